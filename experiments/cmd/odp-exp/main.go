// Command odp-exp runs odpemu's experiment suite: every comparison of on-demand
// paging with pinned registration, written as CSV tables, PNG and SVG figures, a
// JSON manifest of the machine and configuration, and summary.md.
//
//	odp-exp [--tiny | --quick | --full] [--only NAME[,NAME]] [--out DIR] [--seed N] [--list]
//	odp-exp --replot RUN --out DIR [--formats pdf,png] [--tex FILE]
//
// The quick scale (the default) takes about ten minutes on a 2-core machine; tiny
// takes seconds per experiment (CI); full makes ten repetitions of every measurement
// and finer grids (about 45 minutes on 2 cores; the paper's run). Results go to
// experiments/results/<timestamp>/ unless --out names a directory. --replot draws a
// run's figures again from its CSVs alone and, with --tex, writes its headlines as
// LaTeX macros (the paper's numbers).
package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/odpemu/odpemu/experiments/cmdflag"
	"github.com/odpemu/odpemu/experiments/progress"
	"github.com/odpemu/odpemu/experiments/suite"
	"github.com/odpemu/odpemu/transport/roce"
	"github.com/spf13/pflag"
)

// wireServerRole is the hidden first argument that makes this program the wire
// experiment's server process.
const wireServerRole = "wire-server"

func main() {
	var err error
	if len(os.Args) > 1 && os.Args[1] == wireServerRole {
		err = serveWire(os.Args[2:], os.Stdout)
	} else {
		err = run(os.Args[1:], os.Stdout, os.Stderr)
	}
	switch {
	case errors.Is(err, pflag.ErrHelp):
		os.Exit(0)
	case err != nil:
		fmt.Fprintln(os.Stderr, "odp-exp:", err)
		os.Exit(1)
	}
}

func run(args []string, stdout, stderr io.Writer) error {
	fs := pflag.NewFlagSet("odp-exp", pflag.ContinueOnError)
	fs.SetOutput(stderr)
	tiny := fs.Bool("tiny", false, "seconds per experiment: a check that everything runs (CI)")
	quick := fs.Bool("quick", false, "about ten minutes on a 2-core machine (the default)")
	full := fs.Bool("full", false, "ten repetitions of every measurement and finer grids (about 45 minutes on 2 cores)")
	only := fs.StringSlice("only", nil, "run only these experiments (see --list)")
	out := fs.String("out", "", "results directory (default experiments/results/<timestamp>)")
	seed := fs.Uint64("seed", 1, "seed of every random choice")
	list := fs.Bool("list", false, "list the experiments and exit")
	quiet := fs.Bool("quiet", false, "no progress")
	nic := cmdflag.AddNIC(fs)
	rocePort := fs.Uint16("roce-port", roce.UDPPort, "UDP port of the wire experiment's RoCEv2 endpoints, at 127.0.0.1 and 127.0.0.2 (0: the kernel picks)")
	replot := fs.String("replot", "", "draw the figures of the run in this directory again, from its CSVs, into --out (runs nothing)")
	formats := fs.StringSlice("formats", []string{"pdf", "png"}, "with --replot: the figures' formats (pdf, png, svg)")
	tex := fs.String("tex", "", "with --replot: also write the headlines as LaTeX macros to this file")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected argument %q", fs.Arg(0))
	}
	profile, err := nic.Profile()
	if err != nil {
		return err
	}
	if *list {
		for _, e := range suite.Experiments() {
			fmt.Fprintf(stdout, "%-14s %s\n", e.Name, e.Title)
		}
		return nil
	}
	if *replot != "" {
		return replotRun(*replot, *out, *formats, *tex, stdout)
	}
	if *tex != "" {
		return errors.New("--tex goes with --replot")
	}
	scale := suite.Quick
	switch {
	case b2i(*tiny)+b2i(*quick)+b2i(*full) > 1:
		return errors.New("--tiny, --quick and --full: one of them")
	case *tiny:
		scale = suite.Tiny
	case *full:
		scale = suite.Full
	}
	dir := *out
	if dir == "" {
		dir = filepath.Join("experiments", "results", time.Now().UTC().Format("20060102-150405"))
	}
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	cfg := suite.Config{Scale: scale, Only: *only, Dir: dir, Seed: *seed, Command: append([]string{"odp-exp"}, args...),
		WireServer: []string{exe, wireServerRole}, RoCEPort: *rocePort,
		Profile: profile}
	if !*quiet {
		cfg.Progress = &bars{w: stderr}
	}
	fmt.Fprintf(stdout, "odp-exp: %s run into %s; profile %s: %s\n", scale, dir, profile, profile.Describe())
	rep, err := suite.Run(cfg)
	if rep != nil {
		fmt.Fprintf(stdout, "\n%-14s %-40s %s\n", "experiment", "result", "value")
		for _, h := range rep.Headlines {
			fmt.Fprintf(stdout, "%-14s %-40s %s\n", h.Experiment, h.What, h.Value)
		}
		fmt.Fprintf(stdout, "\nsummary: %s\n", filepath.Join(dir, "summary.md"))
	}
	return err
}

// replotRun draws the run in dir again into out and writes its headlines as LaTeX.
func replotRun(dir, out string, formats []string, tex string, stdout io.Writer) error {
	if out == "" {
		return errors.New("--replot needs --out")
	}
	if err := os.MkdirAll(out, 0o755); err != nil {
		return err
	}
	rep, err := suite.Replot(dir, out, formats...)
	if err != nil {
		return err
	}
	for _, h := range rep.Headlines {
		fmt.Fprintf(stdout, "%-14s %-40s %s\n", h.Experiment, h.What, h.Value)
	}
	if tex != "" {
		return suite.WriteTeX(rep, tex)
	}
	return nil
}

// serveWire is the wire experiment's server process.
func serveWire(args []string, stdout io.Writer) error {
	return suite.ServeWire(args, func(cm, udp string) { fmt.Fprintf(stdout, "cm %s udp %s\n", cm, udp) })
}

// bars shows each experiment's progress.
type bars struct {
	w           io.Writer
	bar         *progress.Bar
	done, total int
}

func (b *bars) Start(name string, steps int) {
	b.bar, b.done, b.total = progress.New(b.w, name), 0, steps
	b.bar.Update(0, steps)
}

func (b *bars) Step() {
	b.done++
	if b.bar != nil {
		b.bar.Update(b.done, b.total)
	}
}

func (b *bars) Done(name string, elapsed time.Duration, err error) {
	if b.bar != nil {
		b.bar.Finish()
		b.bar = nil
	}
	status := "done"
	if err != nil {
		status = "FAILED: " + strings.ReplaceAll(err.Error(), "\n", "; ")
	}
	fmt.Fprintf(b.w, "%s: %s in %s\n", name, status, elapsed.Round(100*time.Millisecond))
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}
