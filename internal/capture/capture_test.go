package capture

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A capture's cleanup stops tshark and the dumpcap it started: no process of its
// process group is left capturing on the interface (a zombie, dead but not yet
// reaped by init, captures nothing).
func TestCleanupStopsDumpcap(t *testing.T) {
	for _, live := range []bool{false, true} {
		var pgid int
		t.Run(map[bool]string{false: "file", true: "live"}[live], func(t *testing.T) {
			if live {
				pgid = StartLive(t, "lo", "udp port 9", nil, "frame.number").cmd.Process.Pid
			} else {
				pgid = Start(t, "lo", "udp port 9", 0).cmd.Process.Pid
			}
			require.NotEmpty(t, running(t, pgid), "the capture runs in a process group of its own")
		})
		if pgid != 0 {
			// SIGKILL is delivered when the process next runs: it dies soon after.
			assert.Eventually(t, func() bool { return len(running(t, pgid)) == 0 }, time.Minute, 10*time.Millisecond,
				"processes of the capture's group outlived its cleanup")
		}
	}
}

// running returns the commands of the processes of group pgid that are not
// zombies.
func running(t *testing.T, pgid int) []string {
	stats, err := filepath.Glob("/proc/[0-9]*/stat")
	require.NoError(t, err)
	var out []string
	for _, p := range stats {
		b, err := os.ReadFile(p)
		if err != nil {
			continue // it exited meanwhile
		}
		s := string(b)
		end := strings.LastIndexByte(s, ')')
		if end < 0 {
			continue
		}
		// After the command: state, ppid, pgrp.
		f := strings.Fields(s[end+1:])
		if len(f) < 3 || f[0] == "Z" {
			continue
		}
		if g, _ := strconv.Atoi(f[2]); g == pgid {
			out = append(out, s[strings.IndexByte(s, '(')+1:end])
		}
	}
	return out
}
