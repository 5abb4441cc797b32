package roce

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"time"
)

// ConnParams is what each side of an RC connection tells the other before traffic,
// as rdma_cm's REQ and REP carry it: the QP number, the first PSN it will send, the
// path MTU it uses, the address of its Link, and private data for the application
// (experiments put an MR's address and rkey there).
type ConnParams struct {
	QPN     uint32 // 24 bits
	PSN     uint32 // 24 bits
	MTU     int
	Addr    netip.AddrPort
	Private []byte // at most MaxPrivate bytes
}

// MaxPrivate bounds ConnParams.Private (rdma_cm's REQ allows 56 bytes; experiments
// need a little more).
const MaxPrivate = 256

// ErrCM is wrapped by every connection-setup error caused by the peer's message.
var ErrCM = errors.New("roce: connection setup")

var cmMagic = [8]byte{'o', 'd', 'p', 'e', 'm', 'u', 'c', 'm'}

// cmVersion 2 added the RTU: version 1 peers replied and sent at once.
const cmVersion = 2

// cmRTU is the active side's last setup message, rdma_cm's RTU (ready to use): it
// has attached its QP and may be sent to.
var cmRTU = [8]byte{'o', 'd', 'p', 'e', 'm', 'u', 'R', 'T'}

// Ready is what a side of a connection does between learning the peer's
// parameters and telling the peer it may send: attach its QP, as rdma_cm's passive
// side moves its QP to RTR before it sends REP and the active side to RTR and RTS
// before RTU. An error ends the setup on both sides.
type Ready func(remote ConnParams) error

// A setup message: magic (8), version (1), MTU code (1: log2(MTU)-8), private length
// (2), QPN (4), PSN (4), address (16, IPv6 or IPv4-mapped), port (2), private data.
const cmHeaderSize = 8 + 1 + 1 + 2 + 4 + 4 + 16 + 2

func (c ConnParams) check() error {
	switch {
	case c.QPN >= 1<<24 || c.PSN >= 1<<24:
		return fmt.Errorf("%w: QPN %#x or PSN %#x wider than 24 bits", ErrCM, c.QPN, c.PSN)
	case !ValidMTU(c.MTU):
		return fmt.Errorf("%w: path MTU %d", ErrCM, c.MTU)
	case len(c.Private) > MaxPrivate:
		return fmt.Errorf("%w: %d bytes of private data > %d", ErrCM, len(c.Private), MaxPrivate)
	case !c.Addr.Addr().IsValid() || c.Addr.Addr().IsUnspecified():
		return fmt.Errorf("%w: address %v", ErrCM, c.Addr)
	}
	return nil
}

func (c ConnParams) marshal() ([]byte, error) {
	if err := c.check(); err != nil {
		return nil, err
	}
	b := make([]byte, cmHeaderSize, cmHeaderSize+len(c.Private))
	copy(b, cmMagic[:])
	b[8] = cmVersion
	for n := 256; n < c.MTU; n *= 2 {
		b[9]++
	}
	be := binary.BigEndian
	be.PutUint16(b[10:], uint16(len(c.Private)))
	be.PutUint32(b[12:], c.QPN)
	be.PutUint32(b[16:], c.PSN)
	a := c.Addr.Addr().As16()
	copy(b[20:], a[:])
	be.PutUint16(b[36:], c.Addr.Port())
	return append(b, c.Private...), nil
}

// readParams reads one setup message, checking it before it allocates for its
// private data.
func readParams(r io.Reader) (ConnParams, error) {
	var h [cmHeaderSize]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		return ConnParams{}, fmt.Errorf("%w: reading the peer's parameters: %w", ErrCM, err)
	}
	if [8]byte(h[:8]) != cmMagic || h[8] != cmVersion {
		return ConnParams{}, fmt.Errorf("%w: not an odpemu peer, or another version", ErrCM)
	}
	if h[9] > 4 {
		return ConnParams{}, fmt.Errorf("%w: MTU code %d", ErrCM, h[9])
	}
	be := binary.BigEndian
	c := ConnParams{MTU: 256 << h[9], QPN: be.Uint32(h[12:]), PSN: be.Uint32(h[16:]),
		Addr: netip.AddrPortFrom(netip.AddrFrom16([16]byte(h[20:36])).Unmap(), be.Uint16(h[36:]))}
	n := int(be.Uint16(h[10:]))
	if n > MaxPrivate {
		return ConnParams{}, fmt.Errorf("%w: %d bytes of private data > %d", ErrCM, n, MaxPrivate)
	}
	if n > 0 {
		c.Private = make([]byte, n)
		if _, err := io.ReadFull(r, c.Private); err != nil {
			return ConnParams{}, fmt.Errorf("%w: reading private data: %w", ErrCM, err)
		}
	}
	return c, c.check()
}

// CM is one side's connection-management channel (a TCP connection, the role of
// rdma_cm's): it carried the exchange of ConnParams and stays open while the RC
// connection lives, so that either side learns of an orderly disconnect
// (Disconnect) or of the peer's process ending (Done).
type CM struct {
	conn net.Conn
	done chan struct{}
	err  error // why the channel ended; set before done is closed
}

func newCM(conn net.Conn) *CM {
	c := &CM{conn: conn, done: make(chan struct{})}
	go func() {
		var b [1]byte
		_, err := conn.Read(b[:]) // the peer sends nothing more: any return is the end
		if err == nil || errors.Is(err, io.EOF) {
			err = io.EOF
		}
		c.err = err
		close(c.done)
	}()
	return c
}

// Done is closed when the peer disconnected or the channel failed.
func (c *CM) Done() <-chan struct{} { return c.done }

// Err says why Done was closed (io.EOF: the peer disconnected).
func (c *CM) Err() error {
	<-c.done
	return c.err
}

// Disconnect ends the connection (rdma_disconnect): the peer's Done closes.
func (c *CM) Disconnect() error {
	err := c.conn.Close()
	<-c.done
	return err
}

// CMListener accepts connection requests, the passive side of rdma_cm.
type CMListener struct{ ln net.Listener }

// ListenCM listens for connection requests on a TCP address.
func ListenCM(addr string) (*CMListener, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("roce: %w", err)
	}
	return &CMListener{ln}, nil
}

// Addr returns the listening address.
func (l *CMListener) Addr() net.Addr { return l.ln.Addr() }

// Close stops listening; a blocked Accept returns.
func (l *CMListener) Close() error { return l.ln.Close() }

// Accept waits for a peer's request, answers with local and returns the peer's
// parameters. ctx bounds the exchange (not the wait for a peer: Close ends that).
// It is AcceptReady with nothing to do before the answer.
func (l *CMListener) Accept(ctx context.Context, local ConnParams) (ConnParams, *CM, error) {
	return l.AcceptReady(ctx, local, nil)
}

// AcceptReady waits for a peer's request, calls ready with its parameters, answers
// with local, and returns once the peer said it is ready too (its RTU): so that
// neither side sends before the other's QP can take it. A packet that arrives
// before its QP is attached is dropped (the endpoint does not know its QPN), and
// an RC requester then waits for its ACK timer, a second by default.
func (l *CMListener) AcceptReady(ctx context.Context, local ConnParams, ready Ready) (ConnParams, *CM, error) {
	msg, err := local.marshal()
	if err != nil {
		return ConnParams{}, nil, err
	}
	conn, err := l.ln.Accept()
	if err != nil {
		return ConnParams{}, nil, fmt.Errorf("roce: accept: %w", err)
	}
	return setup(ctx, conn, msg, false, ready)
}

// DialCM connects to a listener, sends local and returns the peer's parameters. It
// is DialCMReady with nothing to do before the RTU.
func DialCM(ctx context.Context, addr string, local ConnParams) (ConnParams, *CM, error) {
	return DialCMReady(ctx, addr, local, nil)
}

// DialCMReady connects to a listener, sends local, calls ready with the peer's
// answer, then tells the peer it is ready (RTU) and returns the peer's parameters.
func DialCMReady(ctx context.Context, addr string, local ConnParams, ready Ready) (ConnParams, *CM, error) {
	msg, err := local.marshal()
	if err != nil {
		return ConnParams{}, nil, err
	}
	var d net.Dialer
	conn, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return ConnParams{}, nil, fmt.Errorf("roce: connect: %w", err)
	}
	return setup(ctx, conn, msg, true, ready)
}

// setup runs the exchange on a new connection and keeps it as the CM channel, or
// closes it when the exchange fails.
func setup(ctx context.Context, conn net.Conn, msg []byte, first bool, ready Ready) (ConnParams, *CM, error) {
	remote, err := exchange(ctx, conn, msg, first, ready)
	if err != nil {
		_ = conn.Close() // the exchange's error is the one to report
		return ConnParams{}, nil, err
	}
	return remote, newCM(conn), nil
}

// exchange runs the setup, within ctx's deadline: the active side (first) sends
// msg (REQ), reads the peer's parameters (REP), calls ready and sends the RTU; the
// passive side reads the REQ, calls ready, sends msg (REP) and reads the RTU.
func exchange(ctx context.Context, conn net.Conn, msg []byte, first bool, ready Ready) (ConnParams, error) {
	deadline, ok := ctx.Deadline()
	if !ok {
		deadline = time.Now().Add(30 * time.Second) // a peer that never answers must not hang us
	}
	if err := conn.SetDeadline(deadline); err != nil {
		return ConnParams{}, err
	}
	send := func(b []byte) error {
		if _, err := conn.Write(b); err != nil {
			return fmt.Errorf("%w: %w", ErrCM, err)
		}
		return nil
	}
	if first {
		if err := send(msg); err != nil {
			return ConnParams{}, err
		}
	}
	remote, err := readParams(conn)
	if err != nil {
		return ConnParams{}, err
	}
	if ready != nil {
		if err := ready(remote); err != nil {
			return ConnParams{}, err
		}
	}
	if first {
		err = send(cmRTU[:])
	} else if err = send(msg); err == nil {
		var rtu [len(cmRTU)]byte
		if _, err = io.ReadFull(conn, rtu[:]); err != nil {
			err = fmt.Errorf("%w: waiting for the peer's RTU: %w", ErrCM, err)
		} else if rtu != cmRTU {
			err = fmt.Errorf("%w: the peer's RTU is %q", ErrCM, rtu[:])
		}
	}
	if err != nil {
		return ConnParams{}, err
	}
	return remote, conn.SetDeadline(time.Time{})
}
