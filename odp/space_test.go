package odp

import (
	"bytes"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// One buffer registered on two devices of the process, first ODP on one and pinned
// on the other, then ODP on both: data moves through each, one invalidation of the
// range clears both devices' entries, and the application's own madvise reaches both.
func TestOneBufferTwoDevices(t *testing.T) {
	nic0, nic1 := newNode(t, Config{Name: "nic0"}), newNode(t, Config{Name: "nic1"})
	peer0, peer1 := newNode(t, Config{Name: "peer0"}), newNode(t, Config{Name: "peer1"})
	require.NoError(t, ConnectLoopback(peer0.qp, nic0.qp))
	require.NoError(t, ConnectLoopback(peer1.qp, nic1.qp))
	require.Same(t, nic0.dev.as, nic1.dev.as, "one address space")
	src0, s0 := peer0.region(t, 16*ps, rw)
	src1, s1 := peer1.region(t, 16*ps, rw)
	fill(src0, 1)
	fill(src1, 2)

	buf, err := nic0.dev.Alloc(16 * ps) // nic0's Alloc, registered on both
	require.NoError(t, err)
	both := func(t *testing.T, m0, m1 *MR) {
		wc := peer0.post(t, write(s0, 0, 8*ps, m0, 0))
		require.Equal(t, WCSuccess, wc.Status, wc.Detail)
		wc = peer1.post(t, write(s1, 8*ps, 8*ps, m1, uint64(8*ps)))
		require.Equal(t, WCSuccess, wc.Status, wc.Detail)
		assert.True(t, bytes.Equal(src0[:8*ps], buf[:8*ps]), "through nic0")
		assert.True(t, bytes.Equal(src1[8*ps:], buf[8*ps:]), "through nic1")
	}

	m0, err := nic0.pd.RegMR(buf, rw|AccessOnDemand)
	require.NoError(t, err)
	m1, err := nic1.pd.RegMR(buf, rw) // pinned on the other device
	require.NoError(t, err)
	both(t, m0, m1)
	require.NoError(t, nic1.dev.Invalidate(uint64(addrOf(buf)), 16*uint64(ps)))
	assert.Zero(t, m0.Stats().ValidPages, "nic0's ODP entries cleared by nic1's call")
	assert.Equal(t, 16, m1.Stats().ValidPages, "a pinned MTT is not invalidated")
	assert.ErrorIs(t, nic1.dev.Free(buf), ErrBusy)
	require.NoError(t, m1.Dereg())

	m1, err = nic1.pd.RegMR(buf, rw|AccessOnDemand)
	require.NoError(t, err)
	both(t, m0, m1)
	assert.Positive(t, m0.Stats().ValidPages)
	assert.Positive(t, m1.Stats().ValidPages)
	e0, e1 := nic0.dev.Stats().Invalidations, nic1.dev.Stats().Invalidations
	require.NoError(t, nic0.dev.Invalidate(uint64(addrOf(buf)), 16*uint64(ps)))
	assert.Zero(t, m0.Stats().ValidPages)
	assert.Zero(t, m1.Stats().ValidPages)
	assert.Equal(t, e0+1, nic0.dev.Stats().Invalidations)
	assert.Equal(t, e1+1, nic1.dev.Stats().Invalidations, "each device counts its own MRs' invalidations")

	// The application's madvise: one REMOVE event, both devices' entries go.
	both(t, m0, m1)
	dontneed(t, buf)
	require.NoError(t, nic1.dev.SyncEvents())
	assert.Zero(t, m0.Stats().ValidPages)
	assert.Zero(t, m1.Stats().ValidPages)
	both(t, m0, m1)

	require.NoError(t, m0.Dereg())
	require.NoError(t, m1.Dereg())
	require.NoError(t, nic1.dev.Free(buf), "a buffer of the address space, freed through another device")
}

// A device's Close leaves mapped the buffers it allocated that another device's MR
// still uses; they go with the address space's last device.
func TestCloseKeepsBuffersOtherDevicesUse(t *testing.T) {
	d0, err := Open(Config{Name: "nic0"})
	require.NoError(t, err)
	n1 := newNode(t, Config{Name: "nic1"})
	shared, err := d0.Alloc(4 * ps)
	require.NoError(t, err)
	private, err := d0.Alloc(4 * ps)
	require.NoError(t, err)
	mr, err := n1.pd.RegMR(shared, rw|AccessOnDemand)
	require.NoError(t, err)
	require.NoError(t, d0.Close())

	shared[5] = 7 // still mapped: a fault served by the address space's server
	peer := newNode(t, Config{Name: "peer"})
	require.NoError(t, ConnectLoopback(peer.qp, n1.qp))
	_, pm := peer.region(t, ps, rw)
	wc := peer.post(t, read(pm, 0, 8, mr, 0))
	require.Equal(t, WCSuccess, wc.Status, wc.Detail)
	n1.dev.as.mu.RLock()
	_, sharedKept := n1.dev.as.bufferLocked(addrOf(shared), 1)
	_, privateKept := n1.dev.as.bufferLocked(addrOf(private), 1)
	n1.dev.as.mu.RUnlock()
	assert.True(t, sharedKept)
	assert.False(t, privateKept, "d0's unused buffer was unmapped with it")
}

// Devices with different address-space settings cannot share a buffer: the kernel
// lets one userfaultfd register a range.
func TestSpacesBySettings(t *testing.T) {
	a := newNode(t, Config{})
	b := newNode(t, Config{NoInvalidate: true})
	assert.NotSame(t, a.dev.as, b.dev.as)
	buf, err := a.dev.Alloc(ps)
	require.NoError(t, err)
	_, err = b.pd.RegMR(buf, rw|AccessOnDemand)
	assert.ErrorIs(t, err, ErrBadAddress)
}
