package odp

import (
	"bytes"
	"runtime"
	"runtime/debug"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// odpPair is a requester with a pinned region and a responder with an ODP region.
func odpPair(t *testing.T, cfg Config, size int) (a, b *node, src []byte, smr *MR, dst []byte, dmr *MR) {
	a, b = pair(t, cfg)
	src, smr = a.region(t, size, AccessLocalWrite)
	dst, dmr = b.region(t, size, rw|AccessOnDemand)
	return
}

func do(t *testing.T, n *node, wr SendWR) WC {
	t.Helper()
	wr.Flags |= SendSignaled
	require.NoError(t, n.qp.PostSend(wr))
	return wait(t, n.scq)
}

func TestDiscardInvalidatesFirst(t *testing.T) {
	a, b, src, smr, dst, dmr := odpPair(t, Config{FaultAround: 1, Audit: true}, 16*ps)
	for i := range src {
		src[i] = 0xaa
	}
	require.Equal(t, WCSuccess, do(t, a, write(smr, 0, 8*ps, dmr, 0)).Status)
	assert.Equal(t, 8, dmr.Stats().ValidPages)

	require.NoError(t, b.dev.Discard(dst[2*ps:4*ps]))
	assert.False(t, dmr.Entry(2).Valid)
	assert.False(t, dmr.Entry(3).Valid)
	assert.True(t, dmr.Entry(4).Valid)
	assert.Equal(t, make([]byte, 2*ps), dst[2*ps:4*ps], "discarded pages read as zeros")

	// The NIC faults the pages afresh: a READ returns zeros, not the old data.
	require.Equal(t, WCSuccess, do(t, a, read(smr, 0, 4*ps, dmr, 0)).Status)
	assert.Equal(t, bytes.Repeat([]byte{0xaa}, 2*ps), src[:2*ps])
	assert.Equal(t, make([]byte, 2*ps), src[2*ps:4*ps])
	ds := b.dev.Stats()
	assert.Zero(t, ds.StaleDMAs)
	assert.NotZero(t, ds.AuditedDMAs)
	assert.GreaterOrEqual(t, ds.PagesInvalidated, uint64(2))

	assert.ErrorIs(t, b.dev.Discard(make([]byte, ps)), ErrNotMmapped)
	assert.ErrorIs(t, b.dev.Discard(nil), ErrInvalidArgument)
}

// A madvise the application makes itself reaches the NIC as a REMOVE event.
func TestMadviseEventInvalidates(t *testing.T) {
	a, b, src, smr, dst, dmr := odpPair(t, Config{FaultAround: 1}, 8*ps)
	src[0] = 5
	require.Equal(t, WCSuccess, do(t, a, write(smr, 0, 8*ps, dmr, 0)).Status)
	require.NoError(t, unix.Madvise(dst[:4*ps], unix.MADV_DONTNEED))
	require.NoError(t, b.dev.SyncEvents())
	for p := 0; p < 4; p++ {
		assert.False(t, dmr.Entry(p).Valid, "page %d", p)
	}
	assert.True(t, dmr.Entry(4).Valid)
	ds := b.dev.Stats()
	assert.EqualValues(t, 1, ds.Events)
	assert.NotZero(t, ds.InvalidationLatency)
	require.Equal(t, WCSuccess, do(t, a, read(smr, 0, ps, dmr, 0)).Status)
	assert.Zero(t, src[0], "the NIC read the fresh zero page")
}

// Unmapping part of an ODP MR leaves that part invalid for good: the NIC gets an access
// error there, and the rest of the MR keeps working.
func TestUnmapPartOfMR(t *testing.T) {
	a, b, src, smr, dst, dmr := odpPair(t, Config{}, 64*ps)
	src[0] = 1
	require.Equal(t, WCSuccess, do(t, a, write(smr, 0, 64*ps, dmr, 0)).Status)
	base := addrOf(dst)
	_, _, e := unix.Syscall(unix.SYS_MUNMAP, base+16*uz, 16*uz, 0)
	require.Zero(t, e)
	require.NoError(t, b.dev.SyncEvents())
	assert.False(t, dmr.Entry(20).Valid)
	assert.True(t, dmr.Entry(40).Valid)
	// Fault-around must not reach into the hole: pages 32.. still fault fine.
	require.NoError(t, b.dev.Discard(dst[32*ps:48*ps]))
	require.Equal(t, WCSuccess, do(t, a, write(smr, 0, ps, dmr, 33*up)).Status)
	wc := do(t, a, write(smr, 0, ps, dmr, 20*up))
	assert.Equal(t, WCRemAccessErr, wc.Status, wc.Detail)
}

func TestMremapInvalidatesOldRange(t *testing.T) {
	a, b, src, smr, dst, dmr := odpPair(t, Config{}, 16*ps)
	src[0] = 7
	require.Equal(t, WCSuccess, do(t, a, write(smr, 0, 16*ps, dmr, 0)).Status)
	hole, err := unix.Mmap(-1, 0, 4*ps, unix.PROT_NONE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	require.NoError(t, err)
	defer func() { require.NoError(t, unix.Munmap(hole)) }()
	_, _, e := unix.Syscall6(unix.SYS_MREMAP, addrOf(dst), 4*uz, 4*uz, unix.MREMAP_MAYMOVE|unix.MREMAP_FIXED, addrOf(hole), 0)
	require.Zero(t, e)
	require.NoError(t, b.dev.SyncEvents())
	assert.False(t, dmr.Entry(0).Valid, "the pages left the MR's range")
	assert.True(t, dmr.Entry(8).Valid)
	assert.EqualValues(t, 7, hole[0], "the data moved with the pages")
	wc := do(t, a, read(smr, 0, ps, dmr, 0))
	assert.Equal(t, WCRemAccessErr, wc.Status, "the old range is unmapped")
}

func TestExplicitInvalidate(t *testing.T) {
	a, b, src, smr, _, dmr := odpPair(t, Config{FaultAround: 1}, 8*ps)
	src[0] = 1
	require.Equal(t, WCSuccess, do(t, a, write(smr, 0, 8*ps, dmr, 0)).Status)
	faults := dmr.Stats().PageFaults
	require.NoError(t, b.dev.Invalidate(dmr.Addr()+up, up))
	assert.Equal(t, 7, dmr.Stats().ValidPages)
	require.Equal(t, WCSuccess, do(t, a, write(smr, 0, 8*ps, dmr, 0)).Status)
	assert.Equal(t, faults+1, dmr.Stats().PageFaults, "one page faulted again")
	assert.ErrorIs(t, b.dev.Invalidate(0, 0), ErrInvalidArgument)
	assert.ErrorIs(t, b.dev.Invalidate(^uint64(0)-10, 100), ErrInvalidArgument)
}

// The audit finds DMA through stale translations when invalidation is switched off,
// and none when it is on.
func TestAuditFindsStaleDMAOnlyWithAblation(t *testing.T) {
	for _, ablate := range []bool{false, true} {
		a, b, src, smr, dst, dmr := odpPair(t, Config{FaultAround: 1, Audit: true, NoInvalidate: ablate}, 32*ps)
		for round := 0; round < 4; round++ {
			src[0] = byte(round + 1)
			require.Equal(t, WCSuccess, do(t, a, write(smr, 0, 32*ps, dmr, 0)).Status)
			require.NoError(t, b.dev.Discard(dst))
			require.NoError(t, b.dev.SyncEvents())
		}
		require.Equal(t, WCSuccess, do(t, a, write(smr, 0, 32*ps, dmr, 0)).Status)
		st := b.dev.Stats()
		if ablate {
			assert.NotZero(t, st.StaleDMAs, "ablation: the NIC wrote through stale entries")
			assert.NotZero(t, st.EventsIgnored)
			assert.NotZero(t, dmr.Stats().StaleDMAs)
		} else {
			assert.Zero(t, st.StaleDMAs)
			assert.Zero(t, st.EventsIgnored)
		}
		t.Logf("ablation=%v: audited %d DMAs, stale %d, events %d (ignored %d)", ablate, st.AuditedDMAs, st.StaleDMAs,
			st.Events, st.EventsIgnored)
	}
}

// A copy into memory that was unmapped under it is an error, not a crash.
func TestDMACopyFaultIsAnError(t *testing.T) {
	n := newNode(t, Config{})
	done := make(chan error)
	buf, err := unix.Mmap(-1, 0, ps, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	require.NoError(t, err)
	require.NoError(t, unix.Munmap(buf)) // buf now points at nothing
	go func() {
		debug.SetPanicOnFault(true)
		done <- n.dev.dmaCopy(buf, make([]byte, ps))
	}()
	err = <-done
	assert.ErrorIs(t, err, errDMAFault)
	assert.EqualValues(t, 1, n.dev.Stats().DMAFaults)
}

// ibv_dereg_mr does not wait for the peer: a WRITE's run on the wire reads its
// source by reference, and holds a DMA on the source MR only until the responder
// takes it. A responder that must wait (FaultStall, its page fault held for longer
// than this test waits) first copies the runs it was sent and lets their DMAs go, so
// the Dereg of the source returns while the fault runs; the WRITE then lands with
// the bytes it read before the Dereg, and a work request that reaches the NIC after
// the Dereg fails with a protection error.
func TestDeregDoesNotWaitForThePeer(t *testing.T) {
	const slow = 300 * time.Millisecond
	a, b := pair(t, Config{ResponderFaults: FaultStall, FaultModel: FaultModel{Name: "slow", PerFault: slow}})
	src, smr := a.region(t, 4*ps, AccessLocalWrite)
	dst, dmr := b.region(t, 4*ps, rw|AccessOnDemand)
	for i := range src {
		src[i] = byte(i * 3)
	}
	want := append([]byte(nil), src[:2*ps]...)
	require.NoError(t, a.qp.PostSend(SendWR{WRID: 1, Opcode: OpRDMAWrite, SGL: sge(smr, 0, 2*ps), Flags: SendSignaled,
		RemoteAddr: dmr.Addr(), RKey: dmr.RKey()}))
	for a.qp.port.Stats().Sent == 0 { // the NIC has read the source and sent it
		runtime.Gosched()
	}
	t0 := time.Now()
	require.NoError(t, smr.Dereg())
	took := time.Since(t0)
	var wcs [1]WC
	n, err := a.scq.Poll(wcs[:])
	require.NoError(t, err)
	assert.Zero(t, n, "the WRITE is not complete: its responder waits for the fault")
	assert.Less(t, took, slow, "Dereg waited for the responder's fault")
	for i := range src {
		src[i] = 0xff // after the Dereg: the WRITE must not carry this
	}
	wc := wait(t, a.scq)
	require.Equal(t, WCSuccess, wc.Status, "the WRITE read its source before the Dereg: %s", wc.Detail)
	assert.Equal(t, want, dst[:2*ps])
	wc = a.post(t, SendWR{WRID: 2, Opcode: OpRDMAWrite, SGL: sge(smr, 0, 8), RemoteAddr: dmr.Addr(), RKey: dmr.RKey()})
	assert.Equal(t, WCLocProtErr, wc.Status, "a WR on the deregistered MR")
}

// The same with RNR NAKs: the SEND is retransmitted after each RNR timer, and the
// retransmission after the Dereg finds the source key gone.
func TestDeregBeforeRNRRetransmission(t *testing.T) {
	a, b := pair(t, Config{})
	_, smr := a.region(t, 4*ps, AccessLocalWrite|AccessOnDemand)
	_, dmr := b.region(t, 4*ps, rw)
	require.NoError(t, a.qp.PostSend(SendWR{WRID: 1, Opcode: OpSend, SGL: sge(smr, 0, 2*ps), Flags: SendSignaled}))
	for a.qp.Stats().RNRNaksReceived == 0 {
		runtime.Gosched()
	}
	require.NoError(t, smr.Dereg())
	require.NoError(t, a.qp.PostSend(SendWR{WRID: 2, Opcode: OpSend, SGL: sge(smr, 0, 8), Flags: SendSignaled}))
	wc := wait(t, a.scq)
	assert.EqualValues(t, 1, wc.WRID)
	assert.Equal(t, WCLocProtErr, wc.Status, wc.Detail)
	wc = wait(t, a.scq)
	assert.EqualValues(t, 2, wc.WRID)
	// Its own key check or the QP's error, whichever comes first.
	assert.Contains(t, []WCStatus{WCLocProtErr, WCWRFlushErr}, wc.Status)
	require.NoError(t, b.qp.PostRecv(RecvWR{WRID: 9, SGL: sge(dmr, 0, 4*ps)}))
	assert.Positive(t, b.qp.Stats().RNRNaksSent)
}
