package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"image/png"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/odpemu/odpemu/experiments/results"
	"github.com/odpemu/odpemu/experiments/suite"
	"github.com/odpemu/odpemu/internal/fusemount"
	"github.com/odpemu/odpemu/odp"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

// TestMain is also the wire experiment's server process, which the suite starts as
// this executable with the server role's argument.
func TestMain(m *testing.M) {
	if len(os.Args) > 1 && os.Args[1] == wireServerRole {
		if err := serveWire(os.Args[2:], os.Stdout); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	code := fusemount.TestMain(m) // the filebacked experiment mounts a filesystem
	if err := goleak.Find(); err != nil && code == 0 {
		fmt.Fprintf(os.Stderr, "goleak: %v\n", err)
		code = 1
	}
	os.Exit(code)
}

func runArgs(args ...string) (string, string, error) {
	var out, errOut bytes.Buffer
	err := run(args, &out, &errOut)
	return out.String(), errOut.String(), err
}

// tinyRows is how many rows each experiment writes at the tiny scale: its
// parameters' product (sizes x repetitions x variants x ...).
var tinyRows = map[string]int{
	"registration": 7 * 2 * 2,             // 4K..16M by 4, 2 reps, pinned and ODP
	"oneshot":      5 * 1 * 4,             // 4K..1M by 4, 1 rep, 4 variants
	"coldwarm":     2 * 1 * 7 * 2,         // 2 sizes, 1 rep, 7 variants, cold and warm
	"anatomy":      2 * (3*6 + 3),         // 2 reps: 3 variants x (5 phases and the whole fault), 3 floors
	"invalidation": 1 * (1 + 2*(1+1*1)),   // 1 rep: pinned, and per fault model no storm and 1 rate x 1 range
	"overcommit":   1 * 4 * 3,             // 1 rep, 4 budgets (1, 3/4, 1/2, 1/8), pinned and 2 fault models
	"buffers":      2 * 1 * 6,             // 2 reuse rates, 1 rep, 6 strategies
	"rnr":          1 * 2 * 2 * (2 + 1),   // 1 rep, 2 models, 2 timers, 2 losses and rnr_retry 1
	"injection":    1 * (1 + 1*1 + 1 + 2), // 1 rep: no faults before each group, 1 latency x 1 rate, 2 RNR timers
	"sweep":        1 * 2 * 4,             // 1 rep, 2 latencies, 4 conclusions
	"qps":          1 * 2 * 3,             // 1 rep, 1 and 4 QPs, pinned and 2 fault models
	"validate":     1 * 6,                 // 1 rep of the 6 anchors rerun (nbs-rnr-timer skipped: its pass takes seconds)
	"wire":         1 * 5,                 // 1 round of UDP, pinned and ODP warm, pinned and ODP cold
	"filebacked":   2 * 3 * 2,             // 2 reps, 3 fractions, pinned and ODP (and 2 rows of the stale demo)
}

// The whole suite at the tiny scale: every CSV parses with its rows, every figure
// is a PNG and an SVG, the manifest and the summary say what ran.
func TestTinySuite(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "run")
	// The wire experiment's endpoints on ports the kernel picks: the packages' tests
	// run in parallel, and others (verbs' programs, odp-perf's) bind port 4791 at
	// 127.0.0.1 and 127.0.0.2.
	out, _, err := runArgs("--tiny", "--quiet", "--out", dir, "--seed", "7", "--roce-port", "0")
	require.NoError(t, err, out)
	assert.Contains(t, out, "summary: "+filepath.Join(dir, "summary.md"))

	b, err := os.ReadFile(filepath.Join(dir, "manifest.json"))
	require.NoError(t, err)
	var m results.Manifest
	require.NoError(t, json.Unmarshal(b, &m))
	assert.NotEmpty(t, m.Machine.Kernel)
	assert.Positive(t, m.Machine.Cores)
	assert.Positive(t, m.WallTime)
	cfg := m.Config.(map[string]any)
	assert.Equal(t, "tiny", cfg["scale"])
	assert.EqualValues(t, 7, cfg["seed"])

	summary, err := os.ReadFile(filepath.Join(dir, "summary.md"))
	require.NoError(t, err)
	require.Len(t, m.Experiments, len(suite.Experiments()))
	for _, e := range m.Experiments {
		t.Run(e.Name, func(t *testing.T) {
			assert.Empty(t, e.Error)
			if e.Name == "filebacked" && fusemount.Available() != nil {
				t.Skipf("filebacked needs FUSE: %v", fusemount.Available())
			}
			tb, err := results.ReadCSV(filepath.Join(dir, e.Name+".csv"))
			require.NoError(t, err)
			assert.Equal(t, tinyRows[e.Name], tb.Len(), "rows")
			rows := 0 // over every table of the experiment
			for _, f := range e.Files {
				if strings.HasSuffix(f, ".csv") {
					ft, err := results.ReadCSV(filepath.Join(dir, f))
					require.NoError(t, err)
					rows += ft.Len()
				}
			}
			assert.Equal(t, rows, e.Rows)
			assert.Contains(t, tb.Columns, "rep", "a tidy table names the repetition")
			for _, r := range tb.Rows(nil) {
				for _, c := range tb.Columns {
					if strings.HasSuffix(c, "_ns") || strings.HasSuffix(c, "_bytes") {
						assert.False(t, math.IsNaN(r.Float(c)), "%s is a number", c)
					}
				}
			}
			pngs := 0
			for _, f := range e.Files {
				path := filepath.Join(dir, f)
				require.FileExists(t, path)
				if filepath.Ext(f) == ".png" {
					pngs++
					fh, err := os.Open(path)
					require.NoError(t, err)
					_, err = png.Decode(fh)
					assert.NoError(t, err, f)
					assert.NoError(t, fh.Close())
					assert.FileExists(t, strings.TrimSuffix(path, ".png")+".svg")
					assert.Contains(t, string(summary), "("+f+")", "the summary shows the figure")
					c := e.Figures[strings.TrimSuffix(f, ".png")]
					assert.NotEmpty(t, c, "%s: what the figure shows", f)
					assert.Contains(t, string(summary), c+":\n\n![", "the summary says what %s shows", f)
				}
			}
			assert.Positive(t, pngs, "at least one figure")
			assert.Contains(t, string(summary), "["+e.Name+"]("+e.Name+".csv)", "a headline links the CSV")
		})
	}

	// Replotted from the CSVs alone, every figure comes back as PDF, and the
	// headlines are the run's, to the digit.
	re := filepath.Join(t.TempDir(), "replot")
	tex := filepath.Join(re, "numbers.tex")
	replotted, _, err := runArgs("--replot", dir, "--out", re, "--formats", "pdf", "--tex", tex)
	require.NoError(t, err)
	for _, e := range m.Experiments {
		for _, f := range e.Files {
			if filepath.Ext(f) == ".png" {
				assert.FileExists(t, filepath.Join(re, strings.TrimSuffix(f, ".png")+".pdf"))
			}
		}
	}
	var runLines, replotLines []string
	for _, l := range strings.Split(out, "\n") {
		for _, e := range m.Experiments {
			if strings.HasPrefix(l, e.Name+" ") {
				runLines = append(runLines, l)
				break
			}
		}
	}
	replotLines = strings.Split(strings.TrimSpace(replotted), "\n")
	assert.Equal(t, runLines, replotLines, "headlines from the CSVs equal the run's")
	b, err = os.ReadFile(tex)
	require.NoError(t, err)
	assert.Contains(t, string(b), `\csname odp@registration@1\endcsname`)
	assert.Contains(t, string(b), `\providecommand{\resultstable}`)
	// The link the run's NICs sent over, as its manifest records it.
	cfg, ok := m.Config.(map[string]any)
	require.True(t, ok, "the manifest's config")
	link, _ := cfg["link"].(string)
	require.NotEmpty(t, link, "the manifest names the link")
	assert.Contains(t, string(b), `\csname resultslink\endcsname{`+strings.ReplaceAll(link, "µ", `\textmu{}`)+"}")
}

func TestOnlyAndList(t *testing.T) {
	out, _, err := runArgs("--list")
	require.NoError(t, err)
	for _, e := range suite.Experiments() {
		assert.Contains(t, out, e.Name)
	}
	dir := t.TempDir()
	_, stderr, err := runArgs("--tiny", "--only", "registration", "--out", dir)
	require.NoError(t, err)
	assert.Contains(t, stderr, "registration: done")
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	assert.ElementsMatch(t, []string{"registration.csv", "registration.png", "registration.svg", "manifest.json", "summary.md"}, names)

	// A profile: the manifest records it, and the registrations pay its memory
	// key costs.
	dir = t.TempDir()
	_, _, err = runArgs("--tiny", "--only", "registration", "--profile", "connectx4", "--out", dir)
	require.NoError(t, err)
	m, err := results.ReadManifest(dir)
	require.NoError(t, err)
	cfg, ok := m.Config.(map[string]any)
	require.True(t, ok)
	assert.Equal(t, "connectx4", cfg["profile"])
	assert.Contains(t, cfg["profile_source"], "ASPLOS'17")
	tab, err := results.ReadCSV(filepath.Join(dir, "registration.csv"))
	require.NoError(t, err)
	rows := tab.Rows(nil)
	require.NotEmpty(t, rows)
	for _, r := range rows {
		assert.GreaterOrEqual(t, r.Float("total_ns"), float64(odp.ProfileConnectX4.Reg.Reg), "%v", r)
		assert.GreaterOrEqual(t, r.Float("dereg_ns"), float64(odp.ProfileConnectX4.Reg.Dereg), "%v", r)
	}
	summary, err := os.ReadFile(filepath.Join(dir, "summary.md"))
	require.NoError(t, err)
	assert.Contains(t, string(summary), "- Profile: connectx4 (")
}

func TestBadArguments(t *testing.T) {
	_, _, err := runArgs("--tiny", "--only", "nonsense", "--out", t.TempDir())
	assert.True(t, errors.Is(err, suite.ErrUnknownExperiment), "%v", err)
	for _, args := range [][]string{{"--tiny", "--full"}, {"extra"}, {"--seed", "x"}} {
		_, _, err := runArgs(args...)
		assert.Error(t, err, "%v", args)
	}
}
