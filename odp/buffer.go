package odp

import (
	"fmt"
	"sort"
	"unsafe"

	"github.com/odpemu/odpemu/internal/interval"
	"github.com/odpemu/odpemu/invalidate"
	"github.com/odpemu/odpemu/pagefault"
	"golang.org/x/sys/unix"
)

type buffer struct {
	start, end uintptr
	mem        []byte
	paged      *invalidate.Region // nil unless paging
	holes      []interval.Range   // parts the application unmapped itself
}

// unmap unmaps the parts of b the device still owns: an address the application
// unmapped may hold someone else's memory now (the Go heap's, say).
func (b *buffer) unmap(u *pagefault.FD) {
	base := unsafe.Pointer(unsafe.SliceData(b.mem))
	for _, r := range interval.Uncovered(interval.Range{Start: b.start, End: b.end}, b.holes) {
		if u != nil {
			// Our own unmapping needs no UNMAP event; a part that is already gone
			// fails harmlessly.
			_ = u.Unregister(r.Start, r.End-r.Start)
		}
		// The parts are ours and mapped: munmap of them cannot fail.
		_ = unix.MunmapPtr(unsafe.Add(base, r.Start-b.start), r.End-r.Start)
	}
}

// noteEvent is the pump hook: it records UNMAP events in the buffers they hit.
func (d *Device) noteEvent(m pagefault.Msg) {
	if m.Event != pagefault.EventUnmap {
		return
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	for i := range d.buffers {
		b := &d.buffers[i]
		if lo, hi := max(b.start, uintptr(m.Start)), min(b.end, uintptr(m.End)); lo < hi {
			b.holes = append(b.holes, interval.Range{Start: lo, End: hi})
		}
	}
}

// PageSize is the size of the pages that the NIC's translation tables map.
var PageSize = int(pagefault.PageSize)

// Alloc maps n bytes (rounded up to pages) of anonymous memory, the only memory ODP
// regions accept. Pages are not touched: their first use faults.
func (d *Device) Alloc(n int) ([]byte, error) {
	if n <= 0 {
		return nil, wrap(ErrInvalidArgument, "alloc %d bytes", n)
	}
	size := (uintptr(n) + pagefault.PageSize - 1) &^ (pagefault.PageSize - 1)
	p, err := unix.MmapPtr(-1, 0, nil, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_NORESERVE)
	if err != nil {
		return nil, wrap(ErrNoMemory, "mmap %d bytes: %v", size, err)
	}
	mem := unsafe.Slice((*byte)(p), size)
	// userfaultfd installs 4 KiB pages; opting out of THP keeps pinned and ODP
	// buffers alike whatever the system's THP mode (EINVAL: a kernel without THP).
	_ = unix.Madvise(mem, unix.MADV_NOHUGEPAGE)
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		_ = unix.MunmapPtr(p, size) // our own fresh mapping
		return nil, ErrClosed
	}
	b := buffer{start: addrOf(mem), end: addrOf(mem) + size, mem: mem}
	// Registered for events from the start (write-protect mode, nothing protected:
	// faults are the kernel's as usual), so that what the application unmaps or
	// moves away is known, registered as an MR or not, and Free never unmaps it.
	if _, err := d.uffd.Register(b.start, size, pagefault.ModeWP); err != nil {
		_ = unix.MunmapPtr(p, size) // our own fresh mapping
		return nil, fmt.Errorf("odp: register buffer for events: %w", err)
	}
	if d.pager != nil {
		r, err := d.pager.AddRegion(mem)
		if err != nil {
			_ = unix.MunmapPtr(p, size) // our own fresh mapping
			return nil, fmt.Errorf("odp: page buffer: %w", err)
		}
		b.paged = r
	}
	i := sort.Search(len(d.buffers), func(i int) bool { return d.buffers[i].start > b.start })
	d.buffers = append(d.buffers, buffer{})
	copy(d.buffers[i+1:], d.buffers[i:])
	d.buffers[i] = b
	return mem[:n:n], nil
}

// Free unmaps a buffer from Alloc. It fails with ErrBusy while a memory region covers
// it. Parts the application unmapped or moved away itself are left alone: whatever is
// mapped there now is not the buffer's.
func (d *Device) Free(buf []byte) error {
	if len(buf) == 0 {
		return wrap(ErrInvalidArgument, "free of an empty slice")
	}
	// Every UNMAP and REMAP the kernel delivered before this call is recorded in the
	// buffer's holes before they are consulted.
	if err := d.pump.Sync(); err != nil {
		return fmt.Errorf("odp: free: %w", err)
	}
	d.mu.Lock()
	start := addrOf(buf)
	i := sort.Search(len(d.buffers), func(i int) bool { return d.buffers[i].start >= start })
	if i == len(d.buffers) || d.buffers[i].start != start {
		d.mu.Unlock()
		return wrap(ErrInvalidArgument, "%#x is not a buffer from Alloc", start)
	}
	b := d.buffers[i]
	for _, mr := range d.mrs {
		if mr.start < b.end && b.start < mr.start+uintptr(mr.length) {
			d.mu.Unlock()
			return wrap(ErrBusy, "buffer %#x is registered as MR %#x", start, mr.key)
		}
	}
	d.buffers = append(d.buffers[:i], d.buffers[i+1:]...)
	d.mu.Unlock()
	// Retired without d.mu, as Close does: Region.Remove takes the pager's reclaim
	// lock, and reclaim takes d.mu (evictable) while holding it.
	var err error
	if b.paged != nil {
		err = b.paged.Remove()
	}
	b.unmap(d.uffd)
	return err
}

// bufferLocked returns the Alloc buffer holding [start, start+n), if any. Called with
// Device.mu held (read or write).
func (d *Device) bufferLocked(start, n uintptr) (buffer, bool) {
	i := sort.Search(len(d.buffers), func(i int) bool { return d.buffers[i].start > start }) - 1
	if i < 0 || start+n > d.buffers[i].end || start+n < start {
		return buffer{}, false
	}
	return d.buffers[i], true
}

func addrOf(b []byte) uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(b))) }

// ResidentBytes returns how many bytes of b (memory from Alloc) are resident now,
// counted from the page tables.
func (d *Device) ResidentBytes(b []byte) int64 {
	if len(b) == 0 {
		return 0
	}
	start := addrOf(b) &^ (pagefault.PageSize - 1)
	n := int((addrOf(b) + uintptr(len(b)) - start + pagefault.PageSize - 1) / pagefault.PageSize)
	const chunk = 4096
	entries := make([]pagefault.PagemapEntry, min(chunk, n))
	var resident int64
	for first := 0; first < n; first += chunk {
		k := min(chunk, n-first)
		if d.pagemap.Read(start+uintptr(first)*pagefault.PageSize, entries[:k]) != nil {
			return -1
		}
		for _, e := range entries[:k] {
			if e.Present() {
				resident += int64(pagefault.PageSize)
			}
		}
	}
	return resident
}
