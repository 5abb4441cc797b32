package paging

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/odpemu/odpemu/pagefault"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// discardRace is the application's madvise(MADV_DONTNEED) of one page, started while
// the pager is about to put the page's old content back (a beforePlace hook) and
// checked right after it did (a placed hook).
type discardRace struct {
	page     []byte
	started  atomic.Bool
	returned chan struct{} // closed when madvise has returned
	err      error         // madvise's, once returned is closed
	seen     atomic.Int32  // the first byte the placed hook read after madvise returned; -1: never
}

func newDiscardRace(page []byte) *discardRace {
	d := &discardRace{page: page, returned: make(chan struct{})}
	d.seen.Store(-1)
	return d
}

// race starts the discard, once, and gives it up to 50 ms to return. The kernel lets
// madvise zap the page and return only after the fault server has read its REMOVE
// event; the pager holds those reads off while it puts content back, so with the
// pager right it does not return in that time (and the hook goes on without it). The
// wait decides nothing the test asserts: without the hold, madvise returns at once,
// and the placed hook then finds the old content in place; were the machine too slow
// for that, the test would pass without having shown it.
func (d *discardRace) race(*Region, int) {
	if !d.start() {
		return
	}
	select {
	case <-d.returned:
	case <-time.After(50 * time.Millisecond):
	}
}

// start starts the discard on a goroutine of its own, unless it was started: it
// reports whether it did.
func (d *discardRace) start() bool {
	if d.started.Swap(true) {
		return false
	}
	go func() {
		d.err = unix.Madvise(d.page, unix.MADV_DONTNEED)
		close(d.returned)
	}()
	return true
}

// check reads the page if madvise has returned: it must read as zeros by then.
func (d *discardRace) check(*Region, int) {
	if !d.started.Load() {
		return
	}
	select {
	case <-d.returned:
		d.seen.CompareAndSwap(-1, int32(d.page[0]))
	default:
	}
}

func (d *discardRace) hook(p *Pager) {
	p.hooks.beforePlace, p.hooks.placed = d.race, d.check
}

// wait waits for the discard and checks what the application sees after it.
func (d *discardRace) wait(t *testing.T) {
	t.Helper()
	require.True(t, d.started.Load(), "the pager put content back: the race ran")
	<-d.returned
	require.NoError(t, d.err)
	if s := d.seen.Load(); s >= 0 {
		assert.Zero(t, s, "after madvise returned the page read its old content (the pager put it back after the zap)")
	}
	assert.Zero(t, d.page[0], "the discarded page reads as zeros")
}

// A migration copies a page back into place after moving it out: a discard of the
// page whose REMOVE is read just before the copy must not see the copy survive it.
func TestMigrationCopyBackLosesToDiscard(t *testing.T) {
	e := newPagerEnv(t, 4, 0)
	e.mem[0] = 0xab
	d := newDiscardRace(e.mem[:ps])
	d.hook(e.pager)
	_, err := e.pager.Migrate(addrOf(e.mem), addrOf(e.mem)+pz)
	require.NoError(t, err)
	d.wait(t)
}

// An eviction that lost its claim to a fault (RECLAIMED: the fault's move back was
// refused while an event waited) moves the content back itself: a discard read just
// before that move must win.
func TestEvictionPutBackLosesToDiscard(t *testing.T) {
	e := newPagerEnv(t, 4, 0)
	e.mem[0] = 0xab
	var reclaimed atomic.Bool
	e.pager.hooks.movedOut = func(r *Region, i int) {
		reclaimed.Store(r.pr.CompareAndSwap(i, pagefault.PageEvicting, pagefault.PageReclaimed))
	}
	d := newDiscardRace(e.mem[:ps])
	d.hook(e.pager)
	n, err := e.pager.Evict(addrOf(e.mem), addrOf(e.mem)+pz)
	require.NoError(t, err)
	require.True(t, reclaimed.Load())
	assert.Zero(t, n, "the eviction was given up")
	assert.EqualValues(t, 1, e.pager.Stats().Aborts)
	d.wait(t)
}

// Restore copies stored pages back before a range stops being paged: a discard read
// just before a copy forgets the stored copy, and the copy must not bring it back.
func TestRestoreLosesToDiscard(t *testing.T) {
	e := newPagerEnv(t, 4, 0)
	e.mem[0] = 0xab
	n, err := e.pager.Evict(addrOf(e.mem), addrOf(e.mem)+pz)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	d := newDiscardRace(e.mem[:ps])
	d.hook(e.pager)
	require.NoError(t, e.pager.Restore(addrOf(e.mem), addrOf(e.mem)+pz))
	d.wait(t)
}

// The application writes, reads back and discards its own pages while the pager
// evicts, migrates and restores them from another goroutine: a write is never lost,
// and a page reads as zeros after madvise(MADV_DONTNEED) returns, however the pager's
// moves interleave with the discards.
func TestPagerChangesRacingDiscards(t *testing.T) {
	for _, procs := range []int{1, 2} {
		t.Run(fmt.Sprintf("GOMAXPROCS=%d", procs), func(t *testing.T) {
			defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(procs))
			const npages, apps, discards = 16, 2, 3000
			e := newPagerEnv(t, npages, 0)
			base := addrOf(e.mem)
			stop := make(chan struct{})
			changes := make(chan error, 1)
			go func() { // the pager, over random ranges
				rng := rand.New(rand.NewPCG(1, uint64(procs)))
				var err error
				for n := 0; err == nil; n++ {
					select {
					case <-stop:
						changes <- nil
						return
					default:
					}
					lo := rng.IntN(npages)
					hi := lo + 1 + rng.IntN(npages-lo)
					switch rng.IntN(3) {
					case 0:
						_, err = e.pager.Evict(base+uintptr(lo)*pz, base+uintptr(hi)*pz)
					case 1:
						_, err = e.pager.Migrate(base+uintptr(lo)*pz, base+uintptr(hi)*pz)
					default:
						err = e.pager.Restore(base+uintptr(lo)*pz, base+uintptr(hi)*pz)
					}
					if n%16 == 0 {
						runtime.Gosched()
					}
				}
				changes <- err
			}()
			var wg sync.WaitGroup
			errs := make(chan string, apps)
			for a := 0; a < apps; a++ {
				wg.Add(1)
				go func() { // the application: pages a, a+apps, ...
					defer wg.Done()
					for k := uint64(1); k <= discards; k++ {
						p := a + apps*int(k%uint64(npages/apps))
						w := e.mem[p*ps+64 : p*ps+72]
						binary.LittleEndian.PutUint64(w, k) // may fault: served in C
						if got := binary.LittleEndian.Uint64(w); got != k {
							errs <- fmt.Sprintf("page %d: wrote %d, read %d", p, k, got)
							return
						}
						if err := unix.Madvise(e.mem[p*ps:(p+1)*ps], unix.MADV_DONTNEED); err != nil {
							errs <- err.Error()
							return
						}
						if got := binary.LittleEndian.Uint64(w); got != 0 {
							errs <- fmt.Sprintf("page %d: read %d after the discard of write %d returned", p, got, k)
							return
						}
					}
				}()
			}
			wg.Wait()
			close(stop)
			require.NoError(t, <-changes)
			close(errs)
			for msg := range errs {
				t.Error(msg)
			}
			st := e.pager.Stats()
			t.Logf("evictions %d, aborted %d, migrations %d, restores %d", st.Evictions, st.Aborts, st.Migrations, st.Restores)
		})
	}
}

// raceUndrained is a beforePlace hook that has the fault server read the discard's
// REMOVE while the put-back is still in the gate: the one case held leaves open. The
// discard's event waits (every ioctl answers EAGAIN: probed on the present page
// probe), then a thread faults on the missing page fault; the server reads the fault,
// cannot serve it while the event waits, and reads the event with the put-back in
// flight (CPUServerStats.Undrained). madvise then returns before the ioctl is made.
func (d *discardRace) raceUndrained(t *testing.T, u *pagefault.FD, probe, fault []byte, faulted chan<- struct{}) func(*Region, int) {
	return func(*Region, int) {
		if !d.start() {
			return
		}
		deadline := time.Now().Add(10 * time.Second)
		for {
			_, err := u.Zeropage(addrOf(probe), pz, true)
			if errors.Is(err, pagefault.ErrAgain) {
				break
			}
			if !assert.ErrorIs(t, err, pagefault.ErrExist) || !assert.True(t, time.Now().Before(deadline), "the discard's event never waited") {
				close(faulted) // no fault made
				return
			}
			runtime.Gosched()
		}
		go func() {
			sink.Add(uint32(fault[0]))
			close(faulted)
		}()
		select {
		case <-d.returned:
		case <-time.After(10 * time.Second):
			t.Error("the server never read the discard with the put-back in flight")
		}
	}
}

// When the server reads a discard with a put-back in the gate (undrained), the
// put-back's ioctl may land after the zap: the content is taken out again, and the
// page reads as zeros once the pager is done.
func TestUndrainedDiscardTakesPutBackOut(t *testing.T) {
	for _, tc := range []struct {
		name  string
		setup func(e *pagerEnv)
		op    func(e *pagerEnv) error
	}{
		{"migrate", func(*pagerEnv) {}, func(e *pagerEnv) error {
			_, err := e.pager.Migrate(addrOf(e.mem), addrOf(e.mem)+pz)
			return err
		}},
		{"restore", func(e *pagerEnv) {
			n, err := e.pager.Evict(addrOf(e.mem), addrOf(e.mem)+pz)
			require.NoError(t, err)
			require.Equal(t, 1, n)
		}, func(e *pagerEnv) error { return e.pager.Restore(addrOf(e.mem), addrOf(e.mem)+pz) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newPagerEnv(t, 4, 0)
			e.mem[0], e.mem[ps] = 0xab, 1 // page 1 present (the probe); page 2 missing
			tc.setup(e)
			before := cpuStats(t, e.srv).Undrained
			d := newDiscardRace(e.mem[:ps])
			faulted := make(chan struct{})
			e.pager.hooks.beforePlace = d.raceUndrained(t, e.u, e.mem[ps:2*ps], e.mem[2*ps:3*ps], faulted)
			require.NoError(t, tc.op(e))
			require.True(t, d.started.Load(), "the pager put content back: the race ran")
			<-d.returned
			<-faulted
			require.NoError(t, d.err)
			require.Greater(t, cpuStats(t, e.srv).Undrained, before, "the server read the discard with the put-back in flight")
			assert.Zero(t, e.mem[0], "the discarded page reads as zeros")
		})
	}
}
