package odp

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"testing"
	"time"

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

// max_rd_atomic bounds the READs a requester has outstanding, rounded up to a power of
// two as mlx5 programs it (0 counts as 1): over a link with a long delay, n READs posted
// at once take at least ceil(n/depth) round trips, since a READ can complete no sooner
// than one round trip after it left, and (with two round trips to spare for a loaded
// machine) not many more: the depth is used, the default one (16) sends all eight at
// once.
func TestMaxRdAtomicBoundsOutstandingReads(t *testing.T) {
	const delay, n = 10 * time.Millisecond, 8
	rtt := 2 * delay
	for _, c := range []struct {
		set        uint8
		depth      int
		useDefault bool
	}{{set: 0, depth: 1}, {set: 1, depth: 1}, {set: 3, depth: 4}, {useDefault: true, depth: DefaultRdAtomic}} {
		t.Run(fmt.Sprintf("max_rd_atomic=%d,default=%v", c.set, c.useDefault), func(t *testing.T) {
			a, b := pair(t, Config{Link: LinkModel{Delay: delay}})
			if !c.useDefault {
				require.NoError(t, a.qp.ModifyAttr(QPAttr{MaxRdAtomic: c.set}, AttrMaxRdAtomic))
			}
			assert.Equal(t, rdAtomicDepth(a.qp.Attr().MaxRdAtomic), c.depth)
			dst, dmr := a.region(t, n*64, rw)
			src, smr := b.region(t, n*64, rw)
			fill(src, 5)
			start := time.Now()
			for i := range n {
				require.NoError(t, a.qp.PostSend(SendWR{WRID: uint64(i), Opcode: OpRDMARead, Flags: SendSignaled,
					SGL: sge(dmr, i*64, 64), RemoteAddr: smr.Addr() + uint64(i*64), RKey: smr.RKey()}))
			}
			for i := range n {
				wc := wait(t, a.scq)
				require.Equal(t, WCSuccess, wc.Status, wc.Detail)
				require.EqualValues(t, i, wc.WRID)
			}
			elapsed := time.Since(start)
			assert.True(t, bytes.Equal(src, dst))
			rounds := (n + c.depth - 1) / c.depth
			assert.GreaterOrEqual(t, elapsed, time.Duration(rounds)*rtt,
				"%d READs, %d outstanding at most: %d round trips of %v", n, c.depth, rounds, rtt)
			if c.depth > 1 {
				assert.Less(t, elapsed, time.Duration(rounds+2)*rtt,
					"%d READs, %d outstanding: about %d round trips of %v", n, c.depth, rounds, rtt)
			}
		})
	}
}

// A depth beyond the device's (max_qp_init_rd_atom, max_qp_rd_atom) is refused: 16
// by default (mlx5's), Config.RdAtomic's on a device given another (128 in the rxe
// profile, rxe's), which its new QPs take.
func TestMaxRdAtomicLimit(t *testing.T) {
	for _, c := range []struct {
		cfg   Config
		limit int
	}{{Config{}, DefaultRdAtomic}, {ProfileRXE.Apply(Config{}), MaxRdAtomicLimit}, {Config{RdAtomic: 4}, 4}} {
		t.Run(fmt.Sprint(c.limit), func(t *testing.T) {
			n := newNode(t, c.cfg)
			assert.Equal(t, c.limit, n.dev.QueryDevice().MaxQPInitRdAtom)
			assert.Equal(t, c.limit, n.dev.QueryDevice().MaxQPRdAtom)
			assert.EqualValues(t, c.limit, n.qp.Attr().MaxRdAtomic, "a new QP takes the device's depth")
			assert.EqualValues(t, c.limit, n.qp.Attr().MaxDestRdAtomic)
			assert.ErrorIs(t, n.qp.ModifyAttr(QPAttr{MaxRdAtomic: uint8(c.limit + 1)}, AttrMaxRdAtomic), ErrInvalidArgument)
			assert.ErrorIs(t, n.qp.ModifyAttr(QPAttr{MaxDestRdAtomic: uint8(c.limit + 1)}, AttrMaxDestRdAtomic),
				ErrInvalidArgument)
			require.NoError(t, n.qp.ModifyAttr(QPAttr{MaxRdAtomic: uint8(c.limit), MaxDestRdAtomic: uint8(c.limit)},
				AttrMaxRdAtomic|AttrMaxDestRdAtomic))
		})
	}
	n := newNode(t, Config{})
	require.NoError(t, n.qp.ModifyAttr(QPAttr{MaxRdAtomic: 2, MaxDestRdAtomic: 5}, AttrMaxRdAtomic|AttrMaxDestRdAtomic))
	got := n.qp.Attr()
	assert.EqualValues(t, 2, got.MaxRdAtomic)
	assert.EqualValues(t, 5, got.MaxDestRdAtomic)
	for set, depth := range map[uint8]int{0: 1, 1: 1, 2: 2, 3: 4, 5: 8, 9: 16, 16: 16, 100: 128, 128: 128} {
		assert.Equal(t, depth, rdAtomicDepth(set), "max_rd_atomic %d", set)
	}
}
