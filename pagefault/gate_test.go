package pagefault

import (
	"fmt"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// until waits for cond, yielding, and fails the test if it does not hold within 10 s
// (a deadlock, not a slow machine: each condition here takes microseconds).
func until(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within 10 s", what)
		}
		runtime.Gosched()
	}
}

// served maps npages, registers them with feats on a new userfaultfd and starts a
// fault server on it; all of it is undone when the test ends.
func served(t *testing.T, npages int, feats Feature) ([]byte, *FD, *CPUServer) {
	t.Helper()
	b := region(t, npages)
	u := registered(t, b, feats)
	s, err := StartCPUServer(u, 1)
	require.NoError(t, err)
	t.Cleanup(func() { stop(t, s) })
	return b, u, s
}

func present(t *testing.T, pm *Pagemap, a uintptr) bool {
	t.Helper()
	var e [1]PagemapEntry
	require.NoError(t, pm.Read(a, e[:]))
	return e[0].Present()
}

// While a DMA holds the gate, the server reads no event: a thread that calls madvise
// or munmap on a registered range stays in the system call, and madvise's pages stay
// present, until the DMA exits. This is the kernel's order: the change waits for the
// DMA in flight.
func TestGateHoldsChangesWhileDMAInFlight(t *testing.T) {
	for _, call := range []string{"madvise", "munmap"} {
		t.Run(call, func(t *testing.T) {
			const npages = 8
			b, _, s := served(t, npages, FeatureEventRemove|FeatureEventUnmap)
			pm, err := OpenPagemap()
			require.NoError(t, err)
			defer func() { require.NoError(t, pm.Close()) }()
			for p := 0; p < npages; p++ {
				b[p*int(PageSize)] = 7
			}
			target := b[2*PageSize : 4*PageSize]
			g := s.Gate()

			g.Enter()
			done := make(chan error, 1)
			go func() {
				if call == "madvise" {
					done <- unix.Madvise(target, unix.MADV_DONTNEED)
				} else {
					_, _, e := unix.Syscall(unix.SYS_MUNMAP, addr(target), uintptr(len(target)), 0)
					done <- map[bool]error{true: e}[e != 0]
				}
			}()
			until(t, "the server closes the gate", g.Closed)
			select {
			case err := <-done:
				t.Fatalf("%s returned (%v) while a DMA was in flight", call, err)
			default:
			}
			assert.Zero(t, stats(t, s).Events, "no event is read while a DMA is in flight")
			if call == "madvise" {
				assert.True(t, present(t, pm, addr(target)), "the page is zapped only after the DMA")
			}
			g.Exit()
			require.NoError(t, <-done)
			if call == "madvise" {
				assert.False(t, present(t, pm, addr(target)))
			}
			n, err := s.SettledEvents()
			require.NoError(t, err)
			assert.EqualValues(t, 1, n)
			assert.EqualValues(t, 1, g.Events())
			st := stats(t, s)
			assert.GreaterOrEqual(t, st.Drains, uint64(1))
			assert.Zero(t, st.Undrained)
			assert.Zero(t, g.InFlight())
		})
	}
}

// A DMA holding the gate may take a fault itself (a page zapped under it); the server
// waiting for it to drain must not deadlock. Here the DMA's goroutine faults inside
// copy() while an event waits to be read, at GOMAXPROCS 1 (where nothing else can run
// while it faults) and 2. The kernel refuses to install any page while the event is
// unread, so the server must read the event with the DMA in flight: counted as
// undrained.
func TestGateServesFaultsOfDMAInFlight(t *testing.T) {
	for _, procs := range []int{1, 2} {
		t.Run(fmt.Sprintf("GOMAXPROCS=%d", procs), func(t *testing.T) {
			defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(procs))
			const npages = 8
			b, _, s := served(t, npages, FeatureEventRemove)
			b[0] = 1
			g := s.Gate()

			g.Enter()
			done := make(chan error, 1)
			go func() { done <- unix.Madvise(b[:PageSize], unix.MADV_DONTNEED) }()
			until(t, "the server closes the gate", g.Closed)
			src := make([]byte, PageSize)
			src[5] = 9
			copy(b[6*PageSize:], src) // a missing page: a fault inside copy(), in the gate
			assert.EqualValues(t, 9, b[6*PageSize+5])
			require.NoError(t, <-done) // released before the DMA ended
			g.Exit()
			st := stats(t, s)
			assert.GreaterOrEqual(t, st.FaultReads, uint64(1), "the fault was read while DMA was in flight")
			assert.EqualValues(t, 1, st.Undrained)
			n, err := s.SettledEvents()
			require.NoError(t, err)
			assert.EqualValues(t, 1, n)
		})
	}
}

// Enter blocks while the gate is closed and every waiter is let in when it opens.
func TestGateWaitsWhileClosed(t *testing.T) {
	const npages = 4
	b, _, s := served(t, npages, FeatureEventRemove)
	b[0] = 1
	g := s.Gate()
	g.Enter() // holds the server in its drain once an event is raised
	done := make(chan error, 1)
	go func() { done <- unix.Madvise(b[:PageSize], unix.MADV_DONTNEED) }()
	until(t, "the server closes the gate", g.Closed)
	entered := make(chan struct{}, 3)
	for i := 0; i < 3; i++ {
		go func() {
			g.Enter()
			entered <- struct{}{}
			g.Exit()
		}()
	}
	// A waiter marks the closed gate (2) before it sleeps: from then on at least one
	// goroutine is inside Enter, and none may have come out.
	until(t, "a DMA waits at the gate", func() bool { return atomic.LoadInt32(g.closed()) == 2 })
	select {
	case <-entered:
		t.Fatal("a DMA entered a closed gate")
	default:
	}
	g.Exit()
	require.NoError(t, <-done)
	for i := 0; i < 3; i++ {
		<-entered
	}
	until(t, "every DMA exits", func() bool { return g.InFlight() == 0 })
}

// The zap barrier returns only once an MADV_DONTNEED whose event was read has zapped
// its whole range. A 64 MiB range takes milliseconds to zap, so a barrier that
// returned before the zap (or skipped the mmap lock) would leave pages present.
func TestZapBarrierWaitsForTheZap(t *testing.T) {
	const npages = 16384
	b, u, s := served(t, npages, FeatureEventRemove)
	zb, err := NewZapBarrier(u)
	require.NoError(t, err)
	pm, err := OpenPagemap()
	require.NoError(t, err)
	defer func() { require.NoError(t, pm.Close()) }()
	entries := make([]PagemapEntry, npages)
	for round := 0; round < 5; round++ {
		for p := 0; p < npages; p++ {
			b[p*int(PageSize)] = 1 // faults served by the server
		}
		done := make(chan error, 1)
		go func() { done <- unix.Madvise(b, unix.MADV_DONTNEED) }()
		until(t, "the REMOVE event is read", func() bool {
			n, err := s.SettledEvents()
			require.NoError(t, err)
			return n == uint64(round+1)
		})
		require.NoError(t, zb.Wait())
		require.NoError(t, pm.Read(addr(b), entries))
		for p, e := range entries {
			require.False(t, e.Present(), "round %d: page %d still present after the barrier", round, p)
		}
		require.NoError(t, <-done)
	}
	t.Logf("probes that found a woken thread not yet run: %d", zb.Spins.Load())
	require.NoError(t, zb.Close())
	assert.ErrorIs(t, zb.Wait(), ErrClosed)
	assert.ErrorIs(t, zb.Close(), ErrClosed)
}
