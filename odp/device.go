// Package odp is odpemu's verbs-like API: devices, protection domains, memory regions
// registered pinned or on demand (ODP), completion queues and RC queue pairs that post
// RDMA WRITE (with and without immediate), RDMA READ, SEND (with and without
// immediate) and the atomics compare-and-swap and fetch-and-add between emulated
// NICs, in one process or over RoCEv2/UDP.
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
//	QP.attrMu                orders ModifyAttr calls
//	space.regMu              ODP userfaultfd registration changes (registerODP, Dereg,
//	                         RegImplicitMR) in the address space
//	paging.Pager.reclaimMu  one evictor at a time; Discard, Evict, Migrate, Restore
//	invalidate.Registry.mu   held for reading while notifiers run
//	mmu.Table.mu             an MR's table lock (umem_mutex); notifiers take it
//	Device.mu                a device's MRs, keys, PDs, CQs, QPs, pinned accounting
//	space.mu                 the address space's buffers, ODP and locked ranges
//	paging.Pager.rmu     the pager's region list (Alloc adds a region under space.mu)
//	QP.mu                    a QP's state, queues and pending WRs
//	CQ.mu                    a CQ's ring (completions are pushed under QP.mu; CreateQP
//	                         and CQ.Destroy take it under Device.mu)
//
// MRs over a shared file mapping (MapFile) are not registered with userfaultfd: their
// faults populate the page cache with madvise and their DMA copies use
// process_vm_readv/writev, so that no goroutine touches a page that a FUSE server of
// this process must fill. A filesystem's change reaches them through FileChanged,
// which runs the registry's invalidation holding no lock.
//
// The address space (space) is shared by the devices opened with the same settings;
// its locks are taken by any of them. spacesMu, the list of address spaces, is taken
// by Open and Close holding no other lock; a space's release takes space.mu under it.
// Device.mu and QP.mu are never held together, nor is Device.mu or space.mu held
// while a table lock is taken. Leaf locks, under which nothing else is taken: pagefault.CPUServer's,
// invalidate.Pump's, the work queues' (internal/fifo). No lock is held across a DMA
// copy, and no goroutine holds a lock while it waits for the C fault server except
// through ioctls that return EAGAIN, and through the server's own mutexes (region
// slots, evictable flags, the store), which only C code holds, for a bounded time.
// Functions named ...Locked say which lock they need.
//
// A connected QP's engine (engine.go) is one goroutine that owns the QP's RC state
// machines, its send queue from the processing cursor on and the runs on its
// port: it takes no lock for them. It takes QP.mu once per received message (the
// receive queue) and per completion, a table lock only through the fault path,
// never two of the locks above at once, and never waits for another engine: a
// network page fault runs on a goroutine of its own (startFault), and the DMA gate
// is entered with TryEnter. The application reaches the engine through the send
// queue ring, atomics and a wake-up; MR keys are looked up in Device.keyed, the
// mkey table, an array read with atomic loads that mirrors Device.mrs (written
// under Device.mu).
//
// The DMA gate (pagefault.Gate) is held like a shared lock from a DMA's table check
// to its end (enterDMA, endDMA): the fault server's reader waits for it before it
// reads an event. A goroutine takes it holding no lock and, while it holds it, takes
// only a table lock, the pager's region lock (access bits) and the CPUServer's lock
// (the fault ring), and never waits for the pump, a network page fault or an
// install: those happen outside it (beginDMA leaves the gate before it faults).
package odp

import (
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"sync"

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
	// ResidentBudget bounds, in bytes, the resident pages of ODP memory, whoever
	// touches them: the NIC's faults reclaim first (CLOCK over the NIC's access bits),
	// the application's CPU faults are served by a fault server that evicts a batch to
	// the backing store before it installs past the budget, and a background reclaimer
	// keeps room. Faults bring evicted pages back with their content. The bound holds
	// for memory an ODP MR registers and no pinned MR locks; the server installs past
	// it only when it finds nothing evictable in time (Stats.Overshoot). Pinned
	// registrations are limited to the budget too. 0: no budget.
	ResidentBudget int64
	// Paging enables the backing store, Evict and Migrate without a budget.
	Paging bool
	// StorePath puts the backing store in a new file at this path instead of in
	// memory (a memfd, which is outside the process's RSS).
	StorePath string
	// ResponderFaults is what a responder does when a request finds its ODP pages
	// missing: answer RNR NAK and resolve the fault meanwhile (FaultRNR, mlx5's
	// behaviour and the default) or resolve it before answering (FaultStall).
	ResponderFaults FaultPolicy
	// Audit checks every DMA after the copy: a copy during which a page of an ODP
	// range was installed anew (a CPU fault found it missing) or whose recorded frame
	// is no longer the page's frame, with no invalidation observed meanwhile, is a
	// stale DMA (on hardware: silent corruption). Pinned MRs are checked by frames.
	// Costs two cgo calls and a pagemap read per DMA.
	Audit bool
	// FaultModel is the latency of a network page fault on the NIC's fault path (see
	// FaultModel): the zero value is the emulator's own cost.
	FaultModel FaultModel
	// Link is the link the device's QPs send on (rate, delay, queue): the zero value
	// is DefaultLinkRate and DefaultLinkDelay; NoLink removes the model.
	Link LinkModel
}

// Device is an emulated RDMA NIC: its keys, protection domains, MRs, CQs, QPs and
// counters. The address space it works in (the userfaultfd, the CPU fault server, the
// event pump, the notifier registry, the pager and the buffers from Alloc) is the
// process's, shared with every device opened with the same address-space settings
// (see Config). Methods are safe for concurrent use.
type Device struct {
	cfg   Config
	as    *space
	limit int64 // pinned byte limit, <0 unlimited
	// background counts asynchronous prefetches in flight; Close waits for them.
	// Added to under mu, while not closed.
	background sync.WaitGroup

	mu     sync.RWMutex // protects everything below; read-locked for key lookups
	closed bool
	mrs    map[uint32]*MR // by key index; every change is mirrored in keyed
	// keyed maps key indices to MRs like mrs, for the engines' lookups of every
	// work request and request without a lock (written under mu).
	keyed   mkeyTable
	keys    keyAllocator
	pinned  int64 // bytes accounted as pinned (pinned_vm)
	pds     map[*PD]struct{}
	cqs     map[*CQ]struct{}
	qps     map[*QP]struct{}
	nextQPN uint32

	stats deviceCounters
	rc    rcCounters // RC events of all its QPs
	// faulting counts network page faults resolving on goroutines of their own;
	// Close waits for them.
	faulting sync.WaitGroup
}

// Open opens an emulated device. Devices whose address-space settings agree
// (UserModeOnly, NoInvalidate, Paging, ResidentBudget, StorePath, CPUFaultAround)
// share the process's address space: memory from one's Alloc can be registered on the
// others.
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
	if cfg.ResponderFaults != FaultRNR && cfg.ResponderFaults != FaultStall {
		return nil, wrap(ErrInvalidArgument, "ResponderFaults %v", cfg.ResponderFaults)
	}
	if err := cfg.FaultModel.check(); err != nil {
		return nil, err
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
	if d.as, err = acquireSpace(cfg.space()); err != nil {
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
func (d *Device) FaultMode() pagefault.Mode { return d.as.uffd.Mode() }

// PFNsReadable reports whether translations record real page frame numbers.
func (d *Device) PFNsReadable() bool { return d.as.pagemap.PFNsReadable() }

// Close destroys every QP, CQ, MR and PD of the device and unmaps the buffers it
// allocated with Alloc, but for those another device's MR still covers (they stay
// mapped until the last device of the address space closes).
//
// A slice of an unmapped buffer must not be used after Close returns (a read or write
// then faults like any access to unmapped memory). Parts the application unmapped
// itself are left alone. Close returns the errors of the teardown; if the events that
// tell which parts those are cannot be read, it leaves the buffers mapped rather than
// risk unmapping foreign memory.
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
	d.faulting.Wait() // network page faults the engines started end
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
	d.background.Wait() // background prefetches end: their MRs are gone
	d.mu.Lock()
	for cq := range d.cqs {
		cq.killLocked()
	}
	for pd := range d.pds {
		pd.dead.Store(true)
	}
	clear(d.cqs)
	clear(d.pds)
	d.mu.Unlock()
	errs = append(errs, d.as.release(d))
	return errors.Join(errs...)
}

func mapKeys[K comparable, V any](m map[K]V) []K {
	out := make([]K, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	return out
}
