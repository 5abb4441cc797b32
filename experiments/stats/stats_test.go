package stats

import (
	"math"
	"testing"

	"github.com/stretchr/testify/assert"
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
