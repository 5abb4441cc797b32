// Package cmdflag holds the flag values the experiment commands (odp-perf, odp-exp)
// share: byte sizes with K, M and G suffixes, and the emulated NICs' profile
// (--profile) with the link model and fault policy that replace its own
// (--link-rate, --link-delay, --link-queue, --link-buffer, --responder-faults).
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

// NIC is the flags of a flag set that choose the emulated NICs' profile (AddNIC).
type NIC struct {
	fs            *pflag.FlagSet
	profile       *string
	rate          *float64
	delay         *time.Duration
	queue, buffer Size
	faults        *string
	gso           *bool
}

// AddNIC adds the profile's flag and the link model's and fault policy's flags to
// fs: --profile names an odp.Profile preset (default the emulator's own), and the
// link and policy flags given replace the profile's settings. Their defaults are
// odp's: a 100 Gb/s link with 2 us of delay each way, RNR NAKs on faults.
func AddNIC(fs *pflag.FlagSet) *NIC {
	var names []string
	for _, p := range odp.Profiles() {
		names = append(names, p.Name)
	}
	l := &NIC{
		fs:      fs,
		profile: fs.String("profile", odp.ProfileEmulator.Name, "the emulated NICs' profile: "+strings.Join(names, ", ")+" (its fault latency, link, fault policy, memory key costs, prefetch limit, implicit children, READs outstanding; the flags below replace its settings)"),
		rate:    fs.Float64("link-rate", odp.DefaultLinkRate, "line rate of each NIC's link in Gb/s (0: unlimited)"),
		delay:   fs.Duration("link-delay", odp.DefaultLinkDelay, "one-way delay of each link (0: none)"),
		faults:  fs.String("responder-faults", "rnr", "what a responder does on a network page fault: rnr (answer RNR NAK, mlx5) or stall (wait, rxe)"),
		gso:     fs.Bool("link-gso", false, "between two processes, send runs of equal-size packets as one UDP datagram the kernel segments (faster; a capture on the sending host shows the unsegmented datagrams, and a hardware RoCE peer refuses the segments' ICRC)"),
	}
	fs.Var(&l.queue, "link-queue", "bytes a sender's transmit queue holds at most (K, M suffixes; default one bandwidth-delay product plus an MTU)")
	fs.Var(&l.buffer, "link-buffer", "bytes the receiving NIC holds that arrived and it has not taken (K, M suffixes; default the queue's size, at least 20 us of the line)")
	return l
}

// Profile returns the profile the flags give: the preset --profile names, with the
// link and fault policy flags that were given in place of its settings.
func (l *NIC) Profile() (odp.Profile, error) {
	p, err := odp.LookupProfile(*l.profile)
	if err != nil {
		return p, fmt.Errorf("--profile: %w", err)
	}
	if *l.rate < 0 || *l.delay < 0 {
		return p, fmt.Errorf("--link-rate and --link-delay must not be negative")
	}
	set := l.fs.Changed
	if set("link-rate") {
		p.Link.RateGbps = *l.rate
		if *l.rate == 0 {
			p.Link.RateGbps = -1
		}
	}
	if set("link-delay") {
		p.Link.Delay = *l.delay
		if *l.delay == 0 {
			p.Link.Delay = -1
		}
	}
	if set("link-queue") {
		p.Link.QueueBytes = int(l.queue)
	}
	if set("link-buffer") {
		p.Link.BufferBytes = int(l.buffer)
	}
	if set("link-gso") {
		p.Link.GSO = *l.gso
	}
	if set("responder-faults") {
		switch *l.faults {
		case "rnr":
			p.ResponderFaults = odp.FaultRNR
		case "stall":
			p.ResponderFaults = odp.FaultStall
		default:
			return p, fmt.Errorf("--responder-faults %q: want rnr or stall", *l.faults)
		}
	}
	return p, nil
}
