package regcache

import (
	"context"
	"errors"
	"testing"
	"time"
	"unsafe"

	"github.com/odpemu/odpemu/odp"
	"github.com/odpemu/odpemu/pagefault"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"golang.org/x/sys/unix"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var page = int(pagefault.PageSize)

const access = odp.AccessLocalWrite | odp.AccessRemoteRead

// nic is a device whose QP is connected to a peer's, and the peer's region.
type nic struct {
	dev, peer *odp.Device
	pd        *odp.PD
	qp        *odp.QP
	cq        *odp.CQ
	sink      *odp.MR
}

func newNIC(t *testing.T, cfg odp.Config) *nic {
	t.Helper()
	if err := pagefault.ProbeKernelBehaviour().Check(pagefault.ReqEvents); err != nil {
		t.Skipf("skipped: the memory monitor needs userfaultfd events: %v", err)
	}
	n := &nic{}
	var err error
	var qps [2]*odp.QP
	for i, d := range []**odp.Device{&n.dev, &n.peer} {
		*d, err = odp.Open(cfg)
		require.NoError(t, err)
		dev := *d
		t.Cleanup(func() { assert.NoError(t, dev.Close()) })
		pd, err := dev.AllocPD()
		require.NoError(t, err)
		cq, err := dev.CreateCQ(16)
		require.NoError(t, err)
		qps[i], err = pd.CreateQP(odp.QPConfig{SendCQ: cq, RecvCQ: cq, MaxSendWR: 8})
		require.NoError(t, err)
		if i == 0 {
			n.pd, n.cq = pd, cq
		} else {
			buf, err := dev.Alloc(1 << 20)
			require.NoError(t, err)
			n.sink, err = pd.RegMR(buf, odp.AccessLocalWrite|odp.AccessRemoteWrite)
			require.NoError(t, err)
		}
	}
	n.qp = qps[0]
	require.NoError(t, odp.ConnectLoopback(qps[0], qps[1]))
	return n
}

// send WRITEs buf through h's registration and returns the completion status.
func (n *nic) send(t *testing.T, h *Handle, buf []byte) odp.WCStatus {
	t.Helper()
	require.NoError(t, n.qp.PostSend(odp.SendWR{Opcode: odp.OpRDMAWrite, Flags: odp.SendSignaled,
		SGL:        []odp.SGE{{Addr: uint64(uintptr(unsafe.Pointer(&buf[0]))), Length: uint32(len(buf)), LKey: h.MR().LKey()}},
		RemoteAddr: n.sink.Addr(), RKey: n.sink.RKey()}))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	wc := make([]odp.WC, 1)
	got, err := n.cq.Wait(ctx, wc)
	require.NoError(t, err)
	require.Equal(t, 1, got)
	return wc[0].Status
}

func mmap(t *testing.T, n int) []byte {
	t.Helper()
	b, err := unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	require.NoError(t, err)
	for i := range b {
		b[i] = 'x'
	}
	return b
}

func newCache(t *testing.T, n *nic, capacity int64) *Cache {
	t.Helper()
	c, err := New(n.pd, access, capacity)
	require.NoError(t, err)
	t.Cleanup(func() {
		if err := c.Close(); !errors.Is(err, ErrClosed) {
			assert.NoError(t, err)
		}
	})
	return c
}

func get(t *testing.T, c *Cache, b []byte) *Handle {
	t.Helper()
	h, err := c.Get(b)
	require.NoError(t, err, "%#v", err)
	return h
}

func TestHitsAndEviction(t *testing.T) {
	n := newNIC(t, odp.Config{})
	c := newCache(t, n, int64(4*page))
	a, b, d := mmap(t, 2*page), mmap(t, 2*page), mmap(t, 2*page)
	defer func() {
		for _, m := range [][]byte{a, b, d} {
			assert.NoError(t, unix.Munmap(m))
		}
	}()
	h := get(t, c, a)
	assert.Equal(t, odp.WCSuccess, n.send(t, h, a))
	require.NoError(t, h.Release())
	h2 := get(t, c, a[100:page+5]) // inside the cached pages
	assert.Same(t, h.MR(), h2.MR())
	require.NoError(t, h2.Release())
	st, err := c.Stats()
	require.NoError(t, err)
	assert.Equal(t, Stats{Hits: 1, Misses: 1, Entries: 1, Bytes: int64(2 * page)}, st)
	assert.Equal(t, odp.WCSuccess, n.send(t, h2, a))

	// b fills the capacity; d evicts the least recently used, a.
	require.NoError(t, get(t, c, b).Release())
	hd := get(t, c, d)
	st, _ = c.Stats()
	assert.EqualValues(t, 1, st.Evictions)
	assert.Equal(t, 2, st.Entries)
	// An entry in use is not evicted: holding d, a and b fit only by dropping b.
	ha := get(t, c, a)
	st, _ = c.Stats()
	assert.EqualValues(t, 4, st.Misses)
	assert.EqualValues(t, 2, st.Evictions, "b went, d is in use")
	assert.Equal(t, odp.WCSuccess, n.send(t, hd, d))
	require.NoError(t, hd.Release())
	require.NoError(t, ha.Release())
	// The registration evicted first is gone (the error moves the QP to ERR: last).
	assert.Equal(t, odp.WCLocProtErr, n.send(t, h, a))
}

// After munmap and a new mapping at the same address the cache registers anew: the
// audit, which compares a pinned MR's frames with the address's, finds no DMA
// through the old pages. Without the cache's monitor the same reuse is stale.
func TestNoStaleHitAfterRemap(t *testing.T) {
	if !odpCanAudit(t) {
		t.Skip("skipped: the audit needs readable page frames (root)")
	}
	for _, monitored := range []bool{true, false} {
		name := map[bool]string{true: "cache", false: "old registration kept"}[monitored]
		t.Run(name, func(t *testing.T) {
			n := newNIC(t, odp.Config{Audit: true})
			c := newCache(t, n, 1<<20)
			a := mmap(t, 4*page)
			addr := unsafe.Pointer(&a[0])
			h := get(t, c, a)
			require.Equal(t, odp.WCSuccess, n.send(t, h, a))
			require.NoError(t, h.Release())
			require.NoError(t, unix.Munmap(a))
			b := remapAt(t, addr, 4*page)
			defer munmap(t, b)
			if monitored {
				h2 := get(t, c, b)
				assert.NotSame(t, h.MR(), h2.MR(), "a new registration")
				assert.Equal(t, odp.WCSuccess, n.send(t, h2, b))
				require.NoError(t, h2.Release())
				st, err := c.Stats()
				require.NoError(t, err)
				assert.EqualValues(t, 1, st.Invalidations)
				assert.Zero(t, n.dev.Stats().StaleDMAs)
				return
			}
			// What a cache without a monitor would do: keep using the old MR.
			old := h.MR()
			_ = n.send(t, &Handle{c: c, e: &entry{mr: old}}, b)
			assert.Positive(t, n.dev.Stats().StaleDMAs, "the audit sees the old frames")
		})
	}
}

func odpCanAudit(t *testing.T) bool {
	d, err := odp.Open(odp.Config{})
	require.NoError(t, err)
	defer func() { assert.NoError(t, d.Close()) }()
	return d.PFNsReadable()
}

// munmap unmaps b, which remapAt mapped (unix.Munmap knows only its own mappings).
func munmap(t *testing.T, b []byte) {
	assert.NoError(t, unix.MunmapPtr(unsafe.Pointer(&b[0]), uintptr(len(b))))
}

// remapAt maps n fresh bytes at addr, filled with 'y'.
func remapAt(t *testing.T, addr unsafe.Pointer, n int) []byte {
	t.Helper()
	p, err := unix.MmapPtr(-1, 0, addr, uintptr(n), unix.PROT_READ|unix.PROT_WRITE,
		unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_FIXED_NOREPLACE)
	require.NoError(t, err)
	require.Equal(t, addr, p, "the same address")
	b := unsafe.Slice((*byte)(p), n)
	for i := range b {
		b[i] = 'y'
	}
	return b
}

// mremap (a REMAP event) drops entries too, and a handle in use when its entry is
// dropped stays valid until released. (The emulator pins by mlock, which refuses
// MADV_DONTNEED on pinned pages: REMOVE events, handled the same way, cannot
// concern a cached entry here.) Growing the pinned range also populates it: with
// ranges watched for missing pages that would hang (see the package doc).
func TestMoveInvalidates(t *testing.T) {
	if err := pagefault.ProbeKernelBehaviour().Check(pagefault.ReqWriteProtect); err != nil {
		t.Skipf("skipped: ranges are watched for missing pages here, and growing one hangs: %v", err)
	}
	n := newNIC(t, odp.Config{})
	c := newCache(t, n, 1<<20)
	b := mmap(t, 4*page)
	h := get(t, c, b)
	moved, err := unix.Mremap(b, 8*page, unix.MREMAP_MAYMOVE)
	require.NoError(t, err)
	defer func() { assert.NoError(t, unix.Munmap(moved)) }()
	st, err := c.Stats()
	require.NoError(t, err)
	assert.EqualValues(t, 1, st.Invalidations)
	assert.Zero(t, st.Entries)
	require.NoError(t, h.Release(), "the dropped handle's MR is deregistered by its release")
	h2 := get(t, c, moved[:page])
	assert.NotSame(t, h.MR(), h2.MR())
	require.NoError(t, h2.Release())
}

func TestClosedAndBadInput(t *testing.T) {
	n := newNIC(t, odp.Config{})
	_, err := New(n.pd, access|odp.AccessOnDemand, 1)
	assert.Error(t, err)
	c := newCache(t, n, 1<<20)
	_, err = c.Get(nil)
	assert.True(t, errors.Is(err, odp.ErrInvalidArgument))
	own, err := n.dev.Alloc(page)
	require.NoError(t, err)
	_, err = c.Get(own)
	assert.Error(t, err, "the device's own ODP memory cannot be watched by a second userfaultfd")
	a := mmap(t, page)
	defer func() { assert.NoError(t, unix.Munmap(a)) }()
	require.NoError(t, get(t, c, a).Release())
	require.NoError(t, c.Close())
	_, err = c.Get(a)
	assert.True(t, errors.Is(err, ErrClosed))
	assert.True(t, errors.Is(c.Close(), ErrClosed))
}

// BenchmarkGetHit is a lookup that hits, with the buffer's release: the cost a
// transfer pays for its registration once the cache holds it, among 64 entries.
func BenchmarkGetHit(b *testing.B) {
	if err := pagefault.ProbeKernelBehaviour().Check(pagefault.ReqEvents); err != nil {
		b.Skipf("skipped: the memory monitor needs userfaultfd events: %v", err)
	}
	dev, err := odp.Open(odp.Config{})
	require.NoError(b, err)
	defer func() { require.NoError(b, dev.Close()) }()
	pd, err := dev.AllocPD()
	require.NoError(b, err)
	c, err := New(pd, access, 1<<30)
	require.NoError(b, err)
	defer func() { require.NoError(b, c.Close()) }()
	region, err := unix.Mmap(-1, 0, 64*4*page, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	require.NoError(b, err)
	defer func() { require.NoError(b, unix.Munmap(region)) }()
	bufs := make([][]byte, 64)
	for i := range bufs {
		bufs[i] = region[i*4*page : (i+1)*4*page]
		h, err := c.Get(bufs[i])
		require.NoError(b, err)
		require.NoError(b, h.Release())
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		h, err := c.Get(bufs[i%len(bufs)])
		if err != nil {
			b.Fatal(err)
		}
		if err := h.Release(); err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	st, err := c.Stats()
	require.NoError(b, err)
	require.EqualValues(b, len(bufs), st.Misses, "every lookup after the first round hits")
}
