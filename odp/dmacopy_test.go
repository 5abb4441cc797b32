package odp

import (
	"runtime"
	"runtime/debug"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// A DMA copy that faults on a page in the middle of its range (the application
// unmapped it under the DMA) leaves the pages before it whole and the pages after it
// untouched, as a NIC placing a message packet by packet does, whatever the two
// sides' alignment: a single memmove may store a range's first bytes last.
func TestDMACopyFaultLeavesWholePages(t *testing.T) {
	runtime.LockOSThread() // SetPanicOnFault is per goroutine; keep the test's one
	defer runtime.UnlockOSThread()
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	const pages = 8
	for _, srcOff := range []int{0, 8, 1000, ps - 8} {
		for _, hole := range []int{1, 3, 6} {
			mem, err := unix.Mmap(-1, 0, pages*ps, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
			require.NoError(t, err)
			for i := range mem {
				mem[i] = 0x11
			}
			src := make([]byte, pages*ps+srcOff)[srcOff:]
			for i := range src {
				src[i] = 0xab
			}
			require.NoError(t, unix.MunmapPtr(unsafe.Pointer(&mem[hole*ps]), uz))
			var d Device
			err = d.dmaCopy(mem, src)
			require.ErrorIs(t, err, errDMAFault, "src offset %d, hole %d", srcOff, hole)
			assert.EqualValues(t, 1, d.stats.dmaFaults.Load())
			for p := 0; p < pages; p++ {
				if p == hole {
					continue
				}
				pg := mem[p*ps : (p+1)*ps]
				want := byte(0x11)
				if p < hole {
					want = 0xab
				}
				if !uniform(pg) || pg[0] != want {
					t.Errorf("src offset %d, hole at page %d: page %d holds %#x...%#x, want all %#x", srcOff, hole, p, pg[0], pg[ps-1], want)
				}
			}
			require.NoError(t, unix.MunmapPtr(unsafe.Pointer(&mem[0]), uintptr(hole*ps)))
			require.NoError(t, unix.MunmapPtr(unsafe.Pointer(&mem[(hole+1)*ps]), uintptr((pages-hole-1)*ps)))
		}
	}
}
