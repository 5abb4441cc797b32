package odp

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/odpemu/odpemu/internal/interval"
	"github.com/odpemu/odpemu/pagefault"
)

// TestLateZap: a zap that comes after its REMOVE event was applied and after the NIC
// mapped the page again (the zap barrier's gap) leaves the translation of memory
// registered for events alone on a freed frame. The test makes that state (the
// page's translation given a frame that is not the page's, as such a zap followed by
// a new fault leaves it) and checks that a DMA within the REMOVE's watch drops the
// translation and faults the page again, so that the audit finds no stale DMA; and
// that on a page no REMOVE covered the same state is what the audit counts as stale.
// The race itself is TestDirectChangesUnderTraffic's (madvise/own, madvise/implicit).
func TestLateZap(t *testing.T) {
	a, b := pair(t, Config{Audit: true})
	if !b.dev.PFNsReadable() {
		t.Skip("frame numbers are not readable (pagemap needs CAP_SYS_ADMIN): neither the check nor the audit can tell frames apart")
	}
	mem := anonymous(t, 4)
	mr, err := b.pd.RegMR(mem, rw|AccessOnDemand)
	require.NoError(t, err)
	src, smr := a.region(t, len(mem), rw)
	fill := byte(1)
	write := func() {
		t.Helper()
		fill++
		for i := range src {
			src[i] = fill
		}
		require.NoError(t, a.qp.PostSend(SendWR{WRID: 1, Opcode: OpRDMAWrite, SGL: sge(smr, 0, len(src)), Flags: SendSignaled,
			RemoteAddr: mr.Addr(), RKey: mr.RKey()}))
		wc := wait(t, a.scq)
		require.Equal(t, WCSuccess, wc.Status, wc.Detail)
		require.Equal(t, src, mem)
	}
	// misplace gives page p's translation a frame that is not the page's.
	misplace := func(p int) {
		t.Helper()
		mr.table.Lock()
		defer mr.table.Unlock()
		e := mr.table.EntryLocked(p)
		require.True(t, e.Valid)
		mr.table.MapLocked(p, []uint64{e.PFN + 1}, true)
	}
	// inStep reports whether page p's translation has the page's frame.
	inStep := func(p int) bool {
		t.Helper()
		var pe [1]pagefault.PagemapEntry
		require.NoError(t, b.dev.as.pagemap.Read(addrOf(mem)+uintptr(p*ps), pe[:]))
		e := mr.table.Entry(p)
		return e.Valid && pe[0].Present() && pe[0].PFN() == e.PFN
	}

	write() // faults the four pages in
	require.Zero(t, b.dev.Stats().StaleDMAs)

	// The application discards page 1; the NIC faults it in again, and then (as a
	// zap in the gap would) its translation is left on another frame.
	require.NoError(t, unix.Madvise(mem[ps:2*ps], unix.MADV_DONTNEED))
	require.NoError(t, b.dev.SyncEvents())
	write()
	misplace(1)
	require.False(t, inStep(1))
	late := b.dev.Stats().LateZaps
	write()
	st := b.dev.Stats()
	assert.Greater(t, st.LateZaps, late, "the DMA found the translation zapped")
	assert.Zero(t, st.StaleDMAs, "and did not copy through it")
	assert.True(t, inStep(1), "the page was faulted again")

	// Page 3 had no REMOVE: a translation off its frame there is not a late zap but
	// a stale translation, which the audit counts.
	misplace(3)
	write()
	st2 := b.dev.Stats()
	assert.Equal(t, st.LateZaps, st2.LateZaps)
	assert.Positive(t, st2.StaleDMAs, "the audit saw the stale translation")
}

// TestZapWindow: the ranges of REMOVE events are watched for zapWatch, the parts of
// a range asked about that they cover are returned, and at most maxZapRanges are kept
// (the oldest goes first).
func TestZapWindow(t *testing.T) {
	var z zapWindow
	t0 := time.Now()
	r := func(a, b uintptr) interval.Range { return interval.Range{Start: a, End: b} }
	assert.Nil(t, z.within(r(0, 100), t0), "nothing watched")
	z.add(r(10, 20), t0)
	z.add(r(40, 60), t0.Add(zapWatch/2))
	assert.Equal(t, []interval.Range{r(15, 20), r(40, 50)}, z.within(r(15, 50), t0.Add(zapWatch/4)))
	assert.Nil(t, z.within(r(20, 40), t0), "between the two")
	assert.Equal(t, []interval.Range{r(40, 50)}, z.within(r(0, 50), t0.Add(zapWatch)), "the first one's watch ended")
	assert.Nil(t, z.within(r(0, 100), t0.Add(2*zapWatch)), "both ended")
	assert.Zero(t, z.pending.Load())

	for i := range maxZapRanges + 1 {
		z.add(r(uintptr(i), uintptr(i+1)), t0)
	}
	assert.Equal(t, int32(maxZapRanges), z.pending.Load())
	assert.Nil(t, z.within(r(0, 1), t0), "the oldest went first")
	assert.Equal(t, []interval.Range{r(1, 2)}, z.within(r(1, 2), t0))
}
