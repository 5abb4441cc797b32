package odp

// The engine's requester side: work requests from the send queue into the RC
// requester (post), their packets out of local memory onto the wire (transmit), the
// responder's answers (response), and completions in posting order (retire).

import (
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/odpemu/odpemu/internal/bufpool"
	"github.com/odpemu/odpemu/pagefault"
	"github.com/odpemu/odpemu/transport/roce"
)

// post takes work requests from the send queue into the requester, in order, as far
// as the window, fences and the QP's state allow. A request that fails the NIC's
// local checks completes with an error in its turn.
func (e *engine) post() bool {
	q := &e.qp.sq
	tail := q.tail.Load()
	// After the tail: a PostSend seen here follows the SetSendPSN and ModifyAttr before it.
	e.refresh()
	state := QPState(e.qp.st.Load())
	busy := false
	for e.sqNext < tail {
		w := q.slot(e.sqNext)
		if !e.errored && (state == StateSQD || state == StateSQE) {
			break // draining: started requests complete, later ones wait
		}
		if e.errored || e.req.Failed() {
			w.done, w.status = true, WCWRFlushErr
			e.sqNext++
			busy = true
			continue
		}
		if w.wr.Flags&SendFence != 0 && e.fenced > 0 {
			break // a READ or atomic before it has not completed
		}
		if w.wr.Opcode.readsBack() && e.fenced >= e.rdAtomic {
			// max_rd_atomic READs and atomics are outstanding (by default as many
			// as the responder keeps for their duplicates, max_dest_rd_atomic):
			// one more waits until one completes, as rxe's requester does
			// (check_init_depth).
			break
		}
		if w.wr.Opcode.local() {
			w.done, w.status, w.detail = true, WCSuccess, e.local(&w.wr)
			if w.detail != "" {
				w.status = WCLocQPOpErr
				if w.wr.Opcode == OpBindMW {
					w.status = WCMWBindErr
				}
			}
			e.sqNext++
			busy = true
			continue
		}
		r, status, detail := e.message(w)
		if status != WCSuccess {
			w.done, w.status, w.detail = true, status, detail
			e.sqNext++
			busy = true
			continue
		}
		if e.req.Outstanding() > 0 && e.req.InFlight()+e.req.Span(&r) > e.window {
			break
		}
		out, err := e.req.Post(r, e.now)
		if err != nil {
			w.done, w.status, w.detail = true, WCLocQPOpErr, err.Error()
		} else if w.wr.Opcode.readsBack() {
			e.fenced++
		}
		e.sqNext++
		e.complete(out, "")
		busy = true
	}
	return busy
}

// message makes a work request's RC message, after the local checks the NIC makes:
// its SGL's keys, looked up once (a retransmission reads through the same MRs, or
// finds one deregistered).
func (e *engine) message(w *wqe) (roce.Request, WCStatus, string) {
	wr := &w.wr
	total := sglLen(wr.SGL)
	r := roce.Request{ID: e.sqNext, VA: wr.RemoteAddr, RKey: wr.RKey}
	if total > maxMsg {
		return r, WCLocLenErr, fmt.Sprintf("message of %d bytes > %d", total, maxMsg)
	}
	r.Length = uint32(total)
	writes := wr.Opcode.readsBack() // the data lands in the SGL later: check for write now
	if wr.Flags&SendInline == 0 || writes {
		w.mrs = w.mrBuf[:0]
		for _, s := range wr.SGL {
			mr, _, why := e.qp.localSGE(s, writes)
			if mr == nil {
				return r, WCLocProtErr, why
			}
			w.mrs = append(w.mrs, mr)
		}
	}
	switch wr.Opcode {
	case OpRDMAWrite, OpRDMAWriteImm:
		r.Kind, r.HasImm, r.Imm = roce.KindWrite, wr.Opcode == OpRDMAWriteImm, wr.Imm
	case OpSend, OpSendImm:
		r.Kind, r.VA, r.RKey, r.HasImm, r.Imm = roce.KindSend, 0, 0, wr.Opcode == OpSendImm, wr.Imm
	case OpSendInv:
		r.Kind, r.VA, r.RKey, r.Inv, r.Imm = roce.KindSend, 0, 0, true, wr.InvRKey
	case OpRDMARead:
		r.Kind = roce.KindReadRequest
	case OpAtomicCmpSwap:
		r.Kind, r.Swap, r.Compare = roce.KindCompareSwap, wr.Swap, wr.CompareAdd
	case OpAtomicFetchAdd:
		r.Kind, r.Swap = roce.KindFetchAdd, wr.CompareAdd
	case OpAtomicWrite:
		r.Kind = roce.KindAtomicWrite
	}
	return r, WCSuccess, ""
}

// local executes a request the NIC carries out without the wire, a bind or a local
// invalidate, when the send queue reaches it, and says why it failed ("": it did
// not). A failure completes the request with an error and moves the QP to ERR, as
// on rxe.
func (e *engine) local(wr *SendWR) string {
	if wr.Opcode == OpBindMW {
		return e.qp.bind(wr.Bind)
	}
	return e.qp.invalidate(wr.InvRKey)
}

// transmit builds the requester's next runs out of local memory, as far as the
// port's room, the RNR timer and the requester's faults allow. It notes in
// roomWait that it stopped because the link was full.
func (e *engine) transmit() bool {
	busy := false
	defer closeHolds(&e.holds)
	runs, room := e.room()
	asked, waiting := false, e.roomWait
	e.roomWait = false
	t := &e.tx
	for len(e.out) < maxOut && e.srcFault == nil && e.retryAt.IsZero() && e.req.NextInto(t, e.maxRun) {
		n := roce.WireSize(&t.Seg, t.Len)
		if runs <= 0 || (room >= 0 && n > room) {
			// The link is full: what the requester counts as sent is on it.
			if asked {
				e.roomWait = true
				if !waiting || busy {
					e.roomSince = e.now // the wait starts now
				}
				break
			}
			e.port.WaitRoom()
			asked = true
			runs, room = e.room()
			continue
		}
		w := e.qp.sq.slot(t.ID)
		if t.Len > 0 {
			if !e.payload(w, t) {
				break
			}
		}
		t.Seg.DestQP = e.remote
		if out := e.req.Sent(t, e.now); len(out.Done) > 0 {
			e.complete(out, "") // UC: sent is done
		}
		e.out = append(e.out, t.Seg)
		runs--
		if room >= 0 {
			room -= n
		}
		busy = true
	}
	return busy
}

// room is what the port takes beyond the runs built and not sent yet; it notes in
// roomAt when more room opens by itself.
func (e *engine) room() (runs, bytes int) {
	runs, bytes, e.roomAt = e.port.Room(e.now)
	runs -= len(e.out)
	if bytes >= 0 {
		for i := range e.out {
			bytes -= roce.WireBytes(&e.out[i])
		}
	}
	return runs, bytes
}

// payload reads a run's payload out of the work request's memory: by reference when
// it lies in one SGE of an MR this process's engines may touch, else copied into a
// buffer. It reports false when the run must wait (the gate is busy, or a network
// page fault is on its way) or failed (the message completes with a local error).
func (e *engine) payload(w *wqe, t *roce.Transmit) bool {
	if w.wr.Flags&SendInline != 0 {
		t.Seg.Payload = w.wr.inline[t.Offset : int(t.Offset)+t.Len]
		return true
	}
	i, in := sglAt(w.wr.SGL, uint64(t.Offset))
	if room := uint64(w.wr.SGL[i].Length) - in; uint64(t.Len) > room && t.Seg.Count > 1 && room >= uint64(e.mtu) {
		// The run crosses into the next SGE: send the packets before it by reference.
		e.req.NextInto(t, int(room)/e.mtu)
	}
	mr := w.mrs[i]
	// By reference, unless UC completes the request before the peer reads it.
	if uint64(t.Len) <= uint64(w.wr.SGL[i].Length)-in && mr.file == nil && !e.uc {
		off := w.wr.SGL[i].Addr - uint64(mr.start) + in
		h, err := holdOn(&e.holds, mr, false)
		miss := -1
		var frames []pagefault.PagemapEntry
		if err == nil {
			miss, frames, err = h.check(off, uint64(t.Len), false)
		}
		if ok := e.readable(t.ID, mr, off, w.wr.SGL[i].Length, in, miss, err); !ok {
			return false
		}
		t.Seg.Payload = mr.slice(off, uint64(t.Len))
		h.runs++ // the run's reference, added when the round closes the hold
		if !e.dev.cfg.Audit {
			t.Seg.Ref = h // the run's range is its payload: nothing per run
			return true
		}
		sr := srcRefs.Get().(*srcRef)
		sr.r = mr.started(off, uint64(t.Len), h.d, h.gated, frames)
		sr.r.hold = h
		t.Seg.Ref = sr
		return true
	}
	buf := bufpool.Get(t.Len)
	if !e.gather(t.ID, w, uint64(t.Offset), buf) {
		bufpool.Put(buf)
		return false
	}
	t.Seg.Payload, t.Seg.Ref = buf, roce.Owned(buf)
	return true
}

// holdOn returns the hold on mr among holds (a transmit round's, a receive pass's,
// a respond round's), opening it (covered: see openHold).
func holdOn(holds *[]*dmaHold, mr *MR, covered bool) (*dmaHold, error) {
	for _, h := range *holds {
		if h.mr == mr {
			return h, nil
		}
	}
	h, err := mr.openHold(covered)
	if err == nil {
		*holds = append(*holds, h)
	}
	return h, err
}

// closeHolds closes the holds of a transmit round or a receive pass: each ends once
// the last run read under it is released.
func closeHolds(holds *[]*dmaHold) {
	for i, h := range *holds {
		h.close()
		(*holds)[i] = nil
	}
	*holds = (*holds)[:0]
}

// readable handles the outcome of a DMA the requester tried on mr's bytes from off
// (SGE of length sgeLen, in bytes into it): it reports true if the DMA began.
// Otherwise the gate was busy, or a network page fault on the rest of the SGE is
// started (the cursor waits for it), or the message fails with a local protection
// error.
func (e *engine) readable(id uint64, mr *MR, off uint64, sgeLen uint32, in uint64, miss int, err error) bool {
	switch {
	case errors.Is(err, errGateBusy):
		e.gateBusy()
		return false
	case err != nil:
		e.fail(id, err.Error())
		return false
	case miss >= 0:
		first, count := mr.pageSpan(off-in, uint64(sgeLen)) // the rest of the SGE: mlx5 resolves whole WQEs
		e.srcFault, e.srcID = e.startFault(mr, miss, first+count, false), id
		return false
	}
	return true
}

// gather copies message bytes [off, off+len(buf)) of w's SGL into buf, one DMA per
// SGE piece, as a NIC gathers a packet that spans SGEs.
func (e *engine) gather(id uint64, w *wqe, off uint64, buf []byte) bool {
	for pos := 0; pos < len(buf); {
		i, in := sglAt(w.wr.SGL, off+uint64(pos))
		s, mr := w.wr.SGL[i], w.mrs[i]
		n := min(uint64(len(buf)-pos), uint64(s.Length)-in)
		moff := s.Addr - uint64(mr.start) + in
		ref, miss, err := mr.tryAcquire(moff, n, false, e.covering > 0)
		if !e.readable(id, mr, moff, s.Length, in, miss, err) {
			return false
		}
		if mr.file != nil {
			err = mr.fileCopy(moff, buf[pos:pos+int(n)], false)
		} else {
			err = e.dev.dmaCopy(buf[pos:pos+int(n)], ref.bytes())
		}
		if torn := ref.release(err == nil); torn && err == nil {
			return false // made again on the next round
		}
		if err != nil {
			e.fail(id, err.Error())
			return false
		}
		pos += int(n)
	}
	return true
}

// fail ends message id with a local protection error: its memory could not be read
// (the MR was deregistered, pages of it unmapped, a fault failed).
func (e *engine) fail(id uint64, why string) {
	e.complete(e.req.Abort(id, roce.StatusLocal), why)
}

// srcRef is a run's payload read by reference: the DMA on the sender's MR, open
// until the receiving engine has copied the payload (roce.Ref). A READ response's
// names the responding engine (owner), which counts its responses not yet read.
type srcRef struct {
	r     dmaRef
	owner *engine
}

var srcRefs = sync.Pool{New: func() any { return new(srcRef) }}

// Release implements roce.Ref.
func (s *srcRef) Release() { s.finish() }

// finish ends the DMA and reports whether its copy was torn (see dmaRef.release).
func (s *srcRef) finish() bool {
	torn := s.r.release(true)
	if o := s.owner; o != nil {
		o.readEnded()
	}
	*s = srcRef{}
	srcRefs.Put(s)
	return torn
}

// response handles an answer from the responder: an ACK or NAK, an atomic's
// result, a READ response run whose data is placed in the work request's SGL.
func (e *engine) response(s *roce.Segment) {
	switch s.Opcode {
	case roce.Acknowledge:
		e.release(s)
		if s.SendsBack() {
			e.takeBack()
		}
		e.complete(e.req.Receive(&s.Packet, e.now), "")
	case roce.AtomicAck:
		e.release(s)
		id, ok := e.req.Lookup(s.PSN)
		if !ok || e.dstFault != nil {
			return
		}
		var orig [8]byte
		binary.NativeEndian.PutUint64(orig[:], s.Orig)
		if !e.deliver(id, s.PSN, 0, orig[:], nil) {
			return
		}
		e.complete(e.req.Receive(&s.Packet, e.now), "")
	default:
		id, off, out, ok := e.req.ReadResponse(s, e.now)
		e.complete(out, "")
		if !ok || e.dstFault != nil {
			e.release(s)
			return
		}
		if !e.deliver(id, s.PSN, uint64(off), s.Payload, s) {
			return
		}
		e.complete(e.req.ResponsePlaced(s, e.now), "")
	}
}

// takeBack takes back, when a NAK sends the requester back, its runs that never
// went on the wire: those built and not handed to the port yet, and those the port
// takes back from its transmit queue, newest first (Requester.Unsent). The go-back
// sends them again; the responder's answers among them stay.
func (e *engine) takeBack() {
	for i := len(e.out) - 1; i >= 0; i-- {
		if s := &e.out[i]; s.Opcode.IsRequest() {
			e.req.Unsent(s)
			if s.Ref != nil {
				s.Ref.Release()
			}
		}
	}
	e.out = slices.DeleteFunc(e.out, func(s roce.Segment) bool { return s.Opcode.IsRequest() })
	e.back = e.port.TakeBack(e.back[:0])
	for i := range e.back {
		e.req.Unsent(&e.back[i])
	}
	clear(e.back)
}

// deliver writes a response's data at byte off of request id's SGL and releases s (a
// READ response run, or nil). If it cannot (the gate is busy, a page is missing,
// the copy was torn), the response is dropped and the request asked again: at once,
// or once the network page fault on the SGL is resolved. It reports whether it
// placed the data.
func (e *engine) deliver(id uint64, psn uint32, off uint64, data []byte, s *roce.Segment) bool {
	w := e.qp.sq.slot(id)
	for pos := 0; pos < len(data); {
		i, in := sglAt(w.wr.SGL, off+uint64(pos))
		sg, mr := w.wr.SGL[i], w.mrs[i]
		n := min(uint64(len(data)-pos), uint64(sg.Length)-in)
		moff := sg.Addr - uint64(mr.start) + in
		miss, torn, err, copyErr := e.place(mr, moff, data[pos:pos+int(n)])
		switch {
		case errors.Is(err, errGateBusy):
			e.gateBusy()
			e.dropResponse(psn, s)
			return false
		case err != nil:
			e.releaseResponse(s)
			e.fail(id, err.Error())
			return false
		case miss >= 0:
			first, count := mr.pageSpan(moff-in, uint64(sg.Length))
			e.dstFault, e.dstID, e.dstPSN = e.startFault(mr, miss, first+count, true), id, psn
			e.releaseResponse(s)
			return false
		case torn:
			e.dropResponse(psn, s)
			return false
		}
		if err := copyErr; err != nil {
			if s != nil && srcFaulted(err, s.Payload) { // the responder's memory went away under its DMA
				e.dropResponse(psn, s)
				return false
			}
			e.releaseResponse(s)
			e.fail(id, err.Error())
			return false
		}
		pos += int(n)
	}
	if s != nil && e.release(s) {
		e.req.RetransmitFrom(psn) // the responder's copy was torn: ask again
		return false
	}
	return true
}

func (e *engine) releaseResponse(s *roce.Segment) {
	if s != nil {
		e.release(s)
	}
}

// dropResponse drops a response that could not be placed now and asks for it again.
func (e *engine) dropResponse(psn uint32, s *roce.Segment) {
	e.releaseResponse(s)
	e.req.RetransmitFrom(psn)
}

// complete records the requester's completions in their work requests' slots; why
// says what went wrong when the status does not say enough.
func (e *engine) complete(out roce.Output, why string) {
	for _, c := range out.Done {
		w := e.qp.sq.slot(c.ID)
		status, detail := WCSuccess, ""
		switch c.Status {
		case roce.StatusRemoteInvalid:
			status, detail = WCRemInvReqErr, "responder: NAK invalid request"
		case roce.StatusRemoteAccess:
			status, detail = WCRemAccessErr, "responder: NAK remote access error"
		case roce.StatusRemoteOp:
			status, detail = WCRemOpErr, "responder: NAK remote operational error"
		case roce.StatusRetryExceeded:
			status, detail = WCRetryExcErr, "no response: transport retry counter exceeded"
			e.rc(func(c *rcCounters) *atomic.Uint64 { return &c.retryExceeded })
		case roce.StatusRNRRetryExceeded:
			status, detail = WCRNRRetryExcErr, "responder not ready: RNR retry counter exceeded"
			e.rc(func(c *rcCounters) *atomic.Uint64 { return &c.rnrRetryExceeded })
		case roce.StatusLocal:
			status, detail = WCLocProtErr, "local memory: "+why
		case roce.StatusFlushed:
			status = WCWRFlushErr
		}
		if why != "" && c.Status == roce.StatusRetryExceeded {
			detail = why
		}
		if w.wr.Opcode.readsBack() && !w.done {
			e.fenced--
		}
		w.done, w.status, w.detail = true, status, detail
	}
	if out.RNRWait > 0 {
		e.rnrSince, e.rnrUntil = e.now, e.now.Add(out.RNRWait)
	}
}

// retire completes finished work requests from the head of the send queue, in
// posting order: a completion for those signaled and for every error, after which
// the QP is in ERR. A slot is free again before its completion is seen, as a verbs
// application that polls a completion expects to post again; head moves once per
// completion and once at the end, not per slot (a poster reads it every post).
func (e *engine) retire() {
	q := &e.qp.sq
	head := q.head.Load()
	for head < e.sqNext {
		w := q.slot(head)
		if !w.done {
			break
		}
		report := w.status != WCSuccess || w.wr.Flags&SendSignaled != 0 || e.qp.cfg.SigAll
		failed := w.status != WCSuccess && w.status != WCWRFlushErr
		var wc WC
		if report {
			wc = WC{WRID: w.wr.WRID, Status: w.status, Opcode: wcOpcode(w.wr.Opcode), QPNum: e.qp.qpn, Detail: w.detail}
			if w.wr.Opcode.readsBack() && w.status == WCSuccess {
				wc.ByteLen = uint32(sglLen(w.wr.SGL)) // as verbs reports a READ's length
			}
		}
		*w = wqe{}
		head++
		if report {
			q.head.Store(head) // the slot is free before its completion is seen
		}
		if failed && !e.errored {
			// An application that polls the error finds the QP in ERR and the
			// counters that say why.
			e.count()
			e.qp.failWith(e.qp.cfg.SendCQ, wc)
			e.toError()
			continue
		}
		if report {
			e.qp.cfg.SendCQ.push(wc)
		}
	}
	q.head.Store(head)
}
