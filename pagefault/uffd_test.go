package pagefault

import (
	"bytes"
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
	t.Cleanup(func() { unix.Munmap(b) })
	return b
}

func addr(b []byte) uintptr { return uintptr(unsafe.Pointer(&b[0])) }

// registered opens a userfaultfd with feats and registers b on it in MISSING mode.
func registered(t testing.TB, b []byte, feats Feature) *FD {
	t.Helper()
	u, err := Open(Options{Features: feats})
	require.NoError(t, err)
	t.Cleanup(func() { u.Close() })
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
	defer u.Close()
	assert.True(t, u.Features().Has(FeatureEventRemove))

	_, err = Open(Options{Features: 1 << 40})
	assert.ErrorIs(t, err, ErrUnsupported)
}

func TestUserModeOnly(t *testing.T) {
	u, err := Open(Options{UserModeOnly: true})
	require.NoError(t, err)
	defer u.Close()
	assert.Equal(t, ModeUserOnly, u.Mode())
}

func TestRegisterReportsRangeIoctls(t *testing.T) {
	b := region(t, 4)
	u, err := Open(Options{})
	require.NoError(t, err)
	defer u.Close()
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
	defer u.Close()
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
