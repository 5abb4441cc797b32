package roce

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// wirePair runs a requester against a responder over a simulated wire that makes
// the faults a Link's injector makes, with a seeded generator, and a memory the
// responder writes and reads. Time is simulated: the ACK timer fires when nothing
// is in flight.
type wirePair struct {
	t      *testing.T
	req    *Requester
	resp   *Responder
	mem    []byte
	rng    *rand.Rand
	loss   float64
	now    time.Time
	toResp []Packet
	toReq  []Packet
	held   map[*[]Packet][]Packet // per direction: the packet held back, sent after the next
	done   []Completion
	rnr    map[uint32]int // PSN -> RNR NAKs the responder still answers for it
}

// deliver puts ps on the wire q as Link sends with Loss{Drop: loss, Duplicate:
// loss/2, Reorder: loss}: each packet is dropped, sent twice, or held back and
// sent after the next one.
func (w *wirePair) deliver(ps []Packet, q *[]Packet) {
	if w.held == nil {
		w.held = map[*[]Packet][]Packet{}
	}
	for _, p := range ps {
		held := w.held[q]
		w.held[q] = nil
		switch r := w.rng.Float64(); {
		case r < w.loss: // dropped
		case r < 1.5*w.loss:
			*q = append(*q, p, p)
		case r < 2.5*w.loss && held == nil:
			w.held[q] = []Packet{p}
		default:
			*q = append(*q, p)
		}
		*q = append(*q, held...)
	}
}

// respond executes a WRITE or READ at the responder and sends its answer.
func (w *wirePair) respond(m *Message) {
	if m.Kind == KindWrite {
		copy(w.mem[m.VA:], m.Payload)
	}
	if m.Kind == KindReadRequest {
		data := append([]byte(nil), w.mem[m.VA:m.VA+uint64(m.DMALen)]...)
		ps, err := Segment(&Message{Kind: KindReadResponse, PSN: m.PSN, Payload: data, Syndrome: SynACK}, w.req.cfg.MTU)
		require.NoError(w.t, err)
		w.deliver(ps, &w.toReq)
		return
	}
	ps, err := Segment(w.resp.Ack(), w.req.cfg.MTU)
	require.NoError(w.t, err)
	w.deliver(ps, &w.toReq)
}

// run moves packets until every message completed; it fails after too many steps.
func (w *wirePair) run(o Output) {
	w.handle(o)
	for step := 0; w.req.Outstanding() > 0; step++ {
		require.Less(w.t, step, 100000, "no progress")
		switch {
		case len(w.toResp) > 0:
			p := w.toResp[0]
			w.toResp = w.toResp[1:]
			act, m, r := w.resp.Receive(&p)
			switch act {
			case ActExecute:
				if w.rnr[m.PSN] > 0 {
					w.rnr[m.PSN]--
					w.deliver([]Packet{mustOne(w.t, w.resp.RNR(m, 1))}, &w.toReq)
					continue
				}
				if m.Kind == KindFetchAdd {
					orig := uint64(w.mem[m.VA])
					w.mem[m.VA] += byte(m.Swap)
					resp := &Message{Kind: KindAtomicAck, PSN: m.PSN, Orig: orig, Syndrome: SynACK}
					w.resp.Executed(m, resp)
					w.deliver([]Packet{mustOne(w.t, resp)}, &w.toReq)
					continue
				}
				w.resp.Executed(m, nil)
				w.respond(m)
			case ActNAK:
				w.deliver([]Packet{mustOne(w.t, r)}, &w.toReq)
			case ActDuplicate:
				if m != nil {
					w.respond(m) // a READ, read again
				} else {
					w.deliver([]Packet{mustOne(w.t, r)}, &w.toReq)
				}
			}
		case len(w.toReq) > 0:
			p := w.toReq[0]
			w.toReq = w.toReq[1:]
			w.handle(w.req.Receive(&p, w.now))
		default: // nothing in flight: time passes until the ACK timer fires
			w.now = w.now.Add(w.req.cfg.Timeout)
			w.handle(w.req.Tick(w.now))
		}
	}
}

func (w *wirePair) handle(o Output) {
	w.done = append(w.done, o.Done...)
	w.deliver(o.Send, &w.toResp)
	if o.RNRWait > 0 {
		w.now = w.now.Add(o.RNRWait)
		w.handle(w.req.Resend(o, w.now))
	}
}

func mustOne(t *testing.T, m *Message) Packet {
	ps, err := Segment(m, 256)
	require.NoError(t, err)
	require.Len(t, ps, 1)
	return ps[0]
}

// Requester and responder over a lossy wire: WRITEs, READs and fetch-adds of many
// packets all complete, in order, with the right data, and each fetch-add executes
// exactly once however often it is retransmitted.
func TestRequesterResponderOverLoss(t *testing.T) {
	for _, loss := range []float64{0, 0.01, 0.05} {
		for seed := uint64(1); seed <= 5; seed++ {
			t.Run(fmt.Sprintf("loss=%v/seed=%d", loss, seed), func(t *testing.T) {
				const mtu = 256
				lim := Limits{MTU: mtu, MaxMessage: 1 << 16}
				w := &wirePair{t: t, rng: rand.New(rand.NewPCG(seed, 3)), loss: loss, mem: make([]byte, 1<<16),
					req:  NewRequester(RequesterConfig{MTU: mtu, FirstPSN: psnMask - 3, Timeout: time.Millisecond, RetryCnt: 7, RNRRetry: 7}),
					resp: NewResponder(psnMask-3, lim, 16), now: time.Unix(0, 0), rnr: map[uint32]int{}}
				src := make([]byte, 4096)
				for i := range src {
					src[i] = byte(i * 7)
				}
				var reads [][]byte
				id := uint64(0)
				for i := 0; i < 20; i++ {
					n := 1 + (i*389)%2000
					id++
					o, err := w.req.Post(id, Message{Kind: KindWrite, VA: uint64(i * 2048), RKey: 1, Payload: src[:n]}, w.now)
					require.NoError(t, err)
					w.run(o)
					id++
					o, err = w.req.Post(id, Message{Kind: KindReadRequest, VA: uint64(i * 2048), RKey: 1, DMALen: uint32(n)}, w.now)
					require.NoError(t, err)
					w.run(o)
					id++
					o, err = w.req.Post(id, Message{Kind: KindFetchAdd, VA: 65535, RKey: 1, Swap: 1}, w.now)
					require.NoError(t, err)
					w.run(o)
					reads = append(reads, src[:n])
				}
				require.Len(t, w.done, int(id))
				r := 0
				for i, c := range w.done {
					require.EqualValues(t, i+1, c.ID, "completions in order")
					require.Equal(t, StatusSuccess, c.Status, "message %d", c.ID)
					switch i % 3 {
					case 1:
						require.True(t, bytes.Equal(reads[r], c.Response.Payload), "READ %d", r)
						r++
					case 2:
						assert.EqualValues(t, i/3, c.Response.Orig, "fetch-add %d executed exactly once", i/3)
					}
				}
				assert.EqualValues(t, 20, w.mem[65535])
			})
		}
	}
}

// A WRITE of many packets that the responder first answers with an RNR NAK (an ODP
// fault), over 1% loss: the responder goes back to the message's first packet,
// and its sequence NAKs after that are progress, not retries, whether the RNR NAK
// arrived or was lost. Before the requester knew that, about one seed in 200
// failed the WRITE with RETRY_EXC_ERR and no timeout.
func TestRequesterLargeWriteAfterRNROverLoss(t *testing.T) {
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
		w := &wirePair{t: t, rng: rand.New(rand.NewPCG(seed, 4)), loss: 0.01, mem: make([]byte, size),
			req:  NewRequester(RequesterConfig{MTU: mtu, FirstPSN: 100, Timeout: time.Millisecond, RetryCnt: 7, RNRRetry: 7}),
			resp: NewResponder(100, Limits{MTU: mtu, MaxMessage: size}, 16), now: time.Unix(0, 0), rnr: map[uint32]int{100: 1}}
		o, err := w.req.Post(1, Message{Kind: KindWrite, RKey: 1, Payload: src}, w.now)
		require.NoError(t, err)
		w.run(o)
		require.Len(t, w.done, 1)
		require.Equal(t, StatusSuccess, w.done[0].Status, "seed %d: %+v", seed, w.req.Stats())
		require.True(t, bytes.Equal(src, w.mem), "seed %d", seed)
		st := w.req.Stats()
		stats.SeqNAKs += st.SeqNAKs
		stats.RNRNAKs += st.RNRNAKs
	}
	assert.Greater(t, stats.SeqNAKs, 2*seeds, "the loss made sequence NAKs")
	assert.Greater(t, stats.RNRNAKs, seeds*9/10, "RNR NAKs arrived, mostly")
}

// Sequence NAKs count as retries unless the responder took packets since it last
// said what it expects; after an RNR NAK, arrived or lost, it expects the
// message's first packet again.
func TestRequesterRetriesAfterRNR(t *testing.T) {
	const mtu = 256
	nak := func(syn Syndrome, psn uint32) *Packet {
		p := mustOne(t, &Message{Kind: KindAck, Syndrome: syn, PSN: psn})
		return &p
	}
	now := time.Unix(0, 0)
	for _, rnrLost := range []bool{false, true} {
		t.Run(fmt.Sprintf("rnrLost=%v", rnrLost), func(t *testing.T) {
			q := NewRequester(RequesterConfig{MTU: mtu, FirstPSN: 100, Timeout: time.Millisecond, RetryCnt: 3, RNRRetry: 7})
			_, err := q.Post(1, Message{Kind: KindWrite, RKey: 1, Payload: make([]byte, 64*mtu)}, now)
			require.NoError(t, err)
			// Packets reordered near the end: two NAKs, each progress.
			for _, psn := range []uint32{150, 151} {
				out := q.Receive(nak(SynNAKPSNSeqError, psn), now)
				require.Empty(t, out.Done)
				require.Len(t, out.Send, 164-int(psn), "go-back-N from %d", psn)
			}
			// The whole message arrived; the responder answers RNR NAK and goes back.
			if !rnrLost {
				out := q.Receive(nak(RNR(1), 100), now)
				require.Positive(t, out.RNRWait)
				require.Len(t, q.Resend(out, now).Send, 64)
			}
			// Then loss in the message's first half: NAKs at ever later PSNs, more
			// than RetryCnt of them, all progress. With the RNR NAK lost, the first
			// one is behind what the responder said last and counts.
			for psn := uint32(105); psn < 115; psn++ {
				out := q.Receive(nak(SynNAKPSNSeqError, psn), now)
				require.Empty(t, out.Done, "NAK %d", psn)
				require.NotEmpty(t, out.Send, "NAK %d", psn)
			}
			// The same NAK again and again is no progress: with the retransmission
			// that NAK 114 asked for, the third repeat exceeds RetryCnt.
			for i := 1; i <= 3; i++ {
				out := q.Receive(nak(SynNAKPSNSeqError, 114), now)
				if i < 3 {
					require.Empty(t, out.Done, "repeat %d", i)
					continue
				}
				require.Equal(t, []Completion{{ID: 1, Status: StatusRetryExceeded}}, out.Done)
			}
		})
	}
}

func TestRequesterRNRAndFailures(t *testing.T) {
	const mtu = 256
	lim := Limits{MTU: mtu, MaxMessage: 1 << 16}
	newPair := func(rnrRetry, retryCnt int) *wirePair {
		return &wirePair{t: t, rng: rand.New(rand.NewPCG(1, 1)), mem: make([]byte, 1<<16),
			req:  NewRequester(RequesterConfig{MTU: mtu, Timeout: time.Millisecond, RetryCnt: retryCnt, RNRRetry: rnrRetry}),
			resp: NewResponder(0, lim, 4), now: time.Unix(0, 0), rnr: map[uint32]int{}}
	}
	// Two RNR NAKs, retried.
	w := newPair(7, 7)
	w.rnr[0] = 2
	o, err := w.req.Post(1, Message{Kind: KindWrite, VA: 0, RKey: 1, Payload: []byte("abc")}, w.now)
	require.NoError(t, err)
	w.run(o)
	require.Len(t, w.done, 1)
	assert.Equal(t, StatusSuccess, w.done[0].Status)
	assert.Equal(t, "abc", string(w.mem[:3]))
	assert.Equal(t, time.Unix(0, 0).Add(2*RNRTimer(1)), w.now, "it waited two RNR timers")

	// rnr_retry 1 and two RNR NAKs: RNR_RETRY_EXC, what follows flushed.
	w = newPair(1, 7)
	w.rnr[0] = 2
	o, err = w.req.Post(1, Message{Kind: KindSend, Payload: []byte("x")}, w.now)
	require.NoError(t, err)
	o2, err := w.req.Post(2, Message{Kind: KindSend, Payload: []byte("y")}, w.now)
	require.NoError(t, err)
	o.Send = append(o.Send, o2.Send...)
	w.run(o)
	require.Len(t, w.done, 2)
	assert.Equal(t, StatusRNRRetryExceeded, w.done[0].Status)
	assert.Equal(t, StatusFlushed, w.done[1].Status)
	o, err = w.req.Post(3, Message{Kind: KindSend}, w.now)
	require.NoError(t, err)
	assert.Equal(t, []Completion{{ID: 3, Status: StatusFlushed}}, o.Done, "a failed QP flushes what is posted")

	// A peer that never answers: RETRY_EXC after RetryCnt timeouts.
	w = newPair(7, 3)
	w.loss = 1 // everything is lost
	o, err = w.req.Post(1, Message{Kind: KindSend, Payload: []byte("x")}, w.now)
	require.NoError(t, err)
	w.run(o)
	require.Len(t, w.done, 1)
	assert.Equal(t, StatusRetryExceeded, w.done[0].Status)
	assert.Equal(t, time.Unix(0, 0).Add(4*time.Millisecond), w.now, "three retransmissions, four timeouts")

	// A remote access NAK fails the message.
	q := NewRequester(RequesterConfig{MTU: mtu, Timeout: time.Millisecond, RetryCnt: 7, RNRRetry: 7})
	_, err = q.Post(1, Message{Kind: KindWrite, VA: 1, RKey: 9, Payload: []byte("z")}, time.Unix(0, 0))
	require.NoError(t, err)
	nak := mustOne(t, &Message{Kind: KindAck, Syndrome: SynNAKRemoteAccess, PSN: 0})
	out := q.Receive(&nak, time.Unix(0, 0))
	assert.Equal(t, []Completion{{ID: 1, Status: StatusRemoteAccess}}, out.Done)
}
