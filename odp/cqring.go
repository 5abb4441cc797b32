package odp

// A CQ as the engines fill it: its ring and the QPs attached.

import (
	"sync"
	"sync/atomic"
)

// CQ is a completion queue. Completions beyond its depth are an overrun, reported by
// Poll and Wait, as a CQ error is; the completions already queued stay readable.
type CQ struct {
	dev *nic
	// unlistLocked removes the CQ from its device's list. Called with Device.mu held.
	unlistLocked func()
	// sendsOwed counts the send work requests posted on the QPs that complete into
	// the CQ and not yet completed (it takes Device.mu).
	sendsOwed func() int
	notify    chan struct{} // holds a token while completions may be queued
	// busy is whether Poll has anything to do: completions queued, an overrun, or
	// the CQ destroyed. Written under mu (setBusyLocked), read without it: an
	// application polls an empty CQ far more often than completions come, and a
	// poll that took the lock each time would take its cache line from the engine
	// that pushes the next completion.
	busy atomic.Bool

	mu      sync.Mutex // protects the fields below
	ring    []WC
	head, n int
	overrun bool
	users   int // QPs attached
	dead    bool
	// armed is called, once, for the next completion queued (RequestNotify).
	armed func()
}

// push queues a completion; it reports false on overrun.
func (cq *CQ) push(wc WC) bool { return cq.pushAll([]WC{wc}) }

// pushAll queues completions, in order, under one lock and with one notification;
// it reports false on overrun (those beyond the depth are lost).
func (cq *CQ) pushAll(wcs []WC) bool {
	cq.mu.Lock()
	ok := true
	for i := range wcs {
		if cq.n == len(cq.ring) {
			cq.overrun, ok = true, false
			break
		}
		cq.ring[(cq.head+cq.n)%len(cq.ring)] = wcs[i]
		cq.n++
	}
	cq.setBusyLocked()
	if f := cq.armed; f != nil {
		cq.armed = nil
		f() // under CQ.mu: once Destroy returns, no notification is on its way
	}
	cq.mu.Unlock()
	select {
	case cq.notify <- struct{}{}:
	default:
	}
	return ok
}

// dropQP removes the completions of QP qpn from the ring, keeping the others in
// their order.
func (cq *CQ) dropQP(qpn uint32) {
	cq.mu.Lock()
	defer cq.mu.Unlock()
	k := 0
	for i := 0; i < cq.n; i++ {
		wc := cq.ring[(cq.head+i)%len(cq.ring)]
		if wc.QPNum != qpn {
			cq.ring[(cq.head+k)%len(cq.ring)] = wc
			k++
		}
	}
	for i := k; i < cq.n; i++ {
		cq.ring[(cq.head+i)%len(cq.ring)] = WC{}
	}
	cq.n = k
	cq.setBusyLocked()
}

// setBusyLocked sets busy from what the CQ holds. Called with CQ.mu held, after
// every change of n, overrun or dead.
func (cq *CQ) setBusyLocked() {
	if b := cq.n > 0 || cq.overrun || cq.dead; b != cq.busy.Load() {
		cq.busy.Store(b)
	}
}

// killLocked marks the CQ destroyed, as Device.Close does. Called with Device.mu held.
func (cq *CQ) killLocked() {
	cq.mu.Lock()
	cq.dead, cq.armed = true, nil
	cq.setBusyLocked()
	cq.mu.Unlock()
}

func (cq *CQ) detach() {
	cq.mu.Lock()
	cq.users--
	cq.mu.Unlock()
}
