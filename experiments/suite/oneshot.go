package suite

import (
	"fmt"
	"math"
	"runtime"
	"strings"

	"github.com/odpemu/odpemu/experiments/perf"
	"github.com/odpemu/odpemu/experiments/plots"
	"github.com/odpemu/odpemu/experiments/results"
	"github.com/odpemu/odpemu/experiments/stats"
	"github.com/odpemu/odpemu/odp"
)

var oneShot = Experiment{
	Name:  "oneshot",
	Title: "Moving N bytes of fresh memory once, registration and deregistration included",
	Run:   runOneShot,
	Replot: func(x *X) error {
		return replot(x, "", func(t *results.Table) error { return oneShotReport(x, t, ints(t, "size_bytes")) })
	},
}

// oneShotVariant is one way to register the source of a one-shot transfer.
type oneShotVariant struct {
	name       string
	odp        bool
	noSnapshot bool
	model      odp.FaultModel
}

var oneShotVariants = []oneShotVariant{
	{name: "pinned"},
	{name: "odp", odp: true},
	{name: "odp-faulting", odp: true, noSnapshot: true},
	{name: "odp-faulting-connectx4", odp: true, noSnapshot: true, model: odp.FaultModelConnectX4},
}

// oneShotMsg is the message size of the transfers (smaller transfers are one message).
const oneShotMsg = 64 << 10

func runOneShot(x *X) error {
	top := min(pick(x.Scale, 1<<20, 1<<30, 1<<30), memoryCap())
	sizes := sizesPow4(4096, top)
	reps := pick(x.Scale, 1, 3, fullReps)
	x.Param("sizes", sizes)
	x.Param("reps", reps)
	x.Param("message_bytes", oneShotMsg)
	x.Param("variants", "pinned; odp (registration maps the present pages, as mlx5's snapshot does); "+
		"odp-faulting (no snapshot: every page takes a network page fault); the same with ConnectX-4 fault latency")
	x.Steps(len(sizes) * reps)
	t := x.Table("", "size_bytes", "variant", "fault_model", "rep", "total_ns", "register_ns", "transfer_ns",
		"dereg_ns", "network_page_faults", "pages_faulted", "pages_mapped", "fault_ns")
	for _, n := range sizes {
		for rep := range reps {
			runtime.GC()
			for i := range oneShotVariants {
				v := oneShotVariants[(i+rep)%len(oneShotVariants)] // each variant leads in turn
				r, err := perf.OneShot(x.nic(perf.Params{ODP: v.odp, Size: oneShotMsg, FaultModel: v.model}), n,
					perf.OneShotOptions{NoSnapshot: v.noSnapshot})
				if err != nil {
					return fmt.Errorf("%s, %s: %w", v.name, human(n), err)
				}
				if err := t.Add(n, v.name, v.model.String(), rep, r.Total, r.Register, r.Transfer, r.Deregister,
					r.PageFaults, r.PagesFault, r.Mapped, r.Source.FaultTime); err != nil {
					return err
				}
			}
			x.Step()
		}
	}
	return oneShotReport(x, t, sizes)
}

func oneShotReport(x *X, t *results.Table, sizes []int) error {
	series := scaleY(plots.Group(t.Rows(nil), "size_bytes", "total_ns", "variant"), 1e-3)
	if err := x.Figure("oneshot", plots.Figure{Title: "One transfer of fresh memory, registration included",
		X: plots.Axis{Label: "bytes moved", Log: true, Bytes: true}, Y: plots.Axis{Label: "time (µs), medians", Log: true},
		Series: series}); err != nil {
		return err
	}
	// ODP / pinned per size, from the per-repetition pairs.
	var ratios []plots.Series
	for _, v := range oneShotVariants[1:] {
		ratios = append(ratios, ratioSeries(v.name+" / pinned", sizes, func(n int) []float64 { return vsPinned(t, "total_ns", n, v.name) }))
	}
	if err := x.Figure("oneshot_ratio", plots.Figure{Title: "One-shot transfer time, ODP over pinned",
		X: plots.Axis{Label: "bytes moved", Log: true, Bytes: true}, Y: plots.Axis{Label: "time ratio (below 1: ODP is faster)", Log: true},
		Series: append(ratios, parity(sizes))}); err != nil {
		return err
	}
	slower, evidence := true, []string{}
	for _, n := range sizes {
		r := stats.Median(vsPinned(t, "total_ns", n, "odp-faulting-connectx4"))
		slower = slower && r >= 1
		evidence = append(evidence, fmt.Sprintf("%s %.2f", human(n), r))
	}
	x.Claim("cxslower", "With ConnectX-4 fault cost on every page ODP is slower at every size.", slower,
		"odp-faulting-connectx4 / pinned, medians of per-repetition ratios of total time: "+strings.Join(evidence, ", "))
	top := sizes[len(sizes)-1]
	// Faulting every page against pinning every page is a race of two per-page costs
	// that sit close with the emulator's faults (a fault-around window's fault, RNR
	// NAK and timer against pinning, mapping and unpinning its pages): which one wins
	// at the largest size depends on the machine's cost of a page fault (0.78 in a
	// full run, 1.0-1.25 in quick runs on another VM of the same type, whose faults
	// took 2.7 times as long). What holds on both is that they are close, as the
	// sweep experiment's oneshotflips says for its fastest fault.
	fa := stats.Median(vsPinned(t, "total_ns", top, "odp-faulting"))
	x.Claim("faultingnear", "with the emulator's cheap faults that costs about as much as pinning the pages once "+
		"transfers are large (within a factor of 1.5 either way)", withinFactor(fa, 1.5),
		fmt.Sprintf("odp-faulting / pinned at %s, median of per-repetition ratios of total time: %.2f", human(top), fa))
	for _, v := range oneShotVariants[1:] {
		x.Headline(fmt.Sprintf("one-shot transfer: smallest size from which %s beats pinned", v.name),
			crossover(t, sizes, v.name), fmt.Sprintf("median of per-repetition ratios of total time below 1 at that size and every larger one; at %s: %s",
				human(sizes[len(sizes)-1]), ratio(stats.Median(vsPinned(t, "total_ns", sizes[len(sizes)-1], v.name)))))
	}
	return oneShotParts(x, t, sizes[len(sizes)-1])
}

// crossover returns the smallest size from which variant's median ratio to pinned
// stays below 1, or says that there is none.
func crossover(t *results.Table, sizes []int, variant string) string {
	from := -1
	for i := len(sizes) - 1; i >= 0; i-- {
		r := vsPinned(t, "total_ns", sizes[i], variant)
		if len(r) == 0 || stats.Median(r) >= 1 {
			break
		}
		from = i
	}
	switch from {
	case -1:
		return fmt.Sprintf("none up to %s", human(sizes[len(sizes)-1]))
	case 0:
		return fmt.Sprintf("every size from %s", human(sizes[0]))
	}
	return human(sizes[from])
}

// oneShotParts decomposes each variant's one-shot transfer of n bytes into its
// registration, the network page faults in its transfer, the rest of its transfer
// and its deregistration (medians over repetitions; the faults' time, summed over
// faults, is capped at the transfer's), as a figure and a headline per variant.
func oneShotParts(x *X, t *results.Table, n int) error {
	parts := []string{"register", "transfer: faults", "transfer: the rest", "deregister"}
	stacks := make([]plots.Stack, len(parts))
	for i, p := range parts {
		stacks[i].Name = p
	}
	var cats []string
	var totals []stats.Interval         // of each variant's total time
	byVariant := map[string][]float64{} // register, faults, rest of transfer, deregister
	for _, v := range oneShotVariants {
		rows := t.Rows(sel("size_bytes", n, "variant", v.name))
		if len(rows) == 0 {
			continue
		}
		med := func(c string) float64 {
			vs := results.Floats(rows, c)
			if len(vs) == 0 {
				return 0 // a run from before the column
			}
			return stats.Median(vs)
		}
		transfer := med("transfer_ns")
		faults := min(med("fault_ns"), transfer)
		vals := []float64{med("register_ns"), faults, transfer - faults, med("dereg_ns")}
		for i := range stacks {
			stacks[i].Values = append(stacks[i].Values, vals[i]/1e6)
		}
		cats = append(cats, strings.NewReplacer("odp-faulting-connectx4", "ODP faulting\nConnectX-4", "odp-faulting",
			"ODP\nfaulting", "odp", "ODP").Replace(v.name))
		byVariant[v.name] = vals
		totals = append(totals, barInterval(results.Floats(rows, "total_ns"), 1e-6))
		interval := func(c string) string { return ci(results.Floats(rows, c), dur) }
		x.HeadlineCI(fmt.Sprintf("one-shot transfer of %s, %s: register, transfer (of which faults), deregister", human(n), v.name),
			fmt.Sprintf("%s, %s (%s), %s", dur(vals[0]), dur(transfer), dur(faults), dur(vals[3])),
			fmt.Sprintf("%s, %s (%s), %s", interval("register_ns"), interval("transfer_ns"), interval("fault_ns"), interval("dereg_ns")),
			"medians over repetitions; the faults' time is summed over faults")
	}
	pin, od := byVariant["pinned"], byVariant["odp"]
	if pin != nil && od != nil {
		prep := (pin[0] + pin[3]) - (od[0] + od[3])
		transfer := (pin[1] + pin[2]) - (od[1] + od[2])
		x.Claim("regdecides", "ODP with the snapshot gains on pinning in registration and deregistration, not in the transfer",
			prep > 0 && prep >= math.Abs(transfer), fmt.Sprintf("at %s, pinned - odp: registration and deregistration %s, "+
				"transfer %s (medians)", human(n), dur(prep), dur(transfer)))
	}
	return x.Figure("oneshot_parts", plots.Bars{Title: fmt.Sprintf("Where a one-shot transfer of %s goes", human(n)),
		Y: plots.Axis{Label: "time (ms), medians"}, Categories: cats, Stacks: stacks, Intervals: totals})
}
