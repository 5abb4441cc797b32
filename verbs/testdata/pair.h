/*
 * What the C tests of verbs_test.go share: two RC QPs of one context connected to
 * each other over the device's own GID, as rdma-core's tests connect theirs.
 */
#ifndef ODPEMU_TEST_PAIR_H
#define ODPEMU_TEST_PAIR_H

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <infiniband/verbs.h>

#define DIE(...)                                      \
	do {                                          \
		fprintf(stderr, "FAIL: " __VA_ARGS__); \
		fprintf(stderr, "\n");                \
		exit(1);                              \
	} while (0)

/* open_first opens the first device (odpemu's) and frees the device list. */
static inline struct ibv_context *open_first(void)
{
	struct ibv_device **list = ibv_get_device_list(NULL);
	struct ibv_context *ctx;
	if (!list || !list[0] || !(ctx = ibv_open_device(list[0])))
		DIE("open_device");
	ibv_free_device_list(list);
	return ctx;
}

/* connect_qp moves qp through INIT, RTR and RTS, connected to the QP dest of the same
 * context; its responder accepts what access allows. */
static inline void connect_qp(struct ibv_context *ctx, struct ibv_qp *qp, uint32_t dest, int access)
{
	union ibv_gid gid;
	if (ibv_query_gid(ctx, 1, 0, &gid))
		DIE("query_gid");
	struct ibv_qp_attr init = {.qp_state = IBV_QPS_INIT, .port_num = 1, .qp_access_flags = access};
	if (ibv_modify_qp(qp, &init, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
		DIE("INIT");
	struct ibv_qp_attr rtr = {.qp_state = IBV_QPS_RTR, .path_mtu = IBV_MTU_4096, .dest_qp_num = dest,
				  .max_dest_rd_atomic = 1, .min_rnr_timer = 1,
				  .ah_attr = {.is_global = 1, .port_num = 1, .grh = {.dgid = gid, .hop_limit = 64}}};
	if (ibv_modify_qp(qp, &rtr, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
					     IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
		DIE("RTR");
	struct ibv_qp_attr rts = {.qp_state = IBV_QPS_RTS, .timeout = 14, .retry_cnt = 7, .rnr_retry = 7,
				  .max_rd_atomic = 1};
	if (ibv_modify_qp(qp, &rts, IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
					     IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC))
		DIE("RTS");
}

/* poll_one polls cq until it returns one completion. */
static inline struct ibv_wc poll_one(struct ibv_cq *cq)
{
	struct ibv_wc wc;
	for (long i = 0; i < 200000000; i++) {
		int n = ibv_poll_cq(cq, 1, &wc);
		if (n < 0)
			DIE("poll_cq: %d", n);
		if (n == 1)
			return wc;
	}
	DIE("no completion");
}

/* create_qp creates an RC QP on pd with 256 WRs of one SGE each way. */
static inline struct ibv_qp *create_qp(struct ibv_pd *pd, struct ibv_cq *scq, struct ibv_cq *rcq)
{
	struct ibv_qp_init_attr init = {.send_cq = scq, .recv_cq = rcq, .qp_type = IBV_QPT_RC,
					.cap = {.max_send_wr = 256, .max_recv_wr = 256, .max_send_sge = 1,
						.max_recv_sge = 1}};
	struct ibv_qp *qp = ibv_create_qp(pd, &init);
	if (!qp)
		DIE("create_qp: %s", strerror(errno));
	return qp;
}

#endif
