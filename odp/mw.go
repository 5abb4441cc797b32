package odp

// Memory windows (IBTA 10.6.7, rxe_mw.c): remote keys for part of an MR, bound and
// unbound by work requests on a send queue while the MR stays registered.

import "sync/atomic"

// MWType is a memory window's type, with ibv_mw_type's values.
type MWType int

// The memory window types (rxe's; mlx5 offers both too).
const (
	// MWType1 windows are bound by a bind work request (ibv_bind_mw) on any QP of
	// their PD, rebound the same way (a zero length unbinds), and any QP of the PD
	// may use them. They cannot be invalidated.
	MWType1 MWType = 1
	// MWType2 windows (type 2B) are bound by a bind work request (IBV_WR_BIND_MW) to
	// the QP that posted it, which alone may use them, and must be invalidated (a
	// local invalidate, or the peer's SEND with invalidate) before they are bound
	// again.
	MWType2 MWType = 2
)

// MW is a memory window. Its R_Key names no memory until a bind work request binds
// it to a range of an MR with AccessMWBind; requests that name it are then checked
// against the window's range and rights, and reach the MR's memory (on demand, if
// the MR is ODP). An MR is not deregistered while windows are bound to it (ErrBusy,
// as on rxe).
type MW struct {
	dev *nic
	pd  *domain
	typ MWType
	idx uint32 // the key index, which its R_Keys keep
	// b is the window's state, replaced whole under nic.mwMu and read without a
	// lock by the responder's key checks.
	b atomic.Pointer[mwBinding]
}

// mwBinding is a window's state: its R_Key and, while it is bound, the range and
// rights it grants.
type mwBinding struct {
	rkey         uint32
	mr           *MR // nil: not bound
	addr, length uint64
	access       Access
	// qpn (type 2) is the QP it was bound through, the only one that may use it
	// (QP numbers come back only after 2^24 QPs were created); 0 for type 1.
	qpn uint32
}

// mwAccessKnown are the rights a bind may ask for: the remote ones, and LOCAL_WRITE,
// which means nothing for a window and is accepted as rxe accepts it (rdma-core's
// tests ask for it). Zero-based windows are not offered.
const mwAccessKnown = AccessRemoteRead | AccessRemoteWrite | AccessRemoteAtomic | AccessLocalWrite

// newMWLocked makes a window of type t under key, unbound. Called with Device.mu
// held.
func (pd *domain) newMWLocked(t MWType, key uint32) *MW {
	d := pd.dev
	mw := &MW{dev: d, pd: pd, typ: t, idx: key >> 8}
	mw.b.Store(&mwBinding{rkey: key}) // before the engines can find it
	d.mws[mw.idx] = mw
	d.windows.storeLocked(mw.idx, mw)
	pd.mws++
	return mw
}

// BindTo returns a bind of the window to [addr, addr+length) of mr with the given
// rights, under the window's R_Key with its tag advanced (ibv_inc_rkey): the
// request's Bind. A zero length (mr may be nil then) unbinds a type 1 window.
func (mw *MW) BindTo(mr *MR, addr, length uint64, access Access) *MWBind {
	cur := mw.RKey()
	b := &MWBind{MWRKey: cur, RKey: nextTag(cur), Addr: addr, Length: length, Access: access}
	if mr != nil {
		b.MRLKey = mr.LKey()
	}
	return b
}

// nextTag is key with its low byte (the tag) advanced and its index kept, as
// ibv_inc_rkey does.
func nextTag(key uint32) uint32 { return key&^0xff | (key+1)&0xff }

// RKey returns the window's R_Key: the one its last bind gave it.
func (mw *MW) RKey() uint32 { return mw.b.Load().rkey }

// Type returns the window's type.
func (mw *MW) Type() MWType { return mw.typ }

// Dealloc frees the window: its R_Key is refused from then on, whether it was
// bound or not.
func (mw *MW) Dealloc() error {
	d := mw.dev
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.mws[mw.idx] != mw {
		return ErrClosed
	}
	mw.deallocLocked()
	return nil
}

// deallocLocked unbinds and frees the window. Called with Device.mu held.
func (mw *MW) deallocLocked() {
	d := mw.dev
	d.mwMu.Lock()
	mw.unbindLocked()
	d.windows.storeLocked(mw.idx, nil) // binds and requests no longer find it
	rkey := mw.b.Load().rkey
	d.mwMu.Unlock()
	delete(d.mws, mw.idx)
	d.keys.release(rkey)
	mw.pd.mws--
}

// unbindLocked ends the window's binding, keeping its R_Key. Called with nic.mwMu
// held.
func (mw *MW) unbindLocked() {
	b := mw.b.Load()
	if b.mr != nil {
		b.mr.windows--
	}
	mw.b.Store(&mwBinding{rkey: b.rkey})
}

// lookupMW returns the window whose current R_Key is key and its state, or nils.
func (d *nic) lookupMW(key uint32) (*MW, *mwBinding) {
	mw := d.windows.load(key >> 8)
	if mw == nil {
		return nil, nil
	}
	b := mw.b.Load()
	if b.rkey != key {
		return nil, nil
	}
	return mw, b
}
