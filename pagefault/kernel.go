package pagefault

import (
	"fmt"
	"os"
	"strings"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Kernel choices and optional features that odpemu and its tests depend on. Each is
// found out once, by trying it on memory of our own, the way cilium/ebpf probes
// features; nothing is assumed from the kernel's version string.

// ErrNotSupported is wrapped, with the feature's name and the kernel that has it, by
// every error that says the running kernel lacks something (see Requirement).
var ErrNotSupported = ErrUnsupported

// Requirement names a kernel facility and the first Linux release that has it.
type Requirement struct {
	Name  string // what is missing, as the kernel names it
	Since string // the first mainline release that has it
}

// Missing returns an error wrapping ErrNotSupported that names r.
func (r Requirement) Missing() error {
	return fmt.Errorf("%w: %s (Linux %s)", ErrNotSupported, r.Name, r.Since)
}

// The facilities that are probed.
var (
	ReqUserfaultfd   = Requirement{"userfaultfd(2)", "4.3"}
	ReqEvents        = Requirement{"UFFD_FEATURE_EVENT_REMOVE|EVENT_UNMAP|EVENT_REMAP", "4.11"}
	ReqWriteProtect  = Requirement{"UFFDIO_REGISTER_MODE_WP on anonymous memory", "5.7"}
	ReqPopulateWrite = Requirement{"MADV_POPULATE_WRITE", "5.14"}
	ReqMove          = Requirement{"UFFDIO_MOVE (UFFD_FEATURE_MOVE)", "6.8"}
	ReqPagemapScan   = Requirement{"PAGEMAP_SCAN", "6.7"}
	ReqEventFork     = Requirement{"UFFD_FEATURE_EVENT_FORK (needs CAP_SYS_PTRACE)", "4.11"}
	ReqKernelFaults  = Requirement{"kernel-mode userfaultfd faults (CAP_SYS_PTRACE or /dev/userfaultfd)", "5.11"}
	ReqPFNs          = Requirement{"page frame numbers in /proc/self/pagemap (CAP_SYS_ADMIN)", "4.2"}
)

// Kernel is what the running kernel offers, found out once by ProbeKernelBehaviour.
type Kernel struct {
	Userfaultfd Probe // the userfaultfd handshake (see ProbeKernel)
	// PopulateWrite: madvise(MADV_POPULATE_WRITE) works.
	PopulateWrite bool
	// WriteProtect: anonymous memory can be registered in UFFDIO_REGISTER_MODE_WP.
	WriteProtect bool
	// PagemapScan: the PAGEMAP_SCAN ioctl on /proc/self/pagemap works.
	PagemapScan bool
	// ReadFaultZeroPage: a read fault on untouched private anonymous memory maps the
	// shared zero page (not exclusive in pagemap); some kernels map a private page.
	ReadFaultZeroPage bool
	// THP is the transparent huge page mode: "always", "madvise", "never" or "" when
	// the kernel has no THP.
	THP string

	readFaultErr error
}

// Has reports whether the kernel offers r.
func (k Kernel) Has(r Requirement) bool {
	u := k.Userfaultfd
	switch r {
	case ReqUserfaultfd:
		return u.Err == nil
	case ReqEvents:
		return u.Err == nil && u.Features.Has(FeatureEventRemove|FeatureEventUnmap|FeatureEventRemap)
	case ReqWriteProtect:
		return k.WriteProtect
	case ReqPopulateWrite:
		return k.PopulateWrite
	case ReqMove:
		return u.Err == nil && u.Features.Has(FeatureMove)
	case ReqPagemapScan:
		return k.PagemapScan
	case ReqEventFork:
		return u.Err == nil && u.Mode == ModeKernel && u.Features.Has(FeatureEventFork)
	case ReqKernelFaults:
		return u.Err == nil && u.Mode == ModeKernel
	}
	return false
}

// Check returns nil if the kernel offers every requirement, else the first missing
// one's error (wrapping ErrNotSupported).
func (k Kernel) Check(reqs ...Requirement) error {
	for _, r := range reqs {
		if !k.Has(r) {
			return r.Missing()
		}
	}
	return nil
}

var kernelOnce = probeCache[Kernel]{probe: probeKernelBehaviour}

// ProbeKernelBehaviour returns the cached probe of the running kernel (not cached
// when it failed for want of memory or descriptors: see ProbeKernel).
func ProbeKernelBehaviour() Kernel { return kernelOnce.get() }

func probeKernelBehaviour() (k Kernel, again bool) {
	k = Kernel{Userfaultfd: ProbeKernel(), THP: thpMode()}
	if k.Userfaultfd.Err != nil && transient(k.Userfaultfd.Err) {
		return k, true
	}
	ps := int(PageSize)
	b, err := unix.Mmap(-1, 0, 2*ps, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return k, true // no scratch page: nothing was learnt
	}
	defer func() { _ = unix.Munmap(b) }()     // a probe's own scratch mapping
	_ = unix.Madvise(b, unix.MADV_NOHUGEPAGE) // EINVAL without THP: nothing to avoid
	k.PopulateWrite = unix.Madvise(b[ps:], unix.MADV_POPULATE_WRITE) == nil
	k.ReadFaultZeroPage, k.readFaultErr = readFaultMapsZeroPage(b[:ps])
	again = transient(k.readFaultErr)
	k.PagemapScan = pagemapScanWorks(b)
	if k.Userfaultfd.Err == nil {
		u, err := Open(Options{})
		if err == nil {
			_, werr := u.Register(addrOf(b), uintptr(len(b)), ModeWP)
			k.WriteProtect = werr == nil
			_ = u.Close() // a probe's own descriptor; registrations die with it
		}
		again = again || transient(err)
	}
	return k, again
}

// readFaultMapsZeroPage reads the first byte of the untouched page b and reports
// whether the kernel then maps the shared zero page there.
func readFaultMapsZeroPage(b []byte) (bool, error) {
	atomic.LoadUint32((*uint32)(unsafe.Pointer(&b[0]))) // a read fault the compiler keeps
	pm, err := OpenPagemap()
	if err != nil {
		return false, err
	}
	defer func() { _ = pm.Close() }() // a read-only file
	var e [1]PagemapEntry
	if err := pm.Read(addrOf(b), e[:]); err != nil {
		return false, err
	}
	if !e[0].Present() {
		return false, fmt.Errorf("pagefault: probe: page not present after a read")
	}
	return !e[0].Exclusive(), nil
}

func thpMode() string {
	raw, err := os.ReadFile("/sys/kernel/mm/transparent_hugepage/enabled")
	if err != nil {
		return ""
	}
	s := string(raw)
	if i, j := strings.IndexByte(s, '['), strings.IndexByte(s, ']'); i >= 0 && j > i {
		return s[i+1 : j]
	}
	return strings.TrimSpace(s)
}

func addrOf(b []byte) uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(b))) }
