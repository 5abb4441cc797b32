package roce

import (
	"time"
)

// Status is how the requester ends a message.
type Status int

// The requester's statuses (the ibv_wc_status each maps to in parentheses).
const (
	StatusSuccess          Status = iota
	StatusRemoteInvalid           // NAK invalid request (REM_INV_REQ_ERR)
	StatusRemoteAccess            // NAK remote access error (REM_ACCESS_ERR)
	StatusRemoteOp                // NAK remote operational error (REM_OP_ERR)
	StatusRetryExceeded           // no answer after RetryCnt retransmissions (RETRY_EXC_ERR)
	StatusRNRRetryExceeded        // RNR NAKs beyond RNRRetry (RNR_RETRY_EXC_ERR)
	StatusFlushed                 // behind a failed message: the QP is in error (WR_FLUSH_ERR)
	StatusLocal                   // the QP could not read the message again (its handler says why)
)

// Completion is a message the requester is done with.
type Completion struct {
	ID       uint64
	Status   Status
	Response *Message // READ: the data; atomics: the original value
}

// Output is what the requester's state machine asks its QP to do.
type Output struct {
	Done []Completion // in posting order
	Send []Packet     // packets to put on the wire, in order
	// RNRWait, when positive, asks the QP to call Resend after that long: the
	// responder answered RNR NAK.
	RNRWait time.Duration
	// Reload lists the messages whose packets Send sends again, oldest first: a
	// NIC reads their payload from memory again before it retransmits (the
	// packets alias Payload).
	Reload []Reload
	resend uint32 // the PSN Resend starts from
}

// Reload is a message about to be retransmitted: its id and its payload, which the
// packets to be sent alias.
type Reload struct {
	ID      uint64
	Payload []byte
}

// RequesterConfig are the requester's RC attributes.
type RequesterConfig struct {
	MTU      int
	FirstPSN uint32
	Timeout  time.Duration // the local ACK timeout; 0: none
	RetryCnt int           // retransmissions after timeouts or sequence NAKs (0..7)
	RNRRetry int           // retransmissions after RNR NAKs (0..7, 7: no limit)
}

type outstanding struct {
	id       uint64
	msg      Message
	pkts     []Packet // its packets, kept for retransmission (payloads alias msg's)
	first    uint32
	last     uint32 // PSN of its last packet (a READ: of its response's last packet)
	rnrTries int
	resp     *Reassembler // READ responses
	respNext uint32       // the PSN of the READ response packet expected next
}

// Requester is the send side of an RC QP (IBTA 9.7.6, rxe_req.c and rxe_comp.c)
// without I/O: Post assigns PSNs and segments messages, Receive takes the
// responder's ACKs, NAKs and responses, Tick runs the ACK timer. Retransmission is
// go-back-N from the PSN the responder asks for. It is not safe for concurrent use.
type Requester struct {
	cfg     RequesterConfig
	stats   RequesterStats
	nextPSN uint32
	out     []*outstanding
	retries int // timeouts and sequence NAKs since the last progress
	// resending: a go-back-N retransmission went out and nothing completed since;
	// responses to the first sending that still arrive imply nothing more.
	resending bool
	deadline  time.Time
	failed    bool
	// confirmed is the PSN the responder last said it expects: the newest ACK's
	// PSN + 1, or the PSN of the NAK that came last. A NAK may go back: a
	// responder that answers RNR NAK at a message's end expects its first packet
	// again, and that NAK itself may be lost.
	confirmed uint32
}

// RequesterStats are a requester's counters.
type RequesterStats struct {
	Retransmitted uint64 // packets sent again
	Timeouts      uint64 // ACK timer expiries with messages outstanding
	SeqNAKs       uint64 // PSN sequence error NAKs received
	RNRNAKs       uint64 // RNR NAKs received
}

// Stats returns the counters.
func (q *Requester) Stats() RequesterStats { return q.stats }

// NewRequester starts a requester.
func NewRequester(cfg RequesterConfig) *Requester {
	return &Requester{cfg: cfg, nextPSN: cfg.FirstPSN & psnMask, confirmed: cfg.FirstPSN & psnMask}
}

// Failed reports whether the requester is in the error state.
func (q *Requester) Failed() bool { return q.failed }

// Outstanding returns the number of messages posted and not completed.
func (q *Requester) Outstanding() int { return len(q.out) }

// Post segments m, assigns its PSNs and returns the packets to send. The last packet
// asks for an acknowledgement.
func (q *Requester) Post(id uint64, m Message, now time.Time) (Output, error) {
	m.PSN, m.AckReq = q.nextPSN, true
	pkts, err := Segment(&m, q.cfg.MTU)
	if err != nil {
		return Output{}, err
	}
	o := &outstanding{id: id, msg: m, pkts: pkts, first: m.PSN, last: (m.PSN + uint32(m.span(q.cfg.MTU)) - 1) & psnMask}
	if m.Kind == KindReadRequest {
		o.resp = NewReassembler(Limits{MTU: q.cfg.MTU, MaxMessage: m.DMALen})
	}
	q.nextPSN = (o.last + 1) & psnMask
	if q.failed {
		return Output{Done: []Completion{{ID: id, Status: StatusFlushed}}}, nil
	}
	if len(q.out) == 0 {
		q.arm(now)
	}
	q.out = append(q.out, o)
	return Output{Send: pkts}, nil
}

func (q *Requester) arm(now time.Time) {
	if q.cfg.Timeout > 0 {
		q.deadline = now.Add(q.cfg.Timeout)
	}
}

// Receive takes a packet from the responder.
func (q *Requester) Receive(p *Packet, now time.Time) Output {
	var out Output
	if q.failed || len(q.out) == 0 || p.Opcode.IsRequest() {
		return out
	}
	switch {
	case p.Opcode == Acknowledge && p.Syndrome.Kind() == 0:
		if next := (p.PSN + 1) & psnMask; psnDiff(next, q.confirmed) > 0 {
			q.confirmed = next
		}
		q.ackThrough(p.PSN, &out, now)
	case p.Opcode == Acknowledge && p.Syndrome.Kind() == 1: // RNR NAK
		q.ackThrough((p.PSN-1)&psnMask, &out, now)
		o := q.find(p.PSN)
		if o == nil {
			return out
		}
		q.stats.RNRNAKs++
		q.confirmed = p.PSN // the responder took the message's packets, then went back to its first
		if q.cfg.RNRRetry != 7 && o.rnrTries >= q.cfg.RNRRetry {
			q.fail(o, StatusRNRRetryExceeded, &out)
			return out
		}
		o.rnrTries++
		out.RNRWait = RNRTimer(p.Syndrome.Timer())
		out.resend = p.PSN
		q.deadline = time.Time{} // the RNR timer, not the ACK timer, runs now
	case p.Opcode == Acknowledge && p.Syndrome == SynNAKPSNSeqError:
		q.stats.SeqNAKs++
		if psnDiff(p.PSN, q.confirmed) > 0 {
			// The responder took packets beyond what it said before: progress
			// within a long message, so the retries start over.
			q.retries = 0
		}
		// A NAK behind what the responder said before is a stale or repeated one,
		// or the responder went back (an RNR NAK we did not get): from now on,
		// progress is judged from here.
		q.confirmed = p.PSN
		q.ackThrough((p.PSN-1)&psnMask, &out, now)
		q.retransmit(p.PSN, &out, now, true)
	case p.Opcode == Acknowledge: // a NAK that ends the QP
		q.ackThrough((p.PSN-1)&psnMask, &out, now)
		if o := q.find(p.PSN); o != nil {
			status := map[Syndrome]Status{SynNAKInvalidRequest: StatusRemoteInvalid, SynNAKRemoteAccess: StatusRemoteAccess,
				SynNAKRemoteOperation: StatusRemoteOp}[p.Syndrome]
			if status == StatusSuccess {
				status = StatusRemoteInvalid // a NAK code we do not know
			}
			q.fail(o, status, &out)
		}
	case p.Opcode == AtomicAck:
		o := q.find(p.PSN)
		if o == nil || o.first != p.PSN || (o.msg.Kind != KindCompareSwap && o.msg.Kind != KindFetchAdd) {
			return out // a stale or misdirected response: ignore it
		}
		q.ackThrough((p.PSN-1)&psnMask, &out, now)
		if q.impliedNAK(o, &out, now) {
			return out
		}
		q.complete(o, &Message{Kind: KindAtomicAck, PSN: p.PSN, Orig: p.Orig}, &out, now)
	default: // READ response packets
		o := q.find(p.PSN)
		if o == nil || o.resp == nil {
			return out
		}
		if p.Opcode == ReadRespFirst || p.Opcode == ReadRespOnly {
			if p.PSN != o.first {
				return out
			}
			q.ackThrough((p.PSN-1)&psnMask, &out, now)
			if q.impliedNAK(o, &out, now) {
				return out
			}
			o.resp = NewReassembler(Limits{MTU: q.cfg.MTU, MaxMessage: o.msg.DMALen})
		} else if p.PSN != o.respNext {
			return out // a gap or a duplicate: the READ is asked again when the timer fires
		}
		o.respNext = (p.PSN + 1) & psnMask
		q.retries = 0 // forward progress
		m, err := o.resp.Add(p)
		if err != nil {
			o.resp = NewReassembler(Limits{MTU: q.cfg.MTU, MaxMessage: o.msg.DMALen})
			return out // the retransmission brings it again
		}
		if m != nil {
			if len(m.Payload) != int(o.msg.DMALen) {
				q.fail(o, StatusRemoteInvalid, &out)
				return out
			}
			q.complete(o, m, &out, now)
		}
	}
	return out
}

// Resend is called RNRWait after an RNR NAK: it sends everything from the NAKed PSN
// again.
func (q *Requester) Resend(o Output, now time.Time) Output {
	var out Output
	if !q.failed && len(q.out) > 0 {
		q.retransmit(o.resend, &out, now, false)
	}
	return out
}

// Tick runs the ACK timer: past the deadline with messages outstanding, it
// retransmits them all, or fails the oldest when RetryCnt retransmissions went
// unanswered.
func (q *Requester) Tick(now time.Time) Output {
	var out Output
	if q.failed || len(q.out) == 0 || q.deadline.IsZero() || now.Before(q.deadline) {
		return out
	}
	q.stats.Timeouts++
	q.retransmit(q.out[0].first, &out, now, true)
	return out
}

// retransmit sends again every packet from psn on (go-back-N); counted ones use up
// the retry count.
func (q *Requester) retransmit(psn uint32, out *Output, now time.Time, counted bool) {
	if counted {
		if q.retries >= q.cfg.RetryCnt {
			q.fail(q.out[0], StatusRetryExceeded, out)
			return
		}
		q.retries++
	}
	q.resending = true
	sent := len(out.Send)
	defer func() { q.stats.Retransmitted += uint64(len(out.Send) - sent) }()
	for _, o := range q.out {
		if o.resp != nil { // a READ whose response reaches psn is asked again, whole
			if psnDiff(o.last, psn) >= 0 {
				out.Send = append(out.Send, o.pkts...)
				o.resp = NewReassembler(Limits{MTU: q.cfg.MTU, MaxMessage: o.msg.DMALen})
			}
			continue
		}
		resent := false
		for _, p := range o.pkts {
			if psnDiff(p.PSN, psn) >= 0 {
				out.Send = append(out.Send, p)
				resent = true
			}
		}
		if resent && len(o.msg.Payload) > 0 {
			out.Reload = append(out.Reload, Reload{ID: o.id, Payload: o.msg.Payload})
		}
	}
	q.arm(now)
}

// impliedNAK handles a response to o while an earlier READ or atomic still waits for
// its own: that response was lost (responses come in order), so everything from the
// earlier one is sent again (IBTA's implied NAK). It reports whether it did.
func (q *Requester) impliedNAK(o *outstanding, out *Output, now time.Time) bool {
	if len(q.out) == 0 || q.out[0] == o {
		return false
	}
	if !q.resending { // the responses of the first sending still arrive after it
		q.retransmit(q.out[0].first, out, now, true)
	}
	return true
}

// ackThrough completes the SENDs and WRITEs whose last packet is at or before psn.
// A READ or atomic is completed by its response, not by an ACK.
func (q *Requester) ackThrough(psn uint32, out *Output, now time.Time) {
	for len(q.out) > 0 {
		o := q.out[0]
		if psnDiff(o.last, psn) > 0 || o.resp != nil || o.msg.Kind == KindCompareSwap || o.msg.Kind == KindFetchAdd {
			return
		}
		q.complete(o, nil, out, now)
	}
}

// complete ends o successfully; the messages before it, which its response
// acknowledges implicitly, are complete too.
func (q *Requester) complete(o *outstanding, resp *Message, out *Output, now time.Time) {
	for len(q.out) > 0 {
		c := q.out[0]
		q.out = q.out[1:]
		if c == o {
			out.Done = append(out.Done, Completion{ID: c.id, Status: StatusSuccess, Response: resp})
			break
		}
		out.Done = append(out.Done, Completion{ID: c.id, Status: StatusSuccess})
	}
	q.retries, q.resending = 0, false
	q.deadline = time.Time{}
	if len(q.out) > 0 {
		q.arm(now)
	}
}

// fail ends o with status and flushes what follows it: the QP is in error.
func (q *Requester) fail(o *outstanding, status Status, out *Output) {
	for _, c := range q.out {
		s := StatusFlushed
		if c == o {
			s = status
		}
		out.Done = append(out.Done, Completion{ID: c.id, Status: s})
	}
	q.out, q.failed = nil, true
}

// find returns the outstanding message whose PSNs include psn.
func (q *Requester) find(psn uint32) *outstanding {
	for _, o := range q.out {
		if psnDiff(psn, o.first) >= 0 && psnDiff(o.last, psn) >= 0 {
			return o
		}
	}
	return nil
}

// RNRTimer decodes an RNR timer value (the IBTA encoding, 0..31: 1 is 0.01 ms, 31 is
// 491.52 ms, 0 is 655.36 ms).
func RNRTimer(t uint8) time.Duration { return time.Duration(rnrTimerUS[t&31]) * time.Microsecond }

var rnrTimerUS = [32]int64{655360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1280, 1920, 2560, 3840,
	5120, 7680, 10240, 15360, 20480, 30720, 40960, 61440, 81920, 122880, 163840, 245760, 327680, 491520}

// SetRetry changes the ACK timeout and the retry counts (ibv_modify_qp on a
// connected QP); messages outstanding keep the tries they used.
func (q *Requester) SetRetry(timeout time.Duration, retryCnt, rnrRetry int) {
	q.cfg.Timeout, q.cfg.RetryCnt, q.cfg.RNRRetry = timeout, retryCnt, rnrRetry
}

// Abort fails the outstanding message id with status (StatusLocal: it could not be
// read again for a retransmission) and flushes the messages after it.
func (q *Requester) Abort(id uint64, status Status) Output {
	var out Output
	for _, o := range q.out {
		if o.id == id {
			q.fail(o, status, &out)
			break
		}
	}
	return out
}

// InFlight returns how many PSNs the outstanding messages span (a READ counts its
// response's packets): the requester's use of its send window.
func (q *Requester) InFlight() int {
	if len(q.out) == 0 {
		return 0
	}
	return int(psnDiff(q.nextPSN, q.out[0].first))
}

// Flush ends every outstanding message with status (StatusFlushed when the QP went to
// the error state, StatusRetryExceeded when the peer is gone) and fails the
// requester: what is posted later is flushed.
func (q *Requester) Flush(status Status) Output {
	var out Output
	for _, o := range q.out {
		out.Done = append(out.Done, Completion{ID: o.id, Status: status})
	}
	q.out, q.failed = nil, true
	return out
}
