/* rdmashim's native completion handler ABI, for a ULP's C (docs/verbs.md, "Native
 * completion handlers"): the layouts a handler set with cq.set_native_handler gets, and
 * the table of verbs it may call. Include it from the directory
 * rdmashim.verbs.native.INCLUDE_DIR names. The built-in engine's _engine.h has the same
 * layouts (rs_wc, rs_hook_recv, rs_hook_send, rs_hook_verbs).
 *
 *     uint32_t handler(void *context, const rdmashim_verbs *v, void *cq, void *qp,
 *                      uint32_t qp_num);
 *
 * is called with the CQ's completions inside the engine's calls (or at once, by
 * qp.run_native_handler()); non-zero hands the CQ on to Python's handler.
 */
#ifndef RDMASHIM_NATIVE_HANDLER_H
#define RDMASHIM_NATIVE_HANDLER_H

#include <stdint.h>

/* One completion: verbs.WC_ROW */
typedef struct {
    uint64_t wr_id;
    uint32_t status;        /* WCStatus: 0 success */
    uint32_t opcode;        /* WCOpcode: 0 SEND, 128 RECV, ... */
    uint32_t byte_len;
    uint32_t qp_num;
    uint32_t wc_flags;
    uint32_t invalidated_rkey;
    uint32_t solicited;
} rdmashim_row;

/* One receive of one buffer */
typedef struct {
    uint64_t wr_id;
    uint64_t addr;
    uint32_t length;
    uint32_t lkey;
} rdmashim_recv;

/* One Send of one buffer, or an RDMA Write or Read of one local buffer */
typedef struct {
    uint64_t wr_id;
    uint64_t addr;
    uint32_t length;
    uint32_t lkey;
    uint32_t flags;         /* SendFlags: FENCE 1, SIGNALED 2, SOLICITED 4, INLINE 8 */
    uint32_t opcode;        /* RDMASHIM_SEND (0: zero-initialised is a Send), ... */
    uint64_t remote_addr;   /* an RDMA Write's or Read's peer buffer */
    uint32_t rkey;
} rdmashim_send;
#define RDMASHIM_SEND 0
#define RDMASHIM_RDMA_WRITE 1
#define RDMASHIM_RDMA_READ 2

typedef struct {
    /* up to n completions into rows */
    uint32_t (*poll)(void *cq, rdmashim_row *rows, uint32_t n);
    /* post n receives on qp; how many were taken */
    uint32_t (*post_recv)(void *qp, const rdmashim_recv *wrs, uint32_t n);
    /* post n Sends on qp; how many were taken */
    uint32_t (*post_send)(void *qp, const rdmashim_send *wrs, uint32_t n);
} rdmashim_verbs;

#endif
