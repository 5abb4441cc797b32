package odp

import (
	"time"
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
	owner          any              // the device whose Close unmaps it (nil: the space's last device)
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

// noteEvent is the pump hook: it records UNMAP events in the buffers they hit, and
// UNMAP and REMAP events (the range the pages left) in what implicit MRs reached of
// the application's memory: the kernel dropped those registrations, and a fault
// there later registers whatever is mapped then.
func (s *space) noteEvent(m pagefault.Msg) {
	var gone interval.Range
	switch m.Event {
	case pagefault.EventRemove:
		s.zaps.add(interval.Range{Start: uintptr(m.Start), End: uintptr(m.End)}, time.Now())
		return
	case pagefault.EventUnmap:
		gone = interval.Range{Start: uintptr(m.Start), End: uintptr(m.End)}
	case pagefault.EventRemap:
		gone = interval.Range{Start: uintptr(m.From), End: uintptr(m.From + m.Len)}
	default:
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, mr := range s.implicitMRs {
		mr.leftLocked(gone)
	}
	if m.Event != pagefault.EventUnmap {
		return
	}
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
