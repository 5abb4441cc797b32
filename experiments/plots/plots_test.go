package plots

import (
	"bytes"
	"errors"
	"image/png"
	"math"
	"os"
	"path/filepath"
	"testing"

	"github.com/odpemu/odpemu/experiments/results"
	"github.com/odpemu/odpemu/experiments/stats"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
)

func TestGroup(t *testing.T) {
	tb, err := results.NewTable("t", "size", "method", "rep", "ns")
	require.NoError(t, err)
	for _, r := range [][]any{{4096, "pinned", 0, 10}, {4096, "pinned", 1, 30}, {4096, "pinned", 2, 20},
		{1024, "pinned", 0, 5}, {4096, "odp", 0, 1}, {4096, "odp", 1, "x"}} {
		require.NoError(t, tb.Add(r...))
	}
	s := Group(tb.Rows(nil), "size", "ns", "method")
	require.Len(t, s, 2)
	assert.Equal(t, "pinned", s[0].Name)
	require.Len(t, s[0].Points, 2)
	assert.Equal(t, 1024.0, s[0].Points[0].X, "points in x order")
	assert.Equal(t, 20.0, s[0].Points[1].Y.Median)
	assert.Equal(t, 3, s[0].Points[1].Y.N)
	assert.Equal(t, 1, s[1].Points[0].Y.N, "a value that is not a number is skipped")
}

func TestSaveWritesPNGAndSVG(t *testing.T) {
	f := Figure{Title: "registration", X: Axis{Label: "size (bytes)", Log: true, Bytes: true},
		Y: Axis{Label: "time (µs)", Log: true}, Series: []Series{
			{Name: "pinned", Points: []Point{{X: 4096, Y: summary(10, 12, 15)}, {X: 1 << 30, Y: summary(3e5, 3.7e5, 4e5)}}},
			{Name: "model", Dashed: true, Points: []Point{{X: 4096, Y: summary(16, 16, 16)}, {X: 1 << 30, Y: summary(8e4, 8e4, 8e4)}}},
			{Name: "zero on a log axis", Points: []Point{{X: 0, Y: summary(1, 1, 1)}}},
		}}
	dir := t.TempDir()
	paths, err := f.Save(dir, "reg")
	require.NoError(t, err)
	assert.Equal(t, []string{filepath.Join(dir, "reg.png"), filepath.Join(dir, "reg.svg")}, paths)
	b, err := os.ReadFile(paths[0])
	require.NoError(t, err)
	img, err := png.Decode(bytes.NewReader(b))
	require.NoError(t, err)
	assert.Equal(t, 680, img.Bounds().Dx(), "3.4 in at 200 dpi")
	svg, err := os.ReadFile(paths[1])
	require.NoError(t, err)
	assert.Contains(t, string(svg), "<svg")
	assert.Contains(t, string(svg), "pinned")

	_, err = Figure{Series: []Series{{Name: "empty"}}}.Save(dir, "empty")
	assert.True(t, errors.Is(err, ErrEmpty))
}

func TestByteTicks(t *testing.T) {
	var labels []string
	for _, tk := range (byteTicks{}).Ticks(4096, 1<<30) {
		if tk.Label != "" {
			labels = append(labels, tk.Label)
		}
	}
	assert.Equal(t, []string{"4K", "64K", "1M", "16M", "256M"}, labels)
	labels = nil
	for _, tk := range (byteTicks{}).Ticks(4096, 1<<20) {
		labels = append(labels, tk.Label)
	}
	assert.Equal(t, []string{"4K", "16K", "64K", "256K", "1M"}, labels)
}

func summary(q1, med, q3 float64) stats.Summary {
	return stats.Summary{N: 3, Min: q1, Q1: q1, Median: med, Q3: q3, Max: q3}
}

func TestBars(t *testing.T) {
	b := Bars{Title: "anatomy", Y: Axis{Label: "µs per page"}, Categories: []string{"a", "b"},
		Stacks: []Stack{{Name: "resolve", Values: []float64{1, 2}}, {Name: "update", Values: []float64{0.5, 0.1}}}}
	paths, err := b.Save(t.TempDir(), "bars")
	require.NoError(t, err)
	assert.Len(t, paths, 2)
	b.Stacks[1].Values = []float64{1}
	_, err = b.Save(t.TempDir(), "bad")
	assert.Error(t, err, "a stack with a value missing")
	_, err = Bars{}.Save(t.TempDir(), "empty")
	assert.True(t, errors.Is(err, ErrEmpty))
}

// The y axis rises above the data only as far as the data under the legend (top
// left) needs: a series that climbs to the right keeps its axis at its data; one
// that is high under the legend raises the axis to keep it below.
func TestHeadroomFitsTheData(t *testing.T) {
	pt := func(x, y float64) Point {
		return Point{X: x, Y: stats.Summary{N: 1, Min: y, Q1: y, Median: y, Q3: y, Max: y}}
	}
	var rising, falling Series
	rising.Name, falling.Name = "rising", "falling"
	for i := 0; i <= 10; i++ {
		x := math.Pow(4, float64(i)) * 4096
		rising.Points = append(rising.Points, pt(x, math.Pow(10, float64(i)/2)))
		falling.Points = append(falling.Points, pt(x, math.Pow(10, float64(10-i)/2)))
	}
	x, y := Axis{Label: "bytes", Log: true, Bytes: true}, Axis{Label: "time", Log: true}
	p, err := Figure{X: x, Y: y, Series: []Series{rising}}.plot()
	require.NoError(t, err)
	assert.InDelta(t, 5, math.Log10(p.Y.Max), 0.01, "rising: the axis ends at the data (1e5)")
	p, err = Figure{X: x, Y: y, Series: []Series{falling}}.plot()
	require.NoError(t, err)
	assert.Greater(t, math.Log10(p.Y.Max), 5.2, "falling: the data under the legend raises the axis")
	// Bars span the width: always raised.
	b, err := Bars{Categories: []string{"a"}, Stacks: []Stack{{Name: "s", Values: []float64{10}}}}.plot()
	require.NoError(t, err)
	assert.Greater(t, b.Y.Max, 10.0)
}

// A reference line of a series (Of) takes no legend entry: the legend of a series
// with its reference is the legend of the series alone.
func TestReferenceHasNoLegendEntry(t *testing.T) {
	pt := func(x, y float64) Point {
		return Point{X: x, Y: stats.Summary{N: 1, Min: y, Q1: y, Median: y, Q3: y, Max: y}}
	}
	trace := Series{Name: "resident", Points: []Point{pt(0, 3), pt(1, 4), pt(2, 3.5)}}
	ref := Series{Name: "budget", Of: "resident", Dashed: true, Points: []Point{pt(0, 4), pt(2, 4)}}
	other := Series{Name: "other", Dashed: true, Points: []Point{pt(0, 1), pt(2, 1)}}
	height := func(s ...Series) vg.Length {
		p, err := Figure{X: Axis{Label: "t"}, Y: Axis{Label: "y"}, Series: s}.plot()
		require.NoError(t, err)
		frame := draw.Canvas{Rectangle: vg.Rectangle{Max: vg.Point{X: Width, Y: Height}}}
		return p.Legend.Rectangle(frame).Size().Y
	}
	alone := height(trace)
	assert.Equal(t, alone, height(trace, ref), "the reference adds no entry")
	assert.Greater(t, height(trace, other), alone, "a series of its own does")
	_, err := Figure{X: Axis{Label: "t"}, Y: Axis{Label: "y"}, Series: []Series{ref}}.plot()
	assert.ErrorIs(t, err, ErrEmpty, "references alone draw no figure")
}

// A log axis spanning less than two decades labels 2 and 5 times a power of ten
// as well as the power; a wider one labels powers only.
func TestDecadeTicks(t *testing.T) {
	labels := func(lo, hi float64) []string {
		var out []string
		for _, tk := range (decadeTicks{}).Ticks(lo, hi) {
			if tk.Label != "" && tk.Value >= lo && tk.Value <= hi { // ticks beyond the axis are clipped
				out = append(out, tk.Label)
			}
		}
		return out
	}
	assert.Equal(t, []string{"100", "200", "500"}, labels(60, 600))
	assert.Equal(t, []string{"5e6", "1e7", "2e7"}, labels(4e6, 3e7))
	assert.Equal(t, []string{"0.1", "0.2", "0.5"}, labels(0.04, 0.6))
	assert.Equal(t, []string{"1", "10", "100", "1000"}, labels(1, 1000))
}

// An axis label longer than its axis is an error, not a figure whose plot shrinks
// to make room for it.
func TestLabelTooLong(t *testing.T) {
	s := Series{Name: "s", Points: []Point{{X: 1, Y: stats.Summary{N: 1, Q1: 1, Median: 1, Q3: 1}}}}
	long := "a label that goes on and on about what the axis shows, longer than the figure is high"
	_, err := Figure{X: Axis{Label: "x"}, Y: Axis{Label: long}, Series: []Series{s}}.plot()
	assert.ErrorIs(t, err, ErrLabelTooLong)
	_, err = Bars{Y: Axis{Label: long}, Categories: []string{"a"}, Stacks: []Stack{{Name: "s", Values: []float64{1}}}}.plot()
	assert.ErrorIs(t, err, ErrLabelTooLong)
	_, err = Figure{X: Axis{Label: "x"}, Y: Axis{Label: "thousand WRITEs per second", Log: true}, Series: []Series{s}}.plot()
	assert.NoError(t, err)
}

// Bars on a log axis rise from the power of ten at or below the smallest value (a
// log axis has no zero); they take one stack of positive values.
func TestLogBars(t *testing.T) {
	one := func(v ...float64) []Stack { return []Stack{{Name: "per fault", Values: v}} }
	p, err := Bars{Y: Axis{Label: "µs", Log: true}, Categories: []string{"a", "b", "c"}, Stacks: one(9.2, 220, 2.5)}.plot()
	require.NoError(t, err)
	assert.Equal(t, 1.0, p.Y.Min, "the floor under 2.5")
	assert.Greater(t, p.Y.Max, 220.0)
	_, err = Bars{Y: Axis{Label: "µs", Log: true}, Categories: []string{"a"}, Stacks: one(0)}.plot()
	assert.Error(t, err, "zero on a log axis")
	two := append(one(1), Stack{Name: "more", Values: []float64{2}})
	_, err = Bars{Y: Axis{Label: "µs", Log: true}, Categories: []string{"a"}, Stacks: two}.plot()
	assert.Error(t, err, "stacks on a log axis")
	dir := t.TempDir()
	_, err = Bars{Y: Axis{Label: "µs", Log: true}, Categories: []string{"a", "b"}, Stacks: one(3, 300)}.SaveAs(dir, "log", "png", "svg")
	require.NoError(t, err)
	svg, err := os.ReadFile(filepath.Join(dir, "log.svg"))
	require.NoError(t, err)
	assert.NotContains(t, string(svg), "NaN")
	assert.NotContains(t, string(svg), "Inf")
}

// A linear axis's ticks are written as short as they can be.
func TestPlainTicks(t *testing.T) {
	var labels []string
	for _, tk := range (plainTicks{}).Ticks(0, 5000) {
		if tk.Label != "" {
			labels = append(labels, tk.Label)
		}
	}
	assert.Contains(t, labels, "2500")
	for _, l := range labels {
		assert.NotContains(t, l, ".00", "%q", l)
	}
	for _, tk := range (plainTicks{}).Ticks(0, 1.3) {
		assert.LessOrEqual(t, len(tk.Label), 4, "%q: no float residue", tk.Label)
	}
}

// A bar's interval is drawn over it and widens the axis to hold it; a wrong count,
// an inverted interval or one at zero on a log axis is an error, a NaN one is not drawn.
func TestBarIntervals(t *testing.T) {
	one := func(v ...float64) []Stack { return []Stack{{Name: "per fault", Values: v}} }
	nan := math.NaN()
	b := Bars{Y: Axis{Label: "µs", Log: true}, Categories: []string{"a", "b"}, Stacks: one(9, 220),
		Intervals: []stats.Interval{{Estimate: 9, Lo: 8, Hi: 11}, {Estimate: 220, Lo: 200, Hi: 900}}}
	p, err := b.plot()
	require.NoError(t, err)
	assert.GreaterOrEqual(t, p.Y.Max, 900.0, "the axis holds the interval's top")
	b.Intervals[1] = stats.Interval{Estimate: 220, Lo: nan, Hi: nan}
	_, err = b.plot()
	assert.NoError(t, err, "an interval with NaN ends is left out")
	b.Intervals = b.Intervals[:1]
	_, err = b.plot()
	assert.Error(t, err, "one interval for two categories")
	b.Intervals = []stats.Interval{{Lo: 10, Hi: 9}, {Lo: 1, Hi: 2}}
	_, err = b.plot()
	assert.Error(t, err, "an inverted interval")
	b.Intervals = []stats.Interval{{Lo: 0, Hi: 9}, {Lo: 1, Hi: 2}}
	_, err = b.plot()
	assert.Error(t, err, "zero on a log axis")
	b.Y.Log = false
	_, err = b.plot()
	assert.NoError(t, err, "zero on a linear axis")
	b.Reference = 3
	p, err = b.plot()
	require.NoError(t, err)
	assert.GreaterOrEqual(t, p.Y.Max, 3.0, "the reference line is on the axis")
}
