package roce

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/odpemu/odpemu/internal/bufpool"
)

// Port is one QP's end of the wire to its peer QP: a Pipe's end in one process, or
// a UDP endpoint's (Endpoint.Attach). The QP's engine, one goroutine, sends and
// receives runs of packets (Segments) through it; Send and Recv are each called by
// that goroutine only, and every method is safe for concurrent use with the others.
type Port interface {
	// Send puts runs on the wire, in order, and returns how many it took: fewer
	// when the link's queue is full (the wake function runs once it has room).
	// It owns the Refs of the runs it took: it releases each once the run was
	// sent, copied or dropped. An error means the port is closed.
	Send(segs []Segment, now time.Time) (int, error)
	// Recv moves up to len(segs) runs that have arrived into segs and returns how
	// many; the caller owns their Refs. With none ready, next is when the next one
	// on its way arrives (zero when none is on its way); the wake function runs when
	// one is sent. It fails with ErrClosed once the port or its peer is closed and
	// everything sent was received.
	Recv(segs []Segment, now time.Time) (n int, next time.Time, err error)
	// MaxRun is the most packets a run sent may hold: 1 where every packet travels
	// on its own (over UDP, or with loss injected), and never more than half the
	// link's queue, so that runs pipeline on the link.
	MaxRun() int
	// Room is what Send takes at now without refusing: runs, and wire bytes (-1:
	// no bound); a run larger than the queue goes onto an idle link alone. A
	// requester builds no more runs than fit, so that what it counts as sent is
	// on the link. Opens is when room for another run of MaxRun packets opens by
	// itself, as the link sends what it queued; zero when only the receiver
	// taking runs opens it (WaitRoom).
	Room(now time.Time) (runs, bytes int, opens time.Time)
	// WaitRoom has the wake function run once the receiver takes runs off the
	// link. A caller that found too little room calls it, then looks at Room
	// again: room that opened in between is seen there or wakes it.
	WaitRoom()
	// Limits are the path MTU and the largest message the peer may send.
	Limits() Limits
	// SetWake sets the function the port calls, from any goroutine, when runs
	// arrive or room opens on the link. It must not block.
	SetWake(func())
	// Hold, while on, has the peer copy what it sends instead of passing it by
	// reference: this end's engine waits for something and must not hold the
	// peer's memory meanwhile (it copies what it was sent already, Detach).
	Hold(on bool)
	// TakeBack takes back the request runs this end sent that had not begun to
	// leave the link when the last NAK it took that sends its requester back (an
	// RNR NAK or a sequence error) arrived, and appends them to runs, newest first,
	// with their Refs released and no payload: they never went on the wire, and the
	// go-back sends them again (Requester.Unsent). A NIC builds its packets as the
	// wire takes them, so what a NAK finds in flight is what has left, not its
	// transmit queue. The runs the peer gave back (GiveBack) come back with them.
	// Over UDP the kernel has what was sent: nothing comes back.
	TakeBack(runs []Segment) []Segment
	// NAKed tells the port that this end's responder answers the request run s,
	// received from it, with a NAK that sends the requester back: in the link's
	// model the NAK leaves as s's first packet arrives (a responder decides on a
	// run at its first packet: it is placed whole or not at all), and reaches the
	// requester the delay after.
	// Until the requester takes it (TakeBack), the request runs it sent later than
	// that, which a NIC's requester would not have sent, may be given back.
	NAKed(s *Segment)
	// GiveBack gives the request run s, received and not taken, back to its
	// sender and reports whether it did: it left the sender after the NAK this
	// end's responder last answered with (NAKed) reached it, in the link's model,
	// and before the sender went back. The emulated responder is software that
	// takes its runs late and answers late, so the sender goes on sending while a
	// NIC's would have gone back; the runs it sent meanwhile return to it as never
	// sent (TakeBack), and the responder drops them unanswered, releasing their
	// Refs itself. False over UDP, and for a run the sender sent after it went
	// back.
	GiveBack(s *Segment) bool
	// Stats returns the port's counters.
	Stats() LinkStats
	// Close closes this end: runs not yet received are dropped (their Refs
	// released), and the peer's Recv fails once it has what was already sent.
	Close() error
}

// ErrClosed is returned by a Port whose end, or whose peer, is closed.
var ErrClosed = errors.New("roce: port closed")

// LinkModel is the link between two NICs: line rate, one-way delay and a bounded
// transmit queue, so that a requester's window fills the link and no more, as a
// NIC's does. The zero value is no model: runs arrive at once and nothing bounds
// them but the requester's window.
//
// In one process (NewPipe) the model runs in the senders' clock: a run leaves
// once the runs before it have, after its wire size at the line rate, and arrives
// the delay after; a sender may queue up to Queue bytes that have not left. The
// receiving engine is software and may take what arrived late; its Buffer bounds
// that backlog as a lossless (PFC) port's would: what was sent and not taken never
// exceeds Queue, the one-way bandwidth-delay product and Buffer together (Limit).
// The queue stands for the NIC's send pipeline, which builds packets as
// the wire takes them: when a NAK sends the requester back, the request runs that
// had not begun to leave when it arrived are taken back (Port.TakeBack), not sent
// twice. A NIC's responder answers a run as it arrives; the receiving engine may
// take it late and answer later, while its requester goes on sending, so the NAK
// counts as leaving when the first packet of the run it answers arrived
// (Port.NAKed), and the runs that left after it reached the requester in that
// clock come back too, from the receiver's side of the link (Port.GiveBack).
type LinkModel struct {
	// Rate is the line rate in bits per second (0: unlimited). Every packet takes
	// its wire size (WireBytes) of it.
	Rate float64
	// Delay is the one-way delay: a packet arrives that long after its last bit
	// left.
	Delay time.Duration
	// Queue bounds, in bytes, the sender's transmit queue: runs sent whose last
	// bit has not left. 0: DefaultQueue.
	Queue int
	// Buffer bounds, in bytes, what arrived at the receiving NIC and it has not
	// taken yet. 0: the queue's size, and at least what the line brings in 20 us
	// (250 KB at 100 Gb/s; receiverLate).
	Buffer int
	// GSO sends a QP's runs of equal-size packets over UDP as one datagram the
	// kernel segments (Link.SetGSO says what that changes on the wire); the
	// in-process wire ignores it.
	GSO bool
}

// BDP is the link's bandwidth-delay product in bytes, over its round trip (twice
// the one-way delay): what a NAK finds in flight when it reaches the sender.
func (m LinkModel) BDP() int { return int(m.Rate / 8 * 2 * m.Delay.Seconds()) }

// DefaultQueue is the queue a link of the given model has by default: one
// bandwidth-delay product plus one packet of the path MTU (with its headers); no
// bound when the rate is unlimited.
func (m LinkModel) DefaultQueue(mtu int) int {
	if m.Rate <= 0 {
		return 0
	}
	return m.BDP() + mtu + maxHeaders
}

// Describe says what the model is at a path MTU: its rate, delay, queue and
// receive buffer, as the link has them.
func (m LinkModel) Describe(mtu int) string {
	if m.GSO {
		m.GSO = false
		return m.Describe(mtu) + ", UDP segmentation offload"
	}
	if m.Rate <= 0 && m.Queue <= 0 {
		if m.Delay <= 0 {
			return "no link model (unlimited rate, no delay)"
		}
		return fmt.Sprintf("unlimited rate, %v one way, no queue bound", m.Delay)
	}
	rate := "unlimited rate"
	if m.Rate > 0 {
		rate = fmt.Sprintf("%g Gb/s", m.Rate/1e9)
	}
	return fmt.Sprintf("%s, %v one way, a %d-byte transmit queue, a %d-byte receive buffer (BDP %d bytes)", rate, m.Delay,
		m.queue(mtu), m.buffer(mtu), m.BDP())
}

func (m LinkModel) queue(mtu int) int {
	if m.Queue > 0 {
		return m.Queue
	}
	return m.DefaultQueue(mtu)
}

// buffer is the receive buffer: Buffer, or the queue's size and at least what the
// line brings in receiverLate.
func (m LinkModel) buffer(mtu int) int {
	if m.Buffer > 0 {
		return m.Buffer
	}
	return max(m.queue(mtu), int(m.Rate/8*receiverLate.Seconds()))
}

// receiverLate is how late the receiving engine may take what arrived before the
// link's limit holds the sender back, at the line rate, by default. The receiver
// is a goroutine that the schedulers hold up for microseconds now and then; a
// buffer of the queue's size alone (one bandwidth-delay product and a packet)
// stopped the sender for each such delay when the delay was small (minRun has the
// figures; a 256 KiB buffer alone took 64 KiB WRITEs with no delay from 0.20 of
// the line to 0.27-0.33, runs of 16 alone to 0.69-0.77, both to 0.83-0.94).
// What the buffer holds has arrived in the link's clock, so its size changes
// nothing of when packets arrive; a NAK's arrival time sends back the runs behind
// it that left later (GiveBack), however many the buffer holds.
const receiverLate = 20 * time.Microsecond

// Limit bounds the bytes a link holds (sent and not taken by the receiver): the
// queue, what is on the wire over the one-way delay, and the receiver's buffer.
// 0: no bound.
func (m LinkModel) Limit(mtu int) int {
	q := m.queue(mtu)
	if q == 0 {
		return 0
	}
	return q + m.BDP()/2 + m.buffer(mtu)
}

// Ethernet framing around every RoCEv2 packet on the wire: preamble and gap (20),
// MAC header (14) and FCS (4), IPv4 (20), UDP (8).
const frameOverhead = 20 + 14 + 4 + 20 + 8

// WirePacket is the size on the wire of a packet carrying n payload bytes of a
// SEND or WRITE MIDDLE: the unit a link's queue and rate are counted in.
func WirePacket(n int) int { return n + frameOverhead + BTHSize + ICRCSize }

// WriteGoodput is the payload rate, in bytes per second, that a link of the given
// line rate (bits per second) carries for RDMA WRITEs of msg bytes at the path
// MTU: each packet's framing and headers (and the first one's RETH) take their
// share.
func WriteGoodput(rate float64, msg, mtu int) float64 {
	packets := max((msg+mtu-1)/mtu, 1)
	wire := msg + packets*WirePacket(0) + RETHSize
	return rate / 8 * float64(msg) / float64(wire)
}

// WireBytes is the size of a run on the wire: every packet's headers, ICRC,
// Ethernet framing and payload.
func WireBytes(s *Segment) int { return WireSize(s, len(s.Payload)) }

// WireSize is the size on the wire of the run s with a payload of n bytes: what a
// run the requester is about to read into will take.
func WireSize(s *Segment, n int) int {
	n += s.Count*(frameOverhead+ICRCSize) + s.Opcode.HeaderSize()
	if s.Count > 1 {
		n += (s.Count-1)*BTHSize + s.Last.HeaderSize() - BTHSize
	}
	return n
}

// firstPacketBytes is the size on the wire of run s's first packet at the path MTU:
// WireSize's arithmetic for one packet.
func firstPacketBytes(s *Segment, mtu int) int {
	return min(len(s.Payload), mtu) + frameOverhead + ICRCSize + s.Opcode.HeaderSize()
}

// PipeConfig configures an in-process wire.
type PipeConfig struct {
	// AB is the link from the first end to the second, BA the other way.
	AB, BA LinkModel
	// Loss injects faults into what each end sends (the second end's generator is
	// seeded differently). Runs are then single packets, copied as they are sent.
	Loss Loss
	// Copy copies every payload as it is sent instead of passing it by reference
	// (the ends' memory is in different address spaces, whose DMA gates differ).
	Copy bool
	// MaxRun bounds the packets of one run (default 64: 256 KiB at MTU 4096, one
	// DMA).
	MaxRun int
}

// Pipe returns two connected in-process ports with no link model.
func Pipe(lim Limits, loss Loss) (Port, Port, error) {
	return NewPipe(lim, PipeConfig{Loss: loss})
}

// NewPipe returns two connected in-process ports. Runs travel by reference, headers
// as structs, with no encoding, ICRC or copy: the receiver copies the payload
// straight from the sender's memory into its own (the one copy a DMA makes), and
// releases the sender's DMA then.
func NewPipe(lim Limits, cfg PipeConfig) (Port, Port, error) {
	if !ValidMTU(lim.MTU) || lim.MaxMessage == 0 {
		return nil, nil, fmt.Errorf("roce: limits %+v: a path MTU of 256..4096 and a largest message", lim)
	}
	if cfg.MaxRun <= 0 {
		cfg.MaxRun = 64
	}
	for _, m := range []LinkModel{cfg.AB, cfg.BA} {
		if m.Rate < 0 || m.Delay < 0 || m.Queue < 0 || m.Buffer < 0 {
			return nil, nil, fmt.Errorf("roce: link model %+v", m)
		}
		if q := m.queue(lim.MTU); q > 0 { // two runs fit the queue, and pipeline, or minRun
			cfg.MaxRun = min(cfg.MaxRun, max(minRun, q/2/WirePacket(lim.MTU)))
		}
	}
	copying := cfg.Copy || cfg.Loss.active()
	if cfg.Loss.active() {
		cfg.MaxRun = 1
	}
	ab := newDirection(cfg.AB, lim.MTU, cfg.Loss, copying)
	lossB := cfg.Loss
	lossB.Seed = ^cfg.Loss.Seed
	ba := newDirection(cfg.BA, lim.MTU, lossB, copying)
	a := &pipeEnd{lim: lim, out: ab, in: ba, maxRun: cfg.MaxRun}
	b := &pipeEnd{lim: lim, out: ba, in: ab, maxRun: cfg.MaxRun}
	return a, b, nil
}

// minRun is the fewest packets the queue's size makes a pipe's runs hold: runs of
// two packets, or of one, cost the engines per run what a run of 16 costs, more
// than a link with a small bandwidth-delay product leaves them (at 100 Gb/s a
// packet of 4 KiB leaves every 0.33 us). A run larger than half the queue goes
// onto a link that is idle, or nearly (noRoom), and one larger than the queue onto
// an idle link; the sender then catches up (catchUp). A run is never more than a
// message, and TakeBack takes back every run whose first bit had not left, so an
// RNR NAK still sends back at most a bandwidth-delay product and a message.
// `odp-perf write_bw -s 64K` at 100 Gb/s, BW/line, medians [range] of three
// alternating rounds, runs of half the queue and a buffer of the queue's size
// before, runs of at least 16 and the buffer's floor (receiverLate) after: no
// delay 0.30 [0.20-0.46] before (runs of one packet), 0.90 [0.88-0.92] after; 1 us
// one way 0.81 [0.60-0.90], 0.94 [0.94-0.96]; 2 us (the default) 0.87
// [0.83-0.95], 0.93 [0.89-0.94].
const minRun = 16

// ringSize is how many runs a direction of a pipe (or a QP's UDP inbox) holds.
const ringSize = 1024

// ring is a single-producer, single-consumer queue of runs, each with the time it
// may be taken (its arrival) and the bytes it holds on the link.
type ring struct {
	slots      [ringSize]slot
	head, tail atomic.Uint64 // consumer's and producer's indices
}

type slot struct {
	seg   Segment
	due   int64 // monotonic nanoseconds
	bytes int
	// state arbitrates, on a link whose sender may take runs back (takesBack),
	// between the receiver taking the run and the sender taking it back.
	state atomic.Uint32
}

// A slot's state on a link whose sender may take runs back.
const (
	slotSent      = iota // on the link
	slotTaken            // the receiver took it
	slotTakenBack        // the sender took it back (TakeBack)
)

func (r *ring) full() bool { return r.tail.Load()-r.head.Load() == ringSize }

// push adds a run; the producer checked that the ring is not full.
func (r *ring) push(s Segment, due int64, bytes int) {
	t := r.tail.Load()
	r.slots[t%ringSize] = slot{seg: s, due: due, bytes: bytes}
	r.tail.Store(t + 1)
}

// peek returns the oldest slot, or nil.
func (r *ring) peek() *slot {
	h := r.head.Load()
	if h == r.tail.Load() {
		return nil
	}
	return &r.slots[h%ringSize]
}

// pop drops the oldest slot (after peek), clearing it.
func (r *ring) pop() {
	h := r.head.Load()
	r.slots[h%ringSize] = slot{}
	r.head.Store(h + 1)
}

// base anchors the monotonic nanoseconds the links keep.
var base = time.Now()

func mono(t time.Time) int64 { return int64(t.Sub(base)) }

func fromMono(n int64) time.Time { return base.Add(time.Duration(n)) }

// direction is one way of a pipe: the sender's link (its clock and queue) and the
// receiver's inbox.
type direction struct {
	r       ring
	rate    float64 // bytes per nanosecond, 0: unlimited
	delay   int64
	queue   int64 // bytes queued to leave at most, 0: unbounded
	limit   int64 // bytes sent and not taken at most, 0: unbounded
	copying bool  // payloads are copied as they are sent (a pipe's setting)
	// takesBack: the link has a rate and a queue, so runs wait to leave and the
	// sender may take them back (TakeBack). Its receiver then leaves the slots it
	// takes as they are (the sender may be reading them) and claims each with a
	// compare-and-swap of its state.
	takesBack bool
	held      atomic.Bool // ... and while the receiver holds the link

	busyUntil int64 // sender's: when the last bit of what it sent leaves
	// backlogged is the sender's: it found no room for another run (Room,
	// WaitRoom, Send) since it last sent, and the runs it sends next may catch up
	// (catchUp); catching is set while Send sends those.
	backlogged, catching bool
	inj                  *segInjector
	// fence is, plus one, the ring index of the last NAK sent this way: its
	// receiver sends nothing once it arrived until it has taken it (nakArrived).
	fence atomic.Uint64

	// giveSince, under mu, is when the NAK the receiver last answered with (NAKed)
	// reached the sender in the link's model (monotonic nanoseconds; 0: none since
	// the sender went back), and givenBack the runs the receiver gave back since
	// (GiveBack), oldest first. A run sent after the sender went back (TakeBack
	// clears giveSince) is never given back for a NAK before: it left after that
	// NAK's arrival, but the sender sent it knowing of the NAK.
	giveSince int64
	givenBack []Segment
	giving    atomic.Bool // giveSince is set: Recv looks at each run (divert)

	mu            sync.Mutex   // held while a closed direction's runs are dropped, and by TakeBack, NAKed and GiveBack
	inflight      atomic.Int64 // bytes sent and not yet taken
	maxInflight   atomic.Int64
	maxQueued     atomic.Int64
	senderWaiting atomic.Bool // wake the sender once the receiver takes a run
	closed        atomic.Bool // either end closed
	sent, taken   atomic.Uint64
	takenBack     atomic.Uint64 // packets the sender took back

	wakeRecv, wakeSend atomic.Pointer[func()]
}

func newDirection(m LinkModel, mtu int, loss Loss, copying bool) *direction {
	d := &direction{rate: m.Rate / 8 / 1e9, delay: int64(m.Delay), queue: int64(m.queue(mtu)),
		limit: int64(m.Limit(mtu)), copying: copying}
	d.takesBack = d.rate > 0 && d.queue > 0
	if loss.active() {
		d.inj = &segInjector{loss: loss, rng: rand.New(rand.NewPCG(loss.Seed, 0x726f6365))}
	}
	return d
}

func wake(p *atomic.Pointer[func()]) {
	if f := p.Load(); f != nil {
		(*f)()
	}
}

type pipeEnd struct {
	lim     Limits
	out, in *direction
	maxRun  int
	once    sync.Once
	// nakDue is when the last NAK this end took that sends its requester back
	// arrived (monotonic nanoseconds; 0: none since TakeBack). Its engine's alone.
	nakDue int64
}

func (e *pipeEnd) Limits() Limits { return e.lim }
func (e *pipeEnd) MaxRun() int    { return e.maxRun }

// Room implements Port.
func (e *pipeEnd) Room(now time.Time) (runs, bytes int, opens time.Time) {
	d := e.out
	runs = int(ringSize - (d.r.tail.Load() - d.r.head.Load()))
	if d.inj != nil {
		runs /= 3
	}
	t := mono(now)
	if e.nakArrived(t) {
		return 0, 0, time.Time{}
	}
	if d.queue == 0 {
		return runs, -1, time.Time{}
	}
	queued := d.queued(t)
	room := d.queue - queued
	largest := e.largest()
	if queued == 0 {
		room = max(room, largest) // an idle link takes a run of any size
	}
	if queued > 0 && d.rate > 0 {
		// Room for the largest run opens once that much of the queue has left.
		opens = fromMono(d.busyUntil - int64(float64(max(d.queue-largest, 0))/d.rate))
	}
	if in := d.inflight.Load(); in > 0 && d.limit-in < room {
		room, opens = max(d.limit-in, 0), time.Time{} // the receiver is behind
	}
	if room < largest {
		d.backlogged = true
	}
	return runs, int(room), opens
}

// largest is the wire size of the largest run the end sends.
func (e *pipeEnd) largest() int64 { return int64(e.maxRun * (e.lim.MTU + frameOverhead + maxHeaders)) }

// queued is how many bytes sent at or before t have not left at t: the sender's
// transmit queue.
func (d *direction) queued(t int64) int64 {
	if d.rate == 0 || d.busyUntil <= t {
		return 0
	}
	return int64(float64(d.busyUntil-t) * d.rate)
}

// WaitRoom implements Port. The sender is backlogged: what it sends next may
// catch up (catchUp).
func (e *pipeEnd) WaitRoom() {
	e.out.backlogged = true
	e.out.senderWaiting.Store(true)
}

func (e *pipeEnd) Hold(on bool) { e.in.held.Store(on) }

func (e *pipeEnd) SetWake(f func()) {
	e.in.wakeRecv.Store(&f)
	e.out.wakeSend.Store(&f)
}

// Send implements Port. The runs are written to the ring and published once, and
// the link's counters change once per call: the receiver's engine, on the other
// core, shares those cache lines.
func (e *pipeEnd) Send(segs []Segment, now time.Time) (int, error) {
	d := e.out
	if d.closed.Load() {
		for i := range segs {
			release(&segs[i])
		}
		return len(segs), ErrClosed
	}
	t := mono(now)
	stopped := e.nakArrived(t) // requests wait; answers go
	d.catching, d.backlogged = d.backlogged, false
	tail := d.r.tail.Load()
	pending, packets := 0, 0 // bytes and packets written, not yet published
	n := 0
	for ; n < len(segs); n++ {
		s := &segs[n]
		if stopped && s.Opcode.IsRequest() {
			break
		}
		bytes := WireBytes(s)
		if d.noRoom(tail, t, pending, bytes) {
			// Say so before looking again, so that a receiver taking a run now
			// either sees the flag or leaves room this look sees.
			d.senderWaiting.Store(true)
			if d.noRoom(tail, t, pending, bytes) {
				break
			}
		}
		if d.copying || d.held.Load() {
			copyPayload(s)
		}
		if d.inj != nil {
			d.publish(&tail, &pending, &packets)
			d.inj.send(d, s, t, bytes)
			tail = d.r.tail.Load()
			continue
		}
		tail = d.put(tail, s, t, bytes)
		pending += bytes
		packets += s.Count
	}
	d.publish(&tail, &pending, &packets)
	if q := d.queued(t); q > d.maxQueued.Load() {
		d.maxQueued.Store(q) // the sender alone stores it
	}
	if n > 0 {
		wake(&d.wakeRecv)
	}
	if d.closed.Load() {
		// The peer closed while these went on the link: its engine has stopped, so
		// what it will never take is dropped here.
		d.drop()
	}
	return n, nil
}

// publish makes the runs written up to tail visible to the receiver, their bytes
// counted in flight first (the receiver uncounts what it takes).
func (d *direction) publish(tail *uint64, pending, packets *int) {
	if *tail == d.r.tail.Load() {
		return
	}
	in := d.inflight.Add(int64(*pending))
	for m := d.maxInflight.Load(); in > m && !d.maxInflight.CompareAndSwap(m, in); m = d.maxInflight.Load() {
	}
	d.sent.Add(uint64(*packets))
	d.r.tail.Store(*tail)
	*pending, *packets = 0, 0
}

// catchUp is how far a backlogged sender's link may fall behind its clock. The
// engines are goroutines that the Go and Linux schedulers hold up now and then for
// tens of microseconds: a sender that waited for room on a full queue may take
// that long to see it open, and a link that went idle meanwhile would measure the
// scheduler, not the line. So the runs it sends then leave as if it had sent them
// in time, up to catchUp earlier than it did, and arrive as early: the link is a
// token bucket at the line rate whose burst is catchUp's worth, which it grants
// only after its queue was full. A sender with nothing queued (a ping-pong, say)
// gets nothing back: its runs leave when it sends them. The link's limit still
// bounds what it holds.
const catchUp = int64(50 * time.Microsecond)

// leave returns when a run of bytes sent at t has left the link: when the link is
// free (see catchUp) and its last bit is out.
func (d *direction) leave(t int64, bytes int) int64 {
	l := max(t, d.busyUntil)
	if d.rate > 0 {
		if d.catching {
			l = max(t-catchUp, d.busyUntil)
		}
		l += int64(float64(bytes) / d.rate)
	}
	d.busyUntil = l
	return l
}

// noRoom reports whether a run of bytes sent at t must wait, with the ring
// written up to tail and pending bytes written before it, not yet counted in
// flight: the ring is full (an injector may put three runs in it at once), the
// transmit queue holds its bound (a run always goes onto an idle link, however
// large), or the link its limit (the receiver is behind).
func (d *direction) noRoom(tail uint64, t int64, pending, bytes int) bool {
	room := uint64(1)
	if d.inj != nil {
		room = 3
	}
	if tail-d.r.head.Load()+room > ringSize {
		return true
	}
	if q := d.queued(t); d.queue > 0 && q > 0 && q+int64(bytes) > d.queue {
		d.backlogged = true
		return true
	}
	in := d.inflight.Load() + int64(pending)
	if d.limit > 0 && in > 0 && in+int64(bytes) > d.limit {
		d.backlogged = true
		return true
	}
	return false
}

// SendsBack reports whether the run is a NAK that sends the requester back to its
// PSN (an RNR NAK or a sequence error): it fences the link (pipeEnd.nakArrived),
// and the requester's runs that had not left when it arrived are taken back
// (TakeBack).
func (s *Segment) SendsBack() bool {
	return s.Opcode == Acknowledge && (s.Syndrome.Kind() == 1 || s.Syndrome == SynNAKPSNSeqError)
}

// drop releases every run on a closed direction; its receiver no longer runs.
func (d *direction) drop() {
	d.mu.Lock()
	defer d.mu.Unlock()
	for sl := d.r.peek(); sl != nil; sl = d.r.peek() {
		if !d.takesBack || sl.state.CompareAndSwap(slotSent, slotTaken) {
			release(&sl.seg)
			d.inflight.Add(-int64(sl.bytes))
		}
		d.r.pop()
	}
}

// put writes a run sent at t into the ring's slot tail, not yet published: it
// leaves when the link is free and its last bit is out, and arrives the delay
// after. A NAK that asks the receiver to send again fences it (nakArrived). It
// returns the next slot.
func (d *direction) put(tail uint64, s *Segment, t int64, bytes int) uint64 {
	d.r.slots[tail%ringSize] = slot{seg: *s, due: d.leave(t, bytes) + d.delay, bytes: bytes}
	tail++
	if s.SendsBack() {
		d.fence.Store(tail)
	}
	return tail
}

// enqueue puts a run on the link at time t, published at once (the injector's
// path): it leaves when the link is free and its last bit is out, and arrives the
// delay after.
func (d *direction) enqueue(s Segment, t int64, bytes int) {
	tail := d.put(d.r.tail.Load(), &s, t, bytes)
	pending, packets := bytes, s.Count
	d.publish(&tail, &pending, &packets)
}

// nakArrived reports whether a NAK that asks this end to send again (an RNR NAK
// or a sequence error) has arrived by t and this end has not taken it. A
// requester sends nothing new once such a NAK reached it: it goes back to the
// NAK's PSN instead. Its engine takes what arrived only when it runs next, and
// until then the link takes nothing from it, so that what it sends again is what
// was in flight when the NAK arrived, not what the emulator's scheduling let it
// send after. The sender of the NAK stores the slot before the index (fence),
// and this end alone takes the slot, so the read is safe.
func (e *pipeEnd) nakArrived(t int64) bool {
	d := e.in
	f := d.fence.Load()
	return f != 0 && d.r.head.Load() < f && d.r.slots[(f-1)%ringSize].due <= t
}

// Recv implements Port.
func (e *pipeEnd) Recv(segs []Segment, now time.Time) (int, time.Time, error) {
	d := e.in
	t := mono(now)
	first, tail := d.r.head.Load(), d.r.tail.Load()
	head := first
	n, bytes, packets := 0, 0, 0
	diverted := false
	var next time.Time
	for n < len(segs) && head != tail {
		sl := &d.r.slots[head%ringSize]
		if d.takesBack && sl.state.Load() == slotTakenBack {
			head++
			continue
		}
		if sl.due > t {
			if n == 0 {
				next = fromMono(sl.due)
			}
			break
		}
		if d.giving.Load() && d.divert(sl) {
			head++ // given back on its way in, or taken back just now
			diverted = true
			continue
		}
		if d.takesBack && !sl.state.CompareAndSwap(slotSent, slotTaken) {
			head++ // taken back just now
			continue
		}
		if sl.seg.SendsBack() {
			e.nakDue = sl.due
		}
		segs[n] = sl.seg
		segs[n].due = sl.due
		bytes += sl.bytes
		packets += sl.seg.Count
		if !d.takesBack {
			*sl = slot{}
		}
		head++
		n++
	}
	if head != first {
		d.r.head.Store(head)
	}
	if n > 0 || diverted {
		d.taken.Add(uint64(packets))
		d.inflight.Add(-int64(bytes))
		if d.senderWaiting.CompareAndSwap(true, false) {
			wake(&d.wakeSend)
		}
	}
	if n == 0 && next.IsZero() && d.closed.Load() {
		return 0, time.Time{}, ErrClosed
	}
	return n, next, nil
}

// TakeBack implements Port. The runs it takes back are those whose first bit had
// not left when the NAK arrived: a run partly out stays, and counts as sent.
func (e *pipeEnd) TakeBack(runs []Segment) []Segment {
	since := e.nakDue
	e.nakDue = 0
	d := e.out
	if since == 0 || !d.takesBack {
		return runs
	}
	d.mu.Lock() // a closing peer may be dropping the ring's runs
	defer d.mu.Unlock()
	head, tail := d.r.head.Load(), d.r.tail.Load()
	if g := d.giveSince; g != 0 {
		since = min(since, g) // the peer gave back runs sent from then on
	}
	kept := since // when the last run the link keeps leaves
	bytes, packets := 0, 0
	for i := tail; i != head; i-- {
		sl := &d.r.slots[(i-1)%ringSize]
		if sl.state.Load() == slotTakenBack {
			continue
		}
		left := sl.due - d.delay // its last bit out
		if left-int64(float64(sl.bytes)/d.rate) < since {
			kept = max(kept, left)
			break // on its way: so is every run before it
		}
		if !sl.seg.Opcode.IsRequest() {
			kept = max(kept, left) // an answer of this end's responder goes as it would have
			continue
		}
		if !sl.state.CompareAndSwap(slotSent, slotTakenBack) {
			kept = max(kept, left)
			break // taken: so is every run before it
		}
		s := sl.seg
		release(&s)
		s.Payload = nil
		runs = append(runs, s)
		bytes += sl.bytes
		packets += s.Count
	}
	// Only now does the receiver take runs without the lock again: meanwhile it gave
	// back, or left to the loop above, every run that left after the NAK arrived.
	d.giveSince = 0
	d.giving.Store(false)
	given := 0
	for i := len(d.givenBack) - 1; i >= 0; i-- { // older than the ring's, newest first
		runs = append(runs, d.givenBack[i])
		given += d.givenBack[i].Count
	}
	d.givenBack = d.givenBack[:0]
	if packets+given > 0 {
		d.busyUntil = kept
		d.inflight.Add(-int64(bytes))
		d.sent.Add(-uint64(packets + given))
		d.takenBack.Add(uint64(packets + given))
	}
	return runs
}

// NAKed implements Port. From now until the sender goes back, Recv gives back the
// runs that qualify as they come (divert), and the receiver those it has (GiveBack).
func (e *pipeEnd) NAKed(s *Segment) {
	d := e.in
	if !d.takesBack || d.inj != nil || s.due == 0 {
		return // nothing waits on the link, or what it loses may lose the NAK too
	}
	// s arrived with its last bit; its first packet, the rest of its time on the
	// wire before that (a run of 16 packets of 4 KiB: 5 us at 100 Gb/s).
	arrived := s.due - int64(float64(WireBytes(s)-firstPacketBytes(s, e.lim.MTU))/d.rate)
	d.mu.Lock()
	defer d.mu.Unlock()
	if since := arrived + d.delay; d.giveSince == 0 || since < d.giveSince {
		d.giveSince = since
		d.giving.Store(true)
	}
}

// GiveBack implements Port.
func (e *pipeEnd) GiveBack(s *Segment) bool {
	d := e.in
	if !d.takesBack || s.due == 0 {
		return false
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if !d.givesBackLocked(s, WireBytes(s), s.due) {
		return false
	}
	d.taken.Add(-uint64(s.Count)) // Recv counted it
	return true
}

// givesBackLocked gives back the request run s of bytes on the wire that arrived at
// due, if it left after the NAK that d.giveSince is the arrival of: its first bit
// did (as TakeBack counts). Called with d.mu held; s's Ref stays the caller's.
func (d *direction) givesBackLocked(s *Segment, bytes int, due int64) bool {
	left := due - d.delay - int64(float64(bytes)/d.rate)
	if d.giveSince == 0 || !s.Opcode.IsRequest() || left < d.giveSince || d.closed.Load() {
		return false
	}
	c := *s
	c.Payload, c.Ref, c.due = nil, nil, 0
	d.givenBack = append(d.givenBack, c)
	return true
}

// divert gives back, on its way into Recv, the run in sl if it qualifies
// (givesBackLocked), and reports whether Recv skips sl: given back, or taken back by
// the sender just now. Under d.mu, so that each run either comes in, is given
// back, or is taken back (TakeBack holds d.mu too).
func (d *direction) divert(sl *slot) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	if sl.state.Load() == slotTakenBack {
		return true
	}
	if !d.givesBackLocked(&sl.seg, sl.bytes, sl.due) {
		return false
	}
	// Only TakeBack, under d.mu, takes a run back, and only this receiver takes one.
	sl.state.Store(slotTaken)
	release(&sl.seg)
	d.inflight.Add(-int64(sl.bytes))
	return true
}

// Close implements Port: what this end has not received is dropped, and both
// directions close. It must be called once this end's engine has stopped: it drops
// runs on the end's inbound direction, whose only receiver that engine is. The
// peer receives what was sent to it before, then ErrClosed.
func (e *pipeEnd) Close() error {
	e.once.Do(func() {
		e.out.closed.Store(true)
		e.in.closed.Store(true)
		e.in.drop()
		wake(&e.out.wakeRecv) // the peer learns of it
		wake(&e.in.wakeSend)
	})
	return nil
}

// Stats implements Port: the packets this end sent and received, the faults
// injected into what it sent, and the most bytes its link held.
func (e *pipeEnd) Stats() LinkStats {
	s := LinkStats{Sent: e.out.sent.Load(), Received: e.in.taken.Load(), MaxInFlight: int(e.out.maxInflight.Load()),
		MaxQueued: int(e.out.maxQueued.Load()), TakenBack: e.out.takenBack.Load()}
	if inj := e.out.inj; inj != nil {
		s.Dropped, s.Doubled, s.Reordered = inj.dropped.Load(), inj.doubled.Load(), inj.reordered.Load()
	}
	return s
}

func release(s *Segment) {
	if s.Ref != nil {
		s.Ref.Release()
		s.Ref = nil
	}
}

// bufRef is a Ref on a payload copied into a pooled buffer.
type bufRef struct{ b []byte }

func (r *bufRef) Release() { bufpool.Put(r.b) }

// Owned returns the Ref of a payload copied into b, a buffer from package bufpool:
// releasing it gives b back.
func Owned(b []byte) Ref { return &bufRef{b: b} }

// Detach replaces the run's payload with a copy of its own and releases the DMA it
// was read under: what a receiver that must wait does with runs it holds.
func Detach(s *Segment) { copyPayload(s) }

// copyPayload replaces the run's payload with a copy of its own and releases the
// DMA it was read under.
func copyPayload(s *Segment) {
	if len(s.Payload) == 0 {
		release(s)
		return
	}
	b := bufpool.Get(len(s.Payload))
	copy(b, s.Payload)
	release(s)
	s.Payload, s.Ref = b, &bufRef{b: b}
}

// segInjector applies a Loss to the runs (single packets) a pipe end sends: each
// is dropped, sent twice, or held back and sent after the next one.
type segInjector struct {
	loss    Loss
	rng     *rand.Rand
	held    *Segment
	heldLen int

	dropped, doubled, reordered atomic.Uint64
}

func (in *segInjector) send(d *direction, s *Segment, t int64, bytes int) {
	held, heldLen := in.held, in.heldLen
	in.held = nil
	switch r := in.rng.Float64(); {
	case r < in.loss.Drop:
		in.dropped.Add(1)
		release(s)
	case r < in.loss.Drop+in.loss.Duplicate:
		in.doubled.Add(1)
		twin := *s
		twin.Ref = nil
		copyPayload(&twin) // a payload of its own: each copy is released by its receiver
		d.enqueue(*s, t, bytes)
		d.enqueue(twin, t, bytes)
	case r < in.loss.Drop+in.loss.Duplicate+in.loss.Reorder && held == nil:
		in.reordered.Add(1)
		c := *s
		in.held, in.heldLen = &c, bytes
	default:
		d.enqueue(*s, t, bytes)
	}
	if held != nil {
		d.enqueue(*held, t, heldLen)
	}
}
