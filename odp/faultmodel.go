package odp

import (
	"fmt"
	"time"
)

// FaultModel is how long a network page fault takes on the NIC's fault path. A
// fault that the emulator resolves faster is held until the model's latency has
// passed since the fault began: the DMA waits that long (a requester's QP stalls, or
// the responder's RNR NAK covers it, as on hardware). The emulator's own cost counts
// toward the latency; it is never shortened. The zero value is the emulator's own
// cost.
//
// A fault over n pages takes PerFault + n*PerPage, n being the pages it maps (its
// fault-around window). Prefetches (AdviseMR) are driver work, not NIC faults: the
// model does not apply to them.
type FaultModel struct {
	Name     string // a label for results; the presets name their source
	PerFault time.Duration
	PerPage  time.Duration
}

// The fault model presets.
var (
	// FaultModelEmulator is the emulator's own cost: 4-6 us per fault on a 2-core VM.
	FaultModelEmulator = FaultModel{Name: "emulator"}
	// FaultModelConnectX4 is a ConnectX-4 as measured by Lesokhin et al., "Page Fault
	// Support for Network Controllers" (ASPLOS 2017): about 220 us for a 4 KiB minor
	// network page fault, most of it firmware and driver, and about 350 us for a
	// batched 4 MiB fault; hence 219.9 us per fault and 127 ns per page.
	FaultModelConnectX4 = FaultModel{Name: "connectx4", PerFault: 219873 * time.Nanosecond, PerPage: 127 * time.Nanosecond}
	// FaultModelNPRDMA is a minor page fault handled in software with a commodity NIC
	// as "NP-RDMA: Using Commodity RDMA without Pinning Memory" (arXiv:2310.11062,
	// 2023) reports it, 3.5-5.7 us; the preset takes the upper bound.
	FaultModelNPRDMA = FaultModel{Name: "np-rdma", PerFault: 5700 * time.Nanosecond}
	// FaultModelNPRDMAMajor is NP-RDMA's major fault, whose page comes back from
	// swap: 60 us.
	FaultModelNPRDMAMajor = FaultModel{Name: "np-rdma-major", PerFault: 60 * time.Microsecond}
	// FaultModelProduction is a device I/O page fault in production: Wang et al.,
	// "To PRI or Not To PRI" (OSDI 2025), report about 700 us per actual fault on
	// average over production VMs (and 3x to 80x a CPU fault's latency).
	FaultModelProduction = FaultModel{Name: "production", PerFault: 700 * time.Microsecond}
)

// Latency is the model's latency of a fault that maps pages pages.
func (m FaultModel) Latency(pages int) time.Duration {
	return m.PerFault + time.Duration(pages)*m.PerPage
}

// String returns the model's name, or its numbers when it has none.
func (m FaultModel) String() string {
	if m.Name != "" {
		return m.Name
	}
	if m == (FaultModel{}) {
		return FaultModelEmulator.Name
	}
	return fmt.Sprintf("%v/fault+%v/page", m.PerFault, m.PerPage)
}

func (m FaultModel) check() error {
	if m.PerFault < 0 || m.PerPage < 0 || m.PerFault > time.Second || m.PerPage > time.Millisecond {
		return wrap(ErrInvalidArgument, "FaultModel %v: latencies must be in [0, 1 s] per fault and [0, 1 ms] per page", m)
	}
	return nil
}
