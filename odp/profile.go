package odp

import (
	"fmt"
	"strings"
	"time"

	"github.com/odpemu/odpemu/internal/bytesize"
	"github.com/odpemu/odpemu/pagefault"
)

// Profile is one NIC's costs and behaviours where they decide an ODP result, bundled
// and named, so that an experiment runs "as a ConnectX-4" or "as rxe" rather than
// with one fault latency picked by hand: what a network page fault costs
// (FaultModel), the link (LinkModel), what a responder does on a fault
// (ResponderFaults), what the firmware's memory keys cost (RegModel), how far a
// responder's fault reaches past the faulting packets (PrefetchLimit), the size
// of an implicit ODP MR's children (ImplicitChild), and how many READs and atomics
// a QP may have outstanding (RdAtomic).
//
// Apply sets them on a Config. The zero value is the emulator's own costs with
// odp's defaults, as ProfileEmulator. The presets (Profiles) say in Source where
// each number comes from; a number no stored source gives is the emulator's
// default, and the Source says so.
type Profile struct {
	Name   string
	Source string // where the numbers come from
	Fault  FaultModel
	Link   LinkModel
	// ResponderFaults is the responder's fault policy: RNR NAK (mlx5) or stall (rxe).
	ResponderFaults FaultPolicy
	Reg             RegModel
	// PrefetchLimit bounds the bytes a responder's fault on a WRITE maps past the
	// faulting packets, toward the end of the WRITE's message: 0 is
	// DefaultPrefetchLimit (mlx5's MAX_PREFETCH_LEN), negative none (the faulting
	// packets' pages alone, as rxe faults per packet).
	PrefetchLimit int64
	// ImplicitChild is the size of the children an implicit ODP MR is made of
	// (a power of two of at least a page): the first network page fault in a
	// child creates it, at the cost of a registration (RegModel.Reg). 0 is
	// DefaultImplicitChild (mlx5's 1 GiB).
	ImplicitChild int64
	// RdAtomic is the READs and atomics a QP may have outstanding and keep
	// (Config.RdAtomic): 0 is DefaultRdAtomic (mlx5's 16).
	RdAtomic int
}

// RegModel is what the NIC's firmware adds to registering and deregistering memory:
// creating a memory key (and writing its context) and destroying it, on top of the
// host's work that the emulator does for real (pinning, userfaultfd registration,
// the translation table). A registration takes Reg longer, a deregistration Dereg
// longer; an implicit ODP MR's child costs Reg when a fault creates it and Dereg
// when the MR goes. The zero value adds nothing: the emulator's own cost.
type RegModel struct {
	Reg, Dereg time.Duration
}

// String says "reg X, dereg Y", or "none".
func (m RegModel) String() string {
	if m == (RegModel{}) {
		return "none"
	}
	return fmt.Sprintf("reg %v, dereg %v", m.Reg, m.Dereg)
}

func (m RegModel) check() error {
	if m.Reg < 0 || m.Dereg < 0 || m.Reg > time.Second || m.Dereg > time.Second {
		return wrap(ErrInvalidArgument, "RegModel %v: costs must be in [0, 1 s]", m)
	}
	return nil
}

// The defaults of Config.PrefetchLimit and Config.ImplicitChild: mlx5's.
const (
	// DefaultPrefetchLimit is mlx5's MAX_PREFETCH_LEN (drivers/infiniband/hw/mlx5/odp.c):
	// a responder's RDMA fault maps up to 4 MiB of the request.
	DefaultPrefetchLimit = 4 << 20
	// DefaultImplicitChild is mlx5's implicit ODP child, 1 GiB (MLX5_IMR_MTT_BITS).
	DefaultImplicitChild = 1 << 30
)

// mlx5Reg is an mlx5 memory key's cost as the Linux commit that caches every user
// mkey on deregistration measured it (dd1b913fb0d0, "RDMA/mlx5: Cache all user
// cacheable mkeys on dereg MR flow", 2023): 100,000 MRs re-registered in about 5 s
// and deregistered in about 4 s with mkeys from the cache (about 50 and 40 us
// each), 28 s and 20 s without. The cached figures bound the firmware's share of
// a registration from above (they include the host's work for small MRs).
var mlx5Reg = RegModel{Reg: 50 * time.Microsecond, Dereg: 40 * time.Microsecond}

// The profile presets.
var (
	// ProfileEmulator is the emulator's own costs: its network page faults (4-6 us
	// on a 2-core VM), the default link, RNR NAKs on faults as mlx5, no firmware
	// cost, mlx5's prefetch limit and implicit children.
	ProfileEmulator = Profile{Name: "emulator", Fault: FaultModelEmulator,
		Source: "the emulator's own fault and registration costs; odp's default link (100 Gb/s, 2 us); mlx5's RNR NAKs, prefetch limit and implicit children"}
	// ProfileConnectX4 is a ConnectX-4 (FaultModelConnectX4) with mlx5's policy,
	// limits and memory key costs.
	ProfileConnectX4 = Profile{Name: "connectx4", Fault: FaultModelConnectX4, Reg: mlx5Reg,
		Source: "faults: Lesokhin et al., ASPLOS'17 (220 us per 4 KiB fault, about 350 us per 4 MiB); " +
			"mkeys: Linux dd1b913fb0d0 (about 50 us per registration, 40 us per deregistration, from the mkey cache); " +
			"mlx5's RNR NAKs, 4 MiB prefetch limit and 1 GiB implicit children (drivers/infiniband/hw/mlx5/odp.c); odp's default link"}
	// ProfileNPRDMA is a minor page fault handled in software beside a commodity
	// mlx5 NIC, as NP-RDMA reports it (FaultModelNPRDMA, 5.7 us).
	ProfileNPRDMA = Profile{Name: "np-rdma", Fault: FaultModelNPRDMA, Reg: mlx5Reg,
		Source: "faults: NP-RDMA (arXiv:2310.11062), 3.5-5.7 us per minor fault, the upper bound; the rest as connectx4"}
	// ProfileNPRDMAMajor is NP-RDMA's major fault (the page comes from swap): 60 us.
	ProfileNPRDMAMajor = Profile{Name: "np-rdma-major", Fault: FaultModelNPRDMAMajor, Reg: mlx5Reg,
		Source: "faults: NP-RDMA (arXiv:2310.11062), 60 us per major fault; the rest as connectx4"}
	// ProfileProduction is a device I/O page fault as production measured it: Wang
	// et al. report about 700 us per fault on average (FaultModelProduction).
	ProfileProduction = Profile{Name: "production", Fault: FaultModelProduction, Reg: mlx5Reg,
		Source: "faults: Wang et al., \"To PRI or Not To PRI\", OSDI'25, 700 us per actual I/O page fault on average over production VMs; the rest as connectx4"}
	// ProfileRXE is Soft-RoCE with ODP (Linux 6.15 on): the responder resolves a
	// fault before it answers, in its own work queue, and never RNR NAKs for it
	// (rxe_odp.c); each packet faults its own pages (no prefetch); no firmware.
	ProfileRXE = Profile{Name: "rxe", Fault: FaultModel{Name: "rxe"}, ResponderFaults: FaultStall, PrefetchLimit: -1,
		ImplicitChild: 2 << 20, RdAtomic: MaxRdAtomicLimit,
		Source: "rxe_odp.c (Linux 6.15): faults resolved synchronously by the responder, no RNR NAK, per packet; " +
			"its fault cost is the kernel's (the emulator's own here); no firmware; implicit children of 2 MiB as the 2026 RFC has them " +
			"(rxe itself refuses implicit ODP); 128 READs and atomics outstanding (rxe_param.h); odp's default link, not rxe's CPU-bound rate"}
)

// Profiles returns the presets, the default (ProfileEmulator) first.
func Profiles() []Profile {
	return []Profile{ProfileEmulator, ProfileConnectX4, ProfileNPRDMA, ProfileNPRDMAMajor, ProfileProduction, ProfileRXE}
}

// LookupProfile returns the preset named name; "" is ProfileEmulator. An unknown
// name is ErrInvalidArgument, naming the presets.
func LookupProfile(name string) (Profile, error) {
	if name == "" {
		return ProfileEmulator, nil
	}
	var names []string
	for _, p := range Profiles() {
		if p.Name == name {
			return p, nil
		}
		names = append(names, p.Name)
	}
	return Profile{}, wrap(ErrInvalidArgument, "no profile %q (presets: %s)", name, strings.Join(names, ", "))
}

// Apply returns c with the profile's fault model, link, responder fault policy,
// registration model, prefetch limit, implicit child size and READs outstanding;
// the rest of c is kept.
func (p Profile) Apply(c Config) Config {
	c.FaultModel, c.Link, c.ResponderFaults = p.Fault, p.Link, p.ResponderFaults
	c.RegModel, c.PrefetchLimit, c.ImplicitChild = p.Reg, p.PrefetchLimit, p.ImplicitChild
	c.RdAtomic = p.RdAtomic
	return c
}

// String returns the profile's name ("emulator" for the zero value).
func (p Profile) String() string {
	if p.Name == "" {
		return ProfileEmulator.Name
	}
	return p.Name
}

// Describe says what the profile sets, one clause each: "fault connectx4 (219.873µs
// per fault + 127ns per page), link ..., responder faults rnr, mkeys reg 50µs, dereg
// 40µs, prefetch 4 MiB, implicit children 1 GiB, READs outstanding 16".
func (p Profile) Describe() string {
	c := p.Apply(Config{}).normalized()
	prefetch := "none past the faulting packets"
	if c.PrefetchLimit > 0 {
		prefetch = bytesize.Format(c.PrefetchLimit)
	}
	fault := fmt.Sprintf("%v per fault + %v per page", p.Fault.PerFault, p.Fault.PerPage)
	if p.Fault.PerFault == 0 && p.Fault.PerPage == 0 {
		fault = "the emulator's own cost"
	}
	return fmt.Sprintf("fault %v (%s), link %v, responder faults %v, mkeys %v, prefetch %s, implicit children %s, READs outstanding %d",
		p.Fault, fault, p.Link, p.ResponderFaults, p.Reg, prefetch, bytesize.Format(c.ImplicitChild), c.RdAtomic)
}

// checkProfile checks the profile's settings in c.
func (c Config) checkProfile() error {
	if err := c.RegModel.check(); err != nil {
		return err
	}
	if k := c.ImplicitChild; k != 0 && (k < int64(pagefault.PageSize) || k&(k-1) != 0 || k > maxMRSize) {
		return wrap(ErrInvalidArgument, "ImplicitChild %d: want a power of two from a page to %d", k, int64(maxMRSize))
	}
	if k := c.RdAtomic; k < 0 || k > MaxRdAtomicLimit || k&(k-1) != 0 {
		// A QP's depth is a power of two (rdAtomicDepth): so is a device's most.
		return wrap(ErrInvalidArgument, "RdAtomic %d: want a power of two from 1 to %d (0: %d)", k, MaxRdAtomicLimit, DefaultRdAtomic)
	}
	return nil
}

// normalized returns c with the profile settings' defaults resolved: PrefetchLimit
// (0: DefaultPrefetchLimit, negative: 0), ImplicitChild (0: DefaultImplicitChild)
// and RdAtomic (0: DefaultRdAtomic).
func (c Config) normalized() Config {
	switch {
	case c.PrefetchLimit == 0:
		c.PrefetchLimit = DefaultPrefetchLimit
	case c.PrefetchLimit < 0:
		c.PrefetchLimit = 0
	}
	if c.ImplicitChild == 0 {
		c.ImplicitChild = DefaultImplicitChild
	}
	if c.RdAtomic == 0 {
		c.RdAtomic = DefaultRdAtomic
	}
	return c
}
