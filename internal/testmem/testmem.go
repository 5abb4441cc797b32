// Package testmem tracks which parts of a test's own mappings the test still owns:
// an address a test unmapped itself may hold the Go runtime's memory by cleanup time,
// so cleanup must unmap only what is still the test's.
package testmem

import (
	"unsafe"

	"github.com/odpemu/odpemu/internal/interval"
	"golang.org/x/sys/unix"
)

// Owned lists the parts of a mapping that the test has not unmapped itself.
type Owned struct{ live []interval.Range }

// Own starts tracking mem, a mapping the test made.
func Own(mem []byte) *Owned {
	start := uintptr(unsafe.Pointer(unsafe.SliceData(mem)))
	return &Owned{live: []interval.Range{{Start: start, End: start + uintptr(len(mem))}}}
}

// Drop records that the test unmapped (or moved away) r.
func (o *Owned) Drop(r interval.Range) {
	var next []interval.Range
	for _, l := range o.live {
		next = append(next, interval.Uncovered(l, []interval.Range{r})...)
	}
	o.live = next
}

// Live returns the parts still owned, in address order.
func (o *Owned) Live() []interval.Range { return append([]interval.Range(nil), o.live...) }

// Unmap unmaps the parts still owned.
func (o *Owned) Unmap() {
	for _, r := range o.live {
		_, _, _ = unix.Syscall(unix.SYS_MUNMAP, r.Start, r.End-r.Start, 0) // the test's own mapping
	}
	o.live = nil
}
