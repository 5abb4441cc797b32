package pagefault

import (
	"bytes"
	"testing"

	"github.com/odpemu/odpemu/internal/forktest"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

func newResolver(t testing.TB, u *FD, src Source) *Resolver {
	t.Helper()
	pm, err := OpenPagemap()
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, pm.Close()) })
	r, err := NewResolver(u, pm, src)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, r.Close()) })
	return r
}

func TestResolverInstallsOnlyMissing(t *testing.T) {
	const npages = 600 // more than one batch
	b := region(t, npages)
	present := map[int]bool{0: true, 3: true, 4: true, 300: true, npages - 1: true}
	for p := range present {
		b[p*int(PageSize)+1] = 0x5a // touched before registration
	}
	u := registered(t, b, 0)
	r := newResolver(t, u, nil)
	out := make([]PagemapEntry, npages)
	st, err := r.Resolve(addr(b), out, false)
	require.NoError(t, err)
	assert.Equal(t, npages-len(present), st.Installed)
	assert.Zero(t, st.Raced)
	for p, e := range out {
		require.True(t, e.Present(), "page %d present", p)
		if r.pm.PFNsReadable() {
			require.NotZero(t, e.PFN(), "page %d frame", p)
		}
		want := byte(0)
		if present[p] {
			want = 0x5a
		}
		require.Equal(t, want, b[p*int(PageSize)+1], "page %d", p)
	}
	// A second resolve finds everything present and installs nothing.
	st, err = r.Resolve(addr(b), out, false)
	require.NoError(t, err)
	assert.Equal(t, ResolveStats{}, st)
}

type patternSource struct{ base uintptr }

func (s patternSource) Fill(a uintptr, dst []byte) (bool, error) {
	for i := 0; i < len(dst); i += int(PageSize) {
		p := byte((a - s.base) / PageSize)
		for j := 0; j < int(PageSize); j++ {
			dst[i+j] = p + byte(i/int(PageSize))
		}
	}
	return false, nil
}

func TestResolverUsesSource(t *testing.T) {
	const npages = 32
	b := region(t, npages)
	u := registered(t, b, 0)
	r := newResolver(t, u, patternSource{addr(b)})
	out := make([]PagemapEntry, 8)
	_, err := r.Resolve(addr(b)+8*PageSize, out, false)
	require.NoError(t, err)
	for p := 8; p < 16; p++ {
		require.Equal(t, bytes.Repeat([]byte{byte(p)}, int(PageSize)), b[p*int(PageSize):(p+1)*int(PageSize)])
	}
}

func TestResolverErrors(t *testing.T) {
	b := region(t, 4)
	u := registered(t, b, 0)
	r := newResolver(t, u, nil)
	out := make([]PagemapEntry, 1)
	_, err := r.Resolve(addr(b)+1, out, false)
	assert.ErrorIs(t, err, unix.EINVAL)

	require.NoError(t, u.Unregister(addr(b), uintptr(len(b))))
	_, err = r.Resolve(addr(b), out, false)
	assert.ErrorIs(t, err, ErrUnmapped)
}

func BenchmarkResolve(b *testing.B) {
	for _, around := range []int{1, 16, 64} {
		b.Run(map[int]string{1: "around=1", 16: "around=16", 64: "around=64"}[around], func(b *testing.B) {
			const npages = 16384
			mem := region(b, npages)
			u := registered(b, mem, 0)
			r := newResolver(b, u, nil)
			out := make([]PagemapEntry, around)
			p := 0
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if p+around > npages {
					b.StopTimer()
					require.NoError(b, unix.Madvise(mem, unix.MADV_DONTNEED))
					p = 0
					b.StartTimer()
				}
				if _, err := r.Resolve(addr(mem)+uintptr(p)*PageSize, out, false); err != nil {
					b.Fatal(err)
				}
				p += around
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*around), "ns/page")
		})
	}
}

// A page read before registration is mapped the way this kernel maps read faults:
// the shared zero page on most kernels (then a write resolve breaks it into a private
// page, so that the recorded frame is where the write lands), a private page on
// others (then there is nothing to break). The probe says which; both are checked.
func TestResolverReadFaultedPage(t *testing.T) {
	zeroPage := ProbeKernelBehaviour().ReadFaultZeroPage
	t.Logf("read faults map the shared zero page: %v", zeroPage)
	b := region(t, 4)
	var sum byte
	sum += b[PageSize] // a read fault before registration
	require.Zero(t, sum)
	u := registered(t, b, 0)
	r := newResolver(t, u, nil)
	out := make([]PagemapEntry, 4)
	st, err := r.Resolve(addr(b), out, false)
	require.NoError(t, err)
	assert.Equal(t, 3, st.Installed)
	assert.Equal(t, !zeroPage, out[1].Exclusive(), "page 1 exclusive unless it is the zero page")
	st, err = r.Resolve(addr(b), out, true)
	require.NoError(t, err)
	if zeroPage {
		assert.Equal(t, 1, st.COWBroken, "the zero page is broken for write")
	} else {
		assert.Zero(t, st.COWBroken, "a private page needs no COW break")
	}
	for p := range out {
		assert.True(t, out[p].Exclusive(), "page %d", p)
	}
}

// The COW-break path of a write resolve, independent of how the kernel maps read
// faults: after fork, written pages are shared with the child until written again.
func TestResolverWriteBreaksCOW(t *testing.T) {
	const n = 8
	b := region(t, n)
	for p := 0; p < n; p++ {
		b[p*int(PageSize)] = byte(p + 1)
	}
	u := registered(t, b, 0)
	r := newResolver(t, u, nil)
	forktest.Paused(t)
	out := make([]PagemapEntry, n)
	st, err := r.Resolve(addr(b), out, false)
	require.NoError(t, err)
	assert.Zero(t, st.Installed)
	for p := range out {
		require.True(t, out[p].Present())
		require.False(t, out[p].Exclusive(), "page %d shared with the child", p)
	}
	st, err = r.Resolve(addr(b), out, true)
	require.NoError(t, err)
	assert.Equal(t, n, st.COWBroken)
	for p := range out {
		assert.True(t, out[p].Exclusive(), "page %d private again", p)
		assert.EqualValues(t, p+1, b[p*int(PageSize)], "page %d kept its content", p)
	}
}
