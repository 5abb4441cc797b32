package odp

import (
	"time"

	"github.com/odpemu/odpemu/transport/roce"
)

// LinkModel is the link an emulated NIC sends on: its line rate, its one-way delay
// and a bounded transmit queue. A requester's window then fills the link and no
// more, as a NIC's does: after an RNR NAK or a loss, go-back-N resends what was
// really in flight (about a bandwidth-delay product), not the whole window.
//
// In one process the model is exact in the senders' clock (roce.LinkModel): runs
// leave at the line rate and arrive the delay later, a requester stops at a full
// queue, and one that a NAK reached sends nothing new before it took the NAK; what
// it had built or queued and had not begun to send then is taken back, not sent
// twice (QPStats.TakenBack), as a NIC builds packets only as the wire takes them.
// The receiving engine is software that may fall behind the line for a while; its
// buffer bounds that backlog, as a lossless port's would, and a sender the
// scheduler held up catches up to the line rate. A NAK counts as leaving when the
// packet it answers arrived, however late the engine got to it, and what the
// requester sent after it reached it in that clock is taken back as well, from
// the receiving side of the link: an RNR NAK resends what a NIC's would find in
// flight, not what the emulator's scheduling let the requester send meanwhile.
// Over UDP the sender paces its datagrams at the line rate and the kernel's socket
// buffers are the queue.
//
// The zero value is the default link: DefaultLinkRate, DefaultLinkDelay, a queue
// of one bandwidth-delay product plus a packet of the path MTU, and a receive
// buffer of the queue's size and at least what the line brings in 20 us. NoLink
// is no model.
type LinkModel struct {
	// RateGbps is the line rate in Gb/s: 0 is DefaultLinkRate, negative unlimited.
	RateGbps float64
	// Delay is the one-way delay: 0 is DefaultLinkDelay, negative none.
	Delay time.Duration
	// QueueBytes bounds the sender's transmit queue (sent and not yet on the
	// wire): 0 is one bandwidth-delay product (over the round trip) plus one
	// packet, unbounded when the rate is.
	QueueBytes int
	// BufferBytes bounds what arrived at the receiving NIC and it has not taken
	// yet: 0 is the queue's size, and at least what the line brings in 20 us
	// (250 KB at 100 Gb/s), which a receiving engine the scheduler held up may
	// fall behind by without holding the sender back. A larger buffer hides more
	// of the emulator's scheduling from the line rate.
	BufferBytes int
	// GSO sends each QP's runs of equal-size packets over UDP with the kernel's
	// segmentation offload: one datagram through the sending stack per run of up
	// to 64 packets instead of one per packet. A capture on the sending host then
	// shows the unsegmented datagrams, and segments carry IPv4 identifications a
	// hardware RoCE peer's ICRC check refuses: for odpemu peers only
	// (roce.Link.SetGSO). The in-process wire ignores it.
	GSO bool
}

// The default link: a 100 Gb/s port with 2 us of delay each way.
const (
	DefaultLinkRate  = 100.0 // Gb/s
	DefaultLinkDelay = 2 * time.Microsecond
)

// NoLink is no link model: unlimited rate, no delay, no queue bound (the requester's
// window alone bounds what is in flight).
var NoLink = LinkModel{RateGbps: -1, Delay: -1}

// wire is the model as the transport takes it.
func (m LinkModel) wire() roce.LinkModel {
	w := roce.LinkModel{Rate: m.RateGbps * 1e9, Delay: m.Delay, Queue: max(m.QueueBytes, 0), Buffer: max(m.BufferBytes, 0),
		GSO: m.GSO}
	if m.RateGbps == 0 {
		w.Rate = DefaultLinkRate * 1e9
	}
	if m.RateGbps < 0 {
		w.Rate = 0
	}
	if m.Delay == 0 {
		w.Delay = DefaultLinkDelay
	}
	if m.Delay < 0 {
		w.Delay = 0
	}
	return w
}

// String says what the model is at a 4096-byte path MTU: its rate, delay, queue
// and receive buffer as the link has them, defaults resolved.
func (m LinkModel) String() string { return m.wire().Describe(4096) }

// Gbps is the line rate in Gb/s, the default resolved: 0 when the rate is
// unlimited.
func (m LinkModel) Gbps() float64 { return m.wire().Rate / 1e9 }

// BDPBytes is the link's bandwidth-delay product over its round trip, in bytes
// (0 for an unlimited rate).
func (m LinkModel) BDPBytes() int { return m.wire().BDP() }
