package paging

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// Store is the backing store evicted pages are written to: a memfd by default (in
// memory, but outside the process's mappings, so not part of its RSS), or a file.
// Offsets are page aligned; a restored page's copy is punched out.
type Store struct {
	f *os.File
}

// NewMemStore returns a store in an anonymous memfd.
func NewMemStore() (*Store, error) {
	fd, err := unix.MemfdCreate("odpemu-store", unix.MFD_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("paging: memfd_create: %w", err)
	}
	return &Store{f: os.NewFile(uintptr(fd), "odpemu-store")}, nil
}

// NewFileStore returns a store in a new file at path, removed when closed.
func NewFileStore(path string) (*Store, error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return nil, fmt.Errorf("paging: file store: %w", err)
	}
	if err := os.Remove(path); err != nil { // the descriptor keeps it alive
		_ = f.Close()
		return nil, fmt.Errorf("paging: file store: unlink %s: %w", path, err)
	}
	return &Store{f: f}, nil
}

// Fd is the store's descriptor (for the CPU fault server, which writes evicted pages
// to it, the pager's as well as its own, under its store lock).
func (s *Store) Fd() int { return int(s.f.Fd()) }

// ReadAt reads len(b) bytes at off; holes read as zeros.
func (s *Store) ReadAt(b []byte, off int64) error {
	n, err := s.f.ReadAt(b, off)
	if n == len(b) {
		return nil
	}
	if err != nil && n < len(b) {
		clear(b[n:]) // past the end of a sparse store
		return nil
	}
	return err
}

// Punch frees [off, off+n). A failure only leaves the space allocated: the page's
// next eviction overwrites it, and removing the region punches it again.
func (s *Store) Punch(off, n int64) {
	_ = unix.Fallocate(int(s.f.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, off, n)
}

// Allocated returns the bytes the store occupies (its allocated blocks).
func (s *Store) Allocated() (int64, error) {
	var st unix.Stat_t
	if err := unix.Fstat(int(s.f.Fd()), &st); err != nil {
		return 0, fmt.Errorf("paging: stat store: %w", err)
	}
	return st.Blocks * 512, nil
}

// Close closes the store.
func (s *Store) Close() error { return s.f.Close() }
