// Package clock waits precisely. Go's timers wake through the netpoller, whose
// timeout has millisecond resolution on these kernels: a 10 us time.Sleep or
// time.Timer lasts about a millisecond. The emulator's modelled latencies and RC
// timers (an RNR timer of 10 us) must not be rounded up to that, so they wait here.
package clock

import (
	"runtime"
	"time"

	"golang.org/x/sys/unix"
)

// slack is how much earlier than the deadline a nanosleep is made to end, the rest
// being spun away: nanosleep overshoots by tens of microseconds (timer slack,
// wake-up).
const slack = 100 * time.Microsecond

// chunk bounds one nanosleep, so that a stop is seen within it.
const chunk = 5 * time.Millisecond

// SleepUntil waits until deadline and reports true, or returns false as soon as
// stop is closed (checked at least every 5 ms). It sleeps in nanosleep, a blocking
// system call whose thread gives up its P, then yields the last 100 us away, so
// other goroutines run meanwhile. A nil stop never closes.
func SleepUntil(deadline time.Time, stop <-chan struct{}) bool {
	for {
		select {
		case <-stop:
			return false
		default:
		}
		d := time.Until(deadline) - slack
		if d <= 0 {
			break
		}
		ts := unix.NsecToTimespec(int64(min(d, chunk)))
		_ = unix.Nanosleep(&ts, nil) // EINTR: the loop sleeps again
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
