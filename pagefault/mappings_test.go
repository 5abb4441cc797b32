package pagefault

import (
	"errors"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

const smapsText = `00400000-00600000 r-xp 00000000 08:01 123 /usr/bin/x
Size:               2048 kB
KernelPageSize:        4 kB
MMUPageSize:           4 kB
VmFlags: rd ex mr mw me
7f0000000000-7f0000400000 rw-s 00000000 00:10 77 /SYSV00000000 (deleted)
Size:               4096 kB
KernelPageSize:     2048 kB
MMUPageSize:        2048 kB
VmFlags: rd wr sh mr mw me ms de ht
7f0000400000-7f0000402000 rw-p 00000000 00:00 0
Size:                  8 kB
KernelPageSize:        4 kB
VmFlags: rd wr mr mw me ac
`

func TestWholePagesOfSmaps(t *testing.T) {
	const huge = 0x7f0000000000
	for _, c := range []struct {
		name               string
		start, end         uintptr
		wantStart, wantEnd uintptr
	}{
		{"ordinary pages", 0x401000, 0x403000, 0x401000, 0x403000},
		{"inside one huge page", huge + 0x1000, huge + 0x21000, huge, huge + 0x200000},
		{"across two huge pages", huge + 0x1ff000, huge + 0x201000, huge, huge + 0x400000},
		{"whole huge pages", huge + 0x200000, huge + 0x400000, huge + 0x200000, huge + 0x400000},
		{"huge then ordinary", huge + 0x3ff000, 0x7f0000401000, huge + 0x200000, 0x7f0000401000},
		{"unmapped ends", 0x10000, 0x11000, 0x10000, 0x11000},
		{"empty", huge + 0x1000, huge + 0x1000, huge + 0x1000, huge + 0x1000},
	} {
		s, e, err := wholePages(strings.NewReader(smapsText), c.start, c.end)
		require.NoError(t, err, c.name)
		assert.Equal(t, [2]uintptr{c.wantStart, c.wantEnd}, [2]uintptr{s, e}, c.name)
	}
	_, _, err := wholePages(strings.NewReader("7f0000000000-7f0000400000 rw-s 0 0 0\nKernelPageSize: 3 kB\n"),
		0x7f0000001000, 0x7f0000002000)
	assert.Error(t, err, "a page size that is no power of two")
}

// TestWholeMappingPagesRegisters: a range inside a hugetlbfs mapping is refused by
// UFFDIO_REGISTER (EINVAL) and taken once widened to its huge pages; ordinary memory
// is left as it is.
func TestWholeMappingPagesRegisters(t *testing.T) {
	b := region(t, 4)
	s, e, err := WholeMappingPages(addr(b)+PageSize, addr(b)+2*PageSize)
	require.NoError(t, err)
	assert.Equal(t, [2]uintptr{addr(b) + PageSize, addr(b) + 2*PageSize}, [2]uintptr{s, e})

	hb, err := unix.Mmap(-1, 0, 4<<20, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_HUGETLB)
	if err != nil {
		t.Skipf("skipped: no huge page mapping (vm.nr_hugepages reserves none?): %v", err)
	}
	defer func() { require.NoError(t, unix.Munmap(hb)) }()
	hb[0] = 1
	s, e, err = WholeMappingPages(addr(hb)+PageSize, addr(hb)+2*PageSize)
	require.NoError(t, err)
	ps := e - s
	require.Greater(t, ps, PageSize, "a huge page")
	require.Zero(t, s%ps)
	require.True(t, s <= addr(hb) && addr(hb)+PageSize < e)

	u, err := Open(Options{})
	require.NoError(t, err)
	defer func() { require.NoError(t, u.Close()) }()
	_, err = u.Register(addr(hb)+PageSize, PageSize, ModeWP)
	if !errors.Is(err, unix.EINVAL) {
		t.Fatalf("a part of a huge page registered: %v", err)
	}
	if _, err := u.Register(s, e-s, ModeWP); err != nil {
		t.Skipf("skipped: this kernel does not register hugetlbfs memory for write-protect: %v", err)
	}
	require.NoError(t, u.Unregister(s, e-s))
}
