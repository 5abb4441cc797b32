/*
 * Built against the installed rdma-core headers and linked with odpemu's
 * libibverbs.so.1 (verbs_test.go): what verbs.h's inline functions and rdma-core's
 * providers reach into, as a program compiled against those headers reaches it.
 * Prints "ok" and exits 0, or says what is wrong and exits 1.
 */
#include <errno.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <infiniband/verbs.h>

static int failed;

#define CHECK(cond, ...)                                  \
	do {                                              \
		if (!(cond)) {                            \
			fprintf(stderr, "FAIL %s: ", #cond); \
			fprintf(stderr, __VA_ARGS__);     \
			fprintf(stderr, "\n");            \
			failed = 1;                       \
		}                                         \
	} while (0)

/* rdma-core's struct verbs_device (driver.h) begins so. */
struct verbs_device_prefix {
	struct ibv_device device;
	const void *ops;
};

/* objects checks MRs, CQs and a QP's life before it connects. */
static void objects(struct ibv_context *ctx, struct ibv_pd *pd)
{
	size_t len = 3 * 4096;
	char *buf = aligned_alloc(4096, len);
	/* perftest asks for relaxed ordering: an optional flag, ignored */
	struct ibv_mr *mr = ibv_reg_mr(pd, buf, len, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_RELAXED_ORDERING);
	CHECK(mr && mr->addr == buf && mr->length == len && mr->lkey == mr->rkey && mr->pd == pd, "reg_mr: %s",
	      strerror(errno));
	CHECK(ibv_reg_mr_iova2(pd, buf, len, 0, IBV_ACCESS_LOCAL_WRITE) == NULL && errno == EOPNOTSUPP,
	      "a zero-based MR is EOPNOTSUPP");
	CHECK(ibv_dealloc_pd(pd) == EBUSY, "a PD with an MR is busy");
	CHECK(ibv_reg_mr(pd, buf, SIZE_MAX, IBV_ACCESS_LOCAL_WRITE) == NULL && errno == EINVAL,
	      "an MR longer than the address space is EINVAL");
	CHECK(ibv_advise_mr(pd, IBV_ADVISE_MR_ADVICE_PREFETCH, IB_UVERBS_ADVISE_MR_FLAG_FLUSH, NULL, 0) == EINVAL,
	      "advise_mr of no SGE is EINVAL");

	/* ODP over the application's own memory: the NIC faults pages in on demand,
	 * and ibv_advise_mr prefetches them. */
	char *odpbuf = aligned_alloc(4096, len);
	struct ibv_mr *odp = ibv_reg_mr(pd, odpbuf + 100, len - 200, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_ON_DEMAND);
	CHECK(odp != NULL, "ODP reg_mr of malloc'd memory: %s", strerror(errno));
	if (odp) {
		struct ibv_sge s = {.addr = (uintptr_t)odpbuf + 100, .length = 4096, .lkey = odp->lkey};
		CHECK(ibv_advise_mr(pd, IBV_ADVISE_MR_ADVICE_PREFETCH_WRITE, IB_UVERBS_ADVISE_MR_FLAG_FLUSH, &s, 1) == 0,
		      "advise_mr prefetch");
		CHECK(ibv_dereg_mr(odp) == 0, "dereg of the ODP MR");
	}
	free(odpbuf);

	struct ibv_comp_channel *ch = ibv_create_comp_channel(ctx);
	CHECK(ch && ch->fd >= 0, "create_comp_channel: %s", strerror(errno));
	struct ibv_cq *cq = ibv_create_cq(ctx, 16, NULL, ch, 0);
	CHECK(cq && cq->cqe >= 16 && cq->channel == ch, "create_cq: %s", strerror(errno));
	CHECK(ibv_destroy_comp_channel(ch) == EBUSY, "a channel with a CQ is busy");
	CHECK(cq && ibv_req_notify_cq(cq, 0) == 0, "req_notify_cq");
	CHECK(ibv_create_cq(ctx, 0, NULL, NULL, 0) == NULL && errno == EINVAL, "a CQ of no entries");
	struct ibv_wc wc;
	CHECK(cq && ibv_poll_cq(cq, 1, &wc) == 0, "an empty CQ polls nothing");

	struct ibv_qp_init_attr init = {.send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
					.cap = {.max_send_wr = 4, .max_recv_wr = 8, .max_send_sge = 1, .max_recv_sge = 2}};
	struct ibv_qp *qp = cq ? ibv_create_qp(pd, &init) : NULL;
	CHECK(qp && qp->state == IBV_QPS_RESET && qp->qp_num != 0, "create_qp: %s", strerror(errno));
	CHECK(init.cap.max_send_wr >= 4 && init.cap.max_recv_wr >= 8 && init.cap.max_recv_sge >= 2, "granted caps");
	struct ibv_qp_init_attr raw = init;
	raw.qp_type = IBV_QPT_RAW_PACKET;
	CHECK(ibv_create_qp(pd, &raw) == NULL && errno == EOPNOTSUPP, "a raw packet QP is EOPNOTSUPP");
	struct ibv_qp_init_attr ud = init;
	ud.qp_type = IBV_QPT_UD;
	struct ibv_qp *udqp = ibv_create_qp(pd, &ud);
	CHECK(udqp && udqp->qp_type == IBV_QPT_UD, "create a UD QP: %s", strerror(errno));
	if (udqp) {
		struct ibv_qp_attr a = {.qp_state = IBV_QPS_INIT, .port_num = 1};
		CHECK(ibv_modify_qp(udqp, &a, IBV_QP_STATE | IBV_QP_PORT | IBV_QP_PKEY_INDEX) == EINVAL,
		      "a UD QP's INIT needs its Q_Key");
		CHECK(ibv_destroy_qp(udqp) == 0, "destroy the UD QP");
	}
	if (qp) {
		struct ibv_qp_attr a = {.qp_state = IBV_QPS_INIT, .port_num = 1};
		CHECK(ibv_modify_qp(qp, &a, IBV_QP_STATE) == EINVAL, "INIT needs port, P_Key and access flags");
		CHECK(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS) == 0 &&
			      qp->state == IBV_QPS_INIT,
		      "to INIT");
		struct ibv_qp_attr rtr = {.qp_state = IBV_QPS_RTR, .path_mtu = IBV_MTU_1024, .dest_qp_num = 1,
					  .ah_attr = {.is_global = 0, .port_num = 1}};
		int rtr_mask = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
			       IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
		CHECK(ibv_modify_qp(qp, &rtr, rtr_mask) == EINVAL && qp->state == IBV_QPS_INIT,
		      "RTR without a GRH is EINVAL on RoCE");
		struct ibv_sge sge = {.addr = (uintptr_t)buf, .length = 64, .lkey = mr ? mr->lkey : 0};
		struct ibv_send_wr wr = {.wr_id = 1, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_SEND}, *bad = NULL;
		CHECK(ibv_post_send(qp, &wr, &bad) != 0 && bad == &wr, "a send in INIT fails at its WR");
		struct ibv_recv_wr rwr = {.wr_id = 2, .sg_list = &sge, .num_sge = 1}, *rbad = NULL;
		CHECK(ibv_post_recv(qp, &rwr, &rbad) == 0, "a receive in INIT is posted");
		struct ibv_qp_attr q;
		struct ibv_qp_init_attr qi;
		CHECK(ibv_query_qp(qp, &q, IBV_QP_STATE | IBV_QP_CAP, &qi) == 0 && q.qp_state == IBV_QPS_INIT &&
			      qi.cap.max_send_wr == init.cap.max_send_wr && qi.send_cq == cq,
		      "query_qp");
		CHECK(ibv_destroy_cq(cq) == EBUSY, "a CQ with a QP is busy");
		CHECK(ibv_destroy_qp(qp) == 0, "destroy_qp");
	}
	if (cq)
		CHECK(ibv_destroy_cq(cq) == 0, "destroy_cq");
	if (ch)
		CHECK(ibv_destroy_comp_channel(ch) == 0, "destroy_comp_channel");
	if (mr)
		CHECK(ibv_dereg_mr(mr) == 0, "dereg_mr");
	free(buf);
}

int main(void)
{
	int n = 0;
	struct ibv_device **list = ibv_get_device_list(&n);
	CHECK(list && n == 1 && list[1] == NULL, "device list of %d", n);
	if (!list || n < 1)
		return 1;
	CHECK(strcmp(ibv_get_device_name(list[0]), "odpemu0") == 0, "name %s", ibv_get_device_name(list[0]));
	CHECK(((struct verbs_device_prefix *)list[0])->ops == NULL, "a provider's ops pointer after ibv_device");

	struct ibv_context *ctx = ibv_open_device(list[0]);
	CHECK(ctx != NULL, "open: %s", strerror(errno));
	if (!ctx)
		return 1;
	struct verbs_context *vctx = verbs_get_ctx(ctx);
	CHECK(vctx != NULL, "verbs_get_ctx: abi_compat %p", ctx->abi_compat);
	CHECK(vctx && vctx->sz == sizeof(struct verbs_context), "sz %zu, want %zu", vctx ? vctx->sz : 0,
	      sizeof(struct verbs_context));
	CHECK(ctx->device == list[0], "context's device");

	struct ibv_device_attr_ex ex;
	memset(&ex, 0xa5, sizeof ex);
	int e = ibv_query_device_ex(ctx, NULL, &ex);
	CHECK(e == 0, "query_device_ex: %d", e);
	CHECK((ex.odp_caps.general_caps & (IBV_ODP_SUPPORT | IBV_ODP_SUPPORT_IMPLICIT)) ==
		      (IBV_ODP_SUPPORT | IBV_ODP_SUPPORT_IMPLICIT), "general ODP caps %#llx",
	      (unsigned long long)ex.odp_caps.general_caps);
	uint32_t rc = IBV_ODP_SUPPORT_SEND | IBV_ODP_SUPPORT_RECV | IBV_ODP_SUPPORT_WRITE | IBV_ODP_SUPPORT_READ;
	CHECK((ex.odp_caps.per_transport_caps.rc_odp_caps & rc) == rc, "RC ODP caps %#x",
	      ex.odp_caps.per_transport_caps.rc_odp_caps);
	CHECK(ex.orig_attr.vendor_id == 0xffffff && ex.orig_attr.phys_port_cnt == 1, "vendor %#x ports %d",
	      ex.orig_attr.vendor_id, ex.orig_attr.phys_port_cnt);
	CHECK(ex.completion_timestamp_mask == 0 && ex.max_dm_size == 0, "the rest of the struct is zeroed");

	struct ibv_device_attr a;
	CHECK(ibv_query_device(ctx, &a) == 0 && a.max_qp_wr > 0, "query_device");
	CHECK(memcmp(&a, &ex.orig_attr, sizeof a) == 0, "query_device and query_device_ex agree");

	struct ibv_port_attr p; /* the macro: verbs_context's query_port op */
	memset(&p, 0xa5, sizeof p);
	CHECK(ibv_query_port(ctx, 1, &p) == 0, "query_port 1");
	CHECK(p.state == IBV_PORT_ACTIVE && p.link_layer == IBV_LINK_LAYER_ETHERNET && p.active_mtu == IBV_MTU_4096,
	      "port state %d link layer %d mtu %d", p.state, p.link_layer, p.active_mtu);
	CHECK(p.port_cap_flags2 == 0, "port_cap_flags2 %#x", p.port_cap_flags2);
	CHECK(ibv_query_port(ctx, 2, &p) == EINVAL, "query_port 2 is EINVAL");

	union ibv_gid gid;
	CHECK(ibv_query_gid(ctx, 1, 0, &gid) == 0, "query_gid 0");
	static const uint8_t mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
	CHECK(memcmp(gid.raw, mapped, 12) == 0, "GID 0 is IPv4-mapped");
	struct ibv_gid_entry ge;
	CHECK(ibv_query_gid_ex(ctx, 1, 0, &ge, 0) == 0 && ge.gid_type == IBV_GID_TYPE_ROCE_V2 &&
		      memcmp(&ge.gid, &gid, sizeof gid) == 0,
	      "query_gid_ex 0: RoCE v2, the same GID");
	CHECK(ibv_query_gid_ex(ctx, 1, 1, &ge, 0) == ENODATA, "an empty GID entry is ENODATA");

	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	CHECK(pd && pd->context == ctx, "alloc_pd: %s", strerror(errno));
	if (pd) {
		objects(ctx, pd);
		/* Implicit ODP: NULL, SIZE_MAX, ON_DEMAND, and nothing else at NULL. */
		struct ibv_mr *imr = ibv_reg_mr(pd, NULL, SIZE_MAX, IBV_ACCESS_ON_DEMAND | IBV_ACCESS_LOCAL_WRITE);
		CHECK(imr && imr->addr == NULL && imr->length == SIZE_MAX && imr->lkey == imr->rkey,
		      "implicit ODP MR: %s", strerror(errno));
		CHECK(!imr || ibv_dereg_mr(imr) == 0, "dereg of the implicit MR");
		CHECK(ibv_reg_mr(pd, NULL, 4096, IBV_ACCESS_ON_DEMAND) == NULL && errno == EINVAL,
		      "an MR at NULL that is not implicit ODP");
		CHECK(ibv_reg_mr(pd, NULL, SIZE_MAX, IBV_ACCESS_LOCAL_WRITE) == NULL && errno == EINVAL,
		      "implicit without ON_DEMAND");
		CHECK(ibv_dealloc_pd(pd) == 0, "dealloc_pd");
	}
	CHECK(ibv_import_pd(NULL, 0) == NULL && errno == EOPNOTSUPP, "a stub returning a pointer");
	/* A forked child has no emulator: its verbs fail with ENODEV, and nothing hangs. */
	pid_t child = fork();
	if (child == 0) {
		struct ibv_pd *p = ibv_alloc_pd(ctx);
		int ok = p == NULL && errno == ENODEV;
		ok = ok && ibv_open_device(list[0]) == NULL && errno == ENODEV;
		_exit(ok ? 0 : 1);
	}
	int status = 0;
	CHECK(child > 0 && waitpid(child, &status, 0) == child && WIFEXITED(status) && WEXITSTATUS(status) == 0,
	      "verbs in a forked child fail with ENODEV (status %#x)", status);
	struct ibv_pd *after = ibv_alloc_pd(ctx);
	CHECK(after != NULL, "the parent's verbs still work after a fork");
	if (after)
		ibv_dealloc_pd(after);

	CHECK(ibv_close_device(ctx) == 0, "close");
	CHECK(strcmp(ibv_wc_status_str(IBV_WC_SUCCESS), "success") == 0 &&
		      strcmp(ibv_wc_status_str((enum ibv_wc_status)999), "unknown") == 0 &&
		      strcmp(ibv_node_type_str(IBV_NODE_UNKNOWN), "unknown") == 0 &&
		      strcmp(ibv_port_state_str(IBV_PORT_ACTIVE), "active") == 0 &&
		      strcmp(ibv_event_type_str(IBV_EVENT_PORT_ACTIVE), "port active") == 0,
	      "the string helpers");
	CHECK(ibv_rate_to_mbps(IBV_RATE_100_GBPS) == 103125 && ibv_rate_to_mult(IBV_RATE_10_GBPS) == 4 &&
		      mult_to_ibv_rate(4) == IBV_RATE_10_GBPS && mbps_to_ibv_rate(25781) == IBV_RATE_25_GBPS &&
		      ibv_rate_to_mult(IBV_RATE_14_GBPS) == -1,
	      "the rate helpers");
	ibv_free_device_list(list);
	if (failed)
		return 1;
	printf("ok\n");
	return 0;
}
