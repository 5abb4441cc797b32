package odp

import (
	"testing"

	"github.com/odpemu/odpemu/internal/forktest"

	"github.com/odpemu/odpemu/pagefault"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// Why pinning exists, and why ODP follows fork: after fork a parent write breaks COW.
// A pinned MR's MTT keeps the old frame (now the child's), so the NIC's DMA goes where
// the CPU no longer looks; an ODP MR is invalidated by the FORK event and its next
// write faults onto the parent's copy. (Real pin_user_pages(FOLL_LONGTERM) pages are
// copied for the child at fork instead; odpemu pins with mlock, which is not a pin.)
func TestForkCOWPinnedVsODP(t *testing.T) {
	if !pagefault.ProbeKernel().Features.Has(pagefault.FeatureEventFork) || pagefault.ProbeKernel().Mode != pagefault.ModeKernel {
		t.Skip("needs UFFD_FEATURE_EVENT_FORK (CAP_SYS_PTRACE)")
	}
	a, b := pair(t, Config{Audit: true, FaultAround: 1})
	if !b.dev.PFNsReadable() {
		t.Skip("the audit of pinned MRs needs page frame numbers (root)")
	}
	src, smr := a.region(t, 4*ps, AccessLocalWrite)
	pinnedBuf, pinned := b.region(t, 4*ps, rw)
	odpBuf, onDemand := b.region(t, 4*ps, rw|AccessOnDemand)
	src[0] = 1
	for _, dst := range []*MR{pinned, onDemand} {
		require.Equal(t, WCSuccess, do(t, a, write(smr, 0, 4*ps, dst, 0)).Status)
	}
	assert.ErrorIs(t, b.dev.Discard(pinnedBuf), unix.EINVAL, "MADV_DONTNEED on pinned memory is refused")

	before := b.dev.Stats()
	forktest.Paused(t)
	require.NoError(t, b.dev.SyncEvents())
	assert.Equal(t, before.Forks+1, b.dev.Stats().Forks)
	assert.Zero(t, onDemand.Stats().ValidPages, "the FORK event dropped the ODP translations")

	pinnedBuf[0], odpBuf[0] = 2, 2 // the parent's writes break COW: new frames
	for _, dst := range []*MR{pinned, onDemand} {
		require.Equal(t, WCSuccess, do(t, a, write(smr, 0, 8, dst, 0)).Status)
	}
	assert.EqualValues(t, 1, b.dev.Stats().StaleDMAs-before.StaleDMAs, "only the pinned MR's DMA used a stale frame")
	assert.Zero(t, onDemand.Stats().StaleDMAs)
}
