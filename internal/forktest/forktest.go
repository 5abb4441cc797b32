// Package forktest forks the test process into a paused child, for tests of what fork
// does to memory: afterwards every private page is COW-shared with the child.
package forktest

import (
	"testing"

	"golang.org/x/sys/unix"
)

// Paused forks with a raw fork(2). The child, one thread without a Go runtime that
// can run, pauses until the test's cleanup kills and reaps it.
func Paused(t testing.TB) {
	t.Helper()
	pid, _, errno := unix.RawSyscall(unix.SYS_FORK, 0, 0, 0)
	if errno != 0 {
		t.Fatalf("fork: %v", errno)
	}
	if pid == 0 {
		for {
			_, _, _ = unix.RawSyscall(unix.SYS_PAUSE, 0, 0, 0) // the child waits to be killed
		}
	}
	t.Cleanup(func() {
		if err := unix.Kill(int(pid), unix.SIGKILL); err != nil {
			t.Errorf("kill the fork child: %v", err)
		}
		var ws unix.WaitStatus
		if _, err := unix.Wait4(int(pid), &ws, 0, nil); err != nil {
			t.Errorf("reap the fork child: %v", err)
		}
	})
}
