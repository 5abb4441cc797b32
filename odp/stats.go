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
	overtaken, tornDMAs, lateZaps                  atomic.Uint64
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
	// LateZaps counts translations a DMA found zapped after a REMOVE event, when it
	// began on memory registered for events alone: dropped and faulted again (see
	// latezap.go).
	LateZaps uint64

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

// QPStats are one QP's RC counters.
type QPStats struct {
	RNRNaksSent     uint64        // requests this responder answered with RNR NAK
	RNRNaksReceived uint64        // RNR NAKs this requester received
	Retransmissions uint64        // packets sent again (go-back-N after an RNR NAK, a sequence NAK or a timeout)
	RNRWait         time.Duration // time this requester waited on RNR timers (as they fired)
	RNRRetryExc     uint64        // requests failed with RNR_RETRY_EXC_ERR
	Timeouts        uint64        // ACK timer expiries (local_ack_timeout_err)
	RetryExc        uint64        // requests failed with RETRY_EXC_ERR
	OutOfSequence   uint64        // PSN sequence error NAKs this responder sent (out_of_sequence)
	SeqNaksReceived uint64        // PSN sequence error NAKs this requester received (packet_seq_err)
	Duplicates      uint64        // duplicate requests answered again (duplicate_request)
	PacketsDropped  uint64        // packets dropped: for another QP, after a NAK, QP in error
	// MaxGoBack is the most packets one go-back-N of this requester sent again:
	// those in flight behind the NAK (or timeout) it answered.
	MaxGoBack uint64
	// TakenBack counts the packets a NAK took back as never sent: built and not
	// handed to the link, still in its transmit queue, or sent after the NAK
	// reached the requester in the link's model (LinkModel). A NIC builds packets
	// as the wire takes them and goes back as the NAK arrives; they are sent again
	// after the NAK, and only those of them sent before count as retransmissions.
	TakenBack uint64
	// LinkMaxInFlight is the most bytes the QP's link held at once, sent and not
	// taken by the peer (LinkModel bounds it; 0 over UDP, whose sender paces
	// itself instead).
	LinkMaxInFlight int
	// LinkSegmented counts the datagrams the QP's port sent with UDP segmentation
	// offload (LinkModel.GSO) and LinkSegmentedPackets the packets they held;
	// LinkGSORefused is 1 once the kernel refused it (the port then sent a
	// datagram per packet).
	LinkSegmented, LinkSegmentedPackets, LinkGSORefused uint64
	// A UD QP's drops: datagrams with another Q_Key, and datagrams that found no
	// receive posted.
	QKeyViolations, NoReceive uint64
}

// rcCounters count RC events, of a QP or of all a device's QPs; every field is
// updated atomically by the QPs' engines.
type rcCounters struct {
	rnrNAKsSent, rnrNAKsReceived    atomic.Uint64
	rnrWaitNanos                    atomic.Uint64
	rnrRetryExceeded, retryExceeded atomic.Uint64
	retransmitted, timeouts         atomic.Uint64
	seqNAKsSent, seqNAKsReceived    atomic.Uint64
	duplicates, dropped             atomic.Uint64
	maxGoBack                       atomic.Uint64 // a maximum, not a count
	takenBack                       atomic.Uint64
}

func (c *rcCounters) stats() QPStats {
	return QPStats{RNRNaksSent: c.rnrNAKsSent.Load(), RNRNaksReceived: c.rnrNAKsReceived.Load(),
		Retransmissions: c.retransmitted.Load(), RNRWait: time.Duration(c.rnrWaitNanos.Load()),
		RNRRetryExc: c.rnrRetryExceeded.Load(), Timeouts: c.timeouts.Load(), RetryExc: c.retryExceeded.Load(),
		OutOfSequence: c.seqNAKsSent.Load(), SeqNaksReceived: c.seqNAKsReceived.Load(),
		Duplicates: c.duplicates.Load(), PacketsDropped: c.dropped.Load(), MaxGoBack: c.maxGoBack.Load(),
		TakenBack: c.takenBack.Load()}
}

type mrCounters struct {
	faults, pagesFaulted, faultRetries, faultNanos atomic.Uint64
	prefetches, pagesPrefetched                    atomic.Uint64
	stale                                          atomic.Uint64
	children                                       atomic.Uint64
}

// RegTiming is how long each stage of registration took.
type RegTiming struct {
	Account  time.Duration // pinned: RLIMIT_MEMLOCK accounting
	Pin      time.Duration // pinned: mlock, which faults every page in
	MTT      time.Duration // pinned: frames read into the translation table
	Register time.Duration // ODP: userfaultfd registration and table allocation
	Snapshot time.Duration // ODP: already-present pages mapped
	Firmware time.Duration // the firmware's memory key (Config.RegModel)
	Total    time.Duration
}

// MRStats are one MR's counters (rdma stat mr).
type MRStats struct {
	PageFaults       uint64 // network page fault events
	PagesFaulted     uint64 // pages mapped by faults
	FaultRetries     uint64 // faults that raced an invalidation and retried
	FaultTime        time.Duration
	Prefetches       uint64
	PagesPrefetched  uint64
	Invalidations    uint64
	PagesInvalidated uint64
	StaleDMAs        uint64 // audit violations on this MR
	ValidPages       int    // entries valid now
	TableBytes       int    // memory the NIC's table of the MR takes (mmu.Table.Footprint)
	Children         uint64 // an implicit MR's children, created by faults and prefetches (Config.ImplicitChild)
}
