// Package hwcounters mounts a read-only FUSE tree (go-fuse) that shows emulated NICs'
// counters the way Linux shows an RDMA device's under /sys/class/infiniband:
//
//	<dir>/<dev>/ports/1/hw_counters/<counter>   the port's counters (mlx5's names)
//	<dir>/<dev>/mr/<mrn>/<counter>              per-MR counters, as rdma stat mr shows
//
// Each file holds a decimal number and a newline, read from the Source when the
// file is opened, so a reading is live and a script that reads mlx5's hw_counters
// works unchanged when pointed at <dir> instead of /sys/class/infiniband. Nothing is
// cached by the kernel (entries and attributes expire at once, files are direct I/O).
//
// What odp's devices show, and where each counter comes from in the kernel (mlx5:
// drivers/infiniband/hw/mlx5/counters.c, documented in NVIDIA's "Understanding mlx5
// Linux Counters"; rxe: drivers/infiniband/sw/rxe/rxe_hw_counters.c and the
// rxe_counter_inc calls in rxe_comp.c and rxe_resp.c). Each means what the driver's
// means; where odpemu's own count differs it says so.
//
//	file                            driver  counts
//	page_faults                     mlx5    network page faults (rdma stat mr)
//	page_faults_handled             mlx5    pages those faults mapped
//	page_invalidations              mlx5    MMU notifier invalidations of ODP MRs
//	page_invalidations_handled      mlx5    pages they unmapped from the NIC
//	page_prefetch                   mlx5    pages mapped by ibv_advise_mr
//	rnr_nak_retry_err               mlx5    RNR NAKs received that did not exhaust rnr_retry
//	packet_seq_err                  mlx5    PSN sequence error NAKs received (also the one
//	                                        that exhausts retry_cnt, which mlx5 leaves out)
//	local_ack_timeout_err           mlx5    ACK timer expiries (also the one that exhausts
//	                                        retry_cnt, which mlx5 leaves out)
//	out_of_sequence                 mlx5    requests received out of sequence (responder)
//	duplicate_request               both    duplicate requests received (responder)
//	req_transport_retries_exceeded  mlx5    requests failed with RETRY_EXC_ERR
//	req_rnr_retries_exceeded        mlx5    requests failed with RNR_RETRY_EXC_ERR
//	rcvd_rnr_err                    rxe     RNR NAKs received (rxe_comp.c check_ack)
//	send_rnr_err                    rxe     RNR NAKs sent (rxe_resp.c)
//	rcvd_seq_err                    rxe     PSN sequence error NAKs received
//	out_of_seq_request              rxe     as out_of_sequence
//	retry_exceeded_err              rxe     as req_transport_retries_exceeded
//	retry_rnr_exceeded_err          rxe     as req_rnr_retries_exceeded
//	completer_retry_err             rxe     retries begun: ACK timeouts and sequence NAKs
//	                                        that did not exhaust retry_cnt
//
// Per MR: the five page_* counters above, valid_pages (pages the NIC's table maps
// now) and stale_dmas (DMAs the audit found reading a page after it changed).
package hwcounters

import (
	"context"
	"slices"
	"strconv"
	"syscall"

	"github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"github.com/odpemu/odpemu/internal/fusemount"
)

// Port is the port number shown (emulated NICs have one port).
const Port = 1

// Source is a device whose counters are shown; *odp.Device is one.
type Source interface {
	// Name is the device's directory name.
	Name() string
	// PortCounters returns the hw_counters files' values by name.
	PortCounters() map[string]uint64
	// MRCounters returns the live MRs' counters by MR number.
	MRCounters() map[uint32]map[string]uint64
}

// Tree is a mounted counters tree.
type Tree struct{ m *fusemount.Mount }

// Mount mounts the counters of srcs at dir (created if missing). It needs root and
// /dev/fuse (fusemount.ErrUnavailable otherwise).
func Mount(dir string, srcs ...Source) (*Tree, error) {
	root := &dirNode{
		list: func() []string {
			var names []string
			for _, s := range srcs {
				names = append(names, s.Name())
			}
			return names
		},
		child: func(name string) fs.InodeEmbedder {
			for _, s := range srcs {
				if s.Name() == name {
					return deviceDir(s)
				}
			}
			return nil
		},
	}
	m, err := fusemount.New(dir, root, fusemount.Options{})
	if err != nil {
		return nil, err
	}
	return &Tree{m: m}, nil
}

// Dir returns the mount point.
func (t *Tree) Dir() string { return t.m.Dir }

// Unmount unmounts the tree (aborting it if it is busy).
func (t *Tree) Unmount() error { return t.m.Unmount() }

func deviceDir(s Source) *dirNode {
	port := strconv.Itoa(Port)
	hw := counterDir(func() (map[string]uint64, bool) { return s.PortCounters(), true })
	return fixedDir(map[string]func() fs.InodeEmbedder{
		"ports": func() fs.InodeEmbedder {
			return fixedDir(map[string]func() fs.InodeEmbedder{
				port: func() fs.InodeEmbedder {
					return fixedDir(map[string]func() fs.InodeEmbedder{"hw_counters": func() fs.InodeEmbedder { return hw }})
				},
			})
		},
		"mr": func() fs.InodeEmbedder {
			return &dirNode{
				list: func() []string {
					var names []string
					for n := range s.MRCounters() {
						names = append(names, strconv.FormatUint(uint64(n), 10))
					}
					return names
				},
				child: func(name string) fs.InodeEmbedder {
					n, err := strconv.ParseUint(name, 10, 32)
					if err != nil {
						return nil
					}
					if _, ok := s.MRCounters()[uint32(n)]; !ok {
						return nil
					}
					return counterDir(func() (map[string]uint64, bool) {
						c, ok := s.MRCounters()[uint32(n)]
						return c, ok
					})
				},
			}
		},
	})
}

// fixedDir is a directory of the given children, each made at lookup.
func fixedDir(children map[string]func() fs.InodeEmbedder) *dirNode {
	return &dirNode{
		list: func() []string {
			var names []string
			for n := range children {
				names = append(names, n)
			}
			return names
		},
		child: func(name string) fs.InodeEmbedder {
			if mk := children[name]; mk != nil {
				return mk()
			}
			return nil
		},
	}
}

// counterDir is a directory of one file per counter that get returns (ok false:
// the directory's object is gone and the directory is empty).
func counterDir(get func() (map[string]uint64, bool)) *dirNode {
	return &dirNode{
		leaves: true,
		list: func() []string {
			c, _ := get()
			var names []string
			for n := range c {
				names = append(names, n)
			}
			return names
		},
		child: func(name string) fs.InodeEmbedder {
			if c, ok := get(); !ok {
				return nil
			} else if _, ok := c[name]; !ok {
				return nil
			}
			return &counterFile{read: func() (uint64, bool) {
				c, ok := get()
				v, found := c[name]
				return v, ok && found
			}}
		},
	}
}

// dirNode is a directory whose entries are computed at each lookup and listing:
// subdirectories, or counter files if leaves.
type dirNode struct {
	fs.Inode
	leaves bool
	list   func() []string
	child  func(name string) fs.InodeEmbedder // nil: no such entry
}

// entryMode is the file type of the directory's entries.
func (d *dirNode) entryMode() uint32 {
	if d.leaves {
		return syscall.S_IFREG
	}
	return syscall.S_IFDIR
}

var (
	_ fs.NodeLookuper  = (*dirNode)(nil)
	_ fs.NodeReaddirer = (*dirNode)(nil)
	_ fs.NodeGetattrer = (*dirNode)(nil)
)

func (d *dirNode) Lookup(ctx context.Context, name string, out *fuse.EntryOut) (*fs.Inode, syscall.Errno) {
	ch := d.child(name)
	if ch == nil {
		return nil, syscall.ENOENT
	}
	if d.leaves {
		out.Attr.Mode = syscall.S_IFREG | 0o444
		out.Attr.Size = 4096
	} else {
		out.Attr.Mode = syscall.S_IFDIR | 0o555
	}
	return d.NewInode(ctx, ch, fs.StableAttr{Mode: d.entryMode()}), fs.OK
}

func (d *dirNode) Readdir(context.Context) (fs.DirStream, syscall.Errno) {
	names := d.list()
	slices.Sort(names)
	entries := make([]fuse.DirEntry, 0, len(names))
	for _, n := range names {
		entries = append(entries, fuse.DirEntry{Name: n, Mode: d.entryMode()})
	}
	return fs.NewListDirStream(entries), fs.OK
}

func (d *dirNode) Getattr(_ context.Context, _ fs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	out.Attr.Mode = syscall.S_IFDIR | 0o555
	return fs.OK
}

// counterFile is one counter: its value is read when the file is opened.
type counterFile struct {
	fs.Inode
	read func() (uint64, bool)
}

var (
	_ fs.NodeOpener    = (*counterFile)(nil)
	_ fs.NodeReader    = (*counterFile)(nil)
	_ fs.NodeGetattrer = (*counterFile)(nil)
	_ fs.NodeFlusher   = (*counterFile)(nil)
)

// Flush answers ENOSYS, which turns FLUSH off for the connection: a close never
// waits for the server (see fusefs.File.Flush).
func (c *counterFile) Flush(context.Context, fs.FileHandle) syscall.Errno { return syscall.ENOSYS }

// value is an open counter file's content, fixed at open as sysfs fixes it at the
// first read.
type value []byte

func (c *counterFile) Open(_ context.Context, flags uint32) (fs.FileHandle, uint32, syscall.Errno) {
	if flags&(syscall.O_WRONLY|syscall.O_RDWR) != 0 {
		return nil, 0, syscall.EACCES
	}
	v, ok := c.read()
	if !ok {
		return nil, 0, syscall.ENOENT // the MR was deregistered
	}
	return value(append(strconv.AppendUint(nil, v, 10), '\n')), fuse.FOPEN_DIRECT_IO, fs.OK
}

func (c *counterFile) Read(_ context.Context, fh fs.FileHandle, dest []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	v, _ := fh.(value)
	if off >= int64(len(v)) {
		return fuse.ReadResultData(nil), fs.OK
	}
	return fuse.ReadResultData(v[off:min(int64(len(v)), off+int64(len(dest)))]), fs.OK
}

// Getattr reports a read-only file of 4096 bytes, as sysfs does.
func (c *counterFile) Getattr(_ context.Context, _ fs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	out.Attr.Mode = syscall.S_IFREG | 0o444
	out.Attr.Size = 4096
	return fs.OK
}
