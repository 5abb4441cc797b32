package odp

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// srqSide is a device with an SRQ and n RC QPs receiving from it, each connected
// to a QP of its own on a sending device.
type srqSide struct {
	send, recv *node
	srq        *SRQ
	senders    []*QP // senders[i] is connected to receivers[i]
	receivers  []*QP
}

func newSRQSide(t *testing.T, cfg Config, n int, srqCfg SRQConfig) *srqSide {
	t.Helper()
	s := &srqSide{send: newNode(t, cfg), recv: newNode(t, cfg)}
	var err error
	s.srq, err = s.recv.pd.CreateSRQ(srqCfg)
	require.NoError(t, err)
	for range n {
		a, err := s.send.pd.CreateQP(QPConfig{SendCQ: s.send.scq, RecvCQ: s.send.rcq, MaxSendWR: 256})
		require.NoError(t, err)
		b, err := s.recv.pd.CreateQP(QPConfig{SendCQ: s.recv.scq, RecvCQ: s.recv.rcq, SRQ: s.srq})
		require.NoError(t, err)
		require.NoError(t, ConnectLoopback(a, b))
		s.senders, s.receivers = append(s.senders, a), append(s.receivers, b)
	}
	return s
}

// Two QPs receive from one SRQ: each SEND takes the oldest receive posted, whichever
// QP it arrives on, and its completion names that QP; the payload lands in that
// receive's buffer. Pinned and ODP receive buffers (every page of the ODP one
// faults when its first SEND arrives, and the receive waits for it).
func TestSRQSharedByTwoQPs(t *testing.T) {
	for _, mode := range memModes {
		t.Run(mode.name, func(t *testing.T) {
			s := newSRQSide(t, Config{ResponderFaults: FaultRNR}, 2, SRQConfig{MaxWR: 64})
			src, smr := s.send.region(t, 16*ps, rw)
			dst, dmr := s.recv.region(t, 16*ps, rw|mode.odp)
			for i := range src {
				src[i] = byte(i*5 + 3)
			}
			const msgs = 16
			for i := range msgs {
				require.NoError(t, s.srq.PostRecv(RecvWR{WRID: uint64(100 + i), SGL: sge(dmr, i*ps, ps)}))
			}
			assert.Equal(t, msgs, s.srq.Len())
			byQP := map[uint32]int{}
			for i := range msgs {
				qp := s.senders[i%2]
				require.NoError(t, qp.PostSend(SendWR{WRID: uint64(i), Opcode: OpSend, SGL: sge(smr, i*ps, 1000+i),
					Flags: SendSignaled}))
				wc := wait(t, s.send.scq)
				require.Equal(t, WCSuccess, wc.Status, wc.Detail)
				rwc := wait(t, s.recv.rcq)
				require.Equal(t, WC{WRID: uint64(100 + i), Opcode: WCRecv, ByteLen: uint32(1000 + i),
					QPNum: s.receivers[i%2].QPNum()}, rwc, rwc.Detail)
				require.Equal(t, src[i*ps:i*ps+1000+i], dst[i*ps:i*ps+1000+i])
				byQP[rwc.QPNum]++
			}
			assert.Equal(t, map[uint32]int{s.receivers[0].QPNum(): msgs / 2, s.receivers[1].QPNum(): msgs / 2}, byQP)
			assert.Zero(t, s.srq.Len())
			if mode.odp != 0 {
				assert.NotZero(t, s.recv.dev.Stats().PageFaults, "the ODP receive buffers faulted")
			}
		})
	}
}

// A SEND that finds the SRQ empty is answered RNR NAK until a receive is posted to
// the SRQ; a SEND whose receive buffer faults (ODP, RNR policy) keeps the receive it
// took across the RNR NAK and its retransmission: exactly one receive per message
// is consumed.
func TestSRQEmptyAndFaultingReceives(t *testing.T) {
	s := newSRQSide(t, Config{ResponderFaults: FaultRNR}, 1, SRQConfig{MaxWR: 8})
	_, smr := s.send.region(t, 4*ps, rw)
	_, dmr := s.recv.region(t, 64*ps, rw|AccessOnDemand)
	require.NoError(t, s.receivers[0].ModifyAttr(QPAttr{MinRNRTimer: 1}, AttrMinRNRTimer))
	require.NoError(t, s.senders[0].ModifyAttr(QPAttr{RNRRetry: 7}, AttrRNRRetry))

	require.NoError(t, s.senders[0].PostSend(SendWR{WRID: 1, Opcode: OpSend, SGL: sge(smr, 0, 3*ps), Flags: SendSignaled}))
	// The SEND is refused until a receive is there: wait for an RNR NAK.
	require.Eventually(t, func() bool { return s.senders[0].Stats().RNRNaksReceived > 0 }, 10*time.Second, time.Millisecond)
	rnrs := s.senders[0].Stats().RNRNaksReceived
	// Two receives over pages never touched: the first SEND faults on its buffer.
	require.NoError(t, s.srq.PostRecv(RecvWR{WRID: 10, SGL: sge(dmr, 8*ps, 3*ps)}))
	require.NoError(t, s.srq.PostRecv(RecvWR{WRID: 11, SGL: sge(dmr, 32*ps, 3*ps)}))
	wc := wait(t, s.send.scq)
	require.Equal(t, WCSuccess, wc.Status, wc.Detail)
	rwc := wait(t, s.recv.rcq)
	require.Equal(t, WC{WRID: 10, Opcode: WCRecv, ByteLen: uint32(3 * ps), QPNum: s.receivers[0].QPNum()}, rwc, rwc.Detail)
	assert.Greater(t, s.senders[0].Stats().RNRNaksReceived, rnrs, "the faulting receive buffer was answered RNR NAK")
	assert.Equal(t, 1, s.srq.Len(), "one receive consumed for one SEND")
}

// The limit event fires once when the SRQ drops below the armed limit, then stays
// disarmed until armed again.
func TestSRQLimitEvent(t *testing.T) {
	var events atomic.Int32
	s := newSRQSide(t, Config{}, 1, SRQConfig{MaxWR: 16, Limit: 3, OnLimit: func() { events.Add(1) }})
	_, smr := s.send.region(t, ps, rw)
	_, dmr := s.recv.region(t, 16*ps, rw)
	assert.Equal(t, SRQAttr{MaxWR: 16, MaxSGE: 16, Limit: 3}, s.srq.Attr())
	for i := range 6 {
		require.NoError(t, s.srq.PostRecv(RecvWR{WRID: uint64(i), SGL: sge(dmr, i*ps, ps)}))
	}
	send := func() {
		t.Helper()
		require.NoError(t, s.senders[0].PostSend(SendWR{Opcode: OpSend, SGL: sge(smr, 0, 8), Flags: SendSignaled}))
		require.Equal(t, WCSuccess, wait(t, s.send.scq).Status)
		require.Equal(t, WCSuccess, wait(t, s.recv.rcq).Status)
	}
	for range 3 { // 6 -> 3 posted: not below 3
		send()
	}
	assert.Zero(t, events.Load())
	send() // 2 < 3
	assert.EqualValues(t, 1, events.Load())
	assert.Zero(t, s.srq.Attr().Limit, "the event disarmed the limit")
	send()
	assert.EqualValues(t, 1, events.Load(), "disarmed: no second event")
	require.NoError(t, s.srq.Arm(2)) // 1 posted already: the next take raises it
	send()
	assert.EqualValues(t, 2, events.Load())
	assert.ErrorIs(t, s.srq.Arm(17), ErrInvalidArgument)
}

// Bad inputs: posting to a QP that receives from an SRQ, too many SGEs, destroying
// an SRQ or deallocating its PD while in use, an SRQ of another device, a receive
// whose lkey is outside the SRQ's PD (a local protection error), posting after
// destroy.
func TestSRQBadInputs(t *testing.T) {
	s := newSRQSide(t, Config{}, 1, SRQConfig{MaxWR: 4, MaxSGE: 2})
	_, smr := s.send.region(t, ps, rw)
	_, dmr := s.recv.region(t, 4*ps, rw)
	err := s.receivers[0].PostRecv(RecvWR{SGL: sge(dmr, 0, ps)})
	assert.ErrorIs(t, err, ErrInvalidArgument)
	err = s.srq.PostRecv(RecvWR{SGL: append(sge(dmr, 0, 8), append(sge(dmr, 8, 8), sge(dmr, 16, 8)...)...)})
	assert.ErrorIs(t, err, ErrInvalidArgument)
	for i := range 4 {
		require.NoError(t, s.srq.PostRecv(RecvWR{WRID: uint64(i), SGL: sge(dmr, i*ps, ps)}))
	}
	assert.ErrorIs(t, s.srq.PostRecv(RecvWR{SGL: sge(dmr, 0, ps)}), ErrQueueFull)
	assert.ErrorIs(t, s.srq.Destroy(), ErrBusy)
	assert.ErrorIs(t, s.recv.pd.Dealloc(), ErrBusy)
	_, err = s.recv.pd.CreateQP(QPConfig{SendCQ: s.recv.scq, RecvCQ: s.recv.rcq, SRQ: s.srq, MaxRecvWR: 4})
	assert.ErrorIs(t, err, ErrInvalidArgument, "a QP with an SRQ and a receive queue")
	_, err = s.send.pd.CreateQP(QPConfig{SendCQ: s.send.scq, RecvCQ: s.send.rcq, SRQ: s.srq})
	assert.ErrorIs(t, err, ErrInvalidArgument, "an SRQ of another device")
	_, err = s.recv.pd.CreateSRQ(SRQConfig{MaxWR: 4, Limit: 5})
	assert.ErrorIs(t, err, ErrInvalidArgument)

	// An SRQ in a second PD, whose receive names an MR of the first: the SEND's
	// receive fails with a local protection error and the QP goes to ERR.
	pd2, err := s.recv.dev.AllocPD()
	require.NoError(t, err)
	srq2, err := pd2.CreateSRQ(SRQConfig{MaxWR: 4})
	require.NoError(t, err)
	a, err := s.send.pd.CreateQP(QPConfig{SendCQ: s.send.scq, RecvCQ: s.send.rcq})
	require.NoError(t, err)
	b, err := s.recv.pd.CreateQP(QPConfig{SendCQ: s.recv.scq, RecvCQ: s.recv.rcq, SRQ: srq2})
	require.NoError(t, err)
	require.NoError(t, ConnectLoopback(a, b))
	require.NoError(t, srq2.PostRecv(RecvWR{WRID: 77, SGL: sge(dmr, 0, ps)}))
	require.NoError(t, a.PostSend(SendWR{Opcode: OpSend, SGL: sge(smr, 0, 8), Flags: SendSignaled}))
	rwc := wait(t, s.recv.rcq)
	assert.Equal(t, uint64(77), rwc.WRID)
	assert.Equal(t, WCLocProtErr, rwc.Status, rwc.Detail)
	assert.Contains(t, rwc.Detail, "another PD")
	assert.Equal(t, WCRemOpErr, wait(t, s.send.scq).Status)
	require.NoError(t, b.Destroy())
	require.NoError(t, srq2.Destroy())
	assert.ErrorIs(t, srq2.PostRecv(RecvWR{SGL: sge(dmr, 0, ps)}), ErrClosed)
	assert.ErrorIs(t, srq2.Destroy(), ErrClosed)
	require.NoError(t, pd2.Dealloc())
}

// perFault is the modelled fault of pendingSRQ's side: the longest a fault model
// allows, so that a receive's fault is pending while a test acts.
const perFault = time.Second

// pendingSRQ is an SRQ side of two QPs with maxWR receives, whose faults stall for
// perFault and are not widened, with an ODP receive region of 8 pages. take(i, left)
// SENDs on QP i and waits until the SEND took a receive, leaving left in the SRQ: its
// fault is then pending, the receive held.
func pendingSRQ(t *testing.T, maxWR int) (s *srqSide, dmr *MR, take func(i, left int)) {
	s = newSRQSide(t, Config{ResponderFaults: FaultStall, FaultAround: 1, FaultModel: FaultModel{PerFault: perFault}}, 2,
		SRQConfig{MaxWR: maxWR})
	_, smr := s.send.region(t, ps, rw)
	_, dmr = s.recv.region(t, 8*ps, rw|AccessOnDemand)
	take = func(i, left int) {
		t.Helper()
		require.NoError(t, s.senders[i].PostSend(SendWR{Opcode: OpSend, SGL: sge(smr, 0, 8)}))
		require.Eventually(t, func() bool { return s.srq.Len() == left }, 10*time.Second, time.Millisecond)
	}
	return s, dmr, take
}

// A QP that goes to ERR completes only the receive it took, with WR_FLUSH_ERR; the
// SRQ's other receives stay for its other QPs. A QP destroyed while it holds a
// receive (its SEND waits for a fault) gives the receive back. The faults take a
// second (the longest a fault model allows) and are not widened, so that each
// receive's fault is pending while the test acts; the destroy's check says what a
// machine too slow for that margin showed instead.
func TestSRQErrorAndDestroyKeepReceives(t *testing.T) {
	s, dmr, take := pendingSRQ(t, 8)
	for i := range 3 {
		require.NoError(t, s.srq.PostRecv(RecvWR{WRID: uint64(i), SGL: sge(dmr, 2*i*ps, ps)}))
	}
	// The SEND on QP 0 takes receive 0 and waits for its page.
	take(0, 2)
	require.NoError(t, s.receivers[0].Modify(StateError))
	rwc := wait(t, s.recv.rcq)
	assert.Equal(t, WC{WRID: 0, Status: WCWRFlushErr, Opcode: WCRecv, QPNum: s.receivers[0].QPNum()}, rwc)
	assert.Equal(t, 2, s.srq.Len(), "the SRQ's other receives stay")

	// QP 1 takes receive 1 and waits; destroyed meanwhile, it gives it back.
	start := time.Now()
	take(1, 1)
	require.NoError(t, s.receivers[1].Destroy())
	n, err := s.recv.rcq.Poll(make([]WC, 4))
	require.NoError(t, err)
	if time.Since(start) < perFault {
		assert.Equal(t, 2, s.srq.Len(), "the destroyed QP's receive is back in the SRQ")
		assert.Zero(t, n, "a destroyed QP completes nothing")
	} else { // the fault may have ended first: the receive was consumed by its SEND
		assert.Equal(t, 2, s.srq.Len()+n, "receive 1 is back in the SRQ or completed once")
	}
}

// A QP reset while it holds a receive (its SEND waits for a fault) gives the receive
// back, behind those posted since, and completes nothing; one destroyed while the SRQ
// has filled up behind it completes its receive with WR_FLUSH_ERR instead. The faults
// take a second and are not widened (see TestSRQErrorAndDestroyKeepReceives).
func TestSRQResetAndFullGiveBack(t *testing.T) {
	s, dmr, take := pendingSRQ(t, 2)
	for i := range 2 {
		require.NoError(t, s.srq.PostRecv(RecvWR{WRID: uint64(i), SGL: sge(dmr, 4*i*ps, ps)}))
	}
	start := time.Now()
	take(0, 1)
	require.NoError(t, s.receivers[0].Modify(StateReset))
	n, err := s.recv.rcq.Poll(make([]WC, 4))
	require.NoError(t, err)
	if time.Since(start) >= perFault {
		t.Skipf("the fault may have ended before the reset (%v): the machine is too slow for this test", time.Since(start))
	}
	assert.Equal(t, 2, s.srq.Len(), "the reset QP's receive is back in the SRQ")
	assert.Zero(t, n, "a reset QP completes nothing")

	// Receive 1 is the oldest now (0 went back behind it): QP 1 takes it and waits;
	// a receive posted meanwhile fills the SRQ, so the destroy cannot give it back.
	start = time.Now()
	take(1, 1)
	require.NoError(t, s.srq.PostRecv(RecvWR{WRID: 7, SGL: sge(dmr, 6*ps, ps)}))
	require.NoError(t, s.receivers[1].Destroy())
	if time.Since(start) >= perFault {
		t.Skipf("the fault may have ended before the destroy (%v): the machine is too slow for this test", time.Since(start))
	}
	rwc := wait(t, s.recv.rcq)
	assert.Equal(t, WC{WRID: 1, Status: WCWRFlushErr, Opcode: WCRecv, QPNum: s.receivers[1].QPNum()}, rwc)
	assert.Equal(t, 2, s.srq.Len())
}

// UD QPs receive from an SRQ too: datagrams to two UD QPs take its receives in order.
func TestSRQUD(t *testing.T) {
	const qkey = 0x2222
	a := udNode(t, Config{}, "127.0.0.1:0", qkey)
	b := newNode(t, Config{})
	srq, err := b.pd.CreateSRQ(SRQConfig{MaxWR: 8})
	require.NoError(t, err)
	_, smr := a.region(t, ps, rw)
	_, dmr := b.region(t, 4*ps, rw)
	var dests []*UDDest
	var qps []*QP
	for i := range 2 {
		qp, err := b.pd.CreateQP(QPConfig{Type: QPTypeUD, SendCQ: b.scq, RecvCQ: b.rcq, SRQ: srq})
		require.NoError(t, err)
		require.NoError(t, qp.ModifyAttr(QPAttr{QKey: qkey}, AttrQKey))
		require.NoError(t, qp.BindUD(netip.MustParseAddrPort(fmt.Sprintf("127.0.0.%d:0", 2+i)), 4096))
		dests = append(dests, &UDDest{Addr: qp.UDAddr(), QPN: qp.QPNum(), QKey: qkey})
		qps = append(qps, qp)
	}
	for i := range 4 {
		require.NoError(t, srq.PostRecv(RecvWR{WRID: uint64(i), SGL: sge(dmr, i*ps, GRHSize+100)}))
	}
	for i := range 4 {
		require.NoError(t, a.qp.PostSend(SendWR{Opcode: OpSend, SGL: sge(smr, 0, 100), Flags: SendSignaled, UD: dests[i%2]}))
		require.Equal(t, WCSuccess, wait(t, a.scq).Status)
		rwc := wait(t, b.rcq)
		require.Equal(t, WC{WRID: uint64(i), Opcode: WCRecv, ByteLen: GRHSize + 100, QPNum: qps[i%2].QPNum(), Flags: WCGRH,
			SrcQP: a.qp.QPNum()}, rwc, rwc.Detail)
	}
	for _, qp := range qps {
		require.NoError(t, qp.Destroy())
	}
	require.NoError(t, srq.Destroy())
}

// Randomized: several QPs receive SENDs of random sizes from one ODP SRQ while a
// goroutine posts receives as their slots free up and the application drops half
// of the consumed buffers' pages (madvise through Discard) before they are posted
// again, so that SENDs fault on them; every receive completes once, each QP's in
// its messages' order and with their lengths.
func TestSRQRandomized(t *testing.T) {
	for _, procs := range []int{1, 2} {
		t.Run(fmt.Sprintf("GOMAXPROCS=%d", procs), func(t *testing.T) {
			defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(procs))
			seed := uint64(time.Now().UnixNano())
			rng := rand.New(rand.NewPCG(seed, 5))
			const qps, perQP, slots = 3, 40, 24
			s := newSRQSide(t, Config{ResponderFaults: FaultRNR}, qps, SRQConfig{MaxWR: slots})
			for _, qp := range s.receivers {
				require.NoError(t, qp.ModifyAttr(QPAttr{MinRNRTimer: 1}, AttrMinRNRTimer))
			}
			for _, qp := range s.senders {
				require.NoError(t, qp.ModifyAttr(QPAttr{RNRRetry: 7}, AttrRNRRetry))
			}
			_, smr := s.send.region(t, 4*ps, rw)
			dst, dmr := s.recv.region(t, slots*2*ps, rw|AccessOnDemand)
			total := qps * perQP
			sizes := make([]int, total)
			for i := range sizes {
				sizes[i] = 1 + rng.IntN(2*ps)
			}
			// One poster reposts a slot's receive once its completion was seen.
			free := make(chan int, slots)
			for i := range slots {
				free <- i
			}
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			var wg sync.WaitGroup
			wg.Add(1)
			go func() {
				defer wg.Done()
				for next := 0; next < total; next++ {
					select {
					case slot := <-free:
						wr := RecvWR{WRID: uint64(slot), SGL: sge(dmr, slot*2*ps, 2*ps)}
						if err := s.srq.PostRecv(wr); err != nil {
							t.Errorf("seed %d: post: %v", seed, err)
							return
						}
					case <-ctx.Done():
						return
					}
				}
			}()
			for q := range qps {
				for i := range perQP {
					k := q*perQP + i
					require.NoError(t, s.senders[q].PostSend(SendWR{WRID: uint64(k), Opcode: OpSend,
						SGL: sge(smr, 0, sizes[k]), Flags: SendSignaled}))
				}
			}
			byQP := map[uint32][]uint32{}
			wcs := make([]WC, 16)
			for seen := 0; seen < total; {
				k, err := s.recv.rcq.Wait(ctx, wcs)
				require.NoError(t, err, "seed %d: %d of %d receives", seed, seen, total)
				for _, wc := range wcs[:k] {
					require.Equal(t, WCSuccess, wc.Status, "seed %d: %s", seed, wc.Detail)
					byQP[wc.QPNum] = append(byQP[wc.QPNum], wc.ByteLen)
					slot := int(wc.WRID)
					if rng.IntN(2) == 0 { // the application drops the buffer's pages before reuse
						require.NoError(t, s.recv.dev.Discard(dst[slot*2*ps:(slot+1)*2*ps]))
					}
					free <- slot
				}
				seen += k
			}
			for seen := 0; seen < total; {
				k, err := s.send.scq.Wait(ctx, wcs)
				require.NoError(t, err)
				for _, wc := range wcs[:k] {
					require.Equal(t, WCSuccess, wc.Status, "seed %d: %s", seed, wc.Detail)
				}
				seen += k
			}
			cancel()
			wg.Wait()
			assert.NotZero(t, s.recv.dev.Stats().PageFaults, "seed %d: no receive faulted", seed)
			// Each QP's receives complete in its messages' order, with their lengths.
			for q, qp := range s.receivers {
				want := make([]uint32, perQP)
				for i := range want {
					want[i] = uint32(sizes[q*perQP+i])
				}
				assert.Equal(t, want, byQP[qp.QPNum()], "seed %d: QP %d", seed, q)
			}
		})
	}
}
