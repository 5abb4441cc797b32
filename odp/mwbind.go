package odp

// What the NIC does with memory windows: binds and invalidations, which the engine
// executes when the send queue (or a SEND with invalidate) reaches them, and the
// responder's check of a request's R_Key against a window (mw.go holds the windows).

import "fmt"

// bind executes a bind work request posted on qp: the NIC's checks (rxe's
// rxe_bind_mw and rxe_check_bind_mw, after IBTA C10-72..75), then the new binding.
// It returns why it refused, or "".
func (qp *QP) bind(b *MWBind) string {
	d := qp.dev
	d.mwMu.Lock()
	defer d.mwMu.Unlock()
	mw, cur := d.lookupMW(b.MWRKey)
	if mw == nil {
		return fmt.Sprintf("%#x is not a memory window's R_Key", b.MWRKey)
	}
	var mr *MR
	if b.Length > 0 {
		// Dereg takes an MR out of the table under mwMu: one found here stays
		// until the window is unbound.
		if mr = d.lookupMR(b.MRLKey); mr == nil {
			return fmt.Sprintf("lkey %#x is not a registered MR", b.MRLKey)
		}
	}
	switch {
	case mw.pd != qp.pd:
		return "the window belongs to another PD"
	case mw.typ == MWType2 && cur.mr != nil:
		return fmt.Sprintf("type 2 window %#x is bound: invalidate it first", cur.rkey)
	case mw.typ == MWType2 && mr == nil:
		return "a type 2 window is bound to an MR, with a length"
	case b.Access&^mwAccessKnown != 0:
		return fmt.Sprintf("window access %v", b.Access)
	}
	if mr != nil {
		acc := mr.Access()
		switch {
		case mr.pd.Load() != qp.pd:
			return fmt.Sprintf("MR %#x belongs to another PD", mr.key)
		case acc&AccessMWBind == 0:
			return fmt.Sprintf("MR %#x lacks MW_BIND", mr.key)
		case b.Access&(AccessRemoteWrite|AccessRemoteAtomic) != 0 && acc&AccessLocalWrite == 0:
			return fmt.Sprintf("a writable window on MR %#x, which lacks LOCAL_WRITE", mr.key)
		}
		if _, ok := mr.offset(b.Addr, b.Length); !ok {
			return fmt.Sprintf("[%#x, +%d) outside MR %#x [%#x, +%d)", b.Addr, b.Length, mr.key, mr.start, mr.length)
		}
	}
	mw.unbindLocked()
	nb := &mwBinding{rkey: mw.idx<<8 | b.RKey&0xff}
	if mr != nil {
		nb.mr, nb.addr, nb.length, nb.access = mr, b.Addr, b.Length, b.Access
		mr.windows++
		if mw.typ == MWType2 {
			nb.qpn = qp.qpn
		}
	}
	mw.b.Store(nb)
	return ""
}

// invalidate invalidates the type 2 window whose R_Key is rkey (a local invalidate
// on qp, or a SEND with invalidate qp received), as rxe_invalidate_mw does: the
// window is unbound and may be bound again. It returns why it refused, or "".
func (qp *QP) invalidate(rkey uint32) string {
	d := qp.dev
	d.mwMu.Lock()
	defer d.mwMu.Unlock()
	mw, _ := d.lookupMW(rkey)
	switch {
	case mw == nil:
		if d.lookupMR(rkey) != nil {
			return fmt.Sprintf("%#x is an MR's key: only fast-registration MRs are invalidated", rkey)
		}
		return fmt.Sprintf("%#x is not a memory window's R_Key", rkey)
	case mw.typ != MWType2:
		return fmt.Sprintf("window %#x is of type 1, which is not invalidated", rkey)
	case mw.b.Load().mr == nil:
		return fmt.Sprintf("window %#x is not bound", rkey)
	}
	mw.unbindLocked()
	return ""
}

// remoteMW checks a request's rkey, range and rights against the device's memory
// windows (rxe_lookup_mw), and returns the MR the window opens and the request's
// offset in it; why says why it refuses.
func (qp *QP) remoteMW(rkey uint32, va, n uint64, need Access) (*MR, uint64, string) {
	mw, b := qp.dev.lookupMW(rkey)
	switch {
	case mw == nil:
		return nil, 0, fmt.Sprintf("rkey %#x is not a registered MR or window", rkey)
	case mw.pd != qp.pd:
		return nil, 0, fmt.Sprintf("window %#x belongs to another PD", rkey)
	case b.mr == nil:
		return nil, 0, fmt.Sprintf("window %#x is not bound", rkey)
	case b.qpn != 0 && b.qpn != qp.qpn:
		return nil, 0, fmt.Sprintf("type 2 window %#x is bound to QP %#x", rkey, b.qpn)
	case b.access&need == 0:
		return nil, 0, fmt.Sprintf("window %#x lacks %v", rkey, need)
	case va < b.addr || n > b.length || va-b.addr > b.length-n:
		return nil, 0, fmt.Sprintf("[%#x, +%d) outside window %#x [%#x, +%d)", va, n, rkey, b.addr, b.length)
	}
	off, ok := b.mr.offset(va, n)
	if !ok { // the binding checked it
		return nil, 0, fmt.Sprintf("[%#x, +%d) outside MR %#x", va, n, b.mr.key)
	}
	return b.mr, off, ""
}
