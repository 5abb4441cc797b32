package odp

import (
	"sync/atomic"
	"time"
)

// deviceCounters are updated atomically.
type deviceCounters struct {
	faults, pagesFaulted, faultRetries, faultNanos atomic.Uint64
	invalidations, pagesInvalidated                atomic.Uint64
	prefetches, pagesPrefetched                    atomic.Uint64
	mrsPinned, mrsODP                              atomic.Uint64
	audited, stale, dmaFaults, dmaWaits            atomic.Uint64
	overtaken, tornDMAs                            atomic.Uint64
	asyncPrefetches, prefetchErrors                atomic.Uint64
	// FaultPhases, in nanoseconds.
	detectNanos, resolveNanos, updateNanos, modelNanos, resumeNanos atomic.Uint64
}

// Stats are a device's counters, named after mlx5's ODP counters.
type Stats struct {
	PageFaults           uint64        // network page fault events
	PagesFaulted         uint64        // pages mapped by faults (page_faults_handled)
	FaultRetries         uint64        // faults that lost a race with an invalidation
	FaultTime            time.Duration // time spent resolving network page faults
	Invalidations        uint64
	PagesInvalidated     uint64
	Prefetches           uint64 // ranges prefetched (ibv_advise_mr SGEs, Advise calls)
	PagesPrefetched      uint64 // entries they mapped (page_prefetch)
	AsyncPrefetches      uint64 // AdviseMR calls without AdviseFlush
	PrefetchErrors       uint64 // of which failed in the background
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
	TornDMAs            uint64 // copies a page fault tore, invalidated and made again

	// The DMA gate between the application's mapping changes and the NIC's DMA:
	// userfaultfd reads that first waited for DMA in flight, and how long (the cost
	// of the kernel's order, paid by the thread that changed the mapping and by CPU
	// faults behind it); reads of waiting faults made while DMA was still in flight;
	// and events such a read returned all the same (their change may overlap a DMA).
	GateDrains     uint64
	GateDrainTime  time.Duration
	GateDrainMax   time.Duration
	GateFaultReads uint64
	GateUndrained  uint64

	// RC counters over all QPs (QP.Stats has them per QP).
	RC QPStats

	// Phases is where network page faults spent their time.
	Phases FaultPhases

	Evictions        uint64 // pages written to the backing store and dropped
	BytesWrittenBack uint64
	EvictionAborts   uint64 // evictions abandoned because the page was touched meanwhile
	Migrations       uint64 // pages moved to new frames
	Restores         uint64 // evicted pages brought back (CPU and NIC faults)
	ResidentPages    int64  // the pager's estimate of resident ODP pages
	// ServerEvictions counts the evictions (of Evictions) that the CPU fault server
	// made before installing past the resident budget; Overshoot the pages it had to
	// install past it all the same, finding nothing to evict in time.
	ServerEvictions, Overshoot uint64
}

// FaultPhases split the time of network page faults, summed over faults, as a NIC's
// fault path runs: Detect is the translation lookup that found a page missing; Resolve
// makes the pages present and reads their frames (the driver's hmm_range_fault),
// Update installs them in the NIC's table under its lock (the MTT update); Model is
// the time the fault model added (see FaultModel); Resume runs from the end of the
// last fault of a DMA to its translations found valid (the NIC resuming the stalled
// access). Resolve and Update also count the fault windows of prefetches. The
// requester's side of a responder's fault (the RNR NAK and its timer) is not a
// phase: QPStats counts it.
type FaultPhases struct {
	Detect, Resolve, Update, Model, Resume time.Duration
}

// Stats returns the device's counters.
func (d *Device) Stats() Stats {
	s, _ := d.as.server.Stats() // after Close the fault server's counters read as zero
	ps := d.as.pump.Stats()
	d.mu.Lock()
	pinned := d.pinned
	d.mu.Unlock()
	c := &d.stats
	// Prefetches is loaded before PagesPrefetched, which prefetch adds first: a
	// prefetch seen counted has its pages counted.
	st := Stats{
		PageFaults: c.faults.Load(), PagesFaulted: c.pagesFaulted.Load(), FaultRetries: c.faultRetries.Load(),
		FaultTime: time.Duration(c.faultNanos.Load()), Invalidations: c.invalidations.Load(),
		PagesInvalidated: c.pagesInvalidated.Load(), Prefetches: c.prefetches.Load(),
		PagesPrefetched: c.pagesPrefetched.Load(), PinnedBytes: pinned, AsyncPrefetches: c.asyncPrefetches.Load(),
		PrefetchErrors: c.prefetchErrors.Load(),
		CPUFaults:      s.Faults, CPUFaultPages: s.Pages, CPUFaultTime: s.ServiceTime, CPUFaultMax: s.MaxServiceTime,
		CPUFaultsFoundMapped: s.Exist,
		Events:               ps.Events, EventsIgnored: ps.Ignored, InvalidationLatency: ps.Latency, InvalidationMax: ps.MaxLat,
		Forks: ps.Forks, DMAWaits: c.dmaWaits.Load(),
		AuditedDMAs: c.audited.Load(), StaleDMAs: c.stale.Load(), OvertakenDMAs: c.overtaken.Load(), DMAFaults: c.dmaFaults.Load(),
		TornDMAs:   c.tornDMAs.Load(),
		GateDrains: s.Drains, GateDrainTime: s.DrainTime, GateDrainMax: s.MaxDrainTime, GateFaultReads: s.FaultReads,
		GateUndrained: s.Undrained,
	}
	st.RC = d.rc.stats()
	st.Phases = FaultPhases{Detect: time.Duration(c.detectNanos.Load()), Resolve: time.Duration(c.resolveNanos.Load()),
		Update: time.Duration(c.updateNanos.Load()), Model: time.Duration(c.modelNanos.Load()),
		Resume: time.Duration(c.resumeNanos.Load())}
	if d.as.pager != nil {
		pg := d.as.pager.Stats()
		st.Evictions, st.BytesWrittenBack, st.EvictionAborts = pg.Evictions, pg.WrittenBack, pg.Aborts
		restored, _ := d.as.server.Restored() // zero after Close
		st.Migrations, st.Restores, st.ResidentPages = pg.Migrations, pg.Restores+restored, pg.Resident
		st.ServerEvictions, st.Overshoot = pg.ServerEvictions, pg.Overshoot
	}
	return st
}
