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

var coldWarm = Experiment{
	Name:  "coldwarm",
	Title: "Bandwidth of a first pass over fresh memory and of steady state, pinned vs ODP variants",
	Run:   runColdWarm,
	Replot: func(x *X) error {
		return replot(x, "", func(t *results.Table) error { return coldWarmReport(x, t, ints(t, "size_bytes")) })
	},
}

// transferVariant is one way to register and prepare the memory of a transfer.
type transferVariant struct {
	name        string
	odp         bool
	faultAround int
	prefetch    string
	model       odp.FaultModel
}

var coldWarmVariants = []transferVariant{
	{name: "pinned"},
	{name: "odp", odp: true, faultAround: 16},
	{name: "odp-fa1", odp: true, faultAround: 1},
	{name: "odp-fa64", odp: true, faultAround: 64},
	{name: "odp-prefetch-sync", odp: true, faultAround: 16, prefetch: "sync"},
	{name: "odp-prefetch-async", odp: true, faultAround: 16, prefetch: "async"},
	{name: "odp-connectx4", odp: true, faultAround: 16, model: odp.FaultModelConnectX4},
}

func (v transferVariant) params(size, region int) perf.Params {
	return perf.Params{ODP: v.odp, Size: size, MRSize: region, FaultAround: v.faultAround, Prefetch: v.prefetch,
		FaultModel: v.model}
}

func runColdWarm(x *X) error {
	sizes := pick(x.Scale, []int{4 << 10, 64 << 10}, []int{4 << 10, 64 << 10, 1 << 20}, []int{4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20})
	// A pass is at least passMsgs messages: a pass of a few messages measures the
	// start of a run, not its steady rate.
	region := pick(x.Scale, 4<<20, 32<<20, 32<<20)
	passMsgs := pick(x.Scale, 64, 128, 128)
	reps := pick(x.Scale, 1, 3, fullReps)
	x.Param("message_sizes", sizes)
	x.Param("region_bytes", fmt.Sprintf("max(%d, %d x message size)", region, passMsgs))
	x.Param("reps", reps)
	x.Param("pass", "the cold pass WRITEs every message-sized slot of a fresh region once (region/size work requests, 128 in flight) "+
		"to a fresh region of the same size; the warm pass repeats it over the same memory. bw_mib_s times the pass alone: "+
		"the two regions' registration (registration_ns, for both passes the one registration before the cold pass) and "+
		"prefetch (prefetch_ns, for async only the call) come before it; bw_prepared_mib_s times the cold pass with them "+
		"(the warm pass: as bw_mib_s). Before each pass the CPU writes both regions four more times (an async prefetch is "+
		"issued after that), so that the pass starts from memory just written whatever the setup took")
	x.Steps(len(sizes) * reps)
	t := x.Table("", "size_bytes", "variant", "fault_model", "fault_around", "prefetch", "rep", "pass", "bw_mib_s",
		"msg_rate_mpps", "elapsed_ns", "iterations", "network_page_faults", "pages_faulted", "rnr_naks",
		"retransmissions", "prefetch_ns", "registration_ns", "bw_prepared_mib_s")
	for _, size := range sizes {
		for rep := range reps {
			runtime.GC()
			for i := range coldWarmVariants {
				v := coldWarmVariants[(i+rep)%len(coldWarmVariants)]
				cold, warm, err := perf.ColdWarm(v.params(size, max(region, passMsgs*size)))
				if err != nil {
					return fmt.Errorf("%s, %s: %w", v.name, human(size), err)
				}
				for _, r := range []struct {
					pass string
					r    perf.Result
				}{{"cold", cold}, {"warm", warm}} {
					if err := t.Add(size, v.name, v.model.String(), v.faultAround, v.prefetch, rep, r.pass, r.r.AvgMiBps,
						r.r.MsgRateMpps, r.r.Elapsed, r.r.Iters, r.r.PageFaults, r.r.PagesFaulted, r.r.RNRNaks,
						r.r.Retransmissions, r.r.PrefetchTime, r.r.RegTime, prepared(r.r)); err != nil {
						return err
					}
				}
			}
			x.Step()
		}
	}
	return coldWarmReport(x, t, sizes)
}

func coldWarmReport(x *X, t *results.Table, sizes []int) error {
	var main []plots.Series
	for _, s := range []struct{ variant, pass string }{{"pinned", "cold"}, {"pinned", "warm"}, {"odp", "cold"}, {"odp", "warm"},
		{"odp-connectx4", "cold"}} {
		g := plots.Group(t.Rows(results.Where("variant", s.variant, "pass", s.pass)), "size_bytes", "bw_mib_s", "variant")
		if len(g) == 1 {
			g[0].Name = s.variant + ", " + s.pass
			main = append(main, g[0])
		}
	}
	if err := x.Figure("coldwarm", plots.Figure{Title: "First pass over fresh memory (cold) and steady state (warm)",
		X: plots.Axis{Label: "message size (bytes)", Log: true, Bytes: true}, Y: plots.Axis{Label: "bandwidth (MiB/s)"},
		Series: main}); err != nil {
		return err
	}
	var ratios []plots.Series
	for _, v := range coldWarmVariants[1:] {
		ratios = append(ratios, ratioSeries(v.name, sizes, func(n int) []float64 {
			return vsPinned(t, "bw_mib_s", n, v.name, "pass", "cold")
		}))
	}
	if err := x.Figure("coldwarm_variants", plots.Figure{Title: "Cold pass: ODP variants over pinned",
		X: plots.Axis{Label: "message size (bytes)", Log: true, Bytes: true}, Y: plots.Axis{Label: "bandwidth ratio to pinned (1: parity)", Log: true},
		Series: append(ratios, parity(sizes))}); err != nil {
		return err
	}
	// The claims the paper makes of the cold pass (medians of per-repetition ratios
	// to pinned, at every size): a synchronous prefetch brings it within a factor of 2
	// of pinned; an asynchronous one, racing the pass, recovers most of what the
	// synchronous one does, and much more than no prefetch; the ConnectX-4 model
	// changes it little (within a factor of 2 of the emulator's fault cost).
	//
	// Whether the asynchronous prefetch recovers less than the synchronous one is
	// not a claim: over ten repetitions it does at every size (async / sync, paired
	// by repetition, medians 0.81-0.91 in one full run, 0.75-0.97 in another, the
	// interval including 1 at two of five sizes), but the two differ by less than the
	// spread of three repetitions, and quick runs found it either way. The paired
	// ratio is a headline, with its interval, instead.
	near, most, little := true, true, true
	var ne, me, ce []string
	for _, n := range sizes {
		cold := func(v string) float64 { return stats.Median(vsPinned(t, "bw_mib_s", n, v, "pass", "cold")) }
		sync, async, plain, cx := cold("odp-prefetch-sync"), cold("odp-prefetch-async"), cold("odp"), cold("odp-connectx4")
		ofSync := stats.Median(coldPaired(t, n, "odp-prefetch-async", "odp-prefetch-sync"))
		near = near && sync >= 0.5
		most = most && ofSync >= 0.5 && async >= 2*plain
		little = little && cx/plain >= 0.5 && cx/plain <= 2
		ne = append(ne, fmt.Sprintf("%s %.2f", human(n), sync))
		me = append(me, fmt.Sprintf("%s %.2f of sync, %.2f vs %.3f", human(n), ofSync, async, plain))
		ce = append(ce, fmt.Sprintf("%s %.3f vs %.3f", human(n), cx, plain))
	}
	x.Claim("syncnear", "a synchronous prefetch brings the cold pass within a factor of 2 of pinned", near,
		"odp-prefetch-sync cold / pinned cold (at least 0.5 at every size): "+strings.Join(ne, ", "))
	x.Claim("asyncmost", "an asynchronous one, which races the pass, recovers most of that, far more than no prefetch", most,
		"at every size, odp-prefetch-async / odp-prefetch-sync cold (paired by repetition) at least 0.5, and "+
			"odp-prefetch-async / pinned at least twice odp / pinned: "+strings.Join(me, ", "))
	x.Claim("cxlittle", "The ConnectX-4 model changes little here", little,
		"cold pass over pinned, connectx4 fault cost vs the emulator's (little: within a factor of 2): "+strings.Join(ce, ", "))
	// One headline per comparison, each listing every size: the same headlines at
	// every scale, whatever its sizes.
	// It returns the medians, by size.
	bySize := func(what, detail string, ratios func(n int) []float64) []float64 {
		var parts, intervals []string
		var meds []float64
		for _, n := range sizes {
			rs := ratios(n)
			meds = append(meds, stats.Median(rs))
			parts = append(parts, fixed2(meds[len(meds)-1])+" at "+human(n))
			intervals = append(intervals, ci(rs, fixed2)+" at "+human(n))
		}
		x.HeadlineCI(what, strings.Join(parts, ", "), strings.Join(intervals, ", "), detail)
		return meds
	}
	bySize("ODP / pinned bandwidth, cold pass, by message size", "medians of per-repetition ratios; the pass alone is timed",
		func(n int) []float64 { return vsPinned(t, "bw_mib_s", n, "odp", "pass", "cold") })
	// The warm pass is a headline and no claim: it follows a cold pass that waited out
	// RNR timers, and what that idling leaves behind on these VMs (perf's settle)
	// decides it more than ODP does. "Warm ODP stays below pinned at every size" held
	// in every run before the passes were settled; after, ODP's warm pass came to
	// 0.98-1.01 of pinned's at 1 MiB, and quick runs put it at 0.7-1.5 of the
	// prefetched variant's.
	bySize("ODP / pinned bandwidth, warm pass, by message size", "medians of per-repetition ratios",
		func(n int) []float64 { return vsPinned(t, "bw_mib_s", n, "odp", "pass", "warm") })
	bySize("pinned cold pass / warm pass bandwidth, by message size", "should be about 1 (pinned takes no fault); medians of per-repetition ratios",
		func(n int) []float64 {
			return perRep(t, "bw_mib_s", sel("size_bytes", n, "variant", "pinned", "pass", "cold"),
				sel("size_bytes", n, "variant", "pinned", "pass", "warm"))
		})
	faster := true
	for _, v := range []string{"odp", "odp-prefetch-sync"} {
		var parts, intervals []string
		for _, n := range sizes {
			rs := vsPinned(t, "bw_prepared_mib_s", n, v, "pass", "cold")
			r := stats.Median(rs)
			parts = append(parts, fmt.Sprintf("%.2f at %s", r, human(n)))
			intervals = append(intervals, fmt.Sprintf("%s at %s", ci(rs, fixed2), human(n)))
			if v == "odp-prefetch-sync" {
				faster = faster && r > 1
			}
		}
		if v == "odp-prefetch-sync" {
			x.Claim("preparedsync", "with registration and prefetch timed, a cold pass after a synchronous prefetch is "+
				"faster than pinned's at every size", faster, "odp-prefetch-sync / pinned, bandwidth with registration and "+
				"prefetch timed, medians of per-repetition ratios: "+strings.Join(parts, ", "))
		}
		x.HeadlineCI(fmt.Sprintf("cold pass with registration and prefetch timed, %s / pinned bandwidth", v), strings.Join(parts, ", "),
			strings.Join(intervals, ", "), "medians of per-repetition ratios; the pass alone leaves both out (bw_mib_s)")
	}
	bySize("asynchronous / synchronous prefetch, cold pass bandwidth, by message size",
		"medians of ratios paired by repetition; the pass alone is timed",
		func(n int) []float64 { return coldPaired(t, n, "odp-prefetch-async", "odp-prefetch-sync") })
	// The warm pass after a cold pass that took no fault: the prefetched variant's
	// cold pass did not wait out RNR timers, and the machine did not idle before
	// its warm pass (see perf's settle).
	bySize("ODP with a synchronous prefetch / pinned bandwidth, warm pass, by message size",
		"medians of per-repetition ratios; its cold pass took no fault",
		func(n int) []float64 { return vsPinned(t, "bw_mib_s", n, "odp-prefetch-sync", "pass", "warm") })
	return nil
}

// coldPaired returns variant a's cold-pass bandwidth over variant b's at size n,
// per repetition.
func coldPaired(t *results.Table, n int, a, b string) []float64 {
	return perRep(t, "bw_mib_s", sel("size_bytes", n, "variant", a, "pass", "cold"),
		sel("size_bytes", n, "variant", b, "pass", "cold"))
}

// prepared is r's bandwidth with its registration and prefetch in the timing, for a
// cold pass; a warm pass (registered and prefetched before the cold one) as it is.
func prepared(r perf.Result) float64 {
	if r.Warm {
		return r.AvgMiBps
	}
	total := r.Elapsed + r.RegTime + r.PrefetchTime
	if total <= 0 {
		return 0
	}
	return float64(r.Iters) * float64(r.Bytes) / (1 << 20) / total.Seconds()
}
