// Command odp-perf measures RDMA bandwidth between two emulated NICs in one process,
// with perftest's columns, and compares pinned against on-demand registration.
//
//	odp-perf write_bw|read_bw|send_bw|atomic_bw [--odp] [-s|--size N | -a|--all] [-n|--iters N] [-t|--tx-depth N]
//	                          [-Q|--cq-mod N] [--warm] [--json] ...
//	odp-perf compare [--test write_bw|read_bw] [-n|--iters N] [--reps N] [--csv FILE] [--quiet]
//	odp-perf wire [-s|--size N] [-n|--iters N] [-t|--tx-depth N] [--reps N]
//	odp-perf perftest [--tests write,read,send] [--sizes 64,4K,64K,1M] [--modes pinned,odp] [--reps N]
//
// Flags take perftest's short forms next to the long ones. Progress goes to stderr:
// a bar on a terminal, a line per finished run otherwise, nothing with --quiet.
package main

import (
	"cmp"
	"context"
	"encoding/csv"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"runtime"
	"runtime/pprof"
	"runtime/trace"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/odpemu/odpemu/experiments/cmdflag"
	"github.com/odpemu/odpemu/experiments/perf"
	"github.com/odpemu/odpemu/experiments/progress"
	"github.com/odpemu/odpemu/odp"
	"github.com/odpemu/odpemu/transport/roce"
	"github.com/spf13/pflag"
)

// serverProcs is how many Ps a --server process of test runs with on cpus CPUs,
// unless GOMAXPROCS says: one fewer than the CPUs for a server that only answers
// (write_bw, read_bw, atomic_bw: the emulated NIC serves the client's requests and no
// goroutine of the application posts or polls), all of them for send_bw's, whose
// application posts receives and polls. odpemu's libibverbs.so.1 runs perftest's
// servers alike (verbs/emu: a process whose threads never post or poll keeps one P
// fewer), so that perftest and odp-perf are compared in processes configured the
// same way (odp-perf perftest). ib_send_bw's server, whose thread waits in Go when
// its CQ stays empty for 20 us, has one P fewer in the library's windows in which it
// waited half the time (a third to a half of a run at 64 B and 4 KiB here); against
// odp-perf's send_bw server with one P fewer throughout, perftest's SEND came out at
// 0.83-1.13 in a run of five rounds (0.87 at 64 B, 0.83-0.87 at 4 KiB), against
// 0.90-1.15 with all. Two processes share this project's 2-CPU machines:
// a READ server with both Ps took the CPU its client's engine and socket needed
// (read_bw -s 1M between two processes: 900-990 MiB/s with two Ps against
// 1,330-2,090 with one, three alternating rounds; write_bw -s 64K 870-1,500
// against 1,050-1,420).
func serverProcs(test string, cpus int) int {
	if test == perf.SendBW {
		return cpus
	}
	return oneFewer(cpus)
}

// oneFewer is one P fewer than cpus, and never none.
func oneFewer(cpus int) int { return max(1, cpus-1) }

// inProcessProcs is how many Ps a measurement in one process runs with unless
// --procs or GOMAXPROCS says. The two emulated NICs' engines and the application
// take turns (the odp package's doc): their work is one chain, and on this
// project's 2-CPU machines a second P made it slower up to 64 KiB and no faster at
// 1 MiB: a goroutine that another wakes goes to the waker's P, the idle P's thread
// is woken (a futex) to look for it and sleeps again, and goroutines that do move
// take their cache lines to the other core. odp-perf goals with one P and with two,
// two pairs one after the other (medians of 5 rounds): 64 B WRITEs 3.39 and 3.45
// Mpps against 2.27 and 2.90, SEND / WRITE at 4 KiB 0.83 and 0.88 against 0.77 and
// 0.66, a 1 MiB WRITE over the 100 Gb/s link 0.97 of the line against 0.86; 1 MiB
// WRITE / memcpy 0.84 against 0.63 in one pair, 0.73 against 0.74 in the other.
const inProcessProcs = 1

// runProcs returns how many Ps a run of test runs with, or 0 to leave the runtime's
// as they are: --procs when given (flag > 0); else, when GOMAXPROCS is not set in
// the environment, inProcessProcs in one process, serverProcs for a server and
// clientProcs for a client.
func runProcs(flag int, test string, server, client, envSet bool, cpus int) int {
	switch {
	case flag > 0:
		return flag
	case envSet:
		return 0
	case server:
		return serverProcs(test, cpus)
	case client:
		return clientProcs(cpus)
	}
	return inProcessProcs
}

// clientProcs is how many Ps a --connect process runs with on cpus CPUs, unless
// --procs or GOMAXPROCS says: one fewer than the CPUs, as odpemu's libibverbs.so.1
// gives perftest's bandwidth clients once their threads wait for completions in Go
// (verbs/emu, procs.go), which odp-perf's application does with many requests in
// flight.
func clientProcs(cpus int) int { return oneFewer(cpus) }

// setProcs sets the runtime's Ps for a run as runProcs decides, from --procs (flag),
// the environment and the CPUs, and returns what gives them back. Runs that overlap
// in one process (a server and its client in a test) leave the Ps as the first found
// them once the last ends, whichever order they end in.
func setProcs(flag int, test string, server, client bool) (restore func()) {
	n := runProcs(flag, test, server, client, os.Getenv("GOMAXPROCS") != "", runtime.NumCPU())
	if n <= 0 {
		return func() {}
	}
	procs.Lock()
	defer procs.Unlock()
	if procs.runs == 0 {
		procs.found = runtime.GOMAXPROCS(0)
	}
	procs.runs++
	runtime.GOMAXPROCS(n)
	return func() {
		procs.Lock()
		defer procs.Unlock()
		if procs.runs--; procs.runs == 0 {
			runtime.GOMAXPROCS(procs.found)
		}
	}
}

// procs counts the runs that set the Ps (setProcs) and have not given them back, and
// keeps the Ps the first of them found.
var procs struct {
	sync.Mutex
	runs, found int
}

const usage = `usage:
  odp-perf write_bw|read_bw|send_bw|atomic_bw [flags]
                                      one perftest-style measurement
  odp-perf compare [flags]            pinned vs ODP, cold and warm, side by side
  odp-perf wire [flags]               the RoCEv2 wire between two processes against a plain UDP stream
  odp-perf perftest [flags]           perftest on odpemu's libibverbs.so.1 against odp-perf, side by side
  odp-perf goals [flags]              the data path's speed goals, side by side in rounds

Run "odp-perf <command> --help" for the flags of a command.
`

func main() {
	err := run(os.Args[1:], os.Stdout, os.Stderr)
	switch {
	case errors.Is(err, pflag.ErrHelp):
		os.Exit(0) // --help printed the usage
	case err != nil:
		fmt.Fprintln(os.Stderr, "odp-perf:", err)
		os.Exit(2)
	}
}

func run(args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return errors.New("no command")
	}
	switch args[0] {
	case perf.WriteBW, perf.ReadBW, perf.SendBW, perf.AtomicBW:
		return bw(args[0], args[1:], stdout, stderr)
	case "compare":
		return compare(args[1:], stdout, stderr)
	case "wire":
		return wire(args[1:], stdout, stderr)
	case "perftest":
		return perftest(args[1:], stdout, stderr)
	case "goals":
		return goalsCmd(args[1:], stdout, stderr)
	case "wire-server": // started by wire
		return wireServer(args[1:], stdout, stderr)
	case "-h", "--help", "help":
		fmt.Fprint(stdout, usage)
		return nil
	}
	fmt.Fprint(stderr, usage)
	return fmt.Errorf("unknown command %q", args[0])
}

// size parses a byte count with an optional K, M or G suffix (powers of two).
// size is a byte count flag with K, M and G suffixes.
type size = cmdflag.Size

// newFlagSet returns a flag set that prints its usage, with --long names and perftest's
// short forms, to w.
func newFlagSet(name string, w io.Writer) *pflag.FlagSet {
	fs := pflag.NewFlagSet(name, pflag.ContinueOnError)
	fs.SetOutput(w)
	fs.SortFlags = false
	return fs
}

// wireFlags checks the wire's flags and returns the two-process wire they describe
// and the ACK timeout, if given. Loss and the timeout apply to the in-process wire
// too.
func wireFlags(server, connect, bind string, loss float64, timeout int) (perf.Wire, *uint8, error) {
	var w perf.Wire
	switch {
	case server != "" && connect != "":
		return w, nil, fmt.Errorf("--server and --connect: one side or the other")
	case loss < 0 || loss >= 1:
		return w, nil, fmt.Errorf("--loss is a probability in [0, 1)")
	case bind != "" && server == "" && connect == "":
		return w, nil, fmt.Errorf("--bind is for a two-process test (--server or --connect)")
	case timeout > 31:
		return w, nil, fmt.Errorf("--timeout is 0..31")
	}
	if bind != "" {
		a, err := netip.ParseAddr(bind)
		if err != nil || a.IsUnspecified() {
			return w, nil, fmt.Errorf("--bind %q: a specific IP address", bind)
		}
		w.Bind = a
	}
	if timeout < 0 {
		return w, nil, nil
	}
	t := uint8(timeout)
	return w, &t, nil
}

func bw(test string, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet(test, stderr)
	odpFlag := fs.Bool("odp", false, "register with AccessOnDemand instead of pinning")
	msg := size(65536)
	fs.VarP(&msg, "size", "s", "message size in bytes (K, M, G suffixes)")
	all := fs.BoolP("all", "a", false, "sweep message sizes 2 B to 8 MiB")
	iters := fs.IntP("iters", "n", 5000, "iterations per size")
	reps := fs.Int("reps", 1, "rounds per size, each with its memcpy floor (in one process): the row shows the medians, a comment line the quartiles of each round's ratios")
	depth := fs.IntP("tx-depth", "t", 128, "work requests in flight")
	cqMod := fs.IntP("cq-mod", "Q", 100, "a completion every N work requests")
	warm := fs.Bool("warm", false, "one untimed pass over the region before measuring")
	mrSize := size(0)
	fs.Var(&mrSize, "mr-size", "region the work requests stride across (default size x tx-depth)")
	fa := fs.Int("fault-around", 0, "network page fault alignment in pages (default 16)")
	asJSON := fs.Bool("json", false, "print one JSON object per size")
	invRate := fs.Int("invalidate-rate", 0, "invalidations per second of random message-sized ranges of the server's MR during the run (needs --odp)")
	budget := size(0)
	fs.Var(&budget, "budget", "resident budget in bytes for the server NIC (K, M, G suffixes): ODP pages beyond it are evicted to the backing store; pinned registrations larger than it are refused")
	random := fs.Bool("random", false, "send each work request to a random slot of the server's region")
	implicit := fs.Bool("implicit", false, "register each side's memory with one implicit ODP MR over the address space (needs --odp)")
	prefetch := fs.String("prefetch", "", "advise each side's whole region before traffic: sync or async (needs --odp)")
	rnrRetry := fs.Int("rnr-retry", -1, "the client QP's rnr_retry, 0..7 (7: infinite; default 7)")
	minRNR := fs.Int("min-rnr-timer", -1, "the server QP's min_rnr_timer, IBTA encoding 0..31 (default 12: 0.64 ms)")
	server := fs.String("server", "", "run as the server of a two-process test: accept the client on this TCP address (host:port, e.g. :18515); unless --procs or GOMAXPROCS is set, a server of a test other than send_bw, which only answers, runs with one P fewer than the CPUs, as odpemu's libibverbs.so.1 runs perftest's")
	procs := fs.Int("procs", 0, "Ps (GOMAXPROCS) the run takes; default, unless GOMAXPROCS is set: 1 in one process (the engines and the application take turns, fastest on one P), --server's rule for a server, one fewer than the CPUs for a client, as odpemu's libibverbs.so.1 runs perftest's bandwidth clients")
	connect := fs.String("connect", "", "run as the client of a two-process test: connect to the server at this TCP address")
	bind := fs.String("bind", "", "local IP address of this side's RoCEv2 endpoint (server default 127.0.0.1; client default the address its route to the server leaves from, 127.0.0.2 on loopback)")
	rocePort := fs.Uint16("roce-port", roce.UDPPort, "UDP port of this side's RoCEv2 endpoint (0: the kernel picks one); packets go to the peer's")
	loss := fs.Float64("loss", 0, "probability that this side (both sides, in one process) drops a packet it sends (0..1)")
	seed := fs.Uint64("seed", 1, "seed of the injected loss")
	timeout := fs.Int("timeout", -1, "the QP's local ACK timeout, IBTA encoding 0..31 (4.096 us x 2^t; default 18)")
	appThread := fs.Bool("app-thread", false, "run the application's loops (posting and polling; a send_bw server's reposting of receives) each on an OS thread of its own, as a C verbs program's threads run: every hand-over to the engines is then a switch between threads (default: goroutines, which take turns with the engines on their threads)")
	outs := fs.Int("outs", 0, "READs and atomics the client has outstanding at most (max_rd_atomic; the server's max_dest_rd_atomic), as perftest's --outs (default: the device's most, 16, or 128 with --profile rxe)")
	cpuProfile := fs.String("cpuprofile", "", "write a CPU profile of the runs to this file (go tool pprof)")
	minMemcpy := fs.Float64("min-memcpy-ratio", 0, "fail unless the median BW/memcpy of each size reaches this (a speed guard for CI; in one process)")
	traceFile := fs.String("trace", "", "write an execution trace of the runs to this file (go tool trace): where the engines wait")
	nic := cmdflag.AddNIC(fs)
	if err := fs.Parse(args); err != nil {
		return err
	}
	profile, err := nic.Profile()
	if err != nil {
		return err
	}
	link := profile.Link
	if *cpuProfile != "" {
		stop, err := startProfile(*cpuProfile, pprof.StartCPUProfile, pprof.StopCPUProfile)
		if err != nil {
			return err
		}
		defer stop()
	}
	if *traceFile != "" {
		stop, err := startProfile(*traceFile, trace.Start, trace.Stop)
		if err != nil {
			return err
		}
		defer stop()
	}
	wire, ackTimeout, err := wireFlags(*server, *connect, *bind, *loss, *timeout)
	if err != nil {
		return err
	}
	wire.Port = *rocePort
	wire.Rejected = func(err error) {
		fmt.Fprintf(stderr, "odp-perf: turned a connection away: %v; waiting for the next client\n", err)
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected argument %q", fs.Arg(0))
	}
	if *iters < 1 || *depth < 1 || *cqMod < 1 || msg < 1 || *fa < 0 || *reps < 1 || *procs < 0 {
		return fmt.Errorf("--iters, --tx-depth, --cq-mod, --reps and --size must be positive, --procs not negative")
	}
	if (*reps > 1 || *minMemcpy != 0) && (*server != "" || *connect != "") {
		return fmt.Errorf("--reps and --min-memcpy-ratio are for runs in one process")
	}
	var rnr, timer *uint8
	if *rnrRetry >= 0 {
		if *rnrRetry > 7 {
			return fmt.Errorf("--rnr-retry is 0..7")
		}
		v := uint8(*rnrRetry)
		rnr = &v
	}
	if *minRNR >= 0 {
		if *minRNR > 31 {
			return fmt.Errorf("--min-rnr-timer is 0..31")
		}
		v := uint8(*minRNR)
		timer = &v
	}
	if test == perf.AtomicBW {
		if *all || (fs.Changed("size") && msg != perf.AtomicSize) {
			return fmt.Errorf("%s moves %d bytes (--size, --all)", test, perf.AtomicSize)
		}
		msg = perf.AtomicSize
	}
	sizes := []int{int(msg)}
	if *all {
		sizes = nil
		for s := 2; s <= 8<<20; s *= 2 {
			sizes = append(sizes, s)
		}
	}
	var ln *roce.CMListener
	if *server != "" {
		if ln, err = roce.ListenCM(*server); err != nil {
			return err
		}
		defer func() { _ = ln.Close() }() // served: nothing is left to accept
	}
	// Restored when the run ends: run serves tests in this process too.
	defer setProcs(*procs, test, ln != nil, *connect != "")()
	if !*asJSON {
		mode := "pinned"
		if *odpFlag {
			mode = "ODP"
		}
		where := "two emulated NICs over an in-process wire"
		switch {
		case ln != nil:
			where = fmt.Sprintf("server waiting on %v (RoCEv2/UDP)", ln.Addr())
		case *connect != "":
			where = fmt.Sprintf("client of %s (RoCEv2/UDP)", *connect)
		}
		where += fmt.Sprintf(", GOMAXPROCS %d", runtime.GOMAXPROCS(0))
		if *loss > 0 {
			where += fmt.Sprintf(", dropping %.3g%% of the packets it sends", 100**loss)
		}
		fmt.Fprintf(stdout, "# %s, %s registration, %s\n", test, mode, where)
		if ln != nil {
			fmt.Fprintf(stdout, " %-10s %-12s %-14s %-14s %-10s %s\n", "#bytes", "#served[s]", "#NIC faults", "#pages", "#RNR NAKs", "#retransmitted")
		}
	}
	inProcess := ln == nil && *connect == ""
	if !*asJSON && ln == nil {
		fmt.Fprintf(stdout, "# profile %s: %s\n", profile, profile.Describe())
		fmt.Fprintf(stdout, " %-10s %-12s %-18s %-21s %-15s", "#bytes", "#iterations", "BW peak[MiB/sec]", "BW average[MiB/sec]", "MsgRate[Mpps]")
		if inProcess {
			fmt.Fprintf(stdout, " %-18s %-10s", "memcpy[MiB/sec]", "BW/memcpy")
		}
		if link.Gbps() > 0 {
			fmt.Fprintf(stdout, " %-16s %s", "line[MiB/sec]", "BW/line")
		}
		fmt.Fprintln(stdout)
	}
	enc := json.NewEncoder(stdout)
	for _, s := range sizes {
		p := perf.Params{Test: test, ODP: *odpFlag, Size: s, Iters: *iters, Depth: *depth, CQMod: *cqMod,
			MRSize: int(mrSize), Warm: *warm, FaultAround: *fa, InvalidateRate: *invRate, Budget: int64(budget), Random: *random,
			Implicit: *implicit, Prefetch: *prefetch, RNRRetry: rnr, MinRNRTimer: timer,
			Loss: *loss, Seed: *seed, Timeout: ackTimeout, Profile: profile, Outs: *outs, AppThread: *appThread}
		var r perf.Result
		switch {
		case ln != nil:
			r, err = perf.Serve(context.Background(), ln, p, wire)
		case *connect != "":
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute) // the connection's setup
			r, err = perf.Connect(ctx, *connect, p, wire)
			cancel()
		default:
			var rounds rounds
			if rounds, err = runRounds(p, *reps, regionSlots(int(mrSize), s, *depth)); err == nil {
				r = rounds.median()
				if !*asJSON {
					printRounds(stdout, rounds, link)
				}
				if _, m, _ := rounds.quartiles(round.memcpyRatio); m < *minMemcpy {
					err = fmt.Errorf("%d-byte messages: BW/memcpy %.3f is below --min-memcpy-ratio %.3g", s, m, *minMemcpy)
				}
			}
		}
		if err != nil {
			return err
		}
		if ln != nil && !*asJSON {
			fmt.Fprintf(stdout, " %-10d %-12.3f %-14d %-14d %-10d %d\n", r.Bytes, r.Elapsed.Seconds(), r.PageFaults, r.PagesFaulted,
				r.RNRNaks, r.Retransmissions)
			continue
		}
		if *asJSON {
			if err := enc.Encode(r); err != nil {
				return err
			}
			continue
		}
		if !inProcess {
			fmt.Fprintf(stdout, " %-10d %-12d %-18.2f %-21.2f %-15.6f", r.Bytes, r.Iters, r.PeakMiBps, r.AvgMiBps, r.MsgRateMpps)
			if link.Gbps() > 0 {
				line := lineRate(link.Gbps(), s)
				fmt.Fprintf(stdout, " %-16.2f %.3f", line, r.AvgMiBps/line)
			}
			fmt.Fprintln(stdout)
		}
		if *odpFlag || r.RNRNaks > 0 {
			perNAK, _ := resentPerNAK(r) // 0 without an RNR NAK
			fmt.Fprintf(stdout, "# %d network page faults (%d pages), %d RNR NAKs, %d retransmissions (%.1f packets per RNR NAK, at most %d behind one; link BDP %s, %.1f packets; most in flight %s; %d taken back as never sent), %d pages prefetched\n",
				r.PageFaults, r.PagesFaulted, r.RNRNaks, r.Retransmissions, perNAK, r.MaxGoBack, perf.HumanBytes(r.LinkBDP),
				bdpPackets(r), perf.HumanBytes(r.LinkMaxInFlight), r.TakenBack, r.PagesPrefetched)
		}
		if budget > 0 {
			fmt.Fprintf(stdout, "# budget %s: max resident %s of %s registered, %d evictions, %d restores\n",
				perf.HumanBytes(int(budget)), perf.HumanBytes(int(r.MaxResident)), perf.HumanBytes(r.Bytes*regionSlots(int(mrSize), r.Bytes, *depth)),
				r.Evictions, r.Restores)
		}
	}
	return nil
}

func compare(args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("compare", stderr)
	test := fs.String("test", perf.WriteBW, "write_bw or read_bw")
	iters := fs.IntP("iters", "n", 5000, "iterations per run (perftest's default)")
	reps := fs.Int("reps", 5, "cold pinned/ODP pairs per size (fresh memory each)")
	warmPairs := fs.Int("warm-pairs", 100, "warm burst pairs per size (one buffer registered both ways)")
	warmIters := fs.Int("warm-iters", 1000, "iterations per warm burst")
	minSize := size(4 << 10)
	maxSize := size(1 << 20)
	fs.Var(&minSize, "min-size", "smallest message size")
	fs.Var(&maxSize, "max-size", "largest message size")
	regSizes := fs.String("reg-sizes", "64M,256M,1G", "region sizes for the registration comparison")
	sweepSizes := fs.String("sweep-sizes", "4K,1M,16M,256M,1G,4G", "region sizes for the ODP registration sweep of untouched memory")
	mrSize := size(0)
	fs.Var(&mrSize, "mr-size", "region the work requests stride across (default size x 128)")
	csvPath := fs.String("csv", "", "also write the bandwidth table to this CSV file")
	quiet := fs.BoolP("quiet", "q", false, "no progress output")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected argument %q", fs.Arg(0))
	}
	if *iters < 1 || *reps < 1 || *warmPairs < 1 || *warmIters < 1 {
		return fmt.Errorf("--iters, --reps, --warm-pairs and --warm-iters must be positive")
	}
	if minSize < 1 || maxSize < minSize {
		return fmt.Errorf("bad size range %d..%d", minSize, maxSize)
	}
	var sizes []int
	for s := int(minSize); s <= int(maxSize); s *= 2 {
		sizes = append(sizes, s)
	}
	regs, err := sizeList("reg-sizes", *regSizes)
	if err != nil {
		return err
	}
	sweep, err := sizeList("sweep-sizes", *sweepSizes)
	if err != nil {
		return err
	}
	cp := perf.CompareParams{Test: *test, Sizes: sizes, Iters: *iters, Reps: *reps, RegSizes: regs, MRSize: int(mrSize),
		WarmPairs: *warmPairs, WarmIters: *warmIters}
	if !*quiet {
		bar := progress.New(stderr, "pinned vs ODP: runs")
		defer bar.Finish()
		cp.Progress = bar.Update
	}
	rows, regRows, err := perf.Compare(&cp)
	if err != nil {
		return err
	}
	perf.WriteRows(stdout, cp, rows)
	perf.WriteRegRows(stdout, regRows)
	if len(sweep) > 0 {
		srows, err := perf.ODPRegSweep(sweep, *reps*3)
		if err != nil {
			return err
		}
		perf.WriteSweep(stdout, srows)
	}
	if *csvPath != "" {
		return writeCSV(*csvPath, *test, rows)
	}
	return nil
}

// regionSlots is how many size-byte slots the work requests stride across: those
// of the region --mr-size gives (both sides register that much), else one per
// work request in flight.
func regionSlots(mrSize, size, depth int) int {
	if mrSize > 0 {
		return max(mrSize/size, 1)
	}
	return depth
}

// round is one run of a size and the memcpy floor measured right after it.
type round struct {
	r     perf.Result
	floor float64 // MiB/s
}

type rounds []round

// memcpyRatio is the round's bandwidth over its memcpy floor.
func (x round) memcpyRatio() float64 { return x.r.AvgMiBps / x.floor }

// runRounds runs p n times, each run followed by its memcpy floor of the same bytes
// and strides (depth slots).
func runRounds(p perf.Params, n, depth int) (rounds, error) {
	var out rounds
	for i := 0; i < n; i++ {
		r, err := perf.Run(p)
		if err != nil {
			return nil, err
		}
		floor, err := perf.MemcpyFloor(p.Size, depth, p.Iters)
		if err != nil {
			return nil, err
		}
		out = append(out, round{r: r, floor: floor})
	}
	return out, nil
}

// median returns the round of median bandwidth.
func (rs rounds) median() perf.Result {
	s := slices.Clone(rs)
	slices.SortFunc(s, func(a, b round) int { return cmp.Compare(a.r.AvgMiBps, b.r.AvgMiBps) })
	return s[len(s)/2].r
}

// quartiles returns the first quartile, the median and the third quartile of f
// over the rounds.
func (rs rounds) quartiles(f func(round) float64) (q1, med, q3 float64) {
	v := make([]float64, len(rs))
	for i, r := range rs {
		v[i] = f(r)
	}
	return quartiles(v)
}

// lineRate is what the line carries of WRITEs of size bytes, in MiB/s (a READ's
// responses carry about as much).
func lineRate(gbps float64, size int) float64 {
	return roce.WriteGoodput(gbps*1e9, size, 4096) / (1 << 20)
}

// resentPerNAK is how many packets the client sent again per RNR NAK it took, and
// whether it took any (0, false if not).
func resentPerNAK(r perf.Result) (float64, bool) {
	if r.RNRNaks == 0 {
		return 0, false
	}
	return float64(r.Retransmissions) / float64(r.RNRNaks), true
}

// bdpPackets is the client's link's bandwidth-delay product in packets of the
// default MTU on the wire.
func bdpPackets(r perf.Result) float64 { return float64(r.LinkBDP) / float64(roce.WirePacket(4096)) }

// printRounds prints the row of a size: the medians of the rounds' figures and
// ratios, and with several rounds their quartiles on a comment line.
func printRounds(w io.Writer, rs rounds, link odp.LinkModel) {
	r := rs.median()
	b1, bw, b3 := rs.quartiles(func(x round) float64 { return x.r.AvgMiBps })
	_, peak, _ := rs.quartiles(func(x round) float64 { return x.r.PeakMiBps })
	p1, mpps, p3 := rs.quartiles(func(x round) float64 { return x.r.MsgRateMpps })
	_, floor, _ := rs.quartiles(func(x round) float64 { return x.floor })
	m1, m, m3 := rs.quartiles(round.memcpyRatio)
	fmt.Fprintf(w, " %-10d %-12d %-18.2f %-21.2f %-15.6f %-18.2f %-10.3f", r.Bytes, r.Iters, peak, bw, mpps, floor, m)
	line := 0.0
	if link.Gbps() > 0 {
		line = lineRate(link.Gbps(), r.Bytes)
		fmt.Fprintf(w, " %-16.2f %.3f", line, bw/line)
	}
	fmt.Fprintln(w)
	if len(rs) > 1 {
		fmt.Fprintf(w, "# %d rounds, quartiles: BW %.2f..%.2f MiB/s, %.3f..%.3f Mpps, BW/memcpy %.3f..%.3f (median %.3f)",
			len(rs), b1, b3, p1, p3, m1, m3, m)
		if line > 0 {
			l1, l, l3 := rs.quartiles(func(x round) float64 { return x.r.AvgMiBps / line })
			fmt.Fprintf(w, ", BW/line %.3f..%.3f (median %.3f)", l1, l3, l)
		}
		fmt.Fprintln(w)
	}
}

// startProfile starts a CPU profile or an execution trace into path; stop ends it
// and closes the file.
func startProfile(path string, start func(io.Writer) error, end func()) (stop func(), err error) {
	f, err := os.Create(path)
	if err != nil {
		return nil, err
	}
	if err := start(f); err != nil {
		_ = f.Close() // the profile's error is the one to report
		return nil, err
	}
	return func() {
		end()
		_ = f.Close() // a profile cut short is the only loss
	}, nil
}

// sizeList parses a comma-separated list of sizes; empty is none.
func sizeList(flag, list string) ([]int, error) {
	var out []int
	if list == "" {
		return nil, nil
	}
	for _, f := range strings.Split(list, ",") {
		var s size
		if err := s.Set(strings.TrimSpace(f)); err != nil || s == 0 {
			return nil, fmt.Errorf("bad --%s entry %q", flag, f)
		}
		out = append(out, int(s))
	}
	return out, nil
}

func writeCSV(path, test string, rows []perf.Row) error {
	recs := [][]string{{"test", "bytes", "pinned_cold_mib_s", "odp_cold_mib_s", "ratio_cold", "pinned_warm_mib_s", "odp_warm_mib_s",
		"ratio_warm", "ratio_warm_q1", "ratio_warm_q3", "cold_faults"}}
	for _, r := range rows {
		recs = append(recs, []string{test, strconv.Itoa(r.Bytes), ff(r.PinnedCold), ff(r.ODPCold), ff(r.RatioCold), ff(r.PinnedWarm),
			ff(r.ODPWarm), ff(r.RatioWarm), ff(r.WarmQ1), ff(r.WarmQ3), strconv.FormatUint(r.ColdFaults, 10)})
	}
	return writeRecords(path, recs)
}

// ff writes a CSV figure with four decimals.
func ff(x float64) string { return strconv.FormatFloat(x, 'f', 4, 64) }

// writeRecords writes recs to a new CSV file at path.
func writeRecords(path string, recs [][]string) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := csv.NewWriter(f).WriteAll(recs); err != nil {
		_ = f.Close() // the write error is the one to report
		return err
	}
	return f.Close()
}
