package suite

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/odpemu/odpemu/experiments/perf"
	"github.com/odpemu/odpemu/experiments/plots"
	"github.com/odpemu/odpemu/experiments/results"
	"github.com/odpemu/odpemu/experiments/stats"
)

var wireExperiment = Experiment{
	Name:  "wire",
	Title: "RoCEv2 over UDP between two processes: pinned and ODP WRITE bandwidth against a plain UDP stream",
	Run:   runWire,
	Replot: func(x *X) error {
		return replot(x, "", func(t *results.Table) error { return wireReport(x, t, len(results.Distinct(t.Rows(nil), "rep"))) })
	},
}

// ErrNoServer is returned by the wire experiment when the run has no command to
// start its server process with (Config.WireServer).
var ErrNoServer = errors.New("suite: no wire server command")

// wireServerArgs are the arguments the suite adds to Config.WireServer's, which the
// server process passes to ServeWire.
func wireServerArgs(size, iters, depth, rounds int, port uint16) []string {
	return []string{strconv.Itoa(size), strconv.Itoa(iters), strconv.Itoa(depth), strconv.Itoa(rounds), strconv.Itoa(int(port))}
}

// ServeWire is the server process of the wire experiment: args are what the suite
// passed (see Config.WireServer). It prints its addresses on stdout, then serves.
func ServeWire(args []string, print func(cm, udp string)) error {
	if len(args) != 5 {
		return fmt.Errorf("suite: wire server: want 5 arguments, got %q", args)
	}
	var n [4]int
	for i, a := range args[:4] {
		v, err := strconv.Atoi(a)
		if err != nil || v < 1 {
			return fmt.Errorf("suite: wire server: bad argument %q", a)
		}
		n[i] = v
	}
	port, err := strconv.ParseUint(args[4], 10, 16)
	if err != nil {
		return fmt.Errorf("suite: wire server: bad port %q", args[4])
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	return perf.ServeWireRounds(ctx, wireParams(n[0], n[1], n[2]), perf.Wire{Port: uint16(port)}, n[3], wireKinds, print)
}

// wireKinds are the wire experiment's rounds: the UDP floor, pinned and ODP warm,
// then a pass over fresh memory pinned and ODP.
var wireKinds = append(append([]string(nil), perf.WireRound...), "pinned-cold", "odp-cold")

func wireParams(size, iters, depth int) perf.Params {
	return perf.Params{Test: perf.WriteBW, Size: size, Iters: iters, Depth: depth, CQMod: 1, MRSize: size * depth}
}

func runWire(x *X) error {
	if len(x.wireServer) == 0 {
		return ErrNoServer
	}
	// 32 messages in flight, not the 128 of the experiments in one process: the
	// plain UDP stream has no flow control, and 128 messages of 64 KiB overflow
	// the sockets' 8 MiB buffers (roce.SocketBuffer) and stall it on a loss.
	const size, depth = wireMsg, 32
	iters := pick(x.Scale, 50, 500, 500)
	rounds := pick(x.Scale, 1, 5, 10)
	x.Param("message_bytes", size)
	x.Param("iterations", iters)
	x.Param("depth", depth)
	x.Param("rounds", rounds)
	x.Param("run", "two processes on loopback: each round a plain UDP stream of the same packets (one sendto/recvfrom each, "+
		"from and into regions as large as the WRITEs', a message acknowledged as RC does), "+
		"then RoCEv2 WRITEs to a pinned region, then to an ODP region after a warm-up pass "+
		"(regions of depth messages), then one pass over fresh regions of iterations messages, pinned and ODP")
	x.Steps(1)
	t := x.Table("", "kind", "rep", "bw_mib_s")
	x.Param("roce_port", int(x.rocePort))
	args := append(append([]string(nil), x.wireServer[1:]...), wireServerArgs(size, iters, depth, rounds, x.rocePort)...)
	cm, udp, wait, err := perf.StartWireServer(x.wireServer[0], args)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	bw, err := perf.WireClient(ctx, cm, udp, wireParams(size, iters, depth), perf.Wire{Port: x.rocePort}, rounds, wireKinds)
	if werr := wait(); err == nil && werr != nil {
		err = fmt.Errorf("wire server: %w", werr)
	}
	if err != nil {
		return err
	}
	for _, kind := range wireKinds {
		for rep, v := range bw[kind] {
			if err := t.Add(kind, rep, v); err != nil {
				return err
			}
		}
	}
	x.Step()
	return wireReport(x, t, rounds)
}

func wireReport(x *X, t *results.Table, rounds int) error {
	var meds []float64
	var cis []stats.Interval
	for _, kind := range wireKinds {
		bw := results.Floats(t.Rows(sel("kind", kind)), "bw_mib_s")
		meds, cis = append(meds, stats.Median(bw)), append(cis, barInterval(bw, 1))
	}
	if err := x.Figure("wire", plots.Bars{Title: "WRITE bandwidth between two processes (medians)",
		Y: plots.Axis{Label: "bandwidth (MiB/s)"}, Categories: []string{"UDP", "pinned", "ODP warm", "pinned cold", "ODP cold"},
		Stacks:    []plots.Stack{{Name: fmt.Sprintf("%s messages, %d rounds", human(wireMsg), rounds), Values: meds}},
		Intervals: cis}); err != nil {
		return err
	}
	for _, kind := range []string{"pinned", "odp"} {
		r := perRep(t, "bw_mib_s", sel("kind", kind), sel("kind", "udp"))
		s := stats.Summarize(r)
		x.HeadlineCI(fmt.Sprintf("two processes over UDP: %s RoCEv2 / plain UDP stream bandwidth", kind), fixed2(s.Median), ci(r, fixed2),
			fmt.Sprintf("median of %d per-round ratios, quartiles %.2f-%.2f", s.N, s.Q1, s.Q3))
	}
	cold := perRep(t, "bw_mib_s", sel("kind", "odp-cold"), sel("kind", "pinned-cold"))
	r := stats.Summarize(cold)
	x.HeadlineCI("two processes over UDP: ODP / pinned bandwidth of a pass over fresh memory", fixed2(r.Median), ci(cold, fixed2),
		fmt.Sprintf("median of %d per-round ratios, quartiles %.2f-%.2f", r.N, r.Q1, r.Q3))
	return nil
}

// wireMsg is the wire experiment's message size.
const wireMsg = 64 << 10
