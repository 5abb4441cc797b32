// Package fusefs is an in-process FUSE filesystem (go-fuse) whose files take their
// content lazily from backing objects: a local file, or a synthetic object of a given
// size and seed for experiments, with a configurable latency per read to model remote
// storage. It is what file-backed on-demand MRs are registered over: the kernel's
// page cache sits between a MAP_SHARED mapping of such a file and the object, so the
// NIC's faults on the mapping become FUSE reads, and a change of the object must
// invalidate the page cache and, before that, the NIC's translations.
//
// A change made through the filesystem (File.Change, File.Truncate, a truncation by
// the kernel) runs the way the kernel runs a page cache invalidation: every Watcher
// (an MMU notifier subscriber, such as odp.Device) is told first and invalidates its
// translations of the file's pages, waiting for DMA in flight; then the object
// changes and the kernel's cached pages of the range are dropped
// (FUSE_NOTIFY_INVAL_INODE); then the watchers let faults map the pages again, which
// read the new content.
//
// The Go runtime hazard: a goroutine that touches a page of a mapping of these files
// that is not in the page cache blocks its thread in the kernel, holding its P, until
// the FUSE server answers, and the server's goroutines need a P. At GOMAXPROCS=1 that
// is a deadlock. Code of this process must therefore reach such pages only through
// system calls (madvise(MADV_POPULATE_READ/WRITE), pread, process_vm_readv), during
// which the runtime hands the P on. odp's file-backed MRs do.
//
// # Lock order
//
//	File.mu   a file's content against reads: held for reading while the object is
//	          read for the kernel, for writing while it changes (never while the
//	          watchers run, nor while the kernel's cache is invalidated)
//	FS.mu     the file list and the watchers; a leaf lock
package fusefs

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"github.com/odpemu/odpemu/internal/clock"
	"github.com/odpemu/odpemu/internal/fusemount"
)

// ErrExists is returned by Add for a name that is taken.
var ErrExists = errors.New("fusefs: file exists")

// Watcher is told of changes to the files' content before they happen, as an MMU
// notifier is. FileChanged must stop using the pages of bytes [off, off+n) of the
// file (dev, ino), call change exactly once, and return its error; until it
// returns, faults on those pages must not map them.
type Watcher interface {
	FileChanged(dev, ino uint64, off, n int64, change func() error) error
}

// Options configure a filesystem.
type Options struct {
	// ReadLatency is added to every read the kernel makes (remote storage).
	ReadLatency time.Duration
	// MaxReadAhead bounds the kernel's readahead in bytes (0: its default).
	MaxReadAhead int
}

// Stats count what the kernel asked of the filesystem.
type Stats struct {
	Reads, BytesRead       uint64 // FUSE READs: page cache fills
	Writes, BytesWritten   uint64 // FUSE WRITEs: writeback of dirty pages, write(2)
	Changes, Invalidations uint64 // changes of objects; page cache invalidations sent
}

// FS is a mounted filesystem of files backed by objects.
type FS struct {
	mount *fusemount.Mount
	root  *fs.Inode
	dev   uint64
	opts  Options

	mu       sync.Mutex
	files    map[string]*File
	watchers map[*watch]struct{}

	reads, bytesRead, writes, bytesWritten, changes, invals atomic.Uint64
}

type watch struct{ w Watcher }

type rootNode struct{ fs.Inode }

// Mount mounts an empty filesystem at dir. It needs root and /dev/fuse
// (fusemount.ErrUnavailable otherwise).
func Mount(dir string, o Options) (*FS, error) {
	r := &rootNode{}
	m, err := fusemount.New(dir, r, fusemount.Options{Timeout: time.Hour, MaxReadAhead: o.MaxReadAhead})
	if err != nil {
		return nil, err
	}
	fsys := &FS{mount: m, root: &r.Inode, opts: o, files: map[string]*File{}, watchers: map[*watch]struct{}{}}
	var st syscall.Stat_t
	if err := syscall.Stat(m.Dir, &st); err != nil {
		return nil, errors.Join(fmt.Errorf("fusefs: stat %s: %w", m.Dir, err), m.Unmount())
	}
	fsys.dev = st.Dev
	return fsys, nil
}

// Dir returns the mount point.
func (fsys *FS) Dir() string { return fsys.mount.Dir }

// Unmount unmounts the filesystem (see fusemount.Mount.Unmount: a busy mount is
// aborted). Mappings and open files of it should be gone first.
func (fsys *FS) Unmount() error { return fsys.mount.Unmount() }

// Watch subscribes w to changes of the files; the returned function unsubscribes.
func (fsys *FS) Watch(w Watcher) (cancel func()) {
	k := &watch{w}
	fsys.mu.Lock()
	fsys.watchers[k] = struct{}{}
	fsys.mu.Unlock()
	return func() {
		fsys.mu.Lock()
		delete(fsys.watchers, k)
		fsys.mu.Unlock()
	}
}

// Stats returns the filesystem's counters.
func (fsys *FS) Stats() Stats {
	return Stats{Reads: fsys.reads.Load(), BytesRead: fsys.bytesRead.Load(), Writes: fsys.writes.Load(),
		BytesWritten: fsys.bytesWritten.Load(), Changes: fsys.changes.Load(), Invalidations: fsys.invals.Load()}
}

// File is a file of the filesystem.
type File struct {
	fs.Inode
	fsys *FS
	name string
	dev  uint64
	ino  uint64

	mu  sync.RWMutex // see the package doc
	obj Object
}

// Add creates the file name in the root directory with obj's content.
func (fsys *FS) Add(name string, obj Object) (*File, error) {
	if name == "" || filepath.Base(name) != name {
		return nil, fmt.Errorf("fusefs: bad file name %q", name)
	}
	fsys.mu.Lock()
	if fsys.files[name] != nil {
		fsys.mu.Unlock()
		return nil, fmt.Errorf("%w: %s", ErrExists, name)
	}
	ino := uint64(len(fsys.files) + 2) // 1 is the root
	f := &File{fsys: fsys, name: name, dev: fsys.dev, ino: ino, obj: obj}
	ch := fsys.root.NewPersistentInode(context.Background(), f, fs.StableAttr{Mode: syscall.S_IFREG, Ino: ino})
	fsys.root.AddChild(name, ch, false)
	fsys.files[name] = f
	first := len(fsys.files) == 1
	fsys.mu.Unlock()
	if first {
		// The first close sends the first FLUSH, whose ENOSYS turns FLUSH off (see
		// Flush).
		fd, err := os.Open(f.Path())
		if err != nil {
			return nil, fmt.Errorf("fusefs: open %s: %w", name, err)
		}
		if err := fd.Close(); err != nil {
			return nil, fmt.Errorf("fusefs: close %s: %w", name, err)
		}
	}
	return f, nil
}

// Path returns the file's path.
func (f *File) Path() string { return filepath.Join(f.fsys.mount.Dir, f.name) }

// ID returns the file's device and inode numbers, as stat(2) reports them.
func (f *File) ID() (dev, ino uint64) { return f.dev, f.ino }

// Object returns the file's backing object.
func (f *File) Object() Object { return f.obj }

// Change writes data at off into the backing object behind the kernel's back (as
// another client of remote storage would) and invalidates what caches it: the
// watchers' translations first, then the page cache.
func (f *File) Change(off int64, data []byte) error {
	if off < 0 {
		return fmt.Errorf("fusefs: change at %d: %w", off, os.ErrInvalid)
	}
	return f.change(off, int64(len(data)), func() error {
		_, err := f.obj.WriteAt(data, off)
		return err
	}, true)
}

// Truncate sets the backing object's size behind the kernel's back, invalidating
// from the new end on (the whole file from a shrunk last page).
func (f *File) Truncate(size int64) error {
	if size < 0 {
		return fmt.Errorf("fusefs: truncate to %d: %w", size, os.ErrInvalid)
	}
	if err := f.change(size, math.MaxInt64-size, func() error { return f.obj.Truncate(size) }, true); err != nil {
		return err
	}
	// The kernel learns the size at its next GETATTR, and drops the pages beyond it
	// only then: a stat now makes mappings fail beyond the end at once.
	var st syscall.Stat_t
	if err := syscall.Stat(f.Path(), &st); err != nil {
		return fmt.Errorf("fusefs: stat %s: %w", f.name, err)
	}
	return nil
}

// DropCache drops the kernel's cached pages of the file, as writing 1 to
// /proc/sys/vm/drop_caches would for it alone; watchers are told first, as for a
// change.
func (f *File) DropCache() error {
	return f.change(0, math.MaxInt64, func() error { return nil }, true)
}

// change runs apply under the file's write lock inside every watcher's
// notification, and then, if notifyKernel, drops the kernel's cached pages of
// [off, off+n) and its cached attributes.
func (f *File) change(off, n int64, apply func() error, notifyKernel bool) error {
	run := func() error {
		f.mu.Lock()
		err := apply()
		f.mu.Unlock()
		f.fsys.changes.Add(1)
		if err != nil || !notifyKernel {
			return err
		}
		return f.invalidateCache(off, n)
	}
	f.fsys.mu.Lock()
	for k := range f.fsys.watchers {
		inner, w := run, k.w
		run = func() error { return w.FileChanged(f.dev, f.ino, off, n, inner) }
	}
	f.fsys.mu.Unlock()
	return run()
}

// invalidateCache drops the kernel's cached attributes and pages of [off, off+n).
// ENOENT means the kernel holds nothing of the file.
func (f *File) invalidateCache(off, n int64) error {
	ps := int64(os.Getpagesize())
	lo := off &^ (ps - 1)
	ln := int64(0) // to the end of the file
	if n < math.MaxInt64-off {
		ln = (off+n+ps-1)&^(ps-1) - lo
	}
	f.fsys.invals.Add(1)
	if e := f.NotifyContent(lo, ln); e != 0 && e != syscall.ENOENT {
		return fmt.Errorf("fusefs: invalidate %s [%d, +%d): %w", f.name, lo, ln, e)
	}
	return nil
}

var (
	_ fs.NodeOpener    = (*File)(nil)
	_ fs.NodeReader    = (*File)(nil)
	_ fs.NodeWriter    = (*File)(nil)
	_ fs.NodeGetattrer = (*File)(nil)
	_ fs.NodeSetattrer = (*File)(nil)
	_ fs.NodeFsyncer   = (*File)(nil)
	_ fs.NodeFlusher   = (*File)(nil)
)

// Open keeps the page cache across opens: changes invalidate it explicitly.
func (f *File) Open(context.Context, uint32) (fs.FileHandle, uint32, syscall.Errno) {
	return nil, fuse.FOPEN_KEEP_CACHE, fs.OK
}

// Read fills the page cache from the object, after the configured latency.
func (f *File) Read(_ context.Context, _ fs.FileHandle, dest []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	if l := f.fsys.opts.ReadLatency; l > 0 {
		clock.SleepUntil(time.Now().Add(l), nil)
	}
	f.mu.RLock()
	n, err := f.obj.ReadAt(dest, off)
	f.mu.RUnlock()
	if err != nil && !errors.Is(err, io.EOF) {
		return nil, fs.ToErrno(err)
	}
	f.fsys.reads.Add(1)
	f.fsys.bytesRead.Add(uint64(n))
	return fuse.ReadResultData(dest[:n]), fs.OK
}

// Write stores what the kernel writes back (dirty pages of a shared mapping, write(2)).
func (f *File) Write(_ context.Context, _ fs.FileHandle, data []byte, off int64) (uint32, syscall.Errno) {
	f.mu.Lock()
	n, err := f.obj.WriteAt(data, off)
	f.mu.Unlock()
	if err != nil {
		return uint32(n), fs.ToErrno(err)
	}
	f.fsys.writes.Add(1)
	f.fsys.bytesWritten.Add(uint64(n))
	return uint32(n), fs.OK
}

// Getattr reports a regular file of the object's size.
func (f *File) Getattr(_ context.Context, _ fs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	f.attr(&out.Attr)
	return fs.OK
}

func (f *File) attr(a *fuse.Attr) {
	a.Mode = syscall.S_IFREG | 0o644
	a.Ino = f.ino
	a.Size = uint64(f.obj.Size())
	a.Blocks = (a.Size + 511) / 512
	a.Blksize = 4096
	a.Nlink = 1
}

// Setattr truncates the object when the kernel asks (ftruncate, O_TRUNC). The
// watchers are told first; the kernel drops its pages beyond the size itself.
func (f *File) Setattr(_ context.Context, _ fs.FileHandle, in *fuse.SetAttrIn, out *fuse.AttrOut) syscall.Errno {
	if sz, ok := in.GetSize(); ok {
		s := int64(sz)
		if err := f.change(s, math.MaxInt64-s, func() error { return f.obj.Truncate(s) }, false); err != nil {
			return fs.ToErrno(err)
		}
	}
	f.attr(&out.Attr)
	return fs.OK
}

// Fsync has nothing to do: writes reach the object as they arrive.
func (f *File) Fsync(context.Context, fs.FileHandle, uint32) syscall.Errno { return fs.OK }

// Flush answers ENOSYS, after which the kernel sends no FLUSH on this connection
// again (fc->no_flush): a close(2) never waits for the server. That matters when
// the process exits without unmounting (a panic): its files are closed before its
// /dev/fuse descriptor, and a FLUSH then waits for a server that is gone, forever.
// Add makes the first FLUSH happen while the server runs.
func (f *File) Flush(context.Context, fs.FileHandle) syscall.Errno { return syscall.ENOSYS }
