package main

import (
	"fmt"
	"io"
	"math"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/odpemu/odpemu/experiments/cmdflag"
	"github.com/odpemu/odpemu/experiments/perf"
	"github.com/odpemu/odpemu/experiments/progress"
	"github.com/odpemu/odpemu/odp"
	"github.com/odpemu/odpemu/transport/roce"
)

// The data path's speed goals (README, "Speed goals"), measured side by side: each
// round runs every configuration once, in one process, and each goal's figure is a
// ratio of a round's own runs (a READ's message rate over the WRITE's of the same
// round, a run's bandwidth over the memcpy floor measured right after it), so that a
// noisy machine moves both sides of it alike. A goal's line shows the figure's
// median over the rounds, its quartiles, the bound and whether the median reaches it.

// goalRun is one configuration the goals are computed from, run once per round.
type goalRun struct {
	key   string // how the goals name it
	p     perf.Params
	floor bool // the memcpy floor of the same bytes and strides is measured after it
}

// goalOutcome is a run's result in one round, with its memcpy floor (MiB/s) when
// measured.
type goalOutcome struct {
	r     perf.Result
	floor float64
}

// goalRound is one round's outcomes by goalRun key.
type goalRound map[string]goalOutcome

// goal is one line of the table: the figure a round gives, and its bound.
type goal struct {
	what   string
	value  func(goalRound) float64 // NaN: the round gives none (no RNR NAK, say)
	target float64
	atMost bool // the figure must be at most target, else at least
	report bool // no bound: the figure is only reported
}

// goalLine is a goal evaluated over the rounds.
type goalLine struct {
	goal
	q1, med, q3 float64 // NaN when no round gave a figure
	rounds      int     // rounds that gave one
}

// met says whether the median reaches the bound: "yes", "no", "n/a" (no figure)
// or "" (reported only).
func (l goalLine) met() string {
	switch {
	case l.report:
		return ""
	case l.rounds == 0:
		return "n/a"
	case l.atMost && l.med <= l.target, !l.atMost && l.med >= l.target:
		return "yes"
	}
	return "no"
}

// evalGoals evaluates each goal over the rounds.
func evalGoals(goals []goal, rounds []goalRound) []goalLine {
	out := make([]goalLine, len(goals))
	for i, g := range goals {
		var v []float64
		for _, r := range rounds {
			if x := g.value(r); !math.IsNaN(x) {
				v = append(v, x)
			}
		}
		l := goalLine{goal: g, rounds: len(v), q1: math.NaN(), med: math.NaN(), q3: math.NaN()}
		if len(v) > 0 {
			l.q1, l.med, l.q3 = quartiles(v)
		}
		out[i] = l
	}
	return out
}

// quartiles returns the first quartile, the median and the third quartile of v
// (nearest rank; v is sorted in place).
func quartiles(v []float64) (q1, med, q3 float64) {
	slices.Sort(v)
	at := func(q float64) float64 { return v[int(q*float64(len(v)-1)+0.5)] }
	return at(0.25), at(0.5), at(0.75)
}

// goalSizes are the message sizes the goals compare operations at; warmSizes
// those of warm ODP against pinned; deepReadSizes those READ / WRITE is reported at
// with rxe's depth as well.
var (
	goalSizes     = []int{64, 4 << 10, 64 << 10, 1 << 20}
	warmSizes     = []int{64, 4 << 10, 64 << 10, 1 << 20, 8 << 20}
	deepReadSizes = []int{64, 4 << 10}
)

// goalIters is how many iterations a run of size-byte messages makes at scale 1:
// a few tenths of a second on a 2-core VM, long enough that a run's first
// milliseconds do not decide its figure.
func goalIters(size int, scale float64) int {
	base := 500_000
	switch {
	case size >= 8<<20:
		base = 400
	case size >= 1<<20:
		base = 3000
	case size >= 64<<10:
		base = 50_000
	case size >= 4<<10:
		base = 200_000
	}
	return max(int(float64(base)*scale), 1)
}

// goalConfig is what the goals' runs are made from: the NIC profile of the line
// goals (the in-process goals run its link at an unlimited rate), the tx depth and
// the iterations' scale.
type goalConfig struct {
	profile odp.Profile
	depth   int
	scale   float64
}

// The invalidation goal's rate and message size.
const (
	goalInvalidateRate = 1000
	goalInvalidateSize = 64 << 10
)

// goalOps are the operations the goals compare, WRITE first.
var goalOps = []struct{ test, name string }{{perf.WriteBW, "WRITE"}, {perf.ReadBW, "READ"}, {perf.SendBW, "SEND"}}

// goalSet returns the runs and the goals computed from them.
func goalSet(c goalConfig) ([]goalRun, []goal) { return goalRuns(c), goalList(c) }

// goalRuns returns the configurations a round runs, in order.
func goalRuns(c goalConfig) []goalRun {
	unlimited := c.profile
	unlimited.Link.RateGbps = -1
	var runs []goalRun
	// Every run but a cold pass is warm, pinned and ODP alike: its timed loop
	// starts on memory the NIC touched.
	add := func(key string, p perf.Params, floor bool) {
		p.Depth = c.depth
		p.Iters = goalIters(p.Size, c.scale)
		p.Warm = !strings.HasPrefix(key, "cold/")
		if p.Size >= 8<<20 {
			p.MRSize = p.Size * min(c.depth, 16) // 16 slots: 128 MiB a side
		}
		runs = append(runs, goalRun{key: key, p: p, floor: floor})
	}
	// READs with as many outstanding as rxe allows (the goal's have mlx5's 16),
	// reported beside them: what the depth leaves of READ's gap to WRITE.
	deep := unlimited
	deep.RdAtomic = odp.MaxRdAtomicLimit
	// Size by size, the runs a ratio compares next to each other (TestGoalNeighbours):
	// pinned SEND, warm ODP WRITE, pinned WRITE, pinned READ, warm ODP READ, then
	// READ with rxe's depth. runGoals runs every other round backwards, so that
	// each of two runs compared runs first as often as the other.
	for _, s := range warmSizes {
		goal := slices.Contains(goalSizes, s)
		pinned := func(test string) {
			add(runKey(test, "pinned", s), perf.Params{Test: test, Size: s, Profile: unlimited},
				goal && test == perf.WriteBW && s >= 64<<10)
		}
		warm := func(test string) {
			add(runKey(test, "odp", s), perf.Params{Test: test, ODP: true, Size: s, Profile: unlimited}, false)
		}
		if goal {
			pinned(perf.SendBW)
		}
		warm(perf.WriteBW)
		pinned(perf.WriteBW)
		pinned(perf.ReadBW)
		warm(perf.ReadBW)
		if slices.Contains(deepReadSizes, s) {
			add(runKey("deepread", "pinned", s), perf.Params{Test: perf.ReadBW, Size: s, Profile: deep}, false)
		}
	}
	if c.profile.Link.Gbps() > 0 {
		for _, s := range goalSizes[2:] {
			add(runKey("line", "pinned", s), perf.Params{Test: perf.WriteBW, Size: s, Profile: c.profile}, false)
		}
	}
	rnr, stall := c.profile, c.profile
	rnr.ResponderFaults, stall.ResponderFaults = odp.FaultRNR, odp.FaultStall
	for _, s := range goalSizes[1:] {
		// A cold pass: the first touch of every page faults.
		add(runKey("cold", "odp", s), perf.Params{Test: perf.WriteBW, ODP: true, Size: s, Profile: rnr}, false)
	}
	for _, pol := range []struct {
		name string
		prof odp.Profile
	}{{"stall", stall}, {"rnr", rnr}} {
		p := perf.Params{Test: perf.WriteBW, ODP: true, Size: goalInvalidateSize, Profile: pol.prof}
		add("noinval/"+pol.name, p, false)
		p.InvalidateRate = goalInvalidateRate
		add("inval/"+pol.name, p, false)
	}
	return runs
}

// goalList returns the goals, each reading the runs goalRuns makes by their keys.
func goalList(c goalConfig) []goal {
	var goals []goal
	ratio := func(a, b float64) float64 {
		if b == 0 {
			return math.NaN()
		}
		return a / b
	}
	memcpy := func(s int, target float64) goal {
		key := runKey(perf.WriteBW, "pinned", s)
		return goal{what: fmt.Sprintf("pinned WRITE %s, BW / memcpy", sizeName(s)), target: target,
			value: func(r goalRound) float64 { return ratio(r[key].r.AvgMiBps, r[key].floor) }}
	}
	w4k, w64 := runKey(perf.WriteBW, "pinned", 4<<10), runKey(perf.WriteBW, "pinned", 64)
	goals = append(goals, memcpy(1<<20, 0.8), memcpy(64<<10, 0.5),
		goal{what: "pinned WRITE 4 KiB, MiB/s", target: 3 << 10,
			value: func(r goalRound) float64 { return r[w4k].r.AvgMiBps }},
		goal{what: "pinned WRITE 64 B, Mpps", target: 3,
			value: func(r goalRound) float64 { return r[w64].r.MsgRateMpps }})
	for _, op := range goalOps[1:] {
		for _, s := range goalSizes {
			a, b := runKey(op.test, "pinned", s), runKey(perf.WriteBW, "pinned", s)
			goals = append(goals, goal{what: fmt.Sprintf("pinned %s / WRITE %s, messages/s", op.name, sizeName(s)), target: 0.8,
				value: func(r goalRound) float64 { return ratio(r[a].r.MsgRateMpps, r[b].r.MsgRateMpps) }})
		}
	}
	for _, s := range deepReadSizes {
		a, b := runKey("deepread", "pinned", s), runKey(perf.WriteBW, "pinned", s)
		goals = append(goals, goal{what: fmt.Sprintf("pinned READ / WRITE %s, messages/s, %d READs outstanding (rxe's most)", sizeName(s), odp.MaxRdAtomicLimit),
			report: true, value: func(r goalRound) float64 { return ratio(r[a].r.MsgRateMpps, r[b].r.MsgRateMpps) }})
	}
	for _, op := range goalOps[:2] {
		for _, s := range warmSizes {
			a, b := runKey(op.test, "odp", s), runKey(op.test, "pinned", s)
			goals = append(goals, goal{what: fmt.Sprintf("warm ODP / pinned %s %s, BW", op.name, sizeName(s)), target: 0.97,
				value: func(r goalRound) float64 { return ratio(r[a].r.AvgMiBps, r[b].r.AvgMiBps) }})
		}
	}
	if c.profile.Link.Gbps() > 0 {
		for _, s := range goalSizes[2:] {
			key, rate := runKey("line", "pinned", s), lineRate(c.profile.Link.Gbps(), s)
			goals = append(goals, goal{what: fmt.Sprintf("pinned WRITE %s over the link, BW / line", sizeName(s)), target: 0.9,
				value: func(r goalRound) float64 { return r[key].r.AvgMiBps / rate }})
		}
	}
	for _, s := range goalSizes[1:] {
		key, msg := runKey("cold", "odp", s), float64(roce.Packets(s, 4096))
		goals = append(goals, goal{what: fmt.Sprintf("cold ODP WRITE %s, packets resent per RNR NAK / (BDP in packets + a message)", sizeName(s)),
			target: 1, atMost: true, value: func(r goalRound) float64 {
				x := r[key].r
				perNAK, ok := resentPerNAK(x)
				if !ok {
					return math.NaN()
				}
				// A packet partly in the bandwidth-delay product is in flight.
				return perNAK / (math.Ceil(bdpPackets(x)) + msg)
			}})
	}
	inval := func(pol string) func(goalRound) float64 {
		return func(r goalRound) float64 {
			return ratio(r["inval/"+pol].r.AvgMiBps, r["noinval/"+pol].r.AvgMiBps)
		}
	}
	invalWhat := fmt.Sprintf("warm ODP WRITE %s, BW with %d invalidations/s / without", sizeName(goalInvalidateSize), goalInvalidateRate)
	goals = append(goals,
		goal{what: invalWhat + ", responder stalls", target: 0.9, value: inval("stall")},
		goal{what: invalWhat + ", responder RNR NAKs", report: true, value: inval("rnr")},
		goal{what: fmt.Sprintf("warm ODP WRITE %s with %d invalidations/s, responder RNR NAKs: packets resent per NAK", sizeName(goalInvalidateSize), goalInvalidateRate),
			report: true, value: func(r goalRound) float64 {
				if perNAK, ok := resentPerNAK(r["inval/rnr"].r); ok {
					return perNAK
				}
				return math.NaN()
			}})
	return goals
}

// runKey names a run: its test (or group), registration and message size.
func runKey(test, reg string, size int) string { return fmt.Sprintf("%s/%s/%d", test, reg, size) }

// sizeName writes a message size as the goals do: 64 B, 4 KiB, 1 MiB.
func sizeName(n int) string {
	switch {
	case n >= 1<<20 && n%(1<<20) == 0:
		return fmt.Sprintf("%d MiB", n>>20)
	case n >= 1<<10 && n%(1<<10) == 0:
		return fmt.Sprintf("%d KiB", n>>10)
	}
	return fmt.Sprintf("%d B", n)
}

// roundOrder is the order round i (from 0) runs runs in: as listed in even
// rounds, backwards in odd ones, so that of two runs a ratio compares each runs
// first as often as the other (within one, and as the rounds go on).
func roundOrder(runs []goalRun, i int) []goalRun {
	if i%2 == 0 {
		return runs
	}
	r := slices.Clone(runs)
	slices.Reverse(r)
	return r
}

// runGoals runs every configuration once per round, in roundOrder, and each run of
// a floor goal is followed by its memcpy floor.
func runGoals(runs []goalRun, rounds, depth int, update func(done, total int)) ([]goalRound, error) {
	out := make([]goalRound, 0, rounds)
	total := rounds * len(runs)
	for i := 0; i < rounds; i++ {
		r := make(goalRound, len(runs))
		for j, run := range roundOrder(runs, i) {
			runtime.GC() // no run pays for the garbage of the one before
			res, err := perf.Run(run.p)
			if err != nil {
				return nil, fmt.Errorf("%s: %w", run.key, err)
			}
			o := goalOutcome{r: res}
			if run.floor {
				if o.floor, err = perf.MemcpyFloor(run.p.Size, regionSlots(run.p.MRSize, run.p.Size, depth), run.p.Iters); err != nil {
					return nil, err
				}
			}
			r[run.key] = o
			if update != nil {
				update(i*len(runs)+j+1, total)
			}
		}
		out = append(out, r)
	}
	return out, nil
}

// writeGoalRuns writes each round's outcome of every run, in the order they ran.
func writeGoalRuns(path string, runs []goalRun, rounds []goalRound) error {
	recs := [][]string{{"round", "run", "test", "odp", "bytes", "iterations", "bw_mib_s", "msg_rate_mpps", "memcpy_mib_s",
		"rnr_naks", "retransmissions", "link_bdp_bytes"}}
	for i, r := range rounds {
		for _, run := range roundOrder(runs, i) {
			o := r[run.key]
			recs = append(recs, []string{strconv.Itoa(i + 1), run.key, run.p.Test, strconv.FormatBool(run.p.ODP), strconv.Itoa(o.r.Bytes),
				strconv.Itoa(o.r.Iters), ff(o.r.AvgMiBps), ff(o.r.MsgRateMpps), ff(o.floor),
				strconv.FormatUint(o.r.RNRNaks, 10), strconv.FormatUint(o.r.Retransmissions, 10), strconv.Itoa(o.r.LinkBDP)})
		}
	}
	return writeRecords(path, recs)
}

// printGoals prints the table of evaluated goals.
func printGoals(w io.Writer, lines []goalLine) {
	fmt.Fprintf(w, " %-86s %10s  %-21s %-11s %s\n", "#goal", "median", "quartiles", "bound", "met")
	for _, l := range lines {
		bound := ""
		if !l.report {
			op := ">="
			if l.atMost {
				op = "<="
			}
			bound = fmt.Sprintf("%s %s", op, figure(l.target))
		}
		med, q := "-", "-" // no round gave a figure
		if l.rounds > 0 {
			med, q = figure(l.med), figure(l.q1)+".."+figure(l.q3)
		}
		fmt.Fprintf(w, " %-86s %10s  %-21s %-11s %s\n", l.what, med, q, bound, l.met())
	}
}

// figure writes a goal's figure with three decimals below 10, whole above.
func figure(x float64) string {
	if math.Abs(x) >= 10 {
		return fmt.Sprintf("%.0f", x)
	}
	return fmt.Sprintf("%.3f", x)
}

func goalsCmd(args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("goals", stderr)
	rounds := fs.Int("rounds", 5, "rounds: each runs every configuration once")
	scale := fs.Float64("scale", 1, "iterations of every run, as a fraction of the default (a few tenths of a second a run)")
	depth := fs.IntP("tx-depth", "t", 128, "work requests in flight")
	quiet := fs.BoolP("quiet", "q", false, "no progress output")
	csvPath := fs.String("csv", "", "also write every run's figures, round by round, to this CSV file")
	procs := fs.Int("procs", 0, "Ps (GOMAXPROCS) the runs take; default, unless GOMAXPROCS is set: 1 (the engines and the application take turns, fastest on one P)")
	nic := cmdflag.AddNIC(fs)
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected argument %q", fs.Arg(0))
	}
	if *rounds < 1 || *depth < 1 || !(*scale > 0) || *procs < 0 {
		return fmt.Errorf("--rounds, --tx-depth and --scale must be positive, --procs not negative")
	}
	defer setProcs(*procs, "", false, false)()
	profile, err := nic.Profile()
	if err != nil {
		return err
	}
	runs, goals := goalSet(goalConfig{profile: profile, depth: *depth, scale: *scale})
	start := time.Now()
	var update func(int, int)
	if !*quiet {
		bar := progress.New(stderr, "goals: runs")
		defer bar.Finish()
		update = bar.Update
	}
	results, err := runGoals(runs, *rounds, *depth, update)
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "# odp-perf goals: %d round(s) of %d runs in one process at GOMAXPROCS %d (%s); a goal's figure comes from one round's runs, its median and quartiles from the rounds\n",
		*rounds, len(runs), runtime.GOMAXPROCS(0), time.Since(start).Round(time.Second))
	fmt.Fprintf(stdout, "# profile %s: %s; the operations, memcpy and warm ODP goals with the link's rate unlimited\n", profile, profile.Describe())
	printGoals(stdout, evalGoals(goals, results))
	if *csvPath != "" {
		if err := writeGoalRuns(*csvPath, runs, results); err != nil {
			return err
		}
	}
	if profile.Link.Gbps() <= 0 {
		fmt.Fprintln(stdout, "# no line goals: the link's rate is unlimited")
	}
	fmt.Fprintln(stdout, "# the wire between two processes against a plain UDP stream: odp-perf wire")
	return nil
}
