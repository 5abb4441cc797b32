package odp

import (
	"sync/atomic"
	"time"

	"github.com/odpemu/odpemu/mmu"
	"github.com/odpemu/odpemu/pagefault"
	"golang.org/x/sys/unix"
)

// registerFileODP registers an ODP MR over a file mapping (mr.file): no userfaultfd,
// faults populate the page cache (see MapFile).
func (mr *MR) registerFileODP(end uintptr, npages int) error {
	d := mr.dev
	t0 := time.Now()
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return ErrClosed
	}
	key, ok := d.keys.alloc()
	if !ok {
		d.mu.Unlock()
		return wrap(ErrNoMemory, "out of memory keys")
	}
	mr.key = key
	mr.table = mmu.New(npages)
	d.as.mu.Lock()
	d.as.fileRegs = append(d.as.fileRegs, mr.span(end))
	d.as.mu.Unlock()
	d.mrs[key>>8] = mr
	d.keyed.storeLocked(key>>8, mr)
	d.mu.Unlock()
	mr.activateODP(end, t0)
	return nil
}

// deregFile ends an ODP MR over a file mapping (its table is cleared already).
func (mr *MR) deregFile(end uintptr) {
	s := mr.dev.as
	s.mu.Lock()
	s.fileRegs = removeRange(s.fileRegs, mr.span(end))
	s.mu.Unlock()
}

// detachedPages is the NIC's copy of the pages of a pinned MR over a file mapping that
// the file let go of (see FileChanged). Pages are detached once and stay so.
type detachedPages struct {
	mem  []byte          // one page per table page, an anonymous mapping of our own
	bits []atomic.Uint64 // which pages are detached
}

func (dt *detachedPages) has(p int) bool { return dt != nil && dt.bits[p/64].Load()&(1<<(p%64)) != 0 }

// detachLocked copies pages [first, first+n) of a pinned file MR, as the file holds
// them now, into the NIC's copy and marks them detached. Called with the MR's table
// lock held. A NIC write racing the change may land in the page cache's page instead
// of the copy: the emulator cannot stop a DMA it does not wait for, and on hardware
// that write would go to the old frame, which no one reads either.
func (mr *MR) detachLocked(first, n int) {
	dt := mr.detached.Load()
	if dt == nil {
		pages := mr.table.Pages()
		mem, err := unix.Mmap(-1, 0, pages*PageSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_NORESERVE)
		if err != nil {
			mr.dev.stats.dmaFaults.Add(1) // nothing to keep the old pages in: the NIC reads the new ones
			return
		}
		dt = &detachedPages{mem: mem, bits: make([]atomic.Uint64, (pages+63)/64)}
		mr.detached.Store(dt)
	}
	for p := first; p < first+n; p++ {
		if dt.has(p) || !mr.table.EntryLocked(p).Valid {
			continue
		}
		page := dt.mem[p*PageSize : (p+1)*PageSize]
		// A page that cannot be read any more (truncated away) is kept as zeros.
		_ = vmCopy(page, mr.base+uintptr(p)*pagefault.PageSize, false)
		dt.bits[p/64].Or(1 << (p % 64))
	}
}

// freeDetached releases a pinned MR's copy of detached pages.
func (mr *MR) freeDetached() {
	if dt := mr.detached.Swap(nil); dt != nil {
		_ = unix.Munmap(dt.mem) // our own mapping
	}
}

// anyDetached reports whether one of table pages [first, first+count) is detached.
func (mr *MR) anyDetached(first, count int) bool {
	dt := mr.detached.Load()
	for p := first; p < first+count; p++ {
		if dt.has(p) {
			return true
		}
	}
	return false
}
