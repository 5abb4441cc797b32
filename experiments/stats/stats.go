// Package stats summarises repeated measurements: medians and quartiles, the
// statistics every odpemu experiment reports, since means are at the mercy of one
// slow run on a noisy machine, per-pair ratios of alternatives measured side by
// side, and bootstrap confidence intervals of medians.
package stats

import (
	"math"
	"math/rand/v2"
	"slices"
)

// Summary describes a sample.
type Summary struct {
	N                        int
	Min, Q1, Median, Q3, Max float64
	// Lo and Hi are the median's 95% bootstrap interval when HasCI (SummarizeCI).
	Lo, Hi float64
	HasCI  bool
}

// CISeed seeds the intervals SummarizeCI computes: one constant, so that a summary
// recomputed from the same sample is the same.
const CISeed = 1

// SummarizeCI is Summarize with the median's 95% bootstrap interval (MedianCI).
func SummarizeCI(xs []float64) Summary {
	s := Summarize(xs)
	if s.N > 0 {
		ci := MedianCI(xs, 0.95, CISeed)
		s.Lo, s.Hi, s.HasCI = ci.Lo, ci.Hi, true
	}
	return s
}

// Band is the interval a figure draws around the median: the 95% interval when the
// summary has one, else the quartiles.
func (s Summary) Band() (lo, hi float64) {
	if s.HasCI {
		return s.Lo, s.Hi
	}
	return s.Q1, s.Q3
}

// Summarize returns xs's summary; quartiles are interpolated between order
// statistics (Hyndman and Fan's type 7, R's and NumPy's default). An empty sample
// summarises to zeros with N 0.
func Summarize(xs []float64) Summary {
	if len(xs) == 0 {
		return Summary{}
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	return Summary{N: len(s), Min: s[0], Q1: quantileSorted(s, 0.25), Median: quantileSorted(s, 0.5),
		Q3: quantileSorted(s, 0.75), Max: s[len(s)-1]}
}

// Median returns xs's median (the mean of the middle two for an even count), 0 for
// an empty sample.
func Median(xs []float64) float64 { return Summarize(xs).Median }

// Quantile returns xs's q-quantile (0 <= q <= 1), interpolated as Summarize does; NaN
// for an empty sample or q out of range.
func Quantile(xs []float64, q float64) float64 {
	if len(xs) == 0 || q < 0 || q > 1 || math.IsNaN(q) {
		return math.NaN()
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	return quantileSorted(s, q)
}

func quantileSorted(s []float64, q float64) float64 {
	h := q * float64(len(s)-1)
	lo := int(math.Floor(h))
	if lo+1 >= len(s) {
		return s[len(s)-1]
	}
	return s[lo] + (h-float64(lo))*(s[lo+1]-s[lo])
}

// Ratios returns a[i]/b[i] for each pair: per-pair ratios of measurements made side
// by side, whose median cancels a noisy machine's drift better than a ratio of
// medians. It panics if the lengths differ, a programming error.
func Ratios(a, b []float64) []float64 {
	if len(a) != len(b) {
		panic("stats: Ratios of samples of different lengths")
	}
	r := make([]float64, len(a))
	for i := range a {
		r[i] = a[i] / b[i]
	}
	return r
}

// Interval is a confidence interval of a statistic: its estimate on the sample and
// the bounds.
type Interval struct {
	Estimate, Lo, Hi float64
}

// Resamples is how many bootstrap resamples MedianCI draws.
const Resamples = 2000

// MedianCI returns the median of xs with a percentile bootstrap confidence interval
// at level (0.95 for 95%): the median of each of Resamples resamples of xs drawn with
// replacement, the interval the middle level of them span. The resamples come from
// a generator seeded with seed, so that a result recomputed from the same sample is
// the same. An empty sample gives NaNs; one value, an interval of that value.
func MedianCI(xs []float64, level float64, seed uint64) Interval {
	if len(xs) == 0 || !(level > 0 && level < 1) {
		return Interval{math.NaN(), math.NaN(), math.NaN()}
	}
	rng := rand.New(rand.NewPCG(seed, 0x626f6f74))
	medians := make([]float64, Resamples)
	r := make([]float64, len(xs))
	for i := range medians {
		for j := range r {
			r[j] = xs[rng.IntN(len(xs))]
		}
		slices.Sort(r)
		medians[i] = quantileSorted(r, 0.5)
	}
	slices.Sort(medians)
	tail := (1 - level) / 2
	return Interval{Estimate: Median(xs), Lo: quantileSorted(medians, tail), Hi: quantileSorted(medians, 1-tail)}
}

// RatioCI is the median of the per-pair ratios a[i]/b[i] with MedianCI's interval:
// how every ratio of alternatives measured side by side is reported.
func RatioCI(a, b []float64, level float64, seed uint64) Interval {
	return MedianCI(Ratios(a, b), level, seed)
}
