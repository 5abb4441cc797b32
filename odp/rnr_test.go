package odp

import (
	"bytes"
	"runtime"
	"testing"
	"time"

	"github.com/odpemu/odpemu/transport/roce"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// RNR NAK on a responder's ODP fault, as on mlx5: with rnr_retry = 0 a cold WRITE
// fails with RNR_RETRY_EXC_ERR, and once the responder resolved the fault behind the
// NAK a warm one succeeds; with rnr_retry = 7 a cold WRITE always succeeds after
// retransmission. Counters on both sides agree.
func TestRNRRetryOnResponderFault(t *testing.T) {
	a, b := pair(t, Config{})
	src, smr := a.region(t, 4*ps, rwa)
	dst, dmr := b.region(t, 4*ps, rwa|AccessOnDemand)
	fill(src, 5)
	wr := func(mr *MR) SendWR {
		return SendWR{WRID: 1, Opcode: OpRDMAWrite, SGL: sge(mr, 0, 2*ps), RemoteAddr: dmr.Addr(), RKey: dmr.RKey()}
	}

	require.NoError(t, a.qp.ModifyAttr(QPAttr{RNRRetry: 0}, AttrRNRRetry))
	wc := a.post(t, wr(smr))
	assert.Equal(t, WCRNRRetryExcErr, wc.Status, wc.Detail)
	assert.Equal(t, StateError, a.qp.State())
	st := a.qp.Stats()
	assert.EqualValues(t, 1, st.RNRNaksReceived)
	assert.EqualValues(t, 0, st.Retransmissions)
	assert.EqualValues(t, 1, st.RNRRetryExc)
	assert.EqualValues(t, 1, b.qp.Stats().RNRNaksSent)
	assert.NotEqual(t, StateError, b.qp.State(), "an RNR NAK does not end the responder")

	// The fault behind the NAK was resolved: a new connection finds the pages.
	a2, b2 := newNode(t, Config{}), b
	qp2, err := b2.pd.CreateQP(QPConfig{SendCQ: b2.scq, RecvCQ: b2.rcq})
	require.NoError(t, err)
	require.NoError(t, ConnectLoopback(a2.qp, qp2))
	_, smr2 := a2.region(t, 4*ps, rwa)
	require.NoError(t, a2.qp.ModifyAttr(QPAttr{RNRRetry: 0}, AttrRNRRetry))
	for dmr.Stats().ValidPages < 2 { // the responder maps them after sending the NAK
		runtime.Gosched()
	}
	wc = a2.post(t, wr(smr2))
	assert.Equal(t, WCSuccess, wc.Status, wc.Detail)
	assert.Zero(t, a2.qp.Stats().RNRNaksReceived)

	// rnr_retry = 7 after dropping the pages again: retransmitted until done.
	dontneed(t, dst)
	require.NoError(t, b.dev.SyncEvents())
	a3 := newNode(t, Config{})
	qp3, err := b.pd.CreateQP(QPConfig{SendCQ: b.scq, RecvCQ: b.rcq})
	require.NoError(t, err)
	require.NoError(t, ConnectLoopback(a3.qp, qp3))
	src3, smr3 := a3.region(t, 4*ps, rwa)
	fill(src3, 9)
	wc = a3.post(t, wr(smr3))
	require.Equal(t, WCSuccess, wc.Status, wc.Detail)
	st = a3.qp.Stats()
	assert.Positive(t, st.RNRNaksReceived)
	// The fault was on the WRITE's first packet: each RNR NAK resends both.
	assert.Equal(t, st.RNRNaksReceived*2, st.Retransmissions, "each RNR NAK resends the message")
	assert.Positive(t, st.RNRWait)
	assert.Equal(t, st.RNRNaksReceived, qp3.Stats().RNRNaksSent)
	assert.True(t, bytes.Equal(src3[:2*ps], dst[:2*ps]))
	ds := b.dev.Stats()
	assert.Equal(t, ds.RC.RNRNaksSent, b.qp.Stats().RNRNaksSent+qp2.Stats().RNRNaksSent+qp3.Stats().RNRNaksSent)
}

// A READ or an atomic that faults at the responder is not RNR NAKed (IBTA lets a
// responder RNR NAK only requests that consume a receive; mlx5 resumes the QP once
// the fault is resolved, rxe faults synchronously): the responder waits for the
// fault, so even with rnr_retry = 0 a cold READ or atomic succeeds, later.
func TestReadAndAtomicWaitForResponderFault(t *testing.T) {
	for _, op := range []Opcode{OpRDMARead, OpAtomicFetchAdd} {
		t.Run(opName(op), func(t *testing.T) {
			a, b := pair(t, Config{})
			back, smr := a.region(t, 4*ps, rwa)
			dst, dmr := b.region(t, 4*ps, rwa|AccessOnDemand)
			n := 2 * ps
			if op.atomic() {
				n = 8
			}
			require.NoError(t, a.qp.ModifyAttr(QPAttr{RNRRetry: 0}, AttrRNRRetry))
			fill(back, 7)
			wc := a.post(t, SendWR{WRID: 1, Opcode: op, SGL: sge(smr, 0, n), RemoteAddr: dmr.Addr(), RKey: dmr.RKey(),
				CompareAdd: 3})
			require.Equal(t, WCSuccess, wc.Status, wc.Detail)
			assert.Zero(t, a.qp.Stats().RNRNaksReceived)
			assert.Zero(t, b.qp.Stats().RNRNaksSent)
			assert.Positive(t, dmr.Stats().PageFaults, "the responder took a network page fault")
			if op.atomic() {
				assert.Zero(t, back[0], "fetch-and-add returns the value it found: zero")
				assert.EqualValues(t, 3, dst[0])
			} else {
				assert.True(t, bytes.Equal(back[:n], dst[:n]), "a READ of fresh memory returns zeros")
			}
		})
	}
}

func opName(op Opcode) string {
	return map[Opcode]string{OpRDMAWrite: "write", OpRDMARead: "read", OpAtomicFetchAdd: "fetch_add"}[op]
}

// With the stall policy the responder resolves the fault first: no RNR NAK, even
// with rnr_retry = 0.
func TestStallPolicyHasNoRNR(t *testing.T) {
	a, b := pair(t, Config{ResponderFaults: FaultStall})
	_, smr := a.region(t, 4*ps, rw)
	_, dmr := b.region(t, 4*ps, rw|AccessOnDemand)
	require.NoError(t, a.qp.ModifyAttr(QPAttr{RNRRetry: 0}, AttrRNRRetry))
	wc := a.post(t, write(smr, 0, 4*ps, dmr, 0))
	assert.Equal(t, WCSuccess, wc.Status, wc.Detail)
	assert.Zero(t, a.qp.Stats().RNRNaksReceived)
	assert.Positive(t, b.dev.Stats().PageFaults)
}

// A SEND with no receive posted is answered with RNR NAK too, and with rnr_retry = 0
// fails; requests behind an RNR NAK are dropped by the responder and retransmitted in
// order (go-back-N), so several outstanding WRITEs and a SEND all land exactly once.
func TestRNRGoBackN(t *testing.T) {
	a, b := pair(t, Config{FaultAround: 1})
	src, smr := a.region(t, 16*ps, rw)
	dst, dmr := b.region(t, 16*ps, rw|AccessOnDemand)
	_, rmr := b.region(t, ps, rw)
	fill(src, 3)
	for i := 0; i < 8; i++ { // every WRITE faults: eight RNR NAKs at least
		require.NoError(t, a.qp.PostSend(SendWR{WRID: uint64(i), Opcode: OpRDMAWrite, SGL: sge(smr, i*2*ps, 2*ps),
			RemoteAddr: dmr.Addr() + uint64(i*2*ps), RKey: dmr.RKey(), Flags: SendSignaled}))
	}
	require.NoError(t, a.qp.PostSend(SendWR{WRID: 8, Opcode: OpSendImm, SGL: sge(smr, 0, 100), Imm: 3, Flags: SendSignaled}))
	for i := 0; i < 8; i++ {
		wc := wait(t, a.scq)
		require.Equal(t, WCSuccess, wc.Status, wc.Detail)
		assert.EqualValues(t, i, wc.WRID, "completions in order")
	}
	// The SEND waits, retransmitted, until a receive is posted.
	require.NoError(t, b.qp.PostRecv(RecvWR{WRID: 50, SGL: sge(rmr, 0, ps)}))
	wc := wait(t, a.scq)
	require.Equal(t, WCSuccess, wc.Status, wc.Detail)
	rwc := wait(t, b.rcq)
	assert.Equal(t, WC{WRID: 50, Opcode: WCRecv, ByteLen: 100, QPNum: b.qp.QPNum(), Flags: WCWithImm, ImmData: 3}, rwc)
	assert.True(t, bytes.Equal(src, dst))
	st := a.qp.Stats()
	assert.GreaterOrEqual(t, st.RNRNaksReceived, uint64(8))
	assert.GreaterOrEqual(t, st.Retransmissions, st.RNRNaksReceived)

	// No receive, rnr_retry = 0: RNR_RETRY_EXC_ERR.
	require.NoError(t, a.qp.ModifyAttr(QPAttr{RNRRetry: 0}, AttrRNRRetry))
	wc = a.post(t, SendWR{WRID: 9, Opcode: OpSend, SGL: sge(smr, 0, 10)})
	assert.Equal(t, WCRNRRetryExcErr, wc.Status)
}

func TestModifyAttr(t *testing.T) {
	n := newNode(t, Config{})
	assert.Equal(t, DefaultQPAttr, n.qp.Attr())
	require.NoError(t, n.qp.ModifyAttr(QPAttr{MinRNRTimer: 1, RNRRetry: 3, Timeout: 8, RetryCnt: 2}, AttrMinRNRTimer|AttrRNRRetry))
	want := DefaultQPAttr
	want.MinRNRTimer, want.RNRRetry = 1, 3
	assert.Equal(t, want, n.qp.Attr())
	assert.ErrorIs(t, n.qp.ModifyAttr(QPAttr{MinRNRTimer: 32}, AttrMinRNRTimer), ErrInvalidArgument)
	assert.ErrorIs(t, n.qp.ModifyAttr(QPAttr{RNRRetry: 8}, AttrRNRRetry), ErrInvalidArgument)
	assert.ErrorIs(t, n.qp.ModifyAttr(QPAttr{}, 1<<9), ErrInvalidArgument)
	assert.Equal(t, 10*time.Microsecond, RNRTimer(1))
	assert.Equal(t, 640*time.Microsecond, RNRTimer(12))
	assert.Equal(t, 491520*time.Microsecond, RNRTimer(31))
	assert.Equal(t, 655360*time.Microsecond, RNRTimer(0))
	_, err := Open(Config{ResponderFaults: 7})
	assert.ErrorIs(t, err, ErrInvalidArgument)
}

// A responder whose fault is pending answers RNR NAK to every retransmission until
// the fault is resolved, as mlx5 does (its page-fault work queue resolves it while
// the QP keeps answering): when min_rnr_timer x (rnr_retry+1) is shorter than the
// fault, the WRITE fails with RNR_RETRY_EXC_ERR, and with rnr_retry 7 (infinite)
// it succeeds once the fault is resolved, after as many NAKs as the timer fits in
// the fault. The fault is modelled at 100 ms, so that no scheduling delay makes a
// retransmission find it resolved: ConnectX-4's 220 us against a 10 us timer fails
// the same way, but a loaded machine may delay a retransmission that long.
func TestRNRRepeatedWhileFaultPending(t *testing.T) {
	fault := FaultModel{Name: "slow", PerFault: 100 * time.Millisecond}
	for _, c := range []struct {
		retry, timer uint8
		want         WCStatus
	}{{1, 1, WCRNRRetryExcErr}, {6, 1, WCRNRRetryExcErr}, {7, 14, WCSuccess}} {
		a, b := pair(t, Config{FaultModel: fault})
		src, smr := a.region(t, 4*ps, rw)
		dst, dmr := b.region(t, 4*ps, rw|AccessOnDemand)
		fill(src, 4)
		require.NoError(t, a.qp.ModifyAttr(QPAttr{RNRRetry: c.retry}, AttrRNRRetry))
		require.NoError(t, b.qp.ModifyAttr(QPAttr{MinRNRTimer: c.timer}, AttrMinRNRTimer))
		t0 := time.Now()
		wc := a.post(t, write(smr, 0, 2*ps, dmr, 0))
		took := time.Since(t0)
		require.Equal(t, c.want, wc.Status, "rnr_retry %d: %s", c.retry, wc.Detail)
		naks := b.qp.Stats().RNRNaksSent
		assert.Equal(t, naks, a.qp.Stats().RNRNaksReceived)
		if c.want == WCRNRRetryExcErr {
			assert.EqualValues(t, c.retry+1, naks, "rnr_retry %d: the first try and every retry, all while the fault was pending", c.retry)
			assert.Less(t, took, fault.PerFault, "it failed before the fault was resolved")
			// The counters say it as mlx5's and rxe's do.
			hw := a.dev.PortCounters()
			assert.Equal(t, naks-1, hw["rnr_nak_retry_err"], "mlx5: the RNR NAKs that did not exhaust rnr_retry")
			assert.Equal(t, naks, hw["rcvd_rnr_err"], "rxe: every RNR NAK received")
			assert.EqualValues(t, 1, hw["req_rnr_retries_exceeded"])
			assert.EqualValues(t, 1, hw["retry_rnr_exceeded_err"])
			assert.Equal(t, naks, b.dev.PortCounters()["send_rnr_err"])
			continue
		}
		assert.GreaterOrEqual(t, took, fault.PerFault)
		most := uint64(fault.PerFault/RNRTimer(c.timer)) + 2
		assert.True(t, naks > 2 && naks <= most, "%d RNR NAKs: one per %v timer while the %v fault was pending", naks, RNRTimer(c.timer), fault.PerFault)
		assert.True(t, bytes.Equal(src[:2*ps], dst[:2*ps]))
	}
}

// Behind an RNR NAK go-back-N sends again what was in flight, and with the link
// model that is what the link holds (its queue, the wire and the receiver's
// buffer) plus what the engines hold, not the requester's whole window: a cold
// transfer of 64 WRITEs of 64 KiB (4 MiB, 1024 packets, all in the window at once)
// never goes back more than that. What the requester sent after the NAK reached it
// in the link's model comes back to it unsent (roce.Port.NAKed), so on average an
// RNR NAK resends what a NIC's would find in flight: a bandwidth-delay product and
// the message (about 40 per NAK without that clock, 17-21 with it counted from the
// answered run's last packet, 16 counted from its first: the message itself).
// Without the model the requester sends its window at once, and goes back over
// hundreds of packets.
func TestGoBackBoundedByTheLink(t *testing.T) {
	const size, count = 64 << 10, 64
	goBack := func(t *testing.T, link LinkModel) (maxBack uint64, held int, perNAK float64) {
		a, b := pair(t, Config{Link: link})
		if wireUDP() {
			t.Skip("the in-process link model is under test")
		}
		_, smr := a.region(t, size*count, rw)
		_, dmr := b.region(t, size*count, rw|AccessOnDemand)
		require.NoError(t, b.qp.ModifyAttr(QPAttr{MinRNRTimer: 1}, AttrMinRNRTimer))
		for i := 0; i < count; i++ {
			wr := write(smr, i*size, size, dmr, uint64(i*size))
			wr.WRID, wr.Flags = uint64(i), 0
			if i == count-1 {
				wr.Flags = SendSignaled
			}
			require.NoError(t, a.qp.PostSend(wr))
		}
		wc := wait(t, a.scq)
		require.Equal(t, WCSuccess, wc.Status, wc.Detail)
		st := a.qp.Stats()
		require.Positive(t, st.RNRNaksReceived)
		return st.MaxGoBack, st.LinkMaxInFlight, float64(st.Retransmissions) / float64(st.RNRNaksReceived)
	}
	mtu := LoopbackLimits.MTU
	packet := roce.WirePacket(mtu)
	withLink, held, perNAK := goBack(t, LinkModel{})
	limit := LinkModel{}.wire().Limit(mtu)
	assert.LessOrEqual(t, held, limit, "the link never held more than its limit")
	bound := 2*limit/packet + size/mtu // the link, the responder's batch, one message
	assert.LessOrEqual(t, withLink, uint64(bound), "go-back-N behind a NAK: %d packets, the link holds %d B", withLink, limit)
	// What a NIC's NAK finds in flight: a bandwidth-delay product and the message.
	bdp := float64(LinkModel{}.wire().BDP()) / float64(packet)
	assert.LessOrEqual(t, perNAK, bdp+float64(size/mtu), "packets resent per RNR NAK (BDP %.1f packets)", bdp)
	without, _, _ := goBack(t, NoLink)
	t.Logf("go-back: %d packets with the link model (bound %d, link held %d B of %d), %.1f resent per RNR NAK (BDP %.1f packets), %d without",
		withLink, bound, held, limit, perNAK, bdp, without)
	assert.Greater(t, without, uint64(bound), "without the link model the requester goes back further")
}

// A network page fault holds up only the QP whose message met it: another QP of the
// same devices goes on meanwhile, and two QPs' faults are resolved at once, not one
// after the other (mlx5 queues page faults per QP on one EQ and resolves them in a
// work queue).
func TestFaultsDoNotSerialiseQPs(t *testing.T) {
	fault := FaultModel{Name: "slow", PerFault: 300 * time.Millisecond}
	a, b := pair(t, Config{FaultModel: fault, FaultAround: 1})
	scq2, err := a.dev.CreateCQ(ps)
	require.NoError(t, err)
	qa, err := a.pd.CreateQP(QPConfig{SendCQ: scq2, RecvCQ: scq2})
	require.NoError(t, err)
	qb, err := b.pd.CreateQP(QPConfig{SendCQ: b.scq, RecvCQ: b.rcq})
	require.NoError(t, err)
	if wireUDP() {
		connectUDP(t, qa, qb, UDPConfig{Addr: addrA}, UDPConfig{Addr: addrB})
	} else {
		require.NoError(t, ConnectLoopback(qa, qb))
	}
	_, smr := a.region(t, 4*ps, rw)
	_, cold1 := b.region(t, 4*ps, rw|AccessOnDemand)
	_, cold2 := b.region(t, 4*ps, rw|AccessOnDemand)
	_, pinned := b.region(t, 4*ps, rw)
	for _, q := range []*QP{a.qp, qa} { // RNR NAKs while the fault runs, never exhausted
		require.NoError(t, q.ModifyAttr(QPAttr{RNRRetry: 7}, AttrRNRRetry))
	}

	// QP 1 meets a fault; QP 2's WRITE to pinned memory completes first.
	t0 := time.Now()
	require.NoError(t, a.qp.PostSend(write(smr, 0, ps, cold1, 0)))
	require.NoError(t, qa.PostSend(write(smr, 0, ps, pinned, 0)))
	wc := wait(t, scq2)
	require.Equal(t, WCSuccess, wc.Status, wc.Detail)
	var n int
	n, err = a.scq.Poll(make([]WC, 1))
	require.NoError(t, err)
	assert.Zero(t, n, "QP 1 still waits for its fault when QP 2 is done")
	wc = wait(t, a.scq)
	require.Equal(t, WCSuccess, wc.Status, wc.Detail)
	assert.GreaterOrEqual(t, time.Since(t0), fault.PerFault)

	// Both QPs meet a fault: resolved side by side, in well under two faults' time.
	t0 = time.Now()
	require.NoError(t, a.qp.PostSend(write(smr, 0, ps, cold2, 0)))
	require.NoError(t, qa.PostSend(write(smr, 0, ps, cold1, 2*up)))
	for _, cq := range []*CQ{a.scq, scq2} {
		wc := wait(t, cq)
		require.Equal(t, WCSuccess, wc.Status, wc.Detail)
	}
	took := time.Since(t0)
	assert.GreaterOrEqual(t, took, fault.PerFault)
	assert.Less(t, took, 2*fault.PerFault-fault.PerFault/4, "the two faults ran at once")
	require.NoError(t, qa.Destroy())
	require.NoError(t, qb.Destroy())
}
