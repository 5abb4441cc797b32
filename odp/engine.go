package odp

// The emulated NIC's engine. Each connected QP has one goroutine, its engine, that
// owns everything the QP's NIC side does: the RC requester and responder state
// machines of transport/roce, the send queue from its processing cursor on, the
// runs the port delivered, the answers to send, and the faults in flight. Nothing
// the engine owns is locked: the application reaches it through the send queue (a
// ring it reads without a lock), the receive queue (QP.mu, once per message), the
// QP's state (an atomic copy) and a wake-up; the peer reaches it through the port.
// The requester side is in requester.go, the responder side in responder.go.
//
// A run of packets in one process travels by reference: the requester reads its
// local memory into the run by starting a DMA on the MR (tryAcquire: the table's
// DMA count, the device's DMA gate, the audit), and the DMA stays open while the
// run is on the wire, so that an invalidation of those pages waits for it and the
// audit sees it. The receiving engine copies the payload straight into its own MR
// (the one copy a DMA makes) and then releases the sender's DMA. Because such a
// run holds the fault server's gate until it is taken, an engine never waits for
// anything while runs may be waiting for it: the gate is entered with TryEnter,
// network page faults are resolved on goroutines of their own (startFault, the EQ
// and page-fault work queue of mlx5), and a responder that must wait for a fault
// (FaultStall, or a READ or atomic, which IBTA does not let it RNR NAK) first
// copies every run the peer sent it and asks the peer to copy what it sends until
// the wait is over (hold).
//
// Where a packet's time goes, between two QPs in one process (CPU profiles of
// odp-perf write_bw/read_bw --link-rate 0 --cpuprofile on a 2-core VM, with two Ps
// unless said; a side's share is that of the functions only it runs):
//   - 1 MiB WRITE (0.56-0.65 of the memcpy floor, odp-perf goals): the
//     responder's engine copies 0.85-0.92 of the time (dmaCopy, one memmove per
//     run of up to 256 KiB; timed around each copy in a build that counted it),
//     and those copies ran at 11-15 GB/s where the floor's ran at 14-21 in the
//     same rounds. The floor copies each 1 MiB message in one memmove on a core
//     nothing else uses, which takes memmove's non-temporal path (1 MiB and up);
//     a DMA stays at most 256 KiB (the fault server's waits for DMA in flight are
//     built on it), so the NIC's copy is the cached one (about 0.9 of the
//     non-temporal one on these VMs, timed alone), and it moves between cores
//     with the engine (a copy loop handed its runs by another goroutine ran at
//     0.86-0.91 of the same loop alone). Neither a non-temporal copy of the
//     runs nor an ACK sent in the middle of a long receive pass changed the
//     WRITE beyond the noise. With the link model at 100 Gb/s that copy is about
//     as fast as the line over the default regions (128 x 1 MiB): the WRITE
//     reaches 0.73-0.8 of the line; over 16 MiB (tx depth 16) it reached 0.93.
//   - 64 KiB WRITE (about 21 GB/s, 0.47 of a memcpy of the same slots, which stay in
//     cache): the responder's engine is busy about three quarters of the time, 0.7
//     of its CPU in the copy (dmaCopy); the requester's engine uses a few percent.
//   - 64 B WRITE (2.4-3.0 Mpps): per WRITE, the engines use about 290 ns of CPU (the
//     requester's some 170: taking the work request, building and handing over its
//     run, the ACK and the completion; the responder's some 90: the RC state
//     machine, the page check under the pass's hold, the copy), the application
//     (PostSend, polling) about 50 and the scheduler about 30. What made it
//     cheaper: DMA holds per transmit round, receive pass and respond round instead
//     of a gate entry and a DMA count per run, references on them counted per
//     round, the send queue's cache lines split between posters and the engine,
//     headers written in place. Spinning instead of sleeping while idle is slower:
//     the cores are shared with the application.
//   - READ: a READ is two packets (request, response) where a WRITE is one and a
//     coalesced ACK, its copy runs on the requester's engine, and at most
//     max_rd_atomic (16 at most, QPAttr.MaxRdAtomic) are outstanding: at 4 KiB it reaches about two thirds of
//     WRITE's message rate, at 64 B a little over half. An execution trace of
//     100,000 READs of 64 B (odp-perf read_bw --trace) shows why it is not more:
//     the two engines and the application together run as long as the run lasts,
//     one core's worth on two cores. Per READ the requester's engine runs about
//     340 ns, the responder's 220, the application 90 (per WRITE: 180, 120, 90,
//     also one core's worth). An engine wakes its peer with a channel send, and
//     Go's scheduler runs the woken goroutine on the sender's P (runnext) once the
//     sender parks rather than on the idle P, so the engines take turns, and 16
//     READs take a round trip through both engines, about 10-13 us where the
//     link's is 4. The turns are full: in a 64 B read_bw of 400,000 READs, 95%
//     of the engines' receive passes took 16 runs (16 requests, or 16
//     responses), so what bounds READ is the chain itself: the requester may not
//     send a 17th READ before the first one's response is placed (the
//     application keeps up to the tx depth posted, so it is off the chain), each
//     READ's work on both engines lies on it, and so do two wake-ups per turn,
//     each about 0.5 us in the waker (the channel send, a futex) and as much in
//     the scheduler of the woken. With two Ps, 128 outstanding ran 64 B READs at
//     1.9-2.2 Mpps against 1.1-1.4 with 16 (four alternating pairs). 128 is rxe's
//     most (Config.RdAtomic, the rxe profile; mlx5's 16 is the default). With one
//     P, 64 B READs with 16, 32, 64 and 128 outstanding ran at 2.0, 2.3-2.4, 2.7
//     and 2.6-2.7 Mpps (two runs of 3 rounds each): about 340 ns per READ and 2.5
//     us per turn, which 16 READs share. So READ / WRITE at 64 B stays near 0.6
//     with 16 outstanding, and with 128 it is 0.76-0.79 (odp-perf goals reports
//     both, medians of two runs); at 0.8 with 16, a turn could cost no more than
//     the two goroutine hand-offs in it. Yielding instead of parking while READs
//     are outstanding made 64 B READs 28% slower (the yielding engine takes the P
//     its peer needs). Taking turns is the cheaper way on a 2-core VM: with one
//     P, 64 B READs run at 2.1 Mpps against 1.75 with two (WRITEs 3.5 against
//     3.0), since a goroutine that moves to the other core takes the cache lines
//     it works on along. An
//     idle P steals a woken goroutine from its waker's runnext only after
//     sleeping 3 us, which Linux's timer slack (50 us) stretches: a trace shows
//     Ps held for 70-170 us with no goroutine. With a slack of 1 ns
//     (PR_SET_TIMERSLACK before exec) goroutines move sooner and everything is
//     slower (READ 1.45 against 1.73 Mpps, WRITE 2.66 against 3.07); an engine
//     that spins on its wake-up flag before parking, rather than yield, is
//     slower still (READ 1.40 spinning 2 us, 0.48 spinning 20 us).
//   - SEND: a WRITE's work and a receive, which the responder takes from the
//     receive ring with a compare-and-swap (no lock: see recvQueue) and completes
//     into the receive CQ with the pass's other receives, under one lock; the
//     application's poll of an empty CQ takes none. It reaches 0.92-0.96 of
//     WRITE's message rate at 64 B and 0.70-0.87 at 4 KiB, by run; a quarter of a
//     SEND's samples were in QP.mu and the CQ's lock before.
//   - Parking: an engine with nothing to do blocks on its kick channel alone. The
//     ACK timer, whose deadline moves with every ACK, wakes it through a callback
//     timer (armTimer) that is reset only when it is not armed as early already;
//     a Go timer in park's select had the runtime add it to and take it off the
//     timer heap, under the timers' lock, at every park: park was 11% of a 64 B
//     READ's samples at one P, 5% after.
//   - One P or two: the engines and the application take turns, so what they do
//     is one chain, and on a 2-CPU VM it ran faster on one P than on two at every
//     size up to 64 KiB, and at 1 MiB faster or as fast (odp-perf's runs in one
//     process take one, --procs). With two, a
//     goroutine that another wakes goes to the waker's P, and the runtime wakes the
//     idle P's thread (a futex) to look for work that it may not steal for
//     microseconds; it sleeps again. A sixth of a 64 B READ's samples at two Ps
//     were those wake-ups (runtime.wakep, futex), against a few percent of a
//     WRITE's; what does move takes its cache lines to the other core. odp-perf
//     goals with one P and with two, one after the other, two pairs (medians of
//     5 rounds): 64 B WRITEs 3.39 and 3.45 Mpps against 2.27 and 2.90; 4 KiB
//     10.5 GiB/s against 7.8 and 8.7; 64 KiB WRITE / memcpy 0.66-0.68 against
//     0.52-0.55; READ / WRITE 0.58-0.60 at 64 B, 0.67-0.70 at 4 KiB, 0.91-0.92
//     at 64 KiB (0.55-0.57, 0.54-0.60, 0.77-0.80); SEND / WRITE at 4 KiB
//     0.83-0.88 (0.66-0.77); the 1 MiB WRITE over the 100 Gb/s link 0.97 of the
//     line (0.86). That last is the receiver: in a build that timed the link's
//     idle spells, runs of 3,000 1 MiB WRITEs at two Ps left the line idle for
//     87-148 ms of their 340-410, and in the two that told the causes apart all
//     but 3-5 ms of it with the sender held back by the receiver's buffer, full
//     because the responder's copies (11-15 GB/s, above) had fallen behind the
//     line's 12.5 for a while.
//     READ / WRITE stays under 0.8 at 64 B and 4 KiB with one P as well: each
//     READ's work on both engines lies on its chain (above), 480 ns of CPU per
//     64 B READ against 290 per WRITE at one P. One P costs what a core does: a
//     Go program with several QP pairs, or whose goroutines fault on ODP memory
//     (a goroutine in a CPU fault holds its P until the fault is resolved), gives
//     the runtime more.

import (
	"errors"
	"runtime"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"

	"github.com/odpemu/odpemu/internal/clock"
	"github.com/odpemu/odpemu/transport/roce"
)

// maxOut bounds the runs an engine builds ahead of what the port takes.
const maxOut = 64

// engine is a connected QP's NIC side; see the file's comment.
type engine struct {
	qp     *QP
	dev    *nic
	port   roce.Port
	req    *roce.Requester
	resp   *roce.Responder
	mtu    int
	maxRun int
	remote uint32 // the peer QP's number
	window int    // PSNs the requester may have in flight
	// rdAtomic is how many READs and atomics the requester has outstanding at most
	// (QPAttr.MaxRdAtomic as its depth).
	rdAtomic int
	uc       bool // a UC QP's engine: nothing is acknowledged (QPTypeUC)

	kick     chan struct{}
	sleeping atomic.Bool
	woken    atomic.Bool
	quit     chan struct{}
	stopOnce sync.Once
	exited   chan struct{}
	// timer wakes the engine at timerAt for a deadline that may be late (the ACK
	// timer): armed only when none is armed for as early, so that a pass that
	// leaves the deadline where it was costs the timer nothing; one armed too early
	// wakes the engine, which arms it again.
	timer   *time.Timer
	timerAt time.Time
	alarm   time.Time // a precise wake-up is armed for then
	attrGen uint64    // the QP's ModifyAttr count the requester's settings reflect

	now time.Time

	// Runs the port gave and the engine has not taken yet, oldest first.
	inbox    []roce.Segment
	inHead   int
	rx       []roce.Segment // Recv's scratch
	covering int            // runs in the inbox whose DMA holds this device's gate
	nextDue  time.Time      // when the next run on its way arrives
	retryAt  time.Time      // the gate was busy: try again then
	bulkAt   time.Time      // when the port last gave a run of an MTU or more
	lost     bool           // the port failed
	errored  bool           // the QP is in ERR and the engine flushed it

	// The requester waits for room on the link since roomSince; it opens by
	// itself at roomAt (zero: when the peer takes runs).
	roomWait  bool
	roomSince time.Time
	roomAt    time.Time

	out  []roce.Segment // runs to send, oldest first
	back []roce.Segment // the runs the port took back (takeBack's scratch)
	tx   roce.Transmit  // the run transmit builds

	// The requester side (requester.go).
	sqNext   uint64 // the next send queue slot to process
	fenced   int    // READs and atomics processed, not completed: fences wait for them
	srcFault *faultJob
	srcID    uint64    // the message srcFault holds up
	dstFault *faultJob // a response could not be placed: asked again after it
	dstID    uint64
	dstPSN   uint32
	rnrUntil time.Time
	rnrSince time.Time
	holds    []*dmaHold // the DMAs of this transmit round, one per MR read
	placing  []*dmaHold // the DMAs of this receive pass, one per MR written
	reading  []*dmaHold // the DMAs of this respond round, one per MR READ responses read
	// drops are the references on the peer's holds of the runs this pass released:
	// put together when the pass ends (letGo), one atomic add per hold.
	drops []heldRuns
	last  roce.RequesterStats // the requester's counters when last added up

	// The responder side (responder.go).
	jobs      []job // answers to send, jobs[jobHead] the oldest
	jobHead   int
	freeReads readJobs
	ackOwed   bool
	rnrFault  *faultJob // the fault behind the last RNR NAK: NAKed again while it runs
	// givingBack: the responder answered a request of this receive pass with a NAK
	// that sends the requester back; the runs behind it in the inbox may go back
	// (giveBack).
	givingBack bool
	stall      *faultJob // the responder waits for it before it takes another request
	// faultErr is why the responder's last fault failed (its pages are unmapped,
	// its MR deregistered): the request it was for is refused when it comes again.
	faultErr error
	holding  bool // the peer copies what it sends while the responder stalls
	// unread counts the READ response runs this responder sent by reference and
	// the requester has not copied yet: they read this device's memory then, so
	// the responder changes no memory until they are read (a later WRITE must not
	// show in an earlier READ's data).
	// With the audit, each run counts; without it, each hold (dmaHold.owner) that
	// READ responses were read under. memWait: the responder waits for unread to
	// reach zero, and the reader that ends the last wakes it (readEnded).
	unread  atomic.Int32
	memWait atomic.Bool
	msgMR   *MR // the WRITE in progress: its MR and the offset of its VA
	msgOff  uint64
	recv    *RecvWR // the receive the SEND in progress fills (&recvWR), or nil
	recvWR  RecvWR  // the receive looked at last (peekRecv), its SGL in recvSGL
	recvSGL [4]SGE
	// recvSeq is the number of recv on UC, which takes it when the message ends
	// (a message lost before leaves it for the next).
	recvSeq uint64
	recvWCs []WC // the receive completions of this pass (recvDone, pushRecvs)
}

// heldRuns counts runs read under one hold.
type heldRuns struct {
	h *dmaHold
	n int32
}

// faultJob is a network page fault resolved on a goroutine of its own.
type faultJob struct {
	done atomic.Bool
	err  error // set before done
}

func (f *faultJob) finished() bool { return f != nil && f.done.Load() }

// startLocked starts the QP's engine once. Called with QP.mu held.
func (qp *QP) startLocked() {
	if qp.eng != nil {
		return
	}
	lim := qp.port.Limits()
	lim.UC = qp.cfg.Type == QPTypeUC
	rc := roce.RequesterConfig{MTU: lim.MTU, FirstPSN: qp.psn, Timeout: ackTimeout(qp.attr.Timeout),
		RetryCnt: int(qp.attr.RetryCnt), RNRRetry: int(qp.attr.RNRRetry), UC: lim.UC}
	e := &engine{qp: qp, dev: qp.dev, port: qp.port, req: roce.NewRequester(rc), uc: lim.UC,
		resp:     roce.NewResponder(qp.remote.PSN, lim, rdAtomicDepth(qp.attr.MaxDestRdAtomic)),
		rdAtomic: rdAtomicDepth(qp.attr.MaxRdAtomic), mtu: lim.MTU, maxRun: max(qp.port.MaxRun(), 1),
		remote: qp.remote.QPN, window: 1024, kick: make(chan struct{}, 1), quit: make(chan struct{}),
		exited: make(chan struct{}), rx: make([]roce.Segment, 64)}
	e.recvWR.SGL = e.recvSGL[:0]
	e.sqNext = qp.sq.head.Load() // a QP reset and connected again numbers on
	qp.eng = e
	qp.engA.Store(e)
	qp.port.SetWake(e.wake)
	go e.run()
}

// refresh takes what ModifyAttr and SetSendPSN changed into the requester: its retry
// settings, its READs and atomics outstanding (max_rd_atomic), and the first PSN
// while nothing was posted (SetSendPSN allows no later).
func (e *engine) refresh() {
	if g := e.qp.attrGen.Load(); g != e.attrGen {
		e.attrGen = g
		a := e.qp.Attr()
		e.req.SetRetry(ackTimeout(a.Timeout), int(a.RetryCnt), int(a.RNRRetry))
		e.rdAtomic = rdAtomicDepth(a.MaxRdAtomic)
		e.req.SetFirstPSN(e.qp.PSN())
	}
}

// ackTimeout decodes the local ACK timeout, 4.096 us * 2^t (0: none).
func ackTimeout(t uint8) time.Duration {
	if t == 0 {
		return 0
	}
	return time.Duration(4096<<t) * time.Nanosecond
}

// wake tells the engine that something changed: work was posted, runs arrived, a
// fault ended, the state changed. Any goroutine may call it; it never blocks.
//
// A wake that finds woken set stores nothing: the engine clears woken only at the
// top of its loop, before it looks at what changed, so a wake seen set was set
// after that clear and the engine looks again before it sleeps. Under load the
// engine is woken many times per loop, and each store would take its cache line.
func (e *engine) wake() {
	if e.woken.Load() {
		return
	}
	e.woken.Store(true)
	if e.sleeping.Load() {
		select {
		case e.kick <- struct{}{}:
		default:
		}
	}
}

// stop ends the engine and releases every run it held. Destroy and reset may both
// call it; the second call waits for the same end.
func (e *engine) stop() {
	e.stopOnce.Do(func() { close(e.quit) })
	e.wake()
	<-e.exited
}

func (e *engine) run() {
	defer close(e.exited)
	// DMA copies run here: a copy that faults on memory the application unmapped
	// is an access error, not a crash (dmaRun).
	debug.SetPanicOnFault(true)
	for {
		// woken is cleared before quit is looked at: stop closes quit and then
		// wakes, so either this look sees quit closed or park finds woken set.
		if e.woken.Load() {
			e.woken.Store(false)
		}
		select {
		case <-e.quit:
			e.teardown()
			return
		default:
		}
		e.now = time.Now()
		e.refresh()
		e.faults()
		if QPState(e.qp.st.Load()) == StateError && !e.errored {
			e.toError()
		}
		busy := e.receive()
		busy = e.timers() || busy
		busy = e.respond() || busy
		busy = e.post() || busy
		busy = e.transmit() || busy
		busy = e.flush() || busy
		e.count()
		e.retire()
		e.letGo() // what respond, transmit and flush released: nothing is held asleep
		if !busy {
			e.park()
		}
	}
}

// armAlarm has wake called at deadline, precisely (internal/clock), unless quit
// closes first. One sleeper at a time per engine, whose deadline *alarm keeps: a new
// one only when none sleeps until before this deadline (the last one may have fired
// while the engine ran). Called by the engine's goroutine, which owns *alarm.
func armAlarm(alarm *time.Time, deadline time.Time, quit <-chan struct{}, wake func()) {
	if armedFor(*alarm, deadline, time.Now()) {
		return
	}
	*alarm = deadline
	go func() {
		if clock.SleepUntil(deadline, quit) {
			wake()
		}
	}()
}

// spinFor is the longest wait an engine yields through instead of sleeping: waking
// a sleeping goroutine takes tens of microseconds on a busy machine.
const spinFor = 100 * time.Microsecond

// bulkSpin is how long after a bulk run (a full MTU's payload, or a READ request
// for one) arrived an engine yields for the next instead of sleeping. Small
// messages never make an engine spin: their cost is the work per message, and a
// spinning engine would take the application's CPU.
const bulkSpin = 50 * time.Microsecond

// park waits until something changes or the next deadline: runs on their way, the
// RNR timer, a busy gate, the ACK timer.
func (e *engine) park() {
	deadline, precise := e.nextDue, !e.nextDue.IsZero()
	soonest := func(t time.Time, p bool) {
		if !t.IsZero() && (deadline.IsZero() || t.Before(deadline)) {
			deadline, precise = t, p
		}
	}
	if e.req.Paused() {
		soonest(e.rnrUntil, true)
	}
	soonest(e.retryAt, true)
	soonest(e.req.Deadline(), false)
	e.sleeping.Store(true)
	defer e.sleeping.Store(false)
	if e.woken.Load() {
		return
	}
	if e.roomWait {
		// The link sends what it queued by roomAt; else the peer takes runs
		// off it within microseconds, as they arrive, and wakes the engine:
		// yield for a while as for a precise deadline, then sleep.
		if !e.roomAt.IsZero() {
			soonest(e.roomAt, true)
		} else if t := e.roomSince.Add(spinFor); t.After(e.now) {
			soonest(t, true)
		}
	}
	if t := e.bulkAt.Add(bulkSpin); t.After(e.now) {
		// A bulk transfer is on: its next run comes within microseconds, and
		// a sleeping engine would take ten to wake. Yield meanwhile.
		soonest(t, true)
	}
	if deadline.IsZero() {
		<-e.kick // stop closes quit and then wakes
		return
	}
	d := deadline.Sub(e.now)
	if d > 0 && d < spinFor {
		d = time.Until(deadline)
	}
	switch {
	case d <= 0:
	case d < spinFor:
		// Runs on the wire and short timers: yield until then.
		for time.Now().Before(deadline) && !e.woken.Load() {
			runtime.Gosched()
		}
	case precise:
		// Go's timers wake a millisecond late here: clock sleeps precisely.
		armAlarm(&e.alarm, deadline, e.quit, e.wake)
		<-e.kick
	default:
		e.armTimer(deadline)
		<-e.kick
	}
}

// armedFor reports whether a wake-up armed for at, which has not come by now, comes
// no later than deadline: armAlarm and armTimer arm nothing new then. A zero at is
// never armed.
func armedFor(at, deadline, now time.Time) bool {
	return at.After(now) && !deadline.Before(at)
}

// armTimer has the engine woken at deadline or earlier, by a timer that calls wake:
// it is reset only when it is not armed for deadline or earlier yet. Called by the
// engine's goroutine, which owns timer and timerAt.
func (e *engine) armTimer(deadline time.Time) {
	if armedFor(e.timerAt, deadline, e.now) {
		return // the engine arms it again when it fires
	}
	e.timerAt = deadline
	d := deadline.Sub(e.now)
	if e.timer == nil {
		e.timer = time.AfterFunc(d, e.wake)
	} else {
		e.timer.Reset(d)
	}
}

// receive takes what the port delivered and handles it in order: the requester's
// answers (ACKs, NAKs, READ responses, atomic results) and the peer's requests. A
// request the responder cannot take yet stays at the head.
func (e *engine) receive() bool {
	defer e.letGo()
	defer e.pushRecvs() // before the pass's ACK goes out
	busy := false
	if !e.lost {
		n, next, err := e.port.Recv(e.rx, e.now)
		e.nextDue = next
		for i := 0; i < n; i++ {
			if e.covers(&e.rx[i]) {
				e.covering++
			}
			if r := &e.rx[i]; len(r.Payload) >= e.mtu || (r.Opcode == roce.ReadRequest && int(r.DMALen) >= e.mtu) {
				e.bulkAt = e.now // a bulk transfer: its data, or a READ that asks for a run of it
			}
			e.inbox = append(e.inbox, e.rx[i])
			e.rx[i] = roce.Segment{}
		}
		busy = n > 0
		if err != nil && e.inHead == len(e.inbox) {
			e.connectionLost(err)
		}
	}
	if e.holding {
		e.detach()
	}
	responded := false // a response was taken since the send queue last retired
	for e.inHead < len(e.inbox) {
		s := &e.inbox[e.inHead]
		// Completions in the order of the runs that caused them, across the QP's two
		// CQs, as a NIC writes them: the receives before a response, the requests the
		// response completed before a request after it (the peer ACKed our SEND
		// before its application could answer it).
		if !e.errored {
			if !s.Opcode.IsRequest() {
				e.pushRecvs()
				responded = true
			} else if responded {
				e.retire()
				responded = false
			}
		}
		switch {
		case e.errored:
			e.release(s)
			e.rc(func(c *rcCounters) *atomic.Uint64 { return &c.dropped })
		case e.givingBack && s.Opcode.IsRequest() && e.giveBack(s):
			// The port has it now, and the requester takes it back.
		case s.Opcode.IsRequest():
			if !e.takeRequest(s) {
				e.compact()
				return busy
			}
		default:
			e.response(s)
		}
		*s = roce.Segment{}
		e.inHead++
		busy = true
	}
	e.givingBack = false // what arrives from now on, the port gives back (Port.NAKed)
	e.compact()
	if e.ackOwed {
		e.answer(e.resp.Ack())
		e.ackOwed = false
	}
	return busy
}

// compact drops the inbox's taken runs.
func (e *engine) compact() {
	if e.inHead == len(e.inbox) {
		e.inbox, e.inHead = e.inbox[:0], 0
	} else if e.inHead > len(e.inbox)/2 {
		n := copy(e.inbox, e.inbox[e.inHead:])
		clear(e.inbox[n:])
		e.inbox, e.inHead = e.inbox[:n], 0
	}
}

// covers reports whether a run's Ref is a DMA of this device's address space,
// which holds its DMA gate until the run is released: a DMA the engine starts
// while it holds such a run needs no gate entry of its own (tryAcquire's covered).
func (e *engine) covers(s *roce.Segment) bool {
	switch r := s.Ref.(type) {
	case *dmaHold:
		return r.gated && r.mr.dev.as == e.dev.as
	case *srcRef:
		return r.r.gated && r.r.mr.dev.as == e.dev.as
	}
	return false
}

// release releases a run's Ref and reports whether the copy taken under it may be
// torn (a page of the sender's memory was installed anew during it): then the run
// counts as lost.
func (e *engine) release(s *roce.Segment) (torn bool) {
	if s.Ref == nil {
		return false
	}
	if e.covers(s) {
		e.covering--
	}
	switch r := s.Ref.(type) {
	case *dmaHold:
		torn = r.torn(s.Payload)
		if n := len(e.drops); n > 0 && e.drops[n-1].h == r {
			e.drops[n-1].n++
		} else {
			e.drops = append(e.drops, heldRuns{h: r, n: 1})
		}
	case *srcRef:
		torn = r.finish()
	default:
		s.Ref.Release()
	}
	s.Ref = nil
	return torn
}

// letGo ends the DMAs of the receive pass: the holds it placed runs under, then the
// references of the runs it released (the holds may rely on those runs' gate entry).
func (e *engine) letGo() {
	closeHolds(&e.placing)
	for i, d := range e.drops {
		d.h.put(d.n)
		e.drops[i] = heldRuns{}
	}
	e.drops = e.drops[:0]
}

// detach copies every run in the inbox that reads the peer's memory by reference
// and releases those DMAs: the responder waits, and must not hold them meanwhile.
func (e *engine) detach() {
	e.letGo()
	for i := e.inHead; i < len(e.inbox); i++ {
		s := &e.inbox[i]
		switch s.Ref.(type) {
		case *srcRef, *dmaHold:
			if e.covers(s) {
				e.covering--
			}
			roce.Detach(s)
		}
	}
}

// hold makes the responder wait for f: the peer copies what it sends meanwhile,
// and what it sent is copied now.
func (e *engine) hold(f *faultJob) {
	e.stall = f
	if !e.holding {
		e.holding = true
		e.port.Hold(true)
	}
	e.detach()
}

// flush sends what is built, as far as the port takes it.
func (e *engine) flush() bool {
	if len(e.out) == 0 {
		return false
	}
	n, err := e.port.Send(e.out, e.now)
	if err != nil {
		clear(e.out)
		e.out = e.out[:0]
		e.connectionLost(err)
		return true
	}
	k := copy(e.out, e.out[n:])
	clear(e.out[k:])
	e.out = e.out[:k]
	return n > 0
}

// faults takes the outcome of the faults that ended.
func (e *engine) faults() {
	if e.stall.finished() {
		e.faultErr = e.stall.err
		e.stall = nil
		if e.holding {
			e.holding = false
			e.port.Hold(false)
		}
	}
	if e.rnrFault.finished() {
		e.faultErr = e.rnrFault.err
		e.rnrFault = nil // the retransmission finds the pages, or is refused
	}
	if f := e.srcFault; f.finished() {
		e.srcFault = nil
		if f.err != nil {
			e.fail(e.srcID, "network page fault: "+f.err.Error())
		}
	}
	if f := e.dstFault; f.finished() {
		e.dstFault = nil
		if f.err != nil {
			e.fail(e.dstID, "network page fault: "+f.err.Error())
		} else {
			e.req.RetransmitFrom(e.dstPSN)
		}
	}
}

// startFault resolves pages [first, end) of mr on a goroutine of its own (widened to
// the fault-around and held for the fault model, as networkFault does) and wakes the
// engine when it is done.
func (e *engine) startFault(mr *MR, first, end int, write bool) *faultJob {
	f := &faultJob{}
	e.dev.faulting.Add(1)
	go func() {
		defer e.dev.faulting.Done()
		_, err := mr.networkFault(first, end, write)
		f.err = err
		f.done.Store(true)
		e.wake()
	}()
	return f
}

// errPortClosed is the loss a closed port reports.
var errPortClosed = errors.New("odp: the connection's port closed")

// connectionLost fails everything outstanding when the wire is gone: the transport's
// retries would run out (RETRY_EXC_ERR).
func (e *engine) connectionLost(err error) {
	if e.lost {
		return
	}
	e.lost = true
	if errors.Is(err, roce.ErrClosed) {
		err = errPortClosed
	}
	e.complete(e.req.Flush(roce.StatusRetryExceeded), "connection lost: "+err.Error())
	e.qp.toError()
}

// toError flushes what the engine holds once the QP is in ERR: outstanding and later
// work requests complete with WR_FLUSH_ERR, the receive a SEND was filling too, and
// the responder answers nothing more but what it already had to say.
func (e *engine) toError() {
	e.errored = true
	if !e.req.Failed() {
		e.complete(e.req.Flush(roce.StatusFlushed), "")
	}
	e.pushRecvs()
	if e.recv != nil {
		e.qp.cfg.RecvCQ.push(WC{WRID: e.recv.WRID, Status: WCWRFlushErr, Opcode: WCRecv, QPNum: e.qp.qpn})
		e.recv = nil
	}
	// The runs in the inbox are dropped as receive reaches them.
	kept := e.jobs[:0]
	for _, j := range e.jobs[e.jobHead:] {
		if j.read == nil { // an ACK or NAK already decided: the NAK that ended the QP, say
			kept = append(kept, j)
		}
	}
	clear(e.jobs[len(kept):])
	e.jobs, e.jobHead = kept, 0
	if e.holding {
		e.holding = false
		e.port.Hold(false)
	}
}

// teardown releases everything the engine holds; the QP is being destroyed.
func (e *engine) teardown() {
	for i := e.inHead; i < len(e.inbox); i++ {
		e.release(&e.inbox[i])
	}
	for i := range e.out {
		e.release(&e.out[i])
	}
	e.letGo()
	e.inbox, e.out, e.jobs, e.jobHead = nil, nil, nil, 0
	if e.timer != nil {
		e.timer.Stop()
	}
}

// timers runs the RNR timer, the ACK timer and the wait for a busy gate; it reports
// whether one of them expired.
func (e *engine) timers() bool {
	busy := false
	if e.req.Paused() && !e.rnrUntil.IsZero() && !e.now.Before(e.rnrUntil) {
		e.req.Resume(e.now)
		e.rcAdd(func(c *rcCounters) *atomic.Uint64 { return &c.rnrWaitNanos }, uint64(e.now.Sub(e.rnrSince)))
		e.rnrUntil = time.Time{}
		busy = true
	}
	if dl := e.req.Deadline(); !dl.IsZero() && !e.now.Before(dl) {
		e.complete(e.req.Tick(e.now), "")
		busy = true
	}
	if !e.retryAt.IsZero() && !e.now.Before(e.retryAt) {
		e.retryAt = time.Time{}
		busy = true
	}
	return busy
}

// gateBusy notes that the DMA gate was closed: the engine tries again shortly. An
// invalidation closed it and waits for the DMAs in flight to end, among them those
// of the runs in the inbox that read this device's address space by reference: they
// are copied and released now, or the engine would wait for the gate while the gate
// waits for it (a READ response blocked on the gate keeps the WRITE behind it, and
// the runs after, in the inbox).
func (e *engine) gateBusy() {
	e.retryAt = e.now.Add(5 * time.Microsecond)
	if e.covering > 0 {
		e.detach()
	}
}

// rc counts one event in the QP's and the device's RC counters.
func (e *engine) rc(field func(*rcCounters) *atomic.Uint64) { e.rcAdd(field, 1) }

// rcAdd adds n to a counter; n may be a negative difference of two uint64s, which
// adds modulo 2^64 as well.
func (e *engine) rcAdd(field func(*rcCounters) *atomic.Uint64, n uint64) {
	if n != 0 {
		field(&e.qp.rc).Add(n)
		field(&e.dev.rc).Add(n)
	}
}

// count adds the requester's counters since the last call to the RC counters.
func (e *engine) count() {
	st := e.req.Stats()
	if st == e.last {
		return
	}
	// Retransmissions taken back before they left are uncounted (Requester.Unsent).
	e.rcAdd(func(c *rcCounters) *atomic.Uint64 { return &c.retransmitted }, st.Retransmitted-e.last.Retransmitted)
	e.rcAdd(func(c *rcCounters) *atomic.Uint64 { return &c.takenBack }, st.Unsent-e.last.Unsent)
	e.rcAdd(func(c *rcCounters) *atomic.Uint64 { return &c.timeouts }, st.Timeouts-e.last.Timeouts)
	e.rcAdd(func(c *rcCounters) *atomic.Uint64 { return &c.seqNAKsReceived }, st.SeqNAKs-e.last.SeqNAKs)
	e.rcAdd(func(c *rcCounters) *atomic.Uint64 { return &c.rnrNAKsReceived }, st.RNRNAKs-e.last.RNRNAKs)
	if st.MaxGoBack > e.last.MaxGoBack {
		for _, c := range []*rcCounters{&e.qp.rc, &e.dev.rc} {
			for m := c.maxGoBack.Load(); st.MaxGoBack > m && !c.maxGoBack.CompareAndSwap(m, st.MaxGoBack); m = c.maxGoBack.Load() {
			}
		}
	}
	e.last = st
}
