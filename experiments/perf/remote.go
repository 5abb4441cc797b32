package perf

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"time"

	"github.com/odpemu/odpemu/odp"
	"github.com/odpemu/odpemu/transport/roce"
)

// Wire configures a run between two processes over RoCEv2/UDP, as perftest runs
// between two hosts: the server (Serve) exposes a region, the client (Connect)
// drives the test against it.
type Wire struct {
	// Bind is the local address of this side's RoCEv2 endpoint. The server's
	// default is 127.0.0.1; the client's, the address its route to the server
	// leaves from, except on loopback, where it is 127.0.0.2: two processes on one
	// host take two addresses, as two hosts would, so both can have port 4791.
	Bind netip.Addr
	// Port is the UDP port of this side's endpoint: roce.UDPPort (4791) as on a
	// RoCEv2 NIC, which odp-perf uses; 0 lets the kernel pick one (tests that run
	// in parallel processes). Packets go to the peer's port either way.
	Port uint16
	// Rejected, if set, learns of each connection the server turned away because
	// its handshake failed (a port probe, another program, a client of another
	// version): the server then waits for the next client.
	Rejected func(error)
}

// privateSize is the length of the server's private data: its region's address,
// rkey and size.
const privateSize = 8 + 4 + 8

func (w Wire) udp(p Params, bind netip.Addr, mtu int) odp.UDPConfig {
	if w.Bind.IsValid() {
		bind = w.Bind
	}
	return odp.UDPConfig{Addr: netip.AddrPortFrom(bind, w.Port), MTU: mtu, Loss: p.loss()}
}

// Serve accepts one client on ln and serves it a region for p's test until it
// disconnects. It returns the server's side of the measurement: its network page
// faults, the RNR NAKs it sent, evictions under a budget, and the connection's
// duration as Elapsed.
func Serve(ctx context.Context, ln *roce.CMListener, p Params, w Wire) (Result, error) {
	if err := p.defaults(); err != nil {
		return Result{}, err
	}
	s, err := newSide(p.device(true), p)
	if err != nil {
		return Result{}, err
	}
	defer s.close()
	if p.Budget == 0 {
		fill(s.buf)
	}
	if err := s.configure(p, true); err != nil {
		return Result{}, err
	}
	t := s.target()
	private := binary.LittleEndian.AppendUint64(nil, t.addr)
	private = binary.LittleEndian.AppendUint32(private, t.rkey)
	private = binary.LittleEndian.AppendUint64(private, uint64(t.size))
	cfg := w.udp(p, netip.AddrFrom4([4]byte{127, 0, 0, 1}), 4096)
	cfg.Private = private
	before := s.dev.Stats()
	for {
		_, err := s.qp.Accept(ctx, ln, cfg)
		if err == nil {
			break
		}
		if !errors.Is(err, roce.ErrCM) || ctx.Err() != nil {
			return Result{}, err
		}
		if w.Rejected != nil {
			w.Rejected(err)
		}
	}
	if p.Test == SendBW {
		rx, err := s.startReceiver(p)
		if err != nil {
			return Result{}, err
		}
		defer func() { _ = rx.stop() }() // the client sees a failed receive as its send's error
	}
	start := time.Now()
	select {
	case <-s.qp.Disconnected():
	case <-ctx.Done():
		return Result{}, ctx.Err()
	}
	after := s.dev.Stats()
	qs := s.qp.Stats()
	r := Result{Test: p.Test, ODP: p.ODP, Bytes: p.Size, Elapsed: time.Since(start),
		PageFaults: after.PageFaults - before.PageFaults, PagesFaulted: after.PagesFaulted - before.PagesFaulted,
		FaultTime: after.FaultTime - before.FaultTime, CPUFaults: after.CPUFaults - before.CPUFaults,
		RNRNaks: qs.RNRNaksSent, Retransmissions: qs.Retransmissions, Evictions: after.Evictions - before.Evictions,
		Restores: after.Restores - before.Restores, RegTime: s.mr.Registration().Total}
	return r, nil
}

// Connect runs p's test as the client of the server whose connection manager is at
// addr, against the region the server exposes.
func Connect(ctx context.Context, addr string, p Params, w Wire) (Result, error) {
	if err := p.defaults(); err != nil {
		return Result{}, err
	}
	if p.Budget != 0 || p.InvalidateRate != 0 {
		return Result{}, fmt.Errorf("perf: --budget and --invalidate-rate act on the server: give them to it")
	}
	bind, err := routeFrom(addr)
	if err != nil {
		return Result{}, err
	}
	if bind.IsLoopback() && bind.Is4() {
		bind = clientLoopback
	}
	s, err := newSide(p.device(false), p)
	if err != nil {
		return Result{}, err
	}
	defer s.close()
	fill(s.buf)
	if err := s.configure(p, false); err != nil {
		return Result{}, err
	}
	private, err := s.qp.Dial(ctx, addr, w.udp(p, bind, 4096))
	if err != nil {
		return Result{}, err
	}
	if len(private) != privateSize {
		return Result{}, fmt.Errorf("perf: the server sent %d bytes of private data, want %d: not an odp-perf server", len(private), privateSize)
	}
	remote := target{addr: binary.LittleEndian.Uint64(private), rkey: binary.LittleEndian.Uint32(private[8:]),
		size: int(binary.LittleEndian.Uint64(private[12:]))}
	if remote.size < p.Size {
		return Result{}, fmt.Errorf("perf: the server's region is %d bytes, smaller than a %d-byte message: give both sides the same flags", remote.size, p.Size)
	}
	if p.Warm {
		warm := p
		warm.Iters = max(remote.size/p.Size, 1)
		if _, err := s.loop(warm, remote); err != nil {
			return Result{}, fmt.Errorf("perf: warm-up: %w", err)
		}
	}
	before := s.dev.Stats()
	r, err := s.loop(p, remote)
	if err != nil {
		return Result{}, err
	}
	after := s.dev.Stats()
	qs := s.qp.Stats()
	r.PageFaults, r.PagesFaulted = after.PageFaults-before.PageFaults, after.PagesFaulted-before.PagesFaulted
	r.FaultTime, r.CPUFaults = after.FaultTime-before.FaultTime, after.CPUFaults-before.CPUFaults
	r.RNRNaks, r.Retransmissions = qs.RNRNaksReceived, qs.Retransmissions
	r.Test, r.ODP, r.Warm, r.RegTime = p.Test, p.ODP, p.Warm, s.mr.Registration().Total
	if err := s.qp.Disconnect(); err != nil {
		return Result{}, err
	}
	return r, nil
}

// clientLoopback is the client's RoCEv2 address when it reaches the server over
// loopback: the server has 127.0.0.1.
var clientLoopback = netip.AddrFrom4([4]byte{127, 0, 0, 2})

// routeFrom returns the local address the route to addr's host leaves from.
func routeFrom(addr string) (netip.Addr, error) {
	c, err := net.Dial("udp", addr) // sends nothing: it only picks the route
	if err != nil {
		return netip.Addr{}, fmt.Errorf("perf: no route to %s: %w", addr, err)
	}
	defer func() { _ = c.Close() }() // a UDP socket that sent nothing
	return c.LocalAddr().(*net.UDPAddr).AddrPort().Addr().Unmap(), nil
}
