package clock

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
)

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
