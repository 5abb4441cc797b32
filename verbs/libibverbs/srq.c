/*
 * Shared receive queues (ibv_create_srq, ibv_create_srq_ex for the basic type,
 * ibv_modify_srq, ibv_query_srq, ibv_destroy_srq, ibv_post_srq_recv through
 * ibv_context.ops). The SRQ limit event reaches the application through the
 * context's async_fd as IBV_EVENT_SRQ_LIMIT_REACHED, which the Go half writes.
 */
#include <errno.h>
#include <stdlib.h>

#include "emu.h"

struct emu_srq {
	struct ibv_srq srq;
	odpemu_handle h;
	struct ibv_async_event limit_event; /* what the Go half writes when the limit is reached */
};

odpemu_handle emu_srq_handle(struct ibv_srq *srq) { return container_of(srq, struct emu_srq, srq)->h; }

EXPORT struct ibv_srq *ibv_create_srq(struct ibv_pd *pd, struct ibv_srq_init_attr *init)
{
	if (!pd || !init || init->attr.srq_limit > init->attr.max_wr) {
		errno = EINVAL;
		return NULL;
	}
	struct emu_srq *s = calloc(1, sizeof *s);
	if (!s) {
		errno = ENOMEM;
		return NULL;
	}
	s->limit_event.element.srq = &s->srq;
	s->limit_event.event_type = IBV_EVENT_SRQ_LIMIT_REACHED;
	uint32_t max_wr = init->attr.max_wr ? init->attr.max_wr : 1, max_sge = init->attr.max_sge ? init->attr.max_sge : 1;
	int e = be.odpemu_create_srq(emu_pd_handle(pd), &max_wr, &max_sge, init->attr.srq_limit,
				     emu_async_wr(pd->context), &s->limit_event, sizeof s->limit_event, &s->h);
	if (e) {
		free(s);
		errno = e;
		return NULL;
	}
	init->attr.max_wr = max_wr;
	init->attr.max_sge = max_sge;
	struct ibv_srq *srq = &s->srq;
	srq->context = pd->context;
	srq->srq_context = init->srq_context;
	srq->pd = pd;
	srq->handle = 0;
	pthread_mutex_init(&srq->mutex, NULL);
	pthread_cond_init(&srq->cond, NULL);
	return srq;
}

/* emu_create_srq_ex is ibv_create_srq_ex for the basic type: XRC and tag-matching
 * SRQs are not emulated. */
static struct ibv_srq *emu_create_srq_ex(struct ibv_context *context, struct ibv_srq_init_attr_ex *attr)
{
	uint32_t known = IBV_SRQ_INIT_ATTR_TYPE | IBV_SRQ_INIT_ATTR_PD;
	if ((attr->comp_mask & ~known) ||
	    ((attr->comp_mask & IBV_SRQ_INIT_ATTR_TYPE) && attr->srq_type != IBV_SRQT_BASIC)) {
		errno = EOPNOTSUPP;
		return NULL;
	}
	if (!(attr->comp_mask & IBV_SRQ_INIT_ATTR_PD) || !attr->pd || attr->pd->context != context) {
		errno = EINVAL;
		return NULL;
	}
	struct ibv_srq_init_attr init = {.srq_context = attr->srq_context, .attr = attr->attr};
	struct ibv_srq *srq = ibv_create_srq(attr->pd, &init);
	if (srq)
		attr->attr = init.attr;
	return srq;
}

EXPORT int ibv_modify_srq(struct ibv_srq *srq, struct ibv_srq_attr *attr, int mask)
{
	if (mask & ~IBV_SRQ_LIMIT)
		return EINVAL; /* unknown bits, or IBV_SRQ_MAX_WR: no resizing, as on mlx5 */
	if (mask & IBV_SRQ_LIMIT)
		return be.odpemu_arm_srq(emu_srq_handle(srq), attr->srq_limit);
	return 0;
}

EXPORT int ibv_query_srq(struct ibv_srq *srq, struct ibv_srq_attr *attr)
{
	uint32_t max_wr, max_sge, limit;
	int e = be.odpemu_query_srq(emu_srq_handle(srq), &max_wr, &max_sge, &limit);
	if (e)
		return e;
	*attr = (struct ibv_srq_attr){.max_wr = max_wr, .max_sge = max_sge, .srq_limit = limit};
	return 0;
}

EXPORT int ibv_destroy_srq(struct ibv_srq *srq)
{
	struct emu_srq *s = container_of(srq, struct emu_srq, srq);
	int e = be.odpemu_destroy_srq(s->h);
	if (e)
		return e;
	pthread_cond_destroy(&srq->cond);
	pthread_mutex_destroy(&srq->mutex);
	free(s);
	return 0;
}

static int emu_post_srq_recv(struct ibv_srq *srq, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad_wr)
{
	odpemu_handle h = emu_srq_handle(srq);
	for (; wr; wr = wr->next) {
		int e = wr->num_sge < 0 ? EINVAL
					: be.odpemu_post_srq_recv(h, wr->wr_id, (const struct odpemu_sge *)wr->sg_list,
								  (uint32_t)wr->num_sge);
		if (e) {
			*bad_wr = wr;
			return e;
		}
	}
	return 0;
}

void emu_set_srq_ops(struct ibv_context *ctx)
{
	ctx->ops.post_srq_recv = emu_post_srq_recv;
	verbs_get_ctx(ctx)->create_srq_ex = emu_create_srq_ex;
}
