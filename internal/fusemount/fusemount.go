// Package fusemount mounts odpemu's FUSE filesystems (go-fuse) and makes sure that
// none outlives the process that serves it.
//
// Every mount has the type fuse.odpemu and the source "odpemu:<pid>", so that the
// mounts of a process can be found in /proc/self/mountinfo after it is gone. Mounts
// are made with mount(2) directly (go-fuse's DirectMount: no fusermount is needed,
// the caller must be root). Unmount first unmounts normally; when the kernel says
// the mount is busy (a mapping or an open file of it is alive) it aborts the FUSE
// connection through the fusectl filesystem, which fails every request in flight
// and every later one, and detaches the mount. CleanStale does the same for mounts
// whose process has died (a panicking test leaves them), and Leftover lists the
// mounts a process still has, for a TestMain check.
package fusemount

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

// Type is the FUSE subtype of odpemu's mounts (fstype fuse.odpemu).
const Type = "odpemu"

// ConnectionsDir is where the fusectl filesystem lists FUSE connections.
const ConnectionsDir = "/sys/fs/fuse/connections"

// ErrUnavailable is returned by Mount where FUSE cannot be used: no /dev/fuse, or
// no permission to mount.
var ErrUnavailable = errors.New("fusemount: FUSE unavailable")

// Available reports why FUSE mounts cannot be made here, or nil if they can.
func Available() error {
	if _, err := os.Stat("/dev/fuse"); err != nil {
		return fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	if os.Geteuid() != 0 {
		return fmt.Errorf("%w: mounting without fusermount needs root", ErrUnavailable)
	}
	return nil
}

// Mount is a mounted filesystem served by this process.
type Mount struct {
	Dir    string
	server *fuse.Server
}

// Options adjust a mount.
type Options struct {
	// Timeout is the kernel's entry and attribute cache time (0: not cached, every
	// stat asks the server).
	Timeout time.Duration
	// MaxReadAhead bounds the kernel's readahead in bytes (0: the kernel's default).
	MaxReadAhead int
}

// New mounts root at dir (created if missing) and serves it until Unmount.
func New(dir string, root fs.InodeEmbedder, o Options) (*Mount, error) {
	if err := Available(); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("fusemount: %w", err)
	}
	abs, err := filepath.Abs(dir)
	if err != nil {
		return nil, fmt.Errorf("fusemount: %w", err)
	}
	t := o.Timeout
	opts := &fs.Options{
		EntryTimeout: &t, AttrTimeout: &t, NegativeTimeout: &t,
		MountOptions: fuse.MountOptions{
			DirectMountStrict: true,
			FsName:            fmt.Sprintf("%s:%d", Type, os.Getpid()),
			Name:              Type,
			MaxReadAhead:      o.MaxReadAhead,
		},
	}
	srv, err := fs.Mount(abs, root, opts)
	if err != nil {
		return nil, fmt.Errorf("fusemount: mount %s: %w", abs, err)
	}
	return &Mount{Dir: abs, server: srv}, nil
}

// Server returns the go-fuse server (for notifications).
func (m *Mount) Server() *fuse.Server { return m.server }

// Unmount unmounts the filesystem and waits until its server has stopped. A busy
// mount is aborted through fusectl and detached instead: its files then fail with
// ENOTCONN, and mappings of them with SIGBUS.
func (m *Mount) Unmount() error {
	if err := unix.Unmount(m.Dir, 0); err != nil {
		if !errors.Is(err, unix.EBUSY) {
			return fmt.Errorf("fusemount: unmount %s: %w", m.Dir, err)
		}
		if err := abortAndDetach(m.Dir); err != nil {
			return err
		}
	}
	m.server.Wait()
	return nil
}

// Info is one odpemu mount of this mount namespace.
type Info struct {
	Dir  string
	PID  int    // the process that serves it
	Conn uint32 // the FUSE connection number (the mount's device minor)
}

// List returns odpemu's mounts in this mount namespace.
func List() ([]Info, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, fmt.Errorf("fusemount: %w", err)
	}
	defer func() { _ = f.Close() }() // read only
	var out []Info
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if in, ok := parseMountinfo(sc.Text()); ok {
			out = append(out, in)
		}
	}
	return out, sc.Err()
}

// parseMountinfo reads one line of /proc/self/mountinfo:
//
//	36 25 0:45 / /mnt rw,relatime shared:1 - fuse.odpemu odpemu:1234 rw,user_id=0
func parseMountinfo(line string) (Info, bool) {
	f := strings.Fields(line)
	sep := -1
	for i, s := range f {
		if s == "-" {
			sep = i
			break
		}
	}
	if sep < 5 || sep+2 >= len(f) || f[sep+1] != "fuse."+Type {
		return Info{}, false
	}
	pid, err := strconv.Atoi(strings.TrimPrefix(f[sep+2], Type+":"))
	if err != nil {
		return Info{}, false
	}
	_, minor, ok := strings.Cut(f[2], ":")
	conn, err := strconv.ParseUint(minor, 10, 32)
	if !ok || err != nil {
		return Info{}, false
	}
	return Info{Dir: unescape(f[4]), PID: pid, Conn: uint32(conn)}, true
}

// unescape undoes mountinfo's octal escapes (\040 for a space).
func unescape(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if v, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// Leftover returns the odpemu mounts that this process still serves.
func Leftover() ([]Info, error) {
	all, err := List()
	var mine []Info
	for _, in := range all {
		if in.PID == os.Getpid() {
			mine = append(mine, in)
		}
	}
	return mine, err
}

// CleanStale aborts and detaches the odpemu mounts whose serving process is gone,
// and returns how many it removed. Mounts of live processes are left alone (test
// binaries of other packages run at the same time).
func CleanStale() (int, error) {
	all, err := List()
	if err != nil {
		return 0, err
	}
	n := 0
	var errs error
	for _, in := range all {
		if in.PID == os.Getpid() || serving(in.PID) {
			continue
		}
		if err := abortConn(in.Conn); err != nil {
			errs = errors.Join(errs, err)
		}
		if err := unix.Unmount(in.Dir, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) {
			errs = errors.Join(errs, fmt.Errorf("fusemount: detach %s: %w", in.Dir, err))
			continue
		}
		n++
	}
	return n, errs
}

// serving reports whether process pid may still serve its mounts: it exists and is
// not exiting. A process that exits while one of its threads waits for a FUSE reply
// from its own server (a fault on a mapping of its own file) stays a zombie until
// the connection is aborted.
func serving(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	// pid (comm) S ...: the state follows the last ')'.
	i := strings.LastIndexByte(string(b), ')')
	if i < 0 || i+2 >= len(b) {
		return false
	}
	st := b[i+2]
	return st != 'Z' && st != 'X'
}

// abortAndDetach aborts the connection of the odpemu mount at dir and detaches it.
func abortAndDetach(dir string) error {
	all, err := List()
	if err != nil {
		return err
	}
	for _, in := range all {
		if in.Dir == dir {
			if err := abortConn(in.Conn); err != nil {
				return err
			}
		}
	}
	if err := unix.Unmount(dir, unix.MNT_DETACH); err != nil {
		return fmt.Errorf("fusemount: detach %s: %w", dir, err)
	}
	return nil
}

// abortConn writes 1 to the connection's abort file, mounting fusectl first if it
// is not mounted. A connection that is gone already is not an error.
func abortConn(conn uint32) error {
	if err := mountFusectl(); err != nil {
		return err
	}
	p := filepath.Join(ConnectionsDir, strconv.FormatUint(uint64(conn), 10), "abort")
	err := os.WriteFile(p, []byte("1"), 0)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("fusemount: abort connection %d: %w", conn, err)
	}
	return nil
}

func mountFusectl() error {
	var st unix.Statfs_t
	if err := unix.Statfs(ConnectionsDir, &st); err != nil {
		return fmt.Errorf("fusemount: %s: %w (is the fuse module loaded?)", ConnectionsDir, err)
	}
	const fusectlMagic = 0x65735543
	if st.Type == fusectlMagic {
		return nil
	}
	if err := unix.Mount("fusectl", ConnectionsDir, "fusectl", 0, ""); err != nil && !errors.Is(err, unix.EBUSY) {
		return fmt.Errorf("fusemount: mount fusectl on %s: %w", ConnectionsDir, err)
	}
	return nil
}
