package invalidate

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/odpemu/odpemu/pagefault"
	"golang.org/x/sys/unix"
)

// EventSource is where a Pump reads events: a pagefault.CPUServer.
type EventSource interface {
	EventFd() (int, error)
	Events(dst []pagefault.Msg) (int, error)
	SettledEvents() (uint64, error)
}

// PumpStats count what a Pump did.
type PumpStats struct {
	Events  uint64 // events read
	Removes uint64
	Unmaps  uint64
	Remaps  uint64
	Forks   uint64
	Evicts  uint64        // the fault server's own evictions (pagefault.EventEvict)
	Ignored uint64        // events dropped because invalidation is disabled
	Latency time.Duration // sum, from the server reading an event to its invalidation done
	MaxLat  time.Duration
}

// Pump applies a server's events to a registry in one goroutine. That goroutine never
// madvises, unmaps or remaps a registered range itself (it would wait for its own
// event).
type Pump struct {
	src      EventSource
	reg      *Registry
	disabled bool
	bell     *os.File // a copy of the source's event fd, waited on in the netpoller
	done     chan struct{}

	mu      sync.Mutex
	cond    sync.Cond           // on mu: signalled after each batch is applied
	applied atomic.Uint64       // events applied (or ignored); written under mu
	stats   PumpStats           // protected by mu
	err     error               // protected by mu
	hook    func(pagefault.Msg) // protected by mu
	barrier func() error        // protected by mu
}

// SetHook sets a function called with every event before it is applied, also when
// invalidation is disabled: for bookkeeping that is about memory, not about the NIC
// (which parts of its buffers the device still owns). Set it before events flow.
func (p *Pump) SetHook(h func(pagefault.Msg)) {
	p.mu.Lock()
	p.hook = h
	p.mu.Unlock()
}

// SetBarrier sets a function that returns once the pages of the REMOVE events read
// so far are zapped (pagefault.ZapBarrier.Wait). The pump runs it inside the
// invalidation of each batch's REMOVE ranges, so the NIC maps none of their pages
// before the kernel has zapped them. Set it before events flow.
func (p *Pump) SetBarrier(b func() error) {
	p.mu.Lock()
	p.barrier = b
	p.mu.Unlock()
}

// StartPump starts applying src's events to reg. With disabled set (the ablation
// switch) events are read and counted but not applied.
//
// The pump waits for events in Go's netpoller, on a copy of the source's event fd
// (a non-blocking eventfd): a goroutine blocked in a system call (poll(2), say)
// keeps its P until sysmon takes it back, which it does late or not at all while
// other Ps go idle now and then, so the NIC's engines would share one P.
func StartPump(src EventSource, reg *Registry, disabled bool) (*Pump, error) {
	efd, err := src.EventFd()
	if err != nil {
		return nil, err
	}
	dup, err := unix.FcntlInt(uintptr(efd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("invalidate: dup event fd: %w", err)
	}
	bell := os.NewFile(uintptr(dup), "odp-events")
	p := &Pump{src: src, reg: reg, disabled: disabled, bell: bell, done: make(chan struct{})}
	p.cond.L = &p.mu
	go p.run()
	return p, nil
}

func (p *Pump) run() {
	defer close(p.done)
	msgs := make([]pagefault.Msg, 64)
	rc, err := p.bell.SyscallConn()
	if err != nil {
		p.fail(err)
		return
	}
	var failed error
	for {
		// Events drains the doorbell, then takes what is queued; an event
		// queued after that rings it again, which wakes the wait.
		n := 0
		err := rc.Read(func(uintptr) bool {
			n, failed = p.src.Events(msgs)
			return n > 0 || failed != nil
		})
		switch {
		case failed != nil:
			p.fail(failed)
			return
		case err != nil: // Stop closed the copy
			return
		}
		p.apply(msgs[:n])
	}
}

func (p *Pump) fail(err error) {
	p.mu.Lock()
	p.err = err
	p.cond.Broadcast()
	p.mu.Unlock()
}

func (p *Pump) apply(msgs []pagefault.Msg) {
	var st PumpStats
	p.mu.Lock()
	hook, barrier := p.hook, p.barrier
	p.mu.Unlock()
	var removed []Range // REMOVEs are applied together, around the barrier
	var removedAt []time.Duration
	for _, m := range msgs {
		if hook != nil {
			hook(m)
		}
		st.Events++
		var r Range
		var why Reason
		switch m.Event {
		case pagefault.EventRemove:
			r, why = Range{Start: uintptr(m.Start), End: uintptr(m.End)}, ReasonRemove
			st.Removes++
		case pagefault.EventUnmap:
			r, why = Range{Start: uintptr(m.Start), End: uintptr(m.End)}, ReasonUnmap
			st.Unmaps++
		case pagefault.EventRemap:
			// The MR keeps its virtual range: the pages left it.
			r, why = Range{Start: uintptr(m.From), End: uintptr(m.From + m.Len)}, ReasonRemap
			st.Remaps++
		case pagefault.EventEvict:
			// The server evicted the pages before it queued the event; no DMA has
			// trusted their translations since (the gate), and none may now.
			r, why = Range{Start: uintptr(m.Start), End: uintptr(m.End)}, ReasonEvict
			st.Evicts++
		case pagefault.EventFork:
			// The kernel write-protected every private page for COW: the NIC's
			// translations must go, so that its next write faults onto the copy.
			r, why = Range{Start: 0, End: ^uintptr(0)}, ReasonFork
			st.Forks++
		default:
			continue
		}
		if p.disabled {
			st.Ignored++
			continue
		}
		if why == ReasonRemove && barrier != nil {
			removed = append(removed, r)
			removedAt = append(removedAt, m.ReadAt)
			continue
		}
		_, _ = p.reg.Invalidate(r, why, nil) // with no change function it cannot fail
		st.note(pagefault.SinceRead(m.ReadAt))
	}
	if len(removed) > 0 {
		// The barrier fails only when the device is closing: then nothing maps anew.
		_, _ = p.reg.InvalidateAll(removed, ReasonRemove, barrier)
		for _, at := range removedAt {
			st.note(pagefault.SinceRead(at))
		}
	}
	p.mu.Lock()
	p.applied.Add(st.Events)
	s := &p.stats
	s.Events += st.Events
	s.Removes += st.Removes
	s.Unmaps += st.Unmaps
	s.Remaps += st.Remaps
	s.Forks += st.Forks
	s.Evicts += st.Evicts
	s.Ignored += st.Ignored
	s.Latency += st.Latency
	s.MaxLat = max(s.MaxLat, st.MaxLat)
	p.cond.Broadcast()
	p.mu.Unlock()
}

// Sync waits until every event the kernel had delivered when Sync was called has been
// applied: after madvise, munmap or mremap returns, Sync returns once the NIC's
// entries for that range are invalid. It is the way to know an event was handled
// without sleeping.
func (p *Pump) Sync() error {
	queued, err := p.src.SettledEvents()
	if err != nil {
		return err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.waitLocked(queued)
	return p.err
}

// waitLocked waits until at least n events have been applied or the pump failed or
// stopped. Called with Pump.mu held.
func (p *Pump) waitLocked(n uint64) {
	for p.applied.Load() < n && p.err == nil {
		p.cond.Wait()
	}
}

// note adds one event's invalidation latency.
func (s *PumpStats) note(lat time.Duration) {
	s.Latency += lat
	s.MaxLat = max(s.MaxLat, lat)
}

// Applied returns how many events have been applied (or ignored, when disabled).
func (p *Pump) Applied() uint64 { return p.applied.Load() }

// WaitApplied waits until at least n events have been applied, or the pump failed or
// stopped (then it returns why).
func (p *Pump) WaitApplied(n uint64) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.waitLocked(n)
	if p.applied.Load() >= n {
		return nil
	}
	return p.err
}

// Stats returns the counters.
func (p *Pump) Stats() PumpStats {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.stats
}

// Stop stops the goroutine and waits for it.
func (p *Pump) Stop() {
	_ = p.bell.Close() // wakes the wait; closing a copy of an eventfd cannot fail
	<-p.done
	p.mu.Lock()
	if p.err == nil {
		p.err = ErrPumpStopped // nobody waits for events that will not be applied
	}
	p.cond.Broadcast()
	p.mu.Unlock()
}

// ErrPumpStopped is returned by Sync and WaitApplied once the pump has stopped.
var ErrPumpStopped = errors.New("invalidate: event pump stopped")

func addrOf(b []byte) uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(b))) }
