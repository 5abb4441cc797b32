// Package capture runs tshark for tests that check what odpemu puts on the wire
// with Wireshark's dissectors: a capture on an interface, started before traffic
// (tshark says when its filter is attached) and read back as fields.
package capture

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// Capture is a tshark capture in progress.
type Capture struct {
	tshark string
	file   string
	cmd    *exec.Cmd
	done   chan error
}

// Start captures on iface what filter (a capture filter) lets through, into a file
// under t.TempDir, and returns once packets are being captured. It skips the test,
// saying why, when tshark is missing or cannot capture. count > 0 makes tshark stop
// by itself after that many packets (Wait); otherwise the test's cleanup ends it.
func Start(t *testing.T, iface, filter string, count int) *Capture {
	t.Helper()
	tshark, err := exec.LookPath("tshark")
	if err != nil {
		t.Skip("skipped: tshark is not installed (apt-get install tshark)")
	}
	c := &Capture{tshark: tshark, file: filepath.Join(t.TempDir(), "capture.pcapng"), done: make(chan error, 1)}
	args := []string{"-i", iface, "-f", filter, "-w", c.file}
	if count > 0 {
		args = append(args, "-c", fmt.Sprint(count))
	}
	c.cmd = command(tshark, args...)
	stderr, err := c.cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := c.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	lines := bufio.NewScanner(stderr)
	said, started := waitStarted(lines)
	go func() { // drain the rest, so that tshark never blocks on its stderr
		for lines.Scan() {
		}
		c.done <- c.cmd.Wait()
	}()
	if !started {
		<-c.done
		t.Skipf("skipped: tshark cannot capture on %s: %s", iface, strings.Join(said, "; "))
	}
	t.Cleanup(func() { kill(c.cmd); <-c.done }) // stopped already unless the test failed early
	return c
}

// Wait waits for a capture started with a count to end, at most until timeout.
func (c *Capture) Wait(timeout time.Duration) error {
	select {
	case err := <-c.done:
		c.done <- err // for the cleanup
		return err
	case <-time.After(timeout):
		return errors.New("capture: tshark did not see all the packets it waits for")
	}
}

// waitStarted reads tshark's messages until it says that its capture has started
// (after "Capturing on", which comes before the filter is attached: nothing sent
// before is seen). It returns what tshark said and whether it started.
func waitStarted(stderr *bufio.Scanner) ([]string, bool) {
	var said []string
	for stderr.Scan() {
		said = append(said, stderr.Text())
		if strings.Contains(stderr.Text(), "Capture started") {
			return said, true
		}
	}
	return said, false
}

// Fields reads the capture back with extra tshark options (decode-as rules,
// disabled protocols) and returns each frame's fields, in order.
func (c *Capture) Fields(opts []string, fields ...string) ([][]string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	args := append([]string{"-r", c.file, "-T", "fields", "-E", "separator=;"}, opts...)
	for _, f := range fields {
		args = append(args, "-e", f)
	}
	read := exec.CommandContext(ctx, c.tshark, args...)
	var errOut strings.Builder
	read.Stderr = &errOut
	out, err := read.Output()
	if err != nil {
		return nil, fmt.Errorf("capture: tshark -r: %w: %s", err, errOut.String())
	}
	var rows [][]string
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		if line != "" {
			rows = append(rows, strings.Split(line, ";"))
		}
	}
	return rows, nil
}

// Live is a capture whose frames tshark dissects as they come, one line of fields
// each: a test reads them until a frame it sent last (a marker) shows that tshark
// has seen everything before it. (Stopping a capture with a signal right after the
// traffic loses what dumpcap had not read yet.)
type Live struct {
	cmd   *exec.Cmd
	lines *bufio.Scanner
	done  chan error
}

// StartLive starts dissecting what filter lets through on iface, with extra tshark
// options (decode-as rules, disabled protocols), and returns once packets are
// being captured. It skips the test, saying why, when tshark is missing or cannot
// capture.
func StartLive(t *testing.T, iface, filter string, opts []string, fields ...string) *Live {
	t.Helper()
	tshark, err := exec.LookPath("tshark")
	if err != nil {
		t.Skip("skipped: tshark is not installed (apt-get install tshark)")
	}
	args := append([]string{"-i", iface, "-f", filter, "-l", "-T", "fields", "-E", "separator=;"}, opts...)
	for _, f := range fields {
		args = append(args, "-e", f)
	}
	l := &Live{cmd: command(tshark, args...), done: make(chan error, 1)}
	stdout, err := l.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	stderr, err := l.cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := l.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	l.lines = bufio.NewScanner(stdout)
	l.lines.Buffer(make([]byte, 1<<16), 1<<22)
	errLines := bufio.NewScanner(stderr)
	said, started := waitStarted(errLines)
	go func() {
		for errLines.Scan() {
		}
		l.done <- nil
	}()
	t.Cleanup(func() {
		kill(l.cmd) // done with it
		<-l.done
		_ = l.cmd.Wait()
	})
	if !started {
		t.Skipf("skipped: tshark cannot capture on %s: %s", iface, strings.Join(said, "; "))
	}
	return l
}

// Next returns the next frame's fields.
func (l *Live) Next() ([]string, error) {
	if !l.lines.Scan() {
		if err := l.lines.Err(); err != nil {
			return nil, err
		}
		return nil, errors.New("capture: tshark ended")
	}
	return strings.Split(l.lines.Text(), ";"), nil
}

// command makes a tshark command that runs in a process group of its own, with the
// dumpcap it starts to capture, so that kill stops both: killing tshark alone
// leaves dumpcap capturing, and filtering every packet on the interface, for good.
func command(tshark string, args ...string) *exec.Cmd {
	cmd := exec.Command(tshark, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	return cmd
}

// kill stops a started command's process group.
func kill(cmd *exec.Cmd) {
	_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) // gone already if it ended by itself
}
