package odp

import (
	"fmt"
	"os"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/odpemu/odpemu/internal/interval"
	"github.com/odpemu/odpemu/invalidate"
	"github.com/odpemu/odpemu/mmu"
	"github.com/odpemu/odpemu/pagefault"
	"golang.org/x/sys/unix"
)

// fileMap is a MAP_SHARED mapping of a file made by MapFile.
type fileMap struct {
	p              unsafe.Pointer
	interval.Range        // the mapping's addresses
	dev, ino       uint64 // the file, as stat(2) names it
	off            int64  // the file offset mapped at start
	owner          *Device
}

// MapFile maps length bytes of f from offset off (a multiple of the page size) with
// MAP_SHARED, writable if writable (f must then be open for writing), as an
// application mmaps a file before it registers it. The mapping can be registered
// pinned or on demand on any device of the address space. An ODP MR over it pins
// nothing: the NIC's faults make the file's pages present through the page cache
// (madvise(MADV_POPULATE_READ/WRITE): for a file of a FUSE filesystem, a FUSE read)
// and record their frames; NIC writes dirty the page cache and reach the file on
// msync or writeback. A pinned MR reads the whole range in at registration.
//
// The kernel tells a NIC that a file's pages changed through the MMU notifiers of
// the page cache invalidation; here a filesystem tells the device: see FileChanged
// (fusefs.FS.Watch takes the device). The emulated NIC reaches file pages only
// through system calls (MADV_POPULATE, process_vm_readv/writev), never by touching
// them, so it never holds a P while a FUSE server of this process fills a page.
// Unmap with Free; a mapping the application unmaps itself is not noticed, and
// DMAs on it then fail with access errors.
func (d *Device) MapFile(f *os.File, off int64, length int, writable bool) ([]byte, error) {
	ps := int64(pagefault.PageSize)
	if length <= 0 || off < 0 || off%ps != 0 {
		return nil, wrap(ErrInvalidArgument, "map %d bytes of %s at %d (offsets are page aligned)", length, f.Name(), off)
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return nil, wrap(ErrInvalidArgument, "stat %s: %v", f.Name(), err)
	}
	prot := unix.PROT_READ
	if writable {
		prot |= unix.PROT_WRITE
	}
	size := (uintptr(length) + pagefault.PageSize - 1) &^ (pagefault.PageSize - 1)
	p, err := unix.MmapPtr(int(f.Fd()), off, nil, size, prot, unix.MAP_SHARED)
	if err != nil {
		return nil, wrap(ErrBadAddress, "mmap %s: %v", f.Name(), err)
	}
	fm := fileMap{p: p, Range: interval.Range{Start: uintptr(p), End: uintptr(p) + size}, dev: st.Dev, ino: st.Ino, off: off, owner: d}
	d.mu.RLock()
	defer d.mu.RUnlock()
	if d.closed {
		_ = unix.MunmapPtr(p, size) // our own fresh mapping
		return nil, ErrClosed
	}
	s := d.as
	s.mu.Lock()
	s.files = insertSorted(s.files, fm)
	s.mu.Unlock()
	return unsafe.Slice((*byte)(p), length), nil
}

// fileMapLocked returns the file mapping holding [start, start+n), if any. Called
// with space.mu held (read or write).
func (s *space) fileMapLocked(start, n uintptr) (fileMap, bool) { return holding(s.files, start, n) }

// freeFile unmaps the file mapping at start, unless an MR covers it; ok is false if
// there is none.
func (s *space) freeFile(start uintptr) (ok bool, err error) {
	s.mu.Lock()
	i := startingAt(s.files, start)
	if i < 0 {
		s.mu.Unlock()
		return false, nil
	}
	fm := s.files[i]
	if s.coveredLocked(fm.Range) {
		s.mu.Unlock()
		return true, wrap(ErrBusy, "file mapping %#x is registered as an MR", start)
	}
	s.files = append(s.files[:i], s.files[i+1:]...)
	s.mu.Unlock()
	return true, fm.unmap()
}

func (fm fileMap) unmap() error {
	if err := unix.MunmapPtr(fm.p, fm.End-fm.Start); err != nil {
		return fmt.Errorf("odp: munmap file mapping: %w", err)
	}
	return nil
}

// FileChanged is the page cache's MMU notifier for the device's address space
// (fusefs.Watcher): bytes [off, off+n) of the file (dev, ino) are about to change.
// ODP MRs over mappings of that range invalidate their translations and wait for
// DMA in flight; change runs (the filesystem changes the file and drops its cached
// pages); then faults may map the pages again, and read the new content. Pinned MRs
// keep their translations, as a pinned page stays the NIC's after the page cache
// lets it go: the emulator keeps the old content of their pages as the NIC's copy
// (it cannot address frames), DMAs go on reading and writing it, and the audit
// counts every DMA through such a page as stale.
func (d *Device) FileChanged(dev, ino uint64, off, n int64, change func() error) error {
	var rs []invalidate.Range
	end := off + n
	if end < off {
		end = 1<<63 - 1
	}
	s := d.as
	s.mu.RLock()
	for _, fm := range s.files {
		if fm.dev != dev || fm.ino != ino {
			continue
		}
		mapEnd := fm.off + int64(fm.End-fm.Start)
		lo, hi := max(off, fm.off), min(end, mapEnd)
		if lo >= hi {
			continue
		}
		ps := int64(pagefault.PageSize)
		lo, hi = lo&^(ps-1), (hi+ps-1)&^(ps-1)
		rs = append(rs, invalidate.Range{Start: fm.Start + uintptr(lo-fm.off), End: fm.Start + uintptr(hi-fm.off)})
	}
	s.mu.RUnlock()
	if len(rs) == 0 {
		return change()
	}
	_, err := s.registry.InvalidateAll(rs, invalidate.ReasonFileChange, change)
	return err
}

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

// fileCopy is the DMA copy of an MR over a file mapping, between MR bytes
// [off, off+len(buf)) and buf: through process_vm_readv/writev, page run by page
// run, from the NIC's copy for detached pages.
func (mr *MR) fileCopy(off uint64, buf []byte, toMR bool) error {
	dt := mr.detached.Load()
	for pos := 0; pos < len(buf); {
		a := mr.start + uintptr(off) + uintptr(pos)
		p := int((a - mr.base) / pagefault.PageSize)
		det := dt.has(p)
		k := min(len(buf)-pos, int(mr.base+uintptr(p+1)*pagefault.PageSize-a))
		for q := p + 1; pos+k < len(buf) && dt.has(q) == det; q++ { // a run of pages alike
			k = min(len(buf)-pos, k+PageSize)
		}
		if det {
			in := dt.mem[a-mr.base:]
			if toMR {
				copy(in, buf[pos:pos+k])
			} else {
				copy(buf[pos:pos+k], in)
			}
		} else if err := vmCopy(buf[pos:pos+k], a, toMR); err != nil {
			mr.dev.stats.dmaFaults.Add(1)
			return err
		}
		pos += k
	}
	return nil
}

// vmCopy copies between local and the len(local) bytes at addr of this process,
// into addr if write, with process_vm_readv/writev: a fault on the way is the
// kernel's to take inside the system call, and an address it cannot provide fails
// with errDMAFault.
func vmCopy(local []byte, addr uintptr, write bool) error {
	pid := os.Getpid()
	for len(local) > 0 {
		liov := []unix.Iovec{{Base: &local[0]}}
		liov[0].SetLen(len(local))
		riov := []unix.RemoteIovec{{Base: addr, Len: len(local)}}
		var n int
		var err error
		if write {
			n, err = unix.ProcessVMWritev(pid, liov, riov, 0)
		} else {
			n, err = unix.ProcessVMReadv(pid, liov, riov, 0)
		}
		if err == unix.EINTR {
			continue
		}
		if err != nil || n == 0 {
			return fmt.Errorf("%w at %#x: %v", errDMAFault, addr, err)
		}
		local, addr = local[n:], addr+uintptr(n)
	}
	return nil
}
