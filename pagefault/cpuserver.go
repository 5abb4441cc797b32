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

// CPUServer serves the page faults that application threads take on a userfaultfd's
// registered ranges. It runs in a C pthread, so a goroutine blocked in a fault (which
// keeps its P, even inside copy()) is served however many Ps are held: no deadlock at
// any GOMAXPROCS, and no stall of the garbage collector beyond one fault's service time.
// Faults are resolved with zero-filled private pages (UFFDIO_COPY, never the shared zero
// page, so a page's frame does not change on a later write). Non-pagefault events
// (REMOVE, UNMAP, REMAP, FORK) are queued and handed to Go through Events.
type CPUServer struct {
	mu sync.Mutex // protects fs against Stop racing the other methods
	fs *C.odp_fs
}

// CPUServerStats are the server's counters.
type CPUServerStats struct {
	Faults, WriteFaults, Pages, Exist, Retries, Errors, Events uint64
	ServiceTime, MaxServiceTime                                time.Duration
}

// StartCPUServer starts a server on u. around is the number of pages installed per
// fault (fault-around; 1 installs just the faulting page).
func StartCPUServer(u *FD, around int) (*CPUServer, error) {
	if around < 1 || around > 1024 {
		return nil, fmt.Errorf("pagefault: fault-around %d out of range [1, 1024]", around)
	}
	var e C.int
	fs := C.odp_fs_start(C.int(u.fd), C.unsigned(around), &e)
	if fs == nil {
		return nil, fmt.Errorf("pagefault: start CPU fault server: %w", unix.Errno(e))
	}
	return &CPUServer{fs: fs}, nil
}

// Stop stops and joins the server thread. Faults taken afterwards are not served, so
// stop only after the ranges are unregistered or no longer touched.
func (s *CPUServer) Stop() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.fs != nil {
		C.odp_fs_stop(s.fs)
		s.fs = nil
	}
}

// Stats reads the counters.
func (s *CPUServer) Stats() CPUServerStats {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.fs == nil {
		return CPUServerStats{}
	}
	var st C.odp_fs_stats
	C.odp_fs_stats_read(s.fs, &st)
	return CPUServerStats{
		Faults: uint64(st.faults), WriteFaults: uint64(st.write_faults), Pages: uint64(st.pages),
		Exist: uint64(st.exist), Retries: uint64(st.retries), Errors: uint64(st.errors),
		Events: uint64(st.events), ServiceTime: time.Duration(st.service_ns),
		MaxServiceTime: time.Duration(st.max_service_ns),
	}
}

// EventFd returns an eventfd that is readable while events are queued. It is owned by
// the server and closed by Stop.
func (s *CPUServer) EventFd() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.fs == nil {
		return -1
	}
	return int(C.odp_fs_event_fd(s.fs))
}

// Events moves queued non-pagefault events into dst and returns how many it moved.
// Each event's Age is how long ago the server read it from the userfaultfd (at which
// point the kernel went on with the operation that raised it).
func (s *CPUServer) Events(dst []Msg) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.fs == nil || len(dst) == 0 {
		return 0, nil
	}
	raw := make([]byte, MsgSize*len(dst))
	times := make([]C.uint64_t, len(dst))
	n := int(C.odp_fs_pop_events(s.fs, unsafe.Pointer(&raw[0]), &times[0], C.int(len(dst))))
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

// Since returns how long ago, on the server's clock, a Msg.ReadAt was.
func (s *CPUServer) Since(readAt time.Duration) time.Duration {
	return time.Duration(C.odp_fs_now_ns()) - readAt
}

// SettledEvents returns how many events the server has queued, once it is not between
// reading messages and queueing them: every event a thread was released from before
// the call is counted. It waits (yielding) through that short window.
func (s *CPUServer) SettledEvents() uint64 {
	for {
		s.mu.Lock()
		if s.fs == nil {
			s.mu.Unlock()
			return 0
		}
		n := int64(C.odp_fs_settled_events(s.fs))
		s.mu.Unlock()
		if n >= 0 {
			return uint64(n)
		}
		runtime.Gosched()
	}
}

// InstallSeq returns a mark for InstalledSince: the sequence number of the latest
// page the server installed.
func (s *CPUServer) InstallSeq() uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.fs == nil {
		return 0
	}
	return uint64(C.odp_fs_install_seq(s.fs))
}

// InstalledSince reports whether the server installed a page overlapping [lo, hi)
// after mark, that is, whether a CPU fault found a page of that range missing. When
// too many installs happened since to tell, it reports true.
func (s *CPUServer) InstalledSince(mark uint64, lo, hi uintptr) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.fs == nil {
		return false
	}
	return C.odp_fs_installed_since(s.fs, C.uint64_t(mark), C.uint64_t(lo), C.uint64_t(hi)) != 0
}

// Page states of a paged region, shared with the server thread.
const (
	PageNone       = C.ODP_PAGE_NONE       // a fault zero-fills
	PageStored     = C.ODP_PAGE_STORED     // the content is in the store
	PageEvicting   = C.ODP_PAGE_EVICTING   // being moved to its bounce page
	PageReclaimed  = C.ODP_PAGE_RECLAIMED  // a fault took it back from the bounce page
	PageGone       = C.ODP_PAGE_GONE       // unmapped: never touch the address again
	PageInstalling = C.ODP_PAGE_INSTALLING // claimed by the server thread's install
)

// SetStore gives the server the store file that stored pages are read from.
func (s *CPUServer) SetStore(fd int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	C.odp_fs_set_store(s.fs, C.int(fd))
}

// PagedRegion is memory whose pages the emulator may evict or migrate; the server
// restores them on faults. Its state words are shared with the server thread and
// accessed atomically.
type PagedRegion struct {
	s      *CPUServer
	slot   C.int
	states []uint32 // C memory, one word per page
}

// ErrRegionTable is returned when the server's region table is full.
var ErrRegionTable = errors.New("pagefault: paged region table full")

// AddRegion makes npages pages at base a paged region: page i bounces at
// bounce + i*PageSize and is stored at storeOff + i*PageSize.
func (s *CPUServer) AddRegion(base uintptr, npages int, bounce uintptr, storeOff int64) (*PagedRegion, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var slot C.int
	st := C.odp_fs_add_region(s.fs, C.uint64_t(base), C.uint64_t(npages), C.uint64_t(bounce), C.uint64_t(storeOff), &slot)
	if st == nil {
		return nil, ErrRegionTable
	}
	return &PagedRegion{s: s, slot: slot, states: unsafe.Slice((*uint32)(unsafe.Pointer(st)), npages)}, nil
}

// Remove retires the region; its memory must be unregistered first.
func (r *PagedRegion) Remove() {
	r.s.mu.Lock()
	defer r.s.mu.Unlock()
	if r.s.fs != nil {
		C.odp_fs_remove_region(r.s.fs, r.slot)
	}
}

// State returns page i's state.
func (r *PagedRegion) State(i int) uint32 { return atomic.LoadUint32(&r.states[i]) }

// SetState stores page i's state.
func (r *PagedRegion) SetState(i int, v uint32) { atomic.StoreUint32(&r.states[i], v) }

// CompareAndSwap changes page i's state from old to new if it is old.
func (r *PagedRegion) CompareAndSwap(i int, old, new uint32) bool {
	return atomic.CompareAndSwapUint32(&r.states[i], old, new)
}

// Restored counts pages the server restored from the store or a bounce page.
func (s *CPUServer) Restored() uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.fs == nil {
		return 0
	}
	return uint64(C.odp_fs_restored(s.fs))
}

// Install makes npages pages at start present by the server thread, as faults would
// (ErrUnmapped if some page is not in a registered range):
// evicted pages come back with their content, others are zero-filled. Pages that are
// present already are left alone; pages outside registered ranges stay missing. The
// caller blocks in read(2), holding no P, until the thread is done. Because the server
// thread is then the only one that installs pages of paged regions, no content it
// chose can be overtaken by an eviction (a page it fills is missing until it fills it).
func (s *CPUServer) Install(start uintptr, npages int) error {
	efd, err := s.doneFd()
	if err != nil {
		return err
	}
	defer s.putDoneFd(efd)
	s.mu.Lock()
	if s.fs == nil {
		s.mu.Unlock()
		return ErrClosed
	}
	e := C.odp_fs_install(s.fs, C.uint64_t(start), C.uint64_t(npages), C.int(efd))
	s.mu.Unlock()
	if e != 0 {
		return fmt.Errorf("pagefault: install request: %w", unix.Errno(e))
	}
	var b [8]byte
	for {
		_, err := unix.Read(efd, b[:])
		if err == unix.EINTR {
			continue
		}
		if err == nil && binary.NativeEndian.Uint64(b[:]) != 1 {
			return fmt.Errorf("pagefault: install %#x+%d pages: %w", start, npages, ErrUnmapped)
		}
		return err
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
		unix.Close(fd)
	}
}
