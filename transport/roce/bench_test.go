package roce

import (
	"net"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// BenchmarkSessionWrite moves 1 MiB WRITEs over a Session on loopback (4 KiB path
// MTU, 4 in flight: RC has no flow control below the requester's window, and more
// than the receiver's socket buffer in flight is lost and sent again);
// BenchmarkUDPStream sends datagrams of the same packet size between two sockets,
// with as much in flight, received by a reader, as the floor the wire is measured
// against. Compare their MB/s run side by side:
//
//	go test -run XXX -bench 'SessionWrite|UDPStream' -count 5 ./transport/roce
func BenchmarkSessionWrite(b *testing.B) {
	lim := Limits{MTU: 4096, MaxMessage: 1 << 20}
	la, err := Listen(netipAP("127.0.0.1:0"), lim, Loss{})
	if err != nil {
		b.Fatal(err)
	}
	lb, err := Listen(netipAP("127.0.0.2:0"), lim, Loss{})
	if err != nil {
		b.Fatal(err)
	}
	mem := make([]byte, 1<<20)
	cfg := SessionConfig{Requester: RequesterConfig{Timeout: 50 * time.Millisecond, RetryCnt: 7, RNRRetry: 7}}
	ra := newRequester()
	a := NewSession(la.Dial(lb.LocalAddr()), cfg, ra)
	defer a.Close()
	s := NewSession(lb.Dial(la.LocalAddr()), cfg, copier(mem))
	defer s.Close()
	src := make([]byte, 1<<20)
	b.SetBytes(int64(len(src)))
	b.ResetTimer()
	const depth = 4
	posted, done := 0, 0
	for done < b.N {
		for posted < b.N && posted-done < depth {
			if err := a.Post(uint64(posted), Message{Kind: KindWrite, RKey: 1, Payload: src}); err != nil {
				b.Fatal(err)
			}
			posted++
		}
		c := <-ra.done
		if c.Status != StatusSuccess {
			b.Fatalf("completion %+v", c)
		}
		done++
	}
	b.ReportMetric(float64(a.RequesterStats().Retransmitted), "retransmitted")
}

// copier is a responder that copies WRITEs into its memory.
type copier []byte

func (m copier) Execute(msg *Message, _ bool) Answer {
	copy(m[msg.VA:], msg.Payload)
	return Answer{}
}
func (m copier) Complete(Completion) {}
func (m copier) Lost(error)          {}

func BenchmarkUDPStream(b *testing.B) {
	rx, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 2)})
	if err != nil {
		b.Fatal(err)
	}
	defer func() { _ = rx.Close() }()
	if rc, err := rx.SyscallConn(); err == nil { // the Link's buffer, for a fair floor
		_ = rc.Control(func(fd uintptr) {
			_ = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, SocketBuffer)
		})
	}
	tx, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		b.Fatal(err)
	}
	defer func() { _ = tx.Close() }()
	const pkt = BTHSize + 4096 + ICRCSize
	perMsg := (1 << 20) / 4096
	b.SetBytes(1 << 20)
	got := make(chan int, 1)
	var received atomic.Int64
	go func() {
		buf := make([]byte, 65536)
		n := 0
		for n < b.N*perMsg {
			if _, err := rx.Read(buf); err != nil {
				break
			}
			n++
			received.Store(int64(n))
		}
		got <- n
	}()
	window := int64(4 * perMsg) // as many bytes in flight as the Session's 4 WRITEs
	msg := make([]byte, pkt)
	to := rx.LocalAddr().(*net.UDPAddr).AddrPort()
	b.ResetTimer()
	for i := 0; i < b.N*perMsg; i++ {
		for int64(i)-received.Load() >= window {
			runtime.Gosched() // the window is full: the reader catches up
		}
		if _, err := tx.WriteToUDPAddrPort(msg, to); err != nil {
			b.Fatal(err)
		}
	}
	select {
	case n := <-got:
		if n < b.N*perMsg {
			b.Fatalf("received %d of %d", n, b.N*perMsg)
		}
	case <-time.After(10 * time.Second):
		b.Fatalf("datagrams were lost: the stream is faster than its reader")
	}
}

func (m copier) Reload(uint64, []byte) error { return nil }
