package suite

import (
	"fmt"
	"runtime"
	"time"

	"github.com/odpemu/odpemu/experiments/perf"
	"github.com/odpemu/odpemu/experiments/plots"
	"github.com/odpemu/odpemu/experiments/results"
	"github.com/odpemu/odpemu/experiments/stats"
	"github.com/odpemu/odpemu/odp"
)

var invalidationStorm = Experiment{
	Name:  "invalidation",
	Title: "Steady-state ODP bandwidth under a rate of invalidations of the server's MR",
	Run:   runInvalidation,
	Replot: func(x *X) error {
		return replot(x, "", func(t *results.Table) error {
			return invalidationReport(x, t, nonzero(ints(t, "rate_per_s")), nonzero(ints(t, "range_bytes")))
		})
	},
}

// faultModels are the fault costs experiments that take faults run with: this
// machine's and a NIC's.
var faultModels = []odp.FaultModel{odp.FaultModelEmulator, odp.FaultModelConnectX4}

func runInvalidation(x *X) error {
	const size = 64 << 10
	region := pick(x.Scale, 4<<20, 16<<20, 16<<20)
	runFor := pick(x.Scale, 100*time.Millisecond, 500*time.Millisecond, 500*time.Millisecond)
	rates := pick(x.Scale, []int{1000}, []int{100, 1000, 10000}, []int{10, 100, 1000, 10000})
	ranges := pick(x.Scale, []int{64 << 10}, []int{4 << 10, 64 << 10, 1 << 20}, []int{4 << 10, 64 << 10, 1 << 20})
	reps := pick(x.Scale, 1, 3, fullReps)
	x.Param("message_bytes", size)
	x.Param("region_bytes", region)
	x.Param("run_duration", runFor.String())
	x.Param("rates_per_s", rates)
	x.Param("range_bytes", ranges)
	x.Param("reps", reps)
	x.Param("run", "warm region, WRITEs striding over it for the run's duration, 128 in flight; random ranges of the server's MR invalidated on schedule")
	x.Steps(reps * (1 + len(faultModels)*(1+len(rates)*len(ranges))))
	t := x.Table("", "variant", "fault_model", "rate_per_s", "range_bytes", "rep", "bw_mib_s", "elapsed_ns",
		"invalidations", "achieved_rate_per_s", "network_page_faults", "pages_faulted", "rnr_naks")
	type run struct {
		odp         bool
		model       odp.FaultModel
		rate, bytes int
	}
	for rep := range reps {
		runs := []run{{}}
		for _, m := range faultModels {
			runs = append(runs, run{odp: true, model: m})
			for _, rate := range rates {
				for _, b := range ranges {
					runs = append(runs, run{odp: true, model: m, rate: rate, bytes: b})
				}
			}
		}
		runtime.GC()
		for i := range runs {
			r := runs[(i+rep)%len(runs)]
			res, err := perf.Run(x.nic(perf.Params{ODP: r.odp, Size: size, Iters: 1 << 30, Duration: runFor, MRSize: region, Warm: true,
				InvalidateRate: r.rate, InvalidateBytes: r.bytes, FaultModel: r.model}))
			if err != nil {
				return fmt.Errorf("rate %d, range %d: %w", r.rate, r.bytes, err)
			}
			variant := "pinned"
			if r.odp {
				variant = "odp"
			}
			if err := t.Add(variant, r.model.String(), r.rate, r.bytes, rep, res.AvgMiBps, res.Elapsed, res.Invalidations,
				float64(res.Invalidations)/res.Elapsed.Seconds(), res.PageFaults, res.PagesFaulted, res.RNRNaks); err != nil {
				return err
			}
			x.Step()
		}
	}
	return invalidationReport(x, t, rates, ranges)
}

func invalidationReport(x *X, t *results.Table, rates, ranges []int) error {
	for _, m := range faultModels {
		var series []plots.Series
		for _, b := range ranges {
			g := plots.Group(t.Rows(sel("variant", "odp", "fault_model", m.String(), "range_bytes", b)), "rate_per_s", "bw_mib_s", "variant")
			if len(g) == 1 {
				g[0].Name = "ODP, " + human(b) + " ranges"
				series = append(series, g[0])
			}
		}
		for _, base := range []struct{ name, variant, model string }{{"ODP, no invalidation", "odp", m.String()},
			{"pinned", "pinned", odp.FaultModelEmulator.String()}} {
			s := stats.Summarize(results.Floats(t.Rows(sel("variant", base.variant, "fault_model", base.model, "rate_per_s", 0)), "bw_mib_s"))
			line := plots.Series{Name: base.name, Dashed: true}
			// Across the rates measured, and a little beyond when there is one.
			for _, r := range []float64{float64(rates[0]) / 1.5, float64(rates[len(rates)-1]) * 1.5} {
				line.Points = append(line.Points, plots.Point{X: r, Y: exactly(s.Median)})
			}
			series = append(series, line)
		}
		if err := x.Figure("invalidation_"+m.String(), plots.Figure{
			Title:  fmt.Sprintf("Invalidation storm, %s fault cost", m),
			X:      plots.Axis{Label: "invalidations per second", Log: true},
			Y:      plots.Axis{Label: "bandwidth (MiB/s)"},
			Series: series}); err != nil {
			return err
		}
		top, mid := rates[len(rates)-1], ranges[len(ranges)/2]
		r := perRep(t, "bw_mib_s", sel("variant", "odp", "fault_model", m.String(), "rate_per_s", top, "range_bytes", mid),
			sel("variant", "odp", "fault_model", m.String(), "rate_per_s", 0))
		s := stats.Summarize(r)
		x.HeadlineCI(fmt.Sprintf("%d invalidations/s of %s ranges, %s faults: bandwidth / none", top, human(mid), m),
			fixed2(s.Median), ci(r, fixed2), fmt.Sprintf("median of %d per-repetition ratios, quartiles %.2f-%.2f", s.N, s.Q1, s.Q3))
	}
	return nil
}
