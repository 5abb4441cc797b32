package odp

import (
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestFaultModelLatency(t *testing.T) {
	m := FaultModelConnectX4
	// The ASPLOS 2017 figures the preset is derived from, within a microsecond.
	assert.InDelta(t, 220e3, float64(m.Latency(1)), 1e3)
	assert.InDelta(t, 350e3, float64(m.Latency(1024)), 1e3)
	assert.Equal(t, "emulator", FaultModel{}.String())
	assert.Equal(t, "1ms/fault+0s/page", FaultModel{PerFault: time.Millisecond}.String())
}

func TestFaultModelRefusesNonsense(t *testing.T) {
	for _, m := range []FaultModel{{PerFault: -1}, {PerPage: -1}, {PerFault: 2 * time.Second}, {PerPage: 2 * time.Millisecond}} {
		_, err := Open(Config{FaultModel: m})
		assert.True(t, errors.Is(err, ErrInvalidArgument), "%v: %v", m, err)
	}
}

// A modelled fault holds the DMA at least the model's latency; the phases account
// for the time, and a warm access pays nothing.
func TestFaultModelHoldsTheFault(t *testing.T) {
	model := FaultModel{Name: "test", PerFault: 3 * time.Millisecond, PerPage: 100 * time.Microsecond}
	for _, policy := range []FaultPolicy{FaultStall, FaultRNR} {
		t.Run(policy.String(), func(t *testing.T) {
			a, b := pair(t, Config{FaultAround: 4, NoSnapshot: true, FaultModel: model, ResponderFaults: policy})
			_, smr := a.region(t, 64<<10, AccessLocalWrite)
			_, dmr := b.region(t, 1<<20, rw|AccessOnDemand)
			write := func() time.Duration {
				t0 := time.Now()
				require.NoError(t, a.qp.PostSend(SendWR{Opcode: OpRDMAWrite, SGL: sge(smr, 0, 100), Flags: SendSignaled,
					RemoteAddr: dmr.Addr(), RKey: dmr.RKey()}))
				require.Equal(t, WCSuccess, wait(t, a.scq).Status)
				return time.Since(t0)
			}
			cold := write()
			st := b.dev.Stats()
			require.EqualValues(t, 1, st.PageFaults)
			require.EqualValues(t, 4, st.PagesFaulted)
			assert.GreaterOrEqual(t, st.FaultTime, model.Latency(4), "the fault lasted the model's latency")
			assert.GreaterOrEqual(t, cold, model.Latency(4), "the WRITE waited for it")
			ph := st.Phases
			assert.Positive(t, ph.Resolve)
			assert.Positive(t, ph.Update)
			assert.Positive(t, ph.Model)
			assert.LessOrEqual(t, ph.Resolve+ph.Update+ph.Model, st.FaultTime)
			write()
			assert.EqualValues(t, 1, b.dev.Stats().PageFaults, "a warm WRITE takes no fault")
			assert.Equal(t, ph.Model, b.dev.Stats().Phases.Model)
		})
	}
}
