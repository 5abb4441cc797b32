package odp

import (
	"context"
	"fmt"
	"sync"
)

// WCStatus is a work completion's status; the values are ibv_wc_status's.
type WCStatus int

// The completion statuses odpemu produces.
const (
	WCSuccess        WCStatus = 0
	WCLocLenErr      WCStatus = 1
	WCLocQPOpErr     WCStatus = 2
	WCLocProtErr     WCStatus = 4
	WCWRFlushErr     WCStatus = 5
	WCBadRespErr     WCStatus = 7
	WCLocAccessErr   WCStatus = 8
	WCRemInvReqErr   WCStatus = 9
	WCRemAccessErr   WCStatus = 10
	WCRemOpErr       WCStatus = 11
	WCRetryExcErr    WCStatus = 12
	WCRNRRetryExcErr WCStatus = 13
)

var wcStatusNames = map[WCStatus]string{
	WCSuccess: "success", WCLocLenErr: "local length error", WCLocQPOpErr: "local QP operation error",
	WCLocProtErr: "local protection error", WCWRFlushErr: "Work Request Flushed Error",
	WCBadRespErr: "bad response error", WCLocAccessErr: "local access error",
	WCRemInvReqErr: "remote invalid request error", WCRemAccessErr: "remote access error",
	WCRemOpErr: "remote operation error", WCRetryExcErr: "transport retry counter exceeded",
	WCRNRRetryExcErr: "RNR retry counter exceeded",
}

// String returns ibv_wc_status_str's text.
func (s WCStatus) String() string {
	if n, ok := wcStatusNames[s]; ok {
		return n
	}
	return fmt.Sprintf("WCStatus(%d)", int(s))
}

// WCOpcode is what a completion completed; the values are ibv_wc_opcode's.
type WCOpcode int

// What completions complete.
const (
	WCSend      WCOpcode = 0
	WCRDMAWrite WCOpcode = 1
	WCRDMARead  WCOpcode = 2
	WCCompSwap  WCOpcode = 3
	WCFetchAdd  WCOpcode = 4
	WCRecv      WCOpcode = 128
	// WCRecvRDMAWithImm completes a receive consumed by an RDMA WRITE with
	// immediate: ByteLen is the bytes written, nothing is placed in the receive.
	WCRecvRDMAWithImm WCOpcode = 129
)

// WCFlags are a completion's flags, with ibv_wc_flags' values.
type WCFlags uint32

// WCWithImm: ImmData holds the sender's immediate data.
const WCWithImm WCFlags = 1 << 1

// WC is a work completion.
type WC struct {
	WRID    uint64
	Status  WCStatus
	Opcode  WCOpcode
	ByteLen uint32 // receive completions: bytes received; READ and atomics: bytes placed
	QPNum   uint32
	Flags   WCFlags
	ImmData uint32 // with WCWithImm
	// Detail says why a completion failed (the vendor syndrome's role).
	Detail string
}

// CQ is a completion queue. Completions beyond its depth are an overrun, reported by
// Poll and Wait, as a CQ error is; the completions already queued stay readable.
type CQ struct {
	dev    *Device
	notify chan struct{} // holds a token while completions may be queued

	mu      sync.Mutex // protects the fields below
	ring    []WC
	head, n int
	overrun bool
	users   int // QPs attached
	dead    bool
}

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
	cq := &CQ{dev: d, ring: make([]WC, depth), notify: make(chan struct{}, 1)}
	d.cqs[cq] = struct{}{}
	return cq, nil
}

// push queues a completion; it reports false on overrun.
func (cq *CQ) push(wc WC) bool {
	cq.mu.Lock()
	ok := cq.n < len(cq.ring)
	if ok {
		cq.ring[(cq.head+cq.n)%len(cq.ring)] = wc
		cq.n++
	} else {
		cq.overrun = true
	}
	cq.mu.Unlock()
	select {
	case cq.notify <- struct{}{}:
	default:
	}
	return ok
}

// Poll moves up to len(wcs) completions into wcs without blocking and returns how many.
// After an overrun it returns the queued completions and ErrCQOverrun.
func (cq *CQ) Poll(wcs []WC) (int, error) {
	cq.mu.Lock()
	defer cq.mu.Unlock()
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
	cq.dead = true
	delete(d.cqs, cq)
	return nil
}

// killLocked marks the CQ destroyed, as Device.Close does. Called with Device.mu held.
func (cq *CQ) killLocked() {
	cq.mu.Lock()
	cq.dead = true
	cq.mu.Unlock()
}
