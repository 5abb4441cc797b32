package transport

import (
	"errors"
	"sync"

	"github.com/odpemu/odpemu/internal/fifo"
)

// ErrClosed is returned by a closed connection, or one whose peer closed.
var ErrClosed = errors.New("transport: connection closed")

// Conn is one RC connection's wire. Send hands a frame to the peer and takes ownership
// of it (its Release is called by the peer, or by the transport if undeliverable).
// Recv returns frames in the order the peer sent them. Send and Recv may be called
// concurrently with each other; Close may be called at any time, more than once.
type Conn interface {
	Send(f *Frame) error
	Recv() (*Frame, error)
	Close() error
}

// Loopback returns two connected in-process ends. Frames are passed by reference:
// payloads are not copied. Send never blocks (flow control is the requester's limit
// on outstanding work requests, as RC credits are).
func Loopback() (Conn, Conn) {
	ab, ba := fifo.New[*Frame](), fifo.New[*Frame]()
	return &loopEnd{in: ba, out: ab}, &loopEnd{in: ab, out: ba}
}

type loopEnd struct {
	in, out *fifo.Queue[*Frame]
	once    sync.Once
}

// Send implements Conn.
func (e *loopEnd) Send(f *Frame) error {
	if !e.out.Push(f) {
		f.Done()
		return ErrClosed
	}
	return nil
}

// Recv implements Conn.
func (e *loopEnd) Recv() (*Frame, error) {
	f, ok := e.in.Pop()
	if !ok {
		return nil, ErrClosed
	}
	return f, nil
}

// Close discards (and releases) frames not yet received, and makes the peer's Recv
// return ErrClosed once it has received what was already sent to it.
func (e *loopEnd) Close() error {
	e.once.Do(func() {
		for _, f := range e.in.Close() {
			f.Done()
		}
		e.out.CloseWrite()
	})
	return nil
}
