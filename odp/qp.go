package odp

import (
	"math/rand/v2"
	"net/netip"
	"sync/atomic"

	"github.com/odpemu/odpemu/transport/roce"
)

// CreateQP creates an RC QP in RESET.
func (pd *PD) CreateQP(cfg QPConfig) (*QP, error) {
	if pd == nil || pd.dead.Load() {
		return nil, wrap(ErrInvalidArgument, "CreateQP on a deallocated PD")
	}
	if cfg.SendCQ == nil || cfg.RecvCQ == nil {
		return nil, wrap(ErrInvalidArgument, "QP needs a send and a receive CQ")
	}
	if cfg.Type != QPTypeRC && cfg.Type != QPTypeUD && cfg.Type != QPTypeUC {
		return nil, wrap(ErrInvalidArgument, "QP type %d", cfg.Type)
	}
	if cfg.MaxSendWR == 0 {
		cfg.MaxSendWR = 128
	}
	if cfg.SRQ != nil {
		if cfg.MaxRecvWR != 0 {
			return nil, wrap(ErrInvalidArgument, "a QP with an SRQ has no receive queue of its own")
		}
		if cfg.SRQ.dev != &pd.owner.nic {
			return nil, wrap(ErrInvalidArgument, "SRQ of another device")
		}
	} else if cfg.MaxRecvWR == 0 {
		cfg.MaxRecvWR = 128
	}
	if cfg.MaxSGE == 0 {
		cfg.MaxSGE = 16
	}
	if cfg.MaxInlineData == 0 {
		cfg.MaxInlineData = 256
	}
	if cfg.MaxSendWR < 0 || cfg.MaxSendWR > maxQPWR || cfg.MaxRecvWR < 0 || cfg.MaxRecvWR > maxQPWR || cfg.MaxSGE < 0 ||
		cfg.MaxSGE > maxSGE || cfg.MaxInlineData < 0 || cfg.MaxInlineData > maxInline {
		return nil, wrap(ErrInvalidArgument, "QP capabilities %d/%d/%d/%d out of range", cfg.MaxSendWR, cfg.MaxRecvWR,
			cfg.MaxSGE, cfg.MaxInlineData)
	}
	d := pd.owner
	for _, cq := range []*CQ{cfg.SendCQ, cfg.RecvCQ} {
		if cq.dev != &d.nic {
			return nil, wrap(ErrInvalidArgument, "CQ of another device")
		}
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil, ErrClosed
	}
	for _, cq := range []*CQ{cfg.SendCQ, cfg.RecvCQ} {
		cq.mu.Lock()
		dead := cq.dead
		if !dead {
			cq.users++
		}
		cq.mu.Unlock()
		if dead {
			if cq == cfg.RecvCQ && cfg.RecvCQ != cfg.SendCQ {
				cfg.SendCQ.detach()
			}
			return nil, wrap(ErrInvalidArgument, "destroyed CQ")
		}
	}
	qp := &QP{pd: &pd.domain, dev: &d.nic, qpn: nextQPN(), cfg: cfg, attr: qpAttr(d.cfg.RdAtomic), done: make(chan struct{}),
		psn: rand.Uint32() & (1<<24 - 1)}
	if cfg.SRQ != nil {
		if err := cfg.SRQ.attachLocked(); err != nil {
			cfg.SendCQ.detach()
			cfg.RecvCQ.detach()
			return nil, err
		}
	}
	qp.access.Store(uint32(DefaultQPAttr.Access))
	qp.sq.slots = make([]wqe, cfg.MaxSendWR)
	qp.rq.slots = make([]rqe, cfg.MaxRecvWR)
	qp.unlistLocked = func() {
		delete(d.qps, qp)
		pd.qps--
		if cfg.SRQ != nil {
			cfg.SRQ.detach()
		}
	}
	d.qps[qp] = struct{}{}
	pd.qps++
	return qp, nil
}

// qpns numbers the QPs of the process: one space for all its devices, as a NIC's
// port numbers its QPs, so that one UDP endpoint tells any two apart.
var qpns atomic.Uint32

func nextQPN() uint32 {
	for {
		if n := qpns.Add(1) & (1<<24 - 1); n > 1 { // 0 and 1 are the special QPs
			return n
		}
	}
}

// QPNum returns the QP number.
func (qp *QP) QPNum() uint32 { return qp.qpn }

// State returns the current state.
func (qp *QP) State() QPState {
	qp.mu.Lock()
	defer qp.mu.Unlock()
	return qp.state
}

// Config returns the QP's configuration, its defaults filled in (the capabilities
// ibv_create_qp and ibv_query_qp report).
func (qp *QP) Config() QPConfig { return qp.cfg }

// SetSendPSN sets the first PSN the QP sends (ibv_modify_qp's sq_psn), in place of the
// one CreateQP drew, before the QP can send: before it is connected, or in RTR.
func (qp *QP) SetSendPSN(psn uint32) error {
	if psn >= 1<<24 {
		return wrap(ErrInvalidArgument, "PSN %#x wider than 24 bits", psn)
	}
	qp.mu.Lock()
	defer qp.mu.Unlock()
	if qp.destroyed {
		return ErrClosed
	}
	if qp.port != nil && qp.state != StateRTR {
		return wrap(ErrQPState, "QP %d in %v: its send PSN is in use", qp.qpn, qp.state)
	}
	qp.psn = psn
	qp.attrGen.Add(1) // a started engine's requester takes it before its first post
	return nil
}

// Connect attaches port, the wire to the peer QP remote, and moves the QP from RESET
// or INIT to RTS. The port's MTU is the path MTU. From then on the QP owns the port:
// Destroy closes it. If Connect fails, the caller keeps it.
func (qp *QP) Connect(port roce.Port, remote Remote) error { return qp.connect(port, remote, StateRTS) }

// connect attaches port and starts the engine in state to (RTR or RTS).
func (qp *QP) connect(port roce.Port, remote Remote, to QPState) error {
	if remote.QPN >= 1<<24 || remote.PSN >= 1<<24 {
		return wrap(ErrInvalidArgument, "remote QPN %#x or PSN %#x wider than 24 bits", remote.QPN, remote.PSN)
	}
	qp.mu.Lock()
	defer qp.mu.Unlock()
	if qp.destroyed {
		return ErrClosed
	}
	if qp.port != nil {
		return wrap(ErrQPState, "QP %d already connected", qp.qpn)
	}
	if qp.cfg.Type == QPTypeUD {
		return wrap(ErrInvalidArgument, "UD QP %d is not connected: BindUD it", qp.qpn)
	}
	if qp.state != StateReset && qp.state != StateInit {
		return wrap(ErrQPState, "connect in %v", qp.state)
	}
	qp.port, qp.remote = port, remote
	qp.setStateLocked(to)
	qp.startLocked()
	return nil
}

// Modify moves the QP to state to. RTR needs a wire attached by Connect first;
// moving to ERR flushes outstanding work. RESET disconnects a connected QP (reset).
func (qp *QP) Modify(to QPState) error {
	qp.mu.Lock()
	defer qp.mu.Unlock()
	if qp.destroyed {
		return ErrClosed
	}
	if qp.resetting {
		return wrap(ErrQPState, "QP %d is being reset", qp.qpn)
	}
	if err := checkTransition(qp.state, to); err != nil {
		return err
	}
	switch to {
	case StateRTR:
		if qp.cfg.Type == QPTypeUD {
			return wrap(ErrQPState, "RTR of a UD QP: BindUD")
		}
		if qp.port == nil {
			return wrap(ErrQPState, "RTR needs a connection")
		}
		qp.startLocked()
	case StateReset:
		if qp.port != nil || qp.ud != nil {
			qp.mu.Unlock()
			err := qp.reset()
			qp.mu.Lock() // for the deferred unlock
			return err
		}
	case StateError:
		qp.toErrorLocked()
		return nil
	}
	qp.setStateLocked(to)
	return nil
}

// LoopbackLimits are the limits of the wire ConnectLoopback makes: a 4096-byte path
// MTU and the largest RC message.
var LoopbackLimits = roce.Limits{MTU: 4096, MaxMessage: maxMsg}

// ConnectLoopback connects two QPs with an in-process wire and moves both to RTS.
// Each direction is its sending device's link (Config.Link); runs of packets travel
// by reference, and the receiving NIC copies each payload from the sender's memory
// into its own, once. Between devices that do not share an address space (their
// DMA gates differ) payloads are copied as they are sent.
func ConnectLoopback(a, b *QP) error { return ConnectLoopbackLoss(a, b, roce.Loss{}) }

// ConnectLoopbackLoss is ConnectLoopback with faults injected into what each side
// sends (none for the zero Loss): runs are then single packets, copied as they are
// sent.
func ConnectLoopbackLoss(a, b *QP, loss roce.Loss) error {
	pa, pb, err := roce.NewPipe(LoopbackLimits, roce.PipeConfig{AB: a.dev.cfg.Link.wire(), BA: b.dev.cfg.Link.wire(),
		Copy: a.dev.as != b.dev.as, Loss: loss})
	if err != nil {
		return err
	}
	return ConnectPorts(a, b, pa, pb)
}

// ConnectPorts connects a over port pa and b over port pb, two ends of one wire
// (a roce.Pipe with loss, say), and moves both to RTS. The QPs own the ports after.
func ConnectPorts(a, b *QP, pa, pb roce.Port) error {
	// Closing a pipe end cannot fail.
	if err := a.Connect(pa, Remote{QPN: b.qpn, PSN: b.psn}); err != nil {
		_ = pa.Close()
		_ = pb.Close()
		return err
	}
	if err := b.Connect(pb, Remote{QPN: a.qpn, PSN: a.psn}); err != nil {
		_ = pb.Close()
		_ = a.Modify(StateError) // fails only if a was destroyed meanwhile: then it is gone anyway
		return err
	}
	return nil
}

// PostSend queues a send work request. It fails (like ibv_post_send's errno) when the
// QP cannot accept work or the request is malformed; everything the NIC checks later
// (keys, bounds, access) is reported as an error completion instead.
func (qp *QP) PostSend(wr SendWR) error {
	if !wr.Opcode.valid() {
		return wrap(ErrInvalidArgument, "send opcode %d", wr.Opcode)
	}
	if f := wr.Flags &^ sendFlagsKnown; f != 0 {
		return wrap(ErrInvalidArgument, "send flags %#x not supported", uint32(f))
	}
	if wr.Opcode.atomic() && (len(wr.SGL) != 1 || wr.SGL[0].Length != 8) {
		return wrap(ErrInvalidArgument, "an atomic's SGL must be one 8-byte SGE")
	}
	if wr.Opcode == OpAtomicWrite && sglLen(wr.SGL) != 8 {
		return wrap(ErrInvalidArgument, "an atomic write carries 8 bytes")
	}
	if wr.Opcode == OpBindMW && wr.Bind == nil {
		return wrap(ErrInvalidArgument, "a bind work request needs a binding")
	}
	if wr.Opcode.local() && len(wr.SGL) > 0 {
		return wrap(ErrInvalidArgument, "a local operation has no SGL")
	}
	if qp.cfg.Type == QPTypeUC && wr.Opcode != OpSend && wr.Opcode != OpSendImm && wr.Opcode != OpRDMAWrite &&
		wr.Opcode != OpRDMAWriteImm {
		return wrap(ErrInvalidArgument, "a UC QP sends SENDs and WRITEs only, not opcode %d", wr.Opcode)
	}
	if qp.cfg.Type == QPTypeUD {
		switch {
		case wr.Opcode != OpSend && wr.Opcode != OpSendImm:
			return wrap(ErrInvalidArgument, "a UD QP sends SENDs only, not opcode %d", wr.Opcode)
		case wr.UD == nil || !wr.UD.Addr.Addr().IsValid() || wr.UD.QPN >= 1<<24:
			return wrap(ErrInvalidArgument, "a UD SEND needs a destination (an address and a 24-bit QPN)")
		}
	}
	if len(wr.SGL) > qp.cfg.MaxSGE {
		return wrap(ErrInvalidArgument, "%d SGEs > max %d", len(wr.SGL), qp.cfg.MaxSGE)
	}
	var inline []byte
	if wr.Flags&SendInline != 0 {
		if !wr.Opcode.carriesData() {
			return wrap(ErrInvalidArgument, "inline %d request", wr.Opcode)
		}
		if n := sglLen(wr.SGL); n > uint64(qp.cfg.MaxInlineData) {
			return wrap(ErrInvalidArgument, "%d inline bytes > max %d", n, qp.cfg.MaxInlineData)
		}
		var err error
		if inline, err = copyInline(wr.SGL); err != nil {
			return err
		}
	}
	if qp.gone.Load() {
		return ErrClosed
	}
	q := &qp.sq
	q.mu.Lock()
	// Under the queue's lock: a reset drops the queue under it after the state
	// changed, so nothing posted in an earlier state is left behind.
	s := QPState(qp.st.Load())
	if !canPostSend(s) {
		q.mu.Unlock()
		return wrap(ErrQPState, "post send in %v", s)
	}
	tail := q.tail.Load()
	if tail-q.head.Load() >= uint64(len(q.slots)) {
		q.mu.Unlock()
		return wrap(ErrQueueFull, "%d send WRs outstanding", len(q.slots))
	}
	w := &q.slots[tail%uint64(len(q.slots))]
	// Field by field: the caller's SGL is copied, never kept (so it does not
	// escape, and a caller's WR on the stack costs no allocation).
	*w = wqe{wr: SendWR{WRID: wr.WRID, Opcode: wr.Opcode, Flags: wr.Flags, RemoteAddr: wr.RemoteAddr, RKey: wr.RKey,
		Imm: wr.Imm, CompareAdd: wr.CompareAdd, Swap: wr.Swap, InvRKey: wr.InvRKey, inline: inline}}
	if wr.Opcode == OpBindMW {
		b := *wr.Bind // a copy of its own: binds are rare, send queue slots many
		w.wr.Bind = &b
	}
	if len(wr.SGL) <= len(w.sgl) {
		w.wr.SGL = w.sgl[:copy(w.sgl[:], wr.SGL)]
	} else {
		w.wr.SGL = append([]SGE(nil), wr.SGL...)
	}
	if wr.UD != nil && qp.cfg.Type == QPTypeUD {
		w.ud = *wr.UD
		w.wr.UD = &w.ud
	}
	q.tail.Store(tail + 1)
	q.mu.Unlock()
	if eng := qp.engA.Load(); eng != nil {
		eng.wake()
	} else if ud := qp.udA.Load(); ud != nil {
		ud.wake()
	} else if s == StateError {
		qp.mu.Lock()
		if qp.eng == nil && qp.ud == nil && qp.state == StateError { // not reset, nor connected, meanwhile
			qp.flushUnstartedLocked()
		}
		qp.mu.Unlock()
	}
	return nil
}

// PostRecv queues a receive work request.
func (qp *QP) PostRecv(wr RecvWR) error {
	if qp.cfg.SRQ != nil {
		return wrap(ErrInvalidArgument, "the QP receives from an SRQ: post to it")
	}
	if len(wr.SGL) > qp.cfg.MaxSGE {
		return wrap(ErrInvalidArgument, "%d SGEs > max %d", len(wr.SGL), qp.cfg.MaxSGE)
	}
	qp.mu.Lock()
	defer qp.mu.Unlock()
	if qp.destroyed {
		return ErrClosed
	}
	if !canPostRecv(qp.state) {
		return wrap(ErrQPState, "post recv in %v", qp.state)
	}
	if qp.state == StateError {
		qp.cfg.RecvCQ.push(WC{WRID: wr.WRID, Status: WCWRFlushErr, Opcode: WCRecv, QPNum: qp.qpn})
		return nil
	}
	if !qp.rq.postLocked(&wr) {
		return wrap(ErrQueueFull, "%d receive WRs outstanding", qp.rq.len())
	}
	// The engine is not woken: no engine waits for a receive. A SEND that found
	// none was answered RNR NAK and comes again after the RNR timer, as on mlx5
	// and rxe; a UD datagram that found none was dropped.
	return nil
}

// BindUD attaches a UD QP, in RESET or INIT, to the process's RoCEv2 endpoint at
// local (as UDPConfig.Addr: RoCEv2's port is 4791; port 0 lets the kernel pick one)
// and moves it to RTR, as ibv_modify_qp to RTR does: it takes the datagrams sent to
// its QPN with its Q_Key from then on (UDAddr says where), and Modify(StateRTS) lets
// it send datagrams of at most mtu bytes (256..4096).
func (qp *QP) BindUD(local netip.AddrPort, mtu int) error {
	if qp.cfg.Type != QPTypeUD {
		return wrap(ErrInvalidArgument, "BindUD of an RC QP")
	}
	ep, err := UDPConfig{Addr: local}.openEndpoint()
	if err != nil {
		return err
	}
	defer func() { _ = ep.Close() }() // the port holds the endpoint while it lives
	qp.mu.Lock()
	defer qp.mu.Unlock()
	switch {
	case qp.destroyed:
		return ErrClosed
	case qp.ud != nil:
		return wrap(ErrQPState, "UD QP %d is bound already", qp.qpn)
	case qp.state != StateReset && qp.state != StateInit:
		return wrap(ErrQPState, "BindUD in %v", qp.state)
	}
	port, err := ep.AttachUD(roce.UDConfig{QPN: qp.qpn, MTU: mtu, Link: qp.dev.cfg.Link.wire()})
	if err != nil {
		return wrap(ErrInvalidArgument, "%v", err)
	}
	qp.setStateLocked(StateRTR)
	qp.startUDLocked(port, ep.Addr())
	return nil
}

// UDAddr returns the endpoint a bound UD QP receives at (its peers' UDDest.Addr),
// or the zero AddrPort.
func (qp *QP) UDAddr() netip.AddrPort {
	qp.mu.Lock()
	defer qp.mu.Unlock()
	if qp.ud == nil {
		return netip.AddrPort{}
	}
	return qp.ud.local
}

// Destroy stops the QP's engine, closes its wire and releases everything it held.
// No completions are generated for work still queued.
func (qp *QP) Destroy() error {
	qp.mu.Lock()
	if qp.destroyed {
		qp.mu.Unlock()
		return ErrClosed
	}
	qp.destroyed = true
	qp.gone.Store(true)
	qp.state = StateError
	qp.st.Store(int32(StateError))
	w := qp.wiringLocked()
	close(qp.done)
	qp.mu.Unlock()

	w.stop()
	qp.wg.Wait()
	if qp.cfg.SRQ != nil { // the engine has stopped: what it held goes back
		qp.mu.Lock()
		lost := qp.giveBackLocked()
		qp.mu.Unlock()
		if lost != nil {
			qp.cfg.RecvCQ.push(*lost)
		}
	}
	qp.cfg.SendCQ.detach()
	qp.cfg.RecvCQ.detach()
	qp.dev.mu.Lock()
	qp.unlistLocked()
	qp.dev.mu.Unlock()
	return nil
}

// ModifyAttr changes the attributes mask selects, as ibv_modify_qp does with those
// attribute bits. Values out of their fields' ranges fail with ErrInvalidArgument.
func (qp *QP) ModifyAttr(attr QPAttr, mask QPAttrMask) error {
	switch {
	case mask&^(AttrMinRNRTimer|AttrRNRRetry|AttrTimeout|AttrRetryCnt|AttrAccess|AttrQKey|AttrMaxRdAtomic|AttrMaxDestRdAtomic) != 0:
		return wrap(ErrInvalidArgument, "attribute mask %#x", uint32(mask))
	case mask&AttrAccess != 0 && attr.Access&^(AccessLocalWrite|AccessRemoteWrite|AccessRemoteRead|AccessRemoteAtomic) != 0:
		return wrap(ErrInvalidArgument, "QP access flags %v", attr.Access)
	case mask&AttrMinRNRTimer != 0 && attr.MinRNRTimer > 31, mask&AttrTimeout != 0 && attr.Timeout > 31:
		return wrap(ErrInvalidArgument, "timer encodings are 0..31")
	case mask&AttrRNRRetry != 0 && attr.RNRRetry > 7, mask&AttrRetryCnt != 0 && attr.RetryCnt > 7:
		return wrap(ErrInvalidArgument, "retry counts are 0..7")
	case mask&AttrMaxRdAtomic != 0 && int(attr.MaxRdAtomic) > qp.dev.cfg.RdAtomic,
		mask&AttrMaxDestRdAtomic != 0 && int(attr.MaxDestRdAtomic) > qp.dev.cfg.RdAtomic:
		return wrap(ErrInvalidArgument, "READs and atomics outstanding are 0..%d", qp.dev.cfg.RdAtomic)
	}
	// The session's retry settings change after QP.mu is left (the lock order),
	// under attrMu, so that concurrent changes reach it in the order they were made.
	qp.attrMu.Lock()
	defer qp.attrMu.Unlock()
	qp.mu.Lock()
	if qp.destroyed {
		qp.mu.Unlock()
		return ErrClosed
	}
	if mask&AttrMinRNRTimer != 0 {
		qp.attr.MinRNRTimer = attr.MinRNRTimer
	}
	if mask&AttrRNRRetry != 0 {
		qp.attr.RNRRetry = attr.RNRRetry
	}
	if mask&AttrTimeout != 0 {
		qp.attr.Timeout = attr.Timeout
	}
	if mask&AttrRetryCnt != 0 {
		qp.attr.RetryCnt = attr.RetryCnt
	}
	if mask&AttrAccess != 0 {
		qp.attr.Access = attr.Access
		qp.access.Store(uint32(attr.Access)) // the responder reads it per request
	}
	if mask&AttrQKey != 0 {
		qp.attr.QKey = attr.QKey
		qp.qkey.Store(attr.QKey) // a UD engine reads it per datagram
	}
	if mask&AttrMaxRdAtomic != 0 {
		qp.attr.MaxRdAtomic = attr.MaxRdAtomic
	}
	if mask&AttrMaxDestRdAtomic != 0 {
		qp.attr.MaxDestRdAtomic = attr.MaxDestRdAtomic
	}
	qp.attrGen.Add(1)
	if qp.eng != nil {
		qp.eng.wake() // the engine gives the requester the new retry settings
	}
	qp.mu.Unlock()
	return nil
}

// Stats returns the QP's counters.
func (qp *QP) Stats() QPStats {
	st := qp.rc.stats()
	st.QKeyViolations, st.NoReceive = qp.udc.qkeyViolations.Load(), qp.udc.noReceive.Load()
	qp.mu.Lock()
	port := qp.port
	qp.mu.Unlock()
	if port != nil {
		ls := port.Stats()
		st.LinkMaxInFlight = ls.MaxInFlight
		st.LinkSegmented, st.LinkSegmentedPackets, st.LinkGSORefused = ls.Segmented, ls.SegmentedPackets, ls.GSORefused
	}
	return st
}

// RespError says why this QP's responder last refused a request with a NAK (the
// requester's completion carries only the NAK code, as on the wire), or "".
func (qp *QP) RespError() string {
	qp.mu.Lock()
	defer qp.mu.Unlock()
	return qp.lastRefusal
}
