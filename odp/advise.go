package odp

import (
	"errors"
	"time"

	"github.com/odpemu/odpemu/pagefault"
)

// Advice is ibv_advise_mr's advice.
type Advice int

// AdviseFlags are ibv_advise_mr's flags.
type AdviseFlags uint32

// AdviseFlush makes AdviseMR synchronous: it returns once the pages are mapped
// (IBV_ADVISE_MR_FLAG_FLUSH). Without it AdviseMR checks its arguments, returns, and
// the NIC maps the pages in the background (Stats counts them as they land).
const AdviseFlush AdviseFlags = 1 << 0

// adviseMR is AdviseMR.
func (pd *domain) adviseMR(advice Advice, flags AdviseFlags, sgl []SGE) error {
	if pd == nil || pd.dead.Load() {
		return wrap(ErrInvalidArgument, "AdviseMR on a deallocated PD")
	}
	if advice < AdvisePrefetch || advice > AdvisePrefetchNoFault {
		return wrap(ErrInvalidArgument, "advice %d", advice)
	}
	if flags&^AdviseFlush != 0 {
		return wrap(ErrInvalidArgument, "advise flags %#x", uint32(flags))
	}
	if len(sgl) == 0 {
		return wrap(ErrInvalidArgument, "AdviseMR of no SGE")
	}
	type job struct {
		mr           *MR
		first, count int
	}
	jobs := make([]job, 0, len(sgl))
	for _, s := range sgl {
		mr := pd.dev.lookupMR(s.LKey)
		if mr == nil || mr.pd.Load() != pd {
			return wrap(ErrInvalidArgument, "lkey %#x is not an MR of the PD", s.LKey)
		}
		first, count, err := mr.adviseRange(advice, s.Addr, uint64(s.Length))
		if err != nil {
			return err
		}
		jobs = append(jobs, job{mr, first, count})
	}
	run := func() error {
		var errs []error
		for _, j := range jobs {
			errs = append(errs, j.mr.prefetch(advice, j.first, j.count))
		}
		return errors.Join(errs...)
	}
	if flags&AdviseFlush != 0 {
		return run()
	}
	d := pd.dev
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return ErrClosed
	}
	d.background.Add(1) // Close waits for it
	d.stats.asyncPrefetches.Add(1)
	go func() {
		defer d.background.Done()
		if run() != nil {
			d.stats.prefetchErrors.Add(1)
		}
	}()
	return nil
}

// Advise is AdviseMR of one range of the MR, synchronous (with AdviseFlush).
func (mr *MR) Advise(advice Advice, addr, length uint64) error {
	if advice < AdvisePrefetch || advice > AdvisePrefetchNoFault {
		return wrap(ErrInvalidArgument, "advice %d", advice)
	}
	first, count, err := mr.adviseRange(advice, addr, length)
	if err != nil {
		return err
	}
	return mr.prefetch(advice, first, count)
}

// adviseRange checks an advice for [addr, addr+length) of the MR and returns the
// table pages it covers.
func (mr *MR) adviseRange(advice Advice, addr, length uint64) (int, int, error) {
	if !mr.odp {
		return 0, 0, wrap(ErrNotSupported, "advise on pinned MR %#x", mr.key)
	}
	off, ok := mr.offset(addr, length)
	if !ok || length == 0 {
		return 0, 0, wrap(ErrInvalidArgument, "[%#x, +%d) outside MR %#x", addr, length, mr.key)
	}
	if advice == AdvisePrefetchWrite && !mr.Access().writable() {
		return 0, 0, wrap(ErrPermission, "PREFETCH_WRITE on MR %#x without write access", mr.key)
	}
	first, count := mr.pageSpan(off, length)
	return first, count, nil
}

// prefetch maps table pages [first, first+count) for the advice, counted. As in
// mlx5, PREFETCH maps for reading only, PREFETCH_WRITE for writing, and NO_FAULT
// snapshots the present pages with the write permission the MR allows (granted to
// pages mapped exclusively, as at registration).
//
// A prefetch is advice: under a resident budget it maps no more than the budget
// holds (the first pages of the range), since pages beyond it would only evict the
// ones it just mapped; and a range that kept being invalidated while it was mapped
// (ErrBusy: evictions, the application's discards) ends the prefetch with what it
// mapped, not with an error.
func (mr *MR) prefetch(advice Advice, first, count int) error {
	write := advice == AdvisePrefetchWrite || (advice == AdvisePrefetchNoFault && mr.Access().writable())
	if b := mr.dev.cfg.ResidentBudget; b > 0 {
		count = min(count, int(b/int64(pagefault.PageSize)))
	}
	pages, err := mr.mapRange(first, count, write, advice == AdvisePrefetchNoFault, false)
	if errors.Is(err, ErrBusy) {
		err = nil
	}
	// Pages before the prefetch itself: whoever sees a background prefetch counted
	// sees the pages it mapped.
	mr.stats.pagesPrefetched.Add(uint64(pages))
	mr.stats.prefetches.Add(1)
	mr.dev.stats.pagesPrefetched.Add(uint64(pages))
	mr.dev.stats.prefetches.Add(1)
	return err
}

// mapRange maps table pages [first, first+count) for the access, taking faults until
// no entry is missing, and returns the entries it mapped. With presentOnly it makes
// one pass that maps only pages already present. counted counts the faults as network
// page faults (prefetch counts its own).
func (mr *MR) mapRange(first, count int, write, presentOnly, counted bool) (int, error) {
	if mr.implicit && !counted {
		// A prefetch creates the children it reaches, as mlx5's does (a network
		// fault creates its own: networkFault).
		firmware(time.Duration(mr.newChildren(first, first+max(count, 1))) * mr.dev.cfg.RegModel.Reg)
	}
	pages := 0
	for round := 0; ; round++ {
		mr.table.Lock()
		miss := mr.table.MissingLocked(first, count, write)
		mr.table.Unlock()
		if miss < 0 || (presentOnly && round > 0) {
			return pages, nil
		}
		if round == maxFaultRounds {
			return pages, wrap(ErrBusy, "MR %#x: range kept being invalidated", mr.key)
		}
		var mapped int
		var err error
		if counted {
			mapped, err = mr.networkFault(miss, first+count, write)
		} else {
			mapped, err = mr.fault(miss, first+count, write, presentOnly)
		}
		if err != nil {
			return pages, err
		}
		pages += mapped
	}
}
