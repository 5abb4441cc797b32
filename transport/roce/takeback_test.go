package roce

import (
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// countRef counts its releases.
type countRef struct{ n *atomic.Int32 }

func (r countRef) Release() { r.n.Add(1) }

// refRun is a request run whose Ref counts into released.
func refRun(psn uint32, released *atomic.Int32) Segment {
	s := testRun(psn)
	s.Ref = countRef{released}
	return s
}

// sendAt sends segs on p at t and requires that the link takes them all.
func sendAt(t *testing.T, p Port, at time.Time, segs ...Segment) {
	t.Helper()
	n, err := p.Send(segs, at)
	require.NoError(t, err)
	require.Equal(t, len(segs), n)
}

// A NAK that sends the requester back takes back the runs that had not begun to
// leave when it arrived: the receiver never gets them, their Refs are released,
// the link counts them as taken back rather than sent, and what the requester sends
// next leaves where the runs it kept end. A run partly out, a run the receiver took
// and the responder's answers stay; a second TakeBack finds nothing.
func TestTakeBackRunsThatHadNotLeft(t *testing.T) {
	m := LinkModel{Rate: oneBytePerNs, Delay: time.Microsecond, Queue: 1 << 20, Buffer: 1 << 20}
	a, b, _, _ := testPipe(t, m)
	var released atomic.Int32
	t0 := time.Now()
	// Five request runs, each leaving testWire ns after the one before, then an ACK
	// of a's responder behind them.
	runs := make([]Segment, 0, 6)
	for psn := uint32(0); psn < 5; psn++ {
		runs = append(runs, refRun(psn, &released))
	}
	ack := One(Packet{Opcode: Acknowledge, Syndrome: SynACK, PSN: 77})
	runs = append(runs, ack)
	sendAt(t, a, t0, runs...)
	at := func(wires float64) time.Time { return t0.Add(time.Duration(wires * testWire)) }

	// The receiver takes the first run as it arrives.
	rx := make([]Segment, 16)
	n, _, err := b.Recv(rx, at(1).Add(m.Delay))
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.Equal(t, uint32(0), rx[0].PSN)

	// An RNR NAK arrives while run 2 leaves (its first bit left at 2 wires, its last
	// leaves at 3): runs 3 and 4 had not begun to leave.
	nak := rnrNAK(0)
	arrives := at(2.5)
	sendAt(t, b, arrives.Add(-m.Delay-time.Duration(WireBytes(&nak))), nak)
	assert.Nil(t, a.TakeBack(nil), "nothing before the NAK was taken")
	n, _, err = a.Recv(rx, arrives)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.True(t, rx[0].SendsBack())

	back := a.TakeBack(nil)
	require.Len(t, back, 2)
	assert.Equal(t, []uint32{4, 3}, []uint32{back[0].PSN, back[1].PSN}, "newest first")
	for _, s := range back {
		assert.Nil(t, s.Ref)
		assert.Nil(t, s.Payload)
		assert.Equal(t, 1, s.Count)
	}
	assert.Equal(t, int32(2), released.Load(), "their DMAs end")
	st := a.Stats()
	assert.Equal(t, uint64(2), st.TakenBack)
	assert.Equal(t, uint64(4), st.Sent, "three runs and the ACK went on the wire")
	assert.Empty(t, a.TakeBack(nil), "taken back once")

	// The requester sends again at once; its run leaves after the ACK, which
	// keeps its place.
	sendAt(t, a, arrives, refRun(3, &released))
	ackLeft := at(5).Add(time.Duration(WireBytes(&ack)))
	n, next, err := b.Recv(rx, ackLeft.Add(m.Delay))
	require.NoError(t, err)
	var got []uint32
	for i := range rx[:n] {
		got = append(got, rx[i].PSN)
		release(&rx[i])
	}
	assert.Equal(t, []uint32{1, 2, 77}, got)
	n, next, err = b.Recv(rx, ackLeft.Add(m.Delay))
	require.NoError(t, err)
	require.Zero(t, n)
	assert.True(t, next.Equal(ackLeft.Add(testWire+m.Delay)), "run 3 again leaves right after the ACK: %v", next.Sub(ackLeft))
	n, _, err = b.Recv(rx, next)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	assert.Equal(t, uint32(3), rx[0].PSN)
	release(&rx[0])
	assert.Equal(t, int32(5), released.Load(), "every DMA ended once")
}

// On a link with no rate nothing waits to leave: nothing is taken back.
func TestTakeBackNeedsARate(t *testing.T) {
	a, b, _, _ := testPipe(t, LinkModel{Delay: time.Microsecond})
	var released atomic.Int32
	now := time.Now()
	sendAt(t, a, now, refRun(0, &released), refRun(1, &released))
	sendAt(t, b, now, rnrNAK(0))
	rx := make([]Segment, 4)
	n, _, err := a.Recv(rx, now.Add(time.Hour))
	require.NoError(t, err)
	require.Equal(t, 1, n)
	assert.Empty(t, a.TakeBack(nil))
	n, _, err = b.Recv(rx, now.Add(time.Hour))
	require.NoError(t, err)
	assert.Equal(t, 2, n)
}

// The receiver taking runs and the sender taking them back race on other cores:
// every run is received or taken back, never both, never neither, and its DMA ends
// once. The receiver's clock runs ahead of the sender's by a random amount, so
// that it takes runs the NAK would take back.
func TestTakeBackRacesTheReceiver(t *testing.T) {
	m := LinkModel{Rate: oneBytePerNs, Delay: time.Microsecond, Queue: 1 << 20, Buffer: 1 << 20}
	rng := rand.New(rand.NewPCG(1, 2))
	for iter := 0; iter < 300; iter++ {
		a, b, _, _ := testPipe(t, m)
		var released atomic.Int32
		const count = 40
		t0 := time.Now()
		sendRuns(t, a, t0, count, &released)
		nak := rnrNAK(0)
		arrives := t0.Add(time.Duration(rng.IntN(count*testWire + 1)))
		sendAt(t, b, arrives.Add(-m.Delay-time.Duration(WireBytes(&nak))), nak)

		var wg sync.WaitGroup
		received := make(map[uint32]int)
		ahead := time.Duration(rng.IntN(2 * count * testWire))
		wg.Add(1)
		go func() {
			defer wg.Done()
			rx := make([]Segment, 3)
			for step := 0; step < 50; step++ {
				n, _, err := b.Recv(rx, arrives.Add(ahead*time.Duration(step)/50))
				if err != nil {
					return
				}
				for i := range rx[:n] {
					received[rx[i].PSN]++
					release(&rx[i])
				}
			}
		}()
		rx := make([]Segment, 1)
		n, _, err := a.Recv(rx, arrives)
		require.NoError(t, err)
		require.Equal(t, 1, n)
		back := a.TakeBack(nil)
		wg.Wait()
		accountOnce(t, iter, a, b, t0.Add(time.Hour), count, received, back, &released)
	}
}

// sendRuns sends request runs 0 to count-1 on p at t, their Refs counting into
// released.
func sendRuns(t *testing.T, p Port, at time.Time, count int, released *atomic.Int32) {
	t.Helper()
	runs := make([]Segment, count)
	for i := range runs {
		runs[i] = refRun(uint32(i), released)
	}
	sendAt(t, p, at, runs...)
}

// accountOnce has b receive what is left on the link by end (what neither end took
// arrives in the end), then requires that each of the runs 0 to count-1 that a sent
// was received (counted in got) or came back to a (back), once, that every DMA
// ended once, and that a's counters say so.
func accountOnce(t *testing.T, iter int, a, b Port, end time.Time, count int, got map[uint32]int, back []Segment,
	released *atomic.Int32) {
	t.Helper()
	rest := make([]Segment, count)
	n, _, err := b.Recv(rest, end)
	require.NoError(t, err)
	for i := range rest[:n] {
		got[rest[i].PSN]++
		release(&rest[i])
	}
	for _, s := range back {
		got[s.PSN] += 100
	}
	for psn := uint32(0); psn < uint32(count); psn++ {
		require.Contains(t, []int{1, 100}, got[psn], "iteration %d: run %d received or back once", iter, psn)
	}
	require.Equal(t, int32(count), released.Load(), "iteration %d: every DMA ended once", iter)
	st := a.Stats()
	require.Equal(t, uint64(len(back)), st.TakenBack)
	require.Equal(t, uint64(count-len(back)), st.Sent)
}

// A responder that answers a run with a NAK that sends the requester back (NAKed)
// gives back the request runs the requester sent after that NAK reached it in the
// link's model: the NAK leaves as the run arrives, whenever the responder gets to
// it. Those it has already received it gives back itself (GiveBack: it keeps their
// Refs), those still on the link never reach it (Recv gives them back on their way,
// releasing their Refs), and the requester takes them all back with the NAK, newest
// first, as never sent. The runs that left before stay: what a NIC's NAK finds in
// flight. Once the requester went back, nothing more is given back.
func TestGiveBackRunsSentAfterTheNAK(t *testing.T) {
	m := LinkModel{Rate: oneBytePerNs, Delay: time.Microsecond, Queue: 1 << 20, Buffer: 1 << 20}
	a, b, _, _ := testPipe(t, m)
	var released atomic.Int32
	t0 := time.Now()
	runs := make([]Segment, 8)
	for i := range runs {
		runs[i] = refRun(uint32(i), &released)
	}
	sendAt(t, a, t0, runs...)
	at := func(wires float64) time.Time { return t0.Add(time.Duration(wires * testWire)) }

	// The responder gets to the link late: runs 0 to 3 have arrived.
	rx := make([]Segment, 16)
	n, _, err := b.Recv(rx, at(4).Add(m.Delay))
	require.NoError(t, err)
	require.Equal(t, 4, n)
	assert.False(t, b.GiveBack(&rx[3]), "no NAK yet: nothing goes back")
	// It NAKs run 0: the NAK reaches the requester at 1 wire + 2 delays (2.9 wires),
	// when run 3 had not begun to leave, runs 1 and 2 had.
	b.NAKed(&rx[0])
	var given []uint32
	for i := 1; i < n; i++ {
		if b.GiveBack(&rx[i]) {
			given = append(given, rx[i].PSN)
		}
		release(&rx[i]) // the responder's to release, given back or not
	}
	release(&rx[0])
	assert.Equal(t, []uint32{3}, given)
	// Runs 4 to 7 arrive, and go back on their way in.
	n, _, err = b.Recv(rx, at(8).Add(m.Delay))
	require.NoError(t, err)
	assert.Zero(t, n, "the runs sent after the NAK arrived never reach the responder")
	assert.Equal(t, int32(8), released.Load(), "every DMA ended once")

	nak := rnrNAK(0)
	sendAt(t, b, at(8).Add(m.Delay), nak)
	n, _, err = a.Recv(rx, at(10).Add(3*m.Delay))
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.True(t, rx[0].SendsBack())
	back := a.TakeBack(nil)
	var psns []uint32
	for _, s := range back {
		psns = append(psns, s.PSN)
		assert.Nil(t, s.Ref)
		assert.Nil(t, s.Payload)
	}
	assert.Equal(t, []uint32{7, 6, 5, 4, 3}, psns, "newest first")
	st := a.Stats()
	assert.Equal(t, uint64(5), st.TakenBack)
	assert.Equal(t, uint64(3), st.Sent, "runs 0 to 2 went on the wire")
	assert.Equal(t, uint64(3), b.Stats().Received)
	assert.Empty(t, a.TakeBack(nil), "taken back once")

	// The requester went back: what it sends now arrives, and goes back no more.
	later := at(12).Add(4 * m.Delay)
	sendAt(t, a, later, refRun(3, &released))
	n, _, err = b.Recv(rx, later.Add(time.Millisecond))
	require.NoError(t, err)
	require.Equal(t, 1, n)
	assert.False(t, b.GiveBack(&rx[0]))
	release(&rx[0])
	assert.Equal(t, int32(9), released.Load())
}

// A NAK that answers a run of several packets leaves, in the link's model, when the
// run's first packet arrived, not its last: the responder decides on a run at its
// first packet. The runs sent after the NAK reached the requester in that clock go
// back, including those that left while the NAKed run's later packets were still
// arriving.
func TestNAKLeavesAtTheRunsFirstPacket(t *testing.T) {
	m := LinkModel{Rate: oneBytePerNs, Delay: time.Microsecond, Queue: 1 << 20, Buffer: 1 << 20}
	a, b, _, _ := testPipe(t, m)
	var released atomic.Int32
	long := Segment{Packet: Packet{Opcode: WriteMiddle, PSN: 0, Payload: make([]byte, 4*testLim.MTU)}, Count: 4,
		Last: WriteMiddle, Ref: countRef{&released}}
	longWire := WireBytes(&long) // on the wire from t0 to t0+longWire ns
	t0 := time.Now()
	sendAt(t, a, t0, long, refRun(4, &released), refRun(5, &released), refRun(6, &released))
	// The NAK leaves as the long run's first packet arrives and reaches the
	// requester 2 delays after that packet left (1106 ns on the wire): 3.11 us
	// after t0, before run 4 began to leave at 4.42 us. Counted from the run's last
	// bit it would reach the requester at 6.42 us, after runs 4 and 5 began (at
	// 4.42 and 5.51 us).
	first := firstPacketBytes(&long, testLim.MTU)
	require.Equal(t, first, WireSize(&Segment{Packet: long.Packet, Count: 1}, testLim.MTU), "one packet's size")
	require.Less(t, time.Duration(first)+2*m.Delay, time.Duration(longWire), "the NAK arrives before run 4 leaves")
	require.Greater(t, time.Duration(longWire+testWire)+2*m.Delay, time.Duration(longWire+2*testWire),
		"counted from the last bit, runs 4 and 5 left before it")

	rx := make([]Segment, 8)
	n, _, err := b.Recv(rx, t0.Add(time.Duration(longWire+3*testWire)+m.Delay))
	require.NoError(t, err)
	require.Equal(t, 4, n, "everything arrived")
	b.NAKed(&rx[0])
	var given []uint32
	for i := 1; i < n; i++ {
		if b.GiveBack(&rx[i]) {
			given = append(given, rx[i].PSN)
		}
		release(&rx[i])
	}
	release(&rx[0])
	assert.Equal(t, []uint32{4, 5, 6}, given, "every run sent after the NAK arrived goes back")
	assert.Equal(t, int32(4), released.Load(), "every DMA ended once")
}

// The responder giving runs back and the requester going back race on other cores:
// every run is received and kept, or comes back to the requester (given back, or
// taken back), exactly once, and its DMA ends once.
func TestGiveBackRacesTheRequester(t *testing.T) {
	m := LinkModel{Rate: oneBytePerNs, Delay: time.Microsecond, Queue: 1 << 20, Buffer: 1 << 20}
	rng := rand.New(rand.NewPCG(3, 4))
	givenBack, cameBack := 0, 0 // over every iteration: given back by the responder, back with TakeBack
	for iter := 0; iter < 300; iter++ {
		a, b, _, _ := testPipe(t, m)
		var released atomic.Int32
		const count = 40
		t0 := time.Now()
		sendRuns(t, a, t0, count, &released)
		late := time.Duration(rng.IntN(count * testWire)) // how late the responder is

		kept := make(map[uint32]int)
		nakSent := make(chan struct{})
		var wg sync.WaitGroup
		wg.Add(1)
		go func() { // the responder
			defer wg.Done()
			rx := make([]Segment, 1+rng.IntN(4))
			first := true
			for step := 0; step < 60; step++ {
				now := t0.Add(late + time.Duration(step)*testWire)
				n, _, err := b.Recv(rx, now)
				if err != nil {
					return
				}
				for i := range rx[:n] {
					switch {
					case first:
						first = false
						b.NAKed(&rx[i])
						kept[rx[i].PSN]++
						nak := rnrNAK(rx[i].PSN)
						if _, err := b.Send([]Segment{nak}, now); err != nil {
							return
						}
						close(nakSent)
					case !b.GiveBack(&rx[i]):
						kept[rx[i].PSN]++
					default:
						givenBack++
					}
					release(&rx[i])
				}
			}
		}()
		<-nakSent
		rx := make([]Segment, 1)
		var back []Segment
		for back == nil {
			n, _, err := a.Recv(rx, t0.Add(time.Hour))
			require.NoError(t, err)
			if n == 1 {
				require.True(t, rx[0].SendsBack())
				back = a.TakeBack([]Segment{})
			}
		}
		wg.Wait()
		accountOnce(t, iter, a, b, t0.Add(time.Hour), count, kept, back, &released)
		cameBack += len(back)
	}
	t.Logf("%d runs came back, %d of them given back by the responder", cameBack, givenBack)
	assert.Positive(t, givenBack, "the responder gave runs back")
	assert.Greater(t, cameBack, givenBack, "runs came back from the link too")
}
