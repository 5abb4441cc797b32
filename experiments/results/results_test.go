package results

import (
	"encoding/json"
	"errors"
	"math"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestTableRoundTrip(t *testing.T) {
	tb, err := NewTable("reg", "size_bytes", "method", "rep", "time_ns", "ratio", "ok")
	require.NoError(t, err)
	require.NoError(t, tb.Add(4096, "pinned", 0, 1500*time.Nanosecond, 0.1, true))
	require.NoError(t, tb.Add(int64(1<<30), "odp", uint64(1), time.Duration(27800), 1.0/3, false))
	dir := t.TempDir()
	path, err := tb.WriteCSV(dir)
	require.NoError(t, err)
	assert.Equal(t, filepath.Join(dir, "reg.csv"), path)
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	assert.Equal(t, "size_bytes,method,rep,time_ns,ratio,ok\n4096,pinned,0,1500,0.1,true\n"+
		"1073741824,odp,1,27800,0.3333333333333333,false\n", string(b))

	back, err := ReadCSV(path)
	require.NoError(t, err)
	assert.Equal(t, tb, back)
	rows := back.Rows(Where("method", "odp"))
	require.Len(t, rows, 1)
	assert.Equal(t, 1.0/3, rows[0].Float("ratio"), "floats read back exactly")
	assert.True(t, math.IsNaN(rows[0].Float("method")))
	assert.Equal(t, "", rows[0].Get("nope"))
	assert.Equal(t, []float64{1500, 27800}, Floats(back.Rows(nil), "time_ns"))
	assert.Equal(t, []string{"pinned", "odp"}, Distinct(back.Rows(nil), "method"))
}

func TestTableSchema(t *testing.T) {
	_, err := NewTable("x", "a", "a")
	assert.True(t, errors.Is(err, ErrSchema))
	_, err = NewTable("x")
	assert.True(t, errors.Is(err, ErrSchema))
	tb, err := NewTable("x", "a", "b")
	require.NoError(t, err)
	assert.True(t, errors.Is(tb.Add(1), ErrSchema), "too few values")
	assert.True(t, errors.Is(tb.Add(1, []int{2}), ErrSchema), "unsupported type")
	assert.Zero(t, tb.Len())

	dir := t.TempDir()
	bad := filepath.Join(dir, "bad.csv")
	require.NoError(t, os.WriteFile(bad, []byte("a,b\n1,2\n3\n"), 0o644))
	_, err = ReadCSV(bad)
	assert.True(t, errors.Is(err, ErrSchema), "a short row: %v", err)
	empty := filepath.Join(dir, "empty.csv")
	require.NoError(t, os.WriteFile(empty, nil, 0o644))
	_, err = ReadCSV(empty)
	assert.True(t, errors.Is(err, ErrSchema))
}

func TestManifest(t *testing.T) {
	m := Manifest{Machine: Describe(), Revision: Revision(), Config: map[string]int{"reps": 3}}
	assert.NotEmpty(t, m.Machine.Kernel)
	assert.Positive(t, m.Machine.Cores)
	assert.Positive(t, m.Machine.MemoryBytes)
	assert.NotEmpty(t, m.Machine.THP)
	assert.Contains(t, m.Machine.String(), m.Machine.Kernel)
	if m.Machine.UserfaultfdError == "" {
		assert.NotEmpty(t, m.Machine.UserfaultfdFeatures)
	}
	dir := t.TempDir()
	require.NoError(t, m.Write(dir))
	b, err := os.ReadFile(filepath.Join(dir, "manifest.json"))
	require.NoError(t, err)
	var back map[string]any
	require.NoError(t, json.Unmarshal(b, &back))
	assert.Contains(t, back, "machine")
	assert.Equal(t, map[string]any{"reps": 3.0}, back["config"])
}

// /proc/stat's first line gives the total and the steal ticks (guest time, already
// in user and nice, is not added twice); the share is the steal over the total
// between two readings, and nothing when no time passed.
func TestCPUTimes(t *testing.T) {
	c, err := parseCPUTimes([]byte("cpu  100 5 50 800 10 1 2 32 7 0\ncpu0 50 2 25 400 5 0 1 16 3 0\n"))
	require.NoError(t, err)
	assert.Equal(t, CPUTimes{Total: 1000, Steal: 32}, c)
	_, err = parseCPUTimes([]byte("cpu  100 5 50 800\n"))
	assert.Error(t, err, "a kernel without the steal column")
	later := CPUTimes{Total: 2000, Steal: 132}
	require.NotNil(t, StealShare(c, later))
	assert.InDelta(t, 0.1, *StealShare(c, later), 1e-12)
	assert.Nil(t, StealShare(c, c))
	now, err := ReadCPUTimes()
	require.NoError(t, err, "this machine's /proc/stat")
	assert.Positive(t, now.Total)
	assert.LessOrEqual(t, now.Steal, now.Total)
}
