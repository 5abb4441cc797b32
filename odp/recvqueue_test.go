package odp

import (
	"context"
	"fmt"
	"math/rand/v2"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The receive ring's rules, without a QP: order, capacity across wrap-arounds,
// copies that do not alias the ring's slots, and a flush between look and take.
func TestRecvQueueRing(t *testing.T) {
	q := recvQueue{slots: make([]rqe, 3)}
	var dst RecvWR
	_, ok := q.peek(&dst)
	require.False(t, ok, "empty ring")
	next := uint64(0) // the next WRID to post; taken in order
	for round := 0; round < 10; round++ {
		for q.postLocked(&RecvWR{WRID: next, SGL: []SGE{{Addr: next, Length: 1}}}) {
			next++
		}
		require.Equal(t, 3, q.len(), "round %d: full at three", round)
		seq, ok := q.peek(&dst)
		require.True(t, ok)
		want := next - 3
		require.Equal(t, want, dst.WRID)
		require.True(t, q.take(seq))
		require.False(t, q.take(seq), "taken twice")
		// The slot is posted again; the copy the engine holds does not change.
		require.True(t, q.postLocked(&RecvWR{WRID: next, SGL: []SGE{{Addr: 1000 + next, Length: 2}}}))
		next++
		assert.Equal(t, RecvWR{WRID: want, SGL: []SGE{{Addr: want, Length: 1}}}, dst)
		for q.len() > 0 {
			seq, ok := q.peek(&dst)
			require.True(t, ok)
			require.True(t, q.take(seq))
		}
	}
	// More SGEs than a slot keeps in itself.
	long := make([]SGE, 7)
	for i := range long {
		long[i] = SGE{Addr: uint64(i), Length: uint32(i + 1), LKey: 9}
	}
	require.True(t, q.postLocked(&RecvWR{WRID: 77, SGL: long}))
	long[0].Addr = 99 // the caller's slice is copied at post time
	seq, ok := q.peek(&dst)
	require.True(t, ok)
	require.Len(t, dst.SGL, 7)
	assert.Equal(t, uint64(0), dst.SGL[0].Addr)
	// A flush between the engine's look and its take: the take fails, and the
	// receive completes once, flushed.
	require.True(t, q.postLocked(&RecvWR{WRID: 78}))
	var flushed []uint64
	q.flushLocked(func(wrid uint64) { flushed = append(flushed, wrid) })
	assert.Equal(t, []uint64{77, 78}, flushed)
	assert.False(t, q.take(seq), "taken after the flush")
	assert.Zero(t, q.len())
	_, ok = q.peek(&dst)
	assert.False(t, ok)
}

// The ring from three goroutines, as a QP uses it: the application posts under its
// lock, the engine looks and takes without one, and a flush (the move to ERR)
// empties the ring once, under the lock, after which nothing is posted. Every
// receive is taken or flushed exactly once, in posting order, and what the engine
// copied is the receive it took, never a slot being written.
func TestRecvQueueConcurrent(t *testing.T) {
	for _, procs := range []int{1, 2} {
		t.Run(fmt.Sprintf("GOMAXPROCS=%d", procs), func(t *testing.T) {
			defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(procs))
			seed := uint64(time.Now().UnixNano())
			rng := rand.New(rand.NewPCG(seed, 23))
			for round := 0; round < 50; round++ {
				const n = 2000
				q := recvQueue{slots: make([]rqe, 1+rng.IntN(8))}
				var mu sync.Mutex            // the posters' lock (QP.mu)
				flushAt := rng.IntN(n + n/4) // posts before the flush; past n: none
				var flushed []uint64
				erred := false
				stopped := make(chan struct{})
				go func() { // the application
					defer close(stopped)
					for i := uint64(0); i < n; {
						mu.Lock()
						if erred {
							mu.Unlock()
							return
						}
						if int(i) == flushAt {
							erred = true
							q.flushLocked(func(wrid uint64) { flushed = append(flushed, wrid) })
							mu.Unlock()
							return
						}
						if q.postLocked(&RecvWR{WRID: i, SGL: []SGE{{Addr: i, Length: uint32(i)}}}) {
							i++
						}
						mu.Unlock()
						runtime.Gosched()
					}
				}()
				var taken []uint64
				var dst RecvWR
				for done := false; !done; {
					select {
					case <-stopped:
						done = true // one more look after the last post
					default:
					}
					for seq, ok := q.peek(&dst); ok; seq, ok = q.peek(&dst) {
						require.Equal(t, []SGE{{Addr: dst.WRID, Length: uint32(dst.WRID)}}, dst.SGL,
							"seed %d round %d: a torn copy", seed, round)
						if q.take(seq) {
							taken = append(taken, dst.WRID)
						}
					}
					runtime.Gosched()
				}
				all := append(taken, flushed...)
				for i, w := range all {
					require.Equal(t, uint64(i), w, "seed %d round %d: taken %d, flushed %d", seed, round, len(taken), len(flushed))
				}
				if flushAt >= n {
					require.Len(t, all, n, "seed %d round %d", seed, round)
				}
				require.Zero(t, q.len())
			}
		})
	}
}

// The application moves the responder's QP to ERR at any moment of a stream of
// SENDs and WRITEs with immediate. Every receive it posted completes exactly once:
// consumed by a message, or flushed (by the move, or by the engine for the SEND it
// was filling). A receive the flush completed while a message was being placed in
// it is not completed again, and nothing panics.
func TestReceivesCompleteOnceWhileFlushed(t *testing.T) {
	const n, rounds = 160, 12
	for _, procs := range []int{1, 2} {
		t.Run(fmt.Sprintf("GOMAXPROCS=%d", procs), func(t *testing.T) {
			defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(procs))
			seed := uint64(time.Now().UnixNano())
			rng := rand.New(rand.NewPCG(seed, 22))
			for round := 0; round < rounds; round++ {
				a, b := pair(t, Config{})
				_, smr := a.region(t, 2*ps, AccessLocalWrite)
				_, dmr := b.region(t, 64*ps, rw)
				for i := 0; i < n; i++ {
					require.NoError(t, b.qp.PostRecv(RecvWR{WRID: uint64(i), SGL: sge(dmr, (i%32)*2*ps, 2*ps)}))
				}
				flushAfter := rng.IntN(n) // the sender's completions seen before the move
				done := make(chan error, 1)
				go func() {
					ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
					defer cancel()
					wcs := make([]WC, 16)
					for seen := 0; seen < flushAfter; {
						k, err := a.scq.Wait(ctx, wcs)
						if err != nil {
							done <- err
							return
						}
						seen += k
					}
					done <- b.qp.Modify(StateError)
				}()
				for i := 0; i < n; i++ {
					wr := SendWR{WRID: uint64(i), Opcode: OpSend, SGL: sge(smr, 0, 1+rng.IntN(2*ps)), Flags: SendSignaled}
					if rng.IntN(3) == 0 {
						wr = SendWR{WRID: uint64(i), Opcode: OpRDMAWriteImm, SGL: sge(smr, 0, 64), Flags: SendSignaled,
							RemoteAddr: dmr.Addr() + uint64(rng.IntN(63*ps)), RKey: dmr.RKey(), Imm: uint32(i)}
					}
					require.NoError(t, a.qp.PostSend(wr))
				}
				require.NoError(t, <-done, "seed %d round %d: moving the responder to ERR", seed, round)
				seen := make(map[uint64]WCStatus, n)
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				wcs := make([]WC, 64)
				for len(seen) < n {
					k, err := b.rcq.Wait(ctx, wcs)
					if !assert.NoError(t, err, "seed %d round %d: %d of %d receives completed", seed, round, len(seen), n) {
						break
					}
					for _, wc := range wcs[:k] {
						prev, twice := seen[wc.WRID]
						require.False(t, twice, "seed %d round %d: receive %d completed twice (%v, then %v)", seed, round,
							wc.WRID, prev, wc.Status)
						require.Contains(t, []WCStatus{WCSuccess, WCWRFlushErr}, wc.Status, wc.Detail)
						seen[wc.WRID] = wc.Status
					}
				}
				cancel()
				// Nothing more comes once the engine has stopped: a late
				// completion would be a second one.
				require.NoError(t, b.qp.Destroy())
				k, err := b.rcq.Poll(wcs)
				require.NoError(t, err)
				require.Zero(t, k, "seed %d round %d: completions beyond the receives posted", seed, round)
				if t.Failed() {
					return
				}
			}
		})
	}
}
