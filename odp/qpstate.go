package odp

import (
	"fmt"
	"time"

	"github.com/odpemu/odpemu/transport/roce"
)

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

// QPAttr are the RC attributes that govern retries and READs (ibv_qp_attr's). The
// requester uses RNRRetry, Timeout, RetryCnt and MaxRdAtomic; the responder sends
// MinRNRTimer in its RNR NAKs and keeps MaxDestRdAtomic READs and atomics.
type QPAttr struct {
	// MinRNRTimer is the RNR timer the responder asks for, in the IBTA encoding:
	// 1 is 0.01 ms up to 31, 491.52 ms; 0 is 655.36 ms (RNRTimer decodes it).
	MinRNRTimer uint8
	// RNRRetry is how often a request answered with RNR NAK is retransmitted before
	// it fails with RNR_RETRY_EXC_ERR; 7 means without limit.
	RNRRetry uint8
	// Timeout is the local ACK timeout, 4.096 us * 2^Timeout (0: none), and RetryCnt
	// the retransmissions it allows (lost packets, a lost peer).
	Timeout  uint8
	RetryCnt uint8
	// Access is what the QP's responder accepts of the peer (ibv_qp_attr's
	// qp_access_flags): AccessRemoteWrite, AccessRemoteRead, AccessRemoteAtomic. A
	// request for another is refused with an invalid request NAK, as rxe refuses it,
	// whatever its MR allows; SENDs are always accepted. AccessLocalWrite may be given
	// and means nothing here.
	Access Access
	// QKey is a UD QP's Q_Key: datagrams carrying another are dropped.
	QKey uint32
	// MaxRdAtomic is how many READs and atomics the requester has outstanding at
	// most (max_rd_atomic, the initiator depth); one more waits until one
	// completes. As mlx5 and rxe program it, the depth is MaxRdAtomic rounded up to
	// a power of two, and 0 counts as 1 (mlx5 writes its log2 into the QP context:
	// 0 and 1 are both 2^0). At most the device's Config.RdAtomic, which a new
	// QP takes.
	MaxRdAtomic uint8
	// MaxDestRdAtomic is how many of the peer's latest READs and atomics the
	// responder keeps to answer their duplicates (max_dest_rd_atomic, the responder
	// resources), rounded up as MaxRdAtomic is; older ones are dropped, so a peer
	// with more outstanding may find a retransmitted one gone. Taken when the QP's
	// engine starts (RTR), as the verbs set it then; at most the device's
	// Config.RdAtomic, which a new QP takes.
	MaxDestRdAtomic uint8
}

// The READs and atomics a QP may have outstanding as a requester or keep as a
// responder (the device's max_qp_init_rd_atom and max_qp_rd_atom, Config.RdAtomic).
const (
	// DefaultRdAtomic is mlx5's, ConnectX-4 to 6: 16.
	DefaultRdAtomic = 16
	// MaxRdAtomicLimit is the most a device may be given: rxe's, 128
	// (RXE_MAX_QP_RD_ATOM and RXE_MAX_QP_INIT_RD_ATOM, rxe_param.h).
	MaxRdAtomicLimit = 128
)

// rdAtomicDepth is the depth a max_rd_atomic or max_dest_rd_atomic setting gives, as
// mlx5 and rxe round it: the next power of two, 0 counting as 1.
func rdAtomicDepth(n uint8) int {
	d := 1
	for d < int(n) {
		d <<= 1
	}
	return d
}

// QPAttrMask says which QPAttr fields ModifyAttr changes (ibv_qp_attr_mask's role).
type QPAttrMask uint32

// The attributes ModifyAttr can change.
const (
	AttrMinRNRTimer QPAttrMask = 1 << iota
	AttrRNRRetry
	AttrTimeout
	AttrRetryCnt
	AttrAccess
	AttrQKey
	AttrMaxRdAtomic
	AttrMaxDestRdAtomic
)

// DefaultQPAttr are a new QP's attributes: a 0.64 ms RNR timer (encoding 12) and
// unlimited RNR retries, as rdma-core's tests set them, and a 1.07 s ACK timeout
// (encoding 18) retried 7 times. Hardware commonly uses 67 ms (14); an emulated
// responder resolving faults under an invalidation storm, on a loaded 2-core machine
// under the race detector, has gone without answering for longer than 7 times that,
// so a lost peer is declared after about 8 s instead. Experiments on loss set
// shorter timeouts.
//
// A new QP accepts every remote operation its MRs allow; a verbs program restricts
// that with qp_access_flags when it moves the QP to INIT. Its READs and atomics
// outstanding are DefaultRdAtomic here, and its device's Config.RdAtomic on a device
// with another (qpAttr).
var DefaultQPAttr = QPAttr{MinRNRTimer: 12, RNRRetry: 7, Timeout: 18, RetryCnt: 7,
	Access:      AccessRemoteWrite | AccessRemoteRead | AccessRemoteAtomic,
	MaxRdAtomic: DefaultRdAtomic, MaxDestRdAtomic: DefaultRdAtomic}

// qpAttr is a new (or reset) QP's attributes on a device whose QPs have rdAtomic
// READs and atomics outstanding at most: DefaultQPAttr with that depth.
func qpAttr(rdAtomic int) QPAttr {
	a := DefaultQPAttr
	a.MaxRdAtomic, a.MaxDestRdAtomic = uint8(rdAtomic), uint8(rdAtomic)
	return a
}

// RNRTimer decodes an RNR timer value (IBTA encoding, 0..31).
func RNRTimer(enc uint8) time.Duration { return roce.RNRTimer(enc) }
