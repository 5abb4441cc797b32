package pagefault

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"os"
	"strconv"
)

// WholeMappingPages widens [start, end) to whole pages of the mappings at its two ends,
// as /proc/self/smaps gives their page size (KernelPageSize): ordinary memory leaves
// it as it is, a hugetlbfs mapping (MAP_HUGETLB, SHM_HUGETLB) widens it to its huge
// pages, the only ranges of such a mapping UFFDIO_REGISTER takes (EINVAL otherwise).
// An end in no mapping stays where it is.
func WholeMappingPages(start, end uintptr) (uintptr, uintptr, error) {
	f, err := os.Open("/proc/self/smaps")
	if err != nil {
		return start, end, err
	}
	defer func() { _ = f.Close() }()
	return wholePages(f, start, end)
}

// wholePages is WholeMappingPages over smaps text.
func wholePages(r io.Reader, start, end uintptr) (uintptr, uintptr, error) {
	if end <= start {
		return start, end, nil
	}
	sizes, err := pageSizesAt(r, start, end-1)
	if err != nil {
		return start, end, err
	}
	if ps := sizes[0]; ps > 0 {
		start &^= ps - 1
	}
	if ps := sizes[1]; ps > 0 {
		end = (end + ps - 1) &^ (ps - 1)
	}
	return start, end, nil
}

// pageSizesAt returns the page sizes of the mappings holding addresses a and b, 0
// for an address in none, reading smaps text: a header line per mapping
// ("lo-hi perms offset dev inode path", hex bounds), then "Key: value" lines, among
// them "KernelPageSize: N kB".
func pageSizesAt(r io.Reader, a, b uintptr) ([2]uintptr, error) {
	var sizes [2]uintptr
	var lo, hi uintptr
	in := false // the current mapping holds a or b
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		line := sc.Bytes()
		if l, h, ok := mappingHeader(line); ok {
			lo, hi = l, h
			in = a >= lo && a < hi || b >= lo && b < hi
			continue
		}
		if !in {
			continue
		}
		v, ok := bytes.CutPrefix(line, []byte("KernelPageSize:"))
		if !ok {
			continue
		}
		f := bytes.Fields(v)
		if len(f) != 2 || string(f[1]) != "kB" {
			return sizes, fmt.Errorf("pagefault: smaps: %q", line)
		}
		kb, err := strconv.ParseUint(string(f[0]), 10, 32)
		if err != nil || kb == 0 || kb&(kb-1) != 0 {
			return sizes, fmt.Errorf("pagefault: smaps: page size %q", line)
		}
		for i, x := range []uintptr{a, b} {
			if x >= lo && x < hi {
				sizes[i] = uintptr(kb) << 10
			}
		}
		in = false
	}
	return sizes, sc.Err()
}

// mappingHeader parses the bounds of a smaps (or maps) header line,
// "7f0000000000-7f0000200000 rw-s ...".
func mappingHeader(line []byte) (lo, hi uintptr, ok bool) {
	sp := bytes.IndexByte(line, ' ')
	if sp < 0 {
		return 0, 0, false
	}
	l, h, found := bytes.Cut(line[:sp], []byte("-"))
	if !found {
		return 0, 0, false
	}
	x, err1 := strconv.ParseUint(string(l), 16, 64)
	y, err2 := strconv.ParseUint(string(h), 16, 64)
	if err1 != nil || err2 != nil || y <= x {
		return 0, 0, false
	}
	return uintptr(x), uintptr(y), true
}
