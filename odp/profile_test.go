package odp

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The presets are named once each, found by name, say where their numbers come
// from, and make configurations a device opens with.
func TestProfilePresets(t *testing.T) {
	seen := map[string]bool{}
	for _, p := range Profiles() {
		require.NotEmpty(t, p.Name)
		require.False(t, seen[p.Name], "%s named twice", p.Name)
		seen[p.Name] = true
		assert.NotEmpty(t, p.Source, p.Name)
		got, err := LookupProfile(p.Name)
		require.NoError(t, err)
		assert.Equal(t, p, got)
		assert.Contains(t, p.Describe(), p.Fault.String(), p.Name)
		c := p.Apply(Config{FaultAround: 4, Name: "kept"})
		assert.Equal(t, 4, c.FaultAround, "Apply keeps what the profile does not set")
		assert.Equal(t, "kept", c.Name)
		assert.Equal(t, p.Fault, c.FaultModel)
		assert.Equal(t, p.Link, c.Link)
		assert.Equal(t, p.ResponderFaults, c.ResponderFaults)
		assert.Equal(t, p.Reg, c.RegModel)
		assert.Equal(t, p.RdAtomic, c.RdAtomic)
		require.NoError(t, c.checkProfile(), p.Name)
	}
	def, err := LookupProfile("")
	require.NoError(t, err)
	assert.Equal(t, ProfileEmulator, def)
	assert.Equal(t, "emulator", Profile{}.String())
	_, err = LookupProfile("connectx9")
	require.True(t, errors.Is(err, ErrInvalidArgument), "%v", err)
	assert.Contains(t, err.Error(), "connectx4", "the error names the presets")

	// The numbers the sources give.
	assert.Equal(t, FaultModelConnectX4, ProfileConnectX4.Fault)
	assert.Equal(t, 700*time.Microsecond, ProfileProduction.Fault.Latency(1))
	assert.Equal(t, 60*time.Microsecond, ProfileNPRDMAMajor.Fault.Latency(1))
	assert.Equal(t, FaultStall, ProfileRXE.ResponderFaults)
	assert.Equal(t, FaultRNR, ProfileConnectX4.ResponderFaults)
	n := ProfileConnectX4.Apply(Config{}).normalized()
	assert.EqualValues(t, 4<<20, n.PrefetchLimit, "mlx5's MAX_PREFETCH_LEN")
	assert.EqualValues(t, 1<<30, n.ImplicitChild, "mlx5's implicit children")
	assert.Equal(t, 16, n.RdAtomic, "mlx5's max_qp_rd_atom")
	assert.Equal(t, 128, ProfileRXE.Apply(Config{}).normalized().RdAtomic, "rxe's RXE_MAX_QP_RD_ATOM")
	assert.Contains(t, ProfileRXE.Describe(), "READs outstanding 128")
	assert.Zero(t, ProfileRXE.Apply(Config{}).normalized().PrefetchLimit, "rxe faults per packet")
	assert.True(t, strings.HasPrefix(ProfileConnectX4.Describe(), "fault connectx4"), ProfileConnectX4.Describe())
}

func TestProfileRefusesNonsense(t *testing.T) {
	for _, c := range []Config{{RegModel: RegModel{Reg: -1}}, {RegModel: RegModel{Dereg: 2 * time.Second}},
		{ImplicitChild: 3 << 20}, {ImplicitChild: 512}, {ImplicitChild: 1 << 50}, {RdAtomic: -1}, {RdAtomic: 129}, {RdAtomic: 100}} {
		_, err := Open(c)
		assert.True(t, errors.Is(err, ErrInvalidArgument), "%+v: %v", c, err)
	}
}

// A RegModel holds registration and deregistration for the firmware's cost, pinned
// and ODP alike, and says so in the registration's timing; without one nothing is
// added.
func TestRegModelHoldsRegistration(t *testing.T) {
	model := RegModel{Reg: 3 * time.Millisecond, Dereg: 2 * time.Millisecond}
	for _, access := range []Access{AccessLocalWrite, AccessLocalWrite | AccessOnDemand} {
		n := newNode(t, Config{RegModel: model})
		buf, err := n.dev.Alloc(4 * ps)
		require.NoError(t, err)
		mr, err := n.pd.RegMR(buf, access)
		require.NoError(t, err)
		reg := mr.Registration()
		assert.GreaterOrEqual(t, reg.Firmware, model.Reg, "access %v", access)
		assert.GreaterOrEqual(t, reg.Total, reg.Firmware)
		t0 := time.Now()
		require.NoError(t, mr.Dereg())
		assert.GreaterOrEqual(t, time.Since(t0), model.Dereg, "access %v", access)

		plain := newNode(t, Config{})
		mr, err = plain.pd.RegMR(buf, access)
		require.NoError(t, err)
		assert.Zero(t, mr.Registration().Firmware)
		require.NoError(t, mr.Dereg())
	}
	n := newNode(t, Config{RegModel: model})
	mr, err := n.pd.RegImplicitMR(rwa)
	require.NoError(t, err)
	assert.GreaterOrEqual(t, mr.Registration().Firmware, model.Reg, "implicit")
	require.NoError(t, mr.Dereg())
	// A refused deregistration costs nothing and changes nothing.
	require.Error(t, mr.Dereg())
}

// A responder's fault on a WRITE maps the rest of the message up to the prefetch
// limit: with mlx5's 4 MiB one fault serves a 1 MiB WRITE, with none each run
// faults its own pages.
func TestPrefetchLimit(t *testing.T) {
	const msg = 1 << 20
	faults := func(limit int64) uint64 {
		a, b := pair(t, Config{FaultAround: 1, NoSnapshot: true, PrefetchLimit: limit})
		_, smr := a.region(t, msg, AccessLocalWrite)
		_, dmr := b.region(t, msg, rw|AccessOnDemand)
		require.NoError(t, a.qp.PostSend(SendWR{Opcode: OpRDMAWrite, SGL: sge(smr, 0, msg), Flags: SendSignaled,
			RemoteAddr: dmr.Addr(), RKey: dmr.RKey()}))
		wc := wait(t, a.scq)
		require.Equal(t, WCSuccess, wc.Status, wc.Detail)
		st := dmr.Stats()
		assert.EqualValues(t, msg/ps, st.ValidPages, "limit %d: the message is mapped", limit)
		return st.PageFaults
	}
	def, part, none := faults(0), faults(64<<10), faults(-1)
	assert.EqualValues(t, 1, def, "mlx5's limit: one fault maps the message")
	assert.Greater(t, part, def, "a 64 KiB limit")
	assert.GreaterOrEqual(t, none, part, "no prefetch")
	assert.GreaterOrEqual(t, none, uint64(4), "no prefetch: runs of at most 256 KiB fault one by one")
}

// An implicit MR's children: the first fault in each creates it, at the firmware's
// cost of a registration; a later fault in a child it created costs none; Dereg
// destroys them all.
func TestImplicitChildren(t *testing.T) {
	const child = 2 << 20
	model := RegModel{Reg: 4 * time.Millisecond, Dereg: time.Millisecond}
	a, b := pair(t, Config{FaultAround: 1, NoSnapshot: true, ImplicitChild: child, RegModel: model})
	_, smr := a.region(t, ps, AccessLocalWrite)
	buf, err := b.dev.Alloc(3 * child)
	require.NoError(t, err)
	mr, err := b.pd.RegImplicitMR(rwa)
	require.NoError(t, err)
	// A child boundary inside buf with a page of buf before it.
	base := (uint64(addrOf(buf)) + uint64(ps) + child - 1) &^ (child - 1)
	write := func(addr uint64) time.Duration {
		t.Helper()
		f0 := mr.Stats().FaultTime
		require.NoError(t, a.qp.PostSend(SendWR{Opcode: OpRDMAWrite, SGL: sge(smr, 0, 64), Flags: SendSignaled,
			RemoteAddr: addr, RKey: mr.RKey()}))
		wc := wait(t, a.scq)
		require.Equal(t, WCSuccess, wc.Status, wc.Detail)
		return mr.Stats().FaultTime - f0
	}
	assert.GreaterOrEqual(t, write(base), model.Reg, "the first fault creates its child")
	assert.EqualValues(t, 1, mr.Stats().Children)
	write(base + child/2) // the same child: a fault, no child
	st := mr.Stats()
	assert.EqualValues(t, 2, st.PageFaults)
	assert.EqualValues(t, 1, st.Children)
	assert.GreaterOrEqual(t, write(base+child), model.Reg, "the next child")
	assert.EqualValues(t, 2, mr.Stats().Children)
	// A prefetch creates the children it reaches.
	require.NoError(t, mr.Advise(AdvisePrefetchWrite, base-uint64(ps), uint64(ps)))
	assert.EqualValues(t, 3, mr.Stats().Children, "the child before")
	t0 := time.Now()
	require.NoError(t, mr.Dereg())
	assert.GreaterOrEqual(t, time.Since(t0), 4*model.Dereg, "the MR and its three children")
}
