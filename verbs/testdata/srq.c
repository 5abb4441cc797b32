/*
 * Built against the installed rdma-core headers and linked with odpemu's
 * libibverbs.so.1 (verbs_test.go: TestSRQ): shared receive queues as verbs programs
 * use them. Two QPs receive from one SRQ whose receive buffers are ODP memory the
 * program malloc'ed; each sends to the other over the device's own GID:
 *   - SENDs on either QP take the SRQ's receives in posting order, and the
 *     completions name the QP that received;
 *   - the limit armed with ibv_modify_srq raises IBV_EVENT_SRQ_LIMIT_REACHED, once,
 *     on the context's async_fd, naming the SRQ, and disarms itself (ibv_query_srq);
 *   - what verbs refuse: ibv_post_recv on a QP that has an SRQ, a receive with more
 *     SGEs than the SRQ takes (bad_wr names it, the receives before it are posted),
 *     resizing (IBV_SRQ_MAX_WR), a limit above the SRQ's size, destroying an SRQ
 *     that QPs use.
 * Prints "ok" and exits 0, or says what is wrong and exits 1.
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <infiniband/verbs.h>

#include "pair.h"

enum { SLOT = 4096, SLOTS = 8 };

static struct ibv_cq *cq;

int main(void)
{
	struct ibv_context *ctx = open_first();
	struct ibv_device_attr_ex dattr;
	if (ibv_query_device_ex(ctx, NULL, &dattr))
		DIE("query_device_ex");
	if (dattr.orig_attr.max_srq <= 0 || dattr.orig_attr.max_srq_wr < SLOTS || dattr.orig_attr.max_srq_sge < 1)
		DIE("max_srq %d, max_srq_wr %d, max_srq_sge %d", dattr.orig_attr.max_srq, dattr.orig_attr.max_srq_wr,
		    dattr.orig_attr.max_srq_sge);
	if (!(dattr.odp_caps.per_transport_caps.rc_odp_caps & IBV_ODP_SUPPORT_SRQ_RECV))
		DIE("rc_odp_caps without SRQ_RECV");
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	cq = ibv_create_cq(ctx, 64, NULL, NULL, 0);
	if (!pd || !cq)
		DIE("alloc_pd/create_cq");

	struct ibv_srq_init_attr sinit = {.srq_context = (void *)0x5151, .attr = {.max_wr = SLOTS, .max_sge = 1}};
	struct ibv_srq *srq = ibv_create_srq(pd, &sinit);
	if (!srq)
		DIE("create_srq: %s", strerror(errno));
	if (sinit.attr.max_wr < SLOTS || srq->srq_context != (void *)0x5151 || srq->pd != pd)
		DIE("srq as created: max_wr %u", sinit.attr.max_wr);

	struct ibv_qp *qp[2];
	for (int i = 0; i < 2; i++) {
		struct ibv_qp_init_attr init = {.send_cq = cq, .recv_cq = cq, .srq = srq, .qp_type = IBV_QPT_RC,
						.cap = {.max_send_wr = 16, .max_recv_wr = 16, .max_send_sge = 1,
							.max_recv_sge = 1}};
		if (!(qp[i] = ibv_create_qp(pd, &init)))
			DIE("create_qp with an SRQ: %s", strerror(errno));
		struct ibv_qp_attr qattr;
		struct ibv_qp_init_attr qinit;
		if (qp[i]->srq != srq || ibv_query_qp(qp[i], &qattr, IBV_QP_CAP, &qinit) || qinit.srq != srq)
			DIE("the QP's SRQ");
	}
	int access = IBV_ACCESS_LOCAL_WRITE;
	connect_qp(ctx, qp[0], qp[1]->qp_num, access);
	connect_qp(ctx, qp[1], qp[0]->qp_num, access);

	char *src = malloc(SLOT), *dst = malloc(SLOT * SLOTS);
	if (!src || !dst)
		DIE("malloc");
	struct ibv_mr *smr = ibv_reg_mr(pd, src, SLOT, IBV_ACCESS_LOCAL_WRITE);
	struct ibv_mr *dmr = ibv_reg_mr(pd, dst, SLOT * SLOTS, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_ON_DEMAND);
	if (!smr || !dmr)
		DIE("reg_mr: %s", strerror(errno));

	/* What verbs refuse. */
	struct ibv_sge one = {(uintptr_t)dst, SLOT, dmr->lkey}, two[2] = {one, one};
	struct ibv_recv_wr rwr = {.wr_id = 1, .sg_list = &one, .num_sge = 1}, *bad = NULL;
	if (ibv_post_recv(qp[0], &rwr, &bad) != EINVAL || bad != &rwr)
		DIE("post_recv on a QP with an SRQ was not refused with EINVAL");
	struct ibv_srq_attr sattr = {.max_wr = 2 * SLOTS};
	if (ibv_modify_srq(srq, &sattr, IBV_SRQ_MAX_WR) != EINVAL)
		DIE("resizing an SRQ was not refused");
	sattr.srq_limit = 2 * SLOTS;
	if (ibv_modify_srq(srq, &sattr, IBV_SRQ_LIMIT) == 0)
		DIE("a limit above the SRQ's size was taken");
	if (ibv_destroy_srq(srq) != EBUSY)
		DIE("destroying an SRQ in use was not refused with EBUSY");

	/* A chain of receives, one per slot; the last has two SGEs and is refused. */
	struct ibv_sge sges[SLOTS];
	struct ibv_recv_wr chain[SLOTS + 1];
	for (int i = 0; i < SLOTS; i++) {
		sges[i] = (struct ibv_sge){(uintptr_t)dst + i * SLOT, SLOT, dmr->lkey};
		chain[i] = (struct ibv_recv_wr){.wr_id = 100 + i, .sg_list = &sges[i], .num_sge = 1, .next = &chain[i + 1]};
	}
	chain[SLOTS] = (struct ibv_recv_wr){.wr_id = 999, .sg_list = two, .num_sge = 2};
	bad = NULL;
	if (ibv_post_srq_recv(srq, chain, &bad) == 0 || bad != &chain[SLOTS])
		DIE("a receive with too many SGEs: bad_wr %p, want %p", (void *)bad, (void *)&chain[SLOTS]);

	/* Armed at 3: the event comes when the sixth SEND leaves 2 receives. */
	sattr.srq_limit = 3;
	if (ibv_modify_srq(srq, &sattr, IBV_SRQ_LIMIT))
		DIE("arm the limit");
	if (ibv_query_srq(srq, &sattr) || sattr.srq_limit != 3 || sattr.max_wr < SLOTS)
		DIE("query_srq: limit %u", sattr.srq_limit);
	int flags = fcntl(ctx->async_fd, F_GETFL);
	if (fcntl(ctx->async_fd, F_SETFL, flags | O_NONBLOCK))
		DIE("async_fd non-blocking");
	struct ibv_async_event ev;
	for (int i = 0; i < 7; i++) {
		memset(src, 'a' + i, SLOT);
		struct ibv_sge s = {(uintptr_t)src, 1000 + i, smr->lkey};
		struct ibv_send_wr wr = {.wr_id = i, .sg_list = &s, .num_sge = 1, .opcode = IBV_WR_SEND,
					 .send_flags = IBV_SEND_SIGNALED},
				   *sbad;
		if (ibv_post_send(qp[i % 2], &wr, &sbad))
			DIE("post_send");
		int sent = 0, received = 0;
		while (!sent || !received) {
			struct ibv_wc wc = poll_one(cq);
			if (wc.status != IBV_WC_SUCCESS)
				DIE("completion %llu: %s", (unsigned long long)wc.wr_id, ibv_wc_status_str(wc.status));
			if (wc.opcode == IBV_WC_SEND) {
				sent = 1;
				continue;
			}
			if (wc.wr_id != 100 + (uint64_t)i || wc.byte_len != 1000 + (uint32_t)i ||
			    wc.qp_num != qp[(i + 1) % 2]->qp_num)
				DIE("receive %llu of %u bytes on QP %u, want %d of %d on %u", (unsigned long long)wc.wr_id,
				    wc.byte_len, wc.qp_num, 100 + i, 1000 + i, qp[(i + 1) % 2]->qp_num);
			if (dst[i * SLOT] != 'a' + i || dst[i * SLOT + 999 + i] != 'a' + i)
				DIE("receive %d holds other bytes", i);
			received = 1;
		}
		int got = ibv_get_async_event(ctx, &ev) == 0;
		if (got)
			ibv_ack_async_event(&ev);
		if (got != (i == 5))
			DIE("after SEND %d (%d receives left): %s limit event", i, SLOTS - 1 - i, got ? "a" : "no");
		if (got && (ev.event_type != IBV_EVENT_SRQ_LIMIT_REACHED || ev.element.srq != srq))
			DIE("event %d for %p", ev.event_type, (void *)ev.element.srq);
	}
	if (ibv_query_srq(srq, &sattr) || sattr.srq_limit != 0)
		DIE("the limit event did not disarm the limit (%u)", sattr.srq_limit);

	for (int i = 0; i < 2; i++)
		if (ibv_destroy_qp(qp[i]))
			DIE("destroy_qp");
	if (ibv_destroy_srq(srq))
		DIE("destroy_srq");
	if (ibv_dereg_mr(smr) || ibv_dereg_mr(dmr) || ibv_destroy_cq(cq) || ibv_dealloc_pd(pd) ||
	    ibv_close_device(ctx))
		DIE("teardown");
	free(src);
	free(dst);
	printf("ok\n");
	return 0;
}
