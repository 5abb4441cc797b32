package odp

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// TestRereg: an MR's access rights and PD change in place under the same keys; the
// responder checks the new ones from then on (test_mr.py's rereg flows: traffic
// refused after the change, the QPs reset and connected again, traffic after the
// change back); what Rereg cannot do fails with typed errors.
func TestRereg(t *testing.T) {
	for _, mode := range memModes {
		t.Run(mode.name, func(t *testing.T) {
			a, b := pair(t, Config{})
			src, smr := a.region(t, ps, rw)
			dst, dmr := b.region(t, ps, rw|mode.odp)
			lkey, rkey := dmr.LKey(), dmr.RKey()
			src[0] = 1
			write := func(id uint64) WC {
				t.Helper()
				require.NoError(t, a.qp.PostSend(SendWR{WRID: id, Opcode: OpRDMAWrite, SGL: sge(smr, 0, 64), Flags: SendSignaled,
					RemoteAddr: dmr.Addr(), RKey: rkey}))
				return wait(t, a.scq)
			}
			restate := func() {
				t.Helper()
				require.NoError(t, a.qp.Modify(StateReset))
				require.NoError(t, b.qp.Modify(StateReset))
				rewire(t, a.qp, b.qp)
			}
			require.Equal(t, WCSuccess, write(1).Status)

			require.NoError(t, dmr.Rereg(nil, AccessLocalWrite|mode.odp))
			require.Equal(t, AccessLocalWrite|mode.odp, dmr.Access())
			require.Equal(t, WCRemAccessErr, write(2).Status, "WRITE after REMOTE_WRITE was taken away")
			assert.Contains(t, b.qp.RespError(), "lacks")
			restate()
			require.NoError(t, dmr.Rereg(nil, rw|mode.odp))
			src[0] = 2
			require.Equal(t, WCSuccess, write(3).Status)
			require.Equal(t, byte(2), dst[0])

			pd2, err := b.dev.AllocPD()
			require.NoError(t, err)
			require.NoError(t, dmr.Rereg(pd2, rw|mode.odp))
			require.ErrorIs(t, pd2.Dealloc(), ErrBusy, "the MR is in it now")
			require.Equal(t, WCRemAccessErr, write(4).Status, "WRITE through a QP of the MR's old PD")
			assert.Contains(t, b.qp.RespError(), "another PD")
			restate()
			require.NoError(t, dmr.Rereg(b.pd, rw|mode.odp))
			require.NoError(t, pd2.Dealloc())
			src[0] = 3
			require.Equal(t, WCSuccess, write(5).Status)
			require.Equal(t, byte(3), dst[0])
			require.Equal(t, [2]uint32{lkey, rkey}, [2]uint32{dmr.LKey(), dmr.RKey()}, "the keys stay")

			// What Rereg refuses, leaving the MR as it was.
			other := newNode(t, Config{})
			for _, bad := range []struct {
				pd     *PD
				access Access
			}{
				{nil, AccessRemoteWrite},                // without LOCAL_WRITE
				{nil, rw | (mode.odp ^ AccessOnDemand)}, // on demand or not: a new registration
				{nil, 1 << 30},                          // unknown
				{other.pd, rw | mode.odp},               // another device's PD
				{pd2, rw | mode.odp},                    // deallocated
			} {
				require.ErrorIs(t, dmr.Rereg(bad.pd, bad.access), ErrInvalidArgument, "%+v", bad)
			}
			require.Equal(t, rw|mode.odp, dmr.Access())
			require.Equal(t, WCSuccess, write(6).Status)
			require.NoError(t, dmr.Dereg())
			require.ErrorIs(t, dmr.Rereg(nil, rw|mode.odp), ErrInvalidArgument, "a deregistered MR")
		})
	}
}

// TestReregPinnedGainsWrite: a pinned MR registered read-only over the application's
// untouched memory (whose pages the kernel may leave as the shared zero page) and
// given LOCAL_WRITE takes WRITEs into the application's pages, with no stale DMA for
// the audit; over a read-only mapping the change fails with ErrBadAddress.
func TestReregPinnedGainsWrite(t *testing.T) {
	a, b := pair(t, Config{Audit: true})
	mem, err := unix.Mmap(-1, 0, 4*ps, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	require.NoError(t, err)
	t.Cleanup(func() { _ = unix.Munmap(mem) })
	dmr, err := b.pd.RegMR(mem, AccessRemoteRead)
	require.NoError(t, err)
	require.NoError(t, dmr.Rereg(nil, rw))
	src, smr := a.region(t, 4*ps, rw)
	for i := range src {
		src[i] = byte(i*3 + 7)
	}
	require.NoError(t, a.qp.PostSend(SendWR{WRID: 1, Opcode: OpRDMAWrite, SGL: sge(smr, 0, 4*ps), Flags: SendSignaled,
		RemoteAddr: dmr.Addr(), RKey: dmr.RKey()}))
	wc := wait(t, a.scq)
	require.Equal(t, WCSuccess, wc.Status, wc.Detail)
	require.Equal(t, src, mem, "the WRITE landed in the application's pages")
	require.Zero(t, dmr.Stats().StaleDMAs)
	require.NoError(t, dmr.Dereg())

	ro, err := unix.Mmap(-1, 0, ps, unix.PROT_READ, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	require.NoError(t, err)
	t.Cleanup(func() { _ = unix.Munmap(ro) })
	rmr, err := b.pd.RegMR(ro, AccessRemoteRead)
	require.NoError(t, err)
	require.ErrorIs(t, rmr.Rereg(nil, rw), ErrBadAddress)
	require.Equal(t, AccessRemoteRead, rmr.Access())
	require.NoError(t, rmr.Dereg())
}
