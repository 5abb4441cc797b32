package roce

import (
	"encoding/binary"
	"net/netip"
	"runtime"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// mmsgSocket sends and receives batches of datagrams on a non-blocking UDP socket
// with sendmmsg and recvmmsg, issued as raw system calls: the goroutine keeps its P
// through the call, as a NIC's send engine keeps its core.
//
// Why raw: a sendmmsg of 64 full packets on loopback runs the receiver's network
// stack too and lasts a few hundred microseconds. Through syscall.Syscall the
// runtime's sysmon takes the P of any system call older than 20 us and hands it to
// another thread, and the caller must win a P back afterwards: two thread wakeups
// per batch, which cost more than the batching saved (odp-perf write_bw between
// two processes, 1 MiB WRITEs: about 650 MiB/s through syscall.Syscall, 820 raw).
// Neither call blocks: the socket is non-blocking, EAGAIN is waited for in the
// runtime's poller (RawConn's Read and Write), and a raw call only delays a
// stop-the-world by its length.
type mmsgSocket struct {
	rc syscall.RawConn
	v6 bool
}

// mmsgBatch is the kernel's view of up to maxBatch datagrams: their headers and
// vectors, and a source or destination address each. It is reused between calls
// (a sync.Pool keeps them) and must not be shared between concurrent calls.
type mmsgBatch struct {
	hdrs  [maxBatch]unix.Mmsghdr
	iovs  [3 * maxBatch]unix.Iovec
	names [maxBatch]unix.RawSockaddrInet6 // a RawSockaddrInet4 fits in one
	ctrl  [maxBatch][cmsgSpace]byte       // a control message each: UDP_SEGMENT's or UDP_GRO's
}

// groSize returns the segment size the UDP_GRO control message of received
// datagram i gives, or 0 when it has none (a datagram of one packet).
func (b *mmsgBatch) groSize(i int) int {
	m := &b.hdrs[i].Hdr
	if m.Control == nil || m.Controllen < uint64(unix.CmsgLen(4)) {
		return 0
	}
	h := (*unix.Cmsghdr)(unsafe.Pointer(&b.ctrl[i][0]))
	if h.Level != unix.SOL_UDP || h.Type != unix.UDP_GRO || h.Len < uint64(unix.CmsgLen(4)) {
		return 0
	}
	return int(binary.NativeEndian.Uint32(b.ctrl[i][unix.CmsgLen(0):]))
}

// setName stores addr in names[i] in the kernel's layout and returns its length.
func (b *mmsgBatch) setName(i int, addr netip.AddrPort, v6 bool) uint32 {
	sa := &b.names[i]
	*sa = unix.RawSockaddrInet6{}
	if !v6 {
		sa4 := (*unix.RawSockaddrInet4)(unsafe.Pointer(sa))
		sa4.Family = unix.AF_INET
		binary.BigEndian.PutUint16((*[2]byte)(unsafe.Pointer(&sa4.Port))[:], addr.Port())
		sa4.Addr = addr.Addr().Unmap().As4()
		return unix.SizeofSockaddrInet4
	}
	sa.Family = unix.AF_INET6
	binary.BigEndian.PutUint16((*[2]byte)(unsafe.Pointer(&sa.Port))[:], addr.Port())
	sa.Addr = addr.Addr().As16()
	return unix.SizeofSockaddrInet6
}

// name decodes the address the kernel stored in names[i]; ok is false for a family
// other than the socket's.
func (b *mmsgBatch) name(i int, v6 bool) (netip.AddrPort, bool) {
	sa := &b.names[i]
	port := binary.BigEndian.Uint16((*[2]byte)(unsafe.Pointer(&sa.Port))[:])
	if !v6 {
		sa4 := (*unix.RawSockaddrInet4)(unsafe.Pointer(sa))
		if sa4.Family != unix.AF_INET {
			return netip.AddrPort{}, false
		}
		return netip.AddrPortFrom(netip.AddrFrom4(sa4.Addr), port), true
	}
	if sa.Family != unix.AF_INET6 {
		return netip.AddrPort{}, false
	}
	return netip.AddrPortFrom(netip.AddrFrom16(sa.Addr).Unmap(), port), true
}

// setMsg makes header i name the address in names[i] (length nameLen) and the
// vectors iovs[at:at+n].
func (b *mmsgBatch) setMsg(i int, nameLen uint32, at, n int) {
	h := &b.hdrs[i]
	*h = unix.Mmsghdr{}
	h.Hdr.Name = (*byte)(unsafe.Pointer(&b.names[i]))
	h.Hdr.Namelen = nameLen
	h.Hdr.Iov = &b.iovs[at]
	h.Hdr.SetIovlen(n)
}

// setIov points vector i at p (an empty p leaves it empty).
func (b *mmsgBatch) setIov(i int, p []byte) {
	b.iovs[i] = unix.Iovec{}
	if len(p) > 0 {
		b.iovs[i].Base = &p[0]
		b.iovs[i].SetLen(len(p))
	}
}

// sendmmsg sends messages [from, to) of b, waiting in the poller while the send
// buffer is full; it returns how many the kernel took (at least one, or an error).
func (s *mmsgSocket) sendmmsg(b *mmsgBatch, from, to int) (int, error) {
	return s.mmsg(unix.SYS_SENDMMSG, b, from, to, 0, s.rc.Write)
}

// recvmmsg receives up to n datagrams into b's vectors, waiting in the poller for
// the first; hdrs[i].Len is each one's length.
func (s *mmsgSocket) recvmmsg(b *mmsgBatch, n int) (int, error) {
	return s.mmsg(unix.SYS_RECVMMSG, b, 0, n, unix.MSG_DONTWAIT, s.rc.Read)
}

func (s *mmsgSocket) mmsg(trap uintptr, b *mmsgBatch, from, to int, flags uintptr, wait func(func(uintptr) bool) error) (int, error) {
	var done int
	var errno syscall.Errno
	err := wait(func(fd uintptr) bool {
		for {
			r, _, e := unix.RawSyscall6(trap, fd, uintptr(unsafe.Pointer(&b.hdrs[from])), uintptr(to-from), flags, 0, 0)
			if e == unix.EINTR {
				continue
			}
			done, errno = int(r), e
			return e != unix.EAGAIN
		}
	})
	runtime.KeepAlive(b) // the kernel read the buffers its vectors point at
	if err != nil {
		return 0, err
	}
	if errno != 0 {
		return 0, errno
	}
	return done, nil
}
