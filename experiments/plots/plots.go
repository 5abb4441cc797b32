// Package plots draws the experiment suite's figures with gonum/plot: the median of
// each point's repetitions as a line, the median's 95% bootstrap interval as error
// bars (the quartiles for a summary without one), log scales where
// values span decades, a legend, and axes with units. Each figure is written as PNG
// (for looking at) and SVG (for the paper), sized for a paper's column.
package plots

import (
	"errors"
	"fmt"
	"image/color"
	"io"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"

	"github.com/odpemu/odpemu/experiments/results"
	"github.com/odpemu/odpemu/experiments/stats"
	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
	"gonum.org/v1/plot/vg/vgpdf"
	"gonum.org/v1/plot/vg/vgsvg"
)

// Axis describes one axis.
type Axis struct {
	Label string // with its unit, e.g. "registration time (µs)"
	Log   bool
	// Bytes labels a log axis's ticks as sizes (4K, 1M, 1G) at powers of 4.
	Bytes bool
	// Min, when non-zero, is where a linear axis starts (default: 0 or the data's
	// minimum, whichever is lower).
	Min float64
}

// Point is one x's summary of y over repetitions.
type Point struct {
	X float64
	Y stats.Summary
}

// Series is one line of a figure.
type Series struct {
	Name   string
	Points []Point
	Dashed bool // a reference or model rather than a measurement
	// Of, for a dashed series, names the series it is the reference of (a budget
	// line of a resident set): it is drawn in that series' colour and has no
	// legend entry of its own.
	Of string
}

// Figure is a line figure.
type Figure struct {
	// Title says what the figure shows. It is not drawn: a paper's caption says
	// it, and a title in the plot would repeat it (Caption returns it for a
	// summary to print beside the image).
	Title  string
	X, Y   Axis
	Series []Series
}

// Group summarises a table's rows into series: one per distinct value of the series
// column (in order of appearance), one point per distinct x, the summary of y over
// the rows that share them. Rows whose x or y is not a number are skipped.
func Group(rows []results.Row, x, y, series string) []Series {
	var out []Series
	for _, name := range results.Distinct(rows, series) {
		s := Series{Name: name}
		byX := map[float64][]float64{}
		var xs []float64
		for _, r := range rows {
			if r.Get(series) != name {
				continue
			}
			xv, yv := r.Float(x), r.Float(y)
			if math.IsNaN(xv) || math.IsNaN(yv) {
				continue
			}
			if _, ok := byX[xv]; !ok {
				xs = append(xs, xv)
			}
			byX[xv] = append(byX[xv], yv)
		}
		slices.Sort(xs)
		for _, xv := range xs {
			s.Points = append(s.Points, Point{X: xv, Y: stats.SummarizeCI(byX[xv])})
		}
		out = append(out, s)
	}
	return out
}

// Width and Height are a figure's size: a column of a two-column paper.
const (
	Width  = 3.4 * vg.Inch
	Height = 2.5 * vg.Inch
	dpi    = 200
)

// ErrEmpty is returned for a figure with no point to draw.
var ErrEmpty = errors.New("plots: nothing to draw")

// Caption returns what the figure shows, its Title.
func (f Figure) Caption() string { return f.Title }

// Caption returns what the figure shows, its Title.
func (b Bars) Caption() string { return b.Title }

// Save draws f and writes dir/name.png and dir/name.svg; it returns their paths.
func (f Figure) Save(dir, name string) ([]string, error) { return f.SaveAs(dir, name, "png", "svg") }

// SaveAs writes the figure as dir/name.<ext> for each of exts: png, svg or pdf.
func (f Figure) SaveAs(dir, name string, exts ...string) ([]string, error) {
	p, err := f.plot()
	if err != nil {
		return nil, fmt.Errorf("plots: %s: %w", name, err)
	}
	return saveAs(p, dir, name, exts)
}

// saveAs writes p as dir/name.<ext> for each of exts.
func saveAs(p *plot.Plot, dir, name string, exts []string) ([]string, error) {
	var paths []string
	for _, ext := range exts {
		path := filepath.Join(dir, name+"."+ext)
		if err := write(p, path, ext); err != nil {
			return nil, fmt.Errorf("plots: %s: %w", path, err)
		}
		paths = append(paths, path)
	}
	return paths, nil
}

func write(p *plot.Plot, path, ext string) error {
	var out io.WriterTo
	switch ext {
	case "png":
		img := vgimg.NewWith(vgimg.UseWH(Width, Height), vgimg.UseDPI(dpi))
		drawPlot(p, draw.New(img))
		out = vgimg.PngCanvas{Canvas: img}
	case "svg":
		svg := vgsvg.New(Width, Height)
		drawPlot(p, draw.New(svg))
		out = svg
	case "pdf":
		pdf := vgpdf.New(Width, Height)
		pdf.EmbedFonts(true)
		drawPlot(p, draw.New(pdf))
		out = pdf
	default:
		return fmt.Errorf("unknown figure format %q", ext)
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	_, err = out.WriteTo(f)
	return errors.Join(err, f.Close())
}

// drawPlot draws p on c. gonum makes room for a y axis's label as if it were
// centred on the axis's arithmetic midpoint, which on a log scale lies near the
// top, and shrinks the data area until the label fits there, though it draws the
// label centred: a log axis with a long label leaves the plot short under an empty
// band. So p is drawn with a label of one space, which takes the same width (a
// line's height) and fits anywhere, and the label is drawn here where gonum draws
// it, centred on the data area.
func drawPlot(p *plot.Plot, c draw.Canvas) {
	label := p.Y.Label.Text
	if label == "" {
		p.Draw(c)
		return
	}
	p.Y.Label.Text = " "
	defer func() { p.Y.Label.Text = label }()
	p.Draw(c)
	sty := p.Y.Label.TextStyle
	x := c.Min.X + sty.Height(label) - sty.FontExtents().Descent
	sty.Rotation += math.Pi / 2
	da := p.DataCanvas(c)
	c.FillText(sty, vg.Point{X: x, Y: da.Center().Y}, label)
}

// palette is Okabe and Ito's colour-blind-safe palette.
var palette = []color.Color{
	color.RGBA{0, 114, 178, 255}, color.RGBA{213, 94, 0, 255}, color.RGBA{0, 158, 115, 255},
	color.RGBA{204, 121, 167, 255}, color.RGBA{230, 159, 0, 255}, color.RGBA{86, 180, 233, 255},
	color.RGBA{0, 0, 0, 255}, color.RGBA{240, 228, 66, 255},
}

// plot builds the gonum plot of f.
func (f Figure) plot() (*plot.Plot, error) {
	p := plot.New()
	for _, a := range []struct {
		ax   *plot.Axis
		spec Axis
	}{{&p.X, f.X}, {&p.Y, f.Y}} {
		a.ax.Label.Text = a.spec.Label
		a.ax.Label.TextStyle.Font.Size = vg.Points(8)
		a.ax.Tick.Label.Font.Size = vg.Points(7)
		if err := fits(a.ax, a.ax == &p.Y); err != nil {
			return nil, err
		}
		switch {
		case a.spec.Log && a.spec.Bytes:
			a.ax.Scale, a.ax.Tick.Marker = plot.LogScale{}, byteTicks{}
		case a.spec.Log:
			a.ax.Scale, a.ax.Tick.Marker = plot.LogScale{}, decadeTicks{}
		default:
			a.ax.Tick.Marker = plainTicks{}
		}
	}
	p.Legend.Top, p.Legend.Left = true, true
	p.Legend.XOffs, p.Legend.YOffs = vg.Points(4), -vg.Points(2)
	p.Legend.TextStyle.Font.Size = vg.Points(7)
	p.Legend.ThumbnailWidth = vg.Points(14)
	p.Add(plotter.NewGrid())
	drawn := 0
	ymin := math.Inf(1)
	colour := map[string]int{} // a series' index in the palette, by name
	for i, s := range f.Series {
		var xys plotter.XYs
		var errs plotter.YErrors
		for _, pt := range s.Points {
			lo, hi := pt.Y.Band()
			if (f.X.Log && pt.X <= 0) || (f.Y.Log && lo <= 0) || pt.Y.N == 0 {
				continue // nothing to place on a log axis
			}
			xys = append(xys, plotter.XY{X: pt.X, Y: pt.Y.Median})
			errs = append(errs, struct{ Low, High float64 }{pt.Y.Median - lo, hi - pt.Y.Median})
			ymin = min(ymin, lo)
		}
		if len(xys) == 0 {
			continue
		}
		ci := i
		if s.Of != "" {
			if j, ok := colour[s.Of]; ok {
				ci = j
			}
		} else {
			colour[s.Name] = i
		}
		c := palette[ci%len(palette)]
		line, points, err := plotter.NewLinePoints(xys)
		if err != nil {
			return nil, err
		}
		line.Color, points.Color = c, c
		line.Width = vg.Points(1)
		points.Shape = shapes[i%len(shapes)]
		points.Radius = vg.Points(2)
		if s.Dashed {
			line.Dashes = []vg.Length{vg.Points(4), vg.Points(2)}
			points.Radius = 0
		}
		p.Add(line, points)
		if !s.Dashed {
			bars, err := plotter.NewYErrorBars(struct {
				plotter.XYs
				plotter.YErrors
			}{xys, errs})
			if err != nil {
				return nil, err
			}
			bars.Color = c
			bars.CapWidth = vg.Points(3)
			p.Add(bars)
		}
		if s.Of == "" {
			p.Legend.Add(s.Name, line, points)
			drawn++
		}
	}
	if drawn == 0 {
		return nil, ErrEmpty
	}
	if !f.Y.Log {
		p.Y.Min = min(p.Y.Min, f.Y.Min, ymin, 0)
	}
	headroom(&p.Y, f.Y.Log, drawn, f.under(p))
	return p, nil
}

// ErrLabelTooLong is returned for an axis label longer than its axis can hold.
var ErrLabelTooLong = errors.New("plots: axis label longer than the axis")

// fits checks that ax's label fits along it: gonum shrinks the data area until a
// y label does, which leaves the plot short under an empty band.
func fits(ax *plot.Axis, vertical bool) error {
	room := Width - vg.Points(50) // beside the y axis's ticks and labels
	if vertical {
		room = Height - vg.Points(40) // above the x axis's ticks and label
	}
	if w := ax.Label.TextStyle.Width(ax.Label.Text); w > room {
		return fmt.Errorf("%w: %q is %.0f pt, the axis %.0f pt", ErrLabelTooLong, ax.Label.Text, w.Points(), room.Points())
	}
	return nil
}

// under returns the highest y of the data under the legend, which sits in the top
// left corner of the data area: the points (the tops of their bands) whose x lies in
// the part of the x axis the legend's width covers, and the lines between them and
// their neighbours. NaN when no point is there.
func (f Figure) under(p *plot.Plot) float64 {
	frame := draw.Canvas{Rectangle: vg.Rectangle{Max: vg.Point{X: Width, Y: Height}}} // measures text only
	lw := p.Legend.Rectangle(frame).Size().X + p.Legend.XOffs + vg.Points(6)
	cover := float64(lw / (Width - vg.Points(45))) // of the data area's width, beside the y axis
	// pos is x's place along the x axis, 0 to 1.
	pos := func(x float64) float64 {
		lo, hi := p.X.Min, p.X.Max
		if f.X.Log {
			x, lo, hi = math.Log10(x), math.Log10(lo), math.Log10(hi)
		}
		if hi <= lo {
			return 0
		}
		return (x - lo) / (hi - lo)
	}
	top := math.NaN()
	for _, s := range f.Series {
		var prev *Point
		for i := range s.Points {
			pt := &s.Points[i]
			lo, hi := pt.Y.Band()
			if (f.X.Log && pt.X <= 0) || (f.Y.Log && lo <= 0) || pt.Y.N == 0 {
				continue
			}
			// A point under the legend, or the first one past it (the line to it
			// rises under the legend).
			if pos(pt.X) <= cover || (prev != nil && pos(prev.X) <= cover) {
				if math.IsNaN(top) || hi > top {
					top = hi
				}
			}
			prev = pt
		}
	}
	return top
}

// headroom raises the y axis's top so that the data under the legend, which sits
// in the top left corner and whose lines take about 7% of the height each, stays
// below it: the top rises only as far as that data needs (under, NaN: all of the
// data, as when the legend spans the whole width), so that the axis fits the data.
func headroom(ax *plot.Axis, log bool, lines int, under float64) {
	h := min(0.07*float64(lines)+0.03, 0.6)
	lo, hi := ax.Min, ax.Max
	u := under
	if math.IsNaN(u) || u > hi {
		u = hi
	}
	if log {
		lo, hi, u = math.Log10(lo), math.Log10(hi), math.Log10(max(u, ax.Min))
	}
	if hi <= lo {
		hi = lo + 1
	}
	hi = max(hi, lo+(u-lo)/(1-h)) // u at 1-h of the axis at most
	if log {
		hi = math.Pow(10, hi)
	}
	ax.Max = hi
}

var shapes = []draw.GlyphDrawer{draw.CircleGlyph{}, draw.SquareGlyph{}, draw.TriangleGlyph{}, draw.CrossGlyph{},
	draw.PlusGlyph{}, draw.RingGlyph{}, draw.BoxGlyph{}, draw.PyramidGlyph{}}

// byteTicks marks powers of 4 (every other power of 2) with sizes: 4K, 16K, ... 1G;
// where the range spans more than 2^12, powers of 16 get labels and the others
// minor ticks.
type byteTicks struct{}

func (byteTicks) Ticks(lo, hi float64) []plot.Tick {
	if lo <= 0 || hi <= lo {
		return nil
	}
	step := 2
	if math.Log2(hi/lo) > 12 {
		step = 4
	}
	var ts []plot.Tick
	for e := int(math.Floor(math.Log2(lo))); float64(e) <= math.Ceil(math.Log2(hi)); e++ {
		v := math.Ldexp(1, e)
		if v < lo || v > hi || e%2 != 0 {
			continue
		}
		t := plot.Tick{Value: v}
		if e%step == 0 {
			t.Label = sizeLabel(e)
		}
		ts = append(ts, t)
	}
	return ts
}

func sizeLabel(e int) string {
	units := []string{"", "K", "M", "G", "T"}
	u := min(e/10, len(units)-1)
	return strconv.Itoa(1<<(e-10*u)) + units[u]
}

// plainTicks are gonum's ticks of a linear axis written as short as they can be
// (2500, not 2500.00).
type plainTicks struct{}

func (plainTicks) Ticks(lo, hi float64) []plot.Tick {
	ts := plot.DefaultTicks{}.Ticks(lo, hi)
	for i, t := range ts {
		if t.Label != "" {
			// Ten significant digits first: 0.1 steps add to 0.30000000000000004.
			v, _ := strconv.ParseFloat(strconv.FormatFloat(t.Value, 'g', 10, 64), 64)
			ts[i].Label = strconv.FormatFloat(v, 'f', -1, 64)
		}
	}
	return ts
}

// decadeTicks marks powers of ten, written out up to 10^5 and as 1e6 beyond; on an
// axis that spans less than two decades, 2 and 5 times a power of ten are written
// too, so that the axis has more than one number.
type decadeTicks struct{}

func (decadeTicks) Ticks(lo, hi float64) []plot.Tick {
	// LogTicks also marks the powers of ten around the range; gonum makes room
	// for the labels of those beyond it, which shrinks the plot: they are dropped.
	ts := slices.DeleteFunc(plot.LogTicks{Prec: -1}.Ticks(lo, hi), func(t plot.Tick) bool {
		return t.Value < lo*(1-1e-9) || t.Value > hi*(1+1e-9)
	})
	few := hi/lo < 100
	for i, t := range ts {
		e := math.Floor(math.Log10(t.Value) + 1e-9)
		m := math.Round(t.Value / math.Pow(10, e))
		if t.Label == "" && !(few && (m == 2 || m == 5)) {
			continue
		}
		switch {
		case e >= 6 || e <= -4:
			ts[i].Label = strconv.FormatFloat(m, 'f', -1, 64) + "e" + strconv.Itoa(int(e))
			if m == 1 {
				ts[i].Label = "1e" + strconv.Itoa(int(e))
			}
		default:
			ts[i].Label = strconv.FormatFloat(m*math.Pow(10, e), 'f', -1, 64)
		}
	}
	return ts
}

// Stack is one segment of every bar of a bar figure: its value per category.
type Stack struct {
	Name   string
	Values []float64
}

// Bars is a stacked bar figure: one bar per category, its segments stacked in the
// order given.
type Bars struct {
	Title      string // what the figure shows, not drawn (as Figure's)
	Y          Axis
	Categories []string
	Stacks     []Stack
	// Intervals, when set, holds one interval per category, drawn as an error bar
	// over its bar: the 95% interval of the median the bar shows (of the total, for
	// a stack of segments). An interval with a NaN end is not drawn.
	Intervals []stats.Interval
	// Reference, when not zero, draws a dashed line across the bars at that value
	// (1 on a ratio's axis), named in the legend as parity.
	Reference float64
}

// Save draws b and writes dir/name.png and dir/name.svg; it returns their paths.
func (b Bars) Save(dir, name string) ([]string, error) { return b.SaveAs(dir, name, "png", "svg") }

// SaveAs writes the figure as dir/name.<ext> for each of exts: png, svg or pdf.
func (b Bars) SaveAs(dir, name string, exts ...string) ([]string, error) {
	p, err := b.plot()
	if err != nil {
		return nil, fmt.Errorf("plots: %s: %w", name, err)
	}
	return saveAs(p, dir, name, exts)
}

func (b Bars) plot() (*plot.Plot, error) {
	if len(b.Categories) == 0 || len(b.Stacks) == 0 {
		return nil, ErrEmpty
	}
	p := plot.New()
	p.Y.Label.Text = b.Y.Label
	p.Y.Label.TextStyle.Font.Size = vg.Points(8)
	p.Y.Tick.Label.Font.Size = vg.Points(7)
	p.Y.Tick.Marker = plainTicks{} // a log axis replaces it
	if err := fits(&p.Y, true); err != nil {
		return nil, err
	}
	p.X.Tick.Label.Font.Size = vg.Points(7)
	p.Legend.Top, p.Legend.Left = true, true
	p.Legend.XOffs, p.Legend.YOffs = vg.Points(4), -vg.Points(2)
	p.Legend.TextStyle.Font.Size = vg.Points(7)
	p.Add(plotter.NewGrid())
	width := (Width - vg.Points(60)) / vg.Length(len(b.Categories)) * 0.6
	var below *plotter.BarChart
	floor := 0.0
	if b.Y.Log {
		// A log axis has no zero: the bars rise from a power of ten at or below the
		// smallest value, an undrawn bar of that height under each. One stack only:
		// segments stacked on a log axis would not show their sizes.
		var err error
		if floor, err = b.logFloor(); err != nil {
			return nil, err
		}
		base := make(plotter.Values, len(b.Categories))
		for i := range base {
			base[i] = floor
		}
		if below, err = plotter.NewBarChart(base, width); err != nil {
			return nil, err
		}
		p.Y.Scale, p.Y.Tick.Marker = plot.LogScale{}, decadeTicks{}
	}
	for i, s := range b.Stacks {
		if len(s.Values) != len(b.Categories) {
			return nil, fmt.Errorf("stack %q has %d values for %d categories", s.Name, len(s.Values), len(b.Categories))
		}
		vals := make(plotter.Values, len(s.Values))
		for k, v := range s.Values {
			vals[k] = v - floor
		}
		bars, err := plotter.NewBarChart(vals, width)
		if err != nil {
			return nil, err
		}
		bars.Color = palette[i%len(palette)]
		bars.LineStyle.Width = 0
		if below != nil {
			bars.StackOn(below)
		}
		below = bars
		p.Add(bars)
		p.Legend.Add(s.Name, bars)
	}
	if err := b.addIntervals(p); err != nil {
		return nil, err
	}
	if b.Reference != 0 {
		n := float64(len(b.Categories))
		line, err := plotter.NewLine(plotter.XYs{{X: -0.5, Y: b.Reference}, {X: n - 0.5, Y: b.Reference}})
		if err != nil {
			return nil, err
		}
		line.Color = palette[len(b.Stacks)%len(palette)]
		line.Dashes = []vg.Length{vg.Points(4), vg.Points(2)}
		p.Add(line)
		p.Legend.Add(fmt.Sprintf("parity (%g)", b.Reference), line)
	}
	p.NominalX(b.Categories...)
	p.Y.Min = floor
	entries := len(b.Stacks)
	if b.Reference != 0 {
		entries++
	}
	headroom(&p.Y, b.Y.Log, entries, math.NaN()) // bars span the width: all under the legend
	return p, nil
}

// addIntervals draws b.Intervals as error bars at the categories' positions.
func (b Bars) addIntervals(p *plot.Plot) error {
	if b.Intervals == nil {
		return nil
	}
	if len(b.Intervals) != len(b.Categories) {
		return fmt.Errorf("%d intervals for %d categories", len(b.Intervals), len(b.Categories))
	}
	var xys plotter.XYs
	var errs plotter.YErrors
	for i, iv := range b.Intervals {
		if math.IsNaN(iv.Lo) || math.IsNaN(iv.Hi) {
			continue
		}
		if iv.Lo > iv.Hi || (b.Y.Log && !(iv.Lo > 0)) {
			return fmt.Errorf("interval %g-%g of %q cannot be drawn", iv.Lo, iv.Hi, b.Categories[i])
		}
		// From Lo up to Hi, wherever the bar's top is: a stack's top is the sum of
		// its segments' medians, which need not be the median of the totals.
		xys = append(xys, plotter.XY{X: float64(i), Y: iv.Lo})
		errs = append(errs, struct{ Low, High float64 }{0, iv.Hi - iv.Lo})
	}
	if len(xys) == 0 {
		return nil
	}
	bars, err := plotter.NewYErrorBars(struct {
		plotter.XYs
		plotter.YErrors
	}{xys, errs})
	if err != nil {
		return err
	}
	bars.Color = color.Black
	bars.CapWidth = vg.Points(4)
	p.Add(bars)
	return nil
}

// logFloor is where the bars of a log axis rise from: the power of ten at or below
// the smallest value. It refuses more than one stack and values that are not
// positive.
func (b Bars) logFloor() (float64, error) {
	if len(b.Stacks) != 1 {
		return 0, fmt.Errorf("a log axis takes one stack, not %d", len(b.Stacks))
	}
	lowest := math.Inf(1)
	for _, v := range b.Stacks[0].Values {
		if !(v > 0) {
			return 0, fmt.Errorf("stack %q: %g on a log axis", b.Stacks[0].Name, v)
		}
		lowest = min(lowest, v)
	}
	return math.Pow(10, math.Floor(math.Log10(lowest))), nil
}
