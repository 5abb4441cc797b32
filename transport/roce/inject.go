package roce

import (
	"errors"
	"math/rand/v2"
	"net/netip"
	"sync"
	"sync/atomic"
)

// injector applies a Loss to what a port sends.
type injector struct {
	loss Loss

	mu     sync.Mutex // protects rng and the held packet
	rng    *rand.Rand
	held   []byte
	heldTo netip.AddrPort

	dropped, doubled, reordered atomic.Uint64
}

func newInjector(loss Loss) *injector {
	return &injector{loss: loss, rng: rand.New(rand.NewPCG(loss.Seed, 0x726f6365))}
}

// send passes the encoded packet b for dst to write, or drops, doubles or holds it
// back. A held packet is copied (b is the caller's buffer) and goes out after the
// next one.
func (in *injector) send(b []byte, dst netip.AddrPort, write func([]byte, netip.AddrPort) error) error {
	if !in.loss.active() {
		return write(b, dst)
	}
	in.mu.Lock()
	defer in.mu.Unlock()
	held, heldTo := in.held, in.heldTo
	in.held = nil
	var err error
	switch r := in.rng.Float64(); {
	case r < in.loss.Drop:
		in.dropped.Add(1)
	case r < in.loss.Drop+in.loss.Duplicate:
		in.doubled.Add(1)
		err = errors.Join(write(b, dst), write(b, dst))
	case r < in.loss.Drop+in.loss.Duplicate+in.loss.Reorder && held == nil:
		in.reordered.Add(1)
		in.held, in.heldTo = append([]byte(nil), b...), dst
	default:
		err = write(b, dst)
	}
	if held != nil {
		err = errors.Join(err, write(held, heldTo))
	}
	return err
}

func (in *injector) stats(s *LinkStats) {
	s.Dropped, s.Doubled, s.Reordered = in.dropped.Load(), in.doubled.Load(), in.reordered.Load()
}

// encode encodes p for ep into a pooled buffer and passes it to send, which must not
// keep it.
func encode(p *Packet, ep Endpoints, send func([]byte) error) error {
	bp := sendBufs.Get().(*[]byte)
	defer sendBufs.Put(bp)
	b, err := p.Append((*bp)[:0], ep)
	*bp = b
	if err != nil {
		return err
	}
	return send(b)
}
