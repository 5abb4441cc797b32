/*
 * Memory windows (ibv_alloc_mw, ibv_dealloc_mw and ibv_bind_mw through
 * ibv_context.ops; IBV_WR_BIND_MW, IBV_WR_LOCAL_INV and IBV_WR_SEND_WITH_INV through
 * ibv_post_send and the ibv_wr_* API). As on rxe, ibv_bind_mw posts a bind work
 * request with the window's R_Key advanced (ibv_inc_rkey) and sets the window's
 * rkey once it is posted; its completion (IBV_WC_BIND_MW) says whether it bound.
 */
#include <errno.h>
#include <stdlib.h>

#include <infiniband/verbs.h>

#include "emu.h"

void emu_bind_info(struct odpemu_send_wr *w, struct ibv_mw *mw, uint32_t rkey, const struct ibv_mw_bind_info *info)
{
	w->mw = container_of(mw, struct emu_mw, mw)->h;
	w->rkey = rkey;
	if (info->mr)
		w->mr = container_of(info->mr, struct emu_mr, mr)->h;
	w->bind_addr = info->addr;
	w->bind_length = info->length;
	w->bind_access = info->mw_access_flags;
}

static struct ibv_mw *emu_alloc_mw(struct ibv_pd *pd, enum ibv_mw_type type)
{
	struct emu_mw *m = calloc(1, sizeof *m);
	if (!m) {
		errno = ENOMEM;
		return NULL;
	}
	uint32_t rkey;
	int e = be.odpemu_alloc_mw(emu_pd_handle(pd), (uint32_t)type, &m->h, &rkey);
	if (e) {
		free(m);
		errno = e;
		return NULL;
	}
	m->mw.context = pd->context;
	m->mw.pd = pd;
	m->mw.rkey = rkey;
	m->mw.handle = rkey;
	m->mw.type = type;
	return &m->mw;
}

static int emu_dealloc_mw(struct ibv_mw *mw)
{
	struct emu_mw *m = container_of(mw, struct emu_mw, mw);
	int e = be.odpemu_dealloc_mw(m->h);
	if (e)
		return e;
	free(m);
	return 0;
}

static int emu_bind_mw(struct ibv_qp *qp, struct ibv_mw *mw, struct ibv_mw_bind *bind)
{
	struct ibv_send_wr wr = {
		.wr_id = bind->wr_id,
		.opcode = IBV_WR_BIND_MW,
		.send_flags = bind->send_flags,
		.bind_mw = {.mw = mw, .rkey = ibv_inc_rkey(mw->rkey), .bind_info = bind->bind_info},
	};
	struct ibv_send_wr *bad;
	int e = qp->context->ops.post_send(qp, &wr, &bad);
	if (e)
		return e;
	mw->rkey = wr.bind_mw.rkey; /* if the bind fails, its completion says so */
	return 0;
}

void emu_set_mw_ops(struct ibv_context *ctx)
{
	ctx->ops.alloc_mw = emu_alloc_mw;
	ctx->ops.dealloc_mw = emu_dealloc_mw;
	ctx->ops.bind_mw = emu_bind_mw;
}
