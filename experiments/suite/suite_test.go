package suite

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/odpemu/odpemu/experiments/results"
	"github.com/odpemu/odpemu/internal/fusemount"
	"github.com/odpemu/odpemu/odp"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func table(t *testing.T, rows ...[]any) *results.Table {
	t.Helper()
	tb, err := results.NewTable("x", "size_bytes", "variant", "rep", "total_ns")
	require.NoError(t, err)
	for _, r := range rows {
		require.NoError(t, tb.Add(r...))
	}
	return tb
}

// perRep pairs measurements by repetition, skips unpaired ones and zero
// denominators.
func TestPerRep(t *testing.T) {
	tb := table(t, []any{4096, "pinned", 0, 10}, []any{4096, "odp", 0, 5}, []any{4096, "pinned", 1, 0},
		[]any{4096, "odp", 1, 7}, []any{4096, "odp", 2, 3})
	assert.Equal(t, []float64{0.5}, perRep(tb, "total_ns", sel("variant", "odp"), sel("variant", "pinned")))
}

func TestCrossover(t *testing.T) {
	sizes := []int{4096, 16384, 65536}
	tb := table(t, []any{4096, "pinned", 0, 1}, []any{4096, "odp", 0, 2}, []any{16384, "pinned", 0, 2},
		[]any{16384, "odp", 0, 1}, []any{65536, "pinned", 0, 4}, []any{65536, "odp", 0, 1})
	assert.Equal(t, "16 KiB", crossover(tb, sizes, "odp"))
	tb = table(t, []any{4096, "pinned", 0, 2}, []any{4096, "odp", 0, 1}, []any{16384, "pinned", 0, 2},
		[]any{16384, "odp", 0, 1}, []any{65536, "pinned", 0, 4}, []any{65536, "odp", 0, 5})
	assert.Equal(t, "none up to 64 KiB", crossover(tb, sizes, "odp"), "ODP loses at the largest size")
}

func TestSizesAndFormats(t *testing.T) {
	assert.Equal(t, []int{4096, 16384, 65536}, sizesPow4(4096, 100000))
	assert.Equal(t, "12.3µs", dur(12345))
	assert.Equal(t, "1.5s", dur(1.5e9))
	assert.Equal(t, "14018x", ratio(14018.2))
	assert.Equal(t, "0.87x", ratio(0.87))
	assert.Equal(t, 2, pick(Quick, 1, 2, 3))
}

// The summary names the machine, links each headline to its experiment's CSV,
// escapes table cells and shows every figure.
func TestSummary(t *testing.T) {
	dir := t.TempDir()
	rep := &Report{Dir: dir, Scale: Tiny, Headlines: []Headline{{Experiment: "registration", What: "a | b", Value: "3x", Detail: "x"},
		{Experiment: "registration", What: "c", Value: "2.5x", Interval: "2.1x–2.9x", Detail: "y"}}}
	rep.Manifest.Machine.Kernel = "6.18"
	rep.Manifest.WallTime = time.Second
	rep.Manifest.Experiments = []results.ExperimentRecord{{Name: "registration", Rows: 4,
		Files: []string{"registration.csv", "registration.png", "registration.svg"}}, {Name: "rnr", Error: "boom"}}
	require.NoError(t, writeSummary(rep))
	b, err := os.ReadFile(filepath.Join(dir, "summary.md"))
	require.NoError(t, err)
	s := string(b)
	assert.Contains(t, s, "Linux 6.18")
	assert.Contains(t, s, "| [registration](registration.csv) | a \\| b | 3x |  | x |", "a count has no interval")
	assert.Contains(t, s, "| [registration](registration.csv) | c | 2.5x | 2.1x–2.9x | y |")
	assert.Contains(t, s, "![registration](registration.png)")
	assert.Contains(t, s, "**failed**: boom")
	assert.Equal(t, 1, strings.Count(s, "## Headlines"))
}

// A file setup removes its mount point's directory when it closes: nothing is left
// mounted or in the temporary directory.
func TestFileSetupCleansUp(t *testing.T) {
	if err := fusemount.Available(); err != nil {
		t.Skip(err)
	}
	t.Setenv("TMPDIR", t.TempDir())
	s, err := newFileSetup(1<<20, 1, odp.Config{})
	require.NoError(t, err)
	mnt := filepath.Join(s.dir, "mnt")
	mounts, err := os.ReadFile("/proc/self/mounts")
	require.NoError(t, err)
	require.Contains(t, string(mounts), " "+mnt+" ", "mounted while the setup lives")
	s.close()
	_, err = os.Stat(s.dir)
	assert.ErrorIs(t, err, os.ErrNotExist, "the directory outlived the setup")
	mounts, err = os.ReadFile("/proc/self/mounts")
	require.NoError(t, err)
	assert.NotContains(t, string(mounts), " "+mnt+" ")
}

// A scale's name gives the scale back, as Replot reads it from a manifest (reports
// that say how large a run's measurements were depend on it); other names none.
func TestScaleNamed(t *testing.T) {
	for _, s := range []Scale{Tiny, Quick, Full} {
		got, ok := scaleNamed(s.String())
		assert.True(t, ok)
		assert.Equal(t, s, got)
	}
	_, ok := scaleNamed("huge")
	assert.False(t, ok)
}

// ci writes a median's 95% bootstrap interval, which brackets the median; a
// sample of one says it has one repetition, an empty one has none.
func TestCI(t *testing.T) {
	xs := []float64{0.8, 0.9, 1.0, 1.1, 1.2, 0.95, 1.05, 1.0, 0.85, 1.15}
	lo, hi, ok := strings.Cut(ci(xs, fixed2), "–")
	require.True(t, ok, "an interval is lo–hi")
	l, err := strconv.ParseFloat(lo, 64)
	require.NoError(t, err)
	h, err := strconv.ParseFloat(hi, 64)
	require.NoError(t, err)
	assert.True(t, l <= 1.0 && 1.0 <= h && l < h, "%v-%v brackets the median 1.0", l, h)
	assert.Equal(t, "1.50 (one repetition)", ci([]float64{1.5}, fixed2))
	assert.Equal(t, "-", ci(nil, fixed2))
	v, i := medianCI(xs, fixed2)
	assert.Equal(t, "1.00", v)
	assert.Equal(t, ci(xs, fixed2), i)
}

// The sweep takes each ODP run over the median of its repetition's references, at
// every latency: one slow reference run does not make its latency's ratio.
func TestSweepRatios(t *testing.T) {
	tb, err := results.NewTable("sweep", "fault_latency_us", "conclusion", "rep", "odp", "reference", "ratio", "network_page_faults")
	require.NoError(t, err)
	for _, r := range [][]any{
		{5, "overcommit", 0, 10, 100, 0.1, 1}, {20, "overcommit", 0, 10, 400, 0.025, 1}, {50, "overcommit", 0, 20, 100, 0.2, 1},
		{5, "overcommit", 1, 30, 300, 0.1, 1}, {20, "overcommit", 1, 30, 300, 0.1, 1},
		{5, "coldpass", 0, 1, 1000, 0.001, 1},
	} {
		require.NoError(t, tb.Add(r...))
	}
	assert.Equal(t, []float64{0.1, 0.1}, sweepRatios(tb, "overcommit", 5))
	assert.Equal(t, []float64{0.1, 0.1}, sweepRatios(tb, "overcommit", 20), "over the median reference, not the slow one beside it")
	assert.Equal(t, []float64{0.2}, sweepRatios(tb, "overcommit", 50))
	assert.Empty(t, sweepRatios(tb, "invalidation", 5))
}
