#define _GNU_SOURCE
#include "floor.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#ifndef UFFD_USER_MODE_ONLY
#define UFFD_USER_MODE_ONLY 1
#endif

static long long now_ns(void) {
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

// region is a registered anonymous region and a source page.
typedef struct {
	int uffd;
	long ps;
	char *mem, *src;
	size_t len;
} region;

static void region_close(region *r) {
	if (r->mem && r->mem != MAP_FAILED) munmap(r->mem, r->len);
	if (r->src && r->src != MAP_FAILED) munmap(r->src, r->ps);
	if (r->uffd >= 0) close(r->uffd);
}

static int region_open(region *r, int pages) {
	memset(r, 0, sizeof(*r));
	r->ps = sysconf(_SC_PAGESIZE);
	r->len = (size_t)pages * r->ps;
	r->uffd = syscall(SYS_userfaultfd, O_CLOEXEC);
	if (r->uffd < 0 && errno == EPERM) r->uffd = syscall(SYS_userfaultfd, O_CLOEXEC | UFFD_USER_MODE_ONLY);
	if (r->uffd < 0) return errno;
	struct uffdio_api api = {.api = UFFD_API};
	if (ioctl(r->uffd, UFFDIO_API, &api) < 0) goto fail;
	r->mem = mmap(NULL, r->len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	r->src = mmap(NULL, r->ps, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (r->mem == MAP_FAILED || r->src == MAP_FAILED) goto fail;
	memset(r->src, 0x5a, r->ps);
	struct uffdio_register reg = {.range = {(uintptr_t)r->mem, r->len}, .mode = UFFDIO_REGISTER_MODE_MISSING};
	if (ioctl(r->uffd, UFFDIO_REGISTER, &reg) < 0) goto fail;
	return 0;
fail:;
	int e = errno;
	region_close(r);
	return e;
}

static int copy_page(region *r, uintptr_t dst) {
	struct uffdio_copy c = {.dst = dst, .src = (uintptr_t)r->src, .len = r->ps};
	if (ioctl(r->uffd, UFFDIO_COPY, &c) < 0 && errno != EEXIST) return errno;
	return 0;
}

long long floor_copy(int pages, int *err) {
	region r;
	if ((*err = region_open(&r, pages))) return -1;
	long long t0 = now_ns();
	for (int i = 0; i < pages && !*err; i++) *err = copy_page(&r, (uintptr_t)r.mem + (uintptr_t)i * r.ps);
	long long t = now_ns() - t0;
	region_close(&r);
	return *err ? -1 : t;
}

typedef struct {
	region *r;
	int pages, spin, err;
} handler_arg;

static void *handle(void *p) {
	handler_arg *a = p;
	struct pollfd pfd = {.fd = a->r->uffd, .events = POLLIN};
	long long give_up = now_ns() + 10000000000LL;
	for (int served = 0; served < a->pages;) {
		if (!a->spin && poll(&pfd, 1, 10000) <= 0) {
			a->err = ETIMEDOUT;
			return NULL;
		}
		if (a->spin && now_ns() > give_up) {
			a->err = ETIMEDOUT;
			return NULL;
		}
		struct uffd_msg m;
		if (read(a->r->uffd, &m, sizeof(m)) != sizeof(m)) {
			if (errno == EAGAIN) continue;
			a->err = errno;
			return NULL;
		}
		if (m.event != UFFD_EVENT_PAGEFAULT) continue;
		if ((a->err = copy_page(a->r, m.arg.pagefault.address & ~(uintptr_t)(a->r->ps - 1)))) return NULL;
		served++;
	}
	return NULL;
}

long long floor_handler(int pages, int spin, int *err) {
	region r;
	if ((*err = region_open(&r, pages))) return -1;
	int fl = fcntl(r.uffd, F_GETFL);
	fcntl(r.uffd, F_SETFL, fl | O_NONBLOCK);
	handler_arg a = {.r = &r, .pages = pages, .spin = spin};
	pthread_t th;
	if ((*err = pthread_create(&th, NULL, handle, &a))) {
		region_close(&r);
		return -1;
	}
	long long t0 = now_ns();
	volatile char *mem = r.mem;
	for (int i = 0; i < pages; i++) mem[(size_t)i * r.ps] = 1;
	long long t = now_ns() - t0;
	pthread_join(th, NULL);
	*err = a.err;
	region_close(&r);
	return *err ? -1 : t;
}
