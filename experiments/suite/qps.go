package suite

import (
	"fmt"
	"runtime"
	"strings"

	"github.com/odpemu/odpemu/experiments/perf"
	"github.com/odpemu/odpemu/experiments/plots"
	"github.com/odpemu/odpemu/experiments/results"
	"github.com/odpemu/odpemu/experiments/stats"
	"github.com/odpemu/odpemu/odp"
)

var severalQPs = Experiment{
	Name:  "qps",
	Title: "Several QPs faulting at once: a cold pass over one region split among 1 to 8 QPs between the same two NICs",
	Run:   runQPs,
	Replot: func(x *X) error {
		return replot(x, "", func(t *results.Table) error { return qpsReport(x, t) })
	},
}

// qpCounts are the numbers of QPs that share a cold pass.
var qpCounts = []int{1, 2, 4, 8}

func runQPs(x *X) error {
	const size = 64 << 10
	region := pick(x.Scale, 2<<20, 16<<20, 32<<20)
	reps := pick(x.Scale, 1, 3, fullReps)
	counts := pick(x.Scale, []int{1, 4}, qpCounts, qpCounts)
	x.Param("message_bytes", size)
	x.Param("region_bytes", region)
	x.Param("qps", counts)
	x.Param("reps", reps)
	// Each QP pair has a link of its own: what one shared link would cap is
	// checked against the link's rate (the claim linkslack).
	linkRate := -1.0 // unlimited
	if g := x.profile.Link.RateGbps; g >= 0 {
		if g == 0 {
			g = odp.DefaultLinkRate
		}
		linkRate = g * 1e9 / 8 / (1 << 20)
	}
	x.Param("link_rate_mib_s", linkRate)
	x.Param("run", "one cold pass of WRITEs over a fresh region split into as many slices as QPs, each QP writing its "+
		"slice from its own goroutine, 128 in flight each, all QPs between the same two devices and MRs (each QP pair over "+
		"a wire of its own); pinned and ODP with the emulator's and ConnectX-4's fault cost")
	type variant struct {
		name  string
		odp   bool
		model odp.FaultModel
	}
	vs := []variant{{"pinned", false, odp.FaultModel{}}}
	for _, m := range faultModels {
		vs = append(vs, variant{"odp", true, m})
	}
	x.Steps(reps * len(counts))
	t := x.Table("", "qps", "variant", "fault_model", "rep", "bw_mib_s", "elapsed_ns", "network_page_faults",
		"fault_time_ns", "rnr_naks")
	for rep := range reps {
		runtime.GC()
		for _, n := range counts {
			for i := range vs {
				v := vs[(i+rep)%len(vs)]
				r, err := perf.MultiQP(x.nic(perf.Params{ODP: v.odp, Size: size, MRSize: region, FaultModel: v.model}), n)
				if err != nil {
					return fmt.Errorf("%s, %s faults, %d QPs: %w", v.name, v.model, n, err)
				}
				if err := t.Add(n, v.name, v.model.String(), rep, r.AvgMiBps, r.Elapsed, r.PageFaults, r.FaultTime,
					r.RNRNaks); err != nil {
					return err
				}
			}
			x.Step()
		}
	}
	return qpsReport(x, t)
}

func qpsReport(x *X, t *results.Table) error {
	counts := ints(t, "qps")
	var series []plots.Series
	for _, m := range faultModels {
		series = append(series, ratioSeries("ODP, "+m.String()+" faults", counts, func(n int) []float64 {
			return perRep(t, "bw_mib_s", sel("qps", n, "variant", "odp", "fault_model", m.String()),
				sel("qps", counts[0], "variant", "odp", "fault_model", m.String()))
		}))
	}
	series = append(series, ratioSeries("pinned", counts, func(n int) []float64 {
		return perRep(t, "bw_mib_s", sel("qps", n, "variant", "pinned"), sel("qps", counts[0], "variant", "pinned"))
	}))
	if err := x.Figure("qps", plots.Figure{Title: "Cold pass split among QPs: aggregate bandwidth over one QP's",
		X: plots.Axis{Label: "QPs faulting at once", Log: true}, Y: plots.Axis{Label: "bandwidth / one QP's", Log: true},
		Series: append(series, parity(counts))}); err != nil {
		return err
	}
	var parts, intervals []string
	scales := true
	top := counts[len(counts)-1]
	for _, m := range faultModels {
		rs := perRep(t, "bw_mib_s", sel("qps", top, "variant", "odp", "fault_model", m.String()),
			sel("qps", counts[0], "variant", "odp", "fault_model", m.String()))
		s := stats.Summarize(rs)
		parts = append(parts, fmt.Sprintf("%.2f with %s faults", s.Median, m))
		intervals = append(intervals, fmt.Sprintf("%s with %s faults", ci(rs, fixed2), m))
		if m == odp.FaultModelConnectX4 {
			scales = s.N > 0 && s.Median >= 2
		}
	}
	x.HeadlineCI(fmt.Sprintf("cold pass, %d QPs at once / 1 QP, aggregate ODP bandwidth", top), strings.Join(parts, ", "),
		strings.Join(intervals, ", "), "medians of per-repetition ratios")
	x.Claim("concurrent", "the NIC resolves several QPs' faults at once, as mlx5's page-fault work queue does: with "+
		"ConnectX-4's fault cost, splitting a cold pass among QPs multiplies its bandwidth", scales,
		fmt.Sprintf("%d QPs / 1 QP, aggregate bandwidth of the cold pass: %s (multiplies: at least 2)", top, strings.Join(parts, ", ")))
	// The pairs' links are not one link: ODP's aggregate must stay well below one
	// link's rate for that not to matter.
	rate, err := x.loadedParam("link_rate_mib_s")
	if err != nil {
		return nil // a run from before the rate was recorded: no claim
	}
	most := 0.0
	for _, n := range counts {
		for _, m := range faultModels {
			most = max(most, stats.Median(results.Floats(t.Rows(sel("qps", n, "variant", "odp", "fault_model", m.String())), "bw_mib_s")))
		}
	}
	slack, ev := true, fmt.Sprintf("ODP's largest aggregate bandwidth (median) %.0f MiB/s; links unlimited", most)
	if rate > 0 {
		slack = most <= rate/10
		ev = fmt.Sprintf("ODP's largest aggregate bandwidth (median) %.0f MiB/s, %.1f%% of one link's %.0f MiB/s (at most 10%%)",
			most, 100*most/rate, rate)
	}
	x.Claim("linkslack", "ODP's aggregate bandwidth stays below a tenth of one link's rate at every count, so one "+
		"shared link would not bind it", slack, ev)
	return nil
}
