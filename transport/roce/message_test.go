package roce

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestSegmentReassemble(t *testing.T) {
	const mtu = 256
	for _, kind := range []Kind{KindSend, KindWrite, KindReadResponse} {
		for _, n := range []int{0, 1, mtu - 1, mtu, mtu + 1, 3 * mtu, 3*mtu + 7} {
			for _, imm := range []bool{false, true} {
				if imm && kind == KindReadResponse {
					continue
				}
				t.Run(fmt.Sprintf("kind%d/%d/imm=%v", kind, n, imm), func(t *testing.T) {
					payload := make([]byte, n)
					for i := range payload {
						payload[i] = byte(i * 13)
					}
					m := Message{Kind: kind, PSN: 1<<24 - 2, DestQP: 9, AckReq: true, Payload: payload, HasImm: imm, Imm: 0xabc}
					if kind == KindWrite {
						m.VA, m.RKey, m.DMALen = 0x1000, 5, uint32(n)
					}
					if kind == KindReadResponse {
						m.Syndrome, m.MSN = SynACK, 3
					}
					ps, err := Segment(&m, mtu)
					require.NoError(t, err)
					require.Len(t, ps, Packets(n, mtu))
					r := NewReassembler(Limits{MTU: mtu, MaxMessage: 1 << 20})
					var got *Message
					for i := range ps {
						assert.Equal(t, (m.PSN+uint32(i))&(1<<24-1), ps[i].PSN, "PSNs wrap at 2^24")
						assert.Equal(t, i == len(ps)-1, ps[i].AckReq, "the last packet asks for the ACK")
						b, err := ps[i].Append(nil, ep4)
						require.NoError(t, err)
						p, err := Decode(b, ep4, Limits{MTU: mtu, MaxMessage: 1 << 20})
						require.NoError(t, err, "packet %d (%v)", i, ps[i].Opcode)
						got, err = r.Add(&p)
						require.NoError(t, err)
						if i < len(ps)-1 {
							require.Nil(t, got)
						}
					}
					require.NotNil(t, got)
					assert.True(t, bytes.Equal(payload, got.Payload))
					assert.Equal(t, kind, got.Kind)
					assert.Equal(t, m.PSN, got.PSN)
					assert.Equal(t, imm, got.HasImm)
					if imm {
						assert.EqualValues(t, 0xabc, got.Imm)
					}
					if kind == KindWrite {
						assert.EqualValues(t, 0x1000, got.VA)
						assert.EqualValues(t, n, got.DMALen)
					}
				})
			}
		}
	}
	for _, m := range []Message{
		{Kind: KindReadRequest, VA: 1, RKey: 2, DMALen: 1 << 20},
		{Kind: KindCompareSwap, VA: 8, RKey: 2, Swap: 3, Compare: 4},
		{Kind: KindFetchAdd, VA: 8, RKey: 2, Swap: 3},
		{Kind: KindAck, Syndrome: RNR(12), MSN: 4},
		{Kind: KindAtomicAck, Syndrome: SynACK, Orig: 77},
	} {
		ps, err := Segment(&m, mtu)
		require.NoError(t, err)
		require.Len(t, ps, 1)
		got, err := NewReassembler(Limits{MTU: mtu, MaxMessage: 1 << 20}).Add(&ps[0])
		require.NoError(t, err)
		got.Payload = nil
		assert.Equal(t, m, *got)
	}
	_, err := Segment(&Message{Kind: KindSend}, 1500)
	assert.ErrorIs(t, err, ErrMalformed)
	_, err = Segment(&Message{Kind: 99}, mtu)
	assert.ErrorIs(t, err, ErrMalformed)
}

func TestReassemblerRejects(t *testing.T) {
	const mtu = 256
	lim := Limits{MTU: mtu, MaxMessage: 4 * mtu}
	pl := make([]byte, mtu)
	cases := map[string][]Packet{
		"MIDDLE without FIRST":     {{Opcode: SendMiddle, Payload: pl}},
		"LAST without FIRST":       {{Opcode: WriteLast, Payload: pl}},
		"FIRST during a message":   {{Opcode: SendFirst, Payload: pl}, {Opcode: SendFirst, Payload: pl}},
		"ONLY during a message":    {{Opcode: SendFirst, Payload: pl}, {Opcode: WriteOnly}},
		"kinds mixed":              {{Opcode: SendFirst, Payload: pl}, {Opcode: WriteLast, Payload: pl}},
		"WRITE over MaxMessage":    {{Opcode: WriteFirst, DMALen: 4*mtu + 1, Payload: pl}},
		"WRITE FIRST is all":       {{Opcode: WriteFirst, DMALen: mtu, Payload: pl}},
		"WRITE beyond its RETH":    {{Opcode: WriteFirst, DMALen: mtu + 1, Payload: pl}, {Opcode: WriteMiddle, Payload: pl}},
		"WRITE short of its RETH":  {{Opcode: WriteFirst, DMALen: 3 * mtu, Payload: pl}, {Opcode: WriteLast, Payload: pl[:1]}},
		"WRITE ONLY against RETH":  {{Opcode: WriteOnly, DMALen: 9, Payload: pl[:8]}},
		"SEND beyond MaxMessage":   {{Opcode: SendFirst, Payload: pl}, {Opcode: SendMiddle, Payload: pl}, {Opcode: SendMiddle, Payload: pl}, {Opcode: SendMiddle, Payload: pl}, {Opcode: SendLast, Payload: pl[:1]}},
		"READ RESPONSE over limit": {{Opcode: ReadRespFirst, Payload: pl}, {Opcode: ReadRespMiddle, Payload: pl}, {Opcode: ReadRespMiddle, Payload: pl}, {Opcode: ReadRespMiddle, Payload: pl}, {Opcode: ReadRespMiddle, Payload: pl}},
	}
	small := NewReassembler(Limits{MTU: mtu, MaxMessage: 16})
	_, err := small.Add(&Packet{Opcode: SendFirst, Payload: pl})
	assert.ErrorIs(t, err, ErrMalformed, "a FIRST larger than the largest message")
	for name, ps := range cases {
		r := NewReassembler(lim)
		var err error
		for i := range ps {
			if _, err = r.Add(&ps[i]); err != nil {
				break
			}
		}
		assert.ErrorIs(t, err, ErrMalformed, name)
		// After an error the reassembler takes a new message.
		m, err := r.Add(&Packet{Opcode: SendOnly, Payload: pl[:3]})
		require.NoError(t, err, name)
		assert.Len(t, m.Payload, 3)
	}
}

// Packets of any content, in any order, never make the reassembler panic or keep
// more than MaxMessage bytes for a message.
func FuzzReassemble(f *testing.F) {
	const mtu = 256
	lim := Limits{MTU: mtu, MaxMessage: 3 * mtu}
	f.Add(framedStream(f, mtu, Message{Kind: KindWrite, VA: 1, RKey: 2, DMALen: 2*mtu + 5, Payload: make([]byte, 2*mtu+5)}))
	f.Fuzz(func(t *testing.T, stream []byte) {
		r := NewReassembler(lim)
		for {
			p, _, ok := nextFramed(&stream, lim)
			if !ok {
				return
			}
			if p == nil {
				continue
			}
			msg, err := r.Add(p)
			if r.cur != nil && cap(r.cur.Payload) > int(lim.MaxMessage) {
				t.Fatalf("a message in progress holds %d bytes, the limit is %d", cap(r.cur.Payload), lim.MaxMessage)
			}
			if err == nil && msg != nil && len(msg.Payload) > int(lim.MaxMessage) {
				t.Fatalf("a %d-byte message, the limit is %d", len(msg.Payload), lim.MaxMessage)
			}
		}
	})
}

// framedStream is a fuzz seed: the packets of msgs, each behind a two-byte length
// and a byte the fuzz target may use to choose what to do with it.
func framedStream(tb testing.TB, mtu int, msgs ...Message) []byte {
	var stream []byte
	for i := range msgs {
		ps, err := Segment(&msgs[i], mtu)
		if err != nil {
			tb.Fatal(err)
		}
		for _, p := range ps {
			b, err := p.Append(nil, ep4)
			if err != nil {
				tb.Fatal(err)
			}
			stream = binary.BigEndian.AppendUint16(stream, uint16(len(b)))
			stream = append(append(stream, 0), b...)
		}
	}
	return stream
}

// nextFramed takes the next framed packet off stream: the decoded packet (nil if
// it does not decode) and its choice byte; ok is false at the end.
func nextFramed(stream *[]byte, lim Limits) (*Packet, byte, bool) {
	s := *stream
	if len(s) < 3 {
		return nil, 0, false
	}
	n, choice := int(binary.BigEndian.Uint16(s)), s[2]
	s = s[3:]
	if n > len(s) {
		return nil, 0, false
	}
	p, err := Decode(s[:n], ep4, lim)
	*stream = s[n:]
	if err != nil {
		return nil, choice, true
	}
	return &p, choice, true
}
