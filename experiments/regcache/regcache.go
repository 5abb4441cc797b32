// Package regcache is a pin-down registration cache, the way UCX's rcache and
// libfabric's MR cache spare applications a registration per transfer: a buffer's
// pinned registration is kept after use and found again when the application sends
// from the same memory, up to a capacity in registered bytes, least recently used
// first out.
//
// A cache must not hand out a registration of memory the application has since
// unmapped or discarded: the NIC would read the old, pinned pages, not what the
// address now holds. Like libfabric's userfaultfd memory monitor, the cache
// registers every cached range with a userfaultfd of its own for UNMAP, REMOVE and
// REMAP events, and drops the entries an event covers before every lookup. The
// kernel holds munmap, madvise(MADV_DONTNEED) and mremap until the event is read; a
// C thread (pagefault.CPUServer) reads them, so whatever such call returned before a
// Get began is seen by that Get.
//
// Ranges are watched in write-protect mode, which delivers the events and no page
// fault (nothing is ever write-protected): the kernel resolves faults on them as on
// any memory. Watching in missing mode, where the kernel lacks write-protection,
// sends the ranges' missing-page faults to the same C thread (zero pages), with one
// hazard: mremap growing an mlocked range populates the new pages while the REMAP
// event is pending, and the kernel refuses to resolve a fault then (EAGAIN), so the
// mremap never returns. The emulator pins by mlock, so that mode deadlocks an
// application that grows a cached buffer.
//
// Memory from odp.Device.Alloc belongs to the device's own userfaultfd and cannot be
// cached (Get fails): cache ordinary memory, as pinned registrations are made of.
//
// Lock order: Cache.mu, then the odp device's locks (Get registers and deregisters
// under Cache.mu).
package regcache

import (
	"container/list"
	"errors"
	"fmt"
	"sync"
	"unsafe"

	"github.com/odpemu/odpemu/odp"
	"github.com/odpemu/odpemu/pagefault"
)

// ErrClosed is returned by a closed cache.
var ErrClosed = errors.New("regcache: closed")

// Stats are a cache's counters.
type Stats struct {
	Hits, Misses  uint64
	Evictions     uint64 // entries dropped for capacity
	Invalidations uint64 // entries dropped because their memory changed
	Events        uint64 // userfaultfd events applied
	Entries       int
	Bytes         int64 // registered bytes held
}

// Cache is a pin-down registration cache. It is safe for concurrent use.
type Cache struct {
	pd       *odp.PD
	access   odp.Access
	capacity int64
	uffd     *pagefault.FD
	srv      *pagefault.CPUServer
	mode     pagefault.RegisterMode // how ranges are watched

	mu     sync.Mutex // protects everything below
	lru    *list.List // of *entry, most recently used first
	stats  Stats
	events []pagefault.Msg // scratch for sync
	popped uint64          // events taken from the server
	// watched are the ranges registered with the userfaultfd; they stay watched
	// until they are unmapped or the cache closes.
	watched map[[2]uintptr]bool
	closed  bool
}

// entry is one cached registration of pages [start, end).
type entry struct {
	start, end uintptr
	mr         *odp.MR
	refs       int
	elem       *list.Element // nil once dropped from the cache
}

// Handle is a registration in use; Release returns it to the cache.
type Handle struct {
	c *Cache
	e *entry
}

// MR returns the registration, which covers the buffer Get was given.
func (h *Handle) MR() *odp.MR { return h.e.mr }

// New returns a cache of pinned registrations with access on pd, holding at most
// capacity registered bytes of entries not in use.
func New(pd *odp.PD, access odp.Access, capacity int64) (*Cache, error) {
	if access&odp.AccessOnDemand != 0 || capacity < 0 {
		return nil, fmt.Errorf("regcache: caches pinned registrations of a capacity >= 0")
	}
	u, err := pagefault.Open(pagefault.Options{Features: pagefault.FeatureEventUnmap | pagefault.FeatureEventRemove | pagefault.FeatureEventRemap})
	if err != nil {
		return nil, fmt.Errorf("regcache: memory monitor: %w", err)
	}
	srv, err := pagefault.StartCPUServer(u, 1)
	if err != nil {
		_ = u.Close() // nothing was registered on it
		return nil, fmt.Errorf("regcache: memory monitor: %w", err)
	}
	mode := pagefault.ModeMissing
	if pagefault.ProbeKernelBehaviour().Has(pagefault.ReqWriteProtect) {
		mode = pagefault.ModeWP
	}
	return &Cache{pd: pd, access: access, capacity: capacity, uffd: u, srv: srv, mode: mode, lru: list.New(),
		events: make([]pagefault.Msg, 64), watched: map[[2]uintptr]bool{}}, nil
}

// Get returns a registration covering buf, cached or new (whole pages). The caller
// must Release it; until then it is neither evicted nor deregistered, though an
// event may drop it from the cache.
func (c *Cache) Get(buf []byte) (*Handle, error) {
	if len(buf) == 0 {
		return nil, fmt.Errorf("regcache: %w: empty buffer", odp.ErrInvalidArgument)
	}
	addr := uintptr(unsafe.Pointer(unsafe.SliceData(buf)))
	page := pagefault.PageSize
	lo, hi := addr&^(page-1), (addr+uintptr(len(buf))+page-1)&^(page-1)
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil, ErrClosed
	}
	if err := c.syncLocked(); err != nil {
		return nil, err
	}
	for el := c.lru.Front(); el != nil; el = el.Next() {
		if e := el.Value.(*entry); e.start <= lo && hi <= e.end {
			c.lru.MoveToFront(el)
			e.refs++
			c.stats.Hits++
			return &Handle{c, e}, nil
		}
	}
	c.stats.Misses++
	// Watch the range before pinning it: an unmap from now on is an event.
	if _, err := c.uffd.Register(lo, hi-lo, c.mode); err != nil {
		return nil, fmt.Errorf("regcache: watch %#x+%#x: %w", lo, hi-lo, err)
	}
	c.watched[[2]uintptr{lo, hi}] = true
	pages := unsafe.Slice((*byte)(unsafe.Add(unsafe.Pointer(unsafe.SliceData(buf)), -int(addr-lo))), hi-lo)
	mr, err := c.pd.RegMR(pages, c.access)
	if err != nil {
		return nil, err
	}
	e := &entry{start: lo, end: hi, mr: mr, refs: 1}
	e.elem = c.lru.PushFront(e)
	c.stats.Bytes += int64(hi - lo)
	c.stats.Entries++
	return &Handle{c, e}, c.evictLocked()
}

// Release returns h to the cache; a handle whose entry was dropped meanwhile is
// deregistered.
func (h *Handle) Release() error {
	c := h.c
	c.mu.Lock()
	defer c.mu.Unlock()
	h.e.refs--
	if h.e.refs == 0 && h.e.elem == nil {
		return h.e.mr.Dereg()
	}
	return c.evictLocked()
}

// evictLocked deregisters least recently used entries not in use until the cache
// holds at most its capacity. c.mu must be held.
func (c *Cache) evictLocked() error {
	var errs []error
	for el := c.lru.Back(); el != nil && c.stats.Bytes > c.capacity; {
		prev := el.Prev()
		if e := el.Value.(*entry); e.refs == 0 {
			errs = append(errs, c.dropLocked(e))
			c.stats.Evictions++
		}
		el = prev
	}
	return errors.Join(errs...)
}

// dropLocked removes e from the cache, deregistering it unless it is in use (its
// last Release does). c.mu must be held.
func (c *Cache) dropLocked(e *entry) error {
	c.lru.Remove(e.elem)
	e.elem = nil
	c.stats.Bytes -= int64(e.end - e.start)
	c.stats.Entries--
	if e.refs > 0 {
		return nil
	}
	return e.mr.Dereg()
}

// syncLocked applies every event of a change to memory that completed before it
// was called. c.mu must be held.
func (c *Cache) syncLocked() error {
	queued, err := c.srv.SettledEvents()
	if err != nil || queued == c.popped {
		return err // nothing new: two atomic loads per lookup, no call into C
	}
	var errs []error
	for {
		n, err := c.srv.Events(c.events)
		if err != nil {
			return err
		}
		c.popped += uint64(n)
		for _, m := range c.events[:n] {
			c.stats.Events++
			lo, hi := m.Start, m.End
			if m.Event == pagefault.EventRemap {
				lo, hi = m.From, m.From+m.Len
			}
			if m.Event != pagefault.EventUnmap && m.Event != pagefault.EventRemove && m.Event != pagefault.EventRemap {
				continue
			}
			for w := range c.watched {
				if lo <= uint64(w[0]) && uint64(w[1]) <= hi {
					delete(c.watched, w) // its registration went with the mapping
				}
			}
			for el := c.lru.Front(); el != nil; {
				next := el.Next()
				if e := el.Value.(*entry); uint64(e.start) < hi && lo < uint64(e.end) {
					errs = append(errs, c.dropLocked(e))
					c.stats.Invalidations++
				}
				el = next
			}
		}
		if n < len(c.events) {
			return errors.Join(errs...)
		}
	}
}

// Stats returns the cache's counters, after applying pending events.
func (c *Cache) Stats() (Stats, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return c.stats, ErrClosed
	}
	err := c.syncLocked()
	return c.stats, err
}

// Close deregisters every entry not in use, stops the monitor and closes its
// userfaultfd, which ends its watch of every range. Handles still held stay valid
// until released.
func (c *Cache) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return ErrClosed
	}
	c.closed = true
	var errs []error
	for el := c.lru.Front(); el != nil; {
		next := el.Next()
		errs = append(errs, c.dropLocked(el.Value.(*entry)))
		el = next
	}
	// Unwatch before the server stops, so that no fault waits for it. A range the
	// application unmapped or moved has no registration left to remove: those
	// errors mean nothing.
	for w := range c.watched {
		_ = c.uffd.Unregister(w[0], w[1]-w[0])
	}
	errs = append(errs, c.srv.Stop(), c.uffd.Close())
	return errors.Join(errs...)
}
