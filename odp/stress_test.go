package odp

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"os"
	"runtime"
	"strconv"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// stressSeed is ODPEMU_SEED if set, else a fixed seed: a failure is repeatable.
func stressSeed(t *testing.T) uint64 {
	if s := os.Getenv("ODPEMU_SEED"); s != "" {
		v, err := strconv.ParseUint(s, 10, 64)
		require.NoError(t, err)
		return v
	}
	return 20261202
}

type stressResult struct {
	mismatches            int
	stale                 uint64
	audited               uint64
	events                uint64
	evictions, migrations uint64
	dmaWaits              uint64
	rnrNaks               uint64
	retransmissions       uint64
	timeouts              uint64
}

// runStress drives NIC traffic (WRITE, READ, SEND) on the even pages of an ODP region
// from one goroutine and application reads, writes, discards and migrations on the odd
// pages from another, with discards (through odpemu and by direct madvise, from both
// goroutines, the application's at any moment during the NIC's traffic), explicit
// invalidations, migrations, eviction under a budget of half the registered size, and
// munmap and mremap of a second MR's pages mixed in. A shadow copy of every page's
// expected content checks every byte the NIC or the application reads.
//
// The budget binds the application's CPU faults as well as the NIC's: the two sides'
// pages together are twice the budget, so both fault and are evicted throughout. An
// application that thrashes in CPU faults holds its P inside copy() (a goroutine
// blocked in a fault keeps its P and cannot be preempted there): at GOMAXPROCS=1 the
// emulated NIC, whose engines are goroutines, would barely run, so the application's
// goroutine yields between accesses, as a thread on a core of its own would leave the
// NIC alone.
func runStress(t *testing.T, seed uint64, steps int, cfg Config) stressResult {
	const pages = 128
	const tailPages = 16

	cfg.Audit = true
	cfg.ResidentBudget = int64((pages + tailPages) * ps / 2) // half of what is registered
	a, b := newNode(t, Config{}), newNode(t, cfg)            // the budget is the responder's
	require.NoError(t, ConnectLoopback(a.qp, b.qp))
	// The responder's ODP faults are answered with RNR NAKs; the smallest timer keeps
	// the requester's waits short under the budget's constant eviction.
	require.NoError(t, b.qp.ModifyAttr(QPAttr{MinRNRTimer: 1}, AttrMinRNRTimer))
	src, smr := a.region(t, pages*ps, AccessLocalWrite)
	back, bmr := a.region(t, pages*ps, AccessLocalWrite)
	dst, dmr := b.region(t, pages*ps, rw|AccessOnDemand)
	shadow := make([]byte, pages*ps) // even pages: the NIC's side; odd: the application's
	// A second ODP MR whose pages the driver unmaps or moves away (mremap) one by one.
	tail, tmr := b.region(t, tailPages*ps, rw|AccessOnDemand)
	tailShadow := make([]byte, tailPages*ps)
	tailGone := make([]bool, tailPages)
	// Destinations for mremap, reserved up front: a hole mapped later could land in a
	// tail page unmapped earlier, inside the MR's range.
	holes, err := unix.Mmap(-1, 0, tailPages*ps, unix.PROT_NONE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	require.NoError(t, err)
	defer func() { require.NoError(t, unix.Munmap(holes)) }()

	var res stressResult
	var mu sync.Mutex // guards res.mismatches
	mismatch := func(format string, args ...any) {
		mu.Lock()
		defer mu.Unlock()
		if res.mismatches < 5 {
			t.Errorf(format, args...)
		}
		res.mismatches++
	}

	appDone := make(chan struct{})
	stop := make(chan struct{})
	var stopOnce sync.Once
	stopApp := func() { stopOnce.Do(func() { close(stop) }); <-appDone }
	defer stopApp() // on every path: the cleanup unmaps what the application touches
	go func() {     // the application, on odd pages
		defer close(appDone)
		rng := rand.New(rand.NewPCG(seed, 1))
		buf := make([]byte, ps)
		for {
			select {
			case <-stop:
				return
			default:
			}
			// An application thread has a core of its own; this goroutine shares
			// the P with the NIC's engines (at GOMAXPROCS=1, the only one), and a
			// goroutine blocked in a CPU fault keeps it: yield between accesses.
			runtime.Gosched()
			p := 2*rng.IntN(pages/2) + 1
			page := dst[p*ps : (p+1)*ps]
			switch rng.IntN(4) {
			case 0, 1:
				v := byte(rng.Uint32())
				for i := range buf {
					buf[i] = v
				}
				off, n := rng.IntN(ps), rng.IntN(ps)+1
				n = min(n, ps-off)
				copy(page[off:off+n], buf[:n]) // may take a CPU fault in copy()
				copy(shadow[p*ps+off:p*ps+off+n], buf[:n])
			case 2:
				if i := firstDiff(page, shadow[p*ps:(p+1)*ps]); i >= 0 {
					mismatch("app read page %d byte %d: %d, want %d", p, i, page[i], shadow[p*ps+i])
				}
			case 3:
				if rng.IntN(2) == 0 {
					if _, err := b.dev.Migrate(uint64(addrOf(page)), up); err != nil {
						mismatch("migrate: %v", err)
					}
					continue
				}
				if rng.IntN(2) == 0 {
					if err := b.dev.Discard(page); err != nil {
						mismatch("discard: %v", err)
					}
				} else if err := unix.Madvise(page, unix.MADV_DONTNEED); err != nil {
					// Behind odpemu's back, with no SyncEvents: the NIC's fault-around
					// maps these pages while its traffic runs next door.
					mismatch("madvise: %v", err)
				}
				clear(shadow[p*ps : (p+1)*ps])
			}
		}
	}()

	rng := rand.New(rand.NewPCG(seed, 2))
	for step := 0; step < steps; step++ {
		p := 2 * rng.IntN(pages/2)
		off := rng.IntN(ps)
		n := rng.IntN(ps-off) + 1
		at := p*ps + off
		switch op := rng.IntN(13); {
		case op < 4: // WRITE
			v := byte(rng.Uint32())
			for i := at; i < at+n; i++ {
				src[i] = v
			}
			wc := do(t, a, write(smr, at, n, dmr, uint64(at)))
			require.Equal(t, WCSuccess, wc.Status, "step %d: %s", step, wc.Detail)
			copy(shadow[at:at+n], src[at:at+n])
		case op < 7: // READ
			wc := do(t, a, read(bmr, at, n, dmr, uint64(at)))
			require.Equal(t, WCSuccess, wc.Status, "step %d: %s", step, wc.Detail)
			for i := at; i < at+n; i++ {
				if back[i] != shadow[i] {
					mismatch("step %d: NIC read page %d byte %d: %d, want %d", step, p, i-p*ps, back[i], shadow[i])
					break
				}
			}
		case op == 7: // SEND into a receive on the same page
			v := byte(rng.Uint32())
			for i := at; i < at+n; i++ {
				src[i] = v
			}
			require.NoError(t, b.qp.PostRecv(RecvWR{WRID: uint64(step), SGL: sge(dmr, at, n)}))
			wc := do(t, a, SendWR{Opcode: OpSend, SGL: sge(smr, at, n)})
			require.Equal(t, WCSuccess, wc.Status, "step %d: %s", step, wc.Detail)
			rwc := wait(t, b.rcq)
			require.Equal(t, WCSuccess, rwc.Status, rwc.Detail)
			copy(shadow[at:at+n], src[at:at+n])
		case op == 8: // discard NIC pages, through odpemu or behind its back
			for q, k := p, rng.IntN(3)+1; q < min(p+2*k, pages); q += 2 { // even pages only
				page := dst[q*ps : (q+1)*ps]
				if rng.IntN(2) == 0 {
					require.NoError(t, b.dev.Discard(page))
				} else {
					require.NoError(t, unix.Madvise(page, unix.MADV_DONTNEED)) // a REMOVE event
					require.NoError(t, b.dev.SyncEvents())
				}
				clear(shadow[q*ps : (q+1)*ps])
			}
		case op == 9: // explicit invalidation of any range: content unchanged
			k := rng.IntN(8) + 1
			require.NoError(t, b.dev.Invalidate(dmr.Addr()+uint64(p*ps), uint64(k*ps)))
		case op == 10: // migrate NIC pages: content unchanged, frames new
			_, err := b.dev.Migrate(dmr.Addr()+uint64(p*ps), up)
			require.NoError(t, err)
		case op == 11: // WRITE, then READ back, a page of the tail MR still mapped
			q := rng.IntN(tailPages)
			if tailGone[q] {
				continue
			}
			v := byte(rng.Uint32())
			for i := 0; i < ps; i++ {
				src[i] = v
			}
			wc := do(t, a, write(smr, 0, ps, tmr, uint64(q*ps)))
			require.Equal(t, WCSuccess, wc.Status, "step %d: tail page %d: %s", step, q, wc.Detail)
			for i := range tailShadow[q*ps : (q+1)*ps] {
				tailShadow[q*ps+i] = v
			}
			require.Equal(t, WCSuccess, do(t, a, read(bmr, 0, ps, tmr, uint64(q*ps))).Status)
			if i := firstDiff(back[:ps], tailShadow[q*ps:(q+1)*ps]); i >= 0 {
				mismatch("step %d: NIC read tail page %d byte %d", step, q, i)
			}
		default: // unmap a tail page, or move it away with mremap
			q := rng.IntN(tailPages)
			if tailGone[q] || cfg.NoInvalidate {
				// Without invalidation the NIC would go on writing where the page
				// was, into whatever this process maps there next: its own heap.
				continue
			}
			at := addrOf(tail) + uintptr(q*ps)
			if rng.IntN(2) == 0 {
				_, _, e := unix.Syscall(unix.SYS_MUNMAP, at, uz, 0)
				require.Zero(t, e)
			} else {
				hole := holes[q*ps : (q+1)*ps]
				_, _, e := unix.Syscall6(unix.SYS_MREMAP, at, uz, uz, unix.MREMAP_MAYMOVE|unix.MREMAP_FIXED, addrOf(hole), 0)
				require.Zero(t, e)
				// The page moved with its content, also if it was evicted: the fault
				// server restored it at the new address when it read the event.
				if i := firstDiff(hole, tailShadow[q*ps:(q+1)*ps]); i >= 0 {
					mismatch("step %d: remapped tail page %d byte %d: %d, want %d", step, q, i, hole[i], tailShadow[q*ps+i])
				}
			}
			require.NoError(t, b.dev.SyncEvents())
			tailGone[q] = true
		}
	}

	stopApp()
	// A page the application unmapped stays unusable for the NIC.
	for q := range tailGone {
		if tailGone[q] {
			wc := do(t, a, write(smr, 0, 8, tmr, uint64(q*ps)))
			assert.Equal(t, WCRemAccessErr, wc.Status, "write to unmapped tail page %d: %s", q, wc.Detail)
			break
		}
	}
	st := b.dev.Stats()
	res.stale, res.audited, res.events = st.StaleDMAs, st.AuditedDMAs, st.Events
	res.evictions, res.migrations, res.dmaWaits = st.Evictions, st.Migrations, st.DMAWaits
	qs := a.qp.Stats()
	res.rnrNaks, res.retransmissions, res.timeouts = qs.RNRNaksReceived, qs.Retransmissions, qs.Timeouts
	return res
}

// firstDiff returns the first index where a and b differ, or -1.
func firstDiff(a, b []byte) int {
	if bytes.Equal(a, b) {
		return -1
	}
	for i := range a {
		if a[i] != b[i] {
			return i
		}
	}
	return len(a)
}

func TestStressInvalidation(t *testing.T) {
	seed := stressSeed(t)
	// Responder faults are answered with RNR NAKs and retransmitted, but for the long
	// runs at GOMAXPROCS=1: there every RNR timer waits for the scheduler to preempt
	// the application's goroutine (about 10 ms), which makes 1500 steps take minutes.
	// A shorter run keeps RNR there too.
	for _, v := range []struct {
		procs  int
		policy FaultPolicy
		steps  int
	}{{1, FaultStall, 1500}, {1, FaultRNR, 300}, {2, FaultRNR, 1500}} {
		for _, ablate := range []bool{false, true} {
			t.Run(fmt.Sprintf("GOMAXPROCS=%d/%v/ablation=%v", v.procs, v.policy, ablate), func(t *testing.T) {
				defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(v.procs))
				r := runStress(t, seed, v.steps, Config{FaultAround: 4, NoInvalidate: ablate, ResponderFaults: v.policy})
				t.Logf("seed %d: audited %d DMAs, stale %d, events %d, evictions %d, migrations %d, invalidations that waited for DMA %d, RNR NAKs %d, retransmitted packets %d, ACK timeouts %d, mismatches %d",
					seed, r.audited, r.stale, r.events, r.evictions, r.migrations, r.dmaWaits, r.rnrNaks, r.retransmissions, r.timeouts, r.mismatches)
				if v.policy == FaultRNR {
					assert.NotZero(t, r.rnrNaks, "responder faults were answered with RNR NAKs")
				}
				assert.NotZero(t, r.audited)
				assert.NotZero(t, r.evictions, "the budget forced evictions")
				assert.NotZero(t, r.migrations)
				if ablate {
					assert.NotZero(t, r.stale, "with invalidation off the audit must find stale DMA")
				} else {
					assert.Zero(t, r.mismatches)
					assert.Zero(t, r.stale)
				}
			})
		}
	}
}
