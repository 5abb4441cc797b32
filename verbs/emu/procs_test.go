package main

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestProcsAdapter: one P fewer than the CPUs after two windows in a row in which the
// threads waited in Go at least half the time and none waited in C for long, one
// per CPU again after any other window, a change reported once.
func TestProcsAdapter(t *testing.T) {
	t0 := time.Unix(1000, 0)
	w := procsWindow
	a := procsAdapter{cpus: 4, procs: 4, last: t0}
	steps := []struct {
		waited  time.Duration
		inC     int64
		procs   int
		changed bool
		why     string
	}{
		{w / 2, 0, 4, false, "one window of waits is not a run"},
		{w, 0, 3, true, "two in a row: one P fewer"},
		{w, 0, 3, false, "still waiting: no change"},
		{w/2 - 1, 0, 4, true, "a window with less waiting: a P per CPU again"},
		{w, 0, 4, false, "one window again"},
		{2 * w, 0, 3, true, "waits that ended in this window count whole"},
		{w, 1, 4, true, "a thread began to wait in C"},
		{w, 0, 4, false, "the run starts again"},
		{w, 0, 3, true, "two in a row"},
		{0, 0, 4, true, "no waits"},
	}
	now := t0
	for i, s := range steps {
		now = now.Add(w)
		procs, changed := a.tick(now, s.waited, s.inC)
		require.Equal(t, s.procs, procs, "step %d: %s", i, s.why)
		require.Equal(t, s.changed, changed, "step %d: %s", i, s.why)
	}
	one := procsAdapter{cpus: 1, procs: 1, last: t0}
	for i := 1; i <= 3; i++ {
		procs, changed := one.tick(t0.Add(time.Duration(i)*w), w, 0)
		require.Equal(t, 1, procs, "never no P")
		require.False(t, changed)
	}
	stalled := procsAdapter{cpus: 2, procs: 2, last: t0}
	procs, _ := stalled.tick(t0, 0, 0)
	require.Equal(t, 2, procs, "an empty window is not one of waits")
}
