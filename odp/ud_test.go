package odp

import (
	"encoding/binary"
	"net/netip"
	"runtime"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// udNode is a node whose QP is a UD QP bound to addr (port 0: the kernel picks one).
func udNode(t *testing.T, cfg Config, addr string, qkey uint32) *node {
	t.Helper()
	n := newNode(t, cfg)
	require.NoError(t, n.qp.Destroy())
	qp, err := n.pd.CreateQP(QPConfig{Type: QPTypeUD, SendCQ: n.scq, RecvCQ: n.rcq, MaxSendWR: 64, MaxRecvWR: 64})
	require.NoError(t, err)
	n.qp = qp
	require.NoError(t, qp.ModifyAttr(QPAttr{QKey: qkey}, AttrQKey))
	require.NoError(t, qp.BindUD(netip.MustParseAddrPort(addr), 4096))
	require.Equal(t, StateRTR, qp.State())
	require.NoError(t, qp.Modify(StateRTS))
	return n
}

// UD SENDs between two devices on two addresses, pinned and ODP (every page faulted
// on both sides): each receive holds the GRH (the sender's and the receiver's IPv4
// addresses in a valid IPv4 header) and the payload; the completion carries the
// source QP, the GRH flag and the immediate data. Datagrams with another Q_Key, or
// with no receive posted, are dropped and counted; a datagram longer than the path
// MTU, or than its receive, is a local length error.
func TestUDSend(t *testing.T) {
	for _, mode := range memModes {
		t.Run(mode.name, func(t *testing.T) {
			cfg := Config{NoSnapshot: true}
			const qkey = 0x11111111
			a := udNode(t, cfg, "127.0.0.1:0", qkey)
			b := udNode(t, cfg, "127.0.0.2:0", qkey)
			src, smr := a.region(t, 2*ps, rw|mode.odp)
			dst, dmr := b.region(t, 4*ps, rw|mode.odp)
			for i := range src {
				src[i] = byte(i*3 + 1)
			}
			bEP := b.qp.UDAddr()
			require.Equal(t, netip.MustParseAddr("127.0.0.2"), bEP.Addr())
			dest := &UDDest{Addr: bEP, QPN: b.qp.QPNum(), QKey: qkey}

			require.NoError(t, b.qp.PostRecv(RecvWR{WRID: 1, SGL: sge(dmr, 0, GRHSize+1000)}))
			require.NoError(t, a.qp.PostSend(SendWR{WRID: 10, Opcode: OpSend, SGL: sge(smr, 7, 1000), Flags: SendSignaled, UD: dest}))
			wc := wait(t, a.scq)
			require.Equal(t, WC{WRID: 10, Opcode: WCSend, QPNum: a.qp.QPNum()}, wc, wc.Detail)
			rwc := wait(t, b.rcq)
			require.Equal(t, WC{WRID: 1, Opcode: WCRecv, ByteLen: GRHSize + 1000, QPNum: b.qp.QPNum(), Flags: WCGRH,
				SrcQP: a.qp.QPNum()}, rwc, rwc.Detail)
			assert.Equal(t, src[7:1007], dst[GRHSize:GRHSize+1000])
			ip := dst[20:GRHSize]
			assert.Equal(t, byte(0x45), ip[0], "an IPv4 header in the GRH's last 20 bytes")
			assert.Equal(t, []byte{127, 0, 0, 1}, ip[12:16], "the sender's address")
			assert.Equal(t, []byte{127, 0, 0, 2}, ip[16:20], "the receiver's")
			var sum uint32
			for i := 0; i < 20; i += 2 {
				sum += uint32(binary.BigEndian.Uint16(ip[i:]))
			}
			assert.EqualValues(t, 0xffff, sum&0xffff+sum>>16, "the IPv4 header checksum")
			assert.Equal(t, make([]byte, 20), dst[:20])

			// With immediate data, into two SGEs; the Q_Key from the sender's QP.
			require.NoError(t, b.qp.PostRecv(RecvWR{WRID: 2, SGL: append(sge(dmr, ps, GRHSize+10), sge(dmr, 2*ps, 100)...)}))
			require.NoError(t, a.qp.PostSend(SendWR{WRID: 11, Opcode: OpSendImm, Imm: 0xcafe, SGL: sge(smr, 0, 60),
				Flags: SendSignaled, UD: &UDDest{Addr: bEP, QPN: b.qp.QPNum(), QKey: 1 << 31}}))
			require.Equal(t, WCSuccess, wait(t, a.scq).Status)
			rwc = wait(t, b.rcq)
			require.Equal(t, WC{WRID: 2, Opcode: WCRecv, ByteLen: GRHSize + 60, QPNum: b.qp.QPNum(), Flags: WCGRH | WCWithImm,
				ImmData: 0xcafe, SrcQP: a.qp.QPNum()}, rwc, rwc.Detail)
			assert.Equal(t, src[:10], dst[ps+GRHSize:ps+GRHSize+10])
			assert.Equal(t, src[10:60], dst[2*ps:2*ps+50])

			// Dropped: another Q_Key, then no receive; the next datagram goes to the
			// receive posted after them.
			require.NoError(t, a.qp.PostSend(SendWR{WRID: 12, Opcode: OpSend, SGL: sge(smr, 0, 8), Flags: SendSignaled,
				UD: &UDDest{Addr: bEP, QPN: b.qp.QPNum(), QKey: 0x22}}))
			require.NoError(t, a.qp.PostSend(SendWR{WRID: 13, Opcode: OpSend, SGL: sge(smr, 0, 9), Flags: SendSignaled, UD: dest}))
			for range 2 {
				require.Equal(t, WCSuccess, wait(t, a.scq).Status, "UD sends complete once sent")
			}
			// A dropped datagram completes nothing: its counter is what shows it.
			deadline := time.Now().Add(10 * time.Second)
			for b.qp.Stats().QKeyViolations+b.qp.Stats().NoReceive < 2 && time.Now().Before(deadline) {
				runtime.Gosched()
			}
			st := b.qp.Stats()
			assert.EqualValues(t, 1, st.QKeyViolations)
			assert.EqualValues(t, 1, st.NoReceive)

			// A datagram longer than the MTU fails at the sender; one longer than its
			// receive fails at the receiver; both QPs go to ERR.
			require.NoError(t, b.qp.PostRecv(RecvWR{WRID: 3, SGL: sge(dmr, 0, GRHSize+4)}))
			require.NoError(t, a.qp.PostSend(SendWR{WRID: 14, Opcode: OpSend, SGL: sge(smr, 0, 8), Flags: SendSignaled, UD: dest}))
			require.Equal(t, WCSuccess, wait(t, a.scq).Status)
			rwc = wait(t, b.rcq)
			assert.Equal(t, WCLocLenErr, rwc.Status, rwc.Detail)
			assert.Equal(t, StateError, b.qp.State())
			_, bmr := a.region(t, 2*4096, rw)
			require.NoError(t, a.qp.PostSend(SendWR{WRID: 15, Opcode: OpSend, SGL: sge(bmr, 0, 4097), Flags: SendSignaled, UD: dest}))
			assert.Equal(t, WCLocLenErr, wait(t, a.scq).Status)
			assert.Equal(t, StateError, a.qp.State())
			if mode.odp != 0 {
				assert.NotZero(t, a.dev.Stats().PageFaults, "the sender faulted its pages in")
				assert.NotZero(t, b.dev.Stats().PageFaults, "the receiver faulted its pages in")
			}
		})
	}
}

// What a UD QP refuses, with typed errors; a reset UD QP binds again and sends.
func TestUDBadInputsAndReset(t *testing.T) {
	const qkey = 7
	a := udNode(t, Config{}, "127.0.0.1:0", qkey)
	b := udNode(t, Config{}, "127.0.0.2:0", qkey)
	_, smr := a.region(t, ps, rw)
	_, dmr := b.region(t, ps, rw)
	dest := &UDDest{Addr: b.qp.UDAddr(), QPN: b.qp.QPNum(), QKey: qkey}
	for _, wr := range []SendWR{
		{Opcode: OpRDMAWrite, SGL: sge(smr, 0, 8), UD: dest, RemoteAddr: dmr.Addr(), RKey: dmr.RKey()},
		{Opcode: OpRDMARead, SGL: sge(smr, 0, 8), UD: dest},
		{Opcode: OpSend, SGL: sge(smr, 0, 8)},                                             // no destination
		{Opcode: OpSend, SGL: sge(smr, 0, 8), UD: &UDDest{QPN: 5}},                        // no address
		{Opcode: OpSend, SGL: sge(smr, 0, 8), UD: &UDDest{Addr: dest.Addr, QPN: 1 << 24}}, // QPN too wide
	} {
		assert.ErrorIs(t, a.qp.PostSend(wr), ErrInvalidArgument, "%+v", wr)
	}
	assert.ErrorIs(t, a.qp.BindUD(netip.MustParseAddrPort("127.0.0.1:0"), 4096), ErrQPState, "bound already")
	assert.ErrorIs(t, a.qp.Modify(StateRTR), ErrQPState)
	rc := newNode(t, Config{})
	assert.ErrorIs(t, rc.qp.BindUD(netip.MustParseAddrPort("127.0.0.1:0"), 4096), ErrInvalidArgument)
	assert.ErrorIs(t, ConnectLoopback(a.qp, rc.qp), ErrInvalidArgument)
	_, err := a.pd.CreateQP(QPConfig{Type: 9, SendCQ: a.scq, RecvCQ: a.rcq})
	assert.ErrorIs(t, err, ErrInvalidArgument)

	// Reset: the QP leaves its endpoint and its Q_Key; bound again, it sends.
	require.NoError(t, a.qp.Modify(StateReset))
	assert.Equal(t, netip.AddrPort{}, a.qp.UDAddr())
	require.NoError(t, a.qp.ModifyAttr(QPAttr{QKey: qkey}, AttrQKey))
	require.NoError(t, a.qp.BindUD(netip.MustParseAddrPort("127.0.0.1:0"), 4096))
	require.NoError(t, a.qp.Modify(StateRTS))
	require.NoError(t, b.qp.PostRecv(RecvWR{WRID: 4, SGL: sge(dmr, 0, ps)}))
	require.NoError(t, a.qp.PostSend(SendWR{WRID: 5, Opcode: OpSend, SGL: sge(smr, 0, 8), Flags: SendSignaled, UD: dest}))
	require.Equal(t, WCSuccess, wait(t, a.scq).Status)
	rwc := wait(t, b.rcq)
	require.Equal(t, WCSuccess, rwc.Status, rwc.Detail)
	assert.Equal(t, a.qp.QPNum(), rwc.SrcQP)

	// ERR flushes what is posted on both queues.
	require.NoError(t, b.qp.PostRecv(RecvWR{WRID: 6, SGL: sge(dmr, 0, ps)}))
	require.NoError(t, b.qp.Modify(StateError))
	assert.Equal(t, WC{WRID: 6, Status: WCWRFlushErr, Opcode: WCRecv, QPNum: b.qp.QPNum()}, wait(t, b.rcq))
	require.NoError(t, b.qp.PostSend(SendWR{WRID: 7, Opcode: OpSend, SGL: sge(dmr, 0, 8), UD: dest}))
	wc := wait(t, b.scq)
	wc.Detail = ""
	assert.Equal(t, WC{WRID: 7, Status: WCWRFlushErr, Opcode: WCSend, QPNum: b.qp.QPNum()}, wc)
	require.NoError(t, b.qp.Destroy())
}

// A datagram is due at the receiver a link's delay after it arrives, and the port
// wakes the engine only when it arrives: the engine must come back for it when it is
// due, whether it yields through a short delay or sleeps through a long one. Each
// datagram of a burst is placed, none before its delay.
func TestUDLinkDelay(t *testing.T) {
	for _, delay := range []time.Duration{50 * time.Microsecond, 30 * time.Millisecond} {
		t.Run(delay.String(), func(t *testing.T) {
			cfg := Config{Link: LinkModel{Delay: delay}}
			const qkey = 0x5
			a := udNode(t, cfg, "127.0.0.1:0", qkey)
			b := udNode(t, cfg, "127.0.0.2:0", qkey)
			_, smr := a.region(t, ps, rw)
			_, dmr := b.region(t, 8*ps, rw)
			dest := &UDDest{Addr: b.qp.UDAddr(), QPN: b.qp.QPNum(), QKey: qkey}
			const n = 8
			for i := range n {
				require.NoError(t, b.qp.PostRecv(RecvWR{WRID: uint64(i), SGL: sge(dmr, i*ps, GRHSize+64)}))
			}
			start := time.Now()
			for i := range n {
				require.NoError(t, a.qp.PostSend(SendWR{WRID: uint64(i), Opcode: OpSend, SGL: sge(smr, 0, 64), Flags: SendSignaled, UD: dest}))
				require.Equal(t, WCSuccess, wait(t, a.scq).Status)
			}
			for i := range n {
				wc := wait(t, b.rcq)
				require.Equal(t, WCSuccess, wc.Status, wc.Detail)
				assert.EqualValues(t, i, wc.WRID)
			}
			assert.GreaterOrEqual(t, time.Since(start), delay, "a datagram is placed after the link's delay")
		})
	}
}
