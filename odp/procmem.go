package odp

// This process's memory reached by address, as a NIC or the kernel reaches it: inline
// data, memory no MR covers, file mappings through process_vm_readv/writev.

import (
	"fmt"
	"os"
	"runtime/debug"
	"unsafe"

	"golang.org/x/sys/unix"
)

// copyInline copies the bytes an inline SGL names, as ibv_post_send copies them into
// the work queue entry: from the caller's memory by address, whatever memory it is
// (no key is checked). An address that is not mapped fails the post with
// ErrBadAddress instead of crashing the program, as a C caller's would.
func copyInline(sgl []SGE) (out []byte, err error) {
	out = make([]byte, 0, sglLen(sgl))
	old := debug.SetPanicOnFault(true)
	defer debug.SetPanicOnFault(old)
	var at uint64
	defer func() {
		if r := recover(); r != nil {
			if _, ok := r.(interface{ Addr() uintptr }); !ok {
				panic(r)
			}
			out, err = nil, wrap(ErrBadAddress, "inline SGE at %#x", at)
		}
	}()
	for _, s := range sgl {
		if s.Length == 0 {
			continue
		}
		at = s.Addr
		out = append(out, bytesAt(at, uint64(s.Length))...) // the caller's to vouch for, as in C
	}
	return out, nil
}

// bytesAt returns the n bytes at address addr, which the caller knows to be mapped
// (or reads under SetPanicOnFault). The address becomes a pointer through memory
// rather than a uintptr conversion, which keeps the race detector's pointer checks
// out of memory that may be the Go heap's.
func bytesAt(addr, n uint64) []byte {
	a := uintptr(addr)
	p := *(*unsafe.Pointer)(unsafe.Pointer(&a))
	return unsafe.Slice((*byte)(p), n)
}

// vmCopy copies between local and the len(local) bytes at addr of this process,
// into addr if write, with process_vm_readv/writev: a fault on the way is the
// kernel's to take inside the system call, and an address it cannot provide fails
// with errDMAFault.
func vmCopy(local []byte, addr uintptr, write bool) error {
	pid := os.Getpid()
	for len(local) > 0 {
		liov := []unix.Iovec{{Base: &local[0]}}
		liov[0].SetLen(len(local))
		riov := []unix.RemoteIovec{{Base: addr, Len: len(local)}}
		var n int
		var err error
		if write {
			n, err = unix.ProcessVMWritev(pid, liov, riov, 0)
		} else {
			n, err = unix.ProcessVMReadv(pid, liov, riov, 0)
		}
		if err == unix.EINTR {
			continue
		}
		if err != nil || n == 0 {
			return fmt.Errorf("%w at %#x: %v", errDMAFault, addr, err)
		}
		local, addr = local[n:], addr+uintptr(n)
	}
	return nil
}
