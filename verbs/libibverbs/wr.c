/*
 * The ibv_wr_* API of odpemu's libibverbs.so.1 (a QP created by ibv_create_qp_ex with
 * send_ops_flags): ibv_wr_start begins a batch, each ibv_wr_<operation> starts a work
 * request with the QP's wr_id and wr_flags of that moment, ibv_wr_set_sge(_list) and
 * ibv_wr_set_inline_data(_list) give it its data (copied then, as a NIC copies them
 * into its send queue), and ibv_wr_complete posts the batch in one call to the Go half,
 * or ibv_wr_abort drops it. An error while building (too many requests, a bad SGL, an
 * operation the QP was not created for) is kept and returned by ibv_wr_complete, which
 * then posts nothing. The Go half checks the batch as ibv_post_send's requests: should
 * one of them fail there (the send queue is full), those before it stay posted.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include <infiniband/verbs.h>

#include "emu.h"

/* The operations the emulated NIC's RC QPs perform. */
#define EMU_WR_OPS                                                                                       \
	(IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM | IBV_QP_EX_WITH_SEND |          \
	 IBV_QP_EX_WITH_SEND_WITH_IMM | IBV_QP_EX_WITH_RDMA_READ | IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP | \
	 IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD | IBV_QP_EX_WITH_BIND_MW | IBV_QP_EX_WITH_LOCAL_INV |     \
	 IBV_QP_EX_WITH_SEND_WITH_INV | IBV_QP_EX_WITH_ATOMIC_WRITE)

static struct emu_qp *eqp(struct ibv_qp_ex *qx) { return container_of(qx, struct emu_qp, qp_ex); }

static void fail(struct emu_wr_batch *b, int e)
{
	if (!b->err)
		b->err = e;
}

/* next starts a work request of opcode, or returns NULL when the batch is full. */
static struct odpemu_send_wr *next(struct ibv_qp_ex *qx, enum ibv_wr_opcode opcode)
{
	struct emu_qp *q = eqp(qx);
	struct emu_wr_batch *b = q->batch;
	if (b->n == q->cap.max_send_wr) {
		fail(b, ENOMEM); /* more than the send queue holds */
		return NULL;
	}
	struct odpemu_send_wr *w = &b->wrs[b->n++];
	*w = (struct odpemu_send_wr){.wr_id = qx->wr_id, .opcode = opcode,
				     .flags = qx->wr_flags & ~EMU_IGNORED_SEND_FLAGS};
	return w;
}

/* cur is the work request the setters apply to, or NULL before the first. */
static struct odpemu_send_wr *cur(struct ibv_qp_ex *qx)
{
	struct emu_wr_batch *b = eqp(qx)->batch;
	if (!b->n) {
		fail(b, EINVAL);
		return NULL;
	}
	return &b->wrs[b->n - 1];
}

static void wr_rdma_write(struct ibv_qp_ex *qx, uint32_t rkey, uint64_t remote_addr)
{
	struct odpemu_send_wr *w = next(qx, IBV_WR_RDMA_WRITE);
	if (w)
		w->rkey = rkey, w->remote_addr = remote_addr;
}

static void wr_rdma_write_imm(struct ibv_qp_ex *qx, uint32_t rkey, uint64_t remote_addr, __be32 imm)
{
	struct odpemu_send_wr *w = next(qx, IBV_WR_RDMA_WRITE_WITH_IMM);
	if (w)
		w->rkey = rkey, w->remote_addr = remote_addr, w->imm = be32toh(imm);
}

static void wr_rdma_read(struct ibv_qp_ex *qx, uint32_t rkey, uint64_t remote_addr)
{
	struct odpemu_send_wr *w = next(qx, IBV_WR_RDMA_READ);
	if (w)
		w->rkey = rkey, w->remote_addr = remote_addr;
}

static void wr_send(struct ibv_qp_ex *qx) { next(qx, IBV_WR_SEND); }

static void wr_send_imm(struct ibv_qp_ex *qx, __be32 imm)
{
	struct odpemu_send_wr *w = next(qx, IBV_WR_SEND_WITH_IMM);
	if (w)
		w->imm = be32toh(imm);
}

static void wr_atomic_cmp_swp(struct ibv_qp_ex *qx, uint32_t rkey, uint64_t remote_addr, uint64_t compare,
			      uint64_t swap)
{
	struct odpemu_send_wr *w = next(qx, IBV_WR_ATOMIC_CMP_AND_SWP);
	if (w)
		w->rkey = rkey, w->remote_addr = remote_addr, w->compare_add = compare, w->swap = swap;
}

static void wr_atomic_fetch_add(struct ibv_qp_ex *qx, uint32_t rkey, uint64_t remote_addr, uint64_t add)
{
	struct odpemu_send_wr *w = next(qx, IBV_WR_ATOMIC_FETCH_AND_ADD);
	if (w)
		w->rkey = rkey, w->remote_addr = remote_addr, w->compare_add = add;
}

static void wr_set_sge_list(struct ibv_qp_ex *qx, size_t num_sge, const struct ibv_sge *sg_list)
{
	struct emu_qp *q = eqp(qx);
	struct odpemu_send_wr *w = cur(qx);
	if (!w)
		return;
	if (num_sge > q->cap.max_send_sge) {
		fail(q->batch, EINVAL);
		return;
	}
	/* Each request's SGEs have their own max_send_sge slots: set again, they replace. */
	struct odpemu_sge *s = &q->batch->sges[(size_t)(w - q->batch->wrs) * q->cap.max_send_sge];
	memcpy(s, sg_list, num_sge * sizeof *s);
	w->sg_list = s;
	w->num_sge = (uint32_t)num_sge;
}

static void wr_set_sge(struct ibv_qp_ex *qx, uint32_t lkey, uint64_t addr, uint32_t length)
{
	struct ibv_sge sge = {.addr = addr, .length = length, .lkey = lkey};
	wr_set_sge_list(qx, 1, &sge);
}

static void wr_set_inline_data_list(struct ibv_qp_ex *qx, size_t num_buf, const struct ibv_data_buf *bufs)
{
	struct emu_qp *q = eqp(qx);
	struct odpemu_send_wr *w = cur(qx);
	if (!w)
		return;
	size_t len = 0;
	for (size_t i = 0; i < num_buf; i++)
		len += bufs[i].length;
	if (len > q->cap.max_inline_data) {
		fail(q->batch, EINVAL);
		return;
	}
	/* The bytes are the request's now: the application may reuse its buffers. */
	size_t slot = (size_t)(w - q->batch->wrs);
	char *to = q->batch->inl + slot * q->cap.max_inline_data;
	for (size_t i = 0, off = 0; i < num_buf; off += bufs[i].length, i++)
		memcpy(to + off, bufs[i].addr, bufs[i].length);
	struct odpemu_sge *s = &q->batch->sges[slot * q->cap.max_send_sge];
	*s = (struct odpemu_sge){.addr = (uintptr_t)to, .length = (uint32_t)len};
	w->sg_list = s;
	w->num_sge = 1;
	w->flags |= IBV_SEND_INLINE;
}

static void wr_set_inline_data(struct ibv_qp_ex *qx, void *addr, size_t length)
{
	struct ibv_data_buf buf = {.addr = addr, .length = length};
	wr_set_inline_data_list(qx, 1, &buf);
}

static void wr_bind_mw(struct ibv_qp_ex *qx, struct ibv_mw *mw, uint32_t rkey, const struct ibv_mw_bind_info *info)
{
	struct odpemu_send_wr *w = next(qx, IBV_WR_BIND_MW);
	if (w && (!mw || !info)) {
		fail(eqp(qx)->batch, EINVAL);
		return;
	}
	if (w)
		emu_bind_info(w, mw, rkey, info);
}

static void wr_local_inv(struct ibv_qp_ex *qx, uint32_t rkey)
{
	struct odpemu_send_wr *w = next(qx, IBV_WR_LOCAL_INV);
	if (w)
		w->invalidate_rkey = rkey;
}

static void wr_send_inv(struct ibv_qp_ex *qx, uint32_t rkey)
{
	struct odpemu_send_wr *w = next(qx, IBV_WR_SEND_WITH_INV);
	if (w)
		w->invalidate_rkey = rkey;
}

/* unsupported is every operation the QP cannot perform: RC QPs here have no XRC
 * addressing, no TSO. wr_complete then fails. */
static void unsupported(struct ibv_qp_ex *qx) { fail(eqp(qx)->batch, EOPNOTSUPP); }
static void wr_with_key(struct ibv_qp_ex *qx, uint32_t key) { (void)key, unsupported(qx); }
static void wr_send_tso(struct ibv_qp_ex *qx, void *hdr, uint16_t hdr_sz, uint16_t mss)
{
	(void)hdr, (void)hdr_sz, (void)mss, unsupported(qx);
}
static void wr_set_ud_addr(struct ibv_qp_ex *qx, struct ibv_ah *ah, uint32_t qpn, uint32_t qkey)
{
	struct odpemu_send_wr *w = cur(qx);
	if (!w)
		return;
	if (qx->qp_base.qp_type != IBV_QPT_UD || !ah) {
		fail(eqp(qx)->batch, EINVAL);
		return;
	}
	memcpy(w->dgid, container_of(ah, struct emu_ah, ah)->dgid, sizeof w->dgid);
	w->remote_qpn = qpn;
	w->remote_qkey = qkey;
}
/* wr_atomic_write's 8 bytes are copied as inline data: the application may reuse
 * them at once. */
static void wr_atomic_write(struct ibv_qp_ex *qx, uint32_t rkey, uint64_t remote_addr, const void *data)
{
	struct odpemu_send_wr *w = next(qx, IBV_WR_ATOMIC_WRITE);
	if (!w)
		return;
	w->rkey = rkey, w->remote_addr = remote_addr;
	struct ibv_data_buf buf = {.addr = (void *)data, .length = 8};
	wr_set_inline_data_list(qx, 1, &buf);
}

static void reset(struct emu_wr_batch *b)
{
	b->n = 0;
	b->err = 0;
}

static void wr_start(struct ibv_qp_ex *qx)
{
	struct emu_wr_batch *b = eqp(qx)->batch;
	pthread_mutex_lock(&b->lock);
	reset(b);
}

static int wr_complete(struct ibv_qp_ex *qx)
{
	struct emu_qp *q = eqp(qx);
	struct emu_wr_batch *b = q->batch;
	int e = b->err;
	if (!e && b->n) {
		uint32_t posted = 0;
		e = be.odpemu_post_send(q->h, b->wrs, b->n, &posted);
		emu_posted(&q->qp, b->wrs, posted);
	}
	reset(b);
	pthread_mutex_unlock(&b->lock);
	return e;
}

static void wr_abort(struct ibv_qp_ex *qx)
{
	struct emu_wr_batch *b = eqp(qx)->batch;
	reset(b);
	pthread_mutex_unlock(&b->lock);
}

int emu_wr_init(struct emu_qp *q, uint64_t ops)
{
	if (ops & ~(uint64_t)EMU_WR_OPS)
		return EOPNOTSUPP;
	struct emu_wr_batch *b = calloc(1, sizeof *b);
	if (!b)
		return ENOMEM;
	size_t n = q->cap.max_send_wr;
	b->wrs = calloc(n, sizeof *b->wrs);
	b->sges = calloc(n * (q->cap.max_send_sge ? q->cap.max_send_sge : 1), sizeof *b->sges);
	b->inl = malloc(n * q->cap.max_inline_data + 1);
	if (!b->wrs || !b->sges || !b->inl) {
		free(b->wrs);
		free(b->sges);
		free(b->inl);
		free(b);
		return ENOMEM;
	}
	pthread_mutex_init(&b->lock, NULL);
	q->batch = b;
	struct ibv_qp_ex *qx = &q->qp_ex;
	qx->comp_mask = 0;
	qx->wr_rdma_write = wr_rdma_write;
	qx->wr_rdma_write_imm = wr_rdma_write_imm;
	qx->wr_rdma_read = wr_rdma_read;
	qx->wr_send = wr_send;
	qx->wr_send_imm = wr_send_imm;
	qx->wr_atomic_cmp_swp = wr_atomic_cmp_swp;
	qx->wr_atomic_fetch_add = wr_atomic_fetch_add;
	qx->wr_set_sge = wr_set_sge;
	qx->wr_set_sge_list = wr_set_sge_list;
	qx->wr_set_inline_data = wr_set_inline_data;
	qx->wr_set_inline_data_list = wr_set_inline_data_list;
	qx->wr_bind_mw = wr_bind_mw;
	qx->wr_local_inv = wr_local_inv;
	qx->wr_send_inv = wr_send_inv;
	qx->wr_send_tso = wr_send_tso;
	qx->wr_set_ud_addr = wr_set_ud_addr;
	qx->wr_set_xrc_srqn = wr_with_key;
	qx->wr_atomic_write = wr_atomic_write;
	qx->wr_start = wr_start;
	qx->wr_complete = wr_complete;
	qx->wr_abort = wr_abort;
	return 0;
}

void emu_wr_free(struct emu_qp *q)
{
	struct emu_wr_batch *b = q->batch;
	if (!b)
		return;
	pthread_mutex_destroy(&b->lock);
	free(b->wrs);
	free(b->sges);
	free(b->inl);
	free(b);
	q->batch = NULL;
}
