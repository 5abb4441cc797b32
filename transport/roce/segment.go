package roce

import "fmt"

// Ref is a DMA a segment's payload is read under: the requester's (or, for a READ
// response, the responder's) registered memory, read by reference. Whoever takes
// the segment off the wire releases it once the payload has been copied, or dropped.
type Ref interface {
	Release()
}

// Segment is what the engine moves: one packet, or, in one process, a run of
// consecutive packets of one message that travel together, as GSO and GRO batch
// them. Every packet keeps its PSN: a run of Count packets takes PSNs PSN ...
// PSN+Count-1, each but the last carries exactly one path MTU of payload, and the
// last has opcode Last. A NAK, a loss or a duplicate splits a run (Split).
//
// The embedded Packet is the run's headers: the first packet's opcode and the
// headers it carries (RETH for a WRITE FIRST or ONLY, AETH for a READ response
// FIRST or ONLY), and the last packet's AckReq, immediate data and, for a READ
// response LAST, AETH (which equals the first's). Payload holds every packet's
// payload, in order. The packets in between are MIDDLE packets of the message's
// kind with no header beyond the BTH.
type Segment struct {
	Packet
	Count int    // packets in the run, at least 1
	Last  Opcode // the last packet's opcode (Opcode when Count is 1)
	// Resent is how many of the run's packets, its first ones, its requester had
	// sent before (Requester.Sent sets it): what Requester.Unsent uncounts when the
	// run never went on the wire.
	Resent uint16
	// Ref, when set, is the DMA Payload is read under, in memory that is not the
	// segment's own; nil when Payload is a buffer of the segment's (a datagram
	// received, a copy) or empty.
	Ref Ref
	// due is when the run arrived, received from an in-process link with a rate
	// (monotonic nanoseconds; 0: not received from one). Port.NAKed and GiveBack
	// read it.
	due int64
}

// One returns the single-packet segment of p.
func One(p Packet) Segment { return Segment{Packet: p, Count: 1, Last: p.Opcode} }

// middle is the MIDDLE opcode of each multi-packet kind (zero for the others).
var middle = [lastKind + 1]Opcode{KindSend: SendMiddle, KindWrite: WriteMiddle, KindReadResponse: ReadRespMiddle}

// Op returns the opcode of packet i of the run (0 <= i < Count).
func (s *Segment) Op(i int) Opcode {
	switch {
	case i == 0:
		return s.Opcode
	case i == s.Count-1:
		return s.Last
	}
	return middle[opInfo[s.Opcode].kind] | s.Opcode&ucBits // a UC run's are UC's
}

// LastPSN returns the PSN of the run's last packet.
func (s *Segment) LastPSN() uint32 { return (s.PSN + uint32(s.Count) - 1) & psnMask }

// check verifies that the run is well formed for the path MTU: a known opcode
// sequence of one kind, and every packet but the last a full MTU. A decoded packet
// (Count 1) passes if Decode took it.
func (s *Segment) check(mtu int) error {
	if s.Count < 1 || !s.Opcode.Valid() || !s.Last.Valid() {
		return fmt.Errorf("%w: run of %d packets %v..%v", ErrMalformed, s.Count, s.Opcode, s.Last)
	}
	if s.Count == 1 {
		if s.Last != s.Opcode {
			return fmt.Errorf("%w: one packet, opcodes %v and %v", ErrMalformed, s.Opcode, s.Last)
		}
		return nil
	}
	first, last := opInfo[s.Opcode], opInfo[s.Last]
	switch {
	case first.kind != last.kind || middle[first.kind] == 0:
		return fmt.Errorf("%w: run %v..%v", ErrMalformed, s.Opcode, s.Last)
	case first.pos != posFirst && first.pos != posMiddle:
		return fmt.Errorf("%w: run starting with %v", ErrMalformed, s.Opcode)
	case last.pos != posMiddle && last.pos != posLast:
		return fmt.Errorf("%w: run ending with %v", ErrMalformed, s.Last)
	case len(s.Payload) <= (s.Count-1)*mtu || len(s.Payload) > s.Count*mtu ||
		(last.pos == posMiddle && len(s.Payload) != s.Count*mtu):
		return fmt.Errorf("%w: run of %d packets with %d payload bytes, path MTU %d", ErrMalformed, s.Count,
			len(s.Payload), mtu)
	}
	return nil
}

// Split returns the run's first k packets and the rest (0 < k < Count): the first
// keeps the headers of the run's first packet, the rest those of its last; both
// share the payload and the Ref (the caller releases it once, when both are done).
func (s *Segment) Split(k, mtu int) (head, tail Segment) {
	if k <= 0 || k >= s.Count {
		panic(fmt.Sprintf("roce: split of a %d-packet run at %d", s.Count, k))
	}
	head, tail = *s, *s
	head.Count, head.Last = k, s.Op(k-1)
	head.Payload = s.Payload[:k*mtu]
	head.AckReq, head.Solicited, head.Imm = false, false, 0
	if opInfo[head.Last].flags&hasAETH == 0 && opInfo[head.Opcode].flags&hasAETH == 0 {
		head.Syndrome, head.MSN = 0, 0
	}
	tail.PSN = (s.PSN + uint32(k)) & psnMask
	tail.Count, tail.Opcode = s.Count-k, s.Op(k)
	tail.Payload = s.Payload[k*mtu:]
	if opInfo[tail.Opcode].flags&hasRETH == 0 {
		tail.VA, tail.RKey, tail.DMALen = 0, 0, 0
	}
	if opInfo[tail.Opcode].flags&hasAETH == 0 && opInfo[tail.Last].flags&hasAETH == 0 {
		tail.Syndrome, tail.MSN = 0, 0
	}
	return head, tail
}

// Packets appends the run's packets, one per PSN, to ps: what a UDP link sends.
// Their payloads alias the run's.
func (s *Segment) Packets(ps []Packet, mtu int) []Packet {
	if s.Count == 1 {
		p := s.Packet
		p.Opcode = s.Last
		return append(ps, p)
	}
	for i := 0; i < s.Count; i++ {
		op := s.Op(i)
		p := Packet{Opcode: op, PKey: s.PKey, DestQP: s.DestQP, PSN: (s.PSN + uint32(i)) & psnMask,
			Payload: s.Payload[i*mtu : min((i+1)*mtu, len(s.Payload))]}
		f := op.flags()
		if i == 0 && f&hasRETH != 0 {
			p.VA, p.RKey, p.DMALen = s.VA, s.RKey, s.DMALen
		}
		if f&hasAETH != 0 {
			p.Syndrome, p.MSN = s.Syndrome, s.MSN
		}
		if i == s.Count-1 {
			p.AckReq, p.Solicited = s.AckReq, s.Solicited
			if f&(hasImm|hasIETH) != 0 {
				p.Imm = s.Imm
			}
		}
		ps = append(ps, p)
	}
	return ps
}
