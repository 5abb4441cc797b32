package fusefs_test

import (
	"bytes"
	"errors"
	"io"
	"os"
	"path/filepath"
	"testing"

	"github.com/odpemu/odpemu/fusefs"
	"github.com/odpemu/odpemu/internal/fusemount"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

func TestMain(m *testing.M) { os.Exit(fusemount.TestMain(m)) }

// mount mounts a filesystem for the test, unmounted at its end, or skips.
func mount(t *testing.T, o fusefs.Options) *fusefs.FS {
	t.Helper()
	if err := fusemount.Available(); err != nil {
		t.Skipf("FUSE: %v", err)
	}
	fsys, err := fusefs.Mount(filepath.Join(t.TempDir(), "mnt"), o)
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, fsys.Unmount()) })
	return fsys
}

func TestSyntheticObject(t *testing.T) {
	s := fusefs.NewSynthetic(10000, 7)
	a := make([]byte, 10000)
	n, err := s.ReadAt(a, 0)
	require.NoError(t, err)
	require.Equal(t, 10000, n)
	b := make([]byte, 100)
	_, err = s.ReadAt(b, 4090) // across a page, unaligned to words
	require.NoError(t, err)
	assert.Equal(t, a[4090:4190], b, "content is a function of the offset")
	assert.NotEqual(t, a[:4096], a[4096:8192])
	assert.NotEqual(t, a, func() []byte { c := make([]byte, 10000); _, _ = fusefs.NewSynthetic(10000, 8).ReadAt(c, 0); return c }(),
		"another seed, other content")

	_, err = s.WriteAt([]byte("hello"), 4094)
	require.NoError(t, err)
	_, err = s.ReadAt(b, 4090)
	require.NoError(t, err)
	assert.Equal(t, append(append(append([]byte{}, a[4090:4094]...), "hello"...), a[4099:4190]...), b)

	n, err = s.ReadAt(b, 9950)
	assert.Equal(t, 50, n)
	assert.ErrorIs(t, err, io.EOF)
	require.NoError(t, s.Truncate(4096))
	require.NoError(t, s.Truncate(8192))
	_, err = s.ReadAt(b, 4090)
	require.NoError(t, err)
	assert.Equal(t, append(append(append([]byte{}, a[4090:4094]...), "he"...), make([]byte, 94)...), b,
		"bytes beyond a truncation read as zero after growth")
}

// recorder is a Watcher that checks the order of a change.
type recorder struct {
	t        *testing.T
	file     *fusefs.File
	calls    int
	off, n   int64
	sawOld   bool // the object still held the old content when told
	failWith error
}

func (r *recorder) FileChanged(dev, ino uint64, off, n int64, change func() error) error {
	r.calls++
	d, i := r.file.ID()
	assert.Equal(r.t, [2]uint64{d, i}, [2]uint64{dev, ino})
	r.off, r.n = off, n
	b := make([]byte, 1)
	if _, err := r.file.Object().ReadAt(b, off); err == nil {
		r.sawOld = b[0] != 'X'
	}
	if r.failWith != nil {
		return r.failWith
	}
	return change()
}

func TestChangeInvalidatesThePageCache(t *testing.T) {
	fsys := mount(t, fusefs.Options{})
	obj := fusefs.NewSynthetic(1<<20, 1)
	f, err := fsys.Add("obj", obj)
	require.NoError(t, err)
	_, err = fsys.Add("obj", obj)
	require.ErrorIs(t, err, fusefs.ErrExists)

	var st unix.Stat_t
	require.NoError(t, unix.Stat(f.Path(), &st))
	dev, ino := f.ID()
	assert.Equal(t, [2]uint64{dev, ino}, [2]uint64{st.Dev, st.Ino}, "ID is what stat(2) reports")
	assert.EqualValues(t, 1<<20, st.Size)

	fd, err := os.Open(f.Path())
	require.NoError(t, err)
	defer func() { _ = fd.Close() }() // read only
	want := make([]byte, 8192)
	_, err = obj.ReadAt(want, 8192)
	require.NoError(t, err)
	got := make([]byte, 8192)
	_, err = fd.ReadAt(got, 8192)
	require.NoError(t, err)
	require.Equal(t, want, got)
	reads := fsys.Stats().Reads
	_, err = fd.ReadAt(got, 8192)
	require.NoError(t, err)
	assert.Equal(t, reads, fsys.Stats().Reads, "a second read is served from the page cache")

	w := &recorder{t: t, file: f}
	cancel := fsys.Watch(w)
	require.NoError(t, f.Change(8192+100, bytes.Repeat([]byte{'X'}, 10)))
	assert.Equal(t, 1, w.calls)
	assert.True(t, w.sawOld, "watchers are told before the object changes")
	assert.Equal(t, [2]int64{8292, 10}, [2]int64{w.off, w.n})
	_, err = fd.ReadAt(got, 8192)
	require.NoError(t, err)
	assert.Equal(t, bytes.Repeat([]byte{'X'}, 10), got[100:110], "the page cache was invalidated")
	assert.Equal(t, want[:100], got[:100])

	w.failWith = errors.New("refused")
	assert.ErrorIs(t, f.Change(0, []byte{'X'}), w.failWith)
	cancel()
	require.NoError(t, f.Change(0, []byte{'X'}))
	assert.Equal(t, 2, w.calls, "no calls after cancel")
}

func TestTruncateAndLocalObject(t *testing.T) {
	fsys := mount(t, fusefs.Options{})
	obj, err := fusefs.OpenLocal(filepath.Join(t.TempDir(), "backing"), 64<<10)
	require.NoError(t, err)
	defer func() { assert.NoError(t, obj.Close()) }()
	f, err := fsys.Add("local", obj)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(f.Path(), []byte("written through the mount"), 0))
	b := make([]byte, 25)
	_, err = obj.ReadAt(b, 0)
	require.NoError(t, err)
	assert.Equal(t, "written through the mount", string(b))
	assert.NotZero(t, fsys.Stats().Writes)

	require.NoError(t, f.Truncate(4096))
	st, err := os.Stat(f.Path())
	require.NoError(t, err)
	assert.EqualValues(t, 4096, st.Size(), "the kernel's size follows a truncation of the object")
	require.NoError(t, os.Truncate(f.Path(), 100))
	assert.EqualValues(t, 100, obj.Size(), "the kernel's truncation reaches the object")
}

// TestDeliberateFailure is run by .ci/run, which checks that no mount outlives it:
// ODPEMU_FAIL_DELIBERATELY=fail fails a subtest (the cleanups unmount), =panic panics
// in another goroutine with a mapping of the file alive (nothing runs after it: the
// mount is left stale, and the next test binary's TestMain removes it).
func TestDeliberateFailure(t *testing.T) {
	how := os.Getenv("ODPEMU_FAIL_DELIBERATELY")
	if how == "" {
		t.Skip("run by .ci/run with ODPEMU_FAIL_DELIBERATELY=fail or panic")
	}
	fsys := mount(t, fusefs.Options{})
	f, err := fsys.Add("x", fusefs.NewSynthetic(1<<20, 1))
	require.NoError(t, err)
	fd, err := os.Open(f.Path())
	require.NoError(t, err)
	mem, err := unix.Mmap(int(fd.Fd()), 0, 1<<20, unix.PROT_READ, unix.MAP_SHARED)
	require.NoError(t, err)
	require.NoError(t, unix.Madvise(mem[:1<<16], unix.MADV_POPULATE_READ)) // by syscall, never by touching
	t.Cleanup(func() {
		assert.NoError(t, unix.Munmap(mem))
		assert.NoError(t, fd.Close())
	})
	t.Run("sub", func(t *testing.T) {
		if how == "panic" {
			done := make(chan struct{})
			go func() { panic("deliberate panic with a FUSE mount and a mapping of it alive") }()
			<-done
		}
		t.Fatal("deliberate failure with a FUSE mount and a mapping of it alive")
	})
}

// An unmount while a file of the mount is open and mapped is busy: Unmount aborts
// the connection through fusectl and detaches the mount; the file then fails with
// ENOTCONN instead of hanging, and nothing is left mounted.
func TestUnmountBusyAborts(t *testing.T) {
	if err := fusemount.Available(); err != nil {
		t.Skipf("FUSE: %v", err)
	}
	fsys, err := fusefs.Mount(filepath.Join(t.TempDir(), "mnt"), fusefs.Options{})
	require.NoError(t, err)
	f, err := fsys.Add("busy", fusefs.NewSynthetic(1<<20, 1))
	require.NoError(t, err)
	fd, err := os.Open(f.Path())
	require.NoError(t, err)
	defer func() { _ = fd.Close() }() // fails harmlessly on an aborted connection
	mem, err := unix.Mmap(int(fd.Fd()), 0, 1<<20, unix.PROT_READ, unix.MAP_SHARED)
	require.NoError(t, err)
	defer func() { assert.NoError(t, unix.Munmap(mem)) }()
	require.ErrorIs(t, unix.Unmount(fsys.Dir(), 0), unix.EBUSY, "the mount is busy")

	require.NoError(t, fsys.Unmount())
	left, err := fusemount.Leftover()
	require.NoError(t, err)
	assert.Empty(t, left, "the busy mount was detached")
	_, err = fd.ReadAt(make([]byte, 10), 0)
	assert.ErrorIs(t, err, unix.ENOTCONN, "the connection was aborted")
	assert.ErrorIs(t, unix.Madvise(mem[:4096], unix.MADV_POPULATE_READ), unix.EFAULT,
		"the mapping's missing pages cannot be filled any more")
}
