package suite

import (
	"errors"
	"fmt"
	"runtime"

	"github.com/odpemu/odpemu/experiments/perf"
	"github.com/odpemu/odpemu/experiments/plots"
	"github.com/odpemu/odpemu/experiments/results"
	"github.com/odpemu/odpemu/experiments/stats"
	"github.com/odpemu/odpemu/odp"
)

var overcommit = Experiment{
	Name:   "overcommit",
	Title:  "An ODP MR larger than the NIC's resident budget: bandwidth, faults and residency vs budget",
	Run:    runOvercommit,
	Replot: func(x *X) error { return replot(x, "", func(t *results.Table) error { return overcommitReport(x, t) }) },
}

// budgetRatios are budget / working set.
var budgetRatios = []float64{1, 0.5, 0.25, 0.125}

func runOvercommit(x *X) error {
	const size = 64 << 10
	region := pick(x.Scale, 4<<20, 32<<20, 1<<30)
	reps := pick(x.Scale, 1, 3, 5)
	iters := max(region/size/4, 64) // as many random WRITEs as a quarter of the region has slots
	x.Param("message_bytes", size)
	x.Param("region_bytes", region)
	x.Param("iterations", iters)
	x.Param("budget_ratios", budgetRatios)
	x.Param("reps", reps)
	x.Param("run", "WRITEs to random slots of the server's region, 128 in flight, after a synchronous prefetch of the whole "+
		"region (ODP), which leaves the budget's worth of it resident; the server NIC's resident budget evicts ODP pages "+
		"to its backing store beyond it")
	x.Steps(reps * len(budgetRatios))
	t := x.Table("", "budget_ratio", "budget_bytes", "region_bytes", "variant", "fault_model", "rep", "status", "bw_mib_s",
		"elapsed_ns", "network_page_faults", "pages_faulted", "evictions", "restores", "max_resident_bytes", "rnr_naks")
	for rep := range reps {
		for _, ratio := range budgetRatios {
			budget := int64(float64(region) * ratio)
			runtime.GC()
			type variant struct {
				name  string
				odp   bool
				model odp.FaultModel
			}
			vs := []variant{{"pinned", false, odp.FaultModel{}}}
			for _, m := range faultModels {
				vs = append(vs, variant{"odp", true, m})
			}
			for i := range vs {
				v := vs[(i+rep)%len(vs)]
				prefetch := ""
				if v.odp {
					prefetch = "sync" // steady state: the region mapped as far as the budget lets it
				}
				res, err := perf.Run(x.nic(perf.Params{ODP: v.odp, Size: size, Iters: iters, MRSize: region, Random: true,
					Budget: budget, FaultModel: v.model, Prefetch: prefetch}))
				status := "ok"
				switch {
				case !v.odp && (errors.Is(err, odp.ErrMemlockLimit) || errors.Is(err, odp.ErrNoMemory)):
					status = "refused"
				case err != nil:
					return fmt.Errorf("%s at budget %.3g: %w", v.name, ratio, err)
				}
				if err := t.Add(ratio, budget, region, v.name, v.model.String(), rep, status, res.AvgMiBps, res.Elapsed,
					res.PageFaults, res.PagesFaulted, res.Evictions, res.Restores, res.MaxResident, res.RNRNaks); err != nil {
					return err
				}
			}
			x.Step()
		}
	}
	return overcommitReport(x, t)
}

func overcommitReport(x *X, t *results.Table) error {
	var bw, faults []plots.Series
	for _, m := range faultModels {
		rows := t.Rows(sel("status", "ok", "variant", "odp", "fault_model", m.String()))
		g := plots.Group(rows, "budget_ratio", "bw_mib_s", "variant")
		if len(g) == 1 {
			g[0].Name = "ODP, " + m.String() + " faults"
			bw = append(bw, g[0])
		}
		// Network page faults per second of each run.
		rate, err := results.NewTable("rate", "budget_ratio", "variant", "faults_per_s")
		if err != nil {
			return err
		}
		for _, r := range rows {
			if err := rate.Add(r.Float("budget_ratio"), r.Get("variant"), r.Float("network_page_faults")/(r.Float("elapsed_ns")/1e9)); err != nil {
				return err
			}
		}
		if g := plots.Group(rate.Rows(nil), "budget_ratio", "faults_per_s", "variant"); len(g) == 1 {
			g[0].Name = "ODP, " + m.String() + " faults"
			faults = append(faults, g[0])
		}
	}
	if g := plots.Group(t.Rows(sel("status", "ok", "variant", "pinned")), "budget_ratio", "bw_mib_s", "variant"); len(g) == 1 {
		g[0].Name = "pinned (refused below 1)"
		bw = append(bw, g[0])
	}
	if err := x.Figure("overcommit", plots.Figure{Title: "Working set larger than the resident budget",
		X: plots.Axis{Label: "resident budget / working set"}, Y: plots.Axis{Label: "bandwidth (MiB/s)", Log: true}, Series: bw}); err != nil {
		return err
	}
	if err := x.Figure("overcommit_faults", plots.Figure{Title: "Network page faults under a resident budget",
		X: plots.Axis{Label: "resident budget / working set"}, Y: plots.Axis{Label: "network page faults per second"},
		Series: faults}); err != nil {
		return err
	}
	lo := budgetRatios[len(budgetRatios)-1]
	for _, m := range faultModels {
		r := perRep(t, "bw_mib_s", sel("variant", "odp", "fault_model", m.String(), "budget_ratio", lo),
			sel("variant", "odp", "fault_model", m.String(), "budget_ratio", 1))
		s := stats.Summarize(r)
		x.Headline(fmt.Sprintf("ODP at budget 1/%.0f of the working set, %s faults: bandwidth / at full budget", 1/lo, m),
			fmt.Sprintf("%.2f", s.Median), fmt.Sprintf("median of %d per-repetition ratios", s.N))
	}
	refused := len(t.Rows(sel("variant", "pinned", "status", "refused")))
	x.Headline("pinned registrations larger than the budget", fmt.Sprintf("%d of %d refused", refused,
		len(t.Rows(sel("variant", "pinned")))-len(t.Rows(sel("variant", "pinned", "budget_ratio", 1)))), "ENOMEM, as ib_umem_get under RLIMIT_MEMLOCK")
	return nil
}
