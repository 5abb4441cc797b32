package odp

import (
	"fmt"
	"math/rand/v2"
	"runtime"
	"strings"
	"sync"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// sentinel fills memory the application maps where an MR's page was: the NIC never
// writes it (its WRITEs carry other values), so finding it changed, or finding it on
// the wire, means a DMA went to memory that is not the MR's any more.
const sentinel = 0xee

// uniform reports whether every byte of b equals b[0].
func uniform(b []byte) bool {
	for _, c := range b {
		if c != b[0] {
			return false
		}
	}
	return true
}

// reconnect replaces the QPs of a and b, after a remote access error put them in the
// error state, and flushes what the old ones left on the CQs.
func reconnect(t *testing.T, a, b *node) {
	t.Helper()
	require.NoError(t, a.qp.Destroy())
	require.NoError(t, b.qp.Destroy())
	wcs := make([]WC, 64)
	for _, cq := range []*CQ{a.scq, a.rcq, b.scq, b.rcq} {
		for {
			n, err := cq.Poll(wcs)
			require.NoError(t, err)
			if n == 0 {
				break
			}
		}
	}
	var err error
	a.qp, err = a.pd.CreateQP(QPConfig{SendCQ: a.scq, RecvCQ: a.rcq, MaxSendWR: 256, MaxRecvWR: 256})
	require.NoError(t, err)
	b.qp, err = b.pd.CreateQP(QPConfig{SendCQ: b.scq, RecvCQ: b.rcq, MaxSendWR: 256, MaxRecvWR: 256})
	require.NoError(t, err)
	require.NoError(t, ConnectLoopback(a.qp, b.qp))
}

type directResult struct {
	ops, errors, gone int
	st                Stats
}

// runDirect drives RDMA WRITEs and READs of whole pages into an ODP region while an
// application goroutine changes the region's mappings itself, with no call into
// odpemu, at any moment, also under DMA in flight:
//   - "madvise": MADV_DONTNEED on random pages;
//   - "munmap": a page is unmapped and at once replaced by a new mapping at the same
//     address, filled with the sentinel;
//   - "mremap": a page is moved away with mremap and a new mapping takes its address.
//
// What the kernel's order guarantees, and the test checks: every page a READ returns
// and every page left in memory is uniform (a page torn by a zap under a DMA would be
// part old, part zero); no sentinel reaches the wire and no new mapping is written by
// the NIC; the audit finds no stale DMA. Each WRITE fills each page with a value of
// its own, never zero or the sentinel.
//
// memory says where the ODP region is: "" a buffer from Alloc, "own" memory the
// application mapped itself, "implicit" that memory reached through an implicit MR
// (madvise only: an implicit MR reaches whatever is mapped at an address, and a hole
// that munmap or mremap leaves could take another thread's new mapping, the Go
// runtime's, while the NIC writes there).
func runDirect(t *testing.T, mode string, seed uint64, steps int, cfg Config, memory string) directResult {
	const pages = 64
	const maxGone = 32
	cfg.Audit = true
	a, b := pair(t, cfg)
	src, smr := a.region(t, pages*ps, AccessLocalWrite)
	// Each READ of a batch lands in a slot of its own: two READs of a batch may read
	// the same page, and one's check must not see the other's scatter in progress.
	const maxBatch = 8
	back, bmr := a.region(t, maxBatch*pages*ps, AccessLocalWrite)
	var dst []byte
	var dmr *MR
	switch memory {
	case "own":
		dst = anonymous(t, pages)
		var err error
		dmr, err = b.pd.RegMR(dst, rw|AccessOnDemand)
		require.NoError(t, err)
	case "implicit":
		dst = anonymous(t, pages)
		var err error
		dmr, err = b.pd.RegImplicitMR(rw)
		require.NoError(t, err)
	default:
		dst, dmr = b.region(t, pages*ps, rw|AccessOnDemand)
	}
	base := addrOf(dst)
	roff := uint64(base) - dmr.Addr() // dst's offset in the MR
	// Destinations for mremap, reserved up front so that nothing else lands there.
	holes, err := unix.Mmap(-1, 0, maxGone*ps, unix.PROT_NONE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	require.NoError(t, err)
	defer func() { require.NoError(t, unix.Munmap(holes)) }()

	var mu sync.Mutex // guards gone and foreign
	gone := map[int]bool{}
	var foreign [][]byte // the application's new mappings where MR pages were
	defer func() {
		for _, f := range foreign {
			require.NoError(t, unix.MunmapPtr(unsafe.Pointer(&f[0]), uz))
		}
	}()
	replace := func(q int) { // called with mu held, after page q left the MR
		at := unsafe.Add(unsafe.Pointer(&dst[0]), q*ps)
		p, err := unix.MmapPtr(-1, 0, at, uz, unix.PROT_READ|unix.PROT_WRITE,
			unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_FIXED_NOREPLACE)
		require.NoError(t, err)
		f := unsafe.Slice((*byte)(p), ps)
		for i := range f {
			f[i] = sentinel
		}
		foreign = append(foreign, f)
	}

	stop := make(chan struct{})
	appDone := make(chan struct{})
	var stopOnce sync.Once
	stopApp := func() {
		stopOnce.Do(func() { close(stop) })
		<-appDone
	}
	defer stopApp()               // before the mappings go, on a failure too
	unmapNow := make(chan int, 1) // the page to unmap or move away next, while WRs to it run
	madviseNow := make(chan struct{}, 64)
	go func() { // the application
		defer close(appDone)
		rng := rand.New(rand.NewPCG(seed, 1))
		for {
			select {
			case <-stop:
				return
			default:
			}
			q := rng.IntN(pages)
			at := base + uintptr(q*ps)
			switch mode {
			case "madvise":
				select { // a few per NIC operation, while it runs
				case <-stop:
					return
				case <-madviseNow:
				}
				n := min(rng.IntN(3)+1, pages-q)
				_, _, e := unix.Syscall(unix.SYS_MADVISE, at, uintptr(n)*uz, unix.MADV_DONTNEED)
				if e != 0 && e != unix.ENOMEM { // ENOMEM: part of it is gone
					t.Errorf("madvise: %v", e)
					return
				}
			case "munmap", "mremap":
				select {
				case <-stop:
					return
				case q = <-unmapNow:
				}
				at = base + uintptr(q*ps)
				mu.Lock()
				if len(gone) >= maxGone { // the holes for mremap are used up
					mu.Unlock()
					t.Errorf("more than %d pages to unmap", maxGone)
					return
				}
				var e unix.Errno
				if mode == "munmap" {
					_, _, e = unix.Syscall(unix.SYS_MUNMAP, at, uz, 0)
				} else {
					to := addrOf(holes) + uintptr(len(gone)*ps)
					_, _, e = unix.Syscall6(unix.SYS_MREMAP, at, uz, uz, unix.MREMAP_MAYMOVE|unix.MREMAP_FIXED, to, 0)
				}
				if e != 0 {
					mu.Unlock()
					t.Errorf("%s: %v", mode, e)
					return
				}
				gone[q] = true
				replace(q) // at once, while the NIC goes on
				mu.Unlock()
			}
		}
	}()

	var res directResult
	rng := rand.New(rand.NewPCG(seed, 2))
	fill := byte(1)
	next := func() byte { // the WRITE values: never 0, never the sentinel
		fill++
		for fill == 0 || fill == sentinel {
			fill++
		}
		return fill
	}
	goneCount := func() int {
		mu.Lock()
		defer mu.Unlock()
		return len(gone)
	}
	isGone := func(p, k int) bool {
		mu.Lock()
		defer mu.Unlock()
		for i := p; i < p+k; i++ {
			if gone[i] {
				return true
			}
		}
		return false
	}
	type op struct {
		isRead bool
		p, k   int
	}
	for step := 0; step < steps && !t.Failed(); step++ {
		// A batch of WRs in flight at once, so that the responder's DMAs follow each
		// other closely while the application changes mappings.
		ops := make([]op, rng.IntN(maxBatch)+1)
		victim := -1
		if mode != "madvise" && step%(steps/maxGone) == 0 && goneCount() < maxGone {
			// The application unmaps a page (or moves it away) while this batch's
			// WRs to it run.
			for q := rng.IntN(pages); victim < 0; q = (q + 1) % pages {
				if !isGone(q, 1) {
					victim = q
				}
			}
		}
		value := map[int]byte{} // each page a WRITE of this batch fills, and its value
		for i := range ops {
			k := rng.IntN(16) + 1
			p := rng.IntN(pages - k + 1)
			for try := 0; try < 8 && isGone(p, k); try++ { // mostly pages still mapped
				p = rng.IntN(pages - k + 1)
			}
			if victim >= 0 {
				p = max(0, min(victim-rng.IntN(k), pages-k)) // a range over the victim
			}
			ops[i] = op{rng.IntN(2) == 0, p, k}
			if !ops[i].isRead {
				for q := p; q < p+k; q++ {
					if _, ok := value[q]; !ok {
						value[q] = next()
						for j := q * ps; j < (q+1)*ps; j++ {
							src[j] = value[q]
						}
					}
				}
			}
		}
		for i, o := range ops {
			wr := write(smr, o.p*ps, o.k*ps, dmr, roff+uint64(o.p*ps))
			if o.isRead {
				wr = read(bmr, (i*pages+o.p)*ps, o.k*ps, dmr, roff+uint64(o.p*ps))
			}
			wr.WRID = uint64(i)
			require.NoError(t, a.qp.PostSend(wr))
			if i == 0 && victim >= 0 {
				unmapNow <- victim
			}
		}
		for range 4 * len(ops) { // a few madvise calls per WR, while they run
			select {
			case madviseNow <- struct{}{}:
			default:
			}
		}
		failed := false
		for range ops {
			wc := wait(t, a.scq)
			res.ops++
			o := ops[wc.WRID]
			switch {
			case wc.Status == WCSuccess && o.isRead:
				for q := o.p; q < o.p+o.k; q++ {
					at := (int(wc.WRID)*pages + q) * ps
					pg := back[at : at+ps]
					if !uniform(pg) {
						t.Errorf("step %d: READ of page %d returned a torn page (byte 0: %#x, differs at %d)", step, q, pg[0], firstDiff(pg, make([]byte, ps)))
					} else if pg[0] == sentinel {
						t.Errorf("step %d: READ of page %d returned the application's new mapping", step, q)
					}
				}
			case wc.Status == WCSuccess:
			default:
				// Only a page the application unmapped may refuse the NIC; the WRs
				// after it are flushed.
				require.NotEqual(t, "madvise", mode, "step %d: %v: %s", step, wc.Status, wc.Detail)
				require.Contains(t, []WCStatus{WCRemAccessErr, WCWRFlushErr}, wc.Status, "step %d: %s", step, wc.Detail)
				res.errors++
				failed = true
			}
		}
		if failed {
			reconnect(t, a, b)
		}
		runtime.Gosched() // at GOMAXPROCS=1 too, the application runs between batches
	}
	stopApp()
	require.NoError(t, b.dev.SyncEvents())

	mu.Lock()
	defer mu.Unlock()
	res.gone = len(gone)
	for q := 0; q < pages; q++ {
		if gone[q] {
			continue
		}
		if pg := dst[q*ps : (q+1)*ps]; !uniform(pg) {
			t.Errorf("page %d torn in memory: byte 0 %#x", q, pg[0])
		}
	}
	for i, f := range foreign {
		if !uniform(f) || f[0] != sentinel {
			t.Errorf("new mapping %d at %#x was written by the NIC", i, addrOf(f))
		}
	}
	res.st = b.dev.Stats()
	return res
}

// The application's own madvise, munmap and mremap, at any moment during NIC traffic,
// follow the kernel's order through the DMA gate: no torn page, no stale DMA, no NIC
// write into memory mapped where the MR's pages were.
func TestDirectChangesUnderTraffic(t *testing.T) {
	seed := stressSeed(t)
	for _, mode := range []string{"madvise", "munmap", "mremap", "madvise/own", "munmap/own", "mremap/own",
		"madvise/implicit"} {
		for _, procs := range []int{1, 2} {
			t.Run(fmt.Sprintf("%s/GOMAXPROCS=%d", mode, procs), func(t *testing.T) {
				defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(procs))
				// own: the application's memory, not Alloc's; implicit: that memory
				// through an implicit MR
				m, memory, _ := strings.Cut(mode, "/")
				r := runDirect(t, m, seed, 600, Config{FaultAround: 4}, memory)
				st := r.st
				t.Logf("seed %d: %d ops (%d refused), %d pages gone; events %d, audited DMAs %d, stale %d (overtaken %d), faulted %d, torn and redone %d, late zaps %d; gate: %d drains (mean %v, max %v), %d fault reads, %d events read with DMA in flight",
					seed, r.ops, r.errors, r.gone, st.Events, st.AuditedDMAs, st.StaleDMAs, st.OvertakenDMAs, st.DMAFaults, st.TornDMAs, st.LateZaps,
					st.GateDrains, st.GateDrainTime/timeDiv(st.GateDrains), st.GateDrainMax, st.GateFaultReads, st.GateUndrained)
				assert.NotZero(t, st.Events)
				assert.NotZero(t, st.AuditedDMAs)
				assert.Zero(t, st.StaleDMAs)
				// The gate and the zap barrier keep changes off the DMAs in flight: a
				// copy is torn (and made again, so nothing of it shows) only in the
				// window pagefault's doc names, a zap whose thread woke but had not
				// taken the mmap lock as the barrier passed. That is rare: at most one
				// DMA in a hundred (one in 2663 was seen).
				assert.LessOrEqual(t, st.TornDMAs*100, st.AuditedDMAs, "torn and redone DMAs")
				if m != "madvise" {
					assert.NotZero(t, r.gone)
				}
			})
		}
	}
}
