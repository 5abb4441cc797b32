// Package cmdflag holds the flag values the experiment commands (odp-perf, odp-exp)
// share: byte sizes with K, M and G suffixes, and the link model and fault policy
// of the emulated NICs (--link-rate, --link-delay, --link-queue, --link-buffer,
// --responder-faults).
package cmdflag

import (
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/odpemu/odpemu/odp"
	"github.com/spf13/pflag"
)

// Size is a byte count given with an optional K, M or G suffix (binary units).
type Size int

func (s *Size) String() string { return strconv.Itoa(int(*s)) }

// Type implements pflag.Value.
func (s *Size) Type() string { return "bytes" }

// Set implements pflag.Value.
func (s *Size) Set(v string) error {
	mult := 1
	switch u := strings.ToUpper(v); {
	case strings.HasSuffix(u, "K"):
		mult, v = 1<<10, v[:len(v)-1]
	case strings.HasSuffix(u, "M"):
		mult, v = 1<<20, v[:len(v)-1]
	case strings.HasSuffix(u, "G"):
		mult, v = 1<<30, v[:len(v)-1]
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 0 || n > (1<<40)/mult {
		return fmt.Errorf("bad size %q", v)
	}
	*s = Size(n * mult)
	return nil
}

// Link is the link flags of a flag set (AddLink).
type Link struct {
	rate          *float64
	delay         *time.Duration
	queue, buffer Size
	faults        *string
}

// AddLink adds the link model's and the fault policy's flags to fs, with odp's
// defaults: a 100 Gb/s link with 2 us of delay each way, RNR NAKs on faults.
func AddLink(fs *pflag.FlagSet) *Link {
	l := &Link{
		rate:   fs.Float64("link-rate", odp.DefaultLinkRate, "line rate of each NIC's link in Gb/s (0: unlimited)"),
		delay:  fs.Duration("link-delay", odp.DefaultLinkDelay, "one-way delay of each link (0: none)"),
		faults: fs.String("responder-faults", "rnr", "what a responder does on a network page fault: rnr (answer RNR NAK, mlx5) or stall (wait, rxe)"),
	}
	fs.Var(&l.queue, "link-queue", "bytes a sender's transmit queue holds at most (K, M suffixes; default one bandwidth-delay product plus an MTU)")
	fs.Var(&l.buffer, "link-buffer", "bytes the receiving NIC holds that arrived and it has not taken (K, M suffixes; default the queue's size)")
	return l
}

// Model returns the link model and the fault policy the flags give.
func (l *Link) Model() (odp.LinkModel, odp.FaultPolicy, error) {
	m := odp.LinkModel{RateGbps: *l.rate, Delay: *l.delay, QueueBytes: int(l.queue), BufferBytes: int(l.buffer)}
	switch {
	case *l.rate < 0 || *l.delay < 0:
		return m, 0, fmt.Errorf("--link-rate and --link-delay must not be negative")
	case *l.rate == 0:
		m.RateGbps = -1
	}
	if *l.delay == 0 {
		m.Delay = -1
	}
	switch *l.faults {
	case "rnr":
		return m, odp.FaultRNR, nil
	case "stall":
		return m, odp.FaultStall, nil
	}
	return m, 0, fmt.Errorf("--responder-faults %q: want rnr or stall", *l.faults)
}
