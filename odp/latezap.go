package odp

import (
	"time"

	"github.com/odpemu/odpemu/internal/interval"
	"github.com/odpemu/odpemu/pagefault"
)

// The late half of a REMOVE's notifier, for memory registered for events alone.
//
// The kernel runs an MMU notifier's invalidation around a zap: it starts before the
// page table changes and ends after. userfaultfd sends REMOVE before MADV_DONTNEED
// zaps and nothing after, and pagefault.ZapBarrier waits for the zap but for one gap
// (a thread the event's read woke that has not yet taken the mmap lock), which a
// loaded machine keeps open for as long as the thread waits for a CPU. A network page
// fault in that gap maps the old page, which is then zapped. On memory registered in
// missing mode the next access to the zapped page is a fault the CPU server sees, and
// the DMA under it is torn and made again. On memory registered for events alone (the
// application's own memory, an implicit MR's reach) nothing would tell the NIC: its
// translation keeps the freed frame. (The emulated NIC copies through virtual
// addresses, so no freed frame is written; its translation table is what would be
// wrong, and the DMA audit counts every DMA through such a translation as stale.)
//
// So a DMA that starts on such memory within zapWatch of a REMOVE over its pages
// compares the MR's translations of them with the page table (pagemap): a page that
// is no longer present, or is present in another frame (where frames are readable),
// was zapped after the NIC mapped it. The DMA does not begin; the MR's translations
// of its pages are invalidated, as the notifier's end would have had them, and the DMA
// faults them again. Stats.LateZaps counts such pages.
//
// The audit takes the page-table entries this check read, so a page zapped and
// touched anew after the check cannot be counted against a DMA the check let begin.
// What stays out of reach: a zap more than zapWatch after its event was applied.

// zapsWatched reports whether REMOVE ranges are watched: the common case, false,
// costs the DMA paths one atomic load.
func (mr *MR) zapsWatched() bool { return mr.dev.as.zaps.pending.Load() != 0 }

// lateZap reports whether a translation of MR pages [first, first+count), valid in
// the MR's table, lost its page to a zap that came after a REMOVE event (see the
// comment above): the DMA that asked must not begin, and its pages' translations
// must be invalidated (dropLate) before it tries again. frames are the pages'
// page-table entries if it read them (nil if no REMOVE's watch covers the pages),
// which the DMA audit takes as they are: read again, a page could be zapped and
// touched anew in between, and the audit would count a DMA this check let begin.
// The DMA paths call it only while REMOVE ranges are watched (zapsWatched).
func (mr *MR) lateZap(first, count int) (zapped bool, frames []pagefault.PagemapEntry) {
	d := mr.dev
	if count == 0 || (!mr.foreign && !mr.implicit) || d.cfg.NoInvalidate {
		return false, nil
	}
	s := d.as
	lo := mr.base + uintptr(first)*pagefault.PageSize
	watched := s.zaps.within(interval.Range{Start: lo, End: lo + uintptr(count)*pagefault.PageSize}, time.Now())
	if watched == nil {
		return false, nil
	}
	if mr.dropping.Load() {
		return true, nil // being invalidated: try again after
	}
	entries := make([]pagefault.PagemapEntry, count)
	if s.pagemap.Read(lo, entries) != nil {
		return false, nil // unmapped under us: the copy faults and reports it
	}
	pfns := s.pagemap.PFNsReadable()
	n := 0
	mr.table.Lock()
	for i, e := range entries {
		te := mr.table.EntryLocked(first + i)
		if !te.Valid || (e.Present() && (!pfns || e.PFN() == te.PFN)) {
			continue
		}
		at := lo + uintptr(i)*pagefault.PageSize
		for _, w := range watched {
			if w.Overlaps(interval.Range{Start: at, End: at + pagefault.PageSize}) { // a REMOVE covered the page: its zap came late
				n++
				break
			}
		}
	}
	mr.table.Unlock()
	if n > 0 {
		d.stats.lateZaps.Add(uint64(n))
		return true, nil
	}
	return false, entries
}

// dropLate invalidates MR pages [first, first+count) after lateZap found one of them
// zapped, on a goroutine of its own unless wait is set (an invalidation waits for
// every DMA of the table, the engine's own holds included), one at a time per MR.
func (mr *MR) dropLate(first, count int, wait bool) {
	if wait {
		mr.invalidate(first, count)
		return
	}
	if !mr.dropping.CompareAndSwap(false, true) {
		return
	}
	d := mr.dev
	d.faulting.Add(1)
	go func() {
		defer d.faulting.Done()
		mr.invalidate(first, count)
		mr.dropping.Store(false)
	}()
}
