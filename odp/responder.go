package odp

// The engine's responder side: the peer's requests, taken in PSN order and checked
// by the RC responder (roce.Responder), placed in or read from this device's MRs;
// and the answers (ACKs, NAKs, READ responses, atomic results), sent in order (a UC
// QP's responder answers nothing: what it cannot take it drops, with its message).
//
// What the responder does when a request finds ODP pages missing (a network page
// fault), by policy and operation:
//
//	               FaultRNR (mlx5, the default)          FaultStall (rxe)
//	WRITE, SEND    RNR NAK; resolved meanwhile; the      waits for the fault, then
//	               retransmission is RNR NAKed again     takes the request
//	               until the fault is resolved
//	READ, atomic,  waits for the fault (IBTA lets a      waits for the fault
//	atomic write   responder RNR NAK only requests that
//	               consume a receive; mlx5 resumes the
//	               QP once an RDMA responder fault is
//	               resolved, rxe faults synchronously)
//	UC SEND,       waits for the fault (UC has no RNR    waits for the fault
//	UC WRITE       NAK)
//
// A SEND or WRITE with immediate that finds no receive posted is answered RNR NAK
// under both policies (IBTA's receiver not ready); on UC it is dropped. An RNR NAK goes to the packet
// that faulted (the run's first PSN, the expected one): the packets placed before
// it are not sent again, and the fault resolves the rest of the message up to
// Config.PrefetchLimit (4 MiB by default, mlx5's MAX_PREFETCH_LEN), so that the
// retransmission finds it mapped.

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sync/atomic"

	"github.com/odpemu/odpemu/transport/roce"
)

// job is an answer the responder sends, in order: one packet (an ACK, a NAK, an
// atomic's result), or a READ response sent run by run as the link takes it.
type job struct {
	seg  roce.Segment
	read *readJob
}

// readJob is a READ response in progress: total packets from PSN first, read from
// MR bytes [off, off+length), k of them sent.
type readJob struct {
	mr       *MR
	off      uint64
	length   uint32
	first    uint32
	total, k int
	msn      uint32
	fault    *faultJob // the last fault resolved for it: if it failed, the READ fails
}

// answer queues a one-packet answer.
func (e *engine) answer(m *roce.Message) {
	m.DestQP = e.remote
	if m.Kind == roce.KindAck && m.Syndrome == roce.SynACK {
		// ACKs coalesce: a later one acknowledges everything an earlier one did.
		if n := len(e.jobs); n > e.jobHead && e.jobs[n-1].read == nil && e.jobs[n-1].seg.Opcode == roce.Acknowledge &&
			e.jobs[n-1].seg.Syndrome == roce.SynACK {
			e.jobs[n-1].seg = m.Segment()
			return
		}
	}
	e.jobs = append(e.jobs, job{seg: m.Segment()})
}

// takeRequest takes one run of the peer's requests. It reports false when the responder
// waits (a fault it stalls on, the gate): the run stays at the inbox's head.
func (e *engine) takeRequest(s *roce.Segment) bool {
	if e.stall != nil {
		return false
	}
	v := e.resp.Receive(s)
	if err := e.faultErr; err != nil && (v.Act == roce.ActPlace || v.Act == roce.ActRead || v.Act == roce.ActAtomic) {
		// The request whose fault failed, again: a NIC that cannot map the pages
		// answers with a remote access error, as rxe does when its fault fails.
		e.faultErr = nil
		e.release(s)
		e.refuse(e.resp.Fail(roce.SynNAKRemoteAccess), "network page fault: "+err.Error())
		return true
	}
	switch v.Act {
	case roce.ActDrop:
		e.rc(func(c *rcCounters) *atomic.Uint64 { return &c.dropped })
	case roce.ActNAK:
		if v.Fatal {
			e.refuse(v.Resp, "malformed request")
		} else {
			e.rc(func(c *rcCounters) *atomic.Uint64 { return &c.seqNAKsSent })
			e.answer(v.Resp)
			if !e.uc {
				e.nakedBack(s)
			}
		}
	case roce.ActAck, roce.ActAtomicAgain:
		e.rc(func(c *rcCounters) *atomic.Uint64 { return &c.duplicates })
		e.answer(v.Resp)
	case roce.ActReadAgain:
		e.rc(func(c *rcCounters) *atomic.Uint64 { return &c.duplicates })
		mr, off, _ := e.qp.remoteMR(v.Msg.RKey, v.Msg.VA, uint64(v.Msg.Length), AccessRemoteRead)
		if mr != nil {
			e.queueRead(mr, off, &v)
		} // else dropped: the MR went away since (class D)
	case roce.ActRead:
		return e.read(s, &v)
	case roce.ActAtomic:
		return e.atomic(s, &v)
	case roce.ActPlace:
		return e.placeRun(s, &v)
	}
	e.release(s)
	return true
}

// refuse answers a request with a NAK that ends the QP (an access error, an invalid
// request); why is kept as the QP's last refusal (RespError). A UC QP answers
// nothing: it drops the message and goes on (rxe's drop_msg).
func (e *engine) refuse(nak *roce.Message, why string) {
	e.qp.mu.Lock()
	e.qp.lastRefusal = why
	e.qp.mu.Unlock()
	if e.uc {
		e.dropMessage()
		return
	}
	e.answer(nak)
	e.qp.toError()
	e.toError()
}

// rnr answers the run s at the expected PSN with an RNR NAK (nakedBack); a UC QP
// drops the message instead.
func (e *engine) rnr(s *roce.Segment) {
	if e.uc {
		e.refuse(nil, "no receive posted")
		return
	}
	e.rc(func(c *rcCounters) *atomic.Uint64 { return &c.rnrNAKsSent })
	e.answer(e.resp.RNR(e.qp.minRNRTimer()))
	e.nakedBack(s)
}

// nakedBack follows an RC responder's answer to s that sends the requester back (an
// RNR NAK, a sequence error NAK): the request runs behind s that the requester sent
// after the NAK reached it in the link's model go back to it, those in the inbox
// (giveBack) and those the port has yet to deliver (roce.Port.NAKed).
func (e *engine) nakedBack(s *roce.Segment) {
	e.port.NAKed(s)
	e.givingBack = true
}

// giveBack gives the request run s, in the inbox behind one the responder answered
// this pass with a NAK that sends the requester back, back to the requester if the
// link says it was sent after that NAK reached it (roce.Port.GiveBack): the
// responder would drop it, and the requester would count it among what it sends
// again.
func (e *engine) giveBack(s *roce.Segment) bool {
	if !e.port.GiveBack(s) {
		return false
	}
	e.release(s) // the requester's DMA ends here, as for a run taken
	return true
}

// dropMessage drops the UC message in progress: what of it was placed stays, its
// receive is not taken, and the rest of it is dropped as it comes.
func (e *engine) dropMessage() {
	e.resp.Drop()
	e.recv, e.msgMR = nil, nil
	e.rc(func(c *rcCounters) *atomic.Uint64 { return &c.dropped })
}

// fault is how a placement or a DMA the responder tried came out.
type fault int

const (
	faultNone  fault = iota
	faultBusy        // the gate is busy: try again shortly
	faultMiss        // a page is missing: a network page fault
	faultLost        // the sender's memory went away or its copy was torn: the run is lost
	faultError       // the MR cannot be written or read: an access error
)

// placeRun places a SEND or WRITE run (or an atomic write).
func (e *engine) placeRun(s *roce.Segment, v *roce.Verdict) bool {
	if v.Msg.Kind == roce.KindAtomicWrite {
		return e.atomic(s, v)
	}
	if e.rnrFault != nil { // the retransmission of an RNR NAKed run: its fault still runs
		e.rnr(s)
		e.release(s)
		return true
	}
	if e.memoryBusy() {
		return false // earlier READs are still being answered (their copy wakes us)
	}
	payload := s.Payload[v.Skip*e.mtu:]
	starts := !e.resp.InMessage()
	var (
		res       fault
		err       error
		mr        *MR
		miss, end int
		recv      *RecvWR
		seq       uint64 // recv's number, when this run starts a SEND
	)
	switch v.Msg.Kind {
	case roce.KindWrite:
		if starts {
			var off uint64
			var why string
			if !e.allows(s, AccessRemoteWrite) {
				return true
			}
			if mr, off, why = e.qp.remoteMR(v.Msg.RKey, v.Msg.VA, uint64(v.Msg.Length), AccessRemoteWrite); mr == nil {
				e.release(s)
				e.refuse(e.resp.Fail(roce.SynNAKRemoteAccess), why)
				return true
			}
			e.msgMR, e.msgOff = mr, off
		}
		if v.Ends && v.Msg.HasImm && !e.qp.hasRecv() {
			e.release(s)
			e.rnr(s) // WRITE with immediate consumes a receive: none posted
			return true
		}
		mr = e.msgMR
		res, miss, end, err = e.write(mr, e.msgOff+uint64(v.Off), payload, s)
	case roce.KindSend:
		recv = e.recv
		if starts {
			var ok bool
			if seq, ok = e.qp.peekRecv(&e.recvWR); !ok {
				e.release(s)
				e.rnr(s) // receiver not ready
				return true
			}
			recv, e.recvSeq = &e.recvWR, seq
		}
		if capacity := sglLen(recv.SGL); uint64(v.Off)+uint64(len(payload)) > capacity {
			e.release(s)
			why := fmt.Sprintf("%d-byte SEND into a %d-byte receive", uint64(v.Off)+uint64(len(payload)), capacity)
			if e.uc { // dropped: the receive stays for the next message
				e.refuse(nil, why)
				return true
			}
			if starts {
				e.qp.takeRecv(seq)
			}
			e.pushRecvs()
			e.qp.cfg.RecvCQ.push(WC{WRID: recv.WRID, Status: WCLocLenErr, Opcode: WCRecv, QPNum: e.qp.qpn, Detail: why})
			e.recv = nil
			e.refuse(e.resp.Fail(roce.SynNAKInvalidRequest), why)
			return true
		}
		res, mr, miss, end, err = e.scatter(recv.SGL, uint64(v.Off), payload, s)
	}
	switch res {
	case faultBusy:
		e.gateBusy()
		return false
	case faultMiss:
		// The run's pages on this MR at least; for a WRITE, the rest of its message.
		end = max(end, mr.pageSpanEnd(e.faultEnd(mr, v, payload)))
		f := e.startFault(mr, miss, end, true)
		if e.dev.cfg.ResponderFaults == FaultStall || e.uc { // UC has no RNR NAK: the QP waits
			e.hold(f)
			return false
		}
		e.rnrFault = f
		e.rnr(s)
		e.release(s)
		return true
	case faultLost:
		e.release(s)
		if e.uc {
			e.refuse(nil, "the sender's memory went away") // nothing comes again
			return true
		}
		e.rc(func(c *rcCounters) *atomic.Uint64 { return &c.dropped })
		return true // the requester sends it again (a sequence NAK for what follows)
	case faultError:
		e.release(s)
		if e.uc {
			e.refuse(nil, err.Error())
			return true
		}
		if v.Msg.Kind == roce.KindSend {
			if starts {
				e.qp.takeRecv(seq)
			}
			e.pushRecvs()
			e.qp.failWith(e.qp.cfg.RecvCQ, WC{WRID: recv.WRID, Status: WCLocProtErr, Opcode: WCRecv, QPNum: e.qp.qpn,
				Detail: err.Error()})
			e.recv = nil
			e.refuse(e.resp.Fail(roce.SynNAKRemoteOperation), "receive: "+err.Error())
		} else {
			e.refuse(e.resp.Fail(roce.SynNAKRemoteAccess), err.Error())
		}
		return true
	}
	if e.release(s) { // the sender's copy was torn: the run is lost, sent again
		if e.uc {
			e.refuse(nil, "the sender's copy was torn") // nothing comes again
			return true
		}
		e.rc(func(c *rcCounters) *atomic.Uint64 { return &c.dropped })
		return true
	}
	switch {
	case v.Msg.Kind != roce.KindSend:
	case e.uc:
		// UC takes the receive when the message ends: one lost before then
		// leaves it for the next message.
		e.recv = recv
		if v.Ends && !e.qp.takeRecv(e.recvSeq) {
			e.recv = nil
			e.resp.Drop() // flushed meanwhile: the QP is in ERR
			return true
		}
	case starts:
		if !e.qp.takeRecv(seq) {
			return true // flushed meanwhile: the QP is in ERR, and answers nothing more
		}
		e.recv = recv
	}
	if v.Ends && v.Msg.Inv {
		if why := e.qp.invalidate(v.Msg.Imm); why != "" {
			// rxe's class J: the receive completes with the error, the QP goes to
			// ERR, and the requester learns of an invalid request.
			e.pushRecvs()
			e.qp.failWith(e.qp.cfg.RecvCQ, WC{WRID: e.recv.WRID, Status: WCRemInvReqErr, Opcode: WCRecv,
				QPNum: e.qp.qpn, Detail: "SEND with invalidate: " + why})
			e.recv = nil
			e.msgMR = nil
			e.refuse(e.resp.Fail(roce.SynNAKInvalidRequest), "SEND with invalidate: "+why)
			return true
		}
	}
	if e.resp.Placed(s, v) {
		e.ackOwed = true
	}
	if v.Ends {
		e.msgMR = nil
		switch {
		case v.Msg.Kind == roce.KindSend:
			wc := WC{WRID: e.recv.WRID, Opcode: WCRecv, QPNum: e.qp.qpn, ByteLen: v.Off + uint32(len(payload))}
			switch {
			case v.Msg.HasImm:
				wc.Flags, wc.ImmData = WCWithImm, v.Msg.Imm
			case v.Msg.Inv:
				wc.Flags, wc.InvRKey = WCWithInv, v.Msg.Imm
			}
			e.recvDone(wc)
			e.recv = nil
		case v.Msg.HasImm:
			seq, ok := e.qp.peekRecv(&e.recvWR)
			if !ok || !e.qp.takeRecv(seq) {
				break // flushed meanwhile: the QP is in ERR
			}
			e.recvDone(WC{WRID: e.recvWR.WRID, Opcode: WCRecvRDMAWithImm, QPNum: e.qp.qpn, ByteLen: v.Msg.Length,
				Flags: WCWithImm, ImmData: v.Msg.Imm})
		}
	}
	return true
}

// recvDone completes a receive (flushed if the QP went to ERR meanwhile). The
// completion is queued with the others of the receive pass, and pushRecvs writes
// them to the CQ together (a CQ's lock taken once per pass, not once per message).
func (e *engine) recvDone(wc WC) {
	if QPState(e.qp.st.Load()) == StateError {
		wc.Status = WCWRFlushErr
	}
	e.recvWCs = append(e.recvWCs, wc)
}

// pushRecvs writes the receive completions recvDone queued to the receive CQ, in
// order: at the end of every receive pass, before the ACKs of their messages go
// out (a requester's completion never precedes its receive's), before the pass
// takes a response (whose completions come after them, receive), and before the
// engine completes anything else into that CQ (an error after them).
func (e *engine) pushRecvs() {
	if len(e.recvWCs) > 0 {
		e.qp.cfg.RecvCQ.pushAll(e.recvWCs)
		clear(e.recvWCs)
		e.recvWCs = e.recvWCs[:0]
	}
}

// faultEnd is the MR byte where a responder fault on run v stops: the end of its
// message, at most Config.PrefetchLimit past the run.
func (e *engine) faultEnd(mr *MR, v *roce.Verdict, payload []byte) uint64 {
	if v.Msg.Kind != roce.KindWrite || mr != e.msgMR {
		return 0 // a receive's buffer: the run's own pages
	}
	start := e.msgOff + uint64(v.Off)
	return min(e.msgOff+uint64(v.Msg.Length), start+uint64(len(payload))+uint64(e.dev.cfg.PrefetchLimit))
}

// write places payload at MR bytes [off, ...), the DMA of a WRITE run. A page
// fault is returned with the first page missing and the page after the run's.
func (e *engine) write(mr *MR, off uint64, payload []byte, s *roce.Segment) (fault, int, int, error) {
	if len(payload) == 0 {
		return faultNone, -1, 0, nil
	}
	miss, torn, err, copyErr := e.place(mr, off, payload)
	if res := dmaOutcome(miss, err); res != faultNone {
		return res, miss, mr.pageSpanEnd(off + uint64(len(payload))), err
	}
	switch {
	case copyErr != nil && srcFaulted(copyErr, s.Payload):
		return faultLost, -1, 0, nil
	case copyErr != nil:
		return faultError, -1, 0, copyErr
	case torn:
		return faultLost, -1, 0, nil // made again when the requester sends it again
	}
	return faultNone, -1, 0, nil
}

// place is the DMA that writes data at MR bytes [off, off+len(data)) (already
// bounds-checked), for a WRITE or SEND run the responder places or a READ response
// the requester delivers. Without the audit it runs under the receive pass's hold
// on mr: a page check and the copy per run. It returns the first page missing, or
// why the DMA could not begin (err: the gate, the MR), or why the copy failed
// (copyErr), or whether the copy was torn (see dmaRef.release).
func (e *engine) place(mr *MR, off uint64, data []byte) (miss int, torn bool, err, copyErr error) {
	if !e.dev.cfg.Audit && mr.file == nil {
		// Covered by a run in the inbox, the hold needs no gate entry of its
		// own: without the audit every run the pass releases is put at its end
		// (letGo), after the pass's holds are closed, so the run's entry lasts
		// as long as the hold.
		h, err := holdOn(&e.placing, mr, e.covering > 0)
		miss := -1
		if err == nil {
			miss, _, err = h.check(off, uint64(len(data)), true)
		}
		if miss >= 0 || err != nil {
			return miss, false, err, nil
		}
		dst := mr.slice(off, uint64(len(data)))
		if copyErr = e.dev.dmaCopy(dst, data); copyErr != nil {
			return -1, false, nil, copyErr
		}
		return -1, h.torn(dst), nil, nil
	}
	ref, miss, err := mr.tryAcquire(off, uint64(len(data)), true, e.covering > 0)
	if miss >= 0 || err != nil {
		return miss, false, err, nil
	}
	if mr.file != nil {
		copyErr = mr.fileCopy(off, data, true)
	} else {
		copyErr = e.dev.dmaCopy(ref.bytes(), data)
	}
	return -1, ref.release(copyErr == nil), nil, copyErr
}

// scatter places payload at byte off of a receive's SGL, one DMA per SGE piece. It
// returns the MR of a missing page with the fault (as write does).
func (e *engine) scatter(sgl []SGE, off uint64, payload []byte, s *roce.Segment) (fault, *MR, int, int, error) {
	for pos := 0; pos < len(payload); {
		i, in := sglAt(sgl, off+uint64(pos))
		sg := sgl[i]
		mr, moff, why := e.qp.recvSGE(SGE{Addr: sg.Addr + in, Length: sg.Length - uint32(in), LKey: sg.LKey})
		if mr == nil {
			return faultError, nil, -1, 0, errors.New(why)
		}
		n := min(len(payload)-pos, int(sg.Length)-int(in))
		res, miss, end, err := e.write(mr, moff, payload[pos:pos+n], s)
		if res != faultNone {
			return res, mr, miss, end, err
		}
		pos += n
	}
	return faultNone, nil, -1, 0, nil
}

// dmaOutcome classifies what tryAcquire returned.
func dmaOutcome(miss int, err error) fault {
	switch {
	case errors.Is(err, errGateBusy):
		return faultBusy
	case err != nil:
		return faultError
	case miss >= 0:
		return faultMiss
	}
	return faultNone
}

// allows reports whether the QP's access flags (QPAttr.Access) allow a request that
// needs need; if not, it refuses the request as rxe does, with an invalid request NAK
// (the operation is not supported on this QP).
func (e *engine) allows(s *roce.Segment, need Access) bool {
	if Access(e.qp.access.Load())&need != 0 {
		return true
	}
	e.release(s)
	e.refuse(e.resp.Fail(roce.SynNAKInvalidRequest), fmt.Sprintf("QP %d does not allow %v", e.qp.qpn, need))
	return false
}

// read takes a new READ: its MR is checked, its pages must be present (a READ is
// not RNR NAKed: the responder waits for its fault), and its response is queued.
func (e *engine) read(s *roce.Segment, v *roce.Verdict) bool {
	if !e.allows(s, AccessRemoteRead) {
		return true
	}
	mr, off, why := e.qp.remoteMR(v.Msg.RKey, v.Msg.VA, uint64(v.Msg.Length), AccessRemoteRead)
	if mr == nil {
		e.release(s)
		e.refuse(e.resp.Fail(roce.SynNAKRemoteAccess), why)
		return true
	}
	if miss := mr.firstMissing(off, uint64(v.Msg.Length), false); miss >= 0 {
		end := mr.pageSpanEnd(off + uint64(v.Msg.Length))
		e.hold(e.startFault(mr, miss, end, false))
		return false
	}
	e.resp.ReadDone(v)
	e.queueRead(mr, off, v)
	e.release(s)
	return true
}

// atomic executes a compare-and-swap, a fetch-and-add or an atomic write on 8
// aligned bytes, once: a duplicate atomic is answered from its saved result, a
// duplicate atomic write acknowledged as a WRITE's (rxe's atomic_write_reply, which
// needs REMOTE_WRITE). The requests before it were executed already: the responder
// takes a QP's requests in order.
func (e *engine) atomic(s *roce.Segment, v *roce.Verdict) bool {
	op, need, value := atomicFetchAdd, AccessRemoteAtomic, v.Msg.Swap
	switch v.Msg.Kind {
	case roce.KindCompareSwap:
		op = atomicCmpSwap
	case roce.KindAtomicWrite:
		op, need = atomicStore, AccessRemoteWrite
		value = binary.NativeEndian.Uint64(s.Payload) // one packet of 8 bytes (Receive checked)
	}
	if !e.allows(s, need) {
		return true
	}
	if v.Msg.VA%8 != 0 {
		e.release(s)
		e.refuse(e.resp.Fail(roce.SynNAKInvalidRequest), fmt.Sprintf("atomic at %#x is not 8-byte aligned", v.Msg.VA))
		return true
	}
	mr, off, why := e.qp.remoteMR(v.Msg.RKey, v.Msg.VA, 8, need)
	if mr == nil {
		e.release(s)
		e.refuse(e.resp.Fail(roce.SynNAKRemoteAccess), why)
		return true
	}
	if e.memoryBusy() {
		return false // earlier READs are still being answered
	}
	ref, miss, err := mr.tryAcquire(off, 8, true, e.covering > 0)
	switch dmaOutcome(miss, err) {
	case faultBusy:
		e.gateBusy()
		return false
	case faultMiss:
		e.hold(e.startFault(mr, miss, miss+1, true))
		return false
	case faultError:
		e.release(s)
		e.refuse(e.resp.Fail(roce.SynNAKRemoteAccess), err.Error())
		return true
	}
	orig, err := mr.atomicOn(ref, off, op, v.Msg.Compare, value)
	if err != nil {
		e.release(s)
		e.refuse(e.resp.Fail(roce.SynNAKRemoteAccess), err.Error())
		return true
	}
	if op != atomicStore {
		e.answer(e.resp.AtomicDone(v, orig))
		e.release(s)
		return true
	}
	if e.release(s) { // the sender's copy was torn: it sends the value again, which is stored again
		e.rc(func(c *rcCounters) *atomic.Uint64 { return &c.dropped })
		return true
	}
	if e.resp.Placed(s, v) {
		e.ackOwed = true
	}
	return true
}

// respond queues the answers for the port in order: one-packet answers as they are,
// READ responses run by run, each read from the MR by reference.
func (e *engine) respond() bool {
	defer closeHolds(&e.reading)
	busy := false
	for len(e.jobs) > e.jobHead && len(e.out) < maxOut {
		j := &e.jobs[e.jobHead]
		if j.read == nil {
			e.out = append(e.out, j.seg)
			e.popJob()
			busy = true
			continue
		}
		r := j.read
		if e.stall != nil || !e.retryAt.IsZero() {
			break
		}
		count := min(e.maxRun, r.total-r.k)
		n := min(count*e.mtu, int(r.length)-r.k*e.mtu)
		seg := roce.ReadResponseRun(r.first, r.k, count, r.total, r.msn)
		seg.DestQP = e.remote
		if n > 0 {
			off := r.off + uint64(r.k*e.mtu)
			if r.mr.file != nil {
				buf := make([]byte, n)
				ref, miss, err := r.mr.tryAcquire(off, uint64(n), false, e.covering > 0)
				if !e.readOK(r, miss, err) {
					break
				}
				err = r.mr.fileCopy(off, buf, false)
				ref.release(err == nil)
				if err != nil {
					e.readFailed(r, err)
					continue
				}
				seg.Payload, seg.Ref = buf, nil
			} else if !e.dev.cfg.Audit {
				// By reference under the round's hold on the MR, which the
				// requester's copies end.
				h, err := e.readHold(r.mr)
				miss := -1
				if err == nil {
					miss, _, err = h.check(off, uint64(n), false)
				}
				if !e.readOK(r, miss, err) {
					break
				}
				h.runs++
				seg.Payload, seg.Ref = r.mr.slice(off, uint64(n)), h
			} else {
				ref, miss, err := r.mr.tryAcquire(off, uint64(n), false, false)
				if !e.readOK(r, miss, err) {
					break
				}
				sr := srcRefs.Get().(*srcRef)
				sr.r, sr.owner = ref, e
				e.unread.Add(1)
				seg.Payload, seg.Ref = ref.bytes(), sr
			}
		}
		e.out = append(e.out, seg)
		r.k += count
		if r.k == r.total {
			e.popJob()
		}
		busy = true
	}
	return busy
}

// readOK handles the outcome of a DMA for a READ response run: it reports true if
// it began; else the gate is busy, a fault is resolved first (an invalidation took
// the pages since the READ was taken), or the READ fails (its pages cannot be
// mapped: the fault resolved for it failed).
func (e *engine) readOK(r *readJob, miss int, err error) bool {
	switch dmaOutcome(miss, err) {
	case faultBusy:
		e.gateBusy()
		return false
	case faultMiss:
		if r.fault != nil && r.fault.err != nil {
			e.readFailed(r, fmt.Errorf("network page fault: %w", r.fault.err))
			return false
		}
		r.fault = e.startFault(r.mr, miss, r.mr.pageSpanEnd(r.off+uint64(r.length)), false)
		e.hold(r.fault)
		return false
	case faultError:
		e.readFailed(r, err)
		return false
	}
	return true
}

// readFailed answers a READ whose memory cannot be read any more with a remote
// access NAK in place of its next response packet; the QP goes to ERR.
func (e *engine) readFailed(r *readJob, err error) {
	nak := &roce.Message{Kind: roce.KindAck, Syndrome: roce.SynNAKRemoteAccess, MSN: r.msn,
		PSN: (r.first + uint32(r.k)) & (1<<24 - 1)}
	e.popJob()
	e.refuse(nak, err.Error())
}

// memoryBusy reports whether the responder must not change its memory yet: it owes
// READ responses not built yet, or sent some by reference that the requester has
// not copied (unread). RC executes a QP's requests in order, so a WRITE or an
// atomic after a READ must not show in the READ's data.
func (e *engine) memoryBusy() bool {
	if e.unread.Load() > 0 {
		// Say that the engine waits, then look again: either the reader that
		// ends the last sees memWait, or this load sees its end.
		e.memWait.Store(true)
		if e.unread.Load() > 0 {
			return true
		}
	}
	if e.memWait.Load() {
		e.memWait.Store(false)
	}
	for i := e.jobHead; i < len(e.jobs); i++ {
		if e.jobs[i].read != nil {
			return true
		}
	}
	return false
}

// readHold returns the respond round's hold on mr, opening it: it counts in unread
// until the requester has copied every run read under it.
func (e *engine) readHold(mr *MR) (*dmaHold, error) {
	n := len(e.reading)
	h, err := holdOn(&e.reading, mr, false)
	if err == nil && len(e.reading) > n { // opened now
		h.owner = e
		e.unread.Add(1)
	}
	return h, err
}

// readEnded ends one unit of unread (a READ response run read by reference, or a
// hold over such runs); the responder waiting for the last is woken.
func (e *engine) readEnded() {
	if e.unread.Add(-1) == 0 && e.memWait.Load() {
		e.wake() // the responder may write memory again
	}
}

// queueRead queues the READ v asks for, of MR bytes [off, off+length).
func (e *engine) queueRead(mr *MR, off uint64, v *roce.Verdict) {
	r := e.freeReads.pop()
	*r = readJob{mr: mr, off: off, length: v.Msg.Length, first: v.Msg.First,
		total: roce.Packets(int(v.Msg.Length), e.mtu), msn: e.resp.MSN()}
	e.jobs = append(e.jobs, job{read: r})
}

// popJob removes the oldest job; a READ's readJob is kept for the next READ.
func (e *engine) popJob() {
	j := &e.jobs[e.jobHead]
	if j.read != nil {
		e.freeReads.push(j.read)
	}
	*j = job{}
	e.jobHead++
	switch {
	case e.jobHead == len(e.jobs):
		e.jobs, e.jobHead = e.jobs[:0], 0
	case e.jobHead >= 64 && e.jobHead > len(e.jobs)/2:
		n := copy(e.jobs, e.jobs[e.jobHead:])
		clear(e.jobs[n:])
		e.jobs, e.jobHead = e.jobs[:n], 0
	}
}

// readJobs is an engine's free list of readJobs: a READ allocates nothing.
type readJobs []*readJob

func (f *readJobs) pop() *readJob {
	if n := len(*f); n > 0 {
		r := (*f)[n-1]
		*f = (*f)[:n-1]
		return r
	}
	return new(readJob)
}

// push keeps r, cleared, for pop to reuse, unless the list holds as many as a
// responder keeps READs for.
func (f *readJobs) push(r *readJob) {
	if len(*f) < MaxRdAtomicLimit {
		*r = readJob{}
		*f = append(*f, r)
	}
}
