package odp

// Ports of rdma-core's tests/test_odp.py: RC traffic over ODP memory whose pages are
// dropped (MADV_DONTNEED) before every iteration, so that every iteration takes
// network page faults, with ODP and pinned MRs mixed; RDMA READ and WRITE; prefetch,
// synchronous and asynchronous, PREFETCH, PREFETCH_WRITE and PREFETCH_NO_FAULT.
// Atomics are in TestAtomics, implicit MRs in implicit_test.go.

import (
	"bytes"
	"fmt"
	"runtime"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

const odpIters = 100

// side is one player of test_odp.py: a node and its registered message buffer.
type side struct {
	*node
	buf []byte
	mr  *MR
}

func players(t *testing.T, clientODP, serverODP bool, size int) (side, side) {
	a, b := pair(t, Config{})
	access := func(odp bool) Access {
		if odp {
			return rwa | AccessOnDemand
		}
		return rwa
	}
	c, s := side{node: a}, side{node: b}
	c.buf, c.mr = a.region(t, size, access(clientODP))
	s.buf, s.mr = b.region(t, size, access(serverODP))
	return c, s
}

// drop drops the side's pages if its MR is ODP (test_odp.py's force_page_faults).
func (s side) drop(t *testing.T) {
	if s.mr.OnDemand() {
		dontneed(t, s.buf)
	}
}

// traffic is test_utils' traffic(): the client SENDs a message, the server receives
// and SENDs one back, iters times, each message different and checked.
func traffic(t *testing.T, c, s side, iters int, force bool) {
	t.Helper()
	for i := 0; i < iters; i++ {
		if force {
			c.drop(t)
			s.drop(t)
		}
		fill(c.buf, byte(i))
		require.NoError(t, s.qp.PostRecv(RecvWR{WRID: uint64(i), SGL: sge(s.mr, 0, len(s.buf))}))
		wc := c.post(t, SendWR{WRID: uint64(i), Opcode: OpSend, SGL: sge(c.mr, 0, len(c.buf))})
		require.Equal(t, WCSuccess, wc.Status, "iteration %d: %s", i, wc.Detail)
		rwc := wait(t, s.rcq)
		require.Equal(t, WCSuccess, rwc.Status, rwc.Detail)
		require.True(t, bytes.Equal(c.buf, s.buf), "iteration %d: server received", i)

		fill(s.buf, byte(i)^0xff)
		require.NoError(t, c.qp.PostRecv(RecvWR{WRID: uint64(i), SGL: sge(c.mr, 0, len(c.buf))}))
		wc = s.post(t, SendWR{WRID: uint64(i), Opcode: OpSend, SGL: sge(s.mr, 0, len(s.buf))})
		require.Equal(t, WCSuccess, wc.Status, wc.Detail)
		rwc = wait(t, c.rcq)
		require.Equal(t, WCSuccess, rwc.Status, rwc.Detail)
		require.True(t, bytes.Equal(c.buf, s.buf), "iteration %d: client received", i)
	}
}

// faultsPerIteration checks that every ODP side faulted at least once per iteration.
func faultsPerIteration(t *testing.T, iters int, sides ...side) {
	for _, s := range sides {
		if s.mr.OnDemand() {
			assert.GreaterOrEqual(t, s.mr.Stats().PageFaults, uint64(iters), "network page faults")
		} else {
			assert.Zero(t, s.mr.Stats().PageFaults)
		}
	}
}

func mixes() []struct{ client, server bool } {
	return []struct{ client, server bool }{{true, true}, {true, false}, {false, true}}
}

func mixName(c, s bool) string {
	n := func(odp bool) string {
		if odp {
			return "odp"
		}
		return "pinned"
	}
	return n(c) + "-" + n(s)
}

func TestODPRCTraffic(t *testing.T) {
	for _, m := range mixes() {
		t.Run(mixName(m.client, m.server), func(t *testing.T) {
			c, s := players(t, m.client, m.server, 3*ps+100) // pages partly covered
			traffic(t, c, s, odpIters, true)
			faultsPerIteration(t, odpIters, c, s)
		})
	}
}

func TestODPRCRDMAWriteRead(t *testing.T) {
	for _, op := range []Opcode{OpRDMAWrite, OpRDMARead} {
		for _, m := range mixes() {
			t.Run(fmt.Sprintf("%s/%s", opName(op), mixName(m.client, m.server)), func(t *testing.T) {
				c, s := players(t, m.client, m.server, 2*ps)
				for i := 0; i < odpIters; i++ {
					c.drop(t)
					s.drop(t)
					src, dst := c.buf, s.buf
					if op == OpRDMARead {
						src, dst = s.buf, c.buf
					}
					fill(src, byte(i))
					wc := c.post(t, SendWR{Opcode: op, SGL: sge(c.mr, 0, 2*ps), RemoteAddr: s.mr.Addr(), RKey: s.mr.RKey()})
					require.Equal(t, WCSuccess, wc.Status, "iteration %d: %s", i, wc.Detail)
					require.True(t, bytes.Equal(src, dst), "iteration %d", i)
				}
				faultsPerIteration(t, odpIters, c, s)
				switch {
				case s.mr.OnDemand() && op == OpRDMAWrite:
					assert.Positive(t, c.qp.Stats().RNRNaksReceived, "responder faults were RNR NAKed")
				case op == OpRDMARead:
					assert.Zero(t, c.qp.Stats().RNRNaksReceived, "a READ is never RNR NAKed: the responder waits for its fault")
				}
			})
		}
	}
}

// Synchronous prefetch maps the range before traffic: the first iteration takes no
// network page fault at the prefetched side; asynchronous prefetch returns at once
// and is counted when it lands; NO_FAULT maps only pages already present.
func TestODPPrefetchRCTraffic(t *testing.T) {
	for _, v := range []struct {
		advice Advice
		flags  AdviseFlags
	}{
		{AdvisePrefetch, AdviseFlush}, {AdvisePrefetchWrite, AdviseFlush}, {AdvisePrefetch, 0},
		{AdvisePrefetchWrite, 0}, {AdvisePrefetchNoFault, AdviseFlush}, {AdvisePrefetchNoFault, 0},
	} {
		t.Run(fmt.Sprintf("advice=%d/flush=%v", v.advice, v.flags != 0), func(t *testing.T) {
			c, s := players(t, true, true, 4*ps)
			if v.advice == AdvisePrefetchNoFault {
				fill(s.buf, 1) // present, so that NO_FAULT has pages to map
			}
			require.NoError(t, s.pd.AdviseMR(v.advice, v.flags, sge(s.mr, 0, 4*ps)))
			st := s.dev.Stats()
			if v.flags == 0 {
				assert.EqualValues(t, 1, st.AsyncPrefetches)
				for s.dev.Stats().Prefetches == 0 { // lands in the background
					runtime.Gosched()
				}
			}
			st = s.dev.Stats()
			assert.EqualValues(t, 1, st.Prefetches)
			assert.EqualValues(t, 4, st.PagesPrefetched, "every page of the range mapped")
			assert.Zero(t, st.PrefetchErrors)
			assert.Equal(t, 4, s.mr.Stats().ValidPages)
			if v.advice == AdvisePrefetchWrite || v.advice == AdvisePrefetchNoFault {
				// Writable entries: a SEND into them needs no fault.
				traffic(t, c, s, 1, false)
				assert.Zero(t, s.mr.Stats().PageFaults, "prefetched pages took no network page fault")
			}
			traffic(t, c, s, 10, true)
			faultsPerIteration(t, 10, c, s)
		})
	}

	// NO_FAULT on pages never touched maps nothing; a bad SGE fails before any work.
	c, s := players(t, true, true, 4*ps)
	require.NoError(t, s.pd.AdviseMR(AdvisePrefetchNoFault, AdviseFlush, sge(s.mr, 0, 4*ps)))
	assert.Zero(t, s.dev.Stats().PagesPrefetched)
	bad := append(sge(s.mr, 0, ps), SGE{Addr: s.mr.Addr(), Length: 8, LKey: s.mr.LKey() ^ 0x100})
	assert.ErrorIs(t, s.pd.AdviseMR(AdvisePrefetch, 0, bad), ErrInvalidArgument)
	assert.ErrorIs(t, s.pd.AdviseMR(AdvisePrefetch, 0, sge(s.mr, 0, 4*ps+1)), ErrInvalidArgument)
	assert.ErrorIs(t, s.pd.AdviseMR(AdvisePrefetch, 1<<5, sge(s.mr, 0, 8)), ErrInvalidArgument)
	assert.ErrorIs(t, s.pd.AdviseMR(AdvisePrefetch, 0, nil), ErrInvalidArgument)
	assert.ErrorIs(t, c.pd.AdviseMR(AdvisePrefetch, 0, sge(s.mr, 0, 8)), ErrInvalidArgument, "an MR of another device")
	assert.Zero(t, s.dev.Stats().AsyncPrefetches, "nothing started")
}
