package odp

import (
	"bytes"
	"os"
	"testing"
	"unsafe"

	"github.com/odpemu/odpemu/pagefault"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// anonymous maps n pages the way an application maps its own memory, unmapped at
// the test's end (unless the test did).
func anonymous(t *testing.T, pages int) []byte {
	t.Helper()
	mem, err := unix.Mmap(-1, 0, pages*ps, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	require.NoError(t, err)
	t.Cleanup(func() { _ = unix.Munmap(mem) }) // EINVAL once the test unmapped it itself
	return mem
}

// TestODPOverApplicationMemory: an ODP MR over memory the application mapped itself,
// sharing its first and last pages with live data. The NIC faults its pages in; the
// application's own writes, madvise and munmap keep behaving as without the MR and
// reach the NIC's table as invalidations; its other data is never touched.
func TestODPOverApplicationMemory(t *testing.T) {
	a, b := pair(t, Config{})
	mem := anonymous(t, 6)
	copy(mem[:100], "the application's own data, before the buffer")
	buf := mem[512 : 5*ps+100] // spans pages 0..5, sharing 0 and 5 with other data
	copy(mem[5*ps+200:], "and after it")
	neighbours := func() {
		t.Helper()
		require.True(t, bytes.HasPrefix(mem, []byte("the application's own data, before the buffer")))
		require.True(t, bytes.HasPrefix(mem[5*ps+200:], []byte("and after it")))
	}
	buf[0] = 1 // pages 0 and 5 present at registration: the snapshot maps them
	mr, err := b.pd.RegMR(buf, rw|AccessOnDemand)
	require.NoError(t, err)
	assert.Equal(t, 2, mr.Stats().ValidPages, "the snapshot: pages 0 and 5, which the application touched")

	src, smr := a.region(t, len(buf), rw)
	for i := range src {
		src[i] = byte(i*13 + 1)
	}
	write := func(off, n int) WC {
		require.NoError(t, a.qp.PostSend(SendWR{WRID: 1, Opcode: OpRDMAWrite, SGL: sge(smr, off, n), Flags: SendSignaled,
			RemoteAddr: mr.Addr() + uint64(off), RKey: mr.RKey()}))
		return wait(t, a.scq)
	}
	wc := write(0, len(buf))
	require.Equal(t, WCSuccess, wc.Status, wc.Detail)
	require.Equal(t, src, buf, "the NIC faulted the pages in and wrote them")
	assert.Positive(t, b.dev.Stats().PageFaults)
	neighbours()

	// The application discards page 2 (its offset in buf: 2*ps-512): the NIC's entry
	// goes, and its next access faults a zero page in, as the CPU's would.
	inv := b.dev.Stats().Invalidations
	require.NoError(t, unix.Madvise(mem[2*ps:3*ps], unix.MADV_DONTNEED))
	require.NoError(t, b.dev.SyncEvents())
	assert.Greater(t, b.dev.Stats().Invalidations, inv)
	require.NoError(t, a.qp.PostSend(SendWR{WRID: 2, Opcode: OpRDMARead, SGL: sge(smr, 0, len(buf)), Flags: SendSignaled,
		RemoteAddr: mr.Addr(), RKey: mr.RKey()}))
	wc = wait(t, a.scq)
	require.Equal(t, WCSuccess, wc.Status, wc.Detail)
	require.Equal(t, make([]byte, ps), src[2*ps-512:3*ps-512], "the discarded page reads as zeros")
	require.Equal(t, buf, src)
	neighbours()

	// The application writes with the CPU, the NIC reads it.
	copy(buf[3*ps:], "written by the CPU")
	wc = write(0, 0) // a zero-length WRITE: an ordering point
	require.Equal(t, WCSuccess, wc.Status, wc.Detail)
	require.NoError(t, a.qp.PostSend(SendWR{WRID: 3, Opcode: OpRDMARead, SGL: sge(smr, 0, len(buf)), Flags: SendSignaled,
		RemoteAddr: mr.Addr(), RKey: mr.RKey()}))
	require.Equal(t, WCSuccess, wait(t, a.scq).Status)
	require.True(t, bytes.HasPrefix(src[3*ps:], []byte("written by the CPU")))

	// An overlapping MR over pages 1..3: dereg of the first leaves it working and
	// still told of the application's changes.
	mr2, err := b.pd.RegMR(mem[ps:4*ps], rw|AccessOnDemand)
	require.NoError(t, err)
	require.NoError(t, mr.Dereg())
	inv2 := mr2.Stats().Invalidations
	require.NoError(t, unix.Madvise(mem[ps:2*ps], unix.MADV_DONTNEED))
	require.NoError(t, b.dev.SyncEvents())
	assert.Greater(t, mr2.Stats().Invalidations, inv2, "the pages stayed registered for the other MR")
	require.NoError(t, a.qp.PostSend(SendWR{WRID: 4, Opcode: OpRDMAWrite, SGL: sge(smr, 0, 3*ps), Flags: SendSignaled,
		RemoteAddr: mr2.Addr(), RKey: mr2.RKey()}))
	require.Equal(t, WCSuccess, wait(t, a.scq).Status)
	require.Equal(t, src[:3*ps], mem[ps:4*ps])

	// The application unmaps page 3: the MR's page is gone for good, an access error.
	require.NoError(t, unix.MunmapPtr(unsafe.Pointer(&mem[3*ps]), uintptr(ps)))
	require.NoError(t, b.dev.SyncEvents())
	require.NoError(t, a.qp.PostSend(SendWR{WRID: 5, Opcode: OpRDMAWrite, SGL: sge(smr, 0, ps), Flags: SendSignaled,
		RemoteAddr: mr2.Addr() + 2*uint64(ps), RKey: mr2.RKey()}))
	assert.Equal(t, WCRemAccessErr, wait(t, a.scq).Status)
	require.NoError(t, mr2.Dereg())
	neighbours()
}

// TestODPOverGoHeap: Go memory registers on demand too; the NIC writes it. In one
// process: over a UDP socket, the race detector cannot see that the completion
// follows the NIC's write into the Go heap (the ordering passes through the kernel),
// and reports a race that is not one.
func TestODPOverGoHeap(t *testing.T) {
	a, b := newNode(t, Config{}), newNode(t, Config{})
	require.NoError(t, ConnectLoopback(a.qp, b.qp))
	heap := make([]byte, 3*ps)
	mr, err := b.pd.RegMR(heap[100:], rw|AccessOnDemand)
	require.NoError(t, err)
	src, smr := a.region(t, 2*ps, rw)
	for i := range src {
		src[i] = byte(i)
	}
	require.NoError(t, a.qp.PostSend(SendWR{WRID: 1, Opcode: OpRDMAWrite, SGL: sge(smr, 0, len(src)), Flags: SendSignaled,
		RemoteAddr: mr.Addr(), RKey: mr.RKey()}))
	require.Equal(t, WCSuccess, wait(t, a.scq).Status)
	require.Equal(t, src, heap[100:100+len(src)])
	require.NoError(t, mr.Dereg())
}

// TestODPRefusesWhatUserfaultfdCannotTake: memory the process mapped from a file
// (not through MapFile) cannot be registered on demand: the error says so.
func TestODPRefusesWhatUserfaultfdCannotTake(t *testing.T) {
	n := newNode(t, Config{})
	f, err := os.CreateTemp(t.TempDir(), "shared")
	require.NoError(t, err)
	defer func() { _ = f.Close() }() // the test's file
	require.NoError(t, f.Truncate(int64(2*ps)))
	mem, err := unix.Mmap(int(f.Fd()), 0, 2*ps, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	require.NoError(t, err)
	defer func() { _ = unix.Munmap(mem) }() // the test's mapping
	_, err = n.pd.RegMR(mem, rw|AccessOnDemand)
	require.ErrorIs(t, err, ErrBadAddress)
	mr, err := n.pd.RegMR(mem, rw) // pinned: any mapping
	require.NoError(t, err)
	require.NoError(t, mr.Dereg())
}

// hugeMapping maps two huge pages the way an application maps them (MAP_HUGETLB),
// unmapped at the test's end, and returns them with the huge page size; it skips the
// test where the system reserves none (vm.nr_hugepages).
func hugeMapping(t *testing.T) ([]byte, int) {
	t.Helper()
	probe, err := unix.Mmap(-1, 0, ps, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_HUGETLB)
	if err != nil {
		t.Skipf("skipped: no huge page to map (vm.nr_hugepages reserves none?): %v", err)
	}
	lo, hi, err := pagefault.WholeMappingPages(uintptr(unsafe.Pointer(&probe[0])), uintptr(unsafe.Pointer(&probe[0]))+1)
	require.NoError(t, err)
	hps := int(hi - lo)
	require.Greater(t, hps, ps, "a huge page")
	require.NoError(t, unix.MunmapPtr(unsafe.Pointer(&probe[0]), uintptr(hps))) // whole huge pages only
	mem, err := unix.Mmap(-1, 0, 2*hps, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_HUGETLB)
	if err != nil {
		t.Skipf("skipped: fewer than two huge pages free: %v", err)
	}
	t.Cleanup(func() { _ = unix.Munmap(mem) })
	return mem, hps
}

// uffdTracked is uffdFlags that skips the test where the kernel does not say.
func uffdTracked(t *testing.T, addr uintptr) bool {
	t.Helper()
	registered, known := uffdFlags(t, addr)
	if !known {
		t.Skip("skipped: smaps shows no userfaultfd flags (VmFlags um/uw) on this kernel")
	}
	return registered
}

// TestODPOverHugePages: an ODP MR over the application's huge pages, beginning and
// ending inside them (perftest's --use_hugepages --odp registers its buffer's size
// from the start of a SHM_HUGETLB segment). userfaultfd takes whole huge pages only:
// the registration covers the MR's huge pages, and ends with the MR. The NIC faults a
// huge page in, the application's MADV_DONTNEED of one invalidates it, an implicit MR
// reaches huge pages too.
func TestODPOverHugePages(t *testing.T) {
	mem, hps := hugeMapping(t)
	a, b := pair(t, Config{NoSnapshot: true})
	base := uintptr(unsafe.Pointer(&mem[0]))
	copy(mem, "the application's own data, before the buffer")
	buf := mem[512 : hps+100] // all of huge page 0 but its first 512 bytes, 100 bytes of page 1
	mr, err := b.pd.RegMR(buf, rw|AccessOnDemand)
	require.NoError(t, err, "an ODP MR over part of a huge page")
	assert.True(t, uffdTracked(t, base))

	src, smr := a.region(t, len(buf), rw)
	for i := range src {
		src[i] = byte(i*7 + 3)
	}
	require.NoError(t, a.qp.PostSend(SendWR{WRID: 1, Opcode: OpRDMAWrite, SGL: sge(smr, 0, len(buf)), Flags: SendSignaled,
		RemoteAddr: mr.Addr(), RKey: mr.RKey()}))
	wc := wait(t, a.scq)
	require.Equal(t, WCSuccess, wc.Status, wc.Detail)
	require.Equal(t, src, buf, "the NIC faulted the huge pages in and wrote them")
	require.True(t, bytes.HasPrefix(mem, []byte("the application's own data, before the buffer")))
	assert.Positive(t, b.dev.Stats().PageFaults)

	// The application discards huge page 1: the NIC's entries there go, and a READ
	// finds zeros where the WRITE left data.
	inv := mr.Stats().Invalidations
	require.NoError(t, unix.Madvise(mem[hps:], unix.MADV_DONTNEED))
	require.NoError(t, b.dev.SyncEvents())
	assert.Greater(t, mr.Stats().Invalidations, inv)
	back, bmr := a.region(t, len(buf), rw)
	require.NoError(t, a.qp.PostSend(SendWR{WRID: 2, Opcode: OpRDMARead, SGL: sge(bmr, 0, len(buf)), Flags: SendSignaled,
		RemoteAddr: mr.Addr(), RKey: mr.RKey()}))
	wc = wait(t, a.scq)
	require.Equal(t, WCSuccess, wc.Status, wc.Detail)
	cut := hps - 512
	require.Equal(t, src[:cut], back[:cut])
	require.Equal(t, make([]byte, 100), back[cut:], "the discarded huge page reads as zeros")

	require.NoError(t, mr.Dereg())
	assert.False(t, uffdTracked(t, base), "the registration ends with the MR")
	assert.Empty(t, b.dev.as.foreignRegs)

	// An implicit MR: a WRITE into the middle of huge page 1 registers that huge page.
	imr, err := b.pd.RegImplicitMR(rw | AccessOnDemand)
	require.NoError(t, err)
	require.NoError(t, a.qp.PostSend(SendWR{WRID: 3, Opcode: OpRDMAWrite, SGL: sge(smr, 0, 3*ps), Flags: SendSignaled,
		RemoteAddr: uint64(base) + uint64(hps) + 5*uint64(ps) + 8, RKey: imr.RKey()}))
	wc = wait(t, a.scq)
	require.Equal(t, WCSuccess, wc.Status, wc.Detail)
	require.Equal(t, src[:3*ps], mem[hps+5*ps+8:hps+8*ps+8])
	assert.True(t, uffdTracked(t, base+uintptr(hps)))
	require.NoError(t, imr.Dereg())
	assert.False(t, uffdTracked(t, base+uintptr(hps)), "the implicit MR's registration ends with it")
}
