package pagefault

// The C header's view of the userfaultfd ABI, for abi_test.go (cgo cannot be used in
// test files). Values the installed header does not define are reported as absent.

/*
#include <stddef.h>
#include <sys/ioctl.h>
#include <linux/userfaultfd.h>

#ifndef UFFD_FEATURE_WP_UNPOPULATED
#define UFFD_FEATURE_WP_UNPOPULATED 0
#endif
#ifndef UFFD_FEATURE_POISON
#define UFFD_FEATURE_POISON 0
#endif
#ifndef UFFD_FEATURE_WP_ASYNC
#define UFFD_FEATURE_WP_ASYNC 0
#endif
#ifndef UFFD_FEATURE_MOVE
#define UFFD_FEATURE_MOVE 0
#endif
static unsigned long odp_ioctl_api(void) { return UFFDIO_API; }
static unsigned long odp_ioctl_register(void) { return UFFDIO_REGISTER; }
static unsigned long odp_ioctl_unregister(void) { return UFFDIO_UNREGISTER; }
static unsigned long odp_ioctl_wake(void) { return UFFDIO_WAKE; }
static unsigned long odp_ioctl_copy(void) { return UFFDIO_COPY; }
static unsigned long odp_ioctl_zeropage(void) { return UFFDIO_ZEROPAGE; }
static unsigned long odp_ioctl_writeprotect(void) { return UFFDIO_WRITEPROTECT; }
static unsigned long odp_ioctl_continue(void) { return UFFDIO_CONTINUE; }
static unsigned long odp_ioc_new(void) { return USERFAULTFD_IOC_NEW; }
#ifdef UFFDIO_MOVE
static unsigned long odp_ioctl_move(void) { return UFFDIO_MOVE; }
#else
static unsigned long odp_ioctl_move(void) { return 0; }
#endif
#ifdef UFFDIO_POISON
static unsigned long odp_ioctl_poison(void) { return UFFDIO_POISON; }
#else
static unsigned long odp_ioctl_poison(void) { return 0; }
#endif
*/
import "C"

import (
	"unsafe"
)

type abiValue struct {
	name   string
	header uint64 // 0: not defined by the installed header
	ours   uint64
}

func headerABI() []abiValue {
	var m C.struct_uffd_msg
	return []abiValue{
		{"UFFD_API", C.UFFD_API, uffdAPI},
		{"UFFD_USER_MODE_ONLY", C.UFFD_USER_MODE_ONLY, userModeOnly},
		{"USERFAULTFD_IOC_NEW", uint64(C.odp_ioc_new()), uint64(ioctlNew)},
		{"UFFDIO_API", uint64(C.odp_ioctl_api()), uint64(ioctlAPI)},
		{"UFFDIO_REGISTER", uint64(C.odp_ioctl_register()), uint64(ioctlRegister)},
		{"UFFDIO_UNREGISTER", uint64(C.odp_ioctl_unregister()), uint64(ioctlUnregister)},
		{"UFFDIO_WAKE", uint64(C.odp_ioctl_wake()), uint64(ioctlWake)},
		{"UFFDIO_COPY", uint64(C.odp_ioctl_copy()), uint64(ioctlCopy)},
		{"UFFDIO_ZEROPAGE", uint64(C.odp_ioctl_zeropage()), uint64(ioctlZeropage)},
		{"UFFDIO_WRITEPROTECT", uint64(C.odp_ioctl_writeprotect()), uint64(ioctlWriteprotect)},
		{"UFFDIO_CONTINUE", uint64(C.odp_ioctl_continue()), uint64(ioctlContinue)},
		{"UFFDIO_MOVE", uint64(C.odp_ioctl_move()), uint64(ioctlMove)},
		{"UFFDIO_POISON", uint64(C.odp_ioctl_poison()), uint64(ioctlPoison)},
		{"sizeof(uffdio_api)", C.sizeof_struct_uffdio_api, uint64(unsafe.Sizeof(uffdioAPI{}))},
		{"sizeof(uffdio_range)", C.sizeof_struct_uffdio_range, uint64(unsafe.Sizeof(uffdioRange{}))},
		{"sizeof(uffdio_register)", C.sizeof_struct_uffdio_register, uint64(unsafe.Sizeof(uffdioRegister{}))},
		{"sizeof(uffdio_copy)", C.sizeof_struct_uffdio_copy, uint64(unsafe.Sizeof(uffdioCopy{}))},
		{"sizeof(uffdio_zeropage)", C.sizeof_struct_uffdio_zeropage, uint64(unsafe.Sizeof(uffdioZeropage{}))},
		{"sizeof(uffdio_writeprotect)", C.sizeof_struct_uffdio_writeprotect, uint64(unsafe.Sizeof(uffdioWriteprotect{}))},
		{"sizeof(uffdio_continue)", C.sizeof_struct_uffdio_continue, uint64(unsafe.Sizeof(uffdioContinue{}))},
		{"sizeof(uffd_msg)", C.sizeof_struct_uffd_msg, MsgSize},
		{"offsetof(uffd_msg.arg)", uint64(unsafe.Offsetof(m.arg)), msgOffArg},
		{"offsetof(uffdio_copy.copy)", uint64(unsafe.Offsetof(C.struct_uffdio_copy{}.copy)), uint64(unsafe.Offsetof(uffdioCopy{}.Copy))},
		{"offsetof(uffdio_zeropage.zeropage)", uint64(unsafe.Offsetof(C.struct_uffdio_zeropage{}.zeropage)), uint64(unsafe.Offsetof(uffdioZeropage{}.Zeropage))},
		{"offsetof(uffdio_register.ioctls)", uint64(unsafe.Offsetof(C.struct_uffdio_register{}.ioctls)), uint64(unsafe.Offsetof(uffdioRegister{}.Ioctls))},
		{"UFFD_EVENT_PAGEFAULT", C.UFFD_EVENT_PAGEFAULT, uint64(EventPagefault)},
		{"UFFD_EVENT_FORK", C.UFFD_EVENT_FORK, uint64(EventFork)},
		{"UFFD_EVENT_REMAP", C.UFFD_EVENT_REMAP, uint64(EventRemap)},
		{"UFFD_EVENT_REMOVE", C.UFFD_EVENT_REMOVE, uint64(EventRemove)},
		{"UFFD_EVENT_UNMAP", C.UFFD_EVENT_UNMAP, uint64(EventUnmap)},
		{"UFFD_PAGEFAULT_FLAG_WRITE", C.UFFD_PAGEFAULT_FLAG_WRITE, PagefaultFlagWrite},
		{"UFFD_PAGEFAULT_FLAG_WP", C.UFFD_PAGEFAULT_FLAG_WP, PagefaultFlagWP},
		{"UFFD_PAGEFAULT_FLAG_MINOR", C.UFFD_PAGEFAULT_FLAG_MINOR, PagefaultFlagMinor},
		{"UFFDIO_REGISTER_MODE_MISSING", C.UFFDIO_REGISTER_MODE_MISSING, uint64(ModeMissing)},
		{"UFFDIO_REGISTER_MODE_WP", C.UFFDIO_REGISTER_MODE_WP, uint64(ModeWP)},
		{"UFFDIO_REGISTER_MODE_MINOR", C.UFFDIO_REGISTER_MODE_MINOR, uint64(ModeMinor)},
		{"UFFDIO_COPY_MODE_DONTWAKE", C.UFFDIO_COPY_MODE_DONTWAKE, copyModeDontWake},
		{"UFFDIO_COPY_MODE_WP", C.UFFDIO_COPY_MODE_WP, copyModeWP},
		{"UFFDIO_ZEROPAGE_MODE_DONTWAKE", C.UFFDIO_ZEROPAGE_MODE_DONTWAKE, zeropageModeDontWake},
		{"UFFD_FEATURE_PAGEFAULT_FLAG_WP", C.UFFD_FEATURE_PAGEFAULT_FLAG_WP, uint64(FeaturePagefaultFlagWP)},
		{"UFFD_FEATURE_EVENT_FORK", C.UFFD_FEATURE_EVENT_FORK, uint64(FeatureEventFork)},
		{"UFFD_FEATURE_EVENT_REMAP", C.UFFD_FEATURE_EVENT_REMAP, uint64(FeatureEventRemap)},
		{"UFFD_FEATURE_EVENT_REMOVE", C.UFFD_FEATURE_EVENT_REMOVE, uint64(FeatureEventRemove)},
		{"UFFD_FEATURE_MISSING_HUGETLBFS", C.UFFD_FEATURE_MISSING_HUGETLBFS, uint64(FeatureMissingHugetlbfs)},
		{"UFFD_FEATURE_MISSING_SHMEM", C.UFFD_FEATURE_MISSING_SHMEM, uint64(FeatureMissingShmem)},
		{"UFFD_FEATURE_EVENT_UNMAP", C.UFFD_FEATURE_EVENT_UNMAP, uint64(FeatureEventUnmap)},
		{"UFFD_FEATURE_SIGBUS", C.UFFD_FEATURE_SIGBUS, uint64(FeatureSigbus)},
		{"UFFD_FEATURE_THREAD_ID", C.UFFD_FEATURE_THREAD_ID, uint64(FeatureThreadID)},
		{"UFFD_FEATURE_MINOR_HUGETLBFS", C.UFFD_FEATURE_MINOR_HUGETLBFS, uint64(FeatureMinorHugetlbfs)},
		{"UFFD_FEATURE_MINOR_SHMEM", C.UFFD_FEATURE_MINOR_SHMEM, uint64(FeatureMinorShmem)},
		{"UFFD_FEATURE_EXACT_ADDRESS", C.UFFD_FEATURE_EXACT_ADDRESS, uint64(FeatureExactAddress)},
		{"UFFD_FEATURE_WP_HUGETLBFS_SHMEM", C.UFFD_FEATURE_WP_HUGETLBFS_SHMEM, uint64(FeatureWPHugetlbfsShmem)},
		{"UFFD_FEATURE_WP_UNPOPULATED", C.UFFD_FEATURE_WP_UNPOPULATED, uint64(FeatureWPUnpopulated)},
		{"UFFD_FEATURE_POISON", C.UFFD_FEATURE_POISON, uint64(FeaturePoison)},
		{"UFFD_FEATURE_WP_ASYNC", C.UFFD_FEATURE_WP_ASYNC, uint64(FeatureWPAsync)},
		{"UFFD_FEATURE_MOVE", C.UFFD_FEATURE_MOVE, uint64(FeatureMove)},
	}
}
