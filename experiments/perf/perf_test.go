package perf

import (
	"fmt"
	"testing"
	"time"

	"github.com/odpemu/odpemu/experiments/stats"
	"github.com/odpemu/odpemu/odp"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestRunReportsFaultsOnlyForODP(t *testing.T) {
	for _, test := range []string{WriteBW, ReadBW} {
		for _, odp := range []bool{false, true} {
			r, err := Run(Params{Test: test, ODP: odp, Size: 16 << 10, Iters: 300, Depth: 16, CQMod: 8})
			require.NoError(t, err)
			assert.Equal(t, 300, r.Iters)
			assert.Positive(t, r.AvgMiBps)
			assert.GreaterOrEqual(t, r.PeakMiBps, r.AvgMiBps)
			if odp {
				// 16 slots of 16 KiB on the responder (WRITE) or requester (READ)
				// side; the other side's region faults too.
				assert.NotZero(t, r.PageFaults, test)
				assert.EqualValues(t, 2*16*4, r.PagesFaulted, test)
			} else {
				assert.Zero(t, r.PageFaults, test)
			}
		}
	}
	r, err := Run(Params{ODP: true, Warm: true, Size: 16 << 10, Iters: 100, Depth: 16})
	require.NoError(t, err)
	assert.Zero(t, r.PageFaults, "the warm-up pass faulted everything in")
	_, err = Run(Params{Test: "cas_bw"})
	assert.Error(t, err)
}

func TestCompare(t *testing.T) {
	calls := 0
	rows, regs, err := Compare(&CompareParams{Sizes: []int{4096, 8192}, Iters: 200, Reps: 1, RegSizes: []int{1 << 20},
		WarmPairs: 4, WarmIters: 100,
		Progress: func(done, total int) { calls++; assert.Equal(t, 8, total) }})
	require.NoError(t, err)
	require.Len(t, rows, 2)
	require.Len(t, regs, 1)
	assert.Equal(t, 8, calls)
	for _, r := range rows {
		assert.Positive(t, r.RatioCold)
		assert.Positive(t, r.RatioWarm)
		assert.LessOrEqual(t, r.WarmQ1, r.RatioWarm)
		assert.GreaterOrEqual(t, r.WarmQ3, r.RatioWarm)
		assert.NotZero(t, r.ColdFaults)
	}
	assert.Positive(t, regs[0].Speedup)
	assert.Equal(t, "1 MiB", HumanBytes(1<<20))
	assert.Equal(t, "1000 B", HumanBytes(1000))
}

func BenchmarkWriteBW(b *testing.B) {
	for _, odp := range []bool{false, true} {
		b.Run(fmt.Sprintf("odp=%v", odp), func(b *testing.B) {
			for i := 0; i < b.N; i++ {
				r, err := Run(Params{ODP: odp, Warm: true, Size: 64 << 10, Iters: 5000})
				if err != nil {
					b.Fatal(err)
				}
				b.ReportMetric(r.AvgMiBps, "MiB/s")
			}
		})
	}
}

func TestWarmPairTakesNoFaults(t *testing.T) {
	pinned, onDemand, err := WarmPair(Params{Size: 8 << 10, Iters: 200, Depth: 16}, 4)
	require.NoError(t, err) // it fails itself if a burst faulted
	assert.Len(t, pinned, 4)
	assert.Len(t, onDemand, 4)
	for i := range pinned {
		assert.Positive(t, pinned[i])
		assert.Positive(t, onDemand[i])
	}
}

func TestInvalidateRate(t *testing.T) {
	r, err := Run(Params{ODP: true, Warm: true, Size: 64 << 10, Iters: 3000, Depth: 32, InvalidateRate: 2000})
	require.NoError(t, err)
	// The run lasts long enough for the ticker to fire; each invalidation makes the
	// next WRITE into that range fault.
	if r.Invalidations > 0 {
		assert.NotZero(t, r.PageFaults)
	}
	_, err = Run(Params{ODP: false, InvalidateRate: 10})
	assert.Error(t, err, "invalidation needs ODP")
}

// WRITE bandwidth under 0, 100 and 1000 invalidations per second, side by side: the
// three rates run interleaved in every repetition (their order rotating), and each
// rate's figure is the median over repetitions of its ratio to the same repetition's
// run without invalidation.
func BenchmarkWriteUnderInvalidation(b *testing.B) {
	rates := []int{0, 100, 1000}
	for i := 0; i < b.N; i++ {
		ratios := make([][]float64, len(rates))
		for rep := 0; rep < 9; rep++ {
			bw := make([]float64, len(rates))
			for k := range rates {
				j := (k + rep) % len(rates)
				r, err := Run(Params{ODP: true, Warm: true, Size: 64 << 10, Iters: 20000, InvalidateRate: rates[j]})
				if err != nil {
					b.Fatal(err)
				}
				bw[j] = r.AvgMiBps
			}
			for j := range rates {
				ratios[j] = append(ratios[j], bw[j]/bw[0])
			}
		}
		for j, rate := range rates[1:] {
			b.ReportMetric(stats.Median(ratios[j+1]), fmt.Sprintf("ratio@%d/s", rate))
		}
	}
}

// A cold pass faults every page of both regions once (in fault-around windows); the
// warm pass over the same memory takes no fault.
func TestColdWarm(t *testing.T) {
	p := Params{ODP: true, Size: 16 << 10, Depth: 16, CQMod: 8, MRSize: 1 << 20}
	cold, warm, err := ColdWarm(p)
	require.NoError(t, err)
	assert.Equal(t, 64, cold.Iters, "a pass is the region")
	assert.EqualValues(t, 2*(1<<20)/4096, cold.PagesFaulted, "every page of both regions")
	assert.Zero(t, warm.PageFaults)
	assert.True(t, warm.Warm)
	assert.Positive(t, warm.AvgMiBps)
}

// A synchronous prefetch maps both regions before the cold pass, and the CPU's
// writes that settle the regions after it invalidate none of it: neither pass faults.
func TestColdWarmPrefetched(t *testing.T) {
	p := Params{ODP: true, Size: 16 << 10, Depth: 16, CQMod: 8, MRSize: 1 << 20, Prefetch: "sync"}
	cold, warm, err := ColdWarm(p)
	require.NoError(t, err)
	assert.EqualValues(t, 2*(1<<20)/4096, cold.PagesPrefetched, "both regions")
	assert.Zero(t, cold.PageFaults)
	assert.Zero(t, warm.PageFaults)
	assert.Positive(t, cold.AvgMiBps)
}

// The in-process wire drops what Loss says, and the QPs retransmit.
func TestRunWithLoss(t *testing.T) {
	timeout := uint8(10)
	r, err := Run(Params{Size: 16 << 10, Iters: 400, Depth: 16, CQMod: 8, Loss: 0.02, Seed: 3, Timeout: &timeout})
	require.NoError(t, err)
	assert.Positive(t, r.Retransmissions)
	_, err = Run(Params{Loss: 1})
	assert.Error(t, err)
}

// A one-shot transfer registers, moves and deregisters. ODP maps the (present)
// source pages at registration, or without the snapshot faults each fault-around
// window once; pinned never faults.
func TestOneShot(t *testing.T) {
	for _, tc := range []struct{ odp, noSnapshot bool }{{false, false}, {true, false}, {true, true}} {
		r, err := OneShot(Params{ODP: tc.odp, Size: 64 << 10, FaultAround: 16}, 1<<20, OneShotOptions{NoSnapshot: tc.noSnapshot})
		require.NoError(t, err)
		assert.Equal(t, 1<<20, r.Bytes)
		assert.Positive(t, r.Register)
		assert.Positive(t, r.Transfer)
		assert.Positive(t, r.Deregister)
		assert.Equal(t, r.Total, r.Register+r.Transfer+r.Deregister)
		switch {
		case tc.noSnapshot:
			assert.EqualValues(t, 256, r.PagesFault, "every source page, once")
			assert.EqualValues(t, 16, r.PageFaults)
			assert.EqualValues(t, 16, r.Source.PageFaults)
			assert.Positive(t, r.Source.Phases.Resolve)
		case tc.odp:
			assert.Equal(t, 256, r.Mapped, "every source page, by the snapshot or faults")
		default:
			assert.Zero(t, r.PageFaults)
		}
	}
	r, err := OneShot(Params{Size: 64 << 10}, 4096, OneShotOptions{})
	require.NoError(t, err)
	assert.Equal(t, 4096, r.Bytes, "a message is at most the transfer")
}

// A run bounded by a duration stops posting when it expires and reports what ran.
func TestRunDuration(t *testing.T) {
	r, err := Run(Params{Size: 4096, Iters: 1 << 30 / 4096 * 1024, Depth: 16, CQMod: 8, Duration: 50 * time.Millisecond})
	require.NoError(t, err)
	assert.Less(t, r.Iters, 1<<30/4096*1024)
	assert.Positive(t, r.Iters)
	assert.GreaterOrEqual(t, r.Elapsed, 50*time.Millisecond)
}

// A failed work request is a CompletionError carrying its completion: rnr_retry 0
// fails a cold ODP run on its first responder fault.
func TestRunCompletionError(t *testing.T) {
	zero := uint8(0)
	_, err := Run(Params{ODP: true, Size: 16 << 10, Iters: 64, Depth: 8, CQMod: 4, RNRRetry: &zero})
	var ce *CompletionError
	require.ErrorAs(t, err, &ce)
	assert.Equal(t, odp.WCRNRRetryExcErr, ce.WC.Status)
}

// send_bw: the server keeps receives posted and every SEND lands in one; on ODP the
// server's receive buffers take network page faults as a WRITE's target does. Warm
// pairs, which switch MRs under posted receives, refuse it.
func TestSendBW(t *testing.T) {
	r, err := Run(Params{Test: SendBW, ODP: true, Size: 4096, Iters: 2000, Depth: 32, CQMod: 16})
	require.NoError(t, err)
	assert.Equal(t, 2000, r.Iters)
	assert.Equal(t, SendBW, r.Test)
	assert.Positive(t, r.AvgMiBps)
	assert.Positive(t, r.PageFaults, "the receive buffers faulted")
	_, _, err = WarmPair(Params{Test: SendBW, Size: 4096, Iters: 100}, 1)
	assert.ErrorContains(t, err, "send_bw")
	_, err = Run(Params{Test: "cas_bw"})
	assert.ErrorContains(t, err, "unknown test")
}

// The application's loops on OS threads of their own (AppThread, as a C program's):
// the engines run on other threads, at GOMAXPROCS 1 as at more, and every message
// completes.
func TestAppThread(t *testing.T) {
	for _, test := range []string{WriteBW, SendBW, ReadBW} {
		r, err := Run(Params{Test: test, Size: 4096, Iters: 1000, Depth: 32, CQMod: 16, AppThread: true})
		require.NoError(t, err, test)
		assert.Equal(t, 1000, r.Iters, test)
		assert.Positive(t, r.AvgMiBps, test)
	}
}

// atomic_bw: 8-byte fetch-and-adds on the server's region, which its MR allows (an
// MR without REMOTE_ATOMIC would fail the first with a remote access error); on ODP
// they fault the server's pages in as a WRITE does. No other size.
func TestAtomicBW(t *testing.T) {
	for _, odpReg := range []bool{false, true} {
		r, err := Run(Params{Test: AtomicBW, ODP: odpReg, Iters: 2000, Depth: 32, CQMod: 16})
		require.NoError(t, err, "odp %v", odpReg)
		assert.Equal(t, AtomicBW, r.Test)
		assert.Equal(t, AtomicSize, r.Bytes)
		assert.Equal(t, 2000, r.Iters)
		assert.Positive(t, r.MsgRateMpps)
		if odpReg {
			assert.Positive(t, r.PageFaults, "the server's region faulted")
		} else {
			assert.Zero(t, r.PageFaults)
		}
	}
	_, err := Run(Params{Test: AtomicBW, Size: 64})
	assert.ErrorContains(t, err, "8 bytes")
}

// Under a budget the server region's resident bytes, read from pagemap over the
// timed loop, stay within the budget (and a few messages in flight) while random
// WRITEs evict and fault pages back; the trace is kept only when asked for.
func TestBudgetResidentTrace(t *testing.T) {
	const size, region, budget = 64 << 10, 4 << 20, 1 << 20
	p := Params{ODP: true, Size: size, MRSize: region, Iters: 64, Random: true, Budget: budget, Prefetch: "sync",
		ResidentTrace: true}
	r, err := Run(p)
	require.NoError(t, err)
	assert.Positive(t, r.Evictions, "a region four times the budget evicts")
	require.GreaterOrEqual(t, len(r.Resident), 2, "a sample as the loop starts and one as it ends")
	var most int64
	for i, s := range r.Resident {
		if i > 0 {
			assert.GreaterOrEqual(t, s.At, r.Resident[i-1].At, "samples in time order")
		}
		assert.LessOrEqual(t, s.Bytes, int64(budget+4*size), "sample %d at %v", i, s.At)
		most = max(most, s.Bytes)
	}
	assert.Equal(t, most, r.MaxResident)
	assert.Positive(t, r.MaxResident, "the prefetch left the budget's worth resident")
	assert.Less(t, r.Resident[0].At, r.Elapsed, "the first sample is taken as the loop starts")

	p.ResidentTrace = false
	r, err = Run(p)
	require.NoError(t, err)
	assert.Nil(t, r.Resident)
	assert.Positive(t, r.MaxResident, "under a budget the samples are taken for MaxResident in any case")
}

// Injection at a low rate starts half an interval in: a run of 300 ms at 4 per
// second has its first invalidation at 125 ms, and each takes a fault at the next
// WRITE to its range; the count follows the rate over the run.
func TestInvalidateRateLow(t *testing.T) {
	r, err := Run(Params{ODP: true, Warm: true, Size: 4 << 10, Iters: 1 << 30, Duration: 300 * time.Millisecond,
		InvalidateRate: 4})
	require.NoError(t, err)
	assert.GreaterOrEqual(t, r.Invalidations, uint64(1), "due at 125 ms of a run of %v", r.Elapsed)
	// The invalidator runs a little longer than the timed loop (it starts before it
	// and stops after it): a second's slack.
	assert.LessOrEqual(t, float64(r.Invalidations), 4*(r.Elapsed.Seconds()+1))
	assert.NotZero(t, r.PageFaults, "an invalidated slot faults at the next WRITE to it")
}

// Several QPs make one cold pass between the same two devices at once: every slot
// is written once, every page of both regions is faulted in once (by whichever QP
// reaches it first), and the QPs' RNR NAKs add up; bad parameters are refused.
func TestMultiQP(t *testing.T) {
	const region, size = 1 << 20, 16 << 10
	for _, qps := range []int{1, 4} {
		r, err := MultiQP(Params{ODP: true, Size: size, MRSize: region, Depth: 16, CQMod: 8}, qps)
		require.NoError(t, err, "%d QPs", qps)
		assert.Equal(t, region/size, r.Iters, "%d QPs: each slot once", qps)
		assert.EqualValues(t, 2*region/4096, r.PagesFaulted, "%d QPs: every page of both regions once", qps)
		assert.NotZero(t, r.RNRNaks, "%d QPs: the server's faults answered with RNR NAK", qps)
		assert.Positive(t, r.AvgMiBps)
	}
	r, err := MultiQP(Params{Size: size, MRSize: region, Depth: 16, CQMod: 8}, 3)
	require.NoError(t, err, "pinned, 3 QPs (slices of 21 slots)")
	assert.Equal(t, 3*(region/3/size), r.Iters)
	assert.Zero(t, r.PageFaults)
	for _, p := range []Params{{Test: SendBW}, {Warm: true}, {Random: true}, {Budget: 1 << 20}} {
		_, err := MultiQP(p, 2)
		assert.Error(t, err, "%+v", p)
	}
	_, err = MultiQP(Params{Size: size, MRSize: size}, 2)
	assert.Error(t, err, "fewer slots than QPs")
}
