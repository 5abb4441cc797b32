package roce

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Loss injects faults into what a Link sends, since these kernels have no netem: each
// packet is dropped with probability Drop, else sent twice with probability
// Duplicate, else held back and sent after the next one with probability Reorder.
// The same Seed gives the same faults for the same packets.
type Loss struct {
	Seed                     uint64
	Drop, Duplicate, Reorder float64
}

func (l Loss) active() bool { return l.Drop > 0 || l.Duplicate > 0 || l.Reorder > 0 }

// LinkStats are a Link's counters.
type LinkStats struct {
	Sent, Received   uint64 // packets put on and taken off the wire
	Malformed        uint64 // datagrams dropped because Decode refused them
	BadICRC          uint64 // of which: the ICRC did not match
	Dropped, Doubled uint64 // faults injected: packets not sent, sent twice
	Reordered        uint64 // packets sent after the one that followed them
	Foreign          uint64 // packets from another address than the QP's peer, dropped
	// UnknownQP counts packets for a QPN that no QP of the endpoint has, dropped
	// (an endpoint's count); Overflow packets dropped because the QP's inbox was
	// full and the QP closed while the endpoint waited for room.
	UnknownQP, Overflow uint64
	// GrantsSent and GrantsReceived count the credit datagrams a UC QP's port
	// sent its peer and took from it over UDP; CreditResets the times its
	// window stayed shut with no grant until it took it back (credit.go).
	GrantsSent, GrantsReceived, CreditResets uint64
	// Segmented counts the datagrams sent with UDP segmentation offload
	// (Link.SetGSO), SegmentedPackets the packets they held; GSORefused is 1 once
	// the kernel refused one and the link went back to a datagram per packet.
	Segmented, SegmentedPackets, GSORefused uint64
	// MaxInFlight is the most bytes the link held at once, sent and not taken by
	// the receiver (LinkModel.Limit bounds it); MaxQueued the most its transmit
	// queue held (LinkModel.Queue bounds it).
	MaxInFlight, MaxQueued int
	// TakenBack counts the packets the sender took back from its transmit queue
	// before they left, when a NAK sent its requester back (Port.TakeBack); Sent
	// does not count them.
	TakenBack uint64
}

// Link is one RoCEv2 endpoint: a UDP socket bound to a specific local address (the
// ICRC covers it), sending RC packets to peers and receiving theirs. Datagrams that
// do not decode are counted and dropped, as a NIC drops them. Send and Recv are safe
// for concurrent use.
type Link struct {
	conn  *net.UDPConn
	mm    mmsgSocket // conn, for sendmmsg and recvmmsg
	local netip.AddrPort
	lim   Limits
	inj   *injector

	rx            rxCounters
	sent, foreign atomic.Uint64
	// gso: SendBatch sends runs of equal-size packets as one datagram the kernel
	// segments (SetGSO); cleared for good when the kernel refuses one.
	gso atomic.Bool
	// gsoSends counts the datagrams SendBatch sent segmented, gsoSegments the
	// packets they held, gsoRefused the kernel's refusals (at most one).
	gsoSends, gsoSegments, gsoRefused atomic.Uint64
}

// sendBufs holds packet buffers for Send.
var sendBufs = sync.Pool{New: func() any { b := make([]byte, 0, 4096+64); return &b }}

// SocketBuffer is the size a Link asks for its socket's send and receive buffers.
const SocketBuffer = 8 << 20

// Listen binds a Link to local (a specific IPv4 or IPv6 address; port 0 picks one).
// Its sends leave with DF set and, from an unconnected socket, an IP identification
// of zero: the header the ICRC assumes.
func Listen(local netip.AddrPort, lim Limits, loss Loss) (*Link, error) {
	if !local.Addr().IsValid() || local.Addr().IsUnspecified() {
		return nil, fmt.Errorf("roce: listen on %v: the ICRC covers the source address, bind a specific one", local)
	}
	if !ValidMTU(lim.MTU) || lim.MaxMessage == 0 {
		return nil, fmt.Errorf("roce: limits %+v: a path MTU of 256..4096 and a largest message", lim)
	}
	network := "udp4"
	if !local.Addr().Unmap().Is4() {
		network = "udp6"
	}
	lc := net.ListenConfig{Control: func(_, _ string, c syscall.RawConn) error {
		var serr error
		err := c.Control(func(fd uintptr) {
			if network == "udp4" {
				serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_IP, unix.IP_MTU_DISCOVER, unix.IP_PMTUDISC_DO)
			} else {
				serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_IPV6, unix.IPV6_MTU_DISCOVER, unix.IPV6_PMTUDISC_DO)
			}
			// A NIC's receive queue holds a window of packets; the default socket
			// buffer (about 200 KiB) drops a burst of a few hundred. Beyond
			// net.core.rmem_max only CAP_NET_ADMIN may go (the FORCE options); the
			// default stays where it may not.
			for _, o := range [][2]int{{unix.SO_RCVBUFFORCE, unix.SO_RCVBUF}, {unix.SO_SNDBUFFORCE, unix.SO_SNDBUF}} {
				if unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, o[0], SocketBuffer) != nil {
					_ = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, o[1], SocketBuffer) // capped, never refused
				}
			}
		})
		return errors.Join(err, serr)
	}}
	pc, err := lc.ListenPacket(context.Background(), network, local.String())
	if err != nil {
		return nil, fmt.Errorf("roce: %w", err)
	}
	conn := pc.(*net.UDPConn)
	bound := conn.LocalAddr().(*net.UDPAddr).AddrPort()
	rc, err := conn.SyscallConn()
	if err != nil {
		_ = conn.Close() // the error to report is err
		return nil, fmt.Errorf("roce: %w", err)
	}
	return &Link{conn: conn, local: netip.AddrPortFrom(bound.Addr().Unmap(), bound.Port()), lim: lim, inj: newInjector(loss),
		mm: mmsgSocket{rc: rc, v6: network == "udp6"}}, nil
}

// LocalAddr returns the bound address.
func (l *Link) LocalAddr() netip.AddrPort { return l.local }

// SetPathMTU lowers the path MTU the Link's packets are checked against (Decode
// requires FIRST and MIDDLE packets to carry exactly that much) to what the
// connection negotiated. It must be called before the Link is used.
func (l *Link) SetPathMTU(mtu int) error {
	if !ValidMTU(mtu) || mtu > l.lim.MTU {
		return fmt.Errorf("roce: path MTU %d (the Link takes up to %d)", mtu, l.lim.MTU)
	}
	l.lim.MTU = mtu
	return nil
}

// Limits returns what the Link's Recv accepts.
func (l *Link) Limits() Limits { return l.lim }

// Close closes the socket; a blocked Recv returns net.ErrClosed.
func (l *Link) Close() error { return l.conn.Close() }

// Send encodes p for dst and sends it, through the fault injector.
func (l *Link) Send(p *Packet, dst netip.AddrPort) error {
	dst = netip.AddrPortFrom(dst.Addr().Unmap(), dst.Port())
	// The kernel copies the datagram: the buffer is reused.
	return encode(p, Endpoints{Src: l.local, Dst: dst}, func(b []byte) error { return l.inj.send(b, dst, l.write) })
}

// maxBatch bounds the packets of one sendmmsg or recvmmsg.
const maxBatch = 64

// UDP segmentation offload (UDP_SEGMENT, Linux 4.18): the bounds of one segmented
// datagram. The kernel takes at most 64 segments (UDP_MAX_SEGMENTS before 6.x;
// more since) and a datagram's payload is at most 65,507 bytes over IPv4.
const (
	maxSegments = 64
	maxGSOBytes = 65507
)

// SetGSO turns UDP segmentation offload on or off for SendBatch: consecutive
// packets of one size (the last of a run may be shorter) go to the kernel as one
// datagram, up to 64 packets or 64 KiB, which it segments into the packets, once
// through its stack instead of once per packet. The packets on the wire are those
// sent without it, but for two things, which is why it is off unless asked for: a
// capture on the sending host (loopback included) sees the unsegmented datagram,
// and the kernel numbers the segments' IPv4 identification 0, 1, 2..., where the
// ICRC assumes 0, so a RoCE NIC that checks it drops every segment but the first.
// Between odpemu processes neither matters: they do not see the IP header. If the
// kernel refuses a segmented send, the Link sends packet by packet from then on.
func (l *Link) SetGSO(on bool) { l.gso.Store(on) }

// sendScratch is a SendBatch's working memory: the headers and trailers of up to
// maxBatch packets (at most 64 bytes each), the kernel's view of them, and a
// UDP_SEGMENT control message per datagram.
type sendScratch struct {
	buf   []byte
	first [maxBatch + 1]int // the first packet of each datagram, and after the last the packets' count
	mmsgBatch
}

// cmsgSpace is the room of a control message holding a uint16 (UDP_SEGMENT's) or
// an int (UDP_GRO's) on a 64-bit Linux: CMSG_SPACE(2) = CMSG_SPACE(4), 16 bytes of
// header and the value padded to 8 (TestCmsgSpace checks it against unix.CmsgSpace).
const cmsgSpace = 24

var sendScratches = sync.Pool{New: func() any { return &sendScratch{buf: make([]byte, 0, maxBatch*64)} }}

// SendBatch sends pkts to dst in order, with one sendmmsg per maxBatch packets and
// without copying their payloads (each packet goes out as headers, payload and
// trailer); with GSO on (SetGSO), runs of equal-size packets as one datagram each.
// With faults injected it sends packet by packet through the injector.
func (l *Link) SendBatch(pkts []Packet, dst netip.AddrPort) error {
	dst = netip.AddrPortFrom(dst.Addr().Unmap(), dst.Port())
	if l.inj.loss.active() {
		var errs []error
		for i := range pkts {
			errs = append(errs, l.Send(&pkts[i], dst))
		}
		return errors.Join(errs...)
	}
	ep := Endpoints{Src: l.local, Dst: dst}
	sc := sendScratches.Get().(*sendScratch)
	defer sendScratches.Put(sc)
	for len(pkts) > 0 {
		chunk := pkts[:min(len(pkts), maxBatch)]
		buf := sc.buf[:0]
		for i := range chunk {
			var h, tr []byte
			var err error
			if buf, h, tr, err = chunk[i].AppendSplit(buf, ep); err != nil {
				return err
			}
			sc.setIov(3*i, h)
			sc.setIov(3*i+1, chunk[i].Payload)
			sc.setIov(3*i+2, tr)
		}
		gso := l.gso.Load()
		msgs := sc.group(len(chunk), dst, l.mm.v6, gso)
		for sent := 0; sent < msgs; {
			n, err := l.mm.sendmmsg(&sc.mmsgBatch, sent, msgs)
			if err == nil && n <= 0 {
				err = io.ErrNoProgress // sendmmsg returns at least one or an error: never seen
			}
			if err != nil && sc.segmented(sent) && gsoRefusal(err) {
				// The kernel refused a segmented datagram (a device without
				// checksum offload, a path MTU below a packet): send the rest of
				// the chunk packet by packet, and everything after it.
				if l.gso.Swap(false) {
					l.gsoRefused.Add(1)
				}
				chunk = chunk[:sc.first[sent]]
				break
			}
			if err != nil {
				return fmt.Errorf("roce: send to %v: %w", dst, err)
			}
			l.sent.Add(uint64(sc.first[sent+n] - sc.first[sent]))
			for i := sent; gso && i < sent+n; i++ {
				if k := sc.packets(i); k > 1 {
					l.gsoSends.Add(1)
					l.gsoSegments.Add(uint64(k))
				}
			}
			sent += n
		}
		pkts = pkts[len(chunk):]
	}
	return nil
}

// gsoRefusal reports whether err is how the kernel refuses a segmented send it
// would take unsegmented (udp_send_skb's EINVAL and EIO; EOPNOTSUPP and
// ENOPROTOOPT before UDP_SEGMENT; EMSGSIZE).
func gsoRefusal(err error) bool {
	for _, e := range []error{unix.EINVAL, unix.EIO, unix.EOPNOTSUPP, unix.ENOPROTOOPT, unix.EMSGSIZE} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}

// group makes the datagrams of n packets whose vectors are set (three each), and
// returns how many: one per packet, or with gso one per run of up to maxSegments
// packets of one size (the run's last may be shorter) and at most maxGSOBytes,
// with a UDP_SEGMENT control message giving the size.
func (sc *sendScratch) group(n int, dst netip.AddrPort, v6, gso bool) int {
	msgs := 0
	for i := 0; i < n; {
		size := sc.wireLen(i)
		k, total := 1, size
		for gso && i+k < n && k < maxSegments {
			next := sc.wireLen(i + k)
			if next > size || total+next > maxGSOBytes {
				break
			}
			k, total = k+1, total+next
			if next < size {
				break // a shorter packet ends the run
			}
		}
		sc.first[msgs] = i
		sc.setMsg(msgs, sc.setName(msgs, dst, v6), 3*i, 3*k)
		if k > 1 {
			c := sc.ctrl[msgs][:]
			h := (*unix.Cmsghdr)(unsafe.Pointer(&c[0]))
			h.Level, h.Type = unix.SOL_UDP, unix.UDP_SEGMENT
			h.SetLen(unix.CmsgLen(2))
			binary.NativeEndian.PutUint16(c[unix.CmsgLen(0):], uint16(size))
			m := &sc.hdrs[msgs].Hdr
			m.Control = &c[0]
			m.SetControllen(cmsgSpace)
		}
		msgs++
		i += k
	}
	sc.first[msgs] = n
	return msgs
}

// wireLen is packet i's datagram size: its three vectors.
func (sc *sendScratch) wireLen(i int) int {
	return int(sc.iovs[3*i].Len + sc.iovs[3*i+1].Len + sc.iovs[3*i+2].Len)
}

// segmented reports whether datagram m carries more than one packet.
func (sc *sendScratch) segmented(m int) bool { return sc.hdrs[m].Hdr.Control != nil }

// packets is how many packets datagram m carries.
func (sc *sendScratch) packets(m int) int { return sc.first[m+1] - sc.first[m] }

// recvBatches hold RecvBatch's kernel views, one call's each.
var recvBatches = sync.Pool{New: func() any { return new(mmsgBatch) }}

// RecvBatch waits for datagrams and decodes up to len(bufs) of them, one per
// buffer, with one recvmmsg: pkts[i] came from froms[i], and its payload aliases
// bufs[i] (BufferSize bytes). Datagrams that do not decode are counted and skipped;
// it returns at least one packet, or an error once the Link is closed.
func (l *Link) RecvBatch(bufs [][]byte, pkts []Packet, froms []netip.AddrPort) (int, error) {
	lens := make([]int, len(bufs))
	for {
		got, err := l.recvRaw(bufs, lens, froms, nil)
		if err != nil {
			return 0, err
		}
		kept := 0
		for i := 0; i < got; i++ {
			if lens[i] < 0 {
				continue
			}
			p, ok := l.rx.decode(bufs[i], lens[i], Endpoints{Src: froms[i], Dst: l.local}, l.lim)
			if !ok {
				continue
			}
			pkts[kept], froms[kept] = p, froms[i]
			bufs[kept], bufs[i] = bufs[i], bufs[kept]
			kept++
		}
		if kept > 0 {
			return kept, nil
		}
	}
}

// recvRaw waits for datagrams and receives up to len(bufs) of them (at most
// maxBatch) with one recvmmsg: datagram i is lens[i] bytes in bufs[i], from
// froms[i]. A datagram whose sender's address family is not the socket's is
// counted malformed and has length -1. With segs (UDP_GRO on: enableGRO), segs[i]
// is the size of the packets datagram i holds when the kernel coalesced several
// (the last may be shorter), else 0.
func (l *Link) recvRaw(bufs [][]byte, lens []int, froms []netip.AddrPort, segs []int) (int, error) {
	b := recvBatches.Get().(*mmsgBatch)
	defer recvBatches.Put(b)
	n := min(len(bufs), maxBatch)
	for i := 0; i < n; i++ {
		b.setIov(i, bufs[i])
		b.setMsg(i, unix.SizeofSockaddrInet6, i, 1)
		if segs != nil {
			m := &b.hdrs[i].Hdr
			m.Control = &b.ctrl[i][0]
			m.SetControllen(cmsgSpace)
		}
	}
	got, err := l.mm.recvmmsg(b, n)
	if err != nil {
		return 0, err
	}
	for i := 0; i < got; i++ {
		from, ok := b.name(i, l.mm.v6)
		if !ok {
			l.rx.malformed.Add(1)
			lens[i] = -1
			continue
		}
		lens[i], froms[i] = int(b.hdrs[i].Len), from
		if segs != nil {
			segs[i] = b.groSize(i)
		}
	}
	return got, nil
}

// enableGRO turns UDP_GRO (Linux 5.0) on for the Link's socket: it takes
// datagrams the kernel coalesced, each with a control message giving the size of
// its segments, so recvRaw must then be given segs and buffers of 64 KiB.
func (l *Link) enableGRO() error {
	var serr error
	err := l.mm.rc.Control(func(fd uintptr) { serr = unix.SetsockoptInt(int(fd), unix.SOL_UDP, unix.UDP_GRO, 1) })
	return errors.Join(err, serr)
}

func (l *Link) write(b []byte, dst netip.AddrPort) error {
	if _, err := l.conn.WriteToUDPAddrPort(b, dst); err != nil {
		return fmt.Errorf("roce: send to %v: %w", dst, err)
	}
	l.sent.Add(1)
	return nil
}

// Recv returns the next packet that decodes, with its sender. Its Payload aliases
// buf, which must hold the largest packet the limits allow (BufferSize). Datagrams
// that do not decode are counted and skipped. It fails only when the Link is closed
// or the socket fails.
func (l *Link) Recv(buf []byte) (Packet, netip.AddrPort, error) {
	var pkts [1]Packet
	var froms [1]netip.AddrPort
	_, err := l.RecvBatch([][]byte{buf}, pkts[:], froms[:])
	return pkts[0], froms[0], err
}

// rxCounters count what a port receives.
type rxCounters struct {
	received, malformed, badICRC atomic.Uint64
}

// decode decodes the n-byte datagram at the start of buf and counts it; a datagram
// that fills buf may have been cut short and is malformed (buf holds one byte more
// than the largest packet the limits allow).
func (c *rxCounters) decode(buf []byte, n int, ep Endpoints, lim Limits) (Packet, bool) {
	if n >= len(buf) {
		c.malformed.Add(1)
		return Packet{}, false
	}
	p, err := Decode(buf[:n], ep, lim)
	if err != nil {
		c.malformed.Add(1)
		if errors.Is(err, ErrICRC) {
			c.badICRC.Add(1)
		}
		return Packet{}, false
	}
	c.received.Add(1)
	return p, true
}

func (c *rxCounters) stats(s *LinkStats) {
	s.Received, s.Malformed, s.BadICRC = c.received.Load(), c.malformed.Load(), c.badICRC.Load()
}

// BufferSize is the receive buffer Recv needs for the limits: the largest packet,
// plus one byte to tell a datagram that is too large.
func BufferSize(lim Limits) int { return BTHSize + RETHSize + ImmDtSize + lim.MTU + ICRCSize + 1 }

// Stats returns the counters.
func (l *Link) Stats() LinkStats {
	s := LinkStats{Sent: l.sent.Load(), Foreign: l.foreign.Load(), Segmented: l.gsoSends.Load(),
		SegmentedPackets: l.gsoSegments.Load(), GSORefused: l.gsoRefused.Load()}
	l.rx.stats(&s)
	l.inj.stats(&s)
	return s
}

// maxHeaders is the most a packet adds to its payload on the wire: IPv6 40 (IPv4
// 20), UDP 8, BTH 12, RETH 16, ImmDt 4, ICRC 4, and up to 3 pad bytes.
const maxHeaders = 40 + 8 + BTHSize + RETHSize + ImmDtSize + ICRCSize + 3

// RouteMTU returns the largest path MTU (256..4096, the IBTA sizes) whose packets
// fit the IP MTU of the route from local to remote, as RoCE derives its MTU from
// the Ethernet one (1500 gives 1024).
func RouteMTU(local, remote netip.AddrPort) (int, error) {
	c, err := net.DialUDP("udp", net.UDPAddrFromAddrPort(netip.AddrPortFrom(local.Addr(), 0)), net.UDPAddrFromAddrPort(remote))
	if err != nil {
		return 0, fmt.Errorf("roce: no route from %v to %v: %w", local.Addr(), remote, err)
	}
	defer func() { _ = c.Close() }() // sent nothing: only asked for the route
	rc, err := c.SyscallConn()
	if err != nil {
		return 0, err
	}
	ipMTU, serr := 0, error(nil)
	err = rc.Control(func(fd uintptr) {
		if remote.Addr().Unmap().Is4() {
			ipMTU, serr = unix.GetsockoptInt(int(fd), unix.IPPROTO_IP, unix.IP_MTU)
		} else {
			ipMTU, serr = unix.GetsockoptInt(int(fd), unix.IPPROTO_IPV6, unix.IPV6_MTU)
		}
	})
	if err = errors.Join(err, serr); err != nil {
		return 0, fmt.Errorf("roce: the route's MTU: %w", err)
	}
	for mtu := 4096; mtu >= 256; mtu /= 2 {
		if mtu+maxHeaders <= ipMTU {
			return mtu, nil
		}
	}
	return 0, fmt.Errorf("roce: the route to %v has an IP MTU of %d, below the smallest path MTU", remote, ipMTU)
}
