package suite

import (
	"fmt"
	"runtime"
	"strings"
	"time"

	"github.com/odpemu/odpemu/experiments/perf"
	"github.com/odpemu/odpemu/experiments/plots"
	"github.com/odpemu/odpemu/experiments/results"
	"github.com/odpemu/odpemu/experiments/stats"
	"github.com/odpemu/odpemu/experiments/uffdfloor"
	"github.com/odpemu/odpemu/odp"
)

var faultAnatomy = Experiment{
	Name:   "anatomy",
	Title:  "Anatomy of a network page fault (detect, resolve, table update, resume) against userfaultfd's floors",
	Run:    runAnatomy,
	Replot: func(x *X) error { return replot(x, "", func(t *results.Table) error { return anatomyReport(x, t) }) },
}

// The phases of a network page fault, as odp.FaultPhases has them.
var phases = []string{"detect", "resolve", "update", "model", "resume"}

func phaseValues(p odp.FaultPhases) []time.Duration {
	return []time.Duration{p.Detect, p.Resolve, p.Update, p.Model, p.Resume}
}

// anatomyVariant is one way the NIC takes its faults.
type anatomyVariant struct {
	name        string
	faultAround int
	model       odp.FaultModel
}

var anatomyVariants = []anatomyVariant{
	{"odp-fa1", 1, odp.FaultModel{}},
	{"odp-fa16", 16, odp.FaultModel{}},
	{"odp-fa16-connectx4", 16, odp.FaultModelConnectX4},
}

// The floors, measured in C.
const (
	floorHandler = "c-uffd-handler"      // sleeping in poll between faults
	floorSpin    = "c-uffd-handler-spin" // reading in a loop: no wake-up
	floorCopy    = "uffdio-copy"
)

func runAnatomy(x *X) error {
	region := pick(x.Scale, 1<<20, 16<<20, 256<<20)
	reps := pick(x.Scale, 2, 5, fullReps)
	pages := region / 4096
	x.Param("region_bytes", region)
	x.Param("reps", reps)
	x.Param("run", "a pass of 4 KiB WRITEs from an untouched ODP source (registered without snapshot) to a warm pinned sink: "+
		"every source page takes a requester-side network page fault that allocates it; floors: the same number of pages "+
		"installed by UFFDIO_COPY alone, and faulted by a thread and served by a minimal C handler thread, sleeping in poll or spinning")
	x.Steps(reps)
	t := x.Table("", "variant", "rep", "faults", "pages", "phase", "total_ns", "per_fault_ns", "per_page_ns")
	add := func(variant string, rep int, faults, pages uint64, phase string, total time.Duration) error {
		return t.Add(variant, rep, faults, pages, phase, total, float64(total)/float64(max(faults, 1)), float64(total)/float64(max(pages, 1)))
	}
	for rep := range reps {
		runtime.GC()
		for i := range anatomyVariants {
			v := anatomyVariants[(i+rep)%len(anatomyVariants)]
			r, err := perf.OneShot(x.nic(perf.Params{ODP: true, Size: 4096, FaultAround: v.faultAround, FaultModel: v.model}), region,
				perf.OneShotOptions{NoSnapshot: true, Untouched: true})
			if err != nil {
				return fmt.Errorf("%s: %w", v.name, err)
			}
			s := r.Source
			for j, d := range phaseValues(s.Phases) {
				if err := add(v.name, rep, s.PageFaults, s.PagesFaulted, phases[j], d); err != nil {
					return err
				}
			}
			if err := add(v.name, rep, s.PageFaults, s.PagesFaulted, "fault", s.FaultTime); err != nil {
				return err
			}
		}
		copyPer, err := uffdfloor.CopyPerPage(pages)
		if err != nil {
			return err
		}
		handlerPer, err := uffdfloor.HandlerPerFault(pages, false)
		if err != nil {
			return err
		}
		spinPer, err := uffdfloor.HandlerPerFault(pages, true)
		if err != nil {
			return err
		}
		n := uint64(pages)
		if err := add(floorCopy, rep, n, n, "total", copyPer*time.Duration(pages)); err != nil {
			return err
		}
		if err := add(floorHandler, rep, n, n, "total", handlerPer*time.Duration(pages)); err != nil {
			return err
		}
		if err := add(floorSpin, rep, n, n, "total", spinPer*time.Duration(pages)); err != nil {
			return err
		}
		x.Step()
	}
	return anatomyReport(x, t)
}

func anatomyReport(x *X, t *results.Table) error {
	vals := func(variant, phase, col string) []float64 {
		return results.Floats(t.Rows(sel("variant", variant, "phase", phase)), col)
	}
	med := func(variant, phase, col string) float64 { return stats.Median(vals(variant, phase, col)) }
	durCI := func(variant, phase, col string) string { return ci(vals(variant, phase, col), dur) }
	cats := []string{"FA 1", "FA 16", "FA 16 CX-4", "handler", "spinning", "COPY"}
	var stacks []plots.Stack
	for _, ph := range phases {
		s := plots.Stack{Name: ph}
		for _, v := range anatomyVariants {
			s.Values = append(s.Values, med(v.name, ph, "per_page_ns")/1e3)
		}
		s.Values = append(s.Values, 0, 0, 0)
		stacks = append(stacks, s)
	}
	stacks = append(stacks, plots.Stack{Name: "C floors (whole fault)",
		Values: []float64{0, 0, 0, med(floorHandler, "total", "per_page_ns") / 1e3, med(floorSpin, "total", "per_page_ns") / 1e3,
			med(floorCopy, "total", "per_page_ns") / 1e3}})
	// Per fault on a log axis: a ConnectX-4 fault and a userfaultfd fault compared
	// as what they are, one fault each (the C floors handle one page per fault).
	perFault := plots.Stack{Name: "time per fault (medians)"}
	var faultCI, pageCI []stats.Interval // of the whole fault, per fault and per page
	for _, v := range anatomyVariants {
		perFault.Values = append(perFault.Values, med(v.name, "fault", "per_fault_ns")/1e3)
		faultCI = append(faultCI, barInterval(vals(v.name, "fault", "per_fault_ns"), 1e-3))
		pageCI = append(pageCI, barInterval(vals(v.name, "fault", "per_page_ns"), 1e-3))
	}
	for _, f := range []string{floorHandler, floorSpin, floorCopy} {
		perFault.Values = append(perFault.Values, med(f, "total", "per_fault_ns")/1e3)
		faultCI = append(faultCI, barInterval(vals(f, "total", "per_fault_ns"), 1e-3))
		pageCI = append(pageCI, barInterval(vals(f, "total", "per_page_ns"), 1e-3))
	}
	if err := x.Figure("anatomy", plots.Bars{Title: "A network page fault's time per fault (FA: fault-around), against " +
		"userfaultfd's floors", Y: plots.Axis{Label: "time per fault (µs)", Log: true}, Categories: cats,
		Stacks: []plots.Stack{perFault}, Intervals: faultCI}); err != nil {
		return err
	}
	if err := x.Figure("anatomy_page", plots.Bars{Title: "A network page fault's time per page, by phase (FA: fault-around)",
		Y: plots.Axis{Label: "time per page (µs)"}, Categories: cats, Stacks: stacks, Intervals: pageCI}); err != nil {
		return err
	}
	for _, v := range anatomyVariants[:2] {
		fault := med(v.name, "fault", "per_fault_ns")
		x.HeadlineCI(fmt.Sprintf("network page fault, %s: time per fault, per page", v.name),
			fmt.Sprintf("%s, %s", dur(fault), dur(med(v.name, "fault", "per_page_ns"))),
			fmt.Sprintf("%s, %s", durCI(v.name, "fault", "per_fault_ns"), durCI(v.name, "fault", "per_page_ns")),
			fmt.Sprintf("medians; resolve %s, table update %s, resume %s per fault", dur(med(v.name, "resolve", "per_fault_ns")),
				dur(med(v.name, "update", "per_fault_ns")), dur(med(v.name, "resume", "per_fault_ns"))))
	}
	// Which phase takes most of the emulator's own faults (the ConnectX-4 variant's
	// is its modelled latency), and how the fault compares with a handler's.
	dominates, ev := true, []string{}
	for _, v := range anatomyVariants[:2] {
		top, most := "", -1.0
		for _, ph := range phases {
			if m := med(v.name, ph, "per_fault_ns"); m > most {
				top, most = ph, m
			}
		}
		dominates = dominates && top == "resolve"
		ev = append(ev, fmt.Sprintf("%s: %s largest, %s per fault", v.name, top, dur(most)))
	}
	x.Claim("resolvedominates", "Resolution dominates", dominates, "the largest phase per fault (medians): "+strings.Join(ev, "; "))
	fault1, handler := med("odp-fa1", "fault", "per_fault_ns"), med(floorHandler, "total", "per_fault_ns")
	x.Claim("cheaperthanhandler", "its fault is cheaper than a userfaultfd fault served by a handler thread", fault1 < handler,
		fmt.Sprintf("odp-fa1 %s per fault against the C handler's %s (medians)", dur(fault1), dur(handler)))
	h := stats.Summarize(results.Floats(t.Rows(sel("variant", floorHandler)), "per_page_ns"))
	x.HeadlineCI("floors: a page by UFFDIO_COPY; a fault served by a minimal C handler sleeping in poll, and spinning",
		fmt.Sprintf("%s; %s, %s", dur(med(floorCopy, "total", "per_page_ns")), dur(h.Median), dur(med(floorSpin, "total", "per_page_ns"))),
		fmt.Sprintf("%s; %s, %s", durCI(floorCopy, "total", "per_page_ns"), durCI(floorHandler, "total", "per_page_ns"),
			durCI(floorSpin, "total", "per_page_ns")),
		fmt.Sprintf("medians; the handler's quartiles %s-%s (its thread's wake-up); the emulator's 1-page fault over the handler's: %s",
			dur(h.Q1), dur(h.Q3), ratio(med("odp-fa1", "fault", "per_fault_ns")/h.Median)))
	return nil
}
