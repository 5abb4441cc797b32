package roce

import (
	"bytes"
	"net/netip"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

func TestCmsgSpace(t *testing.T) { assert.Equal(t, unix.CmsgSpace(2), cmsgSpace) }

// group makes one datagram per run of equal-size packets: a shorter packet ends a
// run (as the last segment), a larger one starts the next, and a run holds at most
// maxSegments packets and maxGSOBytes; without GSO, one datagram per packet.
func TestGroupDatagrams(t *testing.T) {
	dst := netip.MustParseAddrPort("127.0.0.1:4791")
	groups := func(gso bool, sizes ...int) [][2]int {
		sc := new(sendScratch)
		for i, n := range sizes {
			sc.setIov(3*i, make([]byte, 12))
			sc.setIov(3*i+1, make([]byte, n-16))
			sc.setIov(3*i+2, make([]byte, 4))
		}
		msgs := sc.group(len(sizes), dst, false, gso)
		var out [][2]int // first packet, packets
		for m := 0; m < msgs; m++ {
			k := sc.packets(m)
			assert.Equal(t, k > 1, sc.segmented(m), "datagram %d: a control message only when segmented", m)
			assert.EqualValues(t, 3*k, sc.hdrs[m].Hdr.Iovlen, "datagram %d: its packets' vectors", m)
			out = append(out, [2]int{sc.first[m], k})
		}
		return out
	}
	repeat := func(n, size int) []int {
		s := make([]int, n)
		for i := range s {
			s[i] = size
		}
		return s
	}
	// A 1 MiB WRITE's first packets: FIRST (RETH) is longer than MIDDLE.
	write := append(append([]int{4128}, repeat(20, 4112)...), 100)
	assert.Equal(t, [][2]int{{0, 2}, {2, 15}, {17, 5}}, groups(true, write...), "15 x 4112 bytes fit in 65,507, 16 do not")
	assert.Len(t, groups(false, write...), len(write))
	assert.Equal(t, [][2]int{{0, 64}}, groups(true, repeat(64, 96)...))
	assert.Equal(t, [][2]int{{0, 1}, {1, 2}}, groups(true, 100, 200, 200), "a larger packet starts a datagram")
	assert.Equal(t, [][2]int{{0, 2}, {2, 1}}, groups(true, 200, 100, 100), "a shorter packet ends one")
}

// gsoPackets is a batch as an engine sends it: a long WRITE's packets, then small
// ones of two sizes.
func gsoPackets() []Packet {
	var pkts []Packet
	payload := func(i, n int) []byte {
		b := make([]byte, n)
		for j := range b {
			b[j] = byte(i*7 + j)
		}
		return b
	}
	for i := 0; i < 40; i++ {
		op := WriteMiddle
		switch i {
		case 0:
			op = WriteFirst
		case 39:
			op = WriteLast
		}
		p := Packet{Opcode: op, PSN: uint32(i), Payload: payload(i, lim.MTU)}
		if op == WriteFirst {
			p.VA, p.RKey, p.DMALen = 0x1000, 7, uint32(40*lim.MTU)
		}
		pkts = append(pkts, p)
	}
	for i := 40; i < 100; i++ {
		pkts = append(pkts, Packet{Opcode: SendOnly, PSN: uint32(i), Payload: payload(i, 64+(i/80)*64)})
	}
	return pkts
}

// receiveAll receives n packets on b and checks them against sent.
func receiveAll(t *testing.T, b *Link, from netip.AddrPort, sent []Packet) {
	t.Helper()
	bufs := make([][]byte, maxBatch)
	for i := range bufs {
		bufs[i] = make([]byte, BufferSize(lim))
	}
	pkts, froms := make([]Packet, len(bufs)), make([]netip.AddrPort, len(bufs))
	for next := 0; next < len(sent); {
		k, err := b.RecvBatch(bufs, pkts, froms)
		require.NoError(t, err)
		for i := 0; i < k; i++ {
			require.EqualValues(t, next, pkts[i].PSN, "in order, none lost")
			require.Equal(t, from, froms[i])
			require.Equal(t, sent[next].Opcode, pkts[i].Opcode)
			require.Equal(t, sent[next].VA, pkts[i].VA)
			require.Equal(t, sent[next].DMALen, pkts[i].DMALen)
			require.True(t, bytes.Equal(sent[next].Payload, pkts[i].Payload), "packet %d", next)
			next++
		}
	}
}

// With GSO on, a batch leaves in segmented datagrams and arrives as the packets
// sent, each decoding with its ICRC, over IPv4 and IPv6; the counters say how it
// went.
func TestSendBatchGSO(t *testing.T) {
	for _, addrs := range loopbacks {
		t.Run(addrs[0], func(t *testing.T) {
			a, b := listenPair(t, addrs)
			a.SetGSO(true)
			sent := gsoPackets()
			done := make(chan error, 1)
			go func() { done <- a.SendBatch(sent, b.LocalAddr()) }()
			receiveAll(t, b, a.LocalAddr(), sent)
			require.NoError(t, <-done)
			st := a.Stats()
			if st.GSORefused > 0 {
				t.Skip("skipped: this kernel refused UDP_SEGMENT (Linux 4.18) here; the packets went one by one")
			}
			assert.EqualValues(t, len(sent), st.Sent)
			assert.Positive(t, st.Segmented)
			assert.Less(t, st.Segmented, st.SegmentedPackets)
			assert.LessOrEqual(t, st.SegmentedPackets, st.Sent)
			assert.Zero(t, b.Stats().Malformed)
		})
	}
}

// When the kernel refuses a segmented datagram (here: a socket without UDP
// checksums, which segmentation needs), the Link sends what is left packet by
// packet and keeps doing so: nothing is lost.
func TestSendBatchGSORefused(t *testing.T) {
	a, b := listen(t, "127.0.0.1:0", Loss{}), listen(t, "127.0.0.2:0", Loss{})
	var serr error
	require.NoError(t, a.mm.rc.Control(func(fd uintptr) { serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_NO_CHECK, 1) }))
	require.NoError(t, serr)
	a.SetGSO(true)
	sent := gsoPackets()
	for round := 0; round < 2; round++ {
		done := make(chan error, 1)
		go func() { done <- a.SendBatch(sent, b.LocalAddr()) }()
		receiveAll(t, b, a.LocalAddr(), sent)
		require.NoError(t, <-done)
	}
	st := a.Stats()
	assert.EqualValues(t, 1, st.GSORefused)
	assert.Zero(t, st.Segmented)
	assert.EqualValues(t, 2*len(sent), st.Sent)
	assert.False(t, a.gso.Load())
}

// recvPort receives len(sent) packets on p and checks them against sent, in order.
func recvPort(t *testing.T, p Port, woken chan struct{}, sent []Packet) {
	t.Helper()
	takeRuns(t, p, woken, len(sent), func(i int, s *Segment) {
		require.EqualValues(t, i, s.PSN, "in order, none lost")
		require.Equal(t, sent[i].Opcode, s.Opcode)
		require.True(t, bytes.Equal(sent[i].Payload, s.Payload), "packet %d", i)
	})
}

// An endpoint with a QP attached with GSO turns UDP_GRO on: segmented datagrams
// then arrive whole, and each of their packets reaches its QP as sent; single
// datagrams still arrive as they are.
func TestEndpointGRO(t *testing.T) {
	ep, err := OpenEndpoint(netip.MustParseAddrPort("127.0.0.2:0"))
	require.NoError(t, err)
	defer func() { require.NoError(t, ep.Close()) }()
	sender := listen(t, "127.0.0.1:0", Loss{})
	p, err := ep.Attach(AttachConfig{QPN: 0xb, Peer: sender.LocalAddr(), Limits: lim, Link: LinkModel{GSO: true}})
	require.NoError(t, err)
	defer func() { require.NoError(t, p.Close()) }()
	woken := wakeChan(p)

	sent := gsoPackets()
	for i := range sent {
		sent[i].DestQP, sent[i].PKey = 0xb, 0xffff
	}
	for round := 0; round < 3; round++ { // the first may come before GRO is on
		sender.SetGSO(round < 2)
		require.NoError(t, sender.SendBatch(sent, ep.Addr()))
		recvPort(t, p, woken, sent)
	}
	st := ep.Stats()
	require.Zero(t, sender.Stats().GSORefused)
	assert.Positive(t, st.Coalesced, "the second round's segmented datagrams")
	assert.Greater(t, st.CoalescedPackets, st.Coalesced)
	assert.Zero(t, st.Malformed)
}
