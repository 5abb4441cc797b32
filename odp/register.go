package odp

import (
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/odpemu/odpemu/internal/interval"
	"github.com/odpemu/odpemu/mmu"
	"github.com/odpemu/odpemu/pagefault"
	"golang.org/x/sys/unix"
)

func (mr *MR) span(end uintptr) interval.Range { return interval.Range{Start: mr.base, End: end} }

func (mr *MR) registerODP(end uintptr, npages int) error {
	d := mr.dev
	t0 := time.Now()
	s := d.as
	s.regMu.Lock()
	defer s.regMu.Unlock()
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return ErrClosed
	}
	s.mu.Lock()
	if err := mr.registerRangeLocked(end); err != nil {
		s.mu.Unlock()
		d.mu.Unlock()
		return err
	}
	s.mu.Unlock()
	key, ok := d.keys.alloc()
	if !ok {
		d.mu.Unlock()
		mr.unregister(end)
		return wrap(ErrNoMemory, "out of memory keys")
	}
	mr.key = key
	mr.table = mmu.New(npages)
	d.mrs[key>>8] = mr
	d.keyed.storeLocked(key>>8, mr)
	d.mu.Unlock()
	mr.activateODP(end, t0)
	return nil
}

// registerRangeLocked registers an ODP MR's pages with the userfaultfd. A buffer
// from Alloc is registered for faults: the resolver installs its pages, and paging
// works on them. Other memory, the application's own (malloc, its own mmap, the Go
// heap), is registered for events only, with nothing write-protected, so that its
// other data behaves as before (the CPU's faults stay the kernel's): what the
// application unmaps, moves or discards still invalidates the NIC's entries, and a
// network page fault populates the pages as hmm_range_fault does (MADV_POPULATE).
// Called with space.mu held.
func (mr *MR) registerRangeLocked(end uintptr) error {
	s := mr.dev.as
	span := mr.span(end)
	if _, ok := s.bufferLocked(mr.start, uintptr(mr.length)); ok {
		if _, err := s.uffd.Register(mr.base, end-mr.base, pagefault.ModeMissing|pagefault.ModeWP); err != nil {
			return fmt.Errorf("odp: register ODP range: %w", err)
		}
		s.odpRegs = append(s.odpRegs, span)
		s.syncEvictableLocked()
		return nil
	}
	for _, b := range s.buffers {
		if b.Overlaps(span) {
			return wrap(ErrInvalidArgument, "%#x+%d spans a buffer from Alloc and other memory", mr.start, mr.length)
		}
	}
	span, err := s.registerEventsLocked(span)
	if err != nil {
		// Not all anonymous memory this process maps (a file mapping, a hole, another
		// address space's registration): the kernel's ib_umem_odp_get fails so too.
		return wrap(ErrBadAddress, "ODP registration of %#x+%d: %v", mr.start, mr.length, err)
	}
	mr.foreign, mr.foreignSpan = true, span
	s.foreignRegs = append(s.foreignRegs, span)
	return nil
}

// registerEventsLocked registers r, the application's own memory, with the
// userfaultfd for events only (write-protect mode, nothing write-protected) and
// returns the range registered: r, or r widened to whole huge pages where an end of
// it lies in a hugetlbfs mapping (MAP_HUGETLB, SHM_HUGETLB), of which UFFDIO_REGISTER
// takes whole pages only (EINVAL). The kernel's ODP maps any part of a huge page;
// the pages around the MR's that the widening adds only bring events no MR's
// notifier covers. Called with space.mu held.
func (s *space) registerEventsLocked(r interval.Range) (interval.Range, error) {
	_, err := s.uffd.Register(r.Start, r.End-r.Start, pagefault.ModeWP)
	if errors.Is(err, unix.EINVAL) {
		if lo, hi, werr := pagefault.WholeMappingPages(r.Start, r.End); werr == nil && (lo != r.Start || hi != r.End) {
			r = interval.Range{Start: lo, End: hi}
			_, err = s.uffd.Register(r.Start, r.End-r.Start, pagefault.ModeWP)
		}
	}
	return r, err
}

// releaseForeignLocked ends a foreign ODP MR's registration: its range leaves the
// space's list and the pages no other foreign MR covers leave the userfaultfd.
// Called with space.mu held.
func (s *space) releaseForeignLocked(r interval.Range) {
	s.foreignRegs = removeRange(s.foreignRegs, r)
	for _, u := range interval.Uncovered(r, s.foreignCoverLocked()) {
		_ = s.uffd.Unregister(u.Start, u.End-u.Start) // a part the application unmapped is not there to change
	}
}

// foreignCoverLocked returns the ranges of the application's own memory registered
// for events: the explicit ODP MRs' over it and what implicit MRs reached. Called
// with space.mu held.
func (s *space) foreignCoverLocked() []interval.Range {
	cover := slices.Clone(s.foreignRegs)
	for _, m := range s.implicitMRs {
		cover = append(cover, m.(*MR).reached...)
	}
	return cover
}

// activateODP subscribes a new ODP MR, registered from t0, to invalidations and maps
// the pages already present (mlx5's snapshot) unless the device says not to.
func (mr *MR) activateODP(end uintptr, t0 time.Time) {
	d := mr.dev
	mr.sub = d.as.registry.Insert(mr.base, end, notifier{mr})
	mr.reg.Register = time.Since(t0)
	d.stats.mrsODP.Add(1)
	if !d.cfg.NoSnapshot {
		t1 := time.Now()
		mr.snapshot(mr.base, end)
		mr.reg.Snapshot = time.Since(t1)
	}
}

// snapshot maps the pages already present, without faulting, as mlx5 does when an ODP
// MR is created. Pages that are not exclusively mapped (the shared zero page, pages
// shared with a fork child) are mapped read-only: a NIC write must fault them first.
// Runs of absent pages are skipped without reading their entries (ReadPresent), so a
// large untouched region costs no more than a small one.
func (mr *MR) snapshot(start, end uintptr) {
	// A snapshot is an optimisation: pages it cannot read fault later instead.
	_ = mr.dev.as.pagemap.ReadPresent(start, end, 4096, func(addr uintptr, entries []pagefault.PagemapEntry) error {
		first := int((addr - mr.base) / pagefault.PageSize)
		seq := mr.table.ReadBegin()
		mr.table.Lock()
		defer mr.table.Unlock()
		if mr.dead {
			return errDeregistered
		}
		if !mr.table.ReadRetryLocked(seq) { // else invalidated meanwhile: these fault later
			mr.mapPresentLocked(first, entries, mr.Access().writable())
		}
		return nil
	})
}

// mapPresentLocked maps the present pages among entries (page first onward) and
// returns how many it mapped. write asks for writable entries, granted only to pages
// mapped exclusively. Pages the application unmapped (gone) are never mapped, whatever
// is mapped at their address now: the check is made here, under the lock that the
// notifier records them under, because a fault's earlier look at gone can predate an
// unmap whose invalidation then completed before the fault's ReadBegin. Called with
// the MR's table lock (mmu.Table.Lock) held.
func (mr *MR) mapPresentLocked(first int, entries []pagefault.PagemapEntry, write bool) int {
	for _, g := range mr.gone {
		lo, hi := max(g[0]-first, 0), min(g[1]-first, len(entries))
		for i := lo; i < hi; i++ {
			entries[i] = 0 // not present, for this MR
		}
	}
	// A shared file mapping has no copy on write: its pages are the file's wherever
	// else they are mapped.
	exclusive := func(e pagefault.PagemapEntry) bool { return e.Exclusive() || mr.file != nil }
	mapped := 0
	var pfns [64]uint64
	for i := 0; i < len(entries); {
		if !entries[i].Present() {
			i++
			continue
		}
		excl := exclusive(entries[i])
		j := i
		for j < len(entries) && j-i < len(pfns) && entries[j].Present() && exclusive(entries[j]) == excl {
			pfns[j-i] = entries[j].PFN()
			j++
		}
		mr.table.MapLocked(first+i, pfns[:j-i], write && excl)
		mapped += j - i
		i = j
	}
	return mapped
}

func (mr *MR) registerPinned(end uintptr, npages int) error {
	d := mr.dev
	t0 := time.Now()
	bytes := int64(end - mr.base)
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return ErrClosed
	}
	if d.limit >= 0 && d.pinned+bytes > d.limit {
		pinned := d.pinned
		d.mu.Unlock()
		return wrap(ErrMemlockLimit, "pinning %d bytes with %d already pinned; the limit is %d (RLIMIT_MEMLOCK, or the device's ResidentBudget): raise it, or use AccessOnDemand",
			bytes, pinned, d.limit)
	}
	d.pinned += bytes
	d.mu.Unlock()
	mr.reg.Account = time.Since(t0)

	t1 := time.Now()
	// pin_user_pages_fast(FOLL_LONGTERM | FOLL_WRITE if writable) faults every page in,
	// for write if the access can write, and fails with EFAULT where the mapping does
	// not allow it. Populating the same way finds those cases (mlock alone would
	// accept read-only memory and report an unmapped range as ENOMEM); mlock then pins.
	unaccount := func() {
		d.mu.Lock()
		d.pinned -= bytes
		d.mu.Unlock()
	}
	if err := pagefault.PopulateRange(mr.base, end-mr.base, mr.Access().writable()); err != nil {
		unaccount()
		switch {
		case errors.Is(err, unix.ENOMEM):
			return wrap(ErrBadAddress, "[%#x, +%d) is not mapped (%v)", mr.start, mr.length, err)
		case errors.Is(err, unix.EFAULT), errors.Is(err, unix.EINVAL), errors.Is(err, unix.EPERM):
			return wrap(ErrBadAddress, "[%#x, +%d) cannot be pinned for %v: its mapping's protection forbids it (%v)",
				mr.start, mr.length, mr.Access(), err)
		}
		return fmt.Errorf("odp: fault in %d bytes to pin: %w", bytes, err)
	}
	if _, _, e := unix.Syscall(unix.SYS_MLOCK, mr.base, end-mr.base, 0); e != 0 {
		unaccount()
		if e == unix.ENOMEM && d.limit < 0 {
			// No limit applies (CAP_IPC_LOCK): mlock's ENOMEM means a page of the
			// range was unmapped after it was faulted in.
			return wrap(ErrBadAddress, "[%#x, +%d) unmapped during registration (%v)", mr.start, mr.length, e)
		}
		if e == unix.ENOMEM || e == unix.EPERM || e == unix.EAGAIN {
			return wrap(ErrMemlockLimit, "mlock %d bytes: %v (RLIMIT_MEMLOCK)", bytes, e)
		}
		return fmt.Errorf("odp: mlock %d bytes: %w", bytes, e)
	}
	mr.reg.Pin = time.Since(t1)

	t2 := time.Now()
	mr.table = mmu.New(npages)
	mr.table.Lock()
	err := mr.buildMTTLocked()
	mr.table.Unlock()
	if err != nil {
		mr.unpin(end, bytes)
		return err
	}
	mr.reg.MTT = time.Since(t2)

	// Subscribed before the key is published, so that no DMA can use a page the
	// application unmaps from here on.
	mr.sub = d.as.registry.Insert(mr.base, end, notifier{mr})
	d.mu.Lock()
	key, ok := d.keys.alloc()
	if ok {
		mr.key = key
		d.mrs[key>>8] = mr
		d.keyed.storeLocked(key>>8, mr)
		d.as.mu.Lock()
		d.as.locked = append(d.as.locked, mr.span(end))
		d.as.syncEvictableLocked()
		d.as.mu.Unlock()
	}
	d.mu.Unlock()
	if !ok {
		mr.sub.Remove()
		mr.unpin(end, bytes)
		return wrap(ErrNoMemory, "out of memory keys")
	}
	d.stats.mrsPinned.Add(1)
	return nil
}

// buildMTTLocked records the pages of a pinned MR, which are present, in its table,
// as the MTT of pin_user_pages' page list. Called with the table lock held.
func (mr *MR) buildMTTLocked() error {
	const chunk = 4096
	npages := mr.table.Pages()
	entries := make([]pagefault.PagemapEntry, min(chunk, npages))
	for first := 0; first < npages; first += chunk {
		n := min(chunk, npages-first)
		err := mr.dev.as.pagemap.Read(mr.base+uintptr(first)*pagefault.PageSize, entries[:n])
		if err == nil && mr.mapPresentLocked(first, entries[:n], true) != n {
			// Only an munmap racing the registration does this: the caller freed
			// the memory it is registering.
			err = wrap(ErrBadAddress, "pages of [%#x, +%d) unmapped during registration", mr.start, mr.length)
		}
		if err != nil {
			return fmt.Errorf("odp: build MTT: %w", err)
		}
	}
	return nil
}

// unpin undoes a pinned registration that never got a key.
func (mr *MR) unpin(end uintptr, bytes int64) {
	d := mr.dev
	d.as.mu.Lock()
	d.as.unlockUncoveredLocked(mr.span(end))
	d.as.mu.Unlock()
	d.mu.Lock()
	d.pinned -= bytes
	d.mu.Unlock()
}

// unlockUncoveredLocked munlocks the parts of r that no pinned MR (of any device)
// locks any more. Called with space.mu held.
func (s *space) unlockUncoveredLocked(r interval.Range) {
	for _, u := range interval.Uncovered(r, s.locked) {
		// munlock fails only for a range the application unmapped meanwhile.
		_, _, _ = unix.Syscall(unix.SYS_MUNLOCK, u.Start, u.End-u.Start, 0)
	}
}

// unregister undoes an ODP registration that never got a key.
func (mr *MR) unregister(end uintptr) {
	s := mr.dev.as
	s.mu.Lock()
	defer s.mu.Unlock()
	if mr.foreign {
		s.releaseForeignLocked(mr.foreignSpan)
		return
	}
	s.odpRegs = removeRange(s.odpRegs, mr.span(end))
	s.syncEvictableLocked()
	for _, r := range s.uncoveredLocked(mr.span(end)) {
		s.downgradeLocked(r)
	}
}

// uncoveredLocked returns the parts of r that no ODP MR registers for faults. Called
// with space.mu held.
func (s *space) uncoveredLocked(r interval.Range) []interval.Range {
	if len(s.implicitMRs) > 0 {
		return nil // an implicit MR covers every buffer
	}
	return interval.Uncovered(r, s.odpRegs)
}

// downgradeLocked ends on-demand faulting of r, which no ODP MR covers any more: the
// range stays registered for events only (write-protect mode, with nothing
// write-protected), so that its buffer still learns what the application unmaps.
// Called with space.mu held. It cannot fail for a range of a live buffer; a part the
// application unmapped meanwhile is simply not there to change.
func (s *space) downgradeLocked(r interval.Range) {
	_, _ = s.uffd.Register(r.Start, r.End-r.Start, pagefault.ModeWP)
}

func removeRange(rs []interval.Range, r interval.Range) []interval.Range {
	for i, x := range rs {
		if x == r {
			return append(rs[:i], rs[i+1:]...)
		}
	}
	return rs
}
