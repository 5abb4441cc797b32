package odp

import (
	"bytes"
	"os"
	"os/exec"
	"testing"

	"github.com/odpemu/odpemu/internal/seccomp"
	"github.com/odpemu/odpemu/pagefault"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// denyUffdEnv marks a re-executed test binary that runs under a seccomp filter
// refusing userfaultfd, as in a container with the default seccomp profile.
const denyUffdEnv = "ODPEMU_TEST_DENY_USERFAULTFD"

// In a process that may not create a userfaultfd (a container's default seccomp
// profile), a device still opens, without ODP: its ODP caps are zero, AccessOnDemand
// and implicit MRs are refused with ErrNotSupported (EOPNOTSUPP, as the kernel
// refuses IB_ACCESS_ON_DEMAND on a device without ODP), and pinned memory, from
// Alloc or the application's own, works for WRITE, READ and SEND. Paging, which
// needs a userfaultfd, is refused at Open. Run in a child process, which keeps the
// filter.
func TestNoUserfaultfd(t *testing.T) {
	if os.Getenv(denyUffdEnv) == "" {
		cmd := exec.Command(os.Args[0], "-test.run", "^TestNoUserfaultfd$", "-test.v", "-test.count=1")
		cmd.Env = append(os.Environ(), denyUffdEnv+"=1")
		out, err := cmd.CombinedOutput()
		if bytes.Contains(out, []byte("seccomp: no filter for GOARCH")) {
			t.Skipf("skipped: %s", out)
		}
		require.NoError(t, err, "%s", out)
		require.Contains(t, string(out), "--- PASS: TestNoUserfaultfd", "%s", out)
		return
	}
	require.NoError(t, seccomp.DenyUserfaultfd())
	require.ErrorIs(t, pagefault.ProbeKernel().Err, pagefault.ErrRefused)
	_, err := pagefault.Open(pagefault.Options{})
	require.ErrorIs(t, err, pagefault.ErrRefused)
	t.Logf("as in a container: %v", err)

	_, err = Open(Config{Paging: true})
	require.ErrorIs(t, err, ErrNotSupported, "paging needs a userfaultfd")
	assert.Contains(t, err.Error(), "userfaultfd")

	a, b := pair(t, Config{})
	assert.Equal(t, pagefault.ModeNone, a.dev.FaultMode())
	assert.Equal(t, ODPCaps{}, a.dev.QueryDevice().ODP, "no ODP without a userfaultfd")

	own := make([]byte, 1<<16) // the application's own memory
	_, err = a.pd.RegMR(own, rw|AccessOnDemand)
	require.ErrorIs(t, err, ErrNotSupported)
	assert.ErrorIs(t, err, unix.EOPNOTSUPP)
	buf, err := a.dev.Alloc(1 << 16)
	require.NoError(t, err)
	_, err = a.pd.RegMR(buf, rw|AccessOnDemand)
	require.ErrorIs(t, err, ErrNotSupported, "nor over a buffer from Alloc")
	_, err = a.pd.RegImplicitMR(rw)
	require.ErrorIs(t, err, ErrNotSupported)
	require.NoError(t, a.dev.Free(buf))

	// Pinned: WRITE from the application's memory into a buffer from Alloc, READ
	// it back, SEND.
	for i := range own {
		own[i] = byte(i*13 + 1)
	}
	smr, err := a.pd.RegMR(own, rw)
	require.NoError(t, err)
	dst, dmr := b.region(t, 1<<16, rw)
	require.NoError(t, a.qp.PostSend(SendWR{WRID: 1, Opcode: OpRDMAWrite, SGL: sge(smr, 0, 40000), Flags: SendSignaled,
		RemoteAddr: dmr.Addr() + 100, RKey: dmr.RKey()}))
	wc := wait(t, a.scq)
	require.Equal(t, WCSuccess, wc.Status, wc.Detail)
	require.Equal(t, own[:40000], dst[100:40100])
	require.NoError(t, a.qp.PostSend(SendWR{WRID: 2, Opcode: OpRDMARead, SGL: sge(smr, 50000, 1000), Flags: SendSignaled,
		RemoteAddr: dmr.Addr() + 100, RKey: dmr.RKey()}))
	wc = wait(t, a.scq)
	require.Equal(t, WCSuccess, wc.Status, wc.Detail)
	require.Equal(t, own[:1000], own[50000:51000])
	require.NoError(t, b.qp.PostRecv(RecvWR{WRID: 7, SGL: sge(dmr, 60000, 4000)}))
	require.NoError(t, a.qp.PostSend(SendWR{WRID: 3, Opcode: OpSend, SGL: sge(smr, 0, 3000), Flags: SendSignaled}))
	require.Equal(t, WCSuccess, wait(t, a.scq).Status)
	rwc := wait(t, b.rcq)
	require.Equal(t, WCSuccess, rwc.Status, rwc.Detail)
	assert.Equal(t, own[:3000], dst[60000:63000])

	st := b.dev.Stats()
	assert.Zero(t, st.PageFaults)
	assert.EqualValues(t, 1<<16, st.PinnedBytes)
	require.NoError(t, smr.Dereg())
}
