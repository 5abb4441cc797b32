/*
 * Built against the installed rdma-core headers and linked with odpemu's
 * libibverbs.so.1 (verbs_test.go: TestReregReset): ibv_rereg_mr and the move of a
 * connected QP to RESET, as test_mr.py uses them. Two QPs of one context, connected to
 * each other:
 *   - a change of access or PD keeps the MR's keys, and the responder checks the new
 *     ones (a WRITE without REMOTE_WRITE, or through a QP of the old PD, fails);
 *   - RESET of a connected QP in ERR drops its queued work and its completions still
 *     in the CQ, refuses posts, and the QP connects again through INIT, RTR and RTS;
 *   - a change of translation registers the new memory under new keys;
 *   - what ibv_rereg_mr refuses (bad flag combinations) leaves the MR as it was;
 *   - max_dest_rd_atomic at RTR and max_rd_atomic at RTS beyond the device's
 *     max_qp_rd_atom and max_qp_init_rd_atom are refused with EINVAL, as mlx5 refuses
 *     them, and the QP stays where it was; the device's own limits are accepted.
 * Prints "ok" and exits 0, or says what is wrong and exits 1.
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <infiniband/verbs.h>

#include "pair.h"

enum { SIZE = 4096 };

static struct ibv_context *ctx;
static struct ibv_cq *cq;
static struct ibv_qp *a, *b;

/* write_status WRITEs 64 bytes from src into dst through a and returns the status. */
static enum ibv_wc_status write_status(struct ibv_mr *src, struct ibv_mr *dst, uint32_t rkey)
{
	struct ibv_sge sge = {(uintptr_t)src->addr, 64, src->lkey};
	struct ibv_send_wr wr = {.wr_id = 1, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE,
				 .send_flags = IBV_SEND_SIGNALED},
			   *bad;
	wr.wr.rdma.remote_addr = (uintptr_t)dst->addr;
	wr.wr.rdma.rkey = rkey;
	if (ibv_post_send(a, &wr, &bad))
		DIE("post_send");
	struct ibv_wc wc = poll_one(cq);
	if (wc.wr_id != 1 || wc.qp_num != a->qp_num)
		DIE("completion %llu of QP %u", (unsigned long long)wc.wr_id, wc.qp_num);
	return wc.status;
}

static void reconnect(int access)
{
	struct ibv_qp_attr reset = {.qp_state = IBV_QPS_RESET};
	if (ibv_modify_qp(a, &reset, IBV_QP_STATE) || ibv_modify_qp(b, &reset, IBV_QP_STATE))
		DIE("RESET: %s", strerror(errno));
	if (a->state != IBV_QPS_RESET)
		DIE("state %d after RESET", a->state);
	struct ibv_wc wc;
	int n = ibv_poll_cq(cq, 1, &wc);
	if (n != 0)
		DIE("%d completions left after RESET (wr_id %llu, status %s)", n, (unsigned long long)wc.wr_id,
		    ibv_wc_status_str(wc.status));
	connect_qp(ctx, a, b->qp_num, access);
	connect_qp(ctx, b, a->qp_num, access);
}

int main(void)
{
	ctx = open_first();
	struct ibv_pd *pd = ibv_alloc_pd(ctx), *pd2 = ibv_alloc_pd(ctx);
	cq = ibv_create_cq(ctx, 64, NULL, NULL, 0);
	if (!pd || !pd2 || !cq)
		DIE("alloc");
	a = create_qp(pd, cq, cq);
	b = create_qp(pd, cq, cq);
	const int rw = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
	connect_qp(ctx, a, b->qp_num, rw);
	connect_qp(ctx, b, a->qp_num, rw);
	char *src = aligned_alloc(SIZE, SIZE), *dst = aligned_alloc(SIZE, SIZE), *dst2 = aligned_alloc(SIZE, SIZE);
	memset(src, 0x5a, SIZE);
	memset(dst, 0, SIZE);
	struct ibv_mr *smr = ibv_reg_mr(pd, src, SIZE, IBV_ACCESS_LOCAL_WRITE);
	struct ibv_mr *dmr = ibv_reg_mr(pd, dst, SIZE, rw | IBV_ACCESS_ON_DEMAND);
	if (!smr || !dmr)
		DIE("reg_mr: %s", strerror(errno));
	uint32_t rkey = dmr->rkey, lkey = dmr->lkey;
	if (write_status(smr, dmr, rkey) != IBV_WC_SUCCESS || dst[0] != 0x5a)
		DIE("first WRITE");

	/* Access: REMOTE_WRITE taken away, then given back; the keys stay. */
	if (ibv_rereg_mr(dmr, IBV_REREG_MR_CHANGE_ACCESS, NULL, NULL, 0, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_ON_DEMAND))
		DIE("rereg access: %s", strerror(errno));
	if (dmr->rkey != rkey || dmr->lkey != lkey)
		DIE("keys changed by an access change");
	enum ibv_wc_status st = write_status(smr, dmr, rkey);
	if (st != IBV_WC_REM_ACCESS_ERR)
		DIE("WRITE without REMOTE_WRITE: %s", ibv_wc_status_str(st));
	/* a is in ERR now: a post flushes; RESET drops the flush from the CQ. */
	struct ibv_sge sge = {(uintptr_t)src, 8, smr->lkey};
	struct ibv_recv_wr rwr = {.wr_id = 77, .sg_list = &sge, .num_sge = 1}, *rbad;
	if (ibv_post_recv(b, &rwr, &rbad))
		DIE("post_recv on b");
	reconnect(rw);
	struct ibv_send_wr swr = {.wr_id = 5, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_SEND}, *sbad;
	struct ibv_qp_attr reset = {.qp_state = IBV_QPS_RESET};
	if (ibv_rereg_mr(dmr, IBV_REREG_MR_CHANGE_ACCESS, NULL, NULL, 0, rw | IBV_ACCESS_ON_DEMAND))
		DIE("rereg access back: %s", strerror(errno));
	memset(src, 0x6b, SIZE);
	if ((st = write_status(smr, dmr, rkey)) != IBV_WC_SUCCESS || dst[0] != 0x6b)
		DIE("WRITE after access given back: %s", ibv_wc_status_str(st));

	/* PD: moved to another PD, where a's QP cannot reach it, then back. */
	if (ibv_rereg_mr(dmr, IBV_REREG_MR_CHANGE_PD, pd2, NULL, 0, 0) || dmr->pd != pd2 || dmr->rkey != rkey)
		DIE("rereg pd: %s", strerror(errno));
	if (ibv_dealloc_pd(pd2) != EBUSY)
		DIE("dealloc of the MR's new PD did not fail with EBUSY");
	if ((st = write_status(smr, dmr, rkey)) != IBV_WC_REM_ACCESS_ERR)
		DIE("WRITE into another PD's MR: %s", ibv_wc_status_str(st));
	reconnect(rw);
	if (ibv_rereg_mr(dmr, IBV_REREG_MR_CHANGE_PD, pd, NULL, 0, 0) || dmr->pd != pd)
		DIE("rereg pd back: %s", strerror(errno));
	if ((st = write_status(smr, dmr, rkey)) != IBV_WC_SUCCESS)
		DIE("WRITE after PD given back: %s", ibv_wc_status_str(st));

	/* Translation: other memory, new keys; the old rkey no longer reaches anything. */
	memset(dst2, 0, SIZE);
	if (ibv_rereg_mr(dmr, IBV_REREG_MR_CHANGE_TRANSLATION, NULL, dst2, SIZE, 0))
		DIE("rereg translation: %s", strerror(errno));
	if (dmr->addr != dst2 || dmr->length != SIZE || dmr->rkey != dmr->lkey)
		DIE("MR after a translation change: %p %zu", dmr->addr, dmr->length);
	memset(src, 0x7c, SIZE);
	if ((st = write_status(smr, dmr, dmr->rkey)) != IBV_WC_SUCCESS || dst2[0] != 0x7c)
		DIE("WRITE into the new memory: %s", ibv_wc_status_str(st));
	if (dmr->rkey != rkey && (st = write_status(smr, dmr, rkey)) != IBV_WC_REM_ACCESS_ERR)
		DIE("WRITE with the old rkey: %s", ibv_wc_status_str(st));
	reconnect(rw);

	/* Refused: flags outside the set, translation without memory, access without its flag. */
	errno = 0;
	if (ibv_rereg_mr(dmr, 1 << 5, NULL, NULL, 0, 0) != IBV_REREG_MR_ERR_INPUT || errno != EINVAL)
		DIE("unknown flag accepted");
	if (ibv_rereg_mr(dmr, IBV_REREG_MR_CHANGE_TRANSLATION, NULL, NULL, SIZE, 0) != IBV_REREG_MR_ERR_INPUT)
		DIE("translation without an address accepted");
	if (ibv_rereg_mr(dmr, IBV_REREG_MR_CHANGE_PD, NULL, NULL, 0, IBV_ACCESS_LOCAL_WRITE) != IBV_REREG_MR_ERR_INPUT)
		DIE("access without CHANGE_ACCESS accepted");
	if (ibv_rereg_mr(dmr, IBV_REREG_MR_CHANGE_ACCESS, NULL, NULL, 0, IBV_ACCESS_REMOTE_WRITE) != IBV_REREG_MR_ERR_CMD)
		DIE("REMOTE_WRITE without LOCAL_WRITE accepted");
	if ((st = write_status(smr, dmr, dmr->rkey)) != IBV_WC_SUCCESS)
		DIE("WRITE after refused reregs: %s", ibv_wc_status_str(st));

	/* READs and atomics outstanding: beyond the device's limits, refused. */
	struct ibv_device_attr da;
	if (ibv_query_device(ctx, &da))
		DIE("query_device");
	if (ibv_modify_qp(a, &reset, IBV_QP_STATE) || ibv_modify_qp(b, &reset, IBV_QP_STATE))
		DIE("RESET: %s", strerror(errno));
	connect_qp(ctx, b, a->qp_num, rw);
	union ibv_gid gid;
	if (ibv_query_gid(ctx, 1, 0, &gid))
		DIE("query_gid");
	struct ibv_qp_attr init = {.qp_state = IBV_QPS_INIT, .port_num = 1, .qp_access_flags = rw};
	if (ibv_modify_qp(a, &init, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
		DIE("INIT");
	struct ibv_qp_attr rtr = {.qp_state = IBV_QPS_RTR, .path_mtu = IBV_MTU_4096, .dest_qp_num = b->qp_num,
				  .max_dest_rd_atomic = da.max_qp_rd_atom + 1, .min_rnr_timer = 1,
				  .ah_attr = {.is_global = 1, .port_num = 1, .grh = {.dgid = gid, .hop_limit = 64}}};
	const int rtr_mask = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
			     IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
	if (ibv_modify_qp(a, &rtr, rtr_mask) != EINVAL || a->state != IBV_QPS_INIT)
		DIE("RTR with max_dest_rd_atomic %d (max_qp_rd_atom %d) not refused", rtr.max_dest_rd_atomic,
		    da.max_qp_rd_atom);
	rtr.max_dest_rd_atomic = da.max_qp_rd_atom;
	if (ibv_modify_qp(a, &rtr, rtr_mask))
		DIE("RTR with max_dest_rd_atomic %d: %s", rtr.max_dest_rd_atomic, strerror(errno));
	struct ibv_qp_attr rts = {.qp_state = IBV_QPS_RTS, .timeout = 14, .retry_cnt = 7, .rnr_retry = 7,
				  .max_rd_atomic = da.max_qp_init_rd_atom + 1};
	const int rts_mask = IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
			     IBV_QP_MAX_QP_RD_ATOMIC;
	if (ibv_modify_qp(a, &rts, rts_mask) != EINVAL || a->state != IBV_QPS_RTR)
		DIE("RTS with max_rd_atomic %d (max_qp_init_rd_atom %d) not refused", rts.max_rd_atomic,
		    da.max_qp_init_rd_atom);
	rts.max_rd_atomic = da.max_qp_init_rd_atom;
	if (ibv_modify_qp(a, &rts, rts_mask))
		DIE("RTS with max_rd_atomic %d: %s", rts.max_rd_atomic, strerror(errno));
	if ((st = write_status(smr, dmr, dmr->rkey)) != IBV_WC_SUCCESS)
		DIE("WRITE after connecting with the device's limits: %s", ibv_wc_status_str(st));

	/* RESET refuses posts until the QP is connected again, and leaves no attribute. */
	if (ibv_modify_qp(a, &reset, IBV_QP_STATE))
		DIE("RESET of a connected QP: %s", strerror(errno));
	if (ibv_post_send(a, &swr, &sbad) == 0)
		DIE("post_send in RESET accepted");
	struct ibv_qp_attr qa;
	struct ibv_qp_init_attr qi;
	if (ibv_query_qp(a, &qa, IBV_QP_STATE | IBV_QP_DEST_QPN, &qi) || qa.qp_state != IBV_QPS_RESET ||
	    qa.dest_qp_num != 0 || qa.qp_access_flags != 0)
		DIE("query_qp after RESET: state %d, dest QP %u, access %#x", qa.qp_state, qa.dest_qp_num,
		    qa.qp_access_flags);

	if (ibv_destroy_qp(a) || ibv_destroy_qp(b) || ibv_dereg_mr(dmr) || ibv_dereg_mr(smr) || ibv_dealloc_pd(pd2) ||
	    ibv_destroy_cq(cq) || ibv_dealloc_pd(pd) || ibv_close_device(ctx))
		DIE("teardown");
	free(src), free(dst), free(dst2);
	printf("ok\n");
	return 0;
}
