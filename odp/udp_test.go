package odp

import (
	"bytes"
	"context"
	"encoding/binary"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"testing"
	"time"

	"github.com/odpemu/odpemu/transport/roce"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// wireUDP reports whether pair connects its nodes over UDP (ODPEMU_WIRE=udp): the
// whole suite then runs over real sockets instead of the in-process pipe.
func wireUDP() bool { return os.Getenv("ODPEMU_WIRE") == "udp" }

// connectUDP connects a (Dial) to b (Accept) over UDP on loopback addresses, with
// the connection manager on a TCP port of its own.
func connectUDP(t testing.TB, a, b *QP, ca, cb UDPConfig) {
	t.Helper()
	ln, err := roce.ListenCM("127.0.0.1:0")
	require.NoError(t, err)
	defer func() { _ = ln.Close() }() // accepted or failed: the listener is done
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	accepted := make(chan error, 1)
	go func() {
		_, err := b.Accept(ctx, ln, cb)
		accepted <- err
	}()
	_, err = a.Dial(ctx, ln.Addr().String(), ca)
	require.NoError(t, err)
	require.NoError(t, <-accepted)
}

var (
	addrA = netip.MustParseAddrPort("127.0.0.1:0")
	addrB = netip.MustParseAddrPort("127.0.0.2:0")
)

// WRITE, READ, SEND with immediate and atomics between ODP MRs over UDP, without
// and with 1% of the packets lost (and some duplicated and reordered) on both
// sides, and without loss with UDP segmentation offload: the data arrives whole,
// completions are right, with loss the retransmissions are counted, and with GSO
// the runs left in segmented datagrams.
func TestUDPDataWithLoss(t *testing.T) {
	for _, c := range []struct {
		name string
		loss float64
		gso  bool
	}{{"0", 0, false}, {"0.01", 0.01, false}, {"gso", 0, true}} {
		loss := c.loss
		t.Run(c.name, func(t *testing.T) {
			cfg := Config{Link: LinkModel{GSO: c.gso}}
			a, b := newNode(t, cfg), newNode(t, cfg)
			inj := roce.Loss{Seed: 11, Drop: loss, Duplicate: loss / 2, Reorder: loss}
			connectUDP(t, a.qp, b.qp, UDPConfig{Addr: addrA, Loss: inj}, UDPConfig{Addr: addrB, Loss: inj})
			// With loss, a lost tail packet costs one timeout: 16.8 ms. Without, the
			// default (1.07 s) stays: the assertion below that nothing timed out must
			// not depend on a loaded machine never stalling the test for 16.8 ms (a
			// fresh-clone CI run beside two other race-detector runs did, once).
			if loss > 0 {
				for _, n := range []*node{a, b} {
					require.NoError(t, n.qp.ModifyAttr(QPAttr{Timeout: 12}, AttrTimeout))
				}
			}
			const size = 1 << 20
			src, smr := a.region(t, size, rwa|AccessOnDemand)
			back, bmr := a.region(t, size, rwa|AccessOnDemand)
			dst, dmr := b.region(t, size, rwa|AccessOnDemand)
			rng := rand.New(rand.NewPCG(3, 4))
			for i := range src {
				src[i] = byte(rng.Uint32())
			}
			for round := 0; round < 4; round++ {
				off := round * (size / 4)
				wc := a.post(t, write(smr, off, size/4, dmr, uint64(off)))
				require.Equal(t, WCSuccess, wc.Status, wc.Detail)
				wc = a.post(t, read(bmr, off, size/4, dmr, uint64(off)))
				require.Equal(t, WCSuccess, wc.Status, wc.Detail)
				require.True(t, bytes.Equal(src[off:off+size/4], back[off:off+size/4]), "round %d read back", round)
			}
			assert.True(t, bytes.Equal(src, dst))

			require.NoError(t, b.qp.PostRecv(RecvWR{WRID: 5, SGL: sge(dmr, 0, 64<<10)}))
			wc := a.post(t, SendWR{WRID: 6, Opcode: OpSendImm, Imm: 0xfeed, SGL: sge(smr, 4096, 64<<10)})
			require.Equal(t, WCSuccess, wc.Status, wc.Detail)
			rwc := wait(t, b.rcq)
			require.Equal(t, WCSuccess, rwc.Status, rwc.Detail)
			assert.EqualValues(t, 0xfeed, rwc.ImmData)
			assert.EqualValues(t, 64<<10, rwc.ByteLen)
			assert.True(t, bytes.Equal(src[4096:4096+64<<10], dst[:64<<10]))

			binary.NativeEndian.PutUint64(dst[8:], 40)
			for i := 0; i < 10; i++ {
				wc := a.post(t, fetchAdd(bmr, 0, dmr, 8))
				require.Equal(t, WCSuccess, wc.Status, wc.Detail)
				assert.EqualValues(t, 40+i, binary.NativeEndian.Uint64(back[:8]), "fetch-add %d: the original value", i)
			}
			assert.EqualValues(t, 50, binary.NativeEndian.Uint64(dst[8:]), "each fetch-add executed once")

			st := a.qp.Stats()
			t.Logf("loss %v: requester %+v", loss, st)
			if loss > 0 {
				assert.Positive(t, st.Retransmissions)
				assert.Positive(t, st.SeqNaksReceived+st.Timeouts, "losses were noticed")
			} else { // only RNR NAKs (b's ODP faults) cause retransmissions
				assert.Zero(t, st.SeqNaksReceived+st.Timeouts+st.Duplicates)
			}
			bst := b.qp.Stats()
			switch {
			case !c.gso:
				assert.Zero(t, st.LinkSegmented+bst.LinkSegmented)
			case st.LinkGSORefused+bst.LinkGSORefused > 0:
				t.Log("this kernel refused UDP_SEGMENT: the packets went one by one")
			default:
				assert.Positive(t, st.LinkSegmented, "the WRITEs' packets")
				assert.Positive(t, bst.LinkSegmented, "the READ responses")
				assert.Greater(t, st.LinkSegmentedPackets, st.LinkSegmented)
			}
		})
	}
}

// An orderly disconnect (rdma_disconnect) flushes what is outstanding on both
// sides: a SEND that waits for a receive completes with WR_FLUSH_ERR.
func TestUDPDisconnectFlushes(t *testing.T) {
	a, b := newNode(t, Config{}), newNode(t, Config{})
	connectUDP(t, a.qp, b.qp, UDPConfig{Addr: addrA}, UDPConfig{Addr: addrB})
	_, smr := a.region(t, 4096, rw)
	require.NoError(t, a.qp.PostSend(SendWR{WRID: 1, Opcode: OpSend, SGL: sge(smr, 0, 64), Flags: SendSignaled}))
	for a.qp.Stats().RNRNaksReceived == 0 { // b has no receive: RNR NAKs, retried forever
		time.Sleep(time.Millisecond) // polling a counter, not standing in for an event
	}
	require.NoError(t, b.qp.Disconnect())
	wc := wait(t, a.scq)
	assert.Equal(t, WCWRFlushErr, wc.Status, wc.Detail)
	assert.Equal(t, StateError, a.qp.State())
	assert.Equal(t, StateError, b.qp.State())
}

// A peer that vanishes without a word is detected by the retry counter: the
// requester times out RetryCnt+1 times and fails with RETRY_EXC_ERR; nothing hangs.
func TestUDPLostPeer(t *testing.T) {
	a := newNode(t, Config{})
	silent, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 2)})
	require.NoError(t, err)
	defer func() { _ = silent.Close() }() // reads nothing: every packet is lost
	ep, err := roce.OpenEndpoint(addrA)
	require.NoError(t, err)
	defer func() { require.NoError(t, ep.Close()) }()
	port, err := ep.Attach(roce.AttachConfig{QPN: a.qp.QPNum(), Peer: silent.LocalAddr().(*net.UDPAddr).AddrPort(),
		Limits: roce.Limits{MTU: 1024, MaxMessage: 1 << 20}})
	require.NoError(t, err)
	require.NoError(t, a.qp.ModifyAttr(QPAttr{Timeout: 10, RetryCnt: 2}, AttrTimeout|AttrRetryCnt))
	require.NoError(t, a.qp.Connect(port, Remote{QPN: 9, PSN: 1}))
	_, smr := a.region(t, 4096, rw)
	wc := a.post(t, SendWR{WRID: 1, Opcode: OpRDMAWrite, SGL: sge(smr, 0, 64), RemoteAddr: 0x1000, RKey: 5})
	assert.Equal(t, WCRetryExcErr, wc.Status, wc.Detail)
	st := a.qp.Stats()
	assert.EqualValues(t, 3, st.Timeouts, "the first sending and RetryCnt retransmissions, each timed out")
	assert.EqualValues(t, 1, st.RetryExc)
}

// hostile is a peer that speaks raw RoCEv2 from a UDP socket: it sends what it
// likes to a live QP and reads what comes back.
type hostile struct {
	t    *testing.T
	conn *net.UDPConn
	ep   roce.Endpoints // from the hostile socket to the QP's Link
	qpn  uint32         // the QP's number
	psn  uint32         // the QP's expected PSN
	lim  roce.Limits
	qp   *QP // the QP under attack
}

// newHostile connects to qp (Accept on its side) through the connection manager.
func newHostile(t *testing.T, qp *QP) *hostile {
	conn, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 3)})
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() }) // the test is over
	ln, err := roce.ListenCM("127.0.0.1:0")
	require.NoError(t, err)
	defer func() { _ = ln.Close() }() // one connection is all it takes
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	accepted := make(chan error, 1)
	go func() {
		_, err := qp.Accept(ctx, ln, UDPConfig{Addr: addrB, MTU: 1024, MaxMessage: 1 << 16})
		accepted <- err
	}()
	local := conn.LocalAddr().(*net.UDPAddr).AddrPort()
	server, cm, err := roce.DialCM(ctx, ln.Addr().String(), roce.ConnParams{QPN: 0x77, PSN: 100, MTU: 1024, Addr: local})
	require.NoError(t, err)
	require.NoError(t, <-accepted)
	t.Cleanup(func() { _ = cm.Disconnect() }) // the QP goes to ERR with it
	return &hostile{t: t, conn: conn, ep: roce.Endpoints{Src: local, Dst: server.Addr}, qpn: server.QPN, psn: 100,
		lim: roce.Limits{MTU: 4096, MaxMessage: 1 << 20}, qp: qp}
}

// send encodes p for the QP and sends it.
func (h *hostile) send(p roce.Packet) {
	p.DestQP, p.PKey = h.qpn, 0xffff
	b, err := p.Append(nil, h.ep)
	require.NoError(h.t, err)
	h.raw(b)
}

func (h *hostile) raw(b []byte) {
	_, err := h.conn.WriteToUDPAddrPort(b, h.ep.Dst)
	require.NoError(h.t, err)
}

// recv returns the next packet the QP sends, failing after 10 s.
func (h *hostile) recv() roce.Packet {
	buf := make([]byte, 8192)
	require.NoError(h.t, h.conn.SetReadDeadline(time.Now().Add(10*time.Second)))
	n, from, err := h.conn.ReadFromUDPAddrPort(buf)
	require.NoError(h.t, err, "no answer from the QP")
	// The QP sends from a port of its own (its entropy), to this socket.
	require.Equal(h.t, h.ep.Dst.Addr(), from.Addr())
	p, err := roce.Decode(buf[:n], roce.Endpoints{Src: from, Dst: h.ep.Src}, h.lim)
	require.NoError(h.t, err)
	return p
}

// write sends a one-packet WRITE at the next PSN and returns the answer.
func (h *hostile) write(rkey uint32, va uint64, data []byte) roce.Packet {
	h.send(roce.Packet{Opcode: roce.WriteOnly, PSN: h.psn, AckReq: true, RKey: rkey, VA: va, DMALen: uint32(len(data)), Payload: data})
	h.psn++
	return h.recv()
}

// Hostile peers against a live QP: wrong rkeys, ranges and lengths get NAKs,
// truncated and garbage datagrams are dropped, a replayed PSN is acknowledged but
// not executed again, a disconnect in the middle of a message leaves memory alone
// but for the packets of it that arrived.
// The MR is only written by the requests that are valid, and another QP of the same
// device keeps working throughout.
func TestHostilePeer(t *testing.T) {
	b := newNode(t, Config{})
	mem, mr := b.region(t, 64<<10, rw|AccessOnDemand)
	amem, amr := b.region(t, 4096, rwa|AccessOnDemand)
	good := newNode(t, Config{})
	gqp, err := b.pd.CreateQP(QPConfig{SendCQ: b.scq, RecvCQ: b.rcq})
	require.NoError(t, err)
	require.NoError(t, ConnectLoopback(good.qp, gqp))
	gsrc, gmr := good.region(t, 4096, rw)
	want := make([]byte, len(mem)) // what the MR must hold
	otherQPWorks := func(round int) {
		fill(gsrc, byte(round))
		wc := good.post(t, write(gmr, 0, 512, mr, 60<<10))
		require.Equal(t, WCSuccess, wc.Status, wc.Detail)
		copy(want[60<<10:], gsrc[:512])
	}
	payload := bytes.Repeat([]byte{0xab}, 256)
	nakOf := func(p roce.Packet) roce.Syndrome {
		require.Equal(t, roce.Acknowledge, p.Opcode)
		return p.Syndrome
	}

	cases := []struct {
		name string
		run  func(h *hostile)
	}{
		{"wrong rkey", func(h *hostile) {
			assert.Equal(t, roce.SynNAKRemoteAccess, nakOf(h.write(mr.RKey()+1, mr.Addr(), payload)))
		}},
		{"out of range", func(h *hostile) {
			assert.Equal(t, roce.SynNAKRemoteAccess, nakOf(h.write(mr.RKey(), mr.Addr()+64<<10-100, payload)))
		}},
		{"oversized length", func(h *hostile) {
			// A WRITE FIRST whose RETH claims more than the QP's largest message.
			h.send(roce.Packet{Opcode: roce.WriteFirst, PSN: h.psn, RKey: mr.RKey(), VA: mr.Addr(), DMALen: 1 << 30,
				Payload: make([]byte, 1024)})
			assert.Equal(t, roce.SynNAKInvalidRequest, nakOf(h.recv()))
		}},
		{"truncated and garbage", func(h *hostile) {
			p := roce.Packet{Opcode: roce.WriteOnly, PSN: h.psn, AckReq: true, RKey: mr.RKey(), VA: mr.Addr(),
				DMALen: 256, Payload: payload, DestQP: h.qpn, PKey: 0xffff}
			b, err := p.Append(nil, h.ep)
			require.NoError(t, err)
			h.raw(b[:len(b)-10])                     // truncated
			h.raw([]byte("not an RC packet at all")) // garbage
			bad := append([]byte(nil), b...)
			bad[len(bad)-1] ^= 1 // a wrong ICRC
			h.raw(bad)
			// None of it was taken: the same PSN, sent whole, is executed.
			h.psn++
			h.raw(b)
			ack := h.recv()
			assert.Equal(t, roce.SynACK, nakOf(ack))
			copy(want, payload)
		}},
		{"replayed PSN", func(h *hostile) {
			first := bytes.Repeat([]byte{1}, 256)
			assert.Equal(t, roce.SynACK, nakOf(h.write(mr.RKey(), mr.Addr()+4096, first)))
			copy(want[4096:], first)
			h.psn-- // the same PSN again, with other bytes: a duplicate, not executed
			assert.Equal(t, roce.SynACK, nakOf(h.write(mr.RKey(), mr.Addr()+4096, bytes.Repeat([]byte{2}, 256))))
		}},
		{"late duplicate atomic", func(h *hostile) {
			// 17 FETCH_ADDs of 1 to one word, then the first of them again: older
			// than the 16 results a responder keeps (class D), so it is dropped
			// unanswered, as rxe drops it, and the QP goes on: the next WRITE is
			// acknowledged and nothing was added twice.
			const at = 64
			first := h.psn
			for i := range 17 {
				h.send(roce.Packet{Opcode: roce.FetchAdd, PSN: h.psn, AckReq: true, RKey: amr.RKey(), VA: amr.Addr() + at, Swap: 1})
				h.psn++
				resp := h.recv()
				require.Equal(h.t, roce.AtomicAck, resp.Opcode, "FETCH_ADD %d: %v", i, resp.Syndrome)
				assert.EqualValues(h.t, i, resp.Orig)
			}
			h.send(roce.Packet{Opcode: roce.FetchAdd, PSN: first, AckReq: true, RKey: amr.RKey(), VA: amr.Addr() + at, Swap: 1})
			// A recent duplicate is answered from the saved result, not executed.
			h.send(roce.Packet{Opcode: roce.FetchAdd, PSN: h.psn - 1, AckReq: true, RKey: amr.RKey(), VA: amr.Addr() + at, Swap: 1})
			resp := h.recv()
			require.Equal(h.t, roce.AtomicAck, resp.Opcode, "the late duplicate got no answer; the recent one its result")
			assert.EqualValues(h.t, 16, resp.Orig)
			assert.EqualValues(h.t, 17, binary.LittleEndian.Uint64(amem[at:]))
			assert.Equal(h.t, roce.SynACK, nakOf(h.write(mr.RKey(), mr.Addr()+4096, payload)), "the QP still works")
			copy(want[4096:], payload)
			assert.Equal(h.t, StateRTS, h.qp.State())
		}},
		{"duplicate READ", func(h *hostile) {
			// A READ, then the same PSN again naming more than the original (dropped:
			// rxe re-executes only the original range or a part of it, under the same
			// key), then naming a part of it (answered with that part's bytes now).
			read := func(psn uint32, va uint64, n int) {
				h.send(roce.Packet{Opcode: roce.ReadRequest, PSN: psn, AckReq: true, RKey: mr.RKey(), VA: va, DMALen: uint32(n)})
			}
			first := h.psn
			read(first, mr.Addr()+16<<10, 512)
			h.psn++
			resp := h.recv()
			require.Equal(h.t, roce.ReadRespOnly, resp.Opcode, "%v", resp.Syndrome)
			assert.Equal(h.t, want[16<<10:16<<10+512], resp.Payload)
			read(first, mr.Addr()+16<<10, 1024)    // beyond the original
			read(first, mr.Addr()+32<<10, 256)     // elsewhere
			read(first, mr.Addr()+16<<10+128, 256) // a part of it
			resp = h.recv()
			require.Equal(h.t, roce.ReadRespOnly, resp.Opcode, "the first two were dropped unanswered")
			assert.Equal(h.t, want[16<<10+128:16<<10+384], resp.Payload)
			assert.Equal(h.t, roce.SynACK, nakOf(h.write(mr.RKey(), mr.Addr()+4096, payload)), "the QP still works")
			copy(want[4096:], payload)
			assert.Equal(h.t, StateRTS, h.qp.State())
		}},
		{"disconnect mid-message", func(h *hostile) {
			h.send(roce.Packet{Opcode: roce.WriteFirst, PSN: h.psn, RKey: mr.RKey(), VA: mr.Addr() + 8192, DMALen: 2048,
				Payload: bytes.Repeat([]byte{3}, 1024)})
		}},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			qp, err := b.pd.CreateQP(QPConfig{SendCQ: b.scq, RecvCQ: b.rcq})
			require.NoError(t, err)
			h := newHostile(t, qp)
			h.t = t
			tc.run(h)
			require.NoError(t, qp.Destroy()) // disconnects, mid-message or not
			if first := bytes.Repeat([]byte{3}, 1024); tc.name == "disconnect mid-message" && bytes.Equal(mem[8192:9216], first) {
				// A NIC places a WRITE's packets as they arrive: the FIRST may have
				// landed (an incomplete WRITE leaves its target undefined), nothing
				// else did.
				copy(want[8192:], first)
			}
			otherQPWorks(i)
			require.NoError(t, b.dev.SyncEvents())
			assert.True(t, bytes.Equal(want, mem), "the MR holds what valid requests wrote, nothing else")
		})
	}
}

// TestAttachRoCEAddrInUse: a local address whose RoCEv2 port another socket holds
// (another process on the same address) fails the attach with ErrAddrInUse,
// EADDRINUSE to a verbs caller, and leaves the QP as it was.
func TestAttachRoCEAddrInUse(t *testing.T) {
	taken, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 41), Port: roce.UDPPort})
	require.NoError(t, err)
	defer func() { require.NoError(t, taken.Close()) }()
	a := newNode(t, Config{})
	err = a.qp.AttachRoCE(netip.MustParseAddrPort("127.0.0.41:4791"), netip.MustParseAddrPort("127.0.0.42:4791"),
		Remote{QPN: 2, PSN: 1}, 1024)
	require.ErrorIs(t, err, ErrAddrInUse)
	assert.Equal(t, unix.EADDRINUSE, Errno(err))
	assert.Equal(t, StateReset, a.qp.State())
}

// TestConnectRoCE connects two QPs as verbs programs do: QP numbers and PSNs exchanged
// by the application, each QP on its process's RoCEv2 endpoint at port 4791, moved to
// RTR (its responder answers from then on) and to RTS (it sends from the PSN the
// application chose), or connected at once.
func TestConnectRoCE(t *testing.T) {
	a, b := newNode(t, Config{}), newNode(t, Config{})
	ea, eb := netip.MustParseAddrPort("127.0.0.6:4791"), netip.MustParseAddrPort("127.0.0.7:4791")
	const pa, pb = 77, 1<<24 - 1
	require.ErrorIs(t, a.qp.AttachRoCE(ea, netip.MustParseAddrPort("[::1]:4791"), Remote{QPN: b.qp.QPNum(), PSN: pb},
		4096), ErrInvalidArgument, "a peer of another address family")
	require.NoError(t, a.qp.AttachRoCE(ea, netip.AddrPortFrom(eb.Addr(), 0), Remote{QPN: b.qp.QPNum(), PSN: pb}, 1024))
	require.Equal(t, StateRTR, a.qp.State())
	require.ErrorIs(t, a.qp.PostSend(SendWR{Opcode: OpSend}), ErrQPState, "RTR cannot send")
	require.NoError(t, a.qp.SetSendPSN(pa))
	require.NoError(t, a.qp.Modify(StateRTS))
	require.ErrorIs(t, a.qp.SetSendPSN(5), ErrQPState, "its PSN is in use in RTS")
	// b stays in RTR, as perftest's server does: its responder answers.
	require.NoError(t, b.qp.AttachRoCE(eb, ea, Remote{QPN: a.qp.QPNum(), PSN: pa}, 1024))

	src, smr := a.region(t, 5000, rw)
	dst, dmr := b.region(t, 5000, rw)
	for i := range src {
		src[i] = byte(i * 3)
	}
	require.NoError(t, b.qp.PostRecv(RecvWR{WRID: 9, SGL: sge(dmr, 0, len(dst))}))
	require.NoError(t, a.qp.PostSend(SendWR{WRID: 1, Opcode: OpSend, SGL: sge(smr, 0, len(src)), Flags: SendSignaled}))
	wc := wait(t, a.scq)
	require.Equal(t, WCSuccess, wc.Status, wc.Detail)
	wc = wait(t, b.rcq)
	require.Equal(t, WCSuccess, wc.Status, wc.Detail)
	require.Equal(t, uint32(len(src)), wc.ByteLen)
	require.Equal(t, src, dst)
	// and back, from the PSN b chose in RTR
	require.NoError(t, b.qp.SetSendPSN(pb))
	require.NoError(t, b.qp.Modify(StateRTS))
	require.NoError(t, b.qp.PostSend(SendWR{WRID: 2, Opcode: OpRDMAWrite, SGL: sge(dmr, 0, 100), Flags: SendSignaled,
		RemoteAddr: smr.Addr() + 4000, RKey: smr.RKey()}))
	wc = wait(t, b.scq)
	require.Equal(t, WCSuccess, wc.Status, wc.Detail)
	require.Equal(t, dst[:100], src[4000:4100])

	// ConnectRoCE: both steps at once.
	c, d := newNode(t, Config{}), newNode(t, Config{})
	require.NoError(t, c.qp.ConnectRoCE(ea, eb, Remote{QPN: d.qp.QPNum(), PSN: d.qp.PSN()}, 4096))
	require.NoError(t, d.qp.ConnectRoCE(eb, ea, Remote{QPN: c.qp.QPNum(), PSN: c.qp.PSN()}, 4096))
	_, cmr := c.region(t, 4096, rw)
	_, xmr := d.region(t, 4096, rw)
	require.NoError(t, c.qp.PostSend(SendWR{WRID: 3, Opcode: OpRDMAWrite, SGL: sge(cmr, 0, 4096), Flags: SendSignaled,
		RemoteAddr: xmr.Addr(), RKey: xmr.RKey()}))
	require.Equal(t, WCSuccess, wait(t, c.scq).Status)
}

// A setup that fails after the accepting QP attached leaves that QP in ERR, as a
// connection that broke: here the dialing QP cannot attach (it is in ERR already),
// so it sends no RTU, and Accept fails.
func TestAcceptWithoutRTU(t *testing.T) {
	a, b := newNode(t, Config{}), newNode(t, Config{})
	require.NoError(t, a.qp.Modify(StateError))
	ln, err := roce.ListenCM("127.0.0.1:0")
	require.NoError(t, err)
	defer func() { _ = ln.Close() }() // the test's listener
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	accepted := make(chan error, 1)
	go func() {
		_, err := b.qp.Accept(ctx, ln, UDPConfig{Addr: addrB})
		accepted <- err
	}()
	_, err = a.qp.Dial(ctx, ln.Addr().String(), UDPConfig{Addr: addrA})
	require.Error(t, err)
	assert.Equal(t, StateError, a.qp.State(), "the dialing QP as it was")
	require.ErrorIs(t, <-accepted, roce.ErrCM, "no RTU")
	assert.Equal(t, StateError, b.qp.State(), "attached, then the setup failed")
}
