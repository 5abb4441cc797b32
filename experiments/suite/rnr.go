package suite

import (
	"errors"
	"fmt"
	"runtime"
	"strings"
	"time"

	"github.com/odpemu/odpemu/experiments/perf"
	"github.com/odpemu/odpemu/experiments/plots"
	"github.com/odpemu/odpemu/experiments/results"
	"github.com/odpemu/odpemu/experiments/stats"
	"github.com/odpemu/odpemu/odp"
)

var rnrPitfalls = Experiment{
	Name:  "rnr",
	Title: "RNR pitfalls: a cold ODP pass vs the responder's RNR timer, RNR retries and packet loss",
	Run:   runRNR,
	Replot: func(x *X) error {
		return replot(x, "", func(t *results.Table) error { return rnrReport(x, t, floats(t, "loss")) })
	},
}

// rnrTimers are min_rnr_timer encodings: 0.01, 0.16, 0.64 (rdma-core's tests), 2.56
// and 10.24 ms.
var rnrTimers = []uint8{1, 8, 12, 16, 20}

// rnrAckTimeout is the requesters' local ACK timeout: 14, 67 ms, hardware's common
// value (perftest's default).
const rnrAckTimeout = 14

func runRNR(x *X) error {
	const size = 64 << 10
	region := pick(x.Scale, 1<<20, 8<<20, 8<<20)
	reps := pick(x.Scale, 1, 2, fullReps)
	losses := pick(x.Scale, []float64{0, 0.01}, []float64{0, 0.001, 0.01}, []float64{0, 0.001, 0.01})
	timers := pick(x.Scale, []uint8{1, 12}, rnrTimers, rnrTimers)
	type run struct {
		timer, retry uint8
		loss         float64
		model        odp.FaultModel
	}
	var runs []run
	for _, m := range faultModels {
		for _, tm := range timers {
			for _, l := range losses {
				runs = append(runs, run{tm, 7, l, m})
			}
			runs = append(runs, run{tm, 1, 0, m})
		}
	}
	x.Param("message_bytes", size)
	x.Param("region_bytes", region)
	x.Param("reps", reps)
	x.Param("ack_timeout", fmt.Sprintf("%d (%v)", rnrAckTimeout, time.Duration(4096)<<rnrAckTimeout))
	x.Param("run", "one cold pass of WRITEs over a fresh ODP region (every message faults at the responder, which answers RNR NAK), 128 in flight; "+
		"loss drops packets each side sends, seeded")
	x.Steps(reps * len(runs))
	t := x.Table("", "min_rnr_timer", "rnr_timer_us", "rnr_retry", "loss", "fault_model", "rep", "status", "elapsed_ns",
		"bw_mib_s", "rnr_naks", "retransmissions", "timeouts", "network_page_faults")
	ack := uint8(rnrAckTimeout)
	for rep := range reps {
		runtime.GC()
		for i := range runs {
			r := runs[(i+rep)%len(runs)]
			timer, retry := r.timer, r.retry
			res, err := perf.Run(x.nic(perf.Params{ODP: true, Size: size, MRSize: region, Iters: region / size, MinRNRTimer: &timer,
				RNRRetry: &retry, Timeout: &ack, Loss: r.loss, Seed: x.Seed + uint64(rep), FaultModel: r.model}))
			status := "ok"
			if err != nil {
				status = failure(err)
			}
			if err := t.Add(r.timer, float64(odp.RNRTimer(r.timer).Nanoseconds())/1e3, r.retry, r.loss, r.model.String(), rep,
				status, res.Elapsed, res.AvgMiBps, res.RNRNaks, res.Retransmissions, res.Timeouts, res.PageFaults); err != nil {
				return err
			}
			x.Step()
		}
	}
	return rnrReport(x, t, losses)
}

// failure names the completion status a run failed with.
func failure(err error) string {
	if ce := (*perf.CompletionError)(nil); errors.As(err, &ce) {
		return ce.WC.Status.String()
	}
	return "error: " + err.Error()
}

func rnrReport(x *X, t *results.Table, losses []float64) error {
	var series []plots.Series
	for _, m := range faultModels {
		for _, l := range losses {
			g := plots.Group(t.Rows(sel("status", "ok", "rnr_retry", 7, "loss", l, "fault_model", m.String())), "rnr_timer_us", "elapsed_ns", "loss")
			if len(g) == 1 {
				g[0].Name = fmt.Sprintf("%s faults, %.1f%% loss", m, 100*l)
				series = append(series, g[0])
			}
		}
	}
	if err := x.Figure("rnr", plots.Figure{Title: "Cold ODP pass vs the responder's RNR timer",
		X: plots.Axis{Label: "min_rnr_timer (µs)", Log: true}, Y: plots.Axis{Label: "pass time (ms)", Log: true},
		Series: scaleY(series, 1e-6)}); err != nil {
		return err
	}
	def := uint8(12)
	small, smallEv := true, []string{}
	for _, l := range losses[1:] {
		r := perRep(t, "elapsed_ns", sel("status", "ok", "rnr_retry", 7, "loss", l, "min_rnr_timer", def, "fault_model", "emulator"),
			sel("status", "ok", "rnr_retry", 7, "loss", 0, "min_rnr_timer", def, "fault_model", "emulator"))
		s := stats.Summarize(r)
		x1 := func(v float64) string { return fmt.Sprintf("%.1fx", v) }
		x.HeadlineCI(fmt.Sprintf("cold ODP pass with %.1f%% loss / without (RNR timer 0.64 ms)", 100*l), x1(s.Median), ci(r, x1),
			fmt.Sprintf("median of %d per-repetition ratios of pass time", s.N))
		small = small && s.N > 0 && s.Median < 10
		smallEv = append(smallEv, fmt.Sprintf("%.1f%% loss %.2fx", 100*l, s.Median))
	}
	x.Claim("smallmultiple", "a small multiple (under 10x)", small,
		"cold ODP pass with loss / without, RNR timer 0.64 ms, medians of per-repetition ratios: "+strings.Join(smallEv, ", "))
	failures := map[odp.FaultModel]float64{} // the share of rnr_retry 1 passes that failed
	for _, m := range faultModels {
		failed := t.Rows(func(r results.Row) bool {
			return r.Get("rnr_retry") == "1" && r.Get("fault_model") == m.String() && r.Get("status") != "ok"
		})
		all := t.Rows(sel("rnr_retry", 1, "fault_model", m.String()))
		x.Headline(fmt.Sprintf("cold passes failed with rnr_retry 1, %s faults", m), fmt.Sprintf("%d of %d", len(failed), len(all)),
			"RNR_RETRY_EXC_ERR: the responder NAKs the retransmissions while the fault is pending, as mlx5 does; rnr_retry 1 is exhausted when two RNR timers are shorter than the fault")
		if len(all) > 0 {
			failures[m] = float64(len(failed)) / float64(len(all))
		}
	}
	emu, cx := failures[odp.FaultModelEmulator], failures[odp.FaultModelConnectX4]
	x.Claim("longerfails", "a longer fault does so more often", cx > emu,
		fmt.Sprintf("rnr_retry 1 passes failed: %.0f%% with the emulator's faults, %.0f%% with ConnectX-4's", 100*emu, 100*cx))
	return nil
}
