package odp

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/odpemu/odpemu/internal/clock"
	"github.com/odpemu/odpemu/internal/interval"
	"github.com/odpemu/odpemu/invalidate"
	"github.com/odpemu/odpemu/mmu"
	"github.com/odpemu/odpemu/pagefault"
	"github.com/odpemu/odpemu/paging"
)

// nic is a device as its MRs, faults, DMAs and engines see it: its settings, the
// address space, the memory key table and the counters. Device embeds it; nothing
// below the verbs surface holds a Device.
type nic struct {
	cfg   Config
	as    *space
	limit int64 // pinned byte limit, <0 unlimited
	// background counts asynchronous prefetches in flight; Close waits for them.
	// Added to under mu, while not closed.
	background sync.WaitGroup

	// mu (Device.mu) protects the fields below and the Device's lists of PDs, CQs
	// and QPs; read-locked for key lookups.
	mu     sync.RWMutex
	closed bool
	mrs    map[uint32]*MR // by key index; every change is mirrored in keyed
	// keyed maps key indices to MRs like mrs, for the engines' lookups of every
	// work request and request without a lock (written under mu).
	keyed mkeyTable[MR]
	// mws are the memory windows by key index, mirrored in windows as mrs in keyed
	// (MR and window indices come from one allocator).
	mws     map[uint32]*MW
	windows mkeyTable[MW]
	keys    keyAllocator
	// mwMu protects the windows' bindings and the MRs' counts of windows bound. Taken after Device.mu (Dereg, Dealloc), or alone by the
	// engines, which bind and invalidate windows without Device.mu.
	mwMu   sync.Mutex
	pinned int64 // bytes accounted as pinned (pinned_vm)

	stats deviceCounters
	rc    rcCounters // RC events of all its QPs
	// faulting counts network page faults resolving on goroutines of their own;
	// Close waits for them.
	faulting sync.WaitGroup
}

// domain is a protection domain as the NIC checks it: MRs and QPs carry their PD's
// domain, and a key is honoured only for a QP of the same domain. PD embeds it.
type domain struct {
	dev  *nic
	dead atomic.Bool
	// qps, srqs and mws count the QPs, SRQs and memory windows created in it and
	// not destroyed. Protected by Device.mu.
	qps, srqs, mws int
}

// MR is a registered memory region. Its translation table is the NIC's view of the
// region's pages: filled at registration for pinned MRs, on demand for ODP MRs.
type MR struct {
	dev *nic
	// pd and access are the mkey context's PD and rights, which Rereg changes in
	// place while DMAs run: the checks load them per request.
	pd     atomic.Pointer[domain]
	access atomic.Uint32 // an Access
	mem    []byte        // the registered bytes
	start  uintptr       // address of mem[0]
	length uint64
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
	// foreign: an ODP MR over memory the application mapped itself, not Alloc's
	// (registerRangeLocked): registered for events only, faulted in with MADV_POPULATE.
	// foreignSpan is the range registered: the MR's pages, widened to whole huge
	// pages where it begins or ends in a hugetlbfs mapping (registerEventsLocked).
	foreign     bool
	foreignSpan interval.Range
	// dropping: an invalidation that a zap after a REMOVE asked for runs (dropLate).
	dropping atomic.Bool
	// reached: an implicit MR's ranges of the application's own memory, registered
	// for events only as its faults reached them (reach), merged, in address order.
	// Protected by space.mu.
	reached []interval.Range
	// detached: a pinned file MR's copy of the pages the file let go of. Set under
	// the table lock; read by DMAs without it (only ever set until Dereg).
	detached atomic.Pointer[detachedPages]

	stats mrCounters
	// windows counts the memory windows bound to the MR, which Dereg refuses.
	// Protected by nic.mwMu.
	windows int
	// children are an implicit MR's children that faults created (newChildren),
	// by index.
	children sync.Map
}

// odpCaps are the device's ODP capabilities: none in an address space without a
// userfaultfd (space.noODP), where nothing can be faulted on demand.
func (n *nic) odpCaps() ODPCaps {
	if n.as.noODP != nil {
		return ODPCaps{}
	}
	return ODPCaps{
		General: ODPSupport | ODPSupportImplicit,
		RC:      ODPSend | ODPRecv | ODPWrite | ODPRead | ODPAtomic | ODPSRQRecv,
		UC:      ODPSend | ODPRecv | ODPWrite | ODPSRQRecv,
		UD:      ODPSend | ODPRecv | ODPSRQRecv,
	}
}

// onDemand refuses AccessOnDemand on a device without ODP (odpCaps zero) with
// ErrNotSupported, as the kernel's ib_check_mr_access refuses IB_ACCESS_ON_DEMAND
// on a device without IBK_ON_DEMAND_PAGING (EOPNOTSUPP).
func (n *nic) onDemand(access Access) error {
	if access&AccessOnDemand != 0 && n.as.noODP != nil {
		return wrap(ErrNotSupported, "on-demand paging needs a userfaultfd, which this process may not create (%v)", n.as.noODP)
	}
	return nil
}

// regMR is RegMR.
func (pd *domain) regMR(buf []byte, access Access) (*MR, error) {
	t0 := time.Now()
	if pd == nil || pd.dead.Load() {
		return nil, wrap(ErrInvalidArgument, "RegMR on a deallocated PD")
	}
	d := pd.dev
	if len(buf) == 0 {
		return nil, wrap(ErrInvalidArgument, "zero-length MR")
	}
	if err := access.check(); err != nil {
		return nil, err
	}
	if err := d.onDemand(access); err != nil {
		return nil, err
	}
	ps := pagefault.PageSize
	start := addrOf(buf)
	base := start &^ (ps - 1)
	end := (start + uintptr(len(buf)) + ps - 1) &^ (ps - 1)
	mr := &MR{dev: d, mem: buf, start: start, length: uint64(len(buf)), odp: access&AccessOnDemand != 0, base: base}
	mr.pd.Store(pd)
	mr.access.Store(uint32(access))
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
	mr.reg.Firmware = firmware(d.cfg.RegModel.Reg)
	mr.reg.Total = time.Since(t0)
	return mr, nil
}

// firmware holds the caller for cost, the firmware's share of a registration or
// deregistration (Config.RegModel), and returns how long it held.
func firmware(cost time.Duration) time.Duration {
	if cost <= 0 {
		return 0
	}
	t := time.Now()
	clock.SleepUntil(t.Add(cost), nil) // time.Sleep would round it to a millisecond
	return time.Since(t)
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
func (mr *MR) Access() Access { return Access(mr.access.Load()) }

// OnDemand reports whether the MR was registered with AccessOnDemand.
func (mr *MR) OnDemand() bool { return mr.odp }

// Registration returns the time registration's stages took.
func (mr *MR) Registration() RegTiming { return mr.reg }

// Entry returns the NIC translation of page p (counted from the page holding Addr).
func (mr *MR) Entry(p int) mmu.Entry { return mr.table.Entry(p) }

// rereg is Rereg, with the PD's domain (nil: unchanged).
func (mr *MR) rereg(pd *domain, access Access) error {
	d := mr.dev
	old := mr.Access()
	if err := access.check(); err != nil {
		return err
	}
	switch {
	case (access^old)&AccessOnDemand != 0:
		return wrap(ErrInvalidArgument, "rereg from %v to %v: AccessOnDemand changes the registration", old, access)
	case pd != nil && pd.dev != d:
		return wrap(ErrInvalidArgument, "rereg into a PD of another device")
	}
	if !mr.odp && !mr.implicit && access.writable() && !old.writable() {
		end := mr.base + uintptr(mr.table.Pages())*pagefault.PageSize
		if err := pagefault.PopulateRange(mr.base, end-mr.base, true); err != nil {
			return wrap(ErrBadAddress, "[%#x, +%d) cannot be pinned for %v (%v)", mr.start, mr.length, access, err)
		}
		// Written pages may be new ones (a private copy of the zero page, of a
		// file's page): the table takes them, as a new pinning would.
		mr.table.Lock()
		err := mr.buildMTTLocked()
		mr.table.Unlock()
		if err != nil {
			return err
		}
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	switch {
	case d.mrs[mr.key>>8] != mr:
		return wrap(ErrInvalidArgument, "MR %#x is not registered", mr.key)
	case pd != nil && pd.dead.Load(): // Dealloc sets it under Device.mu
		return wrap(ErrInvalidArgument, "rereg into a deallocated PD")
	}
	if pd != nil {
		mr.pd.Store(pd)
	}
	mr.access.Store(uint32(access))
	return nil
}

// Stats returns the MR's counters.
func (mr *MR) Stats() MRStats {
	ts := mr.table.Stats()
	c := &mr.stats
	return MRStats{PageFaults: c.faults.Load(), PagesFaulted: c.pagesFaulted.Load(), FaultRetries: c.faultRetries.Load(),
		FaultTime: time.Duration(c.faultNanos.Load()), Prefetches: c.prefetches.Load(), PagesPrefetched: c.pagesPrefetched.Load(),
		Invalidations: ts.Invalidations, PagesInvalidated: ts.PagesInvalidated, StaleDMAs: c.stale.Load(),
		ValidPages: mr.table.ValidPages(), TableBytes: mr.table.Footprint(), Children: c.children.Load()}
}

// Dereg deregisters the MR. It waits for DMA in flight on the region; work requests
// that use its keys afterwards fail with protection or access errors. With a
// RegModel it takes the firmware's Dereg longer, once for the MR and once for each
// child an implicit MR's faults created.
func (mr *MR) Dereg() error {
	if err := mr.dereg(); err != nil {
		return err
	}
	firmware(time.Duration(1+mr.stats.children.Load()) * mr.dev.cfg.RegModel.Dereg)
	return nil
}

func (mr *MR) dereg() error {
	d := mr.dev
	d.mu.Lock()
	if cur := d.mrs[mr.key>>8]; cur != mr {
		d.mu.Unlock()
		return wrap(ErrInvalidArgument, "MR %#x is not registered", mr.key)
	}
	d.mwMu.Lock() // a bind either counted itself or finds the MR gone
	if mr.windows > 0 {
		d.mwMu.Unlock()
		d.mu.Unlock()
		return wrap(ErrBusy, "MR %#x has %d memory windows bound", mr.key, mr.windows)
	}
	delete(d.mrs, mr.key>>8)
	d.keyed.storeLocked(mr.key>>8, nil)
	d.mwMu.Unlock()
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
	if mr.foreign {
		s.releaseForeignLocked(mr.foreignSpan)
		s.mu.Unlock()
		return nil
	}
	if mr.implicit {
		for i, m := range s.implicitMRs {
			if m == mr {
				s.implicitMRs = append(s.implicitMRs[:i], s.implicitMRs[i+1:]...)
				break
			}
		}
		mr.unreachLocked()
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

// lookupMR finds a live MR by key.
func (d *nic) lookupMR(key uint32) *MR {
	if mr := d.keyed.load(key >> 8); mr != nil && mr.key == key {
		return mr
	}
	return nil
}

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

// offset returns addr's offset in the MR if [addr, addr+n) lies inside it.
func (mr *MR) offset(addr, n uint64) (uint64, bool) {
	start := uint64(mr.start)
	if addr < start || addr-start > mr.length || n > mr.length-(addr-start) {
		return 0, false
	}
	return addr - start, true
}
