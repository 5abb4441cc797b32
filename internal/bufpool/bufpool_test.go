package bufpool

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestClasses(t *testing.T) {
	for _, n := range []int{1, 2, 3, 4095, 4096, 4097, 1 << 20} {
		b := Get(n)
		assert.Len(t, b, n)
		assert.GreaterOrEqual(t, cap(b), n)
		assert.Less(t, cap(b), 2*n+1, "at most one class up")
		Put(b)
	}
	assert.Nil(t, Get(0))
	big := Get(1<<maxClass + 1)
	assert.Len(t, big, 1<<maxClass+1)
	Put(big)             // not pooled, not an error
	Put(make([]byte, 3)) // not from Get: ignored
	b := Get(100)
	b[0] = 9
	Put(b)
	assert.Len(t, Get(128), 128, "a reused buffer gets the new length")
}
