package odp

import (
	"fmt"
	"time"

	"github.com/odpemu/odpemu/internal/interval"
	"github.com/odpemu/odpemu/mmu"
	"github.com/odpemu/odpemu/pagefault"
)

// regImplicitMR is RegImplicitMR.
func (pd *domain) regImplicitMR(access Access) (*MR, error) {
	t0 := time.Now()
	if pd == nil || pd.dead.Load() {
		return nil, wrap(ErrInvalidArgument, "RegImplicitMR on a deallocated PD")
	}
	access |= AccessOnDemand
	switch {
	case access&^accessKnown != 0:
		return nil, wrap(ErrInvalidArgument, "unknown access flags %#x", uint32(access&^accessKnown))
	case access&(AccessRemoteWrite|AccessRemoteAtomic) != 0 && access&AccessLocalWrite == 0:
		return nil, wrap(ErrInvalidArgument, "%v needs LOCAL_WRITE", access)
	}
	d := pd.dev
	s := d.as
	mr := &MR{dev: d, length: maxMRSize, odp: true, implicit: true}
	mr.pd.Store(pd)
	mr.access.Store(uint32(access))
	s.regMu.Lock()
	defer s.regMu.Unlock()
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return nil, ErrClosed
	}
	key, ok := d.keys.alloc()
	if !ok {
		d.mu.Unlock()
		return nil, wrap(ErrNoMemory, "out of memory keys")
	}
	mr.key = key
	mr.table = mmu.New(maxMRSize / PageSize)
	s.mu.Lock()
	if len(s.implicitMRs) == 0 {
		// Every buffer takes faults from now on (new ones are registered so by Alloc).
		for _, b := range s.buffers {
			for _, r := range interval.Uncovered(b.Range, b.holes) {
				if _, err := s.uffd.Register(r.Start, r.End-r.Start, pagefault.ModeMissing|pagefault.ModeWP); err != nil {
					s.mu.Unlock()
					d.keys.release(key)
					d.mu.Unlock()
					return nil, fmt.Errorf("odp: register buffer %#x for implicit ODP: %w", b.Start, err)
				}
			}
		}
	}
	s.implicitMRs = append(s.implicitMRs, mr)
	s.syncEvictableLocked()
	bufs := append([]buffer(nil), s.buffers...)
	s.mu.Unlock()
	d.mrs[key>>8] = mr
	d.keyed.storeLocked(key>>8, mr)
	d.mu.Unlock()
	mr.sub = s.registry.Insert(0, maxMRSize, notifier{mr})
	mr.reg.Register = time.Since(t0)
	d.stats.mrsODP.Add(1)
	if !d.cfg.NoSnapshot {
		t1 := time.Now()
		for _, b := range bufs {
			mr.snapshot(b.Start, b.End)
		}
		mr.reg.Snapshot = time.Since(t1)
	}
	mr.reg.Total = time.Since(t0)
	return mr, nil
}

// Implicit reports whether the MR covers the whole address space (RegImplicitMR).
func (mr *MR) Implicit() bool { return mr.implicit }

// bufferPages returns the table pages [lo, hi) of the buffer that holds page p, for an
// implicit MR, whose faults must stay inside one buffer; ok is false if no buffer of
// the address space holds p.
func (mr *MR) bufferPages(p int) (lo, hi int, ok bool) {
	s := mr.dev.as
	s.mu.RLock()
	defer s.mu.RUnlock()
	b, ok := s.bufferLocked(uintptr(p)*pagefault.PageSize, 1)
	if !ok {
		return 0, 0, false
	}
	return int(b.Start / pagefault.PageSize), int(b.End / pagefault.PageSize), true
}

// slice returns the MR's bytes [off, off+n): for an implicit MR, the memory at that
// address, which a fault has just found in a buffer of the address space.
func (mr *MR) slice(off, n uint64) []byte {
	if !mr.implicit {
		return mr.mem[off : off+n]
	}
	return bytesAt(off, n) // the address is a buffer's
}
