package roce

import (
	"fmt"
	"net/netip"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestCreditFrame(t *testing.T) {
	for _, n := range []uint64{0, 1, creditStep, 1<<64 - 1} {
		got, ok := parseCredit(appendCredit(nil, n))
		require.True(t, ok)
		assert.Equal(t, n, got)
	}
	for _, b := range [][]byte{nil, creditMagic, append(appendCredit(nil, 1), 0), []byte("odpemuCREDIX\x00\x00\x00\x00\x00\x00\x00\x01")} {
		_, ok := parseCredit(b)
		assert.False(t, ok, "%q", b)
	}
}

// sendPaced sends n SENDs of size bytes from port a to QP qpn (UC's if a is a UC
// QP's) as an engine sends them:
// as far as Room lets it, waiting for a wake-up or the time Room names otherwise. It
// counts the times it found no room in shut.
func sendPaced(a Port, wake chan struct{}, qpn uint32, n, size int, shut *atomic.Int64) error {
	payload := make([]byte, size)
	deadline := time.Now().Add(20 * time.Second)
	for psn := uint32(0); psn < uint32(n); {
		if time.Now().After(deadline) {
			return fmt.Errorf("sent %d of %d packets", psn, n)
		}
		runs, _, opens := a.Room(time.Now())
		if runs == 0 {
			shut.Add(1)
			select {
			case <-wake:
			case <-time.After(time.Until(opens)):
			}
			continue
		}
		op := SendOnly
		if a.Limits().UC {
			op = UCSendOnly
		}
		seg := One(Packet{Opcode: op, PKey: 0xffff, DestQP: qpn, PSN: psn, Payload: payload})
		if _, err := a.Send([]Segment{seg}, time.Now()); err != nil {
			return err
		}
		psn++
	}
	return nil
}

// twoEndpoints opens endpoints on 127.0.0.1 and 127.0.0.2 (ports the kernel picks),
// closed when the test ends.
func twoEndpoints(t *testing.T) (*Endpoint, *Endpoint) {
	t.Helper()
	var eps [2]*Endpoint
	for i, addr := range []string{"127.0.0.1:0", "127.0.0.2:0"} {
		ep, err := OpenEndpoint(netip.MustParseAddrPort(addr))
		require.NoError(t, err)
		t.Cleanup(func() { require.NoError(t, ep.Close()) })
		eps[i] = ep
	}
	return eps[0], eps[1]
}

// attachPort attaches QP qpn to ep, connected to peer, until the test ends.
func attachPort(t *testing.T, ep *Endpoint, qpn uint32, peer netip.AddrPort, l Limits) Port {
	t.Helper()
	p, err := ep.Attach(AttachConfig{QPN: qpn, Peer: peer, Limits: l})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, p.Close()) })
	return p
}

// ucLim are UC QPs' limits: theirs have credits.
var ucLim = Limits{MTU: lim.MTU, MaxMessage: lim.MaxMessage, UC: true}

// wakeChan makes p's wake-ups a channel's.
func wakeChan(p Port) chan struct{} {
	ch := make(chan struct{}, 1)
	p.SetWake(func() {
		select {
		case ch <- struct{}{}:
		default:
		}
	})
	return ch
}

// takeBatch is how many runs takeRuns asks each Recv for.
const takeBatch = 64

// takeRuns receives n runs from p, waiting on woken when none is there, and hands
// each to check (i counts the runs from 0) before it releases the run's Ref; the
// test fails if they have not all come within 20 s.
func takeRuns(t *testing.T, p Port, woken chan struct{}, n int, check func(i int, s *Segment)) {
	t.Helper()
	segs := make([]Segment, takeBatch)
	deadline := time.After(20 * time.Second)
	for i := 0; i < n; {
		k, _, err := p.Recv(segs, time.Now())
		require.NoError(t, err)
		for j := range segs[:k] {
			check(i, &segs[j])
			segs[j].Ref.Release()
			i++
		}
		if k == 0 {
			select {
			case <-woken:
			case <-deadline:
				t.Fatalf("received %d of %d runs", i, n)
			}
		}
	}
}

// A UC QP whose engine does not take what arrives shuts its peer's window instead of
// dropping: the sender finds no room once creditWindow datagrams are out, and goes on
// as the engine takes them and grants them back. The sender sends more than the inbox
// and the socket's buffer hold; every packet arrives, in order.
func TestEndpointCredits(t *testing.T) {
	ep1, ep2 := twoEndpoints(t)
	a, b := attachPort(t, ep1, 0xa, ep2.Addr(), ucLim), attachPort(t, ep2, 0xb, ep1.Addr(), ucLim)
	wakeA, wakeB := wakeChan(a), wakeChan(b)

	const n = 24 * ringSize
	var shut atomic.Int64
	sent := make(chan error, 1)
	go func() { sent <- sendPaced(a, wakeA, 0xb, n, 1024, &shut) }()
	// The receiving engine takes nothing until the sender's window is shut.
	require.Eventually(t, func() bool { return shut.Load() > 0 || len(sent) > 0 }, 10*time.Second, time.Millisecond)
	assert.EqualValues(t, creditWindow, a.Stats().Sent, "the window, and not a datagram more")
	takeRuns(t, b, wakeB, n, func(i int, s *Segment) { require.EqualValues(t, i, s.PSN, "in order, none lost") })
	require.NoError(t, <-sent)
	assert.Positive(t, shut.Load(), "the window was shut")
	assert.Zero(t, ep2.Stats().Overflow)
	rs, ss := b.Stats(), a.Stats()
	// A grant once half the window has arrived and creditStep of it is taken, at
	// the end of a Recv (at most 64 runs).
	assert.GreaterOrEqual(t, rs.GrantsSent, uint64((n-creditWindow)/(creditWindow/2+takeBatch)))
	assert.LessOrEqual(t, rs.GrantsSent, uint64(n/creditStep))
	assert.Positive(t, ss.GrantsReceived)
	assert.LessOrEqual(t, ss.GrantsReceived, rs.GrantsSent)
	assert.Zero(t, ss.CreditResets)
}

// An RC QP has no credits: its requester keeps its send queue outstanding at most.
func TestEndpointRCHasNoCredits(t *testing.T) {
	ep1, _ := twoEndpoints(t)
	a := attachPort(t, ep1, 0xa, netip.MustParseAddrPort("127.0.0.2:9"), lim)
	var shut atomic.Int64
	require.NoError(t, sendPaced(a, wakeChan(a), 0xb, 2*creditWindow, 64, &shut))
	assert.Zero(t, shut.Load())
}

// A UC sender whose datagrams are lost before the peer's engine takes them (here, to a
// QPN the peer does not have) gets no grant: once its window has stayed shut for
// creditTimeout it takes it back, and counts the reset.
func TestEndpointCreditTimeout(t *testing.T) {
	ep1, ep2 := twoEndpoints(t)
	a := attachPort(t, ep1, 0xa, ep2.Addr(), ucLim)

	var shut atomic.Int64
	t0 := time.Now()
	require.NoError(t, sendPaced(a, wakeChan(a), 0xdead, creditWindow+10, 64, &shut))
	assert.GreaterOrEqual(t, time.Since(t0), time.Duration(creditTimeout), "the window stayed shut that long")
	assert.EqualValues(t, 1, a.Stats().CreditResets)
	require.Eventually(t, func() bool { return ep2.Stats().UnknownQP == creditWindow+10 }, 10*time.Second, time.Millisecond)
}
