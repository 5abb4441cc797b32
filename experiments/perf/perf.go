// Package perf measures RDMA WRITE, READ and SEND bandwidth between two emulated NICs
// the way perftest's ib_write_bw, ib_read_bw and ib_send_bw do, with pinned or
// on-demand registration.
package perf

import (
	"context"
	"fmt"
	"math/rand/v2"
	"runtime"
	"time"
	"unsafe"

	"github.com/odpemu/odpemu/odp"
	"github.com/odpemu/odpemu/transport/roce"
)

// Test names, as perftest's binaries.
const (
	WriteBW = "write_bw"
	ReadBW  = "read_bw"
	SendBW  = "send_bw"
	// AtomicBW is ib_atomic_bw's test: 8-byte fetch-and-adds (its default type).
	AtomicBW = "atomic_bw"
)

// AtomicSize is the bytes an atomic moves.
const AtomicSize = 8

// RxDepth is how many receives a send_bw server keeps posted (ib_send_bw's default
// rx-depth).
const RxDepth = 512

// Params configure one run. Zero values take perftest's defaults.
type Params struct {
	Test        string // WriteBW, ReadBW, SendBW or AtomicBW
	ODP         bool   // register with AccessOnDemand (perftest --odp)
	Size        int    // message size, default 65536
	Iters       int    // iterations, default 5000
	Depth       int    // TX depth, default 128
	CQMod       int    // a completion every CQMod work requests, default 100
	MRSize      int    // region the work requests stride across, default Size*Depth
	Warm        bool   // one untimed pass over the region before measuring
	FaultAround int    // device fault-around, default the device's
	// InvalidateRate invalidates this many random message-sized ranges of the
	// server's region per second while the timed loop runs (ODP only).
	InvalidateRate int
	// Budget is the server NIC's resident budget in bytes: beyond it ODP pages are
	// evicted to the backing store and fault back on access; a pinned registration
	// larger than it is refused.
	Budget int64
	// Random picks each work request's slot at random instead of striding.
	Random bool
	// Implicit registers each side's memory with one implicit ODP MR (the whole
	// address space) instead of an MR of its buffer (needs ODP).
	Implicit bool
	// Prefetch advises each side's whole region before the timed loop, PREFETCH_WRITE
	// synchronously ("sync") or in the background ("async"); "" does not (needs ODP).
	Prefetch string
	// RNRRetry is the client's rnr_retry (0..7, 7 infinite); MinRNRTimer the
	// server's min_rnr_timer (IBTA encoding 0..31). nil: the QP's default.
	RNRRetry, MinRNRTimer *uint8
	// Timeout is the QPs' local ACK timeout in the IBTA encoding (nil: the QP's
	// default).
	Timeout *uint8
	// Outs is how many READs and atomics the client has outstanding at most (its
	// max_rd_atomic) and the server keeps (its max_dest_rd_atomic), as perftest's
	// --outs; 0 is the device's most (odp.Config.RdAtomic), as perftest's default.
	Outs int
	// HotFloor makes the wire comparison's UDP stream send every packet from one
	// buffer and receive into one, instead of moving the WRITEs' bytes (UDPStream).
	HotFloor bool
	// Loss is the probability that each side drops a packet it sends (seeded by
	// Seed), on the in-process wire as over UDP: with ODP faults, the "Pitfalls"
	// finding that loss costs timeouts.
	Loss float64
	Seed uint64
	// InvalidateBytes is the length of each range InvalidateRate invalidates
	// (default Size).
	InvalidateBytes int
	// Duration, if set, ends the timed loop early: no work request is posted after
	// it (Iters is then a bound, and Result.Iters says how many ran).
	Duration time.Duration
	// ResidentTrace keeps every sample of the server region's resident bytes taken
	// during the timed loop in Result.Resident (under a budget they are taken in
	// any case, for Result.MaxResident).
	ResidentTrace bool
	// Profile is both devices' NIC (odp.Profile: the fault model, the link, the
	// responder's fault policy, the firmware's memory key costs, the prefetch
	// limit, implicit children); the zero value is the emulator's own.
	Profile odp.Profile
	// FaultModel, when set, replaces the profile's fault model.
	FaultModel odp.FaultModel
	// AppThread runs the application's loops (the client's posting and polling, a
	// send_bw server's reposting of receives) each on an OS thread of its own
	// (runtime.LockOSThread), as a C verbs program's threads run: every hand-over
	// between the application and the engines is then a switch between threads,
	// where a goroutine takes turns with the engines on the threads they run on.
	AppThread bool
}

// appThread locks the calling goroutine to its OS thread if p.AppThread says so,
// and returns what unlocks it.
func (p Params) appThread() func() {
	if !p.AppThread {
		return func() {}
	}
	runtime.LockOSThread()
	return runtime.UnlockOSThread
}

// device is the configuration of a side's device; a server takes the budget.
func (p Params) device(server bool) odp.Config {
	cfg := p.Profile.Apply(odp.Config{FaultAround: p.FaultAround})
	if p.FaultModel != (odp.FaultModel{}) {
		cfg.FaultModel = p.FaultModel
	}
	if server {
		cfg.ResidentBudget = p.Budget
	}
	return cfg
}

// loss is the wire's injected loss.
func (p Params) loss() roce.Loss { return roce.Loss{Seed: p.Seed, Drop: p.Loss} }

// connect connects two sides' QPs in one process, each sending on its device's
// link, with p's loss.
func connect(p Params, client, server *odp.QP) error {
	return odp.ConnectLoopbackLoss(client, server, p.loss())
}

func (p *Params) defaults() error {
	if p.Test == "" {
		p.Test = WriteBW
	}
	if p.Test != WriteBW && p.Test != ReadBW && p.Test != SendBW && p.Test != AtomicBW {
		return fmt.Errorf("perf: unknown test %q (want %s, %s, %s or %s)", p.Test, WriteBW, ReadBW, SendBW, AtomicBW)
	}
	if p.Test == AtomicBW {
		if p.Size != 0 && p.Size != AtomicSize {
			return fmt.Errorf("perf: %s moves %d bytes, not %d", AtomicBW, AtomicSize, p.Size)
		}
		p.Size = AtomicSize
	}
	if p.Size == 0 {
		p.Size = 65536
	}
	if p.Iters == 0 {
		p.Iters = 5000
	}
	if p.Depth == 0 {
		p.Depth = 128
	}
	if p.CQMod == 0 {
		p.CQMod = 100
	}
	p.CQMod = min(p.CQMod, p.Depth)
	if p.MRSize == 0 {
		p.MRSize = p.Size * p.Depth
	}
	if p.InvalidateBytes == 0 {
		p.InvalidateBytes = p.Size
	}
	if p.Loss < 0 || p.Loss >= 1 {
		return fmt.Errorf("perf: --loss is a probability in [0, 1)")
	}
	if p.Timeout != nil && *p.Timeout > 31 {
		return fmt.Errorf("perf: --timeout is 0..31")
	}
	if p.InvalidateRate < 0 || (p.InvalidateRate > 0 && !p.ODP) {
		return fmt.Errorf("perf: --invalidate-rate needs ODP and a rate >= 0")
	}
	if p.Budget < 0 {
		return fmt.Errorf("perf: --budget must be >= 0")
	}
	if (p.Implicit || p.Prefetch != "") && !p.ODP {
		return fmt.Errorf("perf: --implicit and --prefetch need --odp")
	}
	if p.Prefetch != "" && p.Prefetch != "sync" && p.Prefetch != "async" {
		return fmt.Errorf("perf: --prefetch %q: want sync or async", p.Prefetch)
	}
	if (p.RNRRetry != nil && *p.RNRRetry > 7) || (p.MinRNRTimer != nil && *p.MinRNRTimer > 31) {
		return fmt.Errorf("perf: --rnr-retry is 0..7 and --min-rnr-timer 0..31")
	}
	if p.Outs < 0 || p.Outs > odp.MaxRdAtomicLimit {
		return fmt.Errorf("perf: --outs is 1..%d (0: the device's most)", odp.MaxRdAtomicLimit)
	}
	if p.Size < 1 || p.Size > 1<<30 || p.Iters < 1 || p.Depth < 1 || p.Depth > 4096 || p.MRSize < p.Size {
		return fmt.Errorf("perf: bad parameters size=%d iters=%d depth=%d mr-size=%d", p.Size, p.Iters, p.Depth, p.MRSize)
	}
	return nil
}

// Result is one run's measurement. Bandwidths are MiB/s, as perftest reports them.
type Result struct {
	Test         string        `json:"test"`
	ODP          bool          `json:"odp"`
	Warm         bool          `json:"warm"`
	Bytes        int           `json:"bytes"`
	Iters        int           `json:"iterations"`
	PeakMiBps    float64       `json:"bw_peak_mib_s"`
	AvgMiBps     float64       `json:"bw_avg_mib_s"`
	MsgRateMpps  float64       `json:"msg_rate_mpps"`
	Elapsed      time.Duration `json:"elapsed_ns"`
	RegTime      time.Duration `json:"registration_ns"` // both regions
	PageFaults   uint64        `json:"network_page_faults"`
	PagesFaulted uint64        `json:"pages_faulted"`
	FaultTime    time.Duration `json:"fault_time_ns"`
	CPUFaults    uint64        `json:"cpu_faults"`
	// RC retries of the client's QP: RNR NAKs its server answered (ODP faults at the
	// responder) and requests it sent again.
	RNRNaks         uint64 `json:"rnr_naks"`
	Retransmissions uint64 `json:"retransmissions"`
	PagesPrefetched uint64 `json:"pages_prefetched"`
	// PrefetchTime is how long the two sides' prefetch calls took before the run
	// (for "async", only the calls).
	PrefetchTime time.Duration `json:"prefetch_ns"`
	// Invalidations issued by --invalidate-rate during the timed loop.
	Invalidations uint64 `json:"invalidations"`
	// Timeouts is how often the client's local ACK timer expired.
	Timeouts uint64 `json:"timeouts"`
	// The client's link: its bandwidth-delay product and the most bytes it held
	// (in one process; 0 without a link model).
	LinkBDP         int `json:"link_bdp_bytes"`
	LinkMaxInFlight int `json:"link_max_in_flight_bytes"`
	// MaxGoBack is the most packets one go-back-N of the client sent again.
	MaxGoBack uint64 `json:"max_go_back_packets"`
	// TakenBack counts the client's packets a NAK took back before they left its
	// NIC (odp.QPStats.TakenBack): sent once, after the NAK, and not counted as
	// retransmissions.
	TakenBack uint64 `json:"taken_back_packets"`
	// Under a budget: pages evicted and restored; the most resident bytes of the
	// server's region seen during the loop (the kernel's count, from pagemap; also
	// with Params.ResidentTrace, 0 otherwise).
	Evictions   uint64 `json:"evictions"`
	Restores    uint64 `json:"restores"`
	MaxResident int64  `json:"max_resident_bytes"`
	// Resident is the server region's resident bytes over the loop, with
	// Params.ResidentTrace: the first sample as the loop starts, the last as it
	// ends.
	Resident []ResidentSample `json:"resident,omitempty"`
}

// ResidentSample is the resident bytes of a region at a time since the timed
// loop started.
type ResidentSample struct {
	At    time.Duration `json:"at_ns"`
	Bytes int64         `json:"bytes"`
}

// addFaults adds the faults the devices took between two readings of their
// counters (the client's and the server's) to r.
func (r *Result) addFaults(before, after [2]odp.Stats) {
	for i := range after {
		r.PageFaults += after[i].PageFaults - before[i].PageFaults
		r.PagesFaulted += after[i].PagesFaulted - before[i].PagesFaulted
		r.FaultTime += after[i].FaultTime - before[i].FaultTime
		r.CPUFaults += after[i].CPUFaults - before[i].CPUFaults
	}
}

// CompletionError is a run's work request that completed with an error status.
type CompletionError struct {
	WC odp.WC
}

func (e *CompletionError) Error() string {
	return fmt.Sprintf("perf: WR %d: %v (%s)", e.WC.WRID, e.WC.Status, e.WC.Detail)
}

// Run performs one measurement on two fresh devices connected by an in-process wire.
func Run(p Params) (Result, error) {
	if err := p.defaults(); err != nil {
		return Result{}, err
	}
	r, err := newRig(p)
	if err != nil {
		return Result{}, err
	}
	defer r.close()
	if p.Warm {
		warm := p
		warm.Iters = max(p.MRSize/p.Size, 1)
		if _, err := r.client.loop(warm, r.server.target()); err != nil {
			return Result{}, fmt.Errorf("perf: warm-up: %w", err)
		}
		r.settle(p) // an ODP warm-up takes faults and lasts far longer than pinned's
	}
	return r.measure(p)
}

// ColdWarm measures one pass over fresh memory, in which every page of both regions
// is new to the NICs (p.Iters is ignored: a pass is MRSize/Size work requests), and
// then a second pass over the same memory, in steady state.
func ColdWarm(p Params) (cold, warm Result, err error) {
	if err := p.defaults(); err != nil {
		return Result{}, Result{}, err
	}
	p.Iters = max(p.MRSize/p.Size, 1)
	r, err := newRig(p)
	if err != nil {
		return Result{}, Result{}, err
	}
	defer r.close()
	if cold, err = r.measure(p); err != nil {
		return Result{}, Result{}, err
	}
	// A cold ODP pass takes faults and lasts far longer than pinned's: the warm pass
	// too starts from memory the CPU has just written (settle).
	r.settle(p)
	p.Warm = true
	warm, err = r.measure(p)
	return cold, warm, err
}

// rig is a client and a server connected by an in-process wire; for send_bw the
// server keeps receives posted.
type rig struct {
	client, server *side
	rx             *receiver
}

// newRig makes a rig for p (defaults applied): devices, QPs, regions filled and
// registered as perftest does, QP attributes set, prefetches made.
func newRig(p Params) (_ *rig, err error) {
	cp := p
	if p.Budget > 0 {
		// Under a budget the experiment is about the server's region: the client
		// needs only a message per work request in flight, not a copy of it.
		cp.MRSize = min(p.MRSize, p.Size*p.Depth)
	}
	r := &rig{}
	defer func() {
		if err != nil {
			r.close()
		}
	}()
	if r.client, err = newSide(p.device(false), cp); err != nil {
		return nil, err
	}
	if r.server, err = newSide(p.device(true), p); err != nil {
		return nil, err
	}
	if err := connect(p, r.client.qp, r.server.qp); err != nil {
		return nil, err
	}
	if p.Test == SendBW {
		if r.rx, err = r.server.startReceiver(p); err != nil {
			return nil, err
		}
	}
	// perftest fills its buffers after registering them: with --odp these first
	// touches are CPU faults. Under a budget the server's region is left untouched:
	// filling it would only evict it again.
	for _, b := range r.regions(p) {
		fill(b)
	}
	// The regions are written again last, so that the first pass starts from memory
	// the CPU has just written (settle), whatever the variant; an asynchronous
	// prefetch, which races the pass, is issued after that.
	async := p.Prefetch == "async"
	if async {
		r.settle(p)
	}
	for i, s := range []*side{r.client, r.server} {
		if err := s.configure(p, i == 1); err != nil {
			return nil, err
		}
	}
	if !async {
		r.settle(p)
	}
	return r, nil
}

func (r *rig) close() {
	if r.rx != nil {
		_ = r.rx.stop() // a failed receive already failed the client's sends
	}
	for _, s := range []*side{r.client, r.server} {
		if s != nil {
			s.close()
		}
	}
}

// measure runs p's timed loop and reports it with the devices' counters over it.
func (r *rig) measure(p Params) (Result, error) {
	client, server := r.client, r.server
	before := [2]odp.Stats{client.dev.Stats(), server.dev.Stats()}
	qbefore := client.qp.Stats()
	stopInval := startInvalidator(server, p)
	stopSample := func() []ResidentSample { return nil }
	if p.Budget > 0 || p.ResidentTrace {
		stopSample = sampleResident(server) // a run without a budget does not pay for pagemap reads
	}
	res, err := client.loop(p, server.target())
	res.Invalidations = stopInval()
	trace := stopSample()
	for _, s := range trace {
		res.MaxResident = max(res.MaxResident, s.Bytes)
	}
	if p.ResidentTrace {
		res.Resident = trace
	}
	if err != nil {
		return Result{}, err
	}
	after := [2]odp.Stats{client.dev.Stats(), server.dev.Stats()}
	res.addFaults(before, after)
	for i := range after {
		// Async prefetches may land during the run: the whole count is reported.
		res.PagesPrefetched += after[i].PagesPrefetched
	}
	qs := client.qp.Stats()
	res.RNRNaks = qs.RNRNaksReceived - qbefore.RNRNaksReceived
	res.Retransmissions = qs.Retransmissions - qbefore.Retransmissions
	res.Timeouts = qs.Timeouts - qbefore.Timeouts
	res.LinkMaxInFlight, res.MaxGoBack, res.TakenBack = qs.LinkMaxInFlight, qs.MaxGoBack, qs.TakenBack
	res.LinkBDP = p.Profile.Link.BDPBytes()
	res.Evictions = after[1].Evictions - before[1].Evictions
	res.Restores = after[1].Restores - before[1].Restores
	res.Test, res.ODP, res.Warm = p.Test, p.ODP, p.Warm
	res.RegTime = client.mr.Registration().Total + server.mr.Registration().Total
	res.PrefetchTime = client.prefetch + server.prefetch
	return res, nil
}

type side struct {
	dev *odp.Device
	pd  *odp.PD
	cq  *odp.CQ
	qp  *odp.QP
	buf []byte
	mr  *odp.MR
	// prefetch is how long configure's prefetch call took (for "async", only the
	// call).
	prefetch time.Duration
}

func newSide(cfg odp.Config, p Params) (*side, error) {
	s, err := newBareSide(cfg, p)
	if err != nil {
		return nil, err
	}
	if err := s.register(p); err != nil {
		s.close()
		return nil, err
	}
	return s, nil
}

// newBareSide is a side whose buffer is not registered yet.
func newBareSide(cfg odp.Config, p Params) (*side, error) {
	d, err := odp.Open(cfg)
	if err != nil {
		return nil, err
	}
	s := &side{dev: d}
	fail := func(err error) (*side, error) { _ = d.Close(); return nil, err } // err is the one to report
	if s.pd, err = d.AllocPD(); err != nil {
		return fail(err)
	}
	qc := odp.QPConfig{MaxSendWR: p.Depth}
	cqSize := 2 * p.Depth
	if p.Test == SendBW {
		qc.MaxRecvWR = RxDepth
		cqSize += RxDepth
	}
	if s.cq, err = d.CreateCQ(cqSize); err != nil {
		return fail(err)
	}
	qc.SendCQ, qc.RecvCQ = s.cq, s.cq
	if s.qp, err = s.pd.CreateQP(qc); err != nil {
		return fail(err)
	}
	if s.buf, err = d.Alloc(p.MRSize); err != nil {
		return fail(err)
	}
	return s, nil
}

// register registers the side's buffer as p says.
func (s *side) register(p Params) (err error) {
	access := odp.AccessLocalWrite | odp.AccessRemoteWrite | odp.AccessRemoteRead
	if p.Test == AtomicBW {
		access |= odp.AccessRemoteAtomic
	}
	if p.ODP {
		access |= odp.AccessOnDemand
	}
	if p.Implicit {
		s.mr, err = s.pd.RegImplicitMR(access)
	} else {
		s.mr, err = s.pd.RegMR(s.buf, access)
	}
	return err
}

// addr is the address of the side's buffer at off, as its MR's SGEs name it.
func (s *side) addr(off uint64) uint64 {
	return uint64(uintptr(unsafe.Pointer(unsafe.SliceData(s.buf)))) + off
}

// configure sets the side's QP attributes from p (the client's rnr_retry and
// max_rd_atomic, the server's min_rnr_timer and max_dest_rd_atomic, the local ACK
// timeout, if given) and prefetches its region as p.Prefetch says.
func (s *side) configure(p Params, server bool) error {
	var attr odp.QPAttr
	var mask odp.QPAttrMask
	if p.RNRRetry != nil && !server {
		attr.RNRRetry, mask = *p.RNRRetry, mask|odp.AttrRNRRetry
	}
	if p.MinRNRTimer != nil && server {
		attr.MinRNRTimer, mask = *p.MinRNRTimer, mask|odp.AttrMinRNRTimer
	}
	if p.Timeout != nil {
		attr.Timeout, mask = *p.Timeout, mask|odp.AttrTimeout
	}
	switch {
	case p.Outs > 0 && server:
		attr.MaxDestRdAtomic, mask = uint8(p.Outs), mask|odp.AttrMaxDestRdAtomic
	case p.Outs > 0:
		attr.MaxRdAtomic, mask = uint8(p.Outs), mask|odp.AttrMaxRdAtomic
	}
	if mask != 0 {
		if err := s.qp.ModifyAttr(attr, mask); err != nil {
			return err
		}
	}
	if p.Prefetch == "" {
		return nil
	}
	flags := odp.AdviseFlags(0)
	if p.Prefetch == "sync" {
		flags = odp.AdviseFlush
	}
	t0 := time.Now()
	if err := s.pd.AdviseMR(odp.AdvisePrefetchWrite, flags, []odp.SGE{s.sge(0, len(s.buf))}); err != nil {
		return fmt.Errorf("perf: prefetch: %w", err)
	}
	s.prefetch = time.Since(t0)
	return nil
}

// target is the server's region as a client sees it: its address, rkey and size.
type target struct {
	addr uint64
	rkey uint32
	size int
}

func (s *side) target() target { return target{addr: s.addr(0), rkey: s.mr.RKey(), size: len(s.buf)} }

// sge is an SGE of [off, off+n) of the side's buffer.
func (s *side) sge(off, n int) odp.SGE {
	return odp.SGE{Addr: s.addr(uint64(off)), Length: uint32(n), LKey: s.mr.LKey()}
}

// WarmPair measures steady state: it registers an ODP MR and a pinned MR over the same
// buffers on both sides, faults the ODP MRs in with one pass, then alternates bursts of
// p.Iters work requests between the two keys, which differ in nothing but registration.
// It returns each burst's average bandwidth, pinned and ODP, in burst order.
func WarmPair(p Params, bursts int) (pinned, onDemand []float64, err error) {
	p.ODP = true
	if err := p.defaults(); err != nil {
		return nil, nil, err
	}
	if p.Test == SendBW {
		// The bursts switch the server's MR under receives already posted.
		return nil, nil, fmt.Errorf("perf: warm pairs measure %s and %s, not %s", WriteBW, ReadBW, SendBW)
	}
	cfg := p.device(false)
	var sides [2]*side
	for i := range sides {
		if sides[i], err = newSide(cfg, p); err != nil {
			return nil, nil, err
		}
		defer sides[i].close()
		fill(sides[i].buf)
	}
	client, server := sides[0], sides[1]
	if err := odp.ConnectLoopback(client.qp, server.qp); err != nil {
		return nil, nil, err
	}
	warm := p
	warm.Iters = max(p.MRSize/p.Size, 1)
	if _, err := client.loop(warm, server.target()); err != nil {
		return nil, nil, err
	}
	faults := func() uint64 { return client.dev.Stats().PageFaults + server.dev.Stats().PageFaults }
	warmed := faults()
	odpMRs := [2]*odp.MR{client.mr, server.mr}
	var pinnedMRs [2]*odp.MR
	for i, s := range sides {
		if pinnedMRs[i], err = s.pd.RegMR(s.buf, odp.AccessLocalWrite|odp.AccessRemoteWrite|odp.AccessRemoteRead); err != nil {
			return nil, nil, err
		}
	}
	for b := 0; b < bursts; b++ {
		order := []bool{false, true}
		if b%2 == 1 {
			order = []bool{true, false}
		}
		for _, useODP := range order {
			mrs := pinnedMRs
			if useODP {
				mrs = odpMRs
			}
			client.mr, server.mr = mrs[0], mrs[1]
			r, err := client.loop(p, server.target())
			if err != nil {
				return nil, nil, err
			}
			if useODP {
				onDemand = append(onDemand, r.AvgMiBps)
			} else {
				pinned = append(pinned, r.AvgMiBps)
			}
		}
	}
	if f := faults(); f != warmed {
		return nil, nil, fmt.Errorf("perf: %d network page faults during steady state", f-warmed)
	}
	return pinned, onDemand, nil
}

// close closes the side's device; a measurement's result does not depend on how the
// teardown went.
func (s *side) close() { _ = s.dev.Close() }

// loop posts p.Iters work requests keeping p.Depth in flight, one signaled every
// p.CQMod, and times them as perftest does: average bandwidth is bytes x iterations
// over (last completion - first post); peak is the best completion window.
func (s *side) loop(p Params, remote target) (Result, error) {
	op := odp.OpRDMAWrite
	switch p.Test {
	case ReadBW:
		op = odp.OpRDMARead
	case SendBW:
		op = odp.OpSend
	case AtomicBW:
		op = odp.OpAtomicFetchAdd
	}
	slots := max(len(s.buf)/p.Size, 1) // local slots; the remote side may be larger
	rslots := max(remote.size/p.Size, 1)
	rng := rand.New(rand.NewPCG(uint64(p.Size), uint64(p.Iters)))
	wcs := make([]odp.WC, 16)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	defer p.appThread()()
	var start time.Time
	var stamps []time.Time // completion times of signaled WRs
	var marks []int        // WRs completed at each stamp
	posted, completed := 0, 0
	limit := p.Iters
	for completed < limit {
		for posted < limit && posted-completed < p.Depth {
			if p.Duration > 0 && posted > 0 && posted < limit-1 && time.Since(start) > p.Duration {
				limit = posted + 1 // this one is the last, and signaled
			}
			off := uint64((posted % slots) * p.Size)
			roff := uint64((posted % rslots) * p.Size)
			if p.Random {
				roff = uint64(rng.IntN(rslots) * p.Size)
			}
			wr := odp.SendWR{WRID: uint64(posted), Opcode: op,
				SGL:        []odp.SGE{s.sge(int(off), p.Size)},
				RemoteAddr: remote.addr + roff, RKey: remote.rkey}
			switch op {
			case odp.OpSend:
				wr.RemoteAddr, wr.RKey = 0, 0 // the receiver's posted buffers choose
			case odp.OpAtomicFetchAdd:
				wr.CompareAdd = 1
			}
			if (posted+1)%p.CQMod == 0 || posted == limit-1 {
				wr.Flags = odp.SendSignaled
			}
			if posted == 0 {
				start = time.Now()
			}
			if err := s.qp.PostSend(wr); err != nil {
				return Result{}, err
			}
			posted++
		}
		n, err := p.pollWait(ctx, s.cq, wcs)
		if err != nil {
			return Result{}, err
		}
		now := time.Now()
		for _, wc := range wcs[:n] {
			if wc.Status != odp.WCSuccess {
				return Result{}, &CompletionError{WC: wc}
			}
			completed = int(wc.WRID) + 1
			stamps = append(stamps, now)
			marks = append(marks, completed)
		}
	}
	elapsed := stamps[len(stamps)-1].Sub(start)
	r := Result{Bytes: p.Size, Iters: limit, Elapsed: elapsed}
	total := float64(p.Size) * float64(limit)
	r.AvgMiBps = total / elapsed.Seconds() / (1 << 20)
	r.MsgRateMpps = float64(limit) / elapsed.Seconds() / 1e6
	prevT, prevN := start, 0
	for i, t := range stamps {
		if d := t.Sub(prevT).Seconds(); d > 0 {
			r.PeakMiBps = max(r.PeakMiBps, float64(marks[i]-prevN)*float64(p.Size)/d/(1<<20))
		}
		prevT, prevN = t, marks[i]
	}
	r.PeakMiBps = max(r.PeakMiBps, r.AvgMiBps)
	return r, nil
}

// receiver keeps a side's receive queue full, as ib_send_bw's server does: RxDepth
// receives over the slots of its buffer, each reposted as it completes. The side posts
// no sends, so every completion on its CQ is a receive's.
type receiver struct {
	cancel context.CancelFunc
	done   chan error
}

func (s *side) startReceiver(p Params) (*receiver, error) {
	slots := max(len(s.buf)/p.Size, 1)
	post := func(i uint64) error {
		return s.qp.PostRecv(odp.RecvWR{WRID: i, SGL: []odp.SGE{s.sge(int(i%uint64(slots))*p.Size, p.Size)}})
	}
	for i := uint64(0); i < RxDepth; i++ {
		if err := post(i); err != nil {
			return nil, fmt.Errorf("perf: post receive: %w", err)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	r := &receiver{cancel: cancel, done: make(chan error, 1)}
	go func() {
		defer p.appThread()()
		wcs := make([]odp.WC, 64)
		for {
			n, err := p.pollWait(ctx, s.cq, wcs)
			if err != nil {
				r.done <- nil // stopped (the context's error): nothing to report
				return
			}
			for _, wc := range wcs[:n] {
				if wc.Status != odp.WCSuccess {
					r.done <- &CompletionError{WC: wc}
					return
				}
				if err := post(wc.WRID); err != nil {
					r.done <- fmt.Errorf("perf: repost receive: %w", err)
					return
				}
			}
		}
	}()
	return r, nil
}

// stop ends the receiver and returns what failed it, if anything did.
func (r *receiver) stop() error {
	r.cancel()
	return <-r.done
}

// pollWait is how the application waits for completions: the package's pollWait,
// or, on a thread of its own (AppThread), a poll and then a wait that blocks, as
// odpemu's verbs library makes a thread with sends in flight wait: a locked goroutine
// that yielded would hand its P to another thread and take it back each time.
func (p Params) pollWait(ctx context.Context, cq *odp.CQ, wcs []odp.WC) (int, error) {
	if !p.AppThread {
		return pollWait(ctx, cq, wcs)
	}
	return cq.Wait(ctx, wcs)
}

// pollWait polls cq for a short while, yielding between polls, before it waits:
// perftest polls its CQ without sleeping, and a completion comes within
// microseconds of the previous one here, sooner than a sleeping goroutine wakes.
func pollWait(ctx context.Context, cq *odp.CQ, wcs []odp.WC) (int, error) {
	deadline := time.Now().Add(pollFor)
	for i := 1; ; i++ {
		if n, err := cq.Poll(wcs); n > 0 || err != nil {
			return n, err
		}
		// The clock every few polls: reading it costs about as much as a poll
		// and a yield, and the application's CPU is the emulated NIC's.
		if i%8 == 0 && !time.Now().Before(deadline) {
			return cq.Wait(ctx, wcs)
		}
		runtime.Gosched()
	}
}

// pollFor is how long pollWait polls. The application's goroutines share the
// machine's cores with the emulated NICs' engines: a receiver that polled an empty
// CQ for long would take the CPU the engine filling it needs (send_bw's server at
// 64 B --link-rate 0: 1.18 Mpps polling 50 us, 1.63 polling 10 us, medians of five
// alternating runs; write_bw and read_bw do not change).
const pollFor = 10 * time.Microsecond

// settle writes the rig's regions settlePasses times more, so that a timed pass starts
// from memory the CPU has just written, as perftest's starts after its fill. On this
// project's VMs memory that the CPU left alone for a while copies at about half speed
// for its next few passes, the CPU's own copies as much as the NIC's, and the setup
// leaves ODP memory alone far longer than pinned: the fault server resolves the fill's
// first touches, which takes several times longer (512 MiB regions: 4.2 s against 0.6
// s), and a synchronous prefetch walks the region after it. In six CPU copy passes over
// 32 MiB regions just filled, the first ran at 8.0-10.7 GB/s over pinned regions and
// 4.5-6.6 over ODP ones, both 12-13.7 by the fifth; with every cache line of both
// written four more times first, both started at 10.5-13.5. odp-perf write_bw -s 64K
// --mr-size 32M -n 512 --reps 10, three runs: a synchronous prefetch's first passes ran
// at 4,221-5,209 MiB/s against pinned's 6,093-8,082 before, 7,431-9,147 against
// 7,421-9,411 with this step. What it cannot undo is idling inside a pass: an ODP pass
// that waits out RNR timers leaves the machine slower for its next pass, settled or not
// (pinned, after half a second asleep and settled: 0.8 of its speed without the sleep).
func (r *rig) settle(p Params) {
	regions := r.regions(p)
	for range settlePasses {
		for _, b := range regions {
			fill(b)
		}
	}
}

// regions returns the rig's regions that the application writes: the client's, and
// the server's unless a budget holds it (filling it would only evict it again).
func (r *rig) regions(p Params) [][]byte {
	if p.Budget != 0 {
		return [][]byte{r.client.buf}
	}
	return [][]byte{r.client.buf, r.server.buf}
}

// settlePasses is how many times settle writes each region.
const settlePasses = 4

// fill writes a byte pattern over b, doubling copies to keep setup short.
func fill(b []byte) {
	for i := 0; i < len(b) && i < 4096; i++ {
		b[i] = byte(i*7 + i>>8)
	}
	for n := 4096; n < len(b); n *= 2 {
		copy(b[n:], b[:n])
	}
}

// startInvalidator invalidates random ranges of s's region of p.InvalidateBytes at
// p.InvalidateRate per second until the returned function is called, which returns
// how many it issued. The schedule sets the count and a timer paces it: each wake-up
// issues what is due by then, so that rates beyond the timer's resolution are met.
// It synchronises nothing.
func startInvalidator(s *side, p Params) func() uint64 {
	if p.InvalidateRate == 0 {
		return func() uint64 { return 0 }
	}
	stop, done := make(chan struct{}), make(chan uint64)
	go func() {
		rng := rand.New(rand.NewPCG(uint64(p.Size), uint64(p.InvalidateRate)))
		rate := float64(p.InvalidateRate)
		// The k-th invalidation is due at (k+1/2)/rate: a run of d seconds has
		// rate*d of them, the first after half an interval. The timer wakes for
		// the next one, or after a millisecond for those due by then.
		start := time.Now()
		next := time.NewTimer(time.Duration(0.5 / rate * 1e9))
		defer next.Stop()
		slots := max(p.MRSize/p.Size, 1)
		var n, issued uint64
		for {
			select {
			case <-stop:
				done <- n
				return
			case now := <-next.C:
				for due := uint64(now.Sub(start).Seconds()*rate + 0.5); issued < due; issued++ {
					off := rng.IntN(slots) * p.Size
					if s.dev.Invalidate(s.addr(uint64(off)), uint64(min(p.InvalidateBytes, len(s.buf)-off))) == nil {
						n++
					}
				}
				at := start.Add(time.Duration((float64(issued) + 0.5) / rate * 1e9))
				next.Reset(max(time.Until(at), time.Millisecond))
			}
		}
	}()
	return func() uint64 { close(stop); return <-done }
}

// sampleResident samples the resident bytes of s's region until the returned
// function is called, which returns the samples: one now, one every
// residentEvery or ten times as long as the last sample took to read (pagemap of
// a large region takes milliseconds, and the sampler must not take a core from
// the run it watches), and one at the end.
func sampleResident(s *side) func() []ResidentSample {
	stop, done := make(chan struct{}), make(chan []ResidentSample)
	start := time.Now()
	go func() {
		var out []ResidentSample
		sample := func() time.Duration {
			t := time.Now()
			n, err := s.dev.ResidentBytes(s.buf)
			if err == nil { // pagemap could not be read: a sample missed
				out = append(out, ResidentSample{At: t.Sub(start), Bytes: n})
			}
			return time.Since(t)
		}
		for {
			took := sample()
			wait := time.NewTimer(max(residentEvery, 10*took))
			select {
			case <-stop:
				wait.Stop()
				sample()
				done <- out
				return
			case <-wait.C:
			}
		}
	}()
	return func() []ResidentSample { close(stop); return <-done }
}

// residentEvery is how often sampleResident samples at most.
const residentEvery = 2 * time.Millisecond
