package perf

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strings"
	"time"

	"github.com/odpemu/odpemu/transport/roce"
	"golang.org/x/sys/unix"
)

// The floor the wire is measured against: a plain UDP stream of packets as large as
// RoCEv2's at a 4096-byte MTU, one sendto and one recvfrom per packet, with as
// many messages in flight as the RC run (the sink acknowledges each message, as a
// responder does), between the same two processes. It moves the bytes a WRITE
// moves: each message's packets are sent from that message's slot of a region as
// large as the WRITEs' (Depth messages), and received into the slots of a region of
// the same size. Params.HotFloor sends every packet from one buffer and receives
// into one, as a stream that moves no data of its own would.

// streamPacket is the size of a full RoCEv2 packet at a 4096-byte path MTU: BTH,
// payload and ICRC.
const streamPacket = roce.BTHSize + 4096 + roce.ICRCSize

// endOfStream is the datagram that ends a stream.
var endOfStream = []byte("end")

// streamRegion returns the region a stream of p's messages is sent from or
// received into (one packet, plus a byte to tell a longer datagram, if
// p.HotFloor), its bytes set, and the packets per message.
func streamRegion(p Params) ([]byte, int) {
	perMsg := (p.Size + 4095) / 4096
	n := p.Depth * perMsg * streamPacket
	if p.HotFloor {
		n = streamPacket
	}
	region := make([]byte, n+1)
	for i := range region {
		region[i] = byte(i)
	}
	return region, perMsg
}

// slot returns packet i's place in a region from streamRegion.
func slot(region []byte, i int) []byte {
	at := (i * streamPacket) % (len(region) - 1)
	return region[at : at+streamPacket+1]
}

// UDPSink receives one UDPStream of p's messages on conn, each packet into its slot:
// it acknowledges every message with a one-byte datagram and returns at the
// stream's end.
func UDPSink(ctx context.Context, conn *net.UDPConn, p Params) error {
	if err := p.defaults(); err != nil {
		return err
	}
	region, perMsg := streamRegion(p)
	n := 0
	for {
		if err := conn.SetReadDeadline(deadline(ctx)); err != nil {
			return err
		}
		buf := slot(region, n)
		k, from, err := conn.ReadFromUDPAddrPort(buf)
		if err != nil {
			return fmt.Errorf("perf: UDP sink: %w", err)
		}
		if k == len(endOfStream) && string(buf[:k]) == string(endOfStream) {
			_, err := conn.WriteToUDPAddrPort(endOfStream, from)
			return err
		}
		if n++; n%perMsg == 0 {
			if _, err := conn.WriteToUDPAddrPort([]byte{1}, from); err != nil {
				return err
			}
		}
	}
}

// UDPStream sends p.Iters messages of p.Size bytes to a UDPSink at addr, in
// packets of streamPacket bytes, keeping p.Depth messages unacknowledged. It
// reports bandwidth as loop does (payload bytes only).
func UDPStream(ctx context.Context, addr string, p Params) (Result, error) {
	if err := p.defaults(); err != nil {
		return Result{}, err
	}
	raddr, err := net.ResolveUDPAddr("udp", addr)
	if err != nil {
		return Result{}, err
	}
	conn, err := net.DialUDP("udp", nil, raddr)
	if err != nil {
		return Result{}, err
	}
	defer func() { _ = conn.Close() }() // the stream is over
	SetBuffers(conn)
	region, perMsg := streamRegion(p)
	acks := make(chan error, p.Iters+1)
	go func() {
		b := make([]byte, 16)
		for {
			if err := conn.SetReadDeadline(deadline(ctx)); err != nil {
				acks <- err
				return
			}
			k, err := conn.Read(b)
			if err != nil {
				acks <- err
				return
			}
			acks <- nil
			if k == len(endOfStream) {
				return
			}
		}
	}()
	start := time.Now()
	for sent, acked := 0, 0; acked < p.Iters; {
		for sent < p.Iters && sent-acked < p.Depth {
			for i := 0; i < perMsg; i++ {
				if _, err := conn.Write(slot(region, sent*perMsg+i)[:streamPacket]); err != nil {
					return Result{}, err
				}
			}
			sent++
		}
		if err := <-acks; err != nil {
			return Result{}, fmt.Errorf("perf: UDP stream: %w (a lost packet stalls the stream)", err)
		}
		acked++
	}
	elapsed := time.Since(start)
	if _, err := conn.Write(endOfStream); err != nil {
		return Result{}, err
	}
	if err := <-acks; err != nil {
		return Result{}, err
	}
	total := float64(p.Size) * float64(p.Iters)
	return Result{Test: "udp_stream", Bytes: p.Size, Iters: p.Iters, Elapsed: elapsed,
		AvgMiBps: total / elapsed.Seconds() / (1 << 20), MsgRateMpps: float64(p.Iters) / elapsed.Seconds() / 1e6}, nil
}

// deadline bounds one wait of the stream: a lost packet stalls a plain UDP stream
// for good, which must end in an error, not a hang.
func deadline(ctx context.Context) time.Time {
	d := time.Now().Add(10 * time.Second)
	if c, ok := ctx.Deadline(); ok && c.Before(d) {
		return c
	}
	return d
}

// SetBuffers gives conn the socket buffers a Link has (roce.SocketBuffer, beyond
// rmem_max where the process may), so that the floor and the wire queue alike.
func SetBuffers(conn *net.UDPConn) {
	rc, err := conn.SyscallConn()
	if err != nil {
		return
	}
	_ = rc.Control(func(fd uintptr) {
		for _, o := range [][2]int{{unix.SO_RCVBUFFORCE, unix.SO_RCVBUF}, {unix.SO_SNDBUFFORCE, unix.SO_SNDBUF}} {
			if unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, o[0], roce.SocketBuffer) != nil {
				_ = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, o[1], roce.SocketBuffer) // capped, never refused
			}
		}
	})
}

// WireRound is one round of the wire comparison: the same WRITE test over the UDP
// floor, pinned and ODP (warm), in that order. Rounds may also take "pinned-cold"
// and "odp-cold": one pass over a fresh region of Iters messages on both sides.
var WireRound = []string{"udp", "pinned", "odp"}

// wireKind returns p as a round's kind runs it.
func wireKind(kind string, p Params) Params {
	p.ODP = strings.HasPrefix(kind, "odp")
	if strings.HasSuffix(kind, "-cold") {
		p.MRSize = p.Iters * p.Size
	} else {
		p.Warm = p.ODP // the client's warm-up pass; the server ignores it
	}
	return p
}

// WireServer serves rounds of the wire comparison: for each round, a UDP sink on
// conn (whose buffers SetBuffers set before its address was given out), then a
// pinned and an ODP server on ln, with p's parameters, its endpoint as w says.
func WireServer(ctx context.Context, ln *roce.CMListener, conn *net.UDPConn, p Params, w Wire, rounds int, kinds []string) error {
	if err := p.defaults(); err != nil {
		return err
	}
	for r := 0; r < rounds; r++ {
		for _, kind := range kinds {
			var err error
			switch kind {
			case "udp":
				err = UDPSink(ctx, conn, p)
			default:
				_, err = Serve(ctx, ln, wireKind(kind, p), w)
			}
			if err != nil {
				return fmt.Errorf("perf: round %d, %s: %w", r, kind, err)
			}
		}
	}
	return nil
}

// ServeWireRounds is a wire comparison's server process: it listens on loopback,
// tells print its connection manager's and UDP sink's addresses, and serves rounds
// of WireServer with p and w.
func ServeWireRounds(ctx context.Context, p Params, w Wire, rounds int, kinds []string, print func(cm, udp string)) error {
	ln, err := roce.ListenCM("127.0.0.1:0")
	if err != nil {
		return err
	}
	defer func() { _ = ln.Close() }() // served
	conn, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close() }() // served
	SetBuffers(conn)                    // before the client may send: a full default buffer drops
	print(ln.Addr().String(), conn.LocalAddr().String())
	return WireServer(ctx, ln, conn, p, w, rounds, kinds)
}

// WireClient runs rounds of the wire comparison against a WireServer and returns
// each kind's bandwidths in round order; w sets the client's endpoint.
func WireClient(ctx context.Context, cmAddr, udpAddr string, p Params, w Wire, rounds int, kinds []string) (map[string][]float64, error) {
	out := map[string][]float64{}
	for r := 0; r < rounds; r++ {
		for _, kind := range kinds {
			var res Result
			var err error
			switch kind {
			case "udp":
				res, err = UDPStream(ctx, udpAddr, p)
			default:
				// The server's listener stays open: the connection waits in its
				// backlog until it accepts.
				res, err = Connect(ctx, cmAddr, wireKind(kind, p), w)
			}
			if err != nil {
				return nil, fmt.Errorf("perf: round %d, %s: %w", r, kind, err)
			}
			out[kind] = append(out[kind], res.AvgMiBps)
		}
	}
	return out, nil
}

// StartWireServer starts exe (this program) with args as the server process and
// returns the connection manager's and the UDP sink's addresses it prints first,
// and a function that waits for it.
func StartWireServer(exe string, args []string) (cm, udp string, wait func() error, err error) {
	cmd := exec.Command(exe, args...)
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		return "", "", nil, err
	}
	if err := cmd.Start(); err != nil {
		return "", "", nil, err
	}
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		_ = cmd.Process.Kill() // it did not start as it should
		_ = cmd.Wait()
		return "", "", nil, fmt.Errorf("perf: wire server: %w", err)
	}
	if _, err := fmt.Sscanf(line, "cm %s udp %s", &cm, &udp); err != nil {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		return "", "", nil, fmt.Errorf("perf: wire server said %q", line)
	}
	return cm, udp, cmd.Wait, nil
}
