package suite

import (
	"errors"
	"fmt"
	"math"
	"runtime"
	"strings"

	"github.com/odpemu/odpemu/experiments/perf"
	"github.com/odpemu/odpemu/experiments/plots"
	"github.com/odpemu/odpemu/experiments/results"
	"github.com/odpemu/odpemu/experiments/stats"
	"github.com/odpemu/odpemu/odp"
)

var overcommit = Experiment{
	Name:  "overcommit",
	Title: "An ODP MR larger than the NIC's resident budget: bandwidth, faults and residency vs budget",
	Run:   runOvercommit,
	Replot: func(x *X) error {
		return replot(x, "", func(t *results.Table) error {
			rt, err := x.Loaded("overcommit_resident")
			if err != nil {
				return err
			}
			return overcommitReport(x, t, rt)
		})
	},
}

// budgetRatios are budget / working set: the cliff lies between 1 and 1/2, the
// collapse below.
var budgetRatios = []float64{1, 0.875, 0.75, 0.625, 0.5, 0.25, 0.125}

func runOvercommit(x *X) error {
	const size = 64 << 10
	region := pick(x.Scale, 4<<20, 32<<20, 64<<20)
	reps := pick(x.Scale, 1, 3, fullReps)
	iters := max(region/size/4, 64) // as many random WRITEs as a quarter of the region has slots
	x.Param("message_bytes", size)
	x.Param("region_bytes", region)
	x.Param("iterations", iters)
	ratios := pick(x.Scale, []float64{1, 0.75, 0.5, 0.125}, budgetRatios, budgetRatios)
	x.Param("budget_ratios", ratios)
	x.Param("reps", reps)
	x.Param("run", "WRITEs to random slots of the server's region, 128 in flight, after a synchronous prefetch of the whole "+
		"region (ODP), which maps no more than the budget holds, so that the timed loop starts in the steady state; the server "+
		"NIC's resident budget evicts ODP pages to its backing store beyond it; the region's resident bytes are read from "+
		"pagemap during the loop (overcommit_resident: every sample of the first repetition)")
	x.Steps(reps * len(ratios))
	t := x.Table("", "budget_ratio", "budget_bytes", "region_bytes", "variant", "fault_model", "rep", "status", "bw_mib_s",
		"elapsed_ns", "network_page_faults", "pages_faulted", "evictions", "restores", "max_resident_bytes", "rnr_naks")
	rt := x.Table("overcommit_resident", "budget_ratio", "budget_bytes", "fault_model", "rep", "t_ms", "resident_bytes")
	for rep := range reps {
		for _, ratio := range ratios {
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
					Budget: budget, FaultModel: v.model, Prefetch: prefetch, ResidentTrace: v.odp && rep == 0}))
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
				for _, r := range res.Resident {
					if err := rt.Add(ratio, budget, v.model.String(), rep, float64(r.At)/1e6, r.Bytes); err != nil {
						return err
					}
				}
			}
			x.Step()
		}
	}
	return overcommitReport(x, t, rt)
}

func overcommitReport(x *X, t, rt *results.Table) error {
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
		x.HeadlineCI(fmt.Sprintf("ODP at budget 1/%.0f of the working set, %s faults: bandwidth / at full budget", 1/lo, m),
			fixed2(s.Median), ci(r, fixed2), fmt.Sprintf("median of %d per-repetition ratios", s.N))
	}
	refused := len(t.Rows(sel("variant", "pinned", "status", "refused")))
	x.Headline("pinned registrations larger than the budget", fmt.Sprintf("%d of %d refused", refused,
		len(t.Rows(sel("variant", "pinned")))-len(t.Rows(sel("variant", "pinned", "budget_ratio", 1)))), "ENOMEM, as ib_umem_get under RLIMIT_MEMLOCK")
	top := true
	var tops []string
	for _, m := range faultModels {
		budgets := cliff(t, m.String())
		var parts, intervals []string
		for _, b := range budgets {
			parts = append(parts, fmt.Sprintf("%.2f at %s", stats.Median(b.ratios), fraction(b.ratio)))
			intervals = append(intervals, fmt.Sprintf("%s at %s", ci(b.ratios, fixed2), fraction(b.ratio)))
		}
		x.HeadlineCI(fmt.Sprintf("ODP's bandwidth by budget / at full budget, %s faults", m), strings.Join(parts, ", "),
			strings.Join(intervals, ", "), "median of per-repetition ratios at each budget / working set")
		if len(budgets) > 0 {
			b := budgets[0] // the largest budget below the whole working set
			med := stats.Median(b.ratios)
			top = top && med <= 2.0/3
			tops = append(tops, fmt.Sprintf("%s faults %.2f at %s", m, med, fraction(b.ratio)))
		}
	}
	x.Claim("cliff", "The cliff is at the top: the first eighth of the working set taken from the budget costs more than "+
		"a third of the bandwidth", top && len(tops) > 0, "bandwidth at the largest budget below the working set / at "+
		"the whole, medians of per-repetition ratios (at most 2/3): "+strings.Join(tops, ", "))
	if err := residentFigure(x, rt); err != nil {
		return err
	}
	timer, evidence := timerPrices(t, lo)
	x.Claim("timerprice", "A miss costs an eviction, a fault and an RNR NAK: the RNR timer's waits are a third of the run "+
		"or more, and the two fault costs give curves within 25% of each other", timer, evidence)
	bounded, evidence := residentBounded(t)
	x.Claim("bounded", "the region's resident set stays within the budget while the NIC works", bounded, evidence)
	return nil
}

// cliff returns ODP's bandwidth at each budget below the whole working set over
// its bandwidth at the whole, per repetition, for fault model m, from the largest
// budget down: where the cliff is. Budgets without a run that completed are left out.
func cliff(t *results.Table, m string) []budgetCliff {
	var out []budgetCliff
	for _, r := range floats(t, "budget_ratio") {
		if r == 1 {
			continue
		}
		rs := perRep(t, "bw_mib_s", sel("status", "ok", "variant", "odp", "fault_model", m, "budget_ratio", r),
			sel("status", "ok", "variant", "odp", "fault_model", m, "budget_ratio", 1))
		if len(rs) > 0 {
			out = append([]budgetCliff{{r, rs}}, out...)
		}
	}
	return out
}

// budgetCliff is the per-repetition ratios at one budget / working set.
type budgetCliff struct {
	ratio  float64
	ratios []float64
}

// timerPrices decides whether, at budget ratio lo, the responder's RNR timer
// (the QPs' default) accounts for a third or more of every ODP run's time and the
// fault models' bandwidths are within 25% of each other: the timer weighs on a miss
// as much as the fault.
func timerPrices(t *results.Table, lo float64) (bool, string) {
	timer := odp.RNRTimer(odp.DefaultQPAttr.MinRNRTimer)
	holds, runs := true, 0
	share := math.Inf(1)
	for _, r := range t.Rows(sel("status", "ok", "variant", "odp", "budget_ratio", lo)) {
		f := r.Float("rnr_naks") * float64(timer) / r.Float("elapsed_ns")
		share = min(share, f)
		holds = holds && f >= 1.0/3
		runs++
	}
	ms := make([]float64, len(faultModels))
	for i, m := range faultModels {
		ms[i] = stats.Median(results.Floats(t.Rows(sel("status", "ok", "variant", "odp", "budget_ratio", lo, "fault_model", m.String())), "bw_mib_s"))
	}
	near := ms[1]/ms[0] >= 0.8 && ms[1]/ms[0] <= 1.25
	return runs > 0 && holds && near, fmt.Sprintf("at budget %s: RNR NAKs x the %v RNR timer / run time, smallest over %d runs: %.2f "+
		"(at least 1/3); median bandwidth %s / %s faults: %.2f (0.8 to 1.25)", fraction(lo), timer, runs, share,
		faultModels[1], faultModels[0], ms[1]/ms[0])
}

// residentSlack is how far a region's resident bytes may exceed its budget for a
// moment: a fault's pages are mapped before reclaim evicts down to the budget, and a
// direct reclaim gives up when another reclaim is under way, so the faults in flight
// at once (a few messages' pages) may overshoot.
const residentSlack = 4 * 64 << 10

// residentBounded decides whether every ODP run below the full budget kept its
// region's resident bytes within the budget (and residentSlack), and says by how
// much the largest overshoot, or the largest share of the budget used, went.
func residentBounded(t *results.Table) (bool, string) {
	holds, worst, runs := true, math.Inf(-1), 0
	var at string
	for _, r := range t.Rows(sel("status", "ok", "variant", "odp")) {
		if r.Float("budget_ratio") >= 1 {
			continue
		}
		runs++
		over := r.Float("max_resident_bytes") - r.Float("budget_bytes")
		holds = holds && over <= residentSlack
		if over > worst {
			worst, at = over, fmt.Sprintf("budget %s of %s, %s faults, repetition %s", human(int(r.Float("budget_bytes"))),
				human(int(r.Float("region_bytes"))), r.Get("fault_model"), r.Get("rep"))
		}
	}
	if runs == 0 {
		return false, "no ODP run under a budget"
	}
	return holds, fmt.Sprintf("most resident bytes - budget, largest over %d runs: %+.0f KiB (%s); allowed: %d KiB, "+
		"a few messages' pages, faults in flight", runs, worst/1024, at, residentSlack>>10)
}

// residentBudgets are the budgets whose resident sets the figure shows.
var residentBudgets = []float64{0.75, 0.5, 0.125}

// residentFigure draws the server region's resident bytes over the timed loop of
// the first repetition, with the emulator's faults, at a few budgets, each with its
// budget as a dashed line.
func residentFigure(x *X, rt *results.Table) error {
	var traces, budgets []plots.Series
	m := odp.FaultModelEmulator.String()
	for _, b := range residentBudgets {
		rows := rt.Rows(sel("budget_ratio", b, "fault_model", m, "rep", 0))
		if len(rows) == 0 {
			continue
		}
		g := plots.Group(rows, "t_ms", "resident_bytes", "fault_model")
		g[0].Name = fmt.Sprintf("budget %s of the region", fraction(b))
		traces = append(traces, g[0])
		end := g[0].Points[len(g[0].Points)-1].X
		budget := exactly(rows[0].Float("budget_bytes"))
		budgets = append(budgets, plots.Series{Name: g[0].Name + ": budget", Of: g[0].Name, Dashed: true,
			Points: []plots.Point{{X: 0, Y: budget}, {X: end, Y: budget}}})
	}
	return x.Figure("overcommit_resident", plots.Figure{Title: "Resident bytes of the server's region during the timed loop, " +
		"budgets dashed",
		X: plots.Axis{Label: "time in the timed loop (ms)"}, Y: plots.Axis{Label: "resident bytes of the region (MiB)"},
		Series: scaleY(append(traces, budgets...), 1.0/(1<<20))})
}

// fraction writes r as a fraction of small numbers (3/4, 1/8), or as a decimal.
func fraction(r float64) string {
	for d := 2; d <= 16; d *= 2 {
		if n := r * float64(d); n == math.Trunc(n) {
			return fmt.Sprintf("%.0f/%d", n, d)
		}
	}
	return fmt.Sprintf("%.3g", r)
}
