package roce

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// memory is a responder's registered memory for the session tests.
type memory struct {
	mu  sync.Mutex
	b   []byte
	rnr int // RNR NAKs still to answer (the first requests)
}

func (m *memory) Execute(msg *Message, duplicate bool) Answer {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.rnr > 0 && !duplicate {
		m.rnr--
		return Answer{RNR: true, Timer: 1}
	}
	switch msg.Kind {
	case KindWrite:
		if msg.VA+uint64(len(msg.Payload)) > uint64(len(m.b)) {
			return Answer{NAK: SynNAKRemoteAccess}
		}
		copy(m.b[msg.VA:], msg.Payload)
	case KindFetchAdd:
		if msg.VA+8 > uint64(len(m.b)) {
			return Answer{NAK: SynNAKRemoteAccess}
		}
		orig := binary.LittleEndian.Uint64(m.b[msg.VA:])
		binary.LittleEndian.PutUint64(m.b[msg.VA:], orig+msg.Swap)
		return Answer{Response: &Message{Orig: orig}}
	case KindReadRequest:
		if msg.VA+uint64(msg.DMALen) > uint64(len(m.b)) {
			return Answer{NAK: SynNAKRemoteAccess}
		}
		return Answer{Response: &Message{Payload: append([]byte(nil), m.b[msg.VA:msg.VA+uint64(msg.DMALen)]...)}}
	}
	return Answer{}
}

func (m *memory) Complete(Completion) {}
func (m *memory) Lost(error)          {}

// requester is a Handler that only posts: its completions go to a channel.
type requester struct {
	done chan Completion
	lost chan error
}

func newRequester() *requester {
	return &requester{done: make(chan Completion, 4096), lost: make(chan error, 1)}
}

func (r *requester) Execute(*Message, bool) Answer { return Answer{NAK: SynNAKRemoteAccess} }
func (r *requester) Complete(c Completion)         { r.done <- c }
func (r *requester) Lost(err error)                { r.lost <- err }

// WRITE and READ over real UDP sockets with 1% of the packets lost (and some
// duplicated and reordered) by the injector: every message completes, in order, with
// the right data, and the retransmissions are counted.
func TestSessionOverLossyUDP(t *testing.T) {
	for _, loss := range []float64{0, 0.01} {
		t.Run(fmt.Sprint(loss), func(t *testing.T) {
			lim := Limits{MTU: 1024, MaxMessage: 1 << 20}
			inj := Loss{Seed: 7, Drop: loss, Duplicate: loss / 2, Reorder: loss}
			la, err := Listen(netipAP("127.0.0.1:0"), lim, inj)
			require.NoError(t, err)
			lb, err := Listen(netipAP("127.0.0.2:0"), lim, inj)
			require.NoError(t, err)
			mem := &memory{b: make([]byte, 1<<20), rnr: 2} // 100 slots of 8 KiB
			// Every timeout resends the whole window (up to a thousand packets here).
			// At GOMAXPROCS=1 under the race detector a 5 ms timeout fired again before
			// the responder had worked through the last resend, eight times running,
			// with no packet lost (RETRY_EXC_ERR in 5 of 60 runs); 20 ms leaves it the time.
			cfg := SessionConfig{Requester: RequesterConfig{Timeout: 20 * time.Millisecond, RetryCnt: 7, RNRRetry: 7, FirstPSN: 100}, PeerPSN: 5000}
			cfg.LocalQPN, cfg.PeerQPN = 0x11, 0x22
			ra := newRequester()
			a := NewSession(la.Dial(lb.LocalAddr()), cfg, ra)
			defer a.Close()
			cfgB := cfg
			cfgB.Requester.FirstPSN, cfgB.PeerPSN = 5000, 100
			cfgB.LocalQPN, cfgB.PeerQPN = 0x22, 0x11
			b := NewSession(lb.Dial(la.LocalAddr()), cfgB, mem)
			defer b.Close()

			rng := rand.New(rand.NewPCG(1, 2))
			type op struct {
				read bool
				va   uint64
				data []byte
			}
			// Each WRITE fills a slot of its own and each READ reads back the slot the
			// WRITE before it filled. Slots are never written twice: a READ whose
			// response is lost is executed again, after the requests that followed
			// it, and IBTA lets that re-read see their writes.
			var ops []op
			const n, slot = 200, 8192
			for i := 0; i < n; i++ {
				if i%2 == 0 {
					data := make([]byte, 1+rng.IntN(slot))
					for j := range data {
						data[j] = byte(rng.Uint32())
					}
					ops = append(ops, op{va: uint64(i / 2 * slot), data: data})
				} else {
					ops = append(ops, op{read: true, va: ops[i-1].va, data: ops[i-1].data})
				}
			}
			go func() { // posting while completions are read
				for i, o := range ops {
					m := Message{Kind: KindWrite, VA: o.va, RKey: 1, Payload: o.data}
					if o.read {
						m = Message{Kind: KindReadRequest, VA: o.va, RKey: 1, DMALen: uint32(len(o.data))}
					}
					if err := a.Post(uint64(i), m); err != nil {
						t.Errorf("post %d: %v", i, err)
						return
					}
				}
			}()
			for i := 0; i < n; i++ {
				var c Completion
				select {
				case c = <-ra.done:
				case <-time.After(60 * time.Second): // a hang detector
					t.Fatalf("completion %d never came (%+v)", i, a.RequesterStats())
				}
				require.EqualValues(t, i, c.ID, "in order")
				require.Equal(t, StatusSuccess, c.Status, "message %d", i)
				if ops[i].read {
					require.NotNil(t, c.Response, "READ %d", i)
					require.True(t, bytes.Equal(ops[i].data, c.Response.Payload), "READ %d", i)
				}
			}
			st := a.RequesterStats()
			t.Logf("requester %+v, link %+v", st, la.Stats())
			assert.EqualValues(t, 2, st.RNRNAKs, "the first requests were RNR NAKed")
			if loss > 0 {
				assert.Positive(t, st.Retransmitted)
				assert.Positive(t, la.Stats().Dropped)
			}
		})
	}
}

func (m *memory) Reload(uint64, []byte) error    { return nil }
func (r *requester) Reload(uint64, []byte) error { return nil }

// Atomics over a pipe that loses half of the responses and doubles half of the
// requests: a lost response is recovered by the requester's timer, and the
// responder answers the duplicate from the result it kept (IBTA 9.7.5.1.5), never
// by executing the atomic again.
func TestSessionDuplicateAtomics(t *testing.T) {
	lim := Limits{MTU: 1024, MaxMessage: 1 << 16}
	pa, pb, err := Pipe(lim, Loss{})
	require.NoError(t, err)
	// Faults apply to what each end sends: requests from a, responses from b.
	pa.(*pipeEnd).inj = newInjector(Loss{Seed: 3, Duplicate: 0.5})
	pb.(*pipeEnd).inj = newInjector(Loss{Seed: 4, Drop: 0.5})
	cfg := SessionConfig{Requester: RequesterConfig{Timeout: 2 * time.Millisecond, RetryCnt: 7, RNRRetry: 7, FirstPSN: 10},
		PeerPSN: 20, LocalQPN: 1, PeerQPN: 2}
	ra := newRequester()
	a := NewSession(pa, cfg, ra)
	defer a.Close()
	cfg.Requester.FirstPSN, cfg.PeerPSN, cfg.LocalQPN, cfg.PeerQPN = 20, 10, 2, 1
	mem := &memory{b: make([]byte, 64)}
	b := NewSession(pb, cfg, mem)
	defer b.Close()
	const n = 200
	for i := 0; i < n; i++ {
		require.NoError(t, a.Post(uint64(i), Message{Kind: KindFetchAdd, VA: 8, RKey: 1, Swap: 3}))
		var c Completion
		select {
		case c = <-ra.done:
		case <-time.After(60 * time.Second): // a hang detector
			t.Fatalf("fetch-add %d never completed (%+v)", i, a.RequesterStats())
		}
		require.Equal(t, StatusSuccess, c.Status, "fetch-add %d (%+v)", i, a.RequesterStats())
		require.EqualValues(t, 3*i, c.Response.Orig, "fetch-add %d: the original value", i)
	}
	mem.mu.Lock()
	defer mem.mu.Unlock()
	assert.EqualValues(t, 3*n, binary.LittleEndian.Uint64(mem.b[8:]), "each fetch-add executed once")
	assert.Positive(t, a.RequesterStats().Timeouts, "responses were lost")
}

// blocked is a responder whose first request waits until released.
type blocked struct {
	release chan struct{}
	once    sync.Once
}

func (b *blocked) Execute(*Message, bool) Answer {
	b.once.Do(func() { <-b.release })
	return Answer{}
}
func (b *blocked) Complete(Completion)         {}
func (b *blocked) Lost(error)                  {}
func (b *blocked) Reload(uint64, []byte) error { return nil }

// A peer that floods a responder stuck on one request makes it hold a bounded
// number of packets: beyond maxQueuedBatches batches they are dropped and counted,
// as a NIC's full receive queue drops them.
func TestSessionBoundsQueuedRequests(t *testing.T) {
	lim := Limits{MTU: 256, MaxMessage: 1 << 16}
	pa, pb, err := Pipe(lim, Loss{})
	require.NoError(t, err)
	var c Counters
	h := &blocked{release: make(chan struct{})}
	s := NewSession(pb, SessionConfig{LocalQPN: 2, PeerQPN: 1, Counters: []*Counters{&c}, ExecuteWaits: true}, h)
	defer s.Close()
	defer close(h.release)
	const n = 200000
	for i := 0; i < n; i++ {
		p := Packet{Opcode: WriteOnly, DestQP: 2, PSN: uint32(i), RKey: 1, DMALen: 8, Payload: make([]byte, 8)}
		require.NoError(t, pa.SendBatch([]Packet{p}))
	}
	for s.port.Stats().Received < n { // the receive loop takes them all
		runtime.Gosched()
	}
	assert.LessOrEqual(t, s.requests.Len(), maxQueuedBatches)
	assert.Positive(t, c.Dropped.Load(), "packets beyond the bound were dropped")
}

// blockedRequester is a blocked responder that posts too: its completions go to a
// channel.
type blockedRequester struct {
	blocked
	done chan Completion
}

func (b *blockedRequester) Complete(c Completion) { b.done <- c }

// completing is a memory that posts too: its completions go to a channel.
type completing struct {
	*memory
	done chan Completion
}

func (c completing) Complete(cp Completion) { c.done <- cp }

// With ExecuteWaits, a request whose Execute waits holds up neither the session's
// own messages nor their ACKs: B's WRITE to A completes while B's responder waits
// on A's WRITE, which then completes once Execute returns.
func TestSessionExecuteWaits(t *testing.T) {
	lim := Limits{MTU: 256, MaxMessage: 1 << 16}
	pa, pb, err := Pipe(lim, Loss{})
	require.NoError(t, err)
	ha := &memory{b: make([]byte, 4096)}
	ra := completing{memory: ha, done: make(chan Completion, 1)}
	a := NewSession(pa, SessionConfig{LocalQPN: 1, PeerQPN: 2}, ra)
	defer a.Close()
	hb := &blockedRequester{blocked: blocked{release: make(chan struct{})}, done: make(chan Completion, 1)}
	b := NewSession(pb, SessionConfig{LocalQPN: 2, PeerQPN: 1, ExecuteWaits: true}, hb)
	defer b.Close()

	require.NoError(t, a.Post(1, Message{Kind: KindWrite, VA: 0, RKey: 1, Payload: []byte("waits")}))
	require.NoError(t, b.Post(7, Message{Kind: KindWrite, VA: 8, RKey: 1, Payload: []byte("goes")}))
	assert.Equal(t, Completion{ID: 7, Status: StatusSuccess}, <-hb.done, "B's WRITE completed while its responder waited")
	ha.mu.Lock()
	assert.Equal(t, "goes", string(ha.b[8:12]))
	ha.mu.Unlock()
	select {
	case c := <-ra.done:
		t.Fatalf("A's WRITE completed while B's Execute still waited: %+v", c)
	default:
	}
	close(hb.release)
	assert.Equal(t, Completion{ID: 1, Status: StatusSuccess}, <-ra.done)
}
