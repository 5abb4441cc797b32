// The floors of a page fault served through userfaultfd, in C: what odpemu's
// network page fault is compared with.
#ifndef ODPEMU_UFFDFLOOR_H
#define ODPEMU_UFFDFLOOR_H

// floor_copy returns the nanoseconds that pages UFFDIO_COPY ioctls take, each
// installing one page into a fresh registered region, or -1 with *err set.
long long floor_copy(int pages, int *err);

// floor_handler returns the nanoseconds a thread takes to touch pages fresh pages
// of a registered region, each fault served by a second thread that reads the
// userfaultfd and installs the page with UFFDIO_COPY: the minimal userfaultfd
// handler. The handler sleeps in poll(2) between faults, or with spin set reads
// the (non-blocking) descriptor in a loop, which leaves out its wake-up. -1 with
// *err set on failure.
long long floor_handler(int pages, int spin, int *err);

#endif
