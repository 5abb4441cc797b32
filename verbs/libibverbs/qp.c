/*
 * MRs, CQs and RC QPs of odpemu's libibverbs.so.1: the verbs objects over the Go
 * half's (backend.h), and the data-path ops verbs.h's inline functions call
 * (ibv_post_send, ibv_post_recv, ibv_poll_cq through ibv_context.ops).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <infiniband/verbs.h>

#include "emu.h"

_Static_assert(sizeof(struct ibv_sge) == sizeof(struct odpemu_sge) &&
		       offsetof(struct ibv_sge, length) == offsetof(struct odpemu_sge, length) &&
		       offsetof(struct ibv_sge, lkey) == offsetof(struct odpemu_sge, lkey),
	       "an ibv_sge is passed to the Go half as it is");

/* A completion channel: a pipe. An armed CQ's next completion writes the CQ's
 * address into it (the Go half does, non-blocking); ibv_get_cq_event reads it, as
 * rdma-core reads the kernel's event from the channel's file. */
struct emu_channel {
	struct ibv_comp_channel ch; /* ch.fd is the read end */
	int wr;
};

EXPORT struct ibv_comp_channel *ibv_create_comp_channel(struct ibv_context *context)
{
	struct emu_channel *c = calloc(1, sizeof *c);
	if (!c) {
		errno = ENOMEM;
		return NULL;
	}
	int fds[2];
	if (pipe2(fds, O_CLOEXEC)) {
		int e = errno;
		free(c);
		errno = e;
		return NULL;
	}
	/* The writer never blocks: a full pipe holds events enough to wake a reader. */
	if (fcntl(fds[1], F_SETFL, O_NONBLOCK)) {
		int e = errno;
		close(fds[0]);
		close(fds[1]);
		free(c);
		errno = e;
		return NULL;
	}
	c->ch.context = context;
	c->ch.fd = fds[0];
	c->ch.refcnt = 0;
	c->wr = fds[1];
	return &c->ch;
}

EXPORT int ibv_destroy_comp_channel(struct ibv_comp_channel *channel)
{
	struct emu_channel *c = container_of(channel, struct emu_channel, ch);
	if (channel->refcnt) {
		errno = EBUSY;
		return EBUSY;
	}
	close(c->ch.fd);
	close(c->wr);
	free(c);
	return 0;
}

EXPORT int ibv_get_cq_event(struct ibv_comp_channel *channel, struct ibv_cq **cq, void **cq_context)
{
	uint64_t ev;
	be.odpemu_wait_in_c();
	ssize_t n = read(channel->fd, &ev, sizeof ev);
	if (n != (ssize_t)sizeof ev)
		return -1; /* errno says why (EAGAIN on a non-blocking channel) */
	*cq = (struct ibv_cq *)(uintptr_t)ev;
	*cq_context = (*cq)->cq_context;
	return 0;
}

EXPORT void ibv_ack_cq_events(struct ibv_cq *cq, unsigned int nevents)
{
	pthread_mutex_lock(&cq->mutex);
	cq->comp_events_completed += nevents;
	pthread_cond_signal(&cq->cond);
	pthread_mutex_unlock(&cq->mutex);
}

/* Access flags a registration may ask for and the emulated NIC does not need: it
 * ignores them, as rdma-core's ibv_reg_mr clears them for providers that do. */
#define EMU_OPTIONAL_ACCESS IBV_ACCESS_OPTIONAL_RANGE

static struct ibv_mr *reg_mr(struct ibv_pd *pd, void *addr, size_t length, uint64_t iova, unsigned int access)
{
	access &= ~EMU_OPTIONAL_ACCESS;
	if (access & IBV_ACCESS_ZERO_BASED) {
		errno = EOPNOTSUPP; /* no zero-based MRs */
		return NULL;
	}
	access &= ~IBV_ACCESS_HUGETLB; /* a hint about the memory: the NIC's pages are 4 KiB anyway */
	if (iova != (uintptr_t)addr) {
		errno = EOPNOTSUPP; /* the emulated NIC addresses an MR by its virtual addresses */
		return NULL;
	}
	if (!addr && (length != SIZE_MAX || !(access & IBV_ACCESS_ON_DEMAND))) {
		errno = EINVAL; /* implicit ODP is NULL, SIZE_MAX, ON_DEMAND; nothing else at NULL */
		return NULL;
	}
	struct emu_mr *m = calloc(1, sizeof *m);
	if (!m) {
		errno = ENOMEM;
		return NULL;
	}
	uint32_t key;
	int e = be.odpemu_reg_mr(emu_pd_handle(pd), addr, length, access, &m->h, &key);
	if (e) {
		free(m);
		errno = e;
		return NULL;
	}
	m->mr.context = pd->context;
	m->mr.pd = pd;
	m->mr.addr = addr;
	m->mr.length = length;
	m->mr.handle = key;
	m->mr.lkey = key;
	m->mr.rkey = key;
	return &m->mr;
}

#undef ibv_reg_mr
EXPORT struct ibv_mr *ibv_reg_mr(struct ibv_pd *pd, void *addr, size_t length, int access)
{
	return reg_mr(pd, addr, length, (uintptr_t)addr, (unsigned int)access);
}

#undef ibv_reg_mr_iova
EXPORT struct ibv_mr *ibv_reg_mr_iova(struct ibv_pd *pd, void *addr, size_t length, uint64_t iova, int access)
{
	return reg_mr(pd, addr, length, iova, (unsigned int)access);
}

EXPORT struct ibv_mr *ibv_reg_mr_iova2(struct ibv_pd *pd, void *addr, size_t length, uint64_t iova,
				       unsigned int access)
{
	return reg_mr(pd, addr, length, iova, access);
}

_Static_assert(IBV_REREG_MR_CHANGE_TRANSLATION == 1 && IBV_REREG_MR_CHANGE_PD == 2 && IBV_REREG_MR_CHANGE_ACCESS == 4,
	       "the Go half's rereg flags");

/* ibv_rereg_mr: a change of PD or access rewrites the MR in place under the same
 * keys, as mlx5 and rxe do; new memory, or a change between pinned and on demand, is
 * a new registration under new keys, made before the old one goes (a failure leaves
 * the MR as it was). */
EXPORT int ibv_rereg_mr(struct ibv_mr *mr, int flags, struct ibv_pd *pd, void *addr, size_t length, int access)
{
	struct emu_mr *m = container_of(mr, struct emu_mr, mr);
	if ((flags & ~IBV_REREG_MR_FLAGS_SUPPORTED) ||
	    ((flags & IBV_REREG_MR_CHANGE_TRANSLATION) && (!addr || !length)) ||
	    (access && !(flags & IBV_REREG_MR_CHANGE_ACCESS)) || ((flags & IBV_REREG_MR_CHANGE_PD) && !pd)) {
		errno = EINVAL;
		return IBV_REREG_MR_ERR_INPUT;
	}
	unsigned int acc = (unsigned int)access & ~(EMU_OPTIONAL_ACCESS | IBV_ACCESS_HUGETLB);
	if (acc & IBV_ACCESS_ZERO_BASED) {
		errno = EOPNOTSUPP;
		return IBV_REREG_MR_ERR_INPUT;
	}
	uint32_t key;
	int e = be.odpemu_rereg_mr(m->h, (uint32_t)flags, (flags & IBV_REREG_MR_CHANGE_PD) ? emu_pd_handle(pd) : 0,
				   addr, length, acc, &key);
	if (e) {
		errno = e;
		return IBV_REREG_MR_ERR_CMD;
	}
	if (flags & IBV_REREG_MR_CHANGE_PD)
		mr->pd = pd;
	if (flags & IBV_REREG_MR_CHANGE_TRANSLATION) {
		mr->addr = addr;
		mr->length = length;
	}
	mr->handle = mr->lkey = mr->rkey = key;
	return 0;
}

EXPORT int ibv_dereg_mr(struct ibv_mr *mr)
{
	struct emu_mr *m = container_of(mr, struct emu_mr, mr);
	int e = be.odpemu_dereg_mr(m->h);
	if (e)
		return e;
	free(m);
	return 0;
}

/*
 * A thread that polls one CQ in a busy loop, as perftest does, would take a CPU from
 * the emulated NIC's engines, which a hardware NIC does not need: while the CQ stays
 * empty, emu_poll_cq yields the CPU, and once the loop has found it empty for
 * SPIN_NS, sleeps on the doorbell, at most SLEEP_NS a poll, until a completion rings
 * it. A loop counts as one while the same thread polls the same CQ again within
 * LOOP_NS; a program that polls now and then, or polls two CQs in turn, never sleeps.
 * A loop that sleeps tells the Go half (odpemu_wait_in_c), which then gives the
 * runtime a P per CPU (verbs/emu/procs.go): the sleeper holds one.
 *
 * A thread that has WAIT_IN_FLIGHT or more sends in flight (posted since one of its
 * polls last found a completion), a signaled one among them, and finds that send's
 * CQ empty waits in Go instead, until the CQ's doorbell rings or SLEEP_NS passes
 * (odpemu_wait_cq), and again at each empty poll until a poll of that CQ finds a
 * completion (100 READs of 4 KiB between two processes take longer than SLEEP_NS):
 * while a C thread runs C it keeps the Go runtime's P it last entered Go with, which
 * the engines and the port then lack until the runtime's monitor takes it back
 * (backend.h); a thread blocked in Go gives it up at once. With that many in flight
 * the completion is the NIC's work away, and the thread has nothing else to do; with
 * a few (a latency test's one) it comes soon, and a wait in Go, whose wake-up takes a
 * thread switch, would add to it. Between two processes on 2 CPUs the wait took
 * perftest's WRITE and SEND at 64 B from 0.6 to about 0.8 of odp-perf; waiting with
 * any send in flight made ib_write_lat's mean 4x longer.
 *
 * A thread with no send in flight (a receiver: what it waits for is its peer's doing)
 * waits in Go too once its loop has found the CQ empty for GO_NS, where it spun on to
 * SPIN_NS and slept in C holding its P: ib_send_bw's server, which reposts each receive
 * as it polls it and spun through every gap of the stream, then left its engine and
 * port without a P until the monitor took it back. A wait the doorbell ends ends the
 * loop (the next gap of a stream is spun through first); one whose SLEEP_NS passed
 * keeps it until a poll finds a completion, however long the thread took to come back
 * from Go, so that a quiet CQ's poller waits again at once instead of spinning GO_NS
 * each time: on a loaded machine, where each sched_yield switches threads, that made
 * it take up to 43% of a CPU, against 3-6%. Between two processes on 2 CPUs
 * perftest's SEND moved 19% more at 64 B and 18% at 4 KiB (medians of five
 * alternating runs: 11.9 against 10.0 MiB/s, 676 against 575), 0.83-1.09 of odp-perf
 * in three runs of five rounds against 0.67-0.90 in one before; ib_send_lat's typical
 * latency did not move (61-149 us with and without, medians of eight runs 99 and 92).
 * With the same wait for a thread with a send in flight, ib_read_lat's went from 88
 * to 131 us.
 */
enum { GO_NS = 20000, SPIN_NS = 50000, SLEEP_NS = 1000000, LOOP_NS = 10000, WAIT_IN_FLIGHT = 16 };

static __thread struct {
	struct emu_cq *cq;
	uint64_t start, last; /* the loop's first and last empty poll */
	int told;	      /* odpemu_wait_in_c was called for the loop */
	int quiet;	      /* its last wait in Go ran out of time (a receiver's) */
} empty_loop;

/* The send CQ of a QP this thread posted a signaled send to since a poll of that CQ
 * last found a completion, and the sends it posted since a poll last found one. */
static __thread struct emu_cq *expected;
static __thread uint32_t in_flight;

void emu_posted(struct ibv_qp *qp, const struct odpemu_send_wr *wrs, uint32_t n)
{
	struct emu_qp *q = container_of(qp, struct emu_qp, qp);
	in_flight += n;
	for (uint32_t i = 0; i < n; i++) {
		if (q->sq_sig_all || (wrs[i].flags & IBV_SEND_SIGNALED)) {
			expected = container_of(qp->send_cq, struct emu_cq, cq);
			return;
		}
	}
}

static uint64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* wait_empty is called when c was empty: it yields or sleeps, as above. */
static void wait_empty(struct emu_cq *c)
{
	if (expected == c && in_flight >= WAIT_IN_FLIGHT) {
		int e = be.odpemu_wait_cq(c->h, SLEEP_NS);
		if (e == 0 || e == ETIMEDOUT) {
			empty_loop.cq = NULL; /* a loop starts afresh */
			return;
		}
	}
	uint64_t now = now_ns();
	/* A receiver's wait for c ran out of time, and no poll found a completion since:
	 * its loop goes on however long the way back from the wait took. */
	int quiet = in_flight == 0 && empty_loop.cq == c && empty_loop.quiet;
	if (!quiet && (empty_loop.cq != c || now - empty_loop.last > LOOP_NS)) {
		empty_loop.cq = c;
		empty_loop.start = now;
		empty_loop.told = 0;
		empty_loop.quiet = 0;
	}
	empty_loop.last = now;
	if (in_flight == 0 && (quiet || now - empty_loop.start >= GO_NS)) {
		empty_loop.quiet = be.odpemu_wait_cq(c->h, SLEEP_NS) == ETIMEDOUT;
		if (!empty_loop.quiet)
			empty_loop.cq = NULL; /* it rang: a loop starts afresh */
		return;
	}
	if (now - empty_loop.start < SPIN_NS) {
		sched_yield();
		return;
	}
	if (!empty_loop.told) {
		empty_loop.told = 1;
		be.odpemu_wait_in_c(); /* a long wait in C, holding a P */
	}
	uint32_t empty = 0; /* 2: a poller sleeps (backend.h) */
	if (__atomic_compare_exchange_n(&c->bell, &empty, 2, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
		struct timespec t = {0, SLEEP_NS};
		syscall(SYS_futex, &c->bell, FUTEX_WAIT_PRIVATE, 2, &t, NULL, 0);
		uint32_t sleeping = 2; /* no ring: take the mark away */
		__atomic_compare_exchange_n(&c->bell, &sleeping, 0, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
	}
	empty_loop.last = now_ns();
}

int emu_poll_cq(struct ibv_cq *cq, int num_entries, struct ibv_wc *wc)
{
	struct emu_cq *c = container_of(cq, struct emu_cq, cq);
	if (__atomic_load_n(&c->idle, __ATOMIC_ACQUIRE) && !emu_forked) {
		if (!__atomic_load_n(&c->bell, __ATOMIC_ACQUIRE))
			wait_empty(c);
		if (__atomic_load_n(&c->bell, __ATOMIC_ACQUIRE) != 1)
			return 0; /* empty, as the doorbell says */
	}
	pthread_mutex_lock(&c->lock);
	__atomic_store_n(&c->bell, 0, __ATOMIC_RELEASE);
	struct odpemu_wc buf[32];
	int done = 0, drained = 0;
	while (done < num_entries) {
		int want = num_entries - done;
		if (want > (int)(sizeof buf / sizeof buf[0]))
			want = sizeof buf / sizeof buf[0];
		int n = be.odpemu_poll_cq(c->h, want, buf);
		if (n < 0) {
			__atomic_store_n(&c->idle, 0, __ATOMIC_RELEASE);
			pthread_mutex_unlock(&c->lock);
			return done ? done : -1; /* a CQ error: verbs' poll_cq returns < 0 */
		}
		for (int i = 0; i < n; i++) {
			struct ibv_wc *w = &wc[done + i];
			memset(w, 0, sizeof *w);
			w->wr_id = buf[i].wr_id;
			w->status = (enum ibv_wc_status)buf[i].status;
			w->opcode = (enum ibv_wc_opcode)buf[i].opcode;
			w->byte_len = buf[i].byte_len;
			w->qp_num = buf[i].qp_num;
			w->wc_flags = buf[i].wc_flags;
			if (w->wc_flags & IBV_WC_WITH_INV)
				w->invalidated_rkey = buf[i].imm;
			else
				w->imm_data = htobe32(buf[i].imm);
			w->src_qp = buf[i].src_qp;
			w->pkey_index = 0;
		}
		done += n;
		if (n < want) {
			drained = 1; /* and the doorbell armed */
			break;
		}
	}
	__atomic_store_n(&c->idle, (uint32_t)drained, __ATOMIC_RELEASE);
	pthread_mutex_unlock(&c->lock);
	if (done) {
		in_flight = 0;
		empty_loop.quiet = 0;
		if (expected == c)
			expected = NULL; /* until the next signaled send */
	}
	return done;
}

static int emu_req_notify_cq(struct ibv_cq *cq, int solicited_only)
{
	(void)solicited_only; /* every completion is an event: no SEND is solicited here */
	if (!cq->channel)
		return 0; /* armed, with nowhere to report to */
	struct emu_channel *ch = container_of(cq->channel, struct emu_channel, ch);
	return be.odpemu_req_notify_cq(container_of(cq, struct emu_cq, cq)->h, ch->wr, (uint64_t)(uintptr_t)cq);
}

EXPORT struct ibv_cq *ibv_create_cq(struct ibv_context *context, int cqe, void *cq_context,
				    struct ibv_comp_channel *channel, int comp_vector)
{
	if (cqe < 1 || comp_vector < 0 || comp_vector >= context->num_comp_vectors) {
		errno = EINVAL;
		return NULL;
	}
	struct emu_cq *c = calloc(1, sizeof *c);
	if (!c) {
		errno = ENOMEM;
		return NULL;
	}
	int e = be.odpemu_create_cq(emu_dev_handle(context), cqe, &c->bell, &c->h);
	if (e) {
		free(c);
		errno = e;
		return NULL;
	}
	pthread_mutex_init(&c->lock, NULL);
	c->cq.context = context;
	c->cq.cq_context = cq_context;
	c->cq.channel = channel;
	if (channel)
		channel->refcnt++;
	c->cq.cqe = cqe;
	c->cq.handle = (uint32_t)(uintptr_t)c;
	pthread_mutex_init(&c->cq.mutex, NULL);
	pthread_cond_init(&c->cq.cond, NULL);
	return &c->cq;
}

EXPORT int ibv_resize_cq(struct ibv_cq *cq, int cqe)
{
	if (cqe < 1)
		return EINVAL;
	int e = be.odpemu_resize_cq(container_of(cq, struct emu_cq, cq)->h, cqe);
	if (e)
		return e;
	cq->cqe = cqe;
	return 0;
}

EXPORT int ibv_destroy_cq(struct ibv_cq *cq)
{
	struct emu_cq *c = container_of(cq, struct emu_cq, cq);
	int e = be.odpemu_destroy_cq(c->h);
	if (e)
		return e;
	if (cq->channel)
		cq->channel->refcnt--;
	pthread_cond_destroy(&cq->cond);
	pthread_mutex_destroy(&cq->mutex);
	pthread_mutex_destroy(&c->lock);
	free(c);
	return 0;
}

/* to_emu_wr turns a verbs send WR of qp into the Go half's form (its SGL as it is). */
static int to_emu_wr(const struct ibv_qp *qp, const struct ibv_send_wr *wr, struct odpemu_send_wr *w)
{
	if (wr->num_sge < 0 || (qp->qp_type == IBV_QPT_UD && !wr->wr.ud.ah))
		return EINVAL;
	*w = (struct odpemu_send_wr){
		.wr_id = wr->wr_id,
		.opcode = wr->opcode,
		.flags = wr->send_flags & ~EMU_IGNORED_SEND_FLAGS,
		.sg_list = (const struct odpemu_sge *)wr->sg_list,
		.num_sge = (uint32_t)wr->num_sge,
	};
	switch (wr->opcode) {
	case IBV_WR_RDMA_WRITE_WITH_IMM:
	case IBV_WR_SEND_WITH_IMM:
		w->imm = be32toh(wr->imm_data);
		break;
	case IBV_WR_LOCAL_INV:
	case IBV_WR_SEND_WITH_INV:
		w->invalidate_rkey = wr->invalidate_rkey;
		break;
	case IBV_WR_BIND_MW:
		if (!wr->bind_mw.mw)
			return EINVAL;
		emu_bind_info(w, wr->bind_mw.mw, wr->bind_mw.rkey, &wr->bind_mw.bind_info);
		break;
	default:
		break;
	}
	if (qp->qp_type == IBV_QPT_UD) {
		memcpy(w->dgid, container_of(wr->wr.ud.ah, struct emu_ah, ah)->dgid, sizeof w->dgid);
		w->remote_qpn = wr->wr.ud.remote_qpn;
		w->remote_qkey = wr->wr.ud.remote_qkey;
		return 0;
	}
	switch (wr->opcode) {
	case IBV_WR_RDMA_WRITE:
	case IBV_WR_RDMA_WRITE_WITH_IMM:
	case IBV_WR_RDMA_READ:
	case IBV_WR_ATOMIC_WRITE: /* its 8 bytes in the SGL */
		w->remote_addr = wr->wr.rdma.remote_addr;
		w->rkey = wr->wr.rdma.rkey;
		break;
	case IBV_WR_ATOMIC_CMP_AND_SWP:
	case IBV_WR_ATOMIC_FETCH_AND_ADD:
		w->remote_addr = wr->wr.atomic.remote_addr;
		w->rkey = wr->wr.atomic.rkey;
		w->compare_add = wr->wr.atomic.compare_add;
		w->swap = wr->wr.atomic.swap;
		break;
	default:
		break;
	}
	return 0;
}

/* emu_post_send posts a chain of WRs, up to 32 of them in one call to the Go half. */
static int emu_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad_wr)
{
	struct emu_qp *q = container_of(qp, struct emu_qp, qp);
	struct odpemu_send_wr batch[32];
	struct ibv_send_wr *first[32];
	while (wr) {
		uint32_t n = 0;
		int e = 0;
		for (; wr && n < sizeof batch / sizeof batch[0]; wr = wr->next) {
			if ((e = to_emu_wr(qp, wr, &batch[n])))
				break;
			first[n++] = wr;
		}
		uint32_t posted = 0;
		if (n) {
			int pe = be.odpemu_post_send(q->h, batch, n, &posted);
			emu_posted(qp, batch, posted);
			if (pe) {
				*bad_wr = first[posted];
				return pe;
			}
		}
		if (e) {
			*bad_wr = wr;
			return e;
		}
	}
	return 0;
}

static int emu_post_recv(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad_wr)
{
	struct emu_qp *q = container_of(qp, struct emu_qp, qp);
	for (; wr; wr = wr->next) {
		int e = wr->num_sge < 0 ? EINVAL
					: be.odpemu_post_recv(q->h, wr->wr_id, (const struct odpemu_sge *)wr->sg_list,
							      (uint32_t)wr->num_sge);
		if (e) {
			*bad_wr = wr;
			return e;
		}
	}
	return 0;
}

static struct ibv_qp *emu_create_qp_ex(struct ibv_context *context, struct ibv_qp_init_attr_ex *attr);

void emu_set_qp_ops(struct ibv_context *ctx)
{
	ctx->ops.poll_cq = emu_poll_cq;
	ctx->ops.req_notify_cq = emu_req_notify_cq;
	ctx->ops.post_send = emu_post_send;
	ctx->ops.post_recv = emu_post_recv;
	verbs_get_ctx(ctx)->create_qp_ex = emu_create_qp_ex;
	verbs_get_ctx(ctx)->create_cq_ex = emu_create_cq_ex;
}

/* create_qp creates an RC QP as init (an ibv_qp_init_attr's fields) asks. */
static struct emu_qp *create_qp(struct ibv_pd *pd, struct ibv_qp_init_attr *init)
{
	if (init->qp_type != IBV_QPT_RC && init->qp_type != IBV_QPT_UC && init->qp_type != IBV_QPT_UD) {
		errno = EOPNOTSUPP; /* RC, UC and UD QPs only */
		return NULL;
	}
	if (!init->send_cq || !init->recv_cq) {
		errno = EINVAL;
		return NULL;
	}
	struct emu_qp *q = calloc(1, sizeof *q);
	if (!q) {
		errno = ENOMEM;
		return NULL;
	}
	uint32_t sge = init->cap.max_send_sge > init->cap.max_recv_sge ? init->cap.max_send_sge : init->cap.max_recv_sge;
	struct odpemu_qp_caps caps = {
		.max_send_wr = init->cap.max_send_wr ? init->cap.max_send_wr : 1,
		/* A QP with an SRQ has no receive queue of its own: its max_recv_wr is ignored. */
		.max_recv_wr = init->srq ? 0 : init->cap.max_recv_wr ? init->cap.max_recv_wr : 1,
		.max_sge = sge ? sge : 1,
		.max_inline_data = init->cap.max_inline_data,
	};
	uint32_t qpn;
	int e = be.odpemu_create_qp(emu_pd_handle(pd), container_of(init->send_cq, struct emu_cq, cq)->h,
				    container_of(init->recv_cq, struct emu_cq, cq)->h,
				    init->srq ? emu_srq_handle(init->srq) : 0, (uint32_t)init->qp_type, &caps,
				    init->sq_sig_all != 0, &q->h, &qpn);
	if (e) {
		free(q);
		errno = e;
		return NULL;
	}
	q->cap = (struct ibv_qp_cap){.max_send_wr = caps.max_send_wr, .max_recv_wr = caps.max_recv_wr,
				     .max_send_sge = caps.max_sge, .max_recv_sge = caps.max_sge,
				     .max_inline_data = caps.max_inline_data};
	init->cap = q->cap;
	q->sq_sig_all = init->sq_sig_all;
	struct ibv_qp *qp = &q->qp;
	qp->context = pd->context;
	qp->qp_context = init->qp_context;
	qp->pd = pd;
	qp->send_cq = init->send_cq;
	qp->recv_cq = init->recv_cq;
	qp->srq = init->srq;
	qp->handle = qpn;
	qp->qp_num = qpn;
	qp->state = IBV_QPS_RESET;
	qp->qp_type = init->qp_type;
	pthread_mutex_init(&qp->mutex, NULL);
	pthread_cond_init(&qp->cond, NULL);
	q->attr.qp_state = IBV_QPS_RESET;
	q->attr.cap = q->cap;
	return q;
}

EXPORT struct ibv_qp *ibv_create_qp(struct ibv_pd *pd, struct ibv_qp_init_attr *init)
{
	struct emu_qp *q = create_qp(pd, init);
	return q ? &q->qp : NULL;
}

/* emu_create_qp_ex is ibv_create_qp_ex: an RC QP on a PD, with the ibv_wr_* API for
 * the operations send_ops_flags names. */
static struct ibv_qp *emu_create_qp_ex(struct ibv_context *context, struct ibv_qp_init_attr_ex *attr)
{
	uint32_t known = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS | IBV_QP_INIT_ATTR_CREATE_FLAGS;
	if ((attr->comp_mask & ~known) || ((attr->comp_mask & IBV_QP_INIT_ATTR_CREATE_FLAGS) && attr->create_flags)) {
		errno = EOPNOTSUPP; /* XRC domains, creation flags, TSO, RSS, source QPNs */
		return NULL;
	}
	if (!(attr->comp_mask & IBV_QP_INIT_ATTR_PD) || !attr->pd || attr->pd->context != context) {
		errno = EINVAL;
		return NULL;
	}
	struct ibv_qp_init_attr init = {.qp_context = attr->qp_context, .send_cq = attr->send_cq,
					.recv_cq = attr->recv_cq, .srq = attr->srq, .cap = attr->cap,
					.qp_type = attr->qp_type, .sq_sig_all = attr->sq_sig_all};
	struct emu_qp *q = create_qp(attr->pd, &init);
	if (!q)
		return NULL;
	attr->cap = init.cap;
	if (attr->comp_mask & IBV_QP_INIT_ATTR_SEND_OPS_FLAGS) {
		int e = emu_wr_init(q, attr->send_ops_flags);
		if (e) {
			ibv_destroy_qp(&q->qp);
			errno = e;
			return NULL;
		}
	}
	return &q->qp;
}

EXPORT struct ibv_qp_ex *ibv_qp_to_qp_ex(struct ibv_qp *qp)
{
	struct emu_qp *q = container_of(qp, struct emu_qp, qp);
	if (!q->batch) {
		errno = EOPNOTSUPP; /* created without send_ops_flags */
		return NULL;
	}
	return &q->qp_ex;
}

static int mtu_bytes(enum ibv_mtu m)
{
	return m >= IBV_MTU_256 && m <= IBV_MTU_4096 ? 128 << m : 0;
}

/* The attributes ibv_modify_qp needs for each RC transition, as the kernel checks them
 * (ib_modify_qp_is_ok's qp_state_table); UC needs the same less what acknowledgements,
 * retries and READs take. */
enum {
	INIT_MASK = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS,
	UC_RTR_MASK = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN,
	RTR_MASK = UC_RTR_MASK | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER,
	UC_RTS_MASK = IBV_QP_STATE | IBV_QP_SQ_PSN,
	RTS_MASK = UC_RTS_MASK | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC,
};

/* save copies the attributes mask names into q->attr. */
static void save(struct emu_qp *q, const struct ibv_qp_attr *a, int mask)
{
	struct ibv_qp_attr *s = &q->attr;
	if (mask & IBV_QP_PKEY_INDEX)
		s->pkey_index = a->pkey_index;
	if (mask & IBV_QP_PORT)
		s->port_num = a->port_num;
	if (mask & IBV_QP_ACCESS_FLAGS)
		s->qp_access_flags = a->qp_access_flags;
	if (mask & IBV_QP_AV)
		s->ah_attr = a->ah_attr;
	if (mask & IBV_QP_PATH_MTU)
		s->path_mtu = a->path_mtu;
	if (mask & IBV_QP_DEST_QPN)
		s->dest_qp_num = a->dest_qp_num;
	if (mask & IBV_QP_RQ_PSN)
		s->rq_psn = a->rq_psn;
	if (mask & IBV_QP_MAX_DEST_RD_ATOMIC)
		s->max_dest_rd_atomic = a->max_dest_rd_atomic;
	if (mask & IBV_QP_MIN_RNR_TIMER)
		s->min_rnr_timer = a->min_rnr_timer;
	if (mask & IBV_QP_SQ_PSN)
		s->sq_psn = a->sq_psn;
	if (mask & IBV_QP_TIMEOUT)
		s->timeout = a->timeout;
	if (mask & IBV_QP_RETRY_CNT)
		s->retry_cnt = a->retry_cnt;
	if (mask & IBV_QP_RNR_RETRY)
		s->rnr_retry = a->rnr_retry;
	if (mask & IBV_QP_MAX_QP_RD_ATOMIC)
		s->max_rd_atomic = a->max_rd_atomic;
	if (mask & IBV_QP_QKEY)
		s->qkey = a->qkey;
}

_Static_assert(IBV_QPT_RC == 2 && IBV_QPT_UC == 3 && IBV_QPT_UD == 4, "the Go half's QP types");

/* set_state records a move to state to that the Go half made. */
static void set_state(struct emu_qp *q, struct ibv_qp_attr *attr, int mask, enum ibv_qp_state to)
{
	if (to == IBV_QPS_RESET)
		memset(&q->attr, 0, sizeof q->attr); /* a QP in RESET has no attributes left */
	save(q, attr, mask);
	q->attr.qp_state = to;
	q->attr.cur_qp_state = to;
	q->qp.state = to;
}

enum { UD_INIT_MASK = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY };

/* to_init moves q to INIT; from RESET, mask must hold the attributes need names. */
static int to_init(struct emu_qp *q, const struct ibv_qp_attr *attr, int mask, int need)
{
	if (q->qp.state == IBV_QPS_RESET && (mask & need) != need)
		return EINVAL;
	if ((mask & IBV_QP_PORT) && attr->port_num != 1)
		return EINVAL;
	return be.odpemu_modify_qp_state(q->h, IBV_QPS_INIT);
}

/* modify_ud is ibv_modify_qp of a UD QP: INIT with its Q_Key, RTR binds it at the
 * device's address (it receives from then on), RTS with its SQ PSN lets it send. */
static int modify_ud(struct emu_qp *q, struct ibv_qp_attr *attr, int mask)
{
	struct ibv_qp *qp = &q->qp;
	if (mask & IBV_QP_QKEY) {
		int e = be.odpemu_set_qp_qkey(q->h, attr->qkey);
		if (e)
			return e;
	}
	if (!(mask & IBV_QP_STATE)) {
		save(q, attr, mask);
		return 0;
	}
	enum ibv_qp_state to = attr->qp_state;
	int e;
	switch (to) {
	case IBV_QPS_INIT:
		e = to_init(q, attr, mask, UD_INIT_MASK);
		break;
	case IBV_QPS_RTR:
		if (qp->state != IBV_QPS_INIT)
			return EINVAL;
		e = be.odpemu_bind_ud_qp(q->h, 4096);
		break;
	case IBV_QPS_RTS:
		if (qp->state == IBV_QPS_RTR && !(mask & IBV_QP_SQ_PSN))
			return EINVAL;
		e = be.odpemu_modify_qp_state(q->h, IBV_QPS_RTS);
		break;
	default:
		e = be.odpemu_modify_qp_state(q->h, to);
		break;
	}
	if (e)
		return e;
	set_state(q, attr, mask, to);
	return 0;
}

EXPORT int ibv_modify_qp(struct ibv_qp *qp, struct ibv_qp_attr *attr, int mask)
{
	struct emu_qp *q = container_of(qp, struct emu_qp, qp);
	if (qp->qp_type == IBV_QPT_UD)
		return modify_ud(q, attr, mask);
	if (mask & IBV_QP_ACCESS_FLAGS) {
		int e = be.odpemu_set_qp_access(q->h, attr->qp_access_flags);
		if (e)
			return e;
	}
	if (!(mask & IBV_QP_STATE)) {
		save(q, attr, mask); /* taken when the QP connects */
		return 0;
	}
	enum ibv_qp_state to = attr->qp_state;
	int uc = qp->qp_type == IBV_QPT_UC, e = 0;
	int rtr = uc ? UC_RTR_MASK : RTR_MASK, rts = uc ? UC_RTS_MASK : RTS_MASK;
	switch (to) {
	case IBV_QPS_INIT:
		e = to_init(q, attr, mask, INIT_MASK);
		break;
	case IBV_QPS_RTR:
		if (qp->state != IBV_QPS_INIT || (mask & rtr) != rtr)
			return EINVAL;
		if (!attr->ah_attr.is_global || !mtu_bytes(attr->path_mtu))
			return EINVAL; /* RoCE addresses by GID: a GRH is required */
		{
			struct odpemu_connect c = {
				.dest_qp_num = attr->dest_qp_num,
				.rq_psn = attr->rq_psn,
				.mtu = (uint32_t)mtu_bytes(attr->path_mtu),
				.min_rnr_timer = uc ? 0 : attr->min_rnr_timer, /* UC: not in the mask */
				.max_dest_rd_atomic = uc ? 0 : attr->max_dest_rd_atomic,
			};
			memcpy(c.dgid, attr->ah_attr.grh.dgid.raw, sizeof c.dgid);
			e = be.odpemu_rtr_qp(q->h, &c);
		}
		break;
	case IBV_QPS_RTS:
		if (qp->state == IBV_QPS_RTR) {
			if ((mask & rts) != rts)
				return EINVAL;
			struct odpemu_connect c = {.sq_psn = attr->sq_psn};
			if (!uc) {
				c.timeout = attr->timeout;
				c.retry_cnt = attr->retry_cnt;
				c.rnr_retry = attr->rnr_retry;
				c.max_rd_atomic = attr->max_rd_atomic;
			}
			e = be.odpemu_rts_qp(q->h, &c);
		} else {
			e = be.odpemu_modify_qp_state(q->h, IBV_QPS_RTS); /* from SQD */
		}
		break;
	default:
		e = be.odpemu_modify_qp_state(q->h, to);
		break;
	}
	if (e)
		return e;
	set_state(q, attr, mask, to);
	return 0;
}

/* Address handles: RoCE addresses by GID, so an AH is its GID (is_global). */
EXPORT struct ibv_ah *ibv_create_ah(struct ibv_pd *pd, struct ibv_ah_attr *attr)
{
	if (!pd || !attr || !attr->is_global || attr->port_num != 1) {
		errno = EINVAL;
		return NULL;
	}
	struct emu_ah *a = calloc(1, sizeof *a);
	if (!a) {
		errno = ENOMEM;
		return NULL;
	}
	memcpy(a->dgid, attr->grh.dgid.raw, sizeof a->dgid);
	a->ah.context = pd->context;
	a->ah.pd = pd;
	return &a->ah;
}

EXPORT int ibv_destroy_ah(struct ibv_ah *ah)
{
	free(container_of(ah, struct emu_ah, ah));
	return 0;
}

/* ibv_init_ah_from_wc: the AH that answers a UD receive, from its GRH, as libibverbs
 * builds it (RoCEv2 over IPv4: the IPv4 header in the GRH's last 20 bytes). */
EXPORT int ibv_init_ah_from_wc(struct ibv_context *context, uint8_t port_num, struct ibv_wc *wc, struct ibv_grh *grh,
			       struct ibv_ah_attr *ah_attr)
{
	(void)context;
	memset(ah_attr, 0, sizeof *ah_attr);
	ah_attr->port_num = port_num;
	ah_attr->dlid = wc->slid;
	ah_attr->sl = wc->sl;
	if (!(wc->wc_flags & IBV_WC_GRH))
		return 0;
	ah_attr->is_global = 1;
	const uint8_t *ip4 = (const uint8_t *)grh + 20;
	if ((be32toh(grh->version_tclass_flow) >> 28) != 6 && ip4[0] == 0x45) {
		uint8_t *g = ah_attr->grh.dgid.raw;
		g[10] = g[11] = 0xff; /* ::ffff:source */
		memcpy(g + 12, ip4 + 12, 4);
		ah_attr->grh.hop_limit = ip4[8];
		ah_attr->grh.traffic_class = ip4[1];
		return 0;
	}
	ah_attr->grh.dgid = grh->sgid;
	ah_attr->grh.hop_limit = grh->hop_limit;
	ah_attr->grh.traffic_class = (uint8_t)(be32toh(grh->version_tclass_flow) >> 20);
	return 0;
}

EXPORT struct ibv_ah *ibv_create_ah_from_wc(struct ibv_pd *pd, struct ibv_wc *wc, struct ibv_grh *grh, uint8_t port_num)
{
	struct ibv_ah_attr attr;
	if (ibv_init_ah_from_wc(pd->context, port_num, wc, grh, &attr))
		return NULL;
	return ibv_create_ah(pd, &attr);
}

EXPORT int ibv_query_qp(struct ibv_qp *qp, struct ibv_qp_attr *attr, int mask, struct ibv_qp_init_attr *init)
{
	(void)mask; /* every attribute is returned, as providers do */
	struct emu_qp *q = container_of(qp, struct emu_qp, qp);
	*attr = q->attr;
	attr->qp_state = qp->state;
	attr->cur_qp_state = qp->state;
	attr->cap = q->cap;
	attr->port_num = attr->port_num ? attr->port_num : 1;
	memset(init, 0, sizeof *init);
	init->qp_context = qp->qp_context;
	init->send_cq = qp->send_cq;
	init->recv_cq = qp->recv_cq;
	init->srq = qp->srq;
	init->cap = q->cap;
	init->qp_type = qp->qp_type;
	init->sq_sig_all = q->sq_sig_all;
	return 0;
}

EXPORT int ibv_destroy_qp(struct ibv_qp *qp)
{
	struct emu_qp *q = container_of(qp, struct emu_qp, qp);
	int e = be.odpemu_destroy_qp(q->h);
	if (e)
		return e;
	pthread_cond_destroy(&qp->cond);
	pthread_mutex_destroy(&qp->mutex);
	emu_wr_free(q);
	free(q);
	return 0;
}

/* ibv_query_qp_data_in_order: the emulated NIC's DMA is a memmove, which may store a
 * message's first bytes after its last: no order is guaranteed, whole message or
 * 128-byte units (0 answers both questions). */
EXPORT int ibv_query_qp_data_in_order(struct ibv_qp *qp, enum ibv_wr_opcode op, uint32_t flags)
{
	(void)qp, (void)op, (void)flags;
	return 0;
}
