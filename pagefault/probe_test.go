package pagefault

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"golang.org/x/sys/unix"
)

// A probe that failed for want of a resource is tried again; one that learnt
// something, even that a feature is missing, is kept.
func TestProbeCacheKeepsOnlyWhatWasLearnt(t *testing.T) {
	calls := 0
	c := probeCache[int]{probe: func() (int, bool) {
		calls++
		return calls, calls < 3 // out of descriptors twice, then an answer
	}}
	assert.Equal(t, 1, c.get())
	assert.Equal(t, 2, c.get())
	assert.Equal(t, 3, c.get())
	assert.Equal(t, 3, c.get(), "kept")
	assert.Equal(t, 3, calls)

	for _, err := range []error{unix.ENOMEM, unix.EMFILE, unix.ENFILE, fmt.Errorf("open: %w", unix.EAGAIN)} {
		assert.True(t, transient(err), "%v", err)
	}
	for _, err := range []error{nil, unix.EPERM, unix.ENOSYS, unix.EINVAL, ErrNotSupported} {
		assert.False(t, transient(err), "%v", err)
	}
}
