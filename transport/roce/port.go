package roce

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"sync"
	"sync/atomic"

	"github.com/odpemu/odpemu/internal/fifo"
)

// Port is one QP's end of the wire: it sends packets to the peer QP and receives
// the peer's. A Link reaches a peer over UDP (Link.Dial); Pipe joins two ports in one
// process. Both carry the same encoded packets, ICRC included, so one protocol
// engine serves both. Send and Recv are safe for concurrent use; Close may be
// called more than once.
type Port interface {
	// SendBatch encodes pkts and puts them on the wire, in order (through the
	// fault injector).
	SendBatch(pkts []Packet) error
	// RecvBatch waits for packets from the peer and decodes up to len(bufs) of
	// them into pkts, one per buffer: pkts[i].Payload aliases bufs[i], which must
	// hold BufferSize(Limits()) bytes. It returns how many; datagrams that do not
	// decode are counted and skipped. It fails once the port is closed or, for a
	// Pipe, the peer's end is closed and drained.
	RecvBatch(bufs [][]byte, pkts []Packet) (int, error)
	// Limits are what RecvBatch accepts.
	Limits() Limits
	// Stats returns the port's counters.
	Stats() LinkStats
	Close() error
}

// ErrClosed is returned by a Port whose end, or whose Pipe peer, is closed.
var ErrClosed = errors.New("roce: port closed")

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

// Dial returns the Link's port to the QP at peer: it sends there and receives only
// what comes from there (other senders' packets are counted as Foreign and dropped).
// Closing the port closes the Link.
func (l *Link) Dial(peer netip.AddrPort) Port {
	return &linkPort{l: l, peer: netip.AddrPortFrom(peer.Addr().Unmap(), peer.Port())}
}

type linkPort struct {
	l     *Link
	peer  netip.AddrPort
	froms []netip.AddrPort
}

func (p *linkPort) SendBatch(pkts []Packet) error { return p.l.SendBatch(pkts, p.peer) }
func (p *linkPort) Limits() Limits                { return p.l.lim }
func (p *linkPort) Stats() LinkStats              { return p.l.Stats() }
func (p *linkPort) Close() error                  { return p.l.Close() }

func (p *linkPort) RecvBatch(bufs [][]byte, pkts []Packet) (int, error) {
	if len(p.froms) < len(bufs) {
		p.froms = make([]netip.AddrPort, len(bufs))
	}
	for {
		n, err := p.l.RecvBatch(bufs, pkts, p.froms)
		if err != nil {
			return 0, err
		}
		kept := 0
		for i := 0; i < n; i++ {
			if p.froms[i] != p.peer {
				p.l.foreign.Add(1)
				continue
			}
			// Keep packet i in slot kept, with the buffer its payload aliases.
			pkts[kept] = pkts[i]
			bufs[kept], bufs[i] = bufs[i], bufs[kept]
			kept++
		}
		if kept > 0 {
			return kept, nil
		}
	}
}

// The addresses a Pipe's two ends put in the ICRC's pseudo-header.
var pipeAddrs = [2]netip.AddrPort{netip.MustParseAddrPort("127.0.0.1:4791"), netip.MustParseAddrPort("127.0.0.2:4791")}

// Pipe returns two connected in-process ports. Each packet is encoded, with its
// ICRC, as a Link would send it, queued, and decoded by the receiving end; loss
// applies to what each end sends (the two ends draw from generators seeded
// differently). Send never blocks.
func Pipe(lim Limits, loss Loss) (Port, Port, error) {
	if !ValidMTU(lim.MTU) || lim.MaxMessage == 0 {
		return nil, nil, fmt.Errorf("roce: limits %+v: a path MTU of 256..4096 and a largest message", lim)
	}
	ab, ba := fifo.New[[]byte](), fifo.New[[]byte]()
	lossB := loss
	lossB.Seed = ^loss.Seed
	a := &pipeEnd{lim: lim, in: ba, out: ab, inj: newInjector(loss), ep: Endpoints{Src: pipeAddrs[0], Dst: pipeAddrs[1]}}
	b := &pipeEnd{lim: lim, in: ab, out: ba, inj: newInjector(lossB), ep: Endpoints{Src: pipeAddrs[1], Dst: pipeAddrs[0]}}
	return a, b, nil
}

type pipeEnd struct {
	lim     Limits
	in, out *fifo.Queue[[]byte]
	inj     *injector
	ep      Endpoints // this end's packets: from Src to Dst
	once    sync.Once

	rx   rxCounters
	sent atomic.Uint64
}

func (e *pipeEnd) Limits() Limits { return e.lim }

func (e *pipeEnd) SendBatch(pkts []Packet) error {
	for i := range pkts {
		err := encode(&pkts[i], e.ep, func(b []byte) error {
			return e.inj.send(b, netip.AddrPort{}, func(b []byte, _ netip.AddrPort) error {
				if !e.out.Push(append([]byte(nil), b...)) {
					return ErrClosed
				}
				e.sent.Add(1)
				return nil
			})
		})
		if err != nil {
			return err
		}
	}
	return nil
}

func (e *pipeEnd) RecvBatch(bufs [][]byte, pkts []Packet) (int, error) {
	ep := Endpoints{Src: e.ep.Dst, Dst: e.ep.Src}
	n := 0
	for n < len(bufs) {
		var b []byte
		var ok bool
		if n == 0 {
			b, ok = e.in.Pop() // wait for the first
		} else {
			b, ok = e.in.TryPop()
		}
		if !ok {
			if n == 0 {
				return 0, ErrClosed
			}
			break
		}
		// A datagram as large as the buffer is cut short by the copy: decode
		// counts it malformed.
		p, ok := e.rx.decode(bufs[n], copy(bufs[n], b), ep, e.lim)
		if !ok {
			continue
		}
		pkts[n] = p
		n++
	}
	return n, nil
}

// Close drops what was not received and makes the peer's Recv fail once it has
// received what was already sent to it.
func (e *pipeEnd) Close() error {
	e.once.Do(func() {
		e.in.Close()
		e.out.CloseWrite()
	})
	return nil
}

func (e *pipeEnd) Stats() LinkStats {
	s := LinkStats{Sent: e.sent.Load()}
	e.rx.stats(&s)
	e.inj.stats(&s)
	return s
}
