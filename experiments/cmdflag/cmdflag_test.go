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

func parse(t *testing.T, args ...string) (odp.LinkModel, odp.FaultPolicy, error) {
	fs := pflag.NewFlagSet("t", pflag.ContinueOnError)
	l := AddLink(fs)
	require.NoError(t, fs.Parse(args))
	return l.Model()
}

func TestLink(t *testing.T) {
	m, pol, err := parse(t)
	require.NoError(t, err)
	assert.Equal(t, odp.FaultRNR, pol)
	assert.Equal(t, odp.LinkModel{RateGbps: odp.DefaultLinkRate, Delay: odp.DefaultLinkDelay}.BDPBytes(), m.BDPBytes())
	assert.Equal(t, 50000, m.BDPBytes(), "100 Gb/s over a 4 us round trip")

	m, pol, err = parse(t, "--link-rate", "0", "--link-delay", "0", "--responder-faults", "stall")
	require.NoError(t, err)
	assert.Equal(t, odp.NoLink, m)
	assert.Equal(t, odp.FaultStall, pol)

	m, _, err = parse(t, "--link-rate", "25", "--link-delay", "5us", "--link-queue", "64K", "--link-buffer", "1M")
	require.NoError(t, err)
	assert.Equal(t, odp.LinkModel{RateGbps: 25, Delay: 5000, QueueBytes: 64 << 10, BufferBytes: 1 << 20}, m)
	assert.Contains(t, m.String(), "25 Gb/s")

	for _, args := range [][]string{{"--link-rate", "-1"}, {"--link-delay", "-1us"}, {"--responder-faults", "panic"}} {
		_, _, err := parse(t, args...)
		assert.Error(t, err, "%q", args)
	}
}
