package pagefault

import (
	"errors"
	"fmt"
	"runtime"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// ZapBarrier waits until the MADV_DONTNEED calls whose REMOVE events have been read
// have zapped their pages.
//
// The kernel sends REMOVE before it zaps: the thread in madvise waits until the event
// is read, then takes the mmap lock and zaps, and says nothing when it is done. A NIC
// fault in between can find an old page still present and map it just before it is
// zapped, leaving the NIC a translation to a freed frame. Two facts close that gap:
// while the woken thread has not yet run (the userfaultfd's mmap_changing count is
// raised from before the event is sent until the thread wakes), every UFFDIO_ZEROPAGE
// on the userfaultfd fails with EAGAIN; and once it has run, it holds the mmap lock
// for reading while it zaps, so an mprotect (which takes the mmap lock for writing)
// returns only after the zap. Wait probes the first, then does the second, on two
// scratch pages of its own. It leaves one gap: a thread that has woken but not yet
// taken the mmap lock (a few instructions, unless it waits for a CPU right there).
// Wait narrows it: after the mprotect it sleeps for gapSleep, so that such a thread
// runs, and takes the lock again; only a thread kept off the CPUs for longer than
// that slips through. On memory registered in missing mode the torn-copy check
// catches the rest (a fault on the zapped page reaches the server); on memory
// registered for events alone package odp compares the NIC's frames with the page
// table at each DMA for a while after a REMOVE (latezap.go). How narrow: in
// TestDirectChangesUnderTraffic's madvise/own and madvise/implicit subtests over
// UDP (ODPEMU_WIRE=udp, where each DMA is shorter and there are five times as many),
// before that comparison existed, 4 of 40 subtests counted a stale DMA with a
// sleep of a nanosecond and 3 of 92 with 200 us, all at GOMAXPROCS=2.
type ZapBarrier struct {
	u      *FD
	probe  unsafe.Pointer // one page registered on u, kept present
	lock   unsafe.Pointer // one private page, PROT_NONE, whose protection Wait sets
	closed atomic.Bool

	Spins atomic.Uint64 // EAGAIN answers Wait saw: it waited for threads to wake
}

// NewZapBarrier maps and registers the barrier's scratch pages on u.
func NewZapBarrier(u *FD) (*ZapBarrier, error) {
	mem, err := unix.MmapPtr(-1, 0, nil, 2*PageSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return nil, fmt.Errorf("pagefault: zap barrier: %w", err)
	}
	b := &ZapBarrier{u: u, probe: mem, lock: unsafe.Add(mem, PageSize)}
	if err = unix.Mprotect(unsafe.Slice((*byte)(b.lock), PageSize), unix.PROT_NONE); err == nil {
		if _, err = u.Register(uintptr(b.probe), PageSize, ModeMissing); err == nil {
			if _, err = u.Zeropage(uintptr(b.probe), PageSize, true); errors.Is(err, ErrAgain) || errors.Is(err, ErrExist) {
				err = nil // an event is pending: the page is installed by the first Wait
			}
			if err != nil {
				_ = u.Unregister(uintptr(b.probe), PageSize) // registered just now: cannot fail
			}
		}
	}
	if err != nil {
		_ = unix.MunmapPtr(mem, 2*PageSize) // our own mapping
		return nil, fmt.Errorf("pagefault: zap barrier: %w", err)
	}
	return b, nil
}

// Wait returns once every MADV_DONTNEED whose event was read before the call has
// zapped its range (but for the gap in the type's comment). It must not be called by
// the thread that reads the events, and it waits for events still unread to be read.
func (b *ZapBarrier) Wait() error {
	if b.closed.Load() {
		return ErrClosed
	}
	for {
		_, err := b.u.Zeropage(uintptr(b.probe), PageSize, true)
		if err == nil || errors.Is(err, ErrExist) {
			break
		}
		if !errors.Is(err, ErrAgain) {
			return fmt.Errorf("pagefault: zap barrier probe: %w", err)
		}
		b.Spins.Add(1)
		runtime.Gosched()
	}
	// Takes the mmap lock for writing: after the zaps that hold it for reading.
	lock := unsafe.Slice((*byte)(b.lock), PageSize)
	if err := unix.Mprotect(lock, unix.PROT_NONE); err != nil {
		return err
	}
	// The gap: a thread the probe saw woken may not hold the mmap lock yet. Let it
	// run, then take the lock again, after its zap.
	ts := unix.NsecToTimespec(gapSleep.Nanoseconds())
	_ = unix.Nanosleep(&ts, nil) // EINTR: the second mprotect comes sooner, that is all
	return unix.Mprotect(lock, unix.PROT_NONE)
}

// gapSleep is how long Wait lets a woken thread run before it takes the mmap lock a
// second time: a wake-up on a loaded 2-vCPU VM takes tens of microseconds.
const gapSleep = 200 * time.Microsecond

// Close unregisters and unmaps the scratch pages (unregistered first, so that the
// unmap raises no event).
func (b *ZapBarrier) Close() error {
	if b.closed.Swap(true) {
		return ErrClosed
	}
	err := b.u.Unregister(uintptr(b.probe), PageSize)
	if errors.Is(err, ErrClosed) {
		err = nil // the userfaultfd went first: its registrations went with it
	}
	return errors.Join(err, unix.MunmapPtr(b.probe, 2*PageSize))
}
