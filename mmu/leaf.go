package mmu

import (
	"fmt"
	"unsafe"
)

// An entry is one 64-bit word, as hmm_pfns packs a page's flags with its frame: the
// valid and writable bits on top, a 14-bit change count below them, the frame number
// in the low 48 bits (physical addresses have at most 52 bits, frames of 4 KiB pages
// at most 40).
const (
	wordValid    = uint64(1) << 63
	wordWritable = uint64(1) << 62
	genShift     = 48
	genBits      = 14
	genMask      = (uint64(1)<<genBits - 1) << genShift
	pfnMask      = uint64(1)<<genShift - 1
)

// Leaves hold leafPages consecutive entries. A leaf exists only while one of its
// entries is valid: it is created when a page of it is first mapped and freed when
// its last valid entry is invalidated, so a table costs nothing per page never
// mapped. Sixteen pages is the default fault-around window: one network page fault
// fills one leaf.
const (
	leafShift = 4
	leafPages = 1 << leafShift
)

type leaf struct {
	w        [leafPages]uint64
	valid    uint8 // valid entries
	writable uint8 // valid and writable entries
}

// leafBytes is what one leaf costs: the leaf and its slot in the map (key, pointer
// and the map's control byte, at the map's full load).
const leafBytes = int(unsafe.Sizeof(leaf{})) + 8 + 8 + 2

// entries is a sparse array of page entries, keyed by leaf index. It is not safe for
// concurrent use: Table.mu protects it.
type entries struct {
	leaves map[int]*leaf
	valid  int // valid entries over all leaves

	// The leaf last looked up, for runs of pages in one leaf.
	lastIdx  int
	lastLeaf *leaf
}

func newEntries() entries { return entries{leaves: map[int]*leaf{}, lastIdx: -1} }

// leaf returns leaf li, creating it if create is set (else nil if absent).
func (e *entries) leaf(li int, create bool) *leaf {
	if li == e.lastIdx {
		return e.lastLeaf
	}
	l := e.leaves[li]
	if l == nil {
		if !create {
			return nil
		}
		l = &leaf{}
		e.leaves[li] = l
	}
	e.lastIdx, e.lastLeaf = li, l
	return l
}

func (e *entries) free(li int) {
	delete(e.leaves, li)
	if e.lastIdx == li {
		e.lastIdx, e.lastLeaf = -1, nil
	}
}

// word returns page p's entry word (0 for a page of no leaf).
func (e *entries) word(p int) uint64 {
	if l := e.leaf(p>>leafShift, false); l != nil {
		return l.w[p&(leafPages-1)]
	}
	return 0
}

// mapPage makes page p valid with frame pfn and reports whether it was invalid.
// Writable is granted if asked, or kept if the entry had it for the same frame. The
// change count moves when the entry was invalid or had another frame.
func (e *entries) mapPage(p int, pfn uint64, writable bool) (newlyValid bool) {
	if pfn > pfnMask {
		panic(fmt.Sprintf("mmu: frame %#x does not fit an entry", pfn))
	}
	l := e.leaf(p>>leafShift, true)
	i := p & (leafPages - 1)
	old := l.w[i]
	wasValid, wasWritable := old&wordValid != 0, old&wordWritable != 0
	gen := old & genMask
	if !wasValid || old&pfnMask != pfn {
		gen = (gen + 1<<genShift) & genMask
	}
	w := wordValid | gen | pfn
	if writable || (wasValid && wasWritable && old&pfnMask == pfn) {
		w |= wordWritable
	}
	l.w[i] = w
	if !wasValid {
		l.valid++
		e.valid++
	}
	if wasValid && wasWritable {
		l.writable--
	}
	if w&wordWritable != 0 {
		l.writable++
	}
	return !wasValid
}

// missing returns the first page in [first, first+n) whose entry is invalid, or not
// writable when write is set, or -1.
func (e *entries) missing(first, n int, write bool) int {
	end := first + n
	for p := first; p < end; {
		li := p >> leafShift
		next := (li + 1) << leafShift
		l := e.leaf(li, false)
		switch {
		case l == nil:
			return p
		case l.valid == leafPages && (!write || l.writable == leafPages):
		default:
			need := wordValid
			if write {
				need |= wordWritable
			}
			for q := p; q < min(end, next); q++ {
				if l.w[q&(leafPages-1)]&need != need {
					return q
				}
			}
		}
		p = next
	}
	return -1
}

// invalidate clears the entries of [first, first+n), frees leaves left without a
// valid entry and returns how many valid entries it cleared. It visits the leaves
// that exist when they are fewer than the range's, so that invalidating a huge
// range (an implicit MR's) costs what is mapped, not what is covered.
func (e *entries) invalidate(first, n int) int {
	end := first + n
	cleared := 0
	clearLeaf := func(li int, l *leaf) {
		base := li << leafShift
		for q := max(first, base); q < min(end, base+leafPages); q++ {
			w := &l.w[q-base]
			if *w&wordValid == 0 {
				continue
			}
			if *w&wordWritable != 0 {
				l.writable--
			}
			l.valid--
			cleared++
			*w = (*w&genMask + 1<<genShift) & genMask // invalid, frame forgotten, counted
		}
		if l.valid == 0 {
			e.free(li)
		}
	}
	if n == 0 {
		return 0
	}
	lo, hi := first>>leafShift, (end-1)>>leafShift
	if hi-lo+1 > len(e.leaves) {
		for li, l := range e.leaves {
			if li >= lo && li <= hi {
				clearLeaf(li, l)
			}
		}
	} else {
		for li := lo; li <= hi; li++ {
			if l := e.leaf(li, false); l != nil {
				clearLeaf(li, l)
			}
		}
	}
	e.valid -= cleared
	return cleared
}

func unpack(w uint64) Entry {
	return Entry{Valid: w&wordValid != 0, Writable: w&wordWritable != 0, PFN: w & pfnMask,
		Gen: uint32((w & genMask) >> genShift)}
}
