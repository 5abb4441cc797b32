package odp

import (
	"errors"
	"fmt"
	"time"

	"github.com/odpemu/odpemu/internal/clock"
	"github.com/odpemu/odpemu/pagefault"
)

// fault is the network page fault handler (mlx5's pagefault_real_mr): it resolves
// pages [miss, end) widened to the fault-around alignment, then maps them unless an
// invalidation ran meanwhile, in which case it maps nothing and the caller simply
// faults again. With presentOnly no page is installed: only present pages are mapped.
// It returns the number of entries mapped.
func (mr *MR) fault(miss, end int, write, presentOnly bool) (int, error) {
	d := mr.dev
	fa := d.cfg.FaultAround
	lo := miss &^ (fa - 1)
	hi := min((end+fa-1)&^(fa-1), mr.table.Pages())
	populate := mr.file != nil || mr.foreign
	if mr.implicit {
		// An implicit MR's fault stays inside the buffer that holds the missing page,
		// or inside the application's own memory between buffers; the caller faults
		// again for what lies beyond.
		blo, bhi, inBuffer := mr.pagesAround(miss)
		lo, hi, end = max(lo, blo), min(hi, bhi), min(end, bhi)
		if !inBuffer {
			lo, hi = miss, end
			if err := mr.reach(lo, hi); err != nil {
				return 0, err
			}
			// Whatever the application unmapped here before, the memory mapped now
			// is the implicit MR's.
			mr.remap(uintptr(lo)*pagefault.PageSize, uintptr(hi)*pagefault.PageSize)
			populate = true
		}
	}
	mr.table.Lock()
	lo, hi, ok := mr.clipGoneLocked(lo, hi, miss, end)
	mr.table.Unlock()
	if !ok {
		return 0, wrap(ErrInvalidArgument, "MR %#x: pages [%d, %d) were unmapped", mr.key, miss, end)
	}
	mapped, err := mr.faultWindow(lo, hi, write, presentOnly, populate)
	if errors.Is(err, pagefault.ErrUnmapped) && (lo < miss || hi > end) {
		// Fault-around reached memory unmapped before its event was applied: retry
		// with exactly the pages asked for.
		mapped, err = mr.faultWindow(miss, end, write, presentOnly, populate)
	}
	return mapped, err
}

// faultWindow resolves and maps table pages [lo, hi): memory the resolver does not
// serve (a file mapping, the application's own) is populated as hmm_range_fault does.
func (mr *MR) faultWindow(lo, hi int, write, presentOnly, populate bool) (int, error) {
	d := mr.dev
	entries := make([]pagefault.PagemapEntry, hi-lo)
	addr := mr.base + uintptr(lo)*pagefault.PageSize

	if d.as.pager != nil && !presentOnly && d.as.pager.Over(hi-lo) {
		d.as.pager.ReclaimDirect() // direct reclaim, bounded, before the fault takes its sequence
	}
	seq := mr.table.ReadBegin()
	t0 := time.Now()
	var err error
	switch {
	case presentOnly:
		err = d.as.pagemap.Read(addr, entries)
	case populate:
		err = d.as.pagemap.Populate(addr, entries, write)
	case d.as.pager != nil:
		// Paged memory has one installer, the CPU fault server's thread: an
		// eviction cannot overtake the content it chose. Then only translate.
		// The server's direct reclaim leaves the pages alone until they are mapped.
		defer d.as.pager.Unhold(addr, hi-lo)
		if err = d.as.server.Install(addr, hi-lo); err == nil {
			err = d.as.resolver.Translate(addr, entries, write)
		}
	default:
		_, err = d.as.resolver.Resolve(addr, entries, write)
	}
	if err != nil {
		return 0, fmt.Errorf("odp: MR %#x: fault in %#x+%d pages: %w", mr.key, addr, hi-lo, err)
	}
	t1 := time.Now()
	d.stats.resolveNanos.Add(uint64(t1.Sub(t0)))
	mr.table.Lock()
	defer mr.table.Unlock()
	defer func() { d.stats.updateNanos.Add(uint64(time.Since(t1))) }()
	if mr.dead {
		return 0, errDeregistered
	}
	if mr.table.ReadRetryLocked(seq) {
		mr.stats.faultRetries.Add(1)
		d.stats.faultRetries.Add(1)
		return 0, nil
	}
	return mr.mapPresentLocked(lo, entries, write), nil
}

// maxFaultRounds bounds fault-and-retry rounds for one DMA; invalidations are finite,
// so this is reached only if the range keeps disappearing.
const maxFaultRounds = 1000

// networkFault is a network page fault from page miss to end: fault, held for the
// device's fault model, counted.
func (mr *MR) networkFault(miss, end int, write bool) (int, error) {
	t0 := time.Now()
	mapped, err := mr.fault(miss, end, write, false)
	if err != nil {
		return 0, err
	}
	var children time.Duration // the firmware creating the implicit MR's children the fault is in
	if mr.implicit {
		children = time.Duration(mr.newChildren(miss, max(end, miss+1))) * mr.dev.cfg.RegModel.Reg
	}
	if m := mr.dev.cfg.FaultModel; m.PerFault > 0 || m.PerPage > 0 || children > 0 {
		held := time.Now()
		// The fault's own cost counts toward the model's latency; the children's
		// creation comes after it.
		until := t0.Add(m.Latency(mapped))
		if until.Before(held) {
			until = held
		}
		clock.SleepUntil(until.Add(children), nil) // time.Sleep would round it to a millisecond
		mr.dev.stats.modelNanos.Add(uint64(time.Since(held)))
	}
	ns := uint64(time.Since(t0))
	mr.stats.faults.Add(1)
	mr.stats.pagesFaulted.Add(uint64(mapped))
	mr.stats.faultNanos.Add(ns)
	mr.dev.stats.faults.Add(1)
	mr.dev.stats.pagesFaulted.Add(uint64(mapped))
	mr.dev.stats.faultNanos.Add(ns)
	return mapped, nil
}
