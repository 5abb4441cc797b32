package odp

import (
	"time"

	"github.com/odpemu/odpemu/mmu"
	"github.com/odpemu/odpemu/pagefault"
)

// lookupMR finds a live MR by key.
func (d *Device) lookupMR(key uint32) *MR {
	d.mu.RLock()
	defer d.mu.RUnlock()
	if mr := d.mrs[key>>8]; mr != nil && mr.key == key {
		return mr
	}
	return nil
}

// errDeregistered is returned by DMA on an MR that is being deregistered.
var errDeregistered = wrap(ErrInvalidArgument, "MR deregistered")

// maxFaultRounds bounds fault-and-retry rounds for one DMA; invalidations are finite,
// so this is reached only if the range keeps disappearing.
const maxFaultRounds = 1000

// pageSpan returns the table pages covering MR bytes [off, off+n).
func (mr *MR) pageSpan(off, n uint64) (first, count int) {
	a := mr.start + uintptr(off) - mr.base
	first = int(a / pagefault.PageSize)
	if n == 0 {
		return first, 0
	}
	last := int((a + uintptr(n) - 1) / pagefault.PageSize)
	return first, last - first + 1
}

// beginDMA starts a DMA over MR bytes [off, off+n) (already bounds-checked), taking
// network page faults for ODP pages that are not mapped. The caller must endDMA.
func (mr *MR) beginDMA(off, n uint64, write bool) (mmu.DMA, error) {
	first, count := mr.pageSpan(off, n)
	for round := 0; round < maxFaultRounds; round++ {
		dma, miss := mr.table.BeginDMA(first, count, write)
		if miss < 0 {
			return dma, nil
		}
		if !mr.odp {
			return dma, errDeregistered // a pinned table is only cleared by Dereg
		}
		t0 := time.Now()
		mapped, err := mr.fault(miss, first+count, write, false)
		if err != nil {
			return dma, err
		}
		ns := uint64(time.Since(t0))
		mr.stats.faults.Add(1)
		mr.stats.pagesFaulted.Add(uint64(mapped))
		mr.stats.faultNanos.Add(ns)
		mr.dev.stats.faults.Add(1)
		mr.dev.stats.pagesFaulted.Add(uint64(mapped))
		mr.dev.stats.faultNanos.Add(ns)
	}
	return mmu.DMA{}, wrap(ErrBusy, "MR %#x: range kept being invalidated", mr.key)
}

// endDMA ends a DMA and reports whether an invalidation completed under it.
func (mr *MR) endDMA(d mmu.DMA) bool { return mr.table.EndDMA(d) }

// dmaRef is one DMA in flight on MR bytes [off, off+n), from acquire to release.
type dmaRef struct {
	mr     *MR
	off, n uint64
	d      mmu.DMA
	audit  bool
	mark   uint64 // CPU fault server install sequence at acquire
}

// acquire starts a DMA, taking network page faults as needed.
func (mr *MR) acquire(off, n uint64, write bool) (dmaRef, error) {
	d, err := mr.beginDMA(off, n, write)
	if err != nil {
		return dmaRef{}, err
	}
	r := dmaRef{mr: mr, off: off, n: n, d: d, audit: mr.dev.cfg.Audit}
	if p := mr.dev.pager; p != nil && mr.odp {
		first, count := mr.pageSpan(off, n)
		p.Touch(mr.base+uintptr(first)*pagefault.PageSize, count) // the NIC's access bits
	}
	if r.audit {
		// The server stops only when the device closes, after its DMA ended; a
		// stopped server's mark of 0 makes the audit assume the worst.
		r.mark, _ = mr.dev.server.InstallSeq()
	}
	return r, nil
}

func (r dmaRef) bytes() []byte { return r.mr.mem[r.off : r.off+r.n] }

// release audits the DMA when auditing is on, then ends it. A DMA that an
// invalidation of its range completed under (the invalidation did not wait for it)
// is stale whatever else the audit finds: it copied through withdrawn translations.
func (r dmaRef) release() {
	if r.audit {
		r.check()
	}
	if r.mr.endDMA(r.d) && r.audit {
		r.mr.dev.stats.stale.Add(1)
		r.mr.stats.stale.Add(1)
		r.mr.dev.stats.overtaken.Add(1)
	}
}

// check is the DMA audit: did the copy run through a translation the CPU no longer
// had, without an invalidation telling the NIC? Evidence is a CPU fault that found a
// page of the range missing during the DMA (immune to frame reuse), or a recorded
// frame that is not the page's frame now. A pinned MR is audited by frames alone:
// nothing ever invalidates its MTT, which is what fork and COW can get wrong.
func (r dmaRef) check() {
	mr, d := r.mr, r.mr.dev
	d.stats.audited.Add(1)
	first, count := mr.pageSpan(r.off, r.n)
	if count == 0 {
		return
	}
	lo := mr.base + uintptr(first)*pagefault.PageSize
	hi := lo + uintptr(count)*pagefault.PageSize
	stale := false
	if mr.odp {
		var err error
		if stale, err = d.server.InstalledSince(r.mark, lo, hi); err != nil {
			stale = false // the device closed under the DMA: nothing to audit against
		}
	}
	if !stale && d.pagemap.PFNsReadable() {
		entries := make([]pagefault.PagemapEntry, count)
		if d.pagemap.Read(lo, entries) == nil {
			mr.table.Lock()
			for i, e := range entries {
				te := mr.table.EntryLocked(first + i)
				if te.Valid && (!e.Present() || e.PFN() != te.PFN) {
					stale = true
					break
				}
			}
			mr.table.Unlock()
		}
	}
	if stale && mr.table.Sequence() == r.d.Seq() {
		d.stats.stale.Add(1)
		mr.stats.stale.Add(1)
	}
}
