package roce

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/odpemu/odpemu/internal/bufpool"
	"github.com/odpemu/odpemu/internal/clock"
	"github.com/odpemu/odpemu/internal/fifo"
)

// Handler is what a Session needs from the QP that owns it: the memory side of RC.
type Handler interface {
	// Execute runs a complete request, in PSN order, against local memory and says
	// how to answer it. m.Payload is valid only until it returns. It runs on the session's responder goroutine, one request at
	// a time, and may block. duplicate marks a READ that came again (IBTA lets the
	// responder read memory again): its answer must not be RNR.
	Execute(m *Message, duplicate bool) Answer
	// Reload reads a message's payload from memory again, into payload, before it
	// is retransmitted, as a NIC does. An error fails the message with StatusLocal.
	// It is called with the session's lock held: it must not call the Session.
	Reload(id uint64, payload []byte) error
	// Complete ends a posted message. It is called in posting order, from one
	// goroutine, never with the session's lock held.
	Complete(c Completion)
	// Lost is called at most once, when the connection can carry nothing more: the
	// port failed or was closed by the peer, or the peer broke the protocol.
	Lost(err error)
}

// Answer is how the responder answers an executed request.
type Answer struct {
	// Response is a READ's data (Payload) or an atomic's original value (Orig).
	Response *Message
	// NAK, when set, refuses the request with that NAK code (remote access error,
	// invalid request, remote operational error); the responder then stops
	// answering, as a QP in the error state does.
	NAK Syndrome
	// RNR asks for an RNR NAK with Timer; Resolve, if set, runs once it is sent
	// (the network page fault is resolved while the requester waits).
	RNR     bool
	Timer   uint8
	Resolve func()
	// Drop answers nothing (the QP is in the error state).
	Drop bool
	// Release, if set, is called once Response has been sent (or will not be).
	Release func()
}

func (a *Answer) release() {
	if a.Release != nil {
		a.Release()
	}
}

// Counters count a session's RC events. Several sessions may share one (a device's
// totals); all fields are updated atomically.
type Counters struct {
	RNRNaksSent      atomic.Uint64 // RNR NAKs the responder sent
	RNRNaksReceived  atomic.Uint64 // RNR NAKs the requester received
	RNRWaitNanos     atomic.Uint64 // time the requester waited on RNR timers
	RNRRetryExceeded atomic.Uint64 // messages failed with RNR_RETRY_EXC_ERR
	Retransmitted    atomic.Uint64 // packets the requester sent again
	Timeouts         atomic.Uint64 // ACK timer expiries (local_ack_timeout_err)
	RetryExceeded    atomic.Uint64 // messages failed with RETRY_EXC_ERR
	SeqNAKsSent      atomic.Uint64 // PSN sequence error NAKs sent (out_of_sequence)
	SeqNAKsReceived  atomic.Uint64 // PSN sequence error NAKs received (packet_seq_err)
	Duplicates       atomic.Uint64 // duplicate requests answered again (duplicate_request)
	Dropped          atomic.Uint64 // packets dropped: wrong QPN, after a NAK, QP in error
}

// SessionConfig configures a Session.
type SessionConfig struct {
	// Requester holds the requester's attributes; its FirstPSN is this side's
	// starting PSN and its MTU defaults to the port's.
	Requester RequesterConfig
	// LocalQPN is this QP's number (packets for another are dropped); PeerQPN the
	// peer's, put in every packet sent.
	LocalQPN, PeerQPN uint32
	// PeerPSN is the peer's starting PSN.
	PeerPSN uint32
	// MaxAtomics is how many atomics' results are kept for duplicates (default 16).
	MaxAtomics int
	// Window bounds the PSNs in flight (default 1024): Post waits beyond it.
	Window int
	// Tick is how often the ACK timer is looked at (default Timeout/4).
	Tick time.Duration
	// Counters are updated with every event, each of them.
	Counters []*Counters
	// ExecuteWaits says that the Handler's Execute may wait on something the
	// peer's answers decide (a receive the application posts once a send
	// completes, a page fault it resolves in place): requests are then executed
	// on a responder goroutine of their own, so that a waiting request does not
	// hold up the ACKs and responses the receive loop takes for the requester.
	// Otherwise the receive loop executes them itself, sparing a goroutine hand-off
	// per batch of packets; an RNR NAK's Resolve then runs there too, before the
	// next packet is taken, and holds up this session's ACKs for as long.
	ExecuteWaits bool
}

// ackEvery bounds the messages a responder leaves unacknowledged within one batch
// of received packets (ACK coalescing: one ACK answers every message before it).
// A batch is acknowledged when the responder is through with it, so that the
// requester's window never waits on a queue behind it.
const ackEvery = 16

// Session is one RC connection: a Requester and a Responder over a Port, driven by
// a receive loop, a responder loop when Execute may wait (SessionConfig.ExecuteWaits;
// otherwise the receive loop executes requests), a completion loop and the ACK
// timer.
//
// Lock order: Session.mu, then Session.sendMu. Session.mu is taken holding no lock
// of the Handler's; under both the session calls only Handler.Reload, which must
// not take a lock that is held while Post or SetRetry is called. Fail takes no lock.
type Session struct {
	port Port
	h    Handler
	cfg  SessionConfig
	lim  Limits // the path MTU and the port's largest message

	mu      sync.Mutex // protects req, last, closed, queued
	sendMu  sync.Mutex // held while the requester's packets are sent; taken under mu (unlockSend)
	queued  []Packet   // the requester's packets to send when mu is released
	cond    sync.Cond  // on mu: the window opened, or the session ended
	req     *Requester
	last    RequesterStats // the requester's counters when last added to cfg.Counters
	closed  bool
	errored atomic.Bool // the responder answers nothing more

	resp     *Responder              // used by the loop that executes requests only
	requests *fifo.Queue[[]rxPacket] // from the receive loop to the responder loop, a batch at a time (ExecuteWaits)
	done     *fifo.Queue[Completion] // to the completion loop, in posting order
	lost     sync.Once

	failc chan struct{} // Fail asks the timer loop to flush
	stop  chan struct{}
	wg    sync.WaitGroup
}

type rxPacket struct {
	p   Packet
	buf []byte // the receive buffer p's payload aliases
}

// NewSession starts a session on port; h serves the peer's requests and takes the
// completions.
func NewSession(port Port, cfg SessionConfig, h Handler) *Session {
	lim := port.Limits()
	if cfg.Requester.MTU == 0 {
		cfg.Requester.MTU = lim.MTU
	}
	if cfg.Tick <= 0 {
		cfg.Tick = max(cfg.Requester.Timeout/4, time.Millisecond)
		if cfg.Requester.Timeout == 0 {
			cfg.Tick = 10 * time.Millisecond // in case SetRetry sets a timeout
		}
	}
	if cfg.Window <= 0 {
		cfg.Window = 1024
	}
	if cfg.MaxAtomics <= 0 {
		cfg.MaxAtomics = 16
	}
	// The path MTU segments both directions: the peer's requester counts a READ
	// response's packets with it.
	path := Limits{MTU: cfg.Requester.MTU, MaxMessage: lim.MaxMessage}
	s := &Session{port: port, h: h, cfg: cfg, lim: path, req: NewRequester(cfg.Requester),
		resp: NewResponder(cfg.PeerPSN, path, cfg.MaxAtomics), requests: fifo.New[[]rxPacket](),
		done: fifo.New[Completion](), stop: make(chan struct{}), failc: make(chan struct{}, 1)}
	s.cond.L = &s.mu
	free := &bufList{size: BufferSize(lim)}
	s.wg.Add(3)
	go s.recvLoop(free)
	go s.completionLoop()
	go s.timerLoop()
	if cfg.ExecuteWaits {
		s.wg.Add(1)
		go s.respLoop(free)
	}
	return s
}

// SetRetry changes the requester's ACK timeout and retry counts.
func (s *Session) SetRetry(timeout time.Duration, retryCnt, rnrRetry int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.req.SetRetry(timeout, retryCnt, rnrRetry)
}

// Post sends a message; its completion comes to the Handler. It waits while the
// window is full. An error means the message is invalid (it is not posted).
func (s *Session) Post(id uint64, m Message) error {
	m.DestQP = s.cfg.PeerQPN
	n := m.span(s.cfg.Requester.MTU)
	s.mu.Lock()
	defer s.unlockSend()
	for !s.closed && s.req.Outstanding() > 0 && s.req.InFlight()+n > s.cfg.Window {
		s.cond.Wait()
	}
	if s.closed {
		return ErrClosed
	}
	s.flushIfFailedLocked()
	out, err := s.req.Post(id, m, time.Now())
	if err != nil {
		return err
	}
	s.applyLocked(out)
	return nil
}

// unlockSend releases Session.mu and sends the packets queued under it. sendMu is
// taken before mu is released, so packets leave in the order the state machine
// made them while the receive loop may take mu meanwhile (an ACK need not wait
// for a long message's packets to be sent).
func (s *Session) unlockSend() {
	pkts := s.queued
	s.queued = nil
	if len(pkts) == 0 {
		s.mu.Unlock()
		return
	}
	s.sendMu.Lock()
	s.mu.Unlock()
	s.send(pkts)
	s.sendMu.Unlock()
}

// Fail puts the session in the error state: outstanding and later messages complete
// with StatusFlushed, and the responder answers nothing more. It takes no lock (the
// timer loop flushes), so the Handler may call it holding its own.
func (s *Session) Fail() {
	s.errored.Store(true)
	select {
	case s.failc <- struct{}{}:
	default: // a flush is due already
	}
}

// flushIfFailedLocked flushes the requester once Fail was called. Called with
// Session.mu held.
func (s *Session) flushIfFailedLocked() {
	if s.errored.Load() && !s.req.Failed() {
		s.applyLocked(s.req.Flush(StatusFlushed))
	}
}

// RequesterStats returns the requester's counters.
func (s *Session) RequesterStats() RequesterStats {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.req.Stats()
}

// PortStats returns the port's counters.
func (s *Session) PortStats() LinkStats { return s.port.Stats() }

// Close stops the loops and closes the port. Completions not yet delivered are
// dropped.
func (s *Session) Close() {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return
	}
	s.closed = true
	s.cond.Broadcast()
	s.mu.Unlock()
	close(s.stop)
	_ = s.port.Close() // ends the receive loop; a Close error leaves nothing to undo
	s.requests.Close()
	s.done.Close()
	s.wg.Wait()
}

// step runs one transition of the requester and applies its output.
func (s *Session) step(f func() Output) {
	s.mu.Lock()
	defer s.unlockSend()
	if !s.closed {
		s.applyLocked(f())
	}
}

// applyLocked queues the output's completions (in order), sends its packets, arms
// the RNR timer it asks for and counts what happened. Called with Session.mu held.
func (s *Session) applyLocked(out Output) {
	for _, c := range out.Done {
		switch c.Status {
		case StatusRNRRetryExceeded:
			s.count(func(c *Counters) *atomic.Uint64 { return &c.RNRRetryExceeded }, 1)
		case StatusRetryExceeded:
			s.count(func(c *Counters) *atomic.Uint64 { return &c.RetryExceeded }, 1)
		}
		s.done.Push(c)
	}
	if len(out.Done) > 0 {
		s.cond.Broadcast()
	}
	if len(out.Reload) > 0 {
		// Packets still being sent may alias these payloads: wait for them.
		s.sendMu.Lock()
		for _, r := range out.Reload {
			if s.h.Reload(r.ID, r.Payload) != nil {
				s.sendMu.Unlock()
				s.applyLocked(s.req.Abort(r.ID, StatusLocal)) // fails what was to be resent
				return
			}
		}
		s.sendMu.Unlock()
	}
	s.queued = append(s.queued, out.Send...) // sent by unlockSend; a lost packet is sent again by the timer
	st := s.req.Stats()
	s.count(func(c *Counters) *atomic.Uint64 { return &c.Retransmitted }, st.Retransmitted-s.last.Retransmitted)
	s.count(func(c *Counters) *atomic.Uint64 { return &c.Timeouts }, st.Timeouts-s.last.Timeouts)
	s.count(func(c *Counters) *atomic.Uint64 { return &c.SeqNAKsReceived }, st.SeqNAKs-s.last.SeqNAKs)
	s.count(func(c *Counters) *atomic.Uint64 { return &c.RNRNaksReceived }, st.RNRNAKs-s.last.RNRNAKs)
	s.last = st
	if out.RNRWait > 0 {
		s.rnrWait(out)
	}
}

// rnrWait resends from the RNR-NAKed PSN once the timer the responder asked for has
// run: precisely, since RNR timers start at 10 us and a Go timer lasts a
// millisecond at least here. Called with Session.mu held.
func (s *Session) rnrWait(out Output) {
	s.wg.Add(1)
	t0 := time.Now()
	go func() {
		defer s.wg.Done()
		if clock.SleepUntil(t0.Add(out.RNRWait), s.stop) {
			s.count(func(c *Counters) *atomic.Uint64 { return &c.RNRWaitNanos }, uint64(time.Since(t0)))
			s.step(func() Output { return s.req.Resend(out, time.Now()) })
		}
	}()
}

func (s *Session) count(field func(*Counters) *atomic.Uint64, n uint64) {
	if n == 0 {
		return
	}
	for _, c := range s.cfg.Counters {
		field(c).Add(n)
	}
}

// send puts packets on the wire; they carry the peer's QPN already.
func (s *Session) send(pkts []Packet) {
	if len(pkts) == 0 {
		return
	}
	_ = s.port.SendBatch(pkts) // a lost packet is the peer's timer's to recover
}

// fail reports the connection lost, once, and fails what is outstanding.
func (s *Session) fail(err error) {
	s.lost.Do(func() {
		s.errored.Store(true)
		s.h.Lost(err)
		s.step(func() Output { return s.req.Flush(StatusRetryExceeded) })
	})
}

// recvBatch is how many packets the receive loop takes per call.
const recvBatch = 32

// maxQueuedBatches bounds the batches of requests waiting for the responder loop,
// and with them the receive buffers a peer can make the session hold.
const maxQueuedBatches = 1024

// bufList holds receive buffers between the receive loop, which hands a request's
// buffer to the responder loop, and the responder loop, which gives it back.
type bufList struct {
	mu   sync.Mutex // protects free
	free [][]byte
	size int
}

func (l *bufList) get() []byte {
	l.mu.Lock()
	defer l.mu.Unlock()
	if n := len(l.free); n > 0 {
		b := l.free[n-1]
		l.free = l.free[:n-1]
		return b
	}
	return make([]byte, l.size)
}

func (l *bufList) put(b []byte) {
	l.mu.Lock()
	l.free = append(l.free, b)
	l.mu.Unlock()
}

func (s *Session) recvLoop(free *bufList) {
	defer s.wg.Done()
	bufs := make([][]byte, recvBatch)
	pkts := make([]Packet, recvBatch)
	for i := range bufs {
		bufs[i] = free.get()
	}
	for {
		// RecvBatch reorders bufs so that pkts[i] aliases bufs[i].
		n, err := s.port.RecvBatch(bufs, pkts)
		if err != nil {
			select {
			case <-s.stop:
			default:
				s.fail(fmt.Errorf("roce: connection lost: %w", err))
			}
			return
		}
		var reqs []rxPacket
		for i := 0; i < n; i++ {
			p := pkts[i]
			if p.DestQP != s.cfg.LocalQPN {
				s.count(func(c *Counters) *atomic.Uint64 { return &c.Dropped }, 1)
				continue
			}
			if p.Opcode.IsRequest() {
				reqs = append(reqs, rxPacket{p, bufs[i]})
				bufs[i] = free.get() // the responder loop gives the other back
				continue
			}
			s.step(func() Output { return s.req.Receive(&p, time.Now()) })
		}
		if len(reqs) > 0 && !s.cfg.ExecuteWaits {
			s.respondBatch(reqs, free)
			continue
		}
		if len(reqs) > 0 && s.requests.Len() >= maxQueuedBatches {
			// The responder is this far behind (a request waits on a fault or a
			// receive, or a peer floods): drop, as a NIC's full receive queue does;
			// RC's retransmission brings what counts again.
			for _, r := range reqs {
				free.put(r.buf)
			}
			s.count(func(c *Counters) *atomic.Uint64 { return &c.Dropped }, uint64(len(reqs)))
			continue
		}
		if len(reqs) > 0 && !s.requests.Push(reqs) {
			return
		}
	}
}

func (s *Session) respLoop(free *bufList) {
	defer s.wg.Done()
	for {
		batch, ok := s.requests.Pop()
		if !ok {
			return
		}
		s.respondBatch(batch, free)
	}
}

// respondBatch takes a batch of request packets through the responder and
// acknowledges what it executed: every ackEvery messages, and at the batch's end.
func (s *Session) respondBatch(batch []rxPacket, free *bufList) {
	unacked := 0
	for i := range batch {
		unacked += s.respond(&batch[i], free)
		if unacked > 0 && (unacked >= ackEvery || i == len(batch)-1) {
			s.reply(s.resp.Ack())
			unacked = 0
		}
	}
}

// respond takes one request packet through the responder and answers what it
// completes; it returns 1 if an ACK is owed (sent coalesced), else 0.
func (s *Session) respond(rx *rxPacket, free *bufList) int {
	act, m, resp := s.resp.Receive(&rx.p)
	free.put(rx.buf) // Receive copied what it keeps
	if s.errored.Load() {
		s.count(func(c *Counters) *atomic.Uint64 { return &c.Dropped }, 1)
		return 0
	}
	switch act {
	case ActExecute:
		owed := s.execute(m)
		if m.Kind == KindWrite || m.Kind == KindSend {
			bufpool.Put(m.Payload) // the Handler keeps none of it
		}
		return owed
	case ActDuplicate:
		s.count(func(c *Counters) *atomic.Uint64 { return &c.Duplicates }, 1)
		if m == nil {
			s.reply(resp)
			break
		}
		a := s.h.Execute(m, true)
		if a.NAK != 0 {
			s.reply(s.resp.Fail(m, a.NAK))
		} else if !a.Drop && a.Response != nil {
			s.replyData(m, a.Response)
		}
		a.release()
	case ActNAK:
		if resp.Syndrome == SynNAKPSNSeqError {
			s.count(func(c *Counters) *atomic.Uint64 { return &c.SeqNAKsSent }, 1)
			s.reply(resp)
			break
		}
		// The peer broke the protocol (a malformed message): IBTA's invalid
		// request, after which this QP is in error.
		s.reply(resp)
		s.fail(errors.New("roce: the peer sent a malformed request"))
	case ActDrop:
		s.count(func(c *Counters) *atomic.Uint64 { return &c.Dropped }, 1)
	}
	return 0
}

// execute runs a new request and answers it; it returns 1 if an ACK is owed
// (sent coalesced), else 0.
func (s *Session) execute(m *Message) int {
	a := s.h.Execute(m, false)
	defer a.release()
	switch {
	case a.Drop:
	case a.RNR:
		s.reply(s.resp.RNR(m, a.Timer))
		s.count(func(c *Counters) *atomic.Uint64 { return &c.RNRNaksSent }, 1)
		if a.Resolve != nil {
			a.Resolve()
		}
	case a.NAK != 0:
		s.errored.Store(true)
		s.reply(s.resp.Fail(m, a.NAK))
	default:
		if m.Kind != KindReadRequest && m.Kind != KindCompareSwap && m.Kind != KindFetchAdd {
			s.resp.Executed(m, nil)
			if m.AckReq {
				return 1
			}
			return 0
		}
		// The response is built whole before Executed keeps it: an atomic's
		// duplicates are answered with this very message.
		r := dataResponse(m, a.Response, (s.resp.MSN()+1)&psnMask)
		s.resp.Executed(m, r)
		s.reply(r)
	}
	return 0
}

// replyData sends a READ's response or an atomic's acknowledgement for m again
// (a duplicate READ: the MSN is the current one).
func (s *Session) replyData(m *Message, resp *Message) {
	s.reply(dataResponse(m, resp, s.resp.MSN()))
}

// dataResponse is the READ response or atomic acknowledgement answering m with
// resp's data (its Payload or Orig).
func dataResponse(m *Message, resp *Message, msn uint32) *Message {
	r := Message{PSN: m.PSN, Syndrome: SynACK, MSN: msn, Kind: KindAtomicAck}
	if resp != nil {
		r.Payload, r.Orig = resp.Payload, resp.Orig
	}
	if m.Kind == KindReadRequest {
		r.Kind = KindReadResponse
	}
	return &r
}

func (s *Session) reply(m *Message) {
	m.DestQP = s.cfg.PeerQPN
	ps, err := Segment(m, s.lim.MTU)
	if err != nil {
		return // only an invalid MTU fails, which the port refused when made
	}
	s.send(ps)
}

func (s *Session) completionLoop() {
	defer s.wg.Done()
	for {
		c, ok := s.done.Pop()
		if !ok {
			return
		}
		s.h.Complete(c)
	}
}

func (s *Session) timerLoop() {
	defer s.wg.Done()
	t := time.NewTicker(s.cfg.Tick)
	defer t.Stop()
	for {
		select {
		case <-s.stop:
			return
		case now := <-t.C:
			s.step(func() Output { return s.req.Tick(now) })
		case <-s.failc:
			s.mu.Lock()
			if !s.closed {
				s.flushIfFailedLocked()
			}
			s.unlockSend()
		}
	}
}
