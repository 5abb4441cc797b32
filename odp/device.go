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
// # Inner shape
//
// The files stand on six floors. A file uses what its own floor and the floors
// below declare, never what a floor above declares (TestFileFloors checks it with
// the type checker):
//
//	floor                      files                              what they hold
//	5 verbs                    device pd memory cq qp cm counters the public surface: Open, AllocPD, RegMR,
//	                                                              Alloc/Free/MapFile, CreateCQ, CreateQP,
//	                                                              CreateSRQ, AllocMW, PostSend, Poll,
//	                                                              counters
//	4 the engine               cqring qpcontext srqcontext checks a QP as the NIC holds it (state, queues),
//	                           engine requester responder ud      an SRQ's receives, the engine goroutine (a
//	                           mwbind                             UD QP's: ud), the CQ ring it fills, memory
//	                                                              window binds and invalidations
//	3 DMA                      dma latezap                        copies under the table check and the gate,
//	                                                              the audit, zaps that came late
//	2 registration and faults  mr register notifier fault        nic (a device as its MRs see it), MRs,
//	                           implicit file advise mw            memory windows, keys, the notifier,
//	                                                              network page faults, prefetch
//	1 the address space        space buffer filemap zapwindow     the process's userfaultfd, fault server,
//	                                                              pump, pager, buffers and file mappings,
//	                                                              REMOVEs whose zap may be late
//	0 vocabulary               errors access config faultmodel    types every floor names: work requests,
//	                           profile link qpstate wr wc caps    completions, settings (a NIC's profile
//	                           stats keys procmem                 among them), counters, the key table,
//	                                                              memory reached by address
//
// Nothing below the verbs floor holds a Device, a PD or a QP's owner: a Device embeds
// nic (settings, address space, MR table, counters), a PD embeds domain (what MRs and
// QPs are checked against), and a QP or CQ is taken off its device's lists through a
// function its creator set (unlistLocked). A network page fault passes through
// dma.go (the miss), fault.go (networkFault, fault) and the address space
// (pagefault's resolver or fault server) and back; the engine only starts it.
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
//	Device.mu (nic.mu)       a device's MRs, keys, PDs, CQs, QPs, pinned accounting
//	nic.mwMu                 memory windows' bindings (the engines take it alone)
//	space.mu                 the address space's buffers, ODP and locked ranges
//	paging.Pager.rmu     the pager's region list (Alloc adds a region under space.mu)
//	QP.mu                    a QP's state, queues and pending WRs
//	SRQ.mu                   a shared receive queue's receives and QPs (a QP takes
//	                         a receive under QP.mu; CreateQP and SRQ.Destroy take it
//	                         under Device.mu)
//	sendQueue.mu             a QP's posters (PostSend); a flush or a reset takes it
//	                         under QP.mu, and a flush pushes completions under it
//	CQ.mu                    a CQ's ring (completions are pushed under QP.mu; CreateQP
//	                         and CQ.Destroy take it under Device.mu); an armed CQ's
//	                         notification (RequestNotify) runs under it and takes nothing
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
// invalidate.Pump's, the work queues' (internal/fifo), zapWindow.mu (the REMOVEs a DMA
// looks through for a late zap, holding the DMA gate and nothing else). No lock is held across a DMA
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
// queue ring, atomics and a wake-up; MR keys are looked up in nic.keyed, the
// mkey table, an array read with atomic loads that mirrors Device.mrs (written
// under Device.mu).
//
// The DMA gate (pagefault.Gate) is held like a shared lock from a DMA's table check
// to its end (enterDMA, endDMA): the fault server's reader waits for it before it
// reads an event. A goroutine takes it holding no lock and, while it holds it, takes
// only a table lock, the pager's region lock (access bits), the CPUServer's lock
// (the fault ring) and zapWindow.mu, and never waits for the pump, a network page fault or an
// install: those happen outside it (beginDMA leaves the gate before it faults).
package odp

import (
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/odpemu/odpemu/pagefault"
)

// Device is an emulated RDMA NIC: its keys, protection domains, MRs, CQs, QPs and
// counters. The address space it works in (the userfaultfd, the CPU fault server, the
// event pump, the notifier registry, the pager and the buffers from Alloc) is the
// process's, shared with every device opened with the same address-space settings
// (see Config). Methods are safe for concurrent use.
type Device struct {
	nic // the NIC's side: what its MRs, faults, DMAs and engines share

	// Protected by nic.mu (Device.mu):
	pds map[*PD]struct{}
	cqs map[*CQ]struct{}
	qps map[*QP]struct{}
}

// Open opens an emulated device. Devices whose address-space settings agree
// (UserModeOnly, NoInvalidate, Paging, ResidentBudget, StorePath, CPUFaultAround)
// share the process's address space: memory from one's Alloc can be registered on the
// others.
//
// Where the process may not create a userfaultfd (pagefault.ErrRefused: a container's
// default seccomp profile, a kernel without it), the device opens without on-demand
// paging: QueryDevice reports no ODP caps, AccessOnDemand and implicit MRs fail with
// ErrNotSupported, FaultMode is pagefault.ModeNone, and pinned memory works as
// everywhere; a Config that pages fails with ErrNotSupported.
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
	if err := cfg.checkProfile(); err != nil {
		return nil, err
	}
	cfg = cfg.normalized()
	d := &Device{nic: nic{cfg: cfg, mrs: map[uint32]*MR{}, mws: map[uint32]*MW{}, limit: cfg.MemlockLimit}, pds: map[*PD]struct{}{},
		cqs: map[*CQ]struct{}{}, qps: map[*QP]struct{}{}}
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

// Name returns the device name.
func (d *Device) Name() string { return d.cfg.Name }

// FaultMode reports which userfaultfd mode serves CPU faults: kernel+user, or
// user-mode-only (then kernel-mode accesses such as read(2) into a missing page of an
// ODP region fail with EFAULT).
func (d *Device) FaultMode() pagefault.Mode {
	if d.as.uffd == nil {
		return pagefault.ModeNone
	}
	return d.as.uffd.Mode()
}

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
	for _, mw := range d.mws { // unbound first: an MR with windows bound stays
		mw.deallocLocked()
	}
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
	errs = append(errs, d.as.release(d, d.cfg.Name))
	return errors.Join(errs...)
}

func mapKeys[K comparable, V any](m map[K]V) []K {
	out := make([]K, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	return out
}

// QueryDevice reports the device's limits and capabilities. The NIC's atomics are
// the CPU's atomic instructions on the registered memory, so they are atomic with
// the application's atomics too (AtomicGlob). Every RC operation works on ODP memory,
// explicit or implicit (RegImplicitMR), and so do receives from an SRQ, UC's SENDs
// and WRITEs (a fault holds the UC QP: it has no RNR NAK) and UD's SENDs.
func (d *Device) QueryDevice() DeviceAttr {
	return DeviceAttr{
		Name: d.cfg.Name, PageSize: PageSize, MaxMRSize: maxMRSize, MaxMsgSize: maxMsg, MaxQPWR: maxQPWR,
		MaxSGE: maxSGE, MaxInlineData: maxInline, MaxCQE: maxCQE, AtomicCap: AtomicGlob,
		MaxQPRdAtom: d.cfg.RdAtomic, MaxQPInitRdAtom: d.cfg.RdAtomic, MaxSRQWR: maxQPWR, MaxSRQSGE: maxSGE,
		ODP:             d.odpCaps(),
		ResponderFaults: d.cfg.ResponderFaults,
	}
}
