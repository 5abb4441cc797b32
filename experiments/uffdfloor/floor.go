// Package uffdfloor measures the floors of a userfaultfd page fault in C, in the
// same run as the emulator's faults they are compared with: a raw UFFDIO_COPY
// (what installing a page costs) and a minimal handler (a thread that reads the
// userfaultfd and copies the page in, as every userfaultfd-based pager does).
package uffdfloor

/*
#cgo CFLAGS: -O2 -Wall
#include "floor.h"
*/
import "C"

import (
	"fmt"
	"time"

	"golang.org/x/sys/unix"
)

// CopyPerPage returns the mean time of a UFFDIO_COPY of one page over pages pages.
func CopyPerPage(pages int) (time.Duration, error) {
	return perPage("UFFDIO_COPY", pages, func(e *C.int) C.longlong { return C.floor_copy(C.int(pages), e) })
}

// HandlerPerFault returns the mean time of a page fault served by a minimal C
// handler thread, over pages faults. The handler sleeps in poll(2) between faults,
// as pagers do, or with spin reads its descriptor in a loop: then its wake-up is
// left out and what remains is the kernel's fault delivery and the copy.
func HandlerPerFault(pages int, spin bool) (time.Duration, error) {
	s := C.int(0)
	if spin {
		s = 1
	}
	return perPage("handler", pages, func(e *C.int) C.longlong { return C.floor_handler(C.int(pages), s, e) })
}

func perPage(what string, pages int, f func(*C.int) C.longlong) (time.Duration, error) {
	if pages < 1 {
		return 0, fmt.Errorf("uffdfloor: %d pages", pages)
	}
	var e C.int
	ns := f(&e)
	if ns < 0 {
		return 0, fmt.Errorf("uffdfloor: %s: %w", what, unix.Errno(e))
	}
	return time.Duration(ns) / time.Duration(pages), nil
}
