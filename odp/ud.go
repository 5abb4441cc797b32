package odp

// A UD QP's NIC side: one goroutine that sends the send queue's datagrams and places
// the datagrams received into posted receives. UD has no acknowledgement, no
// retransmission and no RNR: a datagram that finds no receive posted, or a Q_Key
// other than its QP's, is dropped and counted, as a NIC drops it. A network page
// fault on either side holds the QP's queue while it is resolved (the datagrams
// received meanwhile wait in the port's inbox, and are dropped when it is full): the
// datagrams are copies in the port's buffers, so waiting holds no memory of another
// QP's.

import (
	"encoding/binary"
	"errors"
	"net/netip"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/odpemu/odpemu/transport/roce"
)

// GRHSize is the size of the GRH a UD receive starts with.
const GRHSize = 40

// udEngine is a UD QP's NIC side; see the file's comment.
type udEngine struct {
	qp    *QP
	port  *roce.DatagramPort
	local netip.AddrPort // the endpoint it receives at (its address: the receive GRH's destination)

	kick     chan struct{}
	quit     chan struct{}
	stopOnce sync.Once
	exited   chan struct{}

	alarm   time.Time // a precise wake-up is armed for then (armAlarm)
	psn     uint32
	sqNext  uint64 // the next send queue slot to send
	errored bool   // the QP is in ERR and the engine flushed it
	buf     []byte // a datagram's GRH and payload
	rx      []roce.Datagram
	pkt     [1]roce.Packet
}

// udCounters are a UD QP's drops.
type udCounters struct {
	qkeyViolations atomic.Uint64 // datagrams dropped for a Q_Key other than the QP's
	noReceive      atomic.Uint64 // datagrams dropped with no receive posted
}

// startUDLocked starts the UD QP's engine on port. Called with QP.mu held.
func (qp *QP) startUDLocked(port *roce.DatagramPort, local netip.AddrPort) {
	e := &udEngine{qp: qp, port: port, local: local, kick: make(chan struct{}, 1), quit: make(chan struct{}),
		exited: make(chan struct{}), psn: qp.psn, sqNext: qp.sq.head.Load(),
		buf: make([]byte, GRHSize+port.MTU()), rx: make([]roce.Datagram, 16)}
	qp.ud = e
	qp.udA.Store(e)
	port.SetWake(e.wake)
	go e.run()
}

// wake tells the engine that something changed. It never blocks.
func (e *udEngine) wake() {
	select {
	case e.kick <- struct{}{}:
	default:
	}
}

// stop ends the engine; Destroy and reset may both call it.
func (e *udEngine) stop() {
	e.stopOnce.Do(func() { close(e.quit) })
	<-e.exited
}

func (e *udEngine) run() {
	defer close(e.exited)
	for {
		select {
		case <-e.quit:
			e.release()
			return
		default:
		}
		if QPState(e.qp.st.Load()) == StateError {
			e.flush()
		}
		busy, next := e.receive()
		busy = e.send() || busy
		switch {
		case busy:
		case next.IsZero():
			select {
			case <-e.kick:
			case <-e.quit:
			}
		default:
			e.waitUntil(next)
		}
	}
}

// waitUntil waits until a datagram on its way is due (the link's delay), or
// something wakes the engine: the port wakes it when a datagram arrives, not when
// one that arrived becomes due. Short waits yield; longer ones sleep in internal/clock,
// which wakes the engine.
func (e *udEngine) waitUntil(next time.Time) {
	if time.Until(next) < spinFor {
		for time.Now().Before(next) {
			select {
			case <-e.kick:
				return
			case <-e.quit:
				return
			default:
			}
			runtime.Gosched()
		}
		return
	}
	armAlarm(&e.alarm, next, e.quit, e.wake)
	select {
	case <-e.kick:
	case <-e.quit:
	}
}

// release gives back the datagrams the engine holds (none between rounds).
func (e *udEngine) release() {
	for i := range e.rx {
		e.rx[i].Release()
	}
}

// flush completes every send WR not sent with WR_FLUSH_ERR, once the QP is in ERR
// (its receives were flushed by the move).
func (e *udEngine) flush() {
	e.errored = true
	q := &e.qp.sq
	for tail := q.tail.Load(); e.sqNext < tail; e.sqNext++ {
		w := q.slot(e.sqNext)
		w.done, w.status = true, WCWRFlushErr
	}
	e.retire()
}

// send sends what was posted, one datagram per WR, and reports whether it did
// anything.
func (e *udEngine) send() bool {
	q := &e.qp.sq
	tail := q.tail.Load()
	if e.errored || e.sqNext == tail || QPState(e.qp.st.Load()) != StateRTS {
		return false
	}
	for ; e.sqNext < tail; e.sqNext++ {
		w := q.slot(e.sqNext)
		w.status, w.detail = e.sendOne(&w.wr)
		w.done = true
		if w.status != WCSuccess {
			e.sqNext++
			break
		}
	}
	e.retire()
	return true
}

// sendOne gathers one WR's payload and sends it; it returns the completion status.
func (e *udEngine) sendOne(wr *SendWR) (WCStatus, string) {
	n := sglLen(wr.SGL)
	if n > uint64(e.port.MTU()) {
		return WCLocLenErr, "a datagram longer than the path MTU"
	}
	payload := e.buf[:n]
	if wr.inline != nil {
		copy(payload, wr.inline)
	} else if st, why := e.gather(wr.SGL, payload); st != WCSuccess {
		return st, why
	}
	qkey := wr.UD.QKey
	if qkey&(1<<31) != 0 {
		qkey = e.qp.qkey.Load()
	}
	p := &e.pkt[0]
	*p = roce.Packet{Opcode: roce.UDSendOnly, PKey: 0xffff, DestQP: wr.UD.QPN,
		PSN: e.psn, QKey: qkey, SrcQP: e.qp.qpn, Payload: payload}
	if wr.Opcode == OpSendImm {
		p.Opcode, p.Imm = roce.UDSendOnlyImm, wr.Imm
	}
	e.psn = (e.psn + 1) & (1<<24 - 1)
	dst := wr.UD.Addr
	if dst.Port() == 0 {
		dst = netip.AddrPortFrom(dst.Addr(), roce.UDPPort)
	}
	if err := e.port.SendTo(e.pkt[:], dst, time.Now()); err != nil {
		return WCGeneralErr, "send: " + err.Error()
	}
	return WCSuccess, ""
}

// gather reads an SGL's bytes into buf through the QP's local keys, taking network
// page faults as it goes.
func (e *udEngine) gather(sgl []SGE, buf []byte) (WCStatus, string) {
	pos := 0
	for _, s := range sgl {
		if s.Length == 0 {
			continue
		}
		mr, off, why := e.qp.localSGE(s, false)
		if mr == nil {
			return WCLocProtErr, why
		}
		if err := mr.dma(off, buf[pos:pos+int(s.Length)], false); err != nil {
			return WCLocProtErr, "gather: " + err.Error()
		}
		pos += int(s.Length)
	}
	return WCSuccess, ""
}

// retire completes the WRs sent, in order; an error moves the QP to ERR.
func (e *udEngine) retire() {
	q := &e.qp.sq
	for head := q.head.Load(); head < e.sqNext; head++ {
		w := q.slot(head)
		failed := w.status != WCSuccess && w.status != WCWRFlushErr
		var wc WC
		report := w.status != WCSuccess || w.wr.Flags&SendSignaled != 0 || e.qp.cfg.SigAll
		if report {
			wc = WC{WRID: w.wr.WRID, Status: w.status, Opcode: wcOpcode(w.wr.Opcode), QPNum: e.qp.qpn, Detail: w.detail}
		}
		*w = wqe{}
		q.head.Store(head + 1)
		switch {
		case failed && !e.errored:
			e.qp.failWith(e.qp.cfg.SendCQ, wc)
			e.errored = true
		case report:
			e.qp.cfg.SendCQ.push(wc)
		}
	}
	if e.errored {
		e.flushRest()
	}
}

// flushRest flushes the WRs behind a failed one.
func (e *udEngine) flushRest() {
	q := &e.qp.sq
	tail := q.tail.Load()
	if e.sqNext == tail {
		return
	}
	for ; e.sqNext < tail; e.sqNext++ {
		w := q.slot(e.sqNext)
		w.done, w.status = true, WCWRFlushErr
	}
	e.retire()
}

// receive places the datagrams that arrived, and reports whether there were any.
//
// With nothing to take it returns when the next datagram on its way is due (zero when
// none is).
func (e *udEngine) receive() (bool, time.Time) {
	n, next, err := e.port.RecvFrom(e.rx, time.Now())
	if err != nil || n == 0 {
		return false, next
	}
	for i := range e.rx[:n] {
		d := &e.rx[i]
		if !e.errored {
			e.place(d)
		}
		d.Release()
	}
	return true, time.Time{}
}

// place puts one datagram, behind its GRH, into the oldest receive posted.
func (e *udEngine) place(d *roce.Datagram) {
	qp := e.qp
	if d.QKey != qp.qkey.Load() {
		qp.udc.qkeyViolations.Add(1)
		return
	}
	var recv RecvWR
	seq, ok := qp.peekRecv(&recv)
	if !ok {
		qp.udc.noReceive.Add(1)
		return
	}
	total := GRHSize + len(d.Payload)
	msg := e.buf[:total]
	e.grh(msg[:GRHSize], d)
	copy(msg[GRHSize:], d.Payload)
	wc := WC{WRID: recv.WRID, Opcode: WCRecv, ByteLen: uint32(total), QPNum: qp.qpn, Flags: WCGRH, SrcQP: d.SrcQP}
	if d.Opcode == roce.UDSendOnlyImm {
		wc.Flags |= WCWithImm
		wc.ImmData = d.Imm
	}
	if uint64(total) > sglLen(recv.SGL) {
		wc.Status, wc.Detail = WCLocLenErr, "a datagram longer than the receive"
	} else if err := e.scatter(recv.SGL, msg); err != nil {
		wc.Status, wc.Detail = WCLocProtErr, err.Error()
	}
	if !qp.takeRecv(seq) {
		return // flushed meanwhile: the flush completed it
	}
	if wc.Status != WCSuccess {
		wc.ByteLen, wc.Flags, wc.SrcQP = 0, 0, 0
		qp.failWith(qp.cfg.RecvCQ, wc)
		return
	}
	qp.cfg.RecvCQ.push(wc)
}

// scatter writes msg over a receive's SGL through the QP's local keys.
func (e *udEngine) scatter(sgl []SGE, msg []byte) error {
	for _, s := range sgl {
		if len(msg) == 0 {
			break
		}
		n := min(len(msg), int(s.Length))
		mr, off, why := e.qp.recvSGE(SGE{Addr: s.Addr, Length: uint32(n), LKey: s.LKey})
		if mr == nil {
			return errors.New(why)
		}
		if err := mr.dma(off, msg[:n], true); err != nil {
			return err
		}
		msg = msg[n:]
	}
	return nil
}

// grh writes the receive's GRH for d, as a RoCEv2 NIC does: over IPv4, 20 bytes of
// zero and the datagram's IPv4 header; over IPv6, its IPv6 header.
func (e *udEngine) grh(g []byte, d *roce.Datagram) {
	clear(g)
	src, dst := d.From.Addr().Unmap(), e.local.Addr().Unmap()
	udpLen := 8 + d.Opcode.HeaderSize() + len(d.Payload) + (4-len(d.Payload)%4)%4 + roce.ICRCSize
	be := binary.BigEndian
	if src.Is4() && dst.Is4() {
		h := g[20:]
		h[0] = 0x45                            // version 4, 5 words
		be.PutUint16(h[2:], uint16(20+udpLen)) // total length
		h[6] = 0x40                            // don't fragment
		h[8], h[9] = 64, 17                    // TTL, UDP
		s4, d4 := src.As4(), dst.As4()
		copy(h[12:16], s4[:])
		copy(h[16:20], d4[:])
		var sum uint32
		for i := 0; i < 20; i += 2 {
			sum += uint32(be.Uint16(h[i:]))
		}
		for sum > 0xffff {
			sum = sum&0xffff + sum>>16
		}
		be.PutUint16(h[10:], ^uint16(sum))
		return
	}
	be.PutUint32(g[0:], 6<<28) // version 6
	be.PutUint16(g[4:], uint16(udpLen))
	g[6], g[7] = 17, 64 // next header UDP, hop limit
	s16, d16 := src.As16(), dst.As16()
	copy(g[8:24], s16[:])
	copy(g[24:40], d16[:])
}
