/*
 * odpemu's libibverbs.so.1: the verbs library unmodified programs load (through
 * LD_LIBRARY_PATH) in place of rdma-core's, with one device, odpemu0, the emulated ODP
 * NIC of package odp. Compiled against the installed rdma-core headers, so every
 * structure a program or verbs.h's inline functions touch has the installed layout;
 * verbs.Build links it with a version script and stubs generated from the installed
 * library, so that every (version, symbol) the installed one exports resolves.
 *
 * Objects are the structures verbs.h defines, allocated here, each with the handle of
 * its Go counterpart (backend.h) after it. The Go half is loaded on the first
 * ibv_open_device. This file has devices, contexts, queries and PDs; qp.c has MRs,
 * CQs and QPs.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <arpa/inet.h>
#include <fcntl.h>
#include <libgen.h>
#include <limits.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <infiniband/verbs.h>

#include "emu.h"

/* rdma-core's private declarations (driver.h, not installed) of what programs import. */
enum ibv_gid_type_sysfs {
	IBV_GID_TYPE_SYSFS_IB_ROCE_V1,
	IBV_GID_TYPE_SYSFS_ROCE_V2,
};
EXPORT int ibv_query_gid_type(struct ibv_context *context, uint8_t port_num, unsigned int index,
			      enum ibv_gid_type_sysfs *type);
struct _compat_ibv_port_attr;

/* The GID table: index 0 is the bound address, the rest are empty (as a RoCE port
 * with one IPv4 address shows them). */
enum { GID_TABLE_LEN = 16, PKEY_DEFAULT = 0xffff, EMU_MAX_QP = 1 << 16, EMU_MAX_CQ = 1 << 16,
       EMU_MAX_PD = 1 << 16, EMU_MAX_MR = 1 << 24 };

/*
 * A device as libibverbs lists it: struct ibv_device first and, right after it, the
 * provider-ops pointer of rdma-core's struct verbs_device (driver.h), NULL here. The
 * providers loaded in the same process (libmlx5, libefa) compare that pointer with
 * their own ops to tell their devices; NULL is nobody's.
 */
struct emu_device {
	struct ibv_device ibdev;
	const void *provider_ops;
};
_Static_assert(offsetof(struct emu_device, provider_ops) == sizeof(struct ibv_device),
	       "verbs_device.ops follows struct ibv_device");

static struct emu_device emu_dev;
static pthread_once_t dev_once = PTHREAD_ONCE_INIT;

/* The address the device is bound to: ODPEMU_ADDR, or 127.0.0.1. Its IPv4-mapped form
 * is GID index 0, and the GUID derives from it (as rxe's derives from its MAC). */
static char bind_addr[INET_ADDRSTRLEN];
static struct in_addr bind_in;
static int bind_err; /* ODPEMU_ADDR is not an IPv4 address */

static void init_device(void)
{
	const char *a = getenv("ODPEMU_ADDR");
	if (!a || !*a)
		a = "127.0.0.1";
	if (inet_pton(AF_INET, a, &bind_in) != 1) {
		bind_err = EINVAL;
		fprintf(stderr, "odpemu: ODPEMU_ADDR=%s: want an IPv4 address\n", a);
	}
	inet_ntop(AF_INET, &bind_in, bind_addr, sizeof bind_addr);

	struct ibv_device *d = &emu_dev.ibdev;
	d->node_type = IBV_NODE_CA;
	d->transport_type = IBV_TRANSPORT_IB; /* as rxe: IB transport, Ethernet link layer */
	snprintf(d->name, sizeof d->name, "odpemu0");
	snprintf(d->dev_name, sizeof d->dev_name, "uverbs-odpemu0");
	snprintf(d->dev_path, sizeof d->dev_path, "/sys/class/infiniband_verbs/uverbs-odpemu0");
	snprintf(d->ibdev_path, sizeof d->ibdev_path, "/sys/class/infiniband/odpemu0");
}

/* The Go half (backend.h), loaded once. */
struct emu_backend be;
static pthread_once_t be_once = PTHREAD_ONCE_INIT;
static char be_err[PATH_MAX + 128];

/* load_backend loads libodpemu-verbs.so from ODPEMU_VERBS_BACKEND or from this
 * library's directory. */
static void load_backend(void)
{
	char path[PATH_MAX];
	const char *env = getenv("ODPEMU_VERBS_BACKEND");
	if (env && *env) {
		snprintf(path, sizeof path, "%s", env);
	} else {
		Dl_info info;
		if (!dladdr((void *)load_backend, &info) || !info.dli_fname) {
			snprintf(be_err, sizeof be_err, "cannot find where libibverbs.so.1 lies");
			return;
		}
		char self[PATH_MAX];
		snprintf(self, sizeof self, "%s", info.dli_fname);
		snprintf(path, sizeof path, "%s/libodpemu-verbs.so", dirname(self));
	}
	void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (!h) {
		snprintf(be_err, sizeof be_err, "%s", dlerror());
		return;
	}
#define X(ret, name, args)                                                                   \
	be.name = (ret(*) args)dlsym(h, #name);                                              \
	if (!be.name) {                                                                      \
		snprintf(be_err, sizeof be_err, "%s lacks %s", path, #name);                  \
		memset(&be, 0, sizeof be);                                                   \
		return;                                                                      \
	}
	ODPEMU_BACKEND_FUNCS(X)
#undef X
}

/*
 * A forked child has none of the emulator's threads (the Go runtime's, the fault
 * server's): once the parent loaded the emulator, every call into it fails in the
 * child with ENODEV instead of hanging in a runtime that is not there. A child of a
 * parent that never opened a device loads the emulator afresh.
 */
int emu_forked;

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-parameter"
#define X(ret, name, args) \
	static ret dead_##name args { return ENODEV; }
ODPEMU_BACKEND_FUNCS(X)
#undef X
#pragma GCC diagnostic pop

static int dead_poll(odpemu_handle cq, int n, struct odpemu_wc *wcs)
{
	(void)cq, (void)n, (void)wcs;
	return -ENODEV;
}

static void atfork_child(void)
{
	if (!be.odpemu_open)
		return;
	emu_forked = 1;
#define X(ret, name, args) be.name = dead_##name;
	ODPEMU_BACKEND_FUNCS(X)
#undef X
	be.odpemu_poll_cq = dead_poll;
}

__attribute__((constructor)) static void init_library(void) { pthread_atfork(NULL, NULL, atfork_child); }

static int backend(void)
{
	if (emu_forked) {
		fprintf(stderr, "odpemu: libibverbs: verbs in a forked child: the emulator runs in the parent\n");
		return ENODEV;
	}
	pthread_once(&be_once, load_backend);
	if (!be.odpemu_open) {
		fprintf(stderr, "odpemu: libibverbs: cannot load the emulator: %s\n", be_err);
		return ENOSYS;
	}
	return 0;
}

/*
 * A context: the complete struct verbs_context of the installed headers, whose last
 * member is the ibv_context handed out (verbs_get_ctx finds the extended ops before
 * it), then what this library keeps.
 */
struct emu_context {
	struct verbs_context vctx;
	odpemu_handle dev;
	struct odpemu_device_attr attr;
	int async_rd, async_wr; /* async_fd is the read end; the Go half writes SRQ limit events */
};

static struct emu_context *ectx(struct ibv_context *c)
{
	return container_of(c, struct emu_context, vctx.context);
}

struct emu_pd {
	struct ibv_pd pd;
	odpemu_handle h;
};

odpemu_handle emu_dev_handle(struct ibv_context *ctx) { return ectx(ctx)->dev; }

int emu_async_wr(struct ibv_context *ctx) { return ectx(ctx)->async_wr; }

odpemu_handle emu_pd_handle(struct ibv_pd *pd) { return container_of(pd, struct emu_pd, pd)->h; }

static int emu_advise_mr(struct ibv_pd *pd, enum ibv_advise_mr_advice advice, uint32_t flags,
			 struct ibv_sge *sg_list, uint32_t num_sge)
{
	_Static_assert(sizeof(struct ibv_sge) == sizeof(struct odpemu_sge), "an ibv_sge is an odpemu_sge");
	return be.odpemu_advise_mr(emu_pd_handle(pd), advice, flags, (const struct odpemu_sge *)sg_list, num_sge);
}

EXPORT struct ibv_device **ibv_get_device_list(int *num_devices)
{
	pthread_once(&dev_once, init_device);
	struct ibv_device **list = calloc(2, sizeof *list);
	if (!list) {
		errno = ENOMEM;
		return NULL;
	}
	list[0] = &emu_dev.ibdev;
	if (num_devices)
		*num_devices = 1;
	return list;
}

EXPORT void ibv_free_device_list(struct ibv_device **list) { free(list); }

EXPORT const char *ibv_get_device_name(struct ibv_device *device) { return device->name; }

EXPORT int ibv_get_device_index(struct ibv_device *device)
{
	return device == &emu_dev.ibdev ? 0 : -1;
}

static enum ibv_mtu mtu_enum(uint32_t bytes)
{
	switch (bytes) {
	case 256: return IBV_MTU_256;
	case 512: return IBV_MTU_512;
	case 1024: return IBV_MTU_1024;
	case 2048: return IBV_MTU_2048;
	default: return IBV_MTU_4096;
	}
}

static void gid0(union ibv_gid *gid)
{
	memset(gid, 0, sizeof *gid);
	gid->raw[10] = gid->raw[11] = 0xff; /* ::ffff:a.b.c.d */
	memcpy(&gid->raw[12], &bind_in, 4);
}

/* node_guid: a locally administered EUI-64 holding the address, in network order. */
static __be64 node_guid(void)
{
	uint8_t b[8] = {0x02, 'o', 'd', 0xff};
	memcpy(&b[4], &bind_in, 4);
	__be64 g;
	memcpy(&g, b, sizeof g);
	return g;
}

/* device_attr fills what ibv_query_device reports from what the emulator reports. */
static void device_attr(struct emu_context *c, struct ibv_device_attr *a)
{
	const struct odpemu_device_attr *e = &c->attr;
	memset(a, 0, sizeof *a);
	snprintf(a->fw_ver, sizeof a->fw_ver, "odpemu");
	a->node_guid = node_guid();
	a->sys_image_guid = a->node_guid;
	a->max_mr_size = e->max_mr_size;
	a->page_size_cap = e->page_size_cap;
	a->vendor_id = 0xffffff; /* rxe's: perftest then posts with ibv_post_send */
	a->vendor_part_id = 0;
	a->max_qp = EMU_MAX_QP;
	a->max_qp_wr = (int)e->max_qp_wr;
	/* Memory windows of type 1 and 2B, as rxe's. */
	a->device_cap_flags = IBV_DEVICE_RC_RNR_NAK_GEN | IBV_DEVICE_MEM_WINDOW | IBV_DEVICE_MEM_WINDOW_TYPE_2B;
	a->max_sge = (int)e->max_sge;
	a->max_sge_rd = (int)e->max_sge;
	a->max_cq = EMU_MAX_CQ;
	a->max_cqe = (int)e->max_cqe;
	a->max_mr = EMU_MAX_MR;
	a->max_mw = EMU_MAX_MR; /* windows and MRs share the key space */
	a->max_pd = EMU_MAX_PD;
	a->max_qp_rd_atom = (int)e->max_qp_rd_atom;
	a->max_qp_init_rd_atom = (int)e->max_qp_init_rd_atom;
	a->max_res_rd_atom = (int)e->max_qp_rd_atom * EMU_MAX_QP;
	a->max_srq = EMU_MAX_QP;
	a->max_srq_wr = (int)e->max_srq_wr;
	a->max_srq_sge = (int)e->max_srq_sge;
	a->atomic_cap = (enum ibv_atomic_cap)e->atomic_cap;
	a->max_pkeys = 1;
	a->local_ca_ack_delay = 15;
	a->phys_port_cnt = 1;
}

static int emu_query_device_ex(struct ibv_context *context, const struct ibv_query_device_ex_input *input,
			       struct ibv_device_attr_ex *attr, size_t attr_size)
{
	if ((input && input->comp_mask) || attr_size < sizeof(struct ibv_device_attr))
		return EINVAL;
	struct emu_context *c = ectx(context);
	struct ibv_device_attr_ex ex;
	memset(&ex, 0, sizeof ex);
	device_attr(c, &ex.orig_attr);
	ex.odp_caps.general_caps = c->attr.odp_general_caps;
	ex.odp_caps.per_transport_caps.rc_odp_caps = c->attr.odp_rc_caps;
	ex.odp_caps.per_transport_caps.uc_odp_caps = c->attr.odp_uc_caps;
	ex.odp_caps.per_transport_caps.ud_odp_caps = c->attr.odp_ud_caps;
	ex.phys_port_cnt_ex = 1;
	memcpy(attr, &ex, attr_size < sizeof ex ? attr_size : sizeof ex);
	if (attr_size > sizeof ex)
		memset((char *)attr + sizeof ex, 0, attr_size - sizeof ex);
	return 0;
}

EXPORT int ibv_query_device(struct ibv_context *context, struct ibv_device_attr *device_attr_out)
{
	device_attr(ectx(context), device_attr_out);
	return 0;
}

static int emu_query_port(struct ibv_context *context, uint8_t port_num, struct ibv_port_attr *attr,
			  size_t attr_size)
{
	if (port_num != 1)
		return EINVAL;
	struct emu_context *c = ectx(context);
	struct ibv_port_attr p;
	memset(&p, 0, sizeof p);
	p.state = IBV_PORT_ACTIVE;
	p.max_mtu = IBV_MTU_4096;
	p.active_mtu = mtu_enum(c->attr.active_mtu);
	p.gid_tbl_len = GID_TABLE_LEN;
	p.port_cap_flags = IBV_PORT_CM_SUP;
	p.max_msg_sz = c->attr.max_msg_sz;
	p.pkey_tbl_len = 1;
	p.max_vl_num = 1;
	p.active_width = 2;  /* 4X */
	p.active_speed = 32; /* EDR: 4X EDR is the link model's 100 Gb/s */
	p.phys_state = 5;    /* LinkUp */
	p.link_layer = IBV_LINK_LAYER_ETHERNET;
	memcpy(attr, &p, attr_size < sizeof p ? attr_size : sizeof p);
	return 0;
}

/* The exported ibv_query_port takes the older, shorter struct: ibv_port_attr up to
 * port_cap_flags2 (verbs.h's ibv_query_port macro calls the op above instead). */
#undef ibv_query_port /* verbs.h's macro, which dispatches to the op above */
EXPORT int ibv_query_port(struct ibv_context *context, uint8_t port_num, struct _compat_ibv_port_attr *attr)
{
	int e = emu_query_port(context, port_num, (struct ibv_port_attr *)attr,
			       offsetof(struct ibv_port_attr, port_cap_flags2));
	if (e) {
		errno = e;
		return e;
	}
	return 0;
}

EXPORT int ibv_query_gid(struct ibv_context *context, uint8_t port_num, int index, union ibv_gid *gid)
{
	if (port_num != 1 || index < 0 || index >= GID_TABLE_LEN) {
		errno = EINVAL;
		return -1;
	}
	(void)context;
	memset(gid, 0, sizeof *gid);
	if (index == 0)
		gid0(gid);
	return 0;
}

static void gid_entry(struct ibv_gid_entry *e)
{
	memset(e, 0, sizeof *e);
	gid0(&e->gid);
	e->gid_index = 0;
	e->port_num = 1;
	e->gid_type = IBV_GID_TYPE_ROCE_V2;
	e->ndev_ifindex = 0; /* no netdev: the emulator's port is a UDP socket */
}

EXPORT int _ibv_query_gid_ex(struct ibv_context *context, uint32_t port_num, uint32_t gid_index,
			     struct ibv_gid_entry *entry, uint32_t flags, size_t entry_size)
{
	if (flags || port_num != 1 || entry_size < sizeof *entry)
		return EINVAL;
	if (gid_index >= GID_TABLE_LEN)
		return EINVAL;
	if (gid_index != 0)
		return ENODATA; /* an empty entry */
	(void)context;
	gid_entry(entry);
	return 0;
}

EXPORT ssize_t _ibv_query_gid_table(struct ibv_context *context, struct ibv_gid_entry *entries,
				    size_t max_entries, uint32_t flags, size_t entry_size)
{
	if (flags || entry_size < sizeof *entries || max_entries < 1)
		return -EINVAL;
	(void)context;
	gid_entry(entries);
	return 1;
}

EXPORT int ibv_query_gid_type(struct ibv_context *context, uint8_t port_num, unsigned int index,
			      enum ibv_gid_type_sysfs *type)
{
	(void)context;
	if (port_num != 1 || index >= GID_TABLE_LEN) {
		errno = EINVAL;
		return -1;
	}
	*type = index == 0 ? IBV_GID_TYPE_SYSFS_ROCE_V2 : IBV_GID_TYPE_SYSFS_IB_ROCE_V1;
	return 0;
}

EXPORT int ibv_query_pkey(struct ibv_context *context, uint8_t port_num, int index, __be16 *pkey)
{
	(void)context;
	if (port_num != 1 || index != 0) {
		errno = EINVAL;
		return -1;
	}
	*pkey = htobe16(PKEY_DEFAULT);
	return 0;
}

EXPORT int ibv_get_pkey_index(struct ibv_context *context, uint8_t port_num, __be16 pkey)
{
	(void)context;
	if (port_num != 1 || be16toh(pkey) != PKEY_DEFAULT) {
		errno = EINVAL;
		return -1;
	}
	return 0;
}

EXPORT __be64 ibv_get_device_guid(struct ibv_device *device)
{
	(void)device;
	pthread_once(&dev_once, init_device);
	return node_guid();
}

EXPORT struct ibv_context *ibv_open_device(struct ibv_device *device)
{
	if (device != &emu_dev.ibdev) {
		errno = ENODEV;
		return NULL;
	}
	if (bind_err) {
		errno = bind_err;
		return NULL;
	}
	int e = backend();
	if (e) {
		errno = e;
		return NULL;
	}
	struct emu_context *c = calloc(1, sizeof *c);
	if (!c) {
		errno = ENOMEM;
		return NULL;
	}
	char msg[512] = "";
	e = be.odpemu_open(device->name, bind_addr, &c->dev, &c->attr, msg, sizeof msg);
	if (e) {
		fprintf(stderr, "odpemu: open %s: %s\n", device->name, msg);
		free(c);
		errno = e;
		return NULL;
	}
	int fds[2];
	if (pipe2(fds, O_CLOEXEC) || fcntl(fds[1], F_SETFL, O_NONBLOCK)) {
		e = errno;
		be.odpemu_close(c->dev);
		free(c);
		errno = e;
		return NULL;
	}
	c->async_rd = fds[0];
	c->async_wr = fds[1];
	struct ibv_context *ctx = &c->vctx.context;
	ctx->device = device;
	ctx->cmd_fd = -1; /* no kernel: no uverbs command file */
	ctx->async_fd = c->async_rd;
	ctx->num_comp_vectors = 1;
	pthread_mutex_init(&ctx->mutex, NULL);
	ctx->abi_compat = __VERBS_ABI_IS_EXTENDED;
	c->vctx.sz = sizeof(struct verbs_context);
	c->vctx.query_device_ex = emu_query_device_ex;
	c->vctx.query_port = emu_query_port;
	c->vctx.advise_mr = emu_advise_mr;
	emu_set_qp_ops(ctx);
	emu_set_srq_ops(ctx);
	emu_set_mw_ops(ctx);
	return ctx;
}

EXPORT int ibv_close_device(struct ibv_context *context)
{
	struct emu_context *c = ectx(context);
	int e = be.odpemu_close(c->dev);
	close(c->async_rd);
	close(c->async_wr);
	pthread_mutex_destroy(&context->mutex);
	free(c);
	if (e) {
		errno = e;
		return -1;
	}
	return 0;
}

EXPORT int ibv_get_async_event(struct ibv_context *context, struct ibv_async_event *event)
{
	/* The only event raised is an SRQ's limit, which the Go half writes whole (a
	 * pipe write of this size is atomic); a reader blocks, or sees EAGAIN on a
	 * non-blocking async_fd, while there is none. */
	struct ibv_async_event ev;
	ssize_t n = read(context->async_fd, &ev, sizeof ev);
	if (n != (ssize_t)sizeof ev)
		return -1;
	*event = ev;
	return 0;
}

EXPORT void ibv_ack_async_event(struct ibv_async_event *event) { (void)event; }

EXPORT struct ibv_pd *ibv_alloc_pd(struct ibv_context *context)
{
	struct emu_pd *p = calloc(1, sizeof *p);
	if (!p) {
		errno = ENOMEM;
		return NULL;
	}
	int e = be.odpemu_alloc_pd(ectx(context)->dev, &p->h);
	if (e) {
		free(p);
		errno = e;
		return NULL;
	}
	p->pd.context = context;
	p->pd.handle = (uint32_t)(uintptr_t)p;
	return &p->pd;
}

EXPORT int ibv_dealloc_pd(struct ibv_pd *pd)
{
	struct emu_pd *p = container_of(pd, struct emu_pd, pd);
	int e = be.odpemu_dealloc_pd(p->h);
	if (e)
		return e;
	free(p);
	return 0;
}

EXPORT int ibv_fork_init(void) { return 0; }

EXPORT enum ibv_fork_status ibv_is_fork_initialized(void)
{
	return IBV_FORK_UNNEEDED; /* the emulator pins nothing a child could lose */
}

EXPORT int ibv_read_sysfs_file(const char *dir, const char *file, char *buf, size_t size)
{
	(void)dir, (void)file, (void)buf, (void)size;
	errno = ENOENT; /* the emulated device has no sysfs directory */
	return -1;
}

EXPORT const char *ibv_get_sysfs_path(void) { return "/sys"; }

/* name_of returns names[i], or "unknown" past the table or for a hole in it. */
static const char *name_of(const char *const *names, size_t n, unsigned i)
{
	return i < n && names[i] ? names[i] : "unknown";
}
#define NAME_OF(names, i) name_of(names, sizeof names / sizeof names[0], (unsigned)(i))

EXPORT const char *ibv_node_type_str(enum ibv_node_type node_type)
{
	static const char *const names[] = {
		[IBV_NODE_CA] = "InfiniBand channel adapter", [IBV_NODE_SWITCH] = "InfiniBand switch",
		[IBV_NODE_ROUTER] = "InfiniBand router",      [IBV_NODE_RNIC] = "iWARP NIC",
		[IBV_NODE_USNIC] = "usNIC",                    [IBV_NODE_USNIC_UDP] = "usNIC UDP",
		[IBV_NODE_UNSPECIFIED] = "unspecified",
	};
	return NAME_OF(names, node_type); /* IBV_NODE_UNKNOWN (-1) is past the table */
}

EXPORT const char *ibv_port_state_str(enum ibv_port_state port_state)
{
	static const char *const names[] = {"no state change (NOP)", "down", "init", "armed", "active",
					    "active defer"};
	return NAME_OF(names, port_state);
}

EXPORT const char *ibv_event_type_str(enum ibv_event_type event)
{
	static const char *const names[] = {
		[IBV_EVENT_CQ_ERR] = "CQ error",
		[IBV_EVENT_QP_FATAL] = "local work queue catastrophic error",
		[IBV_EVENT_QP_REQ_ERR] = "invalid request local work queue error",
		[IBV_EVENT_QP_ACCESS_ERR] = "local access violation work queue error",
		[IBV_EVENT_COMM_EST] = "communication established",
		[IBV_EVENT_SQ_DRAINED] = "send queue drained",
		[IBV_EVENT_PATH_MIG] = "path migrated",
		[IBV_EVENT_PATH_MIG_ERR] = "path migration request error",
		[IBV_EVENT_DEVICE_FATAL] = "local catastrophic error",
		[IBV_EVENT_PORT_ACTIVE] = "port active",
		[IBV_EVENT_PORT_ERR] = "port error",
		[IBV_EVENT_LID_CHANGE] = "LID change",
		[IBV_EVENT_PKEY_CHANGE] = "P_Key change",
		[IBV_EVENT_SM_CHANGE] = "SM change",
		[IBV_EVENT_SRQ_ERR] = "SRQ catastrophic error",
		[IBV_EVENT_SRQ_LIMIT_REACHED] = "SRQ limit reached",
		[IBV_EVENT_QP_LAST_WQE_REACHED] = "last WQE reached",
		[IBV_EVENT_CLIENT_REREGISTER] = "client reregistration",
		[IBV_EVENT_GID_CHANGE] = "GID table change",
		[IBV_EVENT_WQ_FATAL] = "WQ fatal",
	};
	return NAME_OF(names, event);
}

EXPORT const char *ibv_wc_status_str(enum ibv_wc_status status)
{
	static const char *const names[] = {
		[IBV_WC_SUCCESS] = "success",
		[IBV_WC_LOC_LEN_ERR] = "local length error",
		[IBV_WC_LOC_QP_OP_ERR] = "local QP operation error",
		[IBV_WC_LOC_EEC_OP_ERR] = "local EE context operation error",
		[IBV_WC_LOC_PROT_ERR] = "local protection error",
		[IBV_WC_WR_FLUSH_ERR] = "Work Request Flushed Error",
		[IBV_WC_MW_BIND_ERR] = "memory management operation error",
		[IBV_WC_BAD_RESP_ERR] = "bad response error",
		[IBV_WC_LOC_ACCESS_ERR] = "local access error",
		[IBV_WC_REM_INV_REQ_ERR] = "remote invalid request error",
		[IBV_WC_REM_ACCESS_ERR] = "remote access error",
		[IBV_WC_REM_OP_ERR] = "remote operation error",
		[IBV_WC_RETRY_EXC_ERR] = "transport retry counter exceeded",
		[IBV_WC_RNR_RETRY_EXC_ERR] = "RNR retry counter exceeded",
		[IBV_WC_LOC_RDD_VIOL_ERR] = "local RDD violation error",
		[IBV_WC_REM_INV_RD_REQ_ERR] = "remote invalid RD request",
		[IBV_WC_REM_ABORT_ERR] = "aborted error",
		[IBV_WC_INV_EECN_ERR] = "invalid EE context number",
		[IBV_WC_INV_EEC_STATE_ERR] = "invalid EE context state",
		[IBV_WC_FATAL_ERR] = "fatal error",
		[IBV_WC_RESP_TIMEOUT_ERR] = "response timeout error",
		[IBV_WC_GENERAL_ERR] = "general error",
		[IBV_WC_TM_ERR] = "TM error",
		[IBV_WC_TM_RNDV_INCOMPLETE] = "TM software rendezvous",
	};
	return NAME_OF(names, status);
}

/* The IB rates: enum value, multiple of 2.5 Gb/s (0: not a multiple), Mb/s. */
static const struct {
	enum ibv_rate rate;
	int mult, mbps;
} rates[] = {
	{IBV_RATE_2_5_GBPS, 1, 2500},     {IBV_RATE_5_GBPS, 2, 5000},      {IBV_RATE_10_GBPS, 4, 10000},
	{IBV_RATE_20_GBPS, 8, 20000},     {IBV_RATE_30_GBPS, 12, 30000},   {IBV_RATE_40_GBPS, 16, 40000},
	{IBV_RATE_60_GBPS, 24, 60000},    {IBV_RATE_80_GBPS, 32, 80000},   {IBV_RATE_120_GBPS, 48, 120000},
	{IBV_RATE_14_GBPS, 0, 14062},     {IBV_RATE_56_GBPS, 0, 56250},    {IBV_RATE_112_GBPS, 0, 112500},
	{IBV_RATE_168_GBPS, 0, 168750},   {IBV_RATE_25_GBPS, 10, 25781},   {IBV_RATE_100_GBPS, 40, 103125},
	{IBV_RATE_200_GBPS, 80, 206250},  {IBV_RATE_300_GBPS, 120, 309375}, {IBV_RATE_28_GBPS, 11, 28125},
	{IBV_RATE_50_GBPS, 20, 53125},    {IBV_RATE_400_GBPS, 160, 425000}, {IBV_RATE_600_GBPS, 240, 637500},
	{IBV_RATE_800_GBPS, 320, 850000}, {IBV_RATE_1200_GBPS, 480, 1275000},
};
#define NRATES (sizeof rates / sizeof rates[0])

EXPORT int ibv_rate_to_mult(enum ibv_rate rate)
{
	for (size_t i = 0; i < NRATES; i++)
		if (rates[i].rate == rate)
			return rates[i].mult ? rates[i].mult : -1;
	return -1;
}

EXPORT enum ibv_rate mult_to_ibv_rate(int mult)
{
	for (size_t i = 0; i < NRATES; i++)
		if (rates[i].mult == mult && mult)
			return rates[i].rate;
	return IBV_RATE_MAX;
}

EXPORT int ibv_rate_to_mbps(enum ibv_rate rate)
{
	for (size_t i = 0; i < NRATES; i++)
		if (rates[i].rate == rate)
			return rates[i].mbps;
	return -1;
}

EXPORT enum ibv_rate mbps_to_ibv_rate(int mbps)
{
	for (size_t i = 0; i < NRATES; i++)
		if (rates[i].mbps == mbps)
			return rates[i].rate;
	return IBV_RATE_MAX;
}
