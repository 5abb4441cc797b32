package pagefault

/*
#cgo CFLAGS: -O2 -Wall
#include "cpuserver.h"
*/
import "C"

import (
	"encoding/binary"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// ErrStopped is returned by every CPUServer method, and every PagedRegion method
// that needs the server, once the server has stopped.
var ErrStopped = errors.New("pagefault: CPU fault server stopped")

// CPUServer serves the page faults that application threads take on a userfaultfd's
// registered ranges. It runs in a C pthread, so a goroutine blocked in a fault (which
// keeps its P, even inside copy()) is served however many Ps are held: no deadlock at
// any GOMAXPROCS, and no stall of the garbage collector beyond one fault's service time.
// Faults are resolved with zero-filled private pages (UFFDIO_COPY, never the shared zero
// page, so a page's frame does not change on a later write). Non-pagefault events
// (REMOVE, UNMAP, REMAP, FORK) are queued and handed to Go through Events.
//
// Every method is safe for concurrent use, also with Stop; after Stop each returns
// ErrStopped. No Go value points into memory that Stop frees.
type CPUServer struct {
	mu   sync.Mutex // protects fs against Stop racing the other methods
	fs   *C.odp_fs  // nil once stopped
	gate *Gate      // lives as long as the CPUServer is reachable
	// reading is the server's word that is 1 between reading messages and queueing
	// them (odp_fs_reading_word), read atomically while fs is not nil.
	reading *int32
}

// CPUServerStats are the server's counters.
type CPUServerStats struct {
	Faults, WriteFaults, Pages, Exist, Retries, Errors, Events uint64
	ServiceTime, MaxServiceTime                                time.Duration

	// The DMA gate (see Gate): reads that first waited for DMA in flight to drain,
	// and how long; reads of waiting faults made while DMA was still in flight
	// (a DMA may wait for one), and events such a read returned all the same.
	Drains, FaultReads, Undrained uint64
	DrainTime, MaxDrainTime       time.Duration

	// Direct reclaim (SetBudget): installs that found the budget exhausted, pages the
	// server evicted, and pages it installed past the budget because it found nothing
	// to evict in time (nothing evictable, or DMA in flight did not drain).
	Reclaims, Evicted, Overshoot uint64
}

// StartCPUServer starts a server on u. around is the number of pages installed per
// fault (fault-around; 1 installs just the faulting page).
func StartCPUServer(u *FD, around int) (*CPUServer, error) {
	if around < 1 || around > 1024 {
		return nil, fmt.Errorf("pagefault: fault-around %d out of range [1, 1024]", around)
	}
	g := newGate()
	if g == nil {
		return nil, fmt.Errorf("pagefault: DMA gate: %w", unix.ENOMEM)
	}
	var e C.int
	fs := C.odp_fs_start(C.int(u.fd), C.unsigned(around), g.g, &e)
	if fs == nil {
		g.owner.stopped.Store(true)
		return nil, fmt.Errorf("pagefault: start CPU fault server: %w", unix.Errno(e))
	}
	return &CPUServer{fs: fs, gate: g, reading: (*int32)(unsafe.Pointer(C.odp_fs_reading_word(fs)))}, nil
}

// Gate returns the server's DMA gate.
func (s *CPUServer) Gate() *Gate { return s.gate }

// live runs fn with the server's lock held if the server runs, else returns
// ErrStopped.
func (s *CPUServer) live(fn func(fs *C.odp_fs)) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.fs == nil {
		return ErrStopped
	}
	fn(s.fs)
	return nil
}

// Stop stops and joins the server thread, fails install requests still waiting, and
// unlinks every region (their state words stay valid for their owners). Faults taken
// afterwards are not served, so stop only after the ranges are unregistered or no
// longer touched. A second Stop returns ErrStopped.
func (s *CPUServer) Stop() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.fs == nil {
		return ErrStopped
	}
	C.odp_fs_stop(s.fs)
	s.fs = nil
	s.gate.owner.stopped.Store(true) // the thread is gone: the gate may be freed
	return nil
}

// Stats reads the counters.
func (s *CPUServer) Stats() (CPUServerStats, error) {
	var st C.odp_fs_stats
	err := s.live(func(fs *C.odp_fs) { C.odp_fs_stats_read(fs, &st) })
	return CPUServerStats{
		Faults: uint64(st.faults), WriteFaults: uint64(st.write_faults), Pages: uint64(st.pages),
		Exist: uint64(st.exist), Retries: uint64(st.retries), Errors: uint64(st.errors),
		Events: uint64(st.events), ServiceTime: time.Duration(st.service_ns),
		MaxServiceTime: time.Duration(st.max_service_ns),
		Drains:         uint64(st.drains), FaultReads: uint64(st.fault_reads), Undrained: uint64(st.undrained),
		DrainTime: time.Duration(st.drain_ns), MaxDrainTime: time.Duration(st.max_drain_ns),
		Reclaims: uint64(st.reclaims), Evicted: uint64(st.evicted), Overshoot: uint64(st.overshoot),
	}, err
}

// EventFd returns an eventfd that is readable while events are queued. It is owned by
// the server and closed by Stop.
func (s *CPUServer) EventFd() (int, error) {
	fd := -1
	err := s.live(func(fs *C.odp_fs) { fd = int(C.odp_fs_event_fd(fs)) })
	return fd, err
}

// Events moves queued non-pagefault events into dst and returns how many it moved.
// Each event's ReadAt is when the server read it from the userfaultfd (at which point
// the kernel went on with the operation that raised it); see SinceRead.
func (s *CPUServer) Events(dst []Msg) (int, error) {
	if len(dst) == 0 {
		return 0, s.live(func(*C.odp_fs) {})
	}
	raw := make([]byte, MsgSize*len(dst))
	times := make([]C.uint64_t, len(dst))
	n := 0
	if err := s.live(func(fs *C.odp_fs) {
		n = int(C.odp_fs_pop_events(fs, unsafe.Pointer(&raw[0]), &times[0], C.int(len(dst))))
	}); err != nil {
		return 0, err
	}
	for i := 0; i < n; i++ {
		m, err := DecodeMsg(raw[i*MsgSize:])
		if err != nil {
			return i, err
		}
		m.ReadAt = time.Duration(times[i])
		dst[i] = m
	}
	return n, nil
}

// SinceRead returns how long ago, on the fault server's clock (CLOCK_MONOTONIC), a
// Msg.ReadAt was.
func SinceRead(readAt time.Duration) time.Duration {
	return time.Duration(C.odp_fs_now_ns()) - readAt
}

// SettledEvents returns how many events the server has queued, once it is not between
// reading messages and queueing them: every event a thread was released from before
// the call is counted. It waits (yielding) through that short window.
//
// It reads the server's words as odp_fs_settled_events does, without a call into C:
// a lookup that checks for new events before every use (a registration cache's)
// pays two atomic loads for it.
func (s *CPUServer) SettledEvents() (uint64, error) {
	for {
		s.mu.Lock()
		if s.fs == nil {
			s.mu.Unlock()
			return 0, ErrStopped
		}
		reading := atomic.LoadInt32(s.reading) != 0 // before the count, as the server writes them
		n := s.gate.Events()
		s.mu.Unlock()
		if !reading {
			return n, nil
		}
		runtime.Gosched()
	}
}

// ReadSince reports whether the server has read an event since Gate.Events returned
// mark, or is reading one now. For a DMA in the gate, that means the server read it
// with the DMA in flight (undrained): the thread that raised the event may have gone
// on before the DMA ended, and SettledEvents waits until the server has applied it.
func (s *CPUServer) ReadSince(mark uint64) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.fs == nil {
		return false
	}
	return atomic.LoadInt32(s.reading) != 0 || s.gate.Events() != mark
}

// FaultSeq returns a mark for FaultedSince: the sequence number of the latest fault
// the server served. Gate.FaultSeq reads the same number without a cgo call.
func (s *CPUServer) FaultSeq() (uint64, error) {
	var seq uint64
	err := s.live(func(fs *C.odp_fs) { seq = uint64(C.odp_fs_fault_seq(fs)) })
	return seq, err
}

// FaultedSince reports whether the server served a fault on a page overlapping
// [lo, hi) after mark, that is, whether some thread found a page of that range
// missing (the server installed it, found it installed meanwhile, or could not). When
// too many faults happened since to tell, it reports true.
func (s *CPUServer) FaultedSince(mark uint64, lo, hi uintptr) (bool, error) {
	var r C.int
	err := s.live(func(fs *C.odp_fs) { r = C.odp_fs_faulted_since(fs, C.uint64_t(mark), C.uint64_t(lo), C.uint64_t(hi)) })
	return r != 0, err
}

// Page states of a paged region, shared with the server thread (doc.go has the
// table of transitions).
const (
	PageNone       = C.ODP_PAGE_NONE       // a fault zero-fills
	PageStored     = C.ODP_PAGE_STORED     // the content is in the store
	PageEvicting   = C.ODP_PAGE_EVICTING   // being moved to its bounce page
	PageReclaimed  = C.ODP_PAGE_RECLAIMED  // a fault took it back from the bounce page
	PageGone       = C.ODP_PAGE_GONE       // unmapped: never touch the address again
	PageInstalling = C.ODP_PAGE_INSTALLING // claimed by the server thread's install
	PageDiscarded  = C.ODP_PAGE_DISCARDED  // discarded while evicting: reads as zero
	PageRemapped   = C.ODP_PAGE_REMAPPED   // mremapped while evicting: the server moves it on
	PageRemoving   = C.ODP_PAGE_REMOVING   // discarded in place, its zap maybe pending: never evicted
	PageDirect     = C.ODP_PAGE_DIRECT     // being evicted by the server thread itself (direct reclaim)
)

// SetStore gives the server the store file that stored pages are read from.
func (s *CPUServer) SetStore(fd int) error {
	return s.live(func(fs *C.odp_fs) { C.odp_fs_set_store(fs, C.int(fd)) })
}

// PagedRegion is memory whose pages the emulator may evict or migrate; the server
// restores them on faults. Its state words are shared with the server thread and
// accessed atomically. They live as long as the PagedRegion does: after Remove, or
// after the server stopped, they still read and write (the server no longer looks).
type PagedRegion struct {
	s      *CPUServer
	slot   C.int
	words  *C.uint32_t
	states []uint32 // the state words, one per page
	refs   []uint32 // the reference bits (CLOCK), one word per page
}

// ErrRegionTable is returned when the server's region table is full: it holds
// MaxPagedRegions regions.
var ErrRegionTable = errors.New("pagefault: paged region table full")

// MaxPagedRegions is how many paged regions a CPU fault server holds (MAX_REGIONS
// in cpuserver.c; a test checks that they agree).
const MaxPagedRegions = 256

// AddRegion makes npages pages at base a paged region: page i bounces at
// bounce + i*PageSize and is stored at storeOff + i*PageSize.
func (s *CPUServer) AddRegion(base uintptr, npages int, bounce uintptr, storeOff int64) (*PagedRegion, error) {
	if npages <= 0 {
		return nil, fmt.Errorf("pagefault: paged region of %d pages: %w", npages, unix.EINVAL)
	}
	words := C.odp_region_alloc(C.uint64_t(npages))
	if words == nil {
		return nil, fmt.Errorf("pagefault: paged region state: %w", unix.ENOMEM)
	}
	slot := C.int(-1)
	if err := s.live(func(fs *C.odp_fs) {
		slot = C.odp_fs_add_region(fs, C.uint64_t(base), C.uint64_t(npages), C.uint64_t(bounce), C.uint64_t(storeOff), words)
	}); err != nil || slot < 0 {
		C.odp_region_free(words)
		if err == nil {
			err = ErrRegionTable
		}
		return nil, err
	}
	all := unsafe.Slice((*uint32)(unsafe.Pointer(words)), 3*npages) // states, reference bits, evictable flags
	r := &PagedRegion{s: s, slot: slot, words: words, states: all[:npages:npages], refs: all[npages : 2*npages : 2*npages]}
	// The words are freed once no Go value can reach them; the region is unlinked
	// from the server first, in case its owner never removed it.
	runtime.AddCleanup(r, func(a regionRef) { a.release() }, regionRef{s, slot, words})
	return r, nil
}

// regionRef is what a PagedRegion's cleanup needs: not the region itself.
type regionRef struct {
	s     *CPUServer
	slot  C.int
	words *C.uint32_t
}

func (a regionRef) release() {
	_ = a.s.live(func(fs *C.odp_fs) { C.odp_fs_remove_region(fs, a.slot, a.words) }) // stopped: unlinked already
	C.odp_region_free(a.words)
}

// Remove retires the region; its memory must be unregistered first. When it returns
// the server thread no longer reads or writes the region's states.
func (r *PagedRegion) Remove() error {
	return r.s.live(func(fs *C.odp_fs) { C.odp_fs_remove_region(fs, r.slot, r.words) })
}

// State returns page i's state.
func (r *PagedRegion) State(i int) uint32 { return atomic.LoadUint32(&r.states[i]) }

// Touch sets page i's reference bit, as an access does: both reclaimers (the Go
// pager's and the server's) pass a referenced page over once, clearing the bit. It
// also ends the hold an install for the NIC put on the page (ODP_REF_HELD: the
// server's direct reclaim does not evict it before the NIC touched it).
func (r *PagedRegion) Touch(i int) {
	if atomic.LoadUint32(&r.refs[i]) != C.ODP_REF_SET {
		atomic.StoreUint32(&r.refs[i], C.ODP_REF_SET)
	}
}

// Unhold ends the hold an install for the NIC put on page i (if it is still held),
// leaving its reference bit set: the NIC's fault mapped the page (or gave up).
func (r *PagedRegion) Unhold(i int) {
	atomic.CompareAndSwapUint32(&r.refs[i], C.ODP_REF_HELD, C.ODP_REF_SET)
}

// TakeReference clears page i's reference bit (or hold) and reports whether it was
// set.
func (r *PagedRegion) TakeReference(i int) bool { return atomic.SwapUint32(&r.refs[i], 0) != 0 }

// CompareAndSwap changes page i's state from old to new if it is old.
func (r *PagedRegion) CompareAndSwap(i int, old, new uint32) bool {
	return atomic.CompareAndSwapUint32(&r.states[i], old, new)
}

// SetEvictable says whether the server's direct reclaim may evict pages
// [first, first+n): only pages of a range registered for missing faults (a later
// access must fault) and not mlocked. Pages start not evictable. When it returns, no
// eviction that decided otherwise is still running.
func (r *PagedRegion) SetEvictable(first, n int, on bool) error {
	if first < 0 || n < 0 || first+n > len(r.states) {
		return fmt.Errorf("pagefault: pages [%d, +%d) of a %d-page region: %w", first, n, len(r.states), unix.EINVAL)
	}
	v := C.int(0)
	if on {
		v = 1
	}
	return r.s.live(func(fs *C.odp_fs) {
		C.odp_fs_set_evictable(fs, r.slot, r.words, C.uint64_t(first), C.uint64_t(n), v)
	})
}

// Unstore changes page i from STORED to NONE and punches its copy at off out of the
// store, under the store lock that the server's evictions take: it reports whether it
// did. After the server stopped it only changes the state.
func (r *PagedRegion) Unstore(i int, off int64) bool {
	ok := false
	if r.s.live(func(fs *C.odp_fs) { ok = C.odp_fs_unstore(fs, &r.wordsSlice()[i], C.uint64_t(off)) != 0 }) != nil {
		ok = r.CompareAndSwap(i, PageStored, PageNone)
	}
	return ok
}

// StoreEvicted writes page i's content (buf, one page) to the store at off and makes
// the page STORED, if it is still EVICTING, all under the store lock that the
// server's own evictions take: a claim a fault took back (and the server may have
// claimed again) is never overwritten. It returns true if it stored the page, false
// if the claim was lost, and an error if the write failed or the server stopped.
func (r *PagedRegion) StoreEvicted(i int, off int64, buf []byte) (bool, error) {
	if len(buf) != int(PageSize) {
		return false, fmt.Errorf("pagefault: store %d bytes as a page: %w", len(buf), unix.EINVAL)
	}
	var ret C.int
	if err := r.s.live(func(fs *C.odp_fs) {
		ret = C.odp_fs_store_evicted(fs, &r.wordsSlice()[i], C.uint64_t(off), unsafe.Pointer(&buf[0]))
	}); err != nil {
		return false, err
	}
	if ret < 0 {
		return false, fmt.Errorf("pagefault: write evicted page to the store: %w", unix.EIO)
	}
	return ret == 1, nil
}

// PunchUnlessStored punches page i's copy at off out of the store unless the page is
// STORED, under the store lock (no eviction writes the copy in between). It does
// nothing once the server stopped.
func (r *PagedRegion) PunchUnlessStored(i int, off int64) {
	_ = r.s.live(func(fs *C.odp_fs) { C.odp_fs_punch_unless_stored(fs, &r.wordsSlice()[i], C.uint64_t(off)) })
}

func (r *PagedRegion) wordsSlice() []C.uint32_t {
	return unsafe.Slice(r.words, len(r.states))
}

// eventEvictC is the code the server queues its own evictions under (a test checks
// that it is EventEvict).
const eventEvictC = C.ODP_EVENT_EVICT

// SetBudget bounds the pages of paged regions the server lets be resident: before an
// install would go past it, the server evicts pages itself (direct reclaim), without
// waiting for Go. 0 (the default) sets no bound.
func (s *CPUServer) SetBudget(pages int64) error {
	return s.live(func(fs *C.odp_fs) { C.odp_fs_set_budget(fs, C.int64_t(pages)) })
}

// Resident returns the estimate of pages present in paged regions: the server counts
// what it installs and evicts; the owner of a region adds what it installs or evicts
// itself (AddResident) and replaces it with the kernel's count (SetResident).
func (s *CPUServer) Resident() (int64, error) {
	var n int64
	err := s.live(func(fs *C.odp_fs) { n = int64(C.odp_fs_resident(fs)) })
	return n, err
}

// AddResident adds delta to the resident estimate.
func (s *CPUServer) AddResident(delta int64) error {
	return s.live(func(fs *C.odp_fs) { C.odp_fs_add_resident(fs, C.int64_t(delta)) })
}

// SetResident replaces the resident estimate.
func (s *CPUServer) SetResident(pages int64) error {
	return s.live(func(fs *C.odp_fs) { C.odp_fs_set_resident(fs, C.int64_t(pages)) })
}

// PopPunches moves up to len(out) store offsets whose copy the server no longer needs
// into out and returns how many. The server never punches the store itself: the
// caller does, with PunchUnlessStored (a punch racing a new eviction of the same page
// would delete the new copy). One caller at a time.
func (s *CPUServer) PopPunches(out []int64) (int, error) {
	if len(out) == 0 {
		return 0, s.live(func(*C.odp_fs) {})
	}
	raw := make([]C.uint64_t, len(out))
	n := 0
	err := s.live(func(fs *C.odp_fs) { n = int(C.odp_fs_pop_punches(fs, &raw[0], C.int(len(out)))) })
	for i := 0; i < n; i++ {
		out[i] = int64(raw[i])
	}
	return n, err
}

// Restored counts pages the server restored from the store or a bounce page.
func (s *CPUServer) Restored() (uint64, error) {
	var n uint64
	err := s.live(func(fs *C.odp_fs) { n = uint64(C.odp_fs_restored(fs)) })
	return n, err
}

// Install makes npages pages at start present by the server thread, as faults would:
// evicted pages come back with their content, others are zero-filled. Pages that are
// present already are left alone. It fails with ErrUnmapped if some page is not in a
// registered range, and with ErrStopped if the server stops first. The caller blocks
// in read(2), holding no P, until the thread is done. Because the server thread is
// then the only one that installs pages of paged regions, no content it chose can be
// overtaken by an eviction (a page it fills is missing until it fills it).
func (s *CPUServer) Install(start uintptr, npages int) error {
	efd, err := s.doneFd()
	if err != nil {
		return err
	}
	var e C.int
	if err := s.live(func(fs *C.odp_fs) { e = C.odp_fs_install(fs, C.uint64_t(start), C.uint64_t(npages), C.int(efd)) }); err != nil {
		s.putDoneFd(efd)
		return err
	}
	if e != 0 {
		s.putDoneFd(efd)
		return fmt.Errorf("pagefault: install request: %w", unix.Errno(e))
	}
	var b [8]byte
	for {
		_, err := unix.Read(efd, b[:])
		if err == unix.EINTR {
			continue
		}
		s.putDoneFd(efd) // one answer per request: the eventfd reads zero again
		if err != nil {
			return fmt.Errorf("pagefault: install answer: %w", err)
		}
		switch binary.NativeEndian.Uint64(b[:]) {
		case C.ODP_INSTALL_DONE:
			return nil
		case C.ODP_INSTALL_STOPPED:
			return ErrStopped
		}
		return fmt.Errorf("pagefault: install %#x+%d pages: %w", start, npages, ErrUnmapped)
	}
}

// doneFds is a bounded free list of completion eventfds.
var doneFds = make(chan int, 64)

func (s *CPUServer) doneFd() (int, error) {
	select {
	case fd := <-doneFds:
		return fd, nil
	default:
		return unix.Eventfd(0, unix.EFD_CLOEXEC) // blocking: the waiter sleeps in read
	}
}

func (s *CPUServer) putDoneFd(fd int) {
	select {
	case doneFds <- fd:
	default:
		_ = unix.Close(fd) // an eventfd of our own: nothing to flush
	}
}
