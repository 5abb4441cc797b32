package odp

import (
	"runtime/debug"
	"unsafe"
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
