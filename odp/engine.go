package odp

// The emulated NIC's engine. A connected QP runs one RC session of transport/roce
// (the requester and responder state machines of IBTA chapter 9, over a roce.Port:
// UDP between processes and hosts, or an in-process Pipe carrying the same encoded
// packets) and two goroutines of its own:
//   - sendLoop processes the send queue in order: it checks local keys, faults ODP
//     source pages in and gathers the payload; postLoop posts the messages to the
//     session, which segments them, assigns PSNs, sends them (while sendLoop
//     gathers the next) and retransmits them as RC requires;
//   - the session's responder loop calls Execute for each complete request, in PSN
//     order: it runs against this device's MRs, taking network page faults as
//     needed, and says whether to ACK, send data, NAK or RNR NAK;
//   - the session's completion loop calls Complete for each finished message, in
//     posting order: READ data and atomic results are scattered into local memory
//     there, and the work request completes.
//
// RC retries as on hardware: a responder whose request finds ODP pages missing (or
// no receive posted) answers RNR NAK, resolves the fault after sending it, and drops
// the requests behind it until the NAKed PSN comes again; the requester waits the
// RNR timer and retransmits from that request on (go-back-N), up to RNRRetry times.
// Lost packets are recovered by sequence NAKs and the ACK timer (Timeout,
// RetryCnt). Config.ResponderFaults = FaultStall resolves first and answers after.
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
	"time"
	"unsafe"

	"github.com/odpemu/odpemu/internal/bufpool"
	"github.com/odpemu/odpemu/pagefault"
	"github.com/odpemu/odpemu/transport/roce"
)

// startLocked starts the QP's session and send loop once. Called with QP.mu held.
func (qp *QP) startLocked() {
	if qp.started {
		return
	}
	qp.started = true
	// Under FaultStall a request waits for a receive to be posted, or for its
	// pages; under FaultRNR it is answered RNR NAK instead, and never waits on
	// what the peer does.
	cfg := roce.SessionConfig{Requester: qp.retryConfigLocked(), LocalQPN: qp.qpn, PeerQPN: qp.remote.QPN,
		PeerPSN: qp.remote.PSN, Counters: []*roce.Counters{&qp.rc, &qp.dev.rc},
		ExecuteWaits: qp.dev.cfg.ResponderFaults == FaultStall}
	cfg.Requester.FirstPSN = qp.psn // the MTU is the port's: the path MTU
	qp.sess = roce.NewSession(qp.port, cfg, (*rcHandler)(qp))
	qp.wg.Add(1)
	go qp.sendLoop()
}

// retryConfigLocked is the requester's part of the QP's attributes. Called with
// QP.mu held.
func (qp *QP) retryConfigLocked() roce.RequesterConfig {
	return roce.RequesterConfig{Timeout: ackTimeout(qp.attr.Timeout), RetryCnt: int(qp.attr.RetryCnt),
		RNRRetry: int(qp.attr.RNRRetry)}
}

// ackTimeout decodes the local ACK timeout, 4.096 us * 2^t (0: none).
func ackTimeout(t uint8) time.Duration {
	if t == 0 {
		return 0
	}
	return time.Duration(4096<<t) * time.Nanosecond
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
	buf := bufpool.Get(int(sglLen(sgl)))
	if status, detail := qp.gatherInto(sgl, buf); status != WCSuccess {
		bufpool.Put(buf)
		return nil, nil, status, detail
	}
	return buf, func() { bufpool.Put(buf) }, WCSuccess, ""
}

// gatherInto reads a local SGL into buf, which has its length, checking every key
// before the first copy.
func (qp *QP) gatherInto(sgl []SGE, buf []byte) (WCStatus, string) {
	type seg struct {
		mr  *MR
		off uint64
		n   uint64
	}
	segs := make([]seg, 0, len(sgl))
	for _, s := range sgl {
		mr, off, why := qp.localSGE(s, false)
		if mr == nil {
			return WCLocProtErr, why
		}
		segs = append(segs, seg{mr, off, uint64(s.Length)})
	}
	pos := uint64(0)
	for _, s := range segs {
		if err := s.mr.dma(s.off, buf[pos:pos+s.n], false); err != nil {
			return WCLocProtErr, err.Error()
		}
		pos += s.n
	}
	return WCSuccess, ""
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
	debug.SetPanicOnFault(true)    // see dmaCopy
	posts := make(chan posting, 2) // the next messages, gathered while one goes out
	qp.wg.Add(1)
	go qp.postLoop(posts)
	defer close(posts)
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
		if p, ok := qp.build(wr); ok {
			posts <- p
		}
	}
}

// posting is a work request's message, built and waiting to be posted.
type posting struct {
	p *pending
	m roce.Message
}

// build processes one work request up to its message: local checks and the gather
// of its payload. It reports false if the request finished already (an error
// completion).
func (qp *QP) build(wr *SendWR) (posting, bool) {
	qp.mu.Lock()
	qp.nextID++
	p := &pending{wr: wr, id: qp.nextID}
	qp.pending = append(qp.pending, p)
	if qp.state == StateError {
		qp.finishLocked(p, WCWRFlushErr, "")
		qp.mu.Unlock()
		return posting{}, false
	}
	qp.mu.Unlock()

	m, release, status, detail := qp.request(wr)
	qp.mu.Lock()
	defer qp.mu.Unlock()
	if status != WCSuccess {
		qp.finishLocked(p, status, detail)
		return posting{}, false
	}
	p.release = release
	return posting{p, m}, true
}

// postLoop posts the built messages to the session in order: the session sends
// one while the send loop gathers the next.
func (qp *QP) postLoop(posts <-chan posting) {
	defer qp.wg.Done()
	qp.mu.Lock()
	sess := qp.sess
	qp.mu.Unlock()
	for b := range posts {
		qp.inflight.Store(b.p.id, &inflight{wr: b.p.wr})
		err := sess.Post(b.p.id, b.m)
		qp.mu.Lock()
		b.p.posted = err == nil
		switch {
		case err == nil:
		case errors.Is(err, roce.ErrClosed):
			qp.finishLocked(b.p, WCWRFlushErr, "")
		default:
			qp.finishLocked(b.p, WCLocQPOpErr, err.Error())
		}
		qp.mu.Unlock()
		if err != nil {
			qp.inflight.Delete(b.p.id)
		}
	}
}

// mustWaitLocked reports whether the send loop holds wr back: the QP is draining
// (SQD, SQE), or wr is fenced and a READ or atomic before it still waits for its
// response. Called with QP.mu held.
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

// request builds the RC message for wr, after the local checks the NIC makes. A
// WRITE's or SEND's payload is a packet buffer, kept by the requester for
// retransmission until the message completes; release returns it.
func (qp *QP) request(wr *SendWR) (m roce.Message, release func(), status WCStatus, detail string) {
	total := sglLen(wr.SGL)
	if total > maxMsg {
		return m, nil, WCLocLenErr, fmt.Sprintf("message of %d bytes > %d", total, maxMsg)
	}
	m = roce.Message{VA: wr.RemoteAddr, RKey: wr.RKey, HasImm: wr.Opcode == OpRDMAWriteImm || wr.Opcode == OpSendImm}
	if m.HasImm {
		m.Imm = wr.Imm
	}
	switch wr.Opcode {
	case OpRDMAWrite, OpRDMAWriteImm, OpSend, OpSendImm:
		m.Kind = roce.KindWrite
		if wr.Opcode == OpSend || wr.Opcode == OpSendImm {
			m.Kind, m.VA, m.RKey = roce.KindSend, 0, 0
		}
		if wr.Flags&SendInline != 0 {
			m.Payload = wr.inline // copied at post time; the WR keeps it until retired
			return m, nil, WCSuccess, ""
		}
		m.Payload, release, status, detail = qp.gather(wr.SGL)
		return m, release, status, detail
	}
	for _, s := range wr.SGL { // the data lands here later: check now, fault then
		if mr, _, why := qp.localSGE(s, true); mr == nil {
			return m, nil, WCLocProtErr, why
		}
	}
	switch wr.Opcode {
	case OpRDMARead:
		m.Kind, m.DMALen = roce.KindReadRequest, uint32(total)
	case OpAtomicCmpSwap:
		m.Kind, m.Swap, m.Compare = roce.KindCompareSwap, wr.Swap, wr.CompareAdd
	case OpAtomicFetchAdd:
		m.Kind, m.Swap = roce.KindFetchAdd, wr.CompareAdd
	}
	return m, nil, WCSuccess, ""
}

// rcHandler is the QP as its session's roce.Handler.
type rcHandler QP

// Complete ends the work request of a finished message: a READ's data and an
// atomic's original value are scattered into the local SGL first.
func (h *rcHandler) Complete(c roce.Completion) {
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true)) // DMA runs here: see dmaCopy
	qp := (*QP)(h)
	qp.mu.Lock()
	var p *pending
	for _, q := range qp.pending {
		if q.id == c.ID {
			p = q
			break
		}
	}
	qp.mu.Unlock()
	var reloadErr string
	if v, ok := qp.inflight.LoadAndDelete(c.ID); ok {
		reloadErr = v.(*inflight).reloadErr
	}
	if p == nil {
		return // finished and retired already: the connection was lost
	}
	if p.release != nil {
		p.release() // the requester keeps no packets of a finished message
	}
	status, detail := WCSuccess, ""
	switch c.Status {
	case roce.StatusSuccess:
		status, detail = qp.deliver(p.wr, c.Response)
	case roce.StatusRemoteInvalid:
		status, detail = WCRemInvReqErr, "responder: NAK invalid request"
	case roce.StatusRemoteAccess:
		status, detail = WCRemAccessErr, "responder: NAK remote access error"
	case roce.StatusRemoteOp:
		status, detail = WCRemOpErr, "responder: NAK remote operational error"
	case roce.StatusRetryExceeded:
		status, detail = WCRetryExcErr, "no response: transport retry counter exceeded"
	case roce.StatusRNRRetryExceeded:
		status, detail = WCRNRRetryExcErr, "responder not ready: RNR retry counter exceeded"
	case roce.StatusLocal:
		status, detail = WCLocProtErr, "retransmission: "+reloadErr
	default:
		status = WCWRFlushErr
	}
	qp.mu.Lock()
	qp.finishLocked(p, status, detail)
	qp.mu.Unlock()
}

// inflight is a message the session may retransmit: its work request, to read the
// payload again, and why that failed.
type inflight struct {
	wr        *SendWR
	reloadErr string
}

// Reload gathers a message's payload again before the session retransmits it: a
// NIC reads local memory again, which may fault ODP pages in again, or find the MR
// deregistered (a local protection error). It runs under Session.mu, so it takes no
// QP lock: the work request comes from QP.inflight.
func (h *rcHandler) Reload(id uint64, payload []byte) error {
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true)) // DMA runs here: see dmaCopy
	v, ok := (*QP)(h).inflight.Load(id)
	if !ok {
		return nil
	}
	in := v.(*inflight)
	if in.wr.Flags&SendInline != 0 {
		return nil // the bytes were copied into the WQE at post time
	}
	if status, detail := (*QP)(h).gatherInto(in.wr.SGL, payload); status != WCSuccess {
		in.reloadErr = detail
		return errors.New(detail)
	}
	return nil
}

// deliver places a READ's data or an atomic's original value, the response to wr.
func (qp *QP) deliver(wr *SendWR, resp *roce.Message) (WCStatus, string) {
	switch {
	case wr.Opcode == OpRDMARead:
		if resp == nil || uint64(len(resp.Payload)) != sglLen(wr.SGL) {
			return WCBadRespErr, "READ response of the wrong length"
		}
		return qp.scatter(wr.SGL, resp.Payload)
	case wr.Opcode.atomic():
		if resp == nil {
			return WCBadRespErr, "atomic without its response"
		}
		var orig [8]byte
		binary.NativeEndian.PutUint64(orig[:], resp.Orig)
		return qp.scatter(wr.SGL, orig[:])
	}
	return WCSuccess, ""
}

// Lost fails everything outstanding when the wire is gone: the transport's retries
// would run out (RETRY_EXC_ERR).
func (h *rcHandler) Lost(err error) {
	qp := (*QP)(h)
	qp.mu.Lock()
	defer qp.mu.Unlock()
	for _, p := range append([]*pending(nil), qp.pending...) {
		if !p.done {
			qp.finishLocked(p, WCRetryExcErr, err.Error())
		}
	}
	qp.toErrorLocked()
}

// Execute runs one request as the responder. A NAK it answers (an access error, an
// invalid request, a failed receive) moves the QP to ERR, as RC responder errors of
// classes B and C do.
func (h *rcHandler) Execute(m *roce.Message, duplicate bool) roce.Answer {
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true)) // DMA runs here: see dmaCopy
	qp := (*QP)(h)
	a := qp.execute(m, duplicate)
	if a.NAK != 0 && !duplicate {
		qp.toError()
	}
	return a
}

// remoteMR checks a request's rkey, range and rights against this device's MRs, and
// says why it refuses.
func (qp *QP) remoteMR(rkey uint32, va, n uint64, need Access) (*MR, uint64, string) {
	mr := qp.dev.lookupMR(rkey)
	switch {
	case mr == nil:
		return nil, 0, fmt.Sprintf("rkey %#x is not a registered MR", rkey)
	case mr.pd != qp.pd:
		return nil, 0, fmt.Sprintf("rkey %#x belongs to another PD", rkey)
	case mr.access&need == 0:
		return nil, 0, fmt.Sprintf("MR %#x lacks %v", rkey, need)
	}
	off, ok := mr.offset(va, n)
	if !ok {
		return nil, 0, fmt.Sprintf("[%#x, +%d) outside MR %#x [%#x, +%d)", va, n, rkey, mr.start, mr.length)
	}
	return mr, off, ""
}

// refuse answers with a NAK; why is kept as the QP's last refusal (RespError).
func (qp *QP) refuse(syn roce.Syndrome, why string) roce.Answer {
	qp.mu.Lock()
	qp.lastRefusal = why
	qp.mu.Unlock()
	return roce.Answer{NAK: syn}
}

// rnrAnswer answers RNR NAK with the QP's MinRNRTimer; resolve, if set, is the page
// fault to resolve once the NAK is sent. If it fails (the MR was deregistered, its
// memory unmapped), the request runs without RNR when it comes again, and its DMA
// reports the error.
func (qp *QP) rnrAnswer(resolve func() error) roce.Answer {
	qp.mu.Lock()
	a := roce.Answer{RNR: true, Timer: qp.attr.MinRNRTimer}
	qp.mu.Unlock()
	if resolve != nil {
		a.Resolve = func() {
			if resolve() != nil {
				qp.rnrFailed = true
			}
		}
	}
	return a
}

// execute runs one request and says how to answer it. A duplicate (a READ that
// came again) resolves its faults instead of answering RNR.
func (qp *QP) execute(m *roce.Message, duplicate bool) roce.Answer {
	if qp.inError() {
		return roce.Answer{Drop: true}
	}
	// After an RNR NAK whose fault could not be resolved, the request that comes
	// again runs without RNR; the requests behind it were dropped, so this is it.
	stall := duplicate || qp.rnrFailed
	qp.rnrFailed = false
	switch m.Kind {
	case roce.KindWrite:
		mr, off, why := qp.remoteMR(m.RKey, m.VA, uint64(len(m.Payload)), AccessRemoteWrite)
		if mr == nil {
			return qp.refuse(roce.SynNAKRemoteAccess, why)
		}
		if resolve := qp.rnrFault(mr, off, uint64(len(m.Payload)), true, stall); resolve != nil {
			return qp.rnrAnswer(resolve)
		}
		if err := mr.dma(off, m.Payload, true); err != nil {
			return qp.refuse(roce.SynNAKRemoteAccess, err.Error())
		}
		if m.HasImm {
			return qp.receive(m, stall)
		}
		return roce.Answer{}
	case roce.KindCompareSwap, roce.KindFetchAdd:
		if m.VA%8 != 0 {
			return qp.refuse(roce.SynNAKInvalidRequest, fmt.Sprintf("atomic at %#x is not 8-byte aligned", m.VA))
		}
		mr, off, why := qp.remoteMR(m.RKey, m.VA, 8, AccessRemoteAtomic)
		if mr == nil {
			return qp.refuse(roce.SynNAKRemoteAccess, why)
		}
		if resolve := qp.rnrFault(mr, off, 8, true, stall); resolve != nil {
			return qp.rnrAnswer(resolve)
		}
		orig, err := mr.atomic(off, m.Kind == roce.KindCompareSwap, m.Compare, m.Swap)
		if err != nil {
			return qp.refuse(roce.SynNAKRemoteAccess, err.Error())
		}
		return roce.Answer{Response: &roce.Message{Orig: orig}}
	case roce.KindReadRequest:
		mr, off, why := qp.remoteMR(m.RKey, m.VA, uint64(m.DMALen), AccessRemoteRead)
		if mr == nil {
			return qp.refuse(roce.SynNAKRemoteAccess, why)
		}
		if resolve := qp.rnrFault(mr, off, uint64(m.DMALen), false, stall); resolve != nil {
			return qp.rnrAnswer(resolve)
		}
		// Copied into the response, so the DMA ends now, not when the packets have
		// been sent.
		buf := bufpool.Get(int(m.DMALen))
		if err := mr.dma(off, buf, false); err != nil {
			bufpool.Put(buf)
			return qp.refuse(roce.SynNAKRemoteAccess, err.Error())
		}
		return roce.Answer{Response: &roce.Message{Payload: buf}, Release: func() { bufpool.Put(buf) }}
	case roce.KindSend:
		return qp.receive(m, stall)
	}
	return qp.refuse(roce.SynNAKInvalidRequest, fmt.Sprintf("message kind %d", m.Kind))
}

// rnrFault reports, under FaultRNR, whether ODP pages of MR bytes [off, off+n) lack
// an entry for the access, and then returns the network page fault to resolve after
// the RNR NAK. It returns nil when the request can run now, or when stall says to
// resolve its faults in its DMA (which reports why if that fails).
func (qp *QP) rnrFault(mr *MR, off, n uint64, write, stall bool) func() error {
	if qp.dev.cfg.ResponderFaults != FaultRNR || !mr.odp || n == 0 || stall {
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
func (qp *QP) receive(m *roce.Message, stall bool) roce.Answer {
	rnr := qp.dev.cfg.ResponderFaults == FaultRNR
	qp.mu.Lock()
	for len(qp.rq) == 0 && qp.state != StateError && !qp.destroyed && !rnr {
		qp.cond.Wait()
	}
	if qp.state == StateError {
		qp.mu.Unlock()
		return roce.Answer{Drop: true}
	}
	if len(qp.rq) == 0 {
		qp.mu.Unlock()
		return qp.rnrAnswer(nil)
	}
	wr := qp.rq[0]
	qp.mu.Unlock()
	if m.Kind == roce.KindSend {
		if resolve := qp.recvFault(wr.SGL, uint64(len(m.Payload)), stall); resolve != nil {
			return qp.rnrAnswer(resolve)
		}
	}
	qp.mu.Lock()
	if len(qp.rq) == 0 { // flushed meanwhile: the QP went to ERR
		qp.mu.Unlock()
		return roce.Answer{Drop: true}
	}
	qp.rq = qp.rq[1:] // the head is wr: only the responder loop takes receives
	qp.mu.Unlock()

	wc := WC{WRID: wr.WRID, Opcode: WCRecv, QPNum: qp.qpn, ByteLen: uint32(len(m.Payload))}
	if m.HasImm {
		wc.Flags, wc.ImmData = WCWithImm, m.Imm
	}
	var a roce.Answer
	if m.Kind == roce.KindWrite {
		wc.Opcode = WCRecvRDMAWithImm
	} else if capacity := sglLen(wr.SGL); uint64(len(m.Payload)) > capacity {
		wc.Status, wc.Detail = WCLocLenErr, fmt.Sprintf("%d-byte SEND into a %d-byte receive", len(m.Payload), capacity)
		a = qp.refuse(roce.SynNAKInvalidRequest, wc.Detail)
	} else if status, detail := qp.scatter(wr.SGL, m.Payload); status != WCSuccess {
		wc.Status, wc.Detail = status, detail
		a = qp.refuse(roce.SynNAKRemoteOperation, "receive: "+detail)
	}
	qp.mu.Lock()
	if wc.Status == WCSuccess && qp.state == StateError {
		wc.Status = WCWRFlushErr
	}
	qp.cfg.RecvCQ.push(wc)
	qp.mu.Unlock()
	return a
}

// recvFault is rnrFault for the first n bytes of a receive's buffers. Bad keys are
// left for scatter to report.
func (qp *QP) recvFault(sgl []SGE, n uint64, stall bool) func() error {
	var faults []func() error
	for _, s := range sgl {
		if n == 0 {
			break
		}
		k := min(uint64(s.Length), n)
		n -= k
		if mr, off, _ := qp.localSGE(s, true); mr != nil {
			if resolve := qp.rnrFault(mr, off, k, true, stall); resolve != nil {
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
// not a crash. The copy goes page by page, in order (copyPages): a copy that faults
// leaves every page before the one it faulted on whole and none after it touched,
// as a NIC that places a message packet by packet does.
func (d *Device) dmaCopy(dst, src []byte) error {
	return d.dmaRun(func() { copyPages(dst, src) })
}

// copyPages copies src to dst in pieces that cross no page boundary of either, in
// ascending order. A piece's copy touches only its own page of each side, so a page
// that is not mapped faults it before it stores anything; one copy over several pages
// (memmove) may store the first bytes of the destination last, and a fault in the
// middle would then leave an earlier page part old and part new.
func copyPages(dst, src []byte) {
	ps := pagefault.PageSize
	for len(src) > 0 && len(dst) > 0 {
		n := min(len(src), len(dst))
		n = min(n, int(ps-uintptr(unsafe.Pointer(&dst[0]))%ps), int(ps-uintptr(unsafe.Pointer(&src[0]))%ps))
		copy(dst[:n], src[:n])
		dst, src = dst[n:], src[n:]
	}
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
