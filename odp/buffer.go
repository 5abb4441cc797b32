package odp

import (
	"fmt"
	"unsafe"

	"github.com/odpemu/odpemu/internal/interval"
	"github.com/odpemu/odpemu/invalidate"
	"github.com/odpemu/odpemu/pagefault"
	"github.com/odpemu/odpemu/paging"
	"golang.org/x/sys/unix"
)

type buffer struct {
	interval.Range // the buffer's addresses
	mem            []byte
	paged          *paging.Region   // nil unless paging
	holes          []interval.Range // parts the application unmapped itself
	owner          *Device          // whose Close unmaps it (nil: the space's last device)
}

// unmap unmaps the parts of b the device still owns: an address the application
// unmapped may hold someone else's memory now (the Go heap's, say).
func (b *buffer) unmap(u *pagefault.FD) {
	base := unsafe.Pointer(unsafe.SliceData(b.mem))
	for _, r := range interval.Uncovered(b.Range, b.holes) {
		if u != nil {
			// Our own unmapping needs no UNMAP event; a part that is already gone
			// fails harmlessly.
			_ = u.Unregister(r.Start, r.End-r.Start)
		}
		// The parts are ours and mapped: munmap of them cannot fail.
		_ = unix.MunmapPtr(unsafe.Add(base, r.Start-b.Start), r.End-r.Start)
	}
}

// noteEvent is the pump hook: it records UNMAP events in the buffers they hit.
func (s *space) noteEvent(m pagefault.Msg) {
	if m.Event != pagefault.EventUnmap {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for i := range s.buffers {
		b := &s.buffers[i]
		if h := b.Intersect(interval.Range{Start: uintptr(m.Start), End: uintptr(m.End)}); !h.Empty() {
			b.holes = append(b.holes, h)
		}
	}
}

// MaxPagedBuffers is how many buffers from Alloc an address space with paging holds
// at once: the CPU fault server's table of paged regions.
const MaxPagedBuffers = pagefault.MaxPagedRegions

// PageSize is the size of the pages that the NIC's translation tables map.
var PageSize = int(pagefault.PageSize)

// Alloc maps n bytes (rounded up to pages) of anonymous memory in the device's address
// space, the only memory ODP regions accept; every device sharing the space can
// register it. Pages are not touched: their first use faults. With paging
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
func (d *Device) addBuffer(mem []byte) ([]*MR, error) {
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
	if _, err := s.uffd.Register(b.Start, b.End-b.Start, s.bufferModeLocked()); err != nil {
		return nil, fmt.Errorf("odp: register buffer for events: %w", err)
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
	return append([]*MR(nil), s.implicitMRs...), nil
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

// retire unmaps a buffer that was removed from the space's list: implicit MRs, which
// cover it, are told first (an unmap odpemu makes itself raises no event), then its
// pages leave the pager and its parts still mapped are unmapped, unregistered first
// if the userfaultfd lives on. Called holding no lock.
func (s *space) retire(b buffer, uffdOpen bool) error {
	if _, err := s.registry.Invalidate(b.Range, invalidate.ReasonUnmap, nil); err != nil {
		return err
	}
	var err error
	if b.paged != nil {
		err = b.paged.Remove()
	}
	if uffdOpen {
		b.unmap(s.uffd)
	} else {
		b.unmap(nil) // the userfaultfd is closed: its registrations went with it
	}
	return err
}

// bufferLocked returns the Alloc buffer holding [start, start+n), if any. Called with
// space.mu held (read or write).
func (s *space) bufferLocked(start, n uintptr) (buffer, bool) { return holding(s.buffers, start, n) }

// bufferModeLocked is how a new buffer is registered with the userfaultfd: for events
// only (write-protect mode, with nothing write-protected), or, while an implicit ODP
// MR covers every buffer, for faults too. Called with space.mu held.
func (s *space) bufferModeLocked() pagefault.RegisterMode {
	if len(s.implicitMRs) > 0 {
		return pagefault.ModeMissing | pagefault.ModeWP
	}
	return pagefault.ModeWP
}

func addrOf(b []byte) uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(b))) }

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
