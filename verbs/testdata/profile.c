/*
 * Built against the installed rdma-core headers and linked with odpemu's
 * libibverbs.so.1 (verbs_test.go: TestProfile): the device runs the profile
 * ODPEMU_PROFILE names. Every ibv_reg_mr and ibv_dereg_mr of a page, pinned and on
 * demand, takes at least MIN_REG_NS and MIN_DEREG_NS nanoseconds (the profile's
 * memory key costs).
 * Prints "ok" and exits 0, or says what is wrong and exits 1.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include <infiniband/verbs.h>

#include "pair.h"

static int64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static int64_t env_ns(const char *name)
{
	const char *v = getenv(name);
	return v ? atoll(v) : -1;
}

int main(void)
{
	int64_t min_reg = env_ns("MIN_REG_NS"), min_dereg = env_ns("MIN_DEREG_NS");
	struct ibv_context *ctx = open_first();
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	if (!pd)
		DIE("alloc_pd");
	static char buf[4096] __attribute__((aligned(4096)));
	int flags[] = {IBV_ACCESS_LOCAL_WRITE, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_ON_DEMAND};
	for (int i = 0; i < 20; i++) {
		int64_t t0 = now_ns();
		struct ibv_mr *mr = ibv_reg_mr(pd, buf, sizeof buf, flags[i % 2]);
		if (!mr)
			DIE("reg_mr");
		int64_t t1 = now_ns();
		if (ibv_dereg_mr(mr))
			DIE("dereg_mr");
		int64_t t2 = now_ns();
		if (t1 - t0 < min_reg || t2 - t1 < min_dereg)
			DIE("registration %d: reg %lld ns (at least %lld), dereg %lld ns (at least %lld)", i,
			    (long long)(t1 - t0), (long long)min_reg, (long long)(t2 - t1), (long long)min_dereg);
	}
	ibv_dealloc_pd(pd);
	ibv_close_device(ctx);
	printf("ok\n");
	return 0;
}
