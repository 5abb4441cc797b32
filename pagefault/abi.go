package pagefault

// This file holds every userfaultfd ABI detail odpemu depends on: ioctl numbers, struct
// layouts, feature bits and event codes from <linux/userfaultfd.h>. abi_test.go checks
// them against the C header (where the installed header defines them) and against the
// _IOWR arithmetic.

import "unsafe"

// Ioctl number encoding from <asm-generic/ioctl.h>.
const (
	iocNRBits   = 8
	iocTypeBits = 8
	iocSizeBits = 14

	iocNRShift   = 0
	iocTypeShift = iocNRShift + iocNRBits
	iocSizeShift = iocTypeShift + iocTypeBits
	iocDirShift  = iocSizeShift + iocSizeBits

	iocNone  = 0
	iocWrite = 1
	iocRead  = 2
)

func ioc(dir, typ, nr, size uintptr) uintptr {
	return dir<<iocDirShift | typ<<iocTypeShift | nr<<iocNRShift | size<<iocSizeShift
}

func iowr(nr, size uintptr) uintptr { return ioc(iocRead|iocWrite, uffdioType, nr, size) }
func ior(nr, size uintptr) uintptr  { return ioc(iocRead, uffdioType, nr, size) }

const (
	uffdAPI    = 0xAA // UFFD_API
	uffdioType = 0xAA // UFFDIO

	// userModeOnly is UFFD_USER_MODE_ONLY: a userfaultfd that only reports faults taken
	// in user mode, the only kind an unprivileged process may create.
	userModeOnly = 1

	// Ioctl ordinals (_UFFDIO_*), which are also the bit numbers in the ioctls masks.
	nrRegister     = 0x00
	nrUnregister   = 0x01
	nrWake         = 0x02
	nrCopy         = 0x03
	nrZeropage     = 0x04
	nrMove         = 0x05
	nrWriteprotect = 0x06
	nrContinue     = 0x07
	nrPoison       = 0x08
	nrAPI          = 0x3F
)

// Ioctl request numbers.
var (
	ioctlAPI          = iowr(nrAPI, unsafe.Sizeof(uffdioAPI{}))
	ioctlRegister     = iowr(nrRegister, unsafe.Sizeof(uffdioRegister{}))
	ioctlUnregister   = ior(nrUnregister, unsafe.Sizeof(uffdioRange{}))
	ioctlWake         = ior(nrWake, unsafe.Sizeof(uffdioRange{}))
	ioctlCopy         = iowr(nrCopy, unsafe.Sizeof(uffdioCopy{}))
	ioctlZeropage     = iowr(nrZeropage, unsafe.Sizeof(uffdioZeropage{}))
	ioctlMove         = iowr(nrMove, unsafe.Sizeof(uffdioMove{}))
	ioctlWriteprotect = iowr(nrWriteprotect, unsafe.Sizeof(uffdioWriteprotect{}))
	ioctlContinue     = iowr(nrContinue, unsafe.Sizeof(uffdioContinue{}))
	ioctlPoison       = iowr(nrPoison, unsafe.Sizeof(uffdioPoison{}))

	// ioctlNew is USERFAULTFD_IOC_NEW, issued on /dev/userfaultfd.
	ioctlNew = ioc(iocNone, uffdioType, 0x00, 0)
)

// Feature is a UFFD_FEATURE_* bit negotiated by UFFDIO_API.
type Feature uint64

// Feature bits, in the kernel's order.
const (
	FeaturePagefaultFlagWP  Feature = 1 << 0
	FeatureEventFork        Feature = 1 << 1
	FeatureEventRemap       Feature = 1 << 2
	FeatureEventRemove      Feature = 1 << 3
	FeatureMissingHugetlbfs Feature = 1 << 4
	FeatureMissingShmem     Feature = 1 << 5
	FeatureEventUnmap       Feature = 1 << 6
	FeatureSigbus           Feature = 1 << 7
	FeatureThreadID         Feature = 1 << 8
	FeatureMinorHugetlbfs   Feature = 1 << 9
	FeatureMinorShmem       Feature = 1 << 10
	FeatureExactAddress     Feature = 1 << 11
	FeatureWPHugetlbfsShmem Feature = 1 << 12
	FeatureWPUnpopulated    Feature = 1 << 13
	FeaturePoison           Feature = 1 << 14
	FeatureWPAsync          Feature = 1 << 15
	FeatureMove             Feature = 1 << 16
	featureLast                     = FeatureMove
)

var featureNames = [...]string{
	"PAGEFAULT_FLAG_WP", "EVENT_FORK", "EVENT_REMAP", "EVENT_REMOVE", "MISSING_HUGETLBFS",
	"MISSING_SHMEM", "EVENT_UNMAP", "SIGBUS", "THREAD_ID", "MINOR_HUGETLBFS", "MINOR_SHMEM",
	"EXACT_ADDRESS", "WP_HUGETLBFS_SHMEM", "WP_UNPOPULATED", "POISON", "WP_ASYNC", "MOVE",
}

// RegisterMode is a UFFDIO_REGISTER_MODE_* bit.
type RegisterMode uint64

// Registration modes (UFFDIO_REGISTER_MODE_*).
const (
	ModeMissing RegisterMode = 1 << 0
	ModeWP      RegisterMode = 1 << 1
	ModeMinor   RegisterMode = 1 << 2
)

// Ioctl mode bits.
const (
	copyModeDontWake     = 1 << 0
	copyModeWP           = 1 << 1
	zeropageModeDontWake = 1 << 0
	moveModeDontWake     = 1 << 0
	moveModeAllowHoles   = 1 << 1
)

// Event is the uffd_msg.event code.
type Event uint8

// The events (UFFD_EVENT_*).
const (
	EventPagefault Event = 0x12
	EventFork      Event = 0x13
	EventRemap     Event = 0x14
	EventRemove    Event = 0x15
	EventUnmap     Event = 0x16

	// EventEvict is not the kernel's: the CPU fault server queues it when it evicted
	// [Start, End) of a paged region itself (direct reclaim, CPUServer.SetBudget).
	// The NIC must drop its translations of the range, as for a REMOVE.
	EventEvict Event = 0xe0
)

// Pagefault flags (UFFD_PAGEFAULT_FLAG_*).
const (
	PagefaultFlagWrite = 1 << 0
	PagefaultFlagWP    = 1 << 1
	PagefaultFlagMinor = 1 << 2
)

// Kernel structs. Field order and sizes mirror <linux/userfaultfd.h>; all fields are
// naturally aligned 64-bit words, so Go and C layouts agree on amd64 and arm64.
type uffdioAPI struct {
	API      uint64
	Features uint64
	Ioctls   uint64
}

type uffdioRange struct {
	Start uint64
	Len   uint64
}

type uffdioRegister struct {
	Range  uffdioRange
	Mode   uint64
	Ioctls uint64
}

type uffdioCopy struct {
	Dst  uint64
	Src  uint64
	Len  uint64
	Mode uint64
	Copy int64
}

type uffdioZeropage struct {
	Range    uffdioRange
	Mode     uint64
	Zeropage int64
}

type uffdioMove struct {
	Dst  uint64
	Src  uint64
	Len  uint64
	Mode uint64
	Move int64
}

type uffdioWriteprotect struct {
	Range uffdioRange
	Mode  uint64
}

type uffdioContinue struct {
	Range  uffdioRange
	Mode   uint64
	Mapped int64
}

type uffdioPoison struct {
	Range   uffdioRange
	Mode    uint64
	Updated int64
}

// MsgSize is sizeof(struct uffd_msg).
const MsgSize = 32

// Offsets inside struct uffd_msg.
const (
	msgOffEvent = 0
	msgOffArg   = 8 // the union starts after event, reserved1, reserved2, reserved3
)

// PAGEMAP_SCAN (Linux 6.7) on /proc/self/pagemap, from <linux/fs.h>: it returns runs
// of pages that share categories, without reading an entry per page.
const (
	pmScanIoctlType = 'f'
	pmScanIoctlNR   = 16

	// Page categories (PAGE_IS_*).
	PageIsWPAllowed = 1 << 0
	PageIsWritten   = 1 << 1
	PageIsFile      = 1 << 2
	PageIsPresent   = 1 << 3
	PageIsSwapped   = 1 << 4
	PageIsPFNZero   = 1 << 5
	PageIsHuge      = 1 << 6
)

// pmScanArg is struct pm_scan_arg.
type pmScanArg struct {
	Size              uint64
	Flags             uint64
	Start             uint64
	End               uint64
	WalkEnd           uint64
	Vec               uint64
	VecLen            uint64
	MaxPages          uint64
	CategoryInverted  uint64
	CategoryMask      uint64
	CategoryAnyofMask uint64
	ReturnMask        uint64
}

// PageRegion is struct page_region: a run [Start, End) of pages with Categories.
type PageRegion struct {
	Start, End, Categories uint64
}

var ioctlPagemapScan = ioc(iocRead|iocWrite, pmScanIoctlType, pmScanIoctlNR, unsafe.Sizeof(pmScanArg{}))
