package paging

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// BenchmarkMigrate migrates 256 present pages per iteration (one invalidation; a
// claim, a move out and a copy back per page): ns/op / 256 is one migration's cost.
func BenchmarkMigrate(b *testing.B) {
	const npages = 256
	e := newPagerEnv(b, npages, 0)
	for p := 0; p < npages; p++ {
		e.mem[p*ps] = byte(p)
	}
	lo, hi := addrOf(e.mem), addrOf(e.mem)+npages*pz
	for b.Loop() {
		n, err := e.pager.Migrate(lo, hi)
		require.NoError(b, err)
		require.Equal(b, npages, n)
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*npages), "ns/page")
}

// BenchmarkEvictRestore evicts 256 pages to the store and restores them per
// iteration: ns/op / 256 is one page's round trip.
func BenchmarkEvictRestore(b *testing.B) {
	const npages = 256
	e := newPagerEnv(b, npages, 0)
	for p := 0; p < npages; p++ {
		e.mem[p*ps] = byte(p)
	}
	lo, hi := addrOf(e.mem), addrOf(e.mem)+npages*pz
	for b.Loop() {
		n, err := e.pager.Evict(lo, hi)
		require.NoError(b, err)
		require.Equal(b, npages, n)
		require.NoError(b, e.pager.Restore(lo, hi))
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*npages), "ns/page")
}
