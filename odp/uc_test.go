package odp

import (
	"context"
	"encoding/binary"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/odpemu/odpemu/transport/roce"
)

// ucPair returns two nodes with a UC QP each, connected in one process or over UDP
// (ODPEMU_WIRE=udp), with loss injected into both directions (none for the zero
// Loss).
func ucPair(t *testing.T, cfg Config, loss roce.Loss) (a, b *node) {
	t.Helper()
	a, b = newNode(t, cfg), newNode(t, cfg)
	for _, n := range []*node{a, b} {
		qp, err := n.pd.CreateQP(QPConfig{Type: QPTypeUC, SendCQ: n.scq, RecvCQ: n.rcq, MaxSendWR: 256, MaxRecvWR: 512})
		require.NoError(t, err)
		n.qp = qp
	}
	if wireUDP() {
		connectUDP(t, a.qp, b.qp, UDPConfig{Addr: addrA, Loss: loss}, UDPConfig{Addr: addrB, Loss: loss})
	} else {
		require.NoError(t, ConnectLoopbackLoss(a.qp, b.qp, loss))
	}
	return a, b
}

// UC SENDs of several packets and WRITEs with immediate land whole, into pinned and
// ODP memory (whose pages fault while the QP waits: UC has no RNR NAK); each send
// completes without an acknowledgement, and no packet is ever sent again.
func TestUCTraffic(t *testing.T) {
	for _, mode := range memModes {
		t.Run(mode.name, func(t *testing.T) {
			a, b := ucPair(t, Config{}, roce.Loss{})
			src, smr := a.region(t, 64*ps, rw)
			dst, dmr := b.region(t, 64*ps, rw|mode.odp)
			for i := range src {
				src[i] = byte(i*13 + i>>12)
			}
			const msgs = 8
			for i := range msgs {
				require.NoError(t, b.qp.PostRecv(RecvWR{WRID: uint64(100 + i), SGL: sge(dmr, i*4*ps, 4*ps)}))
			}
			for i := range msgs {
				n := 3*ps + 17*i // four packets at the 4096-byte MTU
				wr := SendWR{WRID: uint64(i), Opcode: OpSend, SGL: sge(smr, i*4*ps, n), Flags: SendSignaled}
				if i%2 == 1 {
					wr = SendWR{WRID: uint64(i), Opcode: OpRDMAWriteImm, SGL: sge(smr, i*4*ps, n), Flags: SendSignaled,
						RemoteAddr: dmr.Addr() + uint64(32*ps+i*4*ps), RKey: dmr.RKey(), Imm: uint32(i)}
				}
				require.NoError(t, a.qp.PostSend(wr))
			}
			for i := range msgs {
				wc := wait(t, a.scq)
				require.Equal(t, WC{WRID: uint64(i), Opcode: wcOpcode(map[bool]Opcode{false: OpSend, true: OpRDMAWrite}[i%2 == 1]),
					QPNum: a.qp.QPNum()}, wc, wc.Detail)
			}
			for i := range msgs {
				wc := wait(t, b.rcq)
				n := 3*ps + 17*i
				want := WC{WRID: uint64(100 + i), Opcode: WCRecv, ByteLen: uint32(n), QPNum: b.qp.QPNum()}
				at := i * 4 * ps
				if i%2 == 1 {
					want.Opcode, want.Flags, want.ImmData = WCRecvRDMAWithImm, WCWithImm, uint32(i)
					at = 32*ps + i*4*ps
				}
				require.Equal(t, want, wc, wc.Detail)
				require.Equal(t, src[i*4*ps:i*4*ps+n], dst[at:at+n], "message %d", i)
			}
			st := a.qp.Stats()
			assert.Zero(t, st.Retransmissions)
			assert.Zero(t, st.Timeouts)
			if mode.odp != 0 {
				assert.Positive(t, b.dev.Stats().PageFaults)
			}
		})
	}
}

// What a UC responder cannot take it drops, silently, and goes on: a SEND with no
// receive posted, a WRITE under a bad key, a SEND longer than its receive (which
// stays for the next message). The sender's completions say success, as on a NIC,
// and the QPs stay in RTS.
func TestUCDropsWhatItCannotTake(t *testing.T) {
	a, b := ucPair(t, Config{}, roce.Loss{})
	src, smr := a.region(t, 4*ps, rw)
	dst, dmr := b.region(t, 4*ps, rw)
	for i := range src {
		src[i] = byte(i + 1)
	}
	send := func(id uint64, n int) {
		t.Helper()
		require.NoError(t, a.qp.PostSend(SendWR{WRID: id, Opcode: OpSend, SGL: sge(smr, 0, n), Flags: SendSignaled}))
		wc := wait(t, a.scq)
		require.Equal(t, WCSuccess, wc.Status, wc.Detail)
	}
	sync := func() { // a WRITE with immediate: once its receive completes, what came before was taken
		t.Helper()
		require.NoError(t, b.qp.PostRecv(RecvWR{WRID: 999}))
		require.NoError(t, a.qp.PostSend(SendWR{WRID: 998, Opcode: OpRDMAWriteImm, SGL: sge(smr, 0, 8), Flags: SendSignaled,
			RemoteAddr: dmr.Addr() + 3*up, RKey: dmr.RKey()}))
		require.Equal(t, WCSuccess, wait(t, a.scq).Status)
		wc := wait(t, b.rcq)
		require.EqualValues(t, 999, wc.WRID, "the message before was dropped: nothing else completed (%+v)", wc)
	}

	dropped := b.qp.Stats().PacketsDropped
	send(1, 100) // no receive posted: dropped (nothing else tells when it arrived)
	require.Eventually(t, func() bool { return b.qp.Stats().PacketsDropped > dropped }, 10*time.Second, time.Millisecond)
	assert.Contains(t, b.qp.RespError(), "no receive posted")

	require.NoError(t, a.qp.PostSend(SendWR{WRID: 2, Opcode: OpRDMAWrite, SGL: sge(smr, 0, 8), Flags: SendSignaled,
		RemoteAddr: dmr.Addr(), RKey: dmr.RKey() + 0x100}))
	require.Equal(t, WCSuccess, wait(t, a.scq).Status)
	sync()
	assert.Contains(t, b.qp.RespError(), "not a registered MR")
	assert.Zero(t, dst[0], "nothing written")

	require.NoError(t, b.qp.PostRecv(RecvWR{WRID: 3, SGL: sge(dmr, 0, 50)}))
	send(4, 2*ps) // longer than the receive: dropped, the receive stays
	send(5, 50)   // takes it
	wc := wait(t, b.rcq)
	require.Equal(t, WC{WRID: 3, Opcode: WCRecv, ByteLen: 50, QPNum: b.qp.QPNum()}, wc, wc.Detail)
	assert.Equal(t, src[:50], dst[:50])
	assert.Equal(t, StateRTS, b.qp.State())
	assert.Equal(t, StateRTS, a.qp.State())
	assert.GreaterOrEqual(t, b.qp.Stats().PacketsDropped, uint64(3))

	for _, op := range []Opcode{OpRDMARead, OpAtomicFetchAdd, OpSendInv} {
		err := a.qp.PostSend(SendWR{Opcode: op, SGL: sge(smr, 0, 8), RemoteAddr: dmr.Addr(), RKey: dmr.RKey()})
		assert.ErrorIs(t, err, ErrInvalidArgument, "opcode %d on UC", op)
	}
}

// UC over a link that loses, duplicates and reorders packets: a message that lost a
// packet is lost whole, never completed partly or with another message's bytes;
// every receive that completes holds exactly one message; the sender completes
// every request and sends nothing again.
func TestUCOverLossyLink(t *testing.T) {
	a, b := ucPair(t, Config{}, roce.Loss{Seed: 5, Drop: 0.05, Duplicate: 0.02, Reorder: 0.02})
	const msgs, slot, spare = 300, 3 * 4096, 50
	src, smr := a.region(t, msgs*slot, rw)
	dst, dmr := b.region(t, (msgs+spare)*slot, rw)
	for i := range msgs {
		m := src[i*slot : (i+1)*slot]
		for k := range m {
			m[k] = byte(i*31 + k)
		}
		binary.LittleEndian.PutUint32(m, uint32(i))
	}
	for r := range msgs + spare { // the spare ones for the final messages below
		require.NoError(t, b.qp.PostRecv(RecvWR{WRID: uint64(r), SGL: sge(dmr, r*slot, slot)}))
	}
	for i := range msgs {
		require.NoError(t, a.qp.PostSend(SendWR{WRID: uint64(i), Opcode: OpSend, SGL: sge(smr, i*slot, slot-i%7),
			Flags: SendSignaled}))
		wc := wait(t, a.scq)
		require.Equal(t, WC{WRID: uint64(i), Opcode: WCSend, QPNum: a.qp.QPNum()}, wc, wc.Detail)
	}
	// Nothing says when the last messages arrived, or that they were lost: 4-byte
	// messages follow until one arrives, which comes after every message before it.
	got, finals := 0, 0
	for done := false; !done; {
		require.Less(t, finals, spare, "no final message arrived")
		require.NoError(t, a.qp.PostSend(SendWR{WRID: 1 << 32, Opcode: OpSend, SGL: sge(smr, 0, 4), Flags: SendSignaled}))
		require.Equal(t, WCSuccess, wait(t, a.scq).Status)
		finals++
		for !done {
			ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
			var wcs [1]WC
			n, err := b.rcq.Wait(ctx, wcs[:])
			cancel()
			if n == 0 { // this final message was lost too (or is slow): send another
				require.ErrorIs(t, err, context.DeadlineExceeded)
				break
			}
			wc := wcs[0]
			require.Equal(t, WCSuccess, wc.Status, wc.Detail)
			if wc.ByteLen == 4 {
				done = true
				break
			}
			// Receives are taken in order: receive r holds some message j >= r, whole.
			r := int(wc.WRID)
			j := int(binary.LittleEndian.Uint32(dst[r*slot:]))
			require.GreaterOrEqual(t, j, r, "receive %d", r)
			require.Less(t, j, msgs)
			require.EqualValues(t, slot-j%7, wc.ByteLen, "receive %d holds message %d", r, j)
			require.Equal(t, src[j*slot:j*slot+slot-j%7], dst[r*slot:r*slot+slot-j%7], "receive %d: message %d whole", r, j)
			got++
		}
	}
	t.Logf("%d of %d messages arrived", got, msgs)
	assert.Less(t, got, msgs, "5%% of the packets were lost: some messages were")
	assert.Greater(t, got, msgs/2)
	assert.Zero(t, a.qp.Stats().Retransmissions)
	assert.Equal(t, StateRTS, b.qp.State())
}

// A UC QP receiving from an SRQ: SENDs take the SRQ's receives in order, and a SEND
// too long for the receive it took is dropped while the QP keeps that receive for
// the next message (the SRQ's other receives stay).
func TestUCWithSRQ(t *testing.T) {
	a, b := newNode(t, Config{}), newNode(t, Config{})
	srq, err := b.pd.CreateSRQ(SRQConfig{MaxWR: 16})
	require.NoError(t, err)
	qa, err := a.pd.CreateQP(QPConfig{Type: QPTypeUC, SendCQ: a.scq, RecvCQ: a.rcq})
	require.NoError(t, err)
	qb, err := b.pd.CreateQP(QPConfig{Type: QPTypeUC, SendCQ: b.scq, RecvCQ: b.rcq, SRQ: srq})
	require.NoError(t, err)
	require.NoError(t, ConnectLoopback(qa, qb))
	src, smr := a.region(t, 4*ps, rw)
	dst, dmr := b.region(t, 4*ps, rw|AccessOnDemand)
	for i := range src {
		src[i] = byte(i*3 + 1)
	}
	require.NoError(t, srq.PostRecv(RecvWR{WRID: 1, SGL: sge(dmr, 0, 100)}))
	require.NoError(t, srq.PostRecv(RecvWR{WRID: 2, SGL: sge(dmr, 2*ps, 2*ps)}))
	for i, n := range []int{2 * ps, 100, 2 * ps} { // the first is too long for receive 1
		require.NoError(t, qa.PostSend(SendWR{WRID: uint64(i), Opcode: OpSend, SGL: sge(smr, ps, n), Flags: SendSignaled}))
		require.Equal(t, WCSuccess, wait(t, a.scq).Status)
	}
	wc := wait(t, b.rcq)
	require.Equal(t, WC{WRID: 1, Opcode: WCRecv, ByteLen: 100, QPNum: qb.QPNum()}, wc, wc.Detail)
	wc = wait(t, b.rcq)
	require.Equal(t, WC{WRID: 2, Opcode: WCRecv, ByteLen: uint32(2 * ps), QPNum: qb.QPNum()}, wc, wc.Detail)
	assert.Equal(t, src[ps:ps+100], dst[:100])
	assert.Equal(t, src[ps:3*ps], dst[2*ps:4*ps])
	assert.Zero(t, srq.Len())
	assert.Contains(t, qb.RespError(), "into a 100-byte receive")
}
