// Package odp is odpemu's verbs-like API: devices, protection domains, memory regions
// registered pinned or on demand (ODP), completion queues and RC queue pairs that post
// RDMA WRITE, RDMA READ and SEND/RECV between emulated NICs.
//
// Pinned registration emulates ib_umem_get: it accounts against RLIMIT_MEMLOCK, pins
// with mlock (which faults every page in) and records every page's frame in the MR's
// translation table. ODP registration pins nothing: it registers the range with
// userfaultfd and leaves the NIC's entries invalid. When the NIC's engine finds an
// invalid entry it takes a network page fault: it resolves the work request's whole
// range (plus fault-around) with userfaultfd ioctls, maps the entries under the
// mmu-notifier sequence protocol and only then copies. The engine never takes a CPU
// fault on ODP memory; application threads that do are served by a C thread.
//
// # Lock order
//
// A goroutine that holds one of these locks takes only locks further down the list:
//
//	Device.regMu             ODP userfaultfd registration changes (registerODP, Dereg)
//	invalidate.Pager.reclaimMu  one evictor at a time; Discard, Evict, Migrate, Restore
//	invalidate.Registry.mu   held for reading while notifiers run
//	mmu.Table.mu             an MR's table lock (umem_mutex); notifiers take it
//	Device.mu                buffers, MRs, keys, PDs, CQs, QPs, pinned accounting
//	invalidate.Pager.rmu     the pager's region list (Alloc adds a region under Device.mu)
//	QP.mu                    a QP's state, queues and pending WRs
//	CQ.mu                    a CQ's ring (completions are pushed under QP.mu; CreateQP
//	                         and CQ.Destroy take it under Device.mu)
//
// Device.mu and QP.mu are never held together, nor is Device.mu held while a table
// lock is taken. Leaf locks, under which nothing else is taken: pagefault.CPUServer's,
// invalidate.Pump's, the work queues' (internal/fifo). No lock is held across a DMA
// copy, and no goroutine holds a lock while it waits for the C fault server except
// through ioctls that return EAGAIN. Functions named ...Locked say which lock they need.
package odp

import (
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"sort"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/odpemu/odpemu/internal/interval"
	"github.com/odpemu/odpemu/invalidate"
	"github.com/odpemu/odpemu/pagefault"
	"golang.org/x/sys/unix"
)

// Config configures a Device. The zero value is usable.
type Config struct {
	// Name identifies the device in errors and stats ("odpemu0" when empty).
	Name string
	// FaultAround is the alignment, in pages, to which a network page fault's range is
	// widened (mlx5 resolves whole work requests; this adds fault-around). Default 16;
	// 1 resolves exactly the pages a work request touches.
	FaultAround int
	// CPUFaultAround is the number of pages the CPU fault server installs per
	// application fault. Default 1.
	CPUFaultAround int
	// UserModeOnly forces a UFFD_USER_MODE_ONLY userfaultfd.
	UserModeOnly bool
	// MemlockLimit bounds pinned bytes. 0 means RLIMIT_MEMLOCK, unlimited with
	// CAP_IPC_LOCK as ib_umem_get does; negative means unlimited.
	MemlockLimit int64
	// NoSnapshot skips mapping already-present pages at ODP registration.
	NoSnapshot bool
	// NoInvalidate is the ablation switch: userfaultfd events are read but not
	// applied, and Discard, Evict, Migrate and Invalidate change mappings without
	// telling the NIC. The NIC then keeps translations the CPU no longer has; Audit
	// counts its DMAs through them. Do not munmap registered memory with it set: the
	// NIC would write into whatever the process maps at that address next.
	NoInvalidate bool
	// ResidentBudget bounds, in bytes, the resident pages of ODP memory: beyond it the
	// device evicts pages (CLOCK over the NIC's access bits) to its backing store, and
	// faults bring them back with their content. Pinned registrations are limited to
	// the budget too. 0: no budget.
	ResidentBudget int64
	// Paging enables the backing store, Evict and Migrate without a budget.
	Paging bool
	// StorePath puts the backing store in a new file at this path instead of in
	// memory (a memfd, which is outside the process's RSS).
	StorePath string
	// Audit checks every DMA after the copy: a copy during which a page of an ODP
	// range was installed anew (a CPU fault found it missing) or whose recorded frame
	// is no longer the page's frame, with no invalidation observed meanwhile, is a
	// stale DMA (on hardware: silent corruption). Pinned MRs are checked by frames.
	// Costs two cgo calls and a pagemap read per DMA.
	Audit bool
}

// Device is an emulated RDMA NIC. It owns a userfaultfd for its ODP regions, the CPU
// fault server and the key table. Methods are safe for concurrent use.
type Device struct {
	cfg      Config
	uffd     *pagefault.FD
	server   *pagefault.CPUServer
	pagemap  *pagefault.Pagemap
	resolver *pagefault.Resolver
	registry *invalidate.Registry
	pump     *invalidate.Pump
	pager    *invalidate.Pager // nil unless paging
	store    *invalidate.Store
	regMu    sync.Mutex // serialises ODP userfaultfd registration changes
	limit    int64      // pinned byte limit, <0 unlimited

	mu      sync.RWMutex // protects everything below; read-locked for key lookups
	closed  bool
	buffers []buffer       // sorted by start
	mrs     map[uint32]*MR // by key index
	keys    keyAllocator
	pinned  int64            // bytes accounted as pinned (pinned_vm)
	odpRegs []interval.Range // userfaultfd-registered ranges, one per ODP MR
	locked  []interval.Range // mlocked ranges, one per pinned MR
	pds     map[*PD]struct{}
	cqs     map[*CQ]struct{}
	qps     map[*QP]struct{}
	nextQPN uint32

	stats deviceCounters
}

type buffer struct {
	start, end uintptr
	mem        []byte
	paged      *invalidate.Region // nil unless paging
	holes      []interval.Range   // parts the application unmapped itself
}

// unmap unmaps the parts of b the device still owns: an address the application
// unmapped may hold someone else's memory now (the Go heap's, say).
func (b *buffer) unmap(u *pagefault.FD) {
	base := unsafe.Pointer(unsafe.SliceData(b.mem))
	for _, r := range interval.Uncovered(interval.Range{Start: b.start, End: b.end}, b.holes) {
		if u != nil {
			// Our own unmapping needs no UNMAP event; a part that is already gone
			// fails harmlessly.
			_ = u.Unregister(r.Start, r.End-r.Start)
		}
		// The parts are ours and mapped: munmap of them cannot fail.
		_ = unix.MunmapPtr(unsafe.Add(base, r.Start-b.start), r.End-r.Start)
	}
}

// noteEvent is the pump hook: it records UNMAP events in the buffers they hit.
func (d *Device) noteEvent(m pagefault.Msg) {
	if m.Event != pagefault.EventUnmap {
		return
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	for i := range d.buffers {
		b := &d.buffers[i]
		if lo, hi := max(b.start, uintptr(m.Start)), min(b.end, uintptr(m.End)); lo < hi {
			b.holes = append(b.holes, interval.Range{Start: lo, End: hi})
		}
	}
}

// Open opens an emulated device.
func Open(cfg Config) (*Device, error) {
	if cfg.Name == "" {
		cfg.Name = "odpemu0"
	}
	if cfg.FaultAround == 0 {
		cfg.FaultAround = 16
	}
	if cfg.CPUFaultAround == 0 {
		cfg.CPUFaultAround = 1
	}
	if cfg.FaultAround < 1 || cfg.FaultAround > 1<<16 || cfg.FaultAround&(cfg.FaultAround-1) != 0 {
		return nil, wrap(ErrInvalidArgument, "FaultAround %d: want a power of two in [1, 65536]", cfg.FaultAround)
	}
	d := &Device{cfg: cfg, mrs: map[uint32]*MR{}, pds: map[*PD]struct{}{}, cqs: map[*CQ]struct{}{},
		qps: map[*QP]struct{}{}, limit: cfg.MemlockLimit}
	if d.limit == 0 {
		d.limit = memlockLimit()
	}
	if cfg.ResidentBudget < 0 {
		return nil, wrap(ErrInvalidArgument, "ResidentBudget %d", cfg.ResidentBudget)
	}
	if b := cfg.ResidentBudget; b > 0 && (d.limit < 0 || d.limit > b) {
		d.limit = b // what may be resident may be pinned, no more
	}
	if err := checkKernel(cfg, pagefault.ProbeKernelBehaviour()); err != nil {
		return nil, fmt.Errorf("odp: open %s: %w", cfg.Name, err)
	}
	var err error
	feats := pagefault.FeatureEventRemove | pagefault.FeatureEventUnmap | pagefault.FeatureEventRemap
	if p := pagefault.ProbeKernel(); p.Err == nil && p.Mode == pagefault.ModeKernel && !cfg.UserModeOnly {
		feats |= pagefault.FeatureEventFork // needs CAP_SYS_PTRACE
	}
	if d.uffd, err = pagefault.Open(pagefault.Options{Features: feats, UserModeOnly: cfg.UserModeOnly}); err != nil && feats&pagefault.FeatureEventFork != 0 {
		feats &^= pagefault.FeatureEventFork
		d.uffd, err = pagefault.Open(pagefault.Options{Features: feats, UserModeOnly: cfg.UserModeOnly})
	}
	if err != nil {
		return nil, fmt.Errorf("odp: open %s: %w", cfg.Name, err)
	}
	if d.pagemap, err = pagefault.OpenPagemap(); err == nil {
		if d.server, err = pagefault.StartCPUServer(d.uffd, cfg.CPUFaultAround); err == nil {
			d.registry = invalidate.NewRegistry()
			d.registry.SetDisabled(cfg.NoInvalidate)
			if d.pump, err = invalidate.StartPump(d.server, d.registry, cfg.NoInvalidate); err == nil {
				d.pump.SetHook(d.noteEvent)
				if cfg.Paging || cfg.ResidentBudget > 0 {
					if cfg.StorePath != "" {
						d.store, err = invalidate.NewFileStore(cfg.StorePath)
					} else {
						d.store, err = invalidate.NewMemStore()
					}
					if err == nil {
						d.pager = invalidate.NewPager(d.uffd, d.server, d.registry, d.pagemap, d.store,
							invalidate.PagerConfig{Budget: cfg.ResidentBudget, Eligible: d.evictable})
					}
				}
				if err == nil {
					d.resolver, err = pagefault.NewResolver(d.uffd, d.pagemap, pagefault.ZeroSource{})
				}
			}
		}
	}
	if err != nil {
		_ = d.release() // the error that made Open fail is the one to report
		return nil, fmt.Errorf("odp: open %s: %w", cfg.Name, err)
	}
	var seed [4]byte
	_, _ = rand.Read(seed[:]) // crypto/rand.Read never fails (it aborts the program instead)
	d.keys.init(binary.LittleEndian.Uint32(seed[:]))
	return d, nil
}

// requirements lists what the running kernel must offer for cfg: userfaultfd with the
// REMOVE, UNMAP and REMAP events for ODP and its invalidations, write-protect
// registration of anonymous memory (every buffer is registered for events, faults or
// not, so that Free knows what the application unmapped), MADV_POPULATE_WRITE
// for write faults on shared pages and for pinning, and UFFDIO_MOVE for paging (the
// pager moves pages out atomically).
func requirements(cfg Config) []pagefault.Requirement {
	reqs := []pagefault.Requirement{pagefault.ReqUserfaultfd, pagefault.ReqEvents, pagefault.ReqWriteProtect,
		pagefault.ReqPopulateWrite}
	if cfg.Paging || cfg.ResidentBudget > 0 {
		reqs = append(reqs, pagefault.ReqMove)
	}
	return reqs
}

// checkKernel fails with an error matching ErrNotSupported, naming the feature and the
// kernel release that has it, when k lacks something cfg needs.
func checkKernel(cfg Config, k pagefault.Kernel) error {
	if err := k.Check(requirements(cfg)...); err != nil {
		return fmt.Errorf("%w: %w", ErrNotSupported, err)
	}
	return nil
}

// memlockLimit is ib_umem_get's limit: RLIMIT_MEMLOCK unless CAP_IPC_LOCK.
func memlockLimit() int64 {
	if hasCapIPCLock() {
		return -1
	}
	var rl unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_MEMLOCK, &rl); err != nil || rl.Cur == unix.RLIM_INFINITY {
		return -1
	}
	return int64(rl.Cur)
}

func hasCapIPCLock() bool {
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		return false
	}
	return data[unix.CAP_IPC_LOCK/32].Effective&(1<<(unix.CAP_IPC_LOCK%32)) != 0
}

// Name returns the device name.
func (d *Device) Name() string { return d.cfg.Name }

// FaultMode reports which userfaultfd mode serves CPU faults: kernel+user, or
// user-mode-only (then kernel-mode accesses such as read(2) into a missing page of an
// ODP region fail with EFAULT).
func (d *Device) FaultMode() pagefault.Mode { return d.uffd.Mode() }

// PFNsReadable reports whether translations record real page frame numbers.
func (d *Device) PFNsReadable() bool { return d.pagemap.PFNsReadable() }

// Close destroys every QP, CQ, MR and PD of the device, stops the fault server and
// unmaps every buffer from Alloc.
//
// Buffers from Alloc are unmapped by Close: a slice of one must not be used after
// Close returns (a read or write then faults like any access to unmapped memory).
// Parts of them the application unmapped itself are left alone. Close returns the
// errors of the teardown; if the events that tell which parts those are cannot be
// read, it leaves the buffers mapped rather than risk unmapping foreign memory.
func (d *Device) Close() error {
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return ErrClosed
	}
	d.closed = true
	qps := mapKeys(d.qps)
	d.mu.Unlock()
	for _, qp := range qps {
		_ = qp.Destroy() // ErrClosed only: destroyed concurrently
	}
	d.mu.Lock()
	mrs := make([]*MR, 0, len(d.mrs))
	for _, mr := range d.mrs {
		mrs = append(mrs, mr)
	}
	d.mu.Unlock()
	var errs []error
	for _, mr := range mrs {
		if err := mr.Dereg(); err != nil && !errors.Is(err, ErrInvalidArgument) { // deregistered concurrently
			errs = append(errs, err)
		}
	}
	syncErr := d.pump.Sync() // holes the application made are recorded before buffers are unmapped
	d.mu.Lock()
	bufs := d.buffers
	d.buffers = nil
	for cq := range d.cqs {
		cq.killLocked()
	}
	for pd := range d.pds {
		pd.dead.Store(true)
	}
	clear(d.cqs)
	clear(d.pds)
	d.mu.Unlock()
	if d.pager != nil {
		d.pager.Close()
	}
	for _, b := range bufs {
		if b.paged != nil {
			errs = append(errs, b.paged.Remove())
		}
	}
	errs = append(errs, d.release())
	if syncErr != nil {
		errs = append(errs, fmt.Errorf("odp: close %s: buffers left mapped, events unknown: %w", d.cfg.Name, syncErr))
		return errors.Join(errs...)
	}
	for i := range bufs {
		bufs[i].unmap(nil) // the userfaultfd is closed: its registrations went with it
	}
	return errors.Join(errs...)
}

// evictable reports whether pages [start, end) may be evicted or migrated: inside
// ODP registrations (so that a later access faults) and in no pinned MR.
func (d *Device) evictable(start, end uintptr) bool {
	d.mu.RLock()
	defer d.mu.RUnlock()
	r := interval.Range{Start: start, End: end}
	if len(interval.Uncovered(r, d.odpRegs)) > 0 {
		return false
	}
	for _, l := range d.locked {
		if l.Start < end && start < l.End {
			return false
		}
	}
	return true
}

// release stops and closes what Open started, in reverse order, and returns what
// failed. Parts that were never started are skipped.
func (d *Device) release() error {
	var errs []error
	if d.pager != nil {
		d.pager.Close()
	}
	if d.pump != nil {
		d.pump.Stop()
	}
	if d.server != nil {
		errs = append(errs, d.server.Stop())
	}
	if d.resolver != nil {
		errs = append(errs, d.resolver.Close())
	}
	if d.pagemap != nil {
		errs = append(errs, d.pagemap.Close())
	}
	if d.uffd != nil {
		errs = append(errs, d.uffd.Close())
	}
	if d.store != nil {
		errs = append(errs, d.store.Close())
	}
	return errors.Join(errs...)
}

func mapKeys[K comparable, V any](m map[K]V) []K {
	out := make([]K, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	return out
}

// PageSize is the size of the pages that the NIC's translation tables map.
var PageSize = int(pagefault.PageSize)

// Alloc maps n bytes (rounded up to pages) of anonymous memory, the only memory ODP
// regions accept. Pages are not touched: their first use faults.
func (d *Device) Alloc(n int) ([]byte, error) {
	if n <= 0 {
		return nil, wrap(ErrInvalidArgument, "alloc %d bytes", n)
	}
	size := (uintptr(n) + pagefault.PageSize - 1) &^ (pagefault.PageSize - 1)
	p, err := unix.MmapPtr(-1, 0, nil, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_NORESERVE)
	if err != nil {
		return nil, wrap(ErrNoMemory, "mmap %d bytes: %v", size, err)
	}
	mem := unsafe.Slice((*byte)(p), size)
	// userfaultfd installs 4 KiB pages; opting out of THP keeps pinned and ODP
	// buffers alike whatever the system's THP mode (EINVAL: a kernel without THP).
	_ = unix.Madvise(mem, unix.MADV_NOHUGEPAGE)
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		_ = unix.MunmapPtr(p, size) // our own fresh mapping
		return nil, ErrClosed
	}
	b := buffer{start: addrOf(mem), end: addrOf(mem) + size, mem: mem}
	// Registered for events from the start (write-protect mode, nothing protected:
	// faults are the kernel's as usual), so that what the application unmaps or
	// moves away is known, registered as an MR or not, and Free never unmaps it.
	if _, err := d.uffd.Register(b.start, size, pagefault.ModeWP); err != nil {
		_ = unix.MunmapPtr(p, size) // our own fresh mapping
		return nil, fmt.Errorf("odp: register buffer for events: %w", err)
	}
	if d.pager != nil {
		r, err := d.pager.AddRegion(mem)
		if err != nil {
			_ = unix.MunmapPtr(p, size) // our own fresh mapping
			return nil, fmt.Errorf("odp: page buffer: %w", err)
		}
		b.paged = r
	}
	i := sort.Search(len(d.buffers), func(i int) bool { return d.buffers[i].start > b.start })
	d.buffers = append(d.buffers, buffer{})
	copy(d.buffers[i+1:], d.buffers[i:])
	d.buffers[i] = b
	return mem[:n:n], nil
}

// Free unmaps a buffer from Alloc. It fails with ErrBusy while a memory region covers
// it. Parts the application unmapped or moved away itself are left alone: whatever is
// mapped there now is not the buffer's.
func (d *Device) Free(buf []byte) error {
	if len(buf) == 0 {
		return wrap(ErrInvalidArgument, "free of an empty slice")
	}
	// Every UNMAP and REMAP the kernel delivered before this call is recorded in the
	// buffer's holes before they are consulted.
	if err := d.pump.Sync(); err != nil {
		return fmt.Errorf("odp: free: %w", err)
	}
	d.mu.Lock()
	start := addrOf(buf)
	i := sort.Search(len(d.buffers), func(i int) bool { return d.buffers[i].start >= start })
	if i == len(d.buffers) || d.buffers[i].start != start {
		d.mu.Unlock()
		return wrap(ErrInvalidArgument, "%#x is not a buffer from Alloc", start)
	}
	b := d.buffers[i]
	for _, mr := range d.mrs {
		if mr.start < b.end && b.start < mr.start+uintptr(mr.length) {
			d.mu.Unlock()
			return wrap(ErrBusy, "buffer %#x is registered as MR %#x", start, mr.key)
		}
	}
	d.buffers = append(d.buffers[:i], d.buffers[i+1:]...)
	d.mu.Unlock()
	// Retired without d.mu, as Close does: Region.Remove takes the pager's reclaim
	// lock, and reclaim takes d.mu (evictable) while holding it.
	var err error
	if b.paged != nil {
		err = b.paged.Remove()
	}
	b.unmap(d.uffd)
	return err
}

// bufferLocked returns the Alloc buffer holding [start, start+n), if any. Called with
// Device.mu held (read or write).
func (d *Device) bufferLocked(start, n uintptr) (buffer, bool) {
	i := sort.Search(len(d.buffers), func(i int) bool { return d.buffers[i].start > start }) - 1
	if i < 0 || start+n > d.buffers[i].end || start+n < start {
		return buffer{}, false
	}
	return d.buffers[i], true
}

func addrOf(b []byte) uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(b))) }

// PD is a protection domain: MRs and QPs of one PD cannot be used with another's.
type PD struct {
	dev  *Device
	dead atomic.Bool
}

// AllocPD allocates a protection domain.
func (d *Device) AllocPD() (*PD, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil, ErrClosed
	}
	pd := &PD{dev: d}
	d.pds[pd] = struct{}{}
	return pd, nil
}

// Dealloc frees the PD; it fails with ErrBusy while MRs or QPs use it.
func (pd *PD) Dealloc() error {
	d := pd.dev
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, ok := d.pds[pd]; !ok || d.closed {
		return ErrClosed
	}
	for _, mr := range d.mrs {
		if mr.pd == pd {
			return wrap(ErrBusy, "PD has MR %#x", mr.key)
		}
	}
	for qp := range d.qps {
		if qp.pd == pd {
			return wrap(ErrBusy, "PD has QP %d", qp.qpn)
		}
	}
	delete(d.pds, pd)
	pd.dead.Store(true)
	return nil
}

// Device returns the PD's device.
func (pd *PD) Device() *Device { return pd.dev }

// keyAllocator hands out mlx5-style keys: a 24-bit index and an 8-bit variant. A freed
// index waits in a FIFO behind at least keyQuarantine others before reuse, and comes
// back with its variant advanced, so a stale key stays invalid.
type keyAllocator struct {
	next     uint32 // next never-used index
	free     []uint32
	variants map[uint32]uint8
	salt     uint8
}

const (
	keyQuarantine = 64
	maxKeyIndex   = 1<<24 - 1
)

func (k *keyAllocator) init(seed uint32) {
	k.next = 1 + seed%(1<<16) // start at a random index
	k.salt = uint8(seed >> 24)
	k.variants = map[uint32]uint8{}
}

func (k *keyAllocator) alloc() (uint32, bool) {
	var idx uint32
	if len(k.free) > keyQuarantine {
		idx, k.free = k.free[0], k.free[1:]
	} else if k.next <= maxKeyIndex {
		idx = k.next
		k.next++
		k.variants[idx] = k.salt ^ uint8(idx*0x9e)
	} else {
		return 0, false
	}
	return idx<<8 | uint32(k.variants[idx]), true
}

func (k *keyAllocator) release(key uint32) {
	idx := key >> 8
	k.variants[idx]++
	k.free = append(k.free, idx)
}

// deviceCounters are updated atomically.
type deviceCounters struct {
	faults, pagesFaulted, faultRetries, faultNanos atomic.Uint64
	invalidations, pagesInvalidated                atomic.Uint64
	prefetches, pagesPrefetched                    atomic.Uint64
	mrsPinned, mrsODP                              atomic.Uint64
	audited, stale, dmaFaults, dmaWaits            atomic.Uint64
	overtaken                                      atomic.Uint64
}

// Stats are a device's counters, named after mlx5's ODP counters.
type Stats struct {
	PageFaults           uint64        // network page fault events
	PagesFaulted         uint64        // pages mapped by faults (page_faults_handled)
	FaultRetries         uint64        // faults that lost a race with an invalidation
	FaultTime            time.Duration // time spent resolving network page faults
	Invalidations        uint64
	PagesInvalidated     uint64
	Prefetches           uint64
	PagesPrefetched      uint64
	PinnedBytes          int64
	CPUFaults            uint64 // faults taken by application threads, served in C
	CPUFaultPages        uint64
	CPUFaultTime         time.Duration
	CPUFaultMax          time.Duration
	CPUFaultsFoundMapped uint64 // CPU faults on pages the NIC had installed meanwhile

	Events              uint64        // userfaultfd REMOVE, UNMAP and REMAP events read
	EventsIgnored       uint64        // of which dropped by the NoInvalidate ablation
	InvalidationLatency time.Duration // sum over events: event read to entries cleared, DMA drained
	InvalidationMax     time.Duration
	Forks               uint64 // fork events: every ODP translation was dropped
	DMAWaits            uint64 // invalidations that waited for DMA in flight
	AuditedDMAs         uint64 // DMAs checked by the audit
	StaleDMAs           uint64 // audit violations: copies through stale translations
	OvertakenDMAs       uint64 // of which: DMAs an invalidation of their range completed under
	DMAFaults           uint64 // copies that hit unmapped memory (reported as access errors)

	Evictions        uint64 // pages written to the backing store and dropped
	BytesWrittenBack uint64
	EvictionAborts   uint64 // evictions abandoned because the page was touched meanwhile
	Migrations       uint64 // pages moved to new frames
	Restores         uint64 // evicted pages brought back (CPU and NIC faults)
	ResidentPages    int64  // the pager's estimate of resident ODP pages
}

// Stats returns the device's counters.
func (d *Device) Stats() Stats {
	s, _ := d.server.Stats() // after Close the fault server's counters read as zero
	ps := d.pump.Stats()
	d.mu.Lock()
	pinned := d.pinned
	d.mu.Unlock()
	c := &d.stats
	st := Stats{
		PageFaults: c.faults.Load(), PagesFaulted: c.pagesFaulted.Load(), FaultRetries: c.faultRetries.Load(),
		FaultTime: time.Duration(c.faultNanos.Load()), Invalidations: c.invalidations.Load(),
		PagesInvalidated: c.pagesInvalidated.Load(), Prefetches: c.prefetches.Load(),
		PagesPrefetched: c.pagesPrefetched.Load(), PinnedBytes: pinned,
		CPUFaults: s.Faults, CPUFaultPages: s.Pages, CPUFaultTime: s.ServiceTime, CPUFaultMax: s.MaxServiceTime,
		CPUFaultsFoundMapped: s.Exist,
		Events:               ps.Events, EventsIgnored: ps.Ignored, InvalidationLatency: ps.Latency, InvalidationMax: ps.MaxLat,
		Forks: ps.Forks, DMAWaits: c.dmaWaits.Load(),
		AuditedDMAs: c.audited.Load(), StaleDMAs: c.stale.Load(), OvertakenDMAs: c.overtaken.Load(), DMAFaults: c.dmaFaults.Load(),
	}
	if d.pager != nil {
		pg := d.pager.Stats()
		st.Evictions, st.BytesWrittenBack, st.EvictionAborts = pg.Evictions, pg.WrittenBack, pg.Aborts
		restored, _ := d.server.Restored() // zero after Close
		st.Migrations, st.Restores, st.ResidentPages = pg.Migrations, pg.Restores+restored, pg.Resident
	}
	return st
}

// SyncEvents returns once every userfaultfd event raised before the call (by a
// madvise, munmap or mremap that has returned) has been applied to the NIC's tables.
func (d *Device) SyncEvents() error { return d.pump.Sync() }

// Invalidate invalidates the NIC's translations of [addr, addr+length) in every ODP MR
// of the device, waiting for DMA in flight on them: the next access faults afresh.
// With NoInvalidate it does nothing.
func (d *Device) Invalidate(addr, length uint64) error {
	r, err := pageRange(addr, length)
	if err != nil {
		return err
	}
	_, err = d.registry.Invalidate(r, invalidate.ReasonExplicit, nil)
	return err
}

// Discard drops the pages of b (madvise MADV_DONTNEED), which must lie in a buffer from
// Alloc, in the kernel's order: the NIC's translations are invalidated and DMA on them
// drained first, faults are held off while the pages are dropped, and the next access
// faults in zero-filled pages. With NoInvalidate the pages are dropped without telling
// the NIC.
func (d *Device) Discard(b []byte) error {
	if len(b) == 0 {
		return wrap(ErrInvalidArgument, "discard of an empty slice")
	}
	r, err := pageRange(uint64(addrOf(b)), uint64(len(b)))
	if err != nil {
		return err
	}
	d.mu.RLock()
	_, ok := d.bufferLocked(r.Start, r.End-r.Start)
	d.mu.RUnlock()
	if !ok {
		return wrap(ErrNotMmapped, "discard %#x+%d", r.Start, len(b))
	}
	zap := func() error {
		if _, _, e := unix.Syscall(unix.SYS_MADVISE, r.Start, r.End-r.Start, unix.MADV_DONTNEED); e != 0 {
			return fmt.Errorf("odp: madvise: %w", e)
		}
		return nil
	}
	if d.pager != nil {
		inner := zap
		zap = func() error { // evicted copies are forgotten: a discarded page is zero
			d.pager.DiscardedLocked(r.Start, r.End)
			err := inner() // the CPU fault server forgets them again as it reads the event
			d.pager.DiscardedLocked(r.Start, r.End)
			return err
		}
	}
	run := func() error {
		_, err := d.registry.Invalidate(r, invalidate.ReasonDiscard, zap)
		return err
	}
	if d.pager != nil {
		return d.pager.Exclusive(run) // no eviction between forgetting and dropping
	}
	return run()
}

// Evict writes the present pages of [addr, addr+length) in ODP memory to the backing
// store and drops them, invalidating the NIC's entries first; the next access faults
// them back with their content. Needs Config.Paging or a ResidentBudget.
func (d *Device) Evict(addr, length uint64) (int, error) {
	if d.pager == nil {
		return 0, wrap(ErrNotSupported, "Evict without Config.Paging")
	}
	r, err := pageRange(addr, length)
	if err != nil {
		return 0, err
	}
	return d.pager.Evict(r.Start, r.End)
}

// Migrate moves the present pages of [addr, addr+length) in ODP memory to new page
// frames, invalidating the NIC's entries first (compaction, NUMA balancing). Needs
// Config.Paging or a ResidentBudget.
func (d *Device) Migrate(addr, length uint64) (int, error) {
	if d.pager == nil {
		return 0, wrap(ErrNotSupported, "Migrate without Config.Paging")
	}
	r, err := pageRange(addr, length)
	if err != nil {
		return 0, err
	}
	return d.pager.Migrate(r.Start, r.End)
}

// pageRange rounds [addr, addr+length) out to pages.
func pageRange(addr, length uint64) (invalidate.Range, error) {
	end := addr + length
	if length == 0 || end < addr || end > uint64(^uintptr(0))-uint64(pagefault.PageSize) {
		return invalidate.Range{}, wrap(ErrInvalidArgument, "range %#x+%d", addr, length)
	}
	ps := pagefault.PageSize
	return invalidate.Range{Start: uintptr(addr) &^ (ps - 1), End: (uintptr(end) + ps - 1) &^ (ps - 1)}, nil
}

// ResidentBytes returns how many bytes of b (memory from Alloc) are resident now,
// counted from the page tables.
func (d *Device) ResidentBytes(b []byte) int64 {
	if len(b) == 0 {
		return 0
	}
	start := addrOf(b) &^ (pagefault.PageSize - 1)
	n := int((addrOf(b) + uintptr(len(b)) - start + pagefault.PageSize - 1) / pagefault.PageSize)
	const chunk = 4096
	entries := make([]pagefault.PagemapEntry, min(chunk, n))
	var resident int64
	for first := 0; first < n; first += chunk {
		k := min(chunk, n-first)
		if d.pagemap.Read(start+uintptr(first)*pagefault.PageSize, entries[:k]) != nil {
			return -1
		}
		for _, e := range entries[:k] {
			if e.Present() {
				resident += int64(pagefault.PageSize)
			}
		}
	}
	return resident
}
