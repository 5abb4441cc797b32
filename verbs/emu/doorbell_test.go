package main

import (
	"os"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// waiting reports whether a thread waits for c's doorbell in wait.
func waiting(c *completionQueue) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.rung != nil
}

// TestDoorbellWait: odpemu_wait_cq's wait ends when the armed doorbell rings, for every
// thread waiting, and ends at once when it rang before; with no ring it ends when its
// time is up, and a later ring still sets the doorbell. c.ring is what the CQ's next
// completion calls (RequestNotify), c.ringing what a poll that emptied the CQ sets (arm).
func TestDoorbellWait(t *testing.T) {
	t.Run("ring", func(t *testing.T) {
		var bell uint32
		c := &completionQueue{bell: &bell, ringing: true}
		const waiters = 3
		done := make(chan bool, waiters)
		for range waiters {
			go func() { done <- c.wait(10 * time.Second) }()
		}
		for !waiting(c) {
			runtime.Gosched()
		}
		c.ring()
		for range waiters {
			require.True(t, <-done, "the ring ended the wait, not its 10 s")
		}
		require.EqualValues(t, 1, atomic.LoadUint32(&bell), "the doorbell is set")
		require.False(t, waiting(c))
	})
	t.Run("rang before", func(t *testing.T) {
		var bell uint32
		c := &completionQueue{bell: &bell, ringing: true}
		c.ring()
		require.True(t, c.wait(time.Hour), "nothing to wait for")
		require.False(t, waiting(c))
	})
	t.Run("not armed", func(t *testing.T) {
		c := &completionQueue{}
		require.True(t, c.wait(time.Hour))
	})
	t.Run("time up", func(t *testing.T) {
		var bell uint32
		c := &completionQueue{bell: &bell, ringing: true}
		require.False(t, c.wait(time.Millisecond), "no ring")
		require.Zero(t, atomic.LoadUint32(&bell))
		c.ring()
		require.EqualValues(t, 1, atomic.LoadUint32(&bell), "a ring after the wait still sets the doorbell")
		require.False(t, waiting(c))
	})
	t.Run("channel and doorbell", func(t *testing.T) {
		var bell uint32
		events := 0
		c := &completionQueue{bell: &bell, ringing: true, channel: func() { events++ }}
		done := make(chan bool, 1)
		go func() { done <- c.wait(10 * time.Second) }()
		for !waiting(c) {
			runtime.Gosched()
		}
		c.ring()
		require.True(t, <-done)
		require.Equal(t, 1, events, "the channel's event is written too")
	})
}

// TestDataPathProcs: the runtime has one P fewer than the CPUs until a thread posts or
// polls through the library, and one per CPU from then on (main.go).
func TestDataPathProcs(t *testing.T) {
	if os.Getenv("GOMAXPROCS") != "" {
		t.Skip("GOMAXPROCS is set: it decides")
	}
	if raised.Load() {
		t.Skip("dataPath ran in this process already")
	}
	require.Equal(t, max(1, runtime.NumCPU()-1), runtime.GOMAXPROCS(0), "before the data path")
	dataPath()
	require.Equal(t, runtime.NumCPU(), runtime.GOMAXPROCS(0), "once a thread posts or polls")
	dataPath()
	require.Equal(t, runtime.NumCPU(), runtime.GOMAXPROCS(0))
}
