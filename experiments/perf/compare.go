package perf

import (
	"fmt"
	"io"
	"math"
	"runtime"
	"slices"
	"sort"
	"time"

	"github.com/odpemu/odpemu/experiments/stats"
	"github.com/odpemu/odpemu/internal/bytesize"
	"github.com/odpemu/odpemu/odp"
)

// CompareParams configure Compare.
type CompareParams struct {
	Test  string // WriteBW or ReadBW (warm pairs do not measure SendBW)
	Sizes []int  // message sizes
	Iters int
	Reps  int // cold pinned/ODP pairs per size; medians are reported
	// WarmPairs bursts of WarmIters work requests are measured each way in steady
	// state (defaults 100 and 1000): many short pairs give a steady median on a
	// noisy machine.
	WarmPairs, WarmIters int
	RegSizes             []int // region sizes for the registration comparison
	MRSize               int   // 0: size x depth
	// Progress, if set, is called after each run with runs done and runs in all.
	Progress func(done, total int)
}

// Row is one message size's medians.
type Row struct {
	Bytes                int
	PinnedCold, ODPCold  float64 // MiB/s
	PinnedWarm, ODPWarm  float64
	RatioCold, RatioWarm float64 // ODP / pinned: medians of per-pair ratios
	WarmQ1, WarmQ3       float64 // quartiles of the warm per-pair ratios
	ColdFaults           uint64  // network page faults of a cold ODP run (median)
}

// RegRow compares registration times for one region size.
type RegRow struct {
	Bytes             int
	Pinned, ODP       time.Duration // medians
	PinnedMin, ODPMin time.Duration
	ODPMax            time.Duration
	Speedup           float64 // of the medians
	// SpeedupWorst is pinned's fastest run over ODP's slowest: the speedup every run
	// of the comparison reached.
	SpeedupWorst float64
	PinnedStages odp.RegTiming // of the median pinned run
}

// Compare runs pinned and ODP back to back in one process, cold and warm, for every
// size. Cold runs use fresh memory and are paired per repetition; warm runs use one
// buffer registered both ways with alternating bursts (WarmPair), so that the only
// difference measured is the registration. Ratios are medians of per-pair ratios,
// which cancels the drift of a noisy machine better than a ratio of medians.
func Compare(cp *CompareParams) ([]Row, []RegRow, error) {
	if cp.Reps < 1 {
		cp.Reps = 1
	}
	if cp.WarmPairs < 1 {
		cp.WarmPairs = 100
	}
	if cp.WarmIters < 1 {
		cp.WarmIters = 1000
	}
	total := len(cp.Sizes)*(cp.Reps*2+1) + len(cp.RegSizes)*cp.Reps*2
	done := 0
	step := func() {
		done++
		if cp.Progress != nil {
			cp.Progress(done, total)
		}
	}
	var rows []Row
	for _, size := range cp.Sizes {
		// Cold: fresh devices and memory per run, pinned and ODP paired in each
		// repetition (alternating which goes first); the ratio is the median of the
		// pairs' ratios.
		var pc, oc, ratios, faults []float64
		for rep := 0; rep < cp.Reps; rep++ {
			var pair [2]Result
			for _, useODP := range [][]bool{{false, true}, {true, false}}[rep%2] {
				runtime.GC()
				r, err := Run(Params{Test: cp.Test, ODP: useODP, Size: size, Iters: cp.Iters, MRSize: cp.MRSize})
				if err != nil {
					return nil, nil, err
				}
				pair[b2i(useODP)] = r
				step()
			}
			pc, oc = append(pc, pair[0].AvgMiBps), append(oc, pair[1].AvgMiBps)
			ratios = append(ratios, pair[1].AvgMiBps/pair[0].AvgMiBps)
			faults = append(faults, float64(pair[1].PageFaults))
		}
		// Warm: the same memory registered both ways, bursts alternating.
		runtime.GC()
		pw, ow, err := WarmPair(Params{Test: cp.Test, Size: size, Iters: cp.WarmIters, MRSize: cp.MRSize}, cp.WarmPairs)
		if err != nil {
			return nil, nil, err
		}
		step()
		var warmRatios []float64
		for i := range pw {
			warmRatios = append(warmRatios, ow[i]/pw[i])
		}
		sort.Float64s(warmRatios)
		rows = append(rows, Row{Bytes: size, PinnedCold: stats.Median(pc), ODPCold: stats.Median(oc), RatioCold: stats.Median(ratios),
			PinnedWarm: stats.Median(pw), ODPWarm: stats.Median(ow), RatioWarm: stats.Median(warmRatios),
			WarmQ1: warmRatios[len(warmRatios)/4], WarmQ3: warmRatios[len(warmRatios)*3/4], ColdFaults: uint64(stats.Median(faults))})
	}
	var regs []RegRow
	for _, size := range cp.RegSizes {
		rr, err := compareRegistration(size, cp.Reps, step)
		if err != nil {
			return nil, nil, err
		}
		regs = append(regs, rr)
	}
	return rows, regs, nil
}

// compareRegistration times RegMR of fresh, untouched memory, pinned and on demand.
// The garbage collector runs before each pair's allocations, not just before the
// timed call: right after a collection the allocator's caches are empty and the
// collector's workers still run, which made a microsecond registration take tens of
// microseconds and compared pinning with the collector's aftermath.
func compareRegistration(size, reps int, step func()) (RegRow, error) {
	d, err := odp.Open(odp.Config{})
	if err != nil {
		return RegRow{}, err
	}
	defer func() { _ = d.Close() }() // every MR and buffer is released by then: nothing to report
	pd, err := d.AllocPD()
	if err != nil {
		return RegRow{}, err
	}
	var pinned, onDemand []float64
	stages := map[float64]odp.RegTiming{}
	for rep := 0; rep < reps; rep++ {
		runtime.GC()
		for _, access := range []odp.Access{odp.AccessLocalWrite, odp.AccessLocalWrite | odp.AccessOnDemand} {
			buf, err := d.Alloc(size)
			if err != nil {
				return RegRow{}, err
			}
			mr, err := pd.RegMR(buf, access)
			if err != nil {
				return RegRow{}, err
			}
			t := mr.Registration()
			if access&odp.AccessOnDemand != 0 {
				onDemand = append(onDemand, float64(t.Total))
			} else {
				pinned = append(pinned, float64(t.Total))
				stages[float64(t.Total)] = t
			}
			if err := mr.Dereg(); err != nil {
				return RegRow{}, err
			}
			if err := d.Free(buf); err != nil {
				return RegRow{}, err
			}
			step()
		}
	}
	r := RegRow{Bytes: size, Pinned: time.Duration(stats.Median(pinned)), ODP: time.Duration(stats.Median(onDemand)),
		PinnedMin: time.Duration(slices.Min(pinned)), ODPMin: time.Duration(slices.Min(onDemand)),
		ODPMax: time.Duration(slices.Max(onDemand))}
	r.Speedup = float64(r.Pinned) / float64(max(r.ODP, 1))
	r.SpeedupWorst = float64(r.PinnedMin) / float64(max(r.ODPMax, 1))
	// The stages of the pinned run closest to the median (with an even number of runs
	// the median is between two of them).
	best := pinned[0]
	for _, p := range pinned {
		if math.Abs(p-stats.Median(pinned)) < math.Abs(best-stats.Median(pinned)) {
			best = p
		}
	}
	r.PinnedStages = stages[best]
	return r, nil
}

// WriteRows prints the comparison table.
func WriteRows(w io.Writer, cp CompareParams, rows []Row) {
	fmt.Fprintf(w, "# %s: pinned vs ODP, BW average in MiB/s (medians), ODP/pinned = median of per-pair ratios\n", cp.Test)
	fmt.Fprintf(w, "# cold: fresh memory per run, %d pairs of %d iterations; warm: one buffer registered both ways, %d alternating burst pairs of %d iterations\n",
		cp.Reps, cp.Iters, cp.WarmPairs, cp.WarmIters)
	fmt.Fprintf(w, "%-9s %12s %12s %10s %12s %12s %10s %13s %12s\n", "#bytes", "pinned_cold", "odp_cold", "odp/pinned",
		"pinned_warm", "odp_warm", "odp/pinned", "warm_iqr", "cold_faults")
	for _, r := range rows {
		fmt.Fprintf(w, "%-9d %12.1f %12.1f %10.3f %12.1f %12.1f %10.3f %6.3f-%-6.3f %12d\n", r.Bytes, r.PinnedCold, r.ODPCold,
			r.RatioCold, r.PinnedWarm, r.ODPWarm, r.RatioWarm, r.WarmQ1, r.WarmQ3, r.ColdFaults)
	}
}

// WriteRegRows prints the registration lines.
func WriteRegRows(w io.Writer, regs []RegRow) {
	for _, r := range regs {
		us := func(d time.Duration) string { return d.Round(100 * time.Nanosecond).String() }
		fmt.Fprintf(w, "registration %s: pinned %v (min %v), odp %v (min %v, max %v), speedup %.0fx, every run %.0fx (pinned stages: account %v, pin %v, mtt %v)\n",
			HumanBytes(r.Bytes), us(r.Pinned), us(r.PinnedMin), us(r.ODP), us(r.ODPMin), us(r.ODPMax), r.Speedup, r.SpeedupWorst,
			us(r.PinnedStages.Account), us(r.PinnedStages.Pin), us(r.PinnedStages.MTT))
	}
}

// HumanBytes writes n as KiB, MiB or GiB when it is a whole multiple.
func HumanBytes(n int) string { return bytesize.Format(int64(n)) }

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

// SweepRow is the ODP registration time of untouched memory of one size.
type SweepRow struct {
	Bytes       int
	Median, Min time.Duration
}

// ODPRegSweep times ODP registration of fresh, untouched memory of every size, reps
// times each, sizes interleaved within each repetition and nothing else in between
// (no pinned registration to empty the caches): the cost of registration alone,
// which should not depend on the size.
func ODPRegSweep(sizes []int, reps int) ([]SweepRow, error) {
	d, err := odp.Open(odp.Config{})
	if err != nil {
		return nil, err
	}
	defer func() { _ = d.Close() }() // every MR and buffer is released by then: nothing to report
	pd, err := d.AllocPD()
	if err != nil {
		return nil, err
	}
	times := make([][]float64, len(sizes))
	for rep := 0; rep < max(reps, 1); rep++ {
		runtime.GC()
		// Round -1 is a warm-up after the collection, not timed.
		for i := -1; i < len(sizes); i++ {
			size := sizes[max(i, 0)]
			buf, err := d.Alloc(size)
			if err != nil {
				return nil, err
			}
			mr, err := pd.RegMR(buf, odp.AccessLocalWrite|odp.AccessOnDemand)
			if err != nil {
				return nil, err
			}
			if i >= 0 {
				times[i] = append(times[i], float64(mr.Registration().Total))
			}
			if err := mr.Dereg(); err != nil {
				return nil, err
			}
			if err := d.Free(buf); err != nil {
				return nil, err
			}
		}
	}
	rows := make([]SweepRow, len(sizes))
	for i, size := range sizes {
		rows[i] = SweepRow{Bytes: size, Median: time.Duration(stats.Median(times[i])), Min: time.Duration(slices.Min(times[i]))}
	}
	return rows, nil
}

// WriteSweep prints the sweep on one line, with the largest median over the smallest.
func WriteSweep(w io.Writer, rows []SweepRow) {
	if len(rows) == 0 {
		return
	}
	lo, hi := rows[0].Median, rows[0].Median
	fmt.Fprintf(w, "registration odp untouched (median):")
	for _, r := range rows {
		fmt.Fprintf(w, " %s %v;", HumanBytes(r.Bytes), r.Median.Round(100*time.Nanosecond))
		lo, hi = min(lo, r.Median), max(hi, r.Median)
	}
	fmt.Fprintf(w, " max/min %.2f\n", float64(hi)/float64(max(lo, 1)))
}
