package odp

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/odpemu/odpemu/internal/interval"
)

// The address space's watch over REMOVE events whose zap may come after the NIC
// mapped a page again (the DMA floor's latezap.go says why and what is done).

// zapWatch is how long after a REMOVE event DMAs on its range check for its zap: a
// woken thread waits for a CPU for milliseconds at most on a loaded machine.
const zapWatch = 100 * time.Millisecond

// zapWindow holds the ranges of REMOVE events of the last zapWatch.
type zapWindow struct {
	pending atomic.Int32 // len(ranges): zero, the common case, needs no lock
	mu      sync.Mutex
	ranges  []zapRange // protected by mu, oldest first
}

type zapRange struct {
	interval.Range
	until time.Time
}

// maxZapRanges bounds the ranges a zapWindow watches, and so the work of a DMA that
// looks through them: beyond it (REMOVE events faster than about 10,000 a second
// for zapWatch) the oldest range's watch ends early.
const maxZapRanges = 1024

// add notes a REMOVE of r at now.
func (z *zapWindow) add(r interval.Range, now time.Time) {
	z.mu.Lock()
	defer z.mu.Unlock()
	z.expireLocked(now)
	if len(z.ranges) == maxZapRanges {
		k := copy(z.ranges, z.ranges[1:])
		z.ranges = z.ranges[:k]
	}
	z.ranges = append(z.ranges, zapRange{Range: r, until: now.Add(zapWatch)})
	z.pending.Store(int32(len(z.ranges)))
}

// within returns the parts of r that REMOVE events of the zapWatch before now
// covered (nil: none, the common case, which takes no lock).
func (z *zapWindow) within(r interval.Range, now time.Time) []interval.Range {
	if z.pending.Load() == 0 {
		return nil
	}
	z.mu.Lock()
	defer z.mu.Unlock()
	z.expireLocked(now)
	var in []interval.Range
	for _, zr := range z.ranges {
		if h := zr.Intersect(r); !h.Empty() {
			in = append(in, h)
		}
	}
	return in
}

// expireLocked drops the ranges whose watch ended by now. Called with z.mu held.
func (z *zapWindow) expireLocked(now time.Time) {
	n := 0
	for n < len(z.ranges) && !z.ranges[n].until.After(now) {
		n++
	}
	if n > 0 {
		k := copy(z.ranges, z.ranges[n:])
		clear(z.ranges[k:])
		z.ranges = z.ranges[:k]
		z.pending.Store(int32(k))
	}
}
