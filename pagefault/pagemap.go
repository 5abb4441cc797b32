package pagefault

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Pagemap entry bits (Documentation/admin-guide/mm/pagemap.rst).
const (
	pmPFNMask   = 1<<55 - 1
	pmExclusive = 1 << 56
	pmFile      = 1 << 61
	pmSwap      = 1 << 62
	pmPresent   = 1 << 63
)

// PagemapEntry is one 64-bit /proc/self/pagemap entry.
type PagemapEntry uint64

// Present reports whether the page is in RAM.
func (e PagemapEntry) Present() bool { return e&pmPresent != 0 }

// Exclusive reports whether the page is mapped exactly once (not the shared zero page,
// not shared with a fork child).
func (e PagemapEntry) Exclusive() bool { return e&pmExclusive != 0 }

// PFN is the page frame number, or 0 when not present or when the process may not read
// frame numbers (they need CAP_SYS_ADMIN).
func (e PagemapEntry) PFN() uint64 {
	if !e.Present() {
		return 0
	}
	return uint64(e) & pmPFNMask
}

// Pagemap reads /proc/self/pagemap. It is safe for concurrent use.
type Pagemap struct {
	f      *os.File
	pfnsOK bool
	pool   sync.Pool // *[]byte read buffers
}

// OpenPagemap opens /proc/self/pagemap and finds out whether PFNs are readable.
func OpenPagemap() (*Pagemap, error) {
	f, err := os.Open("/proc/self/pagemap")
	if err != nil {
		return nil, fmt.Errorf("pagefault: %w", err)
	}
	p := &Pagemap{f: f}
	var probe [1]uint64 // a live, touched Go variable: its page is present
	probe[0] = 1
	var e [1]PagemapEntry
	if err := p.Read(uintptr(unsafe.Pointer(&probe[0])), e[:]); err == nil {
		p.pfnsOK = e[0].PFN() != 0
	}
	return p, nil
}

// PFNsReadable reports whether entries carry real frame numbers.
func (p *Pagemap) PFNsReadable() bool { return p.pfnsOK }

// Read fills out with the entries of len(out) pages starting at the page holding addr.
func (p *Pagemap) Read(addr uintptr, out []PagemapEntry) error {
	n := len(out) * 8
	bp, _ := p.pool.Get().(*[]byte)
	if bp == nil || cap(*bp) < n {
		b := make([]byte, n)
		bp = &b
	}
	buf := (*bp)[:n]
	defer p.pool.Put(bp)
	off := int64(addr/PageSize) * 8
	for done := 0; done < n; {
		m, err := p.f.ReadAt(buf[done:], off+int64(done))
		done += m
		if err != nil && done < n {
			return fmt.Errorf("pagefault: read pagemap at %#x: %w", addr, err)
		}
	}
	for i := range out {
		out[i] = PagemapEntry(binary.NativeEndian.Uint64(buf[i*8:]))
	}
	return nil
}

// Close closes the file.
func (p *Pagemap) Close() error { return p.f.Close() }

// ScanPresent fills out with the runs of present pages in [start, end) (page
// aligned), using PAGEMAP_SCAN, which walks page tables and skips absent ranges
// without reading an entry per page. It returns how many runs it stored and where the
// walk stopped: when out fills up before end, call again from there. Without
// PAGEMAP_SCAN (before Linux 6.7) it returns an error wrapping ErrNotSupported.
func (p *Pagemap) ScanPresent(start, end uintptr, out []PageRegion) (int, uintptr, error) {
	if len(out) == 0 || start >= end {
		return 0, start, nil
	}
	a := pmScanArg{Size: uint64(unsafe.Sizeof(pmScanArg{})), Start: uint64(start), End: uint64(end),
		Vec: uint64(uintptr(unsafe.Pointer(&out[0]))), VecLen: uint64(len(out)),
		CategoryMask: PageIsPresent, ReturnMask: PageIsPresent}
	r, _, e := unix.Syscall(unix.SYS_IOCTL, p.f.Fd(), ioctlPagemapScan, uintptr(unsafe.Pointer(&a)))
	if e != 0 {
		if e == unix.ENOTTY || e == unix.EINVAL {
			return 0, start, ReqPagemapScan.Missing()
		}
		return 0, start, fmt.Errorf("pagefault: PAGEMAP_SCAN %#x-%#x: %w", start, end, e)
	}
	return int(r), uintptr(a.WalkEnd), nil
}

// pagemapScanWorks reports whether PAGEMAP_SCAN finds the present page of b (whose
// second page the caller populated).
func pagemapScanWorks(b []byte) bool {
	pm, err := OpenPagemap()
	if err != nil {
		return false
	}
	defer func() { _ = pm.Close() }() // a read-only file
	var out [4]PageRegion
	n, _, err := pm.ScanPresent(addrOf(b), addrOf(b)+uintptr(len(b)), out[:])
	return err == nil && n >= 1
}

// ReadPresent calls fn with the pagemap entries of pages in [start, end) (page
// aligned) in chunks of at most maxChunk pages: every present page of the range is in
// some chunk, and the chunks skip runs of absent pages when PAGEMAP_SCAN can find them
// (Linux 6.7), so that reading a large, mostly untouched range costs what its present
// pages cost (the buffer too is sized by them). Without PAGEMAP_SCAN the chunks cover
// the whole range. A chunk may still hold absent pages (a page can be dropped between
// the scan and the read): fn checks Present. fn must not keep entries. It stops at the
// first error, fn's or its own.
func (p *Pagemap) ReadPresent(start, end uintptr, maxChunk int, fn func(addr uintptr, entries []PagemapEntry) error) error {
	var buf []PagemapEntry
	read := func(lo, hi uintptr) error {
		for at := lo; at < hi; {
			n := min(maxChunk, int((hi-at)/PageSize))
			if len(buf) < n {
				buf = make([]PagemapEntry, n)
			}
			if err := p.Read(at, buf[:n]); err != nil {
				return err
			}
			if err := fn(at, buf[:n]); err != nil {
				return err
			}
			at += uintptr(n) * PageSize
		}
		return nil
	}
	err := p.PresentRuns(start, end, read)
	if errors.Is(err, ErrNotSupported) {
		return read(start, end)
	}
	return err
}

// PresentRuns calls fn for every run [lo, hi) of present pages in [start, end),
// found with PAGEMAP_SCAN (several calls when the runs do not fit one), and stops at
// fn's first error. Without PAGEMAP_SCAN it returns an error wrapping
// ErrNotSupported before calling fn.
func (p *Pagemap) PresentRuns(start, end uintptr, fn func(lo, hi uintptr) error) error {
	var runs [64]PageRegion
	for at := start; at < end; {
		k, next, err := p.ScanPresent(at, end, runs[:])
		if err != nil {
			return err
		}
		for _, r := range runs[:k] {
			if err := fn(uintptr(r.Start), uintptr(r.End)); err != nil {
				return err
			}
		}
		if next <= at {
			break
		}
		at = next
	}
	return nil
}

// Populate makes the len(out) pages at start (page aligned) present, for write if
// write, and reads their entries into out: hmm_range_fault for memory that no
// userfaultfd serves, such as a shared mapping of a file. The pages are faulted in
// by madvise(MADV_POPULATE_READ/WRITE), a system call: the calling goroutine's P is
// handed on while the kernel waits for the page (a FUSE read served by this very
// process, say), where touching the page would hold it. Errors: EFAULT for a page
// the mapping cannot provide (beyond the end of the file, an I/O error, a write to
// a read-only mapping), ENOMEM for an address not mapped.
func (p *Pagemap) Populate(start uintptr, out []PagemapEntry, write bool) error {
	if err := PopulateRange(start, uintptr(len(out))*PageSize, write); err != nil {
		return err
	}
	return p.Read(start, out)
}

// PopulateRange faults the pages of [start, start+length) in, for write if write,
// with madvise(MADV_POPULATE_READ/WRITE), as pin_user_pages and hmm_range_fault
// do. The error wraps the errno (errors.Is with unix.ENOMEM, unix.EFAULT...).
func PopulateRange(start, length uintptr, write bool) error {
	advice, name := uintptr(unix.MADV_POPULATE_READ), "read"
	if write {
		advice, name = unix.MADV_POPULATE_WRITE, "write"
	}
	for {
		_, _, e := unix.Syscall(unix.SYS_MADVISE, start, length, advice)
		if e == unix.EINTR {
			continue
		}
		if e != 0 {
			return fmt.Errorf("pagefault: populate [%#x, +%d) for %s: %w", start, length, name, e)
		}
		return nil
	}
}
