package pagefault

import "sync/atomic"

// SetState stores page i's state (tests only: they put a page in a state by hand).
func (r *PagedRegion) SetState(i int, v uint32) { atomic.StoreUint32(&r.states[i], v) }
