package odp

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/odpemu/odpemu/internal/fusemount"
	"github.com/odpemu/odpemu/pagefault"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	if role := os.Getenv("ODPEMU_PEER"); role != "" { // a peer of a two-process test
		os.Exit(runPeer(role))
	}
	code := fusemount.TestMain(m)
	if err := goleak.Find(); err != nil && code == 0 {
		fmt.Fprintf(os.Stderr, "goleak: %v\n", err)
		code = 1
	}
	os.Exit(code)
}

// node is one emulated NIC with a PD, CQs and a QP.
type node struct {
	dev *Device
	pd  *PD
	scq *CQ
	rcq *CQ
	qp  *QP
}

// needKernel skips the test, saying why, when the kernel lacks what cfg needs.
func needKernel(t testing.TB, cfg Config) {
	t.Helper()
	if err := checkKernel(cfg, pagefault.ProbeKernelBehaviour()); err != nil {
		t.Skipf("skipped: %v", err)
	}
}

func newNode(t testing.TB, cfg Config) *node {
	t.Helper()
	needKernel(t, cfg)
	d, err := Open(cfg)
	require.NoError(t, err)
	t.Cleanup(func() {
		if err := d.Close(); err != nil && !errors.Is(err, ErrClosed) { // some tests close it themselves
			t.Errorf("close: %v", err)
		}
	})
	pd, err := d.AllocPD()
	require.NoError(t, err)
	scq, err := d.CreateCQ(ps)
	require.NoError(t, err)
	rcq, err := d.CreateCQ(ps)
	require.NoError(t, err)
	qp, err := pd.CreateQP(QPConfig{SendCQ: scq, RecvCQ: rcq, MaxSendWR: 256, MaxRecvWR: 256})
	require.NoError(t, err)
	return &node{dev: d, pd: pd, scq: scq, rcq: rcq, qp: qp}
}

// pair returns two connected nodes.
func pair(t testing.TB, cfg Config) (*node, *node) {
	t.Helper()
	a, b := newNode(t, cfg), newNode(t, cfg)
	if wireUDP() {
		connectUDP(t, a.qp, b.qp, UDPConfig{Addr: addrA}, UDPConfig{Addr: addrB})
	} else {
		require.NoError(t, ConnectLoopback(a.qp, b.qp))
	}
	return a, b
}

// region allocates n bytes on the node's device and registers them.
func (n *node) region(t testing.TB, size int, access Access) ([]byte, *MR) {
	t.Helper()
	buf, err := n.dev.Alloc(size)
	require.NoError(t, err)
	mr, err := n.pd.RegMR(buf, access)
	require.NoError(t, err)
	return buf, mr
}

// wait returns the next completion on cq, failing the test after 10 s.
func wait(t testing.TB, cq *CQ) WC {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var wc [1]WC
	n, err := cq.Wait(ctx, wc[:])
	require.NoError(t, err, "waiting for a completion")
	require.Equal(t, 1, n)
	return wc[0]
}

func sge(mr *MR, off, n int) []SGE {
	return []SGE{{Addr: mr.Addr() + uint64(off), Length: uint32(n), LKey: mr.LKey()}}
}

const rw = AccessLocalWrite | AccessRemoteWrite | AccessRemoteRead

func TestWriteReadSend(t *testing.T) {
	for _, mode := range []struct {
		name   string
		access Access
	}{{"pinned", rw}, {"odp", rw | AccessOnDemand}} {
		t.Run(mode.name, func(t *testing.T) {
			a, b := pair(t, Config{})
			const size = 1 << 20
			src, smr := a.region(t, size, mode.access)
			dst, dmr := b.region(t, size, mode.access)
			for i := range src {
				src[i] = byte(i * 7)
			}
			// WRITE 300 KiB at an unaligned offset.
			require.NoError(t, a.qp.PostSend(SendWR{WRID: 1, Opcode: OpRDMAWrite, SGL: sge(smr, 100, 300<<10),
				Flags: SendSignaled, RemoteAddr: dmr.Addr() + 5000, RKey: dmr.RKey()}))
			wc := wait(t, a.scq)
			require.Equal(t, WCSuccess, wc.Status, wc.Detail)
			assert.Equal(t, WC{WRID: 1, Opcode: WCRDMAWrite, QPNum: a.qp.QPNum()}, wc)
			require.True(t, bytes.Equal(src[100:100+300<<10], dst[5000:5000+300<<10]))
			assert.Zero(t, dst[4999])

			// READ it back into another place of a's region.
			require.NoError(t, a.qp.PostSend(SendWR{WRID: 2, Opcode: OpRDMARead, SGL: sge(smr, 600<<10, 300<<10),
				Flags: SendSignaled, RemoteAddr: dmr.Addr() + 5000, RKey: dmr.RKey()}))
			wc = wait(t, a.scq)
			require.Equal(t, WCSuccess, wc.Status, wc.Detail)
			assert.EqualValues(t, 300<<10, wc.ByteLen, "a READ completion reports its length")
			require.True(t, bytes.Equal(src[100:100+300<<10], src[600<<10:900<<10]))

			// SEND into a two-SGE receive.
			require.NoError(t, b.qp.PostRecv(RecvWR{WRID: 9, SGL: append(sge(dmr, 0, 10), sge(dmr, 1000, 4000)...)}))
			require.NoError(t, a.qp.PostSend(SendWR{WRID: 3, Opcode: OpSend, SGL: sge(smr, 0, 3000), Flags: SendSignaled}))
			wc = wait(t, a.scq)
			require.Equal(t, WCSuccess, wc.Status, wc.Detail)
			rwc := wait(t, b.rcq)
			assert.Equal(t, WC{WRID: 9, Opcode: WCRecv, ByteLen: 3000, QPNum: b.qp.QPNum()}, rwc)
			assert.Equal(t, src[:10], dst[:10])
			assert.Equal(t, src[10:3000], dst[1000:3990])

			if mode.access&AccessOnDemand != 0 {
				st := b.dev.Stats()
				assert.NotZero(t, st.PageFaults, "ODP destination faulted")
				assert.NotZero(t, dmr.Stats().PagesFaulted)
			} else {
				assert.Zero(t, b.dev.Stats().PageFaults)
				assert.EqualValues(t, size, b.dev.Stats().PinnedBytes)
			}
		})
	}
}

// An ODP MR starts with every entry invalid and maps exactly what the NIC touched,
// widened to the fault-around alignment.
func TestODPFaultsLazilyWithFaultAround(t *testing.T) {
	a, b := pair(t, Config{FaultAround: 4, NoSnapshot: true})
	src, smr := a.region(t, 64<<10, AccessLocalWrite)
	_, dmr := b.region(t, 1<<20, rw|AccessOnDemand)
	src[0] = 1
	assert.Zero(t, dmr.Stats().ValidPages)
	// 2 bytes straddling pages 9 and 10: pages 8..11 get mapped.
	require.NoError(t, a.qp.PostSend(SendWR{Opcode: OpRDMAWrite, SGL: sge(smr, 0, 2), Flags: SendSignaled,
		RemoteAddr: dmr.Addr() + 10*up - 1, RKey: dmr.RKey()}))
	require.Equal(t, WCSuccess, wait(t, a.scq).Status)
	st := dmr.Stats()
	assert.EqualValues(t, 1, st.PageFaults)
	assert.EqualValues(t, 4, st.PagesFaulted)
	assert.Equal(t, 4, st.ValidPages)
	for p := 8; p < 12; p++ {
		e := dmr.Entry(p)
		assert.True(t, e.Valid && e.Writable, "page %d", p)
		if b.dev.PFNsReadable() {
			assert.NotZero(t, e.PFN)
		}
	}
	assert.False(t, dmr.Entry(12).Valid)
	// The same range again hits the table: no new fault.
	require.NoError(t, a.qp.PostSend(SendWR{Opcode: OpRDMAWrite, SGL: sge(smr, 0, 2), Flags: SendSignaled,
		RemoteAddr: dmr.Addr() + 10*up - 1, RKey: dmr.RKey()}))
	require.Equal(t, WCSuccess, wait(t, a.scq).Status)
	assert.EqualValues(t, 1, dmr.Stats().PageFaults)
}

// Pages the application touched before registration are mapped by the snapshot.
func TestODPSnapshot(t *testing.T) {
	n := newNode(t, Config{})
	buf, err := n.dev.Alloc(64 << 10)
	require.NoError(t, err)
	for p := 0; p < 4; p++ {
		buf[p*ps] = 1
	}
	mr, err := n.pd.RegMR(buf, rw|AccessOnDemand)
	require.NoError(t, err)
	assert.Equal(t, 4, mr.Stats().ValidPages)
	assert.True(t, mr.Entry(0).Writable)
	assert.False(t, mr.Entry(4).Valid)
}

func TestPinnedRegistrationTimesStagesAndBuildsMTT(t *testing.T) {
	n := newNode(t, Config{})
	buf := make([]byte, 256<<10) // pinned MRs accept any memory, the Go heap too
	mr, err := n.pd.RegMR(buf, AccessLocalWrite)
	require.NoError(t, err)
	reg := mr.Registration()
	assert.NotZero(t, reg.Pin)
	assert.NotZero(t, reg.MTT)
	assert.GreaterOrEqual(t, reg.Total, reg.Pin+reg.MTT)
	assert.Equal(t, mr.table.Pages(), mr.Stats().ValidPages, "every page mapped at registration")
	if n.dev.PFNsReadable() {
		assert.NotZero(t, mr.Entry(3).PFN)
	}
	assert.EqualValues(t, mr.table.Pages()*ps, n.dev.Stats().PinnedBytes)
	require.NoError(t, mr.Dereg())
	assert.Zero(t, n.dev.Stats().PinnedBytes)
}

func TestMemlockLimit(t *testing.T) {
	n := newNode(t, Config{MemlockLimit: 1 << 20})
	buf, err := n.dev.Alloc(2 << 20)
	require.NoError(t, err)
	_, err = n.pd.RegMR(buf, AccessLocalWrite)
	require.ErrorIs(t, err, ErrMemlockLimit)
	assert.ErrorContains(t, err, "RLIMIT_MEMLOCK")
	// ODP pins nothing, so the same buffer registers on demand.
	mr, err := n.pd.RegMR(buf, AccessLocalWrite|AccessOnDemand)
	require.NoError(t, err)
	require.NoError(t, mr.Dereg())
	small, err := n.pd.RegMR(buf[:1<<20], AccessLocalWrite)
	require.NoError(t, err)
	_, err = n.pd.RegMR(buf[1<<20:1<<20+ps], AccessLocalWrite)
	assert.ErrorIs(t, err, ErrMemlockLimit, "the limit counts what is already pinned")
	require.NoError(t, small.Dereg())
}

func TestKeysAreNotReusedAfterDereg(t *testing.T) {
	n := newNode(t, Config{})
	buf, err := n.dev.Alloc(ps)
	require.NoError(t, err)
	seen := map[uint32]bool{}
	var prev uint32
	for i := 0; i < 300; i++ {
		mr, err := n.pd.RegMR(buf, AccessLocalWrite|AccessOnDemand)
		require.NoError(t, err)
		require.False(t, seen[mr.LKey()], "key %#x reused", mr.LKey())
		seen[mr.LKey()] = true
		assert.Equal(t, mr.LKey(), mr.RKey())
		if prev != 0 {
			assert.Nil(t, n.dev.lookupMR(prev), "deregistered key still resolves")
		}
		prev = mr.LKey()
		require.NoError(t, mr.Dereg())
	}
	// Two devices start their keys at different places.
	m := newNode(t, Config{})
	buf2, err := m.dev.Alloc(ps)
	require.NoError(t, err)
	mr2, err := m.pd.RegMR(buf2, AccessLocalWrite|AccessOnDemand)
	require.NoError(t, err)
	assert.False(t, seen[mr2.LKey()] && mr2.LKey() == prev)
}

func TestOverlappingODPRegistrations(t *testing.T) {
	a, b := pair(t, Config{})
	src, smr := a.region(t, 8192, AccessLocalWrite)
	src[0] = 42
	dst, err := b.dev.Alloc(64 << 10)
	require.NoError(t, err)
	outer, err := b.pd.RegMR(dst, rw|AccessOnDemand)
	require.NoError(t, err)
	inner, err := b.pd.RegMR(dst[8192:16384], rw|AccessOnDemand)
	require.NoError(t, err)
	// Deregistering the inner MR must not unregister the outer one's userfaultfd range.
	require.NoError(t, inner.Dereg())
	require.NoError(t, a.qp.PostSend(SendWR{Opcode: OpRDMAWrite, SGL: sge(smr, 0, 1), Flags: SendSignaled,
		RemoteAddr: outer.Addr() + 8192, RKey: outer.RKey()}))
	require.Equal(t, WCSuccess, wait(t, a.scq).Status)
	assert.EqualValues(t, 42, dst[8192])
	assert.NotZero(t, outer.Stats().PageFaults, "the outer range still faults through userfaultfd")
	require.ErrorIs(t, inner.Dereg(), ErrInvalidArgument)
}

func TestFreeAndClose(t *testing.T) {
	n := newNode(t, Config{})
	buf, mr := n.region(t, 8192, AccessLocalWrite|AccessOnDemand)
	assert.ErrorIs(t, n.dev.Free(buf), ErrBusy)
	assert.ErrorIs(t, n.pd.Dealloc(), ErrBusy)
	require.NoError(t, mr.Dereg())
	require.NoError(t, n.dev.Free(buf))
	assert.ErrorIs(t, n.dev.Free(buf), ErrInvalidArgument)
	require.NoError(t, n.dev.Close())
	assert.ErrorIs(t, n.dev.Close(), ErrClosed)
	_, err := n.dev.Alloc(1)
	assert.ErrorIs(t, err, ErrClosed)
	// Objects of a closed device are gone, whether or not they were destroyed.
	assert.ErrorIs(t, n.pd.Dealloc(), ErrClosed)
	assert.ErrorIs(t, n.scq.Destroy(), ErrClosed)
	_, err = n.scq.Poll(make([]WC, 1))
	assert.ErrorIs(t, err, ErrClosed)
	assert.ErrorIs(t, n.qp.Destroy(), ErrClosed)
	_, err = n.dev.AllocPD()
	assert.ErrorIs(t, err, ErrClosed)
	_, err = n.dev.CreateCQ(1)
	assert.ErrorIs(t, err, ErrClosed)
}

func timeDiv(n uint64) time.Duration { return time.Duration(max(n, 1)) }

func TestAdvise(t *testing.T) {
	n := newNode(t, Config{FaultAround: 1})
	buf, mr := n.region(t, 64<<10, rw|AccessOnDemand)
	buf[15*ps] = 3 // present before any prefetch (after the snapshot)
	require.NoError(t, mr.Advise(AdvisePrefetchNoFault, mr.Addr(), 64<<10))
	assert.Equal(t, 1, mr.Stats().ValidPages, "only the present page")
	assert.True(t, mr.Entry(15).Writable, "NO_FAULT maps a present, exclusive page with the write permission the MR allows")

	require.NoError(t, mr.Advise(AdvisePrefetch, mr.Addr()+up, 3*up))
	assert.Equal(t, 4, mr.Stats().ValidPages)
	assert.False(t, mr.Entry(1).Writable, "PREFETCH maps read-only")
	require.NoError(t, mr.Advise(AdvisePrefetchWrite, mr.Addr()+up, 1))
	assert.True(t, mr.Entry(1).Writable)
	st := mr.Stats()
	assert.EqualValues(t, 3, st.Prefetches)
	assert.EqualValues(t, 1+3+1, st.PagesPrefetched)
	assert.Zero(t, st.PageFaults, "prefetches are not faults")
	assert.EqualValues(t, 3, n.dev.Stats().Prefetches)

	ro, rmr := n.region(t, ps, AccessRemoteRead|AccessOnDemand)
	_ = ro
	assert.ErrorIs(t, rmr.Advise(AdvisePrefetchWrite, rmr.Addr(), 1), ErrPermission)
	assert.ErrorIs(t, mr.Advise(AdvisePrefetch, mr.Addr()+64<<10, 1), ErrInvalidArgument)
	assert.ErrorIs(t, mr.Advise(Advice(7), mr.Addr(), 1), ErrInvalidArgument)
	pinned, err := n.pd.RegMR(make([]byte, ps), AccessLocalWrite)
	require.NoError(t, err)
	assert.ErrorIs(t, pinned.Advise(AdvisePrefetch, pinned.Addr(), 1), ErrNotSupported)

	require.NoError(t, mr.Dereg())
	ds := n.dev.Stats()
	assert.EqualValues(t, 1, ds.Invalidations)
	assert.EqualValues(t, 4, ds.PagesInvalidated)
}

// memModes are the two kinds of MR the data-path tests run over: pinned and ODP.
var memModes = []struct {
	name string
	odp  Access
}{{"pinned", 0}, {"odp", AccessOnDemand}}

// ps is the page size; up is it as a uint64 (MR offsets), uz as a uintptr.
var (
	ps = PageSize
	up = uint64(PageSize)
	uz = uintptr(PageSize)
)

// Open refuses a Config the kernel cannot serve, naming the missing feature and the
// first kernel that has it; the check itself is tested against kernels without it.
func TestOpenChecksKernelFeatures(t *testing.T) {
	k := pagefault.ProbeKernelBehaviour()
	noMove := k
	noMove.Userfaultfd.Features &^= pagefault.FeatureMove
	require.NoError(t, checkKernel(Config{}, noMove), "plain ODP needs no UFFDIO_MOVE")
	for _, cfg := range []Config{{Paging: true}, {ResidentBudget: 1 << 20}} {
		err := checkKernel(cfg, noMove)
		require.ErrorIs(t, err, ErrNotSupported)
		require.ErrorIs(t, err, pagefault.ErrNotSupported)
		assert.Contains(t, err.Error(), "UFFDIO_MOVE")
		assert.Contains(t, err.Error(), "Linux 6.8")
	}
	noPopulate := k
	noPopulate.PopulateWrite = false
	err := checkKernel(Config{}, noPopulate)
	require.ErrorIs(t, err, ErrNotSupported)
	assert.Contains(t, err.Error(), "MADV_POPULATE_WRITE (Linux 5.14)")
	noEvents := k
	noEvents.Userfaultfd.Features &^= pagefault.FeatureEventUnmap
	assert.ErrorIs(t, checkKernel(Config{}, noEvents), ErrNotSupported)

	// And Open does what the check says on this kernel.
	d, err := Open(Config{Paging: true})
	if k.Has(pagefault.ReqMove) {
		require.NoError(t, err)
		require.NoError(t, d.Close())
	} else {
		require.ErrorIs(t, err, ErrNotSupported)
		t.Logf("this kernel: %v", err)
	}
}

// RC executes a QP's requests in order: a READ followed by a WRITE of the same bytes
// returns what was there before the WRITE, although the READ's response reads the
// responder's memory by reference and the requester copies it later: the responder
// changes no memory while responses it sent are unread, and the requester's copy of
// the last one wakes it. With the ACK timer off and small messages (no bulk transfer
// keeps the engines yielding) nothing else would: a lost wake-up hangs the WRITE.
func TestReadThenWriteInOrder(t *testing.T) {
	for _, n := range []int{64, 64 << 10} {
		t.Run(fmt.Sprintf("%dB", n), func(t *testing.T) {
			a, b := pair(t, Config{})
			require.NoError(t, a.qp.ModifyAttr(QPAttr{Timeout: 0}, AttrTimeout))
			src, smr := a.region(t, n, rw)
			back, bmr := a.region(t, n, rw)
			dst, dmr := b.region(t, n, rw)
			for i := 0; i < 100; i++ {
				v := byte(2*i + 1)
				for k := range dst {
					dst[k], src[k] = v, v+1
				}
				require.NoError(t, a.qp.PostSend(SendWR{WRID: 1, Opcode: OpRDMARead, SGL: sge(bmr, 0, n), Flags: SendSignaled,
					RemoteAddr: dmr.Addr(), RKey: dmr.RKey()}))
				require.NoError(t, a.qp.PostSend(SendWR{WRID: 2, Opcode: OpRDMAWrite, SGL: sge(smr, 0, n), Flags: SendSignaled,
					RemoteAddr: dmr.Addr(), RKey: dmr.RKey()}))
				for k := 0; k < 2; k++ {
					wc := wait(t, a.scq)
					require.Equal(t, WCSuccess, wc.Status, wc.Detail)
				}
				require.True(t, uniform(back) && back[0] == v, "iteration %d: the READ saw the WRITE after it (%#x...%#x, want %#x)",
					i, back[0], back[n-1], v)
				require.True(t, uniform(dst) && dst[0] == v+1)
			}
		})
	}
}

// TestPingPongCompletionOrder: a QP's completions come in the order of the packets
// that caused them, across its two CQs, as a NIC writes them. In a ping-pong the ACK
// of a SEND reaches its requester before the peer's reply does (the peer's NIC sent
// it when the SEND arrived, before the peer's application saw the receive), so once
// the reply's receive completion is seen, the SEND's completion is already in the
// send CQ: perftest's ib_send_lat -e polls that CQ once and trusts what it finds. Both
// can arrive in one of the engine's receive passes, which once pushed the receive
// completion before the SEND's.
func TestPingPongCompletionOrder(t *testing.T) {
	a, b := pair(t, Config{})
	const n, size = 1000, 64
	abuf, amr := a.region(t, 2*size, rw)
	_, bmr := b.region(t, 2*size, rw)
	post := func(nd *node, mr *MR, i int) {
		require.NoError(t, nd.qp.PostRecv(RecvWR{WRID: uint64(i), SGL: sge(mr, size, size)}))
	}
	for i := 0; i < 16; i++ {
		post(a, amr, i)
		post(b, bmr, i)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pong := make(chan error, 1)
	go func() { // b answers each SEND as soon as it sees it
		var wc [1]WC
		for i := 0; i < n; i++ {
			k, err := b.rcq.Wait(ctx, wc[:])
			if err == nil && (k != 1 || wc[0].Status != WCSuccess) {
				err = fmt.Errorf("ping %d: %d completions, %+v", i, k, wc[0])
			}
			if err == nil && i > 0 {
				// a saw pong i-1 before it sent ping i: its ACK came first.
				k, err = b.scq.Poll(wc[:])
				if err == nil && (k != 1 || wc[0].WRID != uint64(i-1)) {
					err = fmt.Errorf("ping %d came before pong %d's completion (%d, %+v)", i, i-1, k, wc[0])
				}
			}
			if err == nil {
				err = b.qp.PostRecv(RecvWR{WRID: uint64(i), SGL: sge(bmr, size, size)})
			}
			if err == nil {
				err = b.qp.PostSend(SendWR{WRID: uint64(i), Opcode: OpSend, SGL: sge(bmr, 0, size), Flags: SendSignaled})
			}
			if err != nil {
				pong <- err
				cancel() // a stops waiting
				return
			}
		}
		pong <- nil
	}()
	var wc [1]WC
	for i := 0; i < n; i++ {
		abuf[0] = byte(i)
		require.NoError(t, a.qp.PostSend(SendWR{WRID: uint64(i), Opcode: OpSend, SGL: sge(amr, 0, size), Flags: SendSignaled}))
		k, err := a.rcq.Wait(ctx, wc[:])
		if err != nil {
			select {
			case perr := <-pong:
				require.NoError(t, perr)
			default:
			}
		}
		require.NoError(t, err, "round %d: waiting for the pong", i)
		require.Equal(t, WCSuccess, wc[0].Status, wc[0].Detail)
		k, err = a.scq.Poll(wc[:])
		require.NoError(t, err)
		require.Equal(t, 1, k, "round %d: the pong's receive completion came before the ping's own", i)
		require.Equal(t, WC{WRID: uint64(i), Opcode: WCSend, QPNum: a.qp.QPNum()}, wc[0])
		require.NoError(t, a.qp.PostRecv(RecvWR{WRID: uint64(i), SGL: sge(amr, size, size)}))
	}
	require.NoError(t, <-pong)
}

// TestSetSendPSN: a QP sends from the PSN the application chose (as ibv_modify_qp's
// sq_psn sets it), which the peer expects; once connected it cannot change.
func TestSetSendPSN(t *testing.T) {
	a, b := newNode(t, Config{}), newNode(t, Config{})
	require.ErrorIs(t, a.qp.SetSendPSN(1<<24), ErrInvalidArgument)
	const psn = 1<<24 - 2 // wraps after the second packet
	require.NoError(t, a.qp.SetSendPSN(psn))
	require.Equal(t, uint32(psn), a.qp.PSN())
	require.NoError(t, ConnectLoopback(a.qp, b.qp))
	require.ErrorIs(t, a.qp.SetSendPSN(5), ErrQPState)

	src, smr := a.region(t, 3*4096, rw)
	_, dmr := b.region(t, 3*4096, rw)
	for i := range src {
		src[i] = byte(i * 7)
	}
	require.NoError(t, a.qp.PostSend(SendWR{WRID: 1, Opcode: OpRDMAWrite, SGL: sge(smr, 0, len(src)),
		Flags: SendSignaled, RemoteAddr: dmr.Addr(), RKey: dmr.RKey()}))
	wc := wait(t, a.scq)
	require.Equal(t, WCSuccess, wc.Status, wc.Detail)
	require.Equal(t, src, dmr.mem)
}

// TestCQRequestNotify: an armed CQ calls its function for the next completion queued,
// once; completions queued before arming do not; a destroyed CQ calls nothing.
func TestCQRequestNotify(t *testing.T) {
	a, b := pair(t, Config{})
	src, smr := a.region(t, 4096, rw)
	_, dmr := b.region(t, 4096, rw)
	var calls atomic.Int32
	write := func(id uint64) {
		require.NoError(t, a.qp.PostSend(SendWR{WRID: id, Opcode: OpRDMAWrite, SGL: sge(smr, 0, len(src)),
			Flags: SendSignaled, RemoteAddr: dmr.Addr(), RKey: dmr.RKey()}))
	}
	require.ErrorIs(t, a.scq.RequestNotify(nil), ErrInvalidArgument)
	write(1) // queued before arming
	queued := func() int {
		a.scq.mu.Lock()
		defer a.scq.mu.Unlock()
		return a.scq.n
	}
	for queued() == 0 {
		runtime.Gosched()
	}
	require.NoError(t, a.scq.RequestNotify(func() { calls.Add(1) }))
	require.Equal(t, int32(0), calls.Load(), "a completion queued before arming")
	write(2)
	wait(t, a.scq)
	wait(t, a.scq)
	require.Equal(t, int32(1), calls.Load())
	write(3) // not armed any more
	wait(t, a.scq)
	require.Equal(t, int32(1), calls.Load())

	cq, err := a.dev.CreateCQ(4)
	require.NoError(t, err)
	require.NoError(t, cq.RequestNotify(func() { calls.Add(100) }))
	require.NoError(t, cq.Destroy())
	require.ErrorIs(t, cq.RequestNotify(func() {}), ErrClosed)
	cq.push(WC{})
	require.Equal(t, int32(1), calls.Load(), "a destroyed CQ notifies nobody")
}

// TestQPAccessFlags: a responder refuses what its QP's access flags do not allow,
// whatever the MR allows, with an invalid request NAK (as rxe does); what they allow
// goes on.
func TestQPAccessFlags(t *testing.T) {
	require.ErrorIs(t, newNode(t, Config{}).qp.ModifyAttr(QPAttr{Access: AccessOnDemand}, AttrAccess), ErrInvalidArgument)
	for _, tc := range []struct {
		allow Access
		op    Opcode
		ok    bool
	}{
		{AccessRemoteRead, OpRDMAWrite, false}, {AccessRemoteRead, OpRDMARead, true},
		{AccessRemoteWrite, OpRDMARead, false}, {AccessLocalWrite | AccessRemoteWrite, OpRDMAWrite, true},
		{AccessRemoteWrite | AccessRemoteRead, OpAtomicFetchAdd, false}, {AccessRemoteAtomic, OpAtomicFetchAdd, true},
		{0, OpSend, true},
	} {
		a, b := pair(t, Config{})
		require.NoError(t, b.qp.ModifyAttr(QPAttr{Access: tc.allow}, AttrAccess))
		require.Equal(t, tc.allow, b.qp.Attr().Access)
		_, smr := a.region(t, ps, rw)
		_, dmr := b.region(t, ps, rw|AccessRemoteAtomic)
		require.NoError(t, b.qp.PostRecv(RecvWR{WRID: 7, SGL: sge(dmr, 0, ps)}))
		wr := SendWR{WRID: 1, Opcode: tc.op, SGL: sge(smr, 0, 64), Flags: SendSignaled, RemoteAddr: dmr.Addr(), RKey: dmr.RKey()}
		if tc.op.atomic() {
			wr.SGL = sge(smr, 0, 8)
		}
		require.NoError(t, a.qp.PostSend(wr))
		wc := wait(t, a.scq)
		if tc.ok {
			require.Equal(t, WCSuccess, wc.Status, "%v with %v: %s", tc.op, tc.allow, wc.Detail)
		} else {
			require.Equal(t, WCRemInvReqErr, wc.Status, "%v with %v", tc.op, tc.allow)
			require.Contains(t, b.qp.RespError(), "does not allow")
		}
	}
}
