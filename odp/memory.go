package odp

import (
	"fmt"

	"github.com/odpemu/odpemu/internal/interval"
	"github.com/odpemu/odpemu/invalidate"
	"github.com/odpemu/odpemu/pagefault"
	"golang.org/x/sys/unix"
)

// evictable reports whether pages [start, end) may be evicted or migrated: inside
// ODP registrations (so that a later access faults; with an implicit MR every buffer
// is) and in no pinned MR.
func (s *space) evictable(start, end uintptr) bool {
	s.mu.RLock()
	defer s.mu.RUnlock()
	r := interval.Range{Start: start, End: end}
	if len(s.implicitMRs) == 0 && len(interval.Uncovered(r, s.odpRegs)) > 0 {
		return false
	}
	for _, l := range s.locked {
		if l.Overlaps(r) {
			return false
		}
	}
	return true
}

// syncEvictableLocked tells the fault server's direct reclaim which pages of the
// paged buffers it may evict: those evictable would accept (registered for faults by
// an ODP MR, explicit or implicit; not mlocked by a pinned one). Called with s.mu held,
// after a range became registered for faults and before one stops being so (the
// server then no longer evicts there when it returns).
func (s *space) syncEvictableLocked() {
	if s.pager == nil {
		return
	}
	for _, b := range s.buffers {
		if b.paged == nil {
			continue
		}
		whole := b.Range
		on := []interval.Range{whole}
		if len(s.implicitMRs) == 0 {
			on = interval.Uncovered(whole, interval.Uncovered(whole, s.odpRegs))
		}
		var evictable []interval.Range
		for _, r := range on {
			evictable = append(evictable, interval.Uncovered(r, s.locked)...)
		}
		for _, r := range interval.Uncovered(whole, evictable) {
			s.pager.SetEvictable(r.Start, r.End, false)
		}
		for _, r := range evictable {
			s.pager.SetEvictable(r.Start, r.End, true)
		}
	}
}

// SyncEvents returns once every userfaultfd event raised before the call (by a
// madvise, munmap or mremap that has returned) has been applied to the NIC's tables.
func (d *Device) SyncEvents() error { return d.as.pump.Sync() }

// Invalidate invalidates the NIC's translations of [addr, addr+length) in every ODP MR
// of the device, waiting for DMA in flight on them: the next access faults afresh.
// With NoInvalidate it does nothing.
func (d *Device) Invalidate(addr, length uint64) error {
	r, err := pageRange(addr, length)
	if err != nil {
		return err
	}
	_, err = d.as.registry.Invalidate(r, invalidate.ReasonExplicit, nil)
	return err
}

// Discard drops the pages of b (madvise MADV_DONTNEED), which must lie in a buffer from
// Alloc, in the kernel's order: the NIC's translations are invalidated and DMA on them
// drained first, faults are held off while the pages are dropped, and the next access
// faults in zero-filled pages. With NoInvalidate the pages are dropped without telling
// the NIC.
func (d *Device) Discard(b []byte) error {
	if len(b) == 0 {
		return wrap(ErrInvalidArgument, "discard of an empty slice")
	}
	r, err := pageRange(uint64(addrOf(b)), uint64(len(b)))
	if err != nil {
		return err
	}
	d.as.mu.RLock()
	_, ok := d.as.bufferLocked(r.Start, r.End-r.Start)
	d.as.mu.RUnlock()
	if !ok {
		return wrap(ErrNotMmapped, "discard %#x+%d", r.Start, len(b))
	}
	zap := func() error {
		if _, _, e := unix.Syscall(unix.SYS_MADVISE, r.Start, r.End-r.Start, unix.MADV_DONTNEED); e != 0 {
			return fmt.Errorf("odp: madvise: %w", e)
		}
		return nil
	}
	if d.as.pager != nil {
		inner := zap
		zap = func() error { // evicted copies are forgotten: a discarded page is zero
			d.as.pager.DiscardedLocked(r.Start, r.End)
			err := inner() // the CPU fault server forgets them again as it reads the event
			d.as.pager.DiscardedLocked(r.Start, r.End)
			return err
		}
	}
	run := func() error {
		_, err := d.as.registry.Invalidate(r, invalidate.ReasonDiscard, zap)
		return err
	}
	if d.as.pager != nil {
		return d.as.pager.Exclusive(run) // no eviction between forgetting and dropping
	}
	return run()
}

// Evict writes the present pages of [addr, addr+length) in ODP memory to the backing
// store and drops them, invalidating the NIC's entries first; the next access faults
// them back with their content. Needs Config.Paging or a ResidentBudget.
func (d *Device) Evict(addr, length uint64) (int, error) {
	if d.as.pager == nil {
		return 0, wrap(ErrNotSupported, "Evict without Config.Paging")
	}
	r, err := pageRange(addr, length)
	if err != nil {
		return 0, err
	}
	return d.as.pager.Evict(r.Start, r.End)
}

// Migrate moves the present pages of [addr, addr+length) in ODP memory to new page
// frames, invalidating the NIC's entries first (compaction, NUMA balancing). Needs
// Config.Paging or a ResidentBudget.
func (d *Device) Migrate(addr, length uint64) (int, error) {
	if d.as.pager == nil {
		return 0, wrap(ErrNotSupported, "Migrate without Config.Paging")
	}
	r, err := pageRange(addr, length)
	if err != nil {
		return 0, err
	}
	return d.as.pager.Migrate(r.Start, r.End)
}

// pageRange rounds [addr, addr+length) out to pages.
func pageRange(addr, length uint64) (invalidate.Range, error) {
	end := addr + length
	if length == 0 || end < addr || end > uint64(^uintptr(0))-uint64(pagefault.PageSize) {
		return invalidate.Range{}, wrap(ErrInvalidArgument, "range %#x+%d", addr, length)
	}
	ps := pagefault.PageSize
	return invalidate.Range{Start: uintptr(addr) &^ (ps - 1), End: (uintptr(end) + ps - 1) &^ (ps - 1)}, nil
}
