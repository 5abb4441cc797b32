package pagefault

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Sentinel errors. Errors returned by this package wrap one of these or a unix.Errno.
var (
	// ErrExist means a page in the range was already present (EEXIST).
	ErrExist = errors.New("pagefault: page already present")
	// ErrAgain means a non-cooperative event is pending and the ioctl must be retried
	// once the event has been read (EAGAIN).
	ErrAgain = errors.New("pagefault: event pending, retry")
	// ErrUnmapped means the destination range is no longer registered or mapped.
	ErrUnmapped = errors.New("pagefault: range not registered or unmapped")
	// ErrClosed is returned by operations on a closed FD.
	ErrClosed = errors.New("pagefault: userfaultfd closed")
	// ErrUnsupported means the running kernel lacks a needed feature or ioctl.
	ErrUnsupported = errors.New("pagefault: not supported by this kernel")
)

// Mode says which kind of userfaultfd was created.
type Mode int

const (
	// ModeKernel reports faults taken in user and kernel mode (read(2) into a
	// registered range, GUP). Needs CAP_SYS_PTRACE, vm.unprivileged_userfaultfd=1 or
	// access to /dev/userfaultfd.
	ModeKernel Mode = iota
	// ModeUserOnly (UFFD_USER_MODE_ONLY) reports only user-mode faults; kernel-mode
	// accesses to missing pages of a registered range fail with EFAULT.
	ModeUserOnly
	// ModeNone: no userfaultfd at all (see ErrRefused); nothing is faulted on demand.
	ModeNone
)

// String names the mode.
func (m Mode) String() string {
	switch m {
	case ModeUserOnly:
		return "user-mode-only"
	case ModeNone:
		return "none"
	}
	return "kernel+user"
}

// ErrRefused is wrapped by Open's error when this process may not create a
// userfaultfd at all: the system call is refused (EPERM or EACCES from a seccomp
// filter, such as the default profiles of Docker and Podman, or from
// vm.unprivileged_userfaultfd where UFFD_USER_MODE_ONLY is missing too) or absent
// (ENOSYS, a kernel built without CONFIG_USERFAULTFD). A handshake that fails is not
// a refusal.
var ErrRefused = errors.New("pagefault: this process may not create a userfaultfd")

// FD is an open userfaultfd after the API handshake. Its ioctl methods are safe for
// concurrent use; Close must not race with them.
type FD struct {
	fd       int
	mode     Mode
	features Feature // negotiated
	ioctls   uint64
	source   string // "syscall" or "/dev/userfaultfd"
}

// Options configure Open.
type Options struct {
	// Features requested in the handshake. Features the kernel lacks are an error
	// wrapping ErrUnsupported.
	Features Feature
	// UserModeOnly forces UFFD_USER_MODE_ONLY even when kernel-mode faults are allowed.
	UserModeOnly bool
}

// Open creates a non-blocking, close-on-exec userfaultfd: the syscall first, then
// /dev/userfaultfd, then, if both are refused, UFFD_USER_MODE_ONLY. It then performs the
// UFFDIO_API handshake with opts.Features.
func Open(opts Options) (*FD, error) {
	fd, mode, src, err := create(opts.UserModeOnly)
	if err != nil {
		return nil, err
	}
	u := &FD{fd: fd, mode: mode, source: src}
	api := uffdioAPI{API: uffdAPI, Features: uint64(opts.Features)}
	if err := ioctl(fd, ioctlAPI, unsafe.Pointer(&api)); err != nil {
		_ = unix.Close(fd) // our own descriptor, never used
		if err == unix.EINVAL {
			return nil, fmt.Errorf("UFFDIO_API features %v: %w", opts.Features, ErrUnsupported)
		}
		return nil, fmt.Errorf("UFFDIO_API: %w", err)
	}
	u.features = Feature(api.Features)
	u.ioctls = api.Ioctls
	return u, nil
}

func create(forceUser bool) (fd int, mode Mode, src string, err error) {
	flags := uintptr(unix.O_CLOEXEC | unix.O_NONBLOCK)
	refused := func(call string, e unix.Errno) error { return fmt.Errorf("%w: %s: %w", ErrRefused, call, e) }
	first := unix.Errno(0) // why the full userfaultfd was refused
	if !forceUser {
		r, _, e := unix.Syscall(unix.SYS_USERFAULTFD, flags, 0, 0)
		switch e {
		case 0:
			return int(r), ModeKernel, "syscall", nil
		case unix.ENOSYS:
			return -1, 0, "", refused("userfaultfd", e)
		case unix.EPERM, unix.EACCES:
		default:
			return -1, 0, "", fmt.Errorf("userfaultfd: %w", e)
		}
		first = e
		if dev, derr := unix.Open("/dev/userfaultfd", unix.O_RDWR|unix.O_CLOEXEC, 0); derr == nil {
			r, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(dev), ioctlNew, flags)
			_ = unix.Close(dev) // only the new userfaultfd is kept
			if e == 0 {
				return int(r), ModeKernel, "/dev/userfaultfd", nil
			}
		}
	}
	r, _, e := unix.Syscall(unix.SYS_USERFAULTFD, flags|userModeOnly, 0, 0)
	switch {
	case e == 0:
		return int(r), ModeUserOnly, "syscall", nil
	case e == unix.EPERM || e == unix.EACCES || e == unix.ENOSYS:
		return -1, 0, "", refused("userfaultfd(UFFD_USER_MODE_ONLY)", e)
	case e == unix.EINVAL && first != 0:
		// A kernel before 5.11 does not know the flag: the first refusal stands.
		return -1, 0, "", refused("userfaultfd", first)
	}
	return -1, 0, "", fmt.Errorf("userfaultfd(UFFD_USER_MODE_ONLY): %w", e)
}

// Fd returns the file descriptor. It stays owned by the FD.
func (u *FD) Fd() int { return u.fd }

// Mode reports whether kernel-mode faults are delivered.
func (u *FD) Mode() Mode { return u.mode }

// Features returns the features the kernel reported in the handshake.
func (u *FD) Features() Feature { return u.features }

// Close closes the descriptor. Registrations die with it.
func (u *FD) Close() error {
	if u.fd < 0 {
		return ErrClosed
	}
	err := unix.Close(u.fd)
	u.fd = -1
	return err
}

// Register registers [start, start+length) (page aligned) and returns the ioctls the
// kernel allows on the range as a bit mask of ioctl ordinals.
func (u *FD) Register(start, length uintptr, mode RegisterMode) (uint64, error) {
	r := uffdioRegister{Range: uffdioRange{uint64(start), uint64(length)}, Mode: uint64(mode)}
	if err := ioctl(u.fd, ioctlRegister, unsafe.Pointer(&r)); err != nil {
		return 0, fmt.Errorf("UFFDIO_REGISTER %#x+%#x: %w", start, length, err)
	}
	return r.Ioctls, nil
}

// Unregister unregisters [start, start+length).
func (u *FD) Unregister(start, length uintptr) error {
	r := uffdioRange{uint64(start), uint64(length)}
	if err := ioctl(u.fd, ioctlUnregister, unsafe.Pointer(&r)); err != nil {
		return fmt.Errorf("UFFDIO_UNREGISTER %#x+%#x: %w", start, length, err)
	}
	return nil
}

// Wake wakes threads waiting on faults in [start, start+length).
func (u *FD) Wake(start, length uintptr) error {
	r := uffdioRange{uint64(start), uint64(length)}
	if err := ioctl(u.fd, ioctlWake, unsafe.Pointer(&r)); err != nil {
		return fmt.Errorf("UFFDIO_WAKE: %w", err)
	}
	return nil
}

// Copy atomically installs length bytes from src at dst (both page aligned) and wakes
// waiters unless dontWake. It returns the number of bytes installed. A partial copy
// (the kernel's EAGAIN with progress) returns fewer bytes and a nil error: call again
// from there. With no progress the error says why: ErrExist when the first page is
// present, ErrAgain while a non-cooperative event is pending.
func (u *FD) Copy(dst, src, length uintptr, dontWake bool) (uintptr, error) {
	c := uffdioCopy{Dst: uint64(dst), Src: uint64(src), Len: uint64(length)}
	if dontWake {
		c.Mode = copyModeDontWake
	}
	err := ioctl(u.fd, ioctlCopy, unsafe.Pointer(&c))
	return result("UFFDIO_COPY", c.Copy, err)
}

// Zeropage maps the zero page over [start, start+length); see Copy for the results.
func (u *FD) Zeropage(start, length uintptr, dontWake bool) (uintptr, error) {
	z := uffdioZeropage{Range: uffdioRange{uint64(start), uint64(length)}}
	if dontWake {
		z.Mode = zeropageModeDontWake
	}
	err := ioctl(u.fd, ioctlZeropage, unsafe.Pointer(&z))
	return result("UFFDIO_ZEROPAGE", z.Zeropage, err)
}

// Move atomically moves length bytes of pages from src to dst (UFFDIO_MOVE; dst must
// be registered on this userfaultfd and missing, both anonymous and private). With
// allowHoles, missing source pages are skipped instead of failing. Results as Copy.
func (u *FD) Move(dst, src, length uintptr, allowHoles bool) (uintptr, error) {
	m := uffdioMove{Dst: uint64(dst), Src: uint64(src), Len: uint64(length)}
	if allowHoles {
		m.Mode = moveModeAllowHoles
	}
	err := ioctl(u.fd, ioctlMove, unsafe.Pointer(&m))
	return result("UFFDIO_MOVE", m.Move, err)
}

// result interprets a mapping ioctl's signed result field (bytes done, or -errno).
func result(op string, done int64, err error) (uintptr, error) {
	if done > 0 {
		if err == unix.EAGAIN {
			err = nil // partial: the caller continues from the progress
		}
		return uintptr(done), classify(op, err)
	}
	return 0, classify(op, err)
}

func classify(op string, err error) error {
	switch err {
	case nil:
		return nil
	case unix.EEXIST:
		return ErrExist
	case unix.EAGAIN:
		return ErrAgain
	case unix.ENOENT, unix.EFAULT, unix.ESRCH:
		return fmt.Errorf("%s: %w (%v)", op, ErrUnmapped, err)
	case unix.EBADF:
		return ErrClosed
	}
	return fmt.Errorf("%s: %w", op, err)
}

func ioctl(fd int, req uintptr, arg unsafe.Pointer) error {
	if fd < 0 {
		return ErrClosed
	}
	_, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), req, uintptr(arg))
	if e != 0 {
		return e
	}
	return nil
}

// Msg is a decoded struct uffd_msg.
type Msg struct {
	Event Event
	// Pagefault: Flags (PagefaultFlag*), Address, and ThreadID with FeatureThreadID.
	Flags    uint64
	Address  uint64
	ThreadID uint32
	// Fork: the child's userfaultfd.
	UFD uint32
	// Remap: From, To, Len. Remove and Unmap: Start, End.
	From, To, Len uint64
	Start, End    uint64
	// ReadAt is when a CPUServer read the message (CLOCK_MONOTONIC); see
	// CPUServer.Since. Zero for messages decoded elsewhere.
	ReadAt time.Duration
}

// ErrShortMsg is returned by DecodeMsg for a buffer shorter than MsgSize.
var ErrShortMsg = errors.New("pagefault: short uffd_msg")

// DecodeMsg decodes one 32-byte uffd_msg.
func DecodeMsg(b []byte) (Msg, error) {
	if len(b) < MsgSize {
		return Msg{}, ErrShortMsg
	}
	le := binary.NativeEndian
	m := Msg{Event: Event(b[msgOffEvent])}
	a := b[msgOffArg:]
	switch m.Event {
	case EventPagefault:
		m.Flags, m.Address, m.ThreadID = le.Uint64(a), le.Uint64(a[8:]), le.Uint32(a[16:])
	case EventFork:
		m.UFD = le.Uint32(a)
	case EventRemap:
		m.From, m.To, m.Len = le.Uint64(a), le.Uint64(a[8:]), le.Uint64(a[16:])
	case EventRemove, EventUnmap, EventEvict:
		m.Start, m.End = le.Uint64(a), le.Uint64(a[8:])
	default:
		return m, fmt.Errorf("pagefault: unknown uffd event %#x", b[msgOffEvent])
	}
	return m, nil
}

// Has reports whether every bit of f is in s.
func (s Feature) Has(f Feature) bool { return s&f == f }

// String lists the features by their UFFD_FEATURE_ names.
func (s Feature) String() string {
	var names []string
	for i := range featureNames {
		if s&(1<<i) != 0 {
			names = append(names, featureNames[i])
		}
	}
	if rest := s &^ (featureLast<<1 - 1); rest != 0 {
		names = append(names, fmt.Sprintf("%#x", uint64(rest)))
	}
	if len(names) == 0 {
		return "none"
	}
	return strings.Join(names, "|")
}

// Probe describes what the running kernel offers, found once by a handshake on a
// throwaway userfaultfd (the way cilium/ebpf probes features).
type Probe struct {
	Mode     Mode    // the best mode this process may create
	Source   string  // "syscall" or "/dev/userfaultfd"
	Features Feature // every feature the kernel supports
	Ioctls   uint64  // API-level ioctls
	Err      error   // non-nil when no userfaultfd can be created at all
}

var probeOnce = probeCache[Probe]{probe: func() (Probe, bool) {
	u, err := Open(Options{})
	if err != nil {
		return Probe{Err: err}, transient(err)
	}
	defer func() { _ = u.Close() }() // a probe's throwaway descriptor
	return Probe{Mode: u.mode, Source: u.source, Features: u.features, Ioctls: u.ioctls}, false
}}

// ProbeKernel returns the cached kernel probe. A probe that failed for want of a
// resource (memory, descriptors) says nothing of the kernel: it is not cached, and
// the next call probes again.
func ProbeKernel() Probe { return probeOnce.get() }

// probeCache caches a probe's result unless the probe says it was transient.
type probeCache[T any] struct {
	mu    sync.Mutex
	done  bool
	v     T
	probe func() (T, bool)
}

func (c *probeCache[T]) get() T {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.done {
		v, again := c.probe()
		if again {
			return v
		}
		c.v, c.done = v, true
	}
	return c.v
}

// transient reports whether err is the want of a resource that may be there on
// the next try, not something the kernel lacks.
func transient(err error) bool {
	for _, e := range []error{unix.ENOMEM, unix.EMFILE, unix.ENFILE, unix.EAGAIN, unix.EINTR} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}

// PageSize is the system page size.
var PageSize = uintptr(os.Getpagesize())
