package stats

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestSummarize(t *testing.T) {
	s := Summarize([]float64{7, 1, 3, 5})
	assert.Equal(t, Summary{N: 4, Min: 1, Q1: 2.5, Median: 4, Q3: 5.5, Max: 7}, s)
	assert.Equal(t, Summary{N: 1, Min: 2, Q1: 2, Median: 2, Q3: 2, Max: 2}, Summarize([]float64{2}))
	assert.Equal(t, Summary{}, Summarize(nil))
	// NumPy: np.percentile([1,2,3,4,5,6,7,8,9,10], [25, 50, 75]) = 3.25, 5.5, 7.75
	s = Summarize([]float64{10, 9, 8, 7, 6, 5, 4, 3, 2, 1})
	assert.InDelta(t, 3.25, s.Q1, 1e-12)
	assert.InDelta(t, 5.5, s.Median, 1e-12)
	assert.InDelta(t, 7.75, s.Q3, 1e-12)
}

func TestMedianDoesNotReorder(t *testing.T) {
	xs := []float64{3, 1, 2}
	assert.Equal(t, 2.0, Median(xs))
	assert.Equal(t, []float64{3, 1, 2}, xs)
	assert.Equal(t, 0.0, Median(nil))
}

func TestQuantile(t *testing.T) {
	xs := []float64{1, 2, 3, 4, 5}
	assert.Equal(t, 1.0, Quantile(xs, 0))
	assert.Equal(t, 5.0, Quantile(xs, 1))
	assert.Equal(t, 4.6, math.Round(Quantile(xs, 0.9)*10)/10)
	assert.True(t, math.IsNaN(Quantile(xs, 1.5)))
	assert.True(t, math.IsNaN(Quantile(nil, 0.5)))
}

func TestRatios(t *testing.T) {
	assert.Equal(t, []float64{2, 0.5}, Ratios([]float64{4, 1}, []float64{2, 2}))
	assert.Panics(t, func() { Ratios([]float64{1}, nil) })
}

// The bootstrap interval of a median covers the distribution's true median about as
// often as its level says: 400 samples of 25 from an exponential distribution
// (median ln 2) and from a normal one (median 3), each with its own seed.
func TestMedianCICovers(t *testing.T) {
	for _, d := range []struct {
		name   string
		median float64
		draw   func(*rand.Rand) float64
	}{
		{"exponential", math.Ln2, func(r *rand.Rand) float64 { return r.ExpFloat64() }},
		{"normal", 3, func(r *rand.Rand) float64 { return 3 + 2*r.NormFloat64() }},
	} {
		rng := rand.New(rand.NewPCG(7, 11))
		covered := 0
		const trials = 400
		for i := range trials {
			xs := make([]float64, 25)
			for j := range xs {
				xs[j] = d.draw(rng)
			}
			ci := MedianCI(xs, 0.95, uint64(i))
			assert.LessOrEqual(t, ci.Lo, ci.Estimate, d.name)
			assert.GreaterOrEqual(t, ci.Hi, ci.Estimate, d.name)
			if ci.Lo <= d.median && d.median <= ci.Hi {
				covered++
			}
		}
		cov := float64(covered) / trials
		t.Logf("%s: coverage %.3f", d.name, cov)
		assert.InDelta(t, 0.95, cov, 0.04, "%s: coverage %.3f", d.name, cov)
	}
	// Determinism, and the edges.
	xs := []float64{5, 1, 4, 2, 3}
	assert.Equal(t, MedianCI(xs, 0.95, 1), MedianCI(xs, 0.95, 1))
	assert.Equal(t, Interval{2, 2, 2}, MedianCI([]float64{2}, 0.95, 1))
	assert.True(t, math.IsNaN(MedianCI(nil, 0.95, 1).Estimate))
	assert.True(t, math.IsNaN(MedianCI(xs, 1.5, 1).Lo))
	r := RatioCI([]float64{2, 4, 6}, []float64{1, 2, 3}, 0.9, 1)
	assert.Equal(t, Interval{2, 2, 2}, r, "identical ratios")
}

// SummarizeCI adds the median's 95% bootstrap interval, which brackets the median,
// is the same when recomputed, and is what Band returns; a plain summary's band is
// its quartiles.
func TestSummarizeCI(t *testing.T) {
	xs := []float64{5, 1, 4, 2, 3, 9, 7}
	s := SummarizeCI(xs)
	require.True(t, s.HasCI)
	assert.LessOrEqual(t, s.Lo, s.Median)
	assert.GreaterOrEqual(t, s.Hi, s.Median)
	assert.Equal(t, s, SummarizeCI(xs), "seeded: the same sample, the same interval")
	lo, hi := s.Band()
	assert.Equal(t, [2]float64{s.Lo, s.Hi}, [2]float64{lo, hi})
	p := Summarize(xs)
	lo, hi = p.Band()
	assert.Equal(t, [2]float64{p.Q1, p.Q3}, [2]float64{lo, hi})
	assert.False(t, SummarizeCI(nil).HasCI, "an empty sample has no interval")
}
