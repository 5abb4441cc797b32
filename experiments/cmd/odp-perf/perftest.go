package main

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/odpemu/odpemu/experiments/cmdflag"
	"github.com/odpemu/odpemu/experiments/perf"
	"github.com/odpemu/odpemu/experiments/stats"
	"github.com/odpemu/odpemu/verbs"
)

// perftest measures perftest's own bandwidth tests, unmodified, on odpemu's
// libibverbs.so.1 against odp-perf's two-process tests on the same data path (the
// same device settings and link, RoCEv2 between 127.0.0.1 and 127.0.0.2), in rounds
// that run the two side by side: what a verbs program pays for the library. By
// default odp-perf's applications run on threads of their own (--app-thread), as
// perftest's C threads do: a goroutine application that takes turns with the engines
// on their thread saves the switches between threads that any C program pays.
func perftest(args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("perftest", stderr)
	tests := fs.StringSlice("tests", []string{"write", "read", "send", "atomic"}, "perftest's tests to run (ib_<test>_bw; atomic: 8-byte fetch-and-adds, pinned, whatever --sizes and --modes say)")
	sizeList := fs.StringSlice("sizes", []string{"64", "4K", "64K", "1M"}, "message sizes (K, M suffixes)")
	modes := fs.StringSlice("modes", []string{"pinned", "odp"}, "registrations: pinned, odp (--odp) or both")
	iters := fs.IntP("iters", "n", 0, "iterations per run (default: 100,000 for messages up to 4 KiB and fetch-and-adds, 5,000 above, as perftest's)")
	reps := fs.Int("reps", 5, "rounds: each runs perftest and odp-perf, perftest first in odd rounds and second in even ones")
	gso := fs.Bool("link-gso", false, "both sides send with UDP segmentation offload (ODPEMU_GSO=1 for perftest, --link-gso for odp-perf)")
	procs := fs.Int("procs", 0, "Ps (GOMAXPROCS) of each odp-perf process (0: one fewer than the CPUs, but one per CPU for send_bw's server, whose thread polls its receives; the library gives perftest's the same, and ib_send_bw's server one fewer while its thread waits in the emulator)")
	appThread := fs.Bool("app-thread", true, "odp-perf's applications each on an OS thread of their own (--app-thread), as perftest's C threads run; false: goroutines, which take turns with the engines on their threads")
	lib := fs.String("lib", "", "a directory holding odpemu's built libibverbs.so.1 (default: build it into a temporary directory; needs the odpemu module's sources)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	var sizes []int
	for _, s := range *sizeList {
		var v cmdflag.Size
		if err := v.Set(s); err != nil || v < 1 {
			return fmt.Errorf("--sizes: %q is not a size", s)
		}
		sizes = append(sizes, int(v))
	}
	for _, m := range *modes {
		if m != "pinned" && m != "odp" {
			return fmt.Errorf("--modes: %q: want pinned or odp", m)
		}
	}
	for _, t := range *tests {
		if t != "write" && t != "read" && t != "send" && t != "atomic" {
			return fmt.Errorf("--tests: %q: want write, read, send or atomic", t)
		}
		if _, err := exec.LookPath("ib_" + t + "_bw"); err != nil {
			return fmt.Errorf("needs perftest (Debian: perftest): %w", err)
		}
	}
	if *reps < 1 || *iters < 0 || *procs < 0 {
		return errors.New("--reps must be positive, --iters and --procs 0 (the default) or positive")
	}
	self, err := os.Executable()
	if err != nil {
		return err
	}
	if *lib == "" {
		dir, err := os.MkdirTemp("", "odp-perf-verbs")
		if err != nil {
			return err
		}
		defer func() { _ = os.RemoveAll(dir) }() // a temporary directory
		mod, err := verbs.ModuleDir()
		if err != nil {
			return err
		}
		if err := verbs.Build(mod, dir); err != nil {
			return err
		}
		*lib = dir
	}
	wire := "RoCEv2"
	if *gso {
		wire = "RoCEv2 with UDP segmentation offload"
	}
	fmt.Fprintf(stdout, "# perftest on odpemu's libibverbs.so.1 against odp-perf, two processes each (127.0.0.1, 127.0.0.2) over %s, %s, tx depth 128, a completion every 100, buffers written before the run, %s, %s; MiB/s, medians of %d rounds (ratio: of the rounds' ratios)\n", wire, itersSaid(*iters), procsSaid(*procs), appSaid(*appThread), *reps)
	fmt.Fprintf(stdout, "%-6s %8s %-7s %12s %12s %8s\n", "test", "bytes", "reg", "perftest", "odp-perf", "ratio")
	for _, t := range *tests {
		tsizes, tmodes := sizes, *modes
		if t == "atomic" { // perftest refuses atomics on ODP memory
			tsizes, tmodes = []int{perf.AtomicSize}, []string{"pinned"}
		}
		for _, size := range tsizes {
			for _, mode := range tmodes {
				var pt, op []float64
				n := *iters
				if n == 0 {
					n = perftestIters(size)
				}
				for r := 0; r < *reps; r++ {
					var a, b float64
					if err := inTurn(r,
						func() (err error) { a, err = perftestRun(*lib, t, size, n, mode == "odp", *gso); return err },
						func() (err error) {
							b, err = odpPerfRun(self, odpPerfArgs(t, size, n, mode == "odp", *gso, *procs, *appThread))
							return err
						},
					); err != nil {
						return err
					}
					pt, op = append(pt, a), append(op, b)
					fmt.Fprintf(stderr, "odp-perf perftest: %s %d %s round %d: perftest %.1f, odp-perf %.1f MiB/s\n", t, size, mode, r+1, a, b)
				}
				fmt.Fprintf(stdout, "%-6s %8d %-7s %12.2f %12.2f %8.2f\n", t, size, mode, stats.Median(pt), stats.Median(op),
					stats.Median(stats.Ratios(pt, op)))
			}
		}
	}
	return nil
}

// inTurn runs round r's two runs, first a and then b in even rounds (from 0), b
// and then a in odd ones, so that each runs first as often as the other (a run may
// start while the last one's processes are still going away); it stops at the
// first error.
func inTurn(r int, a, b func() error) error {
	if r%2 == 1 {
		a, b = b, a
	}
	if err := a(); err != nil {
		return err
	}
	return b()
}

// perftestIters is the comparison's iterations for messages of size bytes by
// default: perftest's 5,000, and 100,000 up to 4 KiB (fetch-and-adds included),
// where 5,000 take 30-60 ms between two processes here and the first
// milliseconds of a run (connections, the first wake-ups) weigh on its figure: at 64 B
// perftest's SEND came out at 0.69-0.76 of odp-perf's over 5,000 and 0.81-0.93 over
// 100,000, its fetch-and-adds at 0.74 and 0.85 (five rounds each).
func perftestIters(size int) int {
	if size <= 4096 {
		return 100_000
	}
	return 5000
}

// itersSaid says how many iterations each run has, for the header.
func itersSaid(iters int) string {
	if iters > 0 {
		return fmt.Sprintf("%d iterations", iters)
	}
	return fmt.Sprintf("%d iterations up to 4 KiB, %d above", perftestIters(4096), perftestIters(4097))
}

// perftestRow is a results row of perftest's bandwidth tests: bytes, iterations, BW
// peak, BW average, message rate.
var perftestRow = regexp.MustCompile(`(?m)^\s*\d+\s+\d+\s+[\d.]+\s+([\d.]+)\s+[\d.]+\s*$`)

// perftestRun runs ib_<test>_bw as a server and a client process on odpemu's library
// from lib and returns the client's average bandwidth.
func perftestRun(lib, test string, size, iters int, odp, gso bool) (float64, error) {
	port, err := freeTCPPort()
	if err != nil {
		return 0, err
	}
	args := []string{"-d", "odpemu0", "-x", "0", "-F", "-p", port, "-s", strconv.Itoa(size), "-n", strconv.Itoa(iters),
		"-Q", "100"}
	if odp {
		args = append(args, "--odp")
	}
	prog := "ib_" + test + "_bw"
	env := append(os.Environ(), "LD_LIBRARY_PATH="+lib)
	if gso {
		env = append(env, "ODPEMU_GSO=1")
	}
	srv := exec.Command(prog, args...)
	srv.Env = append(env, "ODPEMU_ADDR=127.0.0.1")
	srvOut, stop, err := startServer(srv)
	if err != nil {
		return 0, err
	}
	defer stop()
	for try := 0; ; try++ { // until the server listens
		cli := exec.Command(prog, append(args, "127.0.0.1")...)
		cli.Env = append(env, "ODPEMU_ADDR=127.0.0.2")
		out, err := cli.CombinedOutput()
		if err != nil && strings.Contains(string(out), "Couldn't connect to") && try < 50 {
			time.Sleep(100 * time.Millisecond)
			continue
		}
		if err != nil {
			return 0, fmt.Errorf("%s %v: %w\n%s\nserver:\n%s", prog, args, err, out, srvOut.String())
		}
		return parseRow(perftestRow, out, prog)
	}
}

// odpPerfRow is a results row of odp-perf's bandwidth tests: bytes, iterations, BW
// peak, BW average, ...
var odpPerfRow = regexp.MustCompile(`(?m)^\s*\d+\s+\d+\s+[\d.]+\s+([\d.]+)\s`)

// odpPerfArgs are the flags of odp-perf's side of the comparison: its <test>_bw
// with the same messages, iterations and registration as perftest's, and procs Ps
// in each process (0: odp-perf's own rule, which gives them as the library gives
// perftest's).
func odpPerfArgs(test string, size, iters int, odp, gso bool, procs int, appThread bool) []string {
	// --warm: perftest writes its buffers before it registers them, so that no page
	// faults in the timed run.
	//
	// --mr-size: perftest's work requests stride, a message (at least a cache line)
	// apart, over one page or one message, whichever is larger (its cycle buffer),
	// so that its messages stay in cache at every size; odp-perf's by default over a
	// slot per request in flight (128 MiB at 1 MiB), bound by memory instead.
	args := []string{test + "_bw", "-s", strconv.Itoa(size), "-n", strconv.Itoa(iters), "-Q", "100", "--warm",
		"--mr-size", strconv.Itoa(perftestFootprint(size))}
	if odp {
		args = append(args, "--odp")
	}
	if gso {
		args = append(args, "--link-gso")
	}
	if procs > 0 {
		args = append(args, "--procs", strconv.Itoa(procs))
	}
	if appThread {
		args = append(args, "--app-thread")
	}
	return args
}

// appSaid says how odp-perf's applications run, for the header.
func appSaid(appThread bool) string {
	if appThread {
		return "odp-perf's applications on threads of their own as perftest's (--app-thread)"
	}
	return "odp-perf's applications goroutines"
}

// procsSaid says how many Ps odp-perf's processes have, for the header.
func procsSaid(procs int) string {
	if procs > 0 {
		return fmt.Sprintf("odp-perf with %d P(s) in each process", procs)
	}
	return "odp-perf with the Ps the library gives perftest"
}

// odpPerfRun runs this program with args (odpPerfArgs) as a server and a client
// process and returns the client's average bandwidth.
func odpPerfRun(self string, args []string) (float64, error) {
	port, err := freeTCPPort()
	if err != nil {
		return 0, err
	}
	srvOut, stop, err := startServer(exec.Command(self, append(args, "--server", "127.0.0.1:"+port)...))
	if err != nil {
		return 0, err
	}
	defer stop()
	for try := 0; ; try++ {
		out, err := exec.Command(self, append(args, "--connect", "127.0.0.1:"+port)...).CombinedOutput()
		if err != nil && strings.Contains(string(out), "connection refused") && try < 50 {
			time.Sleep(100 * time.Millisecond)
			continue
		}
		if err != nil {
			return 0, fmt.Errorf("odp-perf %v: %w\n%s\nserver:\n%s", args, err, out, srvOut.String())
		}
		return parseRow(odpPerfRow, out, "odp-perf")
	}
}

// perftestFootprint is the bytes perftest's bandwidth tests stride over on each
// side for messages of size bytes: its cycle buffer, a page, or one message when
// that is larger (perftest_resources.c, BUFF_SIZE).
func perftestFootprint(size int) int { return max(size, os.Getpagesize()) }

// startServer starts the server side of a two-process test. Its output collects in
// the buffer returned; stop waits for it to exit, and kills it after 30 s.
func startServer(srv *exec.Cmd) (out *bytes.Buffer, stop func(), err error) {
	out = new(bytes.Buffer)
	srv.Stdout, srv.Stderr = out, out
	if err := srv.Start(); err != nil {
		return nil, nil, err
	}
	done := make(chan error, 1)
	go func() { done <- srv.Wait() }()
	return out, func() {
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			_ = srv.Process.Kill()
			<-done
		}
	}, nil
}

// parseRow returns the average bandwidth of the last results row in out.
func parseRow(row *regexp.Regexp, out []byte, prog string) (float64, error) {
	m := row.FindAllSubmatch(out, -1)
	if m == nil {
		return 0, fmt.Errorf("%s printed no results row:\n%s", prog, out)
	}
	return strconv.ParseFloat(string(m[len(m)-1][1]), 64)
}

// freeTCPPort returns a TCP port on 127.0.0.1 nothing listens on now.
func freeTCPPort() (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer func() { _ = ln.Close() }() // the port is what is wanted
	return strconv.Itoa(ln.Addr().(*net.TCPAddr).Port), nil
}
