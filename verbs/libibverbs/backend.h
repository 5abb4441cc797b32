/*
 * The interface between odpemu's libibverbs.so.1 (C, loaded by verbs programs) and its
 * Go half, libodpemu-verbs.so (built with -buildmode=c-shared from verbs/emu), which the
 * C library loads with dlopen the first time a program opens a device: a program that
 * only links libibverbs, or lists devices, never starts the Go runtime.
 *
 * Every function returns 0 or a positive errno value (odpemu_poll_cq: the number of
 * completions, or a negative errno value), and odpemu_open on failure writes a
 * message (NUL-terminated, at most errlen bytes) into err. Objects are named by
 * handles (odpemu_handle): opaque non-zero values the Go half hands out and takes back.
 * odpemu_post_send posts n work requests in order, stopping at the first that fails:
 * *posted says how many were posted. odpemu_create_srq takes the asynchronous event
 * its limit raises as bytes (a struct ibv_async_event the C library built), which the
 * Go half writes into async_fd, non-blocking, each time the armed limit is reached.
 */
#ifndef ODPEMU_BACKEND_H
#define ODPEMU_BACKEND_H

#include <stddef.h>
#include <stdint.h>

typedef uintptr_t odpemu_handle;

/* What a device reports: the verbs library turns it into ibv_device_attr(_ex) and
 * ibv_port_attr. */
struct odpemu_device_attr {
	uint64_t max_mr_size;
	uint64_t page_size_cap;
	uint32_t max_msg_sz;
	uint32_t max_qp_wr;
	uint32_t max_sge;
	uint32_t max_inline_data;
	uint32_t max_cqe;
	uint32_t max_qp_rd_atom;
	uint32_t max_qp_init_rd_atom;
	uint32_t atomic_cap; /* enum ibv_atomic_cap */
	uint64_t odp_general_caps; /* enum ibv_odp_general_caps bits */
	uint32_t odp_rc_caps, odp_uc_caps, odp_ud_caps; /* enum ibv_odp_transport_cap_bits */
	uint32_t active_mtu; /* bytes */
	uint32_t max_srq_wr, max_srq_sge;
};

/* A scatter/gather element: struct ibv_sge's layout. */
struct odpemu_sge {
	uint64_t addr;
	uint32_t length;
	uint32_t lkey;
};

/* A send work request (struct ibv_send_wr's fields for RC). */
struct odpemu_send_wr {
	uint64_t wr_id;
	uint32_t opcode; /* enum ibv_wr_opcode */
	uint32_t flags;  /* enum ibv_send_flags */
	uint32_t imm;    /* in host order (ibv_send_wr has it in network order) */
	uint32_t rkey;   /* IBV_WR_BIND_MW: the window's new R_Key */
	uint64_t remote_addr;
	uint64_t compare_add, swap;
	const struct odpemu_sge *sg_list;
	uint32_t num_sge;
	/* A UD SEND's destination: its address handle's GID, the remote QPN and Q_Key. */
	uint8_t dgid[16];
	uint32_t remote_qpn, remote_qkey;
	/* IBV_WR_LOCAL_INV, IBV_WR_SEND_WITH_INV: the R_Key to invalidate. */
	uint32_t invalidate_rkey;
	/* IBV_WR_BIND_MW: the window and its ibv_mw_bind_info (mr 0, or a zero length:
	 * unbind). */
	odpemu_handle mw, mr;
	uint64_t bind_addr, bind_length;
	uint32_t bind_access;
};

/* A work completion. */
struct odpemu_wc {
	uint64_t wr_id;
	uint32_t status; /* enum ibv_wc_status */
	uint32_t opcode; /* enum ibv_wc_opcode */
	uint32_t byte_len;
	uint32_t qp_num;
	uint32_t wc_flags; /* enum ibv_wc_flags */
	uint32_t imm;      /* host order: immediate data (IBV_WC_WITH_IMM) or the R_Key invalidated (IBV_WC_WITH_INV) */
	uint32_t src_qp;   /* a UD receive's sending QP */
};

/* A QP's capabilities: asked for (0: the emulator's default), then as granted. */
struct odpemu_qp_caps {
	uint32_t max_send_wr, max_recv_wr, max_sge, max_inline_data;
};

/* What a QP needs to connect, from ibv_modify_qp's RTR attributes (odpemu_rtr_qp:
 * the peer, the path, the responder's side) and RTS attributes (odpemu_rts_qp: the
 * requester's side). */
struct odpemu_connect {
	uint32_t dest_qp_num;
	uint32_t rq_psn; /* the first PSN the peer sends */
	uint32_t sq_psn; /* the first PSN this QP sends */
	uint32_t mtu;    /* the path MTU in bytes */
	uint8_t dgid[16];
	uint8_t min_rnr_timer, timeout, retry_cnt, rnr_retry;
	/* RTR: the responder resources (max_dest_rd_atomic); RTS: the initiator depth
	 * (max_rd_atomic). */
	uint8_t max_dest_rd_atomic, max_rd_atomic;
};

/*
 * A CQ's doorbell: a word in the C library's memory that the Go half sets to 1 when it
 * queues a completion after a poll that emptied the CQ (odpemu_poll_cq arms it whenever
 * it returns fewer completions than asked for). While the word is 0 after such a poll,
 * the CQ is empty, and the C library answers ibv_poll_cq without entering Go: a program
 * that polls an empty CQ in a busy loop, as perftest does, reads memory as it would on
 * hardware instead of holding one of the Go runtime's Ps that the emulated NIC's engines
 * need. The C library clears the word before it polls the Go half.
 *
 * odpemu_wait_cq blocks the calling thread in Go until the CQ's armed doorbell rings or
 * ns nanoseconds have passed (0 when it rang, ETIMEDOUT when the time passed first,
 * EINVAL for a bad handle or a negative ns). The C library calls it when a thread with
 * many sends in flight, one signaled, finds that send's CQ empty, or a thread with none
 * in flight has found its CQ empty for 20 us (qp.c). A C thread keeps the runtime's P it
 * last entered Go with while it runs C (to the scheduler, it is in a system call) until
 * the runtime's monitor takes the P back, 20 us to milliseconds later; the engine that
 * its post woke waits for a P meanwhile if none is free. A thread blocked in Go gives
 * its P up at once.
 *
 * odpemu_wait_in_c tells the Go half that a thread waits in C for a completion for
 * long, holding its P (its poll loop found the CQ empty for 50 us and sleeps, or it
 * reads a completion channel): the runtime then keeps a P per CPU
 * (verbs/emu/procs.go). It returns 0.
 */

/* The Go half's entry points, looked up by name with dlsym. */
#define ODPEMU_BACKEND_FUNCS(X)                                                                  \
	X(int, odpemu_open, (const char *name, const char *addr, odpemu_handle *dev,             \
			     struct odpemu_device_attr *attr, char *err, size_t errlen))          \
	X(int, odpemu_close, (odpemu_handle dev))                                                \
	X(int, odpemu_alloc_pd, (odpemu_handle dev, odpemu_handle *pd))                           \
	X(int, odpemu_dealloc_pd, (odpemu_handle pd))                                            \
	X(int, odpemu_reg_mr, (odpemu_handle pd, void *addr, size_t length, uint32_t access,       \
			       odpemu_handle *mr, uint32_t *key))                                  \
	X(int, odpemu_dereg_mr, (odpemu_handle mr))                                              \
	X(int, odpemu_rereg_mr, (odpemu_handle mr, uint32_t flags, odpemu_handle pd, void *addr,   \
				 size_t length, uint32_t access, uint32_t *key))                      \
	X(int, odpemu_advise_mr, (odpemu_handle pd, uint32_t advice, uint32_t flags,               \
				  const struct odpemu_sge *sg, uint32_t num_sge))                     \
	X(int, odpemu_create_cq, (odpemu_handle dev, int depth, uint32_t *bell, odpemu_handle *cq))  \
	X(int, odpemu_destroy_cq, (odpemu_handle cq))                                            \
	X(int, odpemu_resize_cq, (odpemu_handle cq, int depth))                                   \
	X(int, odpemu_poll_cq, (odpemu_handle cq, int n, struct odpemu_wc *wcs))                  \
	X(int, odpemu_wait_cq, (odpemu_handle cq, int64_t ns))                                    \
	X(int, odpemu_wait_in_c, (void))                                                          \
	X(int, odpemu_req_notify_cq, (odpemu_handle cq, int fd, uint64_t event))                  \
	X(int, odpemu_create_qp, (odpemu_handle pd, odpemu_handle send_cq, odpemu_handle recv_cq, \
				  odpemu_handle srq, uint32_t type, struct odpemu_qp_caps *caps,      \
				  uint32_t sig_all, odpemu_handle *qp, uint32_t *qpn))                \
	X(int, odpemu_bind_ud_qp, (odpemu_handle qp, uint32_t mtu))                               \
	X(int, odpemu_set_qp_qkey, (odpemu_handle qp, uint32_t qkey))                             \
	X(int, odpemu_rtr_qp, (odpemu_handle qp, const struct odpemu_connect *c))                  \
	X(int, odpemu_rts_qp, (odpemu_handle qp, const struct odpemu_connect *c))                  \
	X(int, odpemu_modify_qp_state, (odpemu_handle qp, uint32_t state))                        \
	X(int, odpemu_set_qp_access, (odpemu_handle qp, uint32_t access))                          \
	X(int, odpemu_destroy_qp, (odpemu_handle qp))                                            \
	X(int, odpemu_post_send, (odpemu_handle qp, const struct odpemu_send_wr *wrs, uint32_t n,  \
				  uint32_t *posted))                                                  \
	X(int, odpemu_alloc_mw, (odpemu_handle pd, uint32_t type, odpemu_handle *mw, uint32_t *rkey))  \
	X(int, odpemu_dealloc_mw, (odpemu_handle mw))                                            \
	X(int, odpemu_post_recv, (odpemu_handle qp, uint64_t wr_id, const struct odpemu_sge *sg,   \
				  uint32_t num_sge))                                                  \
	X(int, odpemu_create_srq, (odpemu_handle pd, uint32_t *max_wr, uint32_t *max_sge,          \
				   uint32_t limit, int async_fd, const void *event, size_t event_len,  \
				   odpemu_handle *srq))                                               \
	X(int, odpemu_arm_srq, (odpemu_handle srq, uint32_t limit))                               \
	X(int, odpemu_query_srq, (odpemu_handle srq, uint32_t *max_wr, uint32_t *max_sge,          \
				  uint32_t *limit))                                                   \
	X(int, odpemu_destroy_srq, (odpemu_handle srq))                                          \
	X(int, odpemu_post_srq_recv, (odpemu_handle srq, uint64_t wr_id,                          \
				      const struct odpemu_sge *sg, uint32_t num_sge))

#endif
