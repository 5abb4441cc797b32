package pagefault

/*
#include "cpuserver.h"
*/
import "C"

import (
	"runtime"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Gate orders the emulated NIC's DMA against the mapping changes that userfaultfd
// events report, in the kernel's order: a change that raises an event never overlaps
// a DMA, and a DMA that starts after the change sees its event.
//
// The kernel lets the thread that called madvise(MADV_DONTNEED), munmap or mremap on
// a registered range go on only once the server thread has read the event from the
// userfaultfd; for MADV_DONTNEED the pages are zapped only after that. So before
// every read(2) the server thread closes the gate (Enter then blocks), waits until
// no DMA admitted earlier is in flight, reads, counts each event it read in Events,
// and opens the gate again. A DMA is whatever runs between Enter and Exit: the NIC
// enters before it trusts its translations, compares Events with the events it has
// applied to its translation tables (waiting for the rest), and exits after its copy.
// Closing is fair: a closed gate admits no new DMA, so the server waits for one
// copy at most.
//
// The gate's words are shared with the server thread (C) and accessed atomically on
// both sides; Go waits on them with futex(2), which blocks in a system call and so
// releases the goroutine's P. The gate stays valid as long as it is reachable, also
// after the server stopped (then it is open and stays so).
type Gate struct {
	g     *C.odp_gate
	owner *gateOwner
}

// gateOwner decides when the C memory may be freed: once the server thread that
// uses it has stopped and no Gate refers to it.
type gateOwner struct{ stopped atomic.Bool }

func newGate() *Gate {
	g := C.odp_gate_alloc()
	if g == nil {
		return nil
	}
	gt := &Gate{g: g, owner: &gateOwner{}}
	runtime.AddCleanup(gt, func(a gateRef) {
		if a.owner.stopped.Load() {
			C.odp_gate_free(a.g)
		} // else the server was never stopped: it still uses the gate (leaked with it)
	}, gateRef{g, gt.owner})
	return gt
}

// NewGate returns a gate that no fault server closes: that of an address space
// without a userfaultfd, where no event is ever read and so no DMA ever waits. It
// stays open and counts no event.
func NewGate() *Gate {
	g := newGate()
	if g != nil {
		g.owner.stopped.Store(true) // no server thread uses it: freed once unreachable
	}
	return g
}

type gateRef struct {
	g     *C.odp_gate
	owner *gateOwner
}

func (g *Gate) closed() *int32   { return (*int32)(unsafe.Pointer(&g.g.closed)) }
func (g *Gate) inflight() *int32 { return (*int32)(unsafe.Pointer(&g.g.inflight)) }

// Enter admits one DMA, waiting while the server thread reads the userfaultfd.
func (g *Gate) Enter() {
	closed, inflight := g.closed(), g.inflight()
	for {
		for {
			c := atomic.LoadInt32(closed)
			if c == 0 {
				break
			}
			// Say that a DMA waits (2), so that opening wakes it, then sleep until
			// the word is no longer 2.
			if c == 2 || atomic.CompareAndSwapInt32(closed, 1, 2) {
				futexWait(closed, 2)
			}
		}
		atomic.AddInt32(inflight, 1)
		if atomic.LoadInt32(closed) == 0 {
			return
		}
		g.Exit() // closed meanwhile: the server may already wait for this DMA
	}
}

// TryEnter admits one DMA if the gate is open, without waiting: false means the
// server thread is reading the userfaultfd (or about to), and the caller must try
// again later. The emulated NIC's engines use it: an engine that waited here could
// hold up the very DMAs the server waits for (runs it has not taken yet).
func (g *Gate) TryEnter() bool {
	closed, inflight := g.closed(), g.inflight()
	if atomic.LoadInt32(closed) != 0 {
		return false
	}
	atomic.AddInt32(inflight, 1)
	if atomic.LoadInt32(closed) == 0 {
		return true
	}
	g.Exit() // closed meanwhile: the server may already wait for this DMA
	return false
}

// Exit ends a DMA admitted by Enter or TryEnter.
func (g *Gate) Exit() {
	if atomic.AddInt32(g.inflight(), -1) == 0 && atomic.LoadInt32(g.closed()) != 0 {
		futexWake(g.inflight())
	}
}

// Events returns how many non-pagefault events the server thread has read.
func (g *Gate) Events() uint64 { return atomic.LoadUint64((*uint64)(unsafe.Pointer(&g.g.events))) }

// FaultSeq returns the sequence number of the latest fault the server served, as
// CPUServer.FaultSeq does, without a cgo call: a copy during which it did not change
// found no page missing.
func (g *Gate) FaultSeq() uint64 {
	return atomic.LoadUint64((*uint64)(unsafe.Pointer(&g.g.fault_seq)))
}

// Closed reports whether the server thread has closed the gate (for tests).
func (g *Gate) Closed() bool { return atomic.LoadInt32(g.closed()) != 0 }

// InFlight returns the number of DMAs between Enter and Exit (for tests).
func (g *Gate) InFlight() int { return int(atomic.LoadInt32(g.inflight())) }

const (
	futexWaitPrivate = 0 | 128 // FUTEX_WAIT | FUTEX_PRIVATE_FLAG
	futexWakePrivate = 1 | 128 // FUTEX_WAKE | FUTEX_PRIVATE_FLAG
)

// futexWait sleeps while *addr == val (or until a spurious wake-up; callers loop).
func futexWait(addr *int32, val int32) {
	_, _, _ = unix.Syscall6(unix.SYS_FUTEX, uintptr(unsafe.Pointer(addr)), futexWaitPrivate, uintptr(val), 0, 0, 0)
}

// futexWake wakes every waiter on addr.
func futexWake(addr *int32) {
	_, _, _ = unix.Syscall6(unix.SYS_FUTEX, uintptr(unsafe.Pointer(addr)), futexWakePrivate, uintptr(^uint32(0)>>1), 0, 0, 0)
}
