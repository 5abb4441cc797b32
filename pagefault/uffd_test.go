package pagefault

import (
	"bytes"
	"errors"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"golang.org/x/sys/unix"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// region maps npages of anonymous memory, unregistered, for the test's lifetime.
func region(t testing.TB, npages int) []byte {
	t.Helper()
	b, err := unix.Mmap(-1, 0, npages*int(PageSize), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	require.NoError(t, err)
	// Whatever the THP setting, tests see 4 KiB pages (EINVAL: a kernel without THP).
	_ = unix.Madvise(b, unix.MADV_NOHUGEPAGE)
	t.Cleanup(func() { require.NoError(t, unix.Munmap(b)) })
	return b
}

func addr(b []byte) uintptr { return uintptr(unsafe.Pointer(&b[0])) }

// registered opens a userfaultfd with feats and registers b on it in MISSING mode.
func registered(t testing.TB, b []byte, feats Feature) *FD {
	t.Helper()
	u, err := Open(Options{Features: feats})
	require.NoError(t, err)
	t.Cleanup(func() {
		if err := u.Close(); err != nil && !errors.Is(err, ErrClosed) {
			t.Errorf("close: %v", err)
		}
	})
	_, err = u.Register(addr(b), uintptr(len(b)), ModeMissing)
	require.NoError(t, err)
	return u
}

func TestProbe(t *testing.T) {
	p := ProbeKernel()
	require.NoError(t, p.Err)
	t.Logf("userfaultfd via %s, mode %v, features %v", p.Source, p.Mode, p.Features)
	assert.True(t, p.Features.Has(FeatureEventRemove|FeatureEventUnmap|FeatureEventRemap))
	u, err := Open(Options{Features: FeatureEventRemove})
	require.NoError(t, err)
	defer func() { require.NoError(t, u.Close()) }()
	assert.True(t, u.Features().Has(FeatureEventRemove))

	_, err = Open(Options{Features: 1 << 40})
	assert.ErrorIs(t, err, ErrUnsupported)
}

func TestUserModeOnly(t *testing.T) {
	u, err := Open(Options{UserModeOnly: true})
	require.NoError(t, err)
	defer func() { require.NoError(t, u.Close()) }()
	assert.Equal(t, ModeUserOnly, u.Mode())
}

func TestRegisterReportsRangeIoctls(t *testing.T) {
	b := region(t, 4)
	u, err := Open(Options{})
	require.NoError(t, err)
	defer func() { require.NoError(t, u.Close()) }()
	ioctls, err := u.Register(addr(b), uintptr(len(b)), ModeMissing)
	require.NoError(t, err)
	assert.NotZero(t, ioctls&(1<<nrCopy), "COPY allowed")
	assert.NotZero(t, ioctls&(1<<nrZeropage), "ZEROPAGE allowed")
	require.NoError(t, u.Unregister(addr(b), uintptr(len(b))))
	// Unaligned ranges are the kernel's EINVAL.
	_, err = u.Register(addr(b)+1, PageSize, ModeMissing)
	assert.ErrorIs(t, err, unix.EINVAL)
}

func TestCopyZeropageExist(t *testing.T) {
	const n = 8
	b := region(t, n)
	u := registered(t, b, 0)
	src := bytes.Repeat([]byte{0xab}, 3*int(PageSize))

	got, err := u.Copy(addr(b)+PageSize, addr(src), 3*PageSize, false)
	require.NoError(t, err)
	assert.Equal(t, 3*PageSize, got)
	assert.Equal(t, src, b[PageSize:4*PageSize])

	// Copying over pages 0..3 stops at the first present page (1), reporting progress;
	// continuing from there reports the present page.
	got, err = u.Copy(addr(b), addr(src), 3*PageSize, false)
	assert.NoError(t, err)
	assert.Equal(t, PageSize, got)
	got, err = u.Copy(addr(b)+PageSize, addr(src), 2*PageSize, false)
	assert.ErrorIs(t, err, ErrExist)
	assert.Zero(t, got)

	got, err = u.Zeropage(addr(b)+4*PageSize, 4*PageSize, false)
	require.NoError(t, err)
	assert.Equal(t, 4*PageSize, got)
	assert.Equal(t, make([]byte, 4*PageSize), b[4*PageSize:])

	_, err = u.Zeropage(addr(b)+4*PageSize, PageSize, false)
	assert.ErrorIs(t, err, ErrExist)
	require.NoError(t, u.Wake(addr(b), uintptr(len(b))))
}

func TestCopyIntoUnregisteredRange(t *testing.T) {
	b := region(t, 2)
	u, err := Open(Options{})
	require.NoError(t, err)
	defer func() { require.NoError(t, u.Close()) }()
	src := make([]byte, PageSize)
	_, err = u.Copy(addr(b), addr(src), PageSize, false)
	assert.ErrorIs(t, err, ErrUnmapped)
}

func TestClosedFD(t *testing.T) {
	u, err := Open(Options{})
	require.NoError(t, err)
	require.NoError(t, u.Close())
	assert.ErrorIs(t, u.Close(), ErrClosed)
	_, err = u.Zeropage(0, PageSize, false)
	assert.ErrorIs(t, err, ErrClosed)
}

func TestKernelProbe(t *testing.T) {
	k := ProbeKernelBehaviour()
	t.Logf("userfaultfd %v via %s, features %v; MADV_POPULATE_WRITE %v, WP %v, PAGEMAP_SCAN %v, zero page on read %v, THP %q",
		k.Userfaultfd.Mode, k.Userfaultfd.Source, k.Userfaultfd.Features, k.PopulateWrite, k.WriteProtect, k.PagemapScan,
		k.ReadFaultZeroPage, k.THP)
	require.NoError(t, k.readFaultErr, "the read-fault probe itself must work")
	require.NoError(t, k.Check(ReqUserfaultfd, ReqEvents), "the README's minimum")
	assert.Equal(t, k.Userfaultfd.Features.Has(FeatureMove), k.Has(ReqMove))

	// A kernel without anything: every requirement is reported by name and release.
	var none Kernel
	none.Userfaultfd.Err = ErrUnsupported
	for _, r := range []Requirement{ReqUserfaultfd, ReqEvents, ReqWriteProtect, ReqPopulateWrite, ReqMove, ReqPagemapScan, ReqEventFork, ReqKernelFaults} {
		err := none.Check(r)
		require.ErrorIs(t, err, ErrNotSupported, r.Name)
		assert.Contains(t, err.Error(), r.Name)
		assert.Contains(t, err.Error(), "Linux "+r.Since)
	}
}

func TestPagemapScanPresent(t *testing.T) {
	if !ProbeKernelBehaviour().PagemapScan {
		t.Skipf("skipped: %v", ReqPagemapScan.Missing())
	}
	const n = 64
	b := region(t, n)
	for _, p := range []int{3, 4, 5, 40, 63} {
		b[p*int(PageSize)] = 1
	}
	pm, err := OpenPagemap()
	require.NoError(t, err)
	defer func() { require.NoError(t, pm.Close()) }()
	out := make([]PageRegion, 8)
	k, end, err := pm.ScanPresent(addr(b), addr(b)+uintptr(len(b)), out)
	require.NoError(t, err)
	require.Equal(t, 3, k)
	assert.EqualValues(t, addr(b)+uintptr(len(b)), end)
	want := [][2]int{{3, 6}, {40, 41}, {63, 64}}
	for i, w := range want {
		assert.EqualValues(t, addr(b)+uintptr(w[0])*PageSize, out[i].Start, "run %d", i)
		assert.EqualValues(t, addr(b)+uintptr(w[1])*PageSize, out[i].End, "run %d", i)
	}
	// With room for one run the walk stops somewhere after it and before the next;
	// continuing from there finds the others.
	var got []PageRegion
	for at := addr(b); at < addr(b)+uintptr(len(b)); {
		k, end, err = pm.ScanPresent(at, addr(b)+uintptr(len(b)), out[:1])
		require.NoError(t, err)
		require.Greater(t, end, at, "the walk moves on")
		got = append(got, out[:k]...)
		at = end
	}
	require.Len(t, got, 3)
	for i, w := range want {
		assert.EqualValues(t, addr(b)+uintptr(w[0])*PageSize, got[i].Start, "run %d", i)
		assert.EqualValues(t, addr(b)+uintptr(w[1])*PageSize, got[i].End, "run %d", i)
	}
}

// ReadPresent hands every present page to its callback, in chunks no larger than
// asked, and with PAGEMAP_SCAN visits only the runs of present pages, also when
// there are more runs than one scan returns.
func TestReadPresent(t *testing.T) {
	const n = 400
	b := region(t, n)
	touched := []int{3, 4, 5, 40, 63}
	for p := 100; p < n; p += 2 { // 150 runs of one page
		touched = append(touched, p)
	}
	for _, p := range touched {
		b[p*int(PageSize)] = 1
	}
	pm, err := OpenPagemap()
	require.NoError(t, err)
	defer func() { require.NoError(t, pm.Close()) }()
	var present []int
	visited := 0
	err = pm.ReadPresent(addr(b), addr(b)+uintptr(len(b)), 2, func(at uintptr, entries []PagemapEntry) error {
		assert.LessOrEqual(t, len(entries), 2)
		visited += len(entries)
		for i, e := range entries {
			if e.Present() {
				present = append(present, int((at-addr(b))/PageSize)+i)
			}
		}
		return nil
	})
	require.NoError(t, err)
	assert.Equal(t, touched, present)
	if ProbeKernelBehaviour().PagemapScan {
		assert.Equal(t, len(touched), visited, "only present runs are read")
	} else {
		assert.Equal(t, n, visited, "without PAGEMAP_SCAN every page is read")
	}

	// The callback's error stops the walk.
	stop := errors.New("stop")
	calls := 0
	err = pm.ReadPresent(addr(b), addr(b)+uintptr(len(b)), 2, func(uintptr, []PagemapEntry) error { calls++; return stop })
	assert.ErrorIs(t, err, stop)
	assert.Equal(t, 1, calls)
}
