package roce

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestPSNDiff(t *testing.T) {
	assert.EqualValues(t, 1, psnDiff(5, 4))
	assert.EqualValues(t, -1, psnDiff(4, 5))
	assert.EqualValues(t, 2, psnDiff(1, psnMask), "across the wrap")
	assert.EqualValues(t, -2, psnDiff(psnMask, 1))
	assert.EqualValues(t, 0, psnDiff(7, 7))
}

// packets segments m for the responder's tests.
func packetsOf(t *testing.T, m Message) []Packet {
	t.Helper()
	ps, err := Segment(&m, 256)
	require.NoError(t, err)
	return ps
}

func TestResponderInOrder(t *testing.T) {
	lim := Limits{MTU: 256, MaxMessage: 1 << 20}
	start := uint32(psnMask - 1) // the sequence wraps inside the first message
	r := NewResponder(start, lim, 4)
	w := packetsOf(t, Message{Kind: KindWrite, PSN: start, VA: 64, RKey: 1, Payload: make([]byte, 600), AckReq: true})
	require.Len(t, w, 3)
	for i := range w {
		act, m, _ := r.Receive(&w[i])
		if i < 2 {
			assert.Equal(t, ActContinue, act)
			continue
		}
		require.Equal(t, ActExecute, act)
		assert.Len(t, m.Payload, 600)
		r.Executed(m, nil)
	}
	assert.EqualValues(t, 1, r.ExpectedPSN(), "past the wrap")
	assert.EqualValues(t, 1, r.MSN())
	assert.EqualValues(t, 0, r.Ack().PSN, "the last packet acknowledged")

	rd := packetsOf(t, Message{Kind: KindReadRequest, PSN: 1, VA: 64, RKey: 1, DMALen: 3*256 + 1})
	act, m, _ := r.Receive(&rd[0])
	require.Equal(t, ActExecute, act)
	r.Executed(m, nil)
	assert.EqualValues(t, 5, r.ExpectedPSN(), "a READ takes a PSN per response packet")
	assert.EqualValues(t, 2, r.MSN())
}

func TestResponderLossAndDuplicates(t *testing.T) {
	lim := Limits{MTU: 256, MaxMessage: 1 << 20}
	r := NewResponder(10, lim, 2)
	send := func(psn uint32, ackReq bool) Packet {
		return packetsOf(t, Message{Kind: KindSend, PSN: psn, Payload: []byte("x"), AckReq: ackReq})[0]
	}
	exec := func(p Packet) {
		act, m, _ := r.Receive(&p)
		require.Equal(t, ActExecute, act)
		r.Executed(m, nil)
	}
	exec(send(10, false))

	// 11 is lost: 12 draws one sequence NAK naming 11, 13 nothing.
	p12, p13 := send(12, false), send(13, false)
	act, _, resp := r.Receive(&p12)
	require.Equal(t, ActNAK, act)
	assert.Equal(t, SynNAKPSNSeqError, resp.Syndrome)
	assert.EqualValues(t, 11, resp.PSN)
	act, _, _ = r.Receive(&p13)
	assert.Equal(t, ActDrop, act, "one NAK per gap")
	exec(send(11, false)) // the go-back-N retransmission
	exec(p12)

	// A duplicate SEND: acknowledged if it asks, else dropped.
	d := send(11, true)
	act, _, resp = r.Receive(&d)
	require.Equal(t, ActDuplicate, act)
	assert.Equal(t, SynACK, resp.Syndrome)
	assert.EqualValues(t, 12, resp.PSN)
	d = send(11, false)
	act, _, _ = r.Receive(&d)
	assert.Equal(t, ActDrop, act)

	// Atomics: a duplicate is answered from the saved result, not executed again;
	// beyond the saved window it is an invalid request.
	for i, psn := range []uint32{13, 14, 15} {
		a := packetsOf(t, Message{Kind: KindFetchAdd, PSN: psn, VA: 8, RKey: 1, Swap: 1})[0]
		act, m, _ := r.Receive(&a)
		require.Equal(t, ActExecute, act)
		r.Executed(m, &Message{Kind: KindAtomicAck, PSN: psn, Orig: uint64(100 + i)})
	}
	dup := packetsOf(t, Message{Kind: KindFetchAdd, PSN: 15, VA: 8, RKey: 1, Swap: 1})[0]
	act, m, resp := r.Receive(&dup)
	require.Equal(t, ActDuplicate, act)
	assert.Nil(t, m, "not executed again")
	assert.EqualValues(t, 102, resp.Orig)
	old := packetsOf(t, Message{Kind: KindFetchAdd, PSN: 13, VA: 8, RKey: 1, Swap: 1})[0]
	act, _, resp = r.Receive(&old)
	require.Equal(t, ActNAK, act)
	assert.Equal(t, SynNAKInvalidRequest, resp.Syndrome)

	// A duplicate READ is read again.
	rd := packetsOf(t, Message{Kind: KindReadRequest, PSN: 16, VA: 64, RKey: 1, DMALen: 8})[0]
	act, m, _ = r.Receive(&rd)
	require.Equal(t, ActExecute, act)
	r.Executed(m, nil)
	act, m, _ = r.Receive(&rd)
	require.Equal(t, ActDuplicate, act)
	assert.EqualValues(t, 16, m.PSN)
	assert.EqualValues(t, 17, r.ExpectedPSN())

	// A response sent to the responder is not its business.
	ack := packetsOf(t, Message{Kind: KindAck, Syndrome: SynACK})[0]
	act, _, _ = r.Receive(&ack)
	assert.Equal(t, ActDrop, act)
}

// After an RNR NAK the responder waits for the NAKed message again, dropping what
// follows it without a sequence NAK; a multi-packet message starts over.
func TestResponderRNR(t *testing.T) {
	lim := Limits{MTU: 256, MaxMessage: 1 << 20}
	r := NewResponder(0, lim, 1)
	w := packetsOf(t, Message{Kind: KindWrite, PSN: 0, VA: 64, RKey: 1, Payload: make([]byte, 512)})
	next := packetsOf(t, Message{Kind: KindSend, PSN: 2, Payload: []byte("behind")})[0]
	r.Receive(&w[0])
	act, m, _ := r.Receive(&w[1])
	require.Equal(t, ActExecute, act)
	nak := r.RNR(m, 12)
	assert.Equal(t, 1, nak.Syndrome.Kind())
	assert.EqualValues(t, 12, nak.Syndrome.Timer())
	assert.EqualValues(t, 0, nak.PSN)
	act, _, _ = r.Receive(&next)
	assert.Equal(t, ActDrop, act, "dropped silently behind an RNR NAK")
	act, _, _ = r.Receive(&w[1])
	assert.Equal(t, ActDrop, act, "the LAST, ahead of the rolled-back PSN")
	// The retransmission, from the FIRST.
	act, _, _ = r.Receive(&w[0])
	require.Equal(t, ActContinue, act)
	act, m, _ = r.Receive(&w[1])
	require.Equal(t, ActExecute, act)
	r.Executed(m, nil)
	act, _, _ = r.Receive(&next)
	assert.Equal(t, ActExecute, act)

	// A protocol error inside a message (a MIDDLE without FIRST at the expected PSN)
	// is an invalid request.
	r2 := NewResponder(0, lim, 1)
	mid := Packet{Opcode: SendMiddle, PSN: 0, Payload: make([]byte, 256)}
	act, _, resp := r2.Receive(&mid)
	require.Equal(t, ActNAK, act)
	assert.Equal(t, SynNAKInvalidRequest, resp.Syndrome)
}

// The responder's request handling on any packets in any order: no panic, no message
// beyond the limit, and the expected PSN moves only by what was executed.
func FuzzResponder(f *testing.F) {
	const mtu = 256
	lim := Limits{MTU: mtu, MaxMessage: 4 * mtu}
	f.Add(framedStream(f, mtu,
		Message{Kind: KindWrite, PSN: 0, VA: 1, RKey: 2, Payload: make([]byte, 300)},
		Message{Kind: KindReadRequest, PSN: 2, VA: 1, RKey: 2, DMALen: 600},
		Message{Kind: KindFetchAdd, PSN: 5, VA: 8, RKey: 2, Swap: 1},
		Message{Kind: KindSend, PSN: 6, Payload: []byte("hi"), AckReq: true}))
	f.Fuzz(func(t *testing.T, stream []byte) {
		r := NewResponder(0, lim, 2)
		for {
			p, choice, ok := nextFramed(&stream, lim)
			if !ok {
				return
			}
			if p == nil {
				continue
			}
			before := r.ExpectedPSN()
			act, m, resp := r.Receive(p)
			switch act {
			case ActExecute:
				if len(m.Payload) > int(lim.MaxMessage) {
					t.Fatalf("a %d-byte message", len(m.Payload))
				}
				if choice%4 == 0 {
					r.RNR(m, 1)
					continue
				}
				r.Executed(m, &Message{Kind: KindAtomicAck})
			case ActNAK, ActDuplicate:
				if resp == nil && m == nil {
					t.Fatalf("%v without a response or a message", act)
				}
				fallthrough
			case ActDrop:
				if r.ExpectedPSN() != before {
					t.Fatalf("%v moved the expected PSN from %d to %d", act, before, r.ExpectedPSN())
				}
			}
		}
	})
}
