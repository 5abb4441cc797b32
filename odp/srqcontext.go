package odp

// A shared receive queue as the NIC holds it: its receives, armed limit and QPs.
// PD.CreateSRQ (pd.go) makes one.

import "sync"

// SRQConfig configures a shared receive queue.
type SRQConfig struct {
	MaxWR  int // receives the SRQ holds at most; default 128, at most MaxQPWR
	MaxSGE int // SGEs per receive; default 16, at most MaxSGE
	// Limit arms the limit event at creation (ibv_srq_attr.srq_limit); 0 leaves it
	// disarmed. See SRQ.Arm.
	Limit int
	// OnLimit is called once each time the armed limit is reached, as the
	// IBV_EVENT_SRQ_LIMIT_REACHED asynchronous event is raised. It runs on the
	// NIC's goroutine that took the receive, holding no lock: it must not block.
	OnLimit func()
}

// SRQAttr is what an SRQ reports (ibv_query_srq).
type SRQAttr struct {
	MaxWR, MaxSGE int
	Limit         int // the armed limit, 0 when disarmed
}

// SRQ is a shared receive queue (ibv_srq): receives posted to it are taken by
// whichever of its QPs receives a message first. A QP takes a receive from the SRQ
// when a SEND's first packet (or a WRITE with immediate's last) arrives, and holds it
// until the message is placed: a network page fault that makes the responder answer
// RNR NAK keeps the receive for the retransmission, as the NIC keeps the WQE it
// fetched. A QP that goes to ERR completes the receive it holds with WR_FLUSH_ERR on
// its receive CQ; the SRQ's other receives stay for its other QPs. A QP reset or
// destroyed gives its receive back to the SRQ.
//
// The receives' SGEs are checked against the SRQ's PD. Lock order: SRQ.mu comes
// after QP.mu and before CQ.mu (the package's list).
type SRQ struct {
	pd      *domain
	dev     *nic
	maxSGE  int
	onLimit func()

	mu        sync.Mutex // protects everything below
	rq        recvQueue
	limit     int // armed limit (0: disarmed)
	qps       int // QPs attached
	destroyed bool
}

// PostRecv queues a receive for any of the SRQ's QPs. As QP.PostRecv, it wakes no
// engine: none waits for a receive.
func (s *SRQ) PostRecv(wr RecvWR) error {
	if len(wr.SGL) > s.maxSGE {
		return wrap(ErrInvalidArgument, "%d SGEs > max %d", len(wr.SGL), s.maxSGE)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.destroyed {
		return ErrClosed
	}
	if !s.rq.postLocked(&wr) {
		return wrap(ErrQueueFull, "%d receive WRs outstanding", s.rq.len())
	}
	return nil
}

// Arm arms the limit event: once fewer than limit receives remain, OnLimit is
// called and the event disarms (ibv_modify_srq with IBV_SRQ_LIMIT). A limit of 0
// disarms it; one above the SRQ's size is refused. If fewer than limit receives
// are posted already, the event comes with the next receive taken.
func (s *SRQ) Arm(limit int) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.destroyed {
		return ErrClosed
	}
	if limit < 0 || limit > len(s.rq.slots) {
		return wrap(ErrInvalidArgument, "SRQ limit %d of %d receives", limit, len(s.rq.slots))
	}
	s.limit = limit
	return nil
}

// Attr returns the SRQ's size and armed limit.
func (s *SRQ) Attr() SRQAttr {
	s.mu.Lock()
	defer s.mu.Unlock()
	return SRQAttr{MaxWR: len(s.rq.slots), MaxSGE: s.maxSGE, Limit: s.limit}
}

// Len returns how many receives are posted and not taken.
func (s *SRQ) Len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.rq.len()
}

// Destroy destroys the SRQ; it fails with ErrBusy while QPs use it. Receives still
// posted are dropped without completions, as ibv_destroy_srq drops them.
func (s *SRQ) Destroy() error {
	d := s.dev
	d.mu.Lock()
	defer d.mu.Unlock()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.destroyed {
		return ErrClosed
	}
	if s.qps > 0 {
		return wrap(ErrBusy, "SRQ has %d QPs", s.qps)
	}
	s.destroyed = true
	s.rq.flushLocked(func(uint64) {})
	s.pd.srqs--
	return nil
}

// attachLocked counts one more QP of the SRQ's, unless the SRQ was destroyed.
// Called with Device.mu held (SRQ.Destroy checks the count under it).
func (s *SRQ) attachLocked() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.destroyed {
		return wrap(ErrInvalidArgument, "destroyed SRQ")
	}
	s.qps++
	return nil
}

// detach counts one QP of the SRQ's less.
func (s *SRQ) detach() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.qps--
}

// takeLocked moves the oldest receive into dst and reports whether there was one;
// limit reports that it brought the SRQ below its armed limit, which it disarmed.
// Called with SRQ.mu held.
func (s *SRQ) takeLocked(dst *RecvWR) (ok, limit bool) {
	seq, ok := s.rq.peek(dst)
	if !ok || !s.rq.take(seq) { // SRQ.mu orders every taker and the flush
		return false, false
	}
	if s.limit > 0 && s.rq.len() < s.limit {
		s.limit = 0
		return true, s.onLimit != nil
	}
	return true, false
}

// giveBackLocked puts a receive a QP held back at the tail, if there is room.
// Called with SRQ.mu held.
func (s *SRQ) giveBackLocked(wr *RecvWR) bool {
	return !s.destroyed && s.rq.postLocked(wr)
}
