package roce

import (
	"net/netip"
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
		segs := make([]Segment, 8)
		deadline := time.After(10 * time.Second)
		for len(psns) < 4 {
			n, _, err := ports[qpn].Recv(segs, time.Now())
			require.NoError(t, err)
			for _, s := range segs[:n] {
				assert.Equal(t, qpn, s.DestQP)
				psns = append(psns, s.PSN)
				s.Ref.Release()
			}
			if n == 0 {
				select {
				case <-woken[qpn]:
				case <-deadline:
					t.Fatalf("QP %#x received %d of 4 packets", qpn, len(psns))
				}
			}
		}
		want := []uint32{100 + uint32(k), 102 + uint32(k), 104 + uint32(k), 106 + uint32(k)}
		assert.Equal(t, want, psns, "QP %#x", qpn)
	}
	st := ep.Stats()
	assert.EqualValues(t, 1, st.UnknownQP, "the packet for QPN 0x33")
	assert.EqualValues(t, 1, st.Foreign, "the packet from another address")
}
