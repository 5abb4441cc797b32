package perf

import (
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/odpemu/odpemu/odp"
)

// MultiQP is a cold pass made by qps QPs at once between the same two devices: the
// client's region and the server's are each split into qps slices, and QP i WRITEs
// every message-sized slot of its slice of the client's region to its slice of the
// server's, all QPs posting from their own goroutines at once, p.Depth in flight
// each. With ODP every slot of both regions is new to the NICs, so the QPs fault at
// the same time, on the same MRs: how the NIC's fault handling copes with several
// QPs faulting is what it measures. Each QP pair runs over a wire of its own (in
// one process a link model belongs to a connection), so the QPs share the devices,
// their MRs and their fault handling, not a link. Elapsed is from before the first
// post to after the last completion; the counters are the devices' over that time
// and the QPs' summed. p.MRSize is the whole region; p.Iters is ignored.
func MultiQP(p Params, qps int) (Result, error) {
	if err := p.defaults(); err != nil {
		return Result{}, err
	}
	if p.Test == SendBW || qps < 1 || p.Warm || p.Budget != 0 || p.InvalidateRate != 0 || p.Random || p.Duration != 0 {
		return Result{}, errors.New("perf: MultiQP makes one cold pass of WRITEs or READs over qps >= 1 QPs")
	}
	slice := p.MRSize / qps / p.Size * p.Size
	if slice == 0 {
		return Result{}, fmt.Errorf("perf: %d bytes do not make %d slices of %d-byte messages", p.MRSize, qps, p.Size)
	}
	r, err := newRig(p)
	if err != nil {
		return Result{}, err
	}
	defer r.close()
	clients, servers := []*side{r.client}, []*side{r.server}
	for range qps - 1 {
		c, err := r.client.another(p)
		if err != nil {
			return Result{}, err
		}
		s, err := r.server.another(p)
		if err != nil {
			return Result{}, err
		}
		if err := connect(p, c.qp, s.qp); err != nil {
			return Result{}, err
		}
		attrs := p
		attrs.Prefetch = "" // the rig's sides prefetched the regions these QPs share
		if err := s.configure(attrs, true); err != nil {
			return Result{}, err
		}
		if err := c.configure(attrs, false); err != nil {
			return Result{}, err
		}
		clients, servers = append(clients, c), append(servers, s)
	}
	pass := p
	pass.Iters = slice / p.Size
	before := [2]odp.Stats{r.client.dev.Stats(), r.server.dev.Stats()}
	results := make([]Result, qps)
	errs := make([]error, qps)
	var wg sync.WaitGroup
	start := time.Now()
	for i := range qps {
		c := clients[i].slice(i*slice, slice)
		t := servers[i].target()
		t.addr += uint64(i * slice)
		t.size = slice
		wg.Add(1)
		go func() {
			defer wg.Done()
			results[i], errs[i] = c.loop(pass, t)
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	if err := errors.Join(errs...); err != nil {
		return Result{}, err
	}
	res := Result{Test: p.Test, ODP: p.ODP, Bytes: p.Size, Iters: qps * pass.Iters, Elapsed: elapsed}
	total := float64(p.Size) * float64(res.Iters)
	res.AvgMiBps = total / elapsed.Seconds() / (1 << 20)
	res.MsgRateMpps = float64(res.Iters) / elapsed.Seconds() / 1e6
	for _, q := range results {
		res.PeakMiBps = max(res.PeakMiBps, q.PeakMiBps)
	}
	res.addFaults(before, [2]odp.Stats{r.client.dev.Stats(), r.server.dev.Stats()})
	for _, c := range clients {
		qs := c.qp.Stats()
		res.RNRNaks += qs.RNRNaksReceived
		res.Retransmissions += qs.Retransmissions
		res.Timeouts += qs.Timeouts
	}
	res.RegTime = r.client.mr.Registration().Total + r.server.mr.Registration().Total
	return res, nil
}

// another is a side on s's device, PD, buffer and MR with a QP and CQ of its own.
func (s *side) another(p Params) (*side, error) {
	o := &side{dev: s.dev, pd: s.pd, buf: s.buf, mr: s.mr}
	var err error
	if o.cq, err = s.dev.CreateCQ(2 * p.Depth); err != nil {
		return nil, err
	}
	if o.qp, err = s.pd.CreateQP(odp.QPConfig{MaxSendWR: p.Depth, SendCQ: o.cq, RecvCQ: o.cq}); err != nil {
		return nil, err
	}
	return o, nil
}

// slice is s with its buffer narrowed to [off, off+n): its loop posts from there.
func (s *side) slice(off, n int) *side {
	o := *s
	o.buf = s.buf[off : off+n]
	return &o
}
