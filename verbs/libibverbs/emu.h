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

/* The Go half's handles of a context's device and of a PD. */
odpemu_handle emu_dev_handle(struct ibv_context *ctx);
odpemu_handle emu_pd_handle(struct ibv_pd *pd);

/* emu_set_qp_ops gives a new context the data-path ops (qp.c). */
void emu_set_qp_ops(struct ibv_context *ctx);

#endif
