package odp

import (
	"runtime"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// env is a connected pair with a set of MRs for error cases.
type env struct {
	a, b         *node
	src          *MR // a: LOCAL_WRITE
	srcRO        *MR // a: no LOCAL_WRITE
	dst          *MR // b: LOCAL_WRITE | REMOTE_WRITE | REMOTE_READ
	dstRO        *MR // b: REMOTE_READ only
	dstWO        *MR // b: LOCAL_WRITE | REMOTE_WRITE
	dstAtomic    *MR // b: rw | REMOTE_ATOMIC
	otherPD      *MR // b: registered in another PD
	deregistered *MR // b: deregistered
	deregLocal   *MR // a: deregistered
}

func newEnv(t *testing.T, odp Access) *env {
	a, b := pair(t, Config{})
	e := &env{a: a, b: b}
	_, e.src = a.region(t, 64<<10, AccessLocalWrite|odp)
	_, e.srcRO = a.region(t, 64<<10, odp)
	_, e.dst = b.region(t, 64<<10, rw|odp)
	_, e.dstRO = b.region(t, 64<<10, AccessRemoteRead|odp)
	_, e.dstWO = b.region(t, 64<<10, AccessLocalWrite|AccessRemoteWrite|odp)
	_, e.dstAtomic = b.region(t, 64<<10, rwa|odp)
	pd2, err := b.dev.AllocPD()
	require.NoError(t, err)
	buf, err := b.dev.Alloc(64 << 10)
	require.NoError(t, err)
	e.otherPD, err = pd2.RegMR(buf, rw|odp)
	require.NoError(t, err)
	_, e.deregistered = b.region(t, 64<<10, rw|odp)
	require.NoError(t, e.deregistered.Dereg())
	_, e.deregLocal = a.region(t, 64<<10, AccessLocalWrite|odp)
	require.NoError(t, e.deregLocal.Dereg())
	return e
}

func write(src *MR, off, n int, dst *MR, roff uint64) SendWR {
	return SendWR{WRID: 7, Opcode: OpRDMAWrite, SGL: sge(src, off, n), Flags: SendSignaled,
		RemoteAddr: dst.Addr() + roff, RKey: dst.RKey()}
}

func read(dst *MR, off, n int, src *MR, roff uint64) SendWR {
	wr := write(dst, off, n, src, roff)
	wr.Opcode = OpRDMARead
	return wr
}

func fetchAdd(dst *MR, off int, src *MR, roff uint64) SendWR {
	wr := write(dst, off, 8, src, roff)
	wr.Opcode, wr.CompareAdd = OpAtomicFetchAdd, 1
	return wr
}

func TestBadWorkRequests(t *testing.T) {
	cases := []struct {
		name     string
		wr       func(e *env) SendWR
		recv     func(e *env) *RecvWR // posted on b first, for SENDs
		want     WCStatus
		wantRecv WCStatus // b's receive completion, for SENDs
		remote   bool     // the responder detects it: b's QP goes to ERR too
		detail   string   // a part of the completion's detail
	}{
		{name: "wrong rkey", remote: true, want: WCRemAccessErr, detail: "is not a registered MR", wr: func(e *env) SendWR {
			wr := write(e.src, 0, 64, e.dst, 0)
			wr.RKey ^= 0x5a5a00
			return wr
		}},
		{name: "stale rkey variant", remote: true, want: WCRemAccessErr, wr: func(e *env) SendWR {
			wr := write(e.src, 0, 64, e.dst, 0)
			wr.RKey ^= 1
			return wr
		}},
		{name: "remote address below MR", remote: true, want: WCRemAccessErr, wr: func(e *env) SendWR {
			wr := write(e.src, 0, 64, e.dst, 0)
			wr.RemoteAddr--
			return wr
		}},
		{name: "remote length past end", remote: true, want: WCRemAccessErr, detail: "outside MR", wr: func(e *env) SendWR {
			return write(e.src, 0, 64, e.dst, 64<<10-63)
		}},
		{name: "remote address overflow", remote: true, want: WCRemAccessErr, wr: func(e *env) SendWR {
			wr := write(e.src, 0, ps, e.dst, 0)
			wr.RemoteAddr = ^uint64(0) - 100
			return wr
		}},
		{name: "read past end", remote: true, want: WCRemAccessErr, wr: func(e *env) SendWR {
			return read(e.src, 0, ps, e.dst, 62<<10)
		}},
		{name: "write without REMOTE_WRITE", remote: true, want: WCRemAccessErr, detail: "lacks REMOTE_WRITE", wr: func(e *env) SendWR {
			return write(e.src, 0, 64, e.dstRO, 0)
		}},
		{name: "read without REMOTE_READ", remote: true, want: WCRemAccessErr, wr: func(e *env) SendWR {
			return read(e.src, 0, 64, e.dstWO, 0)
		}},
		{name: "rkey of another PD", remote: true, want: WCRemAccessErr, detail: "another PD", wr: func(e *env) SendWR {
			return write(e.src, 0, 64, e.otherPD, 0)
		}},
		{name: "deregistered remote MR", remote: true, want: WCRemAccessErr, wr: func(e *env) SendWR {
			return write(e.src, 0, 64, e.deregistered, 0)
		}},
		{name: "invalid lkey", want: WCLocProtErr, wr: func(e *env) SendWR {
			wr := write(e.src, 0, 64, e.dst, 0)
			wr.SGL[0].LKey = 0x12345678
			return wr
		}},
		{name: "local SGE past end", want: WCLocProtErr, wr: func(e *env) SendWR {
			return write(e.src, 64<<10-10, 11, e.dst, 0)
		}},
		{name: "local SGE address overflow", want: WCLocProtErr, wr: func(e *env) SendWR {
			wr := write(e.src, 0, ps, e.dst, 0)
			wr.SGL[0].Addr = ^uint64(0) - 10
			return wr
		}},
		{name: "read into MR without LOCAL_WRITE", want: WCLocProtErr, wr: func(e *env) SendWR {
			return read(e.srcRO, 0, 64, e.dst, 0)
		}},
		{name: "deregistered local MR", want: WCLocProtErr, wr: func(e *env) SendWR {
			return write(e.deregLocal, 0, 64, e.dst, 0)
		}},
		{name: "atomic without REMOTE_ATOMIC", remote: true, want: WCRemAccessErr, detail: "lacks REMOTE_ATOMIC", wr: func(e *env) SendWR {
			return fetchAdd(e.src, 0, e.dst, 8)
		}},
		{name: "misaligned atomic", remote: true, want: WCRemInvReqErr, detail: "aligned", wr: func(e *env) SendWR {
			return fetchAdd(e.src, 0, e.dstAtomic, 4)
		}},
		{name: "atomic past the MR's end", remote: true, want: WCRemAccessErr, detail: "outside MR", wr: func(e *env) SendWR {
			return fetchAdd(e.src, 0, e.dstAtomic, 64<<10)
		}},
		{name: "atomic result into MR without LOCAL_WRITE", want: WCLocProtErr, wr: func(e *env) SendWR {
			return fetchAdd(e.srcRO, 0, e.dstAtomic, 0)
		}},
		{name: "write with immediate, wrong rkey", remote: true, want: WCRemAccessErr, wr: func(e *env) SendWR {
			wr := write(e.src, 0, 64, e.dst, 0)
			wr.Opcode, wr.RKey = OpRDMAWriteImm, wr.RKey^0x5a5a00
			return wr
		}},
		{name: "send with immediate larger than receive", remote: true, want: WCRemInvReqErr, wantRecv: WCLocLenErr,
			recv: func(e *env) *RecvWR { return &RecvWR{WRID: 70, SGL: sge(e.dst, 0, 100)} },
			wr: func(e *env) SendWR {
				return SendWR{WRID: 7, Opcode: OpSendImm, SGL: sge(e.src, 0, 101), Flags: SendSignaled, Imm: 1}
			}},
		{name: "send larger than receive", remote: true, want: WCRemInvReqErr, wantRecv: WCLocLenErr,
			recv: func(e *env) *RecvWR { return &RecvWR{WRID: 70, SGL: sge(e.dst, 0, 100)} },
			wr: func(e *env) SendWR {
				return SendWR{WRID: 7, Opcode: OpSend, SGL: sge(e.src, 0, 101), Flags: SendSignaled}
			}},
		{name: "receive into MR without LOCAL_WRITE", remote: true, want: WCRemOpErr, wantRecv: WCLocProtErr,
			recv: func(e *env) *RecvWR { return &RecvWR{WRID: 70, SGL: sge(e.dstRO, 0, 100)} },
			wr: func(e *env) SendWR {
				return SendWR{WRID: 7, Opcode: OpSend, SGL: sge(e.src, 0, 10), Flags: SendSignaled}
			}},
	}
	for _, mode := range memModes {
		for _, tc := range cases {
			t.Run(mode.name+"/"+tc.name, func(t *testing.T) {
				e := newEnv(t, mode.odp)
				if tc.recv != nil {
					require.NoError(t, e.b.qp.PostRecv(*tc.recv(e)))
				}
				require.NoError(t, e.b.qp.PostRecv(RecvWR{WRID: 71, SGL: sge(e.dst, 0, 10)}))
				require.NoError(t, e.a.qp.PostSend(tc.wr(e)))
				// A good WR behind the bad one is flushed, not executed.
				good := write(e.src, 0, 8, e.dst, 0)
				good.WRID = 8
				require.NoError(t, e.a.qp.PostSend(good))

				wc := wait(t, e.a.scq)
				assert.Equal(t, tc.want, wc.Status, wc.Detail)
				assert.EqualValues(t, 7, wc.WRID)
				assert.NotEmpty(t, wc.Detail)
				if tc.remote {
					// The wire carries only the NAK code; the responder keeps its reason.
					assert.Contains(t, wc.Detail, "responder: NAK", wc.Detail)
					if tc.detail != "" {
						assert.Contains(t, e.b.qp.RespError(), tc.detail)
					}
				} else if tc.detail != "" {
					assert.Contains(t, wc.Detail, tc.detail)
				}
				wc = wait(t, e.a.scq)
				assert.Equal(t, WCWRFlushErr, wc.Status)
				assert.EqualValues(t, 8, wc.WRID)
				assert.Equal(t, StateError, e.a.qp.State())

				if tc.recv != nil {
					rwc := wait(t, e.b.rcq)
					assert.Equal(t, tc.wantRecv, rwc.Status, rwc.Detail)
					assert.EqualValues(t, 70, rwc.WRID)
				}
				if tc.remote {
					rwc := wait(t, e.b.rcq) // the responder went to ERR: its receive is flushed
					assert.Equal(t, WCWRFlushErr, rwc.Status)
					assert.EqualValues(t, 71, rwc.WRID)
					assert.Equal(t, StateError, e.b.qp.State())
				} else {
					assert.NotEqual(t, StateError, e.b.qp.State(), "a local error stays local")
				}
				// Posting to a QP in ERR still works and flushes.
				require.NoError(t, e.a.qp.PostSend(good))
				assert.Equal(t, WCWRFlushErr, wait(t, e.a.scq).Status)
				require.NoError(t, e.a.qp.PostRecv(RecvWR{WRID: 5}))
				assert.Equal(t, WCWRFlushErr, wait(t, e.a.rcq).Status)
			})
		}
	}
}

func TestBadRegistrations(t *testing.T) {
	n := newNode(t, Config{})
	gone, err := unix.Mmap(-1, 0, 2*ps, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	require.NoError(t, err)
	require.NoError(t, unix.Munmap(gone))
	_, err = n.pd.RegMR(gone, AccessLocalWrite|AccessOnDemand)
	assert.ErrorIs(t, err, ErrBadAddress, "ODP over memory no longer mapped")
	buf, err := n.dev.Alloc(8192)
	require.NoError(t, err)
	_, err = n.pd.RegMR(buf[:0], AccessLocalWrite)
	assert.ErrorIs(t, err, ErrInvalidArgument)
	_, err = n.pd.RegMR(buf, 1<<20)
	assert.ErrorIs(t, err, ErrInvalidArgument)
	_, err = n.pd.RegMR(buf, AccessRemoteWrite)
	assert.ErrorIs(t, err, ErrInvalidArgument, "REMOTE_WRITE needs LOCAL_WRITE")
	// A slice reaching past its Alloc buffer is not ODP-registrable.
	other, err := n.dev.Alloc(8192)
	require.NoError(t, err)
	_ = other
	pd2, err := n.dev.AllocPD()
	require.NoError(t, err)
	require.NoError(t, pd2.Dealloc())
	_, err = pd2.RegMR(buf, AccessLocalWrite)
	assert.ErrorIs(t, err, ErrInvalidArgument, "deallocated PD")
	_, err = Open(Config{FaultAround: 3})
	assert.ErrorIs(t, err, ErrInvalidArgument)
}

// ibv_reg_mr pins with FOLL_WRITE when the access can write: read-only memory fails
// with EFAULT then, as do unmapped and PROT_NONE memory, whatever the access.
func TestPinnedRegistrationNeedsTheMapping(t *testing.T) {
	n := newNode(t, Config{})
	mapping := func(prot int) []byte {
		b, err := unix.Mmap(-1, 0, 4*ps, prot, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
		require.NoError(t, err)
		t.Cleanup(func() { require.NoError(t, unix.Munmap(b)) })
		return b
	}
	ro := mapping(unix.PROT_READ)
	for _, access := range []Access{AccessLocalWrite, AccessLocalWrite | AccessRemoteWrite, AccessLocalWrite | AccessRemoteAtomic} {
		_, err := n.pd.RegMR(ro, access)
		assert.ErrorIs(t, err, ErrBadAddress, "%v on read-only memory", access)
		assert.ErrorIs(t, err, unix.EFAULT)
	}
	mr, err := n.pd.RegMR(ro, AccessRemoteRead)
	require.NoError(t, err, "read-only memory registers for reading")
	require.NoError(t, mr.Dereg())

	_, err = n.pd.RegMR(mapping(unix.PROT_NONE), AccessRemoteRead)
	assert.ErrorIs(t, err, ErrBadAddress, "PROT_NONE")
	assert.Contains(t, err.Error(), "protection")

	gone, err := unix.Mmap(-1, 0, 4*ps, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	require.NoError(t, err)
	require.NoError(t, unix.Munmap(gone))
	_, err = n.pd.RegMR(gone, AccessLocalWrite)
	assert.ErrorIs(t, err, ErrBadAddress, "unmapped memory")
	assert.NotErrorIs(t, err, ErrMemlockLimit)
	assert.Contains(t, err.Error(), "not mapped")
	assert.Zero(t, n.dev.Stats().PinnedBytes, "failed registrations pin nothing")
}

func TestBadPosts(t *testing.T) {
	n := newNode(t, Config{})
	_, mr := n.region(t, ps, AccessLocalWrite)
	wr := SendWR{Opcode: OpSend, SGL: sge(mr, 0, 1)}
	assert.ErrorIs(t, n.qp.PostSend(wr), ErrQPState, "RESET")
	assert.ErrorIs(t, n.qp.PostRecv(RecvWR{}), ErrQPState, "RESET")
	require.NoError(t, n.qp.Modify(StateInit))
	assert.ErrorIs(t, n.qp.Modify(StateRTR), ErrQPState, "RTR needs a connection")
	assert.ErrorIs(t, n.qp.Modify(StateRTS), ErrQPState, "INIT -> RTS")

	m := newNode(t, Config{})
	require.NoError(t, ConnectLoopback(n.qp, m.qp))
	assert.ErrorIs(t, ConnectLoopback(n.qp, m.qp), ErrQPState, "already connected")
	assert.ErrorIs(t, n.qp.PostSend(SendWR{Opcode: 99}), ErrInvalidArgument)
	bad := wr
	bad.Flags = SendSignaled | 1<<2 // IBV_SEND_SOLICITED: not implemented, so refused
	assert.ErrorIs(t, n.qp.PostSend(bad), ErrInvalidArgument)
	atomic := SendWR{Opcode: OpAtomicCmpSwap, SGL: sge(mr, 0, 4)}
	assert.ErrorIs(t, n.qp.PostSend(atomic), ErrInvalidArgument, "an atomic needs one 8-byte SGE")
	atomic.SGL = append(sge(mr, 0, 4), sge(mr, 4, 4)...)
	assert.ErrorIs(t, n.qp.PostSend(atomic), ErrInvalidArgument, "an atomic needs one 8-byte SGE")
	inline := SendWR{Opcode: OpSend, SGL: sge(mr, 0, 257), Flags: SendInline}
	assert.ErrorIs(t, n.qp.PostSend(inline), ErrInvalidArgument, "beyond MaxInlineData")
	inline = SendWR{Opcode: OpRDMARead, SGL: sge(mr, 0, 8), Flags: SendInline}
	assert.ErrorIs(t, n.qp.PostSend(inline), ErrInvalidArgument, "inline READ")
	inline = SendWR{Opcode: OpSend, SGL: []SGE{{Addr: 4096, Length: 8}}, Flags: SendInline}
	assert.ErrorIs(t, n.qp.PostSend(inline), ErrBadAddress, "inline from an unmapped address")
	assert.ErrorIs(t, n.qp.PostSend(SendWR{Opcode: OpSend, SGL: make([]SGE, 17)}), ErrInvalidArgument)
	// Fill the send queue: nothing answers while m has no receive posted.
	for i := 0; i < 256; i++ {
		require.NoError(t, n.qp.PostSend(wr))
	}
	assert.ErrorIs(t, n.qp.PostSend(wr), ErrQueueFull)
	require.NoError(t, n.qp.Destroy())
	assert.ErrorIs(t, n.qp.PostSend(wr), ErrClosed)
	assert.ErrorIs(t, n.qp.Destroy(), ErrClosed)
}

// cqOfDepth returns a CQ of the given depth, a QP connected to a peer that completes
// every send into it, and an MR of a page on each side.
func cqOfDepth(t *testing.T, depth int) (cq *CQ, qp *QP, src, dst *MR) {
	a, b := newNode(t, Config{}), newNode(t, Config{})
	cq, err := a.dev.CreateCQ(depth)
	require.NoError(t, err)
	qp, err = a.pd.CreateQP(QPConfig{SendCQ: cq, RecvCQ: a.rcq, SigAll: true})
	require.NoError(t, err)
	require.NoError(t, ConnectLoopback(qp, b.qp))
	_, src = a.region(t, ps, AccessLocalWrite)
	_, dst = b.region(t, ps, rw)
	return cq, qp, src, dst
}

func TestCQOverrun(t *testing.T) {
	small, qp, src, dst := cqOfDepth(t, 2)
	for i := 0; i < 3; i++ {
		require.NoError(t, qp.PostSend(write(src, 0, 8, dst, 0)))
	}
	// The third completion overruns the CQ. Poll with no room reports the overrun
	// without consuming anything; then the two completions that fit are returned.
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := small.Poll(nil); err != nil {
			assert.ErrorIs(t, err, ErrCQOverrun)
			break
		}
		require.True(t, time.Now().Before(deadline), "no overrun reported")
		runtime.Gosched()
	}
	wcs := make([]WC, 8)
	got, err := small.Poll(wcs)
	assert.ErrorIs(t, err, ErrCQOverrun)
	assert.Equal(t, 2, got)
	assert.ErrorIs(t, small.Destroy(), ErrBusy)
	require.NoError(t, qp.Destroy())
	require.NoError(t, small.Destroy())
}

// Resize keeps the queued completions in order, refuses a depth below their number
// or out of range, and a larger CQ then holds completions the smaller one would
// have overrun.
func TestCQResize(t *testing.T) {
	cq, qp, src, dst := cqOfDepth(t, 3)
	post := func(id uint64) {
		t.Helper()
		wr := write(src, 0, 8, dst, 0)
		wr.WRID = id
		require.NoError(t, qp.PostSend(wr))
	}
	require.NoError(t, cq.Resize(1), "an empty CQ shrinks")
	post(1)
	require.Eventually(t, func() bool { return queued(cq) == 1 }, 10*time.Second, time.Millisecond)
	assert.ErrorIs(t, cq.Resize(0), ErrInvalidArgument)
	require.NoError(t, cq.Resize(8))
	for id := uint64(2); id <= 6; id++ {
		post(id)
	}
	require.Eventually(t, func() bool { return queued(cq) == 6 }, 10*time.Second, time.Millisecond)
	assert.ErrorIs(t, cq.Resize(5), ErrInvalidArgument, "fewer slots than completions queued")
	require.NoError(t, cq.Resize(6))
	wcs := make([]WC, 8)
	n, err := cq.Poll(wcs)
	require.NoError(t, err, "no overrun")
	require.Equal(t, 6, n)
	for i, wc := range wcs[:n] {
		assert.Equal(t, uint64(i+1), wc.WRID, "completions in their order")
		assert.Equal(t, WCSuccess, wc.Status)
	}
	require.NoError(t, qp.Destroy())
	require.NoError(t, cq.Destroy())
	assert.ErrorIs(t, cq.Resize(4), ErrClosed)
}
