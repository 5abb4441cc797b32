package odp

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// An ODP region four times the resident budget is written by the NIC, then read back
// by the application's CPU (faults served by the C server, evicted pages restored
// from the store). Resident memory is sampled from the kernel's page tables during
// the read-back (how far it overshoots while the background reclaimer catches up is
// logged: a measurement, not a bound); after a reclaim pass it is within the budget
// and the pager's estimate equals the kernel's count.
func TestOvercommitCPUReadBack(t *testing.T) {
	const size, budget = 32 << 20, 8 << 20
	a, b := pair(t, Config{ResidentBudget: budget, FaultAround: 4})
	src, smr := a.region(t, 1<<20, AccessLocalWrite)
	dst, dmr := b.region(t, size, rw|AccessOnDemand)
	for i := range src {
		src[i] = byte(i/ps + 1)
	}
	var wrs []SendWR
	for off := 0; off < size; off += 1 << 20 {
		wrs = append(wrs, SendWR{WRID: uint64(off), Opcode: OpRDMAWrite, SGL: sge(smr, 0, 1<<20), Flags: SendSignaled,
			RemoteAddr: dmr.Addr() + uint64(off), RKey: dmr.RKey()})
	}
	stream(t, a, wrs, 4)
	maxResident := 0
	for p := 0; p < size/ps; p++ {
		require.Equal(t, byte(p%256+1), dst[p*ps+1], "page %d", p)
		if p%256 == 0 {
			maxResident = max(maxResident, residentPages(t, b.dev, dst))
		}
	}
	b.dev.as.pager.Reclaim()
	st := b.dev.Stats()
	kernel := residentPages(t, b.dev, dst)
	t.Logf("budget %d pages: max resident during the read-back %d, after reclaim %d (pager's estimate %d); evictions %d, restores %d",
		budget/ps, maxResident, kernel, st.ResidentPages, st.Evictions, st.Restores)
	assert.LessOrEqual(t, kernel, budget/ps)
	// At rest the pager's estimate is the kernel's count: reclaim starts from a
	// PAGEMAP_SCAN count and follows every install and eviction since. Both devices
	// share one address space, and so one pager: its estimate covers a's buffer too.
	assert.EqualValues(t, kernel+residentPages(t, a.dev, src), st.ResidentPages, "estimate vs pagemap")
}
