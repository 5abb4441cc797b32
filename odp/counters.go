package odp

import (
	"time"

	"github.com/odpemu/odpemu/pagefault"
)

// A device shows its counters the way Linux shows an RDMA device's (package
// hwcounters mounts them: hwcounters.Mount(dir, dev) gives
// <dir>/<name>/ports/1/hw_counters/<counter> and <dir>/<name>/mr/<mrn>/<counter>). The
// counters are the fields of Stats and MRStats under mlx5's and rxe's names. odp does
// not import hwcounters: a program that does not mount counters does not link FUSE.

// PortCounters returns the device's counters by their hw_counters file names.
func (d *Device) PortCounters() map[string]uint64 { return portCounters(d.Stats()) }

// odpCounterFiles are the ODP counters' files (mlx5's rdma stat mr names), for a
// device or an MR, with the other counters given.
func odpCounterFiles(faults, pagesFaulted, invalidations, pagesInvalidated, pagesPrefetched uint64, others map[string]uint64) map[string]uint64 {
	others["page_faults"] = faults
	others["page_faults_handled"] = pagesFaulted
	others["page_invalidations"] = invalidations
	others["page_invalidations_handled"] = pagesInvalidated
	others["page_prefetch"] = pagesPrefetched
	return others
}

// portCounters maps the device's counters to the hw_counters files of mlx5 and rxe,
// each meaning what the driver's does; the table in package hwcounters' doc gives
// each file's source.
func portCounters(s Stats) map[string]uint64 {
	rc := s.RC
	sub := func(a, b uint64) uint64 { return a - min(a, b) }
	return odpCounterFiles(s.PageFaults, s.PagesFaulted, s.Invalidations, s.PagesInvalidated, s.PagesPrefetched, map[string]uint64{
		// mlx5's names.
		"rnr_nak_retry_err":              sub(rc.RNRNaksReceived, rc.RNRRetryExc),
		"out_of_sequence":                rc.OutOfSequence,
		"packet_seq_err":                 rc.SeqNaksReceived,
		"local_ack_timeout_err":          rc.Timeouts,
		"duplicate_request":              rc.Duplicates,
		"req_transport_retries_exceeded": rc.RetryExc,
		"req_rnr_retries_exceeded":       rc.RNRRetryExc,
		// rxe's names for what mlx5 counts otherwise or not at all.
		"rcvd_rnr_err":           rc.RNRNaksReceived,
		"send_rnr_err":           rc.RNRNaksSent,
		"rcvd_seq_err":           rc.SeqNaksReceived,
		"out_of_seq_request":     rc.OutOfSequence,
		"retry_exceeded_err":     rc.RetryExc,
		"retry_rnr_exceeded_err": rc.RNRRetryExc,
		"completer_retry_err":    sub(rc.Timeouts+rc.SeqNaksReceived, rc.RetryExc),
	})
}

// mrCounterFiles returns an MR's counters by file name (rdma stat mr).
func mrCounterFiles(s MRStats) map[string]uint64 {
	return odpCounterFiles(s.PageFaults, s.PagesFaulted, s.Invalidations, s.PagesInvalidated, s.PagesPrefetched, map[string]uint64{
		"valid_pages": uint64(s.ValidPages),
		"stale_dmas":  s.StaleDMAs,
	})
}

// MRCounters returns the live MRs' counters by MR number (the key's index, as rdma
// stat mr numbers them) and file name.
func (d *Device) MRCounters() map[uint32]map[string]uint64 {
	d.mu.RLock()
	mrs := make([]*MR, 0, len(d.mrs))
	for _, mr := range d.mrs {
		mrs = append(mrs, mr)
	}
	d.mu.RUnlock()
	out := make(map[uint32]map[string]uint64, len(mrs))
	for _, mr := range mrs {
		out[mr.key>>8] = mrCounterFiles(mr.Stats())
	}
	return out
}

// Stats returns the device's counters.
func (d *Device) Stats() Stats {
	var s pagefault.CPUServerStats
	if d.as.server != nil { // a space without a userfaultfd has no fault server
		s, _ = d.as.server.Stats() // after Close the fault server's counters read as zero
	}
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
		TornDMAs: c.tornDMAs.Load(), LateZaps: c.lateZaps.Load(),
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
