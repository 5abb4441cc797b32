package roce

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The link model's arithmetic in round numbers: 8 Gb/s is one byte per
// nanosecond, and a WRITE MIDDLE of 1000 payload bytes takes 1082 bytes on the
// wire (Ethernet, IPv4, UDP, BTH and ICRC around it).
const (
	oneBytePerNs = 8e9
	testPayload  = 1000
	testWire     = testPayload + frameOverhead + BTHSize + ICRCSize
)

var testLim = Limits{MTU: 1024, MaxMessage: 1 << 20}

func testRun(psn uint32) Segment {
	return One(Packet{Opcode: WriteMiddle, PSN: psn, Payload: make([]byte, testPayload)})
}

// testPipe returns a pipe whose both directions have the model m, and counters of
// the wake-ups each end got.
func testPipe(t *testing.T, m LinkModel) (a, b Port, wokenA, wokenB *atomic.Int32) {
	t.Helper()
	a, b = newTestPipe(t, PipeConfig{AB: m, BA: m})
	wokenA, wokenB = new(atomic.Int32), new(atomic.Int32)
	a.SetWake(func() { wokenA.Add(1) })
	b.SetWake(func() { wokenB.Add(1) })
	return a, b, wokenA, wokenB
}

// newTestPipe returns a pipe of cfg at testLim, closed when the test ends.
func newTestPipe(t *testing.T, cfg PipeConfig) (a, b Port) {
	t.Helper()
	a, b, err := NewPipe(testLim, cfg)
	require.NoError(t, err)
	t.Cleanup(func() {
		_ = a.Close() // closing a pipe end cannot fail
		_ = b.Close()
	})
	return a, b
}

func TestWireSizes(t *testing.T) {
	s := testRun(0)
	assert.Equal(t, testWire, WireBytes(&s))
	assert.Equal(t, testWire, WirePacket(testPayload))
	assert.Equal(t, WireBytes(&s), WireSize(&s, len(s.Payload)))
}

// Runs leave one after the other at the line rate and arrive the delay after their
// last bit left; the receiver is told when the next one arrives.
func TestLinkRateAndDelay(t *testing.T) {
	m := LinkModel{Rate: oneBytePerNs, Delay: time.Microsecond, Queue: 1 << 20, Buffer: 1 << 20}
	a, b, _, wokenB := testPipe(t, m)
	t0 := time.Now()
	segs := []Segment{testRun(0), testRun(1), testRun(2)}
	n, err := a.Send(segs, t0)
	require.NoError(t, err)
	require.Equal(t, 3, n)
	assert.Positive(t, wokenB.Load(), "the receiver is woken when runs are sent")

	rx := make([]Segment, 8)
	for k := 1; k <= 3; k++ {
		due := t0.Add(time.Duration(k*testWire)*time.Nanosecond + m.Delay)
		n, next, err := b.Recv(rx, due.Add(-time.Nanosecond))
		require.NoError(t, err)
		require.Zero(t, n, "run %d taken before it arrived", k)
		require.True(t, next.Equal(due), "run %d: told %v, arrives %v", k, next.Sub(t0), due.Sub(t0))
		n, _, err = b.Recv(rx, due)
		require.NoError(t, err)
		require.Equal(t, 1, n)
		assert.EqualValues(t, k-1, rx[0].PSN)
	}
	st := a.Stats()
	assert.EqualValues(t, 3, st.Sent)
	assert.Equal(t, 3*testWire, st.MaxQueued, "all three were queued at once")
	assert.EqualValues(t, 3, b.Stats().Received)
}

// The transmit queue holds at most Queue bytes that have not left (a run goes onto
// an idle link whatever its size); Room says how much fits and when room for a
// largest run opens, and Send takes exactly what Room allows.
func TestLinkQueueBound(t *testing.T) {
	m := LinkModel{Rate: oneBytePerNs, Queue: 3000, Buffer: 1 << 20}
	a, _ := newTestPipe(t, PipeConfig{AB: m, BA: m, MaxRun: 1}) // runs of one packet, as the sender's below
	t0 := time.Now()

	_, room, opens := a.Room(t0)
	assert.GreaterOrEqual(t, room, 3000, "an idle link takes a run of any size")
	assert.True(t, opens.IsZero(), "an idle link needs no time to open")

	n, err := a.Send([]Segment{testRun(0), testRun(1), testRun(2)}, t0)
	require.NoError(t, err)
	require.Equal(t, 2, n, "a third run would queue %d bytes", 3*testWire)
	_, room, opens = a.Room(t0)
	assert.Equal(t, 3000-2*testWire, room)
	require.False(t, opens.IsZero())

	// Room for the largest run opens once enough of the queue has left.
	largest := testLim.MTU + frameOverhead + maxHeaders
	want := t0.Add(time.Duration(2*testWire-(3000-largest)) * time.Nanosecond)
	assert.True(t, opens.Equal(want), "opens after %v, want %v", opens.Sub(t0), want.Sub(t0))
	_, room, _ = a.Room(opens)
	assert.GreaterOrEqual(t, room, largest)
	n, err = a.Send([]Segment{testRun(2)}, opens)
	require.NoError(t, err)
	require.Equal(t, 1, n)

	// Sent at the pace the queue drains, the queue never holds more than its bound.
	now := opens
	for psn := uint32(3); psn < 100; psn++ {
		_, room, opens := a.Room(now)
		if room < testWire {
			require.False(t, opens.IsZero())
			now = opens
		}
		n, err := a.Send([]Segment{testRun(psn)}, now)
		require.NoError(t, err)
		require.Equal(t, 1, n, "PSN %d: Room said it fits", psn)
	}
	assert.LessOrEqual(t, a.Stats().MaxQueued, 3000)
}

// A pipe's runs hold half its queue, at most PipeConfig.MaxRun packets and at least
// minRun however small the queue (per-run costs would bind the link otherwise); a
// link with faults injected sends single packets.
func TestRunsOfAPipe(t *testing.T) {
	packet := WirePacket(testLim.MTU)
	for name, c := range map[string]struct {
		cfg  PipeConfig
		want int
	}{
		"no link model":           {PipeConfig{}, 64},
		"a queue of 40 packets":   {PipeConfig{AB: LinkModel{Rate: oneBytePerNs, Queue: 40 * packet}}, 20},
		"a queue of one packet":   {PipeConfig{AB: LinkModel{Rate: oneBytePerNs, Queue: packet}}, minRun},
		"no delay, default queue": {PipeConfig{AB: LinkModel{Rate: 100e9}}, minRun},
		"MaxRun below minRun":     {PipeConfig{AB: LinkModel{Rate: oneBytePerNs, Queue: packet}, MaxRun: 4}, 4},
		"faults injected":         {PipeConfig{AB: LinkModel{Rate: oneBytePerNs, Queue: 40 * packet}, Loss: Loss{Drop: 0.5}}, 1},
	} {
		t.Run(name, func(t *testing.T) {
			a, b := newTestPipe(t, c.cfg)
			assert.Equal(t, c.want, a.MaxRun())
			assert.Equal(t, c.want, b.MaxRun(), "both ends send runs of one size")
		})
	}
}

// The receive buffer is the queue's size by default, and at least what the line
// brings in receiverLate; a Buffer given is kept.
func TestLinkBufferDefault(t *testing.T) {
	const mtu = 4096
	noDelay := LinkModel{Rate: 100e9}
	assert.Equal(t, 250_000, noDelay.buffer(mtu), "20 us at 100 Gb/s")
	assert.Equal(t, noDelay.queue(mtu)+250_000, noDelay.Limit(mtu))
	long := LinkModel{Rate: 100e9, Delay: 20 * time.Microsecond}
	assert.Equal(t, long.queue(mtu), long.buffer(mtu), "a queue longer than 20 us of the line")
	given := LinkModel{Rate: 100e9, Buffer: 5000}
	assert.Equal(t, 5000, given.buffer(mtu))
	assert.Zero(t, LinkModel{}.Limit(mtu), "no model, no limit")
}

// A receiver that takes nothing stops the sender at the link's limit (queue, the
// one-way bandwidth-delay product and the buffer), and taking a run wakes a
// sender that waits for room.
func TestLinkLimitBacksUpToTheSender(t *testing.T) {
	m := LinkModel{Rate: oneBytePerNs, Delay: time.Microsecond, Queue: 3000, Buffer: 2000}
	limit := m.Limit(testLim.MTU)
	require.Equal(t, 3000+1000+2000, limit)
	a, b, wokenA, _ := testPipe(t, m)
	now := time.Now()
	sent := 0
	for psn := uint32(0); ; psn++ {
		_, room, opens := a.Room(now)
		if room < testWire {
			if opens.IsZero() {
				break // only the receiver can make room now
			}
			now = opens
			continue
		}
		n, err := a.Send([]Segment{testRun(psn)}, now)
		require.NoError(t, err)
		require.Equal(t, 1, n)
		sent++
		require.Less(t, sent, 100, "the limit never stopped the sender")
	}
	assert.Equal(t, limit/testWire, sent)
	st := a.Stats()
	assert.LessOrEqual(t, st.MaxInFlight, limit)
	assert.Equal(t, sent*testWire, st.MaxInFlight)
	n, err := a.Send([]Segment{testRun(99)}, now.Add(time.Hour))
	require.NoError(t, err)
	assert.Zero(t, n, "Send refuses what Room refused, however late")

	// The sender asks to be woken; the receiver takes a run and wakes it.
	a.WaitRoom()
	before := wokenA.Load()
	rx := make([]Segment, 1)
	n, _, err = b.Recv(rx, now.Add(time.Hour))
	require.NoError(t, err)
	require.Equal(t, 1, n)
	assert.Greater(t, wokenA.Load(), before, "taking a run wakes the waiting sender")
	_, room, _ := a.Room(now.Add(time.Hour))
	assert.GreaterOrEqual(t, room, testWire)
}

// A sender that waited for room on a full queue catches up when the scheduler
// lets it see the room late: its runs leave up to catchUp earlier than it sent
// them, never before the link was free, so that over a long window the link
// carries the line rate and no more. A sender that did not wait gets nothing back.
func TestLinkCatchesUp(t *testing.T) {
	m := LinkModel{Rate: oneBytePerNs, Queue: 3000, Buffer: 1 << 20}
	a, b, _, _ := testPipe(t, m)
	rx := make([]Segment, 16)
	arrival := func(at time.Time) time.Time {
		t.Helper()
		n, next, err := b.Recv(rx, at)
		require.NoError(t, err)
		require.Zero(t, n, "taken before it arrived")
		return next
	}
	take := func(at time.Time, want int) {
		t.Helper()
		n, _, err := b.Recv(rx, at)
		require.NoError(t, err)
		require.Equal(t, want, n)
	}

	// A ping on an idle link leaves when it is sent.
	t0 := time.Now()
	n, err := a.Send([]Segment{testRun(0)}, t0)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	due := t0.Add(testWire * time.Nanosecond)
	assert.True(t, arrival(t0).Equal(due))
	take(due, 1)

	// Fill the queue: the sender waits for room, and is seen again a second late.
	n, err = a.Send([]Segment{testRun(1), testRun(2), testRun(3)}, due)
	require.NoError(t, err)
	require.Equal(t, 2, n)
	_, room, opens := a.Room(due)
	require.Less(t, room, testWire)
	require.False(t, opens.IsZero())
	take(opens.Add(time.Millisecond), 2) // the two queued before
	late := opens.Add(time.Second)
	segs := make([]Segment, 10)
	for i := range segs {
		segs[i] = testRun(uint32(3 + i))
	}
	n, err = a.Send(segs, late)
	require.NoError(t, err)
	require.Equal(t, 10, n, "the link was idle meanwhile: a burst fits the queue")
	for k := 1; k <= 10; k++ {
		due := late.Add(time.Duration(-catchUp + int64(k*testWire)))
		require.True(t, arrival(due.Add(-time.Nanosecond)).Equal(due), "run %d", k)
		take(due, 1)
	}

	// Long after, with nothing queued, a run gets no catch-up.
	later := late.Add(time.Second)
	n, err = a.Send([]Segment{testRun(13)}, later)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	assert.True(t, arrival(later).Equal(later.Add(testWire*time.Nanosecond)))
}

func rnrNAK(psn uint32) Segment {
	return One(Packet{Opcode: Acknowledge, PSN: psn, Syndrome: RNR(1)})
}

// A requester sends nothing new once an RNR NAK or a sequence error NAK reached
// it, until it took the NAK: Room has no room and Send takes nothing. Before the
// NAK arrives it sends as usual (what is in flight then is what go-back-N sends
// again), and an ACK or a NAK that ends the QP does not stop it.
func TestNAKStopsTheRequester(t *testing.T) {
	m := LinkModel{Rate: oneBytePerNs, Delay: time.Microsecond, Queue: 1 << 20, Buffer: 1 << 20}
	a, b, _, _ := testPipe(t, m)
	now := time.Now()
	rx := make([]Segment, 8)
	send := func(p Port, at time.Time, segs ...Segment) int {
		t.Helper()
		n, err := p.Send(segs, at)
		require.NoError(t, err)
		return n
	}
	room := func(at time.Time) int {
		t.Helper()
		_, r, _ := a.Room(at)
		return r
	}

	for _, c := range []struct {
		name  string
		nak   Segment
		stops bool
	}{
		{"ACK", One(Packet{Opcode: Acknowledge, Syndrome: SynACK}), false},
		{"RNR NAK", rnrNAK(1), true},
		{"sequence NAK", One(Packet{Opcode: Acknowledge, Syndrome: SynNAKPSNSeqError}), true},
		{"remote access NAK", One(Packet{Opcode: Acknowledge, Syndrome: SynNAKRemoteAccess}), false},
	} {
		now = now.Add(time.Second) // an idle link
		require.Equal(t, 1, send(b, now, c.nak), c.name)
		arrives := now.Add(time.Duration(WireBytes(&c.nak))*time.Nanosecond + m.Delay)
		require.Positive(t, room(arrives.Add(-time.Nanosecond)), "%s: stopped before it arrived", c.name)
		require.Equal(t, 1, send(a, arrives.Add(-time.Nanosecond), testRun(1)), "%s: in flight when it arrives", c.name)
		if c.stops {
			assert.Zero(t, room(arrives), c.name)
			assert.Zero(t, send(a, arrives, testRun(2)), "%s: the requester must take it first", c.name)
			ack := One(Packet{Opcode: Acknowledge, Syndrome: SynACK})
			assert.Equal(t, 1, send(a, arrives, ack), "%s: its responder still answers", c.name)
		} else {
			assert.Positive(t, room(arrives), c.name)
		}
		n, _, err := a.Recv(rx, arrives)
		require.NoError(t, err)
		require.Equal(t, 1, n, c.name)
		assert.Positive(t, room(arrives), "%s: taken, the requester sends again", c.name)
		if c.stops {
			assert.Equal(t, 1, send(a, arrives, testRun(2)), c.name)
		}
		n, _, err = b.Recv(rx, arrives.Add(time.Second))
		require.NoError(t, err)
		assert.Positive(t, n, "%s: the responder takes what was sent all along", c.name)
	}
}

// Two ends that each wait to take the other's NAK take them: receiving is never
// stopped, nor are answers (ACKs, NAKs, READ responses), so they cannot wait for
// each other.
func TestNAKsBothWays(t *testing.T) {
	a, b, _, _ := testPipe(t, LinkModel{})
	now := time.Now()
	rx := make([]Segment, 8)
	for _, p := range []Port{a, b} {
		n, err := p.Send([]Segment{rnrNAK(7)}, now)
		require.NoError(t, err)
		require.Equal(t, 1, n)
	}
	for _, p := range []Port{a, b} {
		runs, _, _ := p.Room(now)
		assert.Zero(t, runs, "a NAK arrived: no room")
		n, _, err := p.Recv(rx, now)
		require.NoError(t, err)
		assert.Equal(t, 1, n)
		runs, _, _ = p.Room(now)
		assert.Positive(t, runs)
	}
}
