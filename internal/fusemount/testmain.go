package fusemount

import (
	"fmt"
	"os"
	"testing"
)

// TestMain runs a test binary's tests between two checks: stale odpemu mounts of
// dead processes (a test binary that panicked) are removed before, and the binary
// fails if it still serves a mount after (it would be left behind when it exits).
// Mounts it left are then aborted and detached, so that nothing outlives it.
func TestMain(m *testing.M) int {
	if n, err := CleanStale(); err != nil {
		fmt.Fprintf(os.Stderr, "fusemount: cleaning stale mounts: %v\n", err)
	} else if n > 0 {
		fmt.Fprintf(os.Stderr, "fusemount: removed %d stale odpemu mounts of dead processes\n", n)
	}
	code := m.Run()
	left, err := Leftover()
	if err != nil {
		fmt.Fprintf(os.Stderr, "fusemount: %v\n", err)
		return max(code, 1)
	}
	for _, in := range left {
		fmt.Fprintf(os.Stderr, "FAIL: FUSE mount %s (connection %d) left mounted by the tests\n", in.Dir, in.Conn)
		if err := abortAndDetach(in.Dir); err != nil {
			fmt.Fprintf(os.Stderr, "fusemount: %v\n", err)
		}
		code = max(code, 1)
	}
	return code
}
