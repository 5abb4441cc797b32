package roce

import (
	"errors"
	"net/netip"
	"sync"
	"time"
)

// Executor is the responder's side of a Session: it executes a complete request
// message against local memory and says how to answer. A READ's answer is its data
// (Response.Payload); an atomic's, the original value (Response.Orig). RNR asks for
// an RNR NAK with that timer (the request is dropped and comes again); NAK, for a NAK
// with that syndrome (the QP then fails).
type Executor func(m *Message) (resp *Message, rnr bool, timer uint8, nak Syndrome)

// Session is one RC connection over a Link: a Requester and a Responder driven by a
// receive loop and a timer loop. Post sends messages; completions arrive on Done in
// posting order. Close stops the loops.
type Session struct {
	link *Link
	peer netip.AddrPort
	exec Executor
	done chan Completion

	mu   sync.Mutex // protects req and resp
	req  *Requester
	resp *Responder

	stop chan struct{}
	wg   sync.WaitGroup
}

// SessionConfig configures a Session: the requester's attributes (its FirstPSN is
// this side's starting PSN), the peer's starting PSN, and the atomics kept for
// duplicates.
type SessionConfig struct {
	Requester  RequesterConfig
	PeerPSN    uint32
	MaxAtomics int
	// Tick is how often the ACK timer is looked at (default Timeout/4).
	Tick time.Duration
}

// NewSession starts a session with peer over link; exec serves the peer's requests.
func NewSession(link *Link, peer netip.AddrPort, cfg SessionConfig, exec Executor) *Session {
	if cfg.Requester.MTU == 0 {
		cfg.Requester.MTU = link.Limits().MTU
	}
	if cfg.Tick <= 0 {
		cfg.Tick = max(cfg.Requester.Timeout/4, time.Millisecond)
	}
	s := &Session{link: link, peer: peer, exec: exec, done: make(chan Completion, 1024), stop: make(chan struct{}),
		req: NewRequester(cfg.Requester), resp: NewResponder(cfg.PeerPSN, link.Limits(), cfg.MaxAtomics)}
	s.wg.Add(2)
	go s.recvLoop()
	go s.timerLoop(cfg.Tick)
	return s
}

// Done delivers completions in posting order. It must be read: a full channel holds
// the session up.
func (s *Session) Done() <-chan Completion { return s.done }

// Post sends a message; its completion comes on Done.
func (s *Session) Post(id uint64, m Message) error {
	var err error
	return errors.Join(s.step(func() (out Output) {
		out, err = s.req.Post(id, m, time.Now())
		return out
	}), err)
}

// step runs one transition of the requester under the lock and delivers its
// completions before the lock is released (so that they keep posting order whichever
// goroutine made them), then sends what it asked for.
func (s *Session) step(f func() Output) error {
	s.mu.Lock()
	out := f()
	for _, c := range out.Done {
		s.done <- c
	}
	s.mu.Unlock()
	out.Done = nil
	return s.handle(out)
}

// RequesterStats returns the requester's counters.
func (s *Session) RequesterStats() RequesterStats {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.req.Stats()
}

// Close stops the loops and closes the Link (the receive loop waits on it).
func (s *Session) Close() {
	close(s.stop)
	_ = s.link.Close() // ends the receive loop; a Close error leaves nothing to undo
	s.wg.Wait()
}

// handle sends what the requester asked for; an RNR wait is served by a timer.
func (s *Session) handle(out Output) error {
	var errs []error
	for i := range out.Send {
		errs = append(errs, s.link.Send(&out.Send[i], s.peer))
	}
	if out.RNRWait > 0 {
		s.wg.Add(1)
		t := time.NewTimer(out.RNRWait)
		go func() {
			defer s.wg.Done()
			select {
			case <-t.C:
				_ = s.step(func() Output { return s.req.Resend(out, time.Now()) }) // a send error shows as a timeout later
			case <-s.stop:
				t.Stop()
			}
		}()
	}
	return errors.Join(errs...)
}

func (s *Session) recvLoop() {
	defer s.wg.Done()
	buf := make([]byte, BufferSize(s.link.Limits()))
	for {
		p, from, err := s.link.Recv(buf)
		if err != nil {
			return
		}
		if from != s.peer {
			continue // not this connection's peer
		}
		if !p.Opcode.IsRequest() {
			_ = s.step(func() Output { return s.req.Receive(&p, time.Now()) })
			continue
		}
		s.mu.Lock()
		act, m, resp := s.resp.Receive(&p)
		s.mu.Unlock()
		// The payload aliases buf: the executor copies what it keeps.
		switch act {
		case ActExecute:
			s.execute(m, false)
		case ActDuplicate:
			if m != nil {
				s.execute(m, true) // a READ, read again
			} else {
				s.reply(resp)
			}
		case ActNAK:
			s.reply(resp)
		}
	}
}

// execute runs a request through the executor and answers it.
func (s *Session) execute(m *Message, duplicate bool) {
	resp, rnr, timer, nak := s.exec(m)
	s.mu.Lock()
	var answer *Message
	switch {
	case duplicate:
	case rnr:
		answer = s.resp.RNR(m, timer)
	case nak != 0:
		answer = s.resp.Fail(m, nak)
	default:
		s.resp.Executed(m, resp)
		if m.Kind != KindReadRequest && m.Kind != KindCompareSwap && m.Kind != KindFetchAdd && m.AckReq {
			answer = s.resp.Ack()
		}
	}
	s.mu.Unlock()
	if answer != nil {
		s.reply(answer)
		return
	}
	if rnr || nak != 0 || resp == nil {
		return
	}
	resp.PSN = m.PSN
	if m.Kind == KindReadRequest {
		resp.Kind, resp.Syndrome = KindReadResponse, SynACK
	} else {
		resp.Kind, resp.Syndrome = KindAtomicAck, SynACK
	}
	s.reply(resp)
}

func (s *Session) reply(m *Message) {
	ps, err := Segment(m, s.link.Limits().MTU)
	if err != nil {
		return // only an invalid MTU fails, which the Link refused at Listen
	}
	for i := range ps {
		_ = s.link.Send(&ps[i], s.peer) // a lost answer is retransmitted by the peer's timer
	}
}

func (s *Session) timerLoop(tick time.Duration) {
	defer s.wg.Done()
	t := time.NewTicker(tick)
	defer t.Stop()
	for {
		select {
		case <-s.stop:
			return
		case now := <-t.C:
			_ = s.step(func() Output { return s.req.Tick(now) })
		}
	}
}
