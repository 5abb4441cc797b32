package suite

import (
	"fmt"
	"time"

	"github.com/odpemu/odpemu/experiments/perf"
	"github.com/odpemu/odpemu/experiments/plots"
	"github.com/odpemu/odpemu/experiments/results"
	"github.com/odpemu/odpemu/experiments/stats"
)

// human writes a byte count as KiB, MiB or GiB.
func human(n int) string { return perf.HumanBytes(n) }

// dur writes nanoseconds as a duration of three significant digits or so.
func dur(ns float64) string {
	d := time.Duration(ns)
	for _, r := range []time.Duration{time.Second, time.Millisecond, time.Microsecond} {
		if d >= 10*r {
			return d.Round(r / 10).String()
		}
	}
	return d.Round(time.Nanosecond).String()
}

// ci writes the 95% bootstrap interval of the median of xs, each end written by
// f: "lo-hi", or the one value of a sample of one.
func ci(xs []float64, f func(float64) string) string {
	if len(xs) == 0 {
		return "-"
	}
	r := stats.MedianCI(xs, 0.95, ciSeed)
	if len(xs) == 1 {
		return f(r.Estimate) + " (one repetition)"
	}
	return f(r.Lo) + "–" + f(r.Hi)
}

// barInterval is the 95% bootstrap interval of the median of xs, each end times
// scale, for a bar figure (plots.Bars.Intervals); NaN ends for an empty sample.
func barInterval(xs []float64, scale float64) stats.Interval {
	r := stats.MedianCI(xs, 0.95, ciSeed)
	return stats.Interval{Estimate: r.Estimate * scale, Lo: r.Lo * scale, Hi: r.Hi * scale}
}

// medianCI writes the median of xs by f and its interval by ci.
func medianCI(xs []float64, f func(float64) string) (string, string) {
	return f(stats.Median(xs)), ci(xs, f)
}

// fixed2 writes a ratio with two decimals, as the headlines near 1 do.
func fixed2(v float64) string { return fmt.Sprintf("%.2f", v) }

// ratio writes a ratio: two decimals near 1, fewer far from it.
func ratio(r float64) string {
	switch {
	case r >= 100:
		return fmt.Sprintf("%.0fx", r)
	case r >= 10:
		return fmt.Sprintf("%.1fx", r)
	}
	return fmt.Sprintf("%.2fx", r)
}

// withinFactor reports whether the ratio r is within a factor of f of 1, either way
// (f and 1/f included).
func withinFactor(r, f float64) bool { return r >= 1/f && r <= f }

// scaleY multiplies every y of the series by f (units: ns to µs is 1e-3).
func scaleY(series []plots.Series, f float64) []plots.Series {
	for i := range series {
		for j := range series[i].Points {
			y := &series[i].Points[j].Y
			y.Min, y.Q1, y.Median, y.Q3, y.Max, y.Lo, y.Hi = y.Min*f, y.Q1*f, y.Median*f, y.Q3*f, y.Max*f, y.Lo*f, y.Hi*f
		}
	}
	return series
}

// exactly is the summary of a value that is not measured (a model's).
func exactly(v float64) stats.Summary {
	return stats.Summary{N: 1, Min: v, Q1: v, Median: v, Q3: v, Max: v}
}

// sel selects rows whose columns equal the values given as column, value pairs;
// values are written as the table writes them.
func sel(pairs ...any) func(results.Row) bool {
	strs := make([]string, len(pairs))
	for i, v := range pairs {
		strs[i] = fmt.Sprint(v)
	}
	return results.Where(strs...)
}

// ciSeed seeds the bootstrap intervals the reports compute: one constant, so that a
// replot of a run's CSVs computes the run's intervals again.
const ciSeed = 1

// perRep pairs the rows a selects with the rows b selects by repetition and returns
// col's ratio a/b for each pair: ratios of measurements made side by side.
func perRep(t *results.Table, col string, a, b func(results.Row) bool) []float64 {
	den := map[string]float64{}
	for _, r := range t.Rows(b) {
		den[r.Get("rep")] = r.Float(col)
	}
	var out []float64
	for _, r := range t.Rows(a) {
		if d, ok := den[r.Get("rep")]; ok && d > 0 {
			out = append(out, r.Float(col)/d)
		}
	}
	return out
}

// vsPinned returns variant's col over pinned's at size n, per repetition, among
// the rows that also match the extra column, value pairs.
func vsPinned(t *results.Table, col string, n int, variant string, extra ...any) []float64 {
	at := func(v string) func(results.Row) bool {
		return sel(append([]any{"size_bytes", n, "variant", v}, extra...)...)
	}
	return perRep(t, col, at(variant), at("pinned"))
}

// parity is the reference line at 1 of a ratio figure over sizes.
func parity(sizes []int) plots.Series {
	return plots.Series{Name: "parity (1)", Dashed: true,
		Points: []plots.Point{{X: float64(sizes[0]), Y: exactly(1)}, {X: float64(sizes[len(sizes)-1]), Y: exactly(1)}}}
}

// ratioSeries is one point per size, the summary of the ratios measured at it.
func ratioSeries(name string, sizes []int, ratios func(n int) []float64) plots.Series {
	s := plots.Series{Name: name}
	for _, n := range sizes {
		if r := ratios(n); len(r) > 0 {
			s.Points = append(s.Points, plots.Point{X: float64(n), Y: stats.SummarizeCI(r)})
		}
	}
	return s
}
