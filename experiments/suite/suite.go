// Package suite is odpemu's experiment suite: every experiment that compares
// on-demand paging with pinned registration, run at one of three scales, each
// writing tidy CSV tables, figures and headline numbers into one results directory
// with a manifest and a summary.
//
// Experiments measure the alternatives side by side in one run, interleaved within
// each repetition, so that the ratios they report hold on a noisy machine; they
// report medians and quartiles over a stated number of repetitions.
package suite

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"time"

	"github.com/odpemu/odpemu/experiments/perf"
	"github.com/odpemu/odpemu/experiments/results"
	"github.com/odpemu/odpemu/odp"
)

// Scale is how big a run is.
type Scale int

// The scales.
const (
	// Tiny runs each experiment in seconds: a check that everything works (CI).
	Tiny Scale = iota
	// Quick runs the whole suite in about ten minutes on a 2-core machine.
	Quick
	// Full makes ten repetitions of every measurement (fullReps) and the finer
	// grids of sizes, rates and reuses, at the quick scale's regions and run
	// lengths except where larger ones are cheap: about 45 minutes on a 2-core
	// machine, so that the paper's run can be made where the project is.
	Full
)

// String returns "tiny", "quick" or "full".
func (s Scale) String() string {
	switch s {
	case Tiny:
		return "tiny"
	case Quick:
		return "quick"
	case Full:
		return "full"
	}
	return fmt.Sprintf("Scale(%d)", int(s))
}

// scaleNamed is the scale String names, and whether there is one.
func scaleNamed(name string) (Scale, bool) {
	for _, s := range []Scale{Tiny, Quick, Full} {
		if s.String() == name {
			return s, true
		}
	}
	return 0, false
}

// fullReps is how many repetitions a full run makes of each measurement: enough for
// the bootstrap intervals of its medians to mean something.
const fullReps = 10

// pick returns the value for scale s.
func pick[T any](s Scale, tiny, quick, full T) T {
	switch s {
	case Tiny:
		return tiny
	case Full:
		return full
	}
	return quick
}

// Experiment is one question the suite answers.
type Experiment struct {
	Name  string // the CSV's and figures' base name, and --only's argument
	Title string
	Run   func(x *X) error
	// Replot draws the figures and headlines again from the tables a run wrote
	// (x.Loaded), deriving the parameters it needs from them.
	Replot func(x *X) error
}

// Experiments lists every experiment, in the order the suite runs them.
func Experiments() []Experiment {
	return []Experiment{registration, oneShot, coldWarm, faultAnatomy, invalidationStorm, overcommit, bufferStrategies, rnrPitfalls,
		faultInjection, latencySweep, severalQPs, validation, wireExperiment, fileBacked}
}

// Headline is one number of the summary.
type Headline struct {
	Experiment string
	What       string // what the number is
	Value      string // the number, with its unit
	// Interval is the 95% bootstrap interval of each median in Value, written as
	// Value writes it; empty where Value is a count, a choice or a list of choices.
	Interval string
	Detail   string // how it was obtained: repetitions, medians, ranges
}

// Claim is a sentence of the paper that states a direction or a comparison ("ODP is
// slower at every size"), with whether this run's data hold it: the report that
// draws an experiment's figures decides it from its tables, and the paper prints
// the sentence only when it holds (\claim, written by WriteTeX; a false claim stops
// the paper's build, naming it).
type Claim struct {
	Experiment, Name string
	Text             string // the sentence, or the clause, as the paper prints it
	Holds            bool
	Evidence         string // the numbers that decide it
}

// Progress hears of an experiment's progress.
type Progress interface {
	// Start begins an experiment of steps steps.
	Start(name string, steps int)
	// Step reports one step done.
	Step()
	// Done ends the experiment.
	Done(name string, elapsed time.Duration, err error)
}

// Config configures a run of the suite.
type Config struct {
	Scale Scale
	// Only, when not empty, names the experiments to run.
	Only []string
	// Dir is where results go; it is created.
	Dir string
	// Seed seeds every random choice (loss, access patterns); experiments derive
	// their own seeds from it and record them.
	Seed     uint64
	Progress Progress
	// Command is recorded in the manifest.
	Command []string
	// WireServer is the command that starts the wire experiment's server process: a
	// program that passes the arguments the suite appends to ServeWire and prints
	// what ServeWire prints. Without it the wire experiment fails with ErrNoServer.
	WireServer []string
	// RoCEPort is the UDP port of the wire experiment's RoCEv2 endpoints, the
	// server's at 127.0.0.1 and the client's at 127.0.0.2: roce.UDPPort (4791), as
	// odp-exp sets it, or 0 for ports the kernel picks (tests that may run beside
	// another suite).
	RoCEPort uint16
	// Profile is the emulated NICs' profile in every experiment (odp.Profile: the
	// link, the responders' fault policy, the fault model of the variants that
	// name none, the firmware's memory key costs, the prefetch limit, implicit
	// children); the zero value is the emulator's own, with odp's default link
	// (100 Gb/s with 2 us of delay each way). The manifest records it.
	Profile odp.Profile
}

// ErrUnknownExperiment is returned for a name in Config.Only that names none.
var ErrUnknownExperiment = errors.New("suite: unknown experiment")

// Report is what a run produced.
type Report struct {
	Dir       string
	Scale     Scale
	Manifest  results.Manifest
	Headlines []Headline
	Claims    []Claim
}

// X is an experiment's view of a run: its scale and seed, and where its tables,
// figures and headlines go.
type X struct {
	Scale Scale
	Seed  uint64
	name  string
	dir   string
	prog  Progress

	tables    []*results.Table
	files     []string
	captions  map[string]string // what each figure shows, by name
	headlines []Headline
	claims    []Claim
	params    map[string]any

	wireServer []string
	rocePort   uint16
	profile    odp.Profile
	// formats are the figures' file formats (default png and svg); loaded holds
	// the tables Replot read, by name.
	formats []string
	loaded  map[string]*results.Table
}

// Steps announces how many steps the experiment will report.
func (x *X) Steps(n int) { x.prog.Start(x.name, n) }

// Step reports one step done.
func (x *X) Step() { x.prog.Step() }

// Table makes the experiment's table name ("" for the experiment's own name),
// written as CSV when the experiment ends.
func (x *X) Table(name string, columns ...string) *results.Table {
	if name == "" {
		name = x.name
	}
	t, err := results.NewTable(name, columns...)
	if err != nil {
		panic(err) // the experiments' columns are constants
	}
	x.tables = append(x.tables, t)
	return t
}

// figure is a plots.Figure or plots.Bars.
type figure interface {
	SaveAs(dir, name string, exts ...string) ([]string, error)
	Caption() string
}

// Figure saves f as name's PNG and SVG (or the formats Replot was given).
func (x *X) Figure(name string, f figure) error {
	exts := x.formats
	if len(exts) == 0 {
		exts = []string{"png", "svg"}
	}
	paths, err := f.SaveAs(x.dir, name, exts...)
	if err != nil {
		return err
	}
	for _, p := range paths {
		x.files = append(x.files, filepath.Base(p))
	}
	if c := f.Caption(); c != "" {
		if x.captions == nil {
			x.captions = map[string]string{}
		}
		x.captions[name] = c
	}
	return nil
}

// Headline adds a number to the summary that has no interval: a count, a choice.
func (x *X) Headline(what, value, detail string) { x.HeadlineCI(what, value, "", detail) }

// HeadlineCI adds a number to the summary with the 95% bootstrap interval of each
// median in it (see ci).
func (x *X) HeadlineCI(what, value, interval, detail string) {
	x.headlines = append(x.headlines, Headline{Experiment: x.name, What: what, Value: value, Interval: interval, Detail: detail})
}

// Claim records a claim of the paper about this run (see Claim); name is unique
// within the experiment, a TeX-safe word.
func (x *X) Claim(name, text string, holds bool, evidence string) {
	x.claims = append(x.claims, Claim{Experiment: x.name, Name: name, Text: text, Holds: holds, Evidence: evidence})
}

// nic returns p with the run's profile (p's fault model, if it names one, stays).
func (x *X) nic(p perf.Params) perf.Params {
	p.Profile = x.profile
	return p
}

// device returns c with the run's profile (c's fault model, if it names one,
// stays).
func (x *X) device(c odp.Config) odp.Config {
	model := c.FaultModel
	c = x.profile.Apply(c)
	if model != (odp.FaultModel{}) {
		c.FaultModel = model
	}
	return c
}

// Param records a parameter of the experiment in the manifest.
func (x *X) Param(name string, v any) { x.params[name] = v }

// Run runs the configured experiments and writes their results, the manifest and
// the summary into cfg.Dir. An experiment that fails is recorded as failed and the
// others still run; Run then returns an error naming the failures.
func Run(cfg Config) (*Report, error) {
	all := Experiments()
	for _, n := range cfg.Only {
		if !slices.ContainsFunc(all, func(e Experiment) bool { return e.Name == n }) {
			return nil, fmt.Errorf("%w %q", ErrUnknownExperiment, n)
		}
	}
	if err := os.MkdirAll(cfg.Dir, 0o755); err != nil {
		return nil, err
	}
	if cfg.Progress == nil {
		cfg.Progress = silent{}
	}
	rep := &Report{Dir: cfg.Dir, Scale: cfg.Scale}
	m := &rep.Manifest
	m.Started, m.Command, m.Machine, m.Go, m.Revision = time.Now(), cfg.Command, results.Describe(), runtime.Version(), results.Revision()
	params := map[string]map[string]any{}
	m.Config = map[string]any{"scale": cfg.Scale.String(), "seed": cfg.Seed, "only": cfg.Only, "experiments": params,
		"profile": cfg.Profile.String(), "profile_source": cfg.Profile.Source, "profile_settings": cfg.Profile.Describe(),
		"link": cfg.Profile.Link.String(), "link_bdp_bytes": cfg.Profile.Link.BDPBytes(),
		"responder_faults": cfg.Profile.ResponderFaults.String(), "fault_model": cfg.Profile.Fault.String(),
		"fault_model_per_fault_ns": cfg.Profile.Fault.PerFault.Nanoseconds(), "fault_model_per_page_ns": cfg.Profile.Fault.PerPage.Nanoseconds(),
		"mkey_reg_ns": cfg.Profile.Reg.Reg.Nanoseconds(), "mkey_dereg_ns": cfg.Profile.Reg.Dereg.Nanoseconds()}
	cpu0, cpuErr := results.ReadCPUTimes()
	var failed []error
	for i, e := range all {
		if len(cfg.Only) > 0 && !slices.Contains(cfg.Only, e.Name) {
			continue
		}
		x := &X{Scale: cfg.Scale, Seed: cfg.Seed + uint64(i)*1000, name: e.Name, dir: cfg.Dir, prog: cfg.Progress,
			params: map[string]any{}, wireServer: cfg.WireServer, rocePort: cfg.RoCEPort, profile: cfg.Profile}
		x.Param("seed", x.Seed)
		start := time.Now()
		err := e.Run(x)
		rec := results.ExperimentRecord{Name: e.Name, WallTime: time.Since(start)}
		for _, t := range x.tables {
			path, werr := t.WriteCSV(cfg.Dir)
			if werr != nil {
				err = errors.Join(err, werr)
				continue
			}
			rec.Files = append(rec.Files, filepath.Base(path))
			rec.Rows += t.Len()
		}
		rec.Files = append(rec.Files, x.files...)
		rec.Figures = x.captions
		if err != nil {
			rec.Error = err.Error()
			failed = append(failed, fmt.Errorf("%s: %w", e.Name, err))
		}
		cfg.Progress.Done(e.Name, rec.WallTime, err)
		m.Experiments = append(m.Experiments, rec)
		params[e.Name] = x.params
		rep.Headlines = append(rep.Headlines, x.headlines...)
		rep.Claims = append(rep.Claims, x.claims...)
	}
	m.WallTime = time.Since(m.Started)
	if cpu1, err := results.ReadCPUTimes(); err == nil && cpuErr == nil {
		m.Steal = results.StealShare(cpu0, cpu1)
	}
	err := errors.Join(m.Write(cfg.Dir), writeSummary(rep))
	return rep, errors.Join(err, errors.Join(failed...))
}

type silent struct{}

func (silent) Start(string, int)                 {}
func (silent) Step()                             {}
func (silent) Done(string, time.Duration, error) {}
