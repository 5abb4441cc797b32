// Command emu is the Go half of odpemu's libibverbs.so.1, built with
// -buildmode=c-shared as libodpemu-verbs.so (verbs.Build does it): the emulated NIC
// (package odp) behind the C library that verbs programs load. The C library loads it
// with dlopen when a program first opens a device, and calls the functions
// ../libibverbs/backend.h declares; objects cross as cgo handles.
package main

/*
#cgo CFLAGS: -I${SRCDIR}/../libibverbs
#include <string.h>
#include "backend.h"
*/
import "C"

import (
	"fmt"
	"net/netip"
	"os"
	"runtime"
	"runtime/cgo"
	"sync/atomic"
	"syscall"
	"unsafe"

	"github.com/odpemu/odpemu/odp"
)

func main() {} // a c-shared library's main is never run

// The emulated NIC runs on the CPUs the program leaves it. A program's data path is a
// thread of its own that posts and polls (perftest's is one): it enters Go on each
// post, and while it runs C again it keeps the P it entered with (the runtime counts
// it in a system call) until the runtime's monitor takes the P back, 20 us to
// milliseconds later. Until a thread first posts or polls through the library, the
// runtime has one P fewer than the CPUs, leaving the program its CPU; from then on
// one per CPU (dataPath), since that thread holds one. A process that only answers,
// as perftest's server of READ and WRITE tests does, keeps one P fewer: on this
// project's 2-CPU machines it moved 10-25% more at 64 B than with two. With one P
// fewer while a thread posted, the engines had none while it ran C: an engine that
// a post woke waited about 250 us for a P, and perftest's typical 64 B latency
// between two processes was about 200-240 us, now 52-114 us (README). While the
// threads wait for their completions in Go rather than in C, the runtime has one P
// fewer again (procs.go). GOMAXPROCS in the environment still decides.
func init() {
	if os.Getenv("GOMAXPROCS") == "" {
		runtime.GOMAXPROCS(oneFewer(runtime.NumCPU()))
	}
}

// oneFewer is the Ps the runtime has while the program's threads need none of their
// own, on cpus CPUs: one fewer than the CPUs, and never none.
func oneFewer(cpus int) int { return max(1, cpus-1) }

// dataPath gives the runtime one P per CPU once a thread posts or polls through the
// library (see init), and starts adaptProcs. The first call raises it; the rest cost
// an atomic load.
func dataPath() {
	if raised.Load() || !raised.CompareAndSwap(false, true) {
		return
	}
	if os.Getenv("GOMAXPROCS") == "" {
		cpus := runtime.NumCPU()
		runtime.GOMAXPROCS(cpus)
		go adaptProcs(cpus)
	}
}

// raised says dataPath has run.
var raised atomic.Bool

// device is an opened device: one ibv_open_device.
type device struct {
	dev  *odp.Device
	addr netip.Addr // the address its port is bound to (its GID)
}

// errno is the errno value a verbs caller gets for err.
func errno(err error) C.int { return C.int(odp.Errno(err)) }

// fail writes err's message into the caller's buffer and returns its errno.
func fail(err error, buf *C.char, n C.size_t) C.int {
	if buf != nil && n > 0 {
		msg := err.Error()
		b := unsafe.Slice((*byte)(unsafe.Pointer(buf)), int(n))
		k := copy(b[:len(b)-1], msg)
		b[k] = 0
	}
	return errno(err)
}

//export odpemu_open
func odpemu_open(name, addrStr *C.char, out *C.odpemu_handle, attr *C.struct_odpemu_device_attr, errBuf *C.char, errLen C.size_t) C.int {
	addr, err := netip.ParseAddr(C.GoString(addrStr))
	if err != nil || !addr.Is4() {
		return fail(fmt.Errorf("address %q: want an IPv4 address", C.GoString(addrStr)), errBuf, errLen)
	}
	// ODPEMU_PROFILE names the device's profile (odp.Profiles; default the emulator's
	// own). ODPEMU_NO_SNAPSHOT=1: an ODP MR maps no page at registration, so that the
	// first DMA to each page takes a network page fault. ODPEMU_GSO=1: the QPs send
	// runs of packets with UDP segmentation offload (odp.LinkModel.GSO).
	profile, err := odp.LookupProfile(os.Getenv("ODPEMU_PROFILE"))
	if err != nil {
		return fail(fmt.Errorf("ODPEMU_PROFILE: %w", err), errBuf, errLen)
	}
	profile.Link.GSO = os.Getenv("ODPEMU_GSO") == "1"
	dev, err := odp.Open(profile.Apply(odp.Config{Name: C.GoString(name), NoSnapshot: os.Getenv("ODPEMU_NO_SNAPSHOT") == "1"}))
	if err != nil {
		return fail(err, errBuf, errLen)
	}
	fillAttr(attr, dev.QueryDevice())
	*out = C.odpemu_handle(cgo.NewHandle(&device{dev: dev, addr: addr}))
	return 0
}

// fillAttr turns what odp reports into what the C library reports.
func fillAttr(attr *C.struct_odpemu_device_attr, a odp.DeviceAttr) {
	*attr = C.struct_odpemu_device_attr{
		max_mr_size:         C.uint64_t(a.MaxMRSize),
		page_size_cap:       C.uint64_t(a.PageSize),
		max_msg_sz:          C.uint32_t(a.MaxMsgSize),
		max_qp_wr:           C.uint32_t(a.MaxQPWR),
		max_sge:             C.uint32_t(a.MaxSGE),
		max_inline_data:     C.uint32_t(a.MaxInlineData),
		max_cqe:             C.uint32_t(a.MaxCQE),
		max_qp_rd_atom:      C.uint32_t(a.MaxQPRdAtom),
		max_qp_init_rd_atom: C.uint32_t(a.MaxQPInitRdAtom),
		atomic_cap:          C.uint32_t(a.AtomicCap),
		odp_general_caps:    C.uint64_t(a.ODP.General),
		odp_rc_caps:         C.uint32_t(a.ODP.RC),
		odp_uc_caps:         C.uint32_t(a.ODP.UC),
		odp_ud_caps:         C.uint32_t(a.ODP.UD),
		active_mtu:          4096,
		max_srq_wr:          C.uint32_t(a.MaxSRQWR),
		max_srq_sge:         C.uint32_t(a.MaxSRQSGE),
	}
}

//export odpemu_close
func odpemu_close(h C.odpemu_handle) C.int {
	d, ok := lookup[*device](h)
	if !ok {
		return C.int(syscall.EINVAL)
	}
	cgo.Handle(h).Delete()
	return errno(d.dev.Close())
}

//export odpemu_alloc_pd
func odpemu_alloc_pd(h C.odpemu_handle, out *C.odpemu_handle) C.int {
	d, ok := lookup[*device](h)
	if !ok {
		return C.int(syscall.EINVAL)
	}
	pd, err := d.dev.AllocPD()
	if err != nil {
		return errno(err)
	}
	*out = C.odpemu_handle(cgo.NewHandle(&protectionDomain{pd: pd, dev: d}))
	return 0
}

//export odpemu_dealloc_pd
func odpemu_dealloc_pd(h C.odpemu_handle) C.int {
	pd, ok := lookup[*protectionDomain](h)
	if !ok {
		return C.int(syscall.EINVAL)
	}
	if err := pd.pd.Dealloc(); err != nil {
		return errno(err)
	}
	cgo.Handle(h).Delete()
	return 0
}

// lookup returns the object handle h names, if it is a T.
func lookup[T any](h C.odpemu_handle) (T, bool) {
	var zero T
	if h == 0 {
		return zero, false
	}
	v, ok := cgo.Handle(h).Value().(T)
	return v, ok
}
