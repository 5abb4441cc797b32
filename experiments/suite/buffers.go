package suite

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"strings"
	"time"
	"unsafe"

	"github.com/odpemu/odpemu/experiments/plots"
	"github.com/odpemu/odpemu/experiments/regcache"
	"github.com/odpemu/odpemu/experiments/results"
	"github.com/odpemu/odpemu/experiments/stats"
	"github.com/odpemu/odpemu/odp"
	"golang.org/x/sys/unix"
)

var bufferStrategies = Experiment{
	Name:  "buffers",
	Title: "How applications manage RDMA buffers, vs buffer reuse: register each time, bounce, pin-down cache, ODP",
	Run:   runBuffers,
	Replot: func(x *X) error {
		return replot(x, "", func(t *results.Table) error { return buffersReport(x, t, floats(t, "reuse")) })
	},
}

// The strategies, the ways applications really manage RDMA memory.
const (
	stratRegister    = "register-each" // register and deregister around each transfer
	stratBounce      = "bounce"        // copy into one pinned buffer registered once
	stratCache       = "pin-cache"     // regcache: pinned registrations kept, invalidated by unmap events
	stratODP         = "odp"           // one implicit ODP MR over the address space
	stratODPPrefetch = "odp-prefetch"  // and a synchronous prefetch of each new buffer
	stratODPHW       = "odp-connectx4" // implicit ODP with a ConnectX-4's fault latency
)

var strategies = []string{stratRegister, stratBounce, stratCache, stratODP, stratODPPrefetch, stratODPHW}

// bufferWorkload is the transfers' shape.
type bufferWorkload struct {
	size      int // bytes per transfer (one WRITE)
	pool      int // live buffers the application keeps
	transfers int // measured, after pool warm-up transfers
}

func runBuffers(x *X) error {
	w := bufferWorkload{size: 256 << 10, pool: 16, transfers: pick(x.Scale, 40, 200, 400)}
	reuses := pick(x.Scale, []float64{0, 1}, []float64{0, 0.5, 0.9, 1}, []float64{0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1})
	reps := pick(x.Scale, 1, 3, fullReps)
	x.Param("transfer_bytes", w.size)
	x.Param("pool_buffers", w.pool)
	x.Param("transfers", w.transfers)
	x.Param("reuse_rates", reuses)
	x.Param("reps", reps)
	x.Param("cache_capacity_bytes", w.pool*w.size)
	x.Param("workload", "each transfer WRITEs one buffer: with probability reuse one of the application's live buffers, "+
		"else a new one it allocates and fills, freeing (munmap) a random live one; the first pool transfers fill the pool "+
		"and are not timed; timed: the strategy's work and the transfer, not the application's allocation and filling")
	x.Steps(len(reuses) * reps)
	t := x.Table("", "strategy", "reuse", "rep", "transfers", "bytes", "total_ns", "overhead_ns", "new_buffers", "registrations",
		"cache_hits", "cache_misses", "cache_invalidations", "network_page_faults")
	for _, reuse := range reuses {
		for rep := range reps {
			runtime.GC()
			for i := range strategies {
				s := strategies[(i+rep)%len(strategies)]
				r, err := runStrategy(x, s, odp.FaultModel{}, w, reuse, x.Seed+uint64(rep))
				if err != nil {
					return fmt.Errorf("%s at reuse %.2f: %w", s, reuse, err)
				}
				if err := t.Add(s, reuse, rep, w.transfers, w.transfers*w.size, r.total, r.overhead, r.fresh, r.registrations,
					r.cache.Hits, r.cache.Misses, r.cache.Invalidations, r.faults); err != nil {
					return err
				}
			}
			x.Step()
		}
	}
	return buffersReport(x, t, reuses)
}

type strategyResult struct {
	total                time.Duration
	overhead             time.Duration // the strategy's own work and the NIC's faults
	fresh, registrations int
	cache                regcache.Stats
	faults               uint64
}

// bufferRig is a client device whose QP WRITEs to a server's warm pinned sink.
type bufferRig struct {
	client, server *odp.Device
	pd             *odp.PD // the client's
	spd            *odp.PD // the server's
	qp             *odp.QP
	cq             *odp.CQ
	sink           *odp.MR
	wcs            []odp.WC
}

func newBufferRig(cfg odp.Config, size int) (_ *bufferRig, err error) {
	r := &bufferRig{wcs: make([]odp.WC, 1)}
	defer func() {
		if err != nil {
			r.close()
		}
	}()
	var qps [2]*odp.QP
	for i, d := range []**odp.Device{&r.client, &r.server} {
		if *d, err = odp.Open(cfg); err != nil {
			return nil, err
		}
		pd, err := (*d).AllocPD()
		if err != nil {
			return nil, err
		}
		cq, err := (*d).CreateCQ(4)
		if err != nil {
			return nil, err
		}
		if qps[i], err = pd.CreateQP(odp.QPConfig{SendCQ: cq, RecvCQ: cq, MaxSendWR: 4}); err != nil {
			return nil, err
		}
		if i == 0 {
			r.pd, r.cq = pd, cq
			continue
		}
		r.spd = pd
		buf, err := (*d).Alloc(size)
		if err != nil {
			return nil, err
		}
		if r.sink, err = pd.RegMR(buf, odp.AccessLocalWrite|odp.AccessRemoteWrite); err != nil {
			return nil, err
		}
	}
	r.qp = qps[0]
	return r, odp.ConnectLoopback(qps[0], qps[1])
}

func (r *bufferRig) close() {
	for _, d := range []*odp.Device{r.client, r.server} {
		if d != nil {
			_ = d.Close() // a measurement does not depend on the teardown
		}
	}
}

// write WRITEs buf, registered by lkey, to the sink and waits for its completion.
func (r *bufferRig) write(buf []byte, lkey uint32) error {
	return r.transfer(odp.OpRDMAWrite, buf, lkey, r.sink.Addr(), r.sink.RKey())
}

// read READs len(buf) bytes at remote address addr of the server's MR with rkey into
// buf, registered by lkey, and waits for its completion.
func (r *bufferRig) read(buf []byte, lkey uint32, addr uint64, rkey uint32) error {
	return r.transfer(odp.OpRDMARead, buf, lkey, addr, rkey)
}

func (r *bufferRig) transfer(op odp.Opcode, buf []byte, lkey uint32, addr uint64, rkey uint32) error {
	if err := r.qp.PostSend(odp.SendWR{Opcode: op, Flags: odp.SendSignaled,
		SGL:        []odp.SGE{{Addr: uint64(uintptr(unsafe.Pointer(unsafe.SliceData(buf)))), Length: uint32(len(buf)), LKey: lkey}},
		RemoteAddr: addr, RKey: rkey}); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := r.cq.Wait(ctx, r.wcs); err != nil {
		return err
	}
	if wc := r.wcs[0]; wc.Status != odp.WCSuccess {
		return fmt.Errorf("%v: %v (%s)", op, wc.Status, wc.Detail)
	}
	return nil
}

// runStrategy runs the workload with one strategy; the ODP strategies' NIC takes
// faults of model (the run's profile's when zero; odp-connectx4 always ConnectX-4's).
func runStrategy(x *X, strategy string, model odp.FaultModel, w bufferWorkload, reuse float64, seed uint64) (res strategyResult, err error) {
	onDemand := strategy == stratODP || strategy == stratODPPrefetch || strategy == stratODPHW
	if strategy == stratODPHW {
		model = odp.FaultModelConnectX4
	}
	if !onDemand {
		model = odp.FaultModel{}
	}
	cfg := x.device(odp.Config{FaultModel: model})
	rig, err := newBufferRig(cfg, w.size)
	if err != nil {
		return res, err
	}
	defer rig.close()
	const pinned = odp.AccessLocalWrite
	// The application's buffers: ODP memory comes from the device, pinned
	// strategies' from plain anonymous mappings.
	alloc := func() ([]byte, error) {
		if onDemand {
			return rig.client.Alloc(w.size)
		}
		return unix.Mmap(-1, 0, w.size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	}
	free := func(b []byte) error {
		if onDemand {
			return rig.client.Free(b)
		}
		return unix.Munmap(b)
	}
	var live [][]byte
	defer func() {
		for _, b := range live {
			err = errors.Join(err, free(b))
		}
	}()
	// The strategy's state.
	var bounce []byte
	var bounceMR, implicit *odp.MR
	var cache *regcache.Cache
	switch strategy {
	case stratBounce:
		if bounce, err = alloc(); err != nil {
			return res, err
		}
		defer func() { err = errors.Join(err, free(bounce)) }()
		if bounceMR, err = rig.pd.RegMR(bounce, pinned); err != nil {
			return res, err
		}
	case stratCache:
		if cache, err = regcache.New(rig.pd, pinned, int64(w.pool*w.size)); err != nil {
			return res, err
		}
		defer func() { err = errors.Join(err, cache.Close()) }()
	default:
		if onDemand {
			if implicit, err = rig.pd.RegImplicitMR(pinned | odp.AccessOnDemand); err != nil {
				return res, err
			}
		}
	}
	rng := rand.New(rand.NewPCG(seed, uint64(reuse*1e6)))
	nothing := func() error { return nil }
	// prepare is the strategy's work before the transfer of buf: it returns what to
	// send, its lkey, and the strategy's work after the transfer.
	prepare := func(buf []byte, fresh bool) ([]byte, uint32, func() error, error) {
		switch strategy {
		case stratRegister:
			mr, err := rig.pd.RegMR(buf, pinned)
			if err != nil {
				return nil, 0, nil, err
			}
			res.registrations++
			return buf, mr.LKey(), mr.Dereg, nil
		case stratBounce:
			copy(bounce, buf)
			return bounce, bounceMR.LKey(), nothing, nil
		case stratCache:
			h, err := cache.Get(buf)
			if err != nil {
				return nil, 0, nil, err
			}
			return buf, h.MR().LKey(), h.Release, nil
		case stratODPPrefetch:
			if fresh {
				if err := rig.pd.AdviseMR(odp.AdvisePrefetch, odp.AdviseFlush, []odp.SGE{{
					Addr: uint64(uintptr(unsafe.Pointer(&buf[0]))), Length: uint32(len(buf)), LKey: implicit.LKey()}}); err != nil {
					return nil, 0, nil, err
				}
			}
		}
		return buf, implicit.LKey(), nothing, nil
	}
	// send transfers buf and returns the time the strategy's own work took.
	send := func(buf []byte, fresh bool) (time.Duration, error) {
		t0 := time.Now()
		src, lkey, after, err := prepare(buf, fresh)
		if err != nil {
			return 0, err
		}
		t1 := time.Now()
		if err := rig.write(src, lkey); err != nil {
			return 0, err
		}
		t2 := time.Now()
		err = after()
		return t1.Sub(t0) + time.Since(t2), err
	}
	st0 := rig.client.Stats()
	faults, faultTime := st0.PageFaults, st0.FaultTime
	var warmCache regcache.Stats // the cache's counters after the untimed transfers
	for i := range w.pool + w.transfers {
		timed := i >= w.pool
		var buf []byte
		fresh := len(live) < w.pool || rng.Float64() >= reuse
		if fresh {
			if buf, err = alloc(); err != nil {
				return res, err
			}
			for j := 0; j < len(buf); j += 512 {
				buf[j] = byte(i + j)
			}
			if len(live) < w.pool {
				live = append(live, buf)
			} else {
				k := rng.IntN(len(live))
				if err := free(live[k]); err != nil {
					return res, err
				}
				live[k] = buf
			}
		} else {
			buf = live[rng.IntN(len(live))]
		}
		if timed && fresh {
			res.fresh++
		}
		if !timed {
			if _, err := send(buf, fresh); err != nil {
				return res, err
			}
			st := rig.client.Stats()
			faults, faultTime, res.registrations = st.PageFaults, st.FaultTime, 0
			if cache != nil {
				if warmCache, err = cache.Stats(); err != nil {
					return res, err
				}
			}
			continue
		}
		t0 := time.Now()
		own, err := send(buf, fresh)
		if err != nil {
			return res, err
		}
		res.total += time.Since(t0)
		res.overhead += own
	}
	st := rig.client.Stats()
	res.faults = st.PageFaults - faults
	res.overhead += st.FaultTime - faultTime // the NIC's work for ODP: its faults
	if cache != nil {
		if res.cache, err = cache.Stats(); err != nil {
			return res, err
		}
		res.cache.Hits -= warmCache.Hits
		res.cache.Misses -= warmCache.Misses
		res.cache.Invalidations -= warmCache.Invalidations
	}
	return res, nil
}

func buffersReport(x *X, t *results.Table, reuses []float64) error {
	// Per transfer: throughput, and the strategy's own cost.
	per, err := results.NewTable("per_transfer", "reuse", "strategy", "mib_s", "overhead_us")
	if err != nil {
		return err
	}
	for _, r := range t.Rows(nil) {
		if err := per.Add(r.Float("reuse"), r.Get("strategy"), r.Float("bytes")/(1<<20)/(r.Float("total_ns")/1e9),
			r.Float("overhead_ns")/r.Float("transfers")/1e3); err != nil {
			return err
		}
	}
	if err := x.Figure("buffers", plots.Figure{Title: "Buffer strategies vs buffer reuse (256 KiB WRITEs)",
		X: plots.Axis{Label: "fraction of transfers from a buffer sent before"}, Y: plots.Axis{Label: "throughput (MiB/s)"},
		Series: plots.Group(per.Rows(nil), "reuse", "mib_s", "strategy")}); err != nil {
		return err
	}
	if err := x.Figure("buffers_overhead", plots.Figure{Title: "The strategy's own cost per transfer",
		X:      plots.Axis{Label: "fraction of transfers from a buffer sent before"},
		Y:      plots.Axis{Label: "registration, copy or fault time (µs)", Log: true},
		Series: plots.Group(per.Rows(nil), "reuse", "overhead_us", "strategy")}); err != nil {
		return err
	}
	// Where the pin-down cache stops beating ODP, on the strategies' own cost (the
	// transfer's time is the same for all and, on this emulated NIC, noisy).
	for _, odpVariant := range []string{stratODP, stratODPHW} {
		var cacheWins, odpWins, evidence []string
		cacheShort, odpAlways := true, true // the cache cheaper at every reuse short of 1; ODP never dearer
		for _, reuse := range reuses {
			r := stats.Median(perRep(t, "overhead_ns", sel("strategy", stratCache, "reuse", reuse), sel("strategy", odpVariant, "reuse", reuse)))
			if r < 1 {
				cacheWins = append(cacheWins, fmt.Sprintf("%.2g", reuse))
			} else {
				odpWins = append(odpWins, fmt.Sprintf("%.2g", reuse))
			}
			cacheShort = cacheShort && (reuse == 1 || r < 1)
			odpAlways = odpAlways && r >= 1
			evidence = append(evidence, fmt.Sprintf("reuse %.2g: %.2f", reuse, r))
		}
		ev := fmt.Sprintf("pin-cache / %s own cost per transfer, medians of per-repetition ratios: %s", odpVariant, strings.Join(evidence, ", "))
		if odpVariant == stratODPHW {
			x.Claim("cxcache", "A hardware fault makes a cache of pinned registrations the cheaper choice at every reuse short of full reuse",
				cacheShort, ev)
		} else {
			x.Claim("emunever", "with the emulator's cheap faults ODP is never the dearer", odpAlways, ev)
		}
		x.Headline(fmt.Sprintf("buffer reuse at which the pin-down cache costs less than %s, and more", odpVariant),
			fmt.Sprintf("less at %s; more at %s", orNone(cacheWins), orNone(odpWins)),
			"medians of per-repetition ratios of the strategies' own cost (registration, copy, lookup, faults)")
	}
	for _, reuse := range []float64{reuses[0], reuses[len(reuses)-1]} {
		var parts, intervals []string
		for _, s := range strategies {
			var own []float64 // per transfer, one per repetition
			for _, r := range t.Rows(sel("strategy", s, "reuse", reuse)) {
				own = append(own, r.Float("overhead_ns")/max(1, r.Float("transfers")))
			}
			v, i := medianCI(own, dur)
			parts, intervals = append(parts, s+" "+v), append(intervals, s+" "+i)
		}
		x.HeadlineCI(fmt.Sprintf("own cost per transfer at reuse %.2g", reuse), strings.Join(parts, ", "), strings.Join(intervals, ", "),
			"medians over repetitions")
	}
	return nil
}

func orNone(s []string) string {
	if len(s) == 0 {
		return "none"
	}
	return strings.Join(s, ", ")
}
