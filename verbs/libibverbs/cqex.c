/*
 * Extended CQs (ibv_create_cq_ex): a CQ of qp.c that is also an ibv_cq_ex, polled with
 * ibv_start_poll, ibv_next_poll and ibv_end_poll, one completion at a time through
 * ibv_poll_cq's path (the doorbell included), and read with the ibv_wc_read_*
 * functions of the fields asked for. The standard fields are offered
 * (IBV_WC_STANDARD_FLAGS); timestamps, VLANs, flow tags and tag matching are not.
 */
#include <errno.h>

#include "emu.h"

static struct emu_cq *ecq(struct ibv_cq_ex *cq) { return container_of(cq, struct emu_cq, cq_ex); }

/* poll_one polls the next completion into cur: 0, ENOENT when the CQ is empty, or
 * EIO after an overrun (the CQ is in error). */
static int poll_one(struct ibv_cq_ex *cq)
{
	struct emu_cq *c = ecq(cq);
	int n = emu_poll_cq(&c->cq, 1, &c->cur);
	if (n < 0)
		return EIO;
	if (n == 0)
		return ENOENT;
	cq->status = c->cur.status;
	cq->wr_id = c->cur.wr_id;
	return 0;
}

static int start_poll(struct ibv_cq_ex *cq, struct ibv_poll_cq_attr *attr)
{
	if (attr->comp_mask)
		return EINVAL;
	return poll_one(cq);
}

static int next_poll(struct ibv_cq_ex *cq) { return poll_one(cq); }
static void end_poll(struct ibv_cq_ex *cq) { (void)cq; }
static enum ibv_wc_opcode read_opcode(struct ibv_cq_ex *cq) { return ecq(cq)->cur.opcode; }
static uint32_t read_vendor_err(struct ibv_cq_ex *cq) { return ecq(cq)->cur.vendor_err; }
static unsigned int read_wc_flags(struct ibv_cq_ex *cq) { return ecq(cq)->cur.wc_flags; }
static uint32_t read_byte_len(struct ibv_cq_ex *cq) { return ecq(cq)->cur.byte_len; }
static __be32 read_imm_data(struct ibv_cq_ex *cq) { return ecq(cq)->cur.imm_data; }
static uint32_t read_qp_num(struct ibv_cq_ex *cq) { return ecq(cq)->cur.qp_num; }
static uint32_t read_src_qp(struct ibv_cq_ex *cq) { return ecq(cq)->cur.src_qp; }
static uint32_t read_slid(struct ibv_cq_ex *cq) { return ecq(cq)->cur.slid; }
static uint8_t read_sl(struct ibv_cq_ex *cq) { return ecq(cq)->cur.sl; }
static uint8_t read_dlid_path_bits(struct ibv_cq_ex *cq) { return ecq(cq)->cur.dlid_path_bits; }

struct ibv_cq_ex *emu_create_cq_ex(struct ibv_context *context, struct ibv_cq_init_attr_ex *attr)
{
	if ((attr->wc_flags & ~(uint64_t)IBV_WC_STANDARD_FLAGS) ||
	    (attr->comp_mask & ~(uint32_t)IBV_CQ_INIT_ATTR_MASK_FLAGS) ||
	    ((attr->comp_mask & IBV_CQ_INIT_ATTR_MASK_FLAGS) && attr->flags)) {
		errno = EOPNOTSUPP; /* timestamps, VLANs, flow tags, tag matching, parent domains */
		return NULL;
	}
	if (attr->cqe > INT32_MAX) {
		errno = EINVAL;
		return NULL;
	}
	struct ibv_cq *cq = ibv_create_cq(context, (int)attr->cqe, attr->cq_context, attr->channel, (int)attr->comp_vector);
	if (!cq)
		return NULL;
	struct ibv_cq_ex *x = &container_of(cq, struct emu_cq, cq)->cq_ex;
	x->start_poll = start_poll;
	x->next_poll = next_poll;
	x->end_poll = end_poll;
	x->read_opcode = read_opcode;
	x->read_vendor_err = read_vendor_err;
	x->read_wc_flags = read_wc_flags;
	if (attr->wc_flags & IBV_WC_EX_WITH_BYTE_LEN)
		x->read_byte_len = read_byte_len;
	if (attr->wc_flags & IBV_WC_EX_WITH_IMM)
		x->read_imm_data = read_imm_data;
	if (attr->wc_flags & IBV_WC_EX_WITH_QP_NUM)
		x->read_qp_num = read_qp_num;
	if (attr->wc_flags & IBV_WC_EX_WITH_SRC_QP)
		x->read_src_qp = read_src_qp;
	if (attr->wc_flags & IBV_WC_EX_WITH_SLID)
		x->read_slid = read_slid;
	if (attr->wc_flags & IBV_WC_EX_WITH_SL)
		x->read_sl = read_sl;
	if (attr->wc_flags & IBV_WC_EX_WITH_DLID_PATH_BITS)
		x->read_dlid_path_bits = read_dlid_path_bits;
	return x;
}
