package odp

import (
	"errors"
	"fmt"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/odpemu/odpemu/mmu"
	"github.com/odpemu/odpemu/pagefault"
)

// enterDMA admits a DMA past the device's gate (pagefault.Gate): it waits while the
// fault server reads the userfaultfd, then until every event read so far has been
// applied to the translation tables, so that the NIC trusts no translation that a
// change the application already made has withdrawn. With the ablation switch
// nothing waits: nothing tells the NIC anything.
func (d *nic) enterDMA() error {
	if d.cfg.NoInvalidate {
		return nil
	}
	for {
		d.as.gate.Enter()
		ev := d.as.gate.Events()
		if ev <= d.as.pump.Applied() {
			return nil
		}
		d.as.gate.Exit()
		if err := d.as.pump.WaitApplied(ev); err != nil {
			return fmt.Errorf("%w: %s: events not applied: %w", ErrClosed, d.cfg.Name, err)
		}
	}
}

// exitDMA ends a DMA that enterDMA admitted.
func (d *nic) exitDMA() {
	if !d.cfg.NoInvalidate {
		d.as.gate.Exit()
	}
}

// missErr says why table pages [first, first+count) of an MR that takes no faults
// (pinned) are not mapped: it was deregistered, or the application unmapped them.
func (mr *MR) missErr(first, count int) error {
	mr.table.Lock()
	defer mr.table.Unlock()
	if !mr.dead {
		for _, g := range mr.gone {
			if g[0] < first+count && first < g[1] {
				return wrap(ErrInvalidArgument, "MR %#x: pages [%d, %d) were unmapped", mr.key, max(g[0], first), min(g[1], first+count))
			}
		}
	}
	return errDeregistered
}

// beginDMA starts a DMA over MR bytes [off, off+n) (already bounds-checked), taking
// network page faults for ODP pages that are not mapped. The DMA holds the device's
// gate from the moment its translations are found valid; the caller must endDMA.
// A DMA that faults is timed in the phases FaultPhases names. frames are the pages'
// page-table entries if it read them (lateZap), for the audit.
func (mr *MR) beginDMA(off, n uint64, write bool) (mmu.DMA, []pagefault.PagemapEntry, error) {
	first, count := mr.pageSpan(off, n)
	var resumed time.Time // when the last fault of this DMA ended
	for round := 0; round < maxFaultRounds; round++ {
		if err := mr.dev.enterDMA(); err != nil {
			return mmu.DMA{}, nil, err
		}
		t0 := time.Now()
		dma, miss := mr.table.BeginDMA(first, count, write)
		var frames []pagefault.PagemapEntry
		if miss < 0 && mr.zapsWatched() {
			var zapped bool
			if zapped, frames = mr.lateZap(first, count); zapped {
				mr.endDMA(dma, true)
				mr.dropLate(first, count, true)
				continue
			}
		}
		if miss < 0 {
			if round > 0 {
				mr.dev.stats.resumeNanos.Add(uint64(time.Since(resumed)))
			}
			return dma, frames, nil
		}
		mr.dev.exitDMA() // faults wait for the fault server: never inside the gate
		if !mr.odp {
			return dma, nil, mr.missErr(first, count) // a pinned table is only cleared by Dereg and munmap
		}
		mr.dev.stats.detectNanos.Add(uint64(time.Since(t0)))
		if _, err := mr.networkFault(miss, first+count, write); err != nil {
			return dma, nil, err
		}
		resumed = time.Now()
	}
	return mmu.DMA{}, nil, wrap(ErrBusy, "MR %#x: range kept being invalidated", mr.key)
}

// endDMA ends a DMA, leaves the gate if the DMA entered it, and reports whether an
// invalidation completed under the DMA.
func (mr *MR) endDMA(d mmu.DMA, gated bool) bool {
	overtaken := mr.table.EndDMA(d)
	if gated {
		mr.dev.exitDMA()
	}
	return overtaken
}

// errGateBusy: the DMA gate is closed (the fault server reads the userfaultfd), or
// events it read are not yet applied: a DMA that must not wait tries again later.
var errGateBusy = errors.New("odp: DMA gate busy")

// tryAcquire starts a DMA over MR bytes [off, off+n) (already bounds-checked)
// without waiting, for the engine, which must never wait while runs it has not
// taken may hold up the fault server. It returns the DMA and -1, or the first page
// that needs a network page fault (the caller resolves it elsewhere and tries
// again), or errGateBusy, or why the MR cannot be accessed (a pinned MR's page is
// gone, the MR was deregistered). covered says the caller already holds a DMA of
// this address space inside the gate (a run it has not released): then the DMA
// does not enter the gate itself, as the gate is held for it until that run is
// released, and no event can be read meanwhile.
func (mr *MR) tryAcquire(off, n uint64, write, covered bool) (dmaRef, int, error) {
	d := mr.dev
	gated := !covered && !d.cfg.NoInvalidate
	if gated {
		if !d.as.gate.TryEnter() {
			return dmaRef{}, -1, errGateBusy
		}
		if d.as.gate.Events() > d.as.pump.Applied() {
			d.as.gate.Exit()
			return dmaRef{}, -1, errGateBusy
		}
	}
	first, count := mr.pageSpan(off, n)
	dm, miss := mr.table.BeginDMA(first, count, write)
	if miss >= 0 {
		if gated {
			d.exitDMA()
		}
		if !mr.odp {
			return dmaRef{}, -1, mr.missErr(first, count)
		}
		return dmaRef{}, miss, nil
	}
	var frames []pagefault.PagemapEntry
	if mr.zapsWatched() {
		var zapped bool
		if zapped, frames = mr.lateZap(first, count); zapped {
			mr.endDMA(dm, gated)
			mr.dropLate(first, count, false)
			return dmaRef{}, -1, errGateBusy
		}
	}
	return mr.started(off, n, dm, gated, frames), -1, nil
}

// dmaChunk bounds one DMA, as a NIC moves a message in segments: the fault server,
// which waits for DMA in flight before it reads an event, waits for one chunk's copy
// at most.
const dmaChunk = 256 << 10

// dma copies between MR bytes [off, off+len(buf)) (already bounds-checked) and buf,
// into the MR if toMR, one DMA per chunk. A copy that a page fault tore (see release)
// is made again.
func (mr *MR) dma(off uint64, buf []byte, toMR bool) error {
	for pos := 0; pos < len(buf); pos += dmaChunk {
		chunk := buf[pos:min(pos+dmaChunk, len(buf))]
		if err := mr.dmaOnce(off+uint64(pos), chunk, toMR); err != nil {
			return err
		}
	}
	return nil
}

func (mr *MR) dmaOnce(off uint64, buf []byte, toMR bool) error {
	for round := 0; round < maxFaultRounds; round++ {
		ref, err := mr.acquire(off, uint64(len(buf)), toMR)
		if err != nil {
			return err
		}
		if mr.file != nil {
			err = mr.fileCopy(off, buf, toMR)
		} else if toMR {
			err = mr.dev.dmaCopy(ref.bytes(), buf)
		} else {
			err = mr.dev.dmaCopy(buf, ref.bytes())
		}
		if torn := ref.release(err == nil); !torn || err != nil {
			return err
		}
	}
	return wrap(ErrBusy, "MR %#x: DMA kept being torn by page faults", mr.key)
}

// atomicOp is what an 8-byte atomic does to its word.
type atomicOp int

const (
	atomicFetchAdd atomicOp = iota // adds value
	atomicCmpSwap                  // stores value if the word is compare
	atomicStore                    // stores value (an atomic write)
)

// atomicOn runs an 8-byte atomic at MR offset off (aligned, bounds-checked) as the
// DMA ref (begun for write on those bytes), ends ref, and returns the value it
// found (an atomic store finds nothing). The CPU's atomic instructions make it
// atomic with respect to every other NIC atomic and to the application's own
// atomics on the word. It is never made again: a single access cannot be torn, and
// if a page fault during it installed a new page, it ran on that page, as if it came
// after the change that replaced the page.
func (mr *MR) atomicOn(ref dmaRef, off uint64, op atomicOp, compare, value uint64) (uint64, error) {
	word := (*uint64)(unsafe.Pointer(&ref.bytes()[0]))
	if dt := mr.detached.Load(); dt.has(int((mr.start + uintptr(off) - mr.base) / pagefault.PageSize)) {
		word = (*uint64)(unsafe.Pointer(&dt.mem[mr.start+uintptr(off)-mr.base]))
	}
	var orig uint64
	err := mr.dev.dmaRun(func() {
		switch op {
		case atomicFetchAdd:
			orig = atomic.AddUint64(word, value) - value
			return
		case atomicStore:
			atomic.StoreUint64(word, value)
			return
		}
		for {
			orig = atomic.LoadUint64(word)
			if orig != compare || atomic.CompareAndSwapUint64(word, orig, value) {
				return
			}
		}
	})
	ref.release(err == nil)
	return orig, err
}

// dmaRef is one DMA in flight on MR bytes [off, off+n), from acquire to release.
type dmaRef struct {
	mr     *MR
	off, n uint64
	d      mmu.DMA
	audit  bool
	gated  bool     // the DMA entered the device's gate (else it was covered)
	hold   *dmaHold // the DMA d is the hold's, shared with other runs
	mark   uint64   // the fault server's fault sequence at acquire
	stale  bool     // audit: a translation was stale when the DMA began
}

// acquire starts a DMA, taking network page faults as needed.
func (mr *MR) acquire(off, n uint64, write bool) (dmaRef, error) {
	d, frames, err := mr.beginDMA(off, n, write)
	if err != nil {
		return dmaRef{}, err
	}
	return mr.started(off, n, d, true, frames), nil
}

// started is the DMA begun on MR bytes [off, off+n): the NIC's access bits for the
// pager, the fault sequence a torn copy is told by, and the audit's first half, which
// takes frames, the pages' page-table entries, if the caller read them after the DMA
// began (lateZap; nil: the audit reads them).
func (mr *MR) started(off, n uint64, d mmu.DMA, gated bool, frames []pagefault.PagemapEntry) dmaRef {
	r := dmaRef{mr: mr, off: off, n: n, d: d, audit: mr.dev.cfg.Audit, gated: gated}
	if p := mr.dev.as.pager; p != nil && mr.odp {
		first, count := mr.pageSpan(off, n)
		p.Touch(mr.base+uintptr(first)*pagefault.PageSize, count) // the NIC's access bits
	}
	r.mark = mr.dev.as.gate.FaultSeq()
	if r.audit {
		// A detached page is one the file let go of: the NIC's frame is not the file's.
		r.stale = r.framesStale(frames) || mr.anyDetached(mr.pageSpan(off, n))
	}
	return r
}

func (r dmaRef) bytes() []byte { return r.mr.slice(r.off, r.n) }

// release ends the DMA and reports whether its copy was torn and must be made again.
//
// On an ODP MR it first asks whether a thread found a page of the range missing while
// the copy ran (a fault the server served): a copy that faults goes on in the page
// installed for it, so it may hold half old and half new content. The gate and the
// zap barrier keep every change off the DMAs in flight, so this happens only where
// they cannot: when the server had to read an event with the DMA in flight (a DMA
// that faulted while an event waited, see pagefault's doc), or when a zap's thread
// woke but had not taken the mmap lock yet as the barrier passed. Then release
// invalidates the range (the next fault maps the pages anew) and reports true: the
// caller copies again, as if the DMA had come after the invalidation, so nothing of
// the torn copy reaches the wire or stays in memory that the repeated copy does not
// overwrite. TornDMAs counts these. Otherwise, if the copy completed, it audits the
// DMA when auditing is on. A copy that faulted on unmapped memory moved nothing
// through the page it faulted on (munmap removes a page before its event exists, so
// a DMA can start on it): it is reported as an access error and counted in
// DMAFaults, not audited. A DMA that an invalidation of its range completed under
// (the invalidation did not wait for it) is stale whatever else the audit finds: it
// copied through withdrawn translations.
func (r dmaRef) release(copied bool) (torn bool) {
	mr, d := r.mr, r.mr.dev
	first, count := mr.pageSpan(r.off, r.n)
	faulted := false // a page of the range was found missing during the copy
	if mr.odp && count > 0 && d.as.gate.FaultSeq() != r.mark && (r.audit || !d.cfg.NoInvalidate) {
		lo := mr.base + uintptr(first)*pagefault.PageSize
		// A stopped server (the device closing) is no evidence of a fault.
		faulted, _ = d.as.server.FaultedSince(r.mark, lo, lo+uintptr(count)*pagefault.PageSize)
	}
	torn = faulted && !d.cfg.NoInvalidate // with the ablation nothing is made again
	if !torn && r.audit && copied {
		r.check(faulted)
	}
	if r.hold != nil {
		r.hold.put(1)
	} else if overtaken := mr.endDMA(r.d, r.gated); overtaken && r.audit {
		mr.countOvertaken()
	}
	if torn {
		mr.tornAsync(first, count)
		return true
	}
	return false
}

// tornAsync counts a torn copy and invalidates its pages, on a goroutine of its own:
// an engine releases runs of other engines' MRs, and an invalidation waits for every
// DMA of the table, the runs the engine holds included.
func (mr *MR) tornAsync(first, count int) {
	d := mr.dev
	d.stats.tornDMAs.Add(1)
	d.faulting.Add(1)
	go func() {
		defer d.faulting.Done()
		mr.invalidate(first, count)
	}()
}

// countOvertaken counts a DMA an invalidation completed under (the audit's).
func (mr *MR) countOvertaken() {
	d := mr.dev
	d.stats.stale.Add(1)
	mr.stats.stale.Add(1)
	d.stats.overtaken.Add(1)
}

// dmaHold is one DMA on an MR under which several runs are read or written (a
// requester's transmit round, a responder's pass over the runs it received, as a
// NIC's DMA engine moves several packets of one MR): one entry in the device's gate
// and one in the table's DMA count, whatever the runs. Each run checks its own pages
// (check) and, when it leaves the engine, holds a reference; the hold ends when the
// last reference is released (put), the opener's included.
//
// Without the audit, a run read under a hold carries the hold itself as its
// roce.Ref (the engine that copies it checks it with torn, given the run's
// payload, and puts its reference): nothing is allocated per run. The torn-copy
// check of a run then starts from the hold's fault sequence, which can only find
// more faults than the run's own would.
//
// The opener counts the runs it hands out in runs, a field only it touches, and adds
// them to refs when it closes the hold (close): the runs are not on the wire before
// that, so no reader can release one first, and the hold costs one atomic add per
// round rather than one per run.
//
// A responder's hold over READ response runs names the responder (owner), which
// counts such holds not yet ended and is told when one ends.
type dmaHold struct {
	mr    *MR
	d     mmu.DMA
	gated bool
	mark  uint64 // the fault server's fault sequence when the hold began
	refs  atomic.Int32
	runs  int32                    // references handed out and not yet in refs (the opener's)
	owner interface{ readEnded() } // READ responses: the responder counting the hold
}

// Release implements roce.Ref for a run that was dropped unread.
func (h *dmaHold) Release() { h.put(1) }

// torn reports whether a copy of MR bytes b under the hold may be torn (see
// dmaRef.release): a thread found a page of them missing since the hold began. It
// then invalidates those pages, so that the copy made again faults them anew.
func (h *dmaHold) torn(b []byte) bool {
	mr, d := h.mr, h.mr.dev
	if !mr.odp || len(b) == 0 || d.cfg.NoInvalidate || d.as.gate.FaultSeq() == h.mark {
		return false
	}
	first, count := mr.pageSpan(uint64(uintptr(unsafe.Pointer(&b[0]))-mr.start), uint64(len(b)))
	lo := mr.base + uintptr(first)*pagefault.PageSize
	if faulted, _ := d.as.server.FaultedSince(h.mark, lo, lo+uintptr(count)*pagefault.PageSize); !faulted {
		return false
	}
	mr.tornAsync(first, count)
	return true
}

// check checks MR bytes [off, off+n) (already bounds-checked) for a copy under the
// hold, into the MR if write: it returns -1, or the first page that needs a
// network page fault, or why the MR cannot be accessed. frames are the pages'
// page-table entries if it read them (lateZap), for a run the audit checks.
func (h *dmaHold) check(off, n uint64, write bool) (miss int, frames []pagefault.PagemapEntry, err error) {
	mr := h.mr
	first, count := mr.pageSpan(off, n)
	if miss := mr.table.Missing(first, count, write); miss >= 0 {
		if !mr.odp {
			return -1, nil, mr.missErr(first, count)
		}
		return miss, nil, nil
	}
	if mr.zapsWatched() {
		var zapped bool
		if zapped, frames = mr.lateZap(first, count); zapped {
			mr.dropLate(first, count, false) // after the hold ends
			return -1, nil, errGateBusy
		}
	}
	if p := mr.dev.as.pager; p != nil && mr.odp {
		p.Touch(mr.base+uintptr(first)*pagefault.PageSize, count) // the NIC's access bits
	}
	return -1, frames, nil
}

// openHold starts a hold on mr without waiting (errGateBusy: try again later).
// covered says the caller holds a DMA of this address space inside the gate for as
// long as the hold lasts (see tryAcquire): then the hold does not enter the gate.
func (mr *MR) openHold(covered bool) (*dmaHold, error) {
	d := mr.dev
	gated := !covered && !d.cfg.NoInvalidate
	if gated {
		if !d.as.gate.TryEnter() {
			return nil, errGateBusy
		}
		if d.as.gate.Events() > d.as.pump.Applied() {
			d.as.gate.Exit()
			return nil, errGateBusy
		}
	}
	h := &dmaHold{mr: mr, d: mr.table.Enter(), gated: gated, mark: d.as.gate.FaultSeq()}
	h.refs.Store(1)
	return h, nil
}

// close hands the references the opener counted to refs and drops the opener's own:
// the hold ends now if no run holds it.
func (h *dmaHold) close() {
	n := h.runs
	h.runs = 0
	h.put(1 - n)
}

// put releases n references (a negative n adds them); the last ends the hold's DMA.
func (h *dmaHold) put(n int32) {
	if h.refs.Add(-n) != 0 {
		return
	}
	if overtaken := h.mr.endDMA(h.d, h.gated); overtaken && h.mr.dev.cfg.Audit {
		h.mr.countOvertaken()
	}
	if h.owner != nil {
		h.owner.readEnded()
	}
}

// framesStale is the first half of the DMA audit, run when the DMA begins: does the
// NIC hold a valid translation to a frame while the page is present in another
// frame? That is a DMA starting through a translation the CPU no longer has, with no
// invalidation having told the NIC (fork and COW, a migration or a refilled page that
// nobody reported). A pinned MR is audited by frames alone: nothing ever invalidates
// its MTT. Frames are read before the copy, not after it, so that a page the
// application unmaps after the copy read it is not a stale DMA. A page found absent
// is no evidence by itself: munmap clears its page table entries before its event
// exists and before it flushes the TLB, so a copy then still reaches the old page or
// faults (an access error); a copy that finds a page missing in a range registered
// for faults is caught by check instead. entries are the pages' page-table entries
// if the caller read them once the DMA began, else framesStale reads them.
func (r dmaRef) framesStale(entries []pagefault.PagemapEntry) bool {
	mr, d := r.mr, r.mr.dev
	first, count := mr.pageSpan(r.off, r.n)
	if count == 0 || !d.as.pagemap.PFNsReadable() {
		return false
	}
	if len(entries) != count {
		entries = make([]pagefault.PagemapEntry, count)
		if d.as.pagemap.Read(mr.base+uintptr(first)*pagefault.PageSize, entries) != nil {
			return false // unmapped under us: the copy will fault and report it
		}
	}
	mr.table.Lock()
	defer mr.table.Unlock()
	for i, e := range entries {
		te := mr.table.EntryLocked(first + i)
		if te.Valid && e.Present() && e.PFN() != te.PFN {
			return true
		}
	}
	return false
}

// check is the rest of the DMA audit, after the copy: it counts the DMA stale if its
// translations were stale when it began, or if a thread found a page of its range
// missing while it ran (faulted, which release asked the fault ring: a CPU fault is
// immune to frame reuse), unless an invalidation of the MR ran meanwhile (then the
// NIC was told).
func (r dmaRef) check(faulted bool) {
	mr, d := r.mr, r.mr.dev
	d.stats.audited.Add(1)
	if (r.stale || faulted) && mr.table.Sequence() == r.d.Seq() {
		d.stats.stale.Add(1)
		mr.stats.stale.Add(1)
	}
}

// dmaFault is a DMA access that faulted, at Addr: it matches errDMAFault.
type dmaFault struct{ Addr uintptr }

func (f *dmaFault) Error() string { return fmt.Sprintf("%v at %#x", errDMAFault, f.Addr) }
func (f *dmaFault) Unwrap() error { return errDMAFault }

// srcFaulted reports whether a DMA fault err was on src: the memory a copy read.
func srcFaulted(err error, src []byte) bool {
	var f *dmaFault
	if !errors.As(err, &f) || len(src) == 0 {
		return false
	}
	lo := uintptr(unsafe.Pointer(&src[0]))
	return f.Addr >= lo && f.Addr < lo+uintptr(len(src))
}

// dmaCopy is the DMA engine's copy. An application that unmaps memory under an
// in-flight DMA makes the copy fault; the engine goroutines run with
// debug.SetPanicOnFault, so that is reported as an error (an access error completion),
// not a crash. A copy that faults leaves every page before the one it faulted on
// whole and none after it touched, as a NIC that places a message packet by packet
// does. The copy is one memmove, which copies ascending when the two sides do not
// overlap (they never do: a DMA copies between two MRs' pages, or to a buffer of
// its own) but stores the first bytes of the destination last; when it faults, the
// copy is done again page by page from its start (copyPages), which makes the pages
// before the fault whole. A memmove of the run rather than of each page keeps the
// copy at memcpy's speed (pages one by one copy 1 MiB messages at about 0.8 of it).
func (d *nic) dmaCopy(dst, src []byte) error {
	if _, faulted := tryDMA(func() { copy(dst, src) }); !faulted {
		return nil
	}
	return d.dmaRun(func() { copyPages(dst, src) })
}

// copyPages copies src to dst in pieces that cross no page boundary of either, in
// ascending order. A piece's copy touches only its own page of each side, so a page
// that is not mapped faults it before it stores anything; one copy over several pages
// (memmove) may store the first bytes of the destination last, and a fault in the
// middle would then leave an earlier page part old and part new.
func copyPages(dst, src []byte) {
	ps := pagefault.PageSize
	for len(src) > 0 && len(dst) > 0 {
		n := min(len(src), len(dst))
		n = min(n, int(ps-uintptr(unsafe.Pointer(&dst[0]))%ps), int(ps-uintptr(unsafe.Pointer(&src[0]))%ps))
		copy(dst[:n], src[:n])
		dst, src = dst[n:], src[n:]
	}
}

// dmaRun runs one DMA access, a copy or an atomic, reporting a fault on unmapped
// memory as dmaCopy does.
func (d *nic) dmaRun(access func()) error {
	if addr, faulted := tryDMA(access); faulted {
		d.stats.dmaFaults.Add(1)
		return &dmaFault{Addr: addr}
	}
	return nil
}

// tryDMA runs access and reports whether it faulted on memory that is not mapped,
// and where. Memory faults under SetPanicOnFault carry the faulting address; any
// other panic is a bug and goes on.
func tryDMA(access func()) (addr uintptr, faulted bool) {
	defer func() {
		if r := recover(); r != nil {
			fault, ok := r.(interface{ Addr() uintptr })
			if !ok {
				panic(r)
			}
			addr, faulted = fault.Addr(), true
		}
	}()
	access()
	return 0, false
}

// pageSpanEnd returns the table page after MR byte end-1 (0: none).
func (mr *MR) pageSpanEnd(end uint64) int {
	if end == 0 {
		return 0
	}
	first, count := mr.pageSpan(end-1, 1)
	return first + count
}

// firstMissing returns the first page of MR bytes [off, off+n) an ODP MR lacks an
// entry for (for write when write is set), or -1. It takes no lock: it is a hint
// (a READ's pages, faulted before its response is built), and the DMA that follows
// checks the pages again.
func (mr *MR) firstMissing(off, n uint64, write bool) int {
	if !mr.odp || n == 0 {
		return -1
	}
	first, count := mr.pageSpan(off, n)
	return mr.table.Probe(first, count, write)
}

// fileCopy is the DMA copy of an MR over a file mapping, between MR bytes
// [off, off+len(buf)) and buf: through process_vm_readv/writev, page run by page
// run, from the NIC's copy for detached pages.
func (mr *MR) fileCopy(off uint64, buf []byte, toMR bool) error {
	dt := mr.detached.Load()
	for pos := 0; pos < len(buf); {
		a := mr.start + uintptr(off) + uintptr(pos)
		p := int((a - mr.base) / pagefault.PageSize)
		det := dt.has(p)
		k := min(len(buf)-pos, int(mr.base+uintptr(p+1)*pagefault.PageSize-a))
		for q := p + 1; pos+k < len(buf) && dt.has(q) == det; q++ { // a run of pages alike
			k = min(len(buf)-pos, k+PageSize)
		}
		if det {
			in := dt.mem[a-mr.base:]
			if toMR {
				copy(in, buf[pos:pos+k])
			} else {
				copy(buf[pos:pos+k], in)
			}
		} else if err := vmCopy(buf[pos:pos+k], a, toMR); err != nil {
			mr.dev.stats.dmaFaults.Add(1)
			return err
		}
		pos += k
	}
	return nil
}
