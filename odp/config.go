package odp

// A device's settings and what they need of the running kernel.

import (
	"errors"
	"fmt"

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
	// RegModel is the firmware's cost of memory keys (see RegModel): the zero value
	// adds nothing.
	RegModel RegModel
	// PrefetchLimit bounds the bytes a responder's network page fault on a WRITE
	// maps past the faulting packets (toward the end of the message): 0 is
	// DefaultPrefetchLimit, negative none.
	PrefetchLimit int64
	// ImplicitChild is the size of an implicit ODP MR's children (see Profile): 0
	// is DefaultImplicitChild.
	ImplicitChild int64
	// RdAtomic is how many READs and atomics a QP may have outstanding as a
	// requester and keep as a responder (the device's max_qp_init_rd_atom and
	// max_qp_rd_atom), a power of two up to MaxRdAtomicLimit, and what a new QP
	// takes (QPAttr's MaxRdAtomic and MaxDestRdAtomic): 0 is DefaultRdAtomic,
	// mlx5's 16.
	RdAtomic int
	// A Profile sets FaultModel, Link, ResponderFaults, RegModel, PrefetchLimit,
	// ImplicitChild and RdAtomic together (Profile.Apply).
}

// requirements lists what the running kernel must offer for cfg: userfaultfd with the
// REMOVE, UNMAP and REMAP events for ODP and its invalidations, write-protect
// registration of anonymous memory (every buffer is registered for events, faults or
// not, so that Free knows what the application unmapped), MADV_POPULATE_WRITE
// for write faults on shared pages and for pinning, and UFFDIO_MOVE for paging (the
// pager moves pages out atomically). A process that may not create a userfaultfd at
// all (pagefault.ErrRefused: a container's seccomp profile, a kernel without it) gets
// a device without on-demand paging, whose memory is pinned (pinnedOnly); paging
// still needs one.
func requirements(cfg Config, k pagefault.Kernel) []pagefault.Requirement {
	if pinnedOnly(cfg, k) {
		return []pagefault.Requirement{pagefault.ReqPopulateWrite}
	}
	reqs := []pagefault.Requirement{pagefault.ReqUserfaultfd, pagefault.ReqEvents, pagefault.ReqWriteProtect,
		pagefault.ReqPopulateWrite}
	if cfg.Paging || cfg.ResidentBudget > 0 {
		reqs = append(reqs, pagefault.ReqMove)
	}
	return reqs
}

// pinnedOnly reports whether a device of cfg opens without on-demand paging: k says
// this process may not create a userfaultfd, and cfg does not page.
func pinnedOnly(cfg Config, k pagefault.Kernel) bool {
	return errors.Is(k.Userfaultfd.Err, pagefault.ErrRefused) && !cfg.Paging && cfg.ResidentBudget == 0
}

// checkKernel fails with an error matching ErrNotSupported, naming the feature and the
// kernel release that has it, when k lacks something cfg needs.
func checkKernel(cfg Config, k pagefault.Kernel) error {
	if err := k.Check(requirements(cfg, k)...); err != nil {
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

// FaultPolicy is what a responder does when a request finds its ODP pages missing.
type FaultPolicy int

// The responder fault policies.
const (
	// FaultRNR drops the request and answers RNR NAK, as mlx5 does: the page fault
	// is resolved meanwhile, and the requester retransmits after its RNR timer, up to
	// RNRRetry times, then fails the request with RNR_RETRY_EXC_ERR. A SEND or WRITE
	// with immediate that finds no receive posted is answered the same way. The
	// default.
	FaultRNR FaultPolicy = iota
	// FaultStall resolves the fault before answering: the requester never sees it
	// but as latency. A SEND or WRITE with immediate that finds no receive posted
	// is answered RNR NAK, as rxe does.
	FaultStall
)

// String returns "rnr" or "stall".
func (p FaultPolicy) String() string {
	switch p {
	case FaultRNR:
		return "rnr"
	case FaultStall:
		return "stall"
	}
	return fmt.Sprintf("FaultPolicy(%d)", int(p))
}
