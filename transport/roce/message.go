package roce

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
	// KindAtomicWrite is an RDMA ATOMIC WRITE (IBTA 1.5): 8 bytes stored at once at
	// an aligned address, acknowledged as a WRITE is.
	KindAtomicWrite
	lastKind = KindAtomicWrite
)

// Acked reports whether an ACK completes a message of kind k (a SEND, a WRITE, an
// atomic write), rather than a response of its own (a READ, an atomic).
func (k Kind) Acked() bool { return k == KindSend || k == KindWrite || k == KindAtomicWrite }

// Message is a one-packet answer the responder sends: an ACK or NAK, or an atomic's
// acknowledgement. (Requests and READ responses travel as runs of packets the
// requester and the responder build from their memory: Requester.Next,
// ReadResponseRun.)
type Message struct {
	Kind     Kind
	PSN      uint32
	DestQP   uint32
	Syndrome Syndrome
	MSN      uint32
	Orig     uint64 // KindAtomicAck
}

// Segment returns m's packet as a segment.
func (m *Message) Segment() Segment {
	p := Packet{Opcode: Acknowledge, PKey: 0xffff, DestQP: m.DestQP, PSN: m.PSN, Syndrome: m.Syndrome, MSN: m.MSN}
	if m.Kind == KindAtomicAck {
		p.Opcode, p.Orig = AtomicAck, m.Orig
	}
	return One(p)
}

// Packets returns how many packets (and PSNs) a message of n payload bytes takes at
// the given MTU.
func Packets(n, mtu int) int { return max(1, (n+mtu-1)/mtu) }

// segmentOps are the opcodes of a multi-packet message kind: first, middle, last,
// only, last and only with immediate, and last and only with invalidate (where they
// exist); zero for the other kinds. An array, not a map: the requester looks it up
// for every run.
var segmentOps = [lastKind + 1][8]Opcode{
	KindSend:         {SendFirst, SendMiddle, SendLast, SendOnly, SendLastImm, SendOnlyImm, SendLastInv, SendOnlyInv},
	KindWrite:        {WriteFirst, WriteMiddle, WriteLast, WriteOnly, WriteLastImm, WriteOnlyImm},
	KindReadResponse: {ReadRespFirst, ReadRespMiddle, ReadRespLast, ReadRespOnly, ReadRespLast, ReadRespOnly},
	KindAtomicWrite:  {3: AtomicWrite},
}

// ReadResponseRun returns the headers of packets k ... k+count-1 of a READ
// response of total packets whose first packet has PSN first: the AETH (an ACK
// with msn) on the first and last packets of the response. The caller fills the
// payload.
func ReadResponseRun(first uint32, k, count, total int, msn uint32) Segment {
	op := func(i int) Opcode {
		switch {
		case total == 1:
			return ReadRespOnly
		case i == 0:
			return ReadRespFirst
		case i == total-1:
			return ReadRespLast
		}
		return ReadRespMiddle
	}
	p := Packet{Opcode: op(k), PKey: 0xffff, PSN: (first + uint32(k)) & psnMask}
	if k == 0 || k+count == total {
		p.Syndrome, p.MSN = SynACK, msn
	}
	return Segment{Packet: p, Count: count, Last: op(k + count - 1)}
}
