// Package transport carries RC packets between emulated NICs. A Conn is one RC
// connection's wire; Loopback connects two QPs in one process, and a TCP transport will
// implement the same interface.
package transport

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// Op is a frame's operation.
type Op uint8

const (
	OpWrite     Op = iota + 1 // request: RDMA WRITE with payload
	OpRead                    // request: RDMA READ of Len bytes
	OpSend                    // request: SEND with payload
	OpWriteImm                // request: RDMA WRITE with immediate (consumes a receive)
	OpSendImm                 // request: SEND with immediate
	OpCmpSwap                 // request: atomic compare-and-swap of the 8 bytes at RAddr
	OpFetchAdd                // request: atomic fetch-and-add of the 8 bytes at RAddr
	OpAck                     // response: WRITE or SEND executed
	OpReadResp                // response: READ data
	OpNak                     // response: request refused, Syndrome says why
	OpAtomicAck               // response: an atomic executed; Swap holds the original value
	opLast      = OpAtomicAck
)

// String names the operation.
func (o Op) String() string {
	names := [...]string{"INVALID", "WRITE", "READ", "SEND", "WRITE_IMM", "SEND_IMM", "CMP_SWAP", "FETCH_ADD",
		"ACK", "READ_RESP", "NAK", "ATOMIC_ACK"}
	if o > opLast {
		return fmt.Sprintf("Op(%d)", uint8(o))
	}
	return names[o]
}

// IsRequest reports whether o is sent by a requester.
func (o Op) IsRequest() bool { return o >= OpWrite && o <= OpFetchAdd }

// HasImm reports whether o carries immediate data (IB's ImmDt header).
func (o Op) HasImm() bool { return o == OpWriteImm || o == OpSendImm }

// IsAtomic reports whether o is an atomic request (IB's AtomicETH header).
func (o Op) IsAtomic() bool { return o == OpCmpSwap || o == OpFetchAdd }

// hasPayload reports whether o may carry a payload.
func (o Op) hasPayload() bool {
	return o == OpWrite || o == OpSend || o == OpWriteImm || o == OpSendImm || o == OpReadResp
}

// Syndrome is a NAK's reason, after the IB AETH NAK codes.
type Syndrome uint8

// The syndromes; SynNone is no NAK.
const (
	SynNone         Syndrome = iota
	SynInvalidReq            // NAK invalid request: requester gets REM_INV_REQ_ERR
	SynRemoteAccess          // NAK remote access error: REM_ACCESS_ERR
	SynRemoteOp              // NAK remote operational error: REM_OP_ERR
	SynNoResponse            // responder QP in error: the requester's retries run out
	SynRNR                   // receiver not ready: retry after Timer (an RNR NAK)
	synLast         = SynRNR
)

// Frame is one packet. A request and its response carry the same PSN.
type Frame struct {
	Op       Op
	Syndrome Syndrome
	PSN      uint32
	RKey     uint32
	RAddr    uint64
	Len      uint32 // READ request: bytes asked for; atomics: 8; otherwise len(Payload)
	Payload  []byte
	// Imm is the immediate data of WRITE_IMM and SEND_IMM.
	Imm uint32
	// Swap is an atomic's swap value (compare-and-swap) or addend (fetch-and-add),
	// or, in an ATOMIC_ACK, the original value at the address.
	Swap uint64
	// Compare is a compare-and-swap's compare value.
	Compare uint64
	// Timer is an RNR NAK's minimal RNR timer, in the IBTA encoding (MinRNRTimer).
	Timer uint8

	// Reason says why a NAK was sent, for the requester's completion detail. It
	// travels between emulated NICs in one process; the wire format carries only
	// the syndrome, as a real AETH does.
	Reason string

	// Release, when set, is called exactly once when Payload is no longer needed:
	// by the receiver after consuming the frame, or by the transport if it cannot
	// deliver it. Loopback payloads alias the sender's memory until then.
	Release func()
}

// Done calls f.Release if set, at most once.
func (f *Frame) Done() {
	if r := f.Release; r != nil {
		f.Release = nil
		r()
	}
}

// Wire format: a fixed header followed by the payload.
//
//	0  u8  op
//	1  u8  syndrome
//	2  u16 reserved (0)
//	4  u32 psn
//	8  u32 rkey
//	12 u32 len
//	16 u64 raddr
//	24 u32 payload length
//	28 u32 immediate data (WRITE_IMM, SEND_IMM; else 0)
//	32 u64 swap, addend or original value (atomics; else 0)
//	40 u64 compare value (CMP_SWAP; else 0)
//	2  u8  RNR timer (NAK with SynRNR; else 0), in the reserved u16's first byte
const HeaderSize = 48

// MaxPayload bounds one frame's payload on the wire (an RC message may be up to 2 GiB;
// the wire splits nothing, so this is also the largest message a TCP link carries).
const MaxPayload = 1 << 30

// ErrMalformed is wrapped by every decoding error.
var ErrMalformed = errors.New("transport: malformed frame")

// AppendHeader appends f's wire header to b.
func AppendHeader(b []byte, f *Frame) []byte {
	var h [HeaderSize]byte
	h[0], h[1], h[2] = byte(f.Op), byte(f.Syndrome), f.Timer
	le := binary.LittleEndian
	le.PutUint32(h[4:], f.PSN)
	le.PutUint32(h[8:], f.RKey)
	le.PutUint32(h[12:], f.Len)
	le.PutUint64(h[16:], f.RAddr)
	le.PutUint32(h[24:], uint32(len(f.Payload)))
	le.PutUint32(h[28:], f.Imm)
	le.PutUint64(h[32:], f.Swap)
	le.PutUint64(h[40:], f.Compare)
	return append(b, h[:]...)
}

// DecodeHeader decodes a header and returns the frame (without payload) and the payload
// length that follows. It validates everything the header alone can tell.
func DecodeHeader(h []byte) (Frame, int, error) {
	if len(h) < HeaderSize {
		return Frame{}, 0, fmt.Errorf("%w: %d-byte header", ErrMalformed, len(h))
	}
	le := binary.LittleEndian
	f := Frame{Op: Op(h[0]), Syndrome: Syndrome(h[1]), PSN: le.Uint32(h[4:]), RKey: le.Uint32(h[8:]),
		Len: le.Uint32(h[12:]), RAddr: le.Uint64(h[16:]), Timer: h[2], Imm: le.Uint32(h[28:]), Swap: le.Uint64(h[32:]),
		Compare: le.Uint64(h[40:])}
	plen := le.Uint32(h[24:])
	switch {
	case f.Op == 0 || f.Op > opLast:
		return f, 0, fmt.Errorf("%w: op %d", ErrMalformed, h[0])
	case f.Syndrome > synLast:
		return f, 0, fmt.Errorf("%w: syndrome %d", ErrMalformed, h[1])
	case h[3] != 0:
		return f, 0, fmt.Errorf("%w: reserved bits set", ErrMalformed)
	case f.Timer != 0 && f.Syndrome != SynRNR:
		return f, 0, fmt.Errorf("%w: RNR timer on %v", ErrMalformed, f.Op)
	case f.Timer > 31:
		return f, 0, fmt.Errorf("%w: RNR timer %d", ErrMalformed, f.Timer)
	case f.Imm != 0 && !f.Op.HasImm():
		return f, 0, fmt.Errorf("%w: immediate on %v", ErrMalformed, f.Op)
	case f.Swap != 0 && !f.Op.IsAtomic() && f.Op != OpAtomicAck, f.Compare != 0 && f.Op != OpCmpSwap:
		return f, 0, fmt.Errorf("%w: atomic fields on %v", ErrMalformed, f.Op)
	case f.Op.IsAtomic() && f.Len != 8:
		return f, 0, fmt.Errorf("%w: %v of %d bytes", ErrMalformed, f.Op, f.Len)
	case plen > MaxPayload:
		return f, 0, fmt.Errorf("%w: payload %d > %d", ErrMalformed, plen, MaxPayload)
	case !f.Op.hasPayload() && plen != 0:
		return f, 0, fmt.Errorf("%w: %v with %d-byte payload", ErrMalformed, f.Op, plen)
	case f.Op.hasPayload() && f.Len != plen:
		return f, 0, fmt.Errorf("%w: %v len %d, payload %d", ErrMalformed, f.Op, f.Len, plen)
	case f.Op != OpNak && f.Syndrome != SynNone:
		return f, 0, fmt.Errorf("%w: syndrome on %v", ErrMalformed, f.Op)
	case f.Op == OpNak && f.Syndrome == SynNone:
		return f, 0, fmt.Errorf("%w: NAK without syndrome", ErrMalformed)
	}
	return f, int(plen), nil
}
