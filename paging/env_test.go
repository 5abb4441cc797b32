package paging

import (
	"sync"
	"testing"

	"github.com/odpemu/odpemu/invalidate"
	"github.com/odpemu/odpemu/pagefault"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var (
	ps = int(pagefault.PageSize)
	pz = pagefault.PageSize
)

// recorder is a subscriber that records the invalidations it is told about.
type recorder struct {
	mu  sync.Mutex
	got []invalidate.Range
	why []invalidate.Reason
}

func (r *recorder) InvalidateStart(rg invalidate.Range, why invalidate.Reason) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.got = append(r.got, rg)
	r.why = append(r.why, why)
}

func (r *recorder) InvalidateEnd(invalidate.Range, invalidate.Reason) {}
