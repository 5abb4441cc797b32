package paging

import (
	"encoding/binary"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/odpemu/odpemu/internal/testmem"
	"github.com/odpemu/odpemu/invalidate"
	"github.com/odpemu/odpemu/pagefault"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

type pagerEnv struct {
	mem   []byte
	own   *testmem.Owned
	u     *pagefault.FD
	srv   *pagefault.CPUServer
	pm    *pagefault.Pagemap
	pager *Pager
	reg   *invalidate.Registry
	res   *pagefault.Resolver
	store *Store
	pump  *invalidate.Pump
}

func newPagerEnv(t testing.TB, npages int, budget int64) *pagerEnv {
	t.Helper()
	return newPagerEnvAround(t, npages, budget, 1)
}

// newPagerEnvAround is newPagerEnv with a CPU fault server that zero-fills around
// pages after each missing page it fills.
func newPagerEnvAround(t testing.TB, npages int, budget int64, around int) *pagerEnv {
	t.Helper()
	if err := pagefault.ProbeKernelBehaviour().Check(pagefault.ReqMove); err != nil {
		t.Skipf("skipped: the pager moves pages out with %v", err)
	}
	e := &pagerEnv{reg: invalidate.NewRegistry()}
	var err error
	e.mem, err = unix.Mmap(-1, 0, npages*ps, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	require.NoError(t, err)
	_ = unix.Madvise(e.mem, unix.MADV_NOHUGEPAGE) // 4 KiB pages whatever the THP setting
	e.own = testmem.Own(e.mem)
	e.u, err = pagefault.Open(pagefault.Options{Features: pagefault.FeatureEventRemove | pagefault.FeatureEventUnmap | pagefault.FeatureEventRemap})
	require.NoError(t, err)
	_, err = e.u.Register(addrOf(e.mem), uintptr(len(e.mem)), pagefault.ModeMissing)
	require.NoError(t, err)
	e.srv, err = pagefault.StartCPUServer(e.u, around)
	require.NoError(t, err)
	e.pm, err = pagefault.OpenPagemap()
	require.NoError(t, err)
	store, err := NewMemStore()
	require.NoError(t, err)
	e.store = store
	e.pager = NewPager(e.u, e.srv, e.reg, e.pm, store, PagerConfig{Budget: budget})
	r, err := e.pager.AddRegion(e.mem)
	require.NoError(t, err)
	pump, err := invalidate.StartPump(e.srv, e.reg, false) // the stash's REMOVE events must be read
	require.NoError(t, err)
	e.pump = pump
	e.res, err = pagefault.NewResolver(e.u, e.pm, nil)
	require.NoError(t, err)
	t.Cleanup(func() {
		e.pager.Close()
		require.NoError(t, r.Remove())
		pump.Stop()
		require.NoError(t, e.res.Close())
		require.NoError(t, e.srv.Stop())
		require.NoError(t, e.u.Close())
		require.NoError(t, e.pm.Close())
		require.NoError(t, store.Close())
		e.own.Unmap()
	})
	return e
}

func (e *pagerEnv) present(t *testing.T) int {
	entries := make([]pagefault.PagemapEntry, len(e.mem)/ps)
	require.NoError(t, e.pm.Read(addrOf(e.mem), entries))
	n := 0
	for _, x := range entries {
		if x.Present() {
			n++
		}
	}
	return n
}

func TestEvictAndRestoreOnCPUFault(t *testing.T) {
	e := newPagerEnv(t, 64, 0)
	for p := 0; p < 64; p++ {
		binary.LittleEndian.PutUint64(e.mem[p*ps+8:], uint64(p)*1000+7)
	}
	n, err := e.pager.Evict(addrOf(e.mem), addrOf(e.mem)+uintptr(len(e.mem)))
	require.NoError(t, err)
	assert.Equal(t, 64, n)
	assert.Zero(t, e.present(t), "evicted pages are gone from the mapping")
	for p := 0; p < 64; p++ { // CPU faults, restored by the C server from the store
		require.EqualValues(t, uint64(p)*1000+7, binary.LittleEndian.Uint64(e.mem[p*ps+8:]), "page %d", p)
	}
	st := e.pager.Stats()
	assert.EqualValues(t, 64, st.Evictions)
	assert.EqualValues(t, 64*ps, st.WrittenBack)
	assert.EqualValues(t, 64, restored(t, e.srv))
	_, err = e.pager.Evict(0, pz)
	assert.ErrorIs(t, err, ErrNotPaged)
}

func TestEvictedPagesRestoreThroughResolver(t *testing.T) {
	e := newPagerEnv(t, 32, 0)
	for p := 0; p < 32; p++ {
		e.mem[p*ps] = byte(p + 1)
	}
	_, err := e.pager.Evict(addrOf(e.mem), addrOf(e.mem)+16*pz)
	require.NoError(t, err)
	// The NIC's path: the server thread installs, no CPU fault is taken.
	require.NoError(t, e.srv.Install(addrOf(e.mem), 32))
	assert.Equal(t, 32, e.present(t))
	faults := cpuStats(t, e.srv).Faults
	for p := 0; p < 32; p++ {
		require.EqualValues(t, p+1, e.mem[p*ps], "page %d", p)
	}
	assert.Equal(t, faults, cpuStats(t, e.srv).Faults, "no CPU fault: all were present")
	assert.EqualValues(t, 16, restored(t, e.srv))
}

// A writer that never stops writing a page while the pager evicts it over and over:
// no write may be lost.
func TestEvictionLosesNoConcurrentWrite(t *testing.T) {
	for _, procs := range []int{1, 2} {
		t.Run(fmt.Sprintf("GOMAXPROCS=%d", procs), func(t *testing.T) {
			defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(procs))
			e := newPagerEnv(t, 4, 0)
			var last atomic.Uint64
			stop, started := make(chan struct{}), make(chan struct{})
			var wg sync.WaitGroup
			wg.Add(1)
			go func() {
				defer wg.Done()
				for v := uint64(1); ; v++ {
					select {
					case <-stop:
						return
					default:
					}
					binary.LittleEndian.PutUint64(e.mem[ps+64:], v) // may fault: served in C
					last.Store(v)
					if v == 1 {
						close(started)
					}
					if v%64 == 0 {
						runtime.Gosched()
					}
				}
			}()
			<-started
			evicted := 0
			for i := 0; i < 100000 && evicted < 50; i++ {
				n, err := e.pager.Evict(addrOf(e.mem)+pz, addrOf(e.mem)+2*pz)
				require.NoError(t, err)
				evicted += n
				if i%100 == 0 {
					runtime.Gosched()
				}
			}
			close(stop)
			wg.Wait()
			assert.Equal(t, last.Load(), binary.LittleEndian.Uint64(e.mem[ps+64:]), "the last write survived")
			st := e.pager.Stats()
			t.Logf("evicted %d times, %d aborted by a racing fault, %d restored by the server", evicted, st.Aborts, restored(t, e.srv))
			assert.NotZero(t, evicted)
		})
	}
}

func TestMigrateChangesFrame(t *testing.T) {
	e := newPagerEnv(t, 8, 0)
	for p := 0; p < 8; p++ {
		e.mem[p*ps+100] = byte(0x40 + p)
	}
	before := make([]pagefault.PagemapEntry, 8)
	require.NoError(t, e.pm.Read(addrOf(e.mem), before))
	n, err := e.pager.Migrate(addrOf(e.mem), addrOf(e.mem)+8*pz)
	require.NoError(t, err)
	assert.Equal(t, 8, n)
	after := make([]pagefault.PagemapEntry, 8)
	require.NoError(t, e.pm.Read(addrOf(e.mem), after))
	for p := 0; p < 8; p++ {
		assert.True(t, after[p].Present())
		assert.EqualValues(t, 0x40+p, e.mem[p*ps+100])
		if e.pm.PFNsReadable() {
			assert.NotEqual(t, before[p].PFN(), after[p].PFN(), "page %d moved to a new frame", p)
		}
	}
	assert.EqualValues(t, 8, e.pager.Stats().Migrations)
}

func TestReclaimKeepsBudget(t *testing.T) {
	const npages, budget = 2048, 512
	e := newPagerEnv(t, npages, int64(budget*ps))
	e.pager.Close() // no background reclaim: this test calls Reclaim itself
	// Nor the server's direct reclaim, which would keep these faults within budget.
	require.NoError(t, e.srv.SetBudget(0))
	for p := 0; p < npages; p++ {
		e.mem[p*ps] = byte(p)
	}
	require.True(t, e.pager.Over(0))
	n := e.pager.Reclaim()
	assert.GreaterOrEqual(t, n, npages-budget)
	assert.LessOrEqual(t, e.present(t), budget)
	for p := 0; p < npages; p++ {
		require.EqualValues(t, byte(p), e.mem[p*ps], "page %d", p)
	}
}

func TestDiscardedForgetsStoredCopies(t *testing.T) {
	e := newPagerEnv(t, 4, 0)
	e.mem[0] = 9
	_, err := e.pager.Evict(addrOf(e.mem), addrOf(e.mem)+pz)
	require.NoError(t, err)
	require.NoError(t, e.pager.Exclusive(func() error {
		e.pager.DiscardedLocked(addrOf(e.mem), addrOf(e.mem)+pz)
		return nil
	}))
	assert.Zero(t, e.mem[0], "a discarded page reads as zeros")
}

// mremap of an evicted page: the CPU fault server restores it at the new address as it
// reads the REMAP event, before it serves faults there.
func TestEvictedPageFollowsMremap(t *testing.T) {
	e := newPagerEnv(t, 4, 0)
	e.mem[2*ps+5] = 77
	n, err := e.pager.Evict(addrOf(e.mem)+2*pz, addrOf(e.mem)+3*pz)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	hole, err := unix.Mmap(-1, 0, ps, unix.PROT_NONE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	require.NoError(t, err)
	defer func() { require.NoError(t, unix.Munmap(hole)) }()
	_, _, errno := unix.Syscall6(unix.SYS_MREMAP, addrOf(e.mem)+2*pz, pz, pz, unix.MREMAP_MAYMOVE|unix.MREMAP_FIXED, addrOf(hole), 0)
	require.Zero(t, errno)
	e.own.Drop(invalidate.Range{Start: addrOf(e.mem) + 2*pz, End: addrOf(e.mem) + 3*pz})
	assert.EqualValues(t, 77, hole[5], "the evicted page's content followed it")
}

func restored(t *testing.T, s *pagefault.CPUServer) uint64 {
	n, err := s.Restored()
	require.NoError(t, err)
	return n
}

func cpuStats(t *testing.T, s *pagefault.CPUServer) pagefault.CPUServerStats {
	st, err := s.Stats()
	require.NoError(t, err)
	return st
}

func allocated(t *testing.T, s *Store) int64 {
	n, err := s.Allocated()
	require.NoError(t, err)
	return n
}

// A page the fault server restored leaves its stored copy for the evictor to punch
// (the server never punches: a punch racing the page's next eviction would delete
// the new copy). The evictor punches it at its next pass, unless the page is stored
// again by then.
func TestRestoredCopiesArePunchedByTheEvictor(t *testing.T) {
	e := newPagerEnv(t, 8, 0)
	for p := 0; p < 8; p++ {
		e.mem[p*ps] = byte(p + 1)
	}
	n, err := e.pager.Evict(addrOf(e.mem), addrOf(e.mem)+8*pz)
	require.NoError(t, err)
	require.Equal(t, 8, n)
	require.EqualValues(t, 8*ps, allocated(t, e.store))
	for p := 0; p < 4; p++ { // CPU faults restore pages 0-3
		require.EqualValues(t, p+1, e.mem[p*ps])
	}
	assert.EqualValues(t, 8*ps, allocated(t, e.store), "the server punched nothing")
	e.mem[0] = 42 // page 0 changes, then goes to the store again
	n, err = e.pager.Evict(addrOf(e.mem), addrOf(e.mem)+pz)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	// The pass punched pages 1-3 (restored, not stored again), not page 0.
	assert.EqualValues(t, 5*ps, allocated(t, e.store))
	assert.EqualValues(t, 42, e.mem[0], "page 0's new copy survived")
	for p := 1; p < 8; p++ {
		require.EqualValues(t, p+1, e.mem[p*ps], "page %d", p)
	}
}

// Direct reclaim from a fault path scans a bounded number of chunks, even when every
// page carries the NIC's reference bit (the state when a budget is first reached):
// it must not sweep the region. Background reclaim then brings it within budget.
func TestDirectReclaimIsBounded(t *testing.T) {
	const npages, budget = 64 * 256, 512
	e := newPagerEnv(t, npages, budget*int64(ps))
	// No background reclaim: this test runs both kinds itself. Nor the server's
	// direct reclaim: the pages must go over the budget.
	e.pager.Close()
	require.NoError(t, e.srv.SetBudget(0))
	for p := 0; p < npages; p++ {
		e.mem[p*ps] = 1
	}
	e.pager.Touch(addrOf(e.mem), npages) // the NIC's access bits on every page
	require.True(t, e.pager.Over(0))
	e.pager.ReclaimDirect()
	st := e.pager.Stats()
	assert.EqualValues(t, 1, st.DirectReclaims)
	assert.LessOrEqual(t, st.DirectMaxChunks, uint64(MaxDirectChunks))
	assert.NotZero(t, st.DirectMaxChunks)
	assert.Greater(t, e.present(t), budget, "one bounded pass cannot evict everything")
	e.pager.Reclaim()
	assert.LessOrEqual(t, e.present(t), budget)
}

// The CPU fault server's direct reclaim keeps the application's own faults within the
// budget, with no Go reclaimer running: before each install that would go past it,
// the server evicts a batch to the store and tells the NIC with an EventEvict. Every
// page reads back, and the estimate is the kernel's count.
func TestServerReclaimBoundsCPUFaults(t *testing.T) {
	const npages, budget = 2048, 256
	e := newPagerEnv(t, npages, budget*int64(ps))
	e.pager.Close() // no background reclaim
	rec := &recorder{}
	sub := e.reg.Insert(addrOf(e.mem), addrOf(e.mem)+uintptr(len(e.mem)), rec)
	defer sub.Remove()
	peak := 0
	for p := 0; p < npages; p++ {
		e.mem[p*ps] = byte(p + 1)
		if p%64 == 63 {
			peak = max(peak, e.present(t))
		}
	}
	for p := 0; p < npages; p++ {
		require.EqualValues(t, byte(p+1), e.mem[p*ps], "page %d", p)
		if p%64 == 63 {
			peak = max(peak, e.present(t))
		}
	}
	st := e.pager.Stats()
	t.Logf("peak %d pages present of a %d-page budget; server evictions %d, overshoot %d", peak, budget, st.ServerEvictions, st.Overshoot)
	assert.LessOrEqual(t, peak, budget)
	assert.Zero(t, st.Overshoot)
	assert.GreaterOrEqual(t, st.ServerEvictions, uint64(2*npages-budget))
	assert.EqualValues(t, e.present(t), st.Resident, "estimate vs pagemap")
	// Every page the server evicted was invalidated for the NIC, by an EventEvict.
	require.NoError(t, e.pump.Sync())
	var invalidated uint64
	rec.mu.Lock()
	for k, r := range rec.got {
		if rec.why[k] == invalidate.ReasonEvict {
			invalidated += uint64((r.End - r.Start) / pz)
		}
	}
	rec.mu.Unlock()
	assert.EqualValues(t, st.ServerEvictions, invalidated)
	assert.NotZero(t, e.pump.Stats().Evicts)
}

// The server's fault-around zero-fills the missing pages after a faulting one, up to
// the first present page, while the evictor moves pages out and back. A page present
// when the server looked, and moved out while the copy filled the pages before it,
// would get the zero page over the content the evictor stores. Each round the CPU
// discards the first half of a window and faults it in, over and over, while the
// evictor evicts the second half and reads it back; then the second half must hold
// what was written.
func TestFaultAroundNeverFillsOverEvictedContent(t *testing.T) {
	for _, procs := range []int{1, 2} {
		t.Run(fmt.Sprintf("GOMAXPROCS=%d", procs), func(t *testing.T) {
			defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(procs))
			const window, half, windows, passes = 16, 8, 8, 20
			e := newPagerEnvAround(t, window*windows, 0, window)
			rounds := 40
			if testing.Short() {
				rounds = 10
			}
			evicted, faults := 0, 0
			for round := 1; round <= rounds; round++ {
				base := round % windows * window * ps
				for p := half; p < window; p++ {
					binary.LittleEndian.PutUint64(e.mem[base+p*ps:], uint64(round)<<16|uint64(p))
				}
				var pass atomic.Int32
				done := make(chan int, 1)
				go func() {
					n := 0
					for ; pass.Load() < passes; pass.Add(1) {
						got, err := e.pager.Evict(addrOf(e.mem)+uintptr(base+half*ps), addrOf(e.mem)+uintptr(base+window*ps))
						if err != nil {
							break
						}
						n += got
						var sum byte
						for p := half; p < window; p++ { // back in place, present and NONE
							sum += e.mem[base+p*ps]
						}
						sink.Add(uint32(sum))
					}
					done <- n
				}()
				for pass.Load() < passes {
					require.NoError(t, unix.Madvise(e.mem[base:base+half*ps], unix.MADV_DONTNEED))
					require.Zero(t, e.mem[base], "round %d: a discarded page reads as zero", round)
					faults++
					runtime.Gosched()
				}
				evicted += <-done
				for p := half; p < window; p++ {
					require.Equal(t, uint64(round)<<16|uint64(p), binary.LittleEndian.Uint64(e.mem[base+p*ps:]),
						"round %d: page %d of the window lost its content", round, p)
				}
			}
			st := e.pager.Stats()
			t.Logf("%d rounds: %d evictions, %d aborted; %d faults on discarded pages", rounds, evicted, st.Aborts, faults)
			assert.NotZero(t, evicted)
		})
	}
}

var sink atomic.Uint32 // keeps reads meant to fault from being optimised away

// An install request for the NIC may cover pages that are present already: at a full
// budget those need no room, and the server evicts nothing for them. Missing pages
// still get room made first.
func TestInstallOfPresentPagesEvictsNothing(t *testing.T) {
	const npages, budget = 256, 64
	e := newPagerEnv(t, npages, budget*int64(ps))
	e.pager.Close() // no background reclaim
	for p := 0; p < budget; p++ {
		e.mem[p*ps] = byte(p + 1)
	}
	require.Equal(t, budget, e.present(t))
	before := e.pager.Stats().ServerEvictions
	require.NoError(t, e.srv.Install(addrOf(e.mem), budget))
	assert.Equal(t, before, e.pager.Stats().ServerEvictions, "present pages need no room")
	assert.Equal(t, budget, e.present(t))
	require.NoError(t, e.srv.Install(addrOf(e.mem)+budget*pz, 8))
	assert.Greater(t, e.pager.Stats().ServerEvictions, before, "missing pages do")
	assert.LessOrEqual(t, e.present(t), budget)
	for p := 0; p < budget; p++ {
		require.EqualValues(t, p+1, e.mem[p*ps], "page %d", p)
	}
}

// moveOut moves a claimed page into its bounce page, and believes the page tables, not
// the ioctl's error: a page already in its bounce page (the state a misreported move
// leaves) reports as moved; a page neither here nor there does not.
func TestMoveOutReadsThePageTables(t *testing.T) {
	e := newPagerEnv(t, 4, 0)
	r, i := e.pager.lookup(addrOf(e.mem))
	require.NotNil(t, r)
	e.mem[0] = 1
	require.True(t, e.pager.moveOut(r, i), "present: moved")
	assert.True(t, e.pager.moveOut(r, i), "moved already: the failed move (ENOENT) is checked against the page tables")
	assert.False(t, e.pager.moveOut(r, i+1), "neither present")
	_, err := e.u.Move(r.page(i), r.bounce(i), pz, false) // back in place, for the cleanup's count
	require.NoError(t, err)
	assert.EqualValues(t, 1, e.mem[0])
}
