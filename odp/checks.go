package odp

import "fmt"

// The NIC's checks of local and remote keys against the device's MRs.

// localSGE checks one SGE against this device's MRs as the NIC does for a local key.
func (qp *QP) localSGE(s SGE, write bool) (*MR, uint64, string) {
	return qp.dev.localKey(qp.pd, s, write)
}

// recvSGE checks one SGE of a receive: against the SRQ's PD when the receive came
// from an SRQ, the QP's otherwise.
func (qp *QP) recvSGE(s SGE) (*MR, uint64, string) {
	pd := qp.pd
	if qp.cfg.SRQ != nil {
		pd = qp.cfg.SRQ.pd
	}
	return qp.dev.localKey(pd, s, true)
}

// localKey checks one SGE against the device's MRs of pd.
func (d *nic) localKey(pd *domain, s SGE, write bool) (*MR, uint64, string) {
	mr := d.lookupMR(s.LKey)
	switch {
	case mr == nil:
		return nil, 0, fmt.Sprintf("lkey %#x is not a registered MR", s.LKey)
	case mr.pd.Load() != pd:
		return nil, 0, fmt.Sprintf("lkey %#x belongs to another PD", s.LKey)
	case write && mr.Access()&AccessLocalWrite == 0:
		return nil, 0, fmt.Sprintf("MR %#x lacks LOCAL_WRITE", s.LKey)
	}
	off, ok := mr.offset(s.Addr, uint64(s.Length))
	if !ok {
		return nil, 0, fmt.Sprintf("[%#x, +%d) outside MR %#x [%#x, +%d)", s.Addr, s.Length, s.LKey, mr.start, mr.length)
	}
	return mr, off, ""
}

// remoteMR checks a request's rkey, range and rights against this device's MRs and
// memory windows, and says why it refuses.
func (qp *QP) remoteMR(rkey uint32, va, n uint64, need Access) (*MR, uint64, string) {
	mr := qp.dev.lookupMR(rkey)
	switch {
	case mr == nil:
		return qp.remoteMW(rkey, va, n, need)
	case mr.pd.Load() != qp.pd:
		return nil, 0, fmt.Sprintf("rkey %#x belongs to another PD", rkey)
	case mr.Access()&need == 0:
		return nil, 0, fmt.Sprintf("MR %#x lacks %v", rkey, need)
	}
	off, ok := mr.offset(va, n)
	if !ok {
		return nil, 0, fmt.Sprintf("[%#x, +%d) outside MR %#x [%#x, +%d)", va, n, rkey, mr.start, mr.length)
	}
	return mr, off, ""
}
