package main

/*
#include <linux/futex.h>
#include <sys/syscall.h>
#include "backend.h"
*/
import "C"

import (
	"encoding/binary"
	"math"
	"net/netip"
	"runtime/cgo"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/odpemu/odpemu/odp"
	"github.com/odpemu/odpemu/transport/roce"
)

// A QP as the verbs library holds it: the odp QP and the device it was created on.
type queuePair struct {
	qp  *odp.QP
	dev *device
}

// A PD as the verbs library holds it: the odp PD and its device.
type protectionDomain struct {
	pd  *odp.PD
	dev *device
}

// An MR as the verbs library holds it: the odp MR, which ibv_rereg_mr may replace
// by a new registration, its PD and the memory it covers.
type memoryRegion struct {
	mr     *odp.MR
	pd     *protectionDomain
	addr   unsafe.Pointer
	length C.size_t
}

// ibv_rereg_mr's flags (enum ibv_rereg_mr_flags; qp.c checks the values).
const (
	reregTranslation = 1 << iota
	reregPD
	reregAccess
)

// register registers [addr, addr+length) in pd, checking what a slice cannot hold.
func register(pd *protectionDomain, addr unsafe.Pointer, length C.size_t, access odp.Access) (*odp.MR, error) {
	if addr == nil || length == 0 || uint64(length) > pd.dev.dev.QueryDevice().MaxMRSize ||
		uintptr(addr)+uintptr(length) < uintptr(addr) {
		return nil, syscall.EINVAL
	}
	return pd.pd.RegMR(unsafe.Slice((*byte)(addr), int(length)), access)
}

//export odpemu_reg_mr
func odpemu_reg_mr(h C.odpemu_handle, addr unsafe.Pointer, length C.size_t, access C.uint32_t, out *C.odpemu_handle,
	key *C.uint32_t) C.int {
	pd, ok := lookup[*protectionDomain](h)
	if !ok {
		return C.int(syscall.EINVAL)
	}
	var mr *odp.MR
	var err error
	if addr == nil && uint64(length) == math.MaxUint64 && odp.Access(access)&odp.AccessOnDemand != 0 {
		mr, err = pd.pd.RegImplicitMR(odp.Access(access)) // the whole address space
	} else {
		mr, err = register(pd, addr, length, odp.Access(access))
	}
	if err != nil {
		return errno(err)
	}
	*out = C.odpemu_handle(cgo.NewHandle(&memoryRegion{mr: mr, pd: pd, addr: addr, length: length}))
	*key = C.uint32_t(mr.LKey())
	return 0
}

//export odpemu_dereg_mr
func odpemu_dereg_mr(h C.odpemu_handle) C.int {
	r, ok := lookup[*memoryRegion](h)
	if !ok {
		return C.int(syscall.EINVAL)
	}
	if err := r.mr.Dereg(); err != nil {
		return errno(err)
	}
	cgo.Handle(h).Delete()
	return 0
}

//export odpemu_rereg_mr
func odpemu_rereg_mr(h C.odpemu_handle, flags C.uint32_t, pdh C.odpemu_handle, addr unsafe.Pointer, length C.size_t,
	access C.uint32_t, key *C.uint32_t) C.int {
	r, ok := lookup[*memoryRegion](h)
	if !ok {
		return C.int(syscall.EINVAL)
	}
	old := r.mr
	pd, acc := r.pd, old.Access()
	if flags&reregPD != 0 {
		if pd, ok = lookup[*protectionDomain](pdh); !ok || pd.dev != r.pd.dev {
			return C.int(syscall.EINVAL)
		}
	}
	if flags&reregAccess != 0 {
		acc = odp.Access(access)
	}
	if flags&reregTranslation == 0 && (acc^old.Access())&odp.AccessOnDemand == 0 {
		// The mkey rewritten in place (mlx5's UMR): the keys stay.
		if err := old.Rereg(pd.pd, acc); err != nil {
			return errno(err)
		}
		r.pd = pd
		*key = C.uint32_t(old.LKey())
		return 0
	}
	// Other memory, or pinned to on demand or back: a new registration under new
	// keys (mlx5 makes a new mkey too), made before the old one goes, so that a
	// failure leaves the MR as it was.
	if flags&reregTranslation == 0 {
		addr, length = r.addr, r.length
	}
	mr, err := register(pd, addr, length, acc)
	if err != nil {
		return errno(err)
	}
	if err := old.Dereg(); err != nil {
		_ = mr.Dereg() // just registered, unused: nothing can hold it
		return errno(err)
	}
	r.mr, r.pd, r.addr, r.length = mr, pd, addr, length
	*key = C.uint32_t(mr.LKey())
	return 0
}

//export odpemu_advise_mr
func odpemu_advise_mr(h C.odpemu_handle, advice, flags C.uint32_t, sg *C.struct_odpemu_sge, n C.uint32_t) C.int {
	pd, ok := lookup[*protectionDomain](h)
	if !ok {
		return C.int(syscall.EINVAL)
	}
	return errno(pd.pd.AdviseMR(odp.Advice(advice), odp.AdviseFlags(flags), sgl(sg, n)))
}

// A CQ as the verbs library holds it: the odp CQ, and what its next completion is to
// notify (RequestNotify holds one function; the doorbell and a completion channel
// share it through ring).
type completionQueue struct {
	cq   *odp.CQ
	bell *uint32 // the doorbell: C memory (backend.h)

	mu      sync.Mutex // protects the fields below; taken under odp's CQ lock (in ring)
	channel func()     // a completion channel's event, armed by ibv_req_notify_cq
	ringing bool       // the doorbell is armed
	// rung is closed when the armed doorbell rings, for the threads waiting in
	// odpemu_wait_cq; nil while none waits.
	rung chan struct{}
}

// ring is what the CQ's next completion calls: it sets the doorbell and writes the
// channel's event if either is armed, and disarms them.
func (c *completionQueue) ring() {
	c.mu.Lock()
	channel, ringing, rung := c.channel, c.ringing, c.rung
	c.channel, c.ringing, c.rung = nil, false, nil
	c.mu.Unlock()
	// 2: a poller sleeps on the word (the C library's emu_poll_cq), to be woken.
	if ringing && atomic.SwapUint32(c.bell, 1) == 2 {
		_, _, _ = unix.Syscall6(C.SYS_futex, uintptr(unsafe.Pointer(c.bell)), C.FUTEX_WAKE_PRIVATE, 1, 0, 0, 0)
	}
	if rung != nil {
		close(rung)
	}
	if channel != nil {
		channel()
	}
}

// arm arms the doorbell, or the channel's event if channel is not nil, for the next
// completion.
func (c *completionQueue) arm(channel func()) error {
	c.mu.Lock()
	if channel != nil {
		c.channel = channel
	} else {
		c.ringing = true
	}
	c.mu.Unlock()
	return c.cq.RequestNotify(c.ring)
}

// wait waits until the armed doorbell rings or d has passed, and reports whether it
// rang. A doorbell that is not armed has rung since it was (or is armed for the
// channel alone): wait returns true at once.
func (c *completionQueue) wait(d time.Duration) bool {
	c.mu.Lock()
	if !c.ringing {
		c.mu.Unlock()
		return true
	}
	if c.rung == nil {
		c.rung = make(chan struct{})
	}
	rung := c.rung
	c.mu.Unlock()
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-rung:
		return true
	case <-t.C:
		return false
	}
}

// odpemu_wait_in_c counts a thread's long wait in C (backend.h, procs.go).
//
//export odpemu_wait_in_c
func odpemu_wait_in_c() C.int {
	cWaits.Add(1)
	return 0
}

// odpemu_wait_cq blocks the calling thread in Go until the CQ's armed doorbell rings
// or ns nanoseconds have passed (ETIMEDOUT; backend.h), and adds the time it waited
// to waitedNanos (procs.go).
//
//export odpemu_wait_cq
func odpemu_wait_cq(h C.odpemu_handle, ns C.int64_t) C.int {
	c, ok := lookup[*completionQueue](h)
	if !ok || ns < 0 {
		return C.int(syscall.EINVAL)
	}
	t := time.Now()
	rang := c.wait(time.Duration(ns))
	waitedNanos.Add(int64(time.Since(t)))
	if !rang {
		return C.int(syscall.ETIMEDOUT)
	}
	return 0
}

//export odpemu_create_cq
func odpemu_create_cq(h C.odpemu_handle, depth C.int, bell *C.uint32_t, out *C.odpemu_handle) C.int {
	d, ok := lookup[*device](h)
	if !ok || bell == nil {
		return C.int(syscall.EINVAL)
	}
	cq, err := d.dev.CreateCQ(int(depth))
	if err != nil {
		return errno(err)
	}
	*out = C.odpemu_handle(cgo.NewHandle(&completionQueue{cq: cq, bell: (*uint32)(unsafe.Pointer(bell))}))
	return 0
}

//export odpemu_destroy_cq
func odpemu_destroy_cq(h C.odpemu_handle) C.int {
	c, ok := lookup[*completionQueue](h)
	if !ok {
		return C.int(syscall.EINVAL)
	}
	if err := c.cq.Destroy(); err != nil {
		return errno(err)
	}
	cgo.Handle(h).Delete()
	return 0
}

// odpemu_resize_cq changes a CQ's depth, keeping its completions (EINVAL: more are
// queued than the new depth holds).
//
//export odpemu_resize_cq
func odpemu_resize_cq(h C.odpemu_handle, depth C.int) C.int {
	c, ok := lookup[*completionQueue](h)
	if !ok {
		return C.int(syscall.EINVAL)
	}
	return errno(c.cq.Resize(int(depth)))
}

// odpemu_poll_cq returns how many completions it wrote into wcs, or a negative errno
// value. When it returns fewer than n, it has armed the CQ's doorbell: it arms it,
// then polls once more, so that a completion queued between its poll and its arming
// is either returned or rings.
//
//export odpemu_poll_cq
func odpemu_poll_cq(h C.odpemu_handle, n C.int, out *C.struct_odpemu_wc) C.int {
	dataPath()
	c, ok := lookup[*completionQueue](h)
	if !ok || n < 0 {
		return -C.int(syscall.EINVAL)
	}
	wcs := unsafe.Slice(out, int(n))
	done, err := poll(c.cq, wcs)
	if err == nil && done < len(wcs) {
		if err = c.arm(nil); err == nil {
			var k int
			k, err = poll(c.cq, wcs[done:])
			done += k
		}
	}
	if err != nil && done == 0 {
		return -errno(err)
	}
	return C.int(done)
}

// poll moves up to len(wcs) of cq's completions into wcs.
func poll(cq *odp.CQ, wcs []C.struct_odpemu_wc) (int, error) {
	var buf [16]odp.WC
	done := 0
	for done < len(wcs) {
		k, err := cq.Poll(buf[:min(len(buf), len(wcs)-done)])
		for _, wc := range buf[:k] {
			imm := wc.ImmData
			if wc.Flags&odp.WCWithInv != 0 {
				imm = wc.InvRKey
			}
			wcs[done] = C.struct_odpemu_wc{wr_id: C.uint64_t(wc.WRID), status: C.uint32_t(wc.Status),
				opcode: C.uint32_t(wc.Opcode), byte_len: C.uint32_t(wc.ByteLen), qp_num: C.uint32_t(wc.QPNum),
				wc_flags: C.uint32_t(wc.Flags), imm: C.uint32_t(imm), src_qp: C.uint32_t(wc.SrcQP)}
			done++
		}
		if err != nil || k < len(buf) {
			return done, err
		}
	}
	return done, nil
}

// odpemu_req_notify_cq arms a CQ: the next completion writes event, 8 bytes, into fd
// (a completion channel's pipe, non-blocking: a full pipe already holds events).
//
//export odpemu_req_notify_cq
func odpemu_req_notify_cq(h C.odpemu_handle, fd C.int, event C.uint64_t) C.int {
	c, ok := lookup[*completionQueue](h)
	if !ok {
		return C.int(syscall.EINVAL)
	}
	var b [8]byte
	binary.NativeEndian.PutUint64(b[:], uint64(event))
	return errno(c.arm(func() { _, _ = syscall.Write(int(fd), b[:]) }))
}

// QP types (enum ibv_qp_type; qp.c checks the values).
const (
	qptRC = 2
	qptUC = 3
	qptUD = 4
)

//export odpemu_create_qp
func odpemu_create_qp(h, sendCQ, recvCQ, srqH C.odpemu_handle, typ C.uint32_t, caps *C.struct_odpemu_qp_caps,
	sigAll C.uint32_t, out *C.odpemu_handle, qpn *C.uint32_t) C.int {
	pd, ok := lookup[*protectionDomain](h)
	scq, ok1 := lookup[*completionQueue](sendCQ)
	rcq, ok2 := lookup[*completionQueue](recvCQ)
	if !ok || !ok1 || !ok2 {
		return C.int(syscall.EINVAL)
	}
	var srq *odp.SRQ
	if srqH != 0 {
		s, ok := lookup[*sharedReceiveQueue](srqH)
		if !ok {
			return C.int(syscall.EINVAL)
		}
		srq = s.srq
	}
	qpType := odp.QPTypeRC
	switch typ {
	case qptRC:
	case qptUD:
		qpType = odp.QPTypeUD
	case qptUC:
		qpType = odp.QPTypeUC
	default:
		return C.int(syscall.EOPNOTSUPP)
	}
	qp, err := pd.pd.CreateQP(odp.QPConfig{Type: qpType, SendCQ: scq.cq, RecvCQ: rcq.cq, MaxSendWR: int(caps.max_send_wr),
		MaxRecvWR: int(caps.max_recv_wr), MaxSGE: int(caps.max_sge), MaxInlineData: int(caps.max_inline_data),
		SigAll: sigAll != 0, SRQ: srq})
	if err != nil {
		return errno(err)
	}
	got := qp.Config()
	*caps = C.struct_odpemu_qp_caps{max_send_wr: C.uint32_t(got.MaxSendWR), max_recv_wr: C.uint32_t(got.MaxRecvWR),
		max_sge: C.uint32_t(got.MaxSGE), max_inline_data: C.uint32_t(got.MaxInlineData)}
	*out = C.odpemu_handle(cgo.NewHandle(&queuePair{qp: qp, dev: pd.dev}))
	*qpn = C.uint32_t(qp.QPNum())
	return 0
}

// odpemu_rtr_qp moves a QP to RTR as ibv_modify_qp does: attached to the peer QP at
// the address its GID holds, port 4791, from this device's address; its responder
// answers from then on.
//
//export odpemu_rtr_qp
func odpemu_rtr_qp(h C.odpemu_handle, c *C.struct_odpemu_connect) C.int {
	q, ok := lookup[*queuePair](h)
	if !ok {
		return C.int(syscall.EINVAL)
	}
	var gid [16]byte
	for i := range gid {
		gid[i] = byte(c.dgid[i])
	}
	peer := netip.AddrFrom16(gid)
	if !peer.Is4In6() {
		return C.int(syscall.EINVAL) // RoCEv2 over IPv4 only: an IPv4-mapped GID
	}
	attr := odp.QPAttr{MinRNRTimer: uint8(c.min_rnr_timer), MaxDestRdAtomic: uint8(c.max_dest_rd_atomic)}
	if err := q.qp.ModifyAttr(attr, odp.AttrMinRNRTimer|odp.AttrMaxDestRdAtomic); err != nil {
		return errno(err)
	}
	err := q.qp.AttachRoCE(netip.AddrPortFrom(q.dev.addr, roce.UDPPort), netip.AddrPortFrom(peer.Unmap(), roce.UDPPort),
		odp.Remote{QPN: uint32(c.dest_qp_num), PSN: uint32(c.rq_psn)}, int(c.mtu))
	return errno(err)
}

// odpemu_rts_qp moves a QP from RTR to RTS as ibv_modify_qp does: it sends from
// sq_psn, with the retry settings given.
//
//export odpemu_rts_qp
func odpemu_rts_qp(h C.odpemu_handle, c *C.struct_odpemu_connect) C.int {
	q, ok := lookup[*queuePair](h)
	if !ok {
		return C.int(syscall.EINVAL)
	}
	if err := q.qp.SetSendPSN(uint32(c.sq_psn)); err != nil {
		return errno(err)
	}
	attr := odp.QPAttr{Timeout: uint8(c.timeout), RetryCnt: uint8(c.retry_cnt), RNRRetry: uint8(c.rnr_retry),
		MaxRdAtomic: uint8(c.max_rd_atomic)}
	mask := odp.AttrTimeout | odp.AttrRetryCnt | odp.AttrRNRRetry | odp.AttrMaxRdAtomic
	if err := q.qp.ModifyAttr(attr, mask); err != nil {
		return errno(err)
	}
	return errno(q.qp.Modify(odp.StateRTS))
}

// odpemu_bind_ud_qp moves a UD QP to RTR, bound at its device's address (port 4791):
// it receives from then on.
//
//export odpemu_bind_ud_qp
func odpemu_bind_ud_qp(h C.odpemu_handle, mtu C.uint32_t) C.int {
	q, ok := lookup[*queuePair](h)
	if !ok {
		return C.int(syscall.EINVAL)
	}
	return errno(q.qp.BindUD(netip.AddrPortFrom(q.dev.addr, roce.UDPPort), int(mtu)))
}

// odpemu_set_qp_qkey sets a UD QP's Q_Key.
//
//export odpemu_set_qp_qkey
func odpemu_set_qp_qkey(h C.odpemu_handle, qkey C.uint32_t) C.int {
	q, ok := lookup[*queuePair](h)
	if !ok {
		return C.int(syscall.EINVAL)
	}
	return errno(q.qp.ModifyAttr(odp.QPAttr{QKey: uint32(qkey)}, odp.AttrQKey))
}

//export odpemu_modify_qp_state
func odpemu_modify_qp_state(h C.odpemu_handle, state C.uint32_t) C.int {
	q, ok := lookup[*queuePair](h)
	if !ok {
		return C.int(syscall.EINVAL)
	}
	return errno(q.qp.Modify(odp.QPState(state)))
}

// odpemu_set_qp_access sets what the QP's responder accepts (qp_access_flags).
//
//export odpemu_set_qp_access
func odpemu_set_qp_access(h C.odpemu_handle, access C.uint32_t) C.int {
	q, ok := lookup[*queuePair](h)
	if !ok {
		return C.int(syscall.EINVAL)
	}
	remote := odp.Access(access) & (odp.AccessRemoteWrite | odp.AccessRemoteRead | odp.AccessRemoteAtomic)
	return errno(q.qp.ModifyAttr(odp.QPAttr{Access: remote}, odp.AttrAccess))
}

//export odpemu_destroy_qp
func odpemu_destroy_qp(h C.odpemu_handle) C.int {
	q, ok := lookup[*queuePair](h)
	if !ok {
		return C.int(syscall.EINVAL)
	}
	if err := q.qp.Destroy(); err != nil {
		return errno(err)
	}
	cgo.Handle(h).Delete()
	return 0
}

// sgl is the C SGL as odp's, without a copy: the layouts agree (TestSGELayout), and
// odp copies a work request's SGL when it is posted.
func sgl(sg *C.struct_odpemu_sge, n C.uint32_t) []odp.SGE {
	if n == 0 || sg == nil {
		return nil
	}
	return unsafe.Slice((*odp.SGE)(unsafe.Pointer(sg)), int(n))
}

//export odpemu_post_send
func odpemu_post_send(h C.odpemu_handle, wrs *C.struct_odpemu_send_wr, n C.uint32_t, posted *C.uint32_t) C.int {
	dataPath()
	*posted = 0
	q, ok := lookup[*queuePair](h)
	if !ok {
		return C.int(syscall.EINVAL)
	}
	ud := q.qp.Config().Type == odp.QPTypeUD
	var dest odp.UDDest
	var bind odp.MWBind
	for i, wr := range unsafe.Slice(wrs, int(n)) {
		swr := odp.SendWR{WRID: uint64(wr.wr_id), Opcode: odp.Opcode(wr.opcode), Flags: odp.SendFlags(wr.flags),
			SGL: sgl(wr.sg_list, wr.num_sge), RemoteAddr: uint64(wr.remote_addr), RKey: uint32(wr.rkey), Imm: uint32(wr.imm),
			CompareAdd: uint64(wr.compare_add), Swap: uint64(wr.swap), InvRKey: uint32(wr.invalidate_rkey)}
		if swr.Opcode == odp.OpBindMW { // PostSend copies the binding
			var ok bool
			if bind, ok = bindOf(&wr); !ok {
				return C.int(syscall.EINVAL)
			}
			swr.Bind = &bind
		}
		if ud { // PostSend copies the destination
			gid := *(*[16]byte)(unsafe.Pointer(&wr.dgid))
			dest = odp.UDDest{Addr: netip.AddrPortFrom(netip.AddrFrom16(gid).Unmap(), roce.UDPPort),
				QPN: uint32(wr.remote_qpn), QKey: uint32(wr.remote_qkey)}
			swr.UD = &dest
		}
		err := q.qp.PostSend(swr)
		if err != nil {
			return errno(err)
		}
		*posted = C.uint32_t(i + 1)
	}
	return 0
}

// bindOf is a bind work request's window and binding by their keys (the window's
// current R_Key, the MR's L_Key), or false when a handle is not one.
func bindOf(wr *C.struct_odpemu_send_wr) (odp.MWBind, bool) {
	w, ok := lookup[*odp.MW](wr.mw)
	if !ok {
		return odp.MWBind{}, false
	}
	b := odp.MWBind{MWRKey: w.RKey(), RKey: uint32(wr.rkey), Addr: uint64(wr.bind_addr), Length: uint64(wr.bind_length),
		Access: odp.Access(wr.bind_access)}
	if wr.mr != 0 {
		r, ok := lookup[*memoryRegion](wr.mr)
		if !ok {
			return odp.MWBind{}, false
		}
		b.MRLKey = r.mr.LKey()
	}
	return b, true
}

// odpemu_alloc_mw allocates a memory window of type typ (enum ibv_mw_type) in a PD.
//
//export odpemu_alloc_mw
func odpemu_alloc_mw(h C.odpemu_handle, typ C.uint32_t, out *C.odpemu_handle, rkey *C.uint32_t) C.int {
	pd, ok := lookup[*protectionDomain](h)
	if !ok {
		return C.int(syscall.EINVAL)
	}
	mw, err := pd.pd.AllocMW(odp.MWType(typ))
	if err != nil {
		return errno(err)
	}
	*out = C.odpemu_handle(cgo.NewHandle(mw))
	*rkey = C.uint32_t(mw.RKey())
	return 0
}

//export odpemu_dealloc_mw
func odpemu_dealloc_mw(h C.odpemu_handle) C.int {
	mw, ok := lookup[*odp.MW](h)
	if !ok {
		return C.int(syscall.EINVAL)
	}
	if err := mw.Dealloc(); err != nil {
		return errno(err)
	}
	cgo.Handle(h).Delete()
	return 0
}

//export odpemu_post_recv
func odpemu_post_recv(h C.odpemu_handle, wrID C.uint64_t, sg *C.struct_odpemu_sge, n C.uint32_t) C.int {
	dataPath()
	q, ok := lookup[*queuePair](h)
	if !ok {
		return C.int(syscall.EINVAL)
	}
	return errno(q.qp.PostRecv(odp.RecvWR{WRID: uint64(wrID), SGL: sgl(sg, n)}))
}

// An SRQ as the verbs library holds it.
type sharedReceiveQueue struct {
	srq *odp.SRQ
}

// odpemu_create_srq creates an SRQ in a PD: *maxWR receives of *maxSGE SGEs (0: the
// emulator's default), written back as granted. Each time its armed limit is reached
// it writes event (eventLen bytes: the struct ibv_async_event the C library built)
// into asyncFD, whose write end is non-blocking: a full pipe drops the event.
//
//export odpemu_create_srq
func odpemu_create_srq(h C.odpemu_handle, maxWR, maxSGE *C.uint32_t, limit C.uint32_t, asyncFD C.int,
	event unsafe.Pointer, eventLen C.size_t, out *C.odpemu_handle) C.int {
	pd, ok := lookup[*protectionDomain](h)
	if !ok || event == nil || eventLen == 0 {
		return C.int(syscall.EINVAL)
	}
	ev := C.GoBytes(event, C.int(eventLen))
	fd := int(asyncFD)
	srq, err := pd.pd.CreateSRQ(odp.SRQConfig{MaxWR: int(*maxWR), MaxSGE: int(*maxSGE), Limit: int(limit),
		OnLimit: func() { _, _ = syscall.Write(fd, ev) }})
	if err != nil {
		return errno(err)
	}
	a := srq.Attr()
	*maxWR, *maxSGE = C.uint32_t(a.MaxWR), C.uint32_t(a.MaxSGE)
	*out = C.odpemu_handle(cgo.NewHandle(&sharedReceiveQueue{srq: srq}))
	return 0
}

//export odpemu_arm_srq
func odpemu_arm_srq(h C.odpemu_handle, limit C.uint32_t) C.int {
	s, ok := lookup[*sharedReceiveQueue](h)
	if !ok {
		return C.int(syscall.EINVAL)
	}
	return errno(s.srq.Arm(int(limit)))
}

//export odpemu_query_srq
func odpemu_query_srq(h C.odpemu_handle, maxWR, maxSGE, limit *C.uint32_t) C.int {
	s, ok := lookup[*sharedReceiveQueue](h)
	if !ok {
		return C.int(syscall.EINVAL)
	}
	a := s.srq.Attr()
	*maxWR, *maxSGE, *limit = C.uint32_t(a.MaxWR), C.uint32_t(a.MaxSGE), C.uint32_t(a.Limit)
	return 0
}

//export odpemu_destroy_srq
func odpemu_destroy_srq(h C.odpemu_handle) C.int {
	s, ok := lookup[*sharedReceiveQueue](h)
	if !ok {
		return C.int(syscall.EINVAL)
	}
	if err := s.srq.Destroy(); err != nil {
		return errno(err)
	}
	cgo.Handle(h).Delete()
	return 0
}

//export odpemu_post_srq_recv
func odpemu_post_srq_recv(h C.odpemu_handle, wrID C.uint64_t, sg *C.struct_odpemu_sge, n C.uint32_t) C.int {
	dataPath()
	s, ok := lookup[*sharedReceiveQueue](h)
	if !ok {
		return C.int(syscall.EINVAL)
	}
	return errno(s.srq.PostRecv(odp.RecvWR{WRID: uint64(wrID), SGL: sgl(sg, n)}))
}
