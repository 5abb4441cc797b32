package fifo

import (
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestOrderAndClose(t *testing.T) {
	q := New[int]()
	for i := 0; i < 3000; i++ {
		assert.True(t, q.Push(i))
	}
	for i := 0; i < 2000; i++ {
		v, ok := q.Pop()
		assert.True(t, ok)
		assert.Equal(t, i, v)
	}
	assert.Equal(t, 1000, q.Len())
	left := q.Close()
	assert.Len(t, left, 1000)
	assert.Equal(t, 2000, left[0])
	assert.False(t, q.Push(1))
	_, ok := q.Pop()
	assert.False(t, ok)
}

func TestCloseWriteDrains(t *testing.T) {
	q := New[string]()
	q.Push("a")
	q.CloseWrite()
	v, ok := q.Pop()
	assert.True(t, ok)
	assert.Equal(t, "a", v)
	_, ok = q.Pop()
	assert.False(t, ok)
	_, ok = q.TryPop()
	assert.False(t, ok)
}

func TestPopWakesOnPushAndClose(t *testing.T) {
	q := New[int]()
	var wg sync.WaitGroup
	got := make(chan int, 100)
	for w := 0; w < 4; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				v, ok := q.Pop()
				if !ok {
					return
				}
				got <- v
			}
		}()
	}
	for i := 0; i < 100; i++ {
		q.Push(i)
	}
	sum := 0
	for i := 0; i < 100; i++ {
		sum += <-got
	}
	q.Close()
	wg.Wait()
	assert.Equal(t, 4950, sum)
}
