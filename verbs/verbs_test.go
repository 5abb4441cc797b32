package verbs

import (
	"bytes"
	"compress/gzip"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/odpemu/odpemu/internal/seccomp"
	"github.com/odpemu/odpemu/odp"
	"github.com/stretchr/testify/require"
)

// The library is built once per test binary, into built.dir, which TestMain removes.
var built struct {
	once sync.Once
	dir  string
	err  error
}

// execDeniedEnv makes the test binary a wrapper: it installs a seccomp filter that
// refuses userfaultfd, as a container's default profile does, and execs its
// arguments (deniedCmd).
const execDeniedEnv = "ODPEMU_TEST_EXEC_WITHOUT_USERFAULTFD"

func TestMain(m *testing.M) {
	if os.Getenv(execDeniedEnv) != "" {
		os.Exit(execDenied(os.Args[1:]))
	}
	code := m.Run()
	if built.dir != "" {
		_ = os.RemoveAll(built.dir) // a temporary directory
	}
	os.Exit(code)
}

// library builds libibverbs.so.1 and the emulator once, or skips the test when the
// installed rdma-core or gcc is missing. It returns their directory.
func library(t *testing.T) string {
	t.Helper()
	if _, err := SystemLibrary(); err != nil {
		t.Skip(err)
	}
	built.once.Do(func() {
		built.dir, built.err = os.MkdirTemp("", "odpemu-verbs-test")
		if built.err == nil {
			built.err = Build("..", built.dir)
		}
	})
	require.NoError(t, built.err)
	return built.dir
}

// verbsCmd is a command that runs on odpemu's libibverbs.so.1 from dir. The emulator
// inside it runs with the runtime's own GOMAXPROCS, whatever the test's is: a verbs
// program that polls in a busy loop beside its engines needs the machine's CPUs.
func verbsCmd(dir string, env []string, name string, args ...string) *exec.Cmd {
	cmd := exec.Command(name, args...)
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "GOMAXPROCS=") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.Env = append(append(cmd.Env, "LD_LIBRARY_PATH="+dir), env...)
	return cmd
}

// execDenied installs the filter and execs argv; it returns only if that fails.
func execDenied(argv []string) int {
	path, err := exec.LookPath(argv[0])
	if err == nil {
		err = seccomp.DenyUserfaultfd()
	}
	if err == nil {
		err = syscall.Exec(path, argv, os.Environ())
	}
	fmt.Fprintln(os.Stderr, "exec without userfaultfd:", err)
	return 127
}

// outputWithin runs cmd and returns its output; a cmd still running after d is
// killed, and the error says so (a hung peer fails the test, not the test binary's
// timeout).
func outputWithin(cmd *exec.Cmd, d time.Duration) (string, error) {
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		return "", err
	}
	timer := time.AfterFunc(d, func() { _ = cmd.Process.Kill() })
	err := cmd.Wait()
	if !timer.Stop() {
		err = fmt.Errorf("killed after %v: %w", d, err)
	}
	return out.String(), err
}

// deniedCmd is cmd run where the process may not create a userfaultfd (execDenied).
func deniedCmd(cmd *exec.Cmd) *exec.Cmd {
	w := exec.Command(os.Args[0], cmd.Args...)
	w.Env = append(cmd.Env, execDeniedEnv+"=1")
	return w
}

// output runs cmd and returns its output.
func output(cmd *exec.Cmd) (string, error) {
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// TestVersionScriptRoundTrip builds a library from a made-up ABI's version script and
// stubs and reads the ABI back: the generator's part, with no rdma-core installed.
func TestVersionScriptRoundTrip(t *testing.T) {
	if _, err := exec.LookPath("gcc"); err != nil {
		t.Skip("needs gcc:", err)
	}
	want := &ABI{
		Versions: []Version{{Name: "T_1.0"}, {Name: "T_1.1", Parent: "T_1.0"}, {Name: "T_1.2", Parent: "T_1.1"},
			{Name: "T_PRIVATE_7"}},
		Symbols: []Symbol{
			{Name: "t_open", Version: "T_1.0"}, {Name: "t_close", Version: "T_1.0"},
			{Name: "t_query", Version: "T_1.1"}, {Name: "t_flag", Version: "T_PRIVATE_7", Object: true, Size: 1},
			{Name: "t_private", Version: "T_PRIVATE_7"},
		},
	}
	got := buildABI(t, want, map[string]bool{})
	sortSymbols(want)
	require.Equal(t, want, got)
}

// buildABI links the stubs of abi (those defined aside) into a library with abi's
// version script and reads its ABI.
func buildABI(t *testing.T, abi *ABI, defined map[string]bool) *ABI {
	dir := t.TempDir()
	stubs := filepath.Join(dir, "stubs.c")
	require.NoError(t, os.WriteFile(stubs, abi.Stubs(defined, nil), 0o644))
	script := filepath.Join(dir, "t.map")
	require.NoError(t, os.WriteFile(script, abi.VersionScript(), 0o644))
	lib := filepath.Join(dir, "libt.so.1")
	out, err := exec.Command("gcc", "-shared", "-fPIC", "-fvisibility=hidden", "-o", lib, stubs,
		"-Wl,-soname,libt.so.1", "-Wl,--version-script="+script).CombinedOutput()
	require.NoError(t, err, "%s", out)
	got, err := ReadABI(lib)
	require.NoError(t, err)
	return got
}

func sortSymbols(a *ABI) {
	s := a.Symbols
	for i := range s {
		for j := i + 1; j < len(s); j++ {
			if s[j].Version < s[i].Version || (s[j].Version == s[i].Version && s[j].Name < s[i].Name) {
				s[i], s[j] = s[j], s[i]
			}
		}
	}
}

func TestPrototypeKinds(t *testing.T) {
	headers := []byte(`struct ibv_pd *ibv_alloc_pd(struct ibv_context *context);
int ibv_dealloc_pd(struct ibv_pd *pd);
void ibv_ack_cq_events(struct ibv_cq *cq, unsigned int nevents);
static inline int ibv_post_send(struct ibv_qp *qp) { return qp->x(qp); }
const char *ibv_wc_status_str(enum ibv_wc_status status);`)
	kinds := prototypeKinds(headers, []string{"ibv_alloc_pd", "ibv_dealloc_pd", "ibv_ack_cq_events", "ibv_post_send",
		"ibv_wc_status_str", "verbs_private"})
	require.Equal(t, map[string]returnKind{"ibv_alloc_pd": returnsPointer, "ibv_dealloc_pd": returnsInt,
		"ibv_ack_cq_events": returnsVoid, "ibv_wc_status_str": returnsPointer}, kinds)
}

// TestExportsMatchInstalled: the built library exports exactly what the installed one
// does, version nodes and their order, every default-version symbol at its version.
func TestExportsMatchInstalled(t *testing.T) {
	dir := library(t)
	system, err := SystemLibrary()
	require.NoError(t, err)
	want, err := ReadABI(system)
	require.NoError(t, err)
	got, err := ReadABI(filepath.Join(dir, LibraryName))
	require.NoError(t, err)
	require.Equal(t, want.Versions, got.Versions)
	require.Equal(t, want.Symbols, got.Symbols)
	require.NotEmpty(t, got.Symbols)
}

// TestABI runs testdata/abi.c, built against the installed headers: verbs.h's inline
// dispatch, the structures it reaches into, and the basic verbs.
func TestABI(t *testing.T) {
	stderr := runC(t, "abi", nil)
	require.Contains(t, stderr, "verbs in a forked child", "the child's open says why it fails")
}

// runC builds testdata/NAME.c against the installed headers and odpemu's library,
// runs it with env added to its environment, and checks that it printed "ok" and
// nothing else to its standard output. It returns what it printed to standard error.
func runC(t *testing.T, name string, env []string) string {
	t.Helper()
	dir := library(t)
	bin := filepath.Join(t.TempDir(), name)
	out, err := exec.Command("gcc", "-Wall", "-Werror", "-pthread", "-o", bin, filepath.Join("testdata", name+".c"),
		"-L"+dir, "-l:"+LibraryName).CombinedOutput()
	require.NoError(t, err, "%s", out)
	cmd := verbsCmd(dir, env, bin)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	got, err := cmd.Output()
	require.NoError(t, err, "%s%s", got, stderr.String())
	require.Equal(t, "ok\n", string(got), stderr.String())
	return stderr.String()
}

// TestDevinfo: rdma-core's ibv_devices and ibv_devinfo, unmodified, show the emulated device.
func TestDevinfo(t *testing.T) {
	dir := library(t)
	if _, err := exec.LookPath("ibv_devinfo"); err != nil {
		t.Skip("needs ibv_devinfo (Debian: ibverbs-utils):", err)
	}
	out, err := output(verbsCmd(dir, nil, "ibv_devices"))
	require.NoError(t, err, out)
	require.Regexp(t, `odpemu0\s+026f64ff7f000001`, out, "the device and its GUID")
	out, err = output(verbsCmd(dir, []string{"ODPEMU_ADDR=127.0.0.2"}, "ibv_devinfo", "-v"))
	require.NoError(t, err, out)
	for _, want := range []string{
		`hca_id:\s+odpemu0`, `vendor_id:\s+0xffffff`, `general_odp_caps:\s+ODP_SUPPORT\s+ODP_SUPPORT_IMPLICIT\s+rc_odp_caps`,
		`rc_odp_caps:\s+SUPPORT_SEND\s+SUPPORT_RECV\s+SUPPORT_WRITE\s+SUPPORT_READ\s+SUPPORT_ATOMIC`,
		`state:\s+PORT_ACTIVE`, `link_layer:\s+Ethernet`, `active_mtu:\s+4096`,
		`GID\[\s*0\]:\s+::ffff:127\.0\.0\.2, RoCE v2`, `max_qp_rd_atom:\s+16`,
	} {
		require.Regexp(t, want, out)
	}
}

// TestBadSettings: a bad ODPEMU_ADDR, or an emulator the library cannot load, fails
// ibv_open_device with a message, not a crash.
func TestBadSettings(t *testing.T) {
	dir := library(t)
	if _, err := exec.LookPath("ibv_devinfo"); err != nil {
		t.Skip("needs ibv_devinfo (Debian: ibverbs-utils):", err)
	}
	out, err := output(verbsCmd(dir, []string{"ODPEMU_ADDR=::1"}, "ibv_devinfo"))
	require.Error(t, err)
	require.Contains(t, out, "ODPEMU_ADDR=::1: want an IPv4 address")

	out, err = output(verbsCmd(dir, []string{"ODPEMU_VERBS_BACKEND=" + filepath.Join(t.TempDir(), "none.so")},
		"ibv_devinfo"))
	require.Error(t, err)
	require.Contains(t, out, "cannot load the emulator")

	out, err = output(verbsCmd(dir, []string{"ODPEMU_PROFILE=connectx9"}, "ibv_devinfo"))
	require.Error(t, err)
	require.Contains(t, out, `ODPEMU_PROFILE: odp: invalid argument: no profile "connectx9" (presets: emulator, connectx4`)
}

// TestProfile: ODPEMU_PROFILE sets the device's profile; connectx4's memory keys
// cost every registration and deregistration its firmware's time.
func TestProfile(t *testing.T) {
	reg, dereg := odp.ProfileConnectX4.Reg.Reg.Nanoseconds(), odp.ProfileConnectX4.Reg.Dereg.Nanoseconds()
	runC(t, "profile", []string{"ODPEMU_PROFILE=connectx4", fmt.Sprintf("MIN_REG_NS=%d", reg), fmt.Sprintf("MIN_DEREG_NS=%d", dereg)})
	runC(t, "profile", []string{"MIN_REG_NS=0", "MIN_DEREG_NS=0"}) // the default: the emulator's own costs
}

// TestPyverbs runs rdma-core's own tests (pyverbs, from the installed rdma-core's
// documentation) on the emulated device, once as they are and once with no ODP page
// mapped at registration (every first DMA takes a network page fault): none may fail.
func TestPyverbs(t *testing.T) {
	dir := library(t)
	tests := "/usr/share/doc/rdma-core/tests"
	if _, err := os.Stat(tests); err != nil {
		t.Skip("needs rdma-core's tests (Debian: rdma-core):", err)
	}
	if err := exec.Command("/usr/bin/python3", "-c", "import pyverbs.device").Run(); err != nil {
		t.Skip("needs pyverbs (Debian: python3-pyverbs):", err)
	}
	work := t.TempDir()
	copyTests(t, tests, filepath.Join(work, "tests"))
	suites := []string{"test_device", "test_pd", "test_mr", "test_cq", "test_cq_events", "test_qp", "test_qpex", "test_odp",
		"test_atomic", "test_addr", "test_fork", "test_relaxed_ordering", "test_cqex"}
	for _, env := range [][]string{nil, {"ODPEMU_NO_SNAPSHOT=1"}} {
		cmd := verbsCmd(dir, env, "/usr/bin/python3", append([]string{"tests/run_tests.py", "--dev", "odpemu0", "--gid", "0",
			"-v"}, suites...)...)
		cmd.Dir = work
		out, err := output(cmd)
		require.NoError(t, err, "%v:\n%s", env, out)
		m := regexp.MustCompile(`Ran (\d+) tests`).FindStringSubmatch(out)
		require.NotNil(t, m, out)
		ran, _ := strconv.Atoi(m[1])
		skipped := 0
		if s := regexp.MustCompile(`OK \(skipped=(\d+)\)`).FindStringSubmatch(out); s != nil {
			skipped, _ = strconv.Atoi(s[1])
		}
		require.Regexp(t, `(?m)^OK`, out)
		require.NotContains(t, out, "... ERROR")
		require.NotContains(t, out, "... FAIL")
		// rdma-core 44: 105 pass (13 device, 4 PD, 14 ODP with 3 implicit, UD and
		// an SRQ, and 2 more over huge pages where some are reserved, the ibv_wr_*
		// API with UD, 7 atomic, 4 ibv_rereg_mr with QPs reset and connected again,
		// UD QPs and address handles, CQ resize, extended CQs with RC and UD
		// traffic, relaxed ordering over RC and UD, 7 memory windows, a bind and an
		// atomic write through the ibv_wr_* API, UC QPs created and queried, ...);
		// the rest need what the emulator does not offer (XRC, device memory, raw
		// packets, dmabuf; huge pages where none are reserved).
		require.GreaterOrEqual(t, ran-skipped, 105, out)
		t.Logf("%v: %d tests, %d passed, %d skipped", env, ran, ran-skipped, skipped)
	}
}

// copyTests copies rdma-core's test directory, unpacking the files Debian compressed.
func copyTests(t *testing.T, from, to string) {
	require.NoError(t, os.MkdirAll(to, 0o755))
	entries, err := os.ReadDir(from)
	require.NoError(t, err)
	for _, e := range entries {
		if e.IsDir() {
			continue
		}
		data, err := os.ReadFile(filepath.Join(from, e.Name()))
		require.NoError(t, err)
		name := e.Name()
		if strings.HasSuffix(name, ".gz") {
			zr, err := gzip.NewReader(bytes.NewReader(data))
			require.NoError(t, err)
			data, err = io.ReadAll(zr)
			require.NoError(t, err)
			name = strings.TrimSuffix(name, ".gz")
		}
		require.NoError(t, os.WriteFile(filepath.Join(to, name), data, 0o644))
	}
}

// freePort returns a TCP port nothing listens on now.
func freePort(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer func() { _ = ln.Close() }() // the port is what is wanted
	return strconv.Itoa(ln.Addr().(*net.TCPAddr).Port)
}

// serverClient runs a verbs program, unmodified, as a server and a client process
// (the client's last argument: the server's host), each on its own address (port
// 4791 each, as on two hosts). It skips the test when the program is missing.
func serverClient(t *testing.T, dir, prog string, args ...string) (server, client string, serverErr, clientErr error) {
	t.Helper()
	return serverClientWrapped(t, dir, func(c *exec.Cmd) *exec.Cmd { return c }, prog, args...)
}

// serverClientWrapped is serverClient with each process's command wrapped.
func serverClientWrapped(t *testing.T, dir string, wrap func(*exec.Cmd) *exec.Cmd, prog string, args ...string) (server, client string,
	serverErr, clientErr error) {
	t.Helper()
	if _, err := exec.LookPath(prog); err != nil {
		t.Skipf("needs %s: %v", prog, err)
	}
	port := freePort(t)
	common := append([]string{"-d", "odpemu0", "-p", port}, args...)
	srv := wrap(verbsCmd(dir, []string{"ODPEMU_ADDR=127.0.0.8"}, prog, common...))
	var srvOut bytes.Buffer
	srv.Stdout, srv.Stderr = &srvOut, &srvOut
	require.NoError(t, srv.Start())
	done := make(chan error, 1)
	go func() { done <- srv.Wait() }()
	// The client tries again until the server listens.
	var cliOut string
	for i := 0; ; i++ {
		cli := wrap(verbsCmd(dir, []string{"ODPEMU_ADDR=127.0.0.9"}, prog, append(common, "127.0.0.1")...))
		cliOut, clientErr = outputWithin(cli, 2*time.Minute)
		if !strings.Contains(cliOut, "Couldn't connect to") && !strings.Contains(cliOut, "Unable to open file descriptor") || i == 50 {
			break
		}
		select {
		case serverErr = <-done:
			return srvOut.String(), cliOut, serverErr, clientErr
		case <-time.After(100 * time.Millisecond):
		}
	}
	select {
	case serverErr = <-done:
	case <-time.After(30 * time.Second):
		_ = srv.Process.Kill()
		serverErr = <-done
	}
	return srvOut.String(), cliOut, serverErr, clientErr
}

// pingpong runs rdma-core's ibv_rc_pingpong as a server and a client.
func pingpong(t *testing.T, dir string, args ...string) (server, client string, serverErr, clientErr error) {
	t.Helper()
	return serverClient(t, dir, "ibv_rc_pingpong", args...)
}

// TestRCPingpong: rdma-core's ibv_rc_pingpong, unmodified, SENDs between two
// processes over RoCEv2 on the emulated NIC, pinned, ODP and implicit ODP, polling and
// with completion events.
func TestRCPingpong(t *testing.T) {
	dir := library(t)
	for _, args := range [][]string{{"-n", "200"}, {"-n", "20", "-s", "65536", "-m", "4096"},
		{"-n", "100", "-e"}, // -e: completion channels
		{"-n", "100", "-o"}, // -o: ODP over its memalign'd buffer
		{"-n", "100", "-o", "-e"},
		{"-n", "50", "-o", "-P", "-s", "65536", "-m", "4096"}, // -P: ibv_advise_mr prefetches it
		{"-n", "50", "-o", "-P", "-e"},
		{"-n", "100", "-o", "-O"}, // -O: implicit ODP, one MR for the whole address space
		{"-n", "50", "-o", "-O", "-P", "-s", "65536", "-m", "4096"},
	} {
		args = append([]string{"-g", "0", "-c"}, args...) // -c: each side checks the data it received
		server, client, serr, cerr := pingpong(t, dir, args...)
		require.NoError(t, cerr, "client %v:\n%s\nserver:\n%s", args, client, server)
		require.NoError(t, serr, "server %v:\n%s\nclient:\n%s", args, server, client)
		for _, out := range []string{server, client} {
			require.Regexp(t, `\d+ bytes in [\d.]+ seconds`, out)
			require.Regexp(t, `\d+ iters in [\d.]+ seconds`, out)
		}
	}
	// ODPEMU_GSO=1: both processes send runs of packets with UDP segmentation
	// offload; the data each side checks arrives as sent.
	gso := func(c *exec.Cmd) *exec.Cmd { c.Env = append(c.Env, "ODPEMU_GSO=1"); return c }
	server, client, serr, cerr := serverClientWrapped(t, dir, gso, "ibv_rc_pingpong", "-g", "0", "-c", "-n", "50", "-s",
		"65536", "-m", "4096")
	require.NoError(t, cerr, "client with GSO:\n%s\nserver:\n%s", client, server)
	require.NoError(t, serr, "server with GSO:\n%s\nclient:\n%s", server, client)
	// Without -g the QPs have no GRH, which RoCE needs: the server's RTR fails (then
	// the client's exchange with it), as on a RoCE NIC.
	server, client, serr, cerr = pingpong(t, dir, "-n", "5")
	require.Error(t, serr, server)
	require.Contains(t, server, "Failed to modify QP to RTR")
	require.Error(t, cerr, client)
}

// TestNoUserfaultfd: where a process may not create a userfaultfd (a container's
// default seccomp profile), the device still opens, without ODP: ibv_devinfo shows
// no ODP caps, ibv_rc_pingpong runs pinned, and with -o says the device is not ODP
// capable.
func TestNoUserfaultfd(t *testing.T) {
	dir := library(t)
	if _, err := exec.LookPath("ibv_devinfo"); err != nil {
		t.Skip("needs ibv_devinfo (Debian: ibverbs-utils):", err)
	}
	out, err := output(deniedCmd(verbsCmd(dir, nil, "ibv_devinfo", "-v")))
	if strings.Contains(out, "seccomp: no filter for GOARCH") {
		t.Skip(out)
	}
	require.NoError(t, err, out)
	require.Regexp(t, `hca_id:\s+odpemu0`, out)
	require.Regexp(t, `state:\s+PORT_ACTIVE`, out)
	require.NotContains(t, out, "ODP_SUPPORT")
	require.NotContains(t, out, "SUPPORT_SEND")

	server, client, serr, cerr := serverClientWrapped(t, dir, deniedCmd, "ibv_rc_pingpong", "-g", "0", "-c", "-n", "100")
	require.NoError(t, cerr, "client:\n%s\nserver:\n%s", client, server)
	require.NoError(t, serr, "server:\n%s\nclient:\n%s", server, client)
	require.Regexp(t, `\d+ iters in [\d.]+ seconds`, client)

	out, err = output(deniedCmd(verbsCmd(dir, nil, "ibv_rc_pingpong", "-d", "odpemu0", "-g", "0", "-o", "-p", freePort(t))))
	require.Error(t, err, out)
	require.Contains(t, out, "ODP")
}

// TestUDPingpong: rdma-core's ibv_ud_pingpong, unmodified, between two processes:
// UD SENDs to an address handle, the receive's GRH, data checked on both sides.
func TestUDPingpong(t *testing.T) {
	dir := library(t)
	for _, args := range [][]string{{"-n", "100"}, {"-n", "50", "-s", "4000"}, {"-n", "50", "-e"}} {
		args = append([]string{"-g", "0", "-c"}, args...)
		server, client, serr, cerr := serverClient(t, dir, "ibv_ud_pingpong", args...)
		require.NoError(t, cerr, "client %v:\n%s\nserver:\n%s", args, client, server)
		require.NoError(t, serr, "server %v:\n%s\nclient:\n%s", args, server, client)
		for _, out := range []string{server, client} {
			require.Regexp(t, `\d+ iters in [\d.]+ seconds`, out)
		}
	}
}

// TestPerftest: perftest's bandwidth tests, unmodified, between two processes: WRITE,
// READ and SEND, pinned and ODP, atomics pinned, several QPs.
func TestPerftest(t *testing.T) {
	dir := library(t)
	runs := []struct {
		prog string
		args []string
	}{
		{"ib_write_bw", []string{"-n", "200"}}, {"ib_write_bw", []string{"-n", "200", "--odp"}},
		{"ib_write_bw", []string{"-n", "50", "-s", "1048576", "--odp"}}, {"ib_write_bw", []string{"-n", "100", "-q", "4"}},
		{"ib_read_bw", []string{"-n", "200"}}, {"ib_read_bw", []string{"-n", "200", "--odp", "-s", "4096"}},
		{"ib_send_bw", []string{"-n", "200"}}, {"ib_send_bw", []string{"-n", "200", "--odp"}},
		{"ib_atomic_bw", []string{"-n", "200"}},
		// UC between two processes: the server waits for every message, which only
		// the UC credits deliver when the client outruns its engine (credit.go).
		{"ib_send_bw", []string{"-c", "UC", "-n", "50000", "-s", "64"}}, {"ib_send_bw", []string{"-c", "UC", "-n", "5000"}},
		{"ib_write_bw", []string{"-c", "UC", "-n", "200"}},
	}
	row := regexp.MustCompile(`(?m)^\s*(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$`)
	for _, r := range runs {
		m := perftestRow(t, dir, row, r.prog, append([]string{"-x", "0", "-F"}, r.args...)...)
		avg, err := strconv.ParseFloat(m[4], 64)
		require.NoError(t, err)
		require.Positive(t, avg, "%s %v: BW average", r.prog, r.args)
		t.Logf("%s %v: %s bytes, %s iterations, BW average %s MB/s", r.prog, r.args, m[1], m[2], m[4])
	}
	// perftest itself refuses atomics on ODP memory.
	_, client, _, cerr := serverClient(t, dir, "ib_atomic_bw", "-x", "0", "-F", "-n", "10", "--odp")
	require.Error(t, cerr)
	require.Contains(t, client, "ODP does not support ATOMICS")
}

// perftestRow runs a perftest program as a server and a client, which must both
// succeed, and returns the client's results row as row matches it.
func perftestRow(t *testing.T, dir string, row *regexp.Regexp, prog string, args ...string) []string {
	t.Helper()
	server, client, serr, cerr := serverClient(t, dir, prog, args...)
	require.NoError(t, cerr, "%s %v client:\n%s\nserver:\n%s", prog, args, client, server)
	require.NoError(t, serr, "%s %v server:\n%s\nclient:\n%s", prog, args, server, client)
	m := row.FindStringSubmatch(client)
	require.NotNil(t, m, "%s %v: no results row:\n%s", prog, args, client)
	return m
}

// TestPerftestHugePages: perftest's --use_hugepages --odp, which registers its buffer's
// size (no multiple of a huge page) from the start of a SHM_HUGETLB segment: the ODP
// registration takes the huge pages the buffer touches (odp's TestODPOverHugePages).
func TestPerftestHugePages(t *testing.T) {
	meminfo, err := os.ReadFile("/proc/meminfo")
	require.NoError(t, err)
	m := regexp.MustCompile(`(?m)^HugePages_Free:\s+(\d+)`).FindSubmatch(meminfo)
	if m == nil {
		t.Skip("skipped: /proc/meminfo counts no huge pages (a kernel without hugetlbfs)")
	}
	if free, _ := strconv.Atoi(string(m[1])); free < 4 {
		t.Skip("skipped: fewer than 4 huge pages free (vm.nr_hugepages)")
	}
	dir := library(t)
	row := regexp.MustCompile(`(?m)^\s*65536\s+200\s+[\d.]+\s+[\d.]+`)
	for _, prog := range []string{"ib_write_bw", "ib_read_bw", "ib_send_bw"} {
		perftestRow(t, dir, row, prog, "-x", "0", "-F", "-n", "200", "--use_hugepages", "--odp")
	}
}

// TestPerftestLatency: perftest's latency tests, unmodified, between two processes,
// polling and with completion events (-e). ib_send_lat -e takes its two CQs' events
// from one channel (perftest 4.5) and polls the CQ it waits on once: it finds the
// SEND's completion before the peer's answer only because the engine completes in
// the order the packets came (odp's TestPingPongCompletionOrder).
func TestPerftestLatency(t *testing.T) {
	dir := library(t)
	runs := []struct {
		prog string
		args []string
	}{
		{"ib_send_lat", nil}, {"ib_send_lat", []string{"-e"}}, {"ib_send_lat", []string{"-e", "--odp", "-s", "4096"}},
		{"ib_write_lat", nil}, {"ib_read_lat", []string{"-e"}}, {"ib_atomic_lat", []string{"-e"}},
	}
	// #bytes #iterations t_min t_max t_typical t_avg t_stdev 99% 99.9%
	row := regexp.MustCompile(`(?m)^\s*(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)(\s+[\d.]+){4}\s*$`)
	for _, r := range runs {
		m := perftestRow(t, dir, row, r.prog, append([]string{"-x", "0", "-F", "-n", "200"}, r.args...)...)
		typical, err := strconv.ParseFloat(m[5], 64)
		require.NoError(t, err)
		require.Positive(t, typical, "%s %v: typical latency", r.prog, r.args)
		t.Logf("%s %v: %s bytes, %s iterations, typical %s us", r.prog, r.args, m[1], m[2], m[5])
	}
}

// TestPoll runs testdata/poll.c: ibv_poll_cq over the CQ's doorbell, a busy poller
// sleeping on an empty CQ, several threads polling one CQ, a CQ armed for its
// channel while it is polled, bursts of sends whose poster waits in the emulator
// for the doorbell, and a receiver with nothing in flight that waits there too.
func TestPoll(t *testing.T) {
	for i := 0; i < 3; i++ {
		t.Log(strings.TrimSpace(runC(t, "poll", []string{"ODPEMU_ADDR=127.0.0.10"})))
	}
}

// TestWR runs testdata/wr.c: the ibv_wr_* API (every operation in one batch, inline
// data copied when set, batches that fail while built post nothing) and
// ibv_post_send chains longer than one call to the emulator, with a bad WR.
func TestWR(t *testing.T) {
	runC(t, "wr", []string{"ODPEMU_ADDR=127.0.0.12"})
}

// TestSignals runs testdata/signals.c: the application's handlers of SIGUSR1, SIGALRM
// and SIGSEGV keep working with the emulator loaded, while it WRITEs into an ODP MR
// over the application's own mmap and madvises it away; WRITEs to MRs whose memory it
// unmapped complete in error, without a crash.
func TestSignals(t *testing.T) {
	t.Log(strings.TrimSpace(runC(t, "signals", []string{"ODPEMU_ADDR=127.0.0.11"})))
}

// TestSRQ runs testdata/srq.c: two QPs receiving from one SRQ over ODP memory the
// program malloc'ed, the SRQ limit event on async_fd, and what verbs refuse.
func TestSRQ(t *testing.T) {
	runC(t, "srq", []string{"ODPEMU_ADDR=127.0.0.14"})
}

// TestMW runs testdata/mw.c: memory windows of both types over ODP memory the
// program malloc'ed, bound with ibv_bind_mw, ibv_post_send and the ibv_wr_* API,
// invalidated by SENDs with invalidate whose receive completions name the key.
func TestMW(t *testing.T) {
	runC(t, "mw", []string{"ODPEMU_ADDR=127.0.0.15"})
}

// TestUC runs testdata/uc.c: UC QPs connected with UC's attributes, SENDs and WRITEs
// with immediate over ODP memory the program malloc'ed, a SEND with no receive
// dropped, a READ refused.
func TestUC(t *testing.T) {
	runC(t, "uc", []string{"ODPEMU_ADDR=127.0.0.16"})
}

// TestReregReset: ibv_rereg_mr keeps an MR's keys when its access or PD changes and
// gives new ones for new memory; a connected QP moved to RESET drops its work and its
// completions and connects again (testdata/rereg.c says what it checks).
func TestReregReset(t *testing.T) {
	runC(t, "rereg", []string{"ODPEMU_ADDR=127.0.0.13"})
}
