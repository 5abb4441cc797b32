package odp

import (
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// bindMW posts a signaled bind on qp and returns its completion.
func bindMW(t *testing.T, qp *QP, cq *CQ, b *MWBind) WC {
	t.Helper()
	require.NoError(t, qp.PostSend(SendWR{WRID: 77, Opcode: OpBindMW, Bind: b, Flags: SendSignaled}))
	return wait(t, cq)
}

// writeVia WRITEs n bytes of src's MR at off to va under rkey, and returns the
// completion.
func writeVia(t *testing.T, n *node, smr *MR, off, size int, va uint64, rkey uint32) WC {
	t.Helper()
	wr := write(smr, off, size, smr, 0)
	wr.WRID, wr.RemoteAddr, wr.RKey = 5, va, rkey
	require.NoError(t, n.qp.PostSend(wr))
	return wait(t, n.scq)
}

// A type 1 window opens part of an MR, pinned or ODP, to the peer's WRITEs and
// READs under its own R_Key; the MR's own key keeps working; rebinding with a zero
// length closes it again. On the ODP MR the window's pages fault when the WRITE
// reaches them.
func TestMWType1(t *testing.T) {
	for _, mode := range memModes {
		t.Run(mode.name, func(t *testing.T) {
			a, b := pair(t, Config{})
			src, smr := a.region(t, 8*ps, rw)
			dst, dmr := b.region(t, 8*ps, rw|AccessMWBind|mode.odp)
			for i := range src {
				src[i] = byte(i*7 + 1)
			}
			mw, err := b.pd.AllocMW(MWType1)
			require.NoError(t, err)
			assert.Equal(t, MWType1, mw.Type())
			old := mw.RKey()
			lo := dmr.Addr() + 2*up
			wc := bindMW(t, b.qp, b.scq, mw.BindTo(dmr, lo, 3*up, AccessRemoteWrite|AccessRemoteRead))
			require.Equal(t, WC{WRID: 77, Opcode: WCBindMW, QPNum: b.qp.QPNum()}, wc, wc.Detail)
			rkey := mw.RKey()
			assert.Equal(t, nextTag(old), rkey, "the bind gave the window its new tag")
			assert.NotEqual(t, dmr.RKey(), rkey)

			faults := b.dev.Stats().PageFaults
			wc = writeVia(t, a, smr, 0, 3*ps, lo, rkey)
			require.Equal(t, WCSuccess, wc.Status, wc.Detail)
			assert.Equal(t, src[:3*ps], dst[2*ps:5*ps])
			if mode.odp != 0 {
				assert.Greater(t, b.dev.Stats().PageFaults, faults, "the window's pages faulted")
			}
			// READ back through the window, into the second half of src.
			require.NoError(t, a.qp.PostSend(SendWR{WRID: 6, Opcode: OpRDMARead, SGL: sge(smr, 4*ps, ps),
				RemoteAddr: lo + up, RKey: rkey, Flags: SendSignaled}))
			wc = wait(t, a.scq)
			require.Equal(t, WCSuccess, wc.Status, wc.Detail)
			assert.Equal(t, src[ps:2*ps], src[4*ps:5*ps])
			// The MR's own key still opens all of it.
			wc = writeVia(t, a, smr, 0, ps, dmr.Addr(), dmr.RKey())
			require.Equal(t, WCSuccess, wc.Status, wc.Detail)

			// Unbound (a zero length): the key opens nothing; the QP goes to ERR.
			wc = bindMW(t, b.qp, b.scq, mw.BindTo(nil, 0, 0, 0))
			require.Equal(t, WCSuccess, wc.Status, wc.Detail)
			wc = writeVia(t, a, smr, 0, 8, lo, mw.RKey())
			assert.Equal(t, WCRemAccessErr, wc.Status)
			assert.Contains(t, b.qp.RespError(), "not bound")
			require.NoError(t, mw.Dealloc())
			assert.ErrorIs(t, mw.Dealloc(), ErrClosed)
		})
	}
}

// A window's range and rights bound what its key opens: a WRITE past its end, or a
// WRITE through a read-only window, is a remote access error, and the old key of a
// rebound window is refused.
func TestMWRangeAndRights(t *testing.T) {
	for _, c := range []struct {
		name   string
		access Access
		va     func(lo uint64) uint64
		size   int
		stale  bool
		why    string
	}{
		{"past the end", AccessRemoteWrite, func(lo uint64) uint64 { return lo + up }, ps + 1, false, "outside window"},
		{"before the start", AccessRemoteWrite, func(lo uint64) uint64 { return lo - 1 }, 8, false, "outside window"},
		{"read-only", AccessRemoteRead, func(lo uint64) uint64 { return lo }, 8, false, "lacks REMOTE_WRITE"},
		{"old key", AccessRemoteWrite, func(lo uint64) uint64 { return lo }, 8, true, "not a registered MR or window"},
	} {
		t.Run(c.name, func(t *testing.T) {
			a, b := pair(t, Config{})
			_, smr := a.region(t, 4*ps, rw)
			_, dmr := b.region(t, 4*ps, rw|AccessMWBind)
			mw, err := b.pd.AllocMW(MWType1)
			require.NoError(t, err)
			old := mw.RKey()
			lo := dmr.Addr() + up
			wc := bindMW(t, b.qp, b.scq, mw.BindTo(dmr, lo, 2*up, c.access))
			require.Equal(t, WCSuccess, wc.Status, wc.Detail)
			rkey := mw.RKey()
			if c.stale {
				rkey = old
			}
			wc = writeVia(t, a, smr, 0, c.size, c.va(lo), rkey)
			assert.Equal(t, WCRemAccessErr, wc.Status)
			assert.Contains(t, b.qp.RespError(), c.why)
		})
	}
}

// A type 2 window serves only the QP that bound it; a local invalidate or the
// peer's SEND with invalidate closes it (the receive completion names the key), and
// it can be bound again after.
func TestMWType2(t *testing.T) {
	a, b := pair(t, Config{})
	src, smr := a.region(t, 4*ps, rw)
	dst, dmr := b.region(t, 4*ps, rw|AccessMWBind|AccessOnDemand)
	for i := range src {
		src[i] = byte(i*3 + 2)
	}
	// A second pair between the same devices, with its own QPs.
	a2, err := a.pd.CreateQP(QPConfig{SendCQ: a.scq, RecvCQ: a.rcq})
	require.NoError(t, err)
	b2, err := b.pd.CreateQP(QPConfig{SendCQ: b.scq, RecvCQ: b.rcq})
	require.NoError(t, err)
	require.NoError(t, ConnectLoopback(a2, b2))

	mw, err := b.pd.AllocMW(MWType2)
	require.NoError(t, err)
	bindAll := func() uint32 {
		t.Helper()
		rkey := nextTag(mw.RKey())
		wc := bindMW(t, b.qp, b.scq, mw.BindTo(dmr, dmr.Addr(), 2*up, AccessRemoteWrite))
		require.Equal(t, WC{WRID: 77, Opcode: WCBindMW, QPNum: b.qp.QPNum()}, wc, wc.Detail)
		require.Equal(t, rkey, mw.RKey())
		return rkey
	}
	rkey := bindAll()
	wc := writeVia(t, a, smr, 0, 2*ps, dmr.Addr(), rkey)
	require.Equal(t, WCSuccess, wc.Status, wc.Detail)
	assert.Equal(t, src[:2*ps], dst[:2*ps])

	// Bound again without an invalidate: refused, and the QP goes to ERR; the window
	// stays as it was.
	wc = bindMW(t, b.qp, b.scq, mw.BindTo(dmr, dmr.Addr(), up, AccessRemoteWrite))
	assert.Equal(t, WCMWBindErr, wc.Status)
	assert.Contains(t, wc.Detail, "invalidate it first")
	assert.Equal(t, StateError, b.qp.State())
	assert.Equal(t, rkey, mw.RKey())

	// The other QP of the PD may not use it.
	require.NoError(t, a2.PostSend(SendWR{WRID: 9, Opcode: OpRDMAWrite, SGL: sge(smr, 0, 8), RemoteAddr: dmr.Addr(),
		RKey: rkey, Flags: SendSignaled}))
	wc = wait(t, a.scq)
	for wc.WRID != 9 { // the first pair's flushes
		wc = wait(t, a.scq)
	}
	assert.Equal(t, WCRemAccessErr, wc.Status)
	assert.Contains(t, b2.RespError(), "is bound to QP")
}

// A type 2 window's invalidations: local (OpLocalInv) and remote (OpSendInv), each
// followed by a WRITE under the old key (refused) and a new bind (accepted).
func TestMWType2Invalidate(t *testing.T) {
	for _, remote := range []bool{false, true} {
		t.Run(fmt.Sprintf("remote=%v", remote), func(t *testing.T) {
			a, b := pair(t, Config{})
			_, smr := a.region(t, 4*ps, rw)
			_, dmr := b.region(t, 4*ps, rw|AccessMWBind)
			mw, err := b.pd.AllocMW(MWType2)
			require.NoError(t, err)
			rkey := nextTag(mw.RKey())
			wc := bindMW(t, b.qp, b.scq, mw.BindTo(dmr, dmr.Addr(), up, AccessRemoteWrite))
			require.Equal(t, WCSuccess, wc.Status, wc.Detail)
			assert.ErrorIs(t, dmr.Dereg(), ErrBusy, "a window is bound to it")
			if remote {
				require.NoError(t, b.qp.PostRecv(RecvWR{WRID: 31, SGL: sge(dmr, 2*ps, ps)}))
				require.NoError(t, a.qp.PostSend(SendWR{WRID: 30, Opcode: OpSendInv, SGL: sge(smr, 0, 100),
					InvRKey: rkey, Flags: SendSignaled}))
				wc = wait(t, a.scq)
				require.Equal(t, WC{WRID: 30, Opcode: WCSend, QPNum: a.qp.QPNum()}, wc, wc.Detail)
				wc = wait(t, b.rcq)
				require.Equal(t, WC{WRID: 31, Opcode: WCRecv, QPNum: b.qp.QPNum(), ByteLen: 100, Flags: WCWithInv,
					InvRKey: rkey}, wc, wc.Detail)
			} else {
				require.NoError(t, b.qp.PostSend(SendWR{WRID: 32, Opcode: OpLocalInv, InvRKey: rkey,
					Flags: SendSignaled}))
				wc = wait(t, b.scq)
				require.Equal(t, WC{WRID: 32, Opcode: WCLocalInv, QPNum: b.qp.QPNum()}, wc, wc.Detail)
			}
			// Bound again, under a new tag: the invalidated window takes a bind.
			next := nextTag(rkey)
			wc = bindMW(t, b.qp, b.scq, mw.BindTo(dmr, dmr.Addr(), up, AccessRemoteWrite))
			require.Equal(t, WCSuccess, wc.Status, wc.Detail)
			wc = writeVia(t, a, smr, 0, 8, dmr.Addr(), next)
			require.Equal(t, WCSuccess, wc.Status, wc.Detail)
			// The old key is dead.
			wc = writeVia(t, a, smr, 0, 8, dmr.Addr(), rkey)
			assert.Equal(t, WCRemAccessErr, wc.Status)
		})
	}
}

// What the NIC refuses: binds that break IBTA's rules (bind error, QP to ERR),
// invalidating what cannot be invalidated (a local QP operation error; for a SEND
// with invalidate, an invalid request error on both sides), and the verbs that
// would leave a window dangling.
func TestMWRefusals(t *testing.T) {
	binds := []struct {
		name   string
		typ    MWType
		mr     Access
		bind   func(mw *MW, mr *MR) *MWBind
		detail string
	}{
		{"no MW_BIND", MWType1, rw, func(mw *MW, mr *MR) *MWBind {
			return mw.BindTo(mr, mr.Addr(), up, AccessRemoteRead)
		}, "lacks MW_BIND"},
		{"writable window on read-only MR", MWType1, AccessRemoteRead | AccessMWBind, func(mw *MW, mr *MR) *MWBind {
			return mw.BindTo(mr, mr.Addr(), up, AccessRemoteWrite)
		}, "lacks LOCAL_WRITE"},
		{"outside the MR", MWType1, rw | AccessMWBind, func(mw *MW, mr *MR) *MWBind {
			return mw.BindTo(mr, mr.Addr()+up, 4*up, AccessRemoteRead)
		}, "outside MR"},
		{"type 2 without a length", MWType2, rw | AccessMWBind, func(mw *MW, mr *MR) *MWBind {
			return mw.BindTo(mr, mr.Addr(), 0, 0)
		}, "with a length"},
		{"unknown rights", MWType1, rw | AccessMWBind, func(mw *MW, mr *MR) *MWBind {
			return mw.BindTo(mr, mr.Addr(), up, AccessOnDemand|AccessRemoteRead)
		}, "window access"},
		{"stale window key", MWType1, rw | AccessMWBind, func(mw *MW, mr *MR) *MWBind {
			b := mw.BindTo(mr, mr.Addr(), up, AccessRemoteRead)
			b.MWRKey = nextTag(b.MWRKey)
			return b
		}, "not a memory window's R_Key"},
		{"no such MR", MWType2, rw | AccessMWBind, func(mw *MW, mr *MR) *MWBind {
			b := mw.BindTo(mr, mr.Addr(), up, AccessRemoteRead)
			b.MRLKey = nextTag(b.MRLKey)
			return b
		}, "not a registered MR"},
	}
	for _, c := range binds {
		t.Run(c.name, func(t *testing.T) {
			n, b := newNode(t, Config{}), newNode(t, Config{})
			_, mr := n.region(t, 4*ps, c.mr)
			mw, err := n.pd.AllocMW(c.typ)
			require.NoError(t, err)
			require.NoError(t, ConnectLoopback(n.qp, b.qp)) // n's QP needs a peer to reach RTS
			wc := bindMW(t, n.qp, n.scq, c.bind(mw, mr))
			assert.Equal(t, WCMWBindErr, wc.Status)
			assert.Equal(t, WCBindMW, wc.Opcode)
			assert.Contains(t, wc.Detail, c.detail)
			assert.Equal(t, StateError, n.qp.State())
			require.NoError(t, mr.Dereg(), "nothing was bound")
		})
	}

	t.Run("local invalidate of a type 1 window", func(t *testing.T) {
		a, _ := pair(t, Config{})
		mw, err := a.pd.AllocMW(MWType1)
		require.NoError(t, err)
		require.NoError(t, a.qp.PostSend(SendWR{WRID: 1, Opcode: OpLocalInv, InvRKey: mw.RKey()}))
		wc := wait(t, a.scq)
		assert.Equal(t, WCLocQPOpErr, wc.Status)
		assert.Equal(t, WCLocalInv, wc.Opcode)
		assert.Contains(t, wc.Detail, "type 1")
	})

	t.Run("SEND with invalidate of an MR key", func(t *testing.T) {
		a, b := pair(t, Config{})
		_, smr := a.region(t, ps, rw)
		_, dmr := b.region(t, ps, rw)
		require.NoError(t, b.qp.PostRecv(RecvWR{WRID: 2, SGL: sge(dmr, 0, ps)}))
		require.NoError(t, a.qp.PostSend(SendWR{WRID: 1, Opcode: OpSendInv, SGL: sge(smr, 0, 8), InvRKey: dmr.RKey()}))
		wc := wait(t, a.scq)
		assert.Equal(t, WCRemInvReqErr, wc.Status)
		wc = wait(t, b.rcq)
		assert.Equal(t, WCRemInvReqErr, wc.Status)
		assert.EqualValues(t, 2, wc.WRID)
		assert.Contains(t, wc.Detail, "fast-registration")
		require.NoError(t, dmr.Dereg(), "the MR was not invalidated")
	})

	t.Run("verbs", func(t *testing.T) {
		a, _ := pair(t, Config{})
		_, err := a.pd.AllocMW(3)
		assert.ErrorIs(t, err, ErrInvalidArgument)
		_, mr := a.region(t, 2*ps, rw|AccessMWBind)
		mw, err := a.pd.AllocMW(MWType1)
		require.NoError(t, err)
		assert.ErrorIs(t, a.pd.Dealloc(), ErrBusy, "a window is allocated in it")
		assert.ErrorIs(t, a.qp.PostSend(SendWR{Opcode: OpBindMW}), ErrInvalidArgument)
		wc := bindMW(t, a.qp, a.scq, mw.BindTo(mr, mr.Addr(), up, AccessRemoteRead))
		require.Equal(t, WCSuccess, wc.Status, wc.Detail)
		assert.ErrorIs(t, mr.Dereg(), ErrBusy)
		require.NoError(t, mw.Dealloc())
		require.NoError(t, mr.Dereg(), "the window's dealloc unbound it")
		// Closing a device with a window bound unbinds it first.
		_, mr2 := a.region(t, ps, rw|AccessMWBind)
		mw2, err := a.pd.AllocMW(MWType1)
		require.NoError(t, err)
		wc = bindMW(t, a.qp, a.scq, mw2.BindTo(mr2, mr2.Addr(), up, 0))
		require.Equal(t, WCSuccess, wc.Status, wc.Detail)
		require.NoError(t, a.dev.Close())
		assert.ErrorIs(t, mw2.Dealloc(), ErrClosed)
	})
}

// Windows bound, used, invalidated and deallocated from several goroutines at once,
// each with its own QP pair and MR between two devices, while the others do the same:
// every WRITE through a bound window lands, every MR with a window bound refuses
// deregistration, and each one unbound deregisters.
func TestMWRandomized(t *testing.T) {
	a, b := pair(t, Config{})
	const workers, rounds = 4, 25
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		sa, err := a.dev.CreateCQ(64)
		require.NoError(t, err)
		sb, err := b.dev.CreateCQ(64)
		require.NoError(t, err)
		qa, err := a.pd.CreateQP(QPConfig{SendCQ: sa, RecvCQ: sa})
		require.NoError(t, err)
		qb, err := b.pd.CreateQP(QPConfig{SendCQ: sb, RecvCQ: sb})
		require.NoError(t, err)
		require.NoError(t, ConnectLoopback(qa, qb))
		src, smr := a.region(t, 4*ps, rw)
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs <- mwWorker(t, b, &node{dev: a.dev, pd: a.pd, scq: sa, rcq: sa, qp: qa}, qb, sb, src, smr,
				rand.New(rand.NewPCG(uint64(w), 7)), rounds)
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
}

// mwWorker runs rounds of: register an MR on b, allocate a window of a random type,
// bind it on qb to a random range, WRITE through it from a, check the bytes, try to
// deregister (busy), unbind by invalidate or dealloc, deregister.
func mwWorker(t *testing.T, b *node, a *node, qb *QP, cqb *CQ, src []byte, smr *MR, rng *rand.Rand, rounds int) error {
	one := func(cq *CQ) (WC, error) {
		var wc [1]WC
		_, err := cq.Wait(t.Context(), wc[:])
		return wc[0], err
	}
	for r := range rounds {
		for i := range src {
			src[i] = byte(r + i)
		}
		buf, err := b.dev.Alloc(4 * ps)
		if err != nil {
			return err
		}
		acc := rw | AccessMWBind
		if rng.IntN(2) == 0 {
			acc |= AccessOnDemand
		}
		mr, err := b.pd.RegMR(buf, acc)
		if err != nil {
			return err
		}
		typ := MWType(1 + rng.IntN(2))
		mw, err := b.pd.AllocMW(typ)
		if err != nil {
			return err
		}
		off := uint64(rng.IntN(2 * ps))
		size := 1 + rng.IntN(2*ps)
		rkey := nextTag(mw.RKey())
		if err := qb.PostSend(SendWR{Opcode: OpBindMW, Flags: SendSignaled, Bind: mw.BindTo(mr, mr.Addr()+off, uint64(size), AccessRemoteWrite)}); err != nil {
			return err
		}
		if wc, err := one(cqb); err != nil || wc.Status != WCSuccess {
			return fmt.Errorf("bind: %v %v %s", err, wc.Status, wc.Detail)
		}
		if err := a.qp.PostSend(SendWR{Opcode: OpRDMAWrite, Flags: SendSignaled, SGL: sge(smr, 0, size),
			RemoteAddr: mr.Addr() + off, RKey: rkey}); err != nil {
			return err
		}
		if wc, err := one(a.scq); err != nil || wc.Status != WCSuccess {
			return fmt.Errorf("write: %v %v %s", err, wc.Status, wc.Detail)
		}
		if string(buf[off:off+uint64(size)]) != string(src[:size]) {
			return fmt.Errorf("round %d: the WRITE through the window did not land", r)
		}
		if err := mr.Dereg(); err == nil {
			return fmt.Errorf("round %d: an MR with a window bound deregistered", r)
		}
		if typ == MWType2 && rng.IntN(2) == 0 {
			if err := qb.PostSend(SendWR{Opcode: OpLocalInv, InvRKey: rkey, Flags: SendSignaled}); err != nil {
				return err
			}
			if wc, err := one(cqb); err != nil || wc.Status != WCSuccess {
				return fmt.Errorf("invalidate: %v %v %s", err, wc.Status, wc.Detail)
			}
		}
		if err := mw.Dealloc(); err != nil {
			return err
		}
		if err := mr.Dereg(); err != nil {
			return err
		}
		if err := b.dev.Free(buf); err != nil {
			return err
		}
	}
	return nil
}
