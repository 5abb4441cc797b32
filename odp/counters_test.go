package odp

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/odpemu/odpemu/hwcounters"
	"github.com/odpemu/odpemu/internal/fusemount"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// readCounter reads one counter file as a script would (cat).
func readCounter(t *testing.T, path string) uint64 {
	t.Helper()
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	require.True(t, strings.HasSuffix(string(b), "\n"), "%s: %q", path, b)
	v, err := strconv.ParseUint(strings.TrimSuffix(string(b), "\n"), 10, 64)
	require.NoError(t, err, "%s: %q", path, b)
	return v
}

// The hw_counters files equal Device.Stats while traffic runs: every file read lies
// between the counters read just before and just after it, and once traffic stops
// every file equals them exactly. Per-MR files follow the MRs.
func TestHWCountersMatchStats(t *testing.T) {
	if err := fusemount.Available(); err != nil {
		t.Skipf("skipped: %v", err)
	}
	a, b := pair(t, Config{Name: "emu7", FaultAround: 1})
	tree, err := hwcounters.Mount(filepath.Join(t.TempDir(), "infiniband"), b.dev)
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, tree.Unmount()) })

	hw := filepath.Join(tree.Dir(), "emu7", "ports", "1", "hw_counters")
	names, err := os.ReadDir(hw)
	require.NoError(t, err)
	want := b.dev.PortCounters()
	require.Len(t, names, len(want))
	for _, n := range names {
		assert.Contains(t, want, n.Name())
		info, err := n.Info()
		require.NoError(t, err)
		assert.Equal(t, os.FileMode(0o444), info.Mode().Perm())
	}
	assert.Error(t, os.WriteFile(filepath.Join(hw, "page_faults"), []byte("0\n"), 0), "read-only")

	src, smr := a.region(t, 64<<10, AccessLocalWrite)
	buf, dmr := b.region(t, 16<<20, rw|AccessOnDemand)
	src[0] = 1
	mrDir := filepath.Join(tree.Dir(), "emu7", "mr", strconv.FormatUint(uint64(dmr.RKey()>>8), 10))

	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { // WRITEs all over the ODP MR, and discards that invalidate them
		defer wg.Done()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			off := (i * 37 * ps) % (16<<20 - 64<<10)
			if err := a.qp.PostSend(SendWR{Opcode: OpRDMAWrite, SGL: sge(smr, 0, 64<<10), Flags: SendSignaled,
				RemoteAddr: dmr.Addr() + uint64(off), RKey: dmr.RKey()}); err != nil {
				t.Error(err)
				return
			}
			if wc := wait(t, a.scq); wc.Status != WCSuccess {
				t.Error(wc.Status, wc.Detail)
				return
			}
			if i%4 == 3 {
				if err := b.dev.Discard(buf[off : off+64<<10]); err != nil {
					t.Error(err)
					return
				}
			}
		}
	}()
	for round := 0; round < 20; round++ {
		for name := range want {
			before := b.dev.PortCounters()[name]
			v := readCounter(t, filepath.Join(hw, name))
			after := b.dev.PortCounters()[name]
			require.True(t, before <= v && v <= after, "%s: %d read between %d and %d", name, v, before, after)
		}
		before := dmr.Stats().PageFaults
		v := readCounter(t, filepath.Join(mrDir, "page_faults"))
		assert.True(t, before <= v && v <= dmr.Stats().PageFaults)
	}
	close(stop)
	wg.Wait()
	// Quiescent once the pump has applied the REMOVE events of the last discards too
	// (each is one more invalidation, applied after Discard returned).
	require.NoError(t, b.dev.SyncEvents())

	got := map[string]uint64{}
	for name := range want {
		got[name] = readCounter(t, filepath.Join(hw, name))
	}
	assert.Equal(t, b.dev.PortCounters(), got, "quiescent: every file equals Stats")
	assert.NotZero(t, got["page_faults"])
	assert.NotZero(t, got["page_invalidations"])
	st := b.dev.Stats()
	assert.Equal(t, st.PageFaults, got["page_faults"])
	assert.Equal(t, st.PagesFaulted, got["page_faults_handled"])
	assert.Equal(t, st.PagesInvalidated, got["page_invalidations_handled"])
	assert.Equal(t, dmr.Stats().PagesFaulted, readCounter(t, filepath.Join(mrDir, "page_faults_handled")))
	assert.EqualValues(t, dmr.Stats().ValidPages, readCounter(t, filepath.Join(mrDir, "valid_pages")))

	// A script written for /sys/class/infiniband reads the tree unchanged.
	script := `cd "$1" && for dev in *; do for f in "$dev"/ports/*/hw_counters/*; do echo "$dev $(basename "$f") $(cat "$f")"; done; done`
	out, err := exec.Command("sh", "-c", script, "sh", tree.Dir()).Output()
	require.NoError(t, err)
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	require.Len(t, lines, len(want))
	for _, l := range lines {
		f := strings.Fields(l)
		require.Len(t, f, 3, l)
		assert.Equal(t, "emu7", f[0])
		assert.Equal(t, strconv.FormatUint(got[f[1]], 10), f[2], l)
	}

	require.NoError(t, dmr.Dereg())
	_, err = os.Stat(mrDir)
	assert.ErrorIs(t, err, os.ErrNotExist, "a deregistered MR's directory is gone")
}
