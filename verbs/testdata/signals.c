/*
 * Built against the installed rdma-core headers and linked with odpemu's
 * libibverbs.so.1 (verbs_test.go: TestSignals): the application's signal handlers keep
 * working with the emulator (and the Go runtime) loaded into it, and the emulator's
 * own accesses to memory the application unmapped are error completions, not crashes.
 * The program installs handlers for SIGUSR1, SIGALRM (an interval timer firing during
 * verbs calls) and SIGSEGV (a guard page it opens in its handler, as language runtimes
 * do) before it opens the device, then WRITEs into an ODP MR over its own mmap while
 * the signals come, and madvises that memory away now and then.
 * Prints "ok" and exits 0, or says what is wrong and exits 1.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/time.h>
#include <unistd.h>

#include <infiniband/verbs.h>

#include "pair.h"

enum { PAGE = 4096, PAGES = 16, ROUNDS = 300 };

static volatile sig_atomic_t usr1, alarms, segvs;
static char *guard; /* a page the SIGSEGV handler opens */

static void on_usr1(int sig) { (void)sig, usr1++; }
static void on_alarm(int sig) { (void)sig, alarms++; }

static void on_segv(int sig, siginfo_t *si, void *uc)
{
	(void)sig, (void)uc;
	if ((char *)si->si_addr < guard || (char *)si->si_addr >= guard + PAGE)
		_exit(3); /* not the application's guard page: a fault it did not expect */
	mprotect(guard, PAGE, PROT_READ | PROT_WRITE);
	segvs++;
}

static void handle(int sig, void (*fn)(int))
{
	struct sigaction sa = {.sa_handler = fn};
	sigemptyset(&sa.sa_mask);
	if (sigaction(sig, &sa, NULL))
		DIE("sigaction %d", sig);
}

/* write_wait WRITEs len bytes from src to dst and returns the completion's status. */
static enum ibv_wc_status write_wait(struct ibv_qp *qp, struct ibv_cq *cq, struct ibv_mr *src, void *from,
				     struct ibv_mr *dst, void *to, uint32_t len)
{
	struct ibv_sge sge = {(uintptr_t)from, len, src->lkey};
	struct ibv_send_wr wr = {.wr_id = 7, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE,
				 .send_flags = IBV_SEND_SIGNALED},
			   *bad;
	wr.wr.rdma.remote_addr = (uintptr_t)to;
	wr.wr.rdma.rkey = dst->rkey;
	int e = ibv_post_send(qp, &wr, &bad);
	if (e)
		DIE("post_send: %s", strerror(e));
	struct ibv_wc wc;
	int n;
	while ((n = ibv_poll_cq(cq, 1, &wc)) == 0)
		;
	if (n < 0)
		DIE("poll_cq");
	return wc.status;
}

int main(void)
{
	guard = mmap(NULL, PAGE, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (guard == MAP_FAILED)
		DIE("mmap");
	handle(SIGUSR1, on_usr1);
	handle(SIGALRM, on_alarm);
	struct sigaction sa = {.sa_sigaction = on_segv, .sa_flags = SA_SIGINFO};
	sigemptyset(&sa.sa_mask);
	if (sigaction(SIGSEGV, &sa, NULL))
		DIE("sigaction SIGSEGV");
	struct itimerval every_ms = {{0, 1000}, {0, 1000}};
	if (setitimer(ITIMER_REAL, &every_ms, NULL))
		DIE("setitimer");

	struct ibv_context *ctx = open_first();
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	struct ibv_cq *cq = ibv_create_cq(ctx, 64, NULL, NULL, 0);
	char *src = aligned_alloc(PAGE, PAGE);
	char *dst = mmap(NULL, PAGES * PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	char *pinned = mmap(NULL, PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (!pd || !cq || !src || dst == MAP_FAILED || pinned == MAP_FAILED)
		DIE("setup: %s", strerror(errno));
	struct ibv_mr *smr = ibv_reg_mr(pd, src, PAGE, IBV_ACCESS_LOCAL_WRITE);
	struct ibv_mr *dmr = ibv_reg_mr(pd, dst, PAGES * PAGE,
					IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_ON_DEMAND);
	struct ibv_mr *pmr = ibv_reg_mr(pd, pinned, PAGE, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
	if (!smr || !dmr || !pmr)
		DIE("reg_mr: %s", strerror(errno));
	struct ibv_qp *a = create_qp(pd, cq, cq), *b = create_qp(pd, cq, cq);
	connect_qp(ctx, a, b->qp_num, IBV_ACCESS_REMOTE_WRITE);
	connect_qp(ctx, b, a->qp_num, IBV_ACCESS_REMOTE_WRITE);

	int raised = 0, guarded = 0;
	for (int i = 0; i < ROUNDS; i++) {
		char *to = dst + (i % PAGES) * PAGE;
		memset(src, 'a' + i % 26, PAGE);
		enum ibv_wc_status st = write_wait(a, cq, smr, src, dmr, to, PAGE);
		if (st != IBV_WC_SUCCESS)
			DIE("round %d: WRITE status %s", i, ibv_wc_status_str(st));
		if (memcmp(to, src, PAGE))
			DIE("round %d: the WRITE's data did not arrive", i);
		raise(SIGUSR1);
		raised++;
		if (i % 10 == 0) { /* the application's own fault, handled by its handler */
			mprotect(guard, PAGE, PROT_NONE);
			guard[i % PAGE] = 1;
			guarded++;
		}
		if (i % 50 == 49 && madvise(dst, PAGES * PAGE, MADV_DONTNEED)) /* the NIC faults them in again */
			DIE("madvise: %s", strerror(errno));
	}
	struct itimerval off = {{0, 0}, {0, 0}};
	setitimer(ITIMER_REAL, &off, NULL);
	if (usr1 != raised || segvs != guarded || alarms == 0)
		DIE("handlers: SIGUSR1 %d of %d, SIGSEGV %d of %d, SIGALRM %d", usr1, raised, segvs, guarded, alarms);

	/* The application unmaps memory its MRs cover: WRITEs to it complete in error and
	 * the process lives on; its SIGSEGV handler sees nothing of the emulator's access. */
	if (munmap(dst, PAGES * PAGE) || munmap(pinned, PAGE))
		DIE("munmap");
	enum ibv_wc_status st = write_wait(a, cq, smr, src, dmr, dst, PAGE);
	if (st == IBV_WC_SUCCESS)
		DIE("a WRITE to an unmapped ODP MR succeeded");
	fprintf(stderr, "signals: WRITE to an unmapped ODP MR: %s\n", ibv_wc_status_str(st));
	if (ibv_destroy_qp(a) || ibv_destroy_qp(b))
		DIE("destroy_qp");
	a = create_qp(pd, cq, cq); /* the failed WRITE left the pair in error */
	b = create_qp(pd, cq, cq);
	connect_qp(ctx, a, b->qp_num, IBV_ACCESS_REMOTE_WRITE);
	connect_qp(ctx, b, a->qp_num, IBV_ACCESS_REMOTE_WRITE);
	st = write_wait(a, cq, smr, src, pmr, pinned, PAGE);
	if (st == IBV_WC_SUCCESS)
		DIE("a WRITE to an unmapped pinned MR succeeded");
	fprintf(stderr, "signals: WRITE to an unmapped pinned MR: %s\n", ibv_wc_status_str(st));
	if (segvs != guarded)
		DIE("the application's SIGSEGV handler ran for the emulator's access");

	if (ibv_destroy_qp(a) || ibv_destroy_qp(b) || ibv_dereg_mr(smr) || ibv_dereg_mr(dmr) || ibv_dereg_mr(pmr) ||
	    ibv_destroy_cq(cq) || ibv_dealloc_pd(pd) || ibv_close_device(ctx))
		DIE("teardown");
	printf("ok\n");
	return 0;
}
