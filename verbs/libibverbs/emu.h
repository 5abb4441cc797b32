/*
 * What the files of odpemu's libibverbs.so.1 share. Built with -fvisibility=hidden:
 * only functions marked EXPORT leave the library.
 */
#ifndef ODPEMU_EMU_H
#define ODPEMU_EMU_H

#include <infiniband/verbs.h>

#include "backend.h"

#define EXPORT __attribute__((visibility("default")))
#define container_of(p, type, member) ((type *)((char *)(p) - offsetof(type, member)))

/* The Go half's entry points (verbs.c loads them on the first ibv_open_device: every
 * object below a context exists only after that). */
extern struct emu_backend {
#define X(ret, name, args) ret(*name) args;
	ODPEMU_BACKEND_FUNCS(X)
#undef X
} be;

/* Set in a forked child of a process that loaded the Go half: the child's verbs fail
 * with ENODEV (verbs.c). */
extern int emu_forked;

/* The Go half's handles of a context's device, a PD and an SRQ; the write end of a
 * context's asynchronous event pipe (non-blocking). */
odpemu_handle emu_dev_handle(struct ibv_context *ctx);
odpemu_handle emu_pd_handle(struct ibv_pd *pd);
odpemu_handle emu_srq_handle(struct ibv_srq *srq);
int emu_async_wr(struct ibv_context *ctx);

/* Send flags the emulated NIC accepts and ignores: every completion is an event, so a
 * solicited one is too. */
#define EMU_IGNORED_SEND_FLAGS IBV_SEND_SOLICITED

/* A work request of the ibv_wr_* API being built (wr.c), between ibv_wr_start and
 * ibv_wr_complete or ibv_wr_abort, which post or drop the whole batch. */
struct emu_wr_batch {
	pthread_mutex_t lock; /* held from wr_start to wr_complete or wr_abort */
	struct odpemu_send_wr *wrs; /* max_send_wr of them */
	struct odpemu_sge *sges;    /* max_send_wr x max_sge */
	char *inl;                  /* max_send_wr x max_inline_data bytes */
	uint32_t n, nsge;
	size_t ninl;
	int err; /* the first error of the batch, reported by wr_complete */
};

/* A QP: as rdma-core's verbs_qp, an ibv_qp that is also the start of an ibv_qp_ex. */
struct emu_qp {
	union {
		struct ibv_qp qp;
		struct ibv_qp_ex qp_ex;
	};
	odpemu_handle h;
	struct ibv_qp_cap cap;
	int sq_sig_all;
	struct ibv_qp_attr attr;    /* the attributes modify_qp set, for query_qp */
	struct emu_wr_batch *batch; /* a QP created with send_ops_flags: the ibv_wr_* API */
};

/* A CQ. Its doorbell (backend.h) lets an empty CQ answer ibv_poll_cq from C: after a
 * poll of the Go half that returned fewer completions than asked for (idle), the CQ is
 * empty until the Go half sets bell. The poll that goes to the Go half holds lock, so
 * that idle describes the last of them. A CQ made by ibv_create_cq_ex is also an
 * ibv_cq_ex (whose first members are an ibv_cq's), polled one completion at a time
 * into cur (cqex.c). */
struct emu_cq {
	union {
		struct ibv_cq cq;
		struct ibv_cq_ex cq_ex;
	};
	odpemu_handle h;
	uint32_t bell, idle; /* read and written with __atomic builtins */
	pthread_mutex_t lock;
	struct ibv_wc cur; /* the completion start_poll or next_poll found */
};

/* emu_posted notes that the calling thread posted n send WRs to qp (qp.c: a thread that
 * then finds the send CQ empty waits in Go). */
void emu_posted(struct ibv_qp *qp, const struct odpemu_send_wr *wrs, uint32_t n);

/* emu_poll_cq is ibv_poll_cq (qp.c); emu_create_cq_ex is ibv_create_cq_ex (cqex.c). */
int emu_poll_cq(struct ibv_cq *cq, int num_entries, struct ibv_wc *wc);
struct ibv_cq_ex *emu_create_cq_ex(struct ibv_context *context, struct ibv_cq_init_attr_ex *attr);

/* An MR (qp.c) and a memory window (mw.c). */
struct emu_mr {
	struct ibv_mr mr;
	odpemu_handle h;
};
struct emu_mw {
	struct ibv_mw mw;
	odpemu_handle h;
};

/* emu_bind_info fills a bind work request's window and binding (mw.c). */
void emu_bind_info(struct odpemu_send_wr *w, struct ibv_mw *mw, uint32_t rkey, const struct ibv_mw_bind_info *info);

/* An address handle: a UD SEND's destination, by GID (RoCE addresses by GID: the
 * emulator sends to the IPv4 address an IPv4-mapped GID holds, port 4791). */
struct emu_ah {
	struct ibv_ah ah;
	uint8_t dgid[16];
};

/* emu_wr_init gives q the ibv_wr_* API for the operations in ops (enum
 * ibv_qp_create_send_ops_flags); emu_wr_free frees what it allocated. */
int emu_wr_init(struct emu_qp *q, uint64_t ops);
void emu_wr_free(struct emu_qp *q);

/* emu_set_qp_ops gives a new context the data-path ops (qp.c), emu_set_srq_ops the
 * SRQ's (srq.c), emu_set_mw_ops the memory windows' (mw.c). */
void emu_set_qp_ops(struct ibv_context *ctx);
void emu_set_srq_ops(struct ibv_context *ctx);
void emu_set_mw_ops(struct ibv_context *ctx);

#endif
