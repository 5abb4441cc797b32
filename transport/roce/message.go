package roce

import (
	"fmt"

	"github.com/odpemu/odpemu/internal/bufpool"
)

// Kind is what an RC message is: a request or a response.
type Kind uint8

// The message kinds.
const (
	KindSend Kind = iota + 1
	KindWrite
	KindReadRequest
	KindReadResponse
	KindCompareSwap
	KindFetchAdd
	KindAck       // an ACK or a NAK (Syndrome says which)
	KindAtomicAck // an atomic's response, with the original value
)

// Message is one RC message, the unit a work request or its response is: a SEND or
// WRITE of any length becomes FIRST, MIDDLE... LAST packets of one path MTU each, or
// an ONLY packet.
type Message struct {
	Kind Kind
	// PSN is the message's first packet's PSN; a READ request's is the PSN of its
	// response's first packet, and the request takes as many PSNs as its response
	// has packets.
	PSN    uint32
	DestQP uint32
	AckReq bool

	VA     uint64 // WRITE, READ, atomics
	RKey   uint32
	DMALen uint32 // WRITE: len(Payload); READ: the length asked for

	HasImm bool // SEND and WRITE with immediate
	Imm    uint32

	Swap, Compare uint64 // atomics
	Orig          uint64 // KindAtomicAck
	Syndrome      Syndrome
	MSN           uint32

	Payload []byte
}

// span returns how many PSNs m takes at the given MTU: its packets, or a READ
// request's response packets.
func (m *Message) span(mtu int) int {
	switch m.Kind {
	case KindReadRequest:
		return Packets(int(m.DMALen), mtu)
	case KindSend, KindWrite, KindReadResponse:
		return Packets(len(m.Payload), mtu)
	}
	return 1
}

// Packets returns how many packets (and PSNs) a message of n payload bytes takes at
// the given MTU.
func Packets(n, mtu int) int { return max(1, (n+mtu-1)/mtu) }

// segmentOps are the opcodes of a multi-packet message kind: first, middle, last,
// only, and last and only with immediate (where one exists).
var segmentOps = map[Kind][6]Opcode{
	KindSend:         {SendFirst, SendMiddle, SendLast, SendOnly, SendLastImm, SendOnlyImm},
	KindWrite:        {WriteFirst, WriteMiddle, WriteLast, WriteOnly, WriteLastImm, WriteOnlyImm},
	KindReadResponse: {ReadRespFirst, ReadRespMiddle, ReadRespLast, ReadRespOnly, ReadRespLast, ReadRespOnly},
}

// Segment splits m into its packets, with consecutive PSNs from m.PSN (modulo
// 2^24), each payload at most mtu bytes (a slice of m.Payload). The last packet
// carries AckReq when m does.
func Segment(m *Message, mtu int) ([]Packet, error) {
	if !ValidMTU(mtu) {
		return nil, fmt.Errorf("%w: path MTU %d", ErrMalformed, mtu)
	}
	base := Packet{DestQP: m.DestQP, PSN: m.PSN, PKey: 0xffff}
	one := func(op Opcode) []Packet {
		p := base
		p.Opcode, p.AckReq = op, m.AckReq
		return []Packet{p}
	}
	switch m.Kind {
	case KindReadRequest:
		ps := one(ReadRequest)
		ps[0].VA, ps[0].RKey, ps[0].DMALen = m.VA, m.RKey, m.DMALen
		return ps, nil
	case KindCompareSwap, KindFetchAdd:
		op := CompareSwap
		if m.Kind == KindFetchAdd {
			op = FetchAdd
		}
		ps := one(op)
		ps[0].VA, ps[0].RKey, ps[0].Swap, ps[0].Compare = m.VA, m.RKey, m.Swap, m.Compare
		return ps, nil
	case KindAck:
		ps := one(Acknowledge)
		ps[0].Syndrome, ps[0].MSN = m.Syndrome, m.MSN
		return ps, nil
	case KindAtomicAck:
		ps := one(AtomicAck)
		ps[0].Syndrome, ps[0].MSN, ps[0].Orig = m.Syndrome, m.MSN, m.Orig
		return ps, nil
	case KindSend, KindWrite, KindReadResponse:
	default:
		return nil, fmt.Errorf("%w: message kind %d", ErrMalformed, m.Kind)
	}
	ops := segmentOps[m.Kind]
	if m.HasImm && m.Kind == KindReadResponse {
		return nil, fmt.Errorf("%w: a READ response carries no immediate", ErrMalformed)
	}
	n := Packets(len(m.Payload), mtu)
	out := make([]Packet, n)
	for i := range out {
		p := base
		p.PSN = (m.PSN + uint32(i)) & (1<<24 - 1)
		p.Payload = m.Payload[i*mtu : min((i+1)*mtu, len(m.Payload))]
		switch {
		case n == 1:
			p.Opcode = ops[3]
		case i == 0:
			p.Opcode = ops[0]
		case i == n-1:
			p.Opcode = ops[2]
		default:
			p.Opcode = ops[1]
		}
		if i == n-1 {
			p.AckReq = m.AckReq
			if m.HasImm {
				p.Opcode = ops[4]
				if n == 1 {
					p.Opcode = ops[5]
				}
				p.Imm = m.Imm
			}
		}
		if f := p.Opcode.flags(); f&hasRETH != 0 {
			p.VA, p.RKey, p.DMALen = m.VA, m.RKey, uint32(len(m.Payload))
		}
		if p.Opcode.flags()&hasAETH != 0 {
			p.Syndrome, p.MSN = m.Syndrome, m.MSN
		}
		out[i] = p
	}
	return out, nil
}

// Reassembler puts the packets of one direction of a QP back into messages, in PSN
// order (the caller drops what is out of order, as an RC receiver does). It checks
// that the opcodes of a message follow each other (FIRST, MIDDLE..., LAST), that a
// WRITE's packets add up to its RETH's length, and that no message exceeds
// Limits.MaxMessage, before it allocates for a message: a peer cannot make it
// allocate more than that.
type Reassembler struct {
	lim     Limits
	cur     *Message // a message whose FIRST came, or nil
	curKind Kind
}

// NewReassembler returns a reassembler that enforces lim.
func NewReassembler(lim Limits) *Reassembler { return &Reassembler{lim: lim} }

// Add takes the next packet and returns the message it completes, or nil. An error
// means the peer broke the protocol: the message in progress is dropped.
func (r *Reassembler) Add(p *Packet) (*Message, error) {
	op := p.Opcode
	if !op.Valid() {
		return nil, fmt.Errorf("%w: opcode %#x", ErrMalformed, uint8(op))
	}
	kind, pos := opInfo[op].kind, opInfo[op].pos
	if pos == posFirst || pos == posOnly {
		if r.cur != nil {
			r.cur = nil
			return nil, fmt.Errorf("%w: %v while a %d message is in progress", ErrMalformed, op, r.curKind)
		}
		if uint64(len(p.Payload)) > uint64(r.lim.MaxMessage) {
			return nil, fmt.Errorf("%w: %v of %d bytes > %d", ErrMalformed, op, len(p.Payload), r.lim.MaxMessage)
		}
		m := &Message{Kind: kind, PSN: p.PSN, DestQP: p.DestQP, VA: p.VA, RKey: p.RKey, DMALen: p.DMALen,
			Syndrome: p.Syndrome, MSN: p.MSN, Swap: p.Swap, Compare: p.Compare, Orig: p.Orig}
		switch {
		case kind == KindReadRequest && p.DMALen > r.lim.MaxMessage:
			return nil, fmt.Errorf("%w: READ of %d bytes > %d", ErrMalformed, p.DMALen, r.lim.MaxMessage)
		case op.flags()&hasRETH != 0 && kind == KindWrite && pos == posFirst:
			if uint64(p.DMALen) > uint64(r.lim.MaxMessage) {
				return nil, fmt.Errorf("%w: WRITE of %d bytes > %d", ErrMalformed, p.DMALen, r.lim.MaxMessage)
			}
			if p.DMALen <= uint32(len(p.Payload)) {
				return nil, fmt.Errorf("%w: WRITE FIRST of %d bytes for a %d-byte message", ErrMalformed, len(p.Payload), p.DMALen)
			}
			// Bounded by MaxMessage, checked above, and capped at the length (a pooled
			// buffer may be larger: only power-of-two lengths go back to the pool).
			m.Payload = bufpool.Get(int(p.DMALen))[:0:p.DMALen]
		case kind == KindWrite && pos == posOnly && p.DMALen != uint32(len(p.Payload)):
			return nil, fmt.Errorf("%w: WRITE ONLY of %d bytes, RETH says %d", ErrMalformed, len(p.Payload), p.DMALen)
		}
		if pos == posOnly {
			m.Payload = append(m.Payload, p.Payload...)
			m.HasImm, m.Imm, m.AckReq = op.flags()&hasImm != 0, p.Imm, p.AckReq
			return m, nil
		}
		m.Payload = appendBounded(m.Payload, p.Payload, int(r.lim.MaxMessage))
		r.cur, r.curKind = m, kind
		return nil, nil
	}
	m := r.cur
	if m == nil || kind != r.curKind {
		r.cur = nil
		return nil, fmt.Errorf("%w: %v without its FIRST", ErrMalformed, op)
	}
	if uint64(len(m.Payload))+uint64(len(p.Payload)) > uint64(r.lim.MaxMessage) ||
		(kind == KindWrite && len(m.Payload)+len(p.Payload) > cap(m.Payload)) {
		r.cur = nil
		return nil, fmt.Errorf("%w: %v beyond the message's length", ErrMalformed, op)
	}
	m.Payload = appendBounded(m.Payload, p.Payload, int(r.lim.MaxMessage))
	if pos == posMiddle {
		return nil, nil
	}
	r.cur = nil
	if kind == KindWrite && len(m.Payload) != int(m.DMALen) {
		return nil, fmt.Errorf("%w: WRITE of %d bytes, RETH says %d", ErrMalformed, len(m.Payload), m.DMALen)
	}
	m.HasImm, m.Imm, m.AckReq = op.flags()&hasImm != 0, p.Imm, p.AckReq
	if op.flags()&hasAETH != 0 {
		m.Syndrome, m.MSN = p.Syndrome, p.MSN
	}
	return m, nil
}

// appendBounded appends src to dst, growing its capacity at most to limit (append
// alone may allocate up to twice what it needs). The caller checked that the result
// fits.
func appendBounded(dst, src []byte, limit int) []byte {
	if len(dst)+len(src) > cap(dst) {
		grown := make([]byte, len(dst), min(max(2*cap(dst), len(dst)+len(src)), limit))
		copy(grown, dst)
		dst = grown
	}
	return append(dst, src...)
}
