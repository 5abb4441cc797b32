package odp

import (
	"github.com/odpemu/odpemu/invalidate"
	"github.com/odpemu/odpemu/pagefault"
)

// invalidate clears table pages [first, first+n), waiting for DMA in flight on them,
// and counts it.
func (mr *MR) invalidate(first, n int) {
	mr.invalidateBegin(first, n)
	mr.table.InvalidateEnd()
}

func (mr *MR) invalidateBegin(first, n int) {
	r := mr.table.InvalidateBegin(first, n)
	mr.dev.stats.invalidations.Add(1)
	mr.dev.stats.pagesInvalidated.Add(uint64(r.Pages))
	if r.WaitedDMAs > 0 {
		mr.dev.stats.dmaWaits.Add(1)
	}
}

// notifier is an MR's interval notifier. An ODP MR hears every invalidation of its
// range. A pinned MR hears only that its memory left the address space (munmap,
// mremap): its pages stay pinned on hardware, where the NIC would go on DMAing into
// frames nobody maps any more; the emulated NIC copies through the address, so it
// marks the pages gone instead and never writes into whatever is mapped there next.
type notifier struct{ mr *MR }

// hears reports whether the MR's table takes part in an invalidation for why.
func (n notifier) hears(why invalidate.Reason) bool {
	return n.mr.odp || why == invalidate.ReasonUnmap || why == invalidate.ReasonRemap
}

func (n notifier) pages(r invalidate.Range) (int, int) {
	ps := pagefault.PageSize
	first := int((r.Start - n.mr.base) / ps)
	last := int((r.End - n.mr.base + ps - 1) / ps)
	return first, min(last, n.mr.table.Pages()) - first
}

// InvalidateStart implements invalidate.Subscriber.
func (n notifier) InvalidateStart(r invalidate.Range, why invalidate.Reason) {
	if why == invalidate.ReasonFileChange && !n.mr.odp {
		first, count := n.pages(r)
		n.mr.table.Lock()
		n.mr.detachLocked(first, count)
		n.mr.table.Unlock()
		return
	}
	if !n.hears(why) {
		return
	}
	first, count := n.pages(r)
	n.mr.invalidateBegin(first, count)
	if why == invalidate.ReasonUnmap || why == invalidate.ReasonRemap {
		// The pages left the address range (mremap moved them away): whatever is
		// mapped there later is not the MR's memory.
		n.mr.table.Lock()
		n.mr.gone = append(n.mr.gone, [2]int{first, first + count})
		n.mr.table.Unlock()
	}
}

// remap is told that odpemu mapped a new buffer at [start, end): an implicit MR covers
// it, whatever was unmapped there before, so the range is no longer gone.
func (mr *MR) remap(start, end uintptr) {
	lo, hi := int(start/pagefault.PageSize), int(end/pagefault.PageSize)
	mr.table.Lock()
	defer mr.table.Unlock()
	var kept [][2]int
	for _, g := range mr.gone {
		if g[0] < lo {
			kept = append(kept, [2]int{g[0], min(g[1], lo)})
		}
		if g[1] > hi {
			kept = append(kept, [2]int{max(g[0], hi), g[1]})
		}
	}
	mr.gone = kept
}

// clipGoneLocked narrows the fault window [lo, hi) around [miss, end) so that it
// avoids unmapped pages; ok is false if [miss, end) itself touches one. Called with
// the MR's table lock held (it protects gone).
func (mr *MR) clipGoneLocked(lo, hi, miss, end int) (int, int, bool) {
	for _, g := range mr.gone {
		if g[0] < end && miss < g[1] {
			return 0, 0, false
		}
		if g[1] <= miss {
			lo = max(lo, g[1])
		} else if g[0] >= end {
			hi = min(hi, g[0])
		}
	}
	return lo, hi, true
}

// InvalidateEnd implements invalidate.Subscriber.
func (n notifier) InvalidateEnd(_ invalidate.Range, why invalidate.Reason) {
	if n.hears(why) {
		n.mr.table.InvalidateEnd()
	}
}
