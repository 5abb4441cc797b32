package roce

import (
	"fmt"
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
	StatusLocal                   // the QP could not read the message again (its owner says why)
)

// Completion is a message the requester is done with.
type Completion struct {
	ID     uint64
	Status Status
	Orig   uint64 // an atomic's original value
}

// Request is a message to send: the wire part of a work request. Its payload (a
// SEND's or WRITE's Length bytes) stays in the owner's memory and is read each time
// a packet of it goes out (Next), as a NIC reads local memory again to retransmit.
type Request struct {
	ID     uint64
	Kind   Kind   // KindSend, KindWrite, KindReadRequest, KindCompareSwap, KindFetchAdd, KindAtomicWrite
	Length uint32 // SEND, WRITE: the payload; READ: the bytes asked for
	VA     uint64 // WRITE, READ, atomics
	RKey   uint32
	HasImm bool // SEND and WRITE with immediate
	// Inv: a SEND with invalidate, whose last packet's IETH carries Imm, the R_Key
	// the responder invalidates.
	Inv bool
	Imm uint32
	// Swap is a compare-and-swap's new value or a fetch-and-add's addend; Compare
	// the value a compare-and-swap expects.
	Swap, Compare uint64
}

// RequesterConfig are the requester's RC attributes.
type RequesterConfig struct {
	MTU      int
	FirstPSN uint32
	Timeout  time.Duration // the local ACK timeout; 0: none
	RetryCnt int           // retransmissions after timeouts or sequence NAKs (0..7)
	RNRRetry int           // retransmissions after RNR NAKs (0..7, 7: no limit)
	// UC makes it a UC requester (IBTA 9.8): SENDs and WRITEs with UC opcodes, no
	// acknowledgements, no timer; a message completes once its last packet was
	// sent (Sent), and nothing is sent again.
	UC bool
}

// Output is what a transition of the requester ends: completions, and whether an
// RNR NAK paused it.
type Output struct {
	Done []Completion // in posting order
	// RNRWait, when positive, asks the owner to call Resume after that long: the
	// responder answered RNR NAK and nothing is sent meanwhile.
	RNRWait time.Duration
}

// Transmit is the next run of packets the requester sends (Next): the segment's
// headers, and which bytes of which message its payload is.
type Transmit struct {
	Seg    Segment // headers; the owner fills Payload (and Ref) with the bytes below
	ID     uint64  // the message
	Offset uint32  // where the payload starts in the message
	Len    int     // payload bytes
	// Retransmit counts the run's packets sent before.
	Retransmit int
	next       uint32 // the cursor after it
}

type outstanding struct {
	Request
	first, last uint32 // PSNs; a READ's span is its response's
	rnrTries    int
	respNext    uint32 // a READ's response PSN expected next
}

// Requester is the send side of an RC QP (IBTA 9.7.6, rxe_req.c and rxe_comp.c)
// without I/O. Post assigns PSNs; Next and Sent move a transmit cursor over the
// outstanding messages' packets, which are built when they go out, never kept;
// Receive takes the responder's ACKs and NAKs, ReadResponse and ResponsePlaced its
// READ responses; Tick runs the ACK timer. Retransmission is go-back-N: the cursor
// goes back to the PSN the responder asks for. An RNR NAK pauses the cursor until
// Resume. It is not safe for concurrent use.
type Requester struct {
	cfg     RequesterConfig
	stats   RequesterStats
	nextPSN uint32        // the PSN the next message gets
	cursor  uint32        // the PSN sent next; nextPSN when everything is out
	fresh   uint32        // the first PSN never sent: below it, sending is retransmitting
	ring    []outstanding // its length a power of two, or zero
	head, n int           // outstanding messages: ring[head], ..., oldest first
	ci      int           // the outstanding message the cursor was last found in (a hint)
	retries int           // timeouts and sequence NAKs since the last progress
	// resending: a go-back-N retransmission went out and nothing completed since;
	// responses to the first sending that still arrive imply nothing more.
	resending bool
	paused    bool // an RNR NAK came: nothing is sent until Resume
	deadline  time.Time
	failed    bool
	posted    bool // a request was posted: the first PSN is in use
	// confirmed is the PSN the responder last said it expects: the newest ACK's
	// PSN + 1, or the PSN of the NAK that came last. A NAK may go back: a
	// responder that answers RNR NAK expects that PSN again, and the NAK itself may
	// be lost.
	confirmed uint32
	done      []Completion // Output.Done's storage, reused
}

// RequesterStats are a requester's counters.
type RequesterStats struct {
	Retransmitted uint64 // packets sent again
	Timeouts      uint64 // ACK timer expiries with messages outstanding
	SeqNAKs       uint64 // PSN sequence error NAKs received
	RNRNAKs       uint64 // RNR NAKs received
	// MaxGoBack is the most packets one go-back-N had to send again: those sent
	// after the PSN it went back to (what was in flight behind a NAK).
	MaxGoBack uint64
	// Unsent counts the packets taken back as never sent (Unsent):
	// Retransmitted no longer counts those of them sent before.
	Unsent uint64
}

// NewRequester starts a requester.
func NewRequester(cfg RequesterConfig) *Requester {
	psn := cfg.FirstPSN & psnMask
	return &Requester{cfg: cfg, nextPSN: psn, cursor: psn, fresh: psn, confirmed: psn}
}

// Stats returns the counters.
func (q *Requester) Stats() RequesterStats { return q.stats }

// SetFirstPSN makes a requester to which nothing was ever posted start at psn, as
// ibv_modify_qp to RTS sets sq_psn of a QP whose responder RTR already started. It
// reports false, changing nothing, once a request was posted.
func (q *Requester) SetFirstPSN(psn uint32) bool {
	if q.posted {
		return false
	}
	psn &= psnMask
	q.cfg.FirstPSN = psn
	q.nextPSN, q.cursor, q.fresh, q.confirmed = psn, psn, psn, psn
	return true
}

// Failed reports whether the requester is in the error state.
func (q *Requester) Failed() bool { return q.failed }

// Outstanding returns the number of messages posted and not completed.
func (q *Requester) Outstanding() int { return q.n }

// InFlight returns how many PSNs the outstanding messages span (a READ counts its
// response's packets): the requester's use of its send window.
func (q *Requester) InFlight() int {
	if q.n == 0 {
		return 0
	}
	return int(psnDiff(q.nextPSN, q.ring[q.head].first))
}

// Span returns how many PSNs r takes at the path MTU: its packets, or a READ's
// response packets.
func (q *Requester) Span(r *Request) int {
	switch r.Kind {
	case KindSend, KindWrite, KindReadRequest:
		return Packets(int(r.Length), q.cfg.MTU)
	}
	return 1
}

// Deadline returns when the ACK timer expires (zero: it is not running).
func (q *Requester) Deadline() time.Time { return q.deadline }

// Paused reports whether an RNR NAK holds the cursor until Resume.
func (q *Requester) Paused() bool { return q.paused }

// Pending reports whether Next has something to send.
func (q *Requester) Pending() bool { return !q.failed && !q.paused && q.cursor != q.nextPSN }

// at returns the i-th outstanding message, 0 the oldest. The ring's length is a
// power of two (Post grows it from 16 by doubling), so the index is a mask.
func (q *Requester) at(i int) *outstanding { return &q.ring[(q.head+i)&(len(q.ring)-1)] }

func (q *Requester) output() Output {
	q.done = q.done[:0]
	return Output{}
}

// Post assigns r its PSNs. Once the requester failed, r completes flushed at once
// (Output.Done). An error means r is invalid; it is not posted.
func (q *Requester) Post(r Request, now time.Time) (Output, error) {
	out := q.output()
	switch r.Kind {
	case KindSend, KindWrite, KindReadRequest, KindCompareSwap, KindFetchAdd, KindAtomicWrite:
	default:
		return out, fmt.Errorf("%w: request kind %d", ErrMalformed, r.Kind)
	}
	if q.cfg.UC && ((r.Kind != KindSend && r.Kind != KindWrite) || r.Inv) {
		return out, fmt.Errorf("%w: request kind %d on UC", ErrMalformed, r.Kind)
	}
	if r.Length > maxRCMessage || (r.HasImm && r.Kind != KindSend && r.Kind != KindWrite) ||
		(r.Inv && (r.Kind != KindSend || r.HasImm)) || (r.Kind == KindAtomicWrite && r.Length != 8) {
		return out, fmt.Errorf("%w: %d-byte request of kind %d", ErrMalformed, r.Length, r.Kind)
	}
	if q.failed {
		out.Done = append(q.done, Completion{ID: r.ID, Status: StatusFlushed})
		return out, nil
	}
	if q.n == len(q.ring) {
		grown := make([]outstanding, max(16, 2*len(q.ring)))
		for i := 0; i < q.n; i++ {
			grown[i] = *q.at(i)
		}
		q.ring, q.head = grown, 0
	}
	q.posted = true
	o := q.at(q.n)
	*o = outstanding{Request: r, first: q.nextPSN}
	o.last = (o.first + uint32(q.Span(&r)) - 1) & psnMask
	o.respNext = o.first
	q.n++
	q.nextPSN = (o.last + 1) & psnMask
	return out, nil
}

// cursorIndex returns the index of the outstanding message the cursor is in: where
// it was last found, or the one after, as it moves on (a search after a rewind).
func (q *Requester) cursorIndex() int {
	for _, i := range [2]int{q.ci, q.ci + 1} {
		if i >= 0 && i < q.n {
			if o := q.at(i); psnDiff(q.cursor, o.first) >= 0 && psnDiff(o.last, q.cursor) >= 0 {
				q.ci = i
				return i
			}
		}
	}
	q.ci = q.find(q.cursor)
	return q.ci
}

// find returns the index of the outstanding message whose PSNs include psn, or -1.
func (q *Requester) find(psn uint32) int {
	for i := 0; i < q.n; i++ {
		if o := q.at(i); psnDiff(psn, o.first) >= 0 && psnDiff(o.last, psn) >= 0 {
			return i
		}
	}
	return -1
}

// Next returns the next run of at most maxPackets packets to send, if the cursor
// has one: a READ or an atomic is one packet. The owner reads the payload into
// the segment and calls Sent; if it cannot (the run's memory must fault first), it
// calls nothing and asks again later.
func (q *Requester) Next(maxPackets int) (Transmit, bool) {
	var t Transmit
	ok := q.NextInto(&t, maxPackets)
	return t, ok
}

// NextInto is Next writing the run into *t, which it overwrites whole: an engine
// keeps one Transmit and copies no headers per run.
func (q *Requester) NextInto(t *Transmit, maxPackets int) bool {
	if !q.Pending() {
		*t = Transmit{}
		return false
	}
	i := q.cursorIndex()
	if i < 0 { // cannot happen: the cursor lies between the oldest's first PSN and nextPSN
		panic(fmt.Sprintf("roce: requester cursor %#x outside the outstanding messages", q.cursor))
	}
	o := q.at(i)
	*t = Transmit{ID: o.ID}
	s := &t.Seg
	s.PKey, s.PSN, s.Count = 0xffff, q.cursor, 1
	switch o.Kind {
	case KindReadRequest:
		s.Opcode, s.AckReq = ReadRequest, true
		s.PSN, s.VA, s.RKey, s.DMALen = o.first, o.VA, o.RKey, o.Length
		s.Last, t.next = s.Opcode, (o.last+1)&psnMask
		t.Retransmit = q.resent(o.first, 1)
		return true
	case KindCompareSwap, KindFetchAdd:
		s.Opcode, s.AckReq = CompareSwap, true
		if o.Kind == KindFetchAdd {
			s.Opcode = FetchAdd
		}
		s.VA, s.RKey, s.Swap, s.Compare = o.VA, o.RKey, o.Swap, o.Compare
		s.Last, t.next = s.Opcode, (o.last+1)&psnMask
		t.Retransmit = q.resent(o.first, 1)
		return true
	}
	ops := &segmentOps[o.Kind]
	total := Packets(int(o.Length), q.cfg.MTU)
	k := int(psnDiff(q.cursor, o.first)) // the first packet's index in the message
	count := max(1, min(maxPackets, total-k))
	op := func(i int) Opcode {
		switch {
		case total == 1 && o.HasImm:
			return ops[5]
		case total == 1 && o.Inv:
			return ops[7]
		case total == 1:
			return ops[3]
		case i == 0:
			return ops[0]
		case i == total-1 && o.HasImm:
			return ops[4]
		case i == total-1 && o.Inv:
			return ops[6]
		case i == total-1:
			return ops[2]
		}
		return ops[1]
	}
	s.Opcode, s.Count, s.Last = op(k), count, op(k+count-1)
	if q.cfg.UC {
		s.Opcode, s.Last = s.Opcode|ucBits, s.Last|ucBits
	}
	if k == 0 && (o.Kind == KindWrite || o.Kind == KindAtomicWrite) {
		s.VA, s.RKey, s.DMALen = o.VA, o.RKey, o.Length
	}
	if k+count == total {
		s.AckReq = !q.cfg.UC
		if o.HasImm || o.Inv {
			s.Imm = o.Imm
		}
	}
	t.Offset = uint32(k * q.cfg.MTU)
	t.Len = min(count*q.cfg.MTU, int(o.Length)-k*q.cfg.MTU)
	t.next = (q.cursor + uint32(count)) & psnMask
	t.Retransmit = q.resent(q.cursor, count)
	return true
}

// resent counts the packets of [psn, psn+count) sent before.
func (q *Requester) resent(psn uint32, count int) int {
	if d := int(psnDiff(q.fresh, psn)); d > 0 {
		return min(d, count)
	}
	return 0
}

// Sent records that t, the run Next returned last, went out: the cursor moves past
// it and the ACK timer runs. On UC, the messages it ended complete (Output.Done).
func (q *Requester) Sent(t *Transmit, now time.Time) Output {
	q.cursor = t.next
	if psnDiff(q.cursor, q.fresh) > 0 {
		q.fresh = q.cursor
	}
	q.stats.Retransmitted += uint64(t.Retransmit)
	t.Seg.Resent = uint16(t.Retransmit)
	if q.cfg.UC {
		out := q.output()
		for q.n > 0 && psnDiff(q.at(0).last, q.cursor) < 0 {
			q.complete(0, 0, &out, now)
		}
		return out
	}
	if q.deadline.IsZero() {
		q.arm(now)
	}
	return Output{}
}

// Unsent takes back a run that Sent recorded but that never went on the wire: the
// port took it back from its transmit queue or the peer gave it back (Port.TakeBack),
// or the owner had not handed it over yet, when a NAK sent the requester back. The cursor goes back to
// it, and its packets are sent again as what they were: a first sending is not a
// retransmission (the run's first Resent packets were sent before, the rest were
// not). Runs are taken back newest first, so that the packets never sent end
// where fresh does.
func (q *Requester) Unsent(s *Segment) {
	q.stats.Retransmitted -= min(uint64(s.Resent), q.stats.Retransmitted)
	q.stats.Unsent += uint64(s.Count)
	i := q.find(s.PSN)
	if i < 0 {
		return // answered since: nothing to send again
	}
	end, first := (s.PSN+uint32(s.Count))&psnMask, (s.PSN+uint32(s.Resent))&psnMask
	if o := q.at(i); !o.Kind.Acked() { // a READ or an atomic: its PSNs are its response's
		end = (o.last + 1) & psnMask
		if s.Resent > 0 {
			first = end
		}
	}
	if end == q.fresh {
		q.fresh = first
	}
	if psnDiff(s.PSN, q.cursor) < 0 {
		q.cursor = s.PSN
	}
}

func (q *Requester) arm(now time.Time) {
	if q.cfg.Timeout > 0 && !q.cfg.UC {
		q.deadline = now.Add(q.cfg.Timeout)
	}
}

// rewind moves the cursor back to psn (go-back-N), to the first PSN of a READ or an
// atomic that psn falls in: those are asked again whole.
func (q *Requester) rewind(psn uint32) {
	i := q.find(psn)
	if i < 0 {
		return // behind every outstanding message: nothing to send again
	}
	if o := q.at(i); !o.Kind.Acked() {
		psn = o.first
	}
	if psnDiff(psn, q.cursor) < 0 {
		q.cursor = psn
	}
	q.stats.MaxGoBack = max(q.stats.MaxGoBack, uint64(max(psnDiff(q.fresh, q.cursor), 0)))
}

// Receive takes an ACK, a NAK or an atomic's acknowledgement from the responder.
// READ responses go to ReadResponse.
func (q *Requester) Receive(p *Packet, now time.Time) Output {
	out := q.output()
	if q.failed || q.n == 0 {
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
		i := q.find(p.PSN)
		if i < 0 || psnDiff(p.PSN, q.fresh) >= 0 {
			return out // not a PSN of ours in flight
		}
		o := q.at(i)
		q.stats.RNRNAKs++
		q.confirmed = p.PSN // the responder expects that PSN again
		if q.cfg.RNRRetry != 7 && o.rnrTries >= q.cfg.RNRRetry {
			q.fail(i, StatusRNRRetryExceeded, &out)
			return out
		}
		o.rnrTries++
		q.paused = true
		q.cursor = q.nextPSN // nothing goes out until Resume, which goes back
		q.rewind(p.PSN)
		out.RNRWait = RNRTimer(p.Syndrome.Timer())
		q.deadline = time.Time{} // the RNR timer, not the ACK timer, runs now
	case p.Opcode == Acknowledge && p.Syndrome == SynNAKPSNSeqError:
		if psnDiff(p.PSN, q.fresh) > 0 {
			return out // a PSN never sent: not an answer to us
		}
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
		if i := q.find(p.PSN); i >= 0 {
			status := StatusRemoteInvalid // also for a NAK code we do not know
			switch p.Syndrome {
			case SynNAKRemoteAccess:
				status = StatusRemoteAccess
			case SynNAKRemoteOperation:
				status = StatusRemoteOp
			}
			q.fail(i, status, &out)
		}
	case p.Opcode == AtomicAck:
		i := q.find(p.PSN)
		if i < 0 {
			return out
		}
		o := q.at(i)
		if o.first != p.PSN || (o.Kind != KindCompareSwap && o.Kind != KindFetchAdd) {
			return out // a stale or misdirected response: ignore it
		}
		q.ackThrough((p.PSN-1)&psnMask, &out, now)
		if q.impliedNAK(i, &out, now) {
			return out
		}
		q.complete(i, p.Orig, &out, now)
	}
	return out
}

// Lookup returns the id of the outstanding atomic whose PSN is psn: where its
// acknowledgement's original value goes.
func (q *Requester) Lookup(psn uint32) (uint64, bool) {
	i := q.find(psn)
	if i < 0 {
		return 0, false
	}
	o := q.at(i)
	if o.first != psn || (o.Kind != KindCompareSwap && o.Kind != KindFetchAdd) {
		return 0, false
	}
	return o.ID, true
}

// ReadResponse takes a READ response run: it says which READ it answers (id) and
// where its payload goes in that READ's data (off), or ok false when it must be
// dropped (a gap, a duplicate, a response to nothing outstanding). The owner places
// the payload and calls ResponsePlaced; if it cannot (its memory must fault first),
// it drops the run, and RetransmitFrom asks for the READ again later.
func (q *Requester) ReadResponse(s *Segment, now time.Time) (id uint64, off uint32, out Output, ok bool) {
	out = q.output()
	if q.failed || q.n == 0 || opInfo[s.Opcode].kind != KindReadResponse {
		return 0, 0, out, false
	}
	i := q.find(s.PSN)
	if i < 0 {
		return 0, 0, out, false
	}
	o := q.at(i)
	if o.Kind != KindReadRequest || s.PSN != o.respNext {
		return 0, 0, out, false // a gap or a duplicate: the READ is asked again when the timer fires
	}
	if pos := opInfo[s.Opcode].pos; pos == posFirst || pos == posOnly {
		if s.PSN != o.first {
			return 0, 0, out, false
		}
		q.ackThrough((s.PSN-1)&psnMask, &out, now)
		i = q.find(s.PSN) // ackThrough moved the ring's head
		if q.impliedNAK(i, &out, now) {
			return 0, 0, out, false
		}
		o = q.at(i)
	}
	end := uint64(psnDiff(s.PSN, o.first))*uint64(q.cfg.MTU) + uint64(len(s.Payload))
	lastPos := opInfo[s.Last].pos
	if end > uint64(o.Length) || ((lastPos == posLast || lastPos == posOnly) != (s.LastPSN() == o.last)) ||
		((lastPos == posLast || lastPos == posOnly) && end != uint64(o.Length)) {
		q.fail(i, StatusRemoteInvalid, &out) // a response of the wrong length: the peer is broken
		return 0, 0, out, false
	}
	return o.ID, uint32(psnDiff(s.PSN, o.first)) * uint32(q.cfg.MTU), out, true
}

// ResponsePlaced records that the run ReadResponse accepted was placed: a READ
// whose last response packet it was completes.
func (q *Requester) ResponsePlaced(s *Segment, now time.Time) Output {
	out := q.output()
	if q.failed {
		return out
	}
	i := q.find(s.PSN)
	if i < 0 {
		return out
	}
	o := q.at(i)
	o.respNext = (s.LastPSN() + 1) & psnMask
	q.retries = 0 // forward progress
	if s.LastPSN() == o.last {
		q.complete(i, 0, &out, now)
	} else {
		q.arm(now)
	}
	return out
}

// RetransmitFrom goes back to psn, uncounted: the owner dropped a response it could
// not place and has made its memory ready.
func (q *Requester) RetransmitFrom(psn uint32) {
	if !q.failed {
		q.resending = true
		q.rewind(psn)
	}
}

// Resume ends the pause an RNR NAK began (Output.RNRWait after it): the cursor is
// at the NAKed PSN, and the ACK timer runs again.
func (q *Requester) Resume(now time.Time) {
	if q.paused {
		q.paused = false
		if q.n > 0 {
			q.arm(now)
		}
	}
}

// Tick runs the ACK timer: past the deadline with messages outstanding, it
// retransmits them all, or fails the oldest when RetryCnt retransmissions went
// unanswered.
func (q *Requester) Tick(now time.Time) Output {
	out := q.output()
	if q.failed || q.n == 0 || q.deadline.IsZero() || now.Before(q.deadline) {
		return out
	}
	q.stats.Timeouts++
	q.retransmit(q.at(0).first, &out, now, true)
	return out
}

// retransmit goes back to psn (go-back-N); counted ones use up the retry count.
func (q *Requester) retransmit(psn uint32, out *Output, now time.Time, counted bool) {
	if counted {
		if q.retries >= q.cfg.RetryCnt {
			q.fail(0, StatusRetryExceeded, out)
			return
		}
		q.retries++
	}
	q.resending = true
	q.rewind(psn)
	q.deadline = time.Time{}
	q.arm(now)
}

// impliedNAK handles a response to message i while an earlier READ or atomic still
// waits for its own: that response was lost (responses come in order), so
// everything from the earlier one is sent again (IBTA's implied NAK). It reports
// whether it did.
func (q *Requester) impliedNAK(i int, out *Output, now time.Time) bool {
	for j := 0; j < i; j++ {
		if !q.at(j).Kind.Acked() {
			if !q.resending { // the responses of the first sending still arrive after it
				q.retransmit(q.at(j).first, out, now, true)
			}
			return true
		}
	}
	return false
}

// ackThrough completes the SENDs, WRITEs and atomic writes whose last packet is at
// or before psn.
// A READ or atomic is completed by its response, not by an ACK: an ACK beyond one
// that still waits means its response was lost (an implied NAK).
func (q *Requester) ackThrough(psn uint32, out *Output, now time.Time) {
	for q.n > 0 {
		o := q.at(0)
		if psnDiff(o.last, psn) > 0 {
			return
		}
		if !o.Kind.Acked() {
			if !q.resending {
				q.retransmit(o.first, out, now, true)
			}
			return
		}
		q.complete(0, 0, out, now)
	}
}

// complete ends message i successfully; the messages before it, which its response
// acknowledges implicitly, are complete too.
func (q *Requester) complete(i int, orig uint64, out *Output, now time.Time) {
	for k := 0; k <= i; k++ {
		c := Completion{ID: q.at(0).ID, Status: StatusSuccess}
		if k == i {
			c.Orig = orig
		}
		out.Done = append(q.done, c)
		q.done = out.Done
		q.head = (q.head + 1) & (len(q.ring) - 1)
		q.n--
		q.ci--
	}
	q.retries, q.resending = 0, false
	q.deadline = time.Time{}
	if q.n == 0 {
		q.cursor = q.nextPSN // a go-back-N under way has nothing left to send again
		return
	}
	if psnDiff(q.cursor, q.at(0).first) < 0 {
		q.cursor = q.at(0).first
	}
	q.arm(now)
}

// fail ends message i with status and flushes what follows it: the QP is in error.
// Messages before it were acknowledged implicitly by whatever made it fail only if
// an ACK said so; they are flushed too.
func (q *Requester) fail(i int, status Status, out *Output) {
	for k := 0; k < q.n; k++ {
		s := StatusFlushed
		if k == i {
			s = status
		}
		out.Done = append(q.done, Completion{ID: q.at(k).ID, Status: s})
		q.done = out.Done
	}
	q.n, q.failed, q.paused = 0, true, false
	q.cursor = q.nextPSN
	q.deadline = time.Time{}
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
	out := q.output()
	for i := 0; i < q.n; i++ {
		if q.at(i).ID == id {
			q.fail(i, status, &out)
			break
		}
	}
	return out
}

// Flush ends every outstanding message with status (StatusFlushed when the QP went to
// the error state, StatusRetryExceeded when the peer is gone) and fails the
// requester: what is posted later is flushed.
func (q *Requester) Flush(status Status) Output {
	out := q.output()
	for i := 0; i < q.n; i++ {
		out.Done = append(q.done, Completion{ID: q.at(i).ID, Status: status})
		q.done = out.Done
	}
	q.n, q.failed, q.paused = 0, true, false
	q.cursor = q.nextPSN
	q.deadline = time.Time{}
	return out
}
