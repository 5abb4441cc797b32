package odp

import (
	"fmt"
	"sync/atomic"
	"time"

	"github.com/odpemu/odpemu/transport"
	"github.com/odpemu/odpemu/transport/roce"
)

// FaultPolicy is what a responder does when a request finds its ODP pages missing.
type FaultPolicy int

// The responder fault policies.
const (
	// FaultRNR drops the request and answers RNR NAK, as mlx5 does: the page fault
	// is resolved meanwhile, and the requester retransmits after its RNR timer, up to
	// RNRRetry times, then fails the request with RNR_RETRY_EXC_ERR. A SEND or WRITE
	// with immediate that finds no receive posted is answered the same way. The
	// default.
	FaultRNR FaultPolicy = iota
	// FaultStall resolves the fault (or waits for the receive) before answering: the
	// requester never sees it but as latency.
	FaultStall
)

// String returns "rnr" or "stall".
func (p FaultPolicy) String() string {
	switch p {
	case FaultRNR:
		return "rnr"
	case FaultStall:
		return "stall"
	}
	return fmt.Sprintf("FaultPolicy(%d)", int(p))
}

// QPAttr are the RC attributes that govern retries (ibv_qp_attr's). The requester
// uses RNRRetry, Timeout and RetryCnt; the responder sends MinRNRTimer in its RNR
// NAKs.
type QPAttr struct {
	// MinRNRTimer is the RNR timer the responder asks for, in the IBTA encoding:
	// 1 is 0.01 ms up to 31, 491.52 ms; 0 is 655.36 ms (RNRTimer decodes it).
	MinRNRTimer uint8
	// RNRRetry is how often a request answered with RNR NAK is retransmitted before
	// it fails with RNR_RETRY_EXC_ERR; 7 means without limit.
	RNRRetry uint8
	// Timeout is the local ACK timeout, 4.096 us * 2^Timeout (0: none), and RetryCnt
	// the retransmissions it allows. The in-process wire loses nothing: only a
	// lost peer exhausts them.
	Timeout  uint8
	RetryCnt uint8
}

// QPAttrMask says which QPAttr fields ModifyAttr changes (ibv_qp_attr_mask's role).
type QPAttrMask uint32

// The attributes ModifyAttr can change.
const (
	AttrMinRNRTimer QPAttrMask = 1 << iota
	AttrRNRRetry
	AttrTimeout
	AttrRetryCnt
)

// DefaultQPAttr are a new QP's attributes: a 0.64 ms RNR timer (encoding 12) and
// unlimited RNR retries, as rdma-core's tests set them, and a 67 ms ACK timeout
// retried 7 times.
var DefaultQPAttr = QPAttr{MinRNRTimer: 12, RNRRetry: 7, Timeout: 14, RetryCnt: 7}

// RNRTimer decodes an RNR timer value (IBTA encoding, 0..31).
func RNRTimer(enc uint8) time.Duration { return roce.RNRTimer(enc) }

// ModifyAttr changes the attributes mask selects, as ibv_modify_qp does with those
// attribute bits. Values out of their fields' ranges fail with ErrInvalidArgument.
func (qp *QP) ModifyAttr(attr QPAttr, mask QPAttrMask) error {
	switch {
	case mask&^(AttrMinRNRTimer|AttrRNRRetry|AttrTimeout|AttrRetryCnt) != 0:
		return wrap(ErrInvalidArgument, "attribute mask %#x", uint32(mask))
	case mask&AttrMinRNRTimer != 0 && attr.MinRNRTimer > 31, mask&AttrTimeout != 0 && attr.Timeout > 31:
		return wrap(ErrInvalidArgument, "timer encodings are 0..31")
	case mask&AttrRNRRetry != 0 && attr.RNRRetry > 7, mask&AttrRetryCnt != 0 && attr.RetryCnt > 7:
		return wrap(ErrInvalidArgument, "retry counts are 0..7")
	}
	qp.mu.Lock()
	defer qp.mu.Unlock()
	if qp.destroyed {
		return ErrClosed
	}
	if mask&AttrMinRNRTimer != 0 {
		qp.attr.MinRNRTimer = attr.MinRNRTimer
	}
	if mask&AttrRNRRetry != 0 {
		qp.attr.RNRRetry = attr.RNRRetry
	}
	if mask&AttrTimeout != 0 {
		qp.attr.Timeout = attr.Timeout
	}
	if mask&AttrRetryCnt != 0 {
		qp.attr.RetryCnt = attr.RetryCnt
	}
	return nil
}

// Attr returns the QP's attributes.
func (qp *QP) Attr() QPAttr {
	qp.mu.Lock()
	defer qp.mu.Unlock()
	return qp.attr
}

// QPStats are one QP's RC counters.
type QPStats struct {
	RNRNaksSent     uint64        // requests this responder answered with RNR NAK
	RNRNaksReceived uint64        // RNR NAKs this requester received
	Retransmissions uint64        // requests sent again (after an RNR NAK, go-back-N)
	RNRWait         time.Duration // time this requester waited on RNR timers (as they fired)
	RNRRetryExc     uint64        // requests failed with RNR_RETRY_EXC_ERR
}

type qpCounters struct {
	rnrSent, rnrReceived, retransmissions, rnrWaitNanos, rnrRetryExc atomic.Uint64
}

// Stats returns the QP's counters.
func (qp *QP) Stats() QPStats {
	c := &qp.stats
	return QPStats{RNRNaksSent: c.rnrSent.Load(), RNRNaksReceived: c.rnrReceived.Load(),
		Retransmissions: c.retransmissions.Load(), RNRWait: time.Duration(c.rnrWaitNanos.Load()),
		RNRRetryExc: c.rnrRetryExc.Load()}
}

// rnrNak answers f with an RNR NAK carrying the QP's MinRNRTimer, and counts it. The
// responder drops every request after it until f's PSN comes again.
func (qp *QP) rnrNak(f *transport.Frame, why string) *transport.Frame {
	qp.mu.Lock()
	timer := qp.attr.MinRNRTimer
	qp.rnrWait, qp.respPSN = true, f.PSN
	qp.mu.Unlock()
	qp.stats.rnrSent.Add(1)
	qp.dev.stats.rnrSent.Add(1)
	n := nak(f, transport.SynRNR, why)
	n.Timer = timer
	return n
}

// rnrRetry handles an RNR NAK for p: it fails p once its retries are used up;
// otherwise it waits the timer the responder asked for and sends every request from
// p on again (go-back-N: the responder dropped those behind p). It returns false if
// the QP was destroyed meanwhile.
func (qp *QP) rnrRetry(p *pending, timer uint8) bool {
	qp.stats.rnrReceived.Add(1)
	qp.dev.stats.rnrReceived.Add(1)
	qp.mu.Lock()
	if p.done {
		qp.mu.Unlock()
		return true
	}
	if retry := qp.attr.RNRRetry; retry != 7 && p.rnrTries >= int(retry) {
		qp.finishLocked(p, WCRNRRetryExcErr, fmt.Sprintf("responder not ready after %d retries", p.rnrTries))
		qp.mu.Unlock()
		qp.stats.rnrRetryExc.Add(1)
		return true
	}
	p.rnrTries++
	qp.mu.Unlock()

	t0 := time.Now()
	t := time.NewTimer(RNRTimer(timer))
	select {
	case <-t.C:
	case <-qp.done:
		t.Stop()
		return false
	}
	waited := uint64(time.Since(t0)) // the timer, and the scheduler's delay in firing it
	qp.stats.rnrWaitNanos.Add(waited)
	qp.dev.stats.rnrWaitNanos.Add(waited)
	qp.retransmitFrom(p)
	return true
}

// retransmitFrom sends p and every request sent after it again, rebuilt from their
// work requests (a retransmitted WRITE reads local memory again, as a NIC does).
// The send lock keeps new requests behind them.
func (qp *QP) retransmitFrom(p *pending) {
	qp.sendMu.Lock()
	defer qp.sendMu.Unlock()
	qp.mu.Lock()
	var again []*pending
	for i, c := range qp.pending {
		if c == p {
			for _, c := range qp.pending[i:] {
				if c.sent && !c.done {
					again = append(again, c)
				}
			}
			break
		}
	}
	inError, conn := qp.state == StateError, qp.conn
	if inError {
		for _, c := range again {
			qp.finishLocked(c, WCWRFlushErr, "")
		}
		again = nil
	}
	qp.mu.Unlock()
	for _, c := range again {
		f, status, detail := qp.request(c.wr, c.psn)
		if status != WCSuccess {
			// The QP goes to ERR with c: the requests behind it, which the
			// responder dropped, will never be answered.
			qp.mu.Lock()
			qp.finishLocked(c, status, detail)
			for _, rest := range again {
				qp.finishLocked(rest, WCWRFlushErr, "")
			}
			qp.mu.Unlock()
			return
		}
		qp.stats.retransmissions.Add(1)
		qp.dev.stats.retransmissions.Add(1)
		if err := conn.Send(f); err != nil {
			return // the receive loop sees the wire gone and fails what is outstanding
		}
	}
}
