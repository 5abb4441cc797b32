package roce

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// rcSim runs a requester against a responder over a simulated wire that makes the
// faults a Link's injector makes (each packet dropped, doubled, or held back past
// the next), with simulated time, the way the emulated NIC's engine drives them:
// runs are built from the requester's source buffers when they go out, placed in
// the responder's memory at their offsets, READ responses built from that memory
// and placed in the requester's buffers.
type rcSim struct {
	t      *testing.T
	req    *Requester
	resp   *Responder
	mtu    int
	maxRun int
	src    map[uint64][]byte // a WRITE's or SEND's payload, by message id
	back   map[uint64][]byte // where a READ's data lands
	mem    []byte            // the responder's memory: VA is the offset
	recv   map[uint32][]byte // SENDs received, by first PSN
	rng    *rand.Rand
	loss   float64
	now    time.Time
	toResp []Segment
	toReq  []Segment
	held   map[*[]Segment]*Segment
	done   []Completion
	rnr    map[uint32]int // PSN -> RNR NAKs the responder still answers for it
	resume time.Time      // the requester is paused until then
}

func newSim(t *testing.T, seed uint64, loss float64, mtu, maxRun int, memSize int, maxMsg uint32) *rcSim {
	return &rcSim{t: t, mtu: mtu, maxRun: maxRun, src: map[uint64][]byte{}, back: map[uint64][]byte{},
		mem: make([]byte, memSize), recv: map[uint32][]byte{}, rng: rand.New(rand.NewPCG(seed, 3)), loss: loss,
		now: time.Unix(0, 0), held: map[*[]Segment]*Segment{}, rnr: map[uint32]int{},
		req:  NewRequester(RequesterConfig{MTU: mtu, FirstPSN: psnMask - 3, Timeout: time.Millisecond, RetryCnt: 7, RNRRetry: 7}),
		resp: NewResponder(psnMask-3, Limits{MTU: mtu, MaxMessage: maxMsg}, 16)}
}

// deliver puts runs on the wire q; with loss, each is dropped, sent twice, or held
// back and sent after the next one (runs are single packets then).
func (w *rcSim) deliver(q *[]Segment, segs ...Segment) {
	for _, s := range segs {
		held := w.held[q]
		w.held[q] = nil
		switch r := w.rng.Float64(); {
		case r < w.loss: // dropped
		case r < 1.5*w.loss:
			*q = append(*q, s, s)
		case r < 2.5*w.loss && held == nil:
			c := s
			w.held[q] = &c
		default:
			*q = append(*q, s)
		}
		if held != nil {
			*q = append(*q, *held)
		}
	}
}

func (w *rcSim) post(r Request) {
	out, err := w.req.Post(r, w.now)
	require.NoError(w.t, err)
	w.done = append(w.done, out.Done...)
}

// transmit sends what the requester's cursor has, building each run's payload.
func (w *rcSim) transmit() {
	for w.req.Pending() {
		tx, ok := w.req.Next(w.maxRun)
		require.True(w.t, ok)
		if tx.Len > 0 {
			tx.Seg.Payload = w.src[tx.ID][tx.Offset : int(tx.Offset)+tx.Len]
		}
		w.req.Sent(&tx, w.now)
		w.deliver(&w.toResp, tx.Seg)
	}
}

// respond is the responder's engine for one run.
func (w *rcSim) respond(s Segment) {
	v := w.resp.Receive(&s)
	answer := func(m *Message) { w.deliver(&w.toReq, m.Segment()) }
	readResponse := func(first uint32, va uint64, n uint32, msn uint32) {
		total := Packets(int(n), w.mtu)
		for k := 0; k < total; k += w.maxRun {
			count := min(w.maxRun, total-k)
			seg := ReadResponseRun(first, k, count, total, msn)
			lo := va + uint64(k*w.mtu)
			seg.Payload = w.mem[lo:min(lo+uint64(count*w.mtu), va+uint64(n))]
			w.deliver(&w.toReq, seg)
		}
	}
	switch v.Act {
	case ActNAK, ActAck, ActAtomicAgain:
		answer(v.Resp)
	case ActPlace:
		if w.rnr[s.PSN+uint32(v.Skip)] > 0 {
			w.rnr[s.PSN+uint32(v.Skip)]--
			answer(w.resp.RNR(1))
			return
		}
		payload := s.Payload[v.Skip*w.mtu:]
		if v.Msg.Kind == KindWrite {
			copy(w.mem[v.Msg.VA+uint64(v.Off):], payload)
		} else {
			w.recv[v.Msg.First] = append(w.recv[v.Msg.First][:v.Off], payload...)
		}
		if w.resp.Placed(&s, &v) {
			answer(w.resp.Ack())
		}
	case ActRead:
		if w.rnr[s.PSN] > 0 { // a READ is never RNR NAKed: the fault is waited for
			w.rnr[s.PSN] = 0
		}
		w.resp.ReadDone(&v)
		readResponse(v.Msg.First, v.Msg.VA, v.Msg.Length, w.resp.MSN())
	case ActReadAgain:
		readResponse(v.Msg.First, v.Msg.VA, v.Msg.Length, w.resp.MSN())
	case ActAtomic:
		orig := binary.LittleEndian.Uint64(w.mem[v.Msg.VA:])
		binary.LittleEndian.PutUint64(w.mem[v.Msg.VA:], orig+v.Msg.Swap)
		answer(w.resp.AtomicDone(&v, orig))
	}
}

// answer is the requester's engine for one answer.
func (w *rcSim) answer(s Segment) {
	var out Output
	switch s.Opcode {
	case Acknowledge, AtomicAck:
		out = w.req.Receive(&s.Packet, w.now)
	default:
		id, off, o, ok := w.req.ReadResponse(&s, w.now)
		w.done = append(w.done, o.Done...)
		if !ok {
			return
		}
		copy(w.back[id][off:], s.Payload)
		out = w.req.ResponsePlaced(&s, w.now)
	}
	w.done = append(w.done, out.Done...)
	if out.RNRWait > 0 {
		w.resume = w.now.Add(out.RNRWait)
	}
}

// run moves runs until every message completed; it fails after too many steps.
func (w *rcSim) run() {
	for step := 0; w.req.Outstanding() > 0; step++ {
		require.Less(w.t, step, 200000, "no progress")
		w.transmit()
		switch {
		case len(w.toResp) > 0:
			s := w.toResp[0]
			w.toResp = w.toResp[1:]
			w.respond(s)
		case len(w.toReq) > 0:
			s := w.toReq[0]
			w.toReq = w.toReq[1:]
			w.answer(s)
		case w.req.Paused():
			w.now = w.resume
			w.req.Resume(w.now)
		default: // nothing in flight: time passes until the ACK timer fires
			w.now = w.req.Deadline()
			w.done = append(w.done, w.req.Tick(w.now).Done...)
		}
	}
}

// WRITEs, READs, SENDs and fetch-adds over a lossy wire, in runs and in single
// packets: all complete, in order, with the right data, and each fetch-add executes
// exactly once however often it is retransmitted.
func TestRCOverLoss(t *testing.T) {
	for _, loss := range []float64{0, 0.01, 0.05} {
		for seed := uint64(1); seed <= 5; seed++ {
			t.Run(fmt.Sprintf("loss=%v/seed=%d", loss, seed), func(t *testing.T) {
				maxRun := 8
				if loss > 0 {
					maxRun = 1
				}
				const mtu = 256
				w := newSim(t, seed, loss, mtu, maxRun, 1<<16, 1<<16)
				src := make([]byte, 4096)
				for i := range src {
					src[i] = byte(i * 7)
				}
				id := uint64(0)
				var ns []int
				for i := 0; i < 20; i++ {
					n := 1 + (i*389)%2000
					ns = append(ns, n)
					id++
					w.src[id] = src[:n]
					w.post(Request{ID: id, Kind: KindWrite, Length: uint32(n), VA: uint64(i * 2048), RKey: 1})
					id++
					w.back[id] = make([]byte, n)
					w.post(Request{ID: id, Kind: KindReadRequest, Length: uint32(n), VA: uint64(i * 2048), RKey: 1})
					id++
					w.post(Request{ID: id, Kind: KindFetchAdd, VA: 65528, RKey: 1, Swap: 1})
					id++
					w.src[id] = src[n/2 : n]
					w.post(Request{ID: id, Kind: KindSend, Length: uint32(n - n/2), HasImm: true, Imm: uint32(i)})
					w.run()
				}
				require.Len(t, w.done, int(id))
				for i, c := range w.done {
					require.EqualValues(t, i+1, c.ID, "completions in order")
					require.Equal(t, StatusSuccess, c.Status, "message %d", c.ID)
					k := i / 4
					switch i % 4 {
					case 1:
						require.True(t, bytes.Equal(src[:ns[k]], w.back[c.ID]), "READ %d", k)
					case 2:
						assert.EqualValues(t, k, c.Orig, "fetch-add %d executed exactly once", k)
					}
				}
				assert.EqualValues(t, 20, binary.LittleEndian.Uint64(w.mem[65528:]))
				assert.Len(t, w.recv, 20, "every SEND received once")
				for _, got := range w.recv {
					assert.True(t, bytes.HasSuffix(src[:2000], got) || len(got) > 0)
				}
			})
		}
	}
}

// A WRITE of many packets whose first packet the responder answers with an RNR NAK
// (an ODP fault), over 1% loss: the responder expects that packet again, and its
// sequence NAKs after that are progress, not retries, whether the RNR NAK arrived or
// was lost. A requester that did not know that failed about one seed in 200 with
// RETRY_EXC_ERR and no timeout.
func TestRCLargeWriteAfterRNROverLoss(t *testing.T) {
	const mtu, size = 4096, 256 << 10
	seeds := uint64(1000)
	if testing.Short() {
		seeds = 100
	}
	src := make([]byte, size)
	for i := range src {
		src[i] = byte(i * 13)
	}
	var stats RequesterStats
	for seed := uint64(1); seed <= seeds; seed++ {
		w := newSim(t, seed, 0.01, mtu, 1, size, size)
		w.req = NewRequester(RequesterConfig{MTU: mtu, FirstPSN: 100, Timeout: time.Millisecond, RetryCnt: 7, RNRRetry: 7})
		w.resp = NewResponder(100, Limits{MTU: mtu, MaxMessage: size}, 16)
		w.rnr[100] = 1
		w.src[1] = src
		w.post(Request{ID: 1, Kind: KindWrite, Length: size, RKey: 1})
		w.run()
		require.Len(t, w.done, 1)
		require.Equal(t, StatusSuccess, w.done[0].Status, "seed %d: %+v", seed, w.req.Stats())
		require.True(t, bytes.Equal(src, w.mem), "seed %d", seed)
		st := w.req.Stats()
		stats.SeqNAKs += st.SeqNAKs
		stats.RNRNAKs += st.RNRNAKs
	}
	assert.Greater(t, stats.SeqNAKs, seeds, "the loss made sequence NAKs")
	assert.Greater(t, stats.RNRNAKs, seeds*9/10, "RNR NAKs arrived, mostly")
}

// nak is an ACK packet with a syndrome, as the responder sends it.
func nak(syn Syndrome, psn uint32) *Packet {
	m := Message{Kind: KindAck, Syndrome: syn, PSN: psn}
	s := m.Segment()
	return &s.Packet
}

// sendAll transmits everything the cursor has and returns the PSNs sent.
func sendAll(t *testing.T, q *Requester, now time.Time) []uint32 {
	var psns []uint32
	for q.Pending() {
		tx, _ := q.Next(1)
		q.Sent(&tx, now)
		psns = append(psns, tx.Seg.PSN)
	}
	return psns
}

// Sequence NAKs count as retries unless the responder took packets since it last
// said what it expects; after an RNR NAK, arrived or lost, it expects the NAKed
// packet again. A NAK moves the transmit cursor back (go-back-N), and an RNR NAK
// holds it until Resume.
func TestRequesterRetriesAfterRNR(t *testing.T) {
	const mtu = 256
	now := time.Unix(0, 0)
	for _, rnrLost := range []bool{false, true} {
		t.Run(fmt.Sprintf("rnrLost=%v", rnrLost), func(t *testing.T) {
			q := NewRequester(RequesterConfig{MTU: mtu, FirstPSN: 100, Timeout: time.Millisecond, RetryCnt: 3, RNRRetry: 7})
			_, err := q.Post(Request{ID: 1, Kind: KindWrite, Length: 64 * mtu, RKey: 1}, now)
			require.NoError(t, err)
			require.Len(t, sendAll(t, q, now), 64)
			// Packets reordered near the end: two NAKs, each progress.
			for _, psn := range []uint32{150, 151} {
				out := q.Receive(nak(SynNAKPSNSeqError, psn), now)
				require.Empty(t, out.Done)
				require.Len(t, sendAll(t, q, now), 164-int(psn), "go-back-N from %d", psn)
			}
			// The responder faulted on the message's first packet and went back.
			if !rnrLost {
				out := q.Receive(nak(RNR(1), 100), now)
				require.Positive(t, out.RNRWait)
				require.False(t, q.Pending(), "nothing goes out during the RNR wait")
				q.Resume(now.Add(out.RNRWait))
				require.Len(t, sendAll(t, q, now), 64)
			}
			// Then loss in the message's first half: NAKs at ever later PSNs, more
			// than RetryCnt of them, all progress. With the RNR NAK lost, the first
			// one is behind what the responder said last and counts.
			for psn := uint32(105); psn < 115; psn++ {
				out := q.Receive(nak(SynNAKPSNSeqError, psn), now)
				require.Empty(t, out.Done, "NAK %d", psn)
				sent := sendAll(t, q, now)
				require.NotEmpty(t, sent, "NAK %d", psn)
				require.Equal(t, psn, sent[0], "go-back-N from the NAKed PSN")
			}
			// The same NAK again and again is no progress: with the retransmission
			// that NAK 114 asked for, the third repeat exceeds RetryCnt.
			for i := 1; i <= 3; i++ {
				out := q.Receive(nak(SynNAKPSNSeqError, 114), now)
				if i < 3 {
					require.Empty(t, out.Done, "repeat %d", i)
					sendAll(t, q, now)
					continue
				}
				require.Equal(t, []Completion{{ID: 1, Status: StatusRetryExceeded}}, out.Done)
			}
		})
	}
}

func TestRequesterRNRAndFailures(t *testing.T) {
	const mtu = 256
	newSimple := func(rnrRetry, retryCnt int) *rcSim {
		w := newSim(t, 1, 0, mtu, 1, 1<<16, 1<<16)
		w.req = NewRequester(RequesterConfig{MTU: mtu, Timeout: time.Millisecond, RetryCnt: retryCnt, RNRRetry: rnrRetry})
		w.resp = NewResponder(0, Limits{MTU: mtu, MaxMessage: 1 << 16}, 4)
		return w
	}
	// Two RNR NAKs, retried.
	w := newSimple(7, 7)
	w.rnr[0] = 2
	w.src[1] = []byte("abc")
	w.post(Request{ID: 1, Kind: KindWrite, Length: 3, RKey: 1})
	w.run()
	require.Len(t, w.done, 1)
	assert.Equal(t, StatusSuccess, w.done[0].Status)
	assert.Equal(t, "abc", string(w.mem[:3]))
	assert.Equal(t, time.Unix(0, 0).Add(2*RNRTimer(1)), w.now, "it waited two RNR timers")
	assert.EqualValues(t, 2, w.req.Stats().Retransmitted, "the NAKed packet, twice")

	// rnr_retry 1 and two RNR NAKs: RNR_RETRY_EXC, what follows flushed.
	w = newSimple(1, 7)
	w.rnr[0] = 2
	w.src[1], w.src[2] = []byte("x"), []byte("y")
	w.post(Request{ID: 1, Kind: KindSend, Length: 1})
	w.post(Request{ID: 2, Kind: KindSend, Length: 1})
	w.run()
	require.Len(t, w.done, 2)
	assert.Equal(t, StatusRNRRetryExceeded, w.done[0].Status)
	assert.Equal(t, StatusFlushed, w.done[1].Status)
	out, err := w.req.Post(Request{ID: 3, Kind: KindSend}, w.now)
	require.NoError(t, err)
	assert.Equal(t, []Completion{{ID: 3, Status: StatusFlushed}}, out.Done, "a failed QP flushes what is posted")

	// A peer that never answers: RETRY_EXC after RetryCnt timeouts.
	w = newSimple(7, 3)
	w.loss = 1 // everything is lost
	w.src[1] = []byte("x")
	w.post(Request{ID: 1, Kind: KindSend, Length: 1})
	w.run()
	require.Len(t, w.done, 1)
	assert.Equal(t, StatusRetryExceeded, w.done[0].Status)
	assert.Equal(t, time.Unix(0, 0).Add(4*time.Millisecond), w.now, "three retransmissions, four timeouts")

	// A remote access NAK fails the message.
	q := NewRequester(RequesterConfig{MTU: mtu, Timeout: time.Millisecond, RetryCnt: 7, RNRRetry: 7})
	_, err = q.Post(Request{ID: 1, Kind: KindWrite, Length: 1, VA: 1, RKey: 9}, time.Unix(0, 0))
	require.NoError(t, err)
	sendAll(t, q, time.Unix(0, 0))
	out = q.Receive(nak(SynNAKRemoteAccess, 0), time.Unix(0, 0))
	assert.Equal(t, []Completion{{ID: 1, Status: StatusRemoteAccess}}, out.Done)

	// An invalid request kind is refused at Post.
	_, err = q.Post(Request{ID: 2, Kind: KindAck}, time.Unix(0, 0))
	assert.ErrorIs(t, err, ErrMalformed)
}

// An ACK past a READ that has no response yet means the response was lost (IBTA's
// implied NAK): the READ is asked again, whole, and the ACK's WRITEs before it
// complete.
func TestRequesterImpliedNAK(t *testing.T) {
	const mtu = 256
	now := time.Unix(0, 0)
	q := NewRequester(RequesterConfig{MTU: mtu, FirstPSN: 10, Timeout: time.Millisecond, RetryCnt: 7, RNRRetry: 7})
	for _, r := range []Request{{ID: 1, Kind: KindWrite, Length: 10}, {ID: 2, Kind: KindReadRequest, Length: 3 * mtu},
		{ID: 3, Kind: KindWrite, Length: 10}} {
		_, err := q.Post(r, now)
		require.NoError(t, err)
	}
	require.Equal(t, []uint32{10, 11, 14}, sendAll(t, q, now), "a READ takes its response's PSNs")
	out := q.Receive(nak(SynACK, 14), now)
	require.Equal(t, []Completion{{ID: 1, Status: StatusSuccess}}, out.Done)
	require.Equal(t, []uint32{11, 14}, sendAll(t, q, now), "the READ again, whole, and what follows")
	assert.EqualValues(t, 2, q.Stats().Retransmitted)
}

// An ACK that completes every message while a go-back-N is under way (the
// responder had them all; the NAK was stale) leaves nothing to send again.
func TestRequesterAckDuringGoBackN(t *testing.T) {
	const mtu = 256
	now := time.Unix(0, 0)
	q := NewRequester(RequesterConfig{MTU: mtu, FirstPSN: 7, Timeout: time.Millisecond, RetryCnt: 7, RNRRetry: 7})
	for id := uint64(1); id <= 2; id++ {
		_, err := q.Post(Request{ID: id, Kind: KindWrite, Length: 2 * mtu}, now)
		require.NoError(t, err)
	}
	require.Len(t, sendAll(t, q, now), 4)
	q.Receive(nak(SynNAKPSNSeqError, 7), now)
	require.True(t, q.Pending(), "go-back-N from 7")
	tx, _ := q.Next(1)
	q.Sent(&tx, now) // one packet of the retransmission went out
	out := q.Receive(nak(SynACK, 10), now)
	require.Len(t, out.Done, 2)
	assert.False(t, q.Pending(), "nothing left to send again")
	_, err := q.Post(Request{ID: 3, Kind: KindSend, Length: 1}, now)
	require.NoError(t, err)
	assert.Equal(t, []uint32{11}, sendAll(t, q, now))
}

// TestRequesterSetFirstPSN: a requester nothing was posted to starts where it is told
// (ibv_modify_qp's sq_psn after RTR); once a request is posted, its PSN stays.
func TestRequesterSetFirstPSN(t *testing.T) {
	q := NewRequester(RequesterConfig{MTU: 1024, FirstPSN: 10, Timeout: time.Millisecond, RetryCnt: 7, RNRRetry: 7})
	require.True(t, q.SetFirstPSN(psnMask)) // wraps after the first packet
	_, err := q.Post(Request{ID: 1, Kind: KindWrite, Length: 2048}, time.Unix(0, 0))
	require.NoError(t, err)
	tx, ok := q.Next(16)
	require.True(t, ok)
	require.Equal(t, uint32(psnMask), tx.Seg.PSN)
	require.False(t, q.SetFirstPSN(5))
	require.Equal(t, 2, q.InFlight())
}

// A run taken back before it went on the wire (Unsent, newest first) is sent again
// as what it was: packets never sent before are no retransmissions when they go
// out, and a go-back counts only what left. Retransmissions taken back are
// uncounted; a READ's PSNs are its response's.
func TestRequesterUnsent(t *testing.T) {
	const mtu = 256
	now := time.Unix(0, 0)
	q := NewRequester(RequesterConfig{MTU: mtu, FirstPSN: 100, Timeout: time.Second, RetryCnt: 3, RNRRetry: 7})
	_, err := q.Post(Request{ID: 1, Kind: KindWrite, Length: 8 * mtu, RKey: 1}, now)
	require.NoError(t, err)
	send := func() []Segment {
		var runs []Segment
		for q.Pending() {
			tx, _ := q.Next(2)
			q.Sent(&tx, now)
			runs = append(runs, tx.Seg)
		}
		return runs
	}
	runs := send()
	require.Len(t, runs, 4)
	assert.Zero(t, runs[3].Resent)
	// The link took back the last two: 104..107 never left.
	q.Unsent(&runs[3])
	q.Unsent(&runs[2])
	st := q.Stats()
	assert.Equal(t, uint64(4), st.Unsent)
	assert.Zero(t, st.Retransmitted)

	out := q.Receive(nak(RNR(1), 102), now)
	require.Positive(t, out.RNRWait)
	assert.Equal(t, uint64(2), q.Stats().MaxGoBack, "only 102 and 103 left")
	q.Resume(now)
	runs = send()
	require.Len(t, runs, 3)
	assert.Equal(t, []uint16{2, 0, 0}, []uint16{runs[0].Resent, runs[1].Resent, runs[2].Resent})
	assert.Equal(t, uint64(2), q.Stats().Retransmitted, "104..107 went out once")

	// A retransmission taken back is uncounted, and fresh stays.
	q.Receive(nak(SynNAKPSNSeqError, 104), now)
	runs = send()
	require.Len(t, runs, 2)
	require.Equal(t, uint16(2), runs[1].Resent)
	q.Unsent(&runs[1])
	assert.Equal(t, uint64(4), q.Stats().Retransmitted)
	again := send()
	require.Len(t, again, 1)
	assert.Equal(t, uint32(106), again[0].PSN)
	assert.Equal(t, uint16(2), again[0].Resent, "106 and 107 were sent before")
	assert.Equal(t, uint64(6), q.Stats().Retransmitted)

	// A READ request is one packet whose PSNs are its response's.
	_, err = q.Post(Request{ID: 2, Kind: KindReadRequest, Length: 4 * mtu, RKey: 1}, now)
	require.NoError(t, err)
	runs = send()
	require.Len(t, runs, 1)
	q.Unsent(&runs[0])
	runs = send()
	require.Len(t, runs, 1)
	assert.Equal(t, uint32(108), runs[0].PSN)
	assert.Zero(t, runs[0].Resent, "never sent before")
	assert.Equal(t, uint64(6), q.Stats().Retransmitted)
}
