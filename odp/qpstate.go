package odp

import "fmt"

// QPState is an RC queue pair's state, with ibv_qp_state's values.
type QPState int

// The QP states.
const (
	StateReset QPState = 0
	StateInit  QPState = 1
	StateRTR   QPState = 2
	StateRTS   QPState = 3
	// StateSQD (send queue drain): requests already started complete, later ones
	// wait, posted or not, until the QP returns to RTS.
	StateSQD QPState = 4
	// StateSQE (send queue error) is entered by UC and UD QPs after a send error; an
	// RC QP goes to ERR instead, so the emulated NIC never enters it, but a QP moved
	// there leaves it for RTS as verbs allows.
	StateSQE   QPState = 5
	StateError QPState = 6
)

// String returns the state's verbs name.
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
	case StateSQD:
		return "SQD"
	case StateSQE:
		return "SQE"
	case StateError:
		return "ERR"
	}
	return fmt.Sprintf("QPState(%d)", int(s))
}

// transitions are the moves ibv_modify_qp allows for RC besides any state to RESET
// and to ERR (IBTA's QP state diagram).
var transitions = map[QPState][]QPState{
	StateReset: {StateInit},
	StateInit:  {StateInit, StateRTR},
	StateRTR:   {StateRTS},
	StateRTS:   {StateRTS, StateSQD},
	StateSQD:   {StateSQD, StateRTS},
	StateSQE:   {StateRTS},
}

// checkTransition reports whether a QP may move from one state to another.
func checkTransition(from, to QPState) error {
	if to == StateReset || to == StateError {
		return nil
	}
	for _, s := range transitions[from] {
		if s == to {
			return nil
		}
	}
	return wrap(ErrQPState, "%v -> %v", from, to)
}

// canPostSend and canPostRecv say which states accept work requests: sends from RTS
// on (in SQD and SQE they wait, in ERR they complete with WR_FLUSH_ERR), receives
// from INIT on.
func canPostSend(s QPState) bool { return s >= StateRTS }
func canPostRecv(s QPState) bool { return s != StateReset }
