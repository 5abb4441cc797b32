package odp

import (
	"time"

	"github.com/odpemu/odpemu/transport/roce"
)

// LinkModel is the link an emulated NIC sends on: its line rate, its one-way delay
// and a bounded queue, in one process and over UDP alike. A requester's window
// then fills the link and no more, as a NIC's does: after an RNR NAK or a loss,
// go-back-N resends what was really in flight (about a bandwidth-delay product),
// not the whole window.
//
// The zero value is the default link: DefaultLinkRate, DefaultLinkDelay and a queue
// of one bandwidth-delay product plus a packet of the path MTU. NoLink is no model.
type LinkModel struct {
	// RateGbps is the line rate in Gb/s: 0 is DefaultLinkRate, negative unlimited.
	RateGbps float64
	// Delay is the one-way delay: 0 is DefaultLinkDelay, negative none.
	Delay time.Duration
	// QueueBytes bounds what is in flight on the link (sent and not yet taken by
	// the receiving NIC): 0 is one bandwidth-delay product (over the round trip)
	// plus one packet, unbounded when the rate is.
	QueueBytes int
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
	w := roce.LinkModel{Rate: m.RateGbps * 1e9, Delay: m.Delay, Queue: max(m.QueueBytes, 0)}
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

// BDPBytes is the link's bandwidth-delay product over its round trip, in bytes
// (0 for an unlimited rate).
func (m LinkModel) BDPBytes() int { return m.wire().BDP() }
