package odp

import (
	"fmt"
	"testing"

	"golang.org/x/sys/unix"
)

// Invalidation latency per range size: explicit (the notifier path alone: sequence
// bump, entries cleared, DMA drained) and event-driven (madvise -> REMOVE event read
// by the C server -> pump -> entries cleared, measured to SyncEvents).
func BenchmarkInvalidate(b *testing.B) {
	for _, pages := range []int{1, 16, 256, ps} {
		for _, kind := range []string{"explicit", "event"} {
			b.Run(fmt.Sprintf("%s/pages=%d", kind, pages), func(b *testing.B) {
				n := newNode(b, Config{})
				buf, mr := n.region(b, pages*ps, rw|AccessOnDemand)
				for i := 0; i < b.N; i++ {
					b.StopTimer()
					for p := 0; p < pages; p++ {
						buf[p*ps] = 1
					}
					if err := mr.Advise(AdvisePrefetchWrite, mr.Addr(), mr.Len()); err != nil {
						b.Fatal(err)
					}
					b.StartTimer()
					if kind == "explicit" {
						if err := n.dev.Invalidate(mr.Addr(), mr.Len()); err != nil {
							b.Fatal(err)
						}
					} else {
						if err := unix.Madvise(buf, unix.MADV_DONTNEED); err != nil {
							b.Fatal(err)
						}
						if err := n.dev.SyncEvents(); err != nil {
							b.Fatal(err)
						}
					}
				}
				if mr.Stats().ValidPages != 0 {
					b.Fatal("entries still valid")
				}
			})
		}
	}
}
