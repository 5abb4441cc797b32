package odp

import (
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

func TestErrno(t *testing.T) {
	require.Equal(t, unix.Errno(0), Errno(nil))
	require.Equal(t, unix.EBUSY, Errno(wrap(ErrBusy, "PD has MR %#x", 7)))
	require.Equal(t, unix.EOPNOTSUPP, Errno(fmt.Errorf("odp: open: %w", ErrNotSupported)))
	require.Equal(t, unix.EFAULT, Errno(ErrBadAddress))
	require.Equal(t, unix.ENOENT, Errno(fmt.Errorf("open /x: %w", unix.ENOENT)))
	require.Equal(t, unix.EINVAL, Errno(errors.New("something else")))
}
