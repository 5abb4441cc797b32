// Package clock waits precisely. Go's timers wake through the netpoller, whose
// timeout has millisecond resolution on these kernels: a 10 us time.Sleep or
// time.Timer lasts about a millisecond. The emulator's modelled latencies and RC
// timers (an RNR timer of 10 us) must not be rounded up to that, so they wait here.
//
// Waits of more than a few tens of microseconds are kept by one sleeper goroutine on
// an OS thread of its own, which sleeps in ppoll(2) until the earliest deadline
// (with the thread's timer slack at 1 ns, so that the kernel does not round the
// wake-up) and wakes each waiter when its deadline has passed; the waiters are parked
// meanwhile and hold no P; each is woken a little before its deadline and yields
// until it. A goroutine that slept in the system call itself would
// keep its P until the runtime's monitor took it back, tens of microseconds to
// milliseconds later: with more sleepers than Ps, waits that should overlap ran one
// after another (eight 220 us waits at once ended 260 us late each on 2 CPUs). The
// sleeper starts with the first wait and ends once no wait is left for a while.
//
// # Lock order
//
//	sleeper.mu   the waits and the sleeper's state; held for no system call
package clock

import (
	"container/heap"
	"runtime"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// spinBelow is the shortest wait handed to the sleeper: shorter waits yield until
// their deadline, since a sleeper's wake-up (a system call and a goroutine's
// scheduling) costs about as much.
const spinBelow = 30 * time.Microsecond

// early is how much before a deadline the sleeper's ppoll ends, the rest being
// spun on its own thread: the kernel's wake-up of a sleeping thread takes some
// microseconds on a VM, and a wait must not end late by them.
const early = 15 * time.Microsecond

// ahead is how long before its deadline a wait is woken: a woken goroutine takes
// tens of microseconds to run again on a VM (another thread must pick it up), and it
// yields until its deadline itself.
const ahead = 40 * time.Microsecond

// linger is how long the sleeper stays after its last wait before it ends.
const linger = 50 * time.Millisecond

// SleepUntil waits until deadline and reports true, or returns false as soon as
// stop is closed. A wait of more than spinBelow parks the goroutine, holding no P,
// until the sleeper wakes it at its deadline; a shorter one yields in a loop. A nil
// stop never closes. It never returns true before the deadline.
func SleepUntil(deadline time.Time, stop <-chan struct{}) bool {
	if time.Until(deadline) > spinBelow {
		w := the.add(deadline)
		select {
		case <-w.done:
		case <-stop:
			the.cancel(w)
			return false
		}
	}
	for time.Now().Before(deadline) {
		select {
		case <-stop:
			return false
		default:
		}
		runtime.Gosched()
	}
	return true
}

// wait is one goroutine's deadline; done closes when the sleeper has seen it come
// within ahead of now.
type wait struct {
	at    time.Time
	done  chan struct{}
	index int // in the heap, -1 once out of it
}

// waits is a min-heap of waits by deadline (container/heap).
type waits []*wait

func (h waits) Len() int           { return len(h) }
func (h waits) Less(i, j int) bool { return h[i].at.Before(h[j].at) }
func (h waits) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].index, h[j].index = i, j
}
func (h *waits) Push(x any) { w := x.(*wait); w.index = len(*h); *h = append(*h, w) }
func (h *waits) Pop() any {
	old := *h
	w := old[len(old)-1]
	old[len(old)-1] = nil
	w.index = -1
	*h = old[:len(old)-1]
	return w
}

// sleeper keeps the waits. mu protects every field; efd is the eventfd that wakes
// its ppoll early (a wait earlier than the one it sleeps for, or its first wait).
type sleeper struct {
	mu      sync.Mutex
	waits   waits
	running bool      // the sleeper goroutine runs (and owns efd)
	target  time.Time // the deadline its ppoll sleeps until; zero: none (idle)
	efd     int
}

// the is the process's sleeper.
var the sleeper

// add registers a wait for deadline, starting the sleeper or waking it if the wait
// is earlier than the one it sleeps for.
func (s *sleeper) add(deadline time.Time) *wait {
	w := &wait{at: deadline, done: make(chan struct{})}
	s.mu.Lock()
	heap.Push(&s.waits, w)
	switch {
	case !s.running:
		efd, err := unix.Eventfd(0, unix.EFD_NONBLOCK|unix.EFD_CLOEXEC)
		if err != nil {
			// No eventfd: the wait is kept by a goroutine of its own, as precisely
			// as a system call in it allows.
			heap.Remove(&s.waits, w.index)
			s.mu.Unlock()
			go func() { nanosleepUntil(deadline); close(w.done) }()
			return w
		}
		s.running, s.efd, s.target = true, efd, time.Time{}
		go s.run(efd)
	case s.target.IsZero() || deadline.Before(s.target):
		s.kickLocked()
	}
	s.mu.Unlock()
	return w
}

// cancel forgets w (its waiter stopped waiting). If the sleeper slept for w, it
// wakes to sleep for the next wait instead, or to end after linger without one.
func (s *sleeper) cancel(w *wait) {
	s.mu.Lock()
	if w.index >= 0 {
		heap.Remove(&s.waits, w.index)
		if s.running && w.at.Equal(s.target) {
			s.kickLocked()
		}
	}
	s.mu.Unlock()
}

// kickLocked ends the sleeper's ppoll. Needs s.mu.
func (s *sleeper) kickLocked() {
	one := [8]byte{1}
	_, _ = unix.Write(s.efd, one[:]) // EAGAIN: a kick is pending already
}

// run is the sleeper: on a thread of its own with a timer slack of 1 ns, it wakes
// the waits whose deadline is less than ahead away and sleeps until the next one's
// is, until none has come for linger.
func (s *sleeper) run(efd int) {
	// The timer slack is the thread's, so the sleeper keeps to its thread, and
	// gives it back as it found it: a goroutine that ends locked ends its thread
	// too, and a child process started from that thread with a parent-death signal
	// (Pdeathsig, as the packet captures of the tests start tshark) would be killed.
	runtime.LockOSThread()
	_ = unix.Prctl(unix.PR_SET_TIMERSLACK, 1, 0, 0, 0)
	defer runtime.UnlockOSThread()
	defer func() { _ = unix.Prctl(unix.PR_SET_TIMERSLACK, 0, 0, 0, 0) }() // 0: the thread's default
	idleSince := time.Now()
	for {
		s.mu.Lock()
		now := time.Now()
		for len(s.waits) > 0 && !s.waits[0].at.After(now.Add(ahead)) {
			close(heap.Pop(&s.waits).(*wait).done)
		}
		var next time.Time
		if len(s.waits) > 0 {
			next, idleSince = s.waits[0].at, now
		} else if now.Sub(idleSince) >= linger {
			s.running = false
			s.mu.Unlock()
			_ = unix.Close(efd)
			return
		}
		s.target = next
		s.mu.Unlock()
		timeout := linger - now.Sub(idleSince) // idle: until the sleeper may end
		if !next.IsZero() {
			next = next.Add(-ahead) // when the next wait is woken
			timeout = next.Sub(now) - early
		}
		if timeout > 0 {
			ts := unix.NsecToTimespec(int64(timeout))
			_, _ = unix.Ppoll([]unix.PollFd{{Fd: int32(efd), Events: unix.POLLIN}}, &ts, nil) // EINTR: the loop looks again
			var buf [8]byte
			_, _ = unix.Read(efd, buf[:]) // the kick, if any: EAGAIN otherwise
			continue
		}
		// The last microseconds before next are spun, on this thread; a wait
		// added meanwhile for an earlier deadline ends at most early late.
		for time.Now().Before(next) {
			runtime.Gosched()
		}
	}
}

// nanosleepUntil sleeps in nanosleep until deadline, then yields until it: the
// wait of a goroutine that cannot use the sleeper.
func nanosleepUntil(deadline time.Time) {
	for d := time.Until(deadline) - early; d > 0; d = time.Until(deadline) - early {
		ts := unix.NsecToTimespec(int64(d))
		_ = unix.Nanosleep(&ts, nil) // EINTR: the loop sleeps again
	}
	for time.Now().Before(deadline) {
		runtime.Gosched()
	}
}
