package roce

import (
	"encoding/binary"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

var zeroTime = time.Unix(0, 0)

func TestPSNDiff(t *testing.T) {
	assert.EqualValues(t, 1, psnDiff(5, 4))
	assert.EqualValues(t, -1, psnDiff(4, 5))
	assert.EqualValues(t, 2, psnDiff(1, psnMask), "across the wrap")
	assert.EqualValues(t, -2, psnDiff(psnMask, 1))
	assert.EqualValues(t, 0, psnDiff(7, 7))
}

// runOf is the run a requester sends for packets [k, k+count) of r at the MTU.
func runOf(t *testing.T, mtu int, first uint32, r Request, k, count int) Segment {
	t.Helper()
	q := NewRequester(RequesterConfig{MTU: mtu, FirstPSN: first})
	_, err := q.Post(r, zeroTime)
	require.NoError(t, err)
	for i := 0; i < k; {
		tx, _ := q.Next(k - i)
		q.Sent(&tx, zeroTime)
		i += tx.Seg.Count
	}
	tx, ok := q.Next(count)
	require.True(t, ok)
	require.Equal(t, count, tx.Seg.Count)
	tx.Seg.Payload = make([]byte, tx.Len)
	for i := range tx.Seg.Payload {
		tx.Seg.Payload[i] = byte(int(tx.Offset) + i)
	}
	return tx.Seg
}

func TestResponderInOrder(t *testing.T) {
	const mtu = 256
	lim := Limits{MTU: mtu, MaxMessage: 1 << 20}
	start := uint32(psnMask - 1) // the sequence wraps inside the first message
	r := NewResponder(start, lim, 4)
	w := Request{ID: 1, Kind: KindWrite, Length: 600, VA: 64, RKey: 1}
	head, tail := runOf(t, mtu, start, w, 0, 2), runOf(t, mtu, start, w, 2, 1)
	v := r.Receive(&head)
	require.Equal(t, ActPlace, v.Act)
	assert.Equal(t, MessageInfo{Kind: KindWrite, First: start, VA: 64, RKey: 1, Length: 600}, v.Msg)
	assert.False(t, v.Ends)
	assert.False(t, r.Placed(&head, &v), "no ACK asked yet")
	assert.True(t, r.InMessage())
	v = r.Receive(&tail)
	require.Equal(t, ActPlace, v.Act)
	assert.EqualValues(t, 2*mtu, v.Off, "the LAST's place in the message")
	assert.True(t, v.Ends)
	assert.True(t, r.Placed(&tail, &v), "the LAST asks for an ACK")
	assert.EqualValues(t, 1, r.ExpectedPSN(), "past the wrap")
	assert.EqualValues(t, 1, r.MSN())
	assert.EqualValues(t, 0, r.Ack().PSN, "the last packet acknowledged")

	rd := runOf(t, mtu, 1, Request{ID: 2, Kind: KindReadRequest, Length: 3*mtu + 1, VA: 64, RKey: 1}, 0, 1)
	v = r.Receive(&rd)
	require.Equal(t, ActRead, v.Act)
	r.ReadDone(&v)
	assert.EqualValues(t, 5, r.ExpectedPSN(), "a READ takes a PSN per response packet")
	assert.EqualValues(t, 2, r.MSN())
}

// A run whose first packets were taken already (a go-back-N retransmission from
// before what the responder expects) is taken from the expected packet on.
func TestResponderRunStraddlingExpected(t *testing.T) {
	const mtu = 256
	r := NewResponder(0, Limits{MTU: mtu, MaxMessage: 1 << 20}, 4)
	w := Request{ID: 1, Kind: KindWrite, Length: 5 * mtu, VA: 0, RKey: 1}
	first := runOf(t, mtu, 0, w, 0, 2)
	v := r.Receive(&first)
	require.Equal(t, ActPlace, v.Act)
	r.Placed(&first, &v)
	again := runOf(t, mtu, 0, w, 0, 5) // the whole message again
	v = r.Receive(&again)
	require.Equal(t, ActPlace, v.Act)
	assert.Equal(t, 2, v.Skip, "the first two packets were taken")
	assert.EqualValues(t, 2*mtu, v.Off)
	assert.True(t, v.Ends)
	r.Placed(&again, &v)
	assert.EqualValues(t, 5, r.ExpectedPSN())
	assert.False(t, r.InMessage())
}

func TestResponderLossAndDuplicates(t *testing.T) {
	const mtu = 256
	r := NewResponder(10, Limits{MTU: mtu, MaxMessage: 1 << 20}, 2)
	send := func(psn uint32) Segment {
		return runOf(t, mtu, psn, Request{ID: 1, Kind: KindSend, Length: 1}, 0, 1)
	}
	take := func(s Segment) {
		v := r.Receive(&s)
		require.Equal(t, ActPlace, v.Act)
		r.Placed(&s, &v)
	}
	take(send(10))

	// 11 is lost: 12 draws one sequence NAK naming 11, 13 nothing.
	p12, p13 := send(12), send(13)
	v := r.Receive(&p12)
	require.Equal(t, ActNAK, v.Act)
	assert.False(t, v.Fatal)
	assert.Equal(t, SynNAKPSNSeqError, v.Resp.Syndrome)
	assert.EqualValues(t, 11, v.Resp.PSN)
	v = r.Receive(&p13)
	assert.Equal(t, ActDrop, v.Act, "one NAK per gap")
	take(send(11)) // the go-back-N retransmission
	take(p12)

	// A duplicate SEND is acknowledged again.
	d := send(11)
	v = r.Receive(&d)
	require.Equal(t, ActAck, v.Act)
	assert.Equal(t, SynACK, v.Resp.Syndrome)
	assert.EqualValues(t, 12, v.Resp.PSN)

	// Atomics: a duplicate is answered from the saved result, not executed again;
	// one older than what is kept is dropped, silently (rxe's class D), and the QP
	// goes on.
	for i, psn := range []uint32{13, 14, 15} {
		a := runOf(t, mtu, psn, Request{ID: 1, Kind: KindFetchAdd, VA: 8, RKey: 1, Swap: 1}, 0, 1)
		v := r.Receive(&a)
		require.Equal(t, ActAtomic, v.Act)
		assert.EqualValues(t, 1, v.Msg.Swap)
		resp := r.AtomicDone(&v, uint64(100+i))
		assert.EqualValues(t, 100+i, resp.Orig)
	}
	dup := runOf(t, mtu, 15, Request{ID: 1, Kind: KindFetchAdd, VA: 8, RKey: 1, Swap: 1}, 0, 1)
	v = r.Receive(&dup)
	require.Equal(t, ActAtomicAgain, v.Act)
	assert.EqualValues(t, 102, v.Resp.Orig)
	old := runOf(t, mtu, 13, Request{ID: 1, Kind: KindFetchAdd, VA: 8, RKey: 1, Swap: 1}, 0, 1)
	v = r.Receive(&old)
	assert.Equal(t, ActDrop, v.Act, "a late duplicate atomic never brings the QP down")
	take(send(16))

	// A duplicate READ is read again when it asks for the original range or part
	// of it, under the same key; anything else is dropped.
	rd := runOf(t, mtu, 17, Request{ID: 1, Kind: KindReadRequest, Length: 3 * mtu, VA: 4096, RKey: 7}, 0, 1)
	v = r.Receive(&rd)
	require.Equal(t, ActRead, v.Act)
	r.ReadDone(&v)
	assert.EqualValues(t, 20, r.ExpectedPSN())
	v = r.Receive(&rd)
	require.Equal(t, ActReadAgain, v.Act)
	assert.Equal(t, MessageInfo{Kind: KindReadRequest, First: 17, VA: 4096, RKey: 7, Length: 3 * mtu}, v.Msg)
	part := rd
	part.PSN, part.VA, part.DMALen = 18, 4096+mtu, 2*mtu
	v = r.Receive(&part)
	require.Equal(t, ActReadAgain, v.Act, "the rest of the READ, from its second packet")
	assert.EqualValues(t, 18, v.Msg.First)
	for _, bad := range []func(p *Segment){
		func(p *Segment) { p.RKey = 8 },
		func(p *Segment) { p.VA = 0 },
		func(p *Segment) { p.DMALen = 4 * mtu },
		func(p *Segment) { p.VA, p.DMALen = 4096+2*mtu, 2*mtu },
	} {
		p := rd
		bad(&p)
		assert.Equal(t, ActDrop, r.Receive(&p).Act, "a duplicate READ outside the original: %+v", p.Packet)
	}
	stale := runOf(t, mtu, 3, Request{ID: 1, Kind: KindReadRequest, Length: 8, VA: 4096, RKey: 7}, 0, 1)
	assert.Equal(t, ActDrop, r.Receive(&stale).Act, "older than the READs kept")
	take(send(20))

	// A response sent to the responder is not its business.
	ack := (&Message{Kind: KindAck, Syndrome: SynACK}).Segment()
	assert.Equal(t, ActDrop, r.Receive(&ack).Act)
}

// After an RNR NAK the responder waits for the NAKed packet again, dropping what
// follows it without a sequence NAK; a message in progress stays in progress.
func TestResponderRNR(t *testing.T) {
	const mtu = 256
	r := NewResponder(0, Limits{MTU: mtu, MaxMessage: 1 << 20}, 1)
	w := Request{ID: 1, Kind: KindWrite, Length: 3 * mtu, VA: 64, RKey: 1}
	p0, p1, p2 := runOf(t, mtu, 0, w, 0, 1), runOf(t, mtu, 0, w, 1, 1), runOf(t, mtu, 0, w, 2, 1)
	next := runOf(t, mtu, 3, Request{ID: 2, Kind: KindSend, Length: 6}, 0, 1)
	v := r.Receive(&p0)
	require.Equal(t, ActPlace, v.Act)
	r.Placed(&p0, &v)
	v = r.Receive(&p1)
	require.Equal(t, ActPlace, v.Act)
	nakm := r.RNR(12) // the second packet faults
	assert.Equal(t, 1, nakm.Syndrome.Kind())
	assert.EqualValues(t, 12, nakm.Syndrome.Timer())
	assert.EqualValues(t, 1, nakm.PSN, "the packet that faulted")
	assert.Equal(t, ActDrop, r.Receive(&p2).Act, "dropped silently behind an RNR NAK")
	assert.Equal(t, ActDrop, r.Receive(&next).Act)
	// The retransmission, from the NAKed packet: the message goes on.
	v = r.Receive(&p1)
	require.Equal(t, ActPlace, v.Act)
	assert.EqualValues(t, mtu, v.Off)
	r.Placed(&p1, &v)
	v = r.Receive(&p2)
	require.Equal(t, ActPlace, v.Act)
	require.True(t, v.Ends)
	r.Placed(&p2, &v)
	assert.Equal(t, ActPlace, r.Receive(&next).Act)
}

// Runs that break the protocol are invalid requests: the QP is in error (Fatal).
func TestResponderMalformed(t *testing.T) {
	const mtu = 256
	lim := Limits{MTU: mtu, MaxMessage: 4 * mtu}
	for name, s := range map[string]Segment{
		"MIDDLE without FIRST":   One(Packet{Opcode: SendMiddle, Payload: make([]byte, mtu)}),
		"WRITE FIRST of one MTU": One(Packet{Opcode: WriteFirst, DMALen: mtu, Payload: make([]byte, mtu)}),
		"WRITE past the largest message": One(Packet{Opcode: WriteFirst, DMALen: 4*mtu + 1,
			Payload: make([]byte, mtu)}),
		"WRITE ONLY of the wrong length": One(Packet{Opcode: WriteOnly, DMALen: 10, Payload: make([]byte, 9)}),
		"READ past the largest message":  One(Packet{Opcode: ReadRequest, DMALen: 4*mtu + 1}),
		"SEND past the largest message": {Packet: Packet{Opcode: SendFirst, Payload: make([]byte, 5*mtu)}, Count: 5,
			Last: SendMiddle},
		"run of mixed kinds": {Packet: Packet{Opcode: SendFirst, Payload: make([]byte, 2*mtu)}, Count: 2,
			Last: WriteLast},
		"run with a short packet": {Packet: Packet{Opcode: SendFirst, Payload: make([]byte, mtu+1)}, Count: 2,
			Last: SendMiddle},
	} {
		r := NewResponder(0, lim, 1)
		v := r.Receive(&s)
		assert.Equal(t, ActNAK, v.Act, name)
		assert.True(t, v.Fatal, name)
		assert.Equal(t, SynNAKInvalidRequest, v.Resp.Syndrome, name)
	}
	// A WRITE whose packets add up to other than its RETH's length.
	r := NewResponder(0, lim, 1)
	first := One(Packet{Opcode: WriteFirst, DMALen: 2 * mtu, Payload: make([]byte, mtu)})
	v := r.Receive(&first)
	require.Equal(t, ActPlace, v.Act)
	r.Placed(&first, &v)
	last := One(Packet{Opcode: WriteLast, PSN: 1, Payload: make([]byte, mtu-4)})
	v = r.Receive(&last)
	assert.True(t, v.Fatal, "a WRITE shorter than its RETH says")
}

func TestSegmentSplitAndPackets(t *testing.T) {
	const mtu = 256
	w := Request{ID: 1, Kind: KindWrite, Length: 4*mtu - 3, VA: 0x1000, RKey: 9, HasImm: true, Imm: 77}
	s := runOf(t, mtu, 100, w, 0, 4)
	require.NoError(t, s.check(mtu))
	ps := s.Packets(nil, mtu)
	require.Len(t, ps, 4)
	assert.Equal(t, []Opcode{WriteFirst, WriteMiddle, WriteMiddle, WriteLastImm},
		[]Opcode{ps[0].Opcode, ps[1].Opcode, ps[2].Opcode, ps[3].Opcode})
	assert.EqualValues(t, 0x1000, ps[0].VA)
	assert.EqualValues(t, 4*mtu-3, ps[0].DMALen)
	assert.Zero(t, ps[1].VA, "a MIDDLE has no RETH")
	assert.True(t, ps[3].AckReq)
	assert.False(t, ps[0].AckReq)
	assert.EqualValues(t, 77, ps[3].Imm)
	assert.EqualValues(t, 103, ps[3].PSN)
	assert.Len(t, ps[3].Payload, mtu-3)
	for _, p := range ps { // each encodes as a packet of the wire
		_, err := p.Append(nil, Endpoints{Src: netipAP("127.0.0.1:1"), Dst: netipAP("127.0.0.2:4791")})
		require.NoError(t, err)
	}

	head, tail := s.Split(1, mtu)
	assert.Equal(t, 1, head.Count)
	assert.Equal(t, WriteFirst, head.Opcode)
	assert.Equal(t, WriteFirst, head.Last)
	assert.False(t, head.AckReq)
	assert.Equal(t, 3, tail.Count)
	assert.Equal(t, WriteMiddle, tail.Opcode)
	assert.EqualValues(t, 101, tail.PSN)
	assert.Zero(t, tail.VA, "the rest starts with a MIDDLE: no RETH")
	assert.True(t, tail.AckReq)
	require.NoError(t, head.check(mtu))
	require.NoError(t, tail.check(mtu))
	assert.Equal(t, append(head.Payload, tail.Payload...), s.Payload)

	resp := ReadResponseRun(50, 1, 2, 4, 9)
	assert.Equal(t, ReadRespMiddle, resp.Opcode)
	assert.Equal(t, ReadRespMiddle, resp.Last)
	assert.Zero(t, resp.Syndrome, "no AETH in the middle of a response")
	resp = ReadResponseRun(50, 0, 4, 4, 9)
	assert.Equal(t, ReadRespFirst, resp.Opcode)
	assert.Equal(t, ReadRespLast, resp.Last)
	assert.Equal(t, SynACK, resp.Syndrome)
	assert.EqualValues(t, 9, resp.MSN)
}

// The responder on any runs in any order: no panic, nothing placed beyond the
// message's length or the largest message, and the expected PSN moves only by what
// was taken.
func FuzzResponder(f *testing.F) {
	const mtu = 256
	f.Add([]byte{0, 6, 0, 2, 1, 0, 0, 4, 12, 0, 0, 3, 0, 2, 20, 0, 1, 0, 4, 0, 1, 0})
	f.Fuzz(func(t *testing.T, stream []byte) {
		lim := Limits{MTU: mtu, MaxMessage: 4 * mtu}
		r := NewResponder(0, lim, 2)
		var got uint64 // bytes of the message in progress placed
		for len(stream) >= 5 {
			op, count, psn, plen, choice := Opcode(stream[0]%21), int(stream[1]%4)+1, uint32(stream[2]%16),
				int(stream[3])*8, stream[4]
			stream = stream[5:]
			s := Segment{Packet: Packet{Opcode: op, PSN: psn, DMALen: uint32(plen) * 2, VA: uint64(choice),
				Payload: make([]byte, min(plen, 5*mtu))}, Count: count, Last: Opcode((uint8(op) + uint8(count) - 1) % 21)}
			if count == 1 {
				s.Last = s.Opcode
			}
			before := r.ExpectedPSN()
			v := r.Receive(&s)
			switch v.Act {
			case ActPlace:
				n := uint64(len(s.Payload) - v.Skip*mtu)
				if uint64(v.Off)+n > uint64(lim.MaxMessage) {
					t.Fatalf("placing %d bytes at %d, the limit is %d", n, v.Off, lim.MaxMessage)
				}
				if v.Msg.Kind == KindWrite && uint64(v.Off)+n > uint64(v.Msg.Length) {
					t.Fatalf("placing %d bytes at %d of a %d-byte WRITE", n, v.Off, v.Msg.Length)
				}
				if choice%4 == 0 {
					r.RNR(1)
					continue
				}
				r.Placed(&s, &v)
				got = uint64(v.Off) + n
			case ActRead:
				r.ReadDone(&v)
			case ActAtomic:
				var b [8]byte
				binary.LittleEndian.PutUint64(b[:], uint64(choice))
				r.AtomicDone(&v, binary.LittleEndian.Uint64(b[:]))
			default:
				if r.ExpectedPSN() != before {
					t.Fatalf("%v moved the expected PSN from %d to %d", v.Act, before, r.ExpectedPSN())
				}
			}
			_ = got
		}
	})
}

// A SEND with invalidate ends with SEND_LAST_WITH_INVALIDATE (or is one
// SEND_ONLY_WITH_INVALIDATE), whose IETH the responder hands on with the message's end.
func TestSendWithInvalidate(t *testing.T) {
	const mtu = 256
	lim := Limits{MTU: mtu, MaxMessage: 1 << 20}
	for _, n := range []uint32{3*mtu - 5, 9} {
		send := Request{ID: 1, Kind: KindSend, Length: n, Inv: true, Imm: 0xabcd01}
		total := Packets(int(n), mtu)
		s := runOf(t, mtu, 7, send, 0, total)
		require.NoError(t, s.check(mtu))
		ps := s.Packets(nil, mtu)
		want := SendOnlyInv
		if total > 1 {
			want = SendLastInv
			assert.Equal(t, SendFirst, ps[0].Opcode)
		}
		last := ps[len(ps)-1]
		assert.Equal(t, want, last.Opcode)
		assert.EqualValues(t, 0xabcd01, last.Imm, "the IETH")
		for _, p := range ps[:len(ps)-1] {
			assert.Zero(t, p.Imm, "%v: only the last packet has the IETH", p.Opcode)
		}

		r := NewResponder(7, lim, 4)
		v := r.Receive(&s)
		require.Equal(t, ActPlace, v.Act)
		require.True(t, v.Ends)
		assert.True(t, v.Msg.Inv)
		assert.False(t, v.Msg.HasImm)
		assert.EqualValues(t, 0xabcd01, v.Msg.Imm)
	}
	q := NewRequester(RequesterConfig{MTU: mtu})
	for _, bad := range []Request{
		{Kind: KindWrite, Length: 8, Inv: true},
		{Kind: KindSend, Length: 8, Inv: true, HasImm: true},
	} {
		_, err := q.Post(bad, zeroTime)
		assert.ErrorIs(t, err, ErrMalformed, "%+v", bad)
	}
}

// An RDMA ATOMIC WRITE is one packet with a RETH and 8 bytes; the responder places it
// as a WRITE, a duplicate is acknowledged only, and the requester completes it with
// the ACK (not with a response of its own, as an atomic or a READ).
func TestAtomicWrite(t *testing.T) {
	const mtu = 256
	lim := Limits{MTU: mtu, MaxMessage: 1 << 20}
	aw := Request{ID: 4, Kind: KindAtomicWrite, Length: 8, VA: 0x2000, RKey: 3}
	q := NewRequester(RequesterConfig{MTU: mtu, FirstPSN: 40})
	_, err := q.Post(aw, zeroTime)
	require.NoError(t, err)
	tx, ok := q.Next(4)
	require.True(t, ok)
	s := tx.Seg
	assert.Equal(t, AtomicWrite, s.Opcode)
	assert.Equal(t, 1, s.Count)
	assert.EqualValues(t, 8, s.DMALen)
	assert.EqualValues(t, 0x2000, s.VA)
	assert.True(t, s.AckReq)
	assert.Equal(t, 8, tx.Len)
	q.Sent(&tx, zeroTime)
	s.Payload = []byte{1, 2, 3, 4, 5, 6, 7, 8}

	r := NewResponder(40, lim, 4)
	dup := s
	v := r.Receive(&s)
	require.Equal(t, ActPlace, v.Act)
	assert.True(t, v.Ends)
	assert.Equal(t, MessageInfo{Kind: KindAtomicWrite, First: 40, VA: 0x2000, RKey: 3, Length: 8}, v.Msg)
	require.True(t, r.Placed(&s, &v))
	ack := r.Ack()
	v = r.Receive(&dup)
	assert.Equal(t, ActAck, v.Act, "a duplicate is acknowledged, not placed again")

	ackPkt := ack.Segment().Packet
	out := q.Receive(&ackPkt, zeroTime)
	require.Len(t, out.Done, 1)
	assert.Equal(t, Completion{ID: 4, Status: StatusSuccess}, out.Done[0])

	bad := s
	bad.DMALen = 16
	assert.True(t, NewResponder(40, lim, 4).Receive(&bad).Fatal, "an atomic write of other than 8 bytes")
	_, err = NewRequester(RequesterConfig{MTU: mtu}).Post(Request{Kind: KindAtomicWrite, Length: 4}, zeroTime)
	assert.ErrorIs(t, err, ErrMalformed)
}

// UC (IBTA 9.8): the requester sends UC opcodes with no ACK request and completes a
// message when its last packet is sent; the responder answers nothing, takes
// messages in sequence, loses the message a lost packet belonged to, and starts
// again at the next FIRST or ONLY, whatever its PSN.
func TestUC(t *testing.T) {
	const mtu = 256
	lim := Limits{MTU: mtu, MaxMessage: 1 << 20, UC: true}
	q := NewRequester(RequesterConfig{MTU: mtu, FirstPSN: 10, UC: true, Timeout: time.Second})
	for i, r := range []Request{
		{ID: 1, Kind: KindSend, Length: 3 * mtu},
		{ID: 2, Kind: KindWrite, Length: 2*mtu + 1, VA: 0x1000, RKey: 5, HasImm: true, Imm: 9},
		{ID: 3, Kind: KindSend, Length: 3 * mtu},
		{ID: 4, Kind: KindSend, Length: 10},
	} {
		_, err := q.Post(r, zeroTime)
		require.NoError(t, err, "request %d", i)
	}
	_, err := q.Post(Request{ID: 5, Kind: KindReadRequest, Length: 8}, zeroTime)
	assert.ErrorIs(t, err, ErrMalformed, "UC has no READs")

	// Every packet, one by one, as a UDP link carries them.
	var pkts []Segment
	var done []uint64
	for {
		tx, ok := q.Next(1)
		if !ok {
			break
		}
		tx.Seg.Payload = make([]byte, tx.Len)
		pkts = append(pkts, tx.Seg)
		for _, c := range q.Sent(&tx, zeroTime).Done {
			assert.Equal(t, StatusSuccess, c.Status)
			done = append(done, c.ID)
		}
		assert.True(t, tx.Seg.Opcode.UC(), "%v", tx.Seg.Opcode)
		assert.False(t, tx.Seg.AckReq, "UC asks for no ACK")
	}
	assert.Equal(t, []uint64{1, 2, 3, 4}, done, "each completes as its last packet is sent")
	assert.Zero(t, q.Outstanding())
	assert.True(t, q.Deadline().IsZero(), "no ACK timer")
	require.Len(t, pkts, 3+3+3+1)
	assert.Equal(t, []Opcode{UCSendFirst, UCSendMiddle, UCSendLast}, []Opcode{pkts[0].Opcode, pkts[1].Opcode,
		pkts[2].Opcode})
	assert.Equal(t, UCWriteLastImm, pkts[5].Opcode)
	assert.Equal(t, "UC_RDMA_WRITE_LAST_WITH_IMMEDIATE", UCWriteLastImm.String())
	assert.Equal(t, UCSendOnly, pkts[9].Opcode)

	r := NewResponder(10, lim, 4)
	take := func(s Segment) Verdict {
		v := r.Receive(&s)
		assert.Nil(t, v.Resp, "UC answers nothing")
		if v.Act == ActPlace {
			assert.False(t, r.Placed(&s, &v), "no ACK owed")
		}
		return v
	}
	for _, s := range pkts[:6] { // the SEND and the WRITE, whole
		require.Equal(t, ActPlace, take(s).Act)
	}
	// The third message's MIDDLE is lost: its LAST is dropped, the SEND ONLY after
	// it (out of sequence: PSN 19, expected 17) starts anew.
	require.Equal(t, ActPlace, take(pkts[6]).Act)
	assert.Equal(t, ActDrop, take(pkts[8]).Act)
	v := take(pkts[9])
	require.Equal(t, ActPlace, v.Act)
	assert.True(t, v.Ends)
	assert.EqualValues(t, 20, r.ExpectedPSN())
	// A MIDDLE with no FIRST, and an RC request: dropped, not NAKed.
	assert.Equal(t, ActDrop, take(pkts[7]).Act)
	rc := One(Packet{Opcode: SendOnly, PSN: 20, Payload: []byte{1}})
	assert.Equal(t, ActDrop, take(rc).Act)
}

// The READs kept for duplicates are the latest max_dest_rd_atomic: after more
// READs than that, the newest are read again and the oldest dropped (class D).
func TestResponderKeepsLatestReads(t *testing.T) {
	const mtu = 256
	r := NewResponder(0, Limits{MTU: mtu, MaxMessage: 1 << 20}, 3)
	var reads []Segment
	psn := uint32(0)
	for i := range 7 {
		rd := runOf(t, mtu, psn, Request{ID: 1, Kind: KindReadRequest, Length: uint32(i+1) * mtu, VA: 4096, RKey: 7}, 0, 1)
		v := r.Receive(&rd)
		require.Equal(t, ActRead, v.Act)
		r.ReadDone(&v)
		reads = append(reads, rd)
		psn += uint32(i + 1)
	}
	for i, rd := range reads {
		v := r.Receive(&rd)
		if i < 4 {
			assert.Equal(t, ActDrop, v.Act, "READ %d is older than the three kept", i)
			continue
		}
		require.Equal(t, ActReadAgain, v.Act, "READ %d", i)
		assert.Equal(t, MessageInfo{Kind: KindReadRequest, First: rd.PSN, VA: 4096, RKey: 7, Length: uint32(i+1) * mtu}, v.Msg)
	}
}

func TestRecent(t *testing.T) {
	var r recent[int]
	for v := range 10 {
		r.add(v, 4)
		var got []int
		for i := range r.n {
			got = append(got, *r.at(i))
		}
		want := []int{}
		for w := max(0, v-3); w <= v; w++ {
			want = append(want, w)
		}
		require.Equal(t, want, got, "after adding %d", v)
	}
}
