package cmdflag

import (
	"testing"

	"github.com/odpemu/odpemu/odp"
	"github.com/spf13/pflag"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestSize(t *testing.T) {
	for in, want := range map[string]int{"0": 0, "4096": 4096, "4K": 4096, "64k": 64 << 10, "1M": 1 << 20, "2G": 2 << 30} {
		var s Size
		require.NoError(t, s.Set(in), in)
		assert.Equal(t, want, int(s), in)
	}
	for _, in := range []string{"", "K", "-1", "1.5M", "1T", "2000G"} {
		var s Size
		assert.Error(t, s.Set(in), in)
	}
}

func parse(t *testing.T, args ...string) (odp.Profile, error) {
	fs := pflag.NewFlagSet("t", pflag.ContinueOnError)
	l := AddNIC(fs)
	require.NoError(t, fs.Parse(args))
	return l.Profile()
}

func TestNIC(t *testing.T) {
	p, err := parse(t)
	require.NoError(t, err)
	assert.Equal(t, odp.ProfileEmulator, p, "the default profile")
	assert.Equal(t, odp.FaultRNR, p.ResponderFaults)
	assert.Equal(t, 50000, p.Link.BDPBytes(), "100 Gb/s over a 4 us round trip")

	p, err = parse(t, "--link-rate", "0", "--link-delay", "0", "--responder-faults", "stall")
	require.NoError(t, err)
	assert.Equal(t, odp.NoLink, p.Link)
	assert.Equal(t, odp.FaultStall, p.ResponderFaults)

	p, err = parse(t, "--link-rate", "25", "--link-delay", "5us", "--link-queue", "64K", "--link-buffer", "1M")
	require.NoError(t, err)
	assert.Equal(t, odp.LinkModel{RateGbps: 25, Delay: 5000, QueueBytes: 64 << 10, BufferBytes: 1 << 20}, p.Link)
	assert.Contains(t, p.Link.String(), "25 Gb/s")
	p, err = parse(t, "--link-gso")
	require.NoError(t, err)
	assert.Equal(t, odp.LinkModel{GSO: true}, p.Link)
	assert.Contains(t, p.Link.String(), "UDP segmentation offload")

	// A profile, and a flag that replaces one of its settings.
	p, err = parse(t, "--profile", "rxe")
	require.NoError(t, err)
	assert.Equal(t, odp.ProfileRXE, p)
	p, err = parse(t, "--profile", "rxe", "--responder-faults", "rnr", "--link-rate", "40")
	require.NoError(t, err)
	assert.Equal(t, odp.FaultRNR, p.ResponderFaults)
	assert.Equal(t, odp.LinkModel{RateGbps: 40}, p.Link)
	assert.Equal(t, odp.ProfileRXE.Fault, p.Fault, "the rest is the profile's")
	assert.Equal(t, odp.ProfileRXE.PrefetchLimit, p.PrefetchLimit)

	for _, args := range [][]string{{"--link-rate", "-1"}, {"--link-delay", "-1us"}, {"--responder-faults", "panic"},
		{"--profile", "connectx9"}} {
		_, err := parse(t, args...)
		assert.Error(t, err, "%q", args)
	}
}
