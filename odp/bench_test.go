package odp

import (
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

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

// BenchmarkGateCost measures what the DMA gate costs the application while the NIC is
// busy: a CPU fault on ODP memory (the fault server drains DMA in flight before each
// read of the userfaultfd) and a direct madvise(MADV_DONTNEED) (its thread waits
// until its event is read, so for the DMA in flight too). The NIC streams 64 KiB
// WRITEs, eight in flight, into another MR of the same device throughout. The gate is
// on by default; the ablation switch (NoInvalidate) turns it off, with invalidation.
// Both devices run their traffic at once and are measured in alternating rounds, so
// that both see the same machine; medians and 90th percentiles over rounds are
// reported, and their ratios.
func BenchmarkGateCost(b *testing.B) {
	const pages = 64
	type side struct {
		buf         []byte
		fault, madv []time.Duration
		dev         *Device
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	mk := func(cfg Config) *side {
		a, r := pair(b, cfg)
		_, smr := a.region(b, 1<<20, AccessLocalWrite)
		_, dmr := r.region(b, 1<<20, rw|AccessOnDemand)
		buf, _ := r.region(b, pages*ps, rw|AccessOnDemand)
		wg.Add(1)
		go func() { // the NIC's traffic
			defer wg.Done()
			inflight := 0
			for k := 0; ; k++ {
				select {
				case <-stop:
					for ; inflight > 0; inflight-- {
						wait(b, a.scq)
					}
					return
				default:
				}
				if inflight == 8 {
					if wc := wait(b, a.scq); wc.Status != WCSuccess {
						b.Error(wc.Status, wc.Detail)
						return
					}
					inflight--
				}
				off := k % 16 * (64 << 10)
				if err := a.qp.PostSend(write(smr, off, 64<<10, dmr, uint64(off))); err != nil {
					b.Error(err)
					return
				}
				inflight++
			}
		}()
		return &side{buf: buf, dev: r.dev}
	}
	gate, ablation := mk(Config{}), mk(Config{NoInvalidate: true})
	defer func() { close(stop); wg.Wait() }()
	round := func(s *side) {
		for p := 0; p < pages; p++ {
			s.buf[p*ps] = 1
		}
		t0 := time.Now()
		if err := unix.Madvise(s.buf, unix.MADV_DONTNEED); err != nil {
			b.Fatal(err)
		}
		t1 := time.Now()
		for p := 0; p < pages; p++ {
			s.buf[p*ps] = 2 // a CPU fault each
		}
		t2 := time.Now()
		s.madv = append(s.madv, t1.Sub(t0))
		s.fault = append(s.fault, t2.Sub(t1)/pages)
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		round(gate)
		round(ablation)
	}
	b.StopTimer()
	// The median, and the 90th percentile: drains are the tail.
	quantile := func(d []time.Duration, q float64) float64 {
		slices.Sort(d)
		return float64(d[int(q*float64(len(d)-1))])
	}
	for _, q := range []struct {
		name string
		q    float64
	}{{"", 0.5}, {"p90-", 0.9}} {
		fg, fa := quantile(gate.fault, q.q), quantile(ablation.fault, q.q)
		mg, ma := quantile(gate.madv, q.q), quantile(ablation.madv, q.q)
		b.ReportMetric(fg, q.name+"fault-ns/gate")
		b.ReportMetric(fa, q.name+"fault-ns/ablation")
		b.ReportMetric(fg/fa, q.name+"fault-ratio")
		b.ReportMetric(mg, q.name+"madvise-ns/gate")
		b.ReportMetric(ma, q.name+"madvise-ns/ablation")
		b.ReportMetric(mg/ma, q.name+"madvise-ratio")
	}
	st := gate.dev.Stats()
	b.ReportMetric(float64(st.GateDrains), "drains")
	if st.GateDrains > 0 {
		b.ReportMetric(float64(st.GateDrainTime)/float64(st.GateDrains), "drain-ns")
	}
}
