package odp

import "sync/atomic"

// PD is a protection domain: MRs and QPs of one PD cannot be used with another's.
type PD struct {
	dev  *Device
	dead atomic.Bool
}

// AllocPD allocates a protection domain.
func (d *Device) AllocPD() (*PD, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil, ErrClosed
	}
	pd := &PD{dev: d}
	d.pds[pd] = struct{}{}
	return pd, nil
}

// Dealloc frees the PD; it fails with ErrBusy while MRs or QPs use it.
func (pd *PD) Dealloc() error {
	d := pd.dev
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, ok := d.pds[pd]; !ok || d.closed {
		return ErrClosed
	}
	for _, mr := range d.mrs {
		if mr.pd == pd {
			return wrap(ErrBusy, "PD has MR %#x", mr.key)
		}
	}
	for qp := range d.qps {
		if qp.pd == pd {
			return wrap(ErrBusy, "PD has QP %d", qp.qpn)
		}
	}
	delete(d.pds, pd)
	pd.dead.Store(true)
	return nil
}

// Device returns the PD's device.
func (pd *PD) Device() *Device { return pd.dev }
