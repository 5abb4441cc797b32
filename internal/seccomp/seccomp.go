// Package seccomp installs the seccomp filter a container's default profile amounts
// to for userfaultfd, so that tests can run odpemu where a process may not create
// one: Docker's and Podman's default profiles refuse userfaultfd(2) (EPERM) and
// containers have no /dev/userfaultfd node.
package seccomp

import (
	"fmt"
	"runtime"
	"unsafe"

	"golang.org/x/sys/unix"
)

// ioctlNewUserfaultfd is USERFAULTFD_IOC_NEW, _IO(0xAA, 0x00): the ioctl on
// /dev/userfaultfd that creates one.
const ioctlNewUserfaultfd = 0xAA00

// seccomp_data's layout (linux/seccomp.h): nr, arch, instruction_pointer, args[6].
const (
	offNr    = 0
	offArch  = 4
	offArg1  = 16 + 8 // args[1], its low 32 bits on a little-endian machine
	errnoRet = unix.SECCOMP_RET_ERRNO | uint32(unix.EPERM)
)

// auditArch is the AUDIT_ARCH value of the running architecture.
func auditArch() (uint32, error) {
	switch runtime.GOARCH {
	case "amd64":
		return unix.AUDIT_ARCH_X86_64, nil
	case "arm64":
		return unix.AUDIT_ARCH_AARCH64, nil
	}
	return 0, fmt.Errorf("seccomp: no filter for GOARCH %s", runtime.GOARCH)
}

// program is the filter: userfaultfd(2) and the ioctl that creates a userfaultfd
// from /dev/userfaultfd fail with EPERM; every other call, and every call of another
// architecture's ABI, is allowed.
func program(arch uint32) []unix.SockFilter {
	stmt := func(code uint16, k uint32) unix.SockFilter { return unix.SockFilter{Code: code, K: k} }
	jeq := func(k uint32, jt, jf uint8) unix.SockFilter {
		return unix.SockFilter{Code: unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K, Jt: jt, Jf: jf, K: k}
	}
	return []unix.SockFilter{
		stmt(unix.BPF_LD|unix.BPF_W|unix.BPF_ABS, offArch),
		jeq(arch, 0, 5), // another ABI: allow
		stmt(unix.BPF_LD|unix.BPF_W|unix.BPF_ABS, offNr),
		jeq(uint32(unix.SYS_USERFAULTFD), 4, 0),
		jeq(uint32(unix.SYS_IOCTL), 0, 2),
		stmt(unix.BPF_LD|unix.BPF_W|unix.BPF_ABS, offArg1),
		jeq(ioctlNewUserfaultfd, 1, 0),
		stmt(unix.BPF_RET|unix.BPF_K, unix.SECCOMP_RET_ALLOW),
		stmt(unix.BPF_RET|unix.BPF_K, errnoRet),
	}
}

// DenyUserfaultfd installs the filter on every thread of the process, for good (a
// process cannot remove a seccomp filter; its children and the programs it execs
// inherit it). It sets no_new_privs, which seccomp needs without CAP_SYS_ADMIN.
func DenyUserfaultfd() error {
	arch, err := auditArch()
	if err != nil {
		return err
	}
	prog := program(arch)
	fprog := unix.SockFprog{Len: uint16(len(prog)), Filter: &prog[0]}
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("seccomp: no_new_privs: %w", err)
	}
	_, _, e := unix.Syscall(unix.SYS_SECCOMP, unix.SECCOMP_SET_MODE_FILTER, unix.SECCOMP_FILTER_FLAG_TSYNC,
		uintptr(unsafe.Pointer(&fprog)))
	runtime.KeepAlive(prog)
	if e != 0 {
		return fmt.Errorf("seccomp: install the filter: %w", e)
	}
	return nil
}
