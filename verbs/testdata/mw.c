/*
 * Built against the installed rdma-core headers and linked with odpemu's
 * libibverbs.so.1 (verbs_test.go: TestMW): memory windows over ODP memory the program
 * malloc'ed, as verbs programs use them. Two QPs of one context, connected over the
 * device's own GID:
 *   - the device reports windows (IBV_DEVICE_MEM_WINDOW, TYPE_2B, max_mw);
 *   - ibv_bind_mw binds a type 1 window (the window's rkey advanced, the completion
 *     IBV_WC_BIND_MW); a WRITE through it lands in the window's range, and one past
 *     its end fails with a remote access error;
 *   - a type 2 window bound with IBV_WR_BIND_MW through ibv_post_send, a WRITE through
 *     it, then a SEND with invalidate: the receive completion carries
 *     IBV_WC_WITH_INV and the window's rkey in invalidated_rkey (ibv_poll_cq), and a
 *     second one, bound again with the ibv_wr_* API, is invalidated the same way and
 *     read through an extended CQ (ibv_wc_read_invalidated_rkey);
 *   - an MR with a window bound is not deregistered (EBUSY) until the window goes.
 * Prints "ok" and exits 0, or says what is wrong and exits 1.
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <infiniband/verbs.h>

#include "pair.h"

enum { SIZE = 16 * 4096 };

static void expect(struct ibv_cq *cq, uint64_t wr_id, enum ibv_wc_status status, enum ibv_wc_opcode opcode)
{
	struct ibv_wc wc = poll_one(cq);
	if (wc.wr_id != wr_id || wc.status != status || wc.opcode != opcode)
		DIE("completion %lu: %s, opcode %d; want %lu: %s, opcode %d", (unsigned long)wc.wr_id,
		    ibv_wc_status_str(wc.status), wc.opcode, (unsigned long)wr_id, ibv_wc_status_str(status), opcode);
}

static void write_via(struct ibv_qp *qp, struct ibv_mr *src, size_t len, void *to, uint32_t rkey)
{
	struct ibv_sge sge = {.addr = (uintptr_t)src->addr, .length = (uint32_t)len, .lkey = src->lkey};
	struct ibv_send_wr wr = {.wr_id = 2, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE,
				 .send_flags = IBV_SEND_SIGNALED,
				 .wr = {.rdma = {.remote_addr = (uintptr_t)to, .rkey = rkey}}}, *bad;
	if (ibv_post_send(qp, &wr, &bad))
		DIE("post WRITE");
}

/* send_inv SENDs 64 bytes with invalidate of rkey from qp; the peer has a receive. */
static void send_inv(struct ibv_qp *qp, struct ibv_qp *peer, struct ibv_mr *src, struct ibv_mr *dst,
		     uint32_t rkey)
{
	struct ibv_sge rs = {.addr = (uintptr_t)dst->addr + SIZE - 4096, .length = 4096, .lkey = dst->lkey};
	struct ibv_recv_wr rwr = {.wr_id = 9, .sg_list = &rs, .num_sge = 1}, *rbad;
	if (ibv_post_recv(peer, &rwr, &rbad))
		DIE("post_recv");
	struct ibv_sge sge = {.addr = (uintptr_t)src->addr, .length = 64, .lkey = src->lkey};
	struct ibv_send_wr wr = {.wr_id = 8, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_SEND_WITH_INV,
				 .send_flags = IBV_SEND_SIGNALED, .invalidate_rkey = rkey}, *bad;
	if (ibv_post_send(qp, &wr, &bad))
		DIE("post SEND_WITH_INV");
}

int main(void)
{
	struct ibv_context *ctx = open_first();
	struct ibv_device_attr attr;
	if (ibv_query_device(ctx, &attr))
		DIE("query_device");
	if (!(attr.device_cap_flags & IBV_DEVICE_MEM_WINDOW) || !(attr.device_cap_flags & IBV_DEVICE_MEM_WINDOW_TYPE_2B) ||
	    attr.max_mw <= 0)
		DIE("memory windows not reported: flags %#x, max_mw %d", attr.device_cap_flags, attr.max_mw);
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	struct ibv_cq *scq = ibv_create_cq(ctx, 64, NULL, NULL, 0);
	struct ibv_cq_init_attr_ex cx = {.cqe = 64, .wc_flags = IBV_WC_STANDARD_FLAGS};
	struct ibv_cq_ex *rcq = ibv_create_cq_ex(ctx, &cx);
	if (!pd || !scq || !rcq)
		DIE("alloc_pd/create_cq");
	/* The requester's completions on scq; the window owner's receives on the
	 * extended CQ, polled through ibv_poll_cq or the extended API. */
	struct ibv_qp *a = create_qp(pd, scq, ibv_cq_ex_to_cq(rcq));
	struct ibv_qp *b = create_qp(pd, scq, ibv_cq_ex_to_cq(rcq));
	connect_qp(ctx, a, b->qp_num, IBV_ACCESS_REMOTE_WRITE);
	connect_qp(ctx, b, a->qp_num, IBV_ACCESS_REMOTE_WRITE);

	char *sbuf = malloc(SIZE), *dbuf = malloc(SIZE);
	if (!sbuf || !dbuf)
		DIE("malloc");
	memset(sbuf, 0x5a, SIZE);
	memset(dbuf, 0, SIZE);
	struct ibv_mr *src = ibv_reg_mr(pd, sbuf, SIZE, IBV_ACCESS_LOCAL_WRITE);
	struct ibv_mr *dst = ibv_reg_mr(pd, dbuf, SIZE, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
								IBV_ACCESS_MW_BIND | IBV_ACCESS_ON_DEMAND);
	if (!src || !dst)
		DIE("reg_mr: %s", strerror(errno));

	/* Type 1, bound with ibv_bind_mw to [4096, 12288) of dst. */
	struct ibv_mw *mw1 = ibv_alloc_mw(pd, IBV_MW_TYPE_1);
	if (!mw1)
		DIE("alloc_mw type 1: %s", strerror(errno));
	uint32_t before = mw1->rkey;
	struct ibv_mw_bind bind = {.wr_id = 1, .send_flags = IBV_SEND_SIGNALED,
				   .bind_info = {.mr = dst, .addr = (uintptr_t)dbuf + 4096, .length = 8192,
						 .mw_access_flags = IBV_ACCESS_REMOTE_WRITE}};
	if (ibv_bind_mw(b, mw1, &bind))
		DIE("bind_mw");
	if (mw1->rkey != ibv_inc_rkey(before))
		DIE("bind_mw: rkey %#x, want %#x", mw1->rkey, ibv_inc_rkey(before));
	expect(scq, 1, IBV_WC_SUCCESS, IBV_WC_BIND_MW);
	write_via(a, src, 8192, dbuf + 4096, mw1->rkey);
	expect(scq, 2, IBV_WC_SUCCESS, IBV_WC_RDMA_WRITE);
	if (dbuf[4096] != 0x5a || dbuf[4096 + 8191] != 0x5a || dbuf[4095] != 0 || dbuf[4096 + 8192] != 0)
		DIE("the WRITE through the window landed elsewhere");
	if (ibv_dereg_mr(dst) != EBUSY)
		DIE("dereg_mr of an MR with a window bound: want EBUSY");

	/* Type 2, bound through ibv_post_send, written through, invalidated by the
	 * peer's SEND with invalidate. */
	struct ibv_mw *mw2 = ibv_alloc_mw(pd, IBV_MW_TYPE_2);
	if (!mw2)
		DIE("alloc_mw type 2: %s", strerror(errno));
	uint32_t rkey2 = ibv_inc_rkey(mw2->rkey);
	struct ibv_send_wr bwr = {.wr_id = 3, .opcode = IBV_WR_BIND_MW, .send_flags = IBV_SEND_SIGNALED,
				  .bind_mw = {.mw = mw2, .rkey = rkey2,
					      .bind_info = {.mr = dst, .addr = (uintptr_t)dbuf, .length = SIZE,
							    .mw_access_flags = IBV_ACCESS_REMOTE_WRITE}}}, *bad;
	if (ibv_post_send(b, &bwr, &bad))
		DIE("post BIND_MW");
	expect(scq, 3, IBV_WC_SUCCESS, IBV_WC_BIND_MW);
	write_via(a, src, 100, dbuf + 3 * 4096, rkey2);
	expect(scq, 2, IBV_WC_SUCCESS, IBV_WC_RDMA_WRITE);
	send_inv(a, b, src, dst, rkey2);
	expect(scq, 8, IBV_WC_SUCCESS, IBV_WC_SEND);
	struct ibv_wc wc = poll_one(ibv_cq_ex_to_cq(rcq));
	if (wc.wr_id != 9 || wc.status != IBV_WC_SUCCESS || wc.opcode != IBV_WC_RECV || wc.byte_len != 64 ||
	    !(wc.wc_flags & IBV_WC_WITH_INV) || (wc.wc_flags & IBV_WC_WITH_IMM) || wc.invalidated_rkey != rkey2)
		DIE("receive of SEND_WITH_INV: %s, flags %#x, rkey %#x (want %#x)", ibv_wc_status_str(wc.status),
		    wc.wc_flags, wc.invalidated_rkey, rkey2);

	/* Bound again with the ibv_wr_* API, invalidated again, read through the
	 * extended CQ. */
	struct ibv_qp_init_attr_ex xinit = {
		.send_cq = scq, .recv_cq = ibv_cq_ex_to_cq(rcq), .qp_type = IBV_QPT_RC, .pd = pd,
		.cap = {.max_send_wr = 16, .max_recv_wr = 16, .max_send_sge = 1, .max_recv_sge = 1},
		.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS,
		.send_ops_flags = IBV_QP_EX_WITH_BIND_MW | IBV_QP_EX_WITH_SEND_WITH_INV | IBV_QP_EX_WITH_LOCAL_INV};
	struct ibv_qp *c = ibv_create_qp_ex(ctx, &xinit);
	struct ibv_qp *d = create_qp(pd, scq, ibv_cq_ex_to_cq(rcq));
	if (!c)
		DIE("create_qp_ex with BIND_MW: %s", strerror(errno));
	connect_qp(ctx, c, d->qp_num, IBV_ACCESS_REMOTE_WRITE);
	connect_qp(ctx, d, c->qp_num, IBV_ACCESS_REMOTE_WRITE);
	struct ibv_qp_ex *cx2 = ibv_qp_to_qp_ex(c);
	uint32_t rkey3 = ibv_inc_rkey(rkey2);
	struct ibv_mw_bind_info info = {.mr = dst, .addr = (uintptr_t)dbuf, .length = 4096,
					.mw_access_flags = IBV_ACCESS_REMOTE_WRITE};
	ibv_wr_start(cx2);
	cx2->wr_id = 4;
	cx2->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_bind_mw(cx2, mw2, rkey3, &info);
	if (ibv_wr_complete(cx2))
		DIE("wr_bind_mw");
	expect(scq, 4, IBV_WC_SUCCESS, IBV_WC_BIND_MW);
	send_inv(d, c, src, dst, rkey3);
	expect(scq, 8, IBV_WC_SUCCESS, IBV_WC_SEND);
	struct ibv_poll_cq_attr pattr = {0};
	int e;
	for (long i = 0; (e = ibv_start_poll(rcq, &pattr)) == ENOENT && i < 200000000; i++)
		;
	if (e)
		DIE("start_poll: %d", e);
	if (rcq->wr_id != 9 || rcq->status != IBV_WC_SUCCESS || !(ibv_wc_read_wc_flags(rcq) & IBV_WC_WITH_INV) ||
	    ibv_wc_read_invalidated_rkey(rcq) != rkey3)
		DIE("extended CQ: %s, flags %#x, rkey %#x (want %#x)", ibv_wc_status_str(rcq->status),
		    ibv_wc_read_wc_flags(rcq), ibv_wc_read_invalidated_rkey(rcq), rkey3);
	ibv_end_poll(rcq);

	/* The window goes, then the MR. */
	if (ibv_dealloc_mw(mw1) || ibv_dealloc_mw(mw2))
		DIE("dealloc_mw");
	if (ibv_dereg_mr(dst) || ibv_dereg_mr(src))
		DIE("dereg_mr after the windows went");
	if (ibv_destroy_qp(a) || ibv_destroy_qp(b) || ibv_destroy_qp(c) || ibv_destroy_qp(d) || ibv_destroy_cq(scq) ||
	    ibv_destroy_cq(ibv_cq_ex_to_cq(rcq)) || ibv_dealloc_pd(pd) || ibv_close_device(ctx))
		DIE("teardown");
	free(sbuf);
	free(dbuf);
	printf("ok\n");
	return 0;
}
