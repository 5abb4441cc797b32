// Package bufpool keeps reusable byte buffers in power-of-two size classes, for
// packet payloads that the emulated NIC copies out of and into memory regions.
package bufpool

import (
	"math/bits"
	"sync"
)

// maxClass bounds pooled buffers at 64 MiB; larger ones are allocated and dropped.
const maxClass = 26

var classes [maxClass + 1]sync.Pool

// Get returns a buffer of length n (its capacity may be larger). Its content is
// undefined.
func Get(n int) []byte {
	if n == 0 {
		return nil
	}
	c := bits.Len(uint(n - 1))
	if c > maxClass {
		return make([]byte, n)
	}
	if p, ok := classes[c].Get().(*[]byte); ok {
		return (*p)[:n]
	}
	return make([]byte, n, 1<<c)
}

// Put returns a buffer from Get for reuse; b must not be used afterwards.
func Put(b []byte) {
	c := bits.Len(uint(cap(b) - 1))
	if cap(b) == 0 || c > maxClass || cap(b) != 1<<c {
		return
	}
	b = b[:cap(b)]
	classes[c].Put(&b)
}
