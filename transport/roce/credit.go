package roce

import (
	"bytes"
	"encoding/binary"
	"net/netip"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// Flow control between two processes: credits, for UC. A RoCE fabric with PFC, like
// an InfiniBand link with its credits, drops no packet for want of buffer; over UDP a
// QP's inbox (ringSize runs) and its socket's buffer are that buffer, and the QP's
// engine, software in another process, may fall behind its peer's sender. An RC QP
// needs nothing more: its requester keeps at most its send queue outstanding until
// the responder, having taken them, acknowledges them, and goes back N behind a loss.
// A UC QP never sends again and nothing acknowledges it, so it would lose what the
// inbox and the socket cannot hold (perftest's ib_send_bw -c UC between two processes
// then waited for messages that never came). So a UC QP's sender keeps at most
// creditWindow datagrams sent that the peer's engine has not taken: the peer grants
// them back with a credit datagram that says how many of the sender's datagrams its
// engine has taken so far (or its endpoint dropped as malformed). The window is less
// than the inbox holds, and what it holds fits the socket's buffer, so nothing is
// dropped, however late either process runs: a pause (PFC) would have to reach the
// sender in time, which a process the scheduler keeps waiting does not. Credits are
// not free (a grant wakes the sending process; ib_send_bw -c UC at 64 B runs about
// as fast as the receiver takes), which is why RC, lossless by its own protocol, has
// none.
//
// A credit datagram goes from the receiving endpoint's socket to the socket the
// sender's datagrams came from, never to 4791 (it is not a RoCEv2 packet, and a
// RoCEv2 peer never receives one): creditMagic, then the count, big-endian. A sender
// whose window stayed shut for creditTimeout with no grant takes it back (counted in
// CreditResets): what it sent was lost before the peer took it (a QP not attached
// yet, a peer that is not odpemu and grants nothing).

// creditMagic starts every credit datagram.
var creditMagic = []byte("odpemuCREDIT")

// creditSize is a credit datagram's size.
var creditSize = len(creditMagic) + 8

const (
	// creditWindow is how many datagrams a sender may have sent that the peer's
	// engine has not taken: three quarters of the inbox.
	creditWindow = ringSize * 3 / 4
	// creditStep is how many the engine takes before it grants them back.
	creditStep = creditWindow / 8
	// A sender with less than half its window left looks for grants at most every
	// creditPoll; one without room looks again after creditRecheck.
	creditPoll    = int64(20 * time.Microsecond)
	creditRecheck = int64(50 * time.Microsecond)
	// creditTimeout is long enough that a receiving process the scheduler keeps
	// from running does not pass for a loss: at 50 ms, TestEndpointCredits saw a
	// reset in 1 of 200 runs beside a .ci/run.
	creditTimeout = int64(500 * time.Millisecond)
)

// appendCredit appends a credit datagram granting up to count to b.
func appendCredit(b []byte, count uint64) []byte {
	b = append(b, creditMagic...)
	return binary.BigEndian.AppendUint64(b, count)
}

// parseCredit returns the count a credit datagram grants, and whether b is one.
func parseCredit(b []byte) (uint64, bool) {
	if len(b) != creditSize || !bytes.HasPrefix(b, creditMagic) {
		return 0, false
	}
	return binary.BigEndian.Uint64(b[len(creditMagic):]), true
}

// credits are a UC QP port's flow control: as a receiver, granting its peer's
// sender; as a sender, granted by its peer.
type credits struct {
	// Receiving: taken counts the peer's datagrams the QP's engine took or the
	// endpoint dropped as malformed; grantTo is where they come from (the peer's
	// sending socket); granted (the engine's) is taken at the last grant.
	taken   atomic.Uint64
	grantTo atomic.Pointer[netip.AddrPort]
	granted uint64

	// Sending, the engine's alone: sent counts the datagrams that left, acked the
	// peer's last grant; polledAt is when pollGrants last looked, shutSince when
	// the window was found shut with no grant since (0: it is open); buf is
	// pollGrants' scratch (a longer datagram than a grant is none).
	sent, acked         uint64
	polledAt, shutSince int64
	buf                 [32]byte

	grants, grantsReceived, resets atomic.Uint64
}

// noteSender records where the peer's datagrams come from. Called by the
// endpoint's receive loop.
func (c *credits) noteSender(from netip.AddrPort) {
	if to := c.grantTo.Load(); to == nil || *to != from {
		f := from // only a new sender's address is allocated
		c.grantTo.Store(&f)
	}
}

// tookRuns counts n runs the QP's engine took and grants them back: once half the
// window has arrived since the last grant, and creditStep of it has been taken. A
// grant wakes the sending process (its socket's reader in the network poller), so
// an engine that keeps up grants every half window, not every step. Called by the
// engine.
func (p *udpPort) tookRuns(n int) {
	c := &p.credit
	taken := c.taken.Add(uint64(n))
	if taken-c.granted < creditStep || taken-c.granted+(p.in.tail.Load()-p.in.head.Load()) < creditWindow/2 {
		return
	}
	if to := c.grantTo.Load(); to != nil && p.ep.link.write(appendCredit(nil, taken), *to) == nil {
		c.granted = taken
		c.grants.Add(1)
	}
}

// window returns how many more datagrams the sender may send at t (at most
// maxBatch), and when to look again if none. Called by the engine (Room).
func (p *udpPort) window(t int64) (int, int64) {
	c := &p.credit
	room := func() int { return creditWindow - int(max(int64(c.sent-c.acked), 0)) }
	if r := room(); r <= 0 || r < creditWindow/2 && t-c.polledAt >= creditPoll {
		p.pollGrants(t)
	}
	r := room()
	if r > 0 {
		c.shutSince = 0
		return min(r, maxBatch), 0
	}
	if c.shutSince == 0 {
		c.shutSince = t
	}
	if t-c.shutSince < creditTimeout {
		return 0, t + creditRecheck
	}
	c.acked, c.shutSince = c.sent, 0 // lost on the way: take the window back
	c.resets.Add(1)
	return maxBatch, 0
}

// pollGrants takes, without waiting, the grants the peer sent to the QP's socket.
// The sender looks itself: a goroutine blocked on the socket waits for the
// runtime's network poller, which a busy process reaches milliseconds late.
func (p *udpPort) pollGrants(t int64) {
	c := &p.credit
	c.polledAt = t
	peer := p.peer.Addr()
	_ = p.send.mm.rc.Read(func(fd uintptr) bool { // fails only once the socket is closed
		for {
			n, from, err := unix.Recvfrom(int(fd), c.buf[:], unix.MSG_DONTWAIT)
			if err != nil {
				return true // EAGAIN: nothing more
			}
			count, ok := parseCredit(c.buf[:min(n, len(c.buf))])
			if !ok || !fromAddr(from, peer) {
				continue // not a grant, or not from the peer
			}
			c.grantsReceived.Add(1)
			if int64(count-c.acked) > 0 {
				c.acked = count
			}
		}
	})
}

// fromAddr reports whether sa is an address of a.
func fromAddr(sa unix.Sockaddr, a netip.Addr) bool {
	switch sa := sa.(type) {
	case *unix.SockaddrInet4:
		return netip.AddrFrom4(sa.Addr) == a.Unmap()
	case *unix.SockaddrInet6:
		return netip.AddrFrom16(sa.Addr).Unmap() == a.Unmap()
	}
	return false
}
