package odp

import (
	"errors"
	"runtime"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

func TestQPTransitions(t *testing.T) {
	states := []QPState{StateReset, StateInit, StateRTR, StateRTS, StateSQD, StateSQE, StateError}
	allowed := map[[2]QPState]bool{
		{StateReset, StateInit}: true, {StateInit, StateInit}: true, {StateInit, StateRTR}: true,
		{StateRTR, StateRTS}: true, {StateRTS, StateRTS}: true, {StateRTS, StateSQD}: true,
		{StateSQD, StateSQD}: true, {StateSQD, StateRTS}: true, {StateSQE, StateRTS}: true,
	}
	for _, from := range states {
		for _, to := range states {
			err := checkTransition(from, to)
			want := allowed[[2]QPState{from, to}] || to == StateReset || to == StateError
			if want {
				assert.NoError(t, err, "%v -> %v", from, to)
			} else {
				assert.ErrorIs(t, err, ErrQPState, "%v -> %v", from, to)
			}
		}
	}
	for _, s := range states {
		assert.Equal(t, s >= StateRTS, canPostSend(s), "post send in %v", s)
		assert.Equal(t, s != StateReset, canPostRecv(s), "post recv in %v", s)
	}
	assert.Equal(t, "ERR", StateError.String())
	assert.Equal(t, "SQD", StateSQD.String())
	assert.EqualValues(t, 6, StateError, "ibv_qp_state's value")
}

func TestErrorsMatchErrno(t *testing.T) {
	err := wrap(ErrMemlockLimit, "detail")
	assert.ErrorIs(t, err, ErrMemlockLimit)
	assert.ErrorIs(t, err, unix.ENOMEM)
	assert.False(t, errors.Is(err, unix.EINVAL))
	assert.ErrorIs(t, ErrQPState, unix.EINVAL)
	assert.Equal(t, "remote access error", WCRemAccessErr.String())
	assert.Equal(t, "WCStatus(99)", WCStatus(99).String())
	assert.Equal(t, "LOCAL_WRITE|ON_DEMAND", (AccessLocalWrite | AccessOnDemand).String())
}

// In SQD a posted request waits; back in RTS it runs. The responder side keeps
// answering meanwhile.
func TestSQDHoldsTheSendQueue(t *testing.T) {
	a, b := pair(t, Config{})
	src, smr := a.region(t, ps, rw)
	dst, dmr := b.region(t, ps, rw)
	fill(src, 1)
	require.NoError(t, a.qp.Modify(StateSQD))
	assert.ErrorIs(t, a.qp.Modify(StateRTR), ErrQPState, "SQD -> RTR")
	require.NoError(t, a.qp.PostSend(write(smr, 0, 64, dmr, 0)))
	// b's own request to a is served while a's send queue is drained.
	wc := b.post(t, write(dmr, 100, 8, smr, 200))
	require.Equal(t, WCSuccess, wc.Status, wc.Detail)
	for i := 0; i < 100; i++ {
		runtime.Gosched()
		var wcs [1]WC
		n, err := a.scq.Poll(wcs[:])
		require.NoError(t, err)
		require.Zero(t, n, "a request ran in SQD")
	}
	assert.NotEqual(t, src[:64], dst[:64])
	require.NoError(t, a.qp.Modify(StateRTS))
	wc = wait(t, a.scq)
	require.Equal(t, WCSuccess, wc.Status, wc.Detail)
	assert.Equal(t, src[:64], dst[:64])
}

func TestQueryDevice(t *testing.T) {
	d := newNode(t, Config{ResponderFaults: FaultStall}).dev
	attr := d.QueryDevice()
	assert.Equal(t, ODPSupport, attr.ODP.General&ODPSupport)
	for _, c := range []ODPTransportCaps{ODPSend, ODPRecv, ODPWrite, ODPRead, ODPAtomic, ODPSRQRecv} {
		assert.NotZero(t, attr.ODP.RC&c, "RC cap %#x", c)
	}
	// An SRQ of the size reported is created; a larger one is refused.
	pd, err := d.AllocPD()
	require.NoError(t, err)
	srq, err := pd.CreateSRQ(SRQConfig{MaxWR: attr.MaxSRQWR, MaxSGE: attr.MaxSRQSGE})
	require.NoError(t, err)
	require.NoError(t, srq.Destroy())
	_, err = pd.CreateSRQ(SRQConfig{MaxWR: attr.MaxSRQWR + 1})
	assert.ErrorIs(t, err, ErrInvalidArgument)
	assert.Equal(t, PageSize, attr.PageSize)
	assert.Equal(t, FaultStall, attr.ResponderFaults)
	// The limits are the ones the verbs enforce.
	_, err = d.CreateCQ(attr.MaxCQE + 1)
	assert.ErrorIs(t, err, ErrInvalidArgument)
	cq, err := d.CreateCQ(16)
	require.NoError(t, err)
	_, err = pd.CreateQP(QPConfig{SendCQ: cq, RecvCQ: cq, MaxSGE: attr.MaxSGE + 1})
	assert.ErrorIs(t, err, ErrInvalidArgument)
	_, err = pd.CreateQP(QPConfig{SendCQ: cq, RecvCQ: cq, MaxInlineData: attr.MaxInlineData + 1})
	assert.ErrorIs(t, err, ErrInvalidArgument)
	qp, err := pd.CreateQP(QPConfig{SendCQ: cq, RecvCQ: cq, MaxSendWR: attr.MaxQPWR, MaxSGE: attr.MaxSGE, MaxInlineData: attr.MaxInlineData})
	require.NoError(t, err)
	require.NoError(t, qp.Destroy())
}
