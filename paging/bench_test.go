package paging

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"
)

// benchPages runs op over 256 present pages per iteration, reports its cost per
// page, and checks that the pages kept their content.
func benchPages(b *testing.B, op func(p *Pager, lo, hi uintptr) error) {
	const npages = 256
	e := newPagerEnv(b, npages, 0)
	for p := 0; p < npages; p++ {
		e.mem[p*ps] = byte(p)
	}
	lo, hi := addrOf(e.mem), addrOf(e.mem)+npages*pz
	for b.Loop() {
		require.NoError(b, op(e.pager, lo, hi))
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*npages), "ns/page")
	for p := 0; p < npages; p++ {
		require.EqualValues(b, byte(p), e.mem[p*ps], "page %d", p)
	}
}

// every checks that a pager operation moved all 256 pages.
func every(n int, err error) error {
	if err == nil && n != 256 {
		err = fmt.Errorf("%d of 256 pages", n)
	}
	return err
}

// BenchmarkMigrate migrates 256 pages per iteration (one invalidation; a claim, a
// move out and a copy back per page).
func BenchmarkMigrate(b *testing.B) {
	benchPages(b, func(p *Pager, lo, hi uintptr) error { return every(p.Migrate(lo, hi)) })
}

// BenchmarkEvictRestore evicts 256 pages to the store and restores them per
// iteration: one page's round trip.
func BenchmarkEvictRestore(b *testing.B) {
	benchPages(b, func(p *Pager, lo, hi uintptr) error {
		if err := every(p.Evict(lo, hi)); err != nil {
			return err
		}
		return p.Restore(lo, hi)
	})
}
