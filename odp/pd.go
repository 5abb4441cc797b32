package odp

// PD is a protection domain: MRs and QPs of one PD cannot be used with another's.
type PD struct {
	domain
	owner *Device
}

// AllocPD allocates a protection domain.
func (d *Device) AllocPD() (*PD, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil, ErrClosed
	}
	pd := &PD{domain: domain{dev: &d.nic}, owner: d}
	d.pds[pd] = struct{}{}
	return pd, nil
}

// Dealloc frees the PD; it fails with ErrBusy while MRs, QPs, SRQs or windows use it.
func (pd *PD) Dealloc() error {
	d := pd.owner
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, ok := d.pds[pd]; !ok || d.closed {
		return ErrClosed
	}
	for _, mr := range d.mrs {
		if mr.pd.Load() == &pd.domain {
			return wrap(ErrBusy, "PD has MR %#x", mr.key)
		}
	}
	if pd.qps > 0 || pd.srqs > 0 || pd.mws > 0 {
		return wrap(ErrBusy, "PD has %d QPs, %d SRQs and %d memory windows", pd.qps, pd.srqs, pd.mws)
	}
	delete(d.pds, pd)
	pd.dead.Store(true)
	return nil
}

// Device returns the PD's device.
func (pd *PD) Device() *Device { return pd.owner }

// dom is the PD's domain (nil for a nil PD, which the verbs refuse).
func (pd *PD) dom() *domain {
	if pd == nil {
		return nil
	}
	return &pd.domain
}

// RegMR registers buf for NIC access: pinned, any memory (as ibv_reg_mr pins any
// mapping), or with AccessOnDemand any anonymous memory of the process. A buffer from
// Alloc then takes part in paging and the resident budget; other memory (malloc's,
// the application's own mmap, the Go heap) is faulted in as hmm_range_fault does and
// never evicted, and registering it changes nothing for the application's other data
// in the same pages.
func (pd *PD) RegMR(buf []byte, access Access) (*MR, error) { return pd.dom().regMR(buf, access) }

// RegImplicitMR registers the whole address space on demand, as
// ibv_reg_mr(pd, NULL, SIZE_MAX, IBV_ACCESS_ON_DEMAND | access) does on mlx5: one key
// for every buffer the device's address space has mapped with Alloc or will map, on
// any of its devices, and for the process's other memory (malloc's, its own mmap, the
// Go heap), present and future. Nothing is pinned and nothing is allocated per page:
// the NIC's table grows with the pages it touches. A fault on the process's own memory
// registers the pages it touches for userfaultfd events only, as RegMR of that memory
// does (Dereg releases them). An address with no memory a DMA can reach is an access
// error (REM_ACCESS_ERR for the peer, LOC_PROT_ERR locally), never a crash. As on a
// NIC, the MR reaches whatever is mapped at an address when its fault comes: memory
// the application unmapped, and another part of the process (the Go runtime, a
// library) mapped since, is reached too. Invalidation works on it as on explicit
// MRs; eviction and migration on its buffers.
// Addr is 0 and Len the size of the user address space (2^47).
func (pd *PD) RegImplicitMR(access Access) (*MR, error) { return pd.dom().regImplicitMR(access) }

// AdviseMR advises the NIC about the ranges of an SGL, as ibv_advise_mr does: every
// SGE must lie in an ODP MR of the PD. PREFETCH maps the ranges for reading,
// faulting missing pages in; PREFETCH_WRITE maps them writable (the MR must allow
// writes); PREFETCH_NO_FAULT maps only pages already present. Bad arguments fail
// before any work starts; a background prefetch that fails (the MR deregistered
// meanwhile, its memory unmapped) is counted in PrefetchErrors.
func (pd *PD) AdviseMR(advice Advice, flags AdviseFlags, sgl []SGE) error {
	return pd.dom().adviseMR(advice, flags, sgl)
}

// Rereg changes the MR's protection domain and access rights in place, as
// ibv_rereg_mr with IBV_REREG_MR_CHANGE_PD and IBV_REREG_MR_CHANGE_ACCESS does on a
// NIC that rewrites the mkey context (mlx5 through UMR, rxe): the keys, the pages and
// their mapping stay, and every request checked from then on sees the new PD and
// rights (one already past its check completes under the old). A nil pd keeps the
// PD. AccessOnDemand cannot change: that is a new registration (Dereg, RegMR). A
// pinned MR that gains LOCAL_WRITE is faulted in for write first, as pinning for
// write does, and fails with ErrBadAddress where its memory cannot be written.
func (mr *MR) Rereg(pd *PD, access Access) error { return mr.rereg(pd.dom(), access) }

// CreateSRQ creates a shared receive queue in the PD.
func (pd *PD) CreateSRQ(cfg SRQConfig) (*SRQ, error) {
	if pd == nil || pd.dead.Load() {
		return nil, wrap(ErrInvalidArgument, "CreateSRQ on a deallocated PD")
	}
	if cfg.MaxWR == 0 {
		cfg.MaxWR = 128
	}
	if cfg.MaxSGE == 0 {
		cfg.MaxSGE = 16
	}
	if cfg.MaxWR < 0 || cfg.MaxWR > maxQPWR || cfg.MaxSGE < 0 || cfg.MaxSGE > maxSGE || cfg.Limit < 0 ||
		cfg.Limit > cfg.MaxWR {
		return nil, wrap(ErrInvalidArgument, "SRQ of %d receives of %d SGEs, limit %d", cfg.MaxWR, cfg.MaxSGE, cfg.Limit)
	}
	d := pd.owner
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil, ErrClosed
	}
	s := &SRQ{pd: &pd.domain, dev: &d.nic, maxSGE: cfg.MaxSGE, onLimit: cfg.OnLimit, limit: cfg.Limit}
	s.rq.slots = make([]rqe, cfg.MaxWR)
	pd.srqs++
	return s, nil
}

// AllocMW allocates a memory window of type t in the PD, unbound.
func (pd *PD) AllocMW(t MWType) (*MW, error) {
	if t != MWType1 && t != MWType2 {
		return nil, wrap(ErrInvalidArgument, "memory window type %d", t) // as uverbs refuses it
	}
	d := &pd.owner.nic
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed || pd.dead.Load() {
		return nil, ErrClosed
	}
	key, ok := d.keys.alloc()
	if !ok {
		return nil, wrap(ErrNoMemory, "no memory key left")
	}
	return pd.newMWLocked(t, key), nil
}
