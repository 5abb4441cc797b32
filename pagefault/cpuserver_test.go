package pagefault

import (
	"runtime"
	"runtime/debug"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// Goroutines that fault inside copy() (an assembly routine where they cannot be
// preempted and keep their P) must all be served, with more faulting goroutines than
// Ps and the garbage collector forcing stop-the-world phases meanwhile.
func TestCPUServerServesCopyFaults(t *testing.T) {
	for _, procs := range []int{1, 2} {
		t.Run(map[int]string{1: "GOMAXPROCS=1", 2: "GOMAXPROCS=2"}[procs], func(t *testing.T) {
			defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(procs))
			const npages, workers = 2048, 8
			b := region(t, npages)
			u := registered(t, b, 0)
			s, err := StartCPUServer(u, 1)
			require.NoError(t, err)
			defer stop(t, s)

			stop := make(chan struct{})
			gcDone := make(chan struct{})
			go func() { // GC pressure: every cycle needs every P to stop
				defer close(gcDone)
				for {
					select {
					case <-stop:
						return
					default:
						runtime.GC()
					}
				}
			}()
			var wg sync.WaitGroup
			for w := 0; w < workers; w++ {
				wg.Add(1)
				go func(w int) {
					defer wg.Done()
					pat := make([]byte, PageSize)
					for i := range pat {
						pat[i] = byte(w + 1)
					}
					for p := w; p < npages; p += workers {
						copy(b[p*int(PageSize):], pat)
					}
				}(w)
			}
			wg.Wait()
			close(stop)
			<-gcDone
			for p := 0; p < npages; p++ {
				want := byte(p%workers + 1)
				if b[p*int(PageSize)] != want || b[(p+1)*int(PageSize)-1] != want {
					t.Fatalf("page %d holds %d, want %d", p, b[p*int(PageSize)], want)
				}
			}
			st := stats(t, s)
			// Each page is installed exactly once; a thread whose wait a signal interrupted
			// faults again and its second message finds the page present (Exist).
			assert.EqualValues(t, npages, st.Faults)
			assert.EqualValues(t, st.Faults, st.WriteFaults)
			assert.EqualValues(t, st.Faults, st.Pages)
			assert.Zero(t, st.Errors)
			t.Logf("faults %d, mean service %v, max %v", st.Faults, st.ServiceTime/time.Duration(max(st.Faults, 1)), st.MaxServiceTime)
		})
	}
}

func TestCPUServerFaultAround(t *testing.T) {
	const npages = 64
	b := region(t, npages)
	u := registered(t, b, 0)
	s, err := StartCPUServer(u, 16)
	require.NoError(t, err)
	defer stop(t, s)
	var sum byte
	for p := 0; p < npages; p++ {
		sum += b[p*int(PageSize)] // read faults
	}
	assert.Zero(t, sum)
	st := stats(t, s)
	assert.EqualValues(t, npages/16, st.Faults, "one fault per 16-page window")
	assert.EqualValues(t, npages, st.Pages)
	assert.Zero(t, st.WriteFaults)

	_, err = StartCPUServer(u, 0)
	assert.Error(t, err)
}

// waitReadable blocks in poll(2) until fd is readable or the bound passes.
func waitReadable(t *testing.T, fd int) {
	t.Helper()
	fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
	n, err := unix.Poll(fds, 5000)
	require.NoError(t, err)
	require.Equal(t, 1, n, "no event within 5 s")
}

func TestCPUServerQueuesEvents(t *testing.T) {
	const npages = 16
	b := region(t, npages)
	u := registered(t, b, FeatureEventRemove)
	s, err := StartCPUServer(u, 1)
	require.NoError(t, err)
	defer stop(t, s)
	for p := 0; p < npages; p++ {
		b[p*int(PageSize)] = 7
	}
	require.NoError(t, unix.Madvise(b[4*PageSize:8*PageSize], unix.MADV_DONTNEED))
	waitReadable(t, eventFd(t, s))
	var msgs [4]Msg
	n, err := s.Events(msgs[:])
	require.NoError(t, err)
	require.Equal(t, 1, n)
	assert.Equal(t, EventRemove, msgs[0].Event)
	assert.EqualValues(t, addr(b)+4*PageSize, msgs[0].Start)
	assert.EqualValues(t, addr(b)+8*PageSize, msgs[0].End)
	// The removed pages stay registered and fault again, zero filled.
	assert.EqualValues(t, 0, b[5*PageSize])
	assert.EqualValues(t, 7, b[3*PageSize])
	assert.EqualValues(t, 1, stats(t, s).Events)
}

func stats(t testing.TB, s *CPUServer) CPUServerStats {
	st, err := s.Stats()
	require.NoError(t, err)
	return st
}

func eventFd(t testing.TB, s *CPUServer) int {
	fd, err := s.EventFd()
	require.NoError(t, err)
	return fd
}

func stop(t testing.TB, s *CPUServer) { require.NoError(t, s.Stop()) }

// Every method of a stopped server returns ErrStopped, and a region's state words
// outlive the server: no Go value points into memory Stop freed.
func TestCPUServerAfterStop(t *testing.T) {
	b := region(t, 4)
	stash := region(t, 4)
	u := registered(t, b, 0)
	s, err := StartCPUServer(u, 1)
	require.NoError(t, err)
	r, err := s.AddRegion(addr(b), 4, addr(stash), 0)
	require.NoError(t, err)
	r.SetState(2, PageStored)
	require.NoError(t, s.Stop())

	require.ErrorIs(t, s.Stop(), ErrStopped)
	_, err = s.Stats()
	require.ErrorIs(t, err, ErrStopped)
	_, err = s.EventFd()
	require.ErrorIs(t, err, ErrStopped)
	_, err = s.Events(make([]Msg, 4))
	require.ErrorIs(t, err, ErrStopped)
	_, err = s.Events(nil)
	require.ErrorIs(t, err, ErrStopped)
	_, err = s.SettledEvents()
	require.ErrorIs(t, err, ErrStopped)
	_, err = s.FaultSeq()
	require.ErrorIs(t, err, ErrStopped)
	_, err = s.FaultedSince(0, addr(b), addr(b)+PageSize)
	require.ErrorIs(t, err, ErrStopped)
	require.ErrorIs(t, s.SetStore(0), ErrStopped)
	_, err = s.AddRegion(addr(b), 4, addr(stash), 0)
	require.ErrorIs(t, err, ErrStopped)
	_, err = s.Restored()
	require.ErrorIs(t, err, ErrStopped)
	require.ErrorIs(t, s.Install(addr(b), 1), ErrStopped)
	require.ErrorIs(t, r.Remove(), ErrStopped)
	// The region's words are still valid memory.
	assert.EqualValues(t, PageStored, r.State(2))
	assert.True(t, r.CompareAndSwap(2, PageStored, PageNone))
	r = nil
	runtime.GC() // the cleanup frees the words once the region is unreachable
	debug.FreeOSMemory()
}

// Regions come and go as buffers are allocated and freed: a slot is reused once its
// region is removed, far beyond the table's size.
func TestCPUServerReusesRegionSlots(t *testing.T) {
	b := region(t, 4)
	stash := region(t, 4)
	u := registered(t, b, 0)
	s, err := StartCPUServer(u, 1)
	require.NoError(t, err)
	defer stop(t, s)
	for i := 0; i < 1000; i++ {
		r, err := s.AddRegion(addr(b), 4, addr(stash), 0)
		require.NoError(t, err, "round %d", i)
		require.NoError(t, r.Remove())
	}
	// Without removal the table fills up, and says so.
	var rs []*PagedRegion
	for {
		r, err := s.AddRegion(addr(b), 4, addr(stash), 0)
		if err != nil {
			require.ErrorIs(t, err, ErrRegionTable)
			break
		}
		rs = append(rs, r)
	}
	assert.Len(t, rs, MaxPagedRegions, "MAX_REGIONS in cpuserver.c")
	for _, r := range rs {
		require.NoError(t, r.Remove())
	}
}

// Install answers: done, unmapped, and, for a request still waiting when the server
// stops, ErrStopped (not success with nothing installed).
func TestCPUServerInstallAnswers(t *testing.T) {
	b := region(t, 2)
	stash := region(t, 2)
	u := registered(t, b, 0)
	_, err := u.Register(addr(stash), uintptr(len(stash)), ModeMissing)
	require.NoError(t, err)
	s, err := StartCPUServer(u, 1)
	require.NoError(t, err)
	other := region(t, 1)
	assert.ErrorIs(t, s.Install(addr(other), 1), ErrUnmapped, "not registered")
	require.NoError(t, s.Install(addr(b), 1))
	assert.Equal(t, byte(0), b[0])

	// Page 1 claimed by an evictor that has not moved it out yet (its bounce page is
	// empty): the server takes the claim (RECLAIMED) and keeps the request waiting
	// for the evictor to settle, which never happens here.
	r, err := s.AddRegion(addr(b), 2, addr(stash), 0)
	require.NoError(t, err)
	r.SetState(1, PageEvicting)
	done := make(chan error)
	go func() { done <- s.Install(addr(b)+PageSize, 1) }()
	for r.State(1) != PageReclaimed { // the server has seen the request
		runtime.Gosched()
	}
	select {
	case err := <-done:
		t.Fatalf("install answered while the page was claimed: %v", err)
	default:
	}
	require.NoError(t, s.Stop())
	assert.ErrorIs(t, <-done, ErrStopped)
}

func TestCPUServerFaultRing(t *testing.T) {
	const npages = 16
	b := region(t, npages)
	u := registered(t, b, 0)
	s, err := StartCPUServer(u, 1)
	require.NoError(t, err)
	defer stop(t, s)
	since := func(mark uint64, lo, hi uintptr) bool {
		ok, err := s.FaultedSince(mark, lo, hi)
		require.NoError(t, err)
		return ok
	}
	mark, err := s.FaultSeq()
	require.NoError(t, err)
	b[3*PageSize] = 1
	assert.True(t, since(mark, addr(b)+3*PageSize, addr(b)+4*PageSize))
	assert.False(t, since(mark, addr(b), addr(b)+3*PageSize), "a fault on page 3 only")
	assert.Equal(t, mark+1, s.Gate().FaultSeq(), "the gate mirrors the sequence")
	now, err := s.FaultSeq()
	require.NoError(t, err)
	assert.False(t, since(now, addr(b), addr(b)+uintptr(len(b))))
}
