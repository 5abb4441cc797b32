package odp

import (
	"errors"
	"math/rand/v2"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// rewire connects two QPs again after a reset, over the wire pair uses.
func rewire(t testing.TB, a, b *QP) {
	t.Helper()
	if wireUDP() {
		connectUDP(t, a, b, UDPConfig{Addr: addrA}, UDPConfig{Addr: addrB})
		return
	}
	require.NoError(t, ConnectLoopback(a, b))
}

// queued returns how many completions cq holds.
func queued(cq *CQ) int {
	cq.mu.Lock()
	defer cq.mu.Unlock()
	return cq.n
}

// TestResetConnectedQP: a connected QP moved to RESET, from RTS and from ERR, drops
// the work queued on both its queues and its completions still in the CQ, refuses
// posts, and works again once connected anew; the receives posted before the reset
// are gone (a SEND after it fills the one posted after it).
func TestResetConnectedQP(t *testing.T) {
	a, b := pair(t, Config{})
	src, smr := a.region(t, 4*ps, rw)
	dst, dmr := b.region(t, 4*ps, rw)
	for i := range src {
		src[i] = byte(i*5 + 1)
	}
	write := func(id uint64, off int) {
		t.Helper()
		require.NoError(t, a.qp.PostSend(SendWR{WRID: id, Opcode: OpRDMAWrite, SGL: sge(smr, off, ps), Flags: SendSignaled,
			RemoteAddr: dmr.Addr() + uint64(off), RKey: dmr.RKey()}))
	}
	resetBoth := func() {
		t.Helper()
		require.NoError(t, a.qp.Modify(StateReset))
		require.NoError(t, b.qp.Modify(StateReset))
		require.Equal(t, StateReset, a.qp.State())
		require.Equal(t, StateReset, b.qp.State())
		require.Zero(t, queued(a.scq), "a's completions left in its CQ")
		require.Zero(t, queued(b.rcq), "b's completions left in its CQ")
		require.ErrorIs(t, a.qp.PostSend(SendWR{WRID: 99, Opcode: OpRDMAWrite, SGL: sge(smr, 0, 8),
			RemoteAddr: dmr.Addr(), RKey: dmr.RKey()}), ErrQPState)
		require.ErrorIs(t, b.qp.PostRecv(RecvWR{WRID: 99, SGL: sge(dmr, 0, 8)}), ErrQPState)
		require.Equal(t, DefaultQPAttr, a.qp.Attr())
	}
	write(1, 0)
	require.Equal(t, WCSuccess, wait(t, a.scq).Status)

	// From RTS, with a completion queued and receives posted.
	require.NoError(t, b.qp.PostRecv(RecvWR{WRID: 50, SGL: sge(dmr, 0, ps)}))
	require.NoError(t, b.qp.PostRecv(RecvWR{WRID: 51, SGL: sge(dmr, 0, ps)}))
	write(2, ps)
	for queued(a.scq) == 0 {
		runtime.Gosched()
	}
	resetBoth()
	rewire(t, a.qp, b.qp)
	require.NoError(t, b.qp.PostRecv(RecvWR{WRID: 60, SGL: sge(dmr, 2*ps, ps)}))
	require.NoError(t, a.qp.PostSend(SendWR{WRID: 3, Opcode: OpSend, SGL: sge(smr, 0, 100), Flags: SendSignaled}))
	wc := wait(t, a.scq)
	require.Equal(t, WC{WRID: 3, Opcode: WCSend, QPNum: a.qp.QPNum()}, wc, wc.Detail)
	assert.Equal(t, WC{WRID: 60, Opcode: WCRecv, ByteLen: 100, QPNum: b.qp.QPNum()}, wait(t, b.rcq))
	assert.Equal(t, src[:100], dst[2*ps:2*ps+100])
	write(4, 3*ps)
	require.Equal(t, WCSuccess, wait(t, a.scq).Status)
	assert.Equal(t, src[3*ps:], dst[3*ps:])

	// From ERR: a WRITE to a bad rkey ends it; the flushes of both sides go too.
	require.NoError(t, b.qp.PostRecv(RecvWR{WRID: 70, SGL: sge(dmr, 0, ps)}))
	require.NoError(t, a.qp.PostSend(SendWR{WRID: 5, Opcode: OpRDMAWrite, SGL: sge(smr, 0, 8), Flags: SendSignaled,
		RemoteAddr: dmr.Addr(), RKey: dmr.RKey() + 1}))
	require.Equal(t, WCRemAccessErr, wait(t, a.scq).Status)
	require.Equal(t, StateError, a.qp.State())
	require.NoError(t, a.qp.PostSend(SendWR{WRID: 6, Opcode: OpRDMAWrite, SGL: sge(smr, 0, 8), Flags: SendSignaled,
		RemoteAddr: dmr.Addr(), RKey: dmr.RKey()}))
	resetBoth()
	rewire(t, a.qp, b.qp)
	write(7, 0)
	wc = wait(t, a.scq)
	require.Equal(t, WC{WRID: 7, Opcode: WCRDMAWrite, QPNum: a.qp.QPNum()}, wc, wc.Detail)
	require.NoError(t, b.qp.PostRecv(RecvWR{WRID: 80, SGL: sge(dmr, 0, ps)}))
	require.NoError(t, a.qp.PostSend(SendWR{WRID: 8, Opcode: OpSend, SGL: sge(smr, 0, 10), Flags: SendSignaled}))
	require.Equal(t, WCSuccess, wait(t, a.scq).Status)
	assert.Equal(t, uint64(80), wait(t, b.rcq).WRID, "the receive posted before the reset was dropped")

	// A QP that was never connected resets as before; a destroyed one refuses.
	c := newNode(t, Config{})
	require.NoError(t, c.qp.Modify(StateInit))
	require.NoError(t, c.qp.Modify(StateReset))
	require.NoError(t, c.qp.Destroy())
	require.ErrorIs(t, c.qp.Modify(StateReset), ErrClosed)
}

// TestCQDropQP: removing one QP's completions keeps the others in order, across the
// ring's wrap.
func TestCQDropQP(t *testing.T) {
	d := newNode(t, Config{}).dev
	cq, err := d.CreateCQ(5)
	require.NoError(t, err)
	for i := range 3 { // head moves to 3
		cq.push(WC{WRID: uint64(i), QPNum: 9})
	}
	wcs := make([]WC, 8)
	n, err := cq.Poll(wcs)
	require.NoError(t, err)
	require.Equal(t, 3, n)
	for i := range 5 {
		cq.push(WC{WRID: uint64(10 + i), QPNum: uint32(5 + i%2)})
	}
	cq.dropQP(5)
	n, err = cq.Poll(wcs)
	require.NoError(t, err)
	require.Equal(t, []WC{{WRID: 11, QPNum: 6}, {WRID: 13, QPNum: 6}}, wcs[:n])
	require.NoError(t, cq.Destroy())
}

// TestResetUnderTraffic: QPs reset and connected again while goroutines post and
// poll, and, in the end, reset racing Destroy: every call returns nil or a typed
// error, nothing panics or hangs, no goroutine is left, and after each rewiring a
// WRITE goes through.
func TestResetUnderTraffic(t *testing.T) {
	for _, procs := range []int{1, 2} {
		t.Run(map[int]string{1: "GOMAXPROCS=1", 2: "GOMAXPROCS=2"}[procs], func(t *testing.T) {
			defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(procs))
			a, b := pair(t, Config{})
			_, smr := a.region(t, 16*ps, rw|AccessOnDemand)
			dst, dmr := b.region(t, 16*ps, rw)
			var stop atomic.Bool
			var wg sync.WaitGroup
			typed := func(err error) bool {
				return err == nil || errors.Is(err, ErrQPState) || errors.Is(err, ErrQueueFull) || errors.Is(err, ErrClosed)
			}
			var bad atomic.Value
			var succeeded atomic.Int64 // completions with WCSuccess the poller saw
			for g := range 3 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					rng := rand.New(rand.NewPCG(uint64(g), 3))
					for i := uint64(0); !stop.Load(); i++ {
						off := rng.IntN(16) * ps
						var err error
						switch rng.IntN(3) {
						case 0:
							err = a.qp.PostSend(SendWR{WRID: i, Opcode: OpRDMAWrite, SGL: sge(smr, off, ps), Flags: SendSignaled,
								RemoteAddr: dmr.Addr() + uint64(off), RKey: dmr.RKey()})
						case 1:
							err = a.qp.PostSend(SendWR{WRID: i, Opcode: OpSend, SGL: sge(smr, off, 64), Flags: SendSignaled})
						case 2:
							err = b.qp.PostRecv(RecvWR{WRID: i, SGL: sge(dmr, off, ps)})
						}
						if !typed(err) {
							bad.Store(err)
						}
						if i%16 == 0 {
							runtime.Gosched()
						}
					}
				}()
			}
			wg.Add(1)
			go func() { // the application's poller
				defer wg.Done()
				wcs := make([]WC, 32)
				for !stop.Load() {
					for _, cq := range []*CQ{a.scq, b.rcq} {
						n, err := cq.Poll(wcs)
						if err != nil && !errors.Is(err, ErrCQOverrun) {
							bad.Store(err)
						}
						for _, wc := range wcs[:n] {
							if wc.Status == WCSuccess {
								succeeded.Add(1)
							}
						}
					}
					runtime.Gosched()
				}
			}()
			for i := range 20 {
				deadline := time.Now().Add(10 * time.Second)
				for succeeded.Load() <= int64(i) { // traffic flows before each reset
					require.True(t, time.Now().Before(deadline), "no completion after rewiring %d times", i)
					runtime.Gosched()
				}
				require.NoError(t, a.qp.Modify(StateReset))
				require.NoError(t, b.qp.Modify(StateReset))
				rewire(t, a.qp, b.qp)
			}
			stop.Store(true)
			wg.Wait()
			if err := bad.Load(); err != nil {
				t.Fatalf("an untyped error: %v", err)
			}

			// Quiet now: one more reset, then a WRITE whose bytes arrive.
			require.NoError(t, a.qp.Modify(StateReset))
			require.NoError(t, b.qp.Modify(StateReset))
			rewire(t, a.qp, b.qp)
			clear(dst)
			smr.mem[0] = 0xa5
			require.NoError(t, a.qp.PostSend(SendWR{WRID: 1 << 40, Opcode: OpRDMAWrite, SGL: sge(smr, 0, ps), Flags: SendSignaled,
				RemoteAddr: dmr.Addr(), RKey: dmr.RKey()}))
			wc := wait(t, a.scq)
			require.Equal(t, WC{WRID: 1 << 40, Opcode: WCRDMAWrite, QPNum: a.qp.QPNum()}, wc, wc.Detail)
			require.Equal(t, byte(0xa5), dst[0])

			// Reset racing Destroy: one of them releases the engine and the wire.
			var errs [2]error
			var race sync.WaitGroup
			race.Add(2)
			go func() { defer race.Done(); errs[0] = a.qp.Modify(StateReset) }()
			go func() { defer race.Done(); errs[1] = a.qp.Destroy() }()
			race.Wait()
			require.True(t, errs[0] == nil || errors.Is(errs[0], ErrClosed), "reset: %v", errs[0])
			require.NoError(t, errs[1])
		})
	}
}

// TestErrorCompletionBeforeFlushes: when a send work request fails, its error
// completion comes before the flushes of the QP's posted receives, in a CQ that
// holds both (a NIC writes them in that order; rdma-core's tests poll one CQ and
// expect the error).
func TestErrorCompletionBeforeFlushes(t *testing.T) {
	a, b := newNode(t, Config{}), newNode(t, Config{})
	cq, err := a.dev.CreateCQ(16)
	require.NoError(t, err)
	qp, err := a.pd.CreateQP(QPConfig{SendCQ: cq, RecvCQ: cq})
	require.NoError(t, err)
	if wireUDP() {
		connectUDP(t, qp, b.qp, UDPConfig{Addr: addrA}, UDPConfig{Addr: addrB})
	} else {
		require.NoError(t, ConnectLoopback(qp, b.qp))
	}
	_, smr := a.region(t, ps, rw)
	_, dmr := b.region(t, ps, rw)
	require.NoError(t, qp.PostRecv(RecvWR{WRID: 10, SGL: sge(smr, 0, ps)}))
	require.NoError(t, qp.PostRecv(RecvWR{WRID: 11, SGL: sge(smr, 0, ps)}))
	require.NoError(t, qp.PostSend(SendWR{WRID: 1, Opcode: OpRDMAWrite, SGL: sge(smr, 0, 8), Flags: SendSignaled,
		RemoteAddr: dmr.Addr(), RKey: dmr.RKey() ^ 0x100}))
	var got []WC
	for range 3 {
		wc := wait(t, cq)
		wc.Detail = ""
		got = append(got, wc)
	}
	require.Equal(t, []WC{
		{WRID: 1, Status: WCRemAccessErr, Opcode: WCRDMAWrite, QPNum: qp.QPNum()},
		{WRID: 10, Status: WCWRFlushErr, Opcode: WCRecv, QPNum: qp.QPNum()},
		{WRID: 11, Status: WCWRFlushErr, Opcode: WCRecv, QPNum: qp.QPNum()},
	}, got)
}

// TestPostInErrorWhileConnecting: sends posted to a QP in ERR that has no engine are
// flushed by the poster; a reset, an INIT and a connection racing them must not let
// that flush touch slots a new engine owns (the race detector watches the slots).
func TestPostInErrorWhileConnecting(t *testing.T) {
	a, b := newNode(t, Config{}), newNode(t, Config{})
	_, smr := a.region(t, ps, rw)
	_, dmr := b.region(t, ps, rw)
	wr := SendWR{Opcode: OpRDMAWrite, SGL: sge(smr, 0, 64), Flags: SendSignaled, RemoteAddr: dmr.Addr(), RKey: dmr.RKey()}
	var stop atomic.Bool
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { // the application's poster
		defer wg.Done()
		for i := uint64(0); !stop.Load(); i++ {
			wr.WRID = i
			if err := a.qp.PostSend(wr); err != nil && !errors.Is(err, ErrQPState) && !errors.Is(err, ErrQueueFull) {
				t.Errorf("PostSend: %v", err)
				return
			}
		}
	}()
	go func() { // and its poller
		defer wg.Done()
		wcs := make([]WC, 64)
		for !stop.Load() {
			if _, err := a.scq.Poll(wcs); err != nil && !errors.Is(err, ErrCQOverrun) {
				t.Errorf("Poll: %v", err)
				return
			}
		}
	}()
	for range 100 {
		require.NoError(t, a.qp.Modify(StateError)) // no engine: posts flush themselves
		runtime.Gosched()
		require.NoError(t, a.qp.Modify(StateReset))
		require.NoError(t, b.qp.Modify(StateReset))
		require.NoError(t, ConnectLoopback(a.qp, b.qp))
		runtime.Gosched()
		require.NoError(t, a.qp.Modify(StateReset))
	}
	stop.Store(true)
	wg.Wait()
}

// TestReceiveErrorFindsQPInError: a receive that fails (its lkey reaches no MR) completes
// with LOC_PROT_ERR once its QP is in ERR, before the flushes of the receives after it.
func TestReceiveErrorFindsQPInError(t *testing.T) {
	for range 20 {
		a, b := pair(t, Config{})
		_, smr := a.region(t, ps, rw)
		_, dmr := b.region(t, ps, rw)
		require.NoError(t, b.qp.PostRecv(RecvWR{WRID: 1, SGL: []SGE{{Addr: dmr.Addr(), Length: 64, LKey: dmr.LKey() ^ 0x100}}}))
		require.NoError(t, b.qp.PostRecv(RecvWR{WRID: 2, SGL: sge(dmr, 0, 64)}))
		require.NoError(t, a.qp.PostSend(SendWR{WRID: 3, Opcode: OpSend, SGL: sge(smr, 0, 8), Flags: SendSignaled}))
		wc := wait(t, b.rcq)
		require.Equal(t, WCLocProtErr, wc.Status, wc.Detail)
		require.Equal(t, StateError, b.qp.State(), "polled the error: the QP is in ERR")
		assert.Equal(t, WC{WRID: 2, Status: WCWRFlushErr, Opcode: WCRecv, QPNum: b.qp.QPNum()}, wait(t, b.rcq))
		assert.Equal(t, WCRemOpErr, wait(t, a.scq).Status)
	}
}
