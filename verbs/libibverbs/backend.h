/*
 * The interface between odpemu's libibverbs.so.1 (C, loaded by verbs programs) and its
 * Go half, libodpemu-verbs.so (built with -buildmode=c-shared from verbs/emu), which the
 * C library loads with dlopen the first time a program opens a device: a program that
 * only links libibverbs, or lists devices, never starts the Go runtime.
 *
 * Every function returns 0 or a positive errno value, and on failure may write a
 * message (NUL-terminated, at most errlen bytes) into err. Objects are named by
 * handles (odpemu_handle): opaque non-zero values the Go half hands out and takes back.
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
};

/* The Go half's entry points, looked up by name with dlsym. */
#define ODPEMU_BACKEND_FUNCS(X)                                                                  \
	X(int, odpemu_open, (const char *name, const char *addr, odpemu_handle *dev,             \
			     struct odpemu_device_attr *attr, char *err, size_t errlen))          \
	X(int, odpemu_close, (odpemu_handle dev))                                                \
	X(int, odpemu_alloc_pd, (odpemu_handle dev, odpemu_handle *pd))                           \
	X(int, odpemu_dealloc_pd, (odpemu_handle pd))

#endif
