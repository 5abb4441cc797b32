package testmem

import (
	"testing"
	"unsafe"

	"github.com/odpemu/odpemu/internal/interval"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

func TestOwnedDropAndUnmap(t *testing.T) {
	ps := unix.Getpagesize()
	mem, err := unix.Mmap(-1, 0, 8*ps, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	require.NoError(t, err)
	o := Own(mem)
	base := o.Live()[0].Start
	_, _, e := unix.Syscall(unix.SYS_MUNMAP, base+2*uintptr(ps), 2*uintptr(ps), 0)
	require.Zero(t, e)
	o.Drop(interval.Range{Start: base + 2*uintptr(ps), End: base + 4*uintptr(ps)})
	assert.Equal(t, []interval.Range{{Start: base, End: base + 2*uintptr(ps)}, {Start: base + 4*uintptr(ps), End: base + 8*uintptr(ps)}}, o.Live())
	o.Unmap()
	assert.Empty(t, o.Live())
	// Every page is gone: mincore fails with ENOMEM on unmapped memory.
	vec := make([]byte, 8)
	_, _, e = unix.Syscall(unix.SYS_MINCORE, base, 8*uintptr(ps), uintptr(unsafe.Pointer(&vec[0])))
	assert.Equal(t, unix.ENOMEM, e)
}
