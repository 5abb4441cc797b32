package roce

import "fmt"

// psnMask keeps PSNs to 24 bits.
const psnMask = 1<<24 - 1

// psnDiff returns a-b as a signed distance on the 24-bit PSN circle: positive when a
// is ahead of b (by less than half the circle), negative when behind.
func psnDiff(a, b uint32) int32 {
	return int32((a-b)&psnMask<<8) >> 8
}

// Action is what the responder's state machine tells its QP to do with a packet.
type Action int

// The responder's actions.
const (
	// ActDrop: ignore the packet (after an RNR NAK or a sequence NAK, until the
	// expected PSN comes again).
	ActDrop Action = iota
	// ActContinue: a FIRST or MIDDLE packet was taken; nothing to do yet.
	ActContinue
	// ActExecute: Message is complete and new: execute it, then call Executed (or
	// RNR, if its pages are missing).
	ActExecute
	// ActNAK: answer Response (a PSN sequence error NAK, or the malformed packet's
	// invalid request NAK).
	ActNAK
	// ActDuplicate: Message repeats one already executed: answer Response (an ACK,
	// or the saved atomic response), or for a READ execute it again and send the data
	// (IBTA lets a responder read memory again for a duplicate READ).
	ActDuplicate
)

// Responder is the receive side of an RC QP as IBTA chapter 9.7.5 (and rxe_resp.c)
// define it, without I/O: it takes packets in arrival order and says what to do with
// each. It tracks the expected PSN, the message sequence number, the sequence NAK
// already sent, the RNR state and the results of recent atomics for duplicates.
// It is not safe for concurrent use.
type Responder struct {
	mtu      int
	ePSN     uint32
	msn      uint32
	nakSent  bool // a PSN sequence error NAK went out for ePSN
	rnrWait  bool // an RNR NAK went out for ePSN: drop until it comes again
	reasm    *Reassembler
	atomics  []savedAtomic // the latest ones, oldest first
	maxSaved int
	// lastPSN is the last PSN of the newest executed message (the PSN a duplicate
	// SEND or WRITE is acknowledged with).
	lastPSN uint32
}

type savedAtomic struct {
	psn  uint32
	resp Message
}

// NewResponder starts a responder expecting firstPSN (the peer's starting PSN) with
// the given limits; it keeps the results of the last maxAtomics atomics
// (max_dest_rd_atomic) to answer their duplicates.
func NewResponder(firstPSN uint32, lim Limits, maxAtomics int) *Responder {
	return &Responder{mtu: lim.MTU, ePSN: firstPSN & psnMask, lastPSN: (firstPSN - 1) & psnMask,
		reasm: NewReassembler(lim), maxSaved: max(maxAtomics, 1)}
}

// ExpectedPSN returns the PSN the responder waits for.
func (r *Responder) ExpectedPSN() uint32 { return r.ePSN }

// MSN returns the message sequence number (messages completed, modulo 2^24).
func (r *Responder) MSN() uint32 { return r.msn }

// Receive takes the next packet and returns the action, with the complete message
// (ActExecute, ActDuplicate) or the response to send (ActNAK, ActDuplicate).
func (r *Responder) Receive(p *Packet) (Action, *Message, *Message) {
	if !p.Opcode.IsRequest() {
		return ActDrop, nil, nil // a response sent to the responder: not ours
	}
	switch d := psnDiff(p.PSN, r.ePSN); {
	case d > 0: // ahead: packets were lost
		if r.nakSent || r.rnrWait {
			return ActDrop, nil, nil
		}
		r.nakSent = true
		return ActNAK, nil, r.ack(SynNAKPSNSeqError, r.ePSN) // the PSN it expects

	case d < 0: // behind: a duplicate
		return r.duplicate(p)
	}
	r.nakSent, r.rnrWait = false, false
	m, err := r.reasm.Add(p)
	if err != nil {
		r.reasm = NewReassembler(r.reasm.lim)
		return ActNAK, nil, r.ack(SynNAKInvalidRequest, r.ePSN)
	}
	if m == nil {
		r.ePSN = (r.ePSN + 1) & psnMask
		return ActContinue, nil, nil
	}
	return ActExecute, m, nil
}

// Executed records that m, returned by Receive with ActExecute, was executed and
// answered with resp (kept for an atomic's duplicates): the expected PSN moves past
// it (past its response's packets, for a READ) and the MSN advances.
func (r *Responder) Executed(m *Message, resp *Message) {
	n := 1
	if m.Kind == KindReadRequest {
		n = Packets(int(m.DMALen), r.mtu)
	}
	last := (r.ePSN + uint32(n) - 1) & psnMask
	if m.Kind == KindCompareSwap || m.Kind == KindFetchAdd {
		if len(r.atomics) == r.maxSaved {
			r.atomics = r.atomics[1:]
		}
		r.atomics = append(r.atomics, savedAtomic{psn: m.PSN, resp: *resp})
	}
	r.ePSN = (last + 1) & psnMask
	r.lastPSN = last
	r.msn = (r.msn + 1) & psnMask
}

// RNR records that m (returned by Receive with ActExecute) was answered with an RNR
// NAK: the expected PSN goes back to m's first packet, and everything else is
// dropped until the requester sends it again. The NAK to send is returned.
func (r *Responder) RNR(m *Message, timer uint8) *Message {
	r.ePSN = m.PSN
	r.rnrWait = true
	r.reasm = NewReassembler(r.reasm.lim)
	return r.ack(RNR(timer), m.PSN)
}

// Fail records that m was answered with a NAK (access or operation error): the QP
// goes to the error state, so nothing more is expected.
func (r *Responder) Fail(m *Message, syn Syndrome) *Message {
	return r.ack(syn, m.PSN)
}

// Ack returns the ACK for everything executed so far (coalesced).
func (r *Responder) Ack() *Message { return r.ack(SynACK, r.lastPSN) }

func (r *Responder) ack(syn Syndrome, psn uint32) *Message {
	return &Message{Kind: KindAck, Syndrome: syn, MSN: r.msn, PSN: psn}
}

// duplicate answers a request behind the expected PSN.
func (r *Responder) duplicate(p *Packet) (Action, *Message, *Message) {
	switch p.Opcode {
	case ReadRequest:
		// Executed again (the data may be read again); the QP sends it with the
		// request's PSN and does not call Executed.
		return ActDuplicate, &Message{Kind: KindReadRequest, PSN: p.PSN, VA: p.VA, RKey: p.RKey, DMALen: p.DMALen}, nil
	case CompareSwap, FetchAdd:
		for _, s := range r.atomics {
			if s.psn == p.PSN {
				resp := s.resp
				return ActDuplicate, nil, &resp
			}
		}
		// Older than what is kept: IBTA calls this an invalid request.
		return ActNAK, nil, r.ack(SynNAKInvalidRequest, p.PSN)
	}
	// A SEND or WRITE executed already: acknowledge what was executed, once per
	// packet that asks for it.
	if !p.AckReq {
		return ActDrop, nil, nil
	}
	return ActDuplicate, nil, r.Ack()
}

// String names the action.
func (a Action) String() string {
	names := [...]string{"drop", "continue", "execute", "nak", "duplicate"}
	if a < 0 || int(a) >= len(names) {
		return fmt.Sprintf("Action(%d)", int(a))
	}
	return names[a]
}
