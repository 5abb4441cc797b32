package odp

// The application's memory, as the verbs surface offers it: Alloc, Free, MapFile,
// FileChanged, and the kernel's own changes (Discard, Evict, Migrate, Invalidate).

import (
	"fmt"
	"os"
	"unsafe"

	"github.com/odpemu/odpemu/internal/interval"
	"github.com/odpemu/odpemu/invalidate"
	"github.com/odpemu/odpemu/pagefault"
	"golang.org/x/sys/unix"
)

// Alloc maps n bytes (rounded up to pages) of anonymous memory in the device's address
// space, the memory whose ODP pages the emulator installs itself and can page out (see
// RegMR for other memory); every device sharing the space can register it. Pages are not touched: their first use faults. With paging
// (Config.Paging or a ResidentBudget) at most MaxPagedBuffers buffers of the space
// are live at once: one more fails with ErrNoMemory, wrapping
// pagefault.ErrRegionTable.
func (d *Device) Alloc(n int) ([]byte, error) {
	if n <= 0 {
		return nil, wrap(ErrInvalidArgument, "alloc %d bytes", n)
	}
	size := (uintptr(n) + pagefault.PageSize - 1) &^ (pagefault.PageSize - 1)
	s := d.as
	s.mu.RLock()
	implicit := len(s.implicitMRs) > 0
	s.mu.RUnlock()
	if implicit {
		// Implicit MRs mark unmapped ranges gone; the new mapping may reuse one. Its
		// events are applied first, so that none marks the new buffer gone later.
		if err := s.pump.Sync(); err != nil {
			return nil, fmt.Errorf("odp: alloc: %w", err)
		}
	}
	p, err := unix.MmapPtr(-1, 0, nil, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_NORESERVE)
	if err != nil {
		return nil, wrap(ErrNoMemory, "mmap %d bytes: %v", size, err)
	}
	mem := unsafe.Slice((*byte)(p), size)
	// userfaultfd installs 4 KiB pages; opting out of THP keeps pinned and ODP
	// buffers alike whatever the system's THP mode (EINVAL: a kernel without THP).
	_ = unix.Madvise(mem, unix.MADV_NOHUGEPAGE)
	implicitMRs, err := d.addBuffer(mem)
	if err != nil {
		_ = unix.MunmapPtr(p, size) // our own fresh mapping
		return nil, err
	}
	for _, mr := range implicitMRs { // the new buffer is theirs, whatever was there before
		mr.remap(addrOf(mem), addrOf(mem)+size)
	}
	return mem[:n:n], nil
}

// addBuffer registers a new mapping with the userfaultfd and the pager and adds it to
// the address space's buffers; it returns the implicit MRs, which cover it.
func (d *Device) addBuffer(mem []byte) ([]remapper, error) {
	d.mu.RLock() // Close sweeps the device's buffers after it set closed
	defer d.mu.RUnlock()
	if d.closed {
		return nil, ErrClosed
	}
	s := d.as
	s.mu.Lock()
	defer s.mu.Unlock()
	b := buffer{Range: interval.Range{Start: addrOf(mem), End: addrOf(mem) + uintptr(len(mem))}, mem: mem, owner: d}
	// Registered for events from the start (write-protect mode, nothing protected:
	// faults are the kernel's as usual), so that what the application unmaps or
	// moves away is known, registered as an MR or not, and Free never unmaps it.
	// Without a userfaultfd (space.noODP) the buffer is memory like any other, and
	// what the application unmaps of it is not known.
	if s.uffd != nil {
		if _, err := s.uffd.Register(b.Start, b.End-b.Start, s.bufferModeLocked()); err != nil {
			return nil, fmt.Errorf("odp: register buffer for events: %w", err)
		}
	}
	if s.pager != nil {
		r, err := s.pager.AddRegion(mem)
		if err != nil {
			return nil, fmt.Errorf("%w: odp: page buffer: %w", ErrNoMemory, err)
		}
		b.paged = r
	}
	s.buffers = insertSorted(s.buffers, b)
	s.syncEvictableLocked()
	return append([]remapper(nil), s.implicitMRs...), nil
}

// Free unmaps a buffer from Alloc or a file mapping from MapFile (of any device sharing the address space). It fails
// with ErrBusy while an explicit memory region of any of them covers it; implicit MRs
// are told first. Parts the application unmapped or moved away itself are left alone:
// whatever is mapped there now is not the buffer's.
func (d *Device) Free(buf []byte) error {
	if len(buf) == 0 {
		return wrap(ErrInvalidArgument, "free of an empty slice")
	}
	if isFile, err := d.as.freeFile(addrOf(buf)); isFile {
		return err
	}
	// Every UNMAP and REMAP the kernel delivered before this call is recorded in the
	// buffer's holes before they are consulted.
	if err := d.as.pump.Sync(); err != nil {
		return fmt.Errorf("odp: free: %w", err)
	}
	s := d.as
	s.mu.Lock()
	start := addrOf(buf)
	i := startingAt(s.buffers, start)
	if i < 0 {
		s.mu.Unlock()
		return wrap(ErrInvalidArgument, "%#x is not a buffer from Alloc", start)
	}
	b := s.buffers[i]
	if s.coveredLocked(b.Range) {
		s.mu.Unlock()
		return wrap(ErrBusy, "buffer %#x is registered as an MR", start)
	}
	s.buffers = append(s.buffers[:i], s.buffers[i+1:]...)
	s.mu.Unlock()
	// Retired without space.mu, as Close does: Region.Remove takes the pager's
	// reclaim lock, and reclaim takes space.mu (evictable) while holding it.
	return s.retire(b, true)
}

// ResidentBytes returns how many bytes of b (memory from Alloc) are resident now,
// counted from the page tables, or why the page tables could not be read.
func (d *Device) ResidentBytes(b []byte) (int64, error) {
	if len(b) == 0 {
		return 0, nil
	}
	start := addrOf(b) &^ (pagefault.PageSize - 1)
	n := int((addrOf(b) + uintptr(len(b)) - start + pagefault.PageSize - 1) / pagefault.PageSize)
	const chunk = 4096
	entries := make([]pagefault.PagemapEntry, min(chunk, n))
	var resident int64
	for first := 0; first < n; first += chunk {
		k := min(chunk, n-first)
		if err := d.as.pagemap.Read(start+uintptr(first)*pagefault.PageSize, entries[:k]); err != nil {
			return 0, fmt.Errorf("odp: resident bytes: %w", err)
		}
		for _, e := range entries[:k] {
			if e.Present() {
				resident += int64(pagefault.PageSize)
			}
		}
	}
	return resident, nil
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

// SyncEvents returns once every userfaultfd event raised before the call (by a
// madvise, munmap or mremap that has returned) has been applied to the NIC's tables.
func (d *Device) SyncEvents() error { return d.as.pump.Sync() }

// Invalidate invalidates the NIC's translations of [addr, addr+length) in every ODP MR
// of the device, waiting for DMA in flight on them: the next access faults afresh.
// With NoInvalidate it does nothing.
func (d *Device) Invalidate(addr, length uint64) error {
	r, err := pageRange(addr, length)
	if err != nil {
		return err
	}
	_, err = d.as.registry.Invalidate(r, invalidate.ReasonExplicit, nil)
	return err
}

// Discard drops the pages of b (madvise MADV_DONTNEED), which must lie in a buffer from
// Alloc, in the kernel's order: the NIC's translations are invalidated and DMA on them
// drained first, faults are held off while the pages are dropped, and the next access
// faults in zero-filled pages. With NoInvalidate the pages are dropped without telling
// the NIC.
func (d *Device) Discard(b []byte) error {
	if len(b) == 0 {
		return wrap(ErrInvalidArgument, "discard of an empty slice")
	}
	r, err := pageRange(uint64(addrOf(b)), uint64(len(b)))
	if err != nil {
		return err
	}
	d.as.mu.RLock()
	_, ok := d.as.bufferLocked(r.Start, r.End-r.Start)
	d.as.mu.RUnlock()
	if !ok {
		return wrap(ErrNotMmapped, "discard %#x+%d", r.Start, len(b))
	}
	zap := func() error {
		if _, _, e := unix.Syscall(unix.SYS_MADVISE, r.Start, r.End-r.Start, unix.MADV_DONTNEED); e != 0 {
			return fmt.Errorf("odp: madvise: %w", e)
		}
		return nil
	}
	if d.as.pager != nil {
		inner := zap
		zap = func() error { // evicted copies are forgotten: a discarded page is zero
			d.as.pager.DiscardedLocked(r.Start, r.End)
			err := inner() // the CPU fault server forgets them again as it reads the event
			d.as.pager.DiscardedLocked(r.Start, r.End)
			return err
		}
	}
	run := func() error {
		_, err := d.as.registry.Invalidate(r, invalidate.ReasonDiscard, zap)
		return err
	}
	if d.as.pager != nil {
		return d.as.pager.Exclusive(run) // no eviction between forgetting and dropping
	}
	return run()
}

// Evict writes the present pages of [addr, addr+length) in ODP memory to the backing
// store and drops them, invalidating the NIC's entries first; the next access faults
// them back with their content. Needs Config.Paging or a ResidentBudget.
func (d *Device) Evict(addr, length uint64) (int, error) {
	if d.as.pager == nil {
		return 0, wrap(ErrNotSupported, "Evict without Config.Paging")
	}
	r, err := pageRange(addr, length)
	if err != nil {
		return 0, err
	}
	return d.as.pager.Evict(r.Start, r.End)
}

// Migrate moves the present pages of [addr, addr+length) in ODP memory to new page
// frames, invalidating the NIC's entries first (compaction, NUMA balancing). Needs
// Config.Paging or a ResidentBudget.
func (d *Device) Migrate(addr, length uint64) (int, error) {
	if d.as.pager == nil {
		return 0, wrap(ErrNotSupported, "Migrate without Config.Paging")
	}
	r, err := pageRange(addr, length)
	if err != nil {
		return 0, err
	}
	return d.as.pager.Migrate(r.Start, r.End)
}

// pageRange rounds [addr, addr+length) out to pages.
func pageRange(addr, length uint64) (invalidate.Range, error) {
	end := addr + length
	if length == 0 || end < addr || end > uint64(^uintptr(0))-uint64(pagefault.PageSize) {
		return invalidate.Range{}, wrap(ErrInvalidArgument, "range %#x+%d", addr, length)
	}
	ps := pagefault.PageSize
	return invalidate.Range{Start: uintptr(addr) &^ (ps - 1), End: (uintptr(end) + ps - 1) &^ (ps - 1)}, nil
}
