package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"strconv"
	"time"

	"github.com/odpemu/odpemu/experiments/perf"
	"github.com/odpemu/odpemu/experiments/stats"
	"github.com/odpemu/odpemu/transport/roce"
	"github.com/spf13/pflag"
)

// wireOpts are the flags wire and wire-server share.
type wireOpts struct {
	msg                size
	iters, depth, reps int
	hot                bool
	port               uint16
}

func wireFlagSet(name string, w io.Writer) (*pflag.FlagSet, *wireOpts) {
	fs := newFlagSet(name, w)
	f := &wireOpts{msg: size(1 << 20)}
	fs.VarP(&f.msg, "size", "s", "message size in bytes (K, M, G suffixes)")
	fs.IntVarP(&f.iters, "iters", "n", 500, "messages per measurement")
	fs.IntVarP(&f.depth, "tx-depth", "t", 4, "messages in flight")
	fs.IntVar(&f.reps, "reps", 5, "rounds of UDP floor, pinned and ODP, side by side")
	fs.Uint16Var(&f.port, "roce-port", roce.UDPPort, "UDP port of both sides' RoCEv2 endpoints (0: the kernel picks); the server is at 127.0.0.1, the client at 127.0.0.2")
	fs.BoolVar(&f.hot, "hot-floor", false, "the UDP stream sends every packet from one buffer and receives into one, instead of moving the WRITEs' bytes")
	return fs, f
}

// params are the WRITE test's parameters.
func (f *wireOpts) params() perf.Params {
	return perf.Params{Test: perf.WriteBW, Size: int(f.msg), Iters: f.iters, Depth: f.depth, CQMod: 1, MRSize: int(f.msg) * f.depth,
		HotFloor: f.hot}
}

// wire measures RDMA WRITE over the RoCEv2 wire between this process and a server
// process it starts, pinned and ODP (warm), against a plain UDP stream of packets
// of the same size between the same two processes, in rounds.
func wire(args []string, stdout, stderr io.Writer) error {
	fs, f := wireFlagSet("wire", stderr)
	if err := fs.Parse(args); err != nil {
		return err
	}
	if f.reps < 1 || f.iters < 1 || f.depth < 1 || f.msg < 1 {
		return fmt.Errorf("--reps, --iters, --tx-depth and --size must be positive")
	}
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	common := []string{"--size", strconv.Itoa(int(f.msg)), "--iters", strconv.Itoa(f.iters), "--tx-depth", strconv.Itoa(f.depth),
		"--reps", strconv.Itoa(f.reps), "--hot-floor=" + strconv.FormatBool(f.hot),
		"--roce-port", strconv.Itoa(int(f.port))}
	cm, udp, wait, err := perf.StartWireServer(exe, append([]string{"wire-server"}, common...))
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	fmt.Fprintf(stdout, "# RDMA WRITE of %s messages, %d in flight, %d per measurement, between two processes on loopback (server pid in a child)\n",
		perf.HumanBytes(int(f.msg)), f.depth, f.iters)
	floor := "from each message's slot of a region as large as the WRITEs', into the slots of one on the other side"
	if f.hot {
		floor = "all from one buffer, into one (--hot-floor)"
	}
	fmt.Fprintf(stdout, "# each round: a plain UDP stream of %d-byte packets (one sendto/recvfrom each, %s; a message acknowledged as RC does), then RoCEv2 pinned, then ODP warm\n",
		roce.BTHSize+4096+roce.ICRCSize, floor)
	bw, err := perf.WireClient(ctx, cm, udp, f.params(), perf.Wire{Port: f.port}, f.reps, perf.WireRound)
	if werr := wait(); err == nil && werr != nil {
		err = fmt.Errorf("wire server: %w", werr)
	}
	if err != nil {
		return err
	}
	rp, ro := stats.Ratios(bw["pinned"], bw["udp"]), stats.Ratios(bw["odp"], bw["udp"])
	fmt.Fprintf(stdout, " %-8s %-14s %-14s %-14s %-11s %-11s\n", "#round", "UDP[MiB/s]", "pinned[MiB/s]", "ODP[MiB/s]", "pinned/UDP", "ODP/UDP")
	for i := range bw["udp"] {
		fmt.Fprintf(stdout, " %-8d %-14.1f %-14.1f %-14.1f %-11.3f %-11.3f\n", i, bw["udp"][i], bw["pinned"][i], bw["odp"][i], rp[i], ro[i])
	}
	fmt.Fprintf(stdout, "# medians: UDP %.1f, pinned %.1f, ODP %.1f MiB/s\n", stats.Median(bw["udp"]), stats.Median(bw["pinned"]), stats.Median(bw["odp"]))
	sp, so := stats.Summarize(rp), stats.Summarize(ro)
	fmt.Fprintf(stdout, "# per-round ratios (each round's three runs side by side), median and quartiles: pinned/UDP %.3f (%.3f-%.3f), ODP/UDP %.3f (%.3f-%.3f)\n",
		sp.Median, sp.Q1, sp.Q3, so.Median, so.Q1, so.Q3)
	return nil
}

// wireServer is the server process of wire: it prints its addresses, then serves
// the rounds.
func wireServer(args []string, stdout, stderr io.Writer) error {
	fs, f := wireFlagSet("wire-server", stderr)
	if err := fs.Parse(args); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	return perf.ServeWireRounds(ctx, f.params(), perf.Wire{Port: f.port}, f.reps, perf.WireRound, func(cm, udp string) { fmt.Fprintf(stdout, "cm %s udp %s\n", cm, udp) })
}
