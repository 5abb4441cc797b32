package odp

import (
	"bytes"
	"runtime"
	"testing"
	"time"

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
	assert.Equal(t, QPAttr{MinRNRTimer: 1, RNRRetry: 3, Timeout: DefaultQPAttr.Timeout, RetryCnt: DefaultQPAttr.RetryCnt}, n.qp.Attr())
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
