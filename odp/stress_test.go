package odp

import (
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
	mismatches int
	stale      uint64
	audited    uint64
	events     uint64
}

// runStress drives NIC traffic (WRITE, READ, SEND) on the even pages of an ODP region
// from one goroutine and application reads, writes and discards on the odd pages from
// another, with discards, direct madvise calls and explicit invalidations mixed in. A
// shadow copy of every page's expected content checks every byte read.
func runStress(t *testing.T, seed uint64, steps int, cfg Config) stressResult {
	const pages = 128
	const ps = 4096
	cfg.Audit = true
	a, b := pair(t, cfg)
	src, smr := a.region(t, pages*ps, AccessLocalWrite)
	back, bmr := a.region(t, pages*ps, AccessLocalWrite)
	dst, dmr := b.region(t, pages*ps, rw|AccessOnDemand)
	shadow := make([]byte, pages*ps) // even pages: the NIC's side; odd: the application's

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
	go func() { // the application, on odd pages
		defer close(appDone)
		rng := rand.New(rand.NewPCG(seed, 1))
		buf := make([]byte, ps)
		for {
			select {
			case <-stop:
				return
			default:
			}
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
				for i := 0; i < ps; i += 512 {
					if page[i] != shadow[p*ps+i] {
						mismatch("app read page %d byte %d: %d, want %d", p, i, page[i], shadow[p*ps+i])
						break
					}
				}
			case 3:
				if err := b.dev.Discard(page); err != nil {
					mismatch("discard: %v", err)
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
		switch op := rng.IntN(10); {
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
		default: // explicit invalidation of any range: content unchanged
			k := rng.IntN(8) + 1
			require.NoError(t, b.dev.Invalidate(dmr.Addr()+uint64(p*ps), uint64(k*ps)))
		}
	}
	close(stop)
	<-appDone
	st := b.dev.Stats()
	res.stale, res.audited, res.events = st.StaleDMAs, st.AuditedDMAs, st.Events
	return res
}

func TestStressInvalidation(t *testing.T) {
	seed := stressSeed(t)
	for _, procs := range []int{1, 2} {
		for _, ablate := range []bool{false, true} {
			t.Run(fmt.Sprintf("GOMAXPROCS=%d/ablation=%v", procs, ablate), func(t *testing.T) {
				defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(procs))
				r := runStress(t, seed, 1500, Config{FaultAround: 4, NoInvalidate: ablate})
				t.Logf("seed %d: audited %d DMAs, stale %d, events %d, mismatches %d", seed, r.audited, r.stale, r.events, r.mismatches)
				assert.NotZero(t, r.audited)
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
