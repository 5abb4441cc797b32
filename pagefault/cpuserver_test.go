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
			defer s.Stop()

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
			st := s.Stats()
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
	defer s.Stop()
	var sum byte
	for p := 0; p < npages; p++ {
		sum += b[p*int(PageSize)] // read faults
	}
	assert.Zero(t, sum)
	st := s.Stats()
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
	defer s.Stop()
	for p := 0; p < npages; p++ {
		b[p*int(PageSize)] = 7
	}
	require.NoError(t, unix.Madvise(b[4*PageSize:8*PageSize], unix.MADV_DONTNEED))
	waitReadable(t, s.EventFd())
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
	assert.EqualValues(t, 1, s.Stats().Events)
}

func TestCPUServerStopIsIdempotent(t *testing.T) {
	b := region(t, 1)
	u := registered(t, b, 0)
	s, err := StartCPUServer(u, 1)
	require.NoError(t, err)
	s.Stop()
	s.Stop()
	assert.Equal(t, -1, s.EventFd())
	assert.Equal(t, CPUServerStats{}, s.Stats())
	debug.FreeOSMemory()
}

func TestCPUServerInstallRing(t *testing.T) {
	const npages = 16
	b := region(t, npages)
	u := registered(t, b, 0)
	s, err := StartCPUServer(u, 1)
	require.NoError(t, err)
	defer s.Stop()
	mark := s.InstallSeq()
	b[3*PageSize] = 1
	assert.True(t, s.InstalledSince(mark, addr(b)+3*PageSize, addr(b)+4*PageSize))
	assert.False(t, s.InstalledSince(mark, addr(b), addr(b)+3*PageSize), "install of page 3 only")
	assert.False(t, s.InstalledSince(s.InstallSeq(), addr(b), addr(b)+uintptr(len(b))))
}
