package odp

import (
	"encoding/binary"
	"sync"
	"sync/atomic"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

const rwa = rw | AccessRemoteAtomic

// dontneed drops b's pages, as test_odp.py does before each iteration to force faults.
func dontneed(t testing.TB, b []byte) {
	t.Helper()
	require.NoError(t, unix.Madvise(b, unix.MADV_DONTNEED))
}

// post posts wr signaled on n's QP and returns its completion.
func (n *node) post(t testing.TB, wr SendWR) WC {
	t.Helper()
	wr.Flags |= SendSignaled
	require.NoError(t, n.qp.PostSend(wr))
	return wait(t, n.scq)
}

func modes() []struct {
	name   string
	access Access
} {
	return []struct {
		name   string
		access Access
	}{{"pinned", 0}, {"odp", AccessOnDemand}}
}

// Compare-and-swap and fetch-and-add, as test_odp.py's atomic tests, with the remote
// and local pages dropped before each iteration so that every atomic faults on ODP.
func TestAtomics(t *testing.T) {
	for _, m := range modes() {
		t.Run(m.name, func(t *testing.T) {
			a, b := pair(t, Config{})
			local, lmr := a.region(t, ps, rwa|m.access)
			remote, rmr := b.region(t, 2*ps, rwa|m.access)
			word := func(buf []byte, off int) uint64 { return binary.NativeEndian.Uint64(buf[off:]) }
			for it := 0; it < 4; it++ {
				if m.access != 0 {
					dontneed(t, remote)
					dontneed(t, local)
				}
				binary.NativeEndian.PutUint64(remote[ps+8:], 100)
				// A compare that fails leaves memory alone and returns the value.
				wc := a.post(t, SendWR{WRID: 1, Opcode: OpAtomicCmpSwap, SGL: sge(lmr, 0, 8), RemoteAddr: rmr.Addr() + uint64(ps) + 8,
					RKey: rmr.RKey(), CompareAdd: 5, Swap: 7})
				require.Equal(t, WCSuccess, wc.Status, wc.Detail)
				assert.Equal(t, WC{WRID: 1, Opcode: WCCompSwap, ByteLen: 8, QPNum: a.qp.QPNum()}, wc)
				assert.EqualValues(t, 100, word(local, 0))
				assert.EqualValues(t, 100, word(remote, ps+8))
				// One that matches swaps.
				wc = a.post(t, SendWR{WRID: 2, Opcode: OpAtomicCmpSwap, SGL: sge(lmr, 16, 8), RemoteAddr: rmr.Addr() + uint64(ps) + 8,
					RKey: rmr.RKey(), CompareAdd: 100, Swap: 1 << 63})
				require.Equal(t, WCSuccess, wc.Status, wc.Detail)
				assert.EqualValues(t, 100, word(local, 16))
				assert.EqualValues(t, uint64(1<<63), word(remote, ps+8))
				// Fetch-and-add wraps like the hardware's.
				wc = a.post(t, SendWR{WRID: 3, Opcode: OpAtomicFetchAdd, SGL: sge(lmr, 24, 8), RemoteAddr: rmr.Addr() + uint64(ps) + 8,
					RKey: rmr.RKey(), CompareAdd: 1 << 63})
				require.Equal(t, WCSuccess, wc.Status, wc.Detail)
				assert.Equal(t, WCFetchAdd, wc.Opcode)
				assert.EqualValues(t, uint64(1<<63), word(local, 24))
				assert.EqualValues(t, 0, word(remote, ps+8))
			}
			if m.access != 0 {
				assert.GreaterOrEqual(t, b.dev.Stats().PageFaults, uint64(4), "every iteration faulted at the responder")
			}
		})
	}
}

// NIC atomics from two QPs and the application's own atomic adds on the same word
// lose no update.
func TestAtomicsAreAtomic(t *testing.T) {
	for _, m := range modes() {
		t.Run(m.name, func(t *testing.T) {
			srv := newNode(t, Config{})
			remote, rmr := srv.region(t, ps, rwa|m.access)
			ctr := (*uint64)(unsafe.Pointer(&remote[64]))
			const perQP, cpuAdds = 300, 3000
			var clients []*node
			for i := 0; i < 2; i++ {
				c := newNode(t, Config{})
				qp, err := srv.pd.CreateQP(QPConfig{SendCQ: srv.scq, RecvCQ: srv.rcq})
				require.NoError(t, err)
				require.NoError(t, ConnectLoopback(c.qp, qp))
				clients = append(clients, c)
			}
			var wg sync.WaitGroup
			for _, c := range clients {
				_, lmr := c.region(t, ps, rwa|m.access)
				wg.Add(1)
				go func() {
					defer wg.Done()
					for i := 0; i < perQP; i++ {
						wc := c.post(t, SendWR{Opcode: OpAtomicFetchAdd, SGL: sge(lmr, 0, 8), RemoteAddr: rmr.Addr() + 64,
							RKey: rmr.RKey(), CompareAdd: 1})
						if !assert.Equal(t, WCSuccess, wc.Status, wc.Detail) {
							return
						}
					}
				}()
			}
			for i := 0; i < cpuAdds; i++ {
				atomic.AddUint64(ctr, 1)
			}
			wg.Wait()
			assert.EqualValues(t, 2*perQP+cpuAdds, atomic.LoadUint64(ctr))
		})
	}
}

// RDMA WRITE with immediate writes, then consumes a receive whose completion carries
// the immediate; SEND with immediate places its data and carries it too. Several
// SGEs cross page and MR boundaries on both sides.
func TestImmediates(t *testing.T) {
	for _, m := range modes() {
		t.Run(m.name, func(t *testing.T) {
			a, b := pair(t, Config{})
			src1, s1 := a.region(t, 2*ps, rw|m.access)
			src2, s2 := a.region(t, 2*ps, rw|m.access)
			dst, dmr := b.region(t, 4*ps, rw|m.access)
			fill(src1, 1)
			fill(src2, 2)
			for it := 0; it < 3; it++ {
				if m.access != 0 {
					dontneed(t, dst)
				}
				sgl := append(sge(s1, ps-100, 200), sge(s2, ps-50, 100)...) // 300 bytes, 4 pages, 2 MRs
				require.NoError(t, b.qp.PostRecv(RecvWR{WRID: 10}))
				wc := a.post(t, SendWR{WRID: 1, Opcode: OpRDMAWriteImm, SGL: sgl, RemoteAddr: dmr.Addr() + uint64(ps) - 10,
					RKey: dmr.RKey(), Imm: 0xfeedf00d})
				require.Equal(t, WCSuccess, wc.Status, wc.Detail)
				assert.Equal(t, WCRDMAWrite, wc.Opcode)
				rwc := wait(t, b.rcq)
				assert.Equal(t, WC{WRID: 10, Opcode: WCRecvRDMAWithImm, ByteLen: 300, QPNum: b.qp.QPNum(), Flags: WCWithImm,
					ImmData: 0xfeedf00d}, rwc)
				assert.Equal(t, src1[ps-100:ps+100], dst[ps-10:ps+190])
				assert.Equal(t, src2[ps-50:ps+50], dst[ps+190:ps+290])

				require.NoError(t, b.qp.PostRecv(RecvWR{WRID: 11, SGL: append(sge(dmr, 2*ps-5, 10), sge(dmr, 3*ps, 400)...)}))
				wc = a.post(t, SendWR{WRID: 2, Opcode: OpSendImm, SGL: sgl, Imm: 42})
				require.Equal(t, WCSuccess, wc.Status, wc.Detail)
				assert.Equal(t, WCSend, wc.Opcode)
				rwc = wait(t, b.rcq)
				assert.Equal(t, WC{WRID: 11, Opcode: WCRecv, ByteLen: 300, QPNum: b.qp.QPNum(), Flags: WCWithImm, ImmData: 42}, rwc)
				assert.Equal(t, src1[ps-100:ps-90], dst[2*ps-5:2*ps+5])
				assert.Equal(t, src1[ps-90:ps+100], dst[3*ps:3*ps+190])
			}
		})
	}
}

func fill(b []byte, seed byte) {
	for i := range b {
		b[i] = byte(i*31) ^ seed
	}
}

// Inline data is copied at post time: the buffer may change right after, and needs
// no key (here it is not even registered).
func TestInline(t *testing.T) {
	a, b := pair(t, Config{})
	dst, dmr := b.region(t, ps, rw|AccessOnDemand)
	src := []byte("inline payload, from the Go heap")
	want := append([]byte(nil), src...)
	sgl := []SGE{{Addr: uint64(addrOf(src)), Length: uint32(len(src)), LKey: 0xbad}}
	require.NoError(t, a.qp.PostSend(SendWR{WRID: 1, Opcode: OpRDMAWrite, SGL: sgl, Flags: SendInline | SendSignaled,
		RemoteAddr: dmr.Addr() + 7, RKey: dmr.RKey()}))
	copy(src, "overwritten at once")
	wc := wait(t, a.scq)
	require.Equal(t, WCSuccess, wc.Status, wc.Detail)
	assert.Equal(t, want, dst[7:7+len(want)])
}
