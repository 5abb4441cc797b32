package odp

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/odpemu/odpemu/transport/roce"
	"github.com/stretchr/testify/require"
)

// The two-process tests run this test binary again as a peer: ODPEMU_PEER=server
// serves a region and echoes what it receives; ODPEMU_PEER=client runs the data
// checks against a server (the network namespace test runs both roles so).
//
//	ODPEMU_PEER_LISTEN   server: the connection manager's TCP address
//	ODPEMU_PEER_CONNECT  client: the server's connection manager address
//	ODPEMU_PEER_BIND     the RoCE Link's local address (default 127.0.0.1)
//	ODPEMU_PEER_LOSS     drop probability injected into what the peer sends

// runPeer runs the role and returns the process's exit status.
func runPeer(role string) int {
	var err error
	switch role {
	case "server":
		err = peerServer()
	case "client":
		err = peerClient(os.Getenv("ODPEMU_PEER_CONNECT"))
		if err == nil {
			fmt.Println("ok")
		}
	default:
		err = fmt.Errorf("unknown peer role %q", role)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "peer:", err)
		return 1
	}
	return 0
}

// peerWire is the peer's UDP configuration from the environment.
func peerWire() (UDPConfig, error) {
	cfg := UDPConfig{Addr: netip.MustParseAddrPort("127.0.0.1:0")}
	if b := os.Getenv("ODPEMU_PEER_BIND"); b != "" {
		a, err := netip.ParseAddr(b)
		if err != nil {
			return cfg, err
		}
		cfg.Addr = netip.AddrPortFrom(a, 0)
	}
	if l := os.Getenv("ODPEMU_PEER_LOSS"); l != "" {
		p, err := strconv.ParseFloat(l, 64)
		if err != nil {
			return cfg, err
		}
		cfg.Loss = roce.Loss{Seed: uint64(os.Getpid()), Drop: p, Duplicate: p / 2, Reorder: p}
	}
	return cfg, nil
}

// peer is one side's verbs objects: a device, a CQ for everything, a QP, a 1 MiB
// ODP region for RDMA and a 4 MiB ODP region for receives.
type peer struct {
	dev        *Device
	pd         *PD
	cq         *CQ
	qp         *QP
	mem, recv  []byte
	mr, recvMR *MR
}

func newPeer() (*peer, error) {
	d, err := Open(Config{})
	if err != nil {
		return nil, err
	}
	p := &peer{dev: d}
	if p.pd, err = d.AllocPD(); err == nil {
		if p.cq, err = d.CreateCQ(4096); err == nil {
			if p.qp, err = p.pd.CreateQP(QPConfig{SendCQ: p.cq, RecvCQ: p.cq, MaxSendWR: 256, MaxRecvWR: 256}); err == nil {
				err = p.qp.Modify(StateInit) // receives may be posted from INIT on
			}
		}
	}
	for _, r := range []struct {
		b  *[]byte
		mr **MR
		n  int
	}{{&p.mem, &p.mr, 1 << 20}, {&p.recv, &p.recvMR, 4 << 20}} {
		if err != nil {
			break
		}
		if *r.b, err = d.Alloc(r.n); err == nil {
			*r.mr, err = p.pd.RegMR(*r.b, rwa|AccessOnDemand)
		}
	}
	if err != nil {
		_ = d.Close() // the error to report is err
		return nil, err
	}
	return p, nil
}

// echoSlot is the size of each receive the server keeps posted.
const echoSlot = 64 << 10

// peerServer serves one client: it exposes its region (address and rkey in the
// private data) and answers every SEND or WRITE with immediate with a SEND with
// immediate: the bytes received, and the immediate plus one.
func peerServer() error {
	p, err := newPeer()
	if err != nil {
		return err
	}
	defer func() { _ = p.dev.Close() }() // the process ends
	cfg, err := peerWire()
	if err != nil {
		return err
	}
	listen := os.Getenv("ODPEMU_PEER_LISTEN")
	if listen == "" {
		listen = "127.0.0.1:0"
	}
	ln, err := roce.ListenCM(listen)
	if err != nil {
		return err
	}
	defer func() { _ = ln.Close() }() // one client
	for i := 0; i < 64; i++ {
		if err := p.qp.PostRecv(RecvWR{WRID: uint64(i), SGL: sge(p.recvMR, i*echoSlot, echoSlot)}); err != nil {
			return err
		}
	}
	cfg.Private = binary.LittleEndian.AppendUint64(binary.LittleEndian.AppendUint32(nil, p.mr.RKey()), p.mr.Addr())
	fmt.Printf("listening %s\n", ln.Addr())
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if _, err := p.qp.Accept(ctx, ln, cfg); err != nil {
		return err
	}
	go func() {
		<-p.qp.Disconnected()
		cancel()
	}()
	wcs := make([]WC, 16)
	for {
		n, err := p.cq.Wait(ctx, wcs)
		if err != nil {
			return nil // the client disconnected: done
		}
		for _, wc := range wcs[:n] {
			if wc.Status == WCWRFlushErr {
				select {
				case <-p.qp.Disconnected():
					return nil // the receives posted when the client left
				default:
				}
			}
			if wc.Status != WCSuccess {
				return fmt.Errorf("server completion %+v", wc)
			}
			if wc.Opcode != WCRecv && wc.Opcode != WCRecvRDMAWithImm {
				continue
			}
			slot := int(wc.WRID) * echoSlot
			n := int(wc.ByteLen)
			if wc.Opcode == WCRecvRDMAWithImm {
				n = 0 // the data went to the region; the echo carries the immediate
			}
			if err := p.qp.PostSend(SendWR{WRID: wc.WRID, Opcode: OpSendImm, Imm: wc.ImmData + 1,
				SGL: sge(p.recvMR, slot, n)}); err != nil {
				return err
			}
			if err := p.qp.PostRecv(RecvWR{WRID: wc.WRID, SGL: sge(p.recvMR, slot, echoSlot)}); err != nil {
				return err
			}
		}
	}
}

// peerClient connects to the server at addr and checks, over the wire: WRITE and
// READ of the server's region, SEND and WRITE with immediate (echoed), inline
// SEND, fetch-add and compare-swap, and a fenced WRITE after a READ.
func peerClient(addr string) error {
	p, err := newPeer()
	if err != nil {
		return err
	}
	defer func() { _ = p.dev.Close() }() // the checks are done
	cfg, err := peerWire()
	if err != nil {
		return err
	}
	if cfg.Loss.Drop > 0 { // a lost tail packet costs a timeout: keep it short
		if err := p.qp.ModifyAttr(QPAttr{Timeout: 12}, AttrTimeout); err != nil {
			return err
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	private, err := p.qp.Dial(ctx, addr, cfg)
	if err != nil {
		return err
	}
	if len(private) != 12 {
		return fmt.Errorf("server private data of %d bytes", len(private))
	}
	rkey, raddr := binary.LittleEndian.Uint32(private), binary.LittleEndian.Uint64(private[4:])
	for i := 0; i < 16; i++ {
		if err := p.qp.PostRecv(RecvWR{WRID: uint64(i), SGL: sge(p.recvMR, i*echoSlot, echoSlot)}); err != nil {
			return err
		}
	}
	c := &checker{p: p, ctx: ctx}
	rng := rand.New(rand.NewPCG(5, 6))
	src := p.mem[:512<<10]
	for i := range src {
		src[i] = byte(rng.Uint32())
	}
	back := p.mem[512<<10 : 1<<20]
	// WRITE the server's region, READ it back.
	c.post(SendWR{Opcode: OpRDMAWrite, SGL: sge(p.mr, 0, 256<<10), RemoteAddr: raddr, RKey: rkey})
	c.post(SendWR{Opcode: OpRDMARead, SGL: sge(p.mr, 512<<10, 256<<10), RemoteAddr: raddr, RKey: rkey})
	if c.err == nil && !bytes.Equal(src[:256<<10], back[:256<<10]) {
		c.err = errors.New("READ returned other bytes than the WRITE wrote")
	}
	// SEND with immediate: echoed with the immediate plus one.
	c.post(SendWR{Opcode: OpSendImm, Imm: 41, SGL: sge(p.mr, 4096, 48<<10)})
	c.echo(42, src[4096:4096+48<<10])
	// Inline SEND.
	c.post(SendWR{Opcode: OpSend, Flags: SendInline, SGL: sge(p.mr, 100, 200)})
	c.echo(1, src[100:300])
	// WRITE with immediate: the data lands in the region, the echo has no bytes.
	c.post(SendWR{Opcode: OpRDMAWriteImm, Imm: 7, SGL: sge(p.mr, 8192, 4096), RemoteAddr: raddr + 300<<10, RKey: rkey})
	c.echo(8, nil)
	// Atomics on the server's region: ten fetch-adds, then a compare-swap.
	binary.NativeEndian.PutUint64(back[:8], 0)
	c.post(SendWR{Opcode: OpRDMAWrite, SGL: sge(p.mr, 512<<10, 8), RemoteAddr: raddr + 400<<10, RKey: rkey})
	for i := 0; i < 10; i++ {
		c.post(SendWR{Opcode: OpAtomicFetchAdd, CompareAdd: 3, SGL: sge(p.mr, 520<<10, 8), RemoteAddr: raddr + 400<<10, RKey: rkey})
		if got := binary.NativeEndian.Uint64(back[8<<10:]); c.err == nil && got != uint64(3*i) {
			c.err = fmt.Errorf("fetch-add %d returned %d", i, got)
		}
	}
	c.post(SendWR{Opcode: OpAtomicCmpSwap, CompareAdd: 30, Swap: 99, SGL: sge(p.mr, 520<<10, 8), RemoteAddr: raddr + 400<<10, RKey: rkey})
	c.post(SendWR{Opcode: OpRDMARead, SGL: sge(p.mr, 528<<10, 8), RemoteAddr: raddr + 400<<10, RKey: rkey})
	if got := binary.NativeEndian.Uint64(back[16<<10:]); c.err == nil && got != 99 {
		c.err = fmt.Errorf("compare-swap left %d, want 99", got)
	}
	// A READ, then a fenced WRITE over what it reads: the READ sees the old bytes.
	c.postMany([]SendWR{
		{Opcode: OpRDMARead, SGL: sge(p.mr, 600<<10, 4096), RemoteAddr: raddr, RKey: rkey},
		{Opcode: OpRDMAWrite, Flags: SendFence, SGL: sge(p.mr, 64<<10, 4096), RemoteAddr: raddr, RKey: rkey},
	})
	if c.err == nil && !bytes.Equal(p.mem[600<<10:600<<10+4096], src[:4096]) {
		c.err = errors.New("the fenced WRITE overtook the READ before it")
	}
	if c.err != nil {
		return fmt.Errorf("%w (QP counters %+v)", c.err, p.qp.Stats())
	}
	return p.qp.Disconnect()
}

// checker posts work requests and checks their completions, keeping the first
// error.
type checker struct {
	p   *peer
	ctx context.Context
	err error
	id  uint64
}

func (c *checker) post(wr SendWR) { c.postMany([]SendWR{wr}) }

// postMany posts wrs signaled and waits for their completions, in order.
func (c *checker) postMany(wrs []SendWR) {
	if c.err != nil {
		return
	}
	for _, wr := range wrs {
		c.id++
		wr.WRID, wr.Flags = 1000+c.id, wr.Flags|SendSignaled
		if c.err = c.p.qp.PostSend(wr); c.err != nil {
			return
		}
	}
	for range wrs {
		wc, err := c.next(false)
		if err != nil {
			c.err = err
			return
		}
		if wc.Status != WCSuccess {
			c.err = fmt.Errorf("%v of WR %d: %v (%s)", wc.Opcode, wc.WRID, wc.Status, wc.Detail)
			return
		}
	}
}

// echo waits for the server's echo and checks its immediate and bytes.
func (c *checker) echo(imm uint32, want []byte) {
	if c.err != nil {
		return
	}
	wc, err := c.next(true)
	switch {
	case err != nil:
		c.err = err
	case wc.Status != WCSuccess || wc.ImmData != imm || int(wc.ByteLen) != len(want):
		c.err = fmt.Errorf("echo %+v, want immediate %d and %d bytes", wc, imm, len(want))
	case !bytes.Equal(c.p.recv[int(wc.WRID)*echoSlot:][:len(want)], want):
		c.err = errors.New("the echo carried other bytes")
	default:
		c.err = c.p.qp.PostRecv(RecvWR{WRID: wc.WRID, SGL: sge(c.p.recvMR, int(wc.WRID)*echoSlot, echoSlot)})
	}
}

// pendingRecvs holds receive completions that came while a send's was awaited.
var pendingRecvs []WC

// next returns the next send (recv false) or receive completion.
func (c *checker) next(recv bool) (WC, error) {
	for i, wc := range pendingRecvs {
		if recv {
			pendingRecvs = append(pendingRecvs[:i], pendingRecvs[i+1:]...)
			return wc, nil
		}
	}
	var wcs [1]WC
	for {
		if _, err := c.p.cq.Wait(c.ctx, wcs[:]); err != nil {
			return WC{}, fmt.Errorf("waiting for a completion: %w", err)
		}
		isRecv := wcs[0].Opcode == WCRecv || wcs[0].Opcode == WCRecvRDMAWithImm
		if isRecv == recv {
			return wcs[0], nil
		}
		if !isRecv {
			return WC{}, fmt.Errorf("unexpected send completion %+v", wcs[0])
		}
		pendingRecvs = append(pendingRecvs, wcs[0])
	}
}

// startPeer starts this test binary as a peer with env (in the network namespace
// ns, if not empty) and returns the process and its standard output.
func startPeer(t *testing.T, ns string, env ...string) (*exec.Cmd, *bufio.Reader) {
	t.Helper()
	args := []string{"-test.run=^$"}
	name := os.Args[0]
	if ns != "" {
		args = append([]string{"netns", "exec", ns, name}, args...)
		name = "ip"
	}
	cmd := exec.Command(name, args...)
	cmd.Env = append(os.Environ(), env...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		_ = cmd.Process.Kill() // it exited already unless the test failed
		_ = cmd.Wait()
		if t.Failed() {
			t.Logf("peer's stderr:\n%s", stderr.String())
		}
	})
	return cmd, bufio.NewReader(out)
}

// startServer starts a server peer and returns its connection manager's address.
func startServer(t *testing.T, ns string, env ...string) (*exec.Cmd, string) {
	t.Helper()
	cmd, out := startPeer(t, ns, append(env, "ODPEMU_PEER=server")...)
	line, err := out.ReadString('\n')
	require.NoError(t, err, "the server peer did not start")
	addr, ok := strings.CutPrefix(strings.TrimSpace(line), "listening ")
	require.True(t, ok, "server said %q", line)
	return cmd, addr
}

// The data checks between two processes over UDP on loopback, without and with 1%
// loss on both sides.
func TestTwoProcesses(t *testing.T) {
	needKernel(t, Config{})
	for _, loss := range []string{"0", "0.01"} {
		t.Run("loss="+loss, func(t *testing.T) {
			cmd, addr := startServer(t, "", "ODPEMU_PEER_LOSS="+loss)
			t.Setenv("ODPEMU_PEER_LOSS", loss)
			require.NoError(t, peerClient(addr))
			require.NoError(t, cmd.Wait(), "the server saw an error")
		})
	}
}

// The same between two network namespaces joined by a veth pair: the server in
// one, the client in the other, each a process of its own.
func TestNetworkNamespaces(t *testing.T) {
	needKernel(t, Config{})
	if _, err := exec.LookPath("ip"); err != nil {
		t.Skip("skipped: the ip command (iproute2) is not installed")
	}
	suffix := strconv.Itoa(os.Getpid())
	nsA, nsB := "odpemu-a-"+suffix, "odpemu-b-"+suffix
	ip := func(args ...string) error {
		out, err := exec.Command("ip", args...).CombinedOutput()
		if err != nil {
			return fmt.Errorf("ip %s: %v: %s", strings.Join(args, " "), err, out)
		}
		return nil
	}
	if err := ip("netns", "add", nsA); err != nil {
		t.Skipf("skipped: cannot make network namespaces here (needs root): %v", err)
	}
	t.Cleanup(func() { _ = ip("netns", "del", nsA) }) // takes its veth end along
	require.NoError(t, ip("netns", "add", nsB))
	t.Cleanup(func() { _ = ip("netns", "del", nsB) })
	vethA, vethB := "odpa"+suffix, "odpb"+suffix
	if len(vethA) > 15 { // IFNAMSIZ
		vethA, vethB = vethA[:15], vethB[:15]
	}
	for _, args := range [][]string{
		{"link", "add", vethA, "netns", nsA, "type", "veth", "peer", "name", vethB, "netns", nsB},
		{"-n", nsA, "addr", "add", "10.77.0.1/24", "dev", vethA},
		{"-n", nsB, "addr", "add", "10.77.0.2/24", "dev", vethB},
		{"-n", nsA, "link", "set", vethA, "up"},
		{"-n", nsB, "link", "set", vethB, "up"},
		{"-n", nsA, "link", "set", "lo", "up"},
		{"-n", nsB, "link", "set", "lo", "up"},
	} {
		require.NoError(t, ip(args...))
	}
	server, addr := startServer(t, nsA, "ODPEMU_PEER_LISTEN=10.77.0.1:0", "ODPEMU_PEER_BIND=10.77.0.1")
	client, out := startPeer(t, nsB, "ODPEMU_PEER=client", "ODPEMU_PEER_CONNECT="+addr, "ODPEMU_PEER_BIND=10.77.0.2")
	line, _ := out.ReadString('\n')
	require.NoError(t, client.Wait(), "the client peer failed")
	require.Equal(t, "ok\n", line)
	require.NoError(t, server.Wait(), "the server peer failed")
}
