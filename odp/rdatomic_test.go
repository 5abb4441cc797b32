package odp

import (
	"bytes"
	"encoding/binary"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/odpemu/odpemu/transport/roce"
)

// lossyPair returns two connected nodes whose links lose, duplicate and reorder
// packets in both directions, in one process or over UDP (ODPEMU_WIRE=udp).
func lossyPair(t *testing.T, loss roce.Loss) (*node, *node) {
	t.Helper()
	a, b := newNode(t, Config{}), newNode(t, Config{})
	if wireUDP() {
		connectUDP(t, a.qp, b.qp, UDPConfig{Addr: addrA, Loss: loss}, UDPConfig{Addr: addrB, Loss: loss})
	} else {
		require.NoError(t, ConnectLoopbackLoss(a.qp, b.qp, loss))
	}
	for _, n := range []*node{a, b} { // a lost tail packet costs one timeout: 16.8 ms
		require.NoError(t, n.qp.ModifyAttr(QPAttr{Timeout: 12}, AttrTimeout))
	}
	return a, b
}

// A stream of READs and fetch-and-adds with many work requests in flight, over a
// link that loses packets both ways. The responder keeps the last max_dest_rd_atomic
// READs and atomics to answer their duplicates and drops older ones (class D), so a
// requester with more of them outstanding could ask again for one the responder no
// longer has, and retry until RETRY_EXC_ERR. The requester keeps at most
// max_rd_atomic outstanding, as a NIC does: every one completes, the data is whole,
// and each fetch-and-add was executed once.
func TestReadsAndAtomicsOutstandingBounded(t *testing.T) {
	a, b := lossyPair(t, roce.Loss{Seed: 7, Drop: 0.02, Duplicate: 0.01, Reorder: 0.02})
	const n, chunk = 1200, 512
	src, smr := b.region(t, n*chunk, rwa)
	back, bmr := a.region(t, n*chunk, AccessLocalWrite)
	for i := range src {
		src[i] = byte(i*7 + i>>9)
	}
	clear(src[:8])
	wrs := make([]SendWR, 0, n)
	adds := 0
	for i := 0; i < n; i++ {
		if i%10 == 9 {
			wrs = append(wrs, fetchAdd(bmr, i*chunk, smr, 0))
			adds++
		} else {
			wrs = append(wrs, read(bmr, i*chunk, chunk, smr, uint64(i*chunk)))
		}
		wrs[i].WRID, wrs[i].Flags = uint64(i), SendSignaled
	}
	stream(t, a, wrs, 128)
	for i := 0; i < n; i++ {
		if i%10 != 9 && i > 0 {
			require.True(t, bytes.Equal(src[i*chunk:(i+1)*chunk], back[i*chunk:(i+1)*chunk]), "READ %d", i)
		}
	}
	assert.EqualValues(t, adds, binary.NativeEndian.Uint64(src[:8]), "each fetch-and-add executed once")
	st := a.qp.Stats()
	t.Logf("requester %+v; responder %+v", st, b.qp.Stats())
	assert.Positive(t, st.Retransmissions, "the link lost packets")
	assert.Zero(t, st.RetryExc)
}
