package invalidate

import (
	"sync"
	"testing"

	"github.com/odpemu/odpemu/internal/testmem"
	"github.com/odpemu/odpemu/pagefault"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"golang.org/x/sys/unix"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

type recorder struct {
	mu   sync.Mutex
	got  []Range
	why  []Reason
	open int // started, not yet ended
}

func (r *recorder) InvalidateStart(rg Range, why Reason) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.got = append(r.got, rg)
	r.why = append(r.why, why)
	r.open++
}

func (r *recorder) InvalidateEnd(rg Range, why Reason) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.open--
}

func (r *recorder) ranges() []Range {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]Range(nil), r.got...)
}

func TestRegistryClipsAndSkipsDisjoint(t *testing.T) {
	g := NewRegistry()
	a, b := &recorder{}, &recorder{}
	sa := g.Insert(100, 200, a)
	g.Insert(300, 400, b)
	changed := false
	n, err := g.Invalidate(Range{Start: 150, End: 350}, ReasonExplicit, func() error {
		changed = true
		assert.Equal(t, 1, a.open, "change runs between start and end")
		return nil
	})
	require.NoError(t, err)
	assert.True(t, changed)
	assert.Equal(t, 2, n, "both overlap [150, 350)")
	assert.Zero(t, a.open)
	assert.Equal(t, []Range{{Start: 150, End: 200}}, a.ranges())
	assert.Equal(t, []Range{{Start: 300, End: 350}}, b.ranges())
	n, _ = g.Invalidate(Range{Start: 200, End: 300}, ReasonExplicit, nil)
	assert.Equal(t, 0, n, "touching, not overlapping")
	sa.Remove()
	sa.Remove()
	n, _ = g.Invalidate(Range{Start: 0, End: 1000}, ReasonRemove, nil)
	assert.Equal(t, 1, n)
	assert.Len(t, a.ranges(), 1, "removed subscriber not called")
	assert.EqualValues(t, 2, g.Count(ReasonExplicit))
	assert.EqualValues(t, 1, g.Count(ReasonRemove))
	assert.Equal(t, "remap", ReasonRemap.String())
	assert.Equal(t, "migrate", ReasonMigrate.String())
	assert.Equal(t, "Reason(99)", Reason(99).String(), "never panics")
	assert.Equal(t, "Reason(-1)", Reason(-1).String())
	assert.Zero(t, g.Count(Reason(99)))
}

// pumped maps npages, registers them with a userfaultfd asking for the
// non-cooperative events, and starts a fault server and a pump over reg. Tests that
// unmap part of the mapping tell the returned owned.
func pumped(t *testing.T, npages int, reg *Registry, disabled bool) ([]byte, *pagefault.CPUServer, *Pump, *testmem.Owned) {
	t.Helper()
	b, err := unix.Mmap(-1, 0, npages*ps, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	require.NoError(t, err)
	_ = unix.Madvise(b, unix.MADV_NOHUGEPAGE) // 4 KiB pages whatever the THP setting
	own := testmem.Own(b)
	u, err := pagefault.Open(pagefault.Options{Features: pagefault.FeatureEventRemove | pagefault.FeatureEventUnmap | pagefault.FeatureEventRemap})
	require.NoError(t, err)
	_, err = u.Register(addrOf(b), uintptr(len(b)), pagefault.ModeMissing)
	require.NoError(t, err)
	s, err := pagefault.StartCPUServer(u, 1)
	require.NoError(t, err)
	p, err := StartPump(s, reg, disabled)
	require.NoError(t, err)
	t.Cleanup(func() {
		p.Stop()
		require.NoError(t, s.Stop())
		require.NoError(t, u.Close())
		own.Unmap()
	})
	return b, s, p, own
}

func TestPumpTurnsEventsIntoInvalidations(t *testing.T) {
	g := NewRegistry()
	rec := &recorder{}
	b, s, p, own := pumped(t, 32, g, false)
	base := addrOf(b)
	g.Insert(base, base+32*pz, rec)
	for i := 0; i < 32; i++ {
		b[i*ps] = 1
	}

	require.NoError(t, unix.Madvise(b[ps:3*ps], unix.MADV_DONTNEED))
	require.NoError(t, p.Sync())
	assert.Equal(t, []Range{{Start: base + pz, End: base + 3*pz}}, rec.ranges())

	// Unmap the last 4 pages: the pages are gone, the registration with them.
	_, _, e := unix.Syscall(unix.SYS_MUNMAP, base+28*pz, 4*pz, 0) // unix.Munmap wants whole mappings
	require.Zero(t, e)
	own.Drop(Range{Start: base + 28*pz, End: base + 32*pz})
	require.NoError(t, p.Sync())
	assert.Equal(t, Range{Start: base + 28*pz, End: base + 32*pz}, rec.ranges()[1])

	_ = s
	st := p.Stats()
	assert.EqualValues(t, 2, st.Events)
	assert.EqualValues(t, 1, st.Removes)
	assert.EqualValues(t, 1, st.Unmaps)
	assert.NotZero(t, st.Latency)
	assert.GreaterOrEqual(t, st.MaxLat, st.Latency/2)
}

func TestPumpRemap(t *testing.T) {
	g := NewRegistry()
	rec := &recorder{}
	b, _, p, own := pumped(t, 8, g, false)
	base := addrOf(b)
	g.Insert(base, base+8*pz, rec)
	b[0] = 9
	// Move the first two pages elsewhere (MREMAP_MAYMOVE|MREMAP_FIXED into a fresh hole).
	hole, err := unix.Mmap(-1, 0, 2*ps, unix.PROT_NONE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	require.NoError(t, err)
	to, _, e := unix.Syscall6(unix.SYS_MREMAP, base, 2*pz, 2*pz, unix.MREMAP_MAYMOVE|unix.MREMAP_FIXED, addrOf(hole), 0)
	require.Zero(t, e)
	require.Equal(t, addrOf(hole), to)
	own.Drop(Range{Start: base, End: base + 2*pz})
	defer func() { require.NoError(t, unix.Munmap(hole)) }()
	require.NoError(t, p.Sync())
	// REMAP, then UNMAP of the old range (its VMA still carried the context).
	for _, r := range rec.ranges() {
		assert.Equal(t, Range{Start: base, End: base + 2*pz}, r)
	}
	assert.Contains(t, rec.why, ReasonRemap)
	assert.EqualValues(t, 1, p.Stats().Remaps)
	assert.EqualValues(t, 9, hole[0], "the page moved with its content, to where hole was")
}

func TestPumpDisabledDropsEvents(t *testing.T) {
	g := NewRegistry()
	rec := &recorder{}
	b, _, p, _ := pumped(t, 4, g, true)
	g.Insert(addrOf(b), addrOf(b)+4*pz, rec)
	b[0] = 1
	require.NoError(t, unix.Madvise(b, unix.MADV_DONTNEED))
	require.NoError(t, p.Sync())
	assert.Empty(t, rec.ranges())
	assert.EqualValues(t, 1, p.Stats().Ignored)
}

func TestRegistryDisabled(t *testing.T) {
	g := NewRegistry()
	rec := &recorder{}
	g.Insert(0, 100, rec)
	g.SetDisabled(true)
	ran := false
	n, err := g.Invalidate(Range{Start: 0, End: 100}, ReasonEvict, func() error { ran = true; return nil })
	require.NoError(t, err)
	assert.True(t, ran, "the change still happens")
	assert.Zero(t, n)
	assert.Empty(t, rec.ranges())
}

// ps is the page size as an int, pz as an address offset.
var (
	ps = int(pagefault.PageSize)
	pz = pagefault.PageSize
)
