package fusefs

import (
	"encoding/binary"
	"fmt"
	"io"
	"os"
	"sync"
)

// Object is the content behind a file: what local or remote storage holds. Reads
// past Size return io.EOF (with the bytes before it), as io.ReaderAt says.
// Implementations must be safe for concurrent use.
type Object interface {
	io.ReaderAt
	io.WriterAt
	Size() int64
	Truncate(size int64) error
}

// LocalFile is an Object stored in a local file.
type LocalFile struct{ f *os.File }

// OpenLocal opens (or creates, with size bytes of zeros if it does not exist) the
// local file at path as an Object.
func OpenLocal(path string, size int64) (*LocalFile, error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return nil, fmt.Errorf("fusefs: %w", err)
	}
	if st, err := f.Stat(); err == nil && st.Size() == 0 && size > 0 {
		err = f.Truncate(size)
		if err != nil {
			_ = f.Close() // the error that matters is the truncation's
			return nil, fmt.Errorf("fusefs: %w", err)
		}
	}
	return &LocalFile{f: f}, nil
}

func (l *LocalFile) ReadAt(p []byte, off int64) (int, error)  { return l.f.ReadAt(p, off) }
func (l *LocalFile) WriteAt(p []byte, off int64) (int, error) { return l.f.WriteAt(p, off) }
func (l *LocalFile) Truncate(size int64) error                { return l.f.Truncate(size) }

// Size returns the file's size (0 if it cannot be read).
func (l *LocalFile) Size() int64 {
	st, err := l.f.Stat()
	if err != nil {
		return 0
	}
	return st.Size()
}

// Close closes the local file.
func (l *LocalFile) Close() error { return l.f.Close() }

// Synthetic is an Object of a given size whose content is a function of a seed and
// the offset, generated as it is read: experiments get files of any size without
// storage. Writes are kept (page by page) over the generated content; bytes beyond
// a truncation and re-growth read as zeros, as in a file.
type Synthetic struct {
	seed uint64

	mu      sync.RWMutex // protects the fields below
	size    int64
	genEnd  int64 // content below is generated (unless written), above it zero
	written map[int64]*[syntheticPage]byte
}

const syntheticPage = 4096

// NewSynthetic returns a synthetic object of size bytes.
func NewSynthetic(size int64, seed uint64) *Synthetic {
	return &Synthetic{seed: seed, size: size, genEnd: size, written: map[int64]*[syntheticPage]byte{}}
}

// Word is the generated content of the 8-byte word at byte offset 8*i of a
// synthetic object with seed: splitmix64 of the seed and the index, little endian.
func Word(seed uint64, i int64) uint64 {
	z := seed + uint64(i)*0x9e3779b97f4a7c15
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}

// Size implements Object.
func (s *Synthetic) Size() int64 {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.size
}

// ReadAt implements Object.
func (s *Synthetic) ReadAt(p []byte, off int64) (int, error) {
	if off < 0 {
		return 0, fmt.Errorf("fusefs: read at %d: %w", off, os.ErrInvalid)
	}
	s.mu.RLock()
	defer s.mu.RUnlock()
	n := len(p)
	if off >= s.size {
		return 0, io.EOF
	}
	if int64(n) > s.size-off {
		n = int(s.size - off)
	}
	for pos := 0; pos < n; {
		a := off + int64(pos)
		pg, in := a/syntheticPage, int(a%syntheticPage)
		k := min(n-pos, syntheticPage-in)
		if w := s.written[pg]; w != nil {
			copy(p[pos:pos+k], w[in:in+k])
		} else {
			s.generate(p[pos:pos+k], a)
		}
		pos += k
	}
	if n < len(p) {
		return n, io.EOF
	}
	return n, nil
}

// generate fills p with the content at off (one page at most), zero from genEnd.
func (s *Synthetic) generate(p []byte, off int64) {
	var w [8]byte
	for i := 0; i < len(p); {
		a := off + int64(i)
		if a >= s.genEnd {
			clear(p[i:])
			return
		}
		binary.LittleEndian.PutUint64(w[:], Word(s.seed, a/8))
		i += copy(p[i:], w[a%8:])
	}
}

// WriteAt implements Object; it grows the object as a file grows.
func (s *Synthetic) WriteAt(p []byte, off int64) (int, error) {
	if off < 0 {
		return 0, fmt.Errorf("fusefs: write at %d: %w", off, os.ErrInvalid)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for pos := 0; pos < len(p); {
		a := off + int64(pos)
		pg, in := a/syntheticPage, int(a%syntheticPage)
		w := s.written[pg]
		if w == nil {
			w = new([syntheticPage]byte)
			if base := pg * syntheticPage; base < s.size {
				s.generate(w[:min(syntheticPage, s.size-base)], base)
			}
			s.written[pg] = w
		}
		pos += copy(w[in:], p[pos:])
	}
	s.size = max(s.size, off+int64(len(p)))
	return len(p), nil
}

// Truncate implements Object.
func (s *Synthetic) Truncate(size int64) error {
	if size < 0 {
		return fmt.Errorf("fusefs: truncate to %d: %w", size, os.ErrInvalid)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.genEnd = min(s.genEnd, size)
	for pg, w := range s.written {
		if base := pg * syntheticPage; base >= size {
			delete(s.written, pg)
		} else if size-base < syntheticPage {
			clear(w[size-base:])
		}
	}
	s.size = size
	return nil
}
