package odp

import "sync/atomic"

// keyAllocator hands out mlx5-style keys: a 24-bit index and an 8-bit variant. A freed
// index waits in a FIFO behind at least keyQuarantine others before reuse, and comes
// back with its variant advanced, so a stale key stays invalid.
type keyAllocator struct {
	next     uint32 // next never-used index
	free     []uint32
	variants map[uint32]uint8
	salt     uint8
}

const (
	keyQuarantine = 64
	maxKeyIndex   = 1<<24 - 1
)

func (k *keyAllocator) init(seed uint32) {
	k.next = 1 + seed%(1<<16) // start at a random index
	k.salt = uint8(seed >> 24)
	k.variants = map[uint32]uint8{}
}

func (k *keyAllocator) alloc() (uint32, bool) {
	var idx uint32
	if len(k.free) > keyQuarantine {
		idx, k.free = k.free[0], k.free[1:]
	} else if k.next <= maxKeyIndex {
		idx = k.next
		k.next++
		k.variants[idx] = k.salt ^ uint8(idx*0x9e)
	} else {
		return 0, false
	}
	return idx<<8 | uint32(k.variants[idx]), true
}

func (k *keyAllocator) release(key uint32) {
	idx := key >> 8
	k.variants[idx]++
	k.free = append(k.free, idx)
}

// mkeyTable is the NIC's memory key table, as mlx5's mkey context array: MRs by key
// index, read without a lock by the engines on every work request and request,
// written under Device.mu. Two levels of 4096 entries cover the 24-bit index; a
// second-level block is allocated when an index in it is first used.
type mkeyTable[T any] struct {
	blocks [1 << 12]atomic.Pointer[mkeyBlock[T]]
}

type mkeyBlock[T any] [1 << 12]atomic.Pointer[T]

// load returns the entry at key index idx, or nil.
func (t *mkeyTable[T]) load(idx uint32) *T {
	if idx > maxKeyIndex {
		return nil
	}
	b := t.blocks[idx>>12].Load()
	if b == nil {
		return nil
	}
	return b[idx&(1<<12-1)].Load()
}

// storeLocked sets the entry at key index idx (nil: none). Called with Device.mu held.
func (t *mkeyTable[T]) storeLocked(idx uint32, mr *T) {
	b := t.blocks[idx>>12].Load()
	if b == nil {
		if mr == nil {
			return
		}
		b = new(mkeyBlock[T])
		t.blocks[idx>>12].Store(b)
	}
	b[idx&(1<<12-1)].Store(mr)
}
