/*
 * Built against the installed rdma-core headers and linked with odpemu's
 * libibverbs.so.1 (verbs_test.go: TestWR): the ibv_wr_* API of a QP created with
 * ibv_create_qp_ex, and ibv_post_send chains longer than one call to the emulator.
 *   - a batch of every operation (but memory windows': mw.c), one ibv_wr_complete,
 *     each with its own effect;
 *   - inline data copied when it is set: the application's buffer reused at once;
 *   - a batch that fails while it is built (too many requests, a setter before any
 *     request, an operation the QP cannot do) posts nothing;
 *   - a chain of 100 WRs with a bad one at 70: bad_wr names it, the 70 before it run.
 * Prints "ok" and exits 0, or says what is wrong and exits 1.
 */
#include <endian.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <infiniband/verbs.h>

#include "pair.h"

enum { SQ = 128 };

static struct ibv_context *ctx;
static struct ibv_cq *cq;

/* wait takes n completions from cq, checking they succeeded, and returns the last. */
static struct ibv_wc wait_n(int n)
{
	struct ibv_wc wc = {0};
	for (int got = 0; got < n;) {
		int k = ibv_poll_cq(cq, 1, &wc);
		if (k < 0)
			DIE("poll_cq");
		if (k == 1 && wc.status != IBV_WC_SUCCESS)
			DIE("completion %lu: %s", (unsigned long)wc.wr_id, ibv_wc_status_str(wc.status));
		got += k;
	}
	return wc;
}

/* empty checks that no completion is queued after a round trip of one WRITE. */
static void empty(struct ibv_qp_ex *qx, struct ibv_mr *mr, char *buf)
{
	ibv_wr_start(qx);
	qx->wr_id = 999;
	qx->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_rdma_write(qx, mr->rkey, (uintptr_t)buf + 8192);
	ibv_wr_set_sge(qx, mr->lkey, (uintptr_t)buf, 8);
	if (ibv_wr_complete(qx))
		DIE("a WRITE after a failed batch");
	struct ibv_wc wc = wait_n(1);
	if (wc.wr_id != 999)
		DIE("a failed batch posted request %lu", (unsigned long)wc.wr_id);
}

int main(void)
{
	ctx = open_first();
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	cq = ibv_create_cq(ctx, 4 * SQ, NULL, NULL, 0);
	char *buf = aligned_alloc(4096, 4 * 4096);
	memset(buf, 0, 4 * 4096);
	int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
	struct ibv_mr *mr = ibv_reg_mr(pd, buf, 4 * 4096, access);
	if (!pd || !cq || !mr)
		DIE("setup: %s", strerror(errno));

	uint64_t ops = IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM | IBV_QP_EX_WITH_SEND |
		       IBV_QP_EX_WITH_SEND_WITH_IMM | IBV_QP_EX_WITH_RDMA_READ | IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP |
		       IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD | IBV_QP_EX_WITH_ATOMIC_WRITE;
	struct ibv_qp_init_attr_ex attr = {.send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
					   .cap = {.max_send_wr = SQ, .max_recv_wr = SQ, .max_send_sge = 2,
						   .max_recv_sge = 1, .max_inline_data = 64},
					   .comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS,
					   .pd = pd, .send_ops_flags = IBV_QP_EX_WITH_TSO};
	if (ibv_create_qp_ex(ctx, &attr) || errno != EOPNOTSUPP)
		DIE("an RC QP that sends TSO is EOPNOTSUPP");
	attr.send_ops_flags = ops;
	struct ibv_qp *a = ibv_create_qp_ex(ctx, &attr);
	struct ibv_qp *b = create_qp(pd, cq, cq);
	if (!a)
		DIE("create_qp_ex: %s", strerror(errno));
	if (ibv_qp_to_qp_ex(b) != NULL)
		DIE("a QP created without send_ops_flags has no ibv_qp_ex");
	struct ibv_qp_ex *qx = ibv_qp_to_qp_ex(a);
	if (!qx)
		DIE("qp_to_qp_ex");
	connect_qp(ctx, a, b->qp_num, access);
	connect_qp(ctx, b, a->qp_num, access);

	/* Page 0: a's source; page 1: b's SEND targets; page 2: WRITE and READ targets;
	 * page 3: atomics (8-byte words). */
	char *src = buf, *recv = buf + 4096, *dst = buf + 8192;
	uint64_t *words = (uint64_t *)(buf + 3 * 4096);
	for (int i = 0; i < 64; i++)
		src[i] = (char)('A' + i % 26);
	words[0] = 5;
	words[1] = 100;
	/* Receives are taken in order: the WRITE with immediate's, then the two SENDs'. */
	struct ibv_recv_wr imm_rwr = {.wr_id = 102}, *bad_rwr;
	if (ibv_post_recv(b, &imm_rwr, &bad_rwr))
		DIE("post_recv");
	for (int i = 0; i < 2; i++) {
		struct ibv_sge sge = {(uintptr_t)recv + i * 64, 64, mr->lkey};
		struct ibv_recv_wr rwr = {.wr_id = 100 + i, .sg_list = &sge, .num_sge = 1};
		if (ibv_post_recv(b, &rwr, &bad_rwr))
			DIE("post_recv");
	}

	char inl[16];
	ibv_wr_start(qx);
	qx->wr_flags = IBV_SEND_SIGNALED;
	qx->wr_id = 1;
	ibv_wr_rdma_write(qx, mr->rkey, (uintptr_t)dst);
	struct ibv_sge two[2] = {{(uintptr_t)src, 8, mr->lkey}, {(uintptr_t)src + 16, 8, mr->lkey}};
	ibv_wr_set_sge_list(qx, 2, two);
	qx->wr_id = 2;
	ibv_wr_rdma_write_imm(qx, mr->rkey, (uintptr_t)dst + 64, htobe32(0x1234));
	ibv_wr_set_sge(qx, mr->lkey, (uintptr_t)src, 4);
	qx->wr_id = 3;
	ibv_wr_send(qx);
	memcpy(inl, "inline-data-0123", 16);
	ibv_wr_set_inline_data(qx, inl, 16);
	memset(inl, 'X', sizeof inl); /* the request has its copy */
	qx->wr_id = 4;
	ibv_wr_send_imm(qx, htobe32(0xabcd));
	struct ibv_data_buf parts[2] = {{src, 3}, {src + 10, 3}};
	ibv_wr_set_inline_data_list(qx, 2, parts);
	qx->wr_id = 5;
	ibv_wr_rdma_read(qx, mr->rkey, (uintptr_t)src + 32);
	ibv_wr_set_sge(qx, mr->lkey, (uintptr_t)dst + 128, 8);
	qx->wr_id = 6;
	ibv_wr_atomic_cmp_swp(qx, mr->rkey, (uintptr_t)&words[0], 5, 7);
	ibv_wr_set_sge(qx, mr->lkey, (uintptr_t)&words[2], 8);
	qx->wr_id = 7;
	ibv_wr_atomic_fetch_add(qx, mr->rkey, (uintptr_t)&words[1], 11);
	ibv_wr_set_sge(qx, mr->lkey, (uintptr_t)&words[3], 8);
	qx->wr_id = 8;
	uint64_t stored = 0x1122334455667788;
	ibv_wr_atomic_write(qx, mr->rkey, (uintptr_t)&words[4], &stored);
	stored = 0; /* the request has its copy */
	int e = ibv_wr_complete(qx);
	if (e)
		DIE("wr_complete: %s", strerror(e));
	wait_n(8 + 3); /* eight sends, three receives */
	if (words[4] != 0x1122334455667788)
		DIE("atomic write: %#lx", (unsigned long)words[4]);
	/* And through ibv_post_send, the 8 bytes in the SGL. */
	words[5] = 42;
	struct ibv_sge aw_sge = {(uintptr_t)&words[5], 8, mr->lkey};
	struct ibv_send_wr aw = {.wr_id = 9, .sg_list = &aw_sge, .num_sge = 1, .opcode = IBV_WR_ATOMIC_WRITE,
				 .send_flags = IBV_SEND_SIGNALED,
				 .wr = {.rdma = {.remote_addr = (uintptr_t)&words[6], .rkey = mr->rkey}}}, *aw_bad;
	if (ibv_post_send(a, &aw, &aw_bad))
		DIE("post ATOMIC_WRITE");
	struct ibv_wc awc = wait_n(1);
	if (awc.wr_id != 9 || awc.opcode != IBV_WC_ATOMIC_WRITE || words[6] != 42)
		DIE("ATOMIC_WRITE through ibv_post_send: opcode %d, word %lu", awc.opcode, (unsigned long)words[6]);
	if (memcmp(dst, src, 8) || memcmp(dst + 8, src + 16, 8))
		DIE("WRITE with two SGEs");
	if (memcmp(dst + 64, src, 4))
		DIE("WRITE with immediate");
	if (memcmp(recv, "inline-data-0123", 16))
		DIE("SEND of inline data: %.16s", recv);
	if (memcmp(recv + 64, "ABCKLM", 6))
		DIE("SEND of an inline data list: %.6s", recv + 64);
	if (memcmp(dst + 128, src + 32, 8))
		DIE("READ");
	if (words[0] != 7 || words[2] != 5 || words[1] != 111 || words[3] != 100)
		DIE("atomics: %lu %lu %lu %lu", (unsigned long)words[0], (unsigned long)words[1], (unsigned long)words[2],
		    (unsigned long)words[3]);

	/* Batches that fail while built post nothing. */
	ibv_wr_start(qx);
	for (int i = 0; i <= SQ; i++) {
		qx->wr_id = 500 + i;
		ibv_wr_rdma_write(qx, mr->rkey, (uintptr_t)dst);
		ibv_wr_set_sge(qx, mr->lkey, (uintptr_t)src, 8);
	}
	if ((e = ibv_wr_complete(qx)) != ENOMEM)
		DIE("a batch longer than the send queue: %d", e);
	empty(qx, mr, buf);
	ibv_wr_start(qx);
	ibv_wr_set_sge(qx, mr->lkey, (uintptr_t)src, 8);
	if ((e = ibv_wr_complete(qx)) != EINVAL)
		DIE("an SGE before any request: %d", e);
	ibv_wr_start(qx);
	qx->wr_id = 600;
	ibv_wr_rdma_write(qx, mr->rkey, (uintptr_t)dst);
	ibv_wr_set_sge(qx, mr->lkey, (uintptr_t)src, 8);
	ibv_wr_send_tso(qx, src, 8, 64);
	if ((e = ibv_wr_complete(qx)) != EOPNOTSUPP)
		DIE("TSO on an RC QP: %d", e);
	ibv_wr_start(qx);
	qx->wr_id = 601;
	ibv_wr_send(qx);
	ibv_wr_set_inline_data(qx, src, 65);
	if ((e = ibv_wr_complete(qx)) != EINVAL)
		DIE("inline data beyond max_inline_data: %d", e);
	ibv_wr_start(qx);
	qx->wr_id = 602;
	ibv_wr_rdma_write(qx, mr->rkey, (uintptr_t)dst);
	ibv_wr_abort(qx);
	empty(qx, mr, buf);

	/* A chain of 100, the 71st malformed: the 70 before it are posted. */
	struct ibv_send_wr chain[100], *bad = NULL;
	struct ibv_sge sge = {(uintptr_t)src, 8, mr->lkey};
	for (int i = 0; i < 100; i++) {
		chain[i] = (struct ibv_send_wr){.wr_id = 1000 + i, .next = i < 99 ? &chain[i + 1] : NULL,
						.sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE,
						.send_flags = IBV_SEND_SIGNALED};
		chain[i].wr.rdma.remote_addr = (uintptr_t)dst;
		chain[i].wr.rdma.rkey = mr->rkey;
	}
	chain[70].num_sge = 3; /* more than max_send_sge */
	if (ibv_post_send(a, chain, &bad) != EINVAL || bad != &chain[70])
		DIE("a chain with a bad WR: bad_wr %ld", bad ? (long)(bad - chain) : -1L);
	struct ibv_wc wc = wait_n(70);
	if (wc.wr_id != 1069)
		DIE("the chain's last completion is of %lu", (unsigned long)wc.wr_id);
	empty(qx, mr, buf);

	if (ibv_destroy_qp(a) || ibv_destroy_qp(b) || ibv_dereg_mr(mr) || ibv_destroy_cq(cq) || ibv_dealloc_pd(pd) ||
	    ibv_close_device(ctx))
		DIE("teardown");
	free(buf);
	printf("ok\n");
	return 0;
}
