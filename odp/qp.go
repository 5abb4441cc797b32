package odp

import (
	"math/rand/v2"
	"sync"
	"sync/atomic"

	"github.com/odpemu/odpemu/transport/roce"
)

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
)

func (o Opcode) valid() bool { return o >= OpRDMAWrite && o <= OpAtomicFetchAdd }

func (o Opcode) atomic() bool { return o == OpAtomicCmpSwap || o == OpAtomicFetchAdd }

// readsBack reports whether the request's response carries data into the local
// SGL (a READ's data, an atomic's original value), which fences wait for.
func (o Opcode) readsBack() bool { return o == OpRDMARead || o.atomic() }

// carriesData reports whether the request carries the SGL's bytes to the peer.
func (o Opcode) carriesData() bool {
	return o == OpRDMAWrite || o == OpRDMAWriteImm || o == OpSend || o == OpSendImm
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
	RemoteAddr uint64 // RDMA WRITE, READ and atomics
	RKey       uint32 // RDMA WRITE, READ and atomics
	Imm        uint32 // OpRDMAWriteImm, OpSendImm: the immediate data
	CompareAdd uint64 // atomics: the compare value (CmpSwap) or the addend (FetchAdd)
	Swap       uint64 // OpAtomicCmpSwap: the value stored if the compare matches

	inline []byte // SendInline: the bytes, copied at post time
}

// RecvWR is a receive queue work request.
type RecvWR struct {
	WRID uint64
	SGL  []SGE
}

// QPConfig configures a QP.
type QPConfig struct {
	SendCQ, RecvCQ *CQ
	MaxSendWR      int  // default 128
	MaxRecvWR      int  // default 128
	MaxSGE         int  // default 16
	MaxInlineData  int  // largest SendInline request; default 256, at most 1024
	SigAll         bool // every send work request completes, as if signaled
}

// maxMsg is the largest RC message (2 GiB), as on mlx5.
const maxMsg = 1 << 31

// The QP limits QueryDevice reports.
const (
	maxQPWR   = 1 << 15 // work requests per queue
	maxSGE    = 32      // SGEs per work request
	maxInline = 1024    // bytes of inline data per work request
)

// QP is a reliable-connected queue pair. It is created in RESET and becomes usable with
// Connect (or Modify through INIT, RTR and RTS after Connect attached a wire). Work
// requests are processed asynchronously, in order, by the QP's engine, one goroutine
// that runs the QP's requester and responder (engine.go); errors move the QP to ERR,
// after which pending and new work requests complete with WR_FLUSH_ERR.
type QP struct {
	pd  *PD
	dev *Device
	qpn uint32
	cfg QPConfig
	psn uint32       // the first PSN this QP sends
	rc  rcCounters   // the QP's RC events
	sq  sendQueue    // posted by PostSend, processed and retired by the engine
	st  atomic.Int32 // the state, for the engine's loop (written under mu)
	// engA is eng, for PostSend to wake without QP.mu; gone is destroyed.
	engA atomic.Pointer[engine]
	gone atomic.Bool
	// attrGen counts ModifyAttr calls, for the engine to see new retry settings.
	attrGen atomic.Uint64
	wg      sync.WaitGroup // the connection manager watch

	attrMu sync.Mutex // orders ModifyAttr calls; taken before QP.mu

	mu     sync.Mutex // protects everything below
	state  QPState
	attr   QPAttr
	port   roce.Port     // the wire, attached by Connect
	remote Remote        // the peer QP
	eng    *engine       // the engine, once started
	cm     *roce.CM      // the connection manager's channel (Accept, Dial)
	done   chan struct{} // closed by Destroy
	// lastRefusal says why the responder last answered a NAK (RespError).
	lastRefusal string
	destroyed   bool
	rq          recvQueue // posted receives (the engine takes them)
}

// recvQueue is a QP's receive queue, a ring of MaxRecvWR slots: PostRecv fills the
// slot at tail, the engine looks at the slot at head and takes it, and a flush to
// ERR empties the ring; all of it under QP.mu. Receives are numbered in posting
// order, so that the engine takes the one it looked at or, when a flush completed
// it meanwhile, none. A slot keeps up to four SGEs in itself: posting allocates
// nothing.
type recvQueue struct {
	slots      []rqe
	head, tail uint64 // the oldest receive not taken; the next to post
}

// slot returns send queue slot i (i counts every request posted).
func (q *sendQueue) slot(i uint64) *wqe { return &q.slots[i%uint64(len(q.slots))] }

// rqe is a receive queue slot.
type rqe struct {
	wr  RecvWR
	sgl [4]SGE
}

// lenLocked returns how many receives are posted. Called with QP.mu held.
func (q *recvQueue) lenLocked() int { return int(q.tail - q.head) }

// postLocked adds wr (its SGL copied) at the tail, unless the ring is full.
// Called with QP.mu held.
func (q *recvQueue) postLocked(wr *RecvWR) bool {
	if q.lenLocked() >= len(q.slots) {
		return false
	}
	s := &q.slots[q.tail%uint64(len(q.slots))]
	s.wr = RecvWR{WRID: wr.WRID, SGL: append(s.sgl[:0], wr.SGL...)}
	q.tail++
	return true
}

// peekLocked copies the oldest posted receive into dst, reusing dst's SGL, and
// returns its number; ok is false when none is posted. Called with QP.mu held.
func (q *recvQueue) peekLocked(dst *RecvWR) (seq uint64, ok bool) {
	if q.head == q.tail {
		return 0, false
	}
	s := &q.slots[q.head%uint64(len(q.slots))]
	dst.WRID, dst.SGL = s.wr.WRID, append(dst.SGL[:0], s.wr.SGL...)
	return q.head, true
}

// takeLocked removes receive seq if it is still the oldest posted one (a flush
// may have completed it since peekLocked). Called with QP.mu held.
func (q *recvQueue) takeLocked(seq uint64) bool {
	if q.head != seq || q.head == q.tail {
		return false
	}
	q.slots[q.head%uint64(len(q.slots))].wr.SGL = nil
	q.head++
	return true
}

// flushLocked removes every posted receive, oldest first, and calls done with each
// one's WRID. Called with QP.mu held.
func (q *recvQueue) flushLocked(done func(wrid uint64)) {
	for ; q.head != q.tail; q.head++ {
		s := &q.slots[q.head%uint64(len(q.slots))]
		done(s.wr.WRID)
		s.wr.SGL = nil
	}
}

// sendQueue is a QP's send queue, a ring of MaxSendWR slots as a NIC's is: PostSend
// fills the slot at tail (under mu, for concurrent posters) and the engine, its only
// reader, processes slots from its own cursor and retires them at head, in order.
// A slot is reused only after it was retired, so the engine reads a posted slot
// without a lock once it has seen tail.
type sendQueue struct {
	mu    sync.Mutex // serialises posters
	slots []wqe
	tail  atomic.Uint64 // the next slot to post
	head  atomic.Uint64 // the oldest slot not retired
}

// wqe is a send queue slot: the work request as posted, and what the engine found.
type wqe struct {
	wr     SendWR
	sgl    [4]SGE // the SGL when it has at most four elements (no allocation per post)
	mrs    []*MR  // the SGL's MRs, looked up once (engine)
	mrBuf  [4]*MR
	done   bool // completed, waiting to be retired in order (engine)
	status WCStatus
	detail string
}

// Remote is what a QP needs of its peer// Remote is what a QP needs of its peer, as rdma_cm exchanges it: the peer QP's
// number and the first PSN it sends.
type Remote struct {
	QPN uint32
	PSN uint32
}

// CreateQP creates an RC QP in RESET.
func (pd *PD) CreateQP(cfg QPConfig) (*QP, error) {
	if pd == nil || pd.dead.Load() {
		return nil, wrap(ErrInvalidArgument, "CreateQP on a deallocated PD")
	}
	if cfg.SendCQ == nil || cfg.RecvCQ == nil {
		return nil, wrap(ErrInvalidArgument, "QP needs a send and a receive CQ")
	}
	if cfg.MaxSendWR == 0 {
		cfg.MaxSendWR = 128
	}
	if cfg.MaxRecvWR == 0 {
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
	d := pd.dev
	for _, cq := range []*CQ{cfg.SendCQ, cfg.RecvCQ} {
		if cq.dev != d {
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
	qp := &QP{pd: pd, dev: d, qpn: nextQPN(), cfg: cfg, attr: DefaultQPAttr, done: make(chan struct{}),
		psn: rand.Uint32() & (1<<24 - 1)}
	qp.sq.slots = make([]wqe, cfg.MaxSendWR)
	qp.rq.slots = make([]rqe, cfg.MaxRecvWR)
	d.qps[qp] = struct{}{}
	return qp, nil
}

func (cq *CQ) detach() {
	cq.mu.Lock()
	cq.users--
	cq.mu.Unlock()
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

// PSN returns the first PSN the QP sends (random, as rdma_cm picks it): the peer's
// Remote.PSN.
func (qp *QP) PSN() uint32 { return qp.psn }

// Connect attaches port, the wire to the peer QP remote, and moves the QP from RESET
// or INIT to RTS. The port's MTU is the path MTU. From then on the QP owns the port:
// Destroy closes it. If Connect fails, the caller keeps it.
func (qp *QP) Connect(port roce.Port, remote Remote) error {
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
	if qp.state != StateReset && qp.state != StateInit {
		return wrap(ErrQPState, "connect in %v", qp.state)
	}
	qp.port, qp.remote = port, remote
	qp.setStateLocked(StateRTS)
	qp.startLocked()
	return nil
}

// setStateLocked changes the state and tells the engine. Called with QP.mu held.
func (qp *QP) setStateLocked(s QPState) {
	qp.state = s
	qp.st.Store(int32(s))
	if qp.eng != nil {
		qp.eng.wake()
	}
}

// Modify moves the QP to state to. RTR needs a wire attached by Connect first;
// moving to ERR flushes outstanding work.
func (qp *QP) Modify(to QPState) error {
	qp.mu.Lock()
	defer qp.mu.Unlock()
	if qp.destroyed {
		return ErrClosed
	}
	if err := checkTransition(qp.state, to); err != nil {
		return err
	}
	switch to {
	case StateRTR:
		if qp.port == nil {
			return wrap(ErrQPState, "RTR needs a connection")
		}
		qp.startLocked()
	case StateReset:
		if qp.eng != nil {
			return wrap(ErrQPState, "reset of a connected QP: destroy it instead")
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
	s := QPState(qp.st.Load())
	if qp.gone.Load() {
		return ErrClosed
	}
	if !canPostSend(s) {
		return wrap(ErrQPState, "post send in %v", s)
	}
	q := &qp.sq
	q.mu.Lock()
	tail := q.tail.Load()
	if tail-q.head.Load() >= uint64(len(q.slots)) {
		q.mu.Unlock()
		return wrap(ErrQueueFull, "%d send WRs outstanding", len(q.slots))
	}
	w := &q.slots[tail%uint64(len(q.slots))]
	// Field by field: the caller's SGL is copied, never kept (so it does not
	// escape, and a caller's WR on the stack costs no allocation).
	*w = wqe{wr: SendWR{WRID: wr.WRID, Opcode: wr.Opcode, Flags: wr.Flags, RemoteAddr: wr.RemoteAddr, RKey: wr.RKey,
		Imm: wr.Imm, CompareAdd: wr.CompareAdd, Swap: wr.Swap, inline: inline}}
	if len(wr.SGL) <= len(w.sgl) {
		w.wr.SGL = w.sgl[:copy(w.sgl[:], wr.SGL)]
	} else {
		w.wr.SGL = append([]SGE(nil), wr.SGL...)
	}
	q.tail.Store(tail + 1)
	q.mu.Unlock()
	if eng := qp.engA.Load(); eng != nil {
		eng.wake()
	} else if s == StateError {
		qp.flushUnstarted()
	}
	return nil
}

// flushUnstarted completes, with WR_FLUSH_ERR, the send WRs of a QP in ERR that never
// had an engine to do it.
func (qp *QP) flushUnstarted() {
	q := &qp.sq
	q.mu.Lock()
	defer q.mu.Unlock()
	for h := q.head.Load(); h < q.tail.Load(); h++ {
		w := &q.slots[h%uint64(len(q.slots))]
		qp.cfg.SendCQ.push(WC{WRID: w.wr.WRID, Status: WCWRFlushErr, Opcode: wcOpcode(w.wr.Opcode), QPNum: qp.qpn})
		*w = wqe{}
		q.head.Store(h + 1)
	}
}

// PostRecv queues a receive work request.
func (qp *QP) PostRecv(wr RecvWR) error {
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
		return wrap(ErrQueueFull, "%d receive WRs outstanding", qp.rq.lenLocked())
	}
	if qp.eng != nil {
		qp.eng.wake() // a SEND may wait for it
	}
	return nil
}

// toErrorLocked moves the QP to ERR and flushes its posted receives; the engine
// flushes what is outstanding and what it reaches later. Called with QP.mu held; it
// takes the receive CQ's lock.
func (qp *QP) toErrorLocked() {
	if qp.state == StateError {
		return
	}
	qp.setStateLocked(StateError)
	qp.rq.flushLocked(func(wrid uint64) {
		qp.cfg.RecvCQ.push(WC{WRID: wrid, Status: WCWRFlushErr, Opcode: WCRecv, QPNum: qp.qpn})
	})
	if qp.eng == nil {
		qp.flushUnstarted() // takes the send queue's lock under QP.mu
	}
}

func (qp *QP) toError() {
	qp.mu.Lock()
	qp.toErrorLocked()
	qp.mu.Unlock()
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
	eng, port, cm := qp.eng, qp.port, qp.cm
	close(qp.done)
	qp.mu.Unlock()

	if cm != nil {
		_ = cm.Disconnect() // the peer learns of it; the channel is gone either way
	}
	if eng != nil {
		eng.stop() // releases every run it held
	}
	if port != nil {
		_ = port.Close() // the wire is going away either way
	}
	qp.wg.Wait()
	qp.cfg.SendCQ.detach()
	qp.cfg.RecvCQ.detach()
	qp.dev.mu.Lock()
	delete(qp.dev.qps, qp)
	qp.dev.mu.Unlock()
	return nil
}

// hasRecv reports whether a receive is posted.
func (qp *QP) hasRecv() bool {
	qp.mu.Lock()
	defer qp.mu.Unlock()
	return qp.rq.lenLocked() > 0
}

// peekRecv copies the oldest posted receive into dst (reusing dst's SGL) and
// returns its number for takeRecv; ok is false when none is posted.
func (qp *QP) peekRecv(dst *RecvWR) (seq uint64, ok bool) {
	qp.mu.Lock()
	defer qp.mu.Unlock()
	return qp.rq.peekLocked(dst)
}

// takeRecv removes receive seq, which peekRecv returned, and reports whether it
// did: false when a flush to ERR completed it meanwhile (only the engine takes
// receives).
func (qp *QP) takeRecv(seq uint64) bool {
	qp.mu.Lock()
	defer qp.mu.Unlock()
	return qp.rq.takeLocked(seq)
}

// minRNRTimer is the RNR timer the responder asks for.
func (qp *QP) minRNRTimer() uint8 {
	qp.mu.Lock()
	defer qp.mu.Unlock()
	return qp.attr.MinRNRTimer
}
