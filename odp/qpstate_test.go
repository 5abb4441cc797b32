package odp

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"golang.org/x/sys/unix"
)

func TestQPTransitions(t *testing.T) {
	states := []QPState{StateReset, StateInit, StateRTR, StateRTS, StateError}
	allowed := map[[2]QPState]bool{
		{StateReset, StateInit}: true, {StateInit, StateInit}: true, {StateInit, StateRTR}: true,
		{StateRTR, StateRTS}: true, {StateRTS, StateRTS}: true,
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
	assert.True(t, canPostSend(StateRTS) && canPostSend(StateError))
	assert.False(t, canPostSend(StateRTR) || canPostSend(StateInit) || canPostSend(StateReset))
	assert.True(t, canPostRecv(StateInit) && canPostRecv(StateRTR) && canPostRecv(StateError))
	assert.False(t, canPostRecv(StateReset))
	assert.Equal(t, "ERR", StateError.String())
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
