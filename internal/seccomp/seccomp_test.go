package seccomp

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// childEnv marks the re-executed test binary that installs the filter.
const childEnv = "ODPEMU_SECCOMP_TEST_CHILD"

func TestMain(m *testing.M) {
	if os.Getenv(childEnv) != "" {
		os.Exit(child())
	}
	os.Exit(m.Run())
}

// child installs the filter and checks, in a process of its own (a filter cannot be
// removed), what it refuses and what it lets through; it exits 0 when all holds.
func child() int {
	if err := DenyUserfaultfd(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	fail := func(what string, err error) int {
		fmt.Fprintf(os.Stderr, "%s: %v\n", what, err)
		return 1
	}
	if _, _, e := unix.Syscall(unix.SYS_USERFAULTFD, unix.O_CLOEXEC, 0, 0); e != unix.EPERM {
		return fail("userfaultfd(2) not refused with EPERM", e)
	}
	null, err := unix.Open("/dev/null", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return fail("open /dev/null", err)
	}
	defer func() { _ = unix.Close(null) }() // a descriptor of our own, only read
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(null), ioctlNewUserfaultfd, 0); e != unix.EPERM {
		return fail("USERFAULTFD_IOC_NEW not refused with EPERM", e)
	}
	// Other ioctls and calls go through: /dev/null is no terminal.
	if _, err := unix.IoctlGetTermios(null, unix.TCGETS); !errors.Is(err, unix.ENOTTY) {
		return fail("TCGETS on /dev/null", err)
	}
	if unix.Getpid() <= 0 {
		return fail("getpid", nil)
	}
	return 0
}

// The filter refuses userfaultfd(2) and USERFAULTFD_IOC_NEW with EPERM, as a
// container's default seccomp profile (and its missing /dev/userfaultfd) do, and
// lets every other call through; checked in a child process, which keeps it.
func TestDenyUserfaultfd(t *testing.T) {
	if _, err := auditArch(); err != nil {
		t.Skipf("skipped: %v", err)
	}
	cmd := exec.Command(os.Args[0], "-test.run", "^$")
	cmd.Env = append(os.Environ(), childEnv+"=1")
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s", out)
	assert.Empty(t, string(out))
}
