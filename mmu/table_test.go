package mmu

import (
	"fmt"
	"math/rand/v2"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func mapped(t *Table, first, n int, write bool) {
	pfns := make([]uint64, n)
	for i := range pfns {
		pfns[i] = uint64(1000 + first + i)
	}
	t.Lock()
	t.MapLocked(first, pfns, write)
	t.Unlock()
}

func TestNewTableIsInvalid(t *testing.T) {
	tb := New(130)
	assert.Equal(t, 130, tb.Pages())
	assert.Zero(t, tb.ValidPages())
	_, miss := tb.BeginDMA(0, 130, false)
	assert.Equal(t, 0, miss)
	assert.Equal(t, Entry{}, tb.Entry(129))
}

func TestMissingAcrossWords(t *testing.T) {
	tests := []struct {
		name        string
		mapFirst, n int
		write       bool
		qFirst, qN  int
		qWrite      bool
		want        int
	}{
		{"all mapped", 0, 200, false, 0, 200, false, -1},
		{"inside one word", 3, 10, false, 4, 5, false, -1},
		{"gap before", 10, 100, false, 5, 20, false, 5},
		{"gap after, word boundary", 0, 64, false, 60, 10, false, 64},
		{"gap after, far", 0, 190, false, 0, 200, false, 190},
		{"read-only map, write access", 0, 200, false, 100, 1, true, 100},
		{"writable map, write access", 0, 200, true, 63, 66, true, -1},
		{"empty query", 0, 0, false, 17, 0, false, -1},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			tb := New(200)
			mapped(tb, tc.mapFirst, tc.n, tc.write)
			tb.Lock()
			got := tb.MissingLocked(tc.qFirst, tc.qN, tc.qWrite)
			tb.Unlock()
			assert.Equal(t, tc.want, got)
			// Probe answers the same without the lock, and counts no miss.
			assert.Equal(t, tc.want, tb.Probe(tc.qFirst, tc.qN, tc.qWrite))
			assert.Zero(t, tb.Stats().Misses)
		})
	}
}

func TestMapRecordsFramesAndGenerations(t *testing.T) {
	tb := New(8)
	mapped(tb, 2, 3, false)
	e := tb.Entry(3)
	assert.Equal(t, Entry{Valid: true, PFN: 1003, Gen: 1}, e)

	// Remapping the same frame writable keeps the generation; a read-only remap of
	// the same frame keeps write permission; a new frame bumps the generation.
	mapped(tb, 3, 1, true)
	assert.Equal(t, Entry{Valid: true, Writable: true, PFN: 1003, Gen: 1}, tb.Entry(3))
	mapped(tb, 3, 1, false)
	assert.True(t, tb.Entry(3).Writable)
	tb.Lock()
	tb.MapLocked(3, []uint64{77}, false)
	tb.Unlock()
	assert.Equal(t, Entry{Valid: true, PFN: 77, Gen: 2}, tb.Entry(3))

	// Invalidation forgets the frame and counts the change while the leaf lives;
	// clearing its last valid entry frees the leaf, and its counts with it.
	r := tb.Invalidate(3, 1)
	assert.Equal(t, 1, r.Pages)
	assert.Equal(t, Entry{Gen: 3}, tb.Entry(3))
	r = tb.Invalidate(0, 8)
	assert.Equal(t, 2, r.Pages)
	assert.Equal(t, Entry{}, tb.Entry(3))
	assert.Zero(t, tb.Leaves())
	st := tb.Stats()
	assert.EqualValues(t, 3, st.PagesMapped)
	assert.EqualValues(t, 3, st.PagesInvalidated)
}

func TestSequenceProtocol(t *testing.T) {
	tb := New(16)
	seq := tb.ReadBegin()
	tb.Lock()
	assert.False(t, tb.ReadRetryLocked(seq), "nothing happened")
	tb.Unlock()

	seq = tb.ReadBegin()
	tb.Invalidate(4, 2) // even an unrelated, empty range bumps the sequence
	tb.Lock()
	assert.True(t, tb.ReadRetryLocked(seq), "invalidation since ReadBegin")
	tb.Unlock()

	seq = tb.ReadBegin()
	tb.Lock()
	assert.False(t, tb.ReadRetryLocked(seq))
	tb.MapLocked(0, make([]uint64, 16), true)
	tb.Unlock()
	assert.Equal(t, 16, tb.ValidPages())
	assert.EqualValues(t, 1, tb.Stats().RetriesSignalled)
}

// An invalidation waits for DMA that started before it (on any of the table's pages:
// DMAs are counted per table, not per range), and no DMA can start on the
// invalidated pages meanwhile; a fault racing with it must retry. Every check can
// fail: an invalidation that does not wait returns first (caught by the select) and
// leaves the DMA overtaken (caught by EndDMA), never a hang.
func TestInvalidateWaitsForInflightDMA(t *testing.T) {
	tb := New(32)
	mapped(tb, 0, 32, true)
	d, miss := tb.BeginDMA(8, 4, true)
	require.Equal(t, -1, miss)
	other, miss := tb.BeginDMA(20, 4, false) // does not overlap the invalidation, began before it
	require.Equal(t, -1, miss)

	seq := tb.ReadBegin() // a fault in progress
	waiting := make(chan struct{})
	tb.waitHook = func() { close(waiting) }
	done := make(chan InvalidateResult, 1)
	go func() { done <- tb.Invalidate(0, 16) }()
	select {
	case <-waiting: // blocked on d, as it must be: it returns only after EndDMA(d)
	case r := <-done:
		t.Fatalf("invalidation returned with an overlapping DMA in flight: %+v", r)
	}

	_, miss = tb.BeginDMA(9, 1, false)
	assert.Equal(t, 9, miss, "entries are cleared before the wait")
	tb.Lock()
	assert.True(t, tb.ReadRetryLocked(seq), "fault must retry")
	tb.Unlock()

	later, miss := tb.BeginDMA(24, 2, false) // began after the invalidation: not waited for
	require.Equal(t, -1, miss)
	assert.False(t, tb.EndDMA(other), "the invalidation waited for the DMA")
	select {
	case r := <-done:
		t.Fatalf("invalidation returned with an earlier DMA in flight: %+v", r)
	default:
	}
	assert.False(t, tb.EndDMA(d), "the invalidation waited for the DMA")
	r := <-done
	assert.Equal(t, InvalidateResult{Pages: 16, WaitedDMAs: 2}, r)
	assert.False(t, tb.EndDMA(later), "a DMA that began after the invalidation is not overtaken by it")
	s := tb.ReadBegin() // after the invalidation ended
	tb.Lock()
	assert.False(t, tb.ReadRetryLocked(s), "ReadBegin after the invalidation ended")
	tb.Unlock()
	assert.Zero(t, tb.InFlight())
	st := tb.Stats()
	assert.EqualValues(t, 1, st.DMAWaits)
	assert.Zero(t, st.Overtaken)
}

// The check that kills a table whose invalidation forgets to wait: EndDMA reports a
// DMA that an overlapping invalidation completed under.
func TestEndDMAReportsOvertaken(t *testing.T) {
	tb := New(8)
	mapped(tb, 0, 8, true)
	d, _ := tb.BeginDMA(2, 2, true)
	// Simulate the broken protocol: record what an invalidation that did not wait
	// would leave behind, its epoch drained (the real InvalidateBegin cannot
	// return here).
	tb.epoch.Add(1)
	tb.drained.Store(tb.epoch.Load())
	assert.True(t, tb.EndDMA(d))
	assert.EqualValues(t, 1, tb.Stats().Overtaken)
}

func TestReadBeginWaitsForInvalidation(t *testing.T) {
	tb := New(4)
	mapped(tb, 0, 4, false)
	d, _ := tb.BeginDMA(0, 4, false)
	waiting := make(chan struct{})
	tb.waitHook = func() { close(waiting) }
	done := make(chan struct{})
	go func() { tb.Invalidate(0, 4); close(done) }()
	select {
	case <-waiting:
	case <-done:
		t.Fatal("invalidation ended with DMA in flight")
	}
	readWaiting := make(chan struct{})
	tb.Lock()
	tb.readWaitHook = func() { close(readWaiting) }
	tb.Unlock()
	begun := make(chan uint64, 1)
	go func() { begun <- tb.ReadBegin() }()
	select {
	case <-readWaiting: // it waits for the invalidation, as it must
	case <-begun:
		t.Fatal("ReadBegin returned during an invalidation")
	}
	assert.False(t, tb.EndDMA(d))
	<-done
	<-begun
	assert.EqualValues(t, 1, tb.Stats().Invalidations)
	assert.EqualValues(t, 1, tb.Stats().ReadBeginBlocked)
}

func TestEndDMATwicePanics(t *testing.T) {
	tb := New(1)
	mapped(tb, 0, 1, false)
	d, _ := tb.BeginDMA(0, 1, false)
	tb.EndDMA(d)
	assert.Panics(t, func() { tb.EndDMA(d) })
	assert.Panics(t, func() { tb.Invalidate(0, 2) }, "range past the table is a caller bug")
}

func BenchmarkBeginEndDMA(b *testing.B) {
	for _, pages := range []int{1, 16, 256} {
		b.Run(map[int]string{1: "4KiB", 16: "64KiB", 256: "1MiB"}[pages], func(b *testing.B) {
			tb := New(4096)
			mapped(tb, 0, 4096, true)
			for i := 0; i < b.N; i++ {
				d, miss := tb.BeginDMA((i*pages)%(4096-pages), pages, true)
				if miss >= 0 {
					b.Fatal(miss)
				}
				tb.EndDMA(d)
			}
		})
	}
}

// Between InvalidateBegin and InvalidateEnd a fault cannot begin: the mapping is
// being changed.
func TestInvalidateBeginHoldsFaultsOff(t *testing.T) {
	tb := New(8)
	mapped(tb, 0, 8, true)
	s0 := tb.Sequence()
	r := tb.InvalidateBegin(2, 2)
	assert.Equal(t, 2, r.Pages)
	assert.NotEqual(t, s0, tb.Sequence())
	readWaiting := make(chan struct{})
	tb.Lock()
	tb.readWaitHook = func() { close(readWaiting) }
	tb.Unlock()
	begun := make(chan uint64, 1)
	go func() { begun <- tb.ReadBegin() }()
	select {
	case <-readWaiting:
	case <-begun:
		t.Fatal("ReadBegin returned inside an invalidation")
	}
	tb.InvalidateEnd()
	<-begun
	assert.Panics(t, tb.InvalidateEnd)
}

// Sparse edges: leaves are created by the pages mapped, a run of pages and an
// invalidation crossing leaf boundaries touch exactly their pages, a leaf is freed
// with its last valid entry, and MissingLocked finds the first gap inside, before and
// after leaves.
func TestSparseLeafEdges(t *testing.T) {
	L := LeafPages
	tb := New(1 << 40) // spans far more than could ever be allocated per page
	assert.Zero(t, tb.Leaves())
	assert.Zero(t, tb.Footprint())

	mapped(tb, L-2, 4, true) // straddles the boundary of leaves 0 and 1
	assert.Equal(t, 2, tb.Leaves())
	assert.Equal(t, 4, tb.ValidPages())
	tb.Lock()
	assert.Equal(t, -1, tb.MissingLocked(L-2, 4, true))
	assert.Equal(t, L-3, tb.MissingLocked(L-3, 4, false), "gap before, in the first leaf")
	assert.Equal(t, L+2, tb.MissingLocked(L-2, 5, false), "gap after, in the second leaf")
	assert.Equal(t, 2*L, tb.MissingLocked(2*L, 6*L, false), "a leaf that does not exist")
	tb.Unlock()

	mapped(tb, 1<<39, 1, false) // far away: one more leaf, nothing in between
	assert.Equal(t, 3, tb.Leaves())
	tb.Lock()
	assert.Equal(t, 1<<39, tb.MissingLocked(1<<39, 1, true), "read-only entry, write access")
	tb.Unlock()

	// An invalidation spanning both leaves but only part of the run.
	r := tb.Invalidate(L-1, 2)
	assert.Equal(t, 2, r.Pages)
	assert.Equal(t, 3, tb.Leaves(), "leaves keep their other valid entries")
	assert.True(t, tb.Entry(L-2).Valid)
	assert.False(t, tb.Entry(L-1).Valid)
	assert.False(t, tb.Entry(L).Valid)
	assert.True(t, tb.Entry(L+1).Valid)

	// The rest of each leaf: freed one by one.
	tb.Invalidate(L-2, 1)
	assert.Equal(t, 2, tb.Leaves())
	tb.Invalidate(L+1, 1)
	assert.Equal(t, 1, tb.Leaves())
	assert.False(t, tb.Entry(L+1).Valid)
	// A huge range with one leaf in it: visits what exists.
	r = tb.Invalidate(0, 1<<40)
	assert.Equal(t, 1, r.Pages)
	assert.Zero(t, tb.Leaves())
	assert.Zero(t, tb.ValidPages())
	assert.EqualValues(t, 5, tb.Stats().PagesInvalidated)
}

// A full leaf answers MissingLocked from its counts; the counts follow write
// permission being granted, kept and taken.
func TestLeafCountsFollowWritable(t *testing.T) {
	L := LeafPages
	tb := New(4 * L)
	mapped(tb, L, L, true)
	tb.Lock()
	assert.Equal(t, -1, tb.MissingLocked(L, L, true))
	tb.MapLocked(L+3, []uint64{5}, false) // a new frame, read-only: write permission goes
	assert.Equal(t, L+3, tb.MissingLocked(L, L, true))
	assert.Equal(t, -1, tb.MissingLocked(L, L, false))
	tb.MapLocked(L+3, []uint64{5}, true)
	assert.Equal(t, -1, tb.MissingLocked(L, L, true))
	tb.Unlock()
	assert.Equal(t, L, tb.ValidPages())
}

// What a table of a 1 GiB MR costs with 1% of its pages mapped, in the network page
// faults' fault-around windows at random places and in one run, measured on the heap.
func TestSparseFootprint(t *testing.T) {
	const pages = 1 << 30 >> 12
	const windows = pages / 100 / LeafPages
	for _, name := range []string{"scattered", "contiguous"} {
		t.Run(name, func(t *testing.T) {
			rng := rand.New(rand.NewPCG(1, 2))
			before := heapInUse()
			tb := New(pages)
			for i := 0; i < windows; i++ {
				first := i * LeafPages
				if name == "scattered" {
					first = rng.IntN(pages/LeafPages) * LeafPages
				}
				mapped(tb, first, LeafPages, true)
			}
			grown := heapInUse() - before
			t.Logf("%s: %d pages valid in %d leaves: heap grew %d bytes, Footprint %d", name, tb.ValidPages(), tb.Leaves(), grown, tb.Footprint())
			assert.Less(t, grown, int64(64<<10))
			assert.InDelta(t, grown, tb.Footprint(), float64(grown)/2+4096, "the estimate is what the heap says")
			runtime.KeepAlive(tb)
		})
	}
}

func heapInUse() int64 {
	runtime.GC()
	runtime.GC() // sync.Pool victims survive one collection
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return int64(ms.HeapAlloc)
}

// DMAs begin and end from many goroutines, without the table lock, while others map
// pages (faults) and invalidate ranges at random, at GOMAXPROCS 1 and 2: when an
// invalidation's InvalidateBegin returns, no DMA on its pages is in flight (each DMA
// counts itself on its pages between BeginDMA and EndDMA), no DMA is overtaken, and
// the counts end at zero.
func TestConcurrentDMAsFaultsAndInvalidations(t *testing.T) {
	for _, procs := range []int{1, 2} {
		t.Run(fmt.Sprint("GOMAXPROCS=", procs), func(t *testing.T) {
			defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(procs))
			const pages = 4 * LeafPages * 16 // two levels of directories
			tb := New(pages)
			var inflight [pages]atomic.Int32
			var wg sync.WaitGroup
			var dmas, misses atomic.Int64
			stop := make(chan struct{})
			for w := 0; w < 4; w++ {
				wg.Add(1)
				go func(w int) {
					defer wg.Done()
					rng := rand.New(rand.NewPCG(uint64(w), 1))
					for {
						select {
						case <-stop:
							return
						default:
						}
						first := rng.IntN(pages - 8)
						n := rng.IntN(8) + 1
						d, miss := tb.BeginDMA(first, n, rng.IntN(2) == 0)
						if miss >= 0 {
							misses.Add(1)
							continue
						}
						dmas.Add(1)
						for p := first; p < first+n; p++ {
							inflight[p].Add(1)
						}
						runtime.Gosched() // a copy takes time
						for p := first; p < first+n; p++ {
							inflight[p].Add(-1)
						}
						if tb.EndDMA(d) {
							t.Errorf("DMA on [%d, +%d) overtaken", first, n)
						}
					}
				}(w)
			}
			rng := rand.New(rand.NewPCG(9, 9))
			for i := 0; i < 3000; i++ {
				runtime.Gosched() // at GOMAXPROCS=1 too, the DMAs run in between
				first := rng.IntN(pages - 32)
				n := rng.IntN(32) + 1
				if rng.IntN(2) == 0 {
					seq := tb.ReadBegin()
					tb.Lock()
					if !tb.ReadRetryLocked(seq) {
						tb.MapLocked(first, make([]uint64, n), rng.IntN(2) == 0)
					}
					tb.Unlock()
					continue
				}
				tb.InvalidateBegin(first, n)
				for p := first; p < first+n; p++ {
					if c := inflight[p].Load(); c != 0 {
						t.Errorf("invalidation of [%d, +%d) returned with %d DMAs on page %d", first, n, c, p)
					}
				}
				tb.InvalidateEnd()
			}
			close(stop)
			wg.Wait()
			assert.Zero(t, tb.InFlight())
			assert.Zero(t, tb.Stats().Overtaken)
			t.Logf("%d DMAs, %d misses", dmas.Load(), misses.Load())
			assert.Positive(t, dmas.Load())
			assert.Positive(t, misses.Load())
			tb.Invalidate(0, pages)
			assert.Zero(t, tb.Leaves())
			assert.Zero(t, tb.Footprint())
		})
	}
}
