package paging

import (
	"errors"
	"fmt"
	"runtime"
	"sort"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/odpemu/odpemu/invalidate"
	"github.com/odpemu/odpemu/pagefault"
	"golang.org/x/sys/unix"
)

// Pager evicts pages of paged regions to a Store and migrates them to new frames, the
// way reclaim, compaction and NUMA balancing change a page's translation under an ODP
// MR. Every change runs inside invalidate.Registry.Invalidate, so the NIC's entries
// are cleared and its DMA drained first, and no fault maps the page while it moves.
//
// A page leaves the application's mapping atomically (UFFDIO_MOVE into the page's own
// bounce page), so a concurrent write either lands before the move, and is saved, or
// faults after it; the CPU fault server then takes the page back from the bounce page
// or restores it from the store, without waiting for Go. See ODP_PAGE_* in
// pagefault/cpuserver.h for the page states.
//
// Under a budget the pager is one of two reclaimers. It reclaims in the background
// (kswapd's role) and directly from the NIC's fault path; the CPU fault server
// reclaims directly before it installs past the budget (pagefault.CPUServer.SetBudget),
// since the application's threads it serves may hold every P. They share the resident
// estimate (kept by the server), the reference bits and the store, whose writes and
// punches both order under the server's store lock.
type Pager struct {
	uffd     *pagefault.FD
	srv      *pagefault.CPUServer
	reg      *invalidate.Registry
	pm       *pagefault.Pagemap
	store    *Store
	eligible func(start, end uintptr) bool
	budget   int64 // pages; 0 means none

	rmu     sync.RWMutex // protects regions and nextOff
	regions []*Region    // sorted by base
	nextOff int64

	reclaimMu   sync.Mutex // one reclaimer at a time (of the pager's); protects hand and scratch
	scratch     []byte     // one page: an evicted page's content on its way to the store
	hand        struct{ region, page int }
	allEligible bool // no Eligible function: every page may be evicted

	evictions, writtenBack, migrations, aborts, restores atomic.Uint64
	directReclaims, directMaxChunks                      atomic.Uint64

	stop      chan struct{}
	done      chan struct{}
	closeOnce sync.Once

	hooks pagerHooks // set by tests before the pager runs
}

// pagerHooks run on the evictor's goroutine at the points where an application's
// change can overtake it; nil outside tests.
type pagerHooks struct {
	movedOut    func(r *Region, i int) // evictLocked: page i is in its bounce page, not yet stored
	beforePlace func(r *Region, i int) // inside a held section: the state checked, the ioctl not made
	placed      func(r *Region, i int) // after a held section that put content back, before any later check
}

func (p *Pager) hook(h func(*Region, int), r *Region, i int) {
	if h != nil {
		h(r, i)
	}
}

// PagerConfig configures a Pager.
type PagerConfig struct {
	// Budget is the resident size, in bytes, the pager keeps paged regions within
	// (0: no budget; eviction and migration only on request).
	Budget int64
	// Eligible says whether pages in [start, end) may be evicted or migrated: they
	// must be registered with the userfaultfd, or a later access would not fault.
	Eligible func(start, end uintptr) bool
}

// ErrNotPaged is returned for addresses outside every paged region.
var ErrNotPaged = errors.New("paging: address not in a paged region")

// NewPager returns a pager over uffd's server with store as its backing store.
func NewPager(uffd *pagefault.FD, srv *pagefault.CPUServer, reg *invalidate.Registry, pm *pagefault.Pagemap, store *Store, cfg PagerConfig) *Pager {
	p := &Pager{uffd: uffd, srv: srv, reg: reg, pm: pm, store: store, eligible: cfg.Eligible,
		budget: cfg.Budget / int64(pagefault.PageSize), scratch: make([]byte, pagefault.PageSize)}
	if p.eligible == nil {
		p.eligible = func(uintptr, uintptr) bool { return true }
		p.allEligible = true
	}
	// A pager is made on a running server (its owner stops it only after the pager).
	_ = srv.SetStore(store.Fd())
	_ = srv.SetBudget(p.budget) // the server's direct reclaim bounds CPU faults too
	if p.budget > 0 {
		p.stop, p.done = make(chan struct{}), make(chan struct{})
		go p.background()
	}
	return p
}

// background reclaims when the estimate is over budget, the way kswapd runs between
// watermarks. The ticker paces reclaim; it synchronises nothing.
func (p *Pager) background() {
	defer close(p.done)
	t := time.NewTicker(time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-p.stop:
			return
		case <-t.C:
			if p.Over(0) {
				p.Reclaim()
			}
		}
	}
}

// Close stops background reclaim; it may be called more than once. Regions must be
// removed by their owners.
func (p *Pager) Close() {
	p.closeOnce.Do(func() {
		if p.stop != nil {
			close(p.stop)
			<-p.done
		}
	})
}

// Region is one paged buffer.
type Region struct {
	p        *Pager
	base     uintptr
	npages   int
	stash    []byte // bounce pages, registered on the userfaultfd
	pr       *pagefault.PagedRegion
	storeOff int64
}

// AddRegion makes mem (page aligned, from mmap) a paged region.
func (p *Pager) AddRegion(mem []byte) (*Region, error) {
	ps := int(pagefault.PageSize)
	stash, err := unix.Mmap(-1, 0, len(mem), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_NORESERVE)
	if err != nil {
		return nil, fmt.Errorf("paging: map bounce pages: %w", err)
	}
	if _, err := p.uffd.Register(addrOf(stash), uintptr(len(stash)), pagefault.ModeMissing); err != nil {
		_ = unix.Munmap(stash) // our own fresh mapping
		return nil, err
	}
	p.rmu.Lock()
	defer p.rmu.Unlock()
	r := &Region{p: p, base: addrOf(mem), npages: len(mem) / ps, stash: stash, storeOff: p.nextOff}
	if r.pr, err = p.srv.AddRegion(r.base, r.npages, addrOf(stash), r.storeOff); err != nil {
		_ = p.uffd.Unregister(addrOf(stash), uintptr(len(stash))) // registered just above
		_ = unix.Munmap(stash)                                    // our own fresh mapping
		return nil, err
	}
	if p.allEligible {
		_ = r.pr.SetEvictable(0, r.npages, true) // a region of the running server
	}
	p.nextOff += int64(len(mem))
	i := sort.Search(len(p.regions), func(i int) bool { return p.regions[i].base > r.base })
	p.regions = append(p.regions, nil)
	copy(p.regions[i+1:], p.regions[i:])
	p.regions[i] = r
	return r, nil
}

// Remove retires the region; its memory's content is no longer needed (it is being
// unmapped). Call with the memory still mapped. Its error is the fault server's (it
// stopped first); the region is retired on the Go side either way.
func (r *Region) Remove() error {
	p := r.p
	p.reclaimMu.Lock()
	defer p.reclaimMu.Unlock()
	p.rmu.Lock()
	for i, x := range p.regions {
		if x == r {
			p.regions = append(p.regions[:i], p.regions[i+1:]...)
			break
		}
	}
	p.hand.region, p.hand.page = 0, 0
	p.rmu.Unlock()
	// Its pages leave the estimate (they are unmapped next, or were already).
	present, _ := r.present()
	_ = p.srv.AddResident(-present)
	uerr := p.uffd.Unregister(addrOf(r.stash), uintptr(len(r.stash)))
	rerr := r.pr.Remove()
	merr := unix.Munmap(r.stash)
	p.store.Punch(r.storeOff, int64(r.npages)*int64(pagefault.PageSize))
	if errors.Is(uerr, pagefault.ErrClosed) {
		uerr = nil // the userfaultfd closed first: its registrations went with it
	}
	return errors.Join(uerr, rerr, merr)
}

func (p *Pager) lookup(addr uintptr) (*Region, int) {
	p.rmu.RLock()
	defer p.rmu.RUnlock()
	i := sort.Search(len(p.regions), func(i int) bool { return p.regions[i].base > addr }) - 1
	if i < 0 {
		return nil, 0
	}
	r := p.regions[i]
	idx := int((addr - r.base) / pagefault.PageSize)
	if idx >= r.npages {
		return nil, 0
	}
	return r, idx
}

func (r *Region) page(i int) uintptr { return r.base + uintptr(i)*pagefault.PageSize }
func (r *Region) bounce(i int) uintptr {
	return addrOf(r.stash) + uintptr(i)*pagefault.PageSize
}
func (r *Region) storeAt(i int) int64 { return r.storeOff + int64(i)*int64(pagefault.PageSize) }

// punchLocked drops the store's copies that the fault server no longer needs, as far
// as their pages are not STORED again. Two evictors write the store: this pager, one
// at a time under reclaimMu, and the server's direct reclaim, under the server's store
// lock, which PunchUnlessStored takes: no page becomes STORED between the check and
// the punch. Called with reclaimMu held.
func (p *Pager) punchLocked() {
	var offs [256]int64
	for {
		n, err := p.srv.PopPunches(offs[:])
		if err != nil || n == 0 {
			return
		}
		p.rmu.RLock()
		for _, off := range offs[:n] {
			for _, r := range p.regions {
				if off >= r.storeOff && off < r.storeOff+int64(r.npages)*int64(pagefault.PageSize) {
					r.pr.PunchUnlessStored(int((off-r.storeOff)/int64(pagefault.PageSize)), off)
					break
				}
			}
		}
		p.rmu.RUnlock()
	}
}

// installedLocked records that stored pages were installed: the store's copies are
// no longer needed. Called with reclaimMu held (only then may the store be punched).
func (p *Pager) installedLocked(addr uintptr, npages int) {
	for k := 0; k < npages; k++ {
		r, i := p.lookup(addr + uintptr(k)*pagefault.PageSize)
		if r != nil && r.pr.Unstore(i, r.storeAt(i)) {
			p.restores.Add(1)
		}
	}
}

// Touch marks n pages from the page holding addr referenced, for CLOCK: the NIC's
// access bits. The pages must lie in one region.
func (p *Pager) Touch(addr uintptr, n int) { p.pages(addr, n, (*pagefault.PagedRegion).Touch) }

// Unhold ends the holds that installs for the NIC put on n pages from the page
// holding addr (see pagefault.PagedRegion.Unhold): the NIC's fault has mapped them,
// or given up. The pages must lie in one region.
func (p *Pager) Unhold(addr uintptr, n int) { p.pages(addr, n, (*pagefault.PagedRegion).Unhold) }

// pages runs fn on the paged region's pages among n pages from the page holding addr.
func (p *Pager) pages(addr uintptr, n int, fn func(*pagefault.PagedRegion, int)) {
	r, i := p.lookup(addr)
	if r == nil {
		return
	}
	for k := i; k < min(i+n, r.npages); k++ {
		fn(r.pr, k)
	}
}

// Over reports whether the resident estimate exceeds the budget by more than slack
// pages.
func (p *Pager) Over(slack int) bool {
	if p.budget == 0 {
		return false
	}
	return p.resident() > p.budget+int64(slack)
}

// resident is the estimate of present pages in paged regions, which the fault server
// keeps: it counts its own installs and evictions, and the pager's through AddResident.
func (p *Pager) resident() int64 {
	n, err := p.srv.Resident()
	if err != nil {
		return 0 // stopped: nothing is installed any more
	}
	return n
}

// recountLocked replaces the estimate with the kernel's count of present pages in the
// paged regions (PAGEMAP_SCAN walks page tables and returns runs, so it costs what
// the present pages cost, not the regions' size). An install the server counts during
// the scan may be lost or counted twice; the next recount corrects it. Called with
// reclaimMu held; if the scan fails the estimate stays as it was.
func (p *Pager) recountLocked() {
	p.rmu.RLock()
	defer p.rmu.RUnlock()
	var n int64
	for _, r := range p.regions {
		k, err := r.present()
		if err != nil {
			return
		}
		n += k
	}
	_ = p.srv.SetResident(n)
}

// present counts the region's present pages from the page tables.
func (r *Region) present() (int64, error) {
	var n int64
	err := r.p.pm.PresentRuns(r.base, r.page(r.npages), func(lo, hi uintptr) error {
		n += int64((hi - lo) / pagefault.PageSize)
		return nil
	})
	return n, err
}

// MaxDirectChunks bounds the chunks of 256 pages one direct reclaim scans. A fault
// that finds the budget exhausted must not sweep the whole of a large region (when
// the budget is first reached, every page carries the NIC's reference bit, and CLOCK
// clears a whole sweep of them before it evicts anything: seconds for gigabytes); it
// evicts what a bounded scan finds, and background reclaim does the rest.
const MaxDirectChunks = 16

// Reclaim evicts pages, CLOCK order, until the estimate is below nine tenths of the
// budget or a whole sweep found nothing to evict. It is background reclaim (kswapd's
// role): it waits for another reclaim to finish.
func (p *Pager) Reclaim() int {
	p.reclaimMu.Lock()
	defer p.reclaimMu.Unlock()
	return p.reclaimLocked(0)
}

// ReclaimDirect is direct reclaim from a fault path: it gives up at once if another
// reclaim is running (it may be waiting for the faulting goroutine's DMA), and scans
// at most MaxDirectChunks chunks.
func (p *Pager) ReclaimDirect() int {
	if !p.reclaimMu.TryLock() {
		return 0
	}
	defer p.reclaimMu.Unlock()
	p.directReclaims.Add(1)
	return p.reclaimLocked(MaxDirectChunks)
}

// reclaimLocked is Reclaim's loop, scanning at most limit chunks (0: no limit).
// Called with reclaimMu held.
func (p *Pager) reclaimLocked(limit int) int {
	p.punchLocked()
	if limit == 0 {
		p.recountLocked() // background reclaim starts from the kernel's count
	}
	target := p.budget * 9 / 10
	const chunk = 256
	evicted, idle, scanned := 0, 0, 0
	entries := make([]pagefault.PagemapEntry, chunk)
	defer func() {
		if limit > 0 && uint64(scanned) > p.directMaxChunks.Load() {
			p.directMaxChunks.Store(uint64(scanned)) // reclaimMu makes this the only writer
		}
	}()
	for p.resident() > target && (limit == 0 || scanned < limit) {
		scanned++
		p.rmu.RLock()
		if len(p.regions) == 0 {
			p.rmu.RUnlock()
			break
		}
		if p.hand.region >= len(p.regions) {
			p.hand.region, p.hand.page = 0, 0
		}
		r := p.regions[p.hand.region]
		first := p.hand.page
		n := min(chunk, r.npages-first)
		if p.hand.page += n; p.hand.page >= r.npages {
			p.hand.region, p.hand.page = p.hand.region+1, 0
		}
		sweepEnds := p.hand.region >= len(p.regions) // regions change under rmu (AddRegion)
		p.rmu.RUnlock()
		got := p.evictChunk(r, first, entries[:n], true)
		evicted += got
		if sweepEnds {
			p.recountLocked() // a sweep ended: start the next from the kernel's count
		}
		if got == 0 {
			if idle++; idle > 4*p.totalChunks(chunk) {
				break // a whole sweep and more found nothing to evict
			}
		} else {
			idle = 0
		}
	}
	return evicted
}

func (p *Pager) totalChunks(chunk int) int {
	p.rmu.RLock()
	defer p.rmu.RUnlock()
	c := 0
	for _, r := range p.regions {
		c += (r.npages + chunk - 1) / chunk
	}
	return c
}

// evictChunk evicts the present, unreferenced pages among pages [first, first+n) of r
// (all present pages when clock is false) and returns how many it evicted. Called
// with reclaimMu held.
func (p *Pager) evictChunk(r *Region, first int, entries []pagefault.PagemapEntry, clock bool) int {
	lo, hi := r.page(first), r.page(first+len(entries))
	if !p.eligible(lo, hi) || p.pm.Read(lo, entries) != nil {
		return 0
	}
	var victims []int
	for k, e := range entries {
		i := first + k
		if !e.Present() {
			continue
		}
		if clock && r.pr.TakeReference(i) {
			continue // second chance
		}
		if r.pr.State(i) == pagefault.PageNone {
			victims = append(victims, i)
		}
	}
	// Pages discarded while an eviction was on its way keep stale bounce content
	// until a sweep drops it.
	var stale []int
	for k := range entries {
		if r.pr.State(first+k) == pagefault.PageDiscarded {
			stale = append(stale, first+k)
		}
	}
	if len(stale) > 0 {
		p.dropBounces(r, stale)
	}
	if len(victims) == 0 {
		return 0
	}
	done := p.change(r, lo, hi, invalidate.ReasonEvict, victims, p.evictLocked)
	_ = p.srv.AddResident(-int64(done))
	return done
}

// change applies op to pages of r inside one invalidation of [lo, hi) (the NIC's
// entries cleared, its DMA drained, its faults held off), then frees the bounce pages,
// and returns for how many pages op reported success.
func (p *Pager) change(r *Region, lo, hi uintptr, why invalidate.Reason, pages []int, op func(*Region, int) bool) int {
	done := 0
	_, _ = p.reg.Invalidate(invalidate.Range{Start: lo, End: hi}, why, func() error { // the change reports nothing
		for _, i := range pages {
			if op(r, i) {
				done++
			}
		}
		p.dropBounces(r, pages)
		return nil
	})
	return done
}

// evictLocked moves page i to the store. Called with reclaimMu held, inside an
// invalidation of the page's range. Faults on the page meanwhile are served by
// the CPU fault server from the bounce page; then the eviction is abandoned. Events
// the server reads meanwhile change the state under it: a REMOVE makes the page
// DISCARDED (its old content must never come back), an UNMAP makes it GONE, a REMAP
// makes it REMAPPED (the server moves the bounce content to the new address).
func (p *Pager) evictLocked(r *Region, i int) bool {
	ps := pagefault.PageSize
	if !p.claim(r, i) {
		return false // gone, missing, or claimed by an install in progress: skip it
	}
	if !p.moveOut(r, i) {
		// Missing after all, or not movable (shared, pinned): nothing to evict, and
		// nothing in the bounce page. A fault that reclaimed it found it empty.
		p.settleEmpty(r, i)
		return false
	}
	// Never hand a userfaultfd-registered page to a syscall: write(2) holds the
	// store's inode lock while it reads the source, and if a fault took the page
	// back meanwhile the bounce page is missing and the read waits for the fault
	// server, which may itself be waiting for that lock (punching a restored page
	// out of the store). A copy in user mode faults without holding any lock.
	p.hook(p.hooks.movedOut, r, i)
	copy(p.scratch, r.stash[i*int(ps):(i+1)*int(ps)])
	// Written under the server's store lock, and only while the claim holds: a fault
	// may have taken the page back, and the server's direct reclaim evicted it again
	// (its own copy in the store, which this one must not overwrite).
	if stored, _ := r.pr.StoreEvicted(i, r.storeAt(i), p.scratch); stored {
		p.evictions.Add(1)
		p.writtenBack.Add(uint64(ps))
		return true
	}
	// A fault took the page back (RECLAIMED), an event overtook the eviction, or the
	// store failed: put the content back where it still belongs, and forget the
	// eviction.
	p.putBack(r, i)
	p.aborts.Add(1)
	return false
}

// moveOut moves claimed page i into its bounce page (UFFDIO_MOVE) and reports whether
// it is there now. A move that reports failure is checked against the page tables
// (page missing, bounce page present: moved): the kernel has been seen to report a
// move it made as failed (see moved_anyway in pagefault/cpuserver.c), and taking the
// page for still in place would lose it. Called with reclaimMu held, inside the
// page's invalidation: nothing else moves it between the two addresses meanwhile.
func (p *Pager) moveOut(r *Region, i int) bool {
	moved, err := again(func() (uintptr, error) { return p.uffd.Move(r.bounce(i), r.page(i), pagefault.PageSize, false) })
	if err == nil {
		return moved != 0
	}
	var e [1]pagefault.PagemapEntry
	if p.pm.Read(r.page(i), e[:]) != nil || e[0].Present() {
		return false
	}
	return p.pm.Read(r.bounce(i), e[:]) == nil && e[0].Present()
}

// settleEmpty ends an eviction or migration of page i that moved nothing out. A
// REMOVE read while the claim held (DISCARDED) found the page claimed, not NONE: what
// is in place is discarded content whose zap may still be pending, so the page
// becomes REMOVING, as the REMOVE would have made it, and no evictor claims it until a
// fault finds it missing. Set to NONE, the next claim could move that content out
// before the zap reached it and store it, and the next fault would restore it (a
// claim whose probe met the pending REMOVE's EAGAIN settles here).
func (p *Pager) settleEmpty(r *Region, i int) {
	for {
		switch s := r.pr.State(i); s {
		case pagefault.PageEvicting, pagefault.PageReclaimed:
			if r.pr.CompareAndSwap(i, s, pagefault.PageNone) {
				return
			}
		case pagefault.PageDiscarded:
			if r.pr.CompareAndSwap(i, s, pagefault.PageRemoving) {
				return
			}
		default: // GONE, REMAPPED: the server owns the page's fate now
			return
		}
	}
}

// putBack moves page i's content from its bounce page back into place, unless a
// fault already did or an event says it no longer belongs there, and settles the
// page. If the move cannot be made now, the page stays RECLAIMED with its bounce page
// kept: the next fault takes it back. The claim and the move are one held section
// (see held): a discard whose REMOVE the server reads first finds the page claimed and
// makes it DISCARDED, and the move is not made; one read after it zaps what the move
// put back.
func (p *Pager) putBack(r *Region, i int) {
	ps := pagefault.PageSize
	var settled, stale bool
	_, undrained, err := p.held(func() (uintptr, error) {
		// Claim it again, so that a REMOVE read from here on turns it DISCARDED.
		if !r.pr.CompareAndSwap(i, pagefault.PageReclaimed, pagefault.PageEvicting) && r.pr.State(i) != pagefault.PageEvicting {
			// DISCARDED or GONE: dropBounces frees the stale content; REMAPPED: the
			// server moves it on; NONE: the server already took it back.
			settled = true
			return 0, nil
		}
		p.hook(p.hooks.beforePlace, r, i)
		n, err := p.uffd.Move(r.page(i), r.bounce(i), ps, true)
		if err == nil || errors.Is(err, pagefault.ErrExist) {
			stale = !r.pr.CompareAndSwap(i, pagefault.PageEvicting, pagefault.PageNone)
			return n, nil
		}
		return n, err
	})
	if settled {
		return
	}
	p.hook(p.hooks.placed, r, i)
	if err != nil {
		if !r.pr.CompareAndSwap(i, pagefault.PageEvicting, pagefault.PageReclaimed) {
			p.settleEmpty(r, i) // an event overtook it: the content is stale anyway
		}
		return // dropBounces leaves a RECLAIMED page's bounce page
	}
	// A REMOVE read while the content went back (see held for when that can happen):
	// the content must not survive the discard, whose zap may already have run. Take
	// it out again; it is dropped.
	if (stale || undrained) && discarded(r, i) {
		p.takeOut(r, i)
	}
}

// held runs place, which looks at a page's state and then puts content at the page
// with one ioctl, as a DMA in the fault server's gate (pagefault.Gate): the server
// reads no event while place runs. A discard's zap runs only after its REMOVE event
// is read, and the server marks the page as it reads it, so what place saw still
// holds when its ioctl lands: content for a page that a discard marked is never put
// back, and content put back before the REMOVE is read is zapped after it, never
// left in place after madvise returned. Put back outside the gate, an ioctl could land
// after a zap that a state read just before it had not seen.
//
// While an event waits to be read the kernel refuses the ioctl (ErrAgain): held then
// leaves the gate, so that the server can read it, and runs place again (it must look
// at the state again), for up to a second as again does. One case stays open: a
// server that finds faults waiting it cannot serve before an event reads the event
// with DMA in flight (pagefault's doc: undrained), and the thread that raised it may
// zap before place's ioctl lands. held reports that case (undrained), after waiting
// until the server has applied what it read to the page states; the caller then looks
// at the state again and takes content a discard covered out again. Nothing inside
// place may wait for the server: its ioctl moves from a bounce page (holes allowed)
// or copies from the pager's own memory, never from a registered page.
func (p *Pager) held(place func() (uintptr, error)) (n uintptr, undrained bool, err error) {
	g := p.srv.Gate()
	n, err = again(func() (uintptr, error) {
		g.Enter()
		mark := g.Events()
		n, err := place()
		undrained = p.srv.ReadSince(mark)
		g.Exit()
		if undrained {
			_, _ = p.srv.SettledEvents() // stopped: nothing more is applied
		}
		return n, err
	})
	return n, undrained, err
}

// takeOut moves what is at page i back into its bounce page (a hole moves nothing):
// content put back that a discard covered, for the caller to drop.
func (p *Pager) takeOut(r *Region, i int) {
	_, _ = again(func() (uintptr, error) { return p.uffd.Move(r.bounce(i), r.page(i), pagefault.PageSize, true) })
}

// discarded reports whether a REMOVE read with a put-back of page i in flight
// (undrained) covered the page: the server made it DISCARDED (claimed) or REMOVING.
func discarded(r *Region, i int) bool {
	s := r.pr.State(i)
	return s == pagefault.PageDiscarded || s == pagefault.PageRemoving
}

// again retries an ioctl while a non-cooperative event is pending (EAGAIN), for up to
// a second, as the resolver does.
func again(op func() (uintptr, error)) (uintptr, error) {
	deadline := time.Now().Add(time.Second)
	for {
		n, err := op()
		if !errors.Is(err, pagefault.ErrAgain) || time.Now().After(deadline) {
			return n, err
		}
		runtime.Gosched()
	}
}

// claim takes page i for this evictor (NONE -> EVICTING) if it is present memory
// registered on our userfaultfd, and reports whether it did. UFFDIO_MOVE needs only
// its destination registered, so without the check a page of an address the
// application unmapped and the process mapped again (its own heap, say) could be
// moved away; UFFDIO_ZEROPAGE answers EEXIST exactly for a present page of a range
// registered on this userfaultfd, ENOENT when the range is not. It claims first and
// probes after: probing first, the server's direct reclaim could move the page out to
// the store in between, and the probe would map the zero page over its content.
// A claimed page that turns out missing held zero (a missing NONE page is zero), and
// the zero page the probe mapped is its content: nothing to evict. Called with
// reclaimMu held.
func (p *Pager) claim(r *Region, i int) bool {
	if !r.pr.CompareAndSwap(i, pagefault.PageNone, pagefault.PageEvicting) {
		return false // gone (unmapped), or busy
	}
	if _, err := p.uffd.Zeropage(r.page(i), pagefault.PageSize, true); errors.Is(err, pagefault.ErrExist) {
		return true
	}
	p.settleEmpty(r, i)
	return false
}

// dropBounces frees the bounce pages of the settled pages among idx (sorted), one
// madvise per run of consecutive pages (each a REMOVE event for the stash, which
// nothing subscribes to), and settles DISCARDED pages, whose bounce content was stale.
// A RECLAIMED page keeps its bounce page: it may still hold the content, for the next
// fault to take back; a REMAPPED page's bounce page is the server's to move on.
func (p *Pager) dropBounces(r *Region, idx []int) {
	keep := func(i int) bool {
		s := r.pr.State(i)
		return s == pagefault.PageReclaimed || s == pagefault.PageRemapped
	}
	for k := 0; k < len(idx); {
		if keep(idx[k]) {
			k++
			continue
		}
		j := k + 1
		for j < len(idx) && idx[j] == idx[j-1]+1 && !keep(idx[j]) {
			j++
		}
		// Cannot fail on our own mapping; a failure leaves content that the next
		// eviction of the page overwrites.
		_, _, _ = unix.Syscall(unix.SYS_MADVISE, r.bounce(idx[k]), uintptr(j-k)*pagefault.PageSize, unix.MADV_DONTNEED)
		for _, i := range idx[k:j] {
			r.pr.CompareAndSwap(i, pagefault.PageDiscarded, pagefault.PageNone)
		}
		k = j
	}
}

// SetEvictable says whether the fault server's direct reclaim may evict the paged
// pages of [start, end) (see pagefault.PagedRegion.SetEvictable); unpaged memory is
// skipped. The pager's own reclaim asks its Eligible function instead.
func (p *Pager) SetEvictable(start, end uintptr, on bool) {
	p.rmu.RLock()
	defer p.rmu.RUnlock()
	for _, r := range p.regions {
		lo, hi := max(start, r.base), min(end, r.page(r.npages))
		if lo < hi {
			first := int((lo - r.base) / pagefault.PageSize)
			last := int((hi - r.base + pagefault.PageSize - 1) / pagefault.PageSize)
			_ = r.pr.SetEvictable(first, last-first, on) // in range; stopped: nothing evicts
		}
	}
}

// Exclusive runs fn with reclaim held off. Lock order: the reclaim lock comes before
// the registry, so fn may call invalidate.Registry.Invalidate.
func (p *Pager) Exclusive(fn func() error) error {
	p.reclaimMu.Lock()
	defer p.reclaimMu.Unlock()
	p.punchLocked()
	return fn()
}

// Evict evicts every present page of [start, end) that may be evicted, and returns
// how many it evicted.
func (p *Pager) Evict(start, end uintptr) (int, error) {
	p.reclaimMu.Lock()
	defer p.reclaimMu.Unlock()
	p.punchLocked()
	return p.each(start, end, func(r *Region, first, n int) int {
		return p.evictChunk(r, first, make([]pagefault.PagemapEntry, n), false)
	})
}

// Migrate moves every present page of [start, end) that may be moved to a new frame
// (UFFDIO_MOVE out, UFFDIO_COPY back), and returns how many moved.
func (p *Pager) Migrate(start, end uintptr) (int, error) {
	p.reclaimMu.Lock()
	defer p.reclaimMu.Unlock()
	p.punchLocked()
	return p.each(start, end, func(r *Region, first, n int) int {
		lo, hi := r.page(first), r.page(first+n)
		entries := make([]pagefault.PagemapEntry, n)
		if !p.eligible(lo, hi) || p.pm.Read(lo, entries) != nil {
			return 0
		}
		var pages []int
		for k, e := range entries {
			if e.Present() && r.pr.State(first+k) == pagefault.PageNone {
				pages = append(pages, first+k)
			}
		}
		return p.change(r, lo, hi, invalidate.ReasonMigrate, pages, p.migrateLocked)
	})
}

// migrateLocked moves page i to a new frame. Called with reclaimMu held, inside an
// invalidation of the page's range.
func (p *Pager) migrateLocked(r *Region, i int) bool {
	ps := pagefault.PageSize
	if !p.claim(r, i) {
		return false
	}
	if !p.moveOut(r, i) {
		p.settleEmpty(r, i) // a fault found it missing: zero was right
		return false
	}
	// A copy allocates a new frame. If a fault already took the page back, the copy
	// finds it present and the page keeps its frame. Its source is the scratch page,
	// not the bounce page: a fault may move the bounce page's content back meanwhile,
	// and UFFDIO_COPY from a missing bounce page would wait for the server inside the
	// held section (a copy in user mode faults outside it; the state then says so).
	copy(p.scratch, r.stash[i*int(ps):(i+1)*int(ps)])
	var overtaken, stale bool
	n, undrained, _ := p.held(func() (uintptr, error) {
		if overtaken = r.pr.State(i) != pagefault.PageEvicting; overtaken {
			return 0, nil // an event or a fault overtook the move
		}
		p.hook(p.hooks.beforePlace, r, i)
		n, err := p.uffd.Copy(r.page(i), addrOf(p.scratch), ps, false)
		if n == ps {
			stale = !r.pr.CompareAndSwap(i, pagefault.PageEvicting, pagefault.PageNone)
		}
		return n, err
	})
	if !overtaken {
		p.hook(p.hooks.placed, r, i)
	}
	removed := n == ps && (stale || undrained) && discarded(r, i)
	if n == ps && !stale && !removed {
		p.migrations.Add(1)
		return true
	}
	if removed {
		// Discarded while it was copied back (see held for when): the copy must not
		// outlive the discard. The bounce page still holds the original; drop it,
		// then take the copy out.
		_, _, _ = unix.Syscall(unix.SYS_MADVISE, r.bounce(i), ps, unix.MADV_DONTNEED)
		p.takeOut(r, i)
		return false
	}
	p.putBack(r, i)
	return false
}

// Restore brings every stored page of [start, end) back into memory, before the range
// stops being registered (then a fault would zero-fill it).
func (p *Pager) Restore(start, end uintptr) error {
	p.reclaimMu.Lock()
	defer p.reclaimMu.Unlock()
	p.punchLocked()
	_, err := p.each(start, end, func(r *Region, first, n int) int {
		buf := make([]byte, pagefault.PageSize)
		got := 0
		for i := first; i < first+n; i++ {
			if r.pr.State(i) != pagefault.PageStored {
				continue
			}
			if p.store.ReadAt(buf, r.storeAt(i)) != nil {
				continue
			}
			// A discard read before the copy forgot the stored copy (NONE): the page
			// reads as zero, and the copy is not made.
			c, undrained, _ := p.held(func() (uintptr, error) {
				if r.pr.State(i) != pagefault.PageStored {
					return 0, nil
				}
				p.hook(p.hooks.beforePlace, r, i)
				return p.uffd.Copy(r.page(i), addrOf(buf), pagefault.PageSize, false)
			})
			if c > 0 {
				p.hook(p.hooks.placed, r, i)
				if undrained && r.pr.State(i) != pagefault.PageStored {
					// A discard read while the copy was made (see held for when)
					// forgot the stored copy, and its zap may have run first: take
					// the copy out (into the page's bounce page, dropped).
					p.takeOut(r, i)
					_, _, _ = unix.Syscall(unix.SYS_MADVISE, r.bounce(i), pagefault.PageSize, unix.MADV_DONTNEED)
					continue
				}
				got++
				_ = p.srv.AddResident(1)
			}
			p.installedLocked(r.page(i), 1)
		}
		return got
	})
	return err
}

// DiscardedLocked forgets the stored copies of [start, end): after MADV_DONTNEED a page
// reads as zeros, not as what was evicted. (The CPU fault server does the same when
// it reads a REMOVE or UNMAP event, and restores stored pages at their new address on
// REMAP.) Call it inside Exclusive: it punches the store, which only the holder of the
// reclaim lock may do.
func (p *Pager) DiscardedLocked(start, end uintptr) {
	_, _ = p.each(start, end, func(r *Region, first, n int) int { // unpaged memory has nothing stored
		for i := first; i < first+n; i++ {
			r.pr.Unstore(i, r.storeAt(i))
		}
		return 0
	})
}

// each runs fn over the paged pages of [start, end), region by region, in chunks of
// at most 256 pages, and sums its results.
func (p *Pager) each(start, end uintptr, fn func(r *Region, first, n int) int) (int, error) {
	total, found := 0, false
	for a := start &^ (pagefault.PageSize - 1); a < end; {
		r, i := p.lookup(a)
		if r == nil {
			a += pagefault.PageSize
			continue
		}
		found = true
		n := min(r.npages-i, int((end-a+pagefault.PageSize-1)/pagefault.PageSize))
		for off := 0; off < n; off += 256 {
			total += fn(r, i+off, min(256, n-off))
		}
		a = r.page(i + n)
	}
	if !found {
		return 0, ErrNotPaged
	}
	return total, nil
}

// PagerStats count what a pager did.
type PagerStats struct {
	Evictions   uint64 // pages written to the store (by the pager and by the server)
	WrittenBack uint64 // bytes written to the store
	Migrations  uint64 // pages moved to new frames
	Aborts      uint64 // evictions abandoned because the page was faulted meanwhile
	Restores    uint64 // stored pages brought back by the NIC's faults or Restore
	Resident    int64  // estimate of present pages
	// DirectReclaims counts reclaims run from fault paths; DirectMaxChunks is the most
	// chunks one of them scanned (at most MaxDirectChunks).
	DirectReclaims, DirectMaxChunks uint64
	// ServerEvictions counts the evictions (of Evictions) that the CPU fault server
	// made before it installed pages past the budget; Overshoot the pages it installed
	// past the budget all the same, finding nothing to evict in time.
	ServerEvictions, Overshoot uint64
}

// Stats returns the counters.
func (p *Pager) Stats() PagerStats {
	st := PagerStats{Evictions: p.evictions.Load(), WrittenBack: p.writtenBack.Load(), Migrations: p.migrations.Load(),
		Aborts: p.aborts.Load(), Restores: p.restores.Load(), Resident: p.resident(),
		DirectReclaims: p.directReclaims.Load(), DirectMaxChunks: p.directMaxChunks.Load()}
	if cs, err := p.srv.Stats(); err == nil {
		st.ServerEvictions, st.Overshoot = cs.Evicted, cs.Overshoot
		st.Evictions += cs.Evicted
		st.WrittenBack += cs.Evicted * uint64(pagefault.PageSize)
	}
	return st
}

func addrOf(b []byte) uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(b))) }
