package odp

// The emulated NIC's engine. Each connected QP runs three goroutines:
//   - sendLoop processes the send queue in order: it checks local keys, faults ODP
//     source pages in and puts requests on the wire;
//   - recvLoop takes frames off the wire: responses complete send WRs in order,
//     requests are queued for the responder;
//   - respLoop executes the peer's requests in order against this device's MRs,
//     taking network page faults as needed, and answers with ACK, data or NAK.
//
// RC retries as on hardware: a responder whose request finds ODP pages missing (or
// no receive posted) answers RNR NAK, resolves the fault after sending it, and drops
// the requests behind it until the NAKed PSN comes again; the requester waits the
// RNR timer and retransmits from that request on, up to RNRRetry times (rnr.go).
// Config.ResponderFaults = FaultStall resolves first and answers after instead.
//
// No goroutine ever copies to or from an MR page whose NIC entry is invalid: DMA runs
// between mmu.Table BeginDMA and EndDMA, after any fault has been resolved, and inside
// the device's DMA gate (pagefault.Gate), which orders it against the application's
// own madvise, munmap and mremap. Every DMA is one copy of at most dmaChunk bytes
// between an MR and a packet buffer (MR.dma): none lasts while the NIC waits for the
// peer, so invalidations, Dereg and the gate never wait on the network.

import (
	"encoding/binary"
	"errors"
	"fmt"
	"runtime/debug"

	"github.com/odpemu/odpemu/internal/bufpool"
	"github.com/odpemu/odpemu/transport"
)

// wire returns the QP's connection.
func (qp *QP) wire() transport.Conn {
	qp.mu.Lock()
	defer qp.mu.Unlock()
	return qp.conn
}

// startLocked starts the QP's engine goroutines once. Called with QP.mu held.
func (qp *QP) startLocked() {
	if qp.started {
		return
	}
	qp.started = true
	qp.wg.Add(3)
	go qp.sendLoop()
	go qp.recvLoop()
	go qp.respLoop()
}

func wcOpcode(op Opcode) WCOpcode {
	switch op {
	case OpRDMARead:
		return WCRDMARead
	case OpSend, OpSendImm:
		return WCSend
	case OpAtomicCmpSwap:
		return WCCompSwap
	case OpAtomicFetchAdd:
		return WCFetchAdd
	}
	return WCRDMAWrite
}

// retireLocked completes finished send WRs from the head, in posting order. Called
// with QP.mu held; it takes the CQs' locks.
func (qp *QP) retireLocked() {
	for len(qp.pending) > 0 && qp.pending[0].done {
		p := qp.pending[0]
		qp.pending[0] = nil
		qp.pending = qp.pending[1:]
		qp.sqCount--
		if p.status != WCSuccess || p.wr.Flags&SendSignaled != 0 || qp.cfg.SigAll {
			wc := WC{WRID: p.wr.WRID, Status: p.status, Opcode: wcOpcode(p.wr.Opcode), QPNum: qp.qpn, Detail: p.detail}
			if p.wr.Opcode.readsBack() && p.status == WCSuccess {
				wc.ByteLen = uint32(sglLen(p.wr.SGL)) // as verbs reports a READ's length
			}
			qp.cfg.SendCQ.push(wc)
		}
		if p.status != WCSuccess && p.status != WCWRFlushErr {
			qp.toErrorLocked()
		}
	}
}

// finishLocked marks p done and retires what can be retired. Called with QP.mu held.
func (qp *QP) finishLocked(p *pending, status WCStatus, detail string) {
	if p.done {
		return
	}
	if status == WCSuccess && qp.state == StateError {
		status = WCWRFlushErr
	}
	p.done, p.status, p.detail = true, status, detail
	qp.retireLocked()
	qp.cond.Broadcast() // a fenced request may wait for this one
}

// localSGE checks one SGE against this device's MRs as the NIC does for a local key.
func (qp *QP) localSGE(s SGE, write bool) (*MR, uint64, string) {
	mr := qp.dev.lookupMR(s.LKey)
	switch {
	case mr == nil:
		return nil, 0, fmt.Sprintf("lkey %#x is not a registered MR", s.LKey)
	case mr.pd != qp.pd:
		return nil, 0, fmt.Sprintf("lkey %#x belongs to another PD", s.LKey)
	case write && mr.access&AccessLocalWrite == 0:
		return nil, 0, fmt.Sprintf("MR %#x lacks LOCAL_WRITE", s.LKey)
	}
	off, ok := mr.offset(s.Addr, uint64(s.Length))
	if !ok {
		return nil, 0, fmt.Sprintf("[%#x, +%d) outside MR %#x [%#x, +%d)", s.Addr, s.Length, s.LKey, mr.start, mr.length)
	}
	return mr, off, ""
}

// offset returns addr's offset in the MR if [addr, addr+n) lies inside it.
func (mr *MR) offset(addr, n uint64) (uint64, bool) {
	start := uint64(mr.start)
	if addr < start || addr-start > mr.length || n > mr.length-(addr-start) {
		return 0, false
	}
	return addr - start, true
}

func sglLen(sgl []SGE) uint64 {
	var n uint64
	for _, s := range sgl {
		n += uint64(s.Length)
	}
	return n
}

// gather reads a local SGL into a packet buffer, the way a NIC reads local memory
// into its packet buffers: each SGE's DMA lasts as long as its copy, never as long as
// the wait for the peer (a SEND may wait for a receive indefinitely, and Dereg or an
// invalidation must not wait with it). release returns the buffer to its pool.
func (qp *QP) gather(sgl []SGE) (payload []byte, release func(), status WCStatus, detail string) {
	type seg struct {
		mr  *MR
		off uint64
		n   uint64
	}
	segs := make([]seg, 0, len(sgl))
	for _, s := range sgl {
		mr, off, why := qp.localSGE(s, false)
		if mr == nil {
			return nil, nil, WCLocProtErr, why
		}
		segs = append(segs, seg{mr, off, uint64(s.Length)})
	}
	buf := bufpool.Get(int(sglLen(sgl)))
	release = func() { bufpool.Put(buf) }
	pos := uint64(0)
	for _, s := range segs {
		if err := s.mr.dma(s.off, buf[pos:pos+s.n], false); err != nil {
			release()
			return nil, nil, WCLocProtErr, err.Error()
		}
		pos += s.n
	}
	return buf, release, WCSuccess, ""
}

// scatter writes data into a local SGL, faulting ODP pages in for write. The SGL's
// keys must have been checked with write access.
func (qp *QP) scatter(sgl []SGE, data []byte) (WCStatus, string) {
	for _, s := range sgl {
		if len(data) == 0 {
			break
		}
		mr, off, why := qp.localSGE(s, true)
		if mr == nil {
			return WCLocProtErr, why
		}
		n := min(uint64(s.Length), uint64(len(data)))
		if err := mr.dma(off, data[:n], true); err != nil {
			return WCLocProtErr, err.Error()
		}
		data = data[n:]
	}
	return WCSuccess, ""
}

func (qp *QP) sendLoop() {
	defer qp.wg.Done()
	debug.SetPanicOnFault(true) // see dmaCopy
	for {
		wr, ok := qp.sq.Pop()
		if !ok {
			return
		}
		qp.mu.Lock()
		for qp.mustWaitLocked(wr) {
			qp.cond.Wait()
		}
		qp.mu.Unlock()
		qp.sendMu.Lock()
		qp.send(wr)
		qp.sendMu.Unlock()
	}
}

// send processes one work request: it builds its request and puts it on the wire.
// Called with QP.sendMu held.
func (qp *QP) send(wr *SendWR) {
	qp.mu.Lock()
	p := &pending{wr: wr, psn: qp.nextPSN}
	qp.nextPSN++
	qp.pending = append(qp.pending, p)
	if qp.state == StateError {
		qp.finishLocked(p, WCWRFlushErr, "")
		qp.mu.Unlock()
		return
	}
	conn := qp.conn
	qp.mu.Unlock()

	f, status, detail := qp.request(wr, p.psn)
	qp.mu.Lock()
	if p.done { // finished meanwhile: the peer is gone
		qp.mu.Unlock()
		if f != nil {
			f.Done()
		}
		return
	}
	if status != WCSuccess {
		qp.finishLocked(p, status, detail)
		qp.mu.Unlock()
		return
	}
	p.sent = true
	qp.mu.Unlock()
	if err := conn.Send(f); err != nil {
		qp.mu.Lock()
		qp.finishLocked(p, WCRetryExcErr, "peer unreachable: "+err.Error())
		qp.mu.Unlock()
	}
}

// mustWaitLocked reports whether the send loop holds wr back: the QP is draining
// (SQD, SQE), or wr is fenced and a READ or atomic before it still waits for its
// response. It waits without the send lock, which an RNR retransmission of that READ
// needs. Called with QP.mu held.
func (qp *QP) mustWaitLocked(wr *SendWR) bool {
	if qp.destroyed || qp.state == StateError {
		return false
	}
	if qp.state == StateSQD || qp.state == StateSQE {
		return true
	}
	if wr.Flags&SendFence != 0 {
		for _, c := range qp.pending {
			if !c.done && c.wr.Opcode.readsBack() {
				return true
			}
		}
	}
	return false
}

// request builds the wire request for wr, after the local checks the NIC makes. A
// WRITE's or SEND's payload is a packet buffer that the frame owns: its Release
// returns it, called by whoever consumes or drops the frame.
func (qp *QP) request(wr *SendWR, psn uint32) (*transport.Frame, WCStatus, string) {
	total := sglLen(wr.SGL)
	if total > maxMsg {
		return nil, WCLocLenErr, fmt.Sprintf("message of %d bytes > %d", total, maxMsg)
	}
	f := &transport.Frame{PSN: psn, RKey: wr.RKey, RAddr: wr.RemoteAddr, Len: uint32(total), Op: wireOps[wr.Opcode]}
	switch wr.Opcode {
	case OpRDMAWrite, OpRDMAWriteImm, OpSend, OpSendImm:
		if wr.Opcode == OpSend || wr.Opcode == OpSendImm {
			f.RKey, f.RAddr = 0, 0
		}
		if wr.Opcode == OpRDMAWriteImm || wr.Opcode == OpSendImm {
			f.Imm = wr.Imm
		}
		if wr.Flags&SendInline != 0 {
			f.Payload = wr.inline // copied at post time; the WR keeps it until retired
			break
		}
		payload, release, status, detail := qp.gather(wr.SGL)
		if status != WCSuccess {
			return nil, status, detail
		}
		f.Payload, f.Release = payload, release
	case OpRDMARead, OpAtomicCmpSwap, OpAtomicFetchAdd:
		for _, s := range wr.SGL { // the data lands here later: check now, fault then
			if mr, _, why := qp.localSGE(s, true); mr == nil {
				return nil, WCLocProtErr, why
			}
		}
		if wr.Opcode == OpAtomicCmpSwap {
			f.Swap, f.Compare = wr.Swap, wr.CompareAdd
		} else if wr.Opcode == OpAtomicFetchAdd {
			f.Swap = wr.CompareAdd
		}
	}
	return f, WCSuccess, ""
}

// wireOps are the requests' wire operations.
var wireOps = map[Opcode]transport.Op{
	OpRDMAWrite: transport.OpWrite, OpRDMAWriteImm: transport.OpWriteImm, OpSend: transport.OpSend,
	OpSendImm: transport.OpSendImm, OpRDMARead: transport.OpRead, OpAtomicCmpSwap: transport.OpCmpSwap,
	OpAtomicFetchAdd: transport.OpFetchAdd,
}

func (qp *QP) recvLoop() {
	defer qp.wg.Done()
	debug.SetPanicOnFault(true) // see dmaCopy
	conn := qp.wire()
	for {
		f, err := conn.Recv()
		if err != nil {
			qp.peerGone(err)
			return
		}
		if f.Op.IsRequest() {
			if !qp.respQ.Push(f) {
				f.Done()
			}
			continue
		}
		if !qp.response(f) {
			return
		}
	}
}

// peerGone fails everything outstanding when the wire is gone: the transport's retries
// would run out (RETRY_EXC_ERR); in ERR they are flushed.
func (qp *QP) peerGone(err error) {
	qp.mu.Lock()
	defer qp.mu.Unlock()
	for _, p := range append([]*pending(nil), qp.pending...) {
		if !p.done {
			qp.finishLocked(p, WCRetryExcErr, "connection lost: "+err.Error())
		}
	}
	qp.toErrorLocked()
}

// response completes the oldest sent request with the peer's answer, or, for an RNR
// NAK, retransmits it after the RNR timer. It returns false if the QP was destroyed
// while it waited.
func (qp *QP) response(f *transport.Frame) bool {
	defer f.Done()
	qp.mu.Lock()
	var p *pending
	for _, c := range qp.pending {
		if !c.done && c.sent {
			p = c
			break
		}
	}
	if p == nil || p.psn != f.PSN {
		if p != nil {
			qp.finishLocked(p, WCBadRespErr, fmt.Sprintf("response PSN %d, expected %d", f.PSN, p.psn))
		}
		qp.toErrorLocked()
		qp.mu.Unlock()
		return true
	}
	inError := qp.state == StateError
	qp.mu.Unlock()
	if f.Op == transport.OpNak && f.Syndrome == transport.SynRNR && !inError {
		return qp.rnrRetry(p, f.Timer)
	}

	status, detail := WCSuccess, ""
	switch {
	case inError:
		status = WCWRFlushErr
	case f.Op == transport.OpNak:
		status, detail = nakStatus(f.Syndrome), "responder: "+f.Reason
		if f.Reason == "" {
			detail = fmt.Sprintf("responder NAK (%v)", f.Syndrome)
		}
	case f.Op == transport.OpReadResp && p.wr.Opcode == OpRDMARead:
		if uint64(len(f.Payload)) != sglLen(p.wr.SGL) {
			status, detail = WCBadRespErr, fmt.Sprintf("READ response of %d bytes for %d", len(f.Payload), sglLen(p.wr.SGL))
		} else {
			status, detail = qp.scatter(p.wr.SGL, f.Payload)
		}
	case f.Op == transport.OpAtomicAck && p.wr.Opcode.atomic():
		var orig [8]byte
		binary.NativeEndian.PutUint64(orig[:], f.Swap)
		status, detail = qp.scatter(p.wr.SGL, orig[:])
	case f.Op == transport.OpAck && !p.wr.Opcode.readsBack():
	default:
		status, detail = WCBadRespErr, fmt.Sprintf("%v answers %v", f.Op, p.wr.Opcode)
	}
	qp.mu.Lock()
	qp.finishLocked(p, status, detail)
	qp.mu.Unlock()
	return true
}

func nakStatus(s transport.Syndrome) WCStatus {
	switch s {
	case transport.SynInvalidReq:
		return WCRemInvReqErr
	case transport.SynRemoteAccess:
		return WCRemAccessErr
	case transport.SynRemoteOp:
		return WCRemOpErr
	case transport.SynNoResponse:
		return WCRetryExcErr
	}
	return WCBadRespErr
}

func (qp *QP) respLoop() {
	defer qp.wg.Done()
	debug.SetPanicOnFault(true) // see dmaCopy
	conn := qp.wire()
	for {
		f, ok := qp.respQ.Pop()
		if !ok {
			return
		}
		if !qp.inSequence(f) {
			f.Done() // dropped after an RNR NAK: the requester sends it again
			continue
		}
		resp, resolve := qp.execute(f)
		f.Done()
		if resp == nil {
			return // destroyed while waiting for a receive
		}
		if resp.Op == transport.OpNak && resp.Syndrome != transport.SynNoResponse && resp.Syndrome != transport.SynRNR {
			qp.toError() // RC responder errors of class B and C end the connection
		}
		if err := conn.Send(resp); err != nil {
			return
		}
		if resolve != nil {
			// The page fault behind an RNR NAK, while the requester waits. If it
			// fails (the MR was deregistered, its memory unmapped), the request runs
			// without RNR when it comes again, and its DMA reports the error.
			if err := resolve(); err != nil {
				qp.mu.Lock()
				qp.rnrFailed, qp.rnrFailedPSN = true, resp.PSN
				qp.mu.Unlock()
			}
		}
	}
}

// inSequence reports whether the responder executes f: after an RNR NAK it drops
// every request until the NAKed one comes again. Executed requests advance the
// expected PSN.
func (qp *QP) inSequence(f *transport.Frame) bool {
	qp.mu.Lock()
	defer qp.mu.Unlock()
	if qp.rnrWait && f.PSN != qp.respPSN {
		return false
	}
	if qp.rnrFailed && f.PSN != qp.rnrFailedPSN {
		qp.rnrFailed = false
	}
	qp.rnrWait = false
	qp.respPSN = f.PSN + 1
	return true
}

// nak answers f with a NAK; reason says why, for the requester's completion detail.
func nak(f *transport.Frame, s transport.Syndrome, reason string) *transport.Frame {
	return &transport.Frame{Op: transport.OpNak, PSN: f.PSN, Syndrome: s, Reason: reason}
}

// remoteMR checks a request's rkey, range and rights against this device's MRs, and
// says why it refuses.
func (qp *QP) remoteMR(f *transport.Frame, need Access) (*MR, uint64, string) {
	mr := qp.dev.lookupMR(f.RKey)
	switch {
	case mr == nil:
		return nil, 0, fmt.Sprintf("rkey %#x is not a registered MR", f.RKey)
	case mr.pd != qp.pd:
		return nil, 0, fmt.Sprintf("rkey %#x belongs to another PD", f.RKey)
	case mr.access&need == 0:
		return nil, 0, fmt.Sprintf("MR %#x lacks %v", f.RKey, need)
	}
	off, ok := mr.offset(f.RAddr, uint64(f.Len))
	if !ok {
		return nil, 0, fmt.Sprintf("[%#x, +%d) outside MR %#x [%#x, +%d)", f.RAddr, f.Len, f.RKey, mr.start, mr.length)
	}
	return mr, off, ""
}

// execute runs one request as the responder and returns the response, or nil if the
// QP was destroyed while the request waited. With an RNR NAK it may return the page
// fault to resolve once the NAK is sent (FaultRNR).
func (qp *QP) execute(f *transport.Frame) (*transport.Frame, func() error) {
	if qp.inError() {
		return nak(f, transport.SynNoResponse, "responder QP in error"), nil
	}
	switch f.Op {
	case transport.OpWrite, transport.OpWriteImm:
		mr, off, why := qp.remoteMR(f, AccessRemoteWrite)
		if mr == nil {
			return nak(f, transport.SynRemoteAccess, why), nil
		}
		if resolve := qp.rnrFault(mr, off, uint64(len(f.Payload)), true); resolve != nil {
			return qp.rnrNak(f, "page fault"), resolve
		}
		if err := mr.dma(off, f.Payload, true); err != nil {
			return nak(f, transport.SynRemoteAccess, err.Error()), nil
		}
		if f.Op == transport.OpWriteImm {
			return qp.receive(f)
		}
		return &transport.Frame{Op: transport.OpAck, PSN: f.PSN}, nil
	case transport.OpCmpSwap, transport.OpFetchAdd:
		if f.RAddr%8 != 0 {
			return nak(f, transport.SynInvalidReq, fmt.Sprintf("atomic at %#x is not 8-byte aligned", f.RAddr)), nil
		}
		mr, off, why := qp.remoteMR(f, AccessRemoteAtomic)
		if mr == nil {
			return nak(f, transport.SynRemoteAccess, why), nil
		}
		if resolve := qp.rnrFault(mr, off, 8, true); resolve != nil {
			return qp.rnrNak(f, "page fault"), resolve
		}
		orig, err := mr.atomic(off, f.Op == transport.OpCmpSwap, f.Compare, f.Swap)
		if err != nil {
			return nak(f, transport.SynRemoteAccess, err.Error()), nil
		}
		return &transport.Frame{Op: transport.OpAtomicAck, PSN: f.PSN, Swap: orig}, nil
	case transport.OpRead:
		mr, off, why := qp.remoteMR(f, AccessRemoteRead)
		if mr == nil {
			return nak(f, transport.SynRemoteAccess, why), nil
		}
		if resolve := qp.rnrFault(mr, off, uint64(f.Len), false); resolve != nil {
			return qp.rnrNak(f, "page fault"), resolve
		}
		// Copied into the response, so the DMA ends now, not when the requester has
		// consumed the data.
		buf := bufpool.Get(int(f.Len))
		if err := mr.dma(off, buf, false); err != nil {
			bufpool.Put(buf)
			return nak(f, transport.SynRemoteAccess, err.Error()), nil
		}
		return &transport.Frame{Op: transport.OpReadResp, PSN: f.PSN, Len: f.Len, Payload: buf, Release: func() { bufpool.Put(buf) }}, nil
	case transport.OpSend, transport.OpSendImm:
		return qp.receive(f)
	}
	return nak(f, transport.SynInvalidReq, fmt.Sprintf("opcode %v", f.Op)), nil
}

// rnrFault reports, under FaultRNR, whether ODP pages of MR bytes [off, off+n) lack
// an entry for the access, and then returns the network page fault to resolve after
// the RNR NAK. It returns nil when the request can run now, or when resolving its
// fault failed last time (then its DMA faults and reports why).
func (qp *QP) rnrFault(mr *MR, off, n uint64, write bool) func() error {
	if qp.dev.cfg.ResponderFaults != FaultRNR || !mr.odp || n == 0 || qp.rnrFailed {
		return nil
	}
	first, count := mr.pageSpan(off, n)
	mr.table.Lock()
	miss := mr.table.MissingLocked(first, count, write)
	mr.table.Unlock()
	if miss < 0 {
		return nil
	}
	return func() error {
		_, err := mr.mapRange(first, count, write, false, true)
		return err
	}
}

// receive consumes the oldest posted receive for a SEND, whose payload it places
// there, or for an RDMA WRITE with immediate, whose data is already written. With no
// receive posted, or with ODP pages of the receive's buffers missing, it answers RNR
// NAK under FaultRNR; under FaultStall it waits for a receive and faults the pages.
func (qp *QP) receive(f *transport.Frame) (*transport.Frame, func() error) {
	rnr := qp.dev.cfg.ResponderFaults == FaultRNR
	qp.mu.Lock()
	for len(qp.rq) == 0 && qp.state != StateError && !qp.destroyed && !rnr {
		qp.cond.Wait()
	}
	if qp.destroyed {
		qp.mu.Unlock()
		return nil, nil
	}
	if qp.state == StateError {
		qp.mu.Unlock()
		return nak(f, transport.SynNoResponse, "responder QP in error"), nil
	}
	if len(qp.rq) == 0 {
		qp.mu.Unlock()
		return qp.rnrNak(f, "no receive posted"), nil
	}
	wr := qp.rq[0]
	qp.mu.Unlock()
	if f.Op != transport.OpWriteImm {
		if resolve := qp.recvFault(wr.SGL, uint64(len(f.Payload))); resolve != nil {
			return qp.rnrNak(f, "page fault"), resolve
		}
	}
	qp.mu.Lock()
	if len(qp.rq) == 0 { // flushed meanwhile: the QP went to ERR
		qp.mu.Unlock()
		return nak(f, transport.SynNoResponse, "responder QP in error"), nil
	}
	qp.rq = qp.rq[1:] // the head is wr: only this loop takes receives
	qp.mu.Unlock()

	wc := WC{WRID: wr.WRID, Opcode: WCRecv, QPNum: qp.qpn, ByteLen: uint32(len(f.Payload))}
	if f.Op.HasImm() {
		wc.Flags, wc.ImmData = WCWithImm, f.Imm
	}
	var resp *transport.Frame
	if f.Op == transport.OpWriteImm {
		wc.Opcode = WCRecvRDMAWithImm
		resp = &transport.Frame{Op: transport.OpAck, PSN: f.PSN}
	} else if capacity := sglLen(wr.SGL); uint64(len(f.Payload)) > capacity {
		wc.Status, wc.Detail = WCLocLenErr, fmt.Sprintf("%d-byte SEND into a %d-byte receive", len(f.Payload), capacity)
		resp = nak(f, transport.SynInvalidReq, wc.Detail)
	} else if status, detail := qp.scatter(wr.SGL, f.Payload); status != WCSuccess {
		wc.Status, wc.Detail = status, detail
		resp = nak(f, transport.SynRemoteOp, "receive: "+detail)
	} else {
		resp = &transport.Frame{Op: transport.OpAck, PSN: f.PSN}
	}
	qp.mu.Lock()
	if wc.Status == WCSuccess && qp.state == StateError {
		wc.Status = WCWRFlushErr
	}
	qp.cfg.RecvCQ.push(wc)
	qp.mu.Unlock()
	return resp, nil
}

// recvFault is rnrFault for the first n bytes of a receive's buffers. Bad keys are
// left for scatter to report.
func (qp *QP) recvFault(sgl []SGE, n uint64) func() error {
	var faults []func() error
	for _, s := range sgl {
		if n == 0 {
			break
		}
		k := min(uint64(s.Length), n)
		n -= k
		if mr, off, _ := qp.localSGE(s, true); mr != nil {
			if resolve := qp.rnrFault(mr, off, k, true); resolve != nil {
				faults = append(faults, resolve)
			}
		}
	}
	if len(faults) == 0 {
		return nil
	}
	return func() error {
		var errs []error
		for _, f := range faults {
			errs = append(errs, f())
		}
		return errors.Join(errs...)
	}
}

// errDMAFault: a copy touched memory that is not mapped any more.
var errDMAFault = errors.New("odp: DMA touched unmapped memory")

// dmaCopy is the DMA engine's copy. An application that unmaps memory under an
// in-flight DMA makes the copy fault; the engine goroutines run with
// debug.SetPanicOnFault, so that is reported as an error (an access error completion),
// not a crash.
func (d *Device) dmaCopy(dst, src []byte) error {
	return d.dmaRun(func() { copy(dst, src) })
}

// dmaRun runs one DMA access, a copy or an atomic, reporting a fault on unmapped
// memory as dmaCopy does.
func (d *Device) dmaRun(access func()) (err error) {
	defer func() {
		if r := recover(); r != nil {
			// Memory faults under SetPanicOnFault carry the faulting address; any
			// other panic is a bug and goes on.
			fault, ok := r.(interface{ Addr() uintptr })
			if !ok {
				panic(r)
			}
			d.stats.dmaFaults.Add(1)
			err = fmt.Errorf("%w at %#x", errDMAFault, fault.Addr())
		}
	}()
	access()
	return nil
}
