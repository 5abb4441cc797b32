package odp

import (
	"context"
)

// CreateCQ creates a completion queue holding up to depth completions.
func (d *Device) CreateCQ(depth int) (*CQ, error) {
	if depth < 1 || depth > maxCQE {
		return nil, wrap(ErrInvalidArgument, "CQ depth %d", depth)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil, ErrClosed
	}
	cq := &CQ{dev: &d.nic, ring: make([]WC, depth), notify: make(chan struct{}, 1)}
	cq.unlistLocked = func() { delete(d.cqs, cq) }
	cq.sendsOwed = func() int {
		d.mu.Lock()
		defer d.mu.Unlock()
		n := 0
		for qp := range d.qps {
			if qp.cfg.SendCQ == cq {
				n += int(qp.sq.tail.Load() - qp.sq.head.Load())
			}
		}
		return n
	}
	d.cqs[cq] = struct{}{}
	return cq, nil
}

// Resize changes the CQ's depth, as ibv_resize_cq does: the completions queued stay,
// in order. A depth out of range, or below what the CQ must hold, is refused with
// ErrInvalidArgument: the completions queued, and those the send work requests
// posted on its QPs and not yet completed may still queue (the NIC completes them
// asynchronously: a resize cannot tell one that is about to complete from one
// already in the ring). Receives posted are not counted: they may never complete.
func (cq *CQ) Resize(depth int) error {
	if depth < 1 || depth > maxCQE {
		return wrap(ErrInvalidArgument, "CQ depth %d", depth)
	}
	owed := cq.sendsOwed() // Device.mu before CQ.mu, not under it
	cq.mu.Lock()
	defer cq.mu.Unlock()
	if cq.dead {
		return ErrClosed
	}
	if depth < cq.n+owed {
		return wrap(ErrInvalidArgument, "CQ depth %d below the %d completions queued and %d owed", depth, cq.n, owed)
	}
	ring := make([]WC, depth)
	for i := range cq.n {
		ring[i] = cq.ring[(cq.head+i)%len(cq.ring)]
	}
	cq.ring, cq.head = ring, 0
	return nil
}

// Poll moves up to len(wcs) completions into wcs without blocking and returns how many.
// After an overrun it returns the queued completions and ErrCQOverrun.
func (cq *CQ) Poll(wcs []WC) (int, error) {
	if !cq.busy.Load() {
		return 0, nil // see busy; a completion pushed meanwhile is found by the next poll
	}
	cq.mu.Lock()
	defer cq.mu.Unlock()
	defer cq.setBusyLocked()
	if cq.dead {
		return 0, ErrClosed
	}
	k := 0
	for k < len(wcs) && cq.n > 0 {
		wcs[k] = cq.ring[cq.head]
		cq.head = (cq.head + 1) % len(cq.ring)
		cq.n--
		k++
	}
	if cq.overrun {
		return k, ErrCQOverrun
	}
	return k, nil
}

// Wait is Poll that blocks until at least one completion is available or ctx ends.
func (cq *CQ) Wait(ctx context.Context, wcs []WC) (int, error) {
	for {
		n, err := cq.Poll(wcs)
		if n > 0 || err != nil || len(wcs) == 0 {
			return n, err
		}
		select {
		case <-cq.notify:
		case <-ctx.Done():
			return 0, ctx.Err()
		}
	}
}

// Destroy destroys the CQ; it fails with ErrBusy while QPs use it, and with ErrClosed
// once it or its device is gone.
func (cq *CQ) Destroy() error {
	d := cq.dev
	d.mu.Lock() // lock order: Device.mu before CQ.mu
	defer d.mu.Unlock()
	cq.mu.Lock()
	defer cq.mu.Unlock()
	if cq.dead || d.closed {
		return ErrClosed
	}
	if cq.users > 0 {
		return wrap(ErrBusy, "CQ used by %d QPs", cq.users)
	}
	cq.dead, cq.armed = true, nil
	cq.setBusyLocked()
	cq.unlistLocked()
	return nil
}

// RequestNotify arms the CQ, as ibv_req_notify_cq does: the next completion queued
// after it calls notify, once, and disarms the CQ (completions already queued do not).
// notify runs on the goroutine that queues the completion, under the CQ's lock: it
// must return at once and call nothing of the CQ (a completion channel's write of an
// event to a pipe is what it is for). Arming again before it fires replaces notify;
// Destroy disarms.
func (cq *CQ) RequestNotify(notify func()) error {
	if notify == nil {
		return wrap(ErrInvalidArgument, "RequestNotify without a function")
	}
	cq.mu.Lock()
	defer cq.mu.Unlock()
	if cq.dead {
		return ErrClosed
	}
	cq.armed = notify
	return nil
}
