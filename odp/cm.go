package odp

import (
	"context"
	"errors"
	"fmt"
	"net/netip"

	"golang.org/x/sys/unix"

	"github.com/odpemu/odpemu/transport/roce"
)

// UDPConfig configures a QP's RoCEv2 wire over UDP, set up the way rdma_cm does it:
// a TCP connection-manager channel carries each side's QP number, starting PSN, path
// MTU, RoCEv2 address and private data, and stays open while the connection lives.
type UDPConfig struct {
	// Addr is the local RoCEv2 address: the process's endpoint there (a UDP socket on
	// port 4791 unless Addr names another port) receives the packets of every QP
	// connected through it. It must be a specific address (the ICRC covers it); the
	// default is 127.0.0.1. Two processes on one host need two addresses (127.0.0.2
	// for the other, say), as two hosts would have.
	Addr netip.AddrPort
	// MTU is the path MTU offered (256..4096, default 4096); the connection uses
	// the smallest of the two sides' offers and what the route's IP MTU holds.
	MTU int
	// MaxMessage bounds the messages the peer may send (default 1 GiB): nothing
	// larger is taken.
	MaxMessage uint32
	// Loss injects drops, duplicates and reordering into what this side sends.
	Loss roce.Loss
	// Private is sent to the peer, which Accept or Dial returns it to (at most
	// roce.MaxPrivate bytes): experiments put an MR's address and rkey there.
	Private []byte
}

// DefaultAddr is the RoCEv2 address a QP connects from when UDPConfig.Addr is not
// set: 127.0.0.1, port 4791.
var DefaultAddr = netip.AddrPortFrom(netip.AddrFrom4([4]byte{127, 0, 0, 1}), roce.UDPPort)

func (c UDPConfig) endpoint() (*roce.Endpoint, roce.ConnParams, error) {
	if c.MTU == 0 {
		c.MTU = 4096
	}
	ep, err := c.openEndpoint()
	if err != nil {
		return nil, roce.ConnParams{}, err
	}
	return ep, roce.ConnParams{MTU: c.MTU, Addr: ep.Addr(), Private: c.Private}, nil
}

// openEndpoint opens (or shares) the process's endpoint at c.Addr.
func (c UDPConfig) openEndpoint() (*roce.Endpoint, error) {
	if !c.Addr.IsValid() {
		c.Addr = DefaultAddr
	}
	ep, err := roce.OpenEndpoint(c.Addr)
	switch {
	case errors.Is(err, unix.EADDRINUSE):
		return nil, wrap(ErrAddrInUse, "%v", err)
	case err != nil:
		return nil, wrap(ErrInvalidArgument, "%v", err)
	}
	return ep, nil
}

// Accept waits for one connection request on ln and connects qp, in RESET or INIT,
// to the requesting QP over UDP; qp is in RTS after. It returns the peer's private
// data. ctx bounds the exchange once a peer has connected; ln.Close ends the wait.
func (qp *QP) Accept(ctx context.Context, ln *roce.CMListener, cfg UDPConfig) ([]byte, error) {
	ep, local, err := cfg.endpoint()
	if err != nil {
		return nil, err
	}
	defer func() { _ = ep.Close() }() // the port holds the endpoint while it lives
	local.QPN, local.PSN = qp.qpn, qp.PSN()
	attached := false
	remote, cm, err := ln.AcceptReady(ctx, local, qp.readyUDP(ep, cfg, local, &attached))
	return qp.connectedUDP(cm, remote, err, attached)
}

// Dial connects qp, in RESET or INIT, to the QP that accepts on the connection
// manager at addr (host:port); qp is in RTS after. It returns the peer's private
// data.
func (qp *QP) Dial(ctx context.Context, addr string, cfg UDPConfig) ([]byte, error) {
	ep, local, err := cfg.endpoint()
	if err != nil {
		return nil, err
	}
	defer func() { _ = ep.Close() }() // the port holds the endpoint while it lives
	local.QPN, local.PSN = qp.qpn, qp.PSN()
	attached := false
	remote, cm, err := roce.DialCMReady(ctx, addr, local, qp.readyUDP(ep, cfg, local, &attached))
	return qp.connectedUDP(cm, remote, err, attached)
}

// ConnectRoCE connects qp, in RESET or INIT, over RoCEv2/UDP to the peer QP remote
// names at peer (port 4791 if peer names none), from the process's endpoint at local
// (RoCEv2's is port 4791; port 0 lets the kernel pick one), without a connection
// manager: the application exchanged QP numbers and PSNs itself, as verbs programs do
// before ibv_modify_qp to RTR and RTS. The path MTU is mtu (256..4096), or less if the
// route's IP MTU holds less. qp is in RTS after.
func (qp *QP) ConnectRoCE(local, peer netip.AddrPort, remote Remote, mtu int) error {
	return qp.connectRoCE(local, peer, remote, mtu, StateRTS)
}

// AttachRoCE is ConnectRoCE into RTR, as ibv_modify_qp to RTR: the QP's responder
// answers the peer from then on, and Modify(StateRTS) lets it send, from the PSN
// SetSendPSN set meanwhile if the application chose one (ibv_modify_qp to RTS).
func (qp *QP) AttachRoCE(local, peer netip.AddrPort, remote Remote, mtu int) error {
	return qp.connectRoCE(local, peer, remote, mtu, StateRTR)
}

func (qp *QP) connectRoCE(local, peer netip.AddrPort, remote Remote, mtu int, to QPState) error {
	ep, err := UDPConfig{Addr: local}.openEndpoint()
	if err != nil {
		return err
	}
	defer func() { _ = ep.Close() }() // the port holds the endpoint while it lives
	if peer.Port() == 0 {
		peer = netip.AddrPortFrom(peer.Addr(), roce.UDPPort)
	}
	return qp.attach(ep, peer, remote, mtu, 1<<31, roce.Loss{}, to)
}

// attach connects qp through ep to the QP remote names at peer, into state to.
func (qp *QP) attach(ep *roce.Endpoint, peer netip.AddrPort, remote Remote, mtu int, maxMsg uint32, loss roce.Loss,
	to QPState) error {
	// The path MTU fits both sides' offers and the route's IP MTU (each side asks
	// its own route; routes between two hosts have the same MTU both ways).
	route, err := roce.RouteMTU(ep.Addr(), peer)
	if err != nil {
		return fmt.Errorf("%w: no route from %v to %v: %w", ErrInvalidArgument, ep.Addr(), peer, err)
	}
	port, err := ep.Attach(roce.AttachConfig{QPN: qp.qpn, Peer: peer, Loss: loss, Link: qp.dev.cfg.Link.wire(),
		Limits: roce.Limits{MTU: min(mtu, route), MaxMessage: maxMsg, UC: qp.cfg.Type == QPTypeUC}})
	if err != nil {
		return wrap(ErrInvalidArgument, "%v", err)
	}
	if err := qp.connect(port, remote, to); err != nil {
		_ = port.Close() // not connected: ours to close
		return err
	}
	return nil
}

// readyUDP is Accept's and Dial's step between learning the peer's parameters and
// telling the peer it may send (roce.Ready): it attaches qp to the peer over ep and
// moves it to RTS, and notes in *attached that it did. If it cannot, qp stays as
// it was and the setup fails on both sides.
func (qp *QP) readyUDP(ep *roce.Endpoint, cfg UDPConfig, local roce.ConnParams, attached *bool) roce.Ready {
	return func(remote roce.ConnParams) error {
		maxMsg := cfg.MaxMessage
		if maxMsg == 0 {
			maxMsg = 1 << 30
		}
		if err := qp.attach(ep, remote.Addr, Remote{QPN: remote.QPN, PSN: remote.PSN}, min(local.MTU, remote.MTU), maxMsg,
			cfg.Loss, StateRTS); err != nil {
			return err
		}
		*attached = true
		return nil
	}
}

// connectedUDP ends Accept and Dial: with the setup done (err nil), qp keeps cm,
// whose end moves it to ERR, and the peer's private data is returned; a setup that
// failed after qp was attached leaves it in ERR, as a connection that broke.
func (qp *QP) connectedUDP(cm *roce.CM, remote roce.ConnParams, err error, attached bool) ([]byte, error) {
	if err != nil {
		if attached {
			qp.mu.Lock()
			qp.toErrorLocked()
			qp.mu.Unlock()
		}
		return nil, err
	}
	qp.mu.Lock()
	qp.cm = cm
	qp.mu.Unlock()
	qp.wg.Add(1)
	go func() {
		defer qp.wg.Done()
		select {
		case <-cm.Done():
			qp.mu.Lock()
			if qp.cm == cm { // not reset meanwhile
				qp.toErrorLocked()
			}
			qp.mu.Unlock()
		case <-qp.done:
		}
	}()
	return remote.Private, nil
}

// Disconnected is closed when the connection made by Accept or Dial ends: the peer
// disconnected or its process ended. It is nil for a QP connected otherwise.
func (qp *QP) Disconnected() <-chan struct{} {
	qp.mu.Lock()
	defer qp.mu.Unlock()
	if qp.cm == nil {
		return nil
	}
	return qp.cm.Done()
}

// Disconnect ends a connection made by Accept or Dial, as rdma_disconnect does:
// the peer learns of it, and both QPs move to ERR, flushing outstanding work.
func (qp *QP) Disconnect() error {
	qp.mu.Lock()
	cm := qp.cm
	qp.toErrorLocked()
	qp.mu.Unlock()
	if cm == nil {
		return wrap(ErrQPState, "QP %d was not connected by the connection manager", qp.qpn)
	}
	if err := cm.Disconnect(); err != nil {
		return fmt.Errorf("odp: disconnect: %w", err)
	}
	return nil
}
