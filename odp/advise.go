package odp

// Advice is ibv_advise_mr's advice.
type Advice int

// Advise maps [addr, addr+length) into the NIC's table ahead of use, synchronously
// (ibv_advise_mr with IB_UVERBS_ADVISE_MR_FLAG_FLUSH). It is for ODP MRs only.
func (mr *MR) Advise(advice Advice, addr, length uint64) error {
	if !mr.odp {
		return wrap(ErrNotSupported, "advise on pinned MR %#x", mr.key)
	}
	if advice < AdvisePrefetch || advice > AdvisePrefetchNoFault {
		return wrap(ErrInvalidArgument, "advice %d", advice)
	}
	off, ok := mr.offset(addr, length)
	if !ok || length == 0 {
		return wrap(ErrInvalidArgument, "[%#x, +%d) outside MR %#x", addr, length, mr.key)
	}
	write := advice == AdvisePrefetchWrite
	if write && !mr.access.writable() {
		return wrap(ErrPermission, "PREFETCH_WRITE on MR %#x without write access", mr.key)
	}
	first, count := mr.pageSpan(off, length)
	pages := 0
	for round := 0; ; round++ {
		mr.table.Lock()
		miss := mr.table.MissingLocked(first, count, write)
		mr.table.Unlock()
		if miss < 0 || (advice == AdvisePrefetchNoFault && round > 0) {
			break
		}
		if round == maxFaultRounds {
			return wrap(ErrBusy, "MR %#x: range kept being invalidated", mr.key)
		}
		mapped, err := mr.fault(miss, first+count, write, advice == AdvisePrefetchNoFault)
		if err != nil {
			return err
		}
		pages += mapped
	}
	mr.stats.prefetches.Add(1)
	mr.stats.pagesPrefetched.Add(uint64(pages))
	mr.dev.stats.prefetches.Add(1)
	mr.dev.stats.pagesPrefetched.Add(uint64(pages))
	return nil
}
