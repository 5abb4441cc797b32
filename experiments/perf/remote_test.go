package perf

import (
	"context"
	"net"
	"testing"
	"time"
	"unsafe"

	"github.com/odpemu/odpemu/transport/roce"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Serve and Connect run a test between two sides over RoCEv2/UDP: the client's
// numbers are perftest's, the server's are its network page faults and the RNR
// NAKs it sent (for WRITEs and SENDs, whose receives the server keeps posted; a
// READ's responder waits for its faults instead); with
// loss the client retransmits.
func TestServeConnect(t *testing.T) {
	for _, tc := range []struct {
		test string
		loss float64
	}{{WriteBW, 0}, {ReadBW, 0.01}, {SendBW, 0}} {
		t.Run(tc.test, func(t *testing.T) {
			ln, err := roce.ListenCM("127.0.0.1:0")
			require.NoError(t, err)
			defer func() { _ = ln.Close() }() // served
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			timeout := uint8(12) // a lost tail packet costs 16.8 ms
			p := Params{Test: tc.test, ODP: true, Size: 16 << 10, Iters: 300, Depth: 16, CQMod: 8,
				Loss: tc.loss, Seed: 9, Timeout: &timeout}
			var w Wire
			served := make(chan Result, 1)
			go func() {
				r, err := Serve(ctx, ln, p, w)
				assert.NoError(t, err)
				served <- r
			}()
			r, err := Connect(ctx, ln.Addr().String(), p, w)
			require.NoError(t, err)
			s := <-served
			assert.Equal(t, 300, r.Iters)
			assert.Positive(t, r.AvgMiBps)
			assert.Positive(t, s.PageFaults, "the server's ODP region faulted")
			if tc.test != ReadBW { // a SEND's receive buffer faults like a WRITE's target
				assert.Positive(t, s.RNRNaks, "and answered RNR NAKs")
			} else {
				assert.Zero(t, s.RNRNaks, "a READ's responder waits for its fault: no RNR NAK")
			}
			if tc.loss > 0 {
				assert.Positive(t, r.Retransmissions)
			}
		})
	}
}

// One round of the wire comparison, server and client in one process: each kind,
// cold passes too, measures a bandwidth, with either floor.
func TestWireRound(t *testing.T) {
	kinds := append(WireRound, "pinned-cold", "odp-cold")
	ln, err := roce.ListenCM("127.0.0.1:0")
	require.NoError(t, err)
	defer func() { _ = ln.Close() }() // served
	conn, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	require.NoError(t, err)
	defer func() { _ = conn.Close() }() // served
	SetBuffers(conn)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	for _, hot := range []bool{false, true} {
		p := Params{Test: WriteBW, Size: 256 << 10, Iters: 50, Depth: 4, CQMod: 1, MRSize: 1 << 20, HotFloor: hot}
		done := make(chan error, 1)
		go func() { done <- WireServer(ctx, ln, conn, p, Wire{}, 1, kinds) }()
		bw, err := WireClient(ctx, ln.Addr().String(), conn.LocalAddr().String(), p, Wire{}, 1, kinds)
		require.NoError(t, err)
		require.NoError(t, <-done)
		for _, kind := range kinds {
			require.Len(t, bw[kind], 1, kind)
			assert.Positive(t, bw[kind][0], kind)
		}
		kinds = WireRound // the cold passes once
	}
}

// The floor's stream moves a WRITE's bytes: the packets of Depth messages come from
// distinct slots that tile a region as large as the WRITEs' and repeat with the next
// Depth messages; with HotFloor every packet uses one buffer.
func TestStreamRegion(t *testing.T) {
	p := Params{Size: 1 << 20, Depth: 4}
	region, perMsg := streamRegion(p)
	require.Equal(t, 256, perMsg)
	require.Len(t, region, 4*256*streamPacket+1)
	next := 0
	for i := 0; i < p.Depth*perMsg; i++ {
		s := slot(region, i)
		require.Len(t, s, streamPacket+1, "a packet and a byte to tell a longer datagram")
		at := int(uintptr(unsafe.Pointer(&s[0])) - uintptr(unsafe.Pointer(&region[0])))
		require.Equal(t, next, at, "packet %d follows the one before", i)
		next += streamPacket
		again := slot(region, i+p.Depth*perMsg)
		require.Equal(t, &s[0], &again[0], "the next Depth messages reuse the slots")
	}
	p.HotFloor = true
	hot, _ := streamRegion(p)
	require.Len(t, hot, streamPacket+1)
	for _, i := range []int{0, 1, 255, 1000} {
		require.Equal(t, &hot[0], &slot(hot, i)[0])
	}
}

// A server turns away a connection whose handshake fails (a port probe that closes
// at once, a peer that sends garbage), says so, and serves the next client.
func TestServeSurvivesBadHandshakes(t *testing.T) {
	ln, err := roce.ListenCM("127.0.0.1:0")
	require.NoError(t, err)
	defer func() { _ = ln.Close() }() // served
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	p := Params{Test: WriteBW, Size: 4096, Iters: 20, Depth: 4, CQMod: 1}
	rejected := make(chan error, 2)
	served := make(chan error, 1)
	go func() {
		_, err := Serve(ctx, ln, p, Wire{Rejected: func(err error) { rejected <- err }})
		served <- err
	}()
	probe, err := net.Dial("tcp", ln.Addr().String())
	require.NoError(t, err)
	require.NoError(t, probe.Close())
	require.ErrorIs(t, <-rejected, roce.ErrCM)
	garbage, err := net.Dial("tcp", ln.Addr().String())
	require.NoError(t, err)
	_, err = garbage.Write([]byte("GET / HTTP/1.0\r\n\r\n and more than a header's worth of bytes"))
	require.NoError(t, err)
	require.ErrorIs(t, <-rejected, roce.ErrCM)
	require.NoError(t, garbage.Close())

	r, err := Connect(ctx, ln.Addr().String(), p, Wire{})
	require.NoError(t, err)
	assert.Equal(t, 20, r.Iters)
	require.NoError(t, <-served)
}
