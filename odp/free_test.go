package odp

import (
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// The application unmaps part of a buffer and something else is mapped there; Dereg
// and Free follow at once, with no SyncEvents in between. Free must leave the new
// mapping alone, whether the buffer was registered on demand, pinned, or never
// registered. (Before, Free unmapped the new mapping in most tries, and under -race
// sometimes the race runtime's own memory.)
func TestFreeNeverUnmapsForeignMemory(t *testing.T) {
	n := newNode(t, Config{})
	for _, mode := range []string{"unregistered", "odp", "pinned"} {
		t.Run(mode, func(t *testing.T) {
			for i := 0; i < 200; i++ {
				buf, err := n.dev.Alloc(4 * ps)
				require.NoError(t, err)
				var mr *MR
				switch mode {
				case "odp":
					mr, err = n.pd.RegMR(buf, rw|AccessOnDemand)
				case "pinned":
					mr, err = n.pd.RegMR(buf, rw)
				}
				require.NoError(t, err)
				hole := unsafe.Add(unsafe.Pointer(&buf[0]), ps)
				require.NoError(t, unix.MunmapPtr(hole, uz))
				p, err := unix.MmapPtr(-1, 0, hole, uz, unix.PROT_READ|unix.PROT_WRITE,
					unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_FIXED_NOREPLACE)
				require.NoError(t, err, "round %d: map into the hole", i)
				foreign := unsafe.Slice((*byte)(p), ps)
				foreign[7] = 0x5a
				if mr != nil {
					require.NoError(t, mr.Dereg())
				}
				require.NoError(t, n.dev.Free(buf))
				require.NoError(t, unix.Madvise(foreign, unix.MADV_NORMAL), "round %d: the foreign mapping was unmapped", i)
				require.EqualValues(t, 0x5a, foreign[7], "round %d", i)
				require.NoError(t, unix.MunmapPtr(p, uz))
			}
		})
	}
	require.Zero(t, n.dev.Stats().PinnedBytes)
}
