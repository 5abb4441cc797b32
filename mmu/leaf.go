package mmu

import (
	"fmt"
	"sync/atomic"
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

// Leaves hang from a radix tree of directories, as a CPU's page table does: the
// bottom directories hold 16 leaves (256 pages), those above 256 directories each,
// with as many levels as the table's span needs (one for up to 1 MiB of 4 KiB pages,
// three for 4 GiB, five for a 47-bit address space). A directory is allocated when a
// leaf below it is and freed with its last one; small directories at the bottom keep
// a scattered table small (a 1 GiB MR with 1% of its pages mapped in scattered
// fault-around windows costs about 50 KiB).
const (
	bottomShift = 4
	upperShift  = 8
)

// below is how many bits of a leaf index the levels below lvl consume (the bottom
// level is 0), and fanout a directory's slots at lvl.
func below(lvl int) int {
	if lvl == 0 {
		return 0
	}
	return bottomShift + upperShift*(lvl-1)
}

func fanout(lvl int) int {
	if lvl == 0 {
		return 1 << bottomShift
	}
	return 1 << upperShift
}

type leaf struct {
	w        [leafPages]atomic.Uint64
	valid    uint8 // valid entries (table lock)
	writable uint8 // valid and writable entries (table lock)
}

// dir is a directory: slots for directories of the level below, or for leaves at the
// bottom level (a bottom slot holds a *leaf as a *dir: leafIn and setLeaf convert,
// and nothing reads it as a dir). The slots are read without a lock.
type dir struct {
	slots []atomic.Pointer[dir]
	n     int // occupied slots (table lock)
}

func (d *dir) leafIn(i int) *leaf { return (*leaf)(unsafe.Pointer(d.slots[i].Load())) }

func (d *dir) setLeaf(i int, l *leaf) { d.slots[i].Store((*dir)(unsafe.Pointer(l))) }

// leafBytes is what one leaf costs.
const leafBytes = int(unsafe.Sizeof(leaf{}))

// entries is a sparse array of page entries: a radix tree of directories and leaves.
// Writers (mapPage, invalidate) hold the table lock; found, missing and word read
// without it (atomically), for BeginDMA.
type entries struct {
	root     *dir
	levels   int // directory levels, the root's included
	valid    int // valid entries over all leaves (table lock)
	leaves   int // leaves allocated (table lock)
	dirBytes int // what the directories below the root take (table lock)

	// The leaf a writer last looked up, for runs of pages in one leaf (table lock).
	lastIdx  int
	lastLeaf *leaf
}

func newEntries(npages int) entries {
	n := max((npages+leafPages-1)>>leafShift, 1) // leaves the span holds
	levels := 1
	for 1<<(below(levels-1)+fanoutShift(levels-1)) < n {
		levels++
	}
	b := below(levels - 1)
	rootSlots := (n + 1<<b - 1) >> b
	return entries{root: newDir(rootSlots), levels: levels, lastIdx: -1}
}

func fanoutShift(lvl int) int {
	if lvl == 0 {
		return bottomShift
	}
	return upperShift
}

func newDir(slots int) *dir {
	// A directory and its slots in one allocation, for the usual sizes.
	switch slots {
	case 1 << bottomShift:
		b := &struct {
			dir
			a [1 << bottomShift]atomic.Pointer[dir]
		}{}
		b.slots = b.a[:]
		return &b.dir
	case 1 << upperShift:
		u := &struct {
			dir
			a [1 << upperShift]atomic.Pointer[dir]
		}{}
		u.slots = u.a[:]
		return &u.dir
	}
	return &dir{slots: make([]atomic.Pointer[dir], slots)}
}

// slot returns leaf li's index in its directory at level lvl (0: the bottom).
func (e *entries) slot(li, lvl int) int {
	i := li >> below(lvl)
	if lvl < e.levels-1 {
		i &= fanout(lvl) - 1
	}
	return i
}

// found returns leaf li, or nil if it is absent. It takes no lock.
func (e *entries) found(li int) *leaf {
	d := e.root
	for lvl := e.levels - 1; lvl > 0; lvl-- {
		if d = d.slots[e.slot(li, lvl)].Load(); d == nil {
			return nil
		}
	}
	return d.leafIn(e.slot(li, 0))
}

// leaf returns leaf li, creating it (and its directories) if create is set, else
// nil if absent. Called with the table lock held.
func (e *entries) leaf(li int, create bool) *leaf {
	if li == e.lastIdx {
		return e.lastLeaf
	}
	d := e.root
	for lvl := e.levels - 1; lvl > 0; lvl-- {
		s := &d.slots[e.slot(li, lvl)]
		next := s.Load()
		if next == nil {
			if !create {
				return nil
			}
			next = newDir(fanout(lvl - 1))
			s.Store(next)
			d.n++
			e.dirBytes += fanout(lvl-1) * 8
		}
		d = next
	}
	i := e.slot(li, 0)
	l := d.leafIn(i)
	if l == nil {
		if !create {
			return nil
		}
		l = &leaf{}
		d.setLeaf(i, l)
		d.n++
		e.leaves++
	}
	e.lastIdx, e.lastLeaf = li, l
	return l
}

// free unlinks leaf li, and the directories it leaves empty. Its entries were
// cleared first: a reader that still holds it finds them invalid. Called with the
// table lock held.
func (e *entries) free(li int) {
	var path [8]*dir // the directories from the root down
	d := e.root
	for lvl := e.levels - 1; lvl > 0; lvl-- {
		path[lvl] = d
		d = d.slots[e.slot(li, lvl)].Load()
	}
	d.setLeaf(e.slot(li, 0), nil)
	d.n--
	e.leaves--
	for lvl := 1; lvl < e.levels && d.n == 0; lvl++ {
		parent := path[lvl]
		parent.slots[e.slot(li, lvl)].Store(nil)
		parent.n--
		e.dirBytes -= fanout(lvl-1) * 8
		d = parent
	}
	if e.lastIdx == li {
		e.lastIdx, e.lastLeaf = -1, nil
	}
}

// word returns page p's entry word (0 for a page of no leaf). It takes no lock.
func (e *entries) word(p int) uint64 {
	if l := e.found(p >> leafShift); l != nil {
		return l.w[p&(leafPages-1)].Load()
	}
	return 0
}

// mapPage makes page p valid with frame pfn and reports whether it was invalid.
// Writable is granted if asked, or kept if the entry had it for the same frame. The
// change count moves when the entry was invalid or had another frame. Called with
// the table lock held.
func (e *entries) mapPage(p int, pfn uint64, writable bool) (newlyValid bool) {
	if pfn > pfnMask {
		panic(fmt.Sprintf("mmu: frame %#x does not fit an entry", pfn))
	}
	l := e.leaf(p>>leafShift, true)
	i := p & (leafPages - 1)
	old := l.w[i].Load()
	wasValid, wasWritable := old&wordValid != 0, old&wordWritable != 0
	gen := old & genMask
	if !wasValid || old&pfnMask != pfn {
		gen = (gen + 1<<genShift) & genMask
	}
	w := wordValid | gen | pfn
	if writable || (wasValid && wasWritable && old&pfnMask == pfn) {
		w |= wordWritable
	}
	l.w[i].Store(w)
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
// writable when write is set, or -1. It takes no lock: entries are read atomically,
// each leaf found once.
func (e *entries) missing(first, n int, write bool) int {
	need := wordValid
	if write {
		need |= wordWritable
	}
	end := first + n
	for p := first; p < end; {
		li := p >> leafShift
		next := (li + 1) << leafShift
		l := e.found(li)
		if l == nil {
			return p
		}
		for q := p; q < min(end, next); q++ {
			if l.w[q&(leafPages-1)].Load()&need != need {
				return q
			}
		}
		p = next
	}
	return -1
}

// invalidate clears the entries of [first, first+n), frees leaves left without a
// valid entry and returns how many valid entries it cleared. It visits the
// directories and leaves that exist, so that invalidating a huge range (an implicit
// MR's) costs what is mapped, not what is covered. Called with the table lock held.
func (e *entries) invalidate(first, n int) int {
	if n == 0 {
		return 0
	}
	end := first + n
	cleared := 0
	var empty []int // leaves emptied: freed after the walk
	clearLeaf := func(li int, l *leaf) {
		base := li << leafShift
		for q := max(first, base); q < min(end, base+leafPages); q++ {
			w := &l.w[q-base]
			old := w.Load()
			if old&wordValid == 0 {
				continue
			}
			if old&wordWritable != 0 {
				l.writable--
			}
			l.valid--
			cleared++
			w.Store((old&genMask + 1<<genShift) & genMask) // invalid, frame forgotten, counted
		}
		if l.valid == 0 {
			empty = append(empty, li)
		}
	}
	lo, hi := first>>leafShift, (end-1)>>leafShift
	var walk func(d *dir, lvl, base int)
	walk = func(d *dir, lvl, base int) { // base: the first leaf index d covers
		width := 1 << below(lvl) // leaves per slot at this level
		for s := max(0, (lo-base)/width); s < len(d.slots); s++ {
			at := base + s*width
			if at > hi {
				return
			}
			if lvl == 0 {
				if l := d.leafIn(s); l != nil {
					clearLeaf(at, l)
				}
			} else if k := d.slots[s].Load(); k != nil {
				walk(k, lvl-1, at)
			}
		}
	}
	walk(e.root, e.levels-1, 0)
	for _, li := range empty {
		e.free(li)
	}
	e.valid -= cleared
	return cleared
}

func unpack(w uint64) Entry {
	return Entry{Valid: w&wordValid != 0, Writable: w&wordWritable != 0, PFN: w & pfnMask,
		Gen: uint32((w & genMask) >> genShift)}
}
