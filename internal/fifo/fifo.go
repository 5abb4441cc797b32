// Package fifo is an unbounded, closable FIFO queue for handing work between
// goroutines without either side blocking on the other's progress.
package fifo

import "sync"

// Queue is an unbounded FIFO. Push never blocks; Pop blocks until an item is queued or
// the queue is closed. Safe for concurrent use.
type Queue[T any] struct {
	mu     sync.Mutex
	cond   sync.Cond // on mu: signalled on Push and Close
	items  []T       // protected by mu
	head   int       // protected by mu
	closed bool      // protected by mu
}

// New returns an empty queue.
func New[T any]() *Queue[T] {
	q := &Queue[T]{}
	q.cond.L = &q.mu
	return q
}

// Push appends v and reports true, or reports false if the queue is closed.
func (q *Queue[T]) Push(v T) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.closed {
		return false
	}
	q.items = append(q.items, v)
	q.cond.Signal()
	return true
}

// Pop removes the oldest item, waiting for one. ok is false once the queue is closed
// and empty.
func (q *Queue[T]) Pop() (v T, ok bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	for q.head == len(q.items) && !q.closed {
		q.cond.Wait()
	}
	if q.head == len(q.items) {
		return v, false
	}
	return q.popLocked(), true
}

// TryPop removes the oldest item if there is one.
func (q *Queue[T]) TryPop() (v T, ok bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.head == len(q.items) {
		return v, false
	}
	return q.popLocked(), true
}

func (q *Queue[T]) popLocked() T {
	var zero T
	v := q.items[q.head]
	q.items[q.head] = zero
	q.head++
	if q.head == len(q.items) {
		q.items, q.head = q.items[:0], 0
	} else if q.head > 1024 && q.head*2 > len(q.items) {
		q.items, q.head = append(q.items[:0:0], q.items[q.head:]...), 0
	}
	return v
}

// Len returns the number of queued items.
func (q *Queue[T]) Len() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.items) - q.head
}

// Close closes the queue and returns the items still queued, which Pop will no longer
// return. Pushes after Close fail.
func (q *Queue[T]) Close() []T {
	q.mu.Lock()
	defer q.mu.Unlock()
	left := append([]T(nil), q.items[q.head:]...)
	q.items, q.head = nil, 0
	q.closed = true
	q.cond.Broadcast()
	return left
}

// CloseWrite stops further pushes; Pop returns the queued items, then ok=false.
func (q *Queue[T]) CloseWrite() {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.closed = true
	q.cond.Broadcast()
}
