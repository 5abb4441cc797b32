package suite

import (
	"fmt"
	"runtime"
	"time"

	"github.com/odpemu/odpemu/experiments/plots"
	"github.com/odpemu/odpemu/experiments/results"
	"github.com/odpemu/odpemu/experiments/stats"
	"github.com/odpemu/odpemu/odp"
)

// UCX's configured defaults for the cost of a memory registration on InfiniBand
// memory domains (MEM_REG_OVERHEAD and MEM_REG_GROWTH in its ib_md.c, where they are
// marked as estimates to revisit): 16 us plus 0.06 ns per byte. Its protocol
// selection assumes them; nobody measured them, and the figure draws them as a
// reference, not a model of what registration costs.
const (
	ucxRegFixed   = 16 * time.Microsecond
	ucxRegPerByte = 0.06 // ns
)

var registration = Experiment{
	Name:  "registration",
	Title: "Registration time vs MR size: pinned (in stages), ODP, deregistration",
	Run:   runRegistration,
	Replot: func(x *X) error {
		return replot(x, "", func(t *results.Table) error { return registrationReport(x, t, ints(t, "size_bytes")) })
	},
}

// sizesPow4 returns lo, 4*lo, ... up to hi.
func sizesPow4(lo, hi int) []int {
	var s []int
	for n := lo; n <= hi; n *= 4 {
		s = append(s, n)
	}
	return s
}

// memoryCap is the largest region an experiment allocates: a quarter of the
// machine's memory (two regions and the backing store must fit besides).
func memoryCap() int {
	return int(min(results.Describe().MemoryBytes/4, 1<<62))
}

func runRegistration(x *X) error {
	top := pick(x.Scale, 16<<20, 1<<30, 4<<30)
	for top > 4096 && top > memoryCap() {
		top /= 4
	}
	sizes := sizesPow4(4096, top)
	reps := pick(x.Scale, 2, 5, fullReps)
	x.Param("sizes", sizes)
	x.Param("reps", reps)
	x.Steps(len(sizes) * reps)
	t := x.Table("", "size_bytes", "method", "rep", "total_ns", "account_ns", "pin_ns", "mtt_ns",
		"register_ns", "snapshot_ns", "dereg_ns")
	d, err := odp.Open(x.device(odp.Config{})) // the profile's memory key costs
	if err != nil {
		return err
	}
	defer func() { _ = d.Close() }() // every MR and buffer is released by then
	pd, err := d.AllocPD()
	if err != nil {
		return err
	}
	for _, size := range sizes {
		for rep := range reps {
			// A collection before the pair, not before the timed calls: right after
			// one the allocator's caches are empty and a microsecond registration
			// takes ten.
			runtime.GC()
			order := []bool{false, true}
			if rep%2 == 1 {
				order = []bool{true, false}
			}
			for _, onDemand := range order {
				if err := registerOnce(d, pd, t, size, rep, onDemand); err != nil {
					return err
				}
			}
			x.Step()
		}
	}
	return registrationReport(x, t, sizes)
}

// registerOnce registers fresh, untouched memory of size bytes, deregisters it and
// records both.
func registerOnce(d *odp.Device, pd *odp.PD, t *results.Table, size, rep int, onDemand bool) error {
	buf, err := d.Alloc(size)
	if err != nil {
		return err
	}
	access, method := odp.AccessLocalWrite|odp.AccessRemoteWrite, "pinned"
	if onDemand {
		access, method = access|odp.AccessOnDemand, "odp"
	}
	mr, err := pd.RegMR(buf, access)
	if err != nil {
		return err
	}
	t0 := time.Now()
	if err := mr.Dereg(); err != nil {
		return err
	}
	dereg := time.Since(t0)
	if err := d.Free(buf); err != nil {
		return err
	}
	r := mr.Registration()
	return t.Add(size, method, rep, r.Total, r.Account, r.Pin, r.MTT, r.Register, r.Snapshot, dereg)
}

func registrationReport(x *X, t *results.Table, sizes []int) error {
	var series []plots.Series
	for _, s := range []struct{ method, col, name string }{
		{"pinned", "total_ns", "pinned: register"}, {"pinned", "pin_ns", "pinned: pin stage"},
		{"pinned", "dereg_ns", "pinned: deregister"}, {"odp", "total_ns", "ODP: register"}, {"odp", "dereg_ns", "ODP: deregister"},
	} {
		g := plots.Group(t.Rows(results.Where("method", s.method)), "size_bytes", s.col, "method")
		if len(g) == 1 {
			g[0].Name = s.name
			series = append(series, scaleY(g, 1e-3)...)
		}
	}
	model := plots.Series{Name: "UCX's default: 16 µs + 0.06 ns/B", Dashed: true}
	for _, n := range sizes {
		v := float64(ucxRegFixed)/1e3 + ucxRegPerByte*float64(n)/1e3
		model.Points = append(model.Points, plots.Point{X: float64(n), Y: exactly(v)})
	}
	series = append(series, model)
	err := x.Figure("registration", plots.Figure{Title: "Registering fresh memory",
		X: plots.Axis{Label: "MR size (bytes)", Log: true, Bytes: true}, Y: plots.Axis{Label: "time (µs), medians", Log: true},
		Series: series})
	if err != nil {
		return err
	}
	big := sizes[len(sizes)-1]
	at := func(method string) []float64 {
		return results.Floats(t.Rows(results.Where("method", method, "size_bytes", fmt.Sprint(big))), "total_ns")
	}
	pinned, onDemand := at("pinned"), at("odp")
	if len(pinned) == 0 || len(onDemand) == 0 {
		return fmt.Errorf("no registration of %d bytes", big)
	}
	// The ratio is the median of per-repetition ratios, as every ratio the suite
	// reports, with its bootstrap interval.
	ps, os := stats.Summarize(pinned), stats.Summarize(onDemand)
	r := stats.MedianCI(perRep(t, "total_ns", sel("method", "pinned", "size_bytes", big), sel("method", "odp", "size_bytes", big)),
		0.95, ciSeed)
	x.HeadlineCI(fmt.Sprintf("registration of %s: pinned / ODP", human(big)), ratio(r.Estimate), ratio(r.Lo)+"–"+ratio(r.Hi),
		fmt.Sprintf("median of %d per-repetition ratios; medians pinned %s, ODP %s; every run at least %.0fx (fastest pinned / slowest ODP)",
			ps.N, dur(ps.Median), dur(os.Median), ps.Min/os.Max))
	return nil
}
