package odp

import (
	"fmt"
	"sync/atomic"
	"time"

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
	// the retransmissions it allows (lost packets, a lost peer).
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
// unlimited RNR retries, as rdma-core's tests set them, and a 1.07 s ACK timeout
// (encoding 18) retried 7 times. Hardware commonly uses 67 ms (14); an emulated
// responder resolving faults under an invalidation storm, on a loaded 2-core machine
// under the race detector, has gone without answering for longer than 7 times that,
// so a lost peer is declared after about 8 s instead. Experiments on loss set
// shorter timeouts.
var DefaultQPAttr = QPAttr{MinRNRTimer: 12, RNRRetry: 7, Timeout: 18, RetryCnt: 7}

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
	// The session's retry settings change after QP.mu is left (the lock order),
	// under attrMu, so that concurrent changes reach it in the order they were made.
	qp.attrMu.Lock()
	defer qp.attrMu.Unlock()
	qp.mu.Lock()
	if qp.destroyed {
		qp.mu.Unlock()
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
	qp.attrGen.Add(1)
	if qp.eng != nil {
		qp.eng.wake() // the engine gives the requester the new retry settings
	}
	qp.mu.Unlock()
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
	Retransmissions uint64        // packets sent again (go-back-N after an RNR NAK, a sequence NAK or a timeout)
	RNRWait         time.Duration // time this requester waited on RNR timers (as they fired)
	RNRRetryExc     uint64        // requests failed with RNR_RETRY_EXC_ERR
	Timeouts        uint64        // ACK timer expiries (local_ack_timeout_err)
	RetryExc        uint64        // requests failed with RETRY_EXC_ERR
	OutOfSequence   uint64        // PSN sequence error NAKs this responder sent (out_of_sequence)
	SeqNaksReceived uint64        // PSN sequence error NAKs this requester received (packet_seq_err)
	Duplicates      uint64        // duplicate requests answered again (duplicate_request)
	PacketsDropped  uint64        // packets dropped: for another QP, after a NAK, QP in error
	// MaxGoBack is the most packets one go-back-N of this requester sent again:
	// those in flight behind the NAK (or timeout) it answered.
	MaxGoBack uint64
	// LinkMaxInFlight is the most bytes the QP's link held at once, sent and not
	// taken by the peer (LinkModel bounds it; 0 over UDP, whose sender paces
	// itself instead).
	LinkMaxInFlight int
}

// Stats returns the QP's counters.
func (qp *QP) Stats() QPStats {
	st := qp.rc.stats()
	qp.mu.Lock()
	port := qp.port
	qp.mu.Unlock()
	if port != nil {
		st.LinkMaxInFlight = port.Stats().MaxInFlight
	}
	return st
}

// rcCounters count RC events, of a QP or of all a device's QPs; every field is
// updated atomically by the QPs' engines.
type rcCounters struct {
	rnrNAKsSent, rnrNAKsReceived    atomic.Uint64
	rnrWaitNanos                    atomic.Uint64
	rnrRetryExceeded, retryExceeded atomic.Uint64
	retransmitted, timeouts         atomic.Uint64
	seqNAKsSent, seqNAKsReceived    atomic.Uint64
	duplicates, dropped             atomic.Uint64
	maxGoBack                       atomic.Uint64 // a maximum, not a count
}

func (c *rcCounters) stats() QPStats {
	return QPStats{RNRNaksSent: c.rnrNAKsSent.Load(), RNRNaksReceived: c.rnrNAKsReceived.Load(),
		Retransmissions: c.retransmitted.Load(), RNRWait: time.Duration(c.rnrWaitNanos.Load()),
		RNRRetryExc: c.rnrRetryExceeded.Load(), Timeouts: c.timeouts.Load(), RetryExc: c.retryExceeded.Load(),
		OutOfSequence: c.seqNAKsSent.Load(), SeqNaksReceived: c.seqNAKsReceived.Load(),
		Duplicates: c.duplicates.Load(), PacketsDropped: c.dropped.Load(), MaxGoBack: c.maxGoBack.Load()}
}

// RespError says why this QP's responder last refused a request with a NAK (the
// requester's completion carries only the NAK code, as on the wire), or "".
func (qp *QP) RespError() string {
	qp.mu.Lock()
	defer qp.mu.Unlock()
	return qp.lastRefusal
}
