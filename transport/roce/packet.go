// Package roce is the RoCEv2 wire format: the InfiniBand transport headers that RC
// traffic carries over UDP (destination port 4791), as Soft-RoCE (rxe) and mlx5 put
// them on Ethernet, and the invariant CRC that ends every packet.
//
// A Packet is one RC packet: the base transport header (BTH), the extended headers
// its opcode implies (RETH, AETH, AtomicETH, AtomicAckETH, ImmDt, IETH), the payload and
// its pad. Append encodes it and computes the ICRC; Decode checks every field and
// length against the packet and against the configured Limits before it returns
// anything, and allocates nothing: the payload it returns aliases the datagram.
//
// The ICRC (IBTA annex A17) covers the IP and UDP headers with their variant fields
// (IPv4 TOS, TTL and checksum; IPv6 traffic class, flow label and hop limit; the UDP
// checksum) set to ones, the BTH with its reserved byte set to ones, then the other
// headers and the payload. A UDP socket neither shows nor lets one write the IP
// header, so the emulated NIC fixes what would otherwise vary: packets are sent
// from unconnected sockets with path MTU discovery on, for which Linux sets DF and
// an IP identification of zero (see OpenEndpoint).
//
// Above the packets: a Segment is a run of consecutive packets of one message,
// the unit the emulated NICs exchange (one packet over UDP, up to a DMA's worth in
// one process); the Requester and the Responder are RC's two state machines (IBTA
// chapter 9: PSNs, ACKs and NAKs, go-back-N, the ACK and RNR timers, duplicates),
// free of I/O so that tests drive them run by run; the QP that owns the memory
// (odp's engine) runs both. A Port carries a QP's runs to its peer: an Endpoint's
// UDP socket on port 4791, demultiplexed by destination QPN (Endpoint.Attach), or
// a Pipe in one process, where runs travel by reference under a LinkModel (line
// rate, delay, a bounded queue; wire.go); over UDP a QP may send runs of packets
// with segmentation offload (Link.SetGSO). ListenCM and DialCM exchange connection
// parameters over TCP as rdma_cm does (REQ, REP, RTU: AcceptReady, DialCMReady).
//
// # Lock order
//
//	Endpoint.mu        an endpoint's QPs, as they attach and detach
//	  endpoints.mu     the open endpoints and their references
//
// The others are leaves, taken with no other lock of this package held, and taking none:
// direction.mu (a closed pipe direction's runs dropped, a sender taking runs back, a
// receiver giving them back), udpPort.mu (a closed port's inbox dropped) and
// injector.mu (its generator and the packet it holds back). Under direction.mu and
// udpPort.mu the runs dropped or taken back are released: a Ref's Release may take
// its owner's locks, never one of this package. A pipe's runs pass between its two
// engines without a lock: each direction's ring has one producer and one consumer,
// and on a link with a rate each slot's state says who took the run (wire.go); once
// a NAK asks for runs back, its receiver takes each under direction.mu (divert).
package roce

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"net/netip"
)

// maxRCMessage is the largest RC message IBTA allows, 2^31 bytes.
const maxRCMessage = 1 << 31

// UDPPort is RoCEv2's UDP destination port.
const UDPPort = 4791

// Opcode is a BTH opcode: the RC transport's (the top three bits 000), the UC
// transport's SENDs and WRITEs (001) and the UD transport's SENDs (011) exist here.
type Opcode uint8

// The RC opcodes (IBTA 9.2, rxe_opcode.c).
const (
	SendFirst      Opcode = 0x00
	SendMiddle     Opcode = 0x01
	SendLast       Opcode = 0x02
	SendLastImm    Opcode = 0x03
	SendOnly       Opcode = 0x04
	SendOnlyImm    Opcode = 0x05
	WriteFirst     Opcode = 0x06
	WriteMiddle    Opcode = 0x07
	WriteLast      Opcode = 0x08
	WriteLastImm   Opcode = 0x09
	WriteOnly      Opcode = 0x0a
	WriteOnlyImm   Opcode = 0x0b
	ReadRequest    Opcode = 0x0c
	ReadRespFirst  Opcode = 0x0d
	ReadRespMiddle Opcode = 0x0e
	ReadRespLast   Opcode = 0x0f
	ReadRespOnly   Opcode = 0x10
	Acknowledge    Opcode = 0x11
	AtomicAck      Opcode = 0x12
	CompareSwap    Opcode = 0x13
	FetchAdd       Opcode = 0x14
	// SEND with invalidate: the last packet's IETH names an R_Key the responder
	// invalidates once the message is placed (a type 2 memory window's).
	SendLastInv Opcode = 0x16
	SendOnlyInv Opcode = 0x17
	// AtomicWrite is RDMA ATOMIC WRITE (IBTA 1.5, rxe's IB_OPCODE_RC_ATOMIC_WRITE):
	// a RETH and 8 bytes of payload, stored at once.
	AtomicWrite Opcode = 0x1d
)

// The UC opcodes (IBTA 9.2, rxe_opcode.c) are the RC SENDs' and WRITEs' with the
// transport bits 001: UC has no READs, atomics or acknowledgements.
const (
	ucBits         = 0x20
	UCSendFirst    = SendFirst | ucBits
	UCSendMiddle   = SendMiddle | ucBits
	UCSendLast     = SendLast | ucBits
	UCSendLastImm  = SendLastImm | ucBits
	UCSendOnly     = SendOnly | ucBits
	UCSendOnlyImm  = SendOnlyImm | ucBits
	UCWriteFirst   = WriteFirst | ucBits
	UCWriteMiddle  = WriteMiddle | ucBits
	UCWriteLast    = WriteLast | ucBits
	UCWriteLastImm = WriteLastImm | ucBits
	UCWriteOnly    = WriteOnly | ucBits
	UCWriteOnlyImm = WriteOnlyImm | ucBits
)

// The UD opcodes (IBTA 9.2, rxe_opcode.c): a UD message is one packet.
const (
	UDSendOnly    Opcode = 0x64
	UDSendOnlyImm Opcode = 0x65
	lastOpcode           = UDSendOnlyImm
)

// Header sizes in bytes.
const (
	BTHSize          = 12
	RETHSize         = 16
	AETHSize         = 4
	AtomicETHSize    = 28
	AtomicAckETHSize = 8
	ImmDtSize        = 4
	IETHSize         = 4
	DETHSize         = 8
	ICRCSize         = 4
)

// Which extended headers an opcode carries, and whether it carries payload.
const (
	hasRETH = 1 << iota
	hasAETH
	hasAtomicETH
	hasAtomicAckETH
	hasImm
	hasPayload
	hasDETH
	hasIETH
)

// position is a packet's place in its message.
type position int

const (
	posFirst position = iota + 1 // FIRST and MIDDLE carry exactly one path MTU
	posMiddle
	posLast
	posOnly
)

// opInfo describes every opcode: its name, headers, the message kind it belongs to
// and its place in that message.
var opInfo = [lastOpcode + 1]struct {
	name  string
	flags int
	kind  Kind
	pos   position
}{
	SendFirst:      {"SEND_FIRST", hasPayload, KindSend, posFirst},
	SendMiddle:     {"SEND_MIDDLE", hasPayload, KindSend, posMiddle},
	SendLast:       {"SEND_LAST", hasPayload, KindSend, posLast},
	SendLastImm:    {"SEND_LAST_WITH_IMMEDIATE", hasPayload | hasImm, KindSend, posLast},
	SendOnly:       {"SEND_ONLY", hasPayload, KindSend, posOnly},
	SendOnlyImm:    {"SEND_ONLY_WITH_IMMEDIATE", hasPayload | hasImm, KindSend, posOnly},
	WriteFirst:     {"RDMA_WRITE_FIRST", hasRETH | hasPayload, KindWrite, posFirst},
	WriteMiddle:    {"RDMA_WRITE_MIDDLE", hasPayload, KindWrite, posMiddle},
	WriteLast:      {"RDMA_WRITE_LAST", hasPayload, KindWrite, posLast},
	WriteLastImm:   {"RDMA_WRITE_LAST_WITH_IMMEDIATE", hasPayload | hasImm, KindWrite, posLast},
	WriteOnly:      {"RDMA_WRITE_ONLY", hasRETH | hasPayload, KindWrite, posOnly},
	WriteOnlyImm:   {"RDMA_WRITE_ONLY_WITH_IMMEDIATE", hasRETH | hasImm | hasPayload, KindWrite, posOnly},
	ReadRequest:    {"RDMA_READ_REQUEST", hasRETH, KindReadRequest, posOnly},
	ReadRespFirst:  {"RDMA_READ_RESPONSE_FIRST", hasAETH | hasPayload, KindReadResponse, posFirst},
	ReadRespMiddle: {"RDMA_READ_RESPONSE_MIDDLE", hasPayload, KindReadResponse, posMiddle},
	ReadRespLast:   {"RDMA_READ_RESPONSE_LAST", hasAETH | hasPayload, KindReadResponse, posLast},
	ReadRespOnly:   {"RDMA_READ_RESPONSE_ONLY", hasAETH | hasPayload, KindReadResponse, posOnly},
	Acknowledge:    {"ACKNOWLEDGE", hasAETH, KindAck, posOnly},
	AtomicAck:      {"ATOMIC_ACKNOWLEDGE", hasAETH | hasAtomicAckETH, KindAtomicAck, posOnly},
	CompareSwap:    {"COMPARE_SWAP", hasAtomicETH, KindCompareSwap, posOnly},
	FetchAdd:       {"FETCH_ADD", hasAtomicETH, KindFetchAdd, posOnly},
	SendLastInv:    {"SEND_LAST_WITH_INVALIDATE", hasPayload | hasIETH, KindSend, posLast},
	SendOnlyInv:    {"SEND_ONLY_WITH_INVALIDATE", hasPayload | hasIETH, KindSend, posOnly},
	AtomicWrite:    {"RDMA_ATOMIC_WRITE", hasRETH | hasPayload, KindAtomicWrite, posOnly},
	UDSendOnly:     {"UD_SEND_ONLY", hasDETH | hasPayload, KindSend, posOnly},
	UDSendOnlyImm:  {"UD_SEND_ONLY_WITH_IMMEDIATE", hasDETH | hasImm | hasPayload, KindSend, posOnly},
}

// The UC opcodes take the RC SENDs' and WRITEs' headers, kinds and places.
func init() {
	for op := SendFirst; op <= WriteOnlyImm; op++ {
		i := opInfo[op]
		i.name = "UC_" + i.name
		opInfo[op|ucBits] = i
	}
	for o := range headerSizes {
		headerSizes[o] = uint8(Opcode(o).headerSize())
	}
}

func (o Opcode) flags() int { return opInfo[o].flags }

// Valid reports whether o is an opcode this package knows, RC, UC or UD.
func (o Opcode) Valid() bool { return o <= lastOpcode && opInfo[o].name != "" }

// UD reports whether o is a UD opcode.
func (o Opcode) UD() bool { return o.Valid() && o>>5 == 3 }

// UC reports whether o is a UC opcode.
func (o Opcode) UC() bool { return o.Valid() && o>>5 == 1 }

// String returns the opcode's IBTA name.
func (o Opcode) String() string {
	if !o.Valid() {
		return fmt.Sprintf("Opcode(%#x)", uint8(o))
	}
	return opInfo[o].name
}

// IsRequest reports whether a requester sends o.
func (o Opcode) IsRequest() bool {
	return o.Valid() && (o <= ReadRequest || o == CompareSwap || o == FetchAdd || o == SendLastInv || o == SendOnlyInv ||
		o == AtomicWrite || o.UD() || o.UC())
}

// HasPayload reports whether o carries data.
func (o Opcode) HasPayload() bool { return o.Valid() && o.flags()&hasPayload != 0 }

// HeaderSize is the size of o's headers, BTH included, ICRC not.
func (o Opcode) HeaderSize() int { return int(headerSizes[o]) }

// headerSizes holds each known opcode's HeaderSize, filled by init: a link
// computes the wire size of every run it sends, and HeaderSize is on that path.
var headerSizes [lastOpcode + 1]uint8

func (o Opcode) headerSize() int {
	f := o.flags()
	n := BTHSize
	for _, h := range []struct {
		bit, size int
	}{{hasRETH, RETHSize}, {hasAETH, AETHSize}, {hasAtomicETH, AtomicETHSize}, {hasAtomicAckETH, AtomicAckETHSize},
		{hasImm, ImmDtSize}, {hasDETH, DETHSize}, {hasIETH, IETHSize}} {
		if f&h.bit != 0 {
			n += h.size
		}
	}
	return n
}

// Syndrome is an AETH syndrome: its top three bits say ACK, RNR NAK or NAK.
type Syndrome uint8

// The syndromes the emulated NIC sends (IBTA 9.7.5.2.8). An ACK carries the
// credit count (0x1f: none advertised), an RNR NAK the RNR timer, a NAK its code.
const (
	SynACK                Syndrome = 0x1f // ACK, no credits advertised
	SynRNRBase            Syndrome = 0x20 // | timer: RNR NAK
	SynNAKPSNSeqError     Syndrome = 0x60
	SynNAKInvalidRequest  Syndrome = 0x61
	SynNAKRemoteAccess    Syndrome = 0x62
	SynNAKRemoteOperation Syndrome = 0x63
)

// Kind returns 0 for an ACK, 1 for an RNR NAK, 3 for a NAK (2 is reserved).
func (s Syndrome) Kind() int { return int(s >> 5) }

// Timer returns an RNR NAK's timer, a NAK's code or an ACK's credit count.
func (s Syndrome) Timer() uint8 { return uint8(s & 0x1f) }

// RNR returns the RNR NAK syndrome with the given timer (IBTA encoding).
func RNR(timer uint8) Syndrome { return SynRNRBase | Syndrome(timer&0x1f) }

// Packet is one RC packet, decoded. Fields of headers the opcode does not carry are
// zero.
type Packet struct {
	Opcode    Opcode
	Solicited bool
	MigReq    bool
	PKey      uint16
	DestQP    uint32 // 24 bits
	AckReq    bool
	PSN       uint32 // 24 bits

	// RETH: WRITE FIRST/ONLY and READ REQUEST.
	VA     uint64
	RKey   uint32
	DMALen uint32

	// AETH: acknowledgements and READ responses (first, last, only).
	Syndrome Syndrome
	MSN      uint32 // 24 bits

	// AtomicETH (VA and RKey above): the swap value or addend, and the compare value.
	Swap, Compare uint64
	// AtomicAckETH: the value found at the address.
	Orig uint64

	// ImmDt: the immediate data of *_WITH_IMMEDIATE; or IETH: the R_Key that
	// SEND_*_WITH_INVALIDATE invalidates. No opcode carries both; the two headers
	// have the same size and place.
	Imm uint32

	// DETH: a UD SEND's queue key and the sending QP's number (24 bits).
	QKey  uint32
	SrcQP uint32

	// Payload is the data, without pad. Decode returns a slice of its input.
	Payload []byte
}

// Limits bound what Decode accepts: nothing a peer sends is trusted beyond them.
type Limits struct {
	// MTU is the path MTU: the payload of a FIRST or MIDDLE packet is exactly this,
	// of any other at most this (256, 512, 1024, 2048 or 4096).
	MTU int
	// MaxMessage is the largest message a QP takes: the reassembler refuses
	// longer ones (a NAK), Decode only RETH lengths beyond 2^31.
	MaxMessage uint32
	// UD: the QP is a UD QP, which takes UD packets only; UC: a UC QP, which
	// takes UC packets only; an RC QP takes RC packets only.
	UD, UC bool
}

// ValidMTU reports whether n is one of IB's path MTUs.
func ValidMTU(n int) bool { return n == 256 || n == 512 || n == 1024 || n == 2048 || n == 4096 }

// Errors Decode wraps, usable with errors.Is.
var (
	ErrMalformed = errors.New("roce: malformed packet")
	ErrICRC      = errors.New("roce: ICRC mismatch")
)

// Endpoints are a packet's UDP source and destination, which its ICRC covers. The
// IPv4 header the ICRC assumes has no options, DF set and an identification of zero,
// which Linux sends for an unconnected UDP socket with IP_PMTUDISC_DO.
type Endpoints struct {
	Src, Dst netip.AddrPort
}

// ipv4 reports whether both ends are IPv4 (IPv4-mapped IPv6 counts as IPv4).
func (e Endpoints) ipv4() bool { return e.Src.Addr().Unmap().Is4() && e.Dst.Addr().Unmap().Is4() }

// Size returns the size of p encoded: headers, payload, pad and ICRC.
func (p *Packet) Size() int {
	return p.Opcode.HeaderSize() + len(p.Payload) + pad(len(p.Payload)) + ICRCSize
}

func pad(n int) int { return (4 - n%4) % 4 }

// Append appends p, encoded with its ICRC for the given endpoints, to b. It fails
// for an opcode this package does not know or fields wider than their headers'.
func (p *Packet) Append(b []byte, ep Endpoints) ([]byte, error) {
	start := len(b)
	b, err := p.appendHeaders(b)
	if err != nil {
		return b, err
	}
	b = append(b, p.Payload...)
	b = append(b, make([]byte, pad(len(p.Payload)))...)
	crc := ICRC(ep, b[start:])
	return binary.LittleEndian.AppendUint32(b, crc), nil
}

// AppendSplit encodes p for ep as two pieces around its payload, appended to b: the
// headers, and the trailer (pad bytes and ICRC). headers + p.Payload + trailer is the
// packet Append makes, for a vectored send that does not copy the payload.
func (p *Packet) AppendSplit(b []byte, ep Endpoints) (buf, headers, trailer []byte, err error) {
	start := len(b)
	if b, err = p.appendHeaders(b); err != nil {
		return b, nil, nil, err
	}
	mid := len(b)
	b = append(b, make([]byte, pad(len(p.Payload)))...)
	n := mid - start + len(p.Payload) + (len(b) - mid)
	crc := icrc(ep, n, b[start:mid], p.Payload, b[mid:])
	b = binary.LittleEndian.AppendUint32(b, crc)
	return b, b[start:mid], b[mid:], nil
}

// appendHeaders appends p's BTH and extension headers to b.
func (p *Packet) appendHeaders(b []byte) ([]byte, error) {
	switch {
	case !p.Opcode.Valid():
		return b, fmt.Errorf("%w: opcode %#x", ErrMalformed, uint8(p.Opcode))
	case p.DestQP >= 1<<24 || p.PSN >= 1<<24 || p.MSN >= 1<<24 || p.SrcQP >= 1<<24:
		return b, fmt.Errorf("%w: QPN, PSN or MSN wider than 24 bits", ErrMalformed)
	case len(p.Payload) > 0 && !p.Opcode.HasPayload():
		return b, fmt.Errorf("%w: %v carries no payload", ErrMalformed, p.Opcode)
	}
	f := p.Opcode.flags()
	be := binary.BigEndian
	var h [BTHSize]byte
	h[0] = byte(p.Opcode)
	h[1] = byte(pad(len(p.Payload))) << 4 // TVer 0
	if p.Solicited {
		h[1] |= 0x80
	}
	if p.MigReq {
		h[1] |= 0x40
	}
	be.PutUint16(h[2:], p.PKey)
	be.PutUint32(h[4:], p.DestQP) // byte 4, reserved, is zero
	be.PutUint32(h[8:], p.PSN)
	if p.AckReq {
		h[8] |= 0x80
	}
	b = append(b, h[:]...)
	if f&hasDETH != 0 { // BTH, DETH, ImmDt (IBTA 9.2)
		b = be.AppendUint32(b, p.QKey)
		b = be.AppendUint32(b, p.SrcQP) // its top byte, reserved, is zero
	}
	if f&hasRETH != 0 {
		b = be.AppendUint64(b, p.VA)
		b = be.AppendUint32(b, p.RKey)
		b = be.AppendUint32(b, p.DMALen)
	}
	if f&hasAETH != 0 {
		b = be.AppendUint32(b, uint32(p.Syndrome)<<24|p.MSN)
	}
	if f&hasAtomicETH != 0 {
		b = be.AppendUint64(b, p.VA)
		b = be.AppendUint32(b, p.RKey)
		b = be.AppendUint64(b, p.Swap)
		b = be.AppendUint64(b, p.Compare)
	}
	if f&hasAtomicAckETH != 0 {
		b = be.AppendUint64(b, p.Orig)
	}
	if f&(hasImm|hasIETH) != 0 {
		b = be.AppendUint32(b, p.Imm)
	}
	return b, nil
}

// Decode decodes one UDP payload received from ep.Src at ep.Dst, checking every
// length, field and the ICRC before it returns. The packet's Payload aliases b.
func Decode(b []byte, ep Endpoints, lim Limits) (Packet, error) {
	var p Packet
	if len(b) < BTHSize+ICRCSize {
		return p, fmt.Errorf("%w: %d bytes", ErrMalformed, len(b))
	}
	be := binary.BigEndian
	p.Opcode = Opcode(b[0])
	switch {
	case !p.Opcode.Valid():
		return p, fmt.Errorf("%w: opcode %#x (neither RC nor UD, or unknown)", ErrMalformed, b[0])
	case p.Opcode.UD() != lim.UD || p.Opcode.UC() != lim.UC:
		return p, fmt.Errorf("%w: %v to a QP of another transport", ErrMalformed, p.Opcode)
	}
	if tver := b[1] & 0x0f; tver != 0 {
		return p, fmt.Errorf("%w: transport version %d", ErrMalformed, tver)
	}
	if b[4] != 0 || b[8]&0x7f != 0 {
		return p, fmt.Errorf("%w: reserved BTH bits set", ErrMalformed)
	}
	padCnt := int(b[1]>>4) & 3
	p.Solicited, p.MigReq = b[1]&0x80 != 0, b[1]&0x40 != 0
	p.PKey = be.Uint16(b[2:])
	p.DestQP = be.Uint32(b[4:]) & (1<<24 - 1)
	p.AckReq = b[8]&0x80 != 0
	p.PSN = be.Uint32(b[8:]) & (1<<24 - 1)
	hdr := p.Opcode.HeaderSize()
	if len(b) < hdr+ICRCSize {
		return p, fmt.Errorf("%w: %v needs %d header bytes, has %d", ErrMalformed, p.Opcode, hdr, len(b)-ICRCSize)
	}
	if got, want := binary.LittleEndian.Uint32(b[len(b)-ICRCSize:]), ICRC(ep, b[:len(b)-ICRCSize]); got != want {
		return p, fmt.Errorf("%w: %#08x, computed %#08x", ErrICRC, got, want)
	}
	f := p.Opcode.flags()
	at := BTHSize
	if f&hasDETH != 0 {
		if b[at+4] != 0 {
			return p, fmt.Errorf("%w: reserved DETH byte set", ErrMalformed)
		}
		p.QKey, p.SrcQP = be.Uint32(b[at:]), be.Uint32(b[at+4:])
		at += DETHSize
	}
	if f&hasRETH != 0 {
		p.VA, p.RKey, p.DMALen = be.Uint64(b[at:]), be.Uint32(b[at+8:]), be.Uint32(b[at+12:])
		at += RETHSize
		// The largest RC message is 2^31 bytes; the QP's own limit is a message's
		// property, refused with a NAK by the reassembler, not a malformed packet.
		if p.DMALen > maxRCMessage {
			return p, fmt.Errorf("%w: DMA length %d > %d", ErrMalformed, p.DMALen, maxRCMessage)
		}
	}
	if f&hasAETH != 0 {
		a := be.Uint32(b[at:])
		p.Syndrome, p.MSN = Syndrome(a>>24), a&(1<<24-1)
		at += AETHSize
		if p.Syndrome.Kind() == 2 {
			return p, fmt.Errorf("%w: reserved AETH syndrome %#x", ErrMalformed, uint8(p.Syndrome))
		}
	}
	if f&hasAtomicETH != 0 {
		p.VA, p.RKey = be.Uint64(b[at:]), be.Uint32(b[at+8:])
		p.Swap, p.Compare = be.Uint64(b[at+12:]), be.Uint64(b[at+20:])
		at += AtomicETHSize
	}
	if f&hasAtomicAckETH != 0 {
		p.Orig = be.Uint64(b[at:])
		at += AtomicAckETHSize
	}
	if f&(hasImm|hasIETH) != 0 {
		p.Imm = be.Uint32(b[at:])
		at += ImmDtSize
	}
	body := b[at : len(b)-ICRCSize]
	switch {
	case f&hasPayload == 0 && len(body) != 0:
		return p, fmt.Errorf("%w: %v with %d payload bytes", ErrMalformed, p.Opcode, len(body))
	case f&hasPayload == 0 && padCnt != 0:
		return p, fmt.Errorf("%w: pad count on %v", ErrMalformed, p.Opcode)
	case len(body)%4 != 0 || padCnt > len(body):
		return p, fmt.Errorf("%w: %d payload bytes with pad count %d", ErrMalformed, len(body), padCnt)
	}
	p.Payload = body[:len(body)-padCnt]
	if f&hasPayload != 0 {
		if pos := opInfo[p.Opcode].pos; (pos == posFirst || pos == posMiddle) && len(p.Payload) != lim.MTU {
			return p, fmt.Errorf("%w: %v of %d bytes, path MTU %d", ErrMalformed, p.Opcode, len(p.Payload), lim.MTU)
		}
		if len(p.Payload) > lim.MTU {
			return p, fmt.Errorf("%w: %v of %d bytes > path MTU %d", ErrMalformed, p.Opcode, len(p.Payload), lim.MTU)
		}
	}
	return p, nil
}

// icrcSeed is the CRC register after a seed of ones and the eight bytes of ones that
// stand for the masked LRH (rxe_icrc.c), in the form hash/crc32's Update takes.
const icrcSeed = ^uint32(0xdebb20e3)

// ICRC returns the invariant CRC of a packet sent from ep.Src to ep.Dst whose headers,
// payload and pad (everything but the ICRC) are pkt. It is stored little-endian.
func ICRC(ep Endpoints, pkt []byte) uint32 {
	if len(pkt) < BTHSize {
		return 0 // not a packet: Decode refuses it before it asks
	}
	return icrc(ep, len(pkt), pkt)
}

// icrc is the ICRC of an n-byte packet (without the ICRC) given as pieces; the
// first holds at least the BTH.
func icrc(ep Endpoints, n int, first []byte, rest ...[]byte) uint32 {
	var ph [40 + 8]byte // the IPv6 header is the larger
	be := binary.BigEndian
	udpLen := 8 + n + ICRCSize
	var at int
	if ep.ipv4() {
		ph[0] = 0x45
		ph[1] = 0xff // TOS, masked
		be.PutUint16(ph[2:], uint16(20+udpLen))
		be.PutUint16(ph[6:], 0x4000) // DF, identification 0 (ph[4:6])
		ph[8] = 0xff                 // TTL, masked
		ph[9] = 17                   // UDP
		be.PutUint16(ph[10:], 0xffff)
		s, d := ep.Src.Addr().Unmap().As4(), ep.Dst.Addr().Unmap().As4()
		copy(ph[12:], s[:])
		copy(ph[16:], d[:])
		at = 20
	} else {
		be.PutUint32(ph[0:], 0x6fffffff) // version 6; traffic class and flow label masked
		be.PutUint16(ph[4:], uint16(udpLen))
		ph[6] = 17   // next header: UDP
		ph[7] = 0xff // hop limit, masked
		s, d := ep.Src.Addr().As16(), ep.Dst.Addr().As16()
		copy(ph[8:], s[:])
		copy(ph[24:], d[:])
		at = 40
	}
	be.PutUint16(ph[at:], ep.Src.Port())
	be.PutUint16(ph[at+2:], ep.Dst.Port())
	be.PutUint16(ph[at+4:], uint16(udpLen))
	be.PutUint16(ph[at+6:], 0xffff) // UDP checksum, masked
	crc := crc32.Update(icrcSeed, crc32.IEEETable, ph[:at+8])
	var bth [BTHSize]byte
	copy(bth[:], first) // the callers guarantee BTHSize bytes
	bth[4] = 0xff       // reserved, masked
	crc = crc32.Update(crc, crc32.IEEETable, bth[:])
	crc = crc32.Update(crc, crc32.IEEETable, first[BTHSize:])
	for _, r := range rest {
		crc = crc32.Update(crc, crc32.IEEETable, r)
	}
	return crc
}
