package roce

import (
	"bytes"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func listen(t *testing.T, addr string, loss Loss) *Link {
	t.Helper()
	l, err := Listen(netip.MustParseAddrPort(addr), lim, loss)
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close() })
	return l
}

// Every opcode between two links on loopback; what does not decode (garbage, a
// truncated packet, a packet whose ICRC was made for another sender, one too large)
// is counted and skipped, and what follows it arrives.
func TestLinkLoopback(t *testing.T) {
	a, b := listen(t, "127.0.0.1:0", Loss{}), listen(t, "127.0.0.2:0", Loss{})
	buf := make([]byte, BufferSize(lim))
	for _, p := range rcSamples() {
		require.NoError(t, a.Send(&p, b.LocalAddr()))
		got, from, err := b.Recv(buf)
		require.NoError(t, err)
		assert.Equal(t, a.LocalAddr(), from)
		if len(p.Payload) == 0 {
			got.Payload = nil
		}
		assert.Equal(t, p, got, p.Opcode.String())
	}

	raw, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	require.NoError(t, err)
	defer func() { _ = raw.Close() }()
	good := Packet{Opcode: SendOnly, PSN: 7, Payload: []byte("after the bad ones")}
	forOther, err := good.Append(nil, Endpoints{Src: netip.MustParseAddrPort("127.0.0.9:1"), Dst: b.LocalAddr()})
	require.NoError(t, err)
	huge, err := (&Packet{Opcode: SendOnly, Payload: make([]byte, 8192)}).Append(nil, Endpoints{})
	require.NoError(t, err)
	rawFrom := raw.LocalAddr().(*net.UDPAddr).AddrPort()
	ud, err := (&Packet{Opcode: UDSendOnly, QKey: 1, SrcQP: 2, Payload: []byte("a UD SEND to an RC QP")}).Append(nil,
		Endpoints{Src: netip.AddrPortFrom(rawFrom.Addr().Unmap(), rawFrom.Port()), Dst: b.LocalAddr()})
	require.NoError(t, err)
	for _, bad := range [][]byte{[]byte("garbage"), forOther[:20], forOther, huge, ud} {
		_, err := raw.WriteToUDPAddrPort(bad, b.LocalAddr())
		require.NoError(t, err)
	}
	require.NoError(t, a.Send(&good, b.LocalAddr()))
	got, _, err := b.Recv(buf)
	require.NoError(t, err)
	assert.Equal(t, "after the bad ones", string(got.Payload))
	st := b.Stats()
	assert.EqualValues(t, 5, st.Malformed)
	assert.EqualValues(t, 2, st.BadICRC, "the packet made for another sender, and the truncated one")
	assert.EqualValues(t, len(rcSamples())+1, st.Received)
	assert.EqualValues(t, len(rcSamples())+1, a.Stats().Sent)

	_, err = Listen(netip.MustParseAddrPort("0.0.0.0:0"), lim, Loss{})
	assert.Error(t, err, "an unspecified address cannot be the ICRC's")
	_, err = Listen(netip.MustParseAddrPort("127.0.0.1:0"), Limits{MTU: 1500, MaxMessage: 1}, Loss{})
	assert.Error(t, err)

	require.NoError(t, b.Close())
	_, _, err = b.Recv(buf)
	assert.ErrorIs(t, err, net.ErrClosed)
}

// The fault injector: with a seed, drops, duplicates and reorders are counted, and
// what arrives is what was sent less the drops plus the duplicates, some packets
// after their successors.
func TestLinkLoss(t *testing.T) {
	loss := Loss{Seed: 42, Drop: 0.1, Duplicate: 0.05, Reorder: 0.1}
	a, b := listen(t, "127.0.0.1:0", loss), listen(t, "127.0.0.2:0", Loss{})
	marker := listen(t, "127.0.0.3:0", Loss{})
	const n = 500
	// A reader drains b while the packets are sent (a socket buffer of 500 unread
	// packets would overflow and lose some on its own), until the marker comes.
	got := make(chan []uint32, 1)
	go func() {
		buf := make([]byte, BufferSize(lim))
		var psns []uint32
		for {
			p, from, err := b.Recv(buf)
			if err != nil || from == marker.LocalAddr() {
				got <- psns
				return
			}
			psns = append(psns, p.PSN)
		}
	}()
	for i := 0; i < n; i++ {
		require.NoError(t, a.Send(&Packet{Opcode: SendOnly, PSN: uint32(i)}, b.LocalAddr()))
	}
	require.NoError(t, a.Send(&Packet{Opcode: SendOnly, PSN: n}, b.LocalAddr())) // releases a held packet
	require.NoError(t, marker.Send(&Packet{Opcode: Acknowledge, Syndrome: SynACK}, b.LocalAddr()))
	var psns []uint32
	select {
	case psns = <-got:
	case <-time.After(30 * time.Second): // a hang detector, not a measurement
		t.Fatalf("the marker never came: the receiver's socket buffer overflowed (%+v)", b.Stats())
	}
	st := a.Stats()
	t.Logf("%+v", st)
	assert.Positive(t, st.Dropped)
	assert.Positive(t, st.Doubled)
	assert.Positive(t, st.Reordered)
	assert.EqualValues(t, n+1-st.Dropped+st.Doubled, len(psns), "on loopback nothing else is lost")
	out := 0
	for i := 1; i < len(psns); i++ {
		if psns[i] < psns[i-1] {
			out++
		}
	}
	// A held packet goes out after the next one sent, unless that one is dropped.
	assert.Positive(t, out, "reordered packets arrive after their successors")
	assert.LessOrEqual(t, uint64(out), st.Reordered)

	again := listen(t, "127.0.0.1:0", loss) // the same seed, the same faults
	sink := listen(t, "127.0.0.4:0", Loss{})
	for i := 0; i < n+1; i++ {
		require.NoError(t, again.Send(&Packet{Opcode: SendOnly, PSN: uint32(i)}, sink.LocalAddr()))
	}
	assert.Equal(t, st.Dropped, again.Stats().Dropped)
	assert.Equal(t, st.Doubled, again.Stats().Doubled)
}

func netipAP(s string) netip.AddrPort { return netip.MustParseAddrPort(s) }

// loopbacks are a sender's and a receiver's addresses over IPv4 and IPv6.
var loopbacks = [][2]string{{"127.0.0.1:0", "127.0.0.2:0"}, {"[::1]:0", "[::1]:0"}}

// listenPair listens on both addresses until the test ends; it skips the test
// where IPv6 has no loopback.
func listenPair(t *testing.T, addrs [2]string) (a, b *Link) {
	t.Helper()
	a, err := Listen(netip.MustParseAddrPort(addrs[0]), lim, Loss{})
	if err != nil && netip.MustParseAddrPort(addrs[0]).Addr().Is6() {
		t.Skipf("skipped: no IPv6 loopback here: %v", err)
	}
	require.NoError(t, err)
	t.Cleanup(func() { _ = a.Close() })
	return a, listen(t, addrs[1], Loss{})
}

// SendBatch and RecvBatch over IPv4 and IPv6: more packets than one sendmmsg or
// recvmmsg takes, of every size from none to the MTU, arrive in order, whole and
// from the sender's address, in batches no larger than the buffers given; Close
// ends a RecvBatch that waits, and a SendBatch after it fails.
func TestLinkBatches(t *testing.T) {
	for _, addrs := range loopbacks {
		t.Run(addrs[0], func(t *testing.T) {
			a, b := listenPair(t, addrs)
			const n = 3*maxBatch + 7
			sent := make([]Packet, n)
			for i := range sent {
				payload := make([]byte, (i*37)%(lim.MTU+1))
				for j := range payload {
					payload[j] = byte(i + j)
				}
				sent[i] = Packet{Opcode: SendOnly, PSN: uint32(i), Payload: payload}
			}
			got := make(chan error, 1)
			go func() { got <- a.SendBatch(sent, b.LocalAddr()) }()
			bufs := make([][]byte, 40)
			for i := range bufs {
				bufs[i] = make([]byte, BufferSize(lim))
			}
			pkts, froms := make([]Packet, len(bufs)), make([]netip.AddrPort, len(bufs))
			for next := 0; next < n; {
				k, err := b.RecvBatch(bufs, pkts, froms)
				require.NoError(t, err)
				require.LessOrEqual(t, k, len(bufs))
				for i := 0; i < k; i++ {
					require.EqualValues(t, next, pkts[i].PSN, "in order, none lost")
					require.Equal(t, a.LocalAddr(), froms[i])
					require.Equal(t, len(sent[next].Payload), len(pkts[i].Payload), "packet %d", next)
					require.True(t, bytes.Equal(sent[next].Payload, pkts[i].Payload), "packet %d", next)
					next++
				}
			}
			require.NoError(t, <-got)
			assert.EqualValues(t, n, a.Stats().Sent)
			assert.EqualValues(t, n, b.Stats().Received)

			waiting := make(chan error, 1)
			go func() {
				_, err := b.RecvBatch(bufs, pkts, froms)
				waiting <- err
			}()
			require.NoError(t, b.Close())
			assert.ErrorIs(t, <-waiting, net.ErrClosed)
			require.NoError(t, a.Close())
			assert.ErrorIs(t, a.SendBatch(sent[:1], b.LocalAddr()), net.ErrClosed)
		})
	}
}
