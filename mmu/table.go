// Package mmu holds the emulated NIC's translation table for one memory region and the
// protocol that keeps it coherent with the CPU's page table: the mmu-interval-notifier
// sequence (ReadBegin / ReadRetryLocked), invalidation that clears entries and waits
// for DMA that started before it, and in-flight DMA accounting.
//
// It is pure state: no syscalls. Callers fault pages in elsewhere and report frames.
//
// The table is sparse, as the kernel's page tables and mlx5's implicit-MR children
// are: entries live in leaves of LeafPages pages, each page's valid and writable bits
// packed with its frame in one word (as hmm_pfns packs them); a leaf is allocated when
// a page of it is first mapped and freed when its last valid entry is invalidated.
// A table of any span costs nothing until pages are mapped, then about
// Footprint()/mapped pages (8 bytes per page of a full leaf plus a small constant
// per leaf), so one table can span a whole address space (an implicit MR).
//
// The protocol, as in mlx5's pagefault_real_mr:
//
//	seq := t.ReadBegin()         // waits out invalidations in progress
//	pfns := faultIn(range)       // hmm_range_fault analogue, without the lock
//	t.Lock()
//	if t.ReadRetryLocked(seq) {  // an invalidation ran meanwhile
//		t.Unlock(); retry
//	}
//	t.MapLocked(first, pfns, write)
//	t.Unlock()
//
// and before every DMA:
//
//	d, miss := t.BeginDMA(first, n, write) // miss >= 0: a network page fault
//	... copy ...
//	overtaken := t.EndDMA(d)                // true: an invalidation did not wait
//
// # Locking
//
// Table.mu (Lock/Unlock, the umem_mutex analogue) protects all of a table's state;
// methods named ...Locked need it held. Nothing else is locked while it is held, and
// no method blocks while holding it except on its condition variable, which releases
// it. Callers take it after their own locks (in package odp, after the registry and
// the pager, before the device's).
package mmu

import (
	"fmt"
	"sync"
	"sync/atomic"
)

// Entry is one page's translation, unpacked.
type Entry struct {
	Valid    bool
	Writable bool
	PFN      uint64 // frame recorded at map time; 0 when frames are not readable
	// Gen counts the entry's changes (mapped to a new frame, or invalidated) modulo
	// 2^14. A leaf whose pages are all invalid is freed, and its entries' counts
	// start again from zero when it is created anew.
	Gen uint32
}

// DMA is a handle on an in-flight DMA, from BeginDMA to EndDMA.
type DMA struct {
	epoch uint64
	seq   uint64
}

// Seq is the notifier sequence the DMA began under: if Sequence still returns it, no
// invalidation began on the table since.
func (d DMA) Seq() uint64 { return d.seq }

// Stats counts table events.
type Stats struct {
	Maps             uint64 // MapLocked calls
	PagesMapped      uint64 // entries made valid
	Invalidations    uint64 // Invalidate calls
	PagesInvalidated uint64 // valid entries cleared
	DMAs             uint64 // BeginDMA successes
	Misses           uint64 // BeginDMA calls that found an invalid entry
	DMAWaits         uint64 // invalidations that had to wait for in-flight DMA
	Overtaken        uint64 // DMAs an overlapping invalidation completed under (never, if it waits)
	RetriesSignalled uint64 // ReadRetryLocked calls that returned true
	ReadBeginBlocked uint64 // ReadBegin calls that waited for an invalidation
}

// Table is one MR's NIC page table. All methods are safe for concurrent use; methods
// named ...Locked need the table lock (Lock/Unlock), the umem_mutex analogue.
type Table struct {
	mu   sync.Mutex
	cond sync.Cond // on mu: signalled when a DMA ends or an invalidation finishes

	// Protected by mu, but for what BeginDMA reads without it (the entries, read
	// atomically, and seq).
	npages       int
	entries      entries       // sparse: nothing for pages never mapped
	seq          atomic.Uint64 // notifier sequence: bumped (under mu) when an invalidation starts
	invalidating int           // invalidations in progress
	stats        Stats

	// In-flight DMA accounting, without a lock: a DMA counts itself in
	// active[epoch&1] for the epoch it began in. An invalidation moves the epoch on
	// and waits until the previous epoch's count drops to zero, so it waits for
	// every DMA that began before it and for none that began after. drainMu lets one
	// invalidation wait at a time, so that an epoch's counter is empty again before
	// the epoch after next reuses it. drained is the first epoch whose DMAs may
	// still run: a DMA of an earlier epoch ending now was overtaken.
	epoch    atomic.Uint64
	active   [2]atomic.Int64
	waiters  atomic.Int32 // invalidations waiting on cond for active to drain
	drained  atomic.Uint64
	drainMu  sync.Mutex
	dmas     atomic.Uint64 // BeginDMA successes (Stats.DMAs)
	misses   atomic.Uint64 // BeginDMA misses (Stats.Misses)
	overtake atomic.Uint64 // Stats.Overtaken

	waitHook     func() // tests: called, lock held, before an invalidation waits for DMA
	readWaitHook func() // tests: called, lock held, before ReadBegin waits
}

// New returns a table of npages invalid entries. It allocates nothing per page: the
// table grows with the pages mapped, so that a table spanning a whole address space
// (an implicit MR's) costs what its mapped pages cost.
func New(npages int) *Table {
	if npages < 0 {
		panic(fmt.Sprintf("mmu: table of %d pages", npages))
	}
	t := &Table{npages: npages, entries: newEntries(npages)}
	t.cond.L = &t.mu
	return t
}

// Pages returns the number of entries.
func (t *Table) Pages() int { return t.npages }

// Lock takes the table lock.
func (t *Table) Lock() { t.mu.Lock() }

// Unlock releases the table lock.
func (t *Table) Unlock() { t.mu.Unlock() }

func (t *Table) check(first, n int) {
	if first < 0 || n < 0 || first+n > t.npages || first+n < first {
		panic(fmt.Sprintf("mmu: page range [%d, %d) outside table of %d", first, first+n, t.npages))
	}
}

// ReadBegin returns the notifier sequence to pass to ReadRetryLocked, waiting first
// for invalidations in progress to finish (mmu_interval_read_begin).
func (t *Table) ReadBegin() uint64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.invalidating > 0 {
		t.stats.ReadBeginBlocked++
		if t.readWaitHook != nil {
			t.readWaitHook()
		}
	}
	for t.invalidating > 0 {
		t.cond.Wait()
	}
	return t.seq.Load()
}

// ReadRetryLocked reports whether an invalidation started since ReadBegin returned seq,
// in which case the caller's translation may be stale and must not be mapped.
func (t *Table) ReadRetryLocked(seq uint64) bool {
	if t.seq.Load() != seq || t.invalidating > 0 {
		t.stats.RetriesSignalled++
		return true
	}
	return false
}

// MapLocked makes the len(pfns) entries from first valid with the given frames.
// Writable entries allow DMA that writes memory; a read-only map keeps an entry's write
// permission only if it already had it for the same frame.
func (t *Table) MapLocked(first int, pfns []uint64, writable bool) {
	t.check(first, len(pfns))
	t.stats.Maps++
	for i, f := range pfns {
		if t.entries.mapPage(first+i, f, writable) {
			t.stats.PagesMapped++
		}
	}
}

// MissingLocked returns the first page in [first, first+n) that is invalid, or not
// writable when write is set, or -1 when every entry allows the access.
func (t *Table) MissingLocked(first, n int, write bool) int {
	t.check(first, n)
	return t.entries.missing(first, n, write)
}

// BeginDMA starts a DMA over pages [first, first+n) if every entry allows it, and
// returns its handle and -1. Otherwise it returns the first page that needs a fault (a
// network page fault) and no DMA is started. It allocates nothing and takes no lock.
func (t *Table) BeginDMA(first, n int, write bool) (DMA, int) {
	t.check(first, n)
	d := t.Enter()
	if miss := t.entries.missing(first, n, write); miss >= 0 {
		t.end(d.epoch)
		t.misses.Add(1)
		return DMA{}, miss
	}
	t.dmas.Add(1)
	return d, -1
}

// Enter starts a DMA that has checked no entry yet: the caller checks the pages it
// touches with Missing before each access, and ends it with EndDMA. One DMA begun so
// can cover several accesses (a NIC's DMA engine reading several packets of one
// MR): an invalidation waits for it as for any, and an access checked after the
// invalidation began finds its entries cleared.
func (t *Table) Enter() DMA {
	// Count first, then check the entries: an invalidation clears entries before it
	// moves the epoch on, so a DMA counted in the old epoch is waited for, and one
	// counted in the new epoch finds the entries cleared. The sequence is read
	// before the entries: an invalidation that began after it is one the DMA
	// either waited out (a miss) or that waits for the DMA.
	e := t.epoch.Load()
	for {
		t.active[e&1].Add(1)
		if now := t.epoch.Load(); now != e {
			t.end(e)
			e = now
			continue
		}
		break
	}
	return DMA{epoch: e, seq: t.seq.Load()}
}

// Missing returns the first page in [first, first+n) that is invalid, or not
// writable when write is set, or -1, without the lock: for a DMA begun with Enter.
func (t *Table) Missing(first, n int, write bool) int {
	t.check(first, n)
	if miss := t.entries.missing(first, n, write); miss >= 0 {
		t.misses.Add(1)
		return miss
	}
	return -1
}

// Probe is Missing without counting a miss and without a DMA: a hint of what a DMA
// would find (entries may change right after it), for a caller that faults pages in
// ahead of a DMA that checks them again.
func (t *Table) Probe(first, n int, write bool) int {
	t.check(first, n)
	return t.entries.missing(first, n, write)
}

// end uncounts a DMA of epoch e, waking an invalidation waiting for the count. A
// count below zero means a DMA was ended twice (or never begun).
func (t *Table) end(e uint64) {
	c := t.active[e&1].Add(-1)
	if c < 0 {
		panic("mmu: EndDMA of a DMA not in flight")
	}
	if c == 0 && t.waiters.Load() > 0 {
		t.mu.Lock()
		t.cond.Broadcast()
		t.mu.Unlock()
	}
}

// EndDMA ends a DMA begun by BeginDMA, releasing invalidations waiting for it. It
// reports whether an invalidation completed while the DMA was in flight: the
// translations it used were withdrawn under it, which the protocol forbids (an
// invalidation waits for such DMA), so true means the protocol is broken. It takes
// no lock unless an invalidation waits.
func (t *Table) EndDMA(d DMA) (overtaken bool) {
	overtaken = t.drained.Load() > d.epoch
	if overtaken {
		t.overtake.Add(1)
	}
	t.end(d.epoch)
	return overtaken
}

// InvalidateResult reports what one invalidation did.
type InvalidateResult struct {
	Pages      int // valid entries cleared
	WaitedDMAs int // in-flight DMAs it waited for
}

// Invalidate is InvalidateBegin followed by InvalidateEnd.
func (t *Table) Invalidate(first, n int) InvalidateResult {
	r := t.InvalidateBegin(first, n)
	t.InvalidateEnd()
	return r
}

// InvalidateEnd ends an invalidation begun by InvalidateBegin: faults waiting in
// ReadBegin go on.
func (t *Table) InvalidateEnd() {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.invalidating == 0 {
		panic("mmu: InvalidateEnd without InvalidateBegin")
	}
	t.invalidating--
	t.cond.Broadcast()
}

// Sequence returns the notifier sequence without waiting: it changes whenever an
// invalidation begins, so a DMA that sees it unchanged was not overlapped by one.
func (t *Table) Sequence() uint64 { return t.seq.Load() }

// InvalidateBegin is invalidate_range_start for pages [first, first+n): it bumps the
// sequence (so a fault in progress fails ReadRetryLocked), clears the entries, then
// waits for every DMA on the table that began before it (overlapping or not: a DMA is
// one copy, and counting DMAs per range would cost every DMA a lock). When it returns
// no DMA can touch those pages through their old translations, and until
// InvalidateEnd no fault can map new ones (ReadBegin waits): the caller changes the
// mapping in between.
func (t *Table) InvalidateBegin(first, n int) InvalidateResult {
	t.drainMu.Lock()
	defer t.drainMu.Unlock()
	t.mu.Lock()
	defer t.mu.Unlock()
	t.check(first, n)
	t.invalidating++
	t.seq.Add(1)
	t.stats.Invalidations++
	r := InvalidateResult{Pages: t.entries.invalidate(first, n)}
	t.stats.PagesInvalidated += uint64(r.Pages)
	// DMAs that count themselves from here on see the new epoch, and the cleared
	// entries or the new sequence (BeginDMA checks both after counting).
	old := t.epoch.Add(1) - 1
	if c := t.active[old&1].Load(); c > 0 {
		r.WaitedDMAs = int(c)
		t.stats.DMAWaits++
		if t.waitHook != nil {
			t.waitHook()
		}
		t.waiters.Add(1)
		for t.active[old&1].Load() > 0 {
			t.cond.Wait()
		}
		t.waiters.Add(-1)
	}
	t.drained.Store(old + 1)
	return r
}

// Entry returns page p's entry.
func (t *Table) Entry(p int) Entry {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.EntryLocked(p)
}

// EntryLocked returns page p's entry.
func (t *Table) EntryLocked(p int) Entry {
	t.check(p, 1)
	return unpack(t.entries.word(p))
}

// ValidPages counts valid entries.
func (t *Table) ValidPages() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.entries.valid
}

// Leaves returns the number of leaves allocated: groups of LeafPages consecutive
// entries of which at least one is valid.
func (t *Table) Leaves() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.entries.leaves
}

// LeafPages is the number of consecutive pages a leaf of the table holds.
const LeafPages = leafPages

// Footprint estimates the bytes the table's entries occupy beyond its root
// directory: its leaves and the directories above them. It grows with the pages
// mapped, whatever the table spans.
func (t *Table) Footprint() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.entries.leaves*leafBytes + t.entries.dirBytes
}

// InFlight returns the number of DMAs in flight.
func (t *Table) InFlight() int {
	return int(t.active[0].Load() + t.active[1].Load())
}

// Stats returns the counters.
func (t *Table) Stats() Stats {
	t.mu.Lock()
	defer t.mu.Unlock()
	st := t.stats
	st.DMAs, st.Misses, st.Overtaken = t.dmas.Load(), t.misses.Load(), t.overtake.Load()
	return st
}
