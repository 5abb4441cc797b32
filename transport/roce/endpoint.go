package roce

import (
	"errors"
	"fmt"
	"net/netip"
	"runtime"
	"sync"
	"sync/atomic"
	"time"
)

// Endpoint is a NIC port's RoCEv2 address in this process: one UDP socket, bound to
// a local address and UDP port 4791 (RoCEv2's), that receives every packet for the
// port's QPs and hands each to the QP its BTH names (the destination QPN), as a NIC
// with one port and many QPs does. Packets for a QPN no QP of the endpoint has are
// dropped and counted. A connected QP's port (Attach) takes packets from its peer's
// address only; a UD QP's (AttachUD) takes datagrams from any sender and sends each
// where its caller says. Each attached QP sends from a socket of its own on the same
// address, whose source port (chosen by the kernel) is the QP's entropy, as
// RoCEv2 NICs vary the source port per QP; every packet goes to the peer's port
// 4791.
//
// Endpoints are shared: OpenEndpoint returns the process's endpoint at an address,
// counted, and the last Close closes it. Two processes on one host need two
// addresses (127.0.0.1 and 127.0.0.2, say: every 127/8 address is local), as two
// hosts would have.
type Endpoint struct {
	key  netip.AddrPort // what OpenEndpoint was asked for
	addr netip.AddrPort // where it is bound
	link *Link
	refs int // protected by endpoints.mu

	mu   sync.Mutex                          // serialises attach and detach
	qps  atomic.Pointer[map[uint32]*udpPort] // copy on write: the receive loop reads it without a lock
	done chan struct{}                       // closed when the receive loop ends

	unknown, foreign, overflow atomic.Uint64

	// wantGRO: a QP attached with GSO, whose peer presumably sends segmented
	// datagrams too; the receive loop then turns UDP_GRO on (receiveGRO).
	wantGRO atomic.Bool
	// coalesced counts the datagrams that arrived coalesced (UDP_GRO), packets
	// the packets they held.
	coalesced, coalescedPackets atomic.Uint64
}

var endpoints = struct {
	mu sync.Mutex
	m  map[netip.AddrPort]*Endpoint
}{m: map[netip.AddrPort]*Endpoint{}}

// endpointLimits are what an endpoint's socket takes: datagrams up to the largest
// path MTU; each QP checks its own path MTU and largest message.
var endpointLimits = Limits{MTU: 4096, MaxMessage: maxRCMessage}

// OpenEndpoint returns this process's endpoint at addr, a specific address and
// port (RoCEv2's is UDPPort, 4791; port 0 lets the kernel pick one, which tests
// that run in parallel processes use), opening it if it is not open: every
// OpenEndpoint of the same addr in a process returns the same endpoint. Each
// OpenEndpoint needs a Close.
func OpenEndpoint(addr netip.AddrPort) (*Endpoint, error) {
	addr = netip.AddrPortFrom(addr.Addr().Unmap(), addr.Port())
	endpoints.mu.Lock()
	defer endpoints.mu.Unlock()
	if e := endpoints.m[addr]; e != nil {
		e.refs++
		return e, nil
	}
	link, err := Listen(addr, endpointLimits, Loss{})
	if err != nil {
		return nil, fmt.Errorf("roce: endpoint %v (is another process using it?): %w", addr, err)
	}
	e := &Endpoint{key: addr, addr: link.LocalAddr(), link: link, refs: 1, done: make(chan struct{})}
	e.qps.Store(&map[uint32]*udpPort{})
	endpoints.m[addr] = e
	go e.receive()
	return e, nil
}

// Addr returns the endpoint's address, where peers send.
func (e *Endpoint) Addr() netip.AddrPort { return e.addr }

// Close releases the endpoint; the last Close closes its socket.
func (e *Endpoint) Close() error {
	endpoints.mu.Lock()
	e.refs--
	last := e.refs == 0
	if last {
		delete(endpoints.m, e.key)
	}
	endpoints.mu.Unlock()
	if !last {
		return nil
	}
	err := e.link.Close()
	<-e.done
	return err
}

// EndpointStats are an endpoint's counters.
type EndpointStats struct {
	LinkStats
	QPs int // attached
	// Coalesced counts the datagrams that arrived holding several packets (UDP_GRO,
	// on once a QP attached with GSO), CoalescedPackets the packets they held.
	Coalesced, CoalescedPackets uint64
}

// Stats returns the endpoint's counters: its socket's, and the packets it dropped
// for unknown QPNs, foreign senders and the inboxes of QPs that closed while full.
func (e *Endpoint) Stats() EndpointStats {
	s := EndpointStats{LinkStats: e.link.Stats(), QPs: len(*e.qps.Load())}
	s.UnknownQP, s.Foreign, s.Overflow = e.unknown.Load(), e.foreign.Load(), e.overflow.Load()
	s.Coalesced, s.CoalescedPackets = e.coalesced.Load(), e.coalescedPackets.Load()
	return s
}

// AttachConfig is a QP's side of a connection over an endpoint.
type AttachConfig struct {
	QPN  uint32         // the local QP: packets for it come to the port
	Peer netip.AddrPort // the peer's endpoint: packets go there, and come only from its address
	// Limits are the path MTU and the largest message the peer may send.
	Limits Limits
	// Loss injects faults into what the QP sends.
	Loss Loss
	// Link is the link model of what the QP sends: its rate paces the sends, its
	// queue bounds how far ahead of the rate they may be, and its delay holds each
	// packet received for this QP before the QP takes it.
	Link LinkModel
}

// Attach connects QP cfg.QPN to its peer over the endpoint and returns its port.
// Closing the port detaches it.
func (e *Endpoint) Attach(cfg AttachConfig) (Port, error) {
	if !ValidMTU(cfg.Limits.MTU) || cfg.Limits.MaxMessage == 0 || cfg.QPN >= 1<<24 || cfg.Limits.UD {
		return nil, fmt.Errorf("roce: attach QP %#x with limits %+v", cfg.QPN, cfg.Limits)
	}
	p, err := e.attach(cfg)
	if err != nil {
		return nil, err
	}
	return p, nil
}

// attach makes and lists the port of QP cfg.QPN.
func (e *Endpoint) attach(cfg AttachConfig) (*udpPort, error) {
	send, err := Listen(netip.AddrPortFrom(e.addr.Addr(), 0), endpointLimits, cfg.Loss)
	if err != nil {
		return nil, err
	}
	send.SetGSO(cfg.Link.GSO)
	if cfg.Link.GSO {
		e.wantGRO.Store(true) // the receive loop turns UDP_GRO on before its next receive
	}
	p := &udpPort{ep: e, qpn: cfg.QPN, peer: netip.AddrPortFrom(cfg.Peer.Addr().Unmap(), cfg.Peer.Port()), send: send,
		lim: cfg.Limits, in: new(ring), delay: int64(cfg.Link.Delay), rate: cfg.Link.Rate / 8 / 1e9,
		ahead: int64(cfg.Link.queue(cfg.Limits.MTU))}
	if cfg.Limits.UD {
		p.from = new([ringSize]netip.AddrPort)
	}
	if p.rate > 0 {
		p.ahead = int64(float64(p.ahead) / p.rate) // the queue as time at the line rate
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	old := *e.qps.Load()
	if _, ok := old[cfg.QPN]; ok {
		_ = send.Close() // never used
		return nil, fmt.Errorf("roce: endpoint %v: QP %#x is attached already", e.addr, cfg.QPN)
	}
	endpoints.mu.Lock()
	e.refs++ // the port's, released by its Close
	endpoints.mu.Unlock()
	m := make(map[uint32]*udpPort, len(old)+1)
	for k, v := range old {
		m[k] = v
	}
	m[cfg.QPN] = p
	e.qps.Store(&m)
	return p, nil
}

func (e *Endpoint) detach(qpn uint32) {
	e.mu.Lock()
	defer e.mu.Unlock()
	old := *e.qps.Load()
	m := make(map[uint32]*udpPort, len(old))
	for k, v := range old {
		if k != qpn {
			m[k] = v
		}
	}
	e.qps.Store(&m)
}

// rxBuf is a receive buffer that a packet's payload aliases until the QP is done
// with it (its Ref).
type rxBuf struct{ b []byte }

var rxBufs = sync.Pool{New: func() any { return &rxBuf{b: make([]byte, BufferSize(endpointLimits))} }}

func (r *rxBuf) Release() { rxBufs.Put(r) }

// receive takes the socket's datagrams and hands each to its QP until the socket
// closes. Each datagram is received into a buffer of its own, which the packet's
// run holds until its QP is done with it; once a QP attached with GSO asks for it
// (wantGRO), the loop turns to receiveGRO.
func (e *Endpoint) receive() {
	defer close(e.done)
	var (
		bufs  = make([][]byte, maxBatch)
		owner = make([]*rxBuf, maxBatch) // bufs[i] is owner[i].b
		lens  = make([]int, maxBatch)
		froms = make([]netip.AddrPort, maxBatch)
		b     = batch{e: e}
	)
	for i := range bufs {
		owner[i] = rxBufs.Get().(*rxBuf)
		bufs[i] = owner[i].b
	}
	defer func() {
		for _, o := range owner {
			o.Release()
		}
	}()
	for {
		if e.wantGRO.Load() {
			if e.link.enableGRO() == nil {
				e.receiveGRO()
				return
			}
			e.wantGRO.Store(false) // a kernel before UDP_GRO (5.0): datagrams stay one packet each
		}
		n, err := e.link.recvRaw(bufs, lens, froms, nil)
		if err != nil {
			return
		}
		b.begin()
		for i := 0; i < n; i++ {
			if lens[i] >= 0 && b.hand(owner[i], lens[i], froms[i]) {
				owner[i] = rxBufs.Get().(*rxBuf) // the QP holds the old one
				bufs[i] = owner[i].b
			}
		}
		b.end()
	}
}

// batch delivers the packets of one receive: it has the QPs as they were when it
// began, its time, and the ports to wake once it ends.
type batch struct {
	e     *Endpoint
	qps   map[uint32]*udpPort
	now   int64
	woken []*udpPort
}

func (b *batch) begin() { b.qps, b.now, b.woken = *b.e.qps.Load(), mono(time.Now()), b.woken[:0] }

// hand delivers the n-byte packet at the start of buf (deliver) and reports
// whether a QP holds buf now.
func (b *batch) hand(buf *rxBuf, n int, from netip.AddrPort) bool {
	p := b.e.deliver(b.qps, buf, n, from, b.now)
	if p == nil {
		return false
	}
	if len(b.woken) == 0 || b.woken[len(b.woken)-1] != p {
		b.woken = append(b.woken, p)
	}
	return true
}

// end wakes the QPs that were given packets.
func (b *batch) end() {
	for _, p := range b.woken {
		wake(&p.wake)
	}
}

// groBatch is how many datagrams of up to 64 KiB receiveGRO takes per recvmmsg.
const groBatch = 16

// receiveGRO is the receive loop with UDP_GRO on: a datagram may hold several
// packets of one size (the last may be shorter), as a peer's segmentation offload
// sent them, and arrives whole into one of a few 64 KiB buffers, from which each
// packet is copied into a buffer of its own for its QP to hold.
func (e *Endpoint) receiveGRO() {
	var (
		big   = make([][]byte, groBatch)
		lens  = make([]int, groBatch)
		segs  = make([]int, groBatch)
		froms = make([]netip.AddrPort, groBatch)
		b     = batch{e: e}
	)
	for i := range big {
		big[i] = make([]byte, 1<<16)
	}
	spare := rxBufs.Get().(*rxBuf)
	defer func() { spare.Release() }()
	for {
		n, err := e.link.recvRaw(big, lens, froms, segs)
		if err != nil {
			return
		}
		b.begin()
		for i := 0; i < n; i++ {
			if lens[i] < 0 {
				continue
			}
			d := big[i][:lens[i]]
			size := segs[i]
			if size <= 0 || size > len(d) {
				size = len(d)
			}
			if size < len(d) {
				e.coalesced.Add(1)
				e.coalescedPackets.Add(uint64((len(d) + size - 1) / size))
			}
			for off := 0; off < len(d); off += size {
				pkt := d[off:min(off+size, len(d))]
				if len(pkt) >= len(spare.b) {
					e.link.rx.malformed.Add(1) // larger than any packet: cut short
					continue
				}
				copy(spare.b, pkt)
				if b.hand(spare, len(pkt), froms[i]) {
					spare = rxBufs.Get().(*rxBuf) // the QP holds the old one
				}
			}
		}
		b.end()
	}
}

// deliver hands the n-byte packet at the start of buf, from from, to the QP its BTH
// names and returns that QP's port, which holds buf from then on; it returns nil
// when the packet was dropped (and counted), and buf is still the caller's.
func (e *Endpoint) deliver(qps map[uint32]*udpPort, buf *rxBuf, n int, from netip.AddrPort, now int64) *udpPort {
	b := buf.b[:n]
	if len(b) < BTHSize {
		e.link.rx.malformed.Add(1)
		return nil
	}
	qpn := uint32(b[5])<<16 | uint32(b[6])<<8 | uint32(b[7])
	p := qps[qpn]
	switch {
	case p == nil:
		e.unknown.Add(1)
		return nil
	case p.from == nil && from.Addr() != p.peer.Addr(): // a UD QP takes any sender
		e.foreign.Add(1)
		return nil
	case p.lim.UC:
		p.credit.noteSender(from)
	}
	pkt, ok := p.rx.decode(buf.b, n, Endpoints{Src: from, Dst: e.addr}, p.lim)
	if !ok {
		if p.lim.UC {
			p.credit.taken.Add(1) // the peer's, and gone: grant it back
		}
		return nil
	}
	if p.in.full() && !e.waitRoom(p) {
		e.overflow.Add(1) // closed meanwhile
		return nil
	}
	seg := One(pkt)
	seg.Ref = buf
	if p.from != nil { // before push publishes the slot
		p.from[p.in.tail.Load()%ringSize] = from
	}
	p.in.push(seg, now+p.delay, 0)
	if p.closed.Load() {
		p.drop() // closed meanwhile: its engine will not take it
	}
	return p
}

// waitRoom holds the receive loop while p's inbox is full, as a lossless port holds
// what arrives, instead of dropping: a UC QP's credits keep its peer within the
// inbox, an RC QP's peer keeps its send queue at most outstanding, but an engine that
// falls behind, or READ responses, can fill it. It reports false if p closed
// instead.
func (e *Endpoint) waitRoom(p *udpPort) bool {
	for p.in.full() {
		if p.closed.Load() {
			return false
		}
		runtime.Gosched() // the QP's engine takes runs meanwhile
	}
	return true
}

// udpPort is a QP's port on an endpoint.
type udpPort struct {
	ep   *Endpoint
	qpn  uint32
	peer netip.AddrPort
	send *Link
	lim  Limits
	in   *ring // filled by the endpoint's receive loop, emptied by the QP's engine

	delay     int64   // held this long after arriving
	rate      float64 // bytes per nanosecond, 0: unlimited
	ahead     int64   // how far ahead of the line rate sends may run, nanoseconds
	busyUntil int64   // the sender's: when what it sent has left at the line rate

	// from, for a UD QP's port, holds the sender of each datagram in the inbox,
	// at its ring index; nil for a connected QP's.
	from *[ringSize]netip.AddrPort

	credit credits // a UC QP's flow control (credit.go)

	rx     rxCounters
	wake   atomic.Pointer[func()]
	mu     sync.Mutex // held while a closed port's inbox is dropped
	closed atomic.Bool
	once   sync.Once
	pkts   []Packet // Send's scratch
}

func (p *udpPort) Limits() Limits { return p.lim }
func (p *udpPort) MaxRun() int    { return 1 }

// Room implements Port: Send paces itself to the rate; a UC QP sends as many
// datagrams as its peer's credits allow, and with none says when to look again.
func (p *udpPort) Room(now time.Time) (int, int, time.Time) {
	if !p.lim.UC {
		return maxBatch, -1, time.Time{}
	}
	runs, next := p.window(mono(now))
	if runs == 0 {
		return 0, 0, fromMono(next)
	}
	return runs, -1, time.Time{}
}
func (p *udpPort) WaitRoom()        {}
func (p *udpPort) SetWake(f func()) { p.wake.Store(&f) }
func (p *udpPort) Hold(bool)        {} // what arrives over UDP is a datagram of its own

// TakeBack implements Port: the kernel has what was sent.
func (p *udpPort) TakeBack(runs []Segment) []Segment { return runs }
func (p *udpPort) NAKed(*Segment)                    {}
func (p *udpPort) GiveBack(*Segment) bool            { return false }

// Send implements Port: each run's packets go out with sendmmsg (with the link
// model's GSO, segmented: Link.SetGSO), their payloads straight from the QP's
// memory into the kernel, and its Ref is released once the call returns. With a
// rate, it first waits until the link has room.
func (p *udpPort) Send(segs []Segment, now time.Time) (int, error) {
	defer func() {
		for i := range segs {
			release(&segs[i])
		}
	}()
	if p.closed.Load() {
		return len(segs), ErrClosed
	}
	p.pkts = p.pkts[:0]
	bytes := 0
	for i := range segs {
		p.pkts = segs[i].Packets(p.pkts, p.lim.MTU)
		bytes += WireBytes(&segs[i])
	}
	if !p.lim.UC {
		return len(segs), p.sendTo(p.pkts, bytes, p.peer, now)
	}
	before := p.send.sent.Load()
	err := p.sendTo(p.pkts, bytes, p.peer, now)
	p.credit.sent += p.send.sent.Load() - before // what left, whatever was injected
	return len(segs), err
}

// sendTo sends pkts, bytes on the wire, to dst; with a rate, it first waits until
// the link has room.
func (p *udpPort) sendTo(pkts []Packet, bytes int, dst netip.AddrPort, now time.Time) error {
	if p.rate > 0 {
		t := mono(now)
		start := max(t, p.busyUntil)
		for start-t > p.ahead { // the queue is full: the link drains at the line rate
			runtime.Gosched()
			t = mono(time.Now())
		}
		p.busyUntil = start + int64(float64(bytes)/p.rate)
	}
	return p.send.SendBatch(pkts, dst)
}

// Recv implements Port.
func (p *udpPort) Recv(segs []Segment, now time.Time) (int, time.Time, error) {
	if p.closed.Load() {
		return 0, time.Time{}, ErrClosed
	}
	t := mono(now)
	n := 0
	for n < len(segs) {
		sl, _, wait := p.due(t)
		if sl == nil {
			if n == 0 && wait != 0 {
				return 0, fromMono(wait), nil
			}
			break
		}
		segs[n] = sl.seg
		p.in.pop()
		n++
	}
	if n > 0 && p.lim.UC {
		p.tookRuns(n)
	}
	return n, time.Time{}, nil
}

// due returns the oldest run of the inbox that has arrived by t, and its ring index;
// when none has, sl is nil and wait is when the next one on its way arrives (0: none
// is). Only the port's receiver calls it.
func (p *udpPort) due(t int64) (sl *slot, i uint64, wait int64) {
	i = p.in.head.Load()
	if sl = p.in.peek(); sl == nil {
		return nil, 0, 0
	}
	if sl.due > t {
		return nil, 0, sl.due
	}
	return sl, i, 0
}

func (p *udpPort) drop() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for sl := p.in.peek(); sl != nil; sl = p.in.peek() {
		release(&sl.seg)
		p.in.pop()
	}
}

// Close implements Port: the QP is detached and its sending socket closed. It must
// be called once the QP's engine has stopped.
func (p *udpPort) Close() error {
	var err error
	p.once.Do(func() {
		p.closed.Store(true)
		p.ep.detach(p.qpn)
		err = errors.Join(p.send.Close(), p.ep.Close())
		p.drop()
	})
	return err
}

// Stats implements Port: what the QP sent (and the faults injected into it) and
// received.
func (p *udpPort) Stats() LinkStats {
	s := p.send.Stats()
	s.Received, s.Malformed, s.BadICRC = p.rx.received.Load(), p.rx.malformed.Load(), p.rx.badICRC.Load()
	s.GrantsSent, s.GrantsReceived, s.CreditResets = p.credit.grants.Load(), p.credit.grantsReceived.Load(), p.credit.resets.Load()
	return s
}

// UDConfig is a UD QP's side of an endpoint.
type UDConfig struct {
	QPN  uint32 // the local QP: UD packets for it come to the port
	MTU  int    // the largest datagram payload (256, 512, 1024, 2048 or 4096)
	Loss Loss   // faults injected into what the QP sends
	// Link is the link model of what the QP sends (its rate paces the sends) and
	// receives (its delay holds each datagram before the QP takes it).
	Link LinkModel
}

// DatagramPort is a UD QP's port on an endpoint: it takes the UD packets sent to its
// QPN from any address, and sends each datagram to the endpoint its caller names, as
// a UD QP sends to the address handle of each work request. Closing it detaches the
// QP; datagrams not yet received are dropped.
type DatagramPort struct{ p *udpPort }

// Datagram is a UD packet received and the endpoint that sent it (the sending QP's
// socket: its address is the sender's RoCEv2 address). Its Payload aliases a receive
// buffer until Release.
type Datagram struct {
	Packet
	From netip.AddrPort
	ref  Ref
}

// Release gives the datagram's receive buffer back; Payload is invalid after.
func (d *Datagram) Release() {
	if d.ref != nil {
		d.ref.Release()
		d.ref = nil
	}
}

// AttachUD attaches UD QP cfg.QPN to the endpoint and returns its port.
func (e *Endpoint) AttachUD(cfg UDConfig) (*DatagramPort, error) {
	if !ValidMTU(cfg.MTU) || cfg.QPN >= 1<<24 {
		return nil, fmt.Errorf("roce: attach UD QP %#x with MTU %d", cfg.QPN, cfg.MTU)
	}
	p, err := e.attach(AttachConfig{QPN: cfg.QPN, Limits: Limits{MTU: cfg.MTU, MaxMessage: uint32(cfg.MTU), UD: true},
		Loss: cfg.Loss, Link: cfg.Link})
	if err != nil {
		return nil, err
	}
	return &DatagramPort{p}, nil
}

// SendTo sends UD packets to the endpoint dst (port 4791 of the peer's address, for
// a RoCEv2 peer); their payloads are the caller's again when it returns. A packet
// that is not a UD SEND, or whose payload exceeds the MTU, sends nothing.
func (d *DatagramPort) SendTo(pkts []Packet, dst netip.AddrPort, now time.Time) error {
	p := d.p
	if p.closed.Load() {
		return ErrClosed
	}
	bytes := 0
	for i := range pkts {
		s := One(pkts[i])
		switch {
		case !s.Opcode.UD():
			return fmt.Errorf("%w: %v on a UD port", ErrMalformed, s.Opcode)
		case len(s.Payload) > p.lim.MTU:
			return fmt.Errorf("%w: a datagram of %d bytes, MTU %d", ErrMalformed, len(s.Payload), p.lim.MTU)
		}
		bytes += WireBytes(&s)
	}
	return p.sendTo(pkts, bytes, dst, now)
}

// RecvFrom moves up to len(out) datagrams that have arrived into out and returns how
// many; the caller releases each. With none ready, next is when the next one on its
// way arrives (zero when none is); the wake function runs when one arrives. It fails
// with ErrClosed once the port is closed.
func (d *DatagramPort) RecvFrom(out []Datagram, now time.Time) (n int, next time.Time, err error) {
	p := d.p
	if p.closed.Load() {
		return 0, time.Time{}, ErrClosed
	}
	t := mono(now)
	for n < len(out) {
		sl, i, wait := p.due(t)
		if sl == nil {
			if n == 0 && wait != 0 {
				return 0, fromMono(wait), nil
			}
			break
		}
		out[n] = Datagram{Packet: sl.seg.Packet, From: p.from[i%ringSize], ref: sl.seg.Ref}
		p.in.pop()
		n++
	}
	return n, time.Time{}, nil
}

// SetWake sets the function the port calls, from any goroutine, when datagrams
// arrive. It must not block.
func (d *DatagramPort) SetWake(f func()) { d.p.SetWake(f) }

// MTU is the largest datagram payload.
func (d *DatagramPort) MTU() int { return d.p.lim.MTU }

// Stats returns the port's counters: what it sent and what it received.
func (d *DatagramPort) Stats() LinkStats { return d.p.Stats() }

// Close detaches the QP and closes its sending socket.
func (d *DatagramPort) Close() error { return d.p.Close() }
