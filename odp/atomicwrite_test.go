package odp

import (
	"encoding/binary"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/odpemu/odpemu/transport/roce"
)

// atomicWrite is an RDMA ATOMIC WRITE of the 8 bytes at src's off to dst's roff.
func atomicWrite(src *MR, off int, dst *MR, roff uint64) SendWR {
	wr := write(src, off, 8, dst, roff)
	wr.Opcode = OpAtomicWrite
	return wr
}

// An atomic write stores its 8 bytes in the peer's MR, pinned or ODP (its page
// faulting in), from an SGE or inline, and completes with WCAtomicWrite; a
// misaligned one is an invalid request, one into an MR without REMOTE_WRITE a remote
// access error.
func TestAtomicWrite(t *testing.T) {
	for _, mode := range memModes {
		t.Run(mode.name, func(t *testing.T) {
			a, b := pair(t, Config{})
			src, smr := a.region(t, ps, rw)
			dst, dmr := b.region(t, 4*ps, rw|mode.odp)
			binary.NativeEndian.PutUint64(src, 0x0102030405060708)
			wr := atomicWrite(smr, 0, dmr, 3*up+16)
			wr.WRID = 1
			require.NoError(t, a.qp.PostSend(wr))
			wc := wait(t, a.scq)
			require.Equal(t, WC{WRID: 1, Opcode: WCAtomicWrite, QPNum: a.qp.QPNum()}, wc, wc.Detail)
			assert.EqualValues(t, 0x0102030405060708, binary.NativeEndian.Uint64(dst[3*ps+16:]))
			assert.Zero(t, binary.NativeEndian.Uint64(dst[3*ps+24:]), "8 bytes, no more")

			var v [8]byte
			binary.NativeEndian.PutUint64(v[:], 77)
			wr = SendWR{WRID: 2, Opcode: OpAtomicWrite, Flags: SendSignaled | SendInline, RemoteAddr: dmr.Addr() + 8,
				RKey: dmr.RKey(), SGL: []SGE{{Addr: uint64(addrOf(v[:])), Length: 8}}}
			require.NoError(t, a.qp.PostSend(wr))
			v[0] = 0 // the bytes were copied at post time
			wc = wait(t, a.scq)
			require.Equal(t, WCSuccess, wc.Status, wc.Detail)
			assert.EqualValues(t, 77, binary.NativeEndian.Uint64(dst[8:]))
		})
	}
	for _, c := range []struct {
		name   string
		access Access
		roff   uint64
		want   WCStatus
		why    string
	}{
		{"misaligned", rw, 4, WCRemInvReqErr, "not 8-byte aligned"},
		{"read-only MR", AccessRemoteRead, 0, WCRemAccessErr, "lacks REMOTE_WRITE"},
	} {
		t.Run(c.name, func(t *testing.T) {
			a, b := pair(t, Config{})
			_, smr := a.region(t, ps, rw)
			_, dmr := b.region(t, ps, c.access)
			require.NoError(t, a.qp.PostSend(atomicWrite(smr, 0, dmr, c.roff)))
			wc := wait(t, a.scq)
			assert.Equal(t, c.want, wc.Status)
			assert.Contains(t, b.qp.RespError(), c.why)
		})
	}
	a, _ := pair(t, Config{})
	_, smr := a.region(t, ps, rw)
	bad := atomicWrite(smr, 0, smr, 0)
	bad.SGL[0].Length = 4
	assert.ErrorIs(t, a.qp.PostSend(bad), ErrInvalidArgument, "an atomic write carries 8 bytes")
}

// Atomic writes interleaved with WRITEs to the same words, over a link that loses,
// duplicates and reorders packets: each atomic write is executed once, so a
// duplicate arriving after the WRITE that followed it does not undo that WRITE.
func TestAtomicWriteOnceOverLossyLink(t *testing.T) {
	a, b := lossyPair(t, roce.Loss{Seed: 11, Drop: 0.02, Duplicate: 0.05, Reorder: 0.02})
	const words = 400
	src, smr := a.region(t, 2*words*8, rw)
	dst, dmr := b.region(t, words*8, rw|AccessOnDemand)
	wrs := make([]SendWR, 0, 2*words)
	for i := range words {
		binary.NativeEndian.PutUint64(src[16*i:], uint64(1000+i))   // what the atomic write stores
		binary.NativeEndian.PutUint64(src[16*i+8:], uint64(2000+i)) // what the WRITE after it stores
		aw := atomicWrite(smr, 16*i, dmr, uint64(8*i))
		w := write(smr, 16*i+8, 8, dmr, uint64(8*i))
		aw.WRID, w.WRID, w.Flags = uint64(2*i), uint64(2*i+1), SendSignaled
		wrs = append(wrs, aw, w)
	}
	stream(t, a, wrs, 64)
	for i := range words {
		require.EqualValues(t, 2000+i, binary.NativeEndian.Uint64(dst[8*i:]), "word %d", i)
	}
	assert.Positive(t, b.qp.Stats().Duplicates, "duplicates reached the responder, which answered them again")
}
