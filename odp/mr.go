package odp

import (
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/odpemu/odpemu/internal/interval"
	"github.com/odpemu/odpemu/invalidate"
	"github.com/odpemu/odpemu/mmu"
	"github.com/odpemu/odpemu/pagefault"
	"github.com/odpemu/odpemu/paging"
)

// MR is a registered memory region. Its translation table is the NIC's view of the
// region's pages: filled at registration for pinned MRs, on demand for ODP MRs.
type MR struct {
	dev    *Device
	pd     *PD
	mem    []byte  // the registered bytes
	start  uintptr // address of mem[0]
	length uint64
	access Access
	key    uint32
	odp    bool
	// implicit: the MR covers the whole address space (RegImplicitMR).
	implicit bool
	base     uintptr    // start rounded down to a page
	table    *mmu.Table // the NIC's entries for the pages from base (sparse)
	reg      RegTiming

	// dead is set under the table lock when deregistration starts; a fault that
	// finds it set maps nothing.
	dead bool
	sub  *invalidate.Subscription // ODP: the interval notifier
	// gone lists table page ranges [lo, hi) the application unmapped: they stay
	// invalid and a DMA on them is an access error, whatever is mapped there later.
	// Protected by the table lock.
	gone [][2]int

	// file is the file mapping an MR over one lies in (MapFile), pinned or ODP.
	file *fileMap
	// detached: a pinned file MR's copy of the pages the file let go of. Set under
	// the table lock; read by DMAs without it (only ever set until Dereg).
	detached atomic.Pointer[detachedPages]

	stats mrCounters
}

type mrCounters struct {
	faults, pagesFaulted, faultRetries, faultNanos atomic.Uint64
	prefetches, pagesPrefetched                    atomic.Uint64
	stale                                          atomic.Uint64
}

// RegTiming is how long each stage of registration took.
type RegTiming struct {
	Account  time.Duration // pinned: RLIMIT_MEMLOCK accounting
	Pin      time.Duration // pinned: mlock, which faults every page in
	MTT      time.Duration // pinned: frames read into the translation table
	Register time.Duration // ODP: userfaultfd registration and table allocation
	Snapshot time.Duration // ODP: already-present pages mapped
	Total    time.Duration
}

// MRStats are one MR's counters (rdma stat mr).
type MRStats struct {
	PageFaults       uint64 // network page fault events
	PagesFaulted     uint64 // pages mapped by faults
	FaultRetries     uint64 // faults that raced an invalidation and retried
	FaultTime        time.Duration
	Prefetches       uint64
	PagesPrefetched  uint64
	Invalidations    uint64
	PagesInvalidated uint64
	StaleDMAs        uint64 // audit violations on this MR
	ValidPages       int    // entries valid now
	TableBytes       int    // memory the NIC's table of the MR takes (mmu.Table.Footprint)
}

// RegMR registers buf for NIC access. With AccessOnDemand buf must come from
// Device.Alloc; otherwise any memory can be pinned (as ibv_reg_mr pins any mapping).
func (pd *PD) RegMR(buf []byte, access Access) (*MR, error) {
	t0 := time.Now()
	if pd == nil || pd.dead.Load() {
		return nil, wrap(ErrInvalidArgument, "RegMR on a deallocated PD")
	}
	d := pd.dev
	switch {
	case len(buf) == 0:
		return nil, wrap(ErrInvalidArgument, "zero-length MR")
	case access&^accessKnown != 0:
		return nil, wrap(ErrInvalidArgument, "unknown access flags %#x", uint32(access&^accessKnown))
	case access&(AccessRemoteWrite|AccessRemoteAtomic) != 0 && access&AccessLocalWrite == 0:
		return nil, wrap(ErrInvalidArgument, "%v needs LOCAL_WRITE", access)
	}
	ps := pagefault.PageSize
	start := addrOf(buf)
	base := start &^ (ps - 1)
	end := (start + uintptr(len(buf)) + ps - 1) &^ (ps - 1)
	mr := &MR{dev: d, pd: pd, mem: buf, start: start, length: uint64(len(buf)), access: access,
		odp: access&AccessOnDemand != 0, base: base}
	npages := int((end - base) / ps)
	d.as.mu.RLock()
	fm, isFile := d.as.fileMapLocked(start, uintptr(len(buf)))
	d.as.mu.RUnlock()
	if isFile {
		mr.file = &fm
	}
	var err error
	if mr.odp && isFile {
		err = mr.registerFileODP(end, npages)
	} else if mr.odp {
		err = mr.registerODP(end, npages)
	} else {
		err = mr.registerPinned(end, npages)
	}
	if err != nil {
		return nil, err
	}
	mr.reg.Total = time.Since(t0)
	return mr, nil
}

// LKey returns the local key.
func (mr *MR) LKey() uint32 { return mr.key }

// RKey returns the remote key (equal to the local key, as on mlx5).
func (mr *MR) RKey() uint32 { return mr.key }

// Addr returns the registered start address.
func (mr *MR) Addr() uint64 { return uint64(mr.start) }

// Len returns the registered length.
func (mr *MR) Len() uint64 { return mr.length }

// Access returns the access flags.
func (mr *MR) Access() Access { return mr.access }

// OnDemand reports whether the MR was registered with AccessOnDemand.
func (mr *MR) OnDemand() bool { return mr.odp }

// Registration returns the time registration's stages took.
func (mr *MR) Registration() RegTiming { return mr.reg }

// Entry returns the NIC translation of page p (counted from the page holding Addr).
func (mr *MR) Entry(p int) mmu.Entry { return mr.table.Entry(p) }

// Stats returns the MR's counters.
func (mr *MR) Stats() MRStats {
	ts := mr.table.Stats()
	c := &mr.stats
	return MRStats{PageFaults: c.faults.Load(), PagesFaulted: c.pagesFaulted.Load(), FaultRetries: c.faultRetries.Load(),
		FaultTime: time.Duration(c.faultNanos.Load()), Prefetches: c.prefetches.Load(), PagesPrefetched: c.pagesPrefetched.Load(),
		Invalidations: ts.Invalidations, PagesInvalidated: ts.PagesInvalidated, StaleDMAs: c.stale.Load(),
		ValidPages: mr.table.ValidPages(), TableBytes: mr.table.Footprint()}
}

// Dereg deregisters the MR. It waits for DMA in flight on the region; work requests
// that use its keys afterwards fail with protection or access errors.
func (mr *MR) Dereg() error {
	d := mr.dev
	d.mu.Lock()
	if cur := d.mrs[mr.key>>8]; cur != mr {
		d.mu.Unlock()
		return wrap(ErrInvalidArgument, "MR %#x is not registered", mr.key)
	}
	delete(d.mrs, mr.key>>8)
	d.keyed.storeLocked(mr.key>>8, nil)
	d.mu.Unlock()

	if mr.sub != nil {
		mr.sub.Remove() // after this no invalidation runs on the table
	}
	mr.table.Lock()
	mr.dead = true
	mr.table.Unlock()
	mr.invalidate(0, mr.table.Pages()) // waits for DMA in flight

	end := mr.base + uintptr(mr.table.Pages())*pagefault.PageSize
	s := d.as
	defer func() {
		d.mu.Lock()
		d.keys.release(mr.key)
		d.mu.Unlock()
	}()
	if mr.file != nil && mr.odp {
		mr.deregFile(end)
		return nil
	}
	if !mr.odp {
		mr.table.Lock()
		mr.freeDetached()
		mr.table.Unlock()
		s.mu.Lock()
		s.locked = removeRange(s.locked, mr.span(end))
		s.unlockUncoveredLocked(mr.span(end))
		s.syncEvictableLocked()
		s.mu.Unlock()
		d.mu.Lock()
		d.pinned -= int64(end - mr.base)
		d.mu.Unlock()
		return nil
	}
	s.regMu.Lock()
	defer s.regMu.Unlock()
	s.mu.Lock()
	if mr.implicit {
		for i, m := range s.implicitMRs {
			if m == mr {
				s.implicitMRs = append(s.implicitMRs[:i], s.implicitMRs[i+1:]...)
				break
			}
		}
	} else {
		s.odpRegs = removeRange(s.odpRegs, mr.span(end)) // not evictable from here on
	}
	s.syncEvictableLocked()
	var gone []interval.Range
	for _, b := range s.buffers {
		if h := b.Intersect(interval.Range{Start: mr.base, End: end}); !h.Empty() {
			gone = append(gone, s.uncoveredLocked(h)...)
		}
	}
	s.mu.Unlock()
	d.mu.RLock()
	closing := d.closed // Close unmaps the device's buffers next: their content is dropped
	d.mu.RUnlock()
	var restoreErr error
	for _, r := range gone {
		if s.pager != nil && !closing {
			// Unregistered, a stored page would read as zero. Restore fails only
			// for memory that is not paged, which has nothing stored.
			if err := s.pager.Restore(r.Start, r.End); err != nil && !errors.Is(err, paging.ErrNotPaged) {
				restoreErr = errors.Join(restoreErr, err)
			}
		}
		s.mu.Lock()
		s.downgradeLocked(r)
		s.mu.Unlock()
	}
	if restoreErr != nil {
		return fmt.Errorf("odp: dereg %#x: restoring evicted pages: %w", mr.key, restoreErr)
	}
	return nil
}

const (
	// AdvisePrefetch maps the range read-only, faulting missing pages in.
	AdvisePrefetch Advice = iota
	// AdvisePrefetchWrite maps the range writable; the MR must allow writes.
	AdvisePrefetchWrite
	// AdvisePrefetchNoFault maps only the pages already present.
	AdvisePrefetchNoFault
)
