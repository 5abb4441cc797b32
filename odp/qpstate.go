package odp

import "fmt"

// QPState is an RC queue pair's state (ibv_qp_state, without SQD/SQE).
type QPState int

const (
	StateReset QPState = iota
	StateInit
	StateRTR
	StateRTS
	StateError
)

func (s QPState) String() string {
	switch s {
	case StateReset:
		return "RESET"
	case StateInit:
		return "INIT"
	case StateRTR:
		return "RTR"
	case StateRTS:
		return "RTS"
	case StateError:
		return "ERR"
	}
	return fmt.Sprintf("QPState(%d)", int(s))
}

// checkTransition reports whether a QP may move from one state to another, as
// ibv_modify_qp allows for RC: RESET->INIT->RTR->RTS, INIT->INIT, RTS->RTS, any state
// to ERR, and any state to RESET.
func checkTransition(from, to QPState) error {
	ok := false
	switch to {
	case StateReset, StateError:
		ok = true
	case StateInit:
		ok = from == StateReset || from == StateInit
	case StateRTR:
		ok = from == StateInit
	case StateRTS:
		ok = from == StateRTR || from == StateRTS
	}
	if !ok {
		return wrap(ErrQPState, "%v -> %v", from, to)
	}
	return nil
}

// canPostSend and canPostRecv say which states accept work requests; in ERR they are
// accepted and completed with WR_FLUSH_ERR.
func canPostSend(s QPState) bool { return s == StateRTS || s == StateError }
func canPostRecv(s QPState) bool { return s != StateReset }
