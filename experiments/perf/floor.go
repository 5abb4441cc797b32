package perf

import (
	"fmt"
	"slices"
	"time"

	"golang.org/x/sys/unix"
)

// MemcpyFloor copies size-byte messages from one region to another, each of depth
// slots, slot after slot, for iters messages, as the NIC's WRITEs move them
// (perftest strides its buffer the same way, and the server's region is as large),
// and returns the rate in MiB/s, the median of five passes. A NIC in one process
// moves each byte once, as this copy does: its WRITE bandwidth is measured against
// this floor, in the same run. The regions are mapped and written before the first
// pass: the floor measures copying, not first touches.
func MemcpyFloor(size, depth, iters int) (float64, error) {
	if size < 1 || depth < 1 || iters < 1 {
		return 0, fmt.Errorf("perf: floor of %d-byte messages, depth %d, %d iterations", size, depth, iters)
	}
	n := size * depth
	src, err := unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return 0, fmt.Errorf("perf: floor: %w", err)
	}
	defer func() { _ = unix.Munmap(src) }() // the floor is measured; nothing else uses them
	dst, err := unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return 0, fmt.Errorf("perf: floor: %w", err)
	}
	defer func() { _ = unix.Munmap(dst) }()
	fill(src)
	fill(dst)
	var rates []float64
	for pass := 0; pass < 5; pass++ {
		t0 := time.Now()
		for i := 0; i < iters; i++ {
			at := (i % depth) * size
			copy(dst[at:at+size], src[at:at+size])
		}
		rates = append(rates, float64(size)*float64(iters)/time.Since(t0).Seconds()/(1<<20))
	}
	slices.Sort(rates)
	return rates[len(rates)/2], nil
}
