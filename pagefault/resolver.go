package pagefault

import (
	"errors"
	"fmt"
	"runtime"
	"sync"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Source supplies the content of pages the resolver installs. Implementations must be
// safe for concurrent use.
type Source interface {
	// Fill writes the content of the len(dst)/PageSize pages starting at addr into dst,
	// or reports zero=true (dst untouched) when they are all zero.
	Fill(addr uintptr, dst []byte) (zero bool, err error)
}

// ZeroSource fills every page with zeros: anonymous memory's first touch.
type ZeroSource struct{}

// Fill implements Source.
func (ZeroSource) Fill(uintptr, []byte) (bool, error) { return true, nil }

// ErrBusy is returned when a range stays busy (events pending) past the retry deadline.
var ErrBusy = errors.New("pagefault: range busy past retry deadline")

// retryDeadline bounds EAGAIN retries, as mlx5 bounds hmm_range_fault's EBUSY.
const retryDeadline = time.Second

// batchPages bounds one UFFDIO_COPY; it is also the size of the zero source mapping.
const batchPages = 256

var scratchPool = sync.Pool{New: func() any { b := make([]byte, batchPages*PageSize); return &b }}

// Resolver makes page ranges of a userfaultfd-registered region present with ioctls,
// the way the NIC's page-fault handler calls hmm_range_fault: it walks the CPU page
// table (pagemap), installs only missing pages, and reads back the frames. It never
// touches the memory, so it never takes a CPU fault. Safe for concurrent use.
type Resolver struct {
	uffd *FD
	pm   *Pagemap
	src  Source
	zero []byte // read-only anonymous mapping of batchPages pages: reads as zeros
}

// ResolveStats reports what one Resolve did.
type ResolveStats struct {
	Installed int // pages that were missing and are now present
	Raced     int // pages found present by the ioctl (installed concurrently)
	Retries   int // EAGAIN retries
	COWBroken int // present, shared pages faulted for write
}

// NewResolver returns a resolver for ranges registered on u.
func NewResolver(u *FD, pm *Pagemap, src Source) (*Resolver, error) {
	if src == nil {
		src = ZeroSource{}
	}
	z, err := unix.Mmap(-1, 0, int(batchPages*PageSize), unix.PROT_READ, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return nil, fmt.Errorf("pagefault: map zero source: %w", err)
	}
	return &Resolver{uffd: u, pm: pm, src: src, zero: z}, nil
}

// Close releases the resolver's mappings.
func (r *Resolver) Close() error { return unix.Munmap(r.zero) }

// Resolve makes the len(out) pages at start (page aligned) present and stores their
// pagemap entries, read after installation, in out. With write, pages that are present
// but not exclusively mapped (the shared zero page, COW-shared pages) are also faulted
// for write (MADV_POPULATE_WRITE), so the frames recorded are the ones a write lands in.
func (r *Resolver) Resolve(start uintptr, out []PagemapEntry, write bool) (ResolveStats, error) {
	var st ResolveStats
	if start%PageSize != 0 {
		return st, fmt.Errorf("pagefault: resolve %#x: %w", start, unix.EINVAL)
	}
	if err := r.pm.Read(start, out); err != nil {
		return st, err
	}
	n := len(out)
	for i := 0; i < n; {
		if out[i].Present() {
			i++
			continue
		}
		j := i
		for j < n && !out[j].Present() && j-i < batchPages {
			j++
		}
		if err := r.install(start+uintptr(i)*PageSize, j-i, &st); err != nil {
			return st, err
		}
		i = j
	}
	if st.Installed+st.Raced > 0 {
		if err := r.pm.Read(start, out); err != nil {
			return st, err
		}
	}
	err := r.breakCOW(start, out, write, &st)
	return st, err
}

// Translate reads the pagemap entries of the len(out) pages at start into out and,
// with write, faults present but shared pages for write, as Resolve does; it installs
// nothing. Missing pages stay missing (for memory that another installer owns).
func (r *Resolver) Translate(start uintptr, out []PagemapEntry, write bool) error {
	if err := r.pm.Read(start, out); err != nil {
		return err
	}
	var st ResolveStats
	return r.breakCOW(start, out, write, &st)
}

func (r *Resolver) breakCOW(start uintptr, out []PagemapEntry, write bool, st *ResolveStats) error {
	n := len(out)
	if write {
		broke := false
		for i := 0; i < n; i++ {
			if !out[i].Present() || out[i].Exclusive() {
				continue
			}
			j := i
			for j < n && out[j].Present() && !out[j].Exclusive() {
				j++
			}
			a := start + uintptr(i)*PageSize
			if err := PopulateRange(a, uintptr(j-i)*PageSize, true); err != nil {
				return err
			}
			st.COWBroken += j - i
			broke = true
			i = j
		}
		if broke {
			return r.pm.Read(start, out)
		}
	}
	return nil
}

// install makes npages missing pages at dst present, retrying from the kernel's
// reported progress on EAGAIN and stepping over pages that appeared concurrently.
func (r *Resolver) install(dst uintptr, npages int, st *ResolveStats) error {
	length := uintptr(npages) * PageSize
	bp := scratchPool.Get().(*[]byte)
	defer scratchPool.Put(bp)
	src := (*bp)[:length]
	zero, err := r.src.Fill(dst, src)
	if err != nil {
		return fmt.Errorf("pagefault: page source at %#x: %w", dst, err)
	}
	if zero {
		src = r.zero[:length]
	}
	var deadline time.Time
	for off := uintptr(0); off < length; {
		n, err := r.uffd.Copy(dst+off, uintptr(unsafe.Pointer(&src[off])), length-off, false)
		off += n
		st.Installed += int(n / PageSize)
		switch {
		case err == nil:
		case errors.Is(err, ErrExist):
			off += PageSize // this page is present now; carry on after it
			st.Raced++
		case errors.Is(err, ErrAgain):
			st.Retries++
			if deadline.IsZero() {
				deadline = time.Now().Add(retryDeadline)
			} else if time.Now().After(deadline) {
				return fmt.Errorf("pagefault: install %#x: %w", dst+off, ErrBusy)
			}
			runtime.Gosched() // the event reader must run before the range is free
		default:
			return err
		}
	}
	return nil
}
