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
	for _, op := range []Opcode{OpRDMAWrite, OpRDMARead, OpAtomicFetchAdd} {
		t.Run(opName(op), func(t *testing.T) {
			a, b := pair(t, Config{})
			src, smr := a.region(t, 4*ps, rwa)
			dst, dmr := b.region(t, 4*ps, rwa|AccessOnDemand)
			fill(src, 5)
			wr := func() SendWR {
				n := 2 * ps
				if op.atomic() {
					n = 8
				}
				return SendWR{WRID: 1, Opcode: op, SGL: sge(smr, 0, n), RemoteAddr: dmr.Addr(), RKey: dmr.RKey(), CompareAdd: 1}
			}

			require.NoError(t, a.qp.ModifyAttr(QPAttr{RNRRetry: 0}, AttrRNRRetry))
			wc := a.post(t, wr())
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
			w := wr()
			w.SGL = sge(smr2, 0, int(w.SGL[0].Length))
			for dmr.Stats().ValidPages == 0 { // the responder maps them after sending the NAK
				runtime.Gosched()
			}
			wc = a2.post(t, w)
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
			w = wr()
			w.SGL = sge(smr3, 0, int(w.SGL[0].Length))
			wc = a3.post(t, w)
			require.Equal(t, WCSuccess, wc.Status, wc.Detail)
			st = a3.qp.Stats()
			assert.Positive(t, st.RNRNaksReceived)
			packets := map[Opcode]uint64{OpRDMAWrite: 2, OpRDMARead: 1, OpAtomicFetchAdd: 1}[op] // at a 4 KiB MTU
			assert.Equal(t, st.RNRNaksReceived*packets, st.Retransmissions, "each RNR NAK resends the message")
			assert.Positive(t, st.RNRWait)
			assert.Equal(t, st.RNRNaksReceived, qp3.Stats().RNRNaksSent)
			if op == OpRDMAWrite {
				assert.True(t, bytes.Equal(src3[:2*ps], dst[:2*ps]))
			}
			ds := b.dev.Stats()
			assert.Equal(t, ds.RC.RNRNaksSent, b.qp.Stats().RNRNaksSent+qp2.Stats().RNRNaksSent+qp3.Stats().RNRNaksSent)
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
