package odp

import (
	"fmt"
	"runtime"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// stream posts wrs on n's QP keeping up to depth in flight and requires every one to
// complete successfully. The QP must signal all completions (SigAll or SendSignaled).
func stream(t testing.TB, n *node, wrs []SendWR, depth int) {
	t.Helper()
	wcs := make([]WC, 64)
	posted, done := 0, 0
	for done < len(wrs) {
		for posted < len(wrs) && posted-done < depth {
			require.NoError(t, n.qp.PostSend(wrs[posted]))
			posted++
		}
		wc := wait(t, n.scq)
		require.Equal(t, WCSuccess, wc.Status, "WR %d: %s", wc.WRID, wc.Detail)
		done++
		k, err := n.scq.Poll(wcs)
		require.NoError(t, err)
		for _, wc := range wcs[:k] {
			require.Equal(t, WCSuccess, wc.Status, "WR %d: %s", wc.WRID, wc.Detail)
		}
		done += k
	}
}

func pagePattern(p, half int) byte { return byte(p*31 + half*101 + 1) }

// Four application goroutines fault every page of a 64 MiB ODP region in by writing
// its first half with copy() (CPU faults, served by the C thread) while the NIC
// WRITEs and READs the second half of every page through the same MR (network page
// faults, resolved with ioctls). Both paths race for the same pages.
func TestODPConcurrentCPUAndNIC(t *testing.T) {
	for _, procs := range []int{1, 2} {
		t.Run(fmt.Sprintf("GOMAXPROCS=%d", procs), func(t *testing.T) {
			defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(procs))
			const size = 64 << 20
			pages := size / ps
			const half = 2048
			a, b := pair(t, Config{})
			src, smr := a.region(t, size, AccessLocalWrite)
			back, bmr := a.region(t, size, AccessLocalWrite)
			region, rmr := b.region(t, size, rw|AccessOnDemand)
			for p := 0; p < pages; p++ {
				for i := half; i < ps; i++ {
					src[p*ps+i] = pagePattern(p, 1)
				}
			}
			var wg sync.WaitGroup
			for w := 0; w < 4; w++ {
				wg.Add(1)
				go func(w int) {
					defer wg.Done()
					pat := make([]byte, half)
					for p := w; p < pages; p += 4 {
						for i := range pat {
							pat[i] = pagePattern(p, 0)
						}
						copy(region[p*ps:], pat)
					}
				}(w)
			}
			// Interleave pages so the NIC meets the goroutines everywhere; each page's
			// second half is written, then read back, in one ordered stream.
			wrs := make([]SendWR, 0, 2*pages)
			for i := 0; i < pages; i++ {
				p := (i * 7919) % pages
				off := p*ps + half
				wrs = append(wrs,
					SendWR{WRID: uint64(2 * i), Opcode: OpRDMAWrite, SGL: sge(smr, off, half), Flags: SendSignaled,
						RemoteAddr: rmr.Addr() + uint64(off), RKey: rmr.RKey()},
					SendWR{WRID: uint64(2*i + 1), Opcode: OpRDMARead, SGL: sge(bmr, off, half), Flags: SendSignaled,
						RemoteAddr: rmr.Addr() + uint64(off), RKey: rmr.RKey()})
			}
			stream(t, a, wrs, 128)
			wg.Wait()
			// The NIC reads the whole region back after the goroutines are done.
			var whole []SendWR
			for off := 0; off < size; off += 1 << 20 {
				whole = append(whole, SendWR{WRID: uint64(off), Opcode: OpRDMARead, SGL: sge(bmr, off, 1<<20),
					Flags: SendSignaled, RemoteAddr: rmr.Addr() + uint64(off), RKey: rmr.RKey()})
			}
			stream(t, a, whole, 16)
			for p := 0; p < pages; p++ {
				for _, i := range []int{0, half - 1, half, 4095} {
					want := pagePattern(p, i/half)
					require.Equal(t, want, region[p*ps+i], "CPU view, page %d byte %d", p, i)
					require.Equal(t, want, back[p*ps+i], "NIC view, page %d byte %d", p, i)
				}
			}
			ds := b.dev.Stats()
			assert.NotZero(t, ds.PageFaults, "the NIC took network page faults")
			assert.NotZero(t, ds.CPUFaults, "the goroutines took CPU faults")
			assert.Equal(t, pages, rmr.Stats().ValidPages)
			t.Logf("network faults %d (%d pages, %v), CPU faults %d (found mapped %d, mean %v, max %v)",
				ds.PageFaults, ds.PagesFaulted, ds.FaultTime, ds.CPUFaults, ds.CPUFaultsFoundMapped,
				ds.CPUFaultTime/timeDiv(ds.CPUFaults), ds.CPUFaultMax)
		})
	}
}
