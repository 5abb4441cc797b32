package odp

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Keys come back only after the quarantine, with their variant advanced: a stale
// key never names the MR that reuses its index.
func TestKeyAllocatorQuarantine(t *testing.T) {
	var k keyAllocator
	k.init(12345)
	first, ok := k.alloc()
	require.True(t, ok)
	k.release(first)
	seen := map[uint32]bool{first: true}
	for i := 0; i < keyQuarantine; i++ {
		key, ok := k.alloc()
		require.True(t, ok)
		assert.NotEqual(t, first>>8, key>>8, "index reused within the quarantine")
		require.False(t, seen[key])
		seen[key] = true
		k.release(key)
	}
	again, ok := k.alloc()
	require.True(t, ok)
	assert.Equal(t, first>>8, again>>8, "the oldest freed index comes back first")
	assert.NotEqual(t, first, again, "with another variant")
}

// The mkey table finds what was stored at an index, in any second-level block, and
// nothing at indices never stored, cleared, or beyond 24 bits.
func TestMkeyTable(t *testing.T) {
	var tab mkeyTable[MR]
	a, b := &MR{key: 1}, &MR{key: 2}
	for _, idx := range []uint32{0, 1, 4095, 4096, 1 << 20, maxKeyIndex} {
		assert.Nil(t, tab.load(idx), "index %#x before any store", idx)
		tab.storeLocked(idx, a)
		assert.Same(t, a, tab.load(idx), "index %#x", idx)
		tab.storeLocked(idx, b)
		assert.Same(t, b, tab.load(idx), "index %#x replaced", idx)
		assert.Nil(t, tab.load(idx^1), "the neighbour of %#x", idx)
		tab.storeLocked(idx, nil)
		assert.Nil(t, tab.load(idx), "index %#x cleared", idx)
	}
	assert.Nil(t, tab.load(maxKeyIndex+1))
	tab.storeLocked(1<<23, nil) // clearing in a block never used allocates none
	assert.Nil(t, tab.blocks[(1<<23)>>12].Load())
}
