package odp

import (
	"errors"
	"fmt"

	"golang.org/x/sys/unix"
)

// Sentinel errors, usable with errors.Is. Each also matches the errno a verbs call
// returns in the same case (errors.Is(err, unix.EINVAL) and so on).
var (
	ErrInvalidArgument = &verbsError{"invalid argument", unix.EINVAL}
	ErrPermission      = &verbsError{"operation not permitted", unix.EPERM}
	ErrNoMemory        = &verbsError{"cannot allocate", unix.ENOMEM}
	ErrBusy            = &verbsError{"resource busy", unix.EBUSY}
	ErrClosed          = &verbsError{"device or object closed", unix.ENODEV}
	ErrQueueFull       = &verbsError{"work queue full", unix.ENOMEM}
	ErrQPState         = &verbsError{"operation not allowed in this QP state", unix.EINVAL}
	ErrNotSupported    = &verbsError{"operation not supported", unix.EOPNOTSUPP}

	// ErrNotMmapped: the memory is not a buffer from Device.Alloc (Discard needs one).
	ErrNotMmapped = &verbsError{"memory is not a buffer from Device.Alloc", unix.EFAULT}
	// ErrBadAddress: memory to register is not mapped, or not with the permissions the
	// access flags need (ib_umem_get's EFAULT: pinning for write fails on read-only
	// memory).
	ErrBadAddress = &verbsError{"memory not mapped with the needed permissions", unix.EFAULT}
	// ErrMemlockLimit: pinning would exceed RLIMIT_MEMLOCK (ib_umem_get's ENOMEM).
	ErrMemlockLimit = &verbsError{"pinned memory would exceed RLIMIT_MEMLOCK", unix.ENOMEM}
	// ErrCQOverrun: completions were lost because the CQ was full.
	ErrCQOverrun = &verbsError{"completion queue overrun", unix.EOVERFLOW}
	// ErrAddrInUse: the local address's RoCEv2 port (UDP 4791) is another socket's,
	// another process's on the same address, say: two processes on one host need two
	// addresses, as two hosts would have.
	ErrAddrInUse = &verbsError{"the local address's RoCEv2 port is in use", unix.EADDRINUSE}
)

type verbsError struct {
	msg   string
	errno unix.Errno
}

// Error returns the error's text.
func (e *verbsError) Error() string { return "odp: " + e.msg }

// Is makes a sentinel match its errno too.
func (e *verbsError) Is(target error) bool {
	errno, ok := target.(unix.Errno)
	return ok && errno == e.errno
}

// wrap annotates a sentinel with detail while keeping errors.Is working.
func wrap(sentinel error, format string, args ...any) error {
	return fmt.Errorf("%w: %s", sentinel, fmt.Sprintf(format, args...))
}

// errDeregistered is returned by DMA on an MR that is being deregistered.
var errDeregistered = wrap(ErrInvalidArgument, "MR deregistered")

// errDMAFault: a copy touched memory that is not mapped any more.
var errDMAFault = errors.New("odp: DMA touched unmapped memory")

// Errno is the errno value a verbs caller gets for err: the errno of the sentinel err
// wraps or of a system call error it carries, EINVAL for any other error, 0 for nil.
func Errno(err error) unix.Errno {
	var ve *verbsError
	var e unix.Errno
	switch {
	case err == nil:
		return 0
	case errors.As(err, &ve):
		return ve.errno
	case errors.As(err, &e):
		return e
	default:
		return unix.EINVAL
	}
}
