package odp

// A QP as the NIC holds it (mlx5's QP context): its state, attributes, send and
// receive queues; the engine takes work from here and moves the state to ERR.

import (
	"sync"
	"sync/atomic"

	"github.com/odpemu/odpemu/transport/roce"
	"golang.org/x/sys/cpu"
)

// QPType is a QP's transport.
type QPType int

// The transports.
const (
	QPTypeRC QPType = iota // reliable connected (the default)
	QPTypeUD               // unreliable datagram: SENDs of one packet to any UD QP
	// QPTypeUC is unreliable connected (IBTA 9.8, rxe's UC): SENDs and WRITEs to
	// one peer QP, with no acknowledgement, retransmission or RNR. A send
	// completes once its last packet left (its payload copied as it goes out); the
	// responder drops a message it cannot take (no receive posted, an access error,
	// a packet lost) and completes nothing for it, and a network page fault holds
	// the QP until it is resolved.
	QPTypeUC
)

// QPConfig configures a QP.
type QPConfig struct {
	Type           QPType
	SendCQ, RecvCQ *CQ
	MaxSendWR      int  // default 128
	MaxRecvWR      int  // default 128
	MaxSGE         int  // default 16
	MaxInlineData  int  // largest SendInline request; default 256, at most 1024
	SigAll         bool // every send work request completes, as if signaled
	// SRQ is the shared receive queue the QP receives from, instead of a receive
	// queue of its own (MaxRecvWR is then 0, and PostRecv refused).
	SRQ *SRQ
}

// QP is a queue pair: reliable connected by default, unreliable connected or
// datagram by its QPConfig.Type. It is created in RESET and becomes usable with
// Connect (or Modify through INIT, RTR and RTS after Connect attached a wire; a UD QP
// with BindUD). Work
// requests are processed asynchronously, in order, by the QP's engine, one goroutine
// that runs the QP's requester and responder (engine.go); errors move the QP to ERR,
// after which pending and new work requests complete with WR_FLUSH_ERR.
type QP struct {
	pd  *domain
	dev *nic
	// unlistLocked removes the QP from its device's list and its PD's count. Called
	// with Device.mu held.
	unlistLocked func()
	qpn          uint32
	cfg          QPConfig
	psn          uint32       // the first PSN this QP sends (SetSendPSN writes it under mu)
	rc           rcCounters   // the QP's RC events
	sq           sendQueue    // posted by PostSend, processed and retired by the engine
	st           atomic.Int32 // the state, for the engine's loop (written under mu)
	// engA is eng, for PostSend to wake without QP.mu; gone is destroyed.
	engA atomic.Pointer[engine]
	gone atomic.Bool
	// attrGen counts ModifyAttr calls, for the engine to see new retry settings.
	attrGen atomic.Uint64
	// access is attr.Access, for the responder's check of every request.
	access atomic.Uint32
	// qkey is a UD QP's Q_Key (ModifyAttr), which datagrams must carry.
	qkey atomic.Uint32
	udc  udCounters               // a UD QP's drops
	udA  atomic.Pointer[udEngine] // ud, for PostSend to wake without QP.mu
	wg   sync.WaitGroup           // the connection manager watch

	attrMu sync.Mutex // orders ModifyAttr calls; taken before QP.mu

	mu     sync.Mutex // protects everything below
	state  QPState
	attr   QPAttr
	port   roce.Port     // the wire, attached by Connect
	remote Remote        // the peer QP
	eng    *engine       // the engine, once started
	ud     *udEngine     // a UD QP's engine, once bound (BindUD): it holds the QP's port
	cm     *roce.CM      // the connection manager's channel (Accept, Dial)
	done   chan struct{} // closed by Destroy
	// lastRefusal says why the responder last answered a NAK (RespError).
	lastRefusal string
	destroyed   bool
	// resetting: reset is stopping the engine; Modify and a second reset refuse,
	// and the engine's moves to ERR are ignored.
	resetting bool
	rq        recvQueue // posted receives (the engine takes them)
	// With an SRQ: the receive taken from it for the message being received
	// (held), numbered heldSeq for takeRecv.
	held    RecvWR
	holding bool
	heldSeq uint64
}

// recvQueue is a receive queue, a ring of MaxRecvWR slots as a NIC's is: PostRecv
// fills the slot at tail under its lock (QP.mu, or SRQ.mu for an SRQ's), and the
// engine looks at the slot at head and takes it without a lock (peek, take), as it
// reads the send queue; a flush to ERR empties the ring under the posters' lock.
// Receives are numbered in posting order, and head moves only by compare-and-swap
// from the receive's number: the engine takes the one it looked at or, when a
// flush completed it meanwhile, none. A slot is written again only after head
// passed it, which a take or a flush did, and a flushed QP is in ERR, where
// receives are completed without being posted, until a reset that stops its engine
// first: so the engine reads a slot no poster writes. What the posters write
// (tail) and what the engine writes (head) are on cache lines of their own. A slot
// keeps up to four SGEs in itself: posting allocates nothing.
type recvQueue struct {
	slots []rqe
	_     cpu.CacheLinePad
	tail  atomic.Uint64 // the next receive to post
	// headSeen is head as a poster last loaded it (under the posters' lock): head
	// only grows, so a ring that is not full by it is not full. Posters load head
	// again only when it says full, so that they do not take head's line from the
	// engine every post.
	headSeen uint64
	_        cpu.CacheLinePad
	head     atomic.Uint64 // the oldest receive not taken
	// tailSeen is tail as the taker last loaded it (the engine, or an SRQ's
	// takers under SRQ.mu): it loads tail again only when head reaches it.
	tailSeen uint64
	_        cpu.CacheLinePad
}

// slot returns send queue slot i (i counts every request posted).
func (q *sendQueue) slot(i uint64) *wqe { return &q.slots[i%uint64(len(q.slots))] }

// rqe is a receive queue slot.
type rqe struct {
	wr  RecvWR
	sgl [4]SGE
}

// len returns how many receives are posted; any goroutine may call it.
func (q *recvQueue) len() int {
	h := q.head.Load() // first: the tail loaded after it is at least h
	return int(q.tail.Load() - h)
}

// postLocked adds wr (its SGL copied) at the tail, unless the ring is full.
// Called with the posters' lock held (QP.mu, or SRQ.mu).
func (q *recvQueue) postLocked(wr *RecvWR) bool {
	t := q.tail.Load()
	if t-q.headSeen >= uint64(len(q.slots)) {
		if q.headSeen = q.head.Load(); t-q.headSeen >= uint64(len(q.slots)) {
			return false
		}
	}
	s := &q.slots[t%uint64(len(q.slots))]
	s.wr = RecvWR{WRID: wr.WRID, SGL: append(s.sgl[:0], wr.SGL...)}
	q.tail.Store(t + 1)
	return true
}

// peek copies the oldest posted receive into dst, reusing dst's SGL, and returns
// its number for take; ok is false when none is posted. It takes no lock: only
// the QP's engine calls it (or an SRQ's taker, under SRQ.mu).
func (q *recvQueue) peek(dst *RecvWR) (seq uint64, ok bool) {
	h := q.head.Load()
	if h >= q.tailSeen { // a flush may have moved head past it
		if q.tailSeen = q.tail.Load(); h == q.tailSeen {
			return 0, false
		}
	}
	s := &q.slots[h%uint64(len(q.slots))]
	dst.WRID, dst.SGL = s.wr.WRID, append(dst.SGL[:0], s.wr.SGL...)
	return h, true
}

// take removes receive seq, which peek returned, if it is still the oldest posted
// one (a flush may have completed it since), and reports whether it did. It takes
// no lock.
func (q *recvQueue) take(seq uint64) bool { return q.head.CompareAndSwap(seq, seq+1) }

// flushLocked removes every posted receive at once, and calls done with each one's
// WRID, oldest first: the engine takes none of them after it, so no receive
// completes after one the flush completed. Called with the posters' lock held.
func (q *recvQueue) flushLocked(done func(wrid uint64)) {
	t := q.tail.Load() // no post moves it meanwhile
	h := q.head.Load()
	for h != t && !q.head.CompareAndSwap(h, t) {
		h = q.head.Load() // the engine took one
	}
	for ; h != t; h++ {
		done(q.slots[h%uint64(len(q.slots))].wr.WRID)
	}
}

// sendQueue is a QP's send queue, a ring of MaxSendWR slots as a NIC's is: PostSend
// fills the slot at tail (under mu, for concurrent posters) and the engine, its only
// reader, processes slots from its own cursor and retires them at head, in order.
// A slot is reused only after it was retired, so the engine reads a posted slot
// without a lock once it has seen tail. What the posters write (mu, tail) and what
// the engine writes (head) are on cache lines of their own: a post and a retirement
// on two cores do not take each other's line every message.
type sendQueue struct {
	slots []wqe
	_     cpu.CacheLinePad
	mu    sync.Mutex    // serialises posters
	tail  atomic.Uint64 // the next slot to post
	_     cpu.CacheLinePad
	head  atomic.Uint64 // the oldest slot not retired
	_     cpu.CacheLinePad
}

// wqe is a send queue slot: the work request as posted, and what the engine found.
type wqe struct {
	wr     SendWR
	sgl    [4]SGE // the SGL when it has at most four elements (no allocation per post)
	mrs    []*MR  // the SGL's MRs, looked up once (engine)
	mrBuf  [4]*MR
	ud     UDDest // a UD SEND's destination (wr.UD points here)
	done   bool   // completed, waiting to be retired in order (engine)
	status WCStatus
	detail string
}

// Remote is what a QP needs of its peer, as rdma_cm exchanges it: the peer QP's
// number and the first PSN it sends.
type Remote struct {
	QPN uint32
	PSN uint32
}

// setStateLocked changes the state and tells the engine. Called with QP.mu held.
func (qp *QP) setStateLocked(s QPState) {
	qp.state = s
	qp.st.Store(int32(s))
	if qp.eng != nil {
		qp.eng.wake()
	}
	if qp.ud != nil {
		qp.ud.wake()
	}
}

// flushUnstartedLocked completes, with WR_FLUSH_ERR, the send WRs of a QP in ERR that has
// no engine to do it. Called with QP.mu held: an engine started under it would
// process the same slots.
func (qp *QP) flushUnstartedLocked() {
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

// toErrorLocked moves the QP to ERR and flushes its posted receives; the engine
// flushes what is outstanding and what it reaches later. Called with QP.mu held; it
// takes the receive CQ's lock.
func (qp *QP) toErrorLocked() {
	if qp.state == StateError || qp.resetting {
		return
	}
	qp.setStateLocked(StateError)
	qp.flushRecvsLocked()
}

// failWith moves the QP to ERR for the work request whose error completion is wc,
// queued on cq (the send or the receive CQ) once the QP is in ERR and before the
// flushes of the posted receives, in the order a NIC writes them: an application that
// polls the error finds the QP in ERR, and one that polls one CQ for both finds the
// error before the flushes, as rdma-core's tests expect.
func (qp *QP) failWith(cq *CQ, wc WC) {
	qp.mu.Lock()
	defer qp.mu.Unlock()
	if qp.state == StateError || qp.resetting {
		cq.push(wc)
		return
	}
	qp.setStateLocked(StateError)
	cq.push(wc)
	qp.flushRecvsLocked()
}

// flushRecvsLocked completes the posted receives with WR_FLUSH_ERR, and, without an
// engine, the posted sends. Called with QP.mu held; it takes the CQs' locks.
func (qp *QP) flushRecvsLocked() {
	qp.rq.flushLocked(func(wrid uint64) {
		qp.cfg.RecvCQ.push(WC{WRID: wrid, Status: WCWRFlushErr, Opcode: WCRecv, QPNum: qp.qpn})
	})
	if qp.holding { // the SRQ's receive it took; the SRQ keeps the others
		qp.holding = false
		qp.cfg.RecvCQ.push(WC{WRID: qp.held.WRID, Status: WCWRFlushErr, Opcode: WCRecv, QPNum: qp.qpn})
	}
	if qp.eng == nil && qp.ud == nil {
		qp.flushUnstartedLocked() // takes the send queue's lock under QP.mu
	}
}

func (qp *QP) toError() {
	qp.mu.Lock()
	qp.toErrorLocked()
	qp.mu.Unlock()
}

// hasRecv reports whether a receive is posted (or, with an SRQ, held or posted
// to the SRQ).
func (qp *QP) hasRecv() bool {
	srq := qp.cfg.SRQ
	if srq == nil {
		return qp.rq.len() > 0
	}
	qp.mu.Lock()
	defer qp.mu.Unlock()
	return qp.holding || srq.Len() > 0 // SRQ.mu under QP.mu
}

// peekRecv copies the oldest posted receive into dst (reusing dst's SGL) and
// returns its number for takeRecv; ok is false when none is posted. With an SRQ
// it is the receive the QP holds, taken from the SRQ if it holds none; the SRQ's
// limit event, if that take reached it, is raised here, with no lock held.
func (qp *QP) peekRecv(dst *RecvWR) (seq uint64, ok bool) {
	srq := qp.cfg.SRQ
	if srq == nil {
		return qp.rq.peek(dst) // no lock: see recvQueue
	}
	limit := false
	qp.mu.Lock()
	if !qp.holding && qp.state != StateError && !qp.destroyed {
		srq.mu.Lock()
		qp.holding, limit = srq.takeLocked(&qp.held)
		srq.mu.Unlock()
		qp.heldSeq++
	}
	if qp.holding {
		dst.WRID, dst.SGL = qp.held.WRID, append(dst.SGL[:0], qp.held.SGL...)
	}
	seq, ok = qp.heldSeq, qp.holding
	qp.mu.Unlock()
	if limit {
		srq.onLimit()
	}
	return seq, ok
}

// takeRecv removes receive seq, which peekRecv returned, and reports whether it
// did: false when a flush to ERR completed it meanwhile (only the engine takes
// receives).
func (qp *QP) takeRecv(seq uint64) bool {
	if qp.cfg.SRQ == nil {
		return qp.rq.take(seq) // no lock: see recvQueue
	}
	qp.mu.Lock()
	defer qp.mu.Unlock()
	if !qp.holding || seq != qp.heldSeq {
		return false
	}
	qp.holding = false
	return true
}

// giveBackLocked returns the receive the QP holds to its SRQ (a reset or a
// destroy). If the SRQ has no room left, it returns the WR_FLUSH_ERR completion
// the receive ends with instead, for the caller to push. Called with QP.mu held.
func (qp *QP) giveBackLocked() *WC {
	if !qp.holding {
		return nil
	}
	qp.holding = false
	srq := qp.cfg.SRQ
	srq.mu.Lock()
	back := srq.giveBackLocked(&qp.held)
	srq.mu.Unlock()
	if back {
		return nil
	}
	return &WC{WRID: qp.held.WRID, Status: WCWRFlushErr, Opcode: WCRecv, QPNum: qp.qpn}
}

// minRNRTimer is the RNR timer the responder asks for.
func (qp *QP) minRNRTimer() uint8 {
	qp.mu.Lock()
	defer qp.mu.Unlock()
	return qp.attr.MinRNRTimer
}

// Attr returns the QP's attributes.
func (qp *QP) Attr() QPAttr {
	qp.mu.Lock()
	defer qp.mu.Unlock()
	return qp.attr
}

// PSN returns the first PSN the QP sends (random, as rdma_cm picks it): the peer's
// Remote.PSN.
func (qp *QP) PSN() uint32 {
	qp.mu.Lock()
	defer qp.mu.Unlock()
	return qp.psn
}

// wiring is what ties a QP to the NIC and the wire: its engine, its wire and its
// connection manager's channel, or a UD QP's engine and the port it holds. Destroy
// and reset take it under QP.mu and stop it after.
type wiring struct {
	eng  *engine
	port roce.Port
	cm   *roce.CM
	ud   *udEngine
}

// wiringLocked returns the QP's wiring. Called with QP.mu held.
func (qp *QP) wiringLocked() wiring {
	return wiring{eng: qp.eng, port: qp.port, cm: qp.cm, ud: qp.ud}
}

// stop ends the engines (each releases every run it held) and closes the wires; the
// peer of a connection manager's channel learns of it.
func (w wiring) stop() {
	if w.ud != nil {
		w.ud.stop()
		_ = w.ud.port.Close() // the port is going away either way
	}
	if w.cm != nil {
		_ = w.cm.Disconnect() // the channel is gone either way
	}
	if w.eng != nil {
		w.eng.stop()
	}
	if w.port != nil {
		_ = w.port.Close() // the wire is going away either way
	}
}

// reset moves a connected QP to RESET, as ibv_modify_qp does: the engine stops and
// the wire closes (a connection manager's channel is disconnected), the work queued
// on both queues is dropped without completions, and the completions of this QP
// still in its CQs are removed, as libmlx5 cleans its CQs on the move to RESET (rxe
// leaves them). The attributes go back to their defaults; the QP can be connected
// again, through INIT, RTR and RTS, to the same peer or another.
func (qp *QP) reset() error {
	qp.mu.Lock()
	switch {
	case qp.destroyed:
		qp.mu.Unlock()
		return ErrClosed
	case qp.resetting:
		qp.mu.Unlock()
		return wrap(ErrQPState, "QP %d is being reset", qp.qpn)
	}
	qp.resetting = true
	w := qp.wiringLocked()
	qp.cm = nil // its watch ends without moving the QP to ERR
	qp.mu.Unlock()

	w.stop() // nothing of the engines runs after

	qp.mu.Lock()
	qp.resetting = false
	if qp.destroyed { // Destroy ran meanwhile and released the rest
		qp.mu.Unlock()
		return ErrClosed
	}
	qp.eng, qp.port, qp.remote, qp.lastRefusal = nil, nil, Remote{}, ""
	qp.engA.Store(nil)
	qp.ud = nil
	qp.udA.Store(nil)
	qp.qkey.Store(0)
	qp.setStateLocked(StateReset)
	qp.attr = qpAttr(qp.dev.cfg.RdAtomic)
	qp.access.Store(uint32(DefaultQPAttr.Access))
	qp.attrGen.Add(1)
	qp.rq.flushLocked(func(uint64) {})
	lost := qp.giveBackLocked()
	q := &qp.sq
	q.mu.Lock() // posters see RESET from here on (PostSend checks it under q.mu)
	for h := q.head.Load(); h < q.tail.Load(); h++ {
		*q.slot(h) = wqe{}
	}
	q.head.Store(q.tail.Load())
	q.mu.Unlock()
	qp.mu.Unlock()
	qp.cfg.SendCQ.dropQP(qp.qpn)
	if qp.cfg.RecvCQ != qp.cfg.SendCQ {
		qp.cfg.RecvCQ.dropQP(qp.qpn)
	}
	if lost != nil {
		qp.cfg.RecvCQ.push(*lost)
	}
	return nil
}
