package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/odpemu/odpemu/experiments/perf"
	"github.com/spf13/pflag"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func runArgs(args ...string) (string, string, error) {
	var out, errb bytes.Buffer
	err := run(args, &out, &errb)
	return out.String(), errb.String(), err
}

func TestBWPrintsPerftestColumns(t *testing.T) {
	out, _, err := runArgs("write_bw", "--odp", "--size", "8K", "--iters", "200", "--tx-depth", "16", "--cq-mod", "8")
	require.NoError(t, err)
	assert.Contains(t, out, "#bytes     #iterations  BW peak[MiB/sec]   BW average[MiB/sec]   MsgRate[Mpps]")
	lines := strings.Split(strings.TrimSpace(out), "\n")
	require.Len(t, lines, 5, "header, link, columns, the row and the ODP line")
	assert.True(t, strings.HasPrefix(lines[1], "# profile emulator: "), lines[1])
	assert.Contains(t, lines[1], "link 100 Gb/s, 2µs one way")
	assert.True(t, strings.HasPrefix(strings.TrimSpace(lines[3]), "8192"))
	row := strings.Fields(lines[3])
	require.Len(t, row, 9, "perftest's five columns, memcpy and its ratio, the line rate and its ratio")
	assert.True(t, strings.HasPrefix(lines[4], "# "), lines[4])
	assert.Contains(t, lines[4], "packets per RNR NAK, at most")

	// Several rounds: medians in the row, quartiles below it.
	out, _, err = runArgs("write_bw", "--size", "4K", "--iters", "200", "--reps", "3", "--link-rate", "0", "--link-delay", "0")
	require.NoError(t, err)
	lines = strings.Split(strings.TrimSpace(out), "\n")
	require.Len(t, lines, 5, "header, link, columns, the row and the quartiles")
	assert.Contains(t, lines[1], "no link model")
	assert.Len(t, strings.Fields(lines[3]), 7, "no line rate without a rate")
	assert.True(t, strings.HasPrefix(lines[4], "# 3 rounds, quartiles: BW "), lines[4])

	out, _, err = runArgs("write_bw", "--odp", "--size", "4K", "--iters", "2000", "--mr-size", "8M", "--budget", "2M", "--random")
	require.NoError(t, err)
	assert.Contains(t, out, "# budget 2 MiB: max resident")

	out, _, err = runArgs("read_bw", "--json", "--size", "4096", "--iters", "100", "--warm")
	require.NoError(t, err)
	var r map[string]any
	require.NoError(t, json.Unmarshal([]byte(out), &r))
	assert.Equal(t, "read_bw", r["test"])
	assert.EqualValues(t, 4096, r["bytes"])
}

// The verbs flags perftest lacks: an implicit MR with a synchronous prefetch takes no
// network page fault; rnr_retry 0 fails a cold ODP run on its first RNR NAK.
func TestBWVerbsFlags(t *testing.T) {
	out, _, err := runArgs("write_bw", "--odp", "--implicit", "--prefetch", "sync", "--size", "8K", "--iters", "200")
	require.NoError(t, err)
	assert.Contains(t, out, "# 0 network page faults (0 pages), 0 RNR NAKs, 0 retransmissions")
	out, _, err = runArgs("write_bw", "--odp", "--min-rnr-timer", "1", "--size", "8K", "--iters", "200")
	require.NoError(t, err)
	assert.NotContains(t, out, " 0 RNR NAKs", "a cold ODP server answers RNR NAKs")
	_, _, err = runArgs("write_bw", "--odp", "--rnr-retry", "0", "--size", "8K", "--iters", "200")
	assert.ErrorContains(t, err, "RNR retry counter exceeded")
	for _, bad := range [][]string{{"--implicit"}, {"--prefetch", "sync"}, {"--odp", "--prefetch", "later"},
		{"--rnr-retry", "8"}, {"--min-rnr-timer", "32"}} {
		_, _, err = runArgs(append([]string{"write_bw", "--iters", "10"}, bad...)...)
		assert.Error(t, err, "%v", bad)
	}
}

// --outs sets the client's READs outstanding, up to the device's most: 16 by
// default (mlx5's), 128 with the rxe profile (rxe's).
func TestBWOuts(t *testing.T) {
	_, _, err := runArgs("read_bw", "--outs", "32", "--size", "64", "--iters", "200")
	assert.ErrorContains(t, err, "READs and atomics outstanding are 0..16")
	_, _, err = runArgs("read_bw", "--outs", "32", "--profile", "rxe", "--size", "64", "--iters", "200")
	assert.NoError(t, err)
	_, _, err = runArgs("read_bw", "--outs", "4", "--size", "64", "--iters", "200")
	assert.NoError(t, err)
	_, _, err = runArgs("read_bw", "--outs", "129", "--profile", "rxe", "--size", "64", "--iters", "10")
	assert.ErrorContains(t, err, "--outs is 1..128")
}

func TestCompareWritesCSV(t *testing.T) {
	csvPath := filepath.Join(t.TempDir(), "c.csv")
	out, _, err := runArgs("compare", "--quiet", "--iters", "100", "--reps", "1", "--warm-pairs", "2", "--warm-iters", "50",
		"--min-size", "4K", "--max-size", "8K", "--reg-sizes", "1M", "--csv", csvPath)
	require.NoError(t, err)
	assert.Contains(t, out, "registration 1 MiB: pinned ")
	assert.Contains(t, out, "speedup")
	b, err := os.ReadFile(csvPath)
	require.NoError(t, err)
	assert.Len(t, strings.Split(strings.TrimSpace(string(b)), "\n"), 3, "header and two sizes")
}

func TestBadArguments(t *testing.T) {
	for _, args := range [][]string{
		{}, {"cas_bw"}, {"atomic_bw", "--size", "64"}, {"atomic_bw", "--all"}, {"write_bw", "--size", "12Q"}, {"write_bw", "extra"}, {"compare", "--min-size", "8K", "--max-size", "4K"},
		{"compare", "--reg-sizes", "abc"}, {"write_bw", "--iters", "0"}, {"write_bw", "--budget", "1M", "--mr-size", "8M"},
		{"write_bw", "--server", ":0", "--connect", "127.0.0.1:1"}, {"write_bw", "--bind", "127.0.0.1"},
		{"write_bw", "--reps", "0"}, {"write_bw", "--reps", "2", "--server", ":0"}, {"write_bw", "--link-rate", "-1"},
		{"write_bw", "--server", "127.0.0.1:0", "--loss", "1.5"}, {"write_bw", "--connect", "x", "--bind", "0.0.0.0"},
		{"write_bw", "--server", "127.0.0.1:0", "--timeout", "40"}, {"wire", "--reps", "0"},
		{"write_bw", "--min-memcpy-ratio", "0.4", "--server", ":0"}, {"write_bw", "--roce-port", "70000"},
		{"perftest", "--sizes", "4Q"}, {"perftest", "--modes", "implicit"}, {"perftest", "--tests", "cas"},
		{"perftest", "--reps", "0"}, {"perftest", "--iters", "-1"},
	} {
		_, _, err := runArgs(args...)
		assert.Error(t, err, "%v", args)
	}
	out, _, err := runArgs("--help")
	require.NoError(t, err)
	assert.Contains(t, out, "usage:")
	_, stderr, _ := runArgs("compare", "--help")
	assert.Contains(t, stderr, "-warm-pairs")
}

// perftest users type its short flags; --help is not an error and shows the long names.
func TestPerftestFlagsAndHelp(t *testing.T) {
	out, _, err := runArgs("write_bw", "-s", "65536", "-n", "200", "-t", "16", "-Q", "8", "--odp")
	require.NoError(t, err)
	assert.Contains(t, out, " 65536 ")
	assert.Contains(t, out, "ODP registration")
	out, _, err = runArgs("atomic_bw", "-n", "200", "-t", "16", "-Q", "8")
	require.NoError(t, err)
	assert.Regexp(t, `(?m)^ 8 +200 `, out, "8-byte fetch-and-adds")

	_, stderr, err := runArgs("write_bw", "--help")
	assert.ErrorIs(t, err, pflag.ErrHelp, "main exits 0 on ErrHelp")
	for _, f := range []string{"--size", "-s, --size", "-n, --iters", "-t, --tx-depth", "-Q, --cq-mod", "-a, --all", "--odp"} {
		assert.Contains(t, stderr, f)
	}
}

// Output that goes to a file has no progress bar redraws: a line per finished run,
// or nothing with --quiet. The budget line reports the region for the configured depth.
func TestProgressWithoutTerminal(t *testing.T) {
	args := []string{"compare", "--iters", "100", "--reps", "2", "--warm-pairs", "2", "--warm-iters", "50",
		"--min-size", "4K", "--max-size", "8K", "--reg-sizes", "1M"}
	out, stderr, err := runArgs(args...)
	require.NoError(t, err)
	lines := strings.Split(strings.TrimSpace(stderr), "\n")
	// 2 sizes x (2 pairs x 2 + 1 warm) + 1 region size x 2 pairs x 2 = 14 runs.
	require.Len(t, lines, 14)
	assert.Equal(t, "pinned vs ODP: runs: 14/14 done", strings.SplitN(lines[13], " (", 2)[0])
	// With an even number of reps the pinned stages still come from a real run.
	assert.NotContains(t, out, "account 0s, pin 0s, mtt 0s")
	_, stderr, err = runArgs(append(args, "--quiet")...)
	require.NoError(t, err)
	assert.Empty(t, stderr)

	out, _, err = runArgs("write_bw", "--odp", "-s", "4K", "-n", "500", "-t", "32", "--mr-size", "64K", "--budget", "1M")
	require.NoError(t, err)
	assert.Contains(t, out, "of 64 KiB registered", "the region --mr-size gives, not 4 KiB x depth 32")
	out, _, err = runArgs("write_bw", "--odp", "-s", "4K", "-n", "500", "-t", "32", "--budget", "1M")
	require.NoError(t, err)
	assert.Contains(t, out, "of 128 KiB registered", "4 KiB x depth 32, not x 128")
}

// The memcpy floor strides across the slots the NIC's work requests do: the
// region's, else one per work request in flight.
func TestRegionSlots(t *testing.T) {
	assert.Equal(t, 128, regionSlots(0, 4096, 128))
	assert.Equal(t, 4, regionSlots(4<<20, 1<<20, 128), "a region smaller than size x depth")
	assert.Equal(t, 2048, regionSlots(8<<20, 4096, 16), "a region larger than size x depth")
	assert.Equal(t, 1, regionSlots(1000, 4096, 16), "never no slot")
}

// odp-perf's side of the perftest comparison strides over the bytes perftest does:
// a page for messages up to a page, one message above.
func TestPerftestFootprint(t *testing.T) {
	page := os.Getpagesize()
	assert.Equal(t, page, perftestFootprint(64))
	assert.Equal(t, page, perftestFootprint(page))
	assert.Equal(t, 1<<20, perftestFootprint(1<<20))
	assert.Equal(t, 1, regionSlots(perftestFootprint(1<<20), 1<<20, 128), "every 1 MiB message in one slot, as perftest's")
}

// odp-perf's side of the perftest comparison: perftest's messages, iterations and
// registration, --procs only when asked for, and flags odp-perf's own tests take.
func TestOdpPerfArgs(t *testing.T) {
	args := odpPerfArgs("write", 4096, 200, true, false, 0, false)
	assert.Equal(t, []string{"write_bw", "-s", "4096", "-n", "200", "-Q", "100", "--warm", "--mr-size",
		strconv.Itoa(perftestFootprint(4096)), "--odp"}, args)
	assert.NotContains(t, args, "--procs", "odp-perf's own rule gives the Ps")
	args = odpPerfArgs("send", 64, 200, false, true, 1, true)
	assert.NotContains(t, args, "--odp")
	assert.Equal(t, []string{"--link-gso", "--procs", "1", "--app-thread"}, args[len(args)-4:])
	out, _, err := runArgs(args...) // in one process: the flags parse and the test runs
	require.NoError(t, err)
	assert.Regexp(t, `(?m)^ 64 +200 `, out)
	assert.Contains(t, procsSaid(1), "1 P(s)")
	assert.Contains(t, procsSaid(0), "the library gives")
	assert.Contains(t, appSaid(true), "threads of their own")
	assert.Contains(t, appSaid(false), "goroutines")
}

// The speed guard CI runs: a run below --min-memcpy-ratio fails, naming the ratio.
func TestMinMemcpyRatio(t *testing.T) {
	args := []string{"write_bw", "-s", "64K", "-n", "200", "--link-rate", "0"}
	_, _, err := runArgs(append(args, "--min-memcpy-ratio", "0.0001")...)
	require.NoError(t, err)
	_, _, err = runArgs(append(args, "--min-memcpy-ratio", "1000")...)
	require.ErrorContains(t, err, "BW/memcpy")
}

// A --server that only answers runs with one P fewer than the CPUs, as odpemu's
// library runs perftest's servers, a send_bw server with all of them, and the
// process has its Ps back when the server ends.
func TestServerProcs(t *testing.T) {
	assert.Equal(t, 1, serverProcs(perf.WriteBW, 2))
	assert.Equal(t, 3, serverProcs(perf.ReadBW, 4))
	assert.Equal(t, 1, serverProcs(perf.AtomicBW, 1), "never no P")
	assert.Equal(t, 2, serverProcs(perf.SendBW, 2))

	before := runtime.GOMAXPROCS(0)
	want := serverProcs(perf.ReadBW, runtime.NumCPU())
	if os.Getenv("GOMAXPROCS") != "" {
		want = before // the environment decides
	}
	port, err := freeTCPPort()
	require.NoError(t, err)
	// RoCEv2 endpoints at addresses of this test's own: the packages' tests run in
	// parallel, and others bind port 4791 at 127.0.0.1 and 127.0.0.2.
	args := []string{"read_bw", "-s", "4K", "-n", "200"}
	type served struct {
		out string
		err error
	}
	done := make(chan served, 1) // the goroutine reports; only the test asserts
	go func() {
		out, _, err := runArgs(append(args, "--server", "127.0.0.17:"+port, "--bind", "127.0.0.17")...)
		done <- served{out, err}
	}()
	for try := 0; ; try++ { // until the server listens
		_, _, err = runArgs(append(args, "--connect", "127.0.0.17:"+port, "--bind", "127.0.0.18")...)
		if err == nil || !strings.Contains(err.Error(), "connection refused") || try == 100 {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	require.NoError(t, err)
	srv := <-done
	require.NoError(t, srv.err)
	out := srv.out
	assert.Contains(t, out, fmt.Sprintf("server waiting on 127.0.0.17:%s (RoCEv2/UDP), GOMAXPROCS %d\n", port, want))
	assert.Equal(t, before, runtime.GOMAXPROCS(0), "the server gave its Ps back")
}

// Runs that set the Ps and overlap leave them as the first found them once the last
// ends, in either order.
func TestSetProcsOverlap(t *testing.T) {
	if os.Getenv("GOMAXPROCS") != "" {
		t.Skip("GOMAXPROCS is set: runs leave the Ps alone")
	}
	before := runtime.GOMAXPROCS(0)
	for _, firstEndsFirst := range []bool{true, false} {
		a := setProcs(1, perf.WriteBW, false, false)
		require.Equal(t, 1, runtime.GOMAXPROCS(0))
		b := setProcs(3, perf.WriteBW, false, false)
		require.Equal(t, 3, runtime.GOMAXPROCS(0))
		if firstEndsFirst {
			a()
			require.Equal(t, 3, runtime.GOMAXPROCS(0), "the second run still runs")
			b()
		} else {
			b()
			a()
		}
		require.Equal(t, before, runtime.GOMAXPROCS(0))
	}
}

// A run's Ps: --procs decides; else GOMAXPROCS in the environment leaves them; else
// one in one process, the server's rule for a server, one fewer than the CPUs for a
// client.
func TestRunProcs(t *testing.T) {
	assert.Equal(t, 3, runProcs(3, perf.WriteBW, false, false, true, 2), "--procs over the environment")
	assert.Equal(t, 2, runProcs(2, perf.ReadBW, true, false, false, 2), "--procs over the server's rule")
	assert.Equal(t, 0, runProcs(0, perf.WriteBW, false, false, true, 2), "the environment decides")
	assert.Equal(t, 0, runProcs(0, perf.ReadBW, true, false, true, 4), "the environment decides a server's too")
	assert.Equal(t, inProcessProcs, runProcs(0, perf.ReadBW, false, false, false, 8))
	assert.Equal(t, 1, inProcessProcs)
	assert.Equal(t, 3, runProcs(0, perf.ReadBW, true, false, false, 4), "a server that only answers")
	assert.Equal(t, 4, runProcs(0, perf.SendBW, true, false, false, 4), "send_bw's server posts and polls")
	assert.Equal(t, 3, runProcs(0, perf.WriteBW, false, true, false, 4), "a client: one P fewer, as the library's")
	assert.Equal(t, 1, runProcs(0, perf.SendBW, false, true, false, 1), "never no P")
	assert.Equal(t, 0, runProcs(0, perf.WriteBW, false, true, true, 4), "the environment decides a client's too")
}

// A run in one process takes the Ps it says in its header, and the process has its
// own back when it ends; a goals run likewise.
func TestInProcessProcs(t *testing.T) {
	before := runtime.GOMAXPROCS(0)
	want := inProcessProcs
	if os.Getenv("GOMAXPROCS") != "" {
		want = before // the environment decides
	}
	args := []string{"write_bw", "-s", "4K", "-n", "200", "--link-rate", "0"}
	out, _, err := runArgs(args...)
	require.NoError(t, err)
	assert.Contains(t, out, fmt.Sprintf("two emulated NICs over an in-process wire, GOMAXPROCS %d\n", want))
	assert.Equal(t, before, runtime.GOMAXPROCS(0), "the run gave the Ps back")

	out, _, err = runArgs(append(args, "--procs", "3")...)
	require.NoError(t, err)
	assert.Contains(t, out, "two emulated NICs over an in-process wire, GOMAXPROCS 3\n")
	assert.Equal(t, before, runtime.GOMAXPROCS(0), "the run gave the Ps back")

	out, _, err = runArgs("goals", "--quiet", "--rounds", "1", "--scale", "0.001", "--tx-depth", "4", "--procs", "2")
	require.NoError(t, err)
	assert.Contains(t, out, " runs in one process at GOMAXPROCS 2 (")
	assert.Equal(t, before, runtime.GOMAXPROCS(0), "the goals gave the Ps back")

	_, _, err = runArgs(append(args, "--procs", "-1")...)
	assert.ErrorContains(t, err, "--procs not negative")
}

// The comparison runs small messages long enough that its first milliseconds do not
// decide the figure, and large ones as perftest does; --iters decides when given.
func TestPerftestIters(t *testing.T) {
	assert.Equal(t, 100_000, perftestIters(64))
	assert.Equal(t, 100_000, perftestIters(8), "fetch-and-adds")
	assert.Equal(t, 100_000, perftestIters(4096))
	assert.Equal(t, 5000, perftestIters(65536))
	assert.Equal(t, "100000 iterations up to 4 KiB, 5000 above", itersSaid(0))
	assert.Equal(t, "200 iterations", itersSaid(200))
}

// The comparison's two runs take turns at running first, round by round, and an
// error stops the round.
func TestInTurn(t *testing.T) {
	var order []string
	run := func(name string, err error) func() error {
		return func() error { order = append(order, name); return err }
	}
	for r := range 3 {
		require.NoError(t, inTurn(r, run("perftest", nil), run("odp-perf", nil)))
	}
	assert.Equal(t, []string{"perftest", "odp-perf", "odp-perf", "perftest", "perftest", "odp-perf"}, order)
	order = nil
	bad := errors.New("no perftest")
	assert.ErrorIs(t, inTurn(1, run("perftest", bad), run("odp-perf", bad)), bad)
	assert.Equal(t, []string{"odp-perf"}, order, "the first error ends the round")
}
