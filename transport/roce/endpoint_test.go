package roce

import (
	"net/netip"
	"runtime"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// One endpoint, two QPs: each packet goes to the QP its BTH names, whatever the
// sender's port; a packet for a QPN no QP has is dropped and counted, and so is one
// from an address that is not the QP's peer.
func TestEndpointDemultiplexesByQPN(t *testing.T) {
	ep, err := OpenEndpoint(netip.MustParseAddrPort("127.0.0.1:0"))
	require.NoError(t, err)
	defer func() { require.NoError(t, ep.Close()) }()
	peer := listen(t, "127.0.0.2:0", Loss{})
	stranger := listen(t, "127.0.0.3:0", Loss{})

	qpns := []uint32{0x11, 0x22}
	ports := map[uint32]Port{}
	woken := map[uint32]chan struct{}{}
	for _, qpn := range qpns {
		p, err := ep.Attach(AttachConfig{QPN: qpn, Peer: peer.LocalAddr(), Limits: lim})
		require.NoError(t, err)
		defer func() { require.NoError(t, p.Close()) }()
		ch := make(chan struct{}, 1)
		p.SetWake(func() {
			select {
			case ch <- struct{}{}:
			default:
			}
		})
		ports[qpn], woken[qpn] = p, ch
	}
	_, err = ep.Attach(AttachConfig{QPN: 0x11, Peer: peer.LocalAddr(), Limits: lim})
	require.Error(t, err, "a QPN is attached once")
	assert.Equal(t, 2, ep.Stats().QPs)

	send := func(from *Link, qpn, psn uint32) {
		p := Packet{Opcode: SendOnly, PKey: 0xffff, DestQP: qpn, PSN: psn, AckReq: true, Payload: []byte("x")}
		require.NoError(t, from.Send(&p, ep.Addr()))
	}
	send(peer, 0x33, 1)     // no such QP
	send(stranger, 0x11, 2) // not the peer
	for i := uint32(0); i < 8; i++ {
		send(peer, qpns[i%2], 100+i)
	}
	// What each QP received: its own packets in order, no other's.
	for k, qpn := range qpns {
		var psns []uint32
		takeRuns(t, ports[qpn], woken[qpn], 4, func(_ int, s *Segment) {
			assert.Equal(t, qpn, s.DestQP)
			psns = append(psns, s.PSN)
		})
		want := []uint32{100 + uint32(k), 102 + uint32(k), 104 + uint32(k), 106 + uint32(k)}
		assert.Equal(t, want, psns, "QP %#x", qpn)
	}
	st := ep.Stats()
	assert.EqualValues(t, 1, st.UnknownQP, "the packet for QPN 0x33")
	assert.EqualValues(t, 1, st.Foreign, "the packet from another address")
}

// recvUD waits for n datagrams on p, failing the test after 10 s.
func recvUD(t *testing.T, p *DatagramPort, woken chan struct{}, n int) []Datagram {
	t.Helper()
	var got []Datagram
	buf := make([]Datagram, 8)
	deadline := time.After(10 * time.Second)
	for len(got) < n {
		k, _, err := p.RecvFrom(buf, time.Now())
		require.NoError(t, err)
		got = append(got, buf[:k]...)
		if k == 0 {
			select {
			case <-woken:
			case <-deadline:
				t.Fatalf("received %d of %d datagrams", len(got), n)
			}
		}
	}
	return got
}

// UD QPs on two endpoints: a datagram goes to the QP its BTH names from any sender,
// carries its DETH and its sender's address; an RC packet to a UD QP and a UD packet
// to an RC QP are malformed and counted; what SendTo refuses sends nothing.
func TestEndpointUD(t *testing.T) {
	ep1, ep2 := twoEndpoints(t)
	attach := func(ep *Endpoint, qpn uint32) (*DatagramPort, chan struct{}) {
		p, err := ep.AttachUD(UDConfig{QPN: qpn, MTU: 1024})
		require.NoError(t, err)
		t.Cleanup(func() { require.NoError(t, p.Close()) })
		ch := make(chan struct{}, 1)
		p.SetWake(func() {
			select {
			case ch <- struct{}{}:
			default:
			}
		})
		return p, ch
	}
	a, _ := attach(ep1, 0x100)
	c, _ := attach(ep1, 0x300)
	b, bWoken := attach(ep2, 0x200)
	_, err := ep2.AttachUD(UDConfig{QPN: 0x200, MTU: 1024})
	require.Error(t, err, "a QPN is attached once")
	_, err = ep2.AttachUD(UDConfig{QPN: 0x201, MTU: 1000})
	require.Error(t, err, "not a path MTU")
	_, err = ep2.Attach(AttachConfig{QPN: 0x202, Peer: ep1.Addr(), Limits: Limits{MTU: 1024, MaxMessage: 1024, UD: true}})
	require.Error(t, err, "Attach is for connected QPs")

	dgram := func(src uint32, imm bool, payload string) Packet {
		p := Packet{Opcode: UDSendOnly, PKey: 0xffff, DestQP: 0x200, QKey: 0x11111111, SrcQP: src, Payload: []byte(payload)}
		if imm {
			p.Opcode, p.Imm = UDSendOnlyImm, 0xabcd
		}
		return p
	}
	now := time.Now()
	require.NoError(t, a.SendTo([]Packet{dgram(0x100, false, "one"), dgram(0x100, true, "two")}, ep2.Addr(), now))
	require.NoError(t, c.SendTo([]Packet{dgram(0x300, false, "three")}, ep2.Addr(), now))
	got := recvUD(t, b, bWoken, 3)
	var payloads []string
	for i := range got {
		d := &got[i]
		assert.Equal(t, netip.MustParseAddr("127.0.0.1"), d.From.Addr(), "the sender's RoCEv2 address")
		assert.EqualValues(t, 0x11111111, d.QKey)
		payloads = append(payloads, string(d.Payload))
		switch string(d.Payload) {
		case "one", "two":
			assert.EqualValues(t, 0x100, d.SrcQP)
		case "three":
			assert.EqualValues(t, 0x300, d.SrcQP)
		}
		if string(d.Payload) == "two" {
			assert.Equal(t, UDSendOnlyImm, d.Opcode)
			assert.EqualValues(t, 0xabcd, d.Imm)
		}
		d.Release()
	}
	assert.ElementsMatch(t, []string{"one", "two", "three"}, payloads)

	// Refused by SendTo: nothing goes out.
	sent := a.Stats().Sent
	require.ErrorIs(t, a.SendTo([]Packet{dgram(0x100, false, "ok"), {Opcode: SendOnly, DestQP: 0x200}}, ep2.Addr(), now),
		ErrMalformed)
	require.ErrorIs(t, a.SendTo([]Packet{dgram(0x100, false, string(make([]byte, 1028)))}, ep2.Addr(), now), ErrMalformed)
	assert.Equal(t, sent, a.Stats().Sent)

	// The other transport's packets: malformed where they land.
	rc, err := ep2.Attach(AttachConfig{QPN: 0x400, Peer: ep1.Addr(), Limits: Limits{MTU: 1024, MaxMessage: 1 << 20}})
	require.NoError(t, err)
	defer func() { require.NoError(t, rc.Close()) }()
	raw := listen(t, "127.0.0.1:0", Loss{})
	require.NoError(t, raw.Send(&Packet{Opcode: SendOnly, DestQP: 0x200, Payload: []byte("rc")}, ep2.Addr()))
	ud := dgram(0x100, false, "to an RC QP")
	ud.DestQP = 0x400
	require.NoError(t, a.SendTo([]Packet{ud}, ep2.Addr(), now))
	require.NoError(t, a.SendTo([]Packet{dgram(0x100, false, "after")}, ep2.Addr(), time.Now()))
	got = recvUD(t, b, bWoken, 1)
	assert.Equal(t, "after", string(got[0].Payload))
	got[0].Release()
	// Sent before "after", but from other sockets: the counters show them once the
	// endpoint's loop has read them (a dropped packet wakes nobody).
	deadline := time.Now().Add(10 * time.Second)
	for (b.Stats().Malformed == 0 || rc.Stats().Malformed == 0) && time.Now().Before(deadline) {
		runtime.Gosched()
	}
	assert.EqualValues(t, 1, b.Stats().Malformed, "the RC SEND to the UD QP")
	assert.EqualValues(t, 1, rc.Stats().Malformed, "the UD SEND to the RC QP")

	require.NoError(t, c.Close())
	_, _, err = c.RecvFrom(make([]Datagram, 1), time.Now())
	require.ErrorIs(t, err, ErrClosed)
	require.ErrorIs(t, c.SendTo([]Packet{dgram(0x300, false, "x")}, ep2.Addr(), time.Now()), ErrClosed)
}
