/*
 * Built against the installed rdma-core headers and linked with odpemu's
 * libibverbs.so.1 (verbs_test.go: TestPoll): ibv_poll_cq over the CQ's doorbell, which
 * answers an empty CQ without entering the emulator and lets a busy poller sleep.
 * Two RC QPs of one context, connected to each other, move data while threads poll:
 *   - a poller that finds its CQ empty long enough to sleep gets every completion, in
 *     order, when messages come with pauses between them;
 *   - several threads polling one CQ at once get each completion exactly once;
 *   - a CQ armed for a completion channel and polled at the same time reports both;
 *   - a thread with many sends in flight, which waits in the emulator for its send
 *     CQ's doorbell (qp.c), gets every completion, in order;
 *   - a thread with no send in flight whose CQ stays empty waits in the emulator, not
 *     on the doorbell in C, and gets its completion.
 * Prints "ok" and exits 0, or says what is wrong and exits 1.
 */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <infiniband/verbs.h>

#include "pair.h"

enum { MSG = 256, SLOTS = 64, WRITES = 4000, POLLERS = 3 };

static struct ibv_context *ctx;
static struct ibv_pd *pd;
static struct ibv_mr *mr;
static char *buf;
static struct ibv_cq *scq, *rcq;
static struct ibv_comp_channel *channel;
static struct ibv_qp *a, *b; /* a sends to b */

static void post_recv(uint64_t id)
{
	struct ibv_sge sge = {(uintptr_t)(buf + SLOTS * MSG + (id % SLOTS) * MSG), MSG, mr->lkey};
	struct ibv_recv_wr wr = {.wr_id = id, .sg_list = &sge, .num_sge = 1}, *bad;
	if (ibv_post_recv(b, &wr, &bad))
		DIE("post_recv");
}

static void post_send(uint64_t id, enum ibv_wr_opcode op)
{
	struct ibv_sge sge = {(uintptr_t)(buf + (id % SLOTS) * MSG), MSG, mr->lkey};
	struct ibv_send_wr wr = {.wr_id = id, .sg_list = &sge, .num_sge = 1, .opcode = op,
				 .send_flags = IBV_SEND_SIGNALED},
			   *bad;
	wr.wr.rdma.remote_addr = (uintptr_t)(buf + SLOTS * MSG + (id % SLOTS) * MSG);
	wr.wr.rdma.rkey = mr->rkey;
	int e;
	while ((e = ibv_post_send(a, &wr, &bad)) == ENOMEM)
		sched_yield(); /* the send queue is full: the pollers make room */
	if (e)
		DIE("post_send: %s", strerror(e));
}

enum { SLEEPER_MSGS = 40 };

static double thread_seconds(clockid_t c)
{
	struct timespec t;
	clock_gettime(c, &t);
	return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

/* sleepy_poller polls the receive CQ in a busy loop for every SEND, checking order,
 * and returns the share of its wall time it spent on a CPU. */
static void *sleepy_poller(void *out)
{
	double wall = thread_seconds(CLOCK_MONOTONIC), cpu = thread_seconds(CLOCK_THREAD_CPUTIME_ID);
	for (uint64_t i = 0; i < SLEEPER_MSGS; i++) {
		struct ibv_wc wc;
		int n;
		while ((n = ibv_poll_cq(rcq, 1, &wc)) == 0)
			;
		if (n < 0 || wc.status != IBV_WC_SUCCESS || wc.wr_id != i || wc.byte_len != MSG ||
		    wc.opcode != IBV_WC_RECV)
			DIE("receive %lu: n %d status %d wr_id %lu", (unsigned long)i, n, wc.status,
			    (unsigned long)wc.wr_id);
	}
	*(double *)out = (thread_seconds(CLOCK_THREAD_CPUTIME_ID) - cpu) / (thread_seconds(CLOCK_MONOTONIC) - wall);
	return NULL;
}

/* A thread polling an empty CQ in a busy loop sleeps on its doorbell, and gets every
 * SEND, in order, though they come with pauses far longer than it spins. */
static void sleeper(void)
{
	for (uint64_t i = 0; i < SLEEPER_MSGS; i++)
		post_recv(i);
	double busy;
	pthread_t t;
	pthread_create(&t, NULL, sleepy_poller, &busy);
	for (uint64_t i = 0; i < SLEEPER_MSGS; i++) {
		struct timespec pause = {0, 3000000}; /* 3 ms */
		nanosleep(&pause, NULL);
		post_send(i, IBV_WR_SEND);
		struct ibv_wc wc;
		int n;
		while ((n = ibv_poll_cq(scq, 1, &wc)) == 0)
			;
		if (n < 0 || wc.status != IBV_WC_SUCCESS || wc.wr_id != i)
			DIE("send %lu: n %d status %d", (unsigned long)i, n, wc.status);
	}
	pthread_join(t, NULL);
	/* Spinning, it would be on a CPU all the time it is not preempted. */
	if (busy > 0.25)
		DIE("the poller of an empty CQ was on a CPU %.0f%% of the time: it did not sleep", busy * 100);
	fprintf(stderr, "poll: the poller of an empty CQ was on a CPU %.1f%% of the time\n", busy * 100);
}

static unsigned char seen[WRITES];
static int done_count;
static pthread_mutex_t seen_mu = PTHREAD_MUTEX_INITIALIZER;

static void *poller(void *arg)
{
	(void)arg;
	struct ibv_wc wc[8];
	for (;;) {
		pthread_mutex_lock(&seen_mu);
		int all = done_count == WRITES;
		pthread_mutex_unlock(&seen_mu);
		if (all)
			return NULL;
		int n = ibv_poll_cq(scq, 8, wc);
		if (n < 0)
			DIE("poll_cq: %d", n);
		pthread_mutex_lock(&seen_mu);
		for (int i = 0; i < n; i++) {
			if (wc[i].status != IBV_WC_SUCCESS || wc[i].wr_id >= WRITES || seen[wc[i].wr_id]++)
				DIE("completion of %lu: status %d, seen %d times", (unsigned long)wc[i].wr_id, wc[i].status,
				    wc[i].wr_id < WRITES ? seen[wc[i].wr_id] : -1);
			done_count++;
		}
		pthread_mutex_unlock(&seen_mu);
	}
}

/* Threads polling one CQ at once get each completion once. */
static void pollers(void)
{
	pthread_t t[POLLERS];
	for (int i = 0; i < POLLERS; i++)
		pthread_create(&t[i], NULL, poller, NULL);
	for (uint64_t i = 0; i < WRITES; i++) {
		if (i % 500 == 0) {
			struct timespec pause = {0, 2000000}; /* let the pollers sleep now and then */
			nanosleep(&pause, NULL);
		}
		for (;;) { /* at most a send queue's worth of completions unpolled: the CQ holds them */
			pthread_mutex_lock(&seen_mu);
			int room = (int)i - done_count < 256;
			pthread_mutex_unlock(&seen_mu);
			if (room)
				break;
			sched_yield();
		}
		post_send(i, IBV_WR_RDMA_WRITE);
	}
	for (int i = 0; i < POLLERS; i++)
		pthread_join(t[i], NULL);
}

/* A CQ armed for its channel while it is polled: the completion is polled and the
 * channel's event comes too. */
static void channel_and_poll(void)
{
	post_recv(1000);
	if (ibv_req_notify_cq(rcq, 0))
		DIE("req_notify_cq");
	struct ibv_wc wc;
	if (ibv_poll_cq(rcq, 1, &wc) != 0)
		DIE("the receive CQ is not empty");
	post_send(1000, IBV_WR_SEND);
	int n;
	while ((n = ibv_poll_cq(rcq, 1, &wc)) == 0)
		;
	if (n != 1 || wc.wr_id != 1000 || wc.status != IBV_WC_SUCCESS)
		DIE("channel receive: n %d", n);
	struct pollfd p = {.fd = channel->fd, .events = POLLIN};
	if (poll(&p, 1, 10000) != 1)
		DIE("no channel event");
	struct ibv_cq *ev_cq;
	void *ev_ctx;
	if (ibv_get_cq_event(channel, &ev_cq, &ev_ctx) || ev_cq != rcq)
		DIE("get_cq_event");
	ibv_ack_cq_events(rcq, 1);
	while ((n = ibv_poll_cq(scq, 1, &wc)) == 0)
		;
	if (n != 1 || wc.wr_id != 1000)
		DIE("channel send: n %d", n);
}

enum { BURSTS = 50, BURST = 64, SIGNAL_EVERY = 16 };

/* Bursts of WRITEs, every SIGNAL_EVERY-th signaled, each burst polled to its end: the
 * thread has BURST sends in flight when it first finds its send CQ empty. */
static void bursts(void)
{
	uint64_t id = 0;
	for (int b = 0; b < BURSTS; b++) {
		for (int i = 0; i < BURST; i++, id++) {
			struct ibv_sge sge = {(uintptr_t)(buf + (id % SLOTS) * MSG), MSG, mr->lkey};
			struct ibv_send_wr wr = {.wr_id = id, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE},
					   *bad;
			if ((id + 1) % SIGNAL_EVERY == 0)
				wr.send_flags = IBV_SEND_SIGNALED;
			wr.wr.rdma.remote_addr = (uintptr_t)(buf + SLOTS * MSG + (id % SLOTS) * MSG);
			wr.wr.rdma.rkey = mr->rkey;
			if (ibv_post_send(a, &wr, &bad))
				DIE("burst %d: post_send", b);
		}
		for (uint64_t want = id - BURST + SIGNAL_EVERY - 1; want < id; want += SIGNAL_EVERY) {
			struct ibv_wc wc;
			int n;
			while ((n = ibv_poll_cq(scq, 1, &wc)) == 0)
				;
			if (n != 1 || wc.status != IBV_WC_SUCCESS || wc.wr_id != want)
				DIE("burst %d: n %d status %d wr_id %lu, want %lu", b, n, wc.status, (unsigned long)wc.wr_id,
				    (unsigned long)want);
		}
	}
}

/* A thread's system call while it blocks, as /proc shows it: its number and first
 * argument (a futex's address). 0; 1 while the thread runs; -1 where the file cannot
 * be read. */
static int blocked_in(pid_t tid, long *nr, unsigned long *arg0)
{
	char path[64];
	snprintf(path, sizeof path, "/proc/self/task/%d/syscall", (int)tid);
	FILE *f = fopen(path, "r");
	if (!f)
		return -1;
	int n = fscanf(f, "%ld %lx", nr, arg0);
	fclose(f);
	return n == 2 ? 0 : 1; /* "running" */
}

static pid_t receiver_tid;

static void *quiet_receiver(void *arg)
{
	(void)arg;
	__atomic_store_n(&receiver_tid, (pid_t)syscall(SYS_gettid), __ATOMIC_RELEASE);
	struct ibv_wc wc;
	int n;
	while ((n = ibv_poll_cq(rcq, 1, &wc)) == 0)
		;
	if (n != 1 || wc.status != IBV_WC_SUCCESS || wc.wr_id != 2000)
		DIE("quiet receive: n %d status %d wr_id %lu", n, wc.status, (unsigned long)wc.wr_id);
	return NULL;
}

enum { SAMPLES = 40 };

/* A thread that polls its receive CQ with nothing of its own in flight waits in the
 * emulator once the CQ has stayed empty for a while (qp.c), where the runtime's P it
 * holds is given up, not on the CQ's doorbell in C: sampled while it waits, it is
 * blocked on a futex, never on one inside the CQ (the doorbell is a word of the
 * library's CQ, within a page of the ibv_cq the program holds; the Go runtime's
 * futexes are in its own memory). */
static void quiet_receiver_waits(void)
{
	post_recv(2000);
	pthread_t t;
	pthread_create(&t, NULL, quiet_receiver, NULL);
	pid_t tid;
	while (!(tid = __atomic_load_n(&receiver_tid, __ATOMIC_ACQUIRE)))
		sched_yield();
	int on_bell = 0, elsewhere = 0, unreadable = 0;
	for (int i = 0; i < SAMPLES; i++) {
		struct timespec pause = {0, 700000}; /* 0.7 ms: out of step with the 1 ms waits */
		nanosleep(&pause, NULL);
		long nr;
		unsigned long addr;
		int b = blocked_in(tid, &nr, &addr);
		unreadable += b < 0;
		if (b != 0 || nr != SYS_futex)
			continue;
		unsigned long cq = (unsigned long)(uintptr_t)rcq;
		if (addr + 4096 > cq && addr < cq + 4096)
			on_bell++;
		else
			elsewhere++;
	}
	post_send(2000, IBV_WR_SEND);
	struct ibv_wc wc;
	int n;
	while ((n = ibv_poll_cq(scq, 1, &wc)) == 0)
		;
	if (n != 1 || wc.status != IBV_WC_SUCCESS || wc.wr_id != 2000)
		DIE("quiet send: n %d status %d", n, wc.status);
	pthread_join(t, NULL);
	if (unreadable == SAMPLES) {
		fprintf(stderr, "poll: /proc/self/task/%d/syscall unreadable: where a quiet receiver waits not checked\n", (int)tid);
		return;
	}
	if (on_bell)
		DIE("a receiver with nothing in flight slept on its CQ's doorbell in C in %d of %d samples", on_bell, SAMPLES);
	if (!elsewhere)
		DIE("a receiver with nothing in flight was never seen waiting in %d samples", SAMPLES);
	fprintf(stderr, "poll: a quiet receiver waited in the emulator in %d of %d samples\n", elsewhere, SAMPLES);
}

int main(void)
{
	ctx = open_first();
	pd = ibv_alloc_pd(ctx);
	buf = aligned_alloc(4096, 2 * SLOTS * MSG);
	mr = ibv_reg_mr(pd, buf, 2 * SLOTS * MSG, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
	channel = ibv_create_comp_channel(ctx);
	scq = ibv_create_cq(ctx, 512, NULL, NULL, 0);
	rcq = ibv_create_cq(ctx, 512, NULL, channel, 0);
	if (!pd || !mr || !channel || !scq || !rcq)
		DIE("setup: %s", strerror(errno));
	a = create_qp(pd, scq, rcq);
	b = create_qp(pd, scq, rcq);
	connect_qp(ctx, a, b->qp_num, IBV_ACCESS_REMOTE_WRITE);
	connect_qp(ctx, b, a->qp_num, IBV_ACCESS_REMOTE_WRITE);
	sleeper();
	pollers();
	channel_and_poll();
	bursts();
	quiet_receiver_waits();
	if (ibv_destroy_qp(a) || ibv_destroy_qp(b) || ibv_destroy_cq(scq) || ibv_destroy_cq(rcq) ||
	    ibv_destroy_comp_channel(channel) || ibv_dereg_mr(mr) || ibv_dealloc_pd(pd) || ibv_close_device(ctx))
		DIE("teardown");
	free(buf);
	printf("ok\n");
	return 0;
}
