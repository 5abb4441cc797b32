package roce

import (
	"bytes"
	"encoding/binary"
	"errors"
	"hash/crc32"
	"net/netip"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

var (
	ep4 = Endpoints{Src: netip.MustParseAddrPort("10.0.0.1:49152"), Dst: netip.MustParseAddrPort("10.0.0.2:4791")}
	ep6 = Endpoints{Src: netip.MustParseAddrPort("[fd00::1]:49152"), Dst: netip.MustParseAddrPort("[fd00::2]:4791")}
	lim = Limits{MTU: 1024, MaxMessage: 1 << 31}
)

// samples has a packet of every opcode, with every field its headers carry set.
func samples() []Packet {
	mtu := bytes.Repeat([]byte{0xab}, lim.MTU)
	odd := []byte("seven b")
	var out []Packet
	for op := Opcode(0); op <= lastOpcode; op++ {
		if !op.Valid() {
			continue
		}
		p := Packet{Opcode: op, PKey: 0xffff, DestQP: 0x123456, PSN: 0xfedcba, AckReq: op.IsRequest(), Solicited: op == SendOnly}
		f := op.flags()
		if f&hasPayload != 0 {
			p.Payload = odd
			if pos := opInfo[op].pos; pos == posFirst || pos == posMiddle {
				p.Payload = mtu
			}
		}
		if f&(hasRETH|hasAtomicETH) != 0 {
			p.VA, p.RKey = 0x00007f0012345678, 0xabcdef01
		}
		if f&hasRETH != 0 {
			p.DMALen = 3 * 1024
		}
		if f&hasAETH != 0 {
			p.Syndrome, p.MSN = SynACK, 77
		}
		if f&hasAtomicETH != 0 {
			p.Swap, p.Compare = 1<<63|5, 42
		}
		if f&hasAtomicAckETH != 0 {
			p.Orig = 99
		}
		if f&hasImm != 0 {
			p.Imm = 0xdeadbeef
		}
		if f&hasIETH != 0 {
			p.Imm = 0x12345678 // the R_Key to invalidate
		}
		if f&hasDETH != 0 {
			p.QKey, p.SrcQP, p.AckReq = 0x80010203, 0xabcdef, false
		}
		out = append(out, p)
	}
	return out
}

func TestRoundTripEveryOpcode(t *testing.T) {
	for _, ep := range []Endpoints{ep4, ep6} {
		for _, p := range samples() {
			b, err := p.Append(nil, ep)
			require.NoError(t, err, p.Opcode.String())
			require.Len(t, b, p.Size())
			assert.Zero(t, len(b)%4, "%v: packets are whole words", p.Opcode)
			got, err := Decode(b, ep, limFor(p))
			require.NoError(t, err, p.Opcode.String())
			if len(p.Payload) == 0 {
				got.Payload = nil
			}
			assert.Equal(t, p, got, p.Opcode.String())
		}
	}
}

func TestHeaderLayout(t *testing.T) {
	p := Packet{Opcode: WriteOnlyImm, PKey: 0xffff, DestQP: 0x000011, PSN: 5, AckReq: true, VA: 0x1122334455667788,
		RKey: 0x99aabbcc, DMALen: 3, Imm: 0x01020304, Payload: []byte{7, 8, 9}}
	b, err := p.Append(nil, ep4)
	require.NoError(t, err)
	want := []byte{
		0x0b, 0x10, 0xff, 0xff, 0x00, 0x00, 0x00, 0x11, 0x80, 0x00, 0x00, 0x05, // BTH: pad 1
		0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88, 0x99, 0xaa, 0xbb, 0xcc, 0, 0, 0, 3, // RETH
		1, 2, 3, 4, // ImmDt
		7, 8, 9, 0, // payload and pad
	}
	assert.Equal(t, want, b[:len(b)-ICRCSize])
	assert.Equal(t, BTHSize+AETHSize, Acknowledge.HeaderSize())
	assert.Equal(t, BTHSize+AETHSize+AtomicAckETHSize, AtomicAck.HeaderSize())
	assert.Equal(t, BTHSize+AtomicETHSize, CompareSwap.HeaderSize())
	assert.Equal(t, BTHSize+IETHSize, SendOnlyInv.HeaderSize())
}

// A SEND with invalidate's IETH follows the BTH (IBTA 9.3.8), where a SEND with
// immediate has its ImmDt.
func TestIETHLayout(t *testing.T) {
	p := Packet{Opcode: SendOnlyInv, PKey: 0xffff, DestQP: 0x000011, PSN: 5, AckReq: true, Imm: 0x0a0b0c0d,
		Payload: []byte{7, 8, 9, 10}}
	b, err := p.Append(nil, ep4)
	require.NoError(t, err)
	want := []byte{
		0x17, 0x00, 0xff, 0xff, 0x00, 0x00, 0x00, 0x11, 0x80, 0x00, 0x00, 0x05, // BTH
		0x0a, 0x0b, 0x0c, 0x0d, // IETH: the R_Key
		7, 8, 9, 10,
	}
	assert.Equal(t, want, b[:len(b)-ICRCSize])
	assert.Equal(t, "SEND_LAST_WITH_INVALIDATE", SendLastInv.String())
	assert.True(t, SendLastInv.IsRequest())
}

// rcSamples is samples() of the RC opcodes: what an RC QP's link takes.
func rcSamples() []Packet {
	var out []Packet
	for _, p := range samples() {
		if !p.Opcode.UD() && !p.Opcode.UC() {
			out = append(out, p)
		}
	}
	return out
}

// limFor is lim for a QP of p's transport.
func limFor(p Packet) Limits {
	l := lim
	l.UD, l.UC = p.Opcode.UD(), p.Opcode.UC()
	return l
}

// A UD SEND's DETH follows the BTH and comes before the immediate data (IBTA 9.2).
func TestUDHeaderLayout(t *testing.T) {
	p := Packet{Opcode: UDSendOnlyImm, PKey: 0xffff, DestQP: 0x000011, PSN: 5, QKey: 0x11111111, SrcQP: 0x123456,
		Imm: 0x01020304, Payload: []byte{7, 8, 9}}
	b, err := p.Append(nil, ep4)
	require.NoError(t, err)
	want := []byte{
		0x65, 0x10, 0xff, 0xff, 0x00, 0x00, 0x00, 0x11, 0x00, 0x00, 0x00, 0x05, // BTH: pad 1
		0x11, 0x11, 0x11, 0x11, 0x00, 0x12, 0x34, 0x56, // DETH: Q_Key, reserved, source QP
		1, 2, 3, 4, // ImmDt
		7, 8, 9, 0, // payload and pad
	}
	assert.Equal(t, want, b[:len(b)-ICRCSize])
	assert.Equal(t, BTHSize+DETHSize, UDSendOnly.HeaderSize())
	assert.True(t, UDSendOnly.UD() && UDSendOnly.IsRequest() && !SendOnly.UD() && !Opcode(0x66).Valid())
	assert.Equal(t, "UD_SEND_ONLY_WITH_IMMEDIATE", UDSendOnlyImm.String())
}

// The ICRC's seed is rxe's: a CRC over eight bytes of ones (the masked LRH) from a
// register of ones. Every byte the ICRC covers changes it, but for the BTH's
// reserved byte, which it masks.
func TestICRC(t *testing.T) {
	pkt := []byte("0123456789abcdefghijklmnopqrstuvwxyz")
	var ph bytes.Buffer
	ph.Write(bytes.Repeat([]byte{0xff}, 8))
	direct := crc32.Update(0, crc32.IEEETable, ph.Bytes())
	assert.Equal(t, ^uint32(0xdebb20e3), direct, "a register of ones over eight bytes of ones")

	base := ICRC(ep4, pkt)
	for i := range pkt {
		m := append([]byte(nil), pkt...)
		m[i] ^= 1
		if i == 4 {
			assert.Equal(t, base, ICRC(ep4, m), "BTH byte 4 is masked")
			continue
		}
		assert.NotEqual(t, base, ICRC(ep4, m), "byte %d", i)
	}
	other := ep4
	other.Src = netip.MustParseAddrPort("10.0.0.1:49153")
	assert.NotEqual(t, base, ICRC(other, pkt), "the UDP header is covered")
	other = ep4
	other.Dst = netip.MustParseAddrPort("10.0.0.3:4791")
	assert.NotEqual(t, base, ICRC(other, pkt), "the IP header is covered")
	mapped := Endpoints{Src: netip.AddrPortFrom(netip.AddrFrom16(ep4.Src.Addr().As16()), ep4.Src.Port()),
		Dst: netip.AddrPortFrom(netip.AddrFrom16(ep4.Dst.Addr().As16()), ep4.Dst.Port())}
	assert.Equal(t, base, ICRC(mapped, pkt), "an IPv4-mapped address is IPv4 on the wire")
	assert.NotEqual(t, base, ICRC(ep6, pkt))
}

func TestDecodeRejects(t *testing.T) {
	good, err := (&Packet{Opcode: WriteOnly, VA: 4096, RKey: 1, DMALen: 8, Payload: make([]byte, 8)}).Append(nil, ep4)
	require.NoError(t, err)
	resign := func(b []byte) []byte { // a mutation with a valid ICRC, so that the field check is what fails
		b = append([]byte(nil), b...)
		binary.LittleEndian.PutUint32(b[len(b)-ICRCSize:], ICRC(ep4, b[:len(b)-ICRCSize]))
		return b
	}
	mut := func(off int, v byte) []byte {
		b := append([]byte(nil), good...)
		b[off] = v
		return resign(b)
	}
	enc := func(p Packet) []byte {
		b, err := p.Append(nil, ep4)
		require.NoError(t, err)
		return b
	}
	cases := map[string]struct {
		b    []byte
		want error
	}{
		"empty":                {nil, ErrMalformed},
		"shorter than BTH":     {good[:BTHSize], ErrMalformed},
		"opcode of UD":         {mut(0, 0x64), ErrMalformed},
		"opcode unknown":       {mut(0, 0x15), ErrMalformed},
		"opcode of UC":         {mut(0, 0x24), ErrMalformed},
		"transport version":    {mut(1, 0x01), ErrMalformed},
		"BTH reserved byte":    {mut(4, 0x30), ErrMalformed},
		"BTH reserved bits":    {mut(8, 0x01), ErrMalformed},
		"headers cut short":    {resign(good[:BTHSize+8+ICRCSize]), ErrMalformed},
		"ICRC":                 {append(append([]byte(nil), good[:len(good)-1]...), good[len(good)-1]^1), ErrICRC},
		"payload flipped":      {func() []byte { b := append([]byte(nil), good...); b[BTHSize+RETHSize] ^= 1; return b }(), ErrICRC},
		"DMA length too large": {enc(Packet{Opcode: ReadRequest, DMALen: 1<<31 + 1}), ErrMalformed},
		"payload on READ":      {resign(append(enc(Packet{Opcode: ReadRequest})[:BTHSize+RETHSize], 1, 2, 3, 4, 0, 0, 0, 0)), ErrMalformed},
		"pad count on ACK":     {func() []byte { b := enc(Packet{Opcode: Acknowledge, Syndrome: SynACK}); b[1] |= 0x30; return resign(b) }(), ErrMalformed},
		"pad beyond payload":   {func() []byte { b := enc(Packet{Opcode: SendOnly}); b[1] |= 0x30; return resign(b) }(), ErrMalformed},
		"unaligned payload":    {resign(append(append([]byte(nil), good[:len(good)-ICRCSize]...), 1, 0, 0, 0, 0)), ErrMalformed},
		"payload > MTU":        {enc(Packet{Opcode: SendOnly, Payload: make([]byte, lim.MTU+4)}), ErrMalformed},
		"FIRST shorter":        {enc(Packet{Opcode: SendFirst, Payload: make([]byte, lim.MTU-4)}), ErrMalformed},
		"MIDDLE longer":        {enc(Packet{Opcode: WriteMiddle, Payload: make([]byte, lim.MTU+4)}), ErrMalformed},
		"reserved syndrome":    {enc(Packet{Opcode: Acknowledge, Syndrome: 0x40}), ErrMalformed},
	}
	ud := Limits{MTU: lim.MTU, MaxMessage: lim.MaxMessage, UD: true}
	udGood := enc(Packet{Opcode: UDSendOnly, QKey: 7, SrcQP: 9, Payload: make([]byte, 8)})
	for name, c := range map[string][]byte{
		"RC packet to a UD QP": good,
		"DETH reserved byte": func() []byte {
			b := append([]byte(nil), udGood...)
			b[BTHSize+4] = 1
			return resign(b)
		}(),
		"UD payload > MTU":  enc(Packet{Opcode: UDSendOnly, Payload: make([]byte, lim.MTU+4)}),
		"UD headers cut":    resign(udGood[:BTHSize+4+ICRCSize]),
		"UD opcode unknown": func() []byte { b := append([]byte(nil), udGood...); b[0] = 0x66; return resign(b) }(),
	} {
		_, err := Decode(c, ep4, ud)
		assert.ErrorIs(t, err, ErrMalformed, name)
	}
	_, err = Decode(udGood, ep4, ud)
	require.NoError(t, err)
	_, err = Decode(udGood, ep4, lim)
	assert.ErrorIs(t, err, ErrMalformed, "a UD packet to an RC QP")
	_, err = (&Packet{Opcode: UDSendOnly, SrcQP: 1 << 24}).Append(nil, ep4)
	assert.ErrorIs(t, err, ErrMalformed)
	for name, c := range cases {
		_, err := Decode(c.b, ep4, lim)
		assert.ErrorIs(t, err, c.want, name)
		if errors.Is(c.want, ErrMalformed) {
			assert.NotErrorIs(t, err, ErrICRC, name)
		}
	}
	_, err = (&Packet{Opcode: 0x15}).Append(nil, ep4)
	assert.ErrorIs(t, err, ErrMalformed)
	_, err = (&Packet{Opcode: ReadRequest, Payload: []byte{1}}).Append(nil, ep4)
	assert.ErrorIs(t, err, ErrMalformed)
	_, err = (&Packet{Opcode: SendOnly, PSN: 1 << 24}).Append(nil, ep4)
	assert.ErrorIs(t, err, ErrMalformed)
	assert.Equal(t, 1, RNR(12).Kind())
	assert.EqualValues(t, 12, RNR(12).Timer())
	assert.Equal(t, 3, SynNAKRemoteAccess.Kind())
	assert.Equal(t, "RDMA_READ_REQUEST", ReadRequest.String())
	assert.True(t, ValidMTU(4096) && !ValidMTU(1500))
}

// Decode of anything: no panic, and what it accepts re-encodes to the same bytes
// (nothing is accepted that a sender could not have sent).
func FuzzDecode(f *testing.F) {
	for _, p := range samples() {
		b, err := p.Append(nil, ep4)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		p, err := Decode(b, ep4, lim)
		if err != nil {
			if p, err = Decode(b, ep4, Limits{MTU: lim.MTU, MaxMessage: lim.MaxMessage, UD: true}); err != nil {
				return
			}
		}
		again, err := p.Append(nil, ep4)
		if err != nil {
			t.Fatalf("decoded %+v does not encode: %v", p, err)
		}
		if !bytes.Equal(again, b) {
			t.Fatalf("re-encoded %x, decoded from %x", again, b)
		}
	})
}

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
