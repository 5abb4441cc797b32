package perf

import (
	"fmt"
	"time"

	"github.com/odpemu/odpemu/odp"
)

// OneShotResult is one transfer of fresh memory, registration included.
type OneShotResult struct {
	Bytes                  int
	Register, Transfer     time.Duration
	Deregister, Total      time.Duration
	PageFaults, PagesFault uint64 // the source's network page faults
	// Mapped is the source's pages the NIC had mapped at the end, by faults or by
	// the registration's snapshot of present pages (see odp.Config.NoSnapshot).
	Mapped  int
	RNRNaks uint64
	// Source is the source device's counters over the transfer.
	Source odp.Stats
}

// OneShotOptions vary a one-shot transfer.
type OneShotOptions struct {
	// NoSnapshot: the ODP registration maps none of the present pages, and every
	// page takes a network page fault; by default it maps them, as mlx5 does.
	NoSnapshot bool
	// Untouched leaves the source unwritten: every page is missing and a network
	// page fault must allocate it, as for memory the application has not used.
	Untouched bool
}

// oneShotSink bounds the server's region: the transfer's destination is a
// long-lived, registered and warm buffer that the WRITEs wrap around in.
const oneShotSink = 16 << 20

// OneShot answers the question an application faces when it must send n bytes it
// has just produced in fresh memory, once: it registers the memory (pinned, or on
// demand with p.ODP), WRITEs it in p.Size messages to a server's warm pinned buffer
// and deregisters it; the total is what the application waits for. The
// application's writing of the data is not timed. p.Iters and p.MRSize are ignored.
func OneShot(p Params, n int, o OneShotOptions) (OneShotResult, error) {
	p.Size = min(max(p.Size, 0), n)
	p.MRSize = n
	p.Iters = 1
	if err := p.defaults(); err != nil {
		return OneShotResult{}, err
	}
	if p.Implicit || p.Prefetch != "" || p.Budget != 0 || p.InvalidateRate != 0 {
		return OneShotResult{}, fmt.Errorf("perf: a one-shot transfer takes no implicit MR, prefetch, budget or invalidations")
	}
	p.Iters = max(n/p.Size, 1)
	sp := p
	sp.ODP, sp.FaultModel, sp.MRSize = false, odp.FaultModel{}, min(n, oneShotSink)
	server, err := newSide(sp.device(true), sp)
	if err != nil {
		return OneShotResult{}, err
	}
	defer server.close()
	fill(server.buf)
	ccfg := p.device(false)
	ccfg.NoSnapshot = o.NoSnapshot
	client, err := newBareSide(ccfg, p)
	if err != nil {
		return OneShotResult{}, err
	}
	defer client.close()
	if err := connect(p, client.qp, server.qp); err != nil {
		return OneShotResult{}, err
	}
	for i, s := range []*side{client, server} {
		if err := s.configure(sp, i == 1); err != nil {
			return OneShotResult{}, err
		}
	}
	if !o.Untouched {
		fill(client.buf) // the data the application produced
	}
	r := OneShotResult{Bytes: n}
	before := client.dev.Stats()
	start := time.Now()
	if err := client.register(p); err != nil {
		return OneShotResult{}, err
	}
	registered := time.Now()
	if _, err := client.loop(p, server.target()); err != nil {
		return OneShotResult{}, err
	}
	transferred := time.Now()
	st := client.mr.Stats()
	if err := client.mr.Dereg(); err != nil {
		return OneShotResult{}, err
	}
	r.Total = time.Since(start)
	r.Register, r.Transfer, r.Deregister = registered.Sub(start), transferred.Sub(registered), r.Total-transferred.Sub(start)
	r.PageFaults, r.PagesFault, r.Mapped = st.PageFaults, st.PagesFaulted, st.ValidPages
	r.RNRNaks = client.qp.Stats().RNRNaksReceived
	r.Source = statsDelta(client.dev.Stats(), before)
	return r, nil
}

// statsDelta returns the fault counters of a minus b.
func statsDelta(a, b odp.Stats) odp.Stats {
	return odp.Stats{PageFaults: a.PageFaults - b.PageFaults, PagesFaulted: a.PagesFaulted - b.PagesFaulted,
		FaultTime: a.FaultTime - b.FaultTime, CPUFaults: a.CPUFaults - b.CPUFaults, CPUFaultTime: a.CPUFaultTime - b.CPUFaultTime,
		Phases: odp.FaultPhases{Detect: a.Phases.Detect - b.Phases.Detect, Resolve: a.Phases.Resolve - b.Phases.Resolve,
			Update: a.Phases.Update - b.Phases.Update, Model: a.Phases.Model - b.Phases.Model, Resume: a.Phases.Resume - b.Phases.Resume}}
}
