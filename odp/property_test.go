package odp

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
)

// The property test: random programs of work requests (every opcode, some of them
// failing on purpose) run against the emulated NICs and against a model of memory and
// QP state; completions and memory contents must agree. Programs run in batches;
// between batches ODP pages are dropped at random (the model's become zero), so
// requests fault, and responders answer RNR NAKs. A failure names the seed and the
// step.

// propModel is the expected state: every buffer's bytes.
type propModel struct {
	mem map[*MR][]byte
}

type propEnv struct {
	a, b       *node
	local      *MR // a: rwa, the requester's buffer
	remote     *MR // b: rwa, the target of WRITE, READ and atomics
	recvBuf    *MR // b: receives land here
	readOnly   *MR // b: REMOTE_READ only
	bufs       map[*MR][]byte
	model      propModel
	odp        map[*MR]bool
	rng        *rand.Rand
	recvPosted []RecvWR
}

const propSize = 4 * 4096

func newPropEnv(t *testing.T, rng *rand.Rand) *propEnv {
	a, b := pair(t, Config{FaultAround: 1 << rng.IntN(3)})
	e := &propEnv{a: a, b: b, bufs: map[*MR][]byte{}, model: propModel{mem: map[*MR][]byte{}}, odp: map[*MR]bool{}, rng: rng}
	reg := func(n *node, access Access) *MR {
		if rng.IntN(3) > 0 {
			access |= AccessOnDemand
		}
		buf, mr := n.region(t, propSize, access)
		for i := range buf {
			buf[i] = byte(rng.Uint32())
		}
		e.bufs[mr] = buf
		e.model.mem[mr] = append([]byte(nil), buf...)
		e.odp[mr] = access&AccessOnDemand != 0
		return mr
	}
	e.local, e.remote, e.recvBuf, e.readOnly = reg(a, rwa), reg(b, rwa), reg(b, rwa), reg(b, AccessRemoteRead)
	return e
}

// expect is what the model says a request completes with.
type expect struct {
	status  WCStatus
	recv    *WC // the receive completion at b, if any
	failure bool
	// undefined is a buffer whose content the request leaves undefined: a SEND
	// larger than its receive may have placed its first packets when the one that
	// overflows arrives (IBTA leaves the receive buffer undefined on an error; a NIC
	// places packets as they arrive).
	undefined *MR
}

// step generates one request and applies it to the model, returning the request
// and what its completion must be.
func (e *propEnv) step(wrid uint64) (SendWR, expect, string) {
	rng := e.rng
	lm := e.model.mem[e.local]
	rm := e.model.mem[e.remote]
	off := func(n int) int { return rng.IntN(propSize - n + 1) }
	n := 1 + rng.IntN(3*4096)
	lo := off(n)
	wr := SendWR{WRID: wrid, Flags: SendSignaled, SGL: sge(e.local, lo, n)}
	fail := rng.IntN(12) == 0 // about one request in twelve is bad
	switch op := rng.IntN(7); op {
	case 0, 1: // WRITE, WRITE_IMM
		ro := off(n)
		wr.Opcode, wr.RemoteAddr, wr.RKey, wr.Imm = OpRDMAWrite, e.remote.Addr()+uint64(ro), e.remote.RKey(), rng.Uint32()
		if op == 1 {
			wr.Opcode = OpRDMAWriteImm
		}
		if fail {
			wr.RKey = e.readOnly.RKey()
			wr.RemoteAddr = e.readOnly.Addr() + uint64(ro)
			return wr, expect{status: WCRemAccessErr, failure: true}, "write without REMOTE_WRITE"
		}
		copy(rm[ro:ro+n], lm[lo:lo+n])
		ex := expect{status: WCSuccess}
		if op == 1 {
			ex.recv = &WC{Opcode: WCRecvRDMAWithImm, ByteLen: uint32(n), Flags: WCWithImm, ImmData: wr.Imm}
		}
		return wr, ex, ""
	case 2, 3: // SEND, SEND_IMM into a receive of propSize/2 bytes at offset 0
		wr.Opcode, wr.Imm = OpSend, rng.Uint32()
		if op == 3 {
			wr.Opcode = OpSendImm
		}
		if fail || n > propSize/2 {
			wr.SGL = sge(e.local, 0, propSize/2+1)
			return wr, expect{status: WCRemInvReqErr, failure: true, recv: &WC{Status: WCLocLenErr}, undefined: e.recvBuf}, "send larger than the receive"
		}
		copy(e.model.mem[e.recvBuf][:n], lm[lo:lo+n])
		rwc := &WC{Opcode: WCRecv, ByteLen: uint32(n)}
		if op == 3 {
			rwc.Flags, rwc.ImmData = WCWithImm, wr.Imm
		}
		return wr, expect{status: WCSuccess, recv: rwc}, ""
	case 4: // READ
		ro := off(n)
		wr.Opcode, wr.RemoteAddr, wr.RKey = OpRDMARead, e.remote.Addr()+uint64(ro), e.remote.RKey()
		if fail {
			wr.RemoteAddr = e.remote.Addr() + propSize - uint64(n) + 1
			return wr, expect{status: WCRemAccessErr, failure: true}, "read past the MR's end"
		}
		copy(lm[lo:lo+n], rm[ro:ro+n])
		return wr, expect{status: WCSuccess}, ""
	default: // atomics
		ro := rng.IntN(propSize/8) * 8
		lo = rng.IntN(propSize/8) * 8
		wr.SGL = sge(e.local, lo, 8)
		wr.RemoteAddr, wr.RKey = e.remote.Addr()+uint64(ro), e.remote.RKey()
		cur := binary.NativeEndian.Uint64(rm[ro:])
		if fail {
			wr.Opcode, wr.RemoteAddr = OpAtomicFetchAdd, wr.RemoteAddr+4
			return wr, expect{status: WCRemInvReqErr, failure: true}, "misaligned atomic"
		}
		if op == 5 {
			wr.Opcode, wr.CompareAdd, wr.Swap = OpAtomicCmpSwap, rng.Uint64(), rng.Uint64()
			if rng.IntN(2) == 0 {
				wr.CompareAdd = cur
			}
			if cur == wr.CompareAdd {
				binary.NativeEndian.PutUint64(rm[ro:], wr.Swap)
			}
		} else {
			wr.Opcode, wr.CompareAdd = OpAtomicFetchAdd, rng.Uint64()
			binary.NativeEndian.PutUint64(rm[ro:], cur+wr.CompareAdd)
		}
		binary.NativeEndian.PutUint64(lm[lo:], cur)
		return wr, expect{status: WCSuccess}, ""
	}
}

func TestPropertyRandomPrograms(t *testing.T) {
	base := stressSeed(t)
	for p := uint64(0); p < 12; p++ {
		seed := base + p
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(seed, 7))
			e := newPropEnv(t, rng)
			var wrid uint64
			failed := false
			for batch := 0; batch < 8 && !failed; batch++ {
				for mr, odp := range e.odp { // the application drops pages between batches
					if odp && rng.IntN(2) == 0 {
						dontneed(t, e.bufs[mr])
						clear(e.model.mem[mr])
					}
				}
				var exps []expect
				var whys []string
				var wrs []SendWR
				fence := false // a READ or atomic went before: later requests read what it wrote
				for k := 1 + rng.IntN(6); k > 0; k-- {
					wrid++
					wr, ex, why := e.step(wrid)
					if fence {
						wr.Flags |= SendFence
					}
					fence = fence || wr.Opcode.readsBack()
					if ex.recv != nil {
						require.NoError(t, e.b.qp.PostRecv(RecvWR{WRID: wrid, SGL: sge(e.recvBuf, 0, propSize/2)}))
					}
					require.NoError(t, e.a.qp.PostSend(wr))
					wrs, exps, whys = append(wrs, wr), append(exps, ex), append(whys, why)
					if ex.failure {
						break // the QP is in ERR after it: the program ends
					}
				}
				for i, ex := range exps {
					wc := wait(t, e.a.scq)
					require.Equal(t, wrs[i].WRID, wc.WRID, "seed %d: completions in order", seed)
					require.Equal(t, ex.status, wc.Status, "seed %d, WR %d (%v, %s): %s", seed, wc.WRID, wrs[i].Opcode, whys[i], wc.Detail)
					if ex.recv != nil {
						rwc := wait(t, e.b.rcq)
						want := *ex.recv
						want.WRID, want.QPNum = wrs[i].WRID, e.b.qp.QPNum()
						if want.Status != WCSuccess {
							rwc = WC{WRID: rwc.WRID, Status: rwc.Status, QPNum: rwc.QPNum}
						}
						require.Equal(t, want, WC{WRID: rwc.WRID, Status: rwc.Status, Opcode: rwc.Opcode, ByteLen: rwc.ByteLen,
							QPNum: rwc.QPNum, Flags: rwc.Flags, ImmData: rwc.ImmData}, "seed %d, WR %d: receive completion: %s", seed, wc.WRID, rwc.Detail)
					}
					failed = failed || ex.failure
					if ex.undefined != nil {
						copy(e.model.mem[ex.undefined], e.bufs[ex.undefined])
					}
				}
				for mr, want := range e.model.mem {
					if i := firstDiff(e.bufs[mr], want); i >= 0 {
						t.Fatalf("seed %d, batch %d: MR %#x differs from the model at byte %d", seed, batch, mr.LKey(), i)
					}
				}
			}
			if failed {
				require.Equal(t, StateError, e.a.qp.State(), "seed %d", seed)
				// Posting after the failure flushes.
				require.NoError(t, e.a.qp.PostSend(SendWR{WRID: 999, Opcode: OpSend, Flags: SendSignaled}))
				require.Equal(t, WCWRFlushErr, wait(t, e.a.scq).Status)
			}
			require.True(t, bytes.Equal(e.bufs[e.local], e.model.mem[e.local]))
		})
	}
}
