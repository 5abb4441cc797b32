package odp

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"testing"

	"github.com/odpemu/odpemu/fusefs"
	"github.com/odpemu/odpemu/internal/fusemount"
	"github.com/odpemu/odpemu/pagefault"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// mountFS mounts a fusefs filesystem for the test, unmounted at its end, or skips.
func mountFS(t testing.TB, o fusefs.Options) *fusefs.FS {
	t.Helper()
	if err := fusemount.Available(); err != nil {
		t.Skipf("skipped: %v", err)
	}
	fsys, err := fusefs.Mount(filepath.Join(t.TempDir(), "mnt"), o)
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, fsys.Unmount()) })
	return fsys
}

// watchedFile mounts a filesystem for the test holding obj as name, and opens a
// pair of devices; the filesystem tells the second (the one that maps the file) of
// changes.
func watchedFile(t *testing.T, name string, obj fusefs.Object, cfg Config) (*fusefs.FS, *fusefs.File, *node, *node) {
	t.Helper()
	fsys := mountFS(t, fusefs.Options{})
	f, err := fsys.Add(name, obj)
	require.NoError(t, err)
	a, b := pair(t, cfg)
	t.Cleanup(fsys.Watch(b.dev))
	return fsys, f, a, b
}

// openFile opens a file of fsys for the test, closed at its end (before the
// unmount, since cleanups run last first).
func openFile(t testing.TB, f *fusefs.File, writable bool) *os.File {
	t.Helper()
	flag := os.O_RDONLY
	if writable {
		flag = os.O_RDWR
	}
	fd, err := os.OpenFile(f.Path(), flag, 0)
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, fd.Close()) })
	return fd
}

// mapFile maps the whole file on n's device, unmapped at the test's end.
func (n *node) mapFile(t testing.TB, fd *os.File, size int, writable bool) []byte {
	t.Helper()
	mem, err := n.dev.MapFile(fd, 0, size, writable)
	require.NoError(t, err)
	t.Cleanup(func() { _ = n.dev.Free(mem) }) // Close unmaps it too
	return mem
}

// readRemote READs n bytes at off of mr into the start of the local region and
// returns the completion.
func readRemote(t testing.TB, a *node, lmr *MR, mr *MR, off uint64, n int) WC {
	t.Helper()
	require.NoError(t, a.qp.PostSend(SendWR{Opcode: OpRDMARead, SGL: sge(lmr, 0, n), Flags: SendSignaled,
		RemoteAddr: mr.Addr() + off, RKey: mr.RKey()}))
	return wait(t, a.scq)
}

func objectBytes(t testing.TB, o fusefs.Object, off int64, n int) []byte {
	t.Helper()
	b := make([]byte, n)
	_, err := o.ReadAt(b, off)
	require.NoError(t, err)
	return b
}

// A file-backed ODP MR of 256 MiB: NIC READs fault lazily (pages faulted equal pages
// touched, and the filesystem reads a small part of the file); a change of the
// backing object invalidates, and the next READ returns the new bytes; a pinned MR of
// the same file reads all of it at registration and, after the change, serves the
// old bytes, which the audit reports. Also at GOMAXPROCS=1: the NIC's faults on the
// mapping are served by FUSE goroutines of this very process.
func TestFileBackedODP(t *testing.T) {
	procs := []int{runtime.GOMAXPROCS(0)}
	if procs[0] > 1 {
		procs = append(procs, 1)
	}
	for _, p := range procs {
		t.Run(fmt.Sprintf("GOMAXPROCS=%d", p), func(t *testing.T) {
			defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(p))
			testFileBackedODP(t)
		})
	}
}

func testFileBackedODP(t *testing.T) {
	const size = 256 << 20
	obj := fusefs.NewSynthetic(size, 42)
	fsys, f, a, b := watchedFile(t, "object", obj, Config{FaultAround: 1, Audit: true})
	local, lmr := a.region(t, 1<<20, AccessLocalWrite)
	fd := openFile(t, f, false)
	mem := b.mapFile(t, fd, size, false)
	mr, err := b.pd.RegMR(mem, AccessRemoteRead|AccessOnDemand)
	require.NoError(t, err)
	assert.Zero(t, mr.Stats().ValidPages)
	assert.Zero(t, fsys.Stats().Reads, "registration reads nothing")

	rng := rand.New(rand.NewPCG(1, 2))
	touched := map[int]bool{}
	for i := 0; i < 32; i++ {
		off := uint64(rng.IntN(size-3*ps)) &^ 7
		n := 1 + rng.IntN(2*ps)
		wc := readRemote(t, a, lmr, mr, off, n)
		require.Equal(t, WCSuccess, wc.Status, wc.Detail)
		require.True(t, bytes.Equal(objectBytes(t, obj, int64(off), n), local[:n]), "READ %d at %d", n, off)
		for p := off / up; p <= (off+uint64(n)-1)/up; p++ {
			touched[int(p)] = true
		}
	}
	st := mr.Stats()
	assert.EqualValues(t, len(touched), st.PagesFaulted, "pages faulted = pages touched")
	assert.Equal(t, len(touched), st.ValidPages)
	read := fsys.Stats().BytesRead
	assert.Less(t, read, uint64(size/16), "the filesystem read a small part of the file (readahead included)")
	t.Logf("%d pages touched, %d faults; the filesystem read %d KiB in %d reads", len(touched), st.PageFaults, read>>10, fsys.Stats().Reads)

	// The pinned contrast, over a second mapping of the same file.
	pmem := b.mapFile(t, fd, size, false)
	pmr, err := b.pd.RegMR(pmem, AccessRemoteRead)
	require.NoError(t, err)
	assert.GreaterOrEqual(t, fsys.Stats().BytesRead, uint64(size-read), "pinning read the whole file in")

	// Change a page both MRs have seen.
	var page int
	for page = range touched {
		break
	}
	off := int64(page*ps) + 100
	old := objectBytes(t, obj, off, 64)
	require.Equal(t, WCSuccess, readRemote(t, a, lmr, pmr, uint64(off), 64).Status)
	staleBefore := b.dev.Stats().StaleDMAs
	assert.Zero(t, staleBefore)
	inv := mr.Stats().Invalidations
	fresh := bytes.Repeat([]byte{0xA5}, 64)
	require.NoError(t, f.Change(off, fresh))
	assert.Greater(t, mr.Stats().Invalidations, inv, "the change invalidated the ODP MR")
	assert.False(t, mr.Entry(page).Valid)

	wc := readRemote(t, a, lmr, mr, uint64(off), 64)
	require.Equal(t, WCSuccess, wc.Status, wc.Detail)
	assert.Equal(t, fresh, local[:64], "ODP: the next READ returns the new bytes")
	wc = readRemote(t, a, lmr, pmr, uint64(off), 64)
	require.Equal(t, WCSuccess, wc.Status, wc.Detail)
	assert.Equal(t, old, local[:64], "pinned: the NIC keeps serving the old page")
	assert.NotZero(t, pmr.Stats().StaleDMAs, "the audit reports the pinned MR's stale DMA")
	assert.Zero(t, mr.Stats().StaleDMAs)
	got := make([]byte, 64)
	_, err = fd.ReadAt(got, off)
	require.NoError(t, err)
	assert.Equal(t, fresh, got, "the CPU sees the new bytes")
	require.NoError(t, pmr.Dereg())
	require.NoError(t, mr.Dereg())
}

// NIC WRITEs into a writable shared mapping reach the file on msync.
func TestFileBackedODPWritesReachTheFile(t *testing.T) {
	const size = 4 << 20
	obj, err := fusefs.OpenLocal(filepath.Join(t.TempDir(), "backing"), size)
	require.NoError(t, err)
	defer func() { assert.NoError(t, obj.Close()) }()
	fsys, f, a, b := watchedFile(t, "rw", obj, Config{})
	src, smr := a.region(t, 256<<10, AccessLocalWrite)
	for i := range src {
		src[i] = byte(i*13 + 1)
	}
	mem := b.mapFile(t, openFile(t, f, true), size, true)
	mr, err := b.pd.RegMR(mem, rw|AccessRemoteAtomic|AccessOnDemand)
	require.NoError(t, err)
	const at = 1<<20 + 77
	require.NoError(t, a.qp.PostSend(SendWR{Opcode: OpRDMAWrite, SGL: sge(smr, 0, len(src)), Flags: SendSignaled,
		RemoteAddr: mr.Addr() + at, RKey: mr.RKey()}))
	wc := wait(t, a.scq)
	require.Equal(t, WCSuccess, wc.Status, wc.Detail)
	require.NoError(t, unix.Msync(mem, unix.MS_SYNC))
	assert.Equal(t, src, objectBytes(t, obj, at, len(src)), "the WRITE reached the backing file")
	assert.NotZero(t, fsys.Stats().Writes)

	// An atomic on the file too.
	require.NoError(t, a.qp.PostSend(SendWR{Opcode: OpAtomicFetchAdd, SGL: sge(smr, 0, 8), Flags: SendSignaled,
		RemoteAddr: mr.Addr() + 2<<20, RKey: mr.RKey(), CompareAdd: 5}))
	wc = wait(t, a.scq)
	require.Equal(t, WCSuccess, wc.Status, wc.Detail)
	require.NoError(t, unix.Msync(mem, unix.MS_SYNC))
	assert.Equal(t, []byte{5, 0, 0, 0, 0, 0, 0, 0}, objectBytes(t, obj, 2<<20, 8))
	require.NoError(t, mr.Dereg())
}

// A truncation of the backing object takes the pages beyond the new end away from
// the NIC: a READ there fails.
func TestFileBackedODPTruncation(t *testing.T) {
	const size = 1 << 20
	obj := fusefs.NewSynthetic(size, 3)
	_, f, a, b := watchedFile(t, "t", obj, Config{})
	_, lmr := a.region(t, 64<<10, AccessLocalWrite)
	mem := b.mapFile(t, openFile(t, f, false), size, false)
	mr, err := b.pd.RegMR(mem, AccessRemoteRead|AccessOnDemand)
	require.NoError(t, err)
	require.Equal(t, WCSuccess, readRemote(t, a, lmr, mr, size-up, 100).Status)
	require.NoError(t, f.Truncate(size/2))
	wc := readRemote(t, a, lmr, mr, size-up, 100)
	assert.Equal(t, WCRemAccessErr, wc.Status, "a READ beyond the end of the file: %v %s", wc.Status, wc.Detail)
}

// The NIC's faults on a file mapping populate the page cache with madvise. The
// other mechanism, userfaultfd MINOR mode, needs a shared mapping of shmem or
// hugetlbfs; this probes what the kernel says for a FUSE file (EINVAL where MINOR
// is limited to those) and records it. Populate must work whatever it says.
func TestFileMappingFaultMechanism(t *testing.T) {
	fsys := mountFS(t, fusefs.Options{})
	f, err := fsys.Add("m", fusefs.NewSynthetic(1<<20, 5))
	require.NoError(t, err)
	fd := openFile(t, f, false)
	n := newNode(t, Config{})
	mem := n.mapFile(t, fd, 1<<20, false)
	u, err := pagefault.Open(pagefault.Options{Features: pagefault.FeatureMinorShmem})
	if err != nil {
		t.Logf("userfaultfd with MINOR_SHMEM: %v", err)
	} else {
		defer func() { assert.NoError(t, u.Close()) }()
		_, err = u.Register(addrOf(mem), 1<<20, pagefault.ModeMinor)
		t.Logf("UFFDIO_REGISTER MODE_MINOR on a FUSE file mapping: %v", err)
		if err == nil {
			assert.NoError(t, u.Unregister(addrOf(mem), 1<<20))
		}
	}
	entries := make([]pagefault.PagemapEntry, 4)
	require.NoError(t, n.dev.as.pagemap.Populate(addrOf(mem), entries, false))
	for i, e := range entries {
		assert.True(t, e.Present(), "page %d present after MADV_POPULATE_READ", i)
	}
}
