package odp

import "net/netip"

// Work requests as PostSend and PostRecv take them: opcodes, flags, SGEs.

// Opcode is a send work request's operation (ibv_wr_opcode values).
type Opcode int

// The send opcodes.
const (
	OpRDMAWrite Opcode = 0
	// OpRDMAWriteImm writes like OpRDMAWrite, then consumes a receive at the peer,
	// whose completion carries Imm (WCRecvRDMAWithImm).
	OpRDMAWriteImm Opcode = 1
	OpSend         Opcode = 2
	// OpSendImm is a SEND whose receive completion carries Imm.
	OpSendImm  Opcode = 3
	OpRDMARead Opcode = 4
	// OpAtomicCmpSwap compares the 8 bytes at RemoteAddr (8-byte aligned, in an MR
	// with AccessRemoteAtomic) with CompareAdd and, if equal, stores Swap; the
	// original value lands in the SGL, which must be one 8-byte SGE.
	OpAtomicCmpSwap Opcode = 5
	// OpAtomicFetchAdd adds CompareAdd to the 8 bytes at RemoteAddr; the original
	// value lands in the SGL.
	OpAtomicFetchAdd Opcode = 6
	// OpLocalInv invalidates the type 2 memory window whose R_Key is InvRKey, in the
	// send queue's order, without the wire (WCLocalInv).
	OpLocalInv Opcode = 7
	// OpBindMW binds the memory window Bind names to a range of an MR, in the send
	// queue's order, without the wire (WCBindMW); it fails with WCMWBindErr.
	OpBindMW Opcode = 8
	// OpSendInv is a SEND whose arrival invalidates the peer's type 2 memory window
	// whose R_Key is InvRKey; its receive completion says so (WCWithInv).
	OpSendInv Opcode = 9
	// OpAtomicWrite stores the SGL's 8 bytes (one 8-byte SGE, or inline) at once at
	// RemoteAddr (8-byte aligned, in an MR with AccessRemoteWrite), after every
	// request before it: RDMA ATOMIC WRITE, completed with WCAtomicWrite.
	OpAtomicWrite Opcode = 15
)

func (o Opcode) valid() bool { return o >= OpRDMAWrite && o <= OpSendInv || o == OpAtomicWrite }

// local reports whether the NIC executes the request without the wire.
func (o Opcode) local() bool { return o == OpLocalInv || o == OpBindMW }

func (o Opcode) atomic() bool { return o == OpAtomicCmpSwap || o == OpAtomicFetchAdd }

// readsBack reports whether the request's response carries data into the local
// SGL (a READ's data, an atomic's original value), which fences wait for.
func (o Opcode) readsBack() bool { return o == OpRDMARead || o.atomic() }

// carriesData reports whether the request carries the SGL's bytes to the peer.
func (o Opcode) carriesData() bool {
	return o == OpRDMAWrite || o == OpRDMAWriteImm || o == OpSend || o == OpSendImm || o == OpSendInv ||
		o == OpAtomicWrite
}

// SendFlags are a send work request's flags, with ibv_send_flags' values.
type SendFlags uint32

const (
	// SendFence holds the request until every earlier READ and atomic of the QP has
	// completed, so that it reads local memory their responses wrote. (The peer
	// executes a QP's requests in order anyway; what a fence orders is this side's
	// reading of its memory against responses still on the way. A retransmission
	// after an RNR NAK reads the memory again, too.)
	SendFence SendFlags = 1 << 0
	// SendSignaled asks for a completion on success (errors always complete).
	SendSignaled SendFlags = 1 << 1
	// SendInline copies the SGL's bytes when the request is posted (their keys are
	// not checked, and the buffers may be reused at once), up to the QP's
	// MaxInlineData; for WRITE and SEND opcodes only.
	SendInline SendFlags = 1 << 3
)

// Flags the emulated NIC does not implement (SOLICITED, IP_CSUM) are refused.
const sendFlagsKnown = SendFence | SendSignaled | SendInline

// SGE is a scatter/gather element: Length bytes at Addr in the MR whose local key is LKey.
type SGE struct {
	Addr   uint64
	Length uint32
	LKey   uint32
}

// SendWR is a send queue work request.
type SendWR struct {
	WRID       uint64
	Opcode     Opcode
	SGL        []SGE
	Flags      SendFlags
	RemoteAddr uint64 // RDMA WRITE, READ, atomics and atomic write
	RKey       uint32 // RDMA WRITE, READ, atomics and atomic write
	Imm        uint32 // OpRDMAWriteImm, OpSendImm: the immediate data
	CompareAdd uint64 // atomics: the compare value (CmpSwap) or the addend (FetchAdd)
	Swap       uint64 // OpAtomicCmpSwap: the value stored if the compare matches
	// UD is where a UD QP's SEND goes (the address handle, remote QPN and Q_Key of
	// ibv_send_wr.wr.ud); nil on an RC QP.
	UD *UDDest
	// InvRKey is the R_Key OpLocalInv and OpSendInv invalidate (invalidate_rkey).
	InvRKey uint32
	// Bind is OpBindMW's window and binding (ibv_send_wr.bind_mw).
	Bind *MWBind

	inline []byte // SendInline: the bytes, copied at post time
}

// MWBind is a bind work request's window and binding, named by keys as the NIC's
// bind WQE names them (rxe's mw_rkey and mr_lkey); MW.BindTo makes one.
type MWBind struct {
	MWRKey uint32 // the window, by its R_Key before the bind
	// RKey is the window's R_Key once bound: its low eight bits (the key's tag,
	// which the application advances for each bind, as ibv_inc_rkey does) replace
	// the window's; its index stays the window's.
	RKey uint32
	// MRLKey is the region the window opens, by its L_Key; it needs AccessMWBind,
	// and AccessLocalWrite for a writable window. A zero Length unbinds a type 1
	// window (MRLKey is not looked at then).
	MRLKey       uint32
	Addr, Length uint64
	// Access is the window's remote rights: AccessRemoteRead, AccessRemoteWrite,
	// AccessRemoteAtomic (AccessLocalWrite is accepted and ignored).
	Access Access
}

// UDDest is the destination of a UD SEND.
type UDDest struct {
	// Addr is the peer's RoCEv2 endpoint (the address handle's GID; port 4791 if
	// none is given).
	Addr netip.AddrPort
	QPN  uint32 // the remote QP
	// QKey is the remote QP's Q_Key; with its high bit set, the sending QP's own
	// Q_Key is sent instead, as verbs has it.
	QKey uint32
}

// RecvWR is a receive queue work request.
type RecvWR struct {
	WRID uint64
	SGL  []SGE
}

func sglLen(sgl []SGE) uint64 {
	var n uint64
	for _, s := range sgl {
		n += uint64(s.Length)
	}
	return n
}

// sgeAt returns the SGE that holds byte off of an SGL's data, and where in it.
func sglAt(sgl []SGE, off uint64) (int, uint64) {
	for i, s := range sgl {
		if off < uint64(s.Length) || i == len(sgl)-1 {
			return i, off
		}
		off -= uint64(s.Length)
	}
	return 0, off
}
