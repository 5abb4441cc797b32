package odp

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// lifecycle is a pool of verbs objects that goroutines create, use and destroy
// concurrently. The pool's lock guards only the pool: every API call runs without it,
// so calls on the same objects race as they do in a program.
type lifecycle struct {
	t    *testing.T
	devs [2]*Device

	mu   sync.Mutex
	pds  []*PD
	cqs  []*CQ
	qps  []*QP
	mrs  []*MR
	bufs [][]byte
}

// allowed reports whether err is one of the outcomes a verbs user must expect from a
// racing call: the object is busy, gone or in the wrong state, or the request is
// invalid for it.
func allowed(err error) bool {
	return err == nil || errors.Is(err, ErrBusy) || errors.Is(err, ErrClosed) || errors.Is(err, ErrInvalidArgument) ||
		errors.Is(err, ErrQPState) || errors.Is(err, ErrQueueFull) || errors.Is(err, ErrNotMmapped) ||
		errors.Is(err, ErrBadAddress)
}

func pick[T any](rng *rand.Rand, xs []T) (T, bool) {
	var zero T
	if len(xs) == 0 {
		return zero, false
	}
	return xs[rng.IntN(len(xs))], true
}

func remove[T comparable](xs []T, x T) []T {
	for i, y := range xs {
		if y == x {
			return append(xs[:i], xs[i+1:]...)
		}
	}
	return xs
}

// step performs one random operation and fails the test on a disallowed error.
func (l *lifecycle) step(rng *rand.Rand) {
	t := l.t
	d := l.devs[rng.IntN(2)]
	check := func(what string, err error) {
		if !allowed(err) {
			t.Errorf("%s: unexpected error %v", what, err)
		}
	}
	l.mu.Lock()
	pd, havePD := pick(rng, l.pds)
	cq, haveCQ := pick(rng, l.cqs)
	cq2, _ := pick(rng, l.cqs)
	qp, haveQP := pick(rng, l.qps)
	qp2, _ := pick(rng, l.qps)
	mr, haveMR := pick(rng, l.mrs)
	buf, haveBuf := pick(rng, l.bufs)
	l.mu.Unlock()

	switch rng.IntN(16) {
	case 0:
		p, err := d.AllocPD()
		check("AllocPD", err)
		if err == nil {
			l.mu.Lock()
			l.pds = append(l.pds, p)
			l.mu.Unlock()
		}
	case 1:
		if havePD {
			err := pd.Dealloc()
			check("Dealloc", err)
			if err == nil {
				l.mu.Lock()
				l.pds = remove(l.pds, pd)
				l.mu.Unlock()
			}
		}
	case 2:
		c, err := d.CreateCQ(64)
		check("CreateCQ", err)
		if err == nil {
			l.mu.Lock()
			l.cqs = append(l.cqs, c)
			l.mu.Unlock()
		}
	case 3:
		if haveCQ {
			err := cq.Destroy()
			check("CQ.Destroy", err)
			if err == nil {
				l.mu.Lock()
				l.cqs = remove(l.cqs, cq)
				l.mu.Unlock()
			}
		}
	case 4, 5:
		if havePD && haveCQ {
			q, err := pd.CreateQP(QPConfig{SendCQ: cq, RecvCQ: cq2, MaxSendWR: 16, MaxRecvWR: 16})
			check("CreateQP", err)
			if err == nil {
				l.mu.Lock()
				l.qps = append(l.qps, q)
				l.mu.Unlock()
			}
		}
	case 6:
		if haveQP {
			err := qp.Destroy()
			check("QP.Destroy", err)
			if err == nil {
				l.mu.Lock()
				l.qps = remove(l.qps, qp)
				l.mu.Unlock()
			}
		}
	case 7:
		if haveQP && qp2 != qp {
			check("ConnectLoopback", ConnectLoopback(qp, qp2))
		}
	case 8:
		b, err := d.Alloc((rng.IntN(8) + 1) * PageSize)
		check("Alloc", err)
		if err == nil {
			l.mu.Lock()
			l.bufs = append(l.bufs, b)
			l.mu.Unlock()
		}
	case 9:
		if haveBuf {
			l.mu.Lock() // a slice is freed once: take it out of the pool first
			took := false
			for i, b := range l.bufs {
				if &b[0] == &buf[0] {
					l.bufs, took = append(l.bufs[:i], l.bufs[i+1:]...), true
					break
				}
			}
			l.mu.Unlock()
			if !took {
				return // another goroutine took it
			}
			for _, dev := range l.devs {
				if err := dev.Free(buf); err == nil || errors.Is(err, ErrBusy) {
					if err != nil { // registered: back into the pool
						l.mu.Lock()
						l.bufs = append(l.bufs, buf)
						l.mu.Unlock()
					}
					return
				}
			}
		}
	case 10:
		if havePD && haveBuf {
			access := AccessLocalWrite | AccessRemoteWrite | AccessRemoteRead
			if rng.IntN(2) == 0 {
				access |= AccessOnDemand
			}
			m, err := pd.RegMR(buf, access)
			check("RegMR", err)
			if err == nil {
				l.mu.Lock()
				l.mrs = append(l.mrs, m)
				l.mu.Unlock()
			}
		}
	case 11:
		if haveMR {
			err := mr.Dereg()
			check("Dereg", err)
			if err == nil {
				l.mu.Lock()
				l.mrs = remove(l.mrs, mr)
				l.mu.Unlock()
			}
		}
	case 12:
		if haveQP && haveMR {
			wr := SendWR{WRID: rng.Uint64(), Opcode: []Opcode{OpRDMAWrite, OpRDMARead, OpSend}[rng.IntN(3)],
				SGL:   []SGE{{Addr: mr.Addr(), Length: uint32(min(mr.Len(), uint64(PageSize))), LKey: mr.LKey()}},
				Flags: SendSignaled, RemoteAddr: mr.Addr(), RKey: mr.RKey()}
			check("PostSend", qp.PostSend(wr))
			if rng.IntN(2) == 0 {
				check("PostRecv", qp.PostRecv(RecvWR{WRID: 1, SGL: wr.SGL}))
			}
		}
	case 14:
		if haveQP {
			check("Modify", qp.Modify([]QPState{StateReset, StateError, StateInit}[rng.IntN(3)]))
		}
	case 15:
		if haveMR {
			access := mr.Access() ^ []Access{AccessRemoteRead, AccessRemoteWrite, AccessOnDemand}[rng.IntN(3)]
			if havePD && rng.IntN(2) == 0 {
				check("Rereg", mr.Rereg(pd, access))
			} else {
				check("Rereg", mr.Rereg(nil, access))
			}
		}
	case 13:
		if haveCQ {
			wcs := make([]WC, 8)
			_, err := cq.Poll(wcs)
			if err != nil && !errors.Is(err, ErrClosed) && !errors.Is(err, ErrCQOverrun) {
				t.Errorf("Poll: %v", err)
			}
		}
	}
}

// Verbs objects created, used and destroyed from many goroutines at once: no deadlock,
// no panic, no error outside the typed ones, and nothing left behind (goleak, and
// Close releases everything that is still alive).
func TestLifecycleRandomized(t *testing.T) {
	seed := stressSeed(t)
	for _, procs := range []int{1, 2} {
		t.Run(fmt.Sprintf("GOMAXPROCS=%d", procs), func(t *testing.T) {
			defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(procs))
			l := &lifecycle{t: t}
			for i := range l.devs {
				d, err := Open(Config{})
				require.NoError(t, err)
				l.devs[i] = d
			}
			const workers, steps = 8, 3000
			var wg sync.WaitGroup
			for w := 0; w < workers; w++ {
				wg.Add(1)
				go func(w int) {
					defer wg.Done()
					rng := rand.New(rand.NewPCG(seed, uint64(w)))
					for i := 0; i < steps; i++ {
						l.step(rng)
					}
				}(w)
			}
			done := make(chan struct{})
			go func() { wg.Wait(); close(done) }()
			select {
			case <-done:
			case <-time.After(2 * time.Minute): // a hang detector, not a measurement
				buf := make([]byte, 1<<20)
				t.Fatalf("seed %d: workers did not finish: deadlock?\n%s", seed, buf[:runtime.Stack(buf, true)])
			}
			for _, d := range l.devs {
				require.NoError(t, d.Close())
			}
			// Everything the workers left is unusable now, with typed errors.
			for _, pd := range l.pds {
				require.ErrorIs(t, pd.Dealloc(), ErrClosed)
			}
			for _, cq := range l.cqs {
				require.ErrorIs(t, cq.Destroy(), ErrClosed)
			}
			for _, qp := range l.qps {
				require.ErrorIs(t, qp.Destroy(), ErrClosed)
			}
			t.Logf("seed %d: left %d PDs, %d CQs, %d QPs, %d MRs, %d buffers", seed, len(l.pds), len(l.cqs), len(l.qps), len(l.mrs), len(l.bufs))
		})
	}
}
