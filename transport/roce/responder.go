package roce

import "fmt"

// psnMask keeps PSNs to 24 bits.
const psnMask = 1<<24 - 1

// psnDiff returns a-b as a signed distance on the 24-bit PSN circle: positive when a
// is ahead of b (by less than half the circle), negative when behind.
func psnDiff(a, b uint32) int32 {
	return int32((a-b)&psnMask<<8) >> 8
}

// Action is what the responder's state machine tells its QP to do with a run of
// request packets.
type Action int

// The responder's actions.
const (
	// ActDrop: ignore the run (after an RNR NAK or a sequence NAK, until the
	// expected PSN comes again; a duplicate nothing answers).
	ActDrop Action = iota
	// ActNAK: answer Verdict.Resp: a PSN sequence error NAK, or the invalid request
	// NAK of a malformed run, after which the QP is in error (Fatal).
	ActNAK
	// ActAck: a duplicate SEND or WRITE: acknowledge again what was executed.
	ActAck
	// ActPlace: the run's payload from packet Skip on is a SEND's or WRITE's data at
	// byte Off of its message (Verdict.Msg): place it, then call Placed (or RNR).
	ActPlace
	// ActRead: a new READ (Verdict.Msg): read and send the response, then call
	// ReadDone.
	ActRead
	// ActReadAgain: a duplicate READ within one already executed: send the response
	// again from Verdict.Msg.First for Msg.Length bytes at Msg.VA (IBTA lets a
	// responder read memory again).
	ActReadAgain
	// ActAtomic: a new atomic (Verdict.Msg): execute it, then call AtomicDone.
	ActAtomic
	// ActAtomicAgain: a duplicate atomic whose result is kept: send Verdict.Resp.
	ActAtomicAgain
)

// MessageInfo is what the responder knows of a request message: its kind, its
// first PSN and its addressing.
type MessageInfo struct {
	Kind   Kind
	First  uint32 // PSN of the message's first packet (a READ's: of its response's first)
	VA     uint64 // WRITE, READ, atomics
	RKey   uint32
	Length uint32 // WRITE: the RETH's length; READ: the bytes asked for
	// The last packet's: immediate data (HasImm) or the R_Key a SEND with
	// invalidate invalidates (Inv), the ACK request.
	HasImm, Inv bool
	Imm         uint32
	// Atomics: the swap value or addend, and the compare value.
	Swap, Compare uint64
}

// Verdict is what Receive says of a run.
type Verdict struct {
	Act Action
	// Skip is how many of the run's first packets are duplicates, already taken:
	// the action applies to the rest.
	Skip int
	Off  uint32 // ActPlace: where the first packet taken starts in its message
	Ends bool   // ActPlace: the run ends its message
	// AckReq: the run's last packet asks for an acknowledgement.
	AckReq bool
	Msg    MessageInfo
	Resp   *Message // ActNAK, ActAck, ActAtomicAgain: what to send
	// Fatal: the run broke the protocol (ActNAK with an invalid request NAK): the
	// QP goes to the error state.
	Fatal bool
}

// Responder is the receive side of an RC QP as IBTA chapter 9.7.5 (and rxe_resp.c)
// define it, without I/O and without copying: it takes runs of request packets in
// arrival order and says what to do with each, checking the opcode sequence and
// every length before the QP touches memory. It tracks the expected PSN, the
// message sequence number, the message in progress, the sequence NAK already sent,
// the RNR state, and the READs and atomics executed last (max_dest_rd_atomic of
// them), to answer their duplicates as rxe does: a duplicate READ must ask for the
// original range or part of it, a duplicate atomic is answered from its saved result,
// and one older than what is kept is dropped (IBTA's class D error), never NAKed.
//
// Made with Limits.UC, it is a UC responder (IBTA 9.8.3, rxe_resp.c): it answers
// nothing. A packet out of sequence loses the message in progress; a FIRST or ONLY
// out of sequence starts a new one there, anything else is dropped until one
// comes. A run that breaks the protocol is dropped with its message, and so is a
// message the QP cannot take (Drop).
// It is not safe for concurrent use.
type Responder struct {
	uc      bool
	mtu     int
	maxMsg  uint32
	ePSN    uint32
	msn     uint32
	nakSent bool // a PSN sequence error NAK went out for ePSN
	rnrWait bool // an RNR NAK went out for ePSN: drop later PSNs until it comes again
	// The message in progress (a FIRST taken, its LAST not yet).
	cur      MessageInfo
	curGot   uint32 // bytes taken
	inMsg    bool
	atomics  recent[savedAtomic] // the latest maxSaved
	reads    recent[savedRead]   // the latest maxSaved
	maxSaved int
	// lastPSN is the last PSN of the newest executed message (the PSN an ACK
	// acknowledges).
	lastPSN uint32
}

type savedAtomic struct {
	psn  uint32
	resp Message
}

// recent keeps the latest entries added, up to its size, in a ring: one added
// when it is full replaces the oldest without moving the others (a READ adds one).
type recent[T any] struct {
	buf  []T
	head int // the oldest's index in buf
	n    int
}

// add keeps v, dropping the oldest if size are kept already.
func (r *recent[T]) add(v T, size int) {
	if r.buf == nil {
		r.buf = make([]T, size)
	}
	if r.n < len(r.buf) {
		r.buf[(r.head+r.n)%len(r.buf)] = v
		r.n++
		return
	}
	r.buf[r.head] = v
	r.head = (r.head + 1) % len(r.buf)
}

// at returns the i-th kept entry, 0 the oldest.
func (r *recent[T]) at(i int) *T { return &r.buf[(r.head+i)%len(r.buf)] }

type savedRead struct {
	first, last uint32
	va          uint64
	rkey        uint32
	length      uint32
}

// NewResponder starts a responder expecting firstPSN (the peer's starting PSN) with
// the given limits; it keeps the last maxSaved READs and atomics
// (max_dest_rd_atomic) to answer their duplicates.
func NewResponder(firstPSN uint32, lim Limits, maxSaved int) *Responder {
	return &Responder{uc: lim.UC, mtu: lim.MTU, maxMsg: lim.MaxMessage, ePSN: firstPSN & psnMask,
		lastPSN: (firstPSN - 1) & psnMask, maxSaved: max(maxSaved, 1)}
}

// ExpectedPSN returns the PSN the responder waits for.
func (r *Responder) ExpectedPSN() uint32 { return r.ePSN }

// MSN returns the message sequence number (messages completed, modulo 2^24).
func (r *Responder) MSN() uint32 { return r.msn }

// InMessage reports whether a SEND or WRITE is in progress (its FIRST taken).
func (r *Responder) InMessage() bool { return r.inMsg }

// Receive takes the next run of request packets and says what to do with it. It
// changes nothing the QP must undo if it cannot act (a page fault): Placed,
// ReadDone and AtomicDone record that it did.
func (r *Responder) Receive(s *Segment) Verdict {
	if !s.Opcode.IsRequest() || s.Opcode.UC() != r.uc {
		return Verdict{Act: ActDrop} // a response, or another transport's request: not ours
	}
	if err := s.check(r.mtu); err != nil {
		return r.malformed()
	}
	skip := 0
	switch d := psnDiff(s.PSN, r.ePSN); {
	case d != 0 && r.uc: // a packet was lost, or this one is old
		r.inMsg = false // the message in progress, if any, is lost
		if pos := opInfo[s.Opcode].pos; pos != posFirst && pos != posOnly {
			return Verdict{Act: ActDrop}
		}
		r.ePSN = s.PSN // a new message starts here
	case d > 0: // ahead: packets were lost
		if r.nakSent || r.rnrWait {
			return Verdict{Act: ActDrop}
		}
		r.nakSent = true
		return Verdict{Act: ActNAK, Resp: r.ack(SynNAKPSNSeqError, r.ePSN)} // the PSN it expects
	case d < 0:
		if psnDiff(s.LastPSN(), r.ePSN) < 0 {
			return r.duplicate(s)
		}
		skip = int(-d) // a run whose first packets are duplicates: take the rest
	}
	r.nakSent, r.rnrWait = false, false
	op := s.Op(skip)
	info, pos := opInfo[op], opInfo[op].pos
	v := Verdict{Skip: skip}
	payload := len(s.Payload) - skip*r.mtu
	if pos == posFirst || pos == posOnly {
		if r.inMsg {
			return r.malformed() // a new message while one is in progress
		}
		v.Msg = MessageInfo{Kind: info.kind, First: s.PSN, VA: s.VA, RKey: s.RKey, Length: s.DMALen}
		switch {
		case info.kind == KindReadRequest:
			if s.DMALen > r.maxMsg {
				return r.malformed()
			}
			v.Act = ActRead
			return v
		case info.kind == KindCompareSwap || info.kind == KindFetchAdd:
			v.Act = ActAtomic
			v.Msg.Swap, v.Msg.Compare = s.Swap, s.Compare
			return v
		case info.kind == KindWrite && (s.DMALen > r.maxMsg || (pos == posFirst && s.DMALen <= uint32(r.mtu)) ||
			(pos == posOnly && s.DMALen != uint32(payload))):
			return r.malformed()
		case info.kind == KindAtomicWrite && (s.DMALen != 8 || payload != 8):
			return r.malformed()
		case info.kind == KindSend:
			v.Msg.VA, v.Msg.RKey, v.Msg.Length = 0, 0, 0
		}
	} else {
		if !r.inMsg || r.cur.Kind != info.kind {
			return r.malformed() // a MIDDLE or LAST without its FIRST
		}
		v.Msg = r.cur
		v.Off = r.curGot
	}
	limit := r.maxMsg
	if v.Msg.Kind == KindWrite || v.Msg.Kind == KindAtomicWrite {
		limit = v.Msg.Length
	}
	got := uint64(v.Off) + uint64(payload)
	if got > uint64(limit) {
		return r.malformed()
	}
	lastPos := opInfo[s.Last].pos
	v.Ends = lastPos == posLast || lastPos == posOnly
	if v.Ends && v.Msg.Kind == KindWrite && got != uint64(v.Msg.Length) {
		return r.malformed()
	}
	if v.Ends {
		v.AckReq = s.AckReq
		switch f := s.Last.flags(); {
		case f&hasImm != 0:
			v.Msg.HasImm, v.Msg.Imm = true, s.Imm
		case f&hasIETH != 0:
			v.Msg.Inv, v.Msg.Imm = true, s.Imm
		}
	}
	v.Act = ActPlace
	return v
}

// malformed answers a run that breaks the protocol: IBTA's invalid request NAK,
// after which the QP is in error; on UC, the run is dropped with its message.
func (r *Responder) malformed() Verdict {
	r.inMsg = false
	if r.uc {
		return Verdict{Act: ActDrop}
	}
	return Verdict{Act: ActNAK, Fatal: true, Resp: r.ack(SynNAKInvalidRequest, r.ePSN)}
}

// Drop records that the QP dropped the message of the run it was given (UC: no
// receive posted, an access error, a receive too small): the rest of the message
// is dropped as it comes, until a new one starts.
func (r *Responder) Drop() { r.inMsg = false }

// Placed records that the run v was given for (ActPlace) was placed: the expected
// PSN moves past it, and past its message if it ended one. It reports whether the
// run asks for an acknowledgement (sent coalesced).
func (r *Responder) Placed(s *Segment, v *Verdict) bool {
	if !r.inMsg {
		r.cur, r.curGot, r.inMsg = v.Msg, 0, true
	}
	r.curGot += uint32(len(s.Payload) - v.Skip*r.mtu)
	r.ePSN = (s.LastPSN() + 1) & psnMask
	if v.Ends {
		r.inMsg = false
		r.lastPSN = s.LastPSN()
		r.msn = (r.msn + 1) & psnMask
	}
	return v.AckReq && !r.uc
}

// ReadDone records that the new READ v was given for was executed (its response
// sent or being sent): the expected PSN moves past its response's PSNs, and the READ
// is kept for its duplicates.
func (r *Responder) ReadDone(v *Verdict) {
	n := Packets(int(v.Msg.Length), r.mtu)
	last := (v.Msg.First + uint32(n) - 1) & psnMask
	r.reads.add(savedRead{first: v.Msg.First, last: last, va: v.Msg.VA, rkey: v.Msg.RKey, length: v.Msg.Length}, r.maxSaved)
	r.ePSN = (last + 1) & psnMask
	r.lastPSN = last
	r.msn = (r.msn + 1) & psnMask
}

// AtomicDone records that the atomic v was given for executed and found orig, and
// returns its acknowledgement, which is kept for its duplicates.
func (r *Responder) AtomicDone(v *Verdict, orig uint64) *Message {
	r.msn = (r.msn + 1) & psnMask
	resp := Message{Kind: KindAtomicAck, PSN: v.Msg.First, Syndrome: SynACK, MSN: r.msn, Orig: orig}
	r.atomics.add(savedAtomic{psn: v.Msg.First, resp: resp}, r.maxSaved)
	r.ePSN = (v.Msg.First + 1) & psnMask
	r.lastPSN = v.Msg.First
	return &resp
}

// RNR records that the run at the expected PSN was answered with an RNR NAK (its
// pages are missing, or no receive is posted): the requester sends it again, and
// everything after it is dropped until then. A message in progress stays in
// progress: its next packets come again. The NAK to send is returned.
func (r *Responder) RNR(timer uint8) *Message {
	r.rnrWait = true
	return r.ack(RNR(timer), r.ePSN)
}

// Fail returns the NAK answering a request the QP refuses (an access or operation
// error at the expected PSN): the QP goes to the error state, so nothing more is
// expected.
func (r *Responder) Fail(syn Syndrome) *Message {
	r.inMsg = false
	return r.ack(syn, r.ePSN)
}

// Ack returns the ACK for everything executed so far (coalesced).
func (r *Responder) Ack() *Message { return r.ack(SynACK, r.lastPSN) }

func (r *Responder) ack(syn Syndrome, psn uint32) *Message {
	return &Message{Kind: KindAck, Syndrome: syn, MSN: r.msn, PSN: psn}
}

// duplicate answers a run wholly behind the expected PSN.
func (r *Responder) duplicate(s *Segment) Verdict {
	switch s.Opcode {
	case ReadRequest:
		for i := r.reads.n - 1; i >= 0; i-- {
			o := r.reads.at(i)
			if psnDiff(s.PSN, o.first) < 0 || psnDiff(o.last, s.PSN) < 0 {
				continue
			}
			// rxe's rule: the same READ or a part of it, under the same key.
			if s.RKey != o.rkey || s.VA < o.va || s.DMALen > o.length || s.VA+uint64(s.DMALen) > o.va+uint64(o.length) {
				return Verdict{Act: ActDrop}
			}
			return Verdict{Act: ActReadAgain, Msg: MessageInfo{Kind: KindReadRequest, First: s.PSN, VA: s.VA, RKey: s.RKey,
				Length: s.DMALen}}
		}
		return Verdict{Act: ActDrop} // older than what is kept: class D, dropped
	case CompareSwap, FetchAdd:
		for i := range r.atomics.n {
			if o := r.atomics.at(i); o.psn == s.PSN {
				resp := o.resp
				return Verdict{Act: ActAtomicAgain, Resp: &resp}
			}
		}
		return Verdict{Act: ActDrop} // older than what is kept: class D, dropped
	}
	// A SEND or WRITE executed already: acknowledge what was executed (C9-105).
	return Verdict{Act: ActAck, Resp: r.Ack()}
}

// String names the action.
func (a Action) String() string {
	names := [...]string{"drop", "nak", "ack", "place", "read", "read-again", "atomic", "atomic-again"}
	if a < 0 || int(a) >= len(names) {
		return fmt.Sprintf("Action(%d)", int(a))
	}
	return names[a]
}
