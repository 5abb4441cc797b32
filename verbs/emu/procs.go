package main

// The runtime's Ps while a program's threads wait for their completions in Go.

import (
	"runtime"
	"sync/atomic"
	"time"
)

// A thread that finds its send CQ empty with many sends in flight, or its CQ empty
// for 20 us with no send in flight (a receiver's), waits in Go (odpemu_wait_cq),
// holding no P meanwhile; one that polls or spins in C (a latency test's with its
// request in flight, one waiting for a completion channel) holds the P it last
// entered Go with (main.go). A program whose threads spend most of their time
// waiting in Go, as perftest's bandwidth clients do, leaves the engines and the port
// every P, and they run faster with one P fewer than the CPUs, as the odp package's
// do in one process: on this project's 2-CPU machines, with a second P the runtime
// keeps waking a thread to look for work that the first P's goroutines are about to
// run, on the CPU the other process needs. perftest's bandwidth tests
// between two processes moved more with this than with a P per CPU throughout in 17
// of 18 pairs (0.89-1.56 times as much, README), and its latency tests, whose threads
// wait in C for most of each round trip, kept their Ps.
//
// adaptProcs, started by dataPath, looks at the threads' waits every procsWindow:
// after two windows in a row in which they waited in Go at least half the time and
// none waited in C for long (odpemu_wait_in_c: a poll loop of the C library that
// found its CQ empty for 50 us and sleeps, a completion channel's read), the runtime
// gets one P fewer than the CPUs; after any other window, one per CPU. A change of
// GOMAXPROCS stops the world for some 20 us here; there is at most one a window. What
// it cannot see is a thread that waits in C without the library, spinning on memory
// the peer writes: a program that does that while another of its threads waits in Go
// would, with one P, leave the engines waiting each time it spins until the runtime's
// monitor takes the P back (20 us to 10 ms).
const procsWindow = 10 * time.Millisecond

// waitedNanos adds up the nanoseconds threads spent waiting in odpemu_wait_cq, and
// cWaits counts the long waits in C that threads began (odpemu_wait_in_c).
var (
	waitedNanos atomic.Int64
	cWaits      atomic.Int64
)

// procsAdapter is adaptProcs's decision: the Ps it gave the runtime last (procs), the
// run of windows in which the threads waited in Go at least half the time, and when
// the last window ended.
type procsAdapter struct {
	cpus, procs, run int
	last             time.Time
}

// tick ends the window at now, in which threads waited waited in Go and began inC
// long waits in C, and returns the Ps for the next window and whether they differ
// from the last window's.
func (a *procsAdapter) tick(now time.Time, waited time.Duration, inC int64) (procs int, changed bool) {
	window := now.Sub(a.last)
	a.last = now
	if window > 0 && waited*2 >= window && inC == 0 {
		a.run++
	} else {
		a.run = 0
	}
	procs = a.cpus
	if a.run >= 2 {
		procs = oneFewer(a.cpus)
	}
	changed, a.procs = procs != a.procs, procs
	return procs, changed
}

// adaptProcs sets the runtime's Ps window by window, from cpus per CPU (procsAdapter);
// it never returns.
func adaptProcs(cpus int) {
	a := procsAdapter{cpus: cpus, procs: runtime.GOMAXPROCS(0), last: time.Now()}
	for now := range time.Tick(procsWindow) {
		if procs, changed := a.tick(now, time.Duration(waitedNanos.Swap(0)), cWaits.Swap(0)); changed {
			runtime.GOMAXPROCS(procs)
		}
	}
}
