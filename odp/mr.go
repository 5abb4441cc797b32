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
	"golang.org/x/sys/unix"
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
	base   uintptr    // start rounded down to a page
	table  *mmu.Table // one entry per page from base
	reg    RegTiming

	// dead is set under the table lock when deregistration starts; a fault that
	// finds it set maps nothing.
	dead bool
	sub  *invalidate.Subscription // ODP: the interval notifier
	// gone lists table page ranges [lo, hi) the application unmapped: they stay
	// invalid and a DMA on them is an access error, whatever is mapped there later.
	// Protected by the table lock.
	gone [][2]int

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
	var err error
	if mr.odp {
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

func (mr *MR) span(end uintptr) interval.Range { return interval.Range{Start: mr.base, End: end} }

func (mr *MR) registerODP(end uintptr, npages int) error {
	d := mr.dev
	t0 := time.Now()
	d.regMu.Lock()
	defer d.regMu.Unlock()
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return ErrClosed
	}
	if _, ok := d.bufferLocked(mr.start, uintptr(mr.length)); !ok {
		d.mu.Unlock()
		return wrap(ErrNotMmapped, "%#x+%d", mr.start, mr.length)
	}
	if _, err := d.uffd.Register(mr.base, end-mr.base, pagefault.ModeMissing|pagefault.ModeWP); err != nil {
		d.mu.Unlock()
		return fmt.Errorf("odp: register ODP range: %w", err)
	}
	d.odpRegs = append(d.odpRegs, mr.span(end))
	key, ok := d.keys.alloc()
	if !ok {
		d.mu.Unlock()
		mr.unregister(end)
		return wrap(ErrNoMemory, "out of memory keys")
	}
	mr.key = key
	mr.table = mmu.New(npages)
	d.mrs[key>>8] = mr
	d.mu.Unlock()
	mr.sub = d.registry.Insert(mr.base, end, notifier{mr})
	mr.reg.Register = time.Since(t0)
	d.stats.mrsODP.Add(1)

	if !d.cfg.NoSnapshot {
		t1 := time.Now()
		mr.snapshot()
		mr.reg.Snapshot = time.Since(t1)
	}
	return nil
}

// snapshot maps the pages already present, without faulting, as mlx5 does when an ODP
// MR is created. Pages that are not exclusively mapped (the shared zero page, pages
// shared with a fork child) are mapped read-only: a NIC write must fault them first.
func (mr *MR) snapshot() {
	const chunk = 4096
	entries := make([]pagefault.PagemapEntry, min(chunk, mr.table.Pages()))
	for first := 0; first < mr.table.Pages(); first += chunk {
		n := min(chunk, mr.table.Pages()-first)
		if err := mr.dev.pagemap.Read(mr.base+uintptr(first)*pagefault.PageSize, entries[:n]); err != nil {
			return // a snapshot is an optimisation: pages fault later instead
		}
		seq := mr.table.ReadBegin()
		mr.table.Lock()
		if !mr.dead && !mr.table.ReadRetryLocked(seq) {
			mr.mapPresentLocked(first, entries[:n], mr.access.writable())
		}
		mr.table.Unlock()
	}
}

// mapPresentLocked maps the present pages among entries (page first onward) and
// returns how many it mapped. write asks for writable entries, granted only to pages
// mapped exclusively. Called with the MR's table lock (mmu.Table.Lock) held.
func (mr *MR) mapPresentLocked(first int, entries []pagefault.PagemapEntry, write bool) int {
	mapped := 0
	var pfns [64]uint64
	for i := 0; i < len(entries); {
		if !entries[i].Present() {
			i++
			continue
		}
		excl := entries[i].Exclusive()
		j := i
		for j < len(entries) && j-i < len(pfns) && entries[j].Present() && entries[j].Exclusive() == excl {
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
	populate := uintptr(unix.MADV_POPULATE_READ)
	if mr.access.writable() {
		populate = unix.MADV_POPULATE_WRITE
	}
	unaccount := func() {
		d.mu.Lock()
		d.pinned -= bytes
		d.mu.Unlock()
	}
	if _, _, e := unix.Syscall(unix.SYS_MADVISE, mr.base, end-mr.base, populate); e != 0 {
		unaccount()
		switch e {
		case unix.ENOMEM:
			return wrap(ErrBadAddress, "[%#x, +%d) is not mapped (%v)", mr.start, mr.length, e)
		case unix.EFAULT, unix.EINVAL, unix.EPERM:
			return wrap(ErrBadAddress, "[%#x, +%d) cannot be pinned for %v: its mapping's protection forbids it (%v)",
				mr.start, mr.length, mr.access, e)
		}
		return fmt.Errorf("odp: fault in %d bytes to pin: %w", bytes, e)
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
	const chunk = 4096
	entries := make([]pagefault.PagemapEntry, min(chunk, npages))
	mr.table.Lock()
	for first := 0; first < npages; first += chunk {
		n := min(chunk, npages-first)
		err := d.pagemap.Read(mr.base+uintptr(first)*pagefault.PageSize, entries[:n])
		if err == nil && mr.mapPresentLocked(first, entries[:n], true) != n {
			// Only an munmap racing the registration does this: the caller freed
			// the memory it is registering.
			err = wrap(ErrBadAddress, "pages of [%#x, +%d) unmapped during registration", mr.start, mr.length)
		}
		if err != nil {
			mr.table.Unlock()
			mr.unpin(end, bytes)
			return fmt.Errorf("odp: build MTT: %w", err)
		}
	}
	mr.table.Unlock()
	mr.reg.MTT = time.Since(t2)

	d.mu.Lock()
	key, ok := d.keys.alloc()
	if ok {
		mr.key = key
		d.mrs[key>>8] = mr
		d.locked = append(d.locked, mr.span(end))
	}
	d.mu.Unlock()
	if !ok {
		mr.unpin(end, bytes)
		return wrap(ErrNoMemory, "out of memory keys")
	}
	d.stats.mrsPinned.Add(1)
	return nil
}

// unpin undoes a pinned registration that never got a key.
func (mr *MR) unpin(end uintptr, bytes int64) {
	d := mr.dev
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, r := range interval.Uncovered(mr.span(end), d.locked) {
		// munlock fails only for a range the application unmapped meanwhile.
		_, _, _ = unix.Syscall(unix.SYS_MUNLOCK, r.Start, r.End-r.Start, 0)
	}
	d.pinned -= bytes
}

// unregister undoes an ODP registration that never got a key.
func (mr *MR) unregister(end uintptr) {
	d := mr.dev
	d.mu.Lock()
	defer d.mu.Unlock()
	d.odpRegs = removeRange(d.odpRegs, mr.span(end))
	for _, r := range interval.Uncovered(mr.span(end), d.odpRegs) {
		d.downgradeLocked(r)
	}
}

// downgradeLocked ends on-demand faulting of r, which no ODP MR covers any more: the
// range stays registered for events only (write-protect mode, with nothing
// write-protected), so that its buffer still learns what the application unmaps.
// Called with Device.mu held. It cannot fail for a range of a live buffer; a part the
// application unmapped meanwhile is simply not there to change.
func (d *Device) downgradeLocked(r interval.Range) {
	_, _ = d.uffd.Register(r.Start, r.End-r.Start, pagefault.ModeWP)
}

func removeRange(rs []interval.Range, r interval.Range) []interval.Range {
	for i, x := range rs {
		if x == r {
			return append(rs[:i], rs[i+1:]...)
		}
	}
	return rs
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
		ValidPages: mr.table.ValidPages()}
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
	d.mu.Unlock()

	if mr.sub != nil {
		mr.sub.Remove() // after this no invalidation runs on the table
	}
	mr.table.Lock()
	mr.dead = true
	mr.table.Unlock()
	mr.invalidate(0, mr.table.Pages()) // waits for DMA in flight

	end := mr.base + uintptr(mr.table.Pages())*pagefault.PageSize
	if mr.odp {
		d.regMu.Lock()
		defer d.regMu.Unlock()
		d.mu.Lock()
		d.odpRegs = removeRange(d.odpRegs, mr.span(end)) // not evictable from here on
		gone := interval.Uncovered(mr.span(end), d.odpRegs)
		closing := d.closed // Close unmaps the buffers next: their content is dropped
		d.mu.Unlock()
		var restoreErr error
		for _, r := range gone {
			if d.pager != nil && !closing {
				// Unregistered, a stored page would read as zero. Restore fails only
				// for memory that is not paged, which has nothing stored.
				if err := d.pager.Restore(r.Start, r.End); err != nil && !errors.Is(err, invalidate.ErrNotPaged) {
					restoreErr = errors.Join(restoreErr, err)
				}
			}
			d.mu.Lock()
			d.downgradeLocked(r)
			d.mu.Unlock()
		}
		d.mu.Lock()
		d.keys.release(mr.key)
		d.mu.Unlock()
		if restoreErr != nil {
			return fmt.Errorf("odp: dereg %#x: restoring evicted pages: %w", mr.key, restoreErr)
		}
		return nil
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	d.locked = removeRange(d.locked, mr.span(end))
	for _, r := range interval.Uncovered(mr.span(end), d.locked) {
		// munlock fails only for a range the application unmapped meanwhile.
		_, _, _ = unix.Syscall(unix.SYS_MUNLOCK, r.Start, r.End-r.Start, 0)
	}
	d.pinned -= int64(end - mr.base)
	d.keys.release(mr.key)
	return nil
}

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

// notifier is an ODP MR's interval notifier.
type notifier struct{ mr *MR }

func (n notifier) pages(r invalidate.Range) (int, int) {
	ps := pagefault.PageSize
	first := int((r.Start - n.mr.base) / ps)
	last := int((r.End - n.mr.base + ps - 1) / ps)
	return first, min(last, n.mr.table.Pages()) - first
}

// InvalidateStart implements invalidate.Subscriber.
func (n notifier) InvalidateStart(r invalidate.Range, why invalidate.Reason) {
	first, count := n.pages(r)
	n.mr.invalidateBegin(first, count)
	if why == invalidate.ReasonUnmap {
		n.mr.table.Lock()
		n.mr.gone = append(n.mr.gone, [2]int{first, first + count})
		n.mr.table.Unlock()
	}
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
func (n notifier) InvalidateEnd(invalidate.Range, invalidate.Reason) { n.mr.table.InvalidateEnd() }

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
	mr.table.Lock()
	lo, hi, ok := mr.clipGoneLocked(lo, hi, miss, end)
	mr.table.Unlock()
	if !ok {
		return 0, wrap(ErrInvalidArgument, "MR %#x: pages [%d, %d) were unmapped", mr.key, miss, end)
	}
	mapped, err := mr.faultWindow(lo, hi, write, presentOnly)
	if errors.Is(err, pagefault.ErrUnmapped) && (lo < miss || hi > end) {
		// Fault-around reached memory unmapped before its event was applied: retry
		// with exactly the pages asked for.
		mapped, err = mr.faultWindow(miss, end, write, presentOnly)
	}
	return mapped, err
}

// faultWindow resolves and maps table pages [lo, hi).
func (mr *MR) faultWindow(lo, hi int, write, presentOnly bool) (int, error) {
	d := mr.dev
	entries := make([]pagefault.PagemapEntry, hi-lo)
	addr := mr.base + uintptr(lo)*pagefault.PageSize

	if d.pager != nil && !presentOnly && d.pager.Over(hi-lo) {
		d.pager.Reclaim(true) // direct reclaim, before the fault takes its sequence
	}
	seq := mr.table.ReadBegin()
	var err error
	switch {
	case presentOnly:
		err = d.pagemap.Read(addr, entries)
	case d.pager != nil:
		// Paged memory has one installer, the CPU fault server's thread: an
		// eviction cannot overtake the content it chose. Then only translate.
		if err = d.server.Install(addr, hi-lo); err == nil {
			err = d.resolver.Translate(addr, entries, write)
		}
	default:
		_, err = d.resolver.Resolve(addr, entries, write)
	}
	if err != nil {
		return 0, fmt.Errorf("odp: MR %#x: fault in %#x+%d pages: %w", mr.key, addr, hi-lo, err)
	}
	mr.table.Lock()
	defer mr.table.Unlock()
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

// Advice is ibv_advise_mr's advice.
type Advice int

const (
	// AdvisePrefetch maps the range read-only, faulting missing pages in.
	AdvisePrefetch Advice = iota
	// AdvisePrefetchWrite maps the range writable; the MR must allow writes.
	AdvisePrefetchWrite
	// AdvisePrefetchNoFault maps only the pages already present.
	AdvisePrefetchNoFault
)

// Advise maps [addr, addr+length) into the NIC's table ahead of use, synchronously
// (ibv_advise_mr with IB_UVERBS_ADVISE_MR_FLAG_FLUSH). It is for ODP MRs only.
func (mr *MR) Advise(advice Advice, addr, length uint64) error {
	if !mr.odp {
		return wrap(ErrNotSupported, "advise on pinned MR %#x", mr.key)
	}
	if advice < AdvisePrefetch || advice > AdvisePrefetchNoFault {
		return wrap(ErrInvalidArgument, "advice %d", advice)
	}
	off, ok := mr.offset(addr, length)
	if !ok || length == 0 {
		return wrap(ErrInvalidArgument, "[%#x, +%d) outside MR %#x", addr, length, mr.key)
	}
	write := advice == AdvisePrefetchWrite
	if write && !mr.access.writable() {
		return wrap(ErrPermission, "PREFETCH_WRITE on MR %#x without write access", mr.key)
	}
	first, count := mr.pageSpan(off, length)
	pages := 0
	for round := 0; ; round++ {
		mr.table.Lock()
		miss := mr.table.MissingLocked(first, count, write)
		mr.table.Unlock()
		if miss < 0 || (advice == AdvisePrefetchNoFault && round > 0) {
			break
		}
		if round == maxFaultRounds {
			return wrap(ErrBusy, "MR %#x: range kept being invalidated", mr.key)
		}
		mapped, err := mr.fault(miss, first+count, write, advice == AdvisePrefetchNoFault)
		if err != nil {
			return err
		}
		pages += mapped
	}
	mr.stats.prefetches.Add(1)
	mr.stats.pagesPrefetched.Add(uint64(pages))
	mr.dev.stats.prefetches.Add(1)
	mr.dev.stats.pagesPrefetched.Add(uint64(pages))
	return nil
}
