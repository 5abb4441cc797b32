package suite

import (
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"time"

	"github.com/odpemu/odpemu/experiments/perf"
	"github.com/odpemu/odpemu/experiments/plots"
	"github.com/odpemu/odpemu/experiments/results"
	"github.com/odpemu/odpemu/experiments/stats"
	"github.com/odpemu/odpemu/odp"
)

var validation = Experiment{
	Name:  "validate",
	Title: "The published hardware numbers the emulator can rerun, on the matching profile: emulator vs published, with the error",
	Run:   runValidate,
	Replot: func(x *X) error {
		return replot(x, "", func(t *results.Table) error { return validateReport(x, t) })
	},
}

// Kinds of anchor: what agreement with the published number means.
const (
	// calibrated: the profile takes the published number, so agreement shows only
	// that the emulator delivers the cost it is given, its own included.
	kindCalibrated = "calibrated"
	// validated: the number is not an input; agreement is evidence.
	kindValidated = "validated"
	// different: the setup is rerun, but the published system recovers from a
	// fault by another mechanism; the numbers frame each other, no error is taken.
	kindDifferent = "different mechanism"
	// notRun: the emulator cannot rerun the setup; the note says why.
	kindNotRun = "not reproduced"
)

// anchor is a published number and how the emulator reruns its setup.
type anchor struct {
	name      string  // the CSV's anchor column
	what      string  // the quantity, with its setup
	source    string  // where it was published
	cite      string  // its key in the paper's bibliography
	published float64 // NaN: no single number (see text)
	text      string  // the published value as the table prints it
	unit      string
	kind      string
	note      string // why the numbers differ, or why nothing was run
	// measure runs the setup once and returns the emulator's value in unit; nil
	// when the setup is not rerun.
	measure func(x *X, rep int) (float64, error)
}

// validateAnchors are the published numbers whose setups are described well enough
// to rerun, and those that are not, with the reason.
func validateAnchors(x *X) []anchor {
	region := pick(x.Scale, 256<<10, 1<<20, 1<<20)
	regBytes := pick(x.Scale, 8<<20, 64<<20, 1<<30)
	runFor := pick(x.Scale, 200*time.Millisecond, time.Second, time.Second)
	return []anchor{
		{name: "cx4-fault", what: "4 KiB minor network page fault, ConnectX-4", source: "Lesokhin et al., ASPLOS'17", cite: "lesokhin2017pagefault",
			published: 220, text: "220", unit: "µs per fault", kind: kindCalibrated,
			note: "the connectx4 profile's fault model takes this latency; measured: the requester's fault time per fault, " +
				"the emulator's own work included (the median of five transfers')",
			measure: func(x *X, rep int) (float64, error) { return faultTime(x, odp.FaultModelConnectX4, region) }},
		{name: "nprdma-fault", what: "minor page fault handled in software, commodity NIC", source: "NP-RDMA (arXiv 2310.11062)", cite: "shen2023nprdma",
			published: 5.7, text: "3.5-5.7", unit: "µs per fault", kind: kindCalibrated,
			note: "the np-rdma profile takes the upper bound; the emulator's own fault counts toward it and is never " +
				"shortened, so where it costs more the error is the emulator's own",
			measure: func(x *X, rep int) (float64, error) { return faultTime(x, odp.FaultModelNPRDMA, region) }},
		{name: "cx4-steady", what: "steady-state ODP / pinned WRITE bandwidth, pages mapped", source: "Lesokhin et al., ASPLOS'17", cite: "lesokhin2017pagefault",
			published: 16440.0 / 16410, text: "1.002 (16,440 / 16,410 MB/s)", unit: "ratio", kind: kindValidated,
			note:    "measured: alternating bursts of 64 KiB WRITEs over the same buffers registered both ways (connectx4 profile)",
			measure: func(x *X, rep int) (float64, error) { return steadyRatio(x, pick(x.Scale, 200, 2000, 2000)) }},
		{name: "pin-per-gib", what: "pinned registration of pre-faulted memory", source: "Mooncake#855 (500 GB in 49.2 s)", cite: "mooncake855",
			published: 49.2e3 / (500e9 / (1 << 30)), text: "106", unit: "ms per GiB", kind: kindValidated,
			note: fmt.Sprintf("measured on %s: the host's part alone (page walk, pin, table build); hardware adds the IOMMU's "+
				"mappings and the NIC's translation-table writes, which the emulator does not model, and the host's part "+
				"varies by machine (about 55 and 110 ms per GiB on two 2-vCPU VMs)", human(regBytes)),
			measure: func(x *X, rep int) (float64, error) { return pinPerGiB(x, regBytes) }},
		{name: "osdi25-inject", what: "throughput at 10 faults/s of 10 ms / without faults", source: "Wang et al., OSDI'25", cite: "wang2025pri",
			published: math.NaN(), text: "0.40-0.55 (VPRI), above 0.90 (VIO)", unit: "ratio", kind: kindDifferent,
			note: "VPRI recovers by retransmission (delays of several hundred ms, OSDI'25 reports), an RC requester by RNR retries every " +
				"0.64 ms: the emulator's ODP loses about rate x latency, as VIO does",
			measure: func(x *X, rep int) (float64, error) {
				return injectedRatio(x, runFor, perf.Params{InvalidateRate: 10,
					FaultModel: odp.FaultModel{Name: "10ms", PerFault: 10 * time.Millisecond}}, perf.Params{})
			}},
		{name: "nbs-rnr-timer", what: "throughput with min_rnr_timer 13 (0.96 ms) / 0 (655 ms)", source: "ydb-platform/nbs#5790", cite: "nbs5790",
			published: 282, text: "282", unit: "ratio", kind: kindValidated,
			note: "not ODP there: RNR NAKs from a receiver out of receives, at a rate the report does not give; here 10 " +
				"injected faults/s, and the ratio grows with the rate",
			measure: func(x *X, rep int) (float64, error) {
				if x.Scale == Tiny {
					return math.NaN(), nil // a pass at 655 ms takes seconds
				}
				fast, slow := uint8(13), uint8(0)
				return injectedRatio(x, runFor, perf.Params{InvalidateRate: 10, MinRNRTimer: &fast},
					perf.Params{InvalidateRate: 10, MinRNRTimer: &slow})
			}},
		{name: "pitfalls", what: "an RNR or loss pitfall over a common-case fault", source: "Fukuoka et al., ISPASS'21", cite: "fukuoka2021pitfalls",
			published: math.NaN(), text: "3-4 orders of magnitude", unit: "", kind: kindNotRun,
			note: "the sources held here give the slowdown, not the setup or the firmware behaviour behind it; the rnr and " +
				"injection experiments measure the RNR and timeout costs the emulator models"},
		{name: "rxe-odp", what: "Soft-RoCE (rxe) with ODP", source: "Linux v6.15 (rxe ODP)", cite: "matsuda2025rxeodp", published: math.NaN(), text: "none published",
			kind: kindNotRun, note: "no perftest or other figures were posted with the rxe ODP series; the rxe profile models its " +
				"policy (stall, no prefetch), not its speed"},
	}
}

func runValidate(x *X) error {
	reps := pick(x.Scale, 1, 3, fullReps)
	anchors := validateAnchors(x)
	x.Param("reps", reps)
	x.Param("run", "each anchor's setup rerun on the matching fault model or profile (see the table's notes); "+
		"error = emulator / published - 1, for anchors with one published number")
	x.Steps(reps)
	t := x.Table("", "anchor", "rep", "status", "value")
	for rep := range reps {
		runtime.GC()
		for i := range anchors {
			a := anchors[(i+rep)%len(anchors)]
			if a.measure == nil {
				continue
			}
			v, err := a.measure(x, rep)
			status := "ok"
			switch {
			case err != nil:
				status = failure(err)
			case math.IsNaN(v):
				status = "skipped"
			}
			if err := t.Add(a.name, rep, status, v); err != nil {
				return err
			}
		}
		x.Step()
	}
	return validateReport(x, t)
}

// faultTime is the requester's time per network page fault over a one-shot
// transfer of region bytes in 4 KiB WRITEs, one page a fault, under model, in µs:
// minor faults, as both sources measured them (the application wrote the pages;
// the registration maps none of them).
//
// It is the median of oneShotRuns transfers' times per fault: a transfer of the
// quick size's 256 faults lasts about 60 ms, and on a 2-core VM one now and then
// took 250-360 us a fault where the others took 224-236 (in odp-exp's validate, the
// ConnectX-4 fault's repetitions that came after the RNR timer anchor: three of six
// in two runs; with the median of five, nine of nine took 227-232), enough to fail
// the claim that the model's 220 us is delivered within 10%.
func faultTime(x *X, model odp.FaultModel, region int) (float64, error) {
	p := x.nic(perf.Params{ODP: true, Size: 4096, FaultAround: 1, FaultModel: model})
	per := make([]float64, 0, oneShotRuns)
	for range oneShotRuns {
		r, err := perf.OneShot(p, region, perf.OneShotOptions{NoSnapshot: true})
		if err != nil {
			return 0, err
		}
		if r.Source.PageFaults == 0 {
			return 0, errors.New("no network page fault")
		}
		per = append(per, float64(r.Source.FaultTime.Nanoseconds())/float64(r.Source.PageFaults)/1e3)
	}
	return stats.Median(per), nil
}

// steadyRatio is the median of ODP over pinned WRITE bandwidth of alternating
// bursts of iters 64 KiB WRITEs, on the connectx4 profile: 20 pairs of bursts
// (6 at the tiny scale). A pair's ratio spreads by about 5% either way on a
// 2-core VM, so with 6 pairs a repetition's median did too (0.83-1.09 over nine
// quick repetitions), and the claim on the median of three failed now and then;
// with 20 it stayed within 0.99-1.02.
func steadyRatio(x *X, iters int) (float64, error) {
	p := perf.Params{Size: 64 << 10, Iters: iters, Profile: odp.ProfileConnectX4}
	pinned, onDemand, err := perf.WarmPair(p, pick(x.Scale, 6, 20, 20))
	if err != nil {
		return 0, err
	}
	var r []float64
	for i := range min(len(pinned), len(onDemand)) {
		r = append(r, onDemand[i]/pinned[i])
	}
	return stats.Median(r), nil
}

// pinPerGiB registers n bytes of pre-faulted memory pinned and returns the
// registration's time per GiB, in ms.
func pinPerGiB(x *X, n int) (float64, error) {
	d, err := odp.Open(x.device(odp.Config{}))
	if err != nil {
		return 0, err
	}
	defer func() { _ = d.Close() }() // nothing is left to fail: the measurement is taken
	pd, err := d.AllocPD()
	if err != nil {
		return 0, err
	}
	buf, err := d.Alloc(n)
	if err != nil {
		return 0, err
	}
	defer func() { _ = d.Free(buf) }() // the device's close unmaps it in any case
	for i := 0; i < len(buf); i += 4096 {
		buf[i] = 1 // pre-faulted, as Mooncake's MADV_POPULATE_WRITE
	}
	mr, err := pd.RegMR(buf, odp.AccessLocalWrite|odp.AccessRemoteWrite|odp.AccessRemoteRead)
	if err != nil {
		return 0, err
	}
	reg := mr.Registration().Total
	if err := mr.Dereg(); err != nil {
		return 0, err
	}
	return float64(reg.Nanoseconds()) / 1e6 / (float64(n) / (1 << 30)), nil
}

// injectedRatio runs 4 KiB WRITEs over a warm ODP region for d with a's settings
// and with b's, and returns a's message rate over b's.
func injectedRatio(x *X, d time.Duration, a, b perf.Params) (float64, error) {
	var rate [2]float64
	for i, p := range []perf.Params{a, b} {
		p.ODP, p.Size, p.Iters, p.Duration, p.Warm = true, 4096, 1<<30, d, true
		r, err := perf.Run(x.nic(p))
		if err != nil {
			return 0, err
		}
		rate[i] = r.MsgRateMpps
	}
	if rate[1] <= 0 {
		return 0, errors.New("no message completed")
	}
	return rate[0] / rate[1], nil
}

func validateReport(x *X, t *results.Table) error {
	anchors := validateAnchors(x)
	var b strings.Builder
	var cats []string
	bars := plots.Stack{Name: "emulator / published (median)"}
	var barCI []stats.Interval
	b.WriteString("% Generated by odp-exp (experiment validate) from validate.csv; do not edit.\n")
	b.WriteString("\\begin{tabular}{@{}p{0.19\\textwidth}p{0.12\\textwidth}p{0.13\\textwidth}p{0.1\\textwidth}rp{0.33\\textwidth}@{}}\n\\toprule\n")
	b.WriteString("Anchor & Source & Published & Emulator & Error & Kind: why they differ \\\\\n\\midrule\n")
	for _, a := range anchors {
		vals := results.Floats(t.Rows(sel("anchor", a.name, "status", "ok")), "value")
		emu, errText := "--", "--"
		if len(vals) > 0 {
			s := stats.SummarizeCI(vals)
			emu = fmt.Sprintf("%.3g", s.Median)
			if s.N > 2 {
				emu += fmt.Sprintf(" (%.3g--%.3g)", s.Lo, s.Hi)
			}
			if !math.IsNaN(a.published) && a.kind != kindDifferent {
				errText = fmt.Sprintf("%+.0f\\%%", 100*(s.Median/a.published-1))
				cats = append(cats, a.name)
				bars.Values = append(bars.Values, s.Median/a.published)
				barCI = append(barCI, barInterval(vals, 1/a.published))
			}
		}
		unit := ""
		if a.unit != "" && a.unit != "ratio" {
			unit = " " + a.unit
		}
		fmt.Fprintf(&b, "%s & %s~\\cite{%s} & %s%s & %s & %s & \\emph{%s}: %s \\\\\n", texEscape(a.what), texEscape(a.source), a.cite,
			texEscape(a.text), texEscape(unit), emu, errText, texEscape(a.kind), texEscape(a.note))
		interval := ""
		if len(vals) > 0 {
			interval = ci(vals, func(v float64) string { return fmt.Sprintf("%.3g", v) })
		}
		x.HeadlineCI(a.name+": "+a.what, emuOr(vals), interval, fmt.Sprintf("published %s%s (%s); %s: %s", a.text, unit, a.source, a.kind, a.note))
	}
	b.WriteString("\\bottomrule\n\\end{tabular}\n")
	if len(bars.Values) > 0 {
		if err := x.Figure("validate", plots.Bars{Title: "Emulator / published, for the anchors with one published number",
			Y: plots.Axis{Label: "emulator / published"}, Categories: cats, Stacks: []plots.Stack{bars},
			Intervals: barCI, Reference: 1}); err != nil {
			return err
		}
	}
	// agrees says whether the anchor's median is within tol of the published
	// number (a relative error), or within a factor of -tol either way for a
	// negative tol.
	agrees := func(name string, tol float64) (bool, string) {
		for _, a := range anchors {
			if a.name != name {
				continue
			}
			vals := results.Floats(t.Rows(sel("anchor", name, "status", "ok")), "value")
			if len(vals) == 0 {
				return false, name + " was not run"
			}
			m := stats.Median(vals)
			ev := fmt.Sprintf("%s: median %.4g over %d repetitions, published %.4g", name, m, len(vals), a.published)
			if tol < 0 {
				f := -tol
				return withinFactor(m/a.published, f), fmt.Sprintf("%s, ratio %.2f (within a factor of %g)",
					ev, m/a.published, f)
			}
			return math.Abs(m/a.published-1) <= tol, fmt.Sprintf("%s, within %.0f%%", ev, 100*tol)
		}
		return false, "no anchor " + name
	}
	holds, evidence := agrees("cx4-fault", 0.1)
	x.Claim("cxdelivered", "The emulator delivers the ConnectX-4 fault latency its profile takes", holds, evidence)
	holds, evidence = agrees("pin-per-gib", -2.5)
	x.Claim("pinsame", "pinning pre-faulted memory costs the same order per GiB as Mooncake's users measured on "+
		"hardware (within a factor of 2.5), though the emulator does only the host's part of that work", holds, evidence)
	holds, evidence = agrees("cx4-steady", 0.05)
	x.Claim("steadyparity", "with its pages mapped, ODP moves data as fast as pinned memory, as Lesokhin et al. measured", holds, evidence)
	path := filepath.Join(x.dir, "validate_table.tex")
	if err := os.WriteFile(path, []byte(b.String()), 0o644); err != nil {
		return err
	}
	x.files = append(x.files, filepath.Base(path))
	return nil
}

// emuOr is the median of vals, or a dash when the anchor was not run.
func emuOr(vals []float64) string {
	if len(vals) == 0 {
		return "not run"
	}
	return fmt.Sprintf("%.3g", stats.Median(vals))
}
