package clock

import (
	"fmt"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"math/rand/v2"

	"github.com/stretchr/testify/assert"
	"go.uber.org/goleak"
)

// The sleeper ends once no wait has come for a while: no goroutine outlives the
// tests.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// The wait never ends early, and a stop ends it.
func TestSleepUntil(t *testing.T) {
	for _, d := range []time.Duration{0, 10 * time.Microsecond, 300 * time.Microsecond, 12 * time.Millisecond} {
		deadline := time.Now().Add(d)
		assert.True(t, SleepUntil(deadline, nil))
		assert.False(t, time.Now().Before(deadline), "%v ended early", d)
	}
	stop := make(chan struct{})
	close(stop)
	t0 := time.Now()
	assert.False(t, SleepUntil(t0.Add(time.Hour), stop))
}

// Many goroutines wait at once for random deadlines, some stopped before theirs:
// none ends early, every stopped one reports false, and the sleeper forgets the
// stopped ones (a long wait stopped leaves nothing that keeps the sleeper).
func TestConcurrentWaits(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	var wg sync.WaitGroup
	for i := range 200 {
		d := time.Duration(rng.IntN(3000)) * time.Microsecond
		stopAfter := time.Duration(-1)
		if i%5 == 0 {
			stopAfter = time.Duration(rng.IntN(2000)) * time.Microsecond
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			deadline := time.Now().Add(d)
			var stop chan struct{}
			if stopAfter >= 0 {
				deadline = deadline.Add(time.Hour)
				stop = make(chan struct{})
				time.AfterFunc(stopAfter, func() { close(stop) })
			}
			ok := SleepUntil(deadline, stop)
			if stop != nil {
				assert.False(t, ok, "a wait of an hour ended by its stop")
				return
			}
			assert.True(t, ok)
			assert.False(t, time.Now().Before(deadline), "a wait of %v ended early", d)
		}()
	}
	wg.Wait()
	the.mu.Lock()
	left := len(the.waits)
	the.mu.Unlock()
	assert.Zero(t, left, "stopped waits are forgotten")
}

// A wait earlier than the one the sleeper sleeps for wakes it: it ends near its own
// deadline, not at the later one's.
func TestEarlierWaitWakesTheSleeper(t *testing.T) {
	stop := make(chan struct{})
	long := make(chan bool)
	go func() { long <- SleepUntil(time.Now().Add(time.Hour), stop) }()
	for { // the long wait is the sleeper's only one
		the.mu.Lock()
		asleep := the.running && !the.idle && len(the.waits) == 1
		the.mu.Unlock()
		if asleep {
			break
		}
		time.Sleep(time.Millisecond)
	}
	t0 := time.Now()
	assert.True(t, SleepUntil(t0.Add(2*time.Millisecond), nil))
	assert.Less(t, time.Since(t0), time.Second, "ended by its own deadline, not the hour's")
	close(stop)
	assert.False(t, <-long)
}

// Waits end near their deadlines while other goroutines yield in a loop on every P,
// as engines waiting for a run on the wire and applications polling their CQs do:
// a timerfd the netpoller would only see when a P found no work is backed by a Go
// timer, which a yielding P runs. Without the backstop three waits in four ended
// 2-10 ms late (about 10 ms at GOMAXPROCS=1: the runtime monitor's poll).
func TestWaitsBesideYieldingGoroutines(t *testing.T) {
	var stop atomic.Bool
	var wg sync.WaitGroup
	for range runtime.GOMAXPROCS(0) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for !stop.Load() {
				runtime.Gosched()
			}
		}()
	}
	late := make([]time.Duration, 200)
	for i := range late {
		deadline := time.Now().Add(216 * time.Microsecond)
		assert.True(t, SleepUntil(deadline, nil))
		late[i] = time.Since(deadline)
		assert.GreaterOrEqual(t, late[i], time.Duration(0), "ended early")
	}
	stop.Store(true)
	wg.Wait()
	slices.Sort(late)
	assert.Less(t, late[len(late)*3/4], time.Millisecond, "three waits in four end within a millisecond of their deadline "+
		"(median %v, the latest %v)", late[len(late)/2], late[len(late)-1])
}

// Waits of 220 us (a ConnectX-4 fault's hold) by n goroutines at once, as n QPs'
// faults hold at once: how late each ends, on average (overshoot-us), and how long
// a round of n takes over 220 us (round-us).
func BenchmarkConcurrentWaits(b *testing.B) {
	for _, n := range []int{1, 8, 32} {
		b.Run(fmt.Sprint(n), func(b *testing.B) {
			var late atomic.Int64
			var rounds time.Duration
			for range b.N {
				t0 := time.Now()
				var wg sync.WaitGroup
				for range n {
					wg.Add(1)
					go func() {
						defer wg.Done()
						deadline := time.Now().Add(220 * time.Microsecond)
						SleepUntil(deadline, nil)
						late.Add(int64(time.Since(deadline)))
					}()
				}
				wg.Wait()
				rounds += time.Since(t0)
			}
			b.ReportMetric(float64(late.Load())/float64(b.N*n)/1e3, "overshoot-us")
			b.ReportMetric(float64(rounds)/float64(b.N)/1e3, "round-us")
		})
	}
}
