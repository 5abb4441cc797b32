package odp

// The address space's file mappings (MapFile).

import (
	"fmt"
	"unsafe"

	"github.com/odpemu/odpemu/internal/interval"
	"golang.org/x/sys/unix"
)

// fileMap is a MAP_SHARED mapping of a file made by MapFile.
type fileMap struct {
	p              unsafe.Pointer
	interval.Range        // the mapping's addresses
	dev, ino       uint64 // the file, as stat(2) names it
	off            int64  // the file offset mapped at start
	owner          any    // as buffer.owner
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
