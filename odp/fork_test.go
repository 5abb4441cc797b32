package odp

import (
	"testing"

	"github.com/odpemu/odpemu/pagefault"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// forkPaused forks the process with a raw fork(2); the child, one thread and no
// runtime, pauses until the test kills it. Its pages are COW-shared with ours.
func forkPaused(t *testing.T) {
	t.Helper()
	pid, _, errno := unix.RawSyscall(unix.SYS_FORK, 0, 0, 0)
	require.Zero(t, errno)
	if pid == 0 {
		for {
			_, _, _ = unix.RawSyscall(unix.SYS_PAUSE, 0, 0, 0) // the child waits to be killed
		}
	}
	t.Cleanup(func() {
		require.NoError(t, unix.Kill(int(pid), unix.SIGKILL))
		var ws unix.WaitStatus
		_, err := unix.Wait4(int(pid), &ws, 0, nil)
		require.NoError(t, err)
	})
}

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
	forkPaused(t)
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
