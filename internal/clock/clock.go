// Package clock waits precisely. Go's timers wake through the netpoller, whose
// timeout has millisecond resolution on these kernels: a 10 us time.Sleep or
// time.Timer lasts about a millisecond. The emulator's modelled latencies and RC
// timers (an RNR timer of 10 us) must not be rounded up to that, so they wait here.
//
// Waits of more than a few tens of microseconds are kept by one sleeper goroutine:
// it arms a timerfd (an hrtimer, which the kernel fires without timer slack) for the
// earliest deadline and reads it through the netpoller, so it holds no P while it
// waits, and it wakes each waiter shortly before its deadline; the waiters are
// parked meanwhile, hold no P either, and yield through their last microseconds. A
// goroutine that slept in a system call itself would keep its P until the runtime's
// monitor took it back, tens of microseconds to milliseconds later: with more
// sleepers than Ps, waits that should overlap ran one after another (eight 220 us
// waits at once ended 260 us late each on 2 CPUs). The sleeper starts with the
// first wait and ends once no wait has come for a while.
//
// The netpoller sees the timerfd fire only when a P looks for work and finds none,
// or when the runtime's monitor polls, up to 10 ms later. While goroutines yield in
// a loop (an engine waiting for a run on the wire, an application polling its CQ,
// a waiter's last microseconds) every P always finds work, and 216 us waits beside
// one such goroutine on 2 CPUs ended 2 ms late on average (a tenth of them 3.8 ms or
// more). So each waiter also arms a Go timer for the same wake-up: the runtime
// runs due timers each time a P schedules, which a yielding P does all the time,
// and when the Ps are idle, which is when a Go timer can be a millisecond late, the
// timerfd wakes the waiter first. Whichever comes first ends the wait.
//
// # Lock order
//
//	sleeper.mu   the waits, the timerfd's setting and the sleeper's state
package clock

import (
	"container/heap"
	"os"
	"runtime"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// ahead is how long before its deadline a wait is woken: the netpoller's wake-up of
// the sleeper and the sleeper's of the waiter take tens of microseconds on a VM, and
// the waiter yields until its deadline itself. On this project's 2-CPU VMs, whose
// idle CPUs take long to wake, waits of 220 us (an idle process, 300 each, one P and
// two) ended 12-14 us late at the median and 32-35 at the 90th percentile with 40 us
// ahead, 0.2 us and 4-9 with 100; waits of 1 ms 40-55 and 70 late with 40, 0.3-14 and
// 15-42 with 100. The emulated ConnectX-4 fault (220 us, odp-exp's validate, three
// repetitions) took 233-360 us with 40, 229-231 with 100. A wait yields through its
// last 100 us, which goroutines with work to do take from it. A wait no longer than
// ahead is not handed to the sleeper, which would wake it at once: it yields
// throughout.
const ahead = 100 * time.Microsecond

// linger is how long the sleeper stays after its last wait before it ends.
const linger = 50 * time.Millisecond

// SleepUntil waits until deadline and reports true, or returns false as soon as
// stop is closed. A wait of more than ahead parks the goroutine, holding no P, until
// the sleeper or its Go timer wakes it ahead of its deadline, and yields
// through the rest; a shorter one yields in a loop. A nil stop never closes. It
// never returns true before the deadline.
func SleepUntil(deadline time.Time, stop <-chan struct{}) bool {
	if d := time.Until(deadline); d > ahead {
		w := the.add(deadline)
		backstop := time.NewTimer(d - ahead) // see the package doc
		select {
		case <-w.done:
		case <-backstop.C:
			the.cancel(w)
		case <-stop:
			backstop.Stop()
			the.cancel(w)
			return false
		}
		backstop.Stop()
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

// sleeper keeps the waits. mu protects every field.
type sleeper struct {
	mu      sync.Mutex
	waits   waits
	running bool     // the sleeper goroutine runs and owns tfd
	tfd     *os.File // its timerfd, armed for the earliest wake-up or, idle, for the end of linger
	fd      int      // tfd's descriptor (os.File.Fd would make tfd blocking: its reads would hold a P)
	idle    bool     // armed for linger: no wait
}

// the is the process's sleeper.
var the sleeper

// add registers a wait for deadline, starting the sleeper or arming its timer
// earlier if the wait is earlier than every other.
func (s *sleeper) add(deadline time.Time) *wait {
	w := &wait{at: deadline, done: make(chan struct{})}
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.running {
		fd, err := unix.TimerfdCreate(unix.CLOCK_MONOTONIC, unix.TFD_NONBLOCK|unix.TFD_CLOEXEC)
		if err != nil {
			// No timerfd: the wait is kept by a goroutine of its own, as precisely
			// as a system call in it allows.
			go func() { nanosleepUntil(deadline); close(w.done) }()
			return w
		}
		s.tfd, s.fd, s.running = os.NewFile(uintptr(fd), "clock-timerfd"), fd, true
		heap.Push(&s.waits, w)
		s.armLocked()
		go s.run(s.tfd)
		return w
	}
	heap.Push(&s.waits, w)
	if w.index == 0 {
		s.armLocked()
	}
	return w
}

// cancel forgets w (its waiter stopped waiting); if w was the earliest, the timer is
// armed for the next wait, or for the end of linger.
func (s *sleeper) cancel(w *wait) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if w.index < 0 {
		return
	}
	first := w.index == 0
	heap.Remove(&s.waits, w.index)
	if first && s.running {
		s.armLocked()
	}
}

// armLocked arms the timerfd for the earliest wait's wake-up (ahead of its
// deadline), or for linger when there is none. Needs s.mu, and s.running.
func (s *sleeper) armLocked() {
	d := linger
	s.idle = len(s.waits) == 0
	if !s.idle {
		d = time.Until(s.waits[0].at.Add(-ahead))
	}
	d = max(d, time.Nanosecond) // a zero it_value disarms the timer: fire at once
	spec := unix.ItimerSpec{Value: unix.NsecToTimespec(int64(d))}
	_ = unix.TimerfdSettime(s.fd, 0, &spec, nil) // cannot fail on a valid timerfd and value
}

// run is the sleeper: it reads its timerfd through the netpoller (parked, holding
// no P) until the timer fires, wakes the waits whose deadline is less than ahead
// away, and arms the timer for the next; armed for linger with no wait left, it ends
// when that fires. tfd is its timerfd, closed as it ends.
func (s *sleeper) run(tfd *os.File) {
	var buf [8]byte
	for {
		_, _ = tfd.Read(buf[:]) // the expirations; EAGAIN cannot reach here (the poller waits)
		s.mu.Lock()
		if s.idle && len(s.waits) == 0 {
			s.running, s.tfd = false, nil
			s.mu.Unlock()
			_ = tfd.Close()
			return
		}
		soon := time.Now().Add(ahead)
		for len(s.waits) > 0 && !s.waits[0].at.After(soon) {
			close(heap.Pop(&s.waits).(*wait).done)
		}
		s.armLocked()
		s.mu.Unlock()
	}
}

// nanosleepUntil sleeps in nanosleep until deadline, then yields until it: the
// wait of a goroutine that cannot use the sleeper.
func nanosleepUntil(deadline time.Time) {
	for d := time.Until(deadline) - ahead; d > 0; d = time.Until(deadline) - ahead {
		ts := unix.NsecToTimespec(int64(d))
		_ = unix.Nanosleep(&ts, nil) // EINTR: the loop sleeps again
	}
	for time.Now().Before(deadline) {
		runtime.Gosched()
	}
}
