package odp

// Work completions: statuses (ibv_wc_status), opcodes and flags.

import "fmt"

// WCStatus is a work completion's status; the values are ibv_wc_status's.
type WCStatus int

// The completion statuses odpemu produces.
const (
	WCSuccess        WCStatus = 0
	WCLocLenErr      WCStatus = 1
	WCLocQPOpErr     WCStatus = 2
	WCLocProtErr     WCStatus = 4
	WCWRFlushErr     WCStatus = 5
	WCMWBindErr      WCStatus = 6
	WCBadRespErr     WCStatus = 7
	WCLocAccessErr   WCStatus = 8
	WCRemInvReqErr   WCStatus = 9
	WCRemAccessErr   WCStatus = 10
	WCRemOpErr       WCStatus = 11
	WCRetryExcErr    WCStatus = 12
	WCRNRRetryExcErr WCStatus = 13
	WCGeneralErr     WCStatus = 21
)

var wcStatusNames = map[WCStatus]string{
	WCSuccess: "success", WCLocLenErr: "local length error", WCLocQPOpErr: "local QP operation error",
	WCLocProtErr: "local protection error", WCWRFlushErr: "Work Request Flushed Error", WCMWBindErr: "memory bind operation error",
	WCBadRespErr: "bad response error", WCLocAccessErr: "local access error",
	WCRemInvReqErr: "remote invalid request error", WCRemAccessErr: "remote access error",
	WCRemOpErr: "remote operation error", WCRetryExcErr: "transport retry counter exceeded",
	WCRNRRetryExcErr: "RNR retry counter exceeded", WCGeneralErr: "general error",
}

// String returns ibv_wc_status_str's text.
func (s WCStatus) String() string {
	if n, ok := wcStatusNames[s]; ok {
		return n
	}
	return fmt.Sprintf("WCStatus(%d)", int(s))
}

// WCOpcode is what a completion completed; the values are ibv_wc_opcode's.
type WCOpcode int

// What completions complete.
const (
	WCSend        WCOpcode = 0
	WCRDMAWrite   WCOpcode = 1
	WCRDMARead    WCOpcode = 2
	WCCompSwap    WCOpcode = 3
	WCFetchAdd    WCOpcode = 4
	WCBindMW      WCOpcode = 5
	WCLocalInv    WCOpcode = 6
	WCAtomicWrite WCOpcode = 9
	WCRecv        WCOpcode = 128
	// WCRecvRDMAWithImm completes a receive consumed by an RDMA WRITE with
	// immediate: ByteLen is the bytes written, nothing is placed in the receive.
	WCRecvRDMAWithImm WCOpcode = 129
)

// WCFlags are a completion's flags, with ibv_wc_flags' values.
type WCFlags uint32

// The completion flags.
const (
	// WCGRH: a UD receive's first 40 bytes hold the datagram's GRH (for RoCEv2 over
	// IPv4, its IPv4 header in the last 20).
	WCGRH WCFlags = 1 << 0
	// WCWithImm: ImmData holds the sender's immediate data.
	WCWithImm WCFlags = 1 << 1
	// WCWithInv: a SEND with invalidate invalidated the window whose R_Key is
	// InvRKey.
	WCWithInv WCFlags = 1 << 3
)

// WC is a work completion.
type WC struct {
	WRID    uint64
	Status  WCStatus
	Opcode  WCOpcode
	ByteLen uint32 // receive completions: bytes received; READ and atomics: bytes placed
	QPNum   uint32
	Flags   WCFlags
	ImmData uint32 // with WCWithImm
	SrcQP   uint32 // UD receives: the sending QP's number
	InvRKey uint32 // with WCWithInv
	// Detail says why a completion failed (the vendor syndrome's role).
	Detail string
}

func wcOpcode(op Opcode) WCOpcode {
	switch op {
	case OpRDMARead:
		return WCRDMARead
	case OpSend, OpSendImm, OpSendInv:
		return WCSend
	case OpBindMW:
		return WCBindMW
	case OpLocalInv:
		return WCLocalInv
	case OpAtomicCmpSwap:
		return WCCompSwap
	case OpAtomicFetchAdd:
		return WCFetchAdd
	case OpAtomicWrite:
		return WCAtomicWrite
	}
	return WCRDMAWrite
}
