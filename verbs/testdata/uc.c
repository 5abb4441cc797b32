/*
 * Built against the installed rdma-core headers and linked with odpemu's
 * libibverbs.so.1 (verbs_test.go: TestUC): UC QPs as verbs programs use them. Two UC
 * QPs of one context, connected over the device's own GID with the attributes UC
 * takes (RTR without MAX_DEST_RD_ATOMIC and MIN_RNR_TIMER, RTS with only the SQ
 * PSN), exchange over ODP memory the program malloc'ed:
 *   - a SEND of several packets and a WRITE with immediate: each lands whole, the
 *     sender's completions need no acknowledgement;
 *   - a SEND that finds no receive (or one too small) is dropped, completing
 *     nothing, the QP stays in RTS, and the WRITE with immediate after it takes
 *     the receive;
 *   - a READ is refused when posted (EINVAL: UC has no READs).
 * Prints "ok" and exits 0, or says what is wrong and exits 1.
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <infiniband/verbs.h>

#include "pair.h"

enum { SIZE = 64 * 1024 };

static void connect_uc(struct ibv_context *ctx, struct ibv_qp *qp, uint32_t dest)
{
	union ibv_gid gid;
	if (ibv_query_gid(ctx, 1, 0, &gid))
		DIE("query_gid");
	struct ibv_qp_attr init = {.qp_state = IBV_QPS_INIT, .port_num = 1, .qp_access_flags = IBV_ACCESS_REMOTE_WRITE};
	if (ibv_modify_qp(qp, &init, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
		DIE("INIT");
	struct ibv_qp_attr rtr = {.qp_state = IBV_QPS_RTR, .path_mtu = IBV_MTU_4096, .dest_qp_num = dest,
				  .ah_attr = {.is_global = 1, .port_num = 1, .grh = {.dgid = gid, .hop_limit = 64}}};
	if (ibv_modify_qp(qp, &rtr, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN))
		DIE("RTR: %s", strerror(errno));
	struct ibv_qp_attr rts = {.qp_state = IBV_QPS_RTS};
	if (ibv_modify_qp(qp, &rts, IBV_QP_STATE | IBV_QP_SQ_PSN))
		DIE("RTS: %s", strerror(errno));
}

static void post_send(struct ibv_qp *qp, uint64_t id, enum ibv_wr_opcode op, struct ibv_mr *mr, size_t off,
		      size_t len, void *to, uint32_t rkey)
{
	struct ibv_sge sge = {.addr = (uintptr_t)mr->addr + off, .length = (uint32_t)len, .lkey = mr->lkey};
	struct ibv_send_wr wr = {.wr_id = id, .sg_list = &sge, .num_sge = 1, .opcode = op,
				 .send_flags = IBV_SEND_SIGNALED, .imm_data = htobe32(0x77),
				 .wr = {.rdma = {.remote_addr = (uintptr_t)to, .rkey = rkey}}}, *bad;
	if (ibv_post_send(qp, &wr, &bad))
		DIE("post_send %lu", (unsigned long)id);
}

static void post_recv(struct ibv_qp *qp, uint64_t id, struct ibv_mr *mr, size_t off, size_t len)
{
	struct ibv_sge sge = {.addr = (uintptr_t)mr->addr + off, .length = (uint32_t)len, .lkey = mr->lkey};
	struct ibv_recv_wr wr = {.wr_id = id, .sg_list = &sge, .num_sge = 1}, *bad;
	if (ibv_post_recv(qp, &wr, &bad))
		DIE("post_recv");
}

static struct ibv_wc expect(struct ibv_cq *cq, uint64_t id, enum ibv_wc_opcode op)
{
	struct ibv_wc wc = poll_one(cq);
	if (wc.wr_id != id || wc.status != IBV_WC_SUCCESS || wc.opcode != op)
		DIE("completion %lu (%s, opcode %d), want %lu opcode %d", (unsigned long)wc.wr_id,
		    ibv_wc_status_str(wc.status), wc.opcode, (unsigned long)id, op);
	return wc;
}

int main(void)
{
	struct ibv_context *ctx = open_first();
	struct ibv_device_attr_ex dattr;
	if (ibv_query_device_ex(ctx, NULL, &dattr))
		DIE("query_device_ex");
	uint32_t uc = dattr.odp_caps.per_transport_caps.uc_odp_caps;
	if (!(uc & IBV_ODP_SUPPORT_SEND) || !(uc & IBV_ODP_SUPPORT_RECV) || !(uc & IBV_ODP_SUPPORT_WRITE))
		DIE("uc_odp_caps %#x", uc);
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	struct ibv_cq *scq = ibv_create_cq(ctx, 64, NULL, NULL, 0), *rcq = ibv_create_cq(ctx, 64, NULL, NULL, 0);
	if (!pd || !scq || !rcq)
		DIE("alloc_pd/create_cq");
	struct ibv_qp *q[2];
	for (int i = 0; i < 2; i++) {
		struct ibv_qp_init_attr init = {.send_cq = scq, .recv_cq = rcq, .qp_type = IBV_QPT_UC,
						.cap = {.max_send_wr = 64, .max_recv_wr = 64, .max_send_sge = 1,
							.max_recv_sge = 1}};
		if (!(q[i] = ibv_create_qp(pd, &init)))
			DIE("create_qp UC: %s", strerror(errno));
	}
	connect_uc(ctx, q[0], q[1]->qp_num);
	connect_uc(ctx, q[1], q[0]->qp_num);

	char *sbuf = malloc(SIZE), *dbuf = malloc(SIZE);
	if (!sbuf || !dbuf)
		DIE("malloc");
	for (int i = 0; i < SIZE; i++)
		sbuf[i] = (char)(i * 7 + 3);
	memset(dbuf, 0, SIZE);
	int odp = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_ON_DEMAND;
	struct ibv_mr *src = ibv_reg_mr(pd, sbuf, SIZE, odp), *dst = ibv_reg_mr(pd, dbuf, SIZE, odp);
	if (!src || !dst)
		DIE("reg_mr: %s", strerror(errno));

	post_recv(q[1], 10, dst, 0, 20000);
	post_send(q[0], 1, IBV_WR_SEND, src, 0, 20000, NULL, 0);
	expect(scq, 1, IBV_WC_SEND);
	struct ibv_wc wc = expect(rcq, 10, IBV_WC_RECV);
	if (wc.byte_len != 20000 || memcmp(dbuf, sbuf, 20000))
		DIE("SEND: %u bytes", wc.byte_len);
	post_recv(q[1], 11, dst, 0, 0);
	post_send(q[0], 2, IBV_WR_RDMA_WRITE_WITH_IMM, src, 0, 9000, dbuf + 32768, dst->rkey);
	expect(scq, 2, IBV_WC_RDMA_WRITE);
	wc = expect(rcq, 11, IBV_WC_RECV_RDMA_WITH_IMM);
	if (!(wc.wc_flags & IBV_WC_WITH_IMM) || be32toh(wc.imm_data) != 0x77 || memcmp(dbuf + 32768, sbuf, 9000))
		DIE("WRITE with immediate");

	/* No receive, then a zero-length one: the SEND is dropped whichever it finds,
	 * completing nothing; the WRITE with immediate after it takes that receive. */
	post_send(q[0], 3, IBV_WR_SEND, src, 0, 100, NULL, 0);
	expect(scq, 3, IBV_WC_SEND);
	post_recv(q[1], 12, dst, 0, 0);
	post_send(q[0], 5, IBV_WR_RDMA_WRITE_WITH_IMM, src, 0, 8, dbuf + 32768, dst->rkey);
	expect(scq, 5, IBV_WC_RDMA_WRITE);
	expect(rcq, 12, IBV_WC_RECV_RDMA_WITH_IMM);
	struct ibv_qp_attr qa;
	struct ibv_qp_init_attr qi;
	if (ibv_query_qp(q[1], &qa, IBV_QP_STATE, &qi) || qa.qp_state != IBV_QPS_RTS || qi.qp_type != IBV_QPT_UC)
		DIE("query_qp: state %d, type %d", qa.qp_state, qi.qp_type);

	struct ibv_sge sge = {.addr = (uintptr_t)sbuf, .length = 8, .lkey = src->lkey};
	struct ibv_send_wr rd = {.wr_id = 4, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_RDMA_READ,
				 .wr = {.rdma = {.remote_addr = (uintptr_t)dbuf, .rkey = dst->rkey}}}, *bad;
	if (ibv_post_send(q[0], &rd, &bad) != EINVAL || bad != &rd)
		DIE("a READ on UC: want EINVAL");

	if (ibv_destroy_qp(q[0]) || ibv_destroy_qp(q[1]) || ibv_dereg_mr(src) || ibv_dereg_mr(dst) ||
	    ibv_destroy_cq(scq) || ibv_destroy_cq(rcq) || ibv_dealloc_pd(pd) || ibv_close_device(ctx))
		DIE("teardown");
	free(sbuf);
	free(dbuf);
	printf("ok\n");
	return 0;
}
