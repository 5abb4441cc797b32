// Package invalidate delivers MMU-notifier-like invalidations to the emulated NIC.
//
// A Registry holds interval subscriptions (one per ODP memory region, like
// mmu_interval_notifier_insert) and calls every subscriber overlapping an invalidated
// range. A Pump reads the userfaultfd events (REMOVE, UNMAP, REMAP, and the fault
// server's own evictions) that the CPU fault server queued and turns them into
// invalidations. Eviction and migration (package paging) are changes of the first
// kind.
//
// Ordering: the kernel's notifier runs before a page's translation changes and the
// change waits for it. Changes that odpemu makes itself (explicit invalidation,
// discards, evictions and migrations) call Registry.Invalidate first and change the
// mapping only after it returned. Changes the application makes itself reach the
// Pump as userfaultfd events; the DMA gate (pagefault.Gate) keeps the NIC's DMA off
// them until the Pump has applied them, and the Pump applies REMOVE ranges around a
// barrier that waits for their zap (pagefault.ZapBarrier). pagefault's package doc
// has the whole protocol.
//
// # Lock order
//
//	Registry.mu       held for reading while subscribers run; they may block on DMA
//	                  but must not call into the Registry
//	Pump.mu           the pump's counters; a leaf
//
// Callers' locks come before Registry.mu (paging.Pager.reclaimMu: an eviction runs
// inside an invalidation); subscribers' locks (an MR's table lock) come after it.
// The Pump's waitLocked needs Pump.mu.
package invalidate

import (
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/odpemu/odpemu/internal/interval"
)

// Reason says why a range is invalidated.
type Reason int

const (
	ReasonRemove     Reason = iota // madvise(DONTNEED/REMOVE) (UFFD_EVENT_REMOVE)
	ReasonUnmap                    // munmap (UFFD_EVENT_UNMAP)
	ReasonRemap                    // mremap moved the range away (UFFD_EVENT_REMAP)
	ReasonExplicit                 // an Invalidate call
	ReasonDiscard                  // a discard odpemu performs itself
	ReasonFork                     // fork write-protected the parent's pages (COW)
	ReasonEvict                    // the pager wrote a page to the backing store
	ReasonMigrate                  // the pager moved a page to a new frame
	ReasonFileChange               // a mapped file's content changed (page cache invalidation)
	numReasons
)

var reasonNames = [numReasons]string{"remove", "unmap", "remap", "explicit", "discard", "fork", "evict", "migrate", "file"}

// String names the reason.
func (r Reason) String() string {
	if r < 0 || r >= numReasons {
		return fmt.Sprintf("Reason(%d)", int(r))
	}
	return reasonNames[r]
}

// Range is the half-open address range [Start, End): the one range type of odpemu's
// packages, with its overlap and intersection.
type Range = interval.Range

// Subscriber is told about invalidations overlapping its interval.
// InvalidateStart must return only when no DMA can use the old translations of r any
// more (it may block for DMA in flight) and must hold new translations off until the
// matching InvalidateEnd. Neither may call into the Registry.
type Subscriber interface {
	InvalidateStart(r Range, why Reason)
	InvalidateEnd(r Range, why Reason)
}

// Subscription is one registered interval.
type Subscription struct {
	reg   *Registry
	r     Range
	sub   Subscriber
	alive bool // protected by reg.mu
}

// Registry is a set of subscriptions. Safe for concurrent use.
type Registry struct {
	mu   sync.RWMutex // protects subs; held for reading while subscribers run
	subs map[*Subscription]struct{}

	counts   [numReasons]atomic.Uint64
	disabled atomic.Bool
}

// SetDisabled is the ablation switch: while set, Invalidate runs the change but tells
// no subscriber (the NIC keeps translations the CPU no longer has).
func (g *Registry) SetDisabled(v bool) { g.disabled.Store(v) }

// NewRegistry returns an empty registry.
func NewRegistry() *Registry { return &Registry{subs: map[*Subscription]struct{}{}} }

// Insert subscribes s to invalidations overlapping [start, end).
func (g *Registry) Insert(start, end uintptr, s Subscriber) *Subscription {
	g.mu.Lock()
	defer g.mu.Unlock()
	sub := &Subscription{reg: g, r: Range{Start: start, End: end}, sub: s, alive: true}
	g.subs[sub] = struct{}{}
	return sub
}

// Remove unsubscribes; once it returns, the subscriber is not called again. Safe to
// call more than once.
func (s *Subscription) Remove() {
	g := s.reg
	g.mu.Lock() // waits for invalidations running over the registry
	defer g.mu.Unlock()
	s.alive = false
	delete(g.subs, s)
}

// Invalidate runs invalidate_range_start on every subscriber overlapping r (with r
// clipped to its interval), then change (which may be nil: the mapping already
// changed), then invalidate_range_end, and returns how many subscribers it called.
// change's error is returned.
func (g *Registry) Invalidate(r Range, why Reason, change func() error) (int, error) {
	return g.InvalidateAll([]Range{r}, why, change)
}

// InvalidateAll is Invalidate over several ranges at once: every overlapping
// subscriber's invalidate_range_start for every range, then change, then every
// invalidate_range_end.
func (g *Registry) InvalidateAll(rs []Range, why Reason, change func() error) (int, error) {
	if why >= 0 && why < numReasons {
		g.counts[why].Add(uint64(len(rs)))
	}
	if g.disabled.Load() {
		if change != nil {
			return 0, change()
		}
		return 0, nil
	}
	g.mu.RLock()
	defer g.mu.RUnlock()
	type hit struct {
		s *Subscription
		r Range
	}
	var hits []hit
	for _, r := range rs {
		for s := range g.subs {
			if s.alive && s.r.Overlaps(r) {
				h := hit{s, s.r.Intersect(r)}
				h.s.sub.InvalidateStart(h.r, why)
				hits = append(hits, h)
			}
		}
	}
	var err error
	if change != nil {
		err = change()
	}
	for _, h := range hits {
		h.s.sub.InvalidateEnd(h.r, why)
	}
	return len(hits), err
}

// Count returns how many invalidations were requested for a reason.
func (g *Registry) Count(why Reason) uint64 {
	if why < 0 || why >= numReasons {
		return 0
	}
	return g.counts[why].Load()
}
