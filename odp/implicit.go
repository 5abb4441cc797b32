package odp

import (
	"fmt"
	"math/bits"
	"slices"
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
	if err := access.check(); err != nil {
		return nil, err
	}
	d := pd.dev
	if err := d.onDemand(access); err != nil {
		return nil, err
	}
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
	mr.reg.Firmware = firmware(d.cfg.RegModel.Reg)
	mr.reg.Total = time.Since(t0)
	return mr, nil
}

// Implicit reports whether the MR covers the whole address space (RegImplicitMR).
func (mr *MR) Implicit() bool { return mr.implicit }

// newChildren creates the implicit MR's children that table pages [first, end) lie
// in and that no fault created before, and returns how many it created: a child is
// Config.ImplicitChild bytes of the address space, aligned, which mlx5 creates as
// an MR of its own (a memory key, at the firmware's cost) on the first fault in it.
// Concurrent faults create each child once.
func (mr *MR) newChildren(first, end int) int {
	shift := uint(bits.TrailingZeros64(uint64(mr.dev.cfg.ImplicitChild)))
	lo := (uint64(mr.base) + uint64(first)*uint64(PageSize)) >> shift
	hi := (uint64(mr.base) + uint64(end)*uint64(PageSize) - 1) >> shift
	n := 0
	for c := lo; c <= hi; c++ {
		if _, had := mr.children.LoadOrStore(c, struct{}{}); !had {
			n++
		}
	}
	mr.stats.children.Add(uint64(n))
	return n
}

// pagesAround returns, for an implicit MR, whose faults must stay inside one buffer
// or outside every buffer, the table pages [lo, hi) around page p that are of one
// kind: the buffer that holds p (inBuffer), or the gap between buffers where p lies,
// the application's own memory or no memory at all.
func (mr *MR) pagesAround(p int) (lo, hi int, inBuffer bool) {
	s := mr.dev.as
	ps := pagefault.PageSize
	s.mu.RLock()
	defer s.mu.RUnlock()
	if b, ok := s.bufferLocked(uintptr(p)*ps, 1); ok {
		return int(b.Start / ps), int(b.End / ps), true
	}
	lo, hi = 0, mr.table.Pages()
	for _, b := range s.buffers { // sorted by start
		if bs := int(b.Start / ps); bs > p {
			hi = bs
			break
		}
		lo = int(b.End / ps)
	}
	return lo, hi, false
}

// reach registers the application's own memory at table pages [lo, hi), which the
// request that faults touches, with the userfaultfd for events only, as an explicit
// ODP MR over it is (registerRangeLocked), so that what the application unmaps,
// moves or discards there invalidates the MR's entries from then on. Nothing around
// it is registered (no fault-around): the pages next to it are whatever else the
// process maps. It fails with ErrBadAddress where [lo, hi) is not such memory
// (unmapped, a file mapping).
func (mr *MR) reach(lo, hi int) error {
	s := mr.dev.as
	ps := pagefault.PageSize
	s.regMu.Lock()
	defer s.regMu.Unlock()
	s.mu.Lock()
	defer s.mu.Unlock()
	if !slices.Contains(s.implicitMRs, remapper(mr)) {
		return errDeregistered
	}
	r := interval.Range{Start: uintptr(lo) * ps, End: uintptr(hi) * ps}
	for _, u := range interval.Uncovered(r, mr.reached) {
		w, err := s.registerEventsLocked(u)
		if err != nil {
			return wrap(ErrBadAddress, "MR %#x: %#x+%d is not memory of this process that implicit ODP reaches: %v",
				mr.key, u.Start, u.End-u.Start, err)
		}
		mr.reached = interval.Merge(append(mr.reached, w))
	}
	return nil
}

// leftLocked is told that the application unmapped or moved away r: the kernel
// dropped the registrations there, and a fault registers whatever is mapped there
// later. Called with space.mu held.
func (mr *MR) leftLocked(r interval.Range) {
	if len(mr.reached) > 0 {
		mr.reached = interval.Subtract(mr.reached, r)
	}
}

// unreachLocked ends the MR's registrations of the application's memory: the parts
// no other MR needs leave the userfaultfd. Called with space.mu held, the MR already
// out of the space's implicit MRs.
func (mr *MR) unreachLocked() {
	s := mr.dev.as
	cover := s.foreignCoverLocked()
	for _, r := range mr.reached {
		for _, u := range interval.Uncovered(r, cover) {
			_ = s.uffd.Unregister(u.Start, u.End-u.Start) // a part the application unmapped is not there to change
		}
	}
	mr.reached = nil
}

// slice returns the MR's bytes [off, off+n): for an implicit MR, the memory at that
// address, which a fault has just found in a buffer of the address space.
func (mr *MR) slice(off, n uint64) []byte {
	if !mr.implicit {
		return mr.mem[off : off+n]
	}
	return bytesAt(off, n) // the address is a buffer's
}
