package main

import (
	"bytes"
	"encoding/csv"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/odpemu/odpemu/experiments/perf"
	"github.com/odpemu/odpemu/odp"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// evalGoals takes each goal's figure from every round that gives one, and a goal
// is met when the median reaches its bound, from below or above.
func TestEvalGoals(t *testing.T) {
	rounds := []goalRound{
		{"a": {r: perf.Result{AvgMiBps: 3}, floor: 4}},
		{"a": {r: perf.Result{AvgMiBps: 1}, floor: 4}},
		{"a": {r: perf.Result{AvgMiBps: 2}, floor: 4}},
		{"a": {r: perf.Result{AvgMiBps: 8}, floor: 4}},
		{"a": {r: perf.Result{AvgMiBps: 5}}}, // no floor: no figure
	}
	ratio := func(r goalRound) float64 {
		if r["a"].floor == 0 {
			return math.NaN()
		}
		return r["a"].r.AvgMiBps / r["a"].floor
	}
	none := func(goalRound) float64 { return math.NaN() }
	lines := evalGoals([]goal{
		{what: "at least", value: ratio, target: 0.7},
		{what: "at least, missed", value: ratio, target: 0.8},
		{what: "at most", value: ratio, target: 0.75, atMost: true},
		{what: "at most, missed", value: ratio, target: 0.7, atMost: true},
		{what: "reported", value: ratio, report: true},
		{what: "no figure", value: none, target: 1},
	}, rounds)
	require.Len(t, lines, 6)
	l := lines[0]
	assert.Equal(t, 4, l.rounds, "the round without a floor gives no figure")
	// 0.25, 0.5, 0.75, 2: the nearest ranks of 0.75, 1.5 and 2.25 (of 0..3).
	assert.InDelta(t, 0.5, l.q1, 1e-9)
	assert.InDelta(t, 0.75, l.med, 1e-9)
	assert.InDelta(t, 0.75, l.q3, 1e-9)
	assert.Equal(t, []string{"yes", "no", "yes", "no", "", "n/a"},
		[]string{lines[0].met(), lines[1].met(), lines[2].met(), lines[3].met(), lines[4].met(), lines[5].met()})
	assert.True(t, math.IsNaN(lines[5].med))
}

// Every goal reads runs the set makes, and the line goals are there only with a
// line rate.
func TestGoalSet(t *testing.T) {
	for _, rate := range []float64{0, -1} {
		prof := odp.ProfileEmulator
		prof.Link.RateGbps = rate
		runs, goals := goalSet(goalConfig{profile: prof, depth: 4, scale: 1})
		keys := map[string]goalRun{}
		for _, r := range runs {
			_, dup := keys[r.key]
			require.False(t, dup, "run %s twice", r.key)
			keys[r.key] = r
		}
		// A round whose every run has a distinct, known result: each goal must
		// find the runs it reads (a missing key reads as zeros and gives 0, Inf or
		// NaN).
		round := goalRound{}
		for i, r := range runs {
			x := float64(i + 1)
			round[r.key] = goalOutcome{r: perf.Result{AvgMiBps: x, MsgRateMpps: x, RNRNaks: 1, Retransmissions: 4, LinkBDP: 1 << 16}, floor: 1}
		}
		line := 0
		for _, g := range goals {
			v := g.value(round)
			assert.False(t, math.IsNaN(v) || math.IsInf(v, 0) || v == 0, "%s: %v", g.what, v)
			if strings.Contains(g.what, "over the link") {
				line++
			}
		}
		if rate == 0 {
			assert.Equal(t, 2, line, "64 KiB and 1 MiB over a 100 Gb/s link")
		} else {
			assert.Zero(t, line, "no line goal without a rate")
		}
		assert.Equal(t, -1.0, keys[runKey(perf.WriteBW, "pinned", 64)].p.Profile.Link.RateGbps, "operations at an unlimited rate")
		assert.False(t, keys[runKey("cold", "odp", 4096)].p.Warm, "a cold pass")
		assert.True(t, keys[runKey(perf.ReadBW, "odp", 4096)].p.Warm)
		assert.Equal(t, 4*(8<<20), keys[runKey(perf.ReadBW, "odp", 8<<20)].p.MRSize)
		assert.Equal(t, odp.FaultStall, keys["inval/stall"].p.Profile.ResponderFaults)
		assert.Equal(t, goalInvalidateRate, keys["inval/stall"].p.InvalidateRate)
	}
}

// The command runs every configuration and prints one line per goal, whose median
// lies within its quartiles and whose verdict follows from it.
func TestGoalsCommand(t *testing.T) {
	csvPath := filepath.Join(t.TempDir(), "goals.csv")
	out, _, err := runArgs("goals", "--quiet", "--rounds", "2", "--scale", "0.002", "--tx-depth", "4", "--csv", csvPath)
	require.NoError(t, err)
	runs, goals := goalSet(goalConfig{profile: odp.ProfileEmulator, depth: 4, scale: 1})
	lines := strings.Split(strings.TrimSpace(out), "\n")
	require.True(t, strings.HasPrefix(lines[0], "# odp-perf goals: 2 round(s) of "), lines[0])
	require.True(t, strings.HasPrefix(lines[2], " #goal"), lines[2])
	rows := lines[3 : 3+len(goals)]
	for i, g := range goals {
		row := rows[i]
		require.True(t, strings.HasPrefix(row, " "+g.what+" "), "row %d: %q, want %q", i, row, g.what)
		f := strings.Fields(row[len(g.what)+1:])
		if f[0] == "-" {
			assert.Equal(t, "n/a", f[len(f)-1], row)
			continue
		}
		med, err := strconv.ParseFloat(f[0], 64)
		require.NoError(t, err, row)
		q := strings.Split(f[1], "..")
		require.Len(t, q, 2, row)
		q1, err1 := strconv.ParseFloat(q[0], 64)
		q3, err3 := strconv.ParseFloat(q[1], 64)
		require.NoError(t, err1, row)
		require.NoError(t, err3, row)
		assert.True(t, q1 <= med && med <= q3, row)
		if g.report {
			assert.Len(t, f, 2, "a reported figure has no bound: %s", row)
			continue
		}
		require.Len(t, f, 5, row)
		bound, err := strconv.ParseFloat(f[3], 64)
		require.NoError(t, err, row)
		if math.Abs(med-bound) <= 1e-3*max(1, math.Abs(bound)) {
			continue // the row's rounding decides no verdict this close
		}
		met := f[2] == "<=" && med <= bound || f[2] == ">=" && med >= bound
		assert.Equal(t, map[bool]string{true: "yes", false: "no"}[met], f[4], row)
	}
	assert.Contains(t, out, "odp-perf wire")

	// The CSV: every run of every round, in the order they ran (the second round
	// backwards), each with its figures.
	b, err := os.ReadFile(csvPath)
	require.NoError(t, err)
	recs, err := csv.NewReader(bytes.NewReader(b)).ReadAll()
	require.NoError(t, err)
	require.Len(t, recs, 1+2*len(runs), "a header and a row per run and round")
	for i, rec := range recs[1:] {
		round, j := i/len(runs), i%len(runs)
		if round == 1 {
			j = len(runs) - 1 - j
		}
		assert.Equal(t, strconv.Itoa(round+1), rec[0])
		assert.Equal(t, runs[j].key, rec[1])
		bw, err := strconv.ParseFloat(rec[6], 64)
		require.NoError(t, err)
		assert.Positive(t, bw, "%v", rec)
	}

	_, _, err = runArgs("goals", "--rounds", "0")
	assert.Error(t, err)
	_, _, err = runArgs("goals", "--scale", "-1")
	assert.Error(t, err)
}

// The runs a ratio compares run next to each other in a round: a warm ODP run
// beside its pinned one, READ beside WRITE, SEND and READ with rxe's depth within
// a run or two of the WRITE of their size; and every other round runs backwards.
func TestGoalNeighbours(t *testing.T) {
	runs, _ := goalSet(goalConfig{profile: odp.ProfileEmulator, depth: 4, scale: 1})
	at := map[string]int{}
	for i, r := range runs {
		at[r.key] = i
	}
	apart := func(a, b string) int {
		i, ok1 := at[a]
		j, ok2 := at[b]
		require.True(t, ok1 && ok2, "%s, %s", a, b)
		return max(i-j, j-i)
	}
	for _, s := range warmSizes {
		for _, test := range []string{perf.WriteBW, perf.ReadBW} {
			assert.Equal(t, 1, apart(runKey(test, "odp", s), runKey(test, "pinned", s)), "warm ODP %s %d", test, s)
		}
	}
	for _, s := range goalSizes {
		w := runKey(perf.WriteBW, "pinned", s)
		assert.Equal(t, 1, apart(runKey(perf.ReadBW, "pinned", s), w), "READ / WRITE %d", s)
		assert.LessOrEqual(t, apart(runKey(perf.SendBW, "pinned", s), w), 2, "SEND / WRITE %d", s)
	}
	for _, s := range deepReadSizes {
		assert.LessOrEqual(t, apart(runKey("deepread", "pinned", s), runKey(perf.WriteBW, "pinned", s)), 3, "deep READ %d", s)
	}
	assert.Equal(t, apart("noinval/rnr", "inval/rnr"), 1)
	assert.Equal(t, runs, roundOrder(runs, 0))
	assert.Equal(t, runs, roundOrder(runs, 2))
	first := runs[0].key
	back := roundOrder(runs, 1)
	assert.Equal(t, first, runs[0].key, "a round run backwards leaves the list as it was")
	require.Len(t, back, len(runs))
	for i := range runs {
		assert.Equal(t, runs[len(runs)-1-i].key, back[i].key)
	}
}
