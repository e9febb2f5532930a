/* The native engine's core: one device's memory table, completion and receive
 * queues, and the RDMAP/DDP/MPA protocol state of each queue pair, in C.
 *
 * It is sans-IO, as the Python engine (engine.py) it is held to: received bytes
 * come in through rs_qp_rx, the bytes to send go out through rs_qp_tx and
 * rs_qp_tx_done, work requests through rs_qp_post_*, completions into rs_cq
 * rings. It follows the Python engine's rules exactly (the same Terminate codes
 * in the same order of checks, the same completions, the same bytes on the
 * wire); tests/test_native_engine.py holds the two to that with the same
 * streams. docs/native-engine.md has the design.
 *
 * Memory safety: a region is named by its STag everywhere; every copy into or
 * out of registered memory looks the region up and checks it first, and a
 * deregistration (rs_mem_remove) has every QP drop the work it started on the
 * region before it returns. Nothing a peer sends is trusted: every length and
 * offset is checked before it is used.
 */
#include "_engine.h"
#include "_accel.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>

/* A native completion handler (rs_cq_set_hook in _engine.h) */
typedef uint32_t (*rs_hook_fn)(void *context, const rs_hook_verbs *verbs, rs_cq *cq, rs_qp *qp,
                               uint32_t qp_num);

#define HDR_TAGGED 16
#define HDR_UNTAGGED 20
#define HDR_READ_REQUEST 48
#define CRC_LEN 4
#define MAX_HDR 48
#define RTR_STAG 1
#define DDP_TAGGED 0x80
#define DDP_LAST 0x40
#define DDP_VERSION 0x01
#define RDMAP_VERSION 0x40
#define MAX_ORD_IRD 128
#define TX_BUDGET (256 * 1024) /* bytes framed ahead of what TCP has taken */
#define DIRECT_MIN (16 * 1024) /* a Write's FPDU payload sent from its region from this size */
#define DIRECT_MAX 16          /* such payloads framed per write at most */

enum { OP_WRITE, OP_READ_REQUEST, OP_READ_RESPONSE, OP_SEND, OP_SEND_INV, OP_SEND_SE,
       OP_SEND_SE_INV, OP_TERMINATE };
enum { QN_SEND, QN_READ_REQUEST, QN_TERMINATE };
/* Terminate codes: layers, types, codes (terminate.py) */
enum { L_RDMAP = 0, L_DDP = 1, L_LLP = 2 };
enum { T_RDMAP_CATASTROPHIC = 0, T_REMOTE_PROTECTION = 1, T_REMOTE_OPERATION = 2 };
enum { T_DDP_CATASTROPHIC = 0, T_DDP_TAGGED = 1, T_DDP_UNTAGGED = 2 };
enum { C_INVALID_STAG = 0, C_BASE_BOUNDS = 1, C_ACCESS_RIGHTS = 2, C_STAG_NOT_ASSOC = 3,
       C_TO_WRAP = 4, C_VERSION = 5, C_OPCODE = 6, C_CATASTROPHIC_STREAM = 7,
       C_CANNOT_INVALIDATE = 9, C_UNSPECIFIED = 0xFF };
enum { D_INVALID_STAG = 0, D_BASE_BOUNDS = 1, D_STAG_NOT_ASSOC = 2, D_TO_WRAP = 3,
       D_VERSION = 4 };
enum { U_INVALID_QN = 1, U_MSN_NO_BUFFER = 2, U_MSN_RANGE = 3, U_INVALID_MO = 4,
       U_VERSION = 6 };
enum { M_CRC = 2, M_FPDU_START = 3 };
/* Why an access to registered memory is refused (memory.py's Violation) */
enum { V_OK, V_INVALID_STAG, V_PD, V_ACCESS, V_BOUNDS };

static const uint8_t header_len[8] = {HDR_TAGGED, HDR_READ_REQUEST, HDR_TAGGED, HDR_UNTAGGED,
                                      HDR_UNTAGGED, HDR_UNTAGGED, HDR_UNTAGGED, HDR_UNTAGGED};

static inline uint16_t be16(const uint8_t *p) { return (uint16_t)(p[0] << 8 | p[1]); }
static inline uint32_t be32(const uint8_t *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}
static inline uint64_t be64(const uint8_t *p) { return (uint64_t)be32(p) << 32 | be32(p + 4); }
static inline void put16(uint8_t *p, uint32_t v) { p[0] = (uint8_t)(v >> 8); p[1] = (uint8_t)v; }
static inline void put32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)(v >> 24); p[1] = (uint8_t)(v >> 16); p[2] = (uint8_t)(v >> 8);
    p[3] = (uint8_t)v;
}
static inline void put64(uint8_t *p, uint64_t v) { put32(p, (uint32_t)(v >> 32)); put32(p + 4, (uint32_t)v); }
static inline uint32_t pad_of(uint32_t ulpdu_len) { return (uint32_t)(-(ulpdu_len + 2)) & 3; }

/* The 48 header bytes of an RDMA Read Request (untagged, QN 1, MO 0, last). */
static void put_read_request(uint8_t *p, uint32_t msn, uint32_t sink_stag, uint64_t sink_to,
                             uint32_t size, uint32_t src_stag, uint64_t src_to)
{
    put16(p, HDR_READ_REQUEST - 2);
    p[2] = DDP_LAST | DDP_VERSION;
    p[3] = RDMAP_VERSION | OP_READ_REQUEST;
    put32(p + 4, 0);
    put32(p + 8, QN_READ_REQUEST);
    put32(p + 12, msn);
    put32(p + 16, 0);
    put32(p + 20, sink_stag);
    put64(p + 24, sink_to);
    put32(p + 32, size);
    put32(p + 36, src_stag);
    put64(p + 40, src_to);
}

/* ------------------------------------------------------------------ memory */
typedef struct {
    uint32_t stag;
    int valid;
    uint8_t *base;
    uint64_t iova;
    uint64_t length;
    uint32_t access;
    uint64_t pd;
} rs_region;

struct rs_mem {
    rs_region **slots; /* open addressing by STag index, linear probing */
    uint32_t cap;      /* a power of 2 */
    uint32_t count;
    rs_qp *qps;        /* every QP of the device, for deregistration */
    int dead;          /* rs_mem_free was called: freed when its last QP is */
    rs_mem_view v;     /* epoch: regions removed or invalidated ever */
    pthread_mutex_t lock; /* the device's lock: see "One caller at a time" below */
};

static uint32_t slot_of(const rs_mem *mem, uint32_t index)
{
    return (index * 2654435761u) & (mem->cap - 1);
}

rs_mem *rs_mem_new(void)
{
    rs_mem *mem = calloc(1, sizeof *mem);
    if (!mem)
        return NULL;
    mem->cap = 64;
    mem->slots = calloc(mem->cap, sizeof *mem->slots);
    pthread_mutexattr_t recursive;
    pthread_mutexattr_init(&recursive);
    pthread_mutexattr_settype(&recursive, PTHREAD_MUTEX_RECURSIVE);
    int failed = !mem->slots || pthread_mutex_init(&mem->lock, &recursive);
    pthread_mutexattr_destroy(&recursive);
    if (failed) {
        free(mem->slots);
        free(mem);
        return NULL;
    }
    rs_init();
    return mem;
}

/* A table, CQ or SRQ that its owner freed lives on while a QP uses it (rs_qp_free of
 * the last one frees it): the owners may close them in any order. */
void rs_mem_free(rs_mem *mem)
{
    if (!mem)
        return;
    pthread_mutex_lock(&mem->lock);
    mem->dead = 1;
    int used = mem->qps != NULL;
    pthread_mutex_unlock(&mem->lock);
    if (used)
        return;
    pthread_mutex_destroy(&mem->lock);
    for (uint32_t i = 0; i < mem->cap; i++)
        free(mem->slots[i]);
    free(mem->slots);
    free(mem);
}

static rs_region *mem_find(const rs_mem *mem, uint32_t stag)
{
    uint32_t index = stag >> 8;
    for (uint32_t s = slot_of(mem, index);; s = (s + 1) & (mem->cap - 1)) {
        rs_region *r = mem->slots[s];
        if (!r)
            return NULL;
        if (r->stag >> 8 == index)
            return r->stag == stag ? r : NULL;
    }
}

/* The valid region an STag names, or NULL. */
static rs_region *mem_lookup(const rs_mem *mem, uint32_t stag)
{
    rs_region *r = mem_find(mem, stag);
    return r && r->valid ? r : NULL;
}

static int mem_grow(rs_mem *mem)
{
    uint32_t old_cap = mem->cap;
    rs_region **old = mem->slots;
    rs_region **slots = calloc((size_t)old_cap * 2, sizeof *slots);
    if (!slots)
        return -1;
    mem->slots = slots;
    mem->cap = old_cap * 2;
    for (uint32_t i = 0; i < old_cap; i++) {
        if (!old[i])
            continue;
        uint32_t s = slot_of(mem, old[i]->stag >> 8);
        while (slots[s])
            s = (s + 1) & (mem->cap - 1);
        slots[s] = old[i];
    }
    free(old);
    return 0;
}

static int rs_mem_add_in_lock(rs_mem *mem, uint32_t stag, uint8_t *base, uint64_t iova, uint64_t length,
                               uint32_t access, uint64_t pd)
{
    if (stag >> 8 == 0 || (length && iova > UINT64_MAX - (length - 1)))
        return -EINVAL;
    if (mem_find(mem, stag) || (mem->count + 1) * 2 > mem->cap) {
        if (mem_find(mem, stag))
            return -EEXIST;
        if (mem_grow(mem))
            return -ENOMEM;
    }
    uint32_t s = slot_of(mem, stag >> 8);
    while (mem->slots[s]) {
        if (mem->slots[s]->stag >> 8 == stag >> 8)
            return -EEXIST;
        s = (s + 1) & (mem->cap - 1);
    }
    rs_region *r = calloc(1, sizeof *r);
    if (!r)
        return -ENOMEM;
    *r = (rs_region){stag, 1, base, iova, length, access, pd};
    mem->slots[s] = r;
    mem->count++;
    return 0;
}

static int rs_mem_valid_in_lock(rs_mem *mem, uint32_t stag) { return mem_lookup(mem, stag) != NULL; }
rs_mem_view *rs_mem_view_of(rs_mem *mem) { return &mem->v; }

/* Check [addr, addr + len) of region r for access rights; *p its first byte. */
static int region_locate(const rs_region *r, uint64_t pd, uint64_t addr, uint64_t len,
                         uint32_t access, uint8_t **p)
{
    if (!r)
        return V_INVALID_STAG;
    if (r->pd != pd)
        return V_PD;
    if (access & ~r->access)
        return V_ACCESS;
#ifndef RS_FUZZ_SELFTEST /* (tools/native_fuzz.c's self-test: the harness must catch this) */
    if (addr < r->iova || len > r->length || addr - r->iova > r->length - len)
        return V_BOUNDS;
#endif
    *p = r->base + (addr - r->iova);
    return V_OK;
}

/* The same for the valid region stag names (an access that starts now). */
static int mem_locate(const rs_mem *mem, uint32_t stag, uint64_t pd, uint64_t addr, uint64_t len,
                      uint32_t access, uint8_t **p)
{
    return region_locate(mem_lookup(mem, stag), pd, addr, len, access, p);
}

/* The same for the region stag names, valid or invalidated since the access started
 * (a peer's Send with Invalidate does not stop a message in progress, as in the
 * Python engine; a deregistration does: the region is gone, and the QP was stopped). */
static int mem_locate_started(const rs_mem *mem, uint32_t stag, uint64_t pd, uint64_t addr,
                              uint64_t len, uint32_t access, uint8_t **p)
{
    return region_locate(mem_find(mem, stag), pd, addr, len, access, p);
}

/* ------------------------------------------------------------------ queues */
struct rs_cq {
    rs_cq_view v; /* pushed, notable, count, overrun */
    rs_wc *ring;
    uint32_t cap, head;
    uint32_t refs; /* QPs completing here */
    int dead;
    pthread_mutex_t *lock; /* its QPs' device lock (set by the first QP) */
    rs_hook_fn hook;       /* its native handler (rs_cq_set_hook), or NULL */
    void *hook_context;
    int hooking;           /* the handler runs now (it is not called again from inside) */
};

rs_cq *rs_cq_new(uint32_t cqe)
{
    if (cqe == 0)
        return NULL;
    rs_cq *cq = calloc(1, sizeof *cq);
    if (!cq)
        return NULL;
    cq->ring = calloc(cqe, sizeof *cq->ring);
    if (!cq->ring) {
        free(cq);
        return NULL;
    }
    cq->cap = cqe;
    return cq;
}

void rs_cq_free(rs_cq *cq)
{
    if (!cq)
        return;
    cq->dead = 1;
    if (cq->refs == 0) {
        free(cq->ring);
        free(cq);
    }
}

static void cq_unref(rs_cq *cq)
{
    if (--cq->refs == 0 && cq->dead)
        rs_cq_free(cq);
}

static int cq_push(rs_cq *cq, const rs_wc *wc)
{
    cq->v.pushed++;
    if (wc->solicited || wc->status != RS_WC_SUCCESS)
        cq->v.notable++;
    if (cq->v.count == cq->cap) {
        cq->v.overrun = 1;
        return -1;
    }
    cq->ring[(cq->head + cq->v.count) % cq->cap] = *wc;
    cq->v.count++;
    return 0;
}

static uint32_t rs_cq_poll_in_lock(rs_cq *cq, rs_wc *out, uint32_t n)
{
    uint32_t k = 0;
    while (k < n && cq->v.count) {
        out[k++] = cq->ring[cq->head];
        cq->head = (cq->head + 1) % cq->cap;
        cq->v.count--;
    }
    return k;
}

/* What rows out[0..k) have in common (rs_wc_sum). */
static void sum_rows(const rs_wc *out, uint32_t k, rs_wc_sum *sum)
{
    uint32_t odd = 0, opcode = k ? out[0].opcode : 0, qp_num = k ? out[0].qp_num : 0;
    for (uint32_t i = 0; i < k; i++) {
        const rs_wc *w = &out[i];
        odd |= (w->status ? RS_SUM_STATUS : 0) | (w->wc_flags ? RS_SUM_FLAGS : 0) |
               (w->solicited ? RS_SUM_SOLICITED : 0) | (w->invalidated_rkey ? RS_SUM_INV : 0) |
               (w->opcode != opcode ? RS_SUM_OPCODES : 0) |
               (w->qp_num != qp_num ? RS_SUM_QPS : 0) | (w->byte_len ? RS_SUM_LENGTHS : 0);
    }
    sum->odd = odd;
    sum->opcode = opcode;
    sum->qp_num = qp_num;
}

static uint32_t rs_cq_poll_sum_in_lock(rs_cq *cq, rs_wc *out, uint32_t n, rs_wc_sum *sum)
{
    uint32_t k = rs_cq_poll(cq, out, n);
    sum_rows(out, k, sum);
    return k;
}

rs_cq_view *rs_cq_view_of(rs_cq *cq) { return &cq->v; }

void rs_cq_set_hook(rs_cq *cq, void *fn, void *context)
{
    pthread_mutex_t *lock = cq->lock; /* (none before its first QP: no call runs it yet) */
    if (lock)
        pthread_mutex_lock(lock);
    cq->hook = (rs_hook_fn)fn;
    cq->hook_context = fn ? context : NULL;
    cq->v.wanted = 0;
    if (lock)
        pthread_mutex_unlock(lock);
}

typedef struct {
    rs_recv_wr *ring;
    uint32_t cap, head, count;
} rs_rq;

static int rq_init(rs_rq *q, uint32_t cap)
{
    q->ring = calloc(cap ? cap : 1, sizeof *q->ring);
    q->cap = cap;
    q->head = q->count = 0;
    return q->ring ? 0 : -1;
}

static uint32_t rq_post(rs_rq *q, const rs_recv_wr *wrs, uint32_t n)
{
    uint32_t k = 0;
    for (; k < n && q->count < q->cap; k++) {
        q->ring[(q->head + q->count) % q->cap] = wrs[k];
        q->count++;
    }
    return k;
}

static int rq_take(rs_rq *q, rs_recv_wr *out)
{
    if (!q->count)
        return 0;
    *out = q->ring[q->head];
    q->head = (q->head + 1) % q->cap;
    q->count--;
    return 1;
}

struct rs_srq {
    rs_rq q;
    uint32_t refs;
    int dead;
    pthread_mutex_t *lock; /* its QPs' device lock (set by the first QP) */
};

rs_srq *rs_srq_new(uint32_t max_wr)
{
    rs_srq *srq = calloc(1, sizeof *srq);
    if (srq && rq_init(&srq->q, max_wr)) {
        free(srq);
        return NULL;
    }
    return srq;
}

void rs_srq_free(rs_srq *srq)
{
    if (!srq)
        return;
    srq->dead = 1;
    if (srq->refs == 0) {
        free(srq->q.ring);
        free(srq);
    }
}

static uint32_t rs_srq_post_in_lock(rs_srq *srq, const rs_recv_wr *wrs, uint32_t n)
{
    return rq_post(&srq->q, wrs, n);
}

/* ------------------------------------------------------------------ the QP */
#define SMALL_INLINE 128 /* inline bytes kept in the entry itself (no malloc) */

typedef struct {
    rs_send_wr wr;
    uint8_t *data;       /* the inline copy (small, or malloc'd), or NULL */
    uint64_t length;     /* payload bytes (a Read: bytes to read) */
    uint64_t done_at;    /* tx_total once its last byte was framed */
    uint32_t msn;        /* a Read's Request MSN */
    uint64_t received;   /* a Read's response bytes placed */
    int framed;          /* its last FPDU was framed (a Read: its Request) */
    int done;
    uint32_t status;
    uint8_t small[SMALL_INLINE];
} sq_entry;

/* Let go of an entry's inline copy. */
static void entry_release(sq_entry *e)
{
    if (e->data != e->small)
        free(e->data);
    e->data = NULL;
}

typedef struct {
    uint32_t sink_stag, src_stag;
    uint64_t sink_to, src_to;
    uint32_t size;
} irq_entry;

enum { RX_HDR, RX_PAYLOAD, RX_TRAILER, RX_DISCARD };
enum { CUR_NONE, CUR_SQ, CUR_IRQ };

struct rs_qp {
    rs_qp_view v; /* news, sq_depth (live); rx_owed, tx_ready (publish()) */
    rs_mem *mem;
    rs_qp *next_in_mem, *prev_in_mem;
    uint64_t pd;
    uint32_t qp_num;
    rs_cq *scq, *rcq;
    rs_srq *srq;
    rs_rq rq;
    int sq_sig_all;
    int state;
    rs_error err;
    int crc;
    uint32_t ird, ord, max_fpdu;
    int rtr_pending;
    /* send side */
    sq_entry *sq;                 /* posted, not completed: [sq_head, sq_head + sq_count) */
    uint32_t sq_cap, sq_head, sq_started; /* v.sq_depth: posted; sq_started: framed or begun */
    uint32_t max_send_wr;
    uint32_t orq[MAX_ORD_IRD];    /* SQ positions (offsets from sq_head are unstable: absolute) */
    uint64_t orq_seq[MAX_ORD_IRD];
    uint32_t orq_head, orq_count;
    int orq_rtr;                  /* the RTR Read is outstanding (no SQ entry) */
    irq_entry irq[MAX_ORD_IRD];
    uint32_t irq_head, irq_count, responding;
    uint64_t sq_seq0;             /* absolute number of the entry at sq_head */
    int cur;                      /* CUR_*: the message being framed */
    uint64_t cur_seq;             /* its SQ number */
    irq_entry cur_irq;
    uint64_t cur_off;
    uint32_t tx_msn[3];
    uint8_t *tx;
    size_t tx_off, tx_len, tx_cap;
    uint64_t tx_total, tx_taken;  /* bytes framed ever; bytes TCP has taken */
    int direct_fd;                /* while rs_qp_write_fd frames: its socket (else -1): the
                                   * payload of a large Write's FPDU stays in its region */
    struct {
        size_t at;                /* the transmit buffer's bytes (from tx_off) before it */
        const uint8_t *from;
        uint32_t len;
    } direct[DIRECT_MAX];         /* those payloads, in order (direct_flush sends them) */
    uint32_t direct_n;
    uint64_t direct_bytes;
    int terminate_queued;
    /* receive side */
    uint32_t rx_msn[3];
    int rx;
    uint8_t hdr[MAX_HDR];
    uint32_t hdr_have;
    uint32_t op, last, ulpdu_len, payload, remaining;
    uint32_t stag, qn, msn, mo, inv_stag, sink_stag, read_size, src_stag;
    uint64_t to, sink_to, src_to;
    uint32_t crc_state;
    uint8_t trailer[8];
    uint32_t trailer_have, trailer_need;
    uint64_t place_to;            /* a Write's TO of the next payload byte */
    int send_open;                /* a Send message is being received */
    rs_recv_wr send_wr;
    uint64_t send_len, send_received;
    uint32_t send_status;
    uint8_t term_body[4 + MAX_HDR];
    uint32_t term_have;
    uint8_t *rxbuf;               /* what rs_qp_read_fd reads into (made at the first read) */
    uint64_t rx_total;            /* bytes received ever */
    int overrun;                  /* a completion did not fit its CQ (settle() acts) */
};

static void enter_error(rs_qp *qp, uint32_t kind, const char *message, int remote_quoted_read,
                        uint32_t quoted_msn, uint32_t remote_status);

static void set_error_info(rs_qp *qp, uint32_t kind, uint32_t layer, uint32_t etype,
                           uint32_t ecode, const char *message)
{
    if (qp->err.kind != RS_ERR_NONE)
        return;
    qp->err.kind = kind;
    qp->err.layer = layer;
    qp->err.etype = etype;
    qp->err.ecode = ecode;
    snprintf(qp->err.message, sizeof qp->err.message, "%s", message);
}

rs_qp *rs_qp_new(rs_mem *mem, uint64_t pd, uint32_t qp_num, rs_cq *send_cq, rs_cq *recv_cq,
                 rs_srq *srq, uint32_t max_send_wr, uint32_t max_recv_wr, int sq_sig_all)
{
    rs_qp *qp = calloc(1, sizeof *qp);
    if (!qp)
        return NULL;
    qp->mem = mem;
    qp->pd = pd;
    qp->qp_num = qp_num;
    qp->scq = send_cq;
    qp->rcq = recv_cq;
    qp->srq = srq;
    qp->sq_sig_all = sq_sig_all;
    qp->max_send_wr = max_send_wr;
    qp->sq_cap = max_send_wr + 1;
    qp->sq = calloc(qp->sq_cap, sizeof *qp->sq);
    qp->tx_cap = 16 * 1024; /* grows as needed */
    qp->direct_fd = -1;
    qp->tx = malloc(qp->tx_cap);
    if (!qp->sq || !qp->tx || rq_init(&qp->rq, srq ? 0 : max_recv_wr)) {
        free(qp->sq);
        free(qp->tx);
        free(qp->rq.ring);
        free(qp);
        return NULL;
    }
    qp->crc = 1;
    qp->ird = qp->ord = 16;
    qp->max_fpdu = 65536;
    qp->rx_msn[0] = qp->rx_msn[1] = qp->rx_msn[2] = 1;
    qp->state = RS_QP_IDLE;
    pthread_mutex_lock(&mem->lock);
    send_cq->refs++;
    recv_cq->refs++;
    send_cq->lock = recv_cq->lock = &mem->lock;
    if (srq) {
        srq->refs++;
        srq->lock = &mem->lock;
    }
    qp->next_in_mem = mem->qps;
    if (mem->qps)
        mem->qps->prev_in_mem = qp;
    mem->qps = qp;
    pthread_mutex_unlock(&mem->lock);
    return qp;
}

void rs_qp_free(rs_qp *qp)
{
    if (!qp)
        return;
    rs_mem *mem = qp->mem;
    pthread_mutex_lock(&mem->lock);
    if (qp->prev_in_mem)
        qp->prev_in_mem->next_in_mem = qp->next_in_mem;
    else
        qp->mem->qps = qp->next_in_mem;
    if (qp->next_in_mem)
        qp->next_in_mem->prev_in_mem = qp->prev_in_mem;
    for (uint32_t i = 0; i < qp->v.sq_depth; i++)
        entry_release(&qp->sq[(qp->sq_head + i) % qp->sq_cap]);
    free(qp->sq);
    free(qp->tx);
    free(qp->rq.ring);
    free(qp->rxbuf);
    cq_unref(qp->scq);
    cq_unref(qp->rcq);
    if (qp->srq && --qp->srq->refs == 0 && qp->srq->dead)
        rs_srq_free(qp->srq);
    int last = !mem->qps && mem->dead;
    free(qp);
    pthread_mutex_unlock(&mem->lock);
    if (last)
        rs_mem_free(mem);
}

int rs_qp_state(rs_qp *qp) { return qp->state; }
void rs_qp_error(rs_qp *qp, rs_error *out) { *out = qp->err; }
rs_qp_view *rs_qp_view_of(rs_qp *qp) { return &qp->v; }
int rs_qp_rtr_pending(rs_qp *qp) { return qp->rtr_pending; }
uint64_t rs_qp_rx_total(rs_qp *qp) { return qp->rx_total; }

static sq_entry *sq_at(rs_qp *qp, uint64_t seq)
{
    return &qp->sq[(qp->sq_head + (uint32_t)(seq - qp->sq_seq0)) % qp->sq_cap];
}

/* ---- transmit buffer */
static uint8_t *tx_room(rs_qp *qp, size_t n)
{
    if (qp->tx_off && qp->tx_off == qp->tx_len)
        qp->tx_off = qp->tx_len = 0;
    if (qp->tx_cap - qp->tx_len < n) {
        if (qp->tx_off) {
            memmove(qp->tx, qp->tx + qp->tx_off, qp->tx_len - qp->tx_off);
            qp->tx_len -= qp->tx_off;
            qp->tx_off = 0;
        }
        if (qp->tx_cap - qp->tx_len < n) {
            size_t cap = qp->tx_cap;
            while (cap - qp->tx_len < n)
                cap *= 2;
            uint8_t *tx = realloc(qp->tx, cap);
            if (!tx)
                return NULL;
            qp->tx = tx;
            qp->tx_cap = cap;
        }
    }
    return qp->tx + qp->tx_len;
}

/* Write an FPDU's trailer at t: pad zero bytes, then the CRC (little-endian), which goes
 * on from crc, summed over the bytes before the trailer (when the QP checks CRCs). */
static void put_trailer(const rs_qp *qp, uint8_t *t, uint32_t pad, uint32_t crc)
{
    memset(t, 0, pad + CRC_LEN);
    if (qp->crc) {
        uint32_t c = rs_crc32c(crc, t, pad);
        t[pad] = (uint8_t)c;
        t[pad + 1] = (uint8_t)(c >> 8);
        t[pad + 2] = (uint8_t)(c >> 16);
        t[pad + 3] = (uint8_t)(c >> 24);
    }
}

/* Close the FPDU whose header and payload (ulpdu_len + 2 bytes) are at p: PAD, CRC. */
static void tx_seal(rs_qp *qp, uint8_t *p, uint32_t ulpdu_len)
{
    uint32_t pad = pad_of(ulpdu_len);
    uint32_t n = ulpdu_len + 2;
    put_trailer(qp, p + n, pad, qp->crc ? rs_crc32c(0, p, n) : 0);
    qp->tx_len += n + pad + CRC_LEN;
    qp->tx_total += n + pad + CRC_LEN;
}

/* ---- completions */
static void complete(rs_qp *qp, rs_cq *cq, uint64_t wr_id, uint32_t status, uint32_t opcode,
                     uint32_t byte_len, uint32_t flags, uint32_t inv, uint32_t solicited)
{
    rs_wc wc = {wr_id, status, opcode, byte_len, qp->qp_num, flags, inv, solicited};
    qp->v.news |= RS_NEWS_CQ;
    /* Not ERROR at once: a completion comes from inside loops over the queues (drain_sq)
     * that entering ERROR would change under them. settle() does it at the end of the
     * call, as the Python engine fails the QPs of an overrun CQ after the event. */
    if (cq_push(cq, &wc) && qp->state == RS_QP_RTS)
        qp->overrun = 1;
}

static int head_may_start(rs_qp *qp);
static uint64_t rx_owed(rs_qp *qp);

/* Bring the view's computed fields up to date (rs_qp_view in _engine.h). */
static void publish(rs_qp *qp)
{
    qp->v.rx_owed = rx_owed(qp);
    qp->v.tx_ready = qp->tx_len > qp->tx_off ||
                     (qp->state == RS_QP_RTS && !qp->rtr_pending &&
                      (qp->cur != CUR_NONE || qp->irq_count || head_may_start(qp)));
}

/* What a native handler may call: the in-lock poll, and receives of one buffer each. */
static uint32_t post_recv(rs_qp *qp, const rs_recv_wr *wrs, uint32_t n);

static uint32_t hook_post_recv(rs_qp *qp, const rs_hook_recv *wrs, uint32_t n)
{
    uint32_t k;
    for (k = 0; k < n; k++) {
        rs_recv_wr w;
        memset(&w, 0, sizeof w);
        w.wr_id = wrs[k].wr_id;
        w.num_sge = 1;
        w.sg_list[0].addr = wrs[k].addr;
        w.sg_list[0].length = wrs[k].length;
        w.sg_list[0].lkey = wrs[k].lkey;
        if (post_recv(qp, &w, 1) != 1)
            break;
    }
    return k;
}

static uint32_t post_send(rs_qp *qp, const rs_send_wr *wrs, uint32_t n, int *why);

static uint32_t hook_post_send(rs_qp *qp, const rs_hook_send *wrs, uint32_t n)
{
    static const uint32_t opcodes[] = {RS_WR_SEND, RS_WR_RDMA_WRITE, RS_WR_RDMA_READ};
    uint32_t k;
    for (k = 0; k < n; k++) {
        rs_send_wr w;
        int why;
        if (wrs[k].opcode >= sizeof opcodes / sizeof opcodes[0])
            break; /* (not one a handler may post: not taken) */
        memset(&w, 0, sizeof w);
        w.wr_id = wrs[k].wr_id;
        w.opcode = opcodes[wrs[k].opcode];
        w.remote_addr = wrs[k].remote_addr;
        w.rkey = wrs[k].rkey;
        w.flags = wrs[k].flags & (RS_FENCE | RS_SIGNALED | RS_SOLICITED | RS_INLINE);
        w.num_sge = 1;
        w.sg_list[0].addr = wrs[k].addr;
        w.sg_list[0].length = wrs[k].length;
        w.sg_list[0].lkey = wrs[k].lkey;
        if (post_send(qp, &w, 1, &why) != 1)
            break;
    }
    return k;
}

static const rs_hook_verbs hook_verbs = {rs_cq_poll_in_lock, hook_post_recv, hook_post_send};

/* Run cq's native handler, if it has one and completions wait or (force) always; not
 * from inside it. */
static void run_hook(rs_qp *qp, rs_cq *cq, int force)
{
    if (!cq->hook || cq->hooking || (!cq->v.count && !force))
        return;
    cq->hooking = 1;
    uint32_t want = cq->hook(cq->hook_context, &hook_verbs, cq, qp, qp->qp_num);
    cq->hooking = 0;
    if (want)
        cq->v.wanted = 1;
}

/* The end of every public call on a QP: a completion that did not fit moves it to ERROR,
 * the native handlers of its CQs take what waits there, and the view says what is now.
 * A QP whose one CQ's handler took every completion and asked for nothing has no news
 * of completions left (the provider has nothing to hand on). */
static void settle(rs_qp *qp)
{
    if (qp->overrun && qp->state == RS_QP_RTS)
        enter_error(qp, RS_ERR_CQ_OVERRUN, "completion queue overrun", 0, 0, 0);
    qp->overrun = 0;
    rs_cq *cq = qp->rcq;
    if (cq->hook) {
        run_hook(qp, cq, 0);
        if (qp->scq != cq)
            run_hook(qp, qp->scq, 0);
        else if (!cq->v.count && !cq->v.wanted && !cq->v.overrun)
            qp->v.news &= ~(uint32_t)RS_NEWS_CQ;
    } else if (qp->scq->hook) {
        run_hook(qp, qp->scq, 0);
    }
    publish(qp);
}

static uint32_t wc_opcode(uint32_t wr_opcode)
{
    return wr_opcode == RS_WR_RDMA_WRITE ? RS_WC_RDMA_WRITE
           : wr_opcode == RS_WR_RDMA_READ ? RS_WC_RDMA_READ
                                          : RS_WC_SEND;
}

/* Complete the SQ entries at the head that are done, in posting order. */
static void drain_sq(rs_qp *qp)
{
    while (qp->v.sq_depth) {
        sq_entry *e = &qp->sq[qp->sq_head];
        int done = e->done || (e->framed && e->wr.opcode != RS_WR_RDMA_READ &&
                               e->status == RS_WC_SUCCESS && qp->tx_taken >= e->done_at);
        if (!done || qp->sq_started == 0)
            break;
        if (e->status != RS_WC_SUCCESS || qp->sq_sig_all || (e->wr.flags & RS_SIGNALED))
            complete(qp, qp->scq, e->wr.wr_id, e->status, wc_opcode(e->wr.opcode),
                     e->wr.opcode == RS_WR_RDMA_READ ? (uint32_t)e->length : 0, 0, 0, 0);
        entry_release(e);
        qp->sq_head = (qp->sq_head + 1) % qp->sq_cap;
        qp->v.sq_depth--;
        qp->sq_started--;
        qp->sq_seq0++;
    }
}

/* ---- Terminate */
static void queue_terminate(rs_qp *qp, uint32_t layer, uint32_t etype, uint32_t ecode,
                            const uint8_t *copied, uint32_t copied_len, int ddp_flag,
                            int rdmap_flag)
{
    if (qp->state != RS_QP_RTS)
        return;
    uint32_t body = 4 + copied_len;
    uint32_t ulpdu = HDR_UNTAGGED - 2 + body;
    uint8_t *p = tx_room(qp, ulpdu + 2 + 3 + CRC_LEN);
    if (!p)
        return;
    put16(p, ulpdu);
    p[2] = DDP_LAST | DDP_VERSION;
    p[3] = RDMAP_VERSION | OP_TERMINATE;
    put32(p + 4, 0);
    put32(p + 8, QN_TERMINATE);
    put32(p + 12, 1);
    put32(p + 16, 0);
    uint32_t word = (layer & 0xF) << 28 | (etype & 0xF) << 24 | (ecode & 0xFF) << 16;
    if (copied_len)
        word |= 0x8000;
    if (ddp_flag)
        word |= 0x4000;
    if (rdmap_flag)
        word |= 0x2000;
    put32(p + 20, word);
    if (copied_len)
        memcpy(p + 24, copied, copied_len);
    tx_seal(qp, p, ulpdu);
    qp->terminate_queued = 1;
}

/* Re-encode the header being received, for a Terminate's copy of it; its length. */
static uint32_t quoted_header(const rs_qp *qp, uint8_t *out)
{
    uint32_t op = qp->op;
    uint32_t payload = qp->payload;
    if (op == OP_WRITE || op == OP_READ_RESPONSE) {
        put16(out, HDR_TAGGED - 2 + payload);
        out[2] = DDP_TAGGED | (qp->last ? DDP_LAST : 0) | DDP_VERSION;
        out[3] = (uint8_t)(RDMAP_VERSION | op);
        put32(out + 4, qp->stag);
        put64(out + 8, qp->to);
        return HDR_TAGGED;
    }
    if (op == OP_READ_REQUEST) {
        put_read_request(out, qp->msn, qp->sink_stag, qp->sink_to, qp->read_size, qp->src_stag,
                         qp->src_to);
        return HDR_READ_REQUEST;
    }
    put16(out, HDR_UNTAGGED - 2 + payload);
    out[2] = (qp->last ? DDP_LAST : 0) | DDP_VERSION;
    out[3] = (uint8_t)(RDMAP_VERSION | op);
    put32(out + 4, qp->inv_stag);
    put32(out + 8, qp->qn);
    put32(out + 12, qp->msn);
    put32(out + 16, qp->mo);
    return HDR_UNTAGGED;
}

/* The peer broke the protocol: Terminate (quoting the header when `quote`: 1 as a DDP
 * header, 2 as an RDMAP header), ERROR, flush. */
static void protocol_error(rs_qp *qp, uint32_t layer, uint32_t etype, uint32_t ecode, int quote,
                           const char *message)
{
    uint8_t copied[MAX_HDR];
    uint32_t n = quote ? quoted_header(qp, copied) : 0;
    if (qp->send_open && qp->send_status != RS_WC_SUCCESS) {
        qp->send_open = 0;
        complete(qp, qp->rcq, qp->send_wr.wr_id, qp->send_status, RS_WC_RECV, 0, 0, 0, 0);
    }
    set_error_info(qp, RS_ERR_PROTOCOL, layer, etype, ecode, message);
    queue_terminate(qp, layer, etype, ecode, copied, n, quote == 1, quote == 2);
    enter_error(qp, RS_ERR_PROTOCOL, message, 0, 0, 0);
}

static void local_error(rs_qp *qp, uint32_t kind, const char *message)
{
    set_error_info(qp, kind, L_RDMAP, T_RDMAP_CATASTROPHIC, C_UNSPECIFIED, message);
    queue_terminate(qp, L_RDMAP, T_RDMAP_CATASTROPHIC, C_UNSPECIFIED, NULL, 0, 0, 0);
    enter_error(qp, kind, message, 0, 0, 0);
}

static void flush_rq(rs_qp *qp)
{
    rs_recv_wr wr;
    while (rq_take(&qp->rq, &wr))
        complete(qp, qp->rcq, wr.wr_id, RS_WC_WR_FLUSH_ERR, RS_WC_RECV, 0, 0, 0, 0);
}

static void enter_error(rs_qp *qp, uint32_t kind, const char *message, int remote_quoted_read,
                        uint32_t quoted_msn, uint32_t remote_status)
{
    if (qp->state == RS_QP_ERROR || qp->state == RS_QP_TERMINATE)
        return;
    set_error_info(qp, kind, 0, 0, 0, message);
    qp->rx = RX_DISCARD;
    qp->state = qp->terminate_queued ? RS_QP_TERMINATE : RS_QP_ERROR;
    qp->v.news |= RS_NEWS_STATE;
    if (remote_quoted_read) {
        for (uint32_t i = 0; i < qp->orq_count; i++) {
            uint64_t seq = qp->orq_seq[(qp->orq_head + i) % MAX_ORD_IRD];
            if (seq == UINT64_MAX)
                continue;
            sq_entry *e = sq_at(qp, seq);
            if (e->msn == quoted_msn) {
                e->done = 1;
                e->status = remote_status;
                break;
            }
        }
    }
    if (qp->cur == CUR_SQ) {
        sq_entry *e = sq_at(qp, qp->cur_seq);
        if (!e->done && !e->framed)
            e->status = RS_WC_WR_FLUSH_ERR;
    }
    qp->cur = CUR_NONE;
    for (uint32_t i = 0; i < qp->sq_started; i++) {
        sq_entry *e = &qp->sq[(qp->sq_head + i) % qp->sq_cap];
        int sent = e->framed && e->wr.opcode != RS_WR_RDMA_READ && qp->tx_taken >= e->done_at &&
                   e->status == RS_WC_SUCCESS;
        if (!e->done && !sent) {
            e->done = 1;
            if (e->status == RS_WC_SUCCESS)
                e->status = RS_WC_WR_FLUSH_ERR;
        }
        e->done = 1;
    }
    qp->orq_head = qp->orq_count = 0;
    qp->orq_rtr = 0;
    qp->irq_head = qp->irq_count = qp->responding = 0;
    drain_sq(qp);
    while (qp->v.sq_depth) { /* not started: flushed */
        sq_entry *e = &qp->sq[qp->sq_head];
        complete(qp, qp->scq, e->wr.wr_id, RS_WC_WR_FLUSH_ERR, wc_opcode(e->wr.opcode),
                 e->wr.opcode == RS_WR_RDMA_READ ? (uint32_t)e->length : 0, 0, 0, 0);
        entry_release(e);
        qp->sq_head = (qp->sq_head + 1) % qp->sq_cap;
        qp->v.sq_depth--;
        qp->sq_seq0++;
    }
    qp->sq_started = 0;
    if (qp->send_open) {
        qp->send_open = 0;
        complete(qp, qp->rcq, qp->send_wr.wr_id, RS_WC_WR_FLUSH_ERR, RS_WC_RECV, 0, 0, 0, 0);
    }
    flush_rq(qp);
    publish(qp); /* (also when a deregistration stops it, outside its own calls) */
}

static void rs_qp_set_error_in_lock(rs_qp *qp, uint32_t kind, const char *message)
{
    enter_error(qp, kind, message, 0, 0, 0);
}

/* ------------------------------------------------------------------ setup */
static int rs_qp_start_in_lock(rs_qp *qp, int crc, uint32_t ird, uint32_t ord, uint32_t max_fpdu, int rtr,
                                int wait_rtr)
{
    if (max_fpdu < 64 || max_fpdu > 65536 || ird > MAX_ORD_IRD || ord > MAX_ORD_IRD)
        return -1;
    qp->crc = crc;
    qp->ird = ird;
    qp->ord = ord;
    qp->max_fpdu = max_fpdu;
    qp->rtr_pending = wait_rtr;
    qp->state = RS_QP_RTS;
    if (rtr == 1) { /* a zero-length Write to the RTR STag */
        uint8_t *p = tx_room(qp, HDR_TAGGED + 3 + CRC_LEN);
        if (!p)
            return -1;
        put16(p, HDR_TAGGED - 2);
        p[2] = DDP_TAGGED | DDP_LAST | DDP_VERSION;
        p[3] = RDMAP_VERSION | OP_WRITE;
        put32(p + 4, RTR_STAG);
        put64(p + 8, 0);
        tx_seal(qp, p, HDR_TAGGED - 2);
    } else if (rtr == 2) { /* a zero-length Read Request, answered by a Read Response */
        uint8_t *p = tx_room(qp, HDR_READ_REQUEST + 3 + CRC_LEN);
        if (!p)
            return -1;
        put_read_request(p, ++qp->tx_msn[QN_READ_REQUEST], RTR_STAG, 0, 0, RTR_STAG, 0);
        tx_seal(qp, p, HDR_READ_REQUEST - 2);
        qp->orq_rtr = 1;
        qp->orq_seq[qp->orq_head] = UINT64_MAX;
        qp->orq_count = 1;
    }
    publish(qp);
    return 0;
}

/* ------------------------------------------------------------------ posting */
static uint32_t post_send(rs_qp *qp, const rs_send_wr *wrs, uint32_t n, int *why)
{
    *why = 0;
    for (uint32_t k = 0; k < n; k++) {
        const rs_send_wr *w = &wrs[k];
        uint64_t length = 0;
        if (w->num_sge > RS_MAX_SGE) {
            *why = EINVAL;
            return k;
        }
        for (uint32_t i = 0; i < w->num_sge; i++)
            length += w->sg_list[i].length;
        if (w->opcode != RS_WR_SEND && w->opcode != RS_WR_SEND_WITH_INV &&
            w->opcode != RS_WR_RDMA_WRITE && w->opcode != RS_WR_RDMA_READ) {
            *why = EOPNOTSUPP;
            return k;
        }
        if ((w->opcode == RS_WR_RDMA_READ && w->num_sge > 1) || length > UINT32_MAX ||
            (length && w->remote_addr > UINT64_MAX - (length - 1))) {
            *why = EINVAL;
            return k;
        }
        /* The next free entry (free even when the queue is full: the ring has one more). */
        sq_entry *e = &qp->sq[(qp->sq_head + qp->v.sq_depth) % qp->sq_cap];
        e->data = NULL;
        uint8_t *data = NULL;
        if ((w->flags & RS_INLINE) && w->opcode != RS_WR_RDMA_READ) {
            if (length > RS_MAX_INLINE) {
                *why = EINVAL;
                return k;
            }
            data = length <= SMALL_INLINE ? e->small : malloc(length);
            e->data = data;
            if (!data) {
                *why = ENOMEM;
                return k;
            }
            uint64_t off = 0;
            for (uint32_t i = 0; i < w->num_sge; i++) { /* inline: any registered region */
                const rs_sge *s = &w->sg_list[i];
                if (w->flags & RS_INLINE_RAW) { /* the provider's own bytes (InlineData) */
                    if (s->length)
                        memcpy(data + off, (const uint8_t *)(uintptr_t)s->addr, s->length);
                    off += s->length;
                    continue;
                }
                rs_region *r = mem_lookup(qp->mem, s->lkey);
                if (!r || s->addr < r->iova || s->length > r->length ||
                    s->addr - r->iova > r->length - s->length) {
                    entry_release(e);
                    *why = EINVAL;
                    return k;
                }
                memcpy(data + off, r->base + (s->addr - r->iova), s->length);
                off += s->length;
            }
        }
        if (qp->state != RS_QP_RTS) {
            entry_release(e);
            if (qp->state == RS_QP_IDLE) {
                *why = ENOTCONN;
                return k;
            }
            complete(qp, qp->scq, w->wr_id, RS_WC_WR_FLUSH_ERR, wc_opcode(w->opcode),
                     w->opcode == RS_WR_RDMA_READ ? (uint32_t)length : 0, 0, 0, 0);
            continue;
        }
        if (qp->v.sq_depth >= qp->max_send_wr) {
            entry_release(e);
            *why = ENOMEM;
            return k;
        }
        e->wr = *w;
        e->length = length;
        e->done_at = e->received = 0;
        e->msn = e->status = 0;
        e->framed = e->done = 0;
        qp->v.sq_depth++;
    }
    return n;
}

static uint32_t rs_qp_post_send_in_lock(rs_qp *qp, const rs_send_wr *wrs, uint32_t n, int *why)
{
    uint32_t r = post_send(qp, wrs, n, why);
    settle(qp);
    return r;
}

static uint32_t post_recv(rs_qp *qp, const rs_recv_wr *wrs, uint32_t n)
{
    if (qp->srq)
        return 0;
    uint32_t k = rq_post(&qp->rq, wrs, n);
    if (qp->state == RS_QP_ERROR || qp->state == RS_QP_TERMINATE)
        flush_rq(qp);
    return k;
}

static uint32_t rs_qp_post_recv_in_lock(rs_qp *qp, const rs_recv_wr *wrs, uint32_t n)
{
    uint32_t r = post_recv(qp, wrs, n);
    settle(qp);
    return r;
}

/* Post entries at[0..count) of table[0..n), in order, to qp's receive queue or (qp NULL)
 * to srq; all of the indices are checked first. */
static uint32_t post_at(rs_qp *qp, rs_srq *srq, const rs_recv_wr *table, uint32_t n,
                        const uint32_t *at, uint32_t count)
{
    for (uint32_t k = 0; k < count; k++)
        if (at[k] >= n)
            return RS_BAD_INDEX;
    uint32_t k = 0;
    while (k < count) {
        const rs_recv_wr *w = &table[at[k]];
        if ((qp ? post_recv(qp, w, 1) : rs_srq_post(srq, w, 1)) != 1)
            break;
        k++;
    }
    return k;
}

static uint32_t rs_qp_post_recv_at_in_lock(rs_qp *qp, const rs_recv_wr *table, uint32_t n, const uint32_t *at,
                                            uint32_t count)
{
    uint32_t r = post_at(qp, NULL, table, n, at, count);
    settle(qp);
    return r;
}

static uint32_t rs_srq_post_at_in_lock(rs_srq *srq, const rs_recv_wr *table, uint32_t n, const uint32_t *at,
                                        uint32_t count)
{
    return post_at(NULL, srq, table, n, at, count);
}

/* ------------------------------------------------------------------ transmit */
/* Copy len payload bytes of entry e, from payload offset off, to dst (its SGEs'
 * memory, checked now: a region gone or not the QP's is a local protection error). */
static int copy_payload(rs_qp *qp, sq_entry *e, uint64_t off, uint8_t *dst, uint64_t len)
{
    if (e->data) {
        memcpy(dst, e->data + off, len);
        return 0;
    }
    for (uint32_t i = 0; i < e->wr.num_sge && len; i++) {
        const rs_sge *s = &e->wr.sg_list[i];
        if (off >= s->length) {
            off -= s->length;
            continue;
        }
        uint64_t n = s->length - off < len ? s->length - off : len;
        uint8_t *src;
        if (mem_locate_started(qp->mem, s->lkey, qp->pd, s->addr, s->length, 0, &src) != V_OK)
            return -1;
        memcpy(dst, src + off, n);
        dst += n;
        len -= n;
        off = 0;
    }
    return 0;
}

/* Check every SGE of e now (as the Python engine resolves them when the message starts). */
static int check_sges(rs_qp *qp, const sq_entry *e, uint32_t access)
{
    if (e->data)
        return 0;
    for (uint32_t i = 0; i < e->wr.num_sge; i++) {
        const rs_sge *s = &e->wr.sg_list[i];
        uint8_t *p;
        if (s->length &&
            mem_locate(qp->mem, s->lkey, qp->pd, s->addr, s->length, access, &p) != V_OK)
            return -1;
    }
    return 0;
}

static int head_may_start(rs_qp *qp)
{
    if (qp->sq_started >= qp->v.sq_depth)
        return 0;
    const sq_entry *e = &qp->sq[(qp->sq_head + qp->sq_started) % qp->sq_cap];
    if ((e->wr.flags & RS_FENCE) && qp->orq_count)
        return 0;
    return !(e->wr.opcode == RS_WR_RDMA_READ && qp->orq_count >= qp->ord);
}

/* Where the len bytes of e's payload from off lie, when they lie in one piece: 1 and
 * *out; 0 when they span SGEs; -1 when the region does not allow it. */
static int payload_span(rs_qp *qp, sq_entry *e, uint64_t off, uint64_t len, const uint8_t **out)
{
    if (e->data) {
        *out = e->data + off;
        return 1;
    }
    for (uint32_t i = 0; i < e->wr.num_sge; i++) {
        const rs_sge *s = &e->wr.sg_list[i];
        if (off >= s->length) {
            off -= s->length;
            continue;
        }
        if (s->length - off < len)
            return 0;
        uint8_t *src;
        if (mem_locate_started(qp->mem, s->lkey, qp->pd, s->addr, s->length, 0, &src) != V_OK)
            return -1;
        *out = src + off;
        return 1;
    }
    return 0;
}

/* Frame the FPDU whose header is at p (the transmit buffer's room) with its n payload
 * bytes left where they lie (src): the header, then the PAD and CRC, go into the buffer,
 * and the payload is noted to go between them (direct_flush). */
static void frame_direct(rs_qp *qp, uint8_t *p, const uint8_t *src, uint32_t n, uint32_t ulpdu)
{
    uint32_t pad = pad_of(ulpdu);
    put_trailer(qp, p + HDR_TAGGED, pad,
                qp->crc ? rs_crc32c(rs_crc32c(0, p, HDR_TAGGED), src, n) : 0);
    qp->tx_len += HDR_TAGGED;
    qp->direct[qp->direct_n].at = qp->tx_len - qp->tx_off;
    qp->direct[qp->direct_n].from = src;
    qp->direct[qp->direct_n].len = n;
    qp->direct_n++;
    qp->direct_bytes += n;
    qp->tx_len += pad + CRC_LEN;
    qp->tx_total += HDR_TAGGED + n + pad + CRC_LEN;
}

/* Frame the next FPDU of the current tagged message (a Write or a Read Response). */
static int frame_tagged(rs_qp *qp, uint32_t op, uint32_t stag, uint64_t to, uint64_t total,
                        sq_entry *e, const uint8_t *src)
{
    uint32_t chunk = (qp->max_fpdu - HDR_TAGGED - CRC_LEN) & ~3u;
    uint64_t n = total - qp->cur_off < chunk ? total - qp->cur_off : chunk;
    int final = qp->cur_off + n == total;
    uint32_t ulpdu = HDR_TAGGED - 2 + (uint32_t)n;
    int direct = qp->direct_fd >= 0 && e && n >= DIRECT_MIN && qp->direct_n < DIRECT_MAX;
    uint8_t *p = tx_room(qp, ulpdu + 2 + 3 + CRC_LEN);
    if (!p)
        return -1;
    put16(p, ulpdu);
    p[2] = DDP_TAGGED | (final ? DDP_LAST : 0) | DDP_VERSION;
    p[3] = (uint8_t)(RDMAP_VERSION | op);
    put32(p + 4, stag);
    put64(p + 8, to + qp->cur_off);
    /* A large Write of ours goes from its region (not a Read Response: the region's
     * owner may change it while the peer reads, and the CRC must cover what goes). */
    const uint8_t *from = NULL;
    int span = direct ? payload_span(qp, e, qp->cur_off, n, &from) : 0;
    if (span < 0)
        return -2;
    if (span) {
        frame_direct(qp, p, from, (uint32_t)n, ulpdu);
        qp->cur_off += n;
        return final;
    }
    if (src)
        memcpy(p + HDR_TAGGED, src + qp->cur_off, n);
    else if (copy_payload(qp, e, qp->cur_off, p + HDR_TAGGED, n))
        return -2;
    tx_seal(qp, p, ulpdu);
    qp->cur_off += n;
    return final;
}

static int frame_send(rs_qp *qp, sq_entry *e)
{
    uint32_t chunk = (qp->max_fpdu - HDR_UNTAGGED - CRC_LEN) & ~3u;
    uint64_t n = e->length - qp->cur_off < chunk ? e->length - qp->cur_off : chunk;
    int final = qp->cur_off + n == e->length;
    uint32_t op = (e->wr.flags & RS_SOLICITED) ? OP_SEND_SE : OP_SEND;
    if (e->wr.opcode == RS_WR_SEND_WITH_INV)
        op += 1;
    uint32_t ulpdu = HDR_UNTAGGED - 2 + (uint32_t)n;
    uint8_t *p = tx_room(qp, ulpdu + 2 + 3 + CRC_LEN);
    if (!p)
        return -1;
    put16(p, ulpdu);
    p[2] = (final ? DDP_LAST : 0) | DDP_VERSION;
    p[3] = (uint8_t)(RDMAP_VERSION | op);
    put32(p + 4, e->wr.opcode == RS_WR_SEND_WITH_INV ? e->wr.invalidate_rkey : 0);
    put32(p + 8, QN_SEND);
    put32(p + 12, e->msn);
    put32(p + 16, (uint32_t)qp->cur_off);
    if (copy_payload(qp, e, qp->cur_off, p + HDR_UNTAGGED, n))
        return -2;
    tx_seal(qp, p, ulpdu);
    qp->cur_off += n;
    return final;
}

static int frame_read_request(rs_qp *qp, sq_entry *e, uint64_t seq)
{
    uint8_t *p = tx_room(qp, HDR_READ_REQUEST + 3 + CRC_LEN);
    if (!p)
        return -1;
    const rs_sge *s = e->wr.num_sge ? &e->wr.sg_list[0] : NULL;
    e->msn = ++qp->tx_msn[QN_READ_REQUEST];
    put_read_request(p, e->msn, s ? s->lkey : 0, s ? s->addr : 0, (uint32_t)e->length,
                     e->wr.rkey, e->wr.remote_addr);
    tx_seal(qp, p, HDR_READ_REQUEST - 2);
    uint32_t slot = (qp->orq_head + qp->orq_count) % MAX_ORD_IRD;
    qp->orq_seq[slot] = seq;
    qp->orq_count++;
    return 1;
}

/* Frame FPDUs until TX_BUDGET bytes wait for TCP or nothing can be sent. */
static void produce(rs_qp *qp)
{
    while (qp->state == RS_QP_RTS && !qp->rtr_pending &&
           qp->tx_len - qp->tx_off + qp->direct_bytes < TX_BUDGET) {
        if (qp->cur == CUR_NONE) {
            if (qp->irq_count) {
                qp->cur_irq = qp->irq[qp->irq_head];
                qp->irq_head = (qp->irq_head + 1) % MAX_ORD_IRD;
                qp->irq_count--;
                qp->cur = CUR_IRQ;
                qp->cur_off = 0;
            } else if (head_may_start(qp)) {
                qp->cur_seq = qp->sq_seq0 + qp->sq_started;
                qp->sq_started++;
                qp->cur = CUR_SQ;
                qp->cur_off = 0;
                sq_entry *e = sq_at(qp, qp->cur_seq);
                uint32_t access = e->wr.opcode == RS_WR_RDMA_READ ? RS_LOCAL_WRITE : 0;
                const char *what = e->wr.opcode == RS_WR_RDMA_READ ? "a Read's sink"
                                                                   : "a send's memory";
                if ((e->wr.opcode == RS_WR_RDMA_READ && !e->length) ? 0
                                                                     : check_sges(qp, e, access)) {
                    char message[96];
                    snprintf(message, sizeof message, "local protection error: %s", what);
                    e->status = RS_WC_LOC_PROT_ERR;
                    e->done = 1;
                    qp->cur = CUR_NONE;
                    local_error(qp, RS_ERR_LOCAL, message);
                    return;
                }
                if (e->wr.opcode == RS_WR_SEND || e->wr.opcode == RS_WR_SEND_WITH_INV)
                    e->msn = ++qp->tx_msn[QN_SEND];
            } else {
                return;
            }
        }
        int r;
        if (qp->cur == CUR_IRQ) {
            irq_entry *q = &qp->cur_irq;
            uint8_t *src = NULL;
            if (q->size && mem_locate_started(qp->mem, q->src_stag, qp->pd, q->src_to, q->size,
                                              RS_REMOTE_READ, &src) != V_OK) {
                local_error(qp, RS_ERR_LOCAL, "local protection error: a Read's source");
                return;
            }
            r = frame_tagged(qp, OP_READ_RESPONSE, q->sink_stag, q->sink_to, q->size, NULL,
                             src ? src : (const uint8_t *)"");
            if (r == 1) {
                qp->responding--;
                qp->cur = CUR_NONE;
            }
        } else {
            sq_entry *e = sq_at(qp, qp->cur_seq);
            if (e->wr.opcode == RS_WR_RDMA_READ)
                r = frame_read_request(qp, e, qp->cur_seq);
            else if (e->wr.opcode == RS_WR_RDMA_WRITE)
                r = frame_tagged(qp, OP_WRITE, e->wr.rkey, e->wr.remote_addr, e->length, e,
                                 NULL);
            else
                r = frame_send(qp, e);
            if (r == -2) {
                e->status = RS_WC_LOC_PROT_ERR;
                e->done = 1;
                qp->cur = CUR_NONE;
                local_error(qp, RS_ERR_LOCAL, "local protection error: a send's memory");
                return;
            }
            if (r == 1) {
                e->framed = 1;
                e->done_at = qp->tx_total;
                qp->cur = CUR_NONE;
            }
        }
        if (r < 0)
            return;
    }
}

static const uint8_t *rs_qp_tx_in_lock(rs_qp *qp, size_t *len)
{
    produce(qp);
    settle(qp);
    *len = qp->tx_len - qp->tx_off;
    return *len ? qp->tx + qp->tx_off : NULL;
}

static void tx_done(rs_qp *qp, size_t n)
{
    size_t have = qp->tx_len - qp->tx_off;
    if (n > have)
        n = have;
    qp->tx_off += n;
    qp->tx_taken += n;
    if (qp->state == RS_QP_TERMINATE && qp->tx_off == qp->tx_len) {
        qp->state = RS_QP_ERROR;
        qp->v.news |= RS_NEWS_STATE;
    }
    drain_sq(qp);
}

static void rs_qp_tx_done_in_lock(rs_qp *qp, size_t n)
{
    tx_done(qp, n);
    settle(qp);
}

/* ------------------------------------------------------------------ receive */
static void read_done(rs_qp *qp)
{
    uint64_t seq = qp->orq_seq[qp->orq_head];
    qp->orq_head = (qp->orq_head + 1) % MAX_ORD_IRD;
    qp->orq_count--;
    if (seq == UINT64_MAX) {
        qp->orq_rtr = 0;
        return;
    }
    sq_at(qp, seq)->done = 1;
    drain_sq(qp);
}

static void rtr_received(rs_qp *qp)
{
    qp->rtr_pending = 0;
    qp->v.news |= RS_NEWS_RTR;
}

static void ddp_violation(rs_qp *qp, int v, const char *what)
{
    static const uint32_t code[] = {0, D_INVALID_STAG, D_STAG_NOT_ASSOC, D_INVALID_STAG,
                                    D_BASE_BOUNDS};
    protocol_error(qp, L_DDP, T_DDP_TAGGED, code[v], 1, what);
}

static void rdmap_violation(rs_qp *qp, int v, const char *what)
{
    static const uint32_t code[] = {0, C_INVALID_STAG, C_STAG_NOT_ASSOC, C_ACCESS_RIGHTS,
                                    C_BASE_BOUNDS};
    protocol_error(qp, L_RDMAP, T_REMOTE_PROTECTION, code[v], 2, what);
}

/* QN and MSN of an untagged segment; 0 if good. */
static int check_untagged(rs_qp *qp, uint32_t qn)
{
    if (qp->qn != qn) {
        protocol_error(qp, L_DDP, T_DDP_UNTAGGED, U_INVALID_QN, 1, "segment on the wrong queue");
        return -1;
    }
    if (qp->msn != qp->rx_msn[qn]) {
        protocol_error(qp, L_DDP, T_DDP_UNTAGGED, U_MSN_RANGE, 1, "MSN out of range");
        return -1;
    }
    return 0;
}

/* The header is whole (qp->hdr): decode it and start the segment. */
static void begin_segment(rs_qp *qp)
{
    const uint8_t *h = qp->hdr;
    uint32_t op = qp->op;
    qp->last = (h[2] & DDP_LAST) != 0;
    qp->payload = qp->ulpdu_len + 2 - header_len[op];
    if (op == OP_WRITE || op == OP_READ_RESPONSE) {
        qp->stag = be32(h + 4);
        qp->to = be64(h + 8);
    } else if (op == OP_READ_REQUEST) {
        qp->qn = be32(h + 8);
        qp->msn = be32(h + 12);
        qp->mo = be32(h + 16);
        qp->sink_stag = be32(h + 20);
        qp->sink_to = be64(h + 24);
        qp->read_size = be32(h + 32);
        qp->src_stag = be32(h + 36);
        qp->src_to = be64(h + 40);
    } else {
        qp->inv_stag = be32(h + 4);
        qp->qn = be32(h + 8);
        qp->msn = be32(h + 12);
        qp->mo = be32(h + 16);
    }
    if (qp->state != RS_QP_RTS) {
        protocol_error(qp, L_DDP, T_DDP_CATASTROPHIC, 0, 0, "FPDU before the connection reached RTS");
        return;
    }
    uint32_t payload = qp->payload;
    if (op == OP_WRITE) {
        if (payload) {
            uint8_t *p;
            if (qp->to > UINT64_MAX - (payload - 1)) {
                protocol_error(qp, L_DDP, T_DDP_TAGGED, D_TO_WRAP, 1, "Write wraps the TO space");
                return;
            }
            int v = mem_locate(qp->mem, qp->stag, qp->pd, qp->to, payload, RS_REMOTE_WRITE, &p);
            if (v) {
                ddp_violation(qp, v, "Write refused");
                return;
            }
            qp->place_to = qp->to;
        } else if (qp->rtr_pending) {
            rtr_received(qp);
        }
    } else if (op == OP_READ_RESPONSE) {
        if (!qp->orq_count) {
            protocol_error(qp, L_DDP, T_DDP_CATASTROPHIC, 0, 1, "Read Response with no Read outstanding");
            return;
        }
        uint64_t seq = qp->orq_seq[qp->orq_head];
        uint64_t length = 0, received = 0, addr = 0;
        uint32_t lkey = 0;
        if (seq != UINT64_MAX) {
            sq_entry *e = sq_at(qp, seq);
            length = e->length;
            received = e->received;
            if (e->wr.num_sge) {
                lkey = e->wr.sg_list[0].lkey;
                addr = e->wr.sg_list[0].addr;
            }
        }
        if (length && qp->stag != lkey) {
            protocol_error(qp, L_DDP, T_DDP_TAGGED, D_INVALID_STAG, 1, "Read Response to another STag");
            return;
        }
        if ((length && qp->to != addr + received) || received + payload > length) {
            protocol_error(qp, L_DDP, T_DDP_TAGGED, D_BASE_BOUNDS, 1, "Read Response outside the Read's sink");
            return;
        }
        qp->place_to = qp->to;
    } else if (op == OP_READ_REQUEST) {
        if (payload) {
            protocol_error(qp, L_DDP, T_DDP_CATASTROPHIC, 0, 0, "Read Request with payload");
            return;
        }
    } else if (op == OP_TERMINATE) {
        if (check_untagged(qp, QN_TERMINATE))
            return;
        if (qp->mo != 0) {
            protocol_error(qp, L_DDP, T_DDP_UNTAGGED, U_INVALID_MO, 0, "Terminate with an MO");
            return;
        }
        qp->term_have = 0;
    } else { /* a Send */
        if (check_untagged(qp, QN_SEND))
            return;
        if (!qp->send_open) {
            if (qp->mo != 0) {
                protocol_error(qp, L_DDP, T_DDP_UNTAGGED, U_INVALID_MO, 1, "first segment with an MO");
                return;
            }
            if (qp->rtr_pending)
                rtr_received(qp);
            rs_rq *q = qp->srq ? &qp->srq->q : &qp->rq;
            if (!rq_take(q, &qp->send_wr)) {
                protocol_error(qp, L_DDP, T_DDP_UNTAGGED, U_MSN_NO_BUFFER, 1, "Send with no receive posted");
                return;
            }
            qp->send_open = 1;
            qp->send_received = 0;
            qp->send_status = RS_WC_SUCCESS;
            qp->send_len = 0;
            for (uint32_t i = 0; i < qp->send_wr.num_sge; i++)
                qp->send_len += qp->send_wr.sg_list[i].length;
            for (uint32_t i = 0; i < qp->send_wr.num_sge; i++) {
                const rs_sge *s = &qp->send_wr.sg_list[i];
                uint8_t *p;
                if (s->length && mem_locate(qp->mem, s->lkey, qp->pd, s->addr, s->length,
                                            RS_LOCAL_WRITE, &p) != V_OK) {
                    qp->send_status = RS_WC_LOC_PROT_ERR;
                    protocol_error(qp, L_DDP, T_DDP_CATASTROPHIC, 0, 1, "a receive names bad memory");
                    return;
                }
            }
        } else if (qp->mo != qp->send_received) {
            protocol_error(qp, L_DDP, T_DDP_UNTAGGED, U_INVALID_MO, 1, "MO out of order");
            return;
        }
        if (qp->send_received + payload > qp->send_len) {
            qp->send_status = RS_WC_LOC_LEN_ERR;
            protocol_error(qp, L_DDP, T_DDP_UNTAGGED, U_MSN_NO_BUFFER, 1, "Send longer than its receive");
            return;
        }
    }
    qp->remaining = payload;
    qp->rx = payload ? RX_PAYLOAD : RX_TRAILER;
}

/* Place n payload bytes of the current segment (checked when it began; looked up again
 * here: a region deregistered since stops the QP instead). */
static void place(rs_qp *qp, const uint8_t *src, uint32_t n)
{
    uint32_t op = qp->op;
    uint8_t *dst;
    if (op == OP_WRITE || op == OP_READ_RESPONSE) {
        uint32_t stag = qp->stag;
        uint32_t access = op == OP_WRITE ? RS_REMOTE_WRITE : RS_LOCAL_WRITE;
        if (mem_locate_started(qp->mem, stag, qp->pd, qp->place_to, n, access, &dst) != V_OK) {
            local_error(qp, RS_ERR_REVOKED, "a region in use was deregistered");
            return;
        }
        memcpy(dst, src, n);
        qp->place_to += n;
        if (op == OP_READ_RESPONSE)
            sq_at(qp, qp->orq_seq[qp->orq_head])->received += n;
        return;
    }
    if (op == OP_TERMINATE) {
        uint32_t room = (uint32_t)sizeof qp->term_body - qp->term_have;
        uint32_t k = n < room ? n : room;
        memcpy(qp->term_body + qp->term_have, src, k);
        qp->term_have += k;
        return;
    }
    /* a Send: walk the receive's SGEs from the message offset */
    uint64_t off = qp->send_received;
    for (uint32_t i = 0; i < qp->send_wr.num_sge && n; i++) {
        const rs_sge *s = &qp->send_wr.sg_list[i];
        if (off >= s->length) {
            off -= s->length;
            continue;
        }
        uint32_t k = (uint32_t)(s->length - off < n ? s->length - off : n);
        if (mem_locate_started(qp->mem, s->lkey, qp->pd, s->addr + off, k, RS_LOCAL_WRITE,
                               &dst) != V_OK) {
            qp->send_status = RS_WC_LOC_PROT_ERR;
            qp->send_open = 0;
            complete(qp, qp->rcq, qp->send_wr.wr_id, RS_WC_LOC_PROT_ERR, RS_WC_RECV, 0, 0, 0, 0);
            local_error(qp, RS_ERR_REVOKED, "a region in use was deregistered");
            return;
        }
        memcpy(dst, src, k);
        src += k;
        n -= k;
        qp->send_received += k;
        off = 0;
    }
}

static void end_segment(rs_qp *qp)
{
    uint32_t op = qp->op;
    if (op == OP_WRITE)
        return;
    if (op >= OP_SEND && op <= OP_SEND_SE_INV) {
        if (!qp->last)
            return;
        qp->send_open = 0;
        qp->rx_msn[QN_SEND]++;
        uint32_t flags = 0, inv = 0;
        uint32_t solicited = op == OP_SEND_SE || op == OP_SEND_SE_INV;
        if (op == OP_SEND_INV || op == OP_SEND_SE_INV) {
            rs_region *r = mem_lookup(qp->mem, qp->inv_stag);
            int v = !r ? V_INVALID_STAG
                    : r->pd != qp->pd ? V_PD
                    : !(r->access & (RS_REMOTE_READ | RS_REMOTE_WRITE | RS_REMOTE_ATOMIC)) ? V_ACCESS
                                                                                            : V_OK;
            if (v) {
                complete(qp, qp->rcq, qp->send_wr.wr_id, RS_WC_REM_INV_REQ_ERR, RS_WC_RECV,
                         (uint32_t)qp->send_received, 0, 0, 0);
                protocol_error(qp, L_RDMAP,
                               v == V_INVALID_STAG ? T_REMOTE_OPERATION : T_REMOTE_PROTECTION,
                               C_CANNOT_INVALIDATE, 1, "cannot invalidate the STag");
                return;
            }
            r->valid = 0;
            qp->mem->v.epoch++;
            flags = RS_WC_WITH_INV;
            inv = qp->inv_stag;
        }
        complete(qp, qp->rcq, qp->send_wr.wr_id, RS_WC_SUCCESS, RS_WC_RECV,
                 (uint32_t)qp->send_received, flags, inv, solicited);
    } else if (op == OP_READ_RESPONSE) {
        if (!qp->last)
            return;
        uint64_t seq = qp->orq_seq[qp->orq_head];
        if (seq != UINT64_MAX && sq_at(qp, seq)->received != sq_at(qp, seq)->length) {
            protocol_error(qp, L_DDP, T_DDP_TAGGED, D_BASE_BOUNDS, 1, "Read Response shorter than its Read");
            return;
        }
        read_done(qp);
    } else if (op == OP_READ_REQUEST) {
        if (check_untagged(qp, QN_READ_REQUEST))
            return;
        if (qp->responding >= qp->ird) {
            protocol_error(qp, L_RDMAP, T_REMOTE_OPERATION, C_CATASTROPHIC_STREAM, 2,
                           "more Read Requests than IRD");
            return;
        }
        qp->rx_msn[QN_READ_REQUEST]++;
        uint64_t size = qp->read_size;
        if ((size && qp->sink_to > UINT64_MAX - (size - 1)) ||
            (size && qp->src_to > UINT64_MAX - (size - 1))) {
            protocol_error(qp, L_RDMAP, T_REMOTE_PROTECTION, C_TO_WRAP, 2, "Read wraps the TO space");
            return;
        }
        if (!size) {
            if (qp->rtr_pending)
                rtr_received(qp);
        } else {
            uint8_t *p;
            int v = mem_locate(qp->mem, qp->src_stag, qp->pd, qp->src_to, size, RS_REMOTE_READ, &p);
            if (v) {
                rdmap_violation(qp, v, "Read refused");
                return;
            }
        }
        irq_entry *q = &qp->irq[(qp->irq_head + qp->irq_count) % MAX_ORD_IRD];
        *q = (irq_entry){qp->sink_stag, qp->src_stag, qp->sink_to, qp->src_to, qp->read_size};
        qp->irq_count++;
        qp->responding++;
    } else { /* Terminate */
        uint32_t layer = 0, etype = 0, ecode = 0, quoted_read = 0, quoted_msn = 0, status = 0;
        if (qp->term_have < 4) {
            protocol_error(qp, L_RDMAP, T_REMOTE_OPERATION, C_OPCODE, 0, "Terminate too short");
            return;
        }
        uint32_t word = be32(qp->term_body);
        layer = word >> 28;
        etype = (word >> 24) & 0xF;
        ecode = (word >> 16) & 0xFF;
        const uint8_t *c = qp->term_body + 4;
        uint32_t have = qp->term_have - 4;
        if ((word & 0x8000) && have >= HDR_READ_REQUEST && (c[2] & 0x03) == DDP_VERSION &&
            (c[3] & 0xC0) == RDMAP_VERSION && (c[3] & 0x0F) == OP_READ_REQUEST &&
            !(c[2] & DDP_TAGGED) && be16(c) + 2u >= HDR_READ_REQUEST) {
            quoted_read = 1;
            quoted_msn = be32(c + 12);
            status = layer == L_RDMAP && etype == T_REMOTE_PROTECTION ? RS_WC_REM_ACCESS_ERR
                                                                       : RS_WC_REM_OP_ERR;
        }
        qp->err.kind = RS_ERR_REMOTE;
        qp->err.layer = layer;
        qp->err.etype = etype;
        qp->err.ecode = ecode;
        snprintf(qp->err.message, sizeof qp->err.message, "the peer ended the connection");
        enter_error(qp, RS_ERR_REMOTE, "the peer ended the connection", (int)quoted_read,
                    quoted_msn, status);
    }
}

/* Check the DDP and RDMAP control bytes and the length (parse_header's checks). */
static int check_control(rs_qp *qp)
{
    const uint8_t *h = qp->hdr;
    uint32_t ddp = h[2], rdmap = h[3];
    int tagged = (ddp & DDP_TAGGED) != 0;
    if ((ddp & 0x03) != DDP_VERSION) {
        protocol_error(qp, L_DDP, tagged ? T_DDP_TAGGED : T_DDP_UNTAGGED,
                       tagged ? D_VERSION : U_VERSION, 0, "DDP version");
        return -1;
    }
    if ((rdmap & 0xC0) != RDMAP_VERSION) {
        protocol_error(qp, L_RDMAP, T_REMOTE_OPERATION, C_VERSION, 0, "RDMAP version");
        return -1;
    }
    uint32_t op = rdmap & 0x0F;
    if (op > OP_TERMINATE || tagged != (op == OP_WRITE || op == OP_READ_RESPONSE)) {
        protocol_error(qp, L_RDMAP, T_REMOTE_OPERATION, C_OPCODE, 0, "RDMAP opcode");
        return -1;
    }
    qp->ulpdu_len = be16(h);
    if (qp->ulpdu_len + 2 < header_len[op]) {
        protocol_error(qp, L_LLP, 0, M_FPDU_START, 0, "ULPDU shorter than its header");
        return -1;
    }
    qp->op = op;
    return 0;
}

static void rx(rs_qp *qp, const uint8_t *data, size_t len)
{
    qp->rx_total += len;
    while (len && qp->rx != RX_DISCARD) {
        if (qp->rx == RX_HDR) {
            uint32_t need = qp->hdr_have < 4 ? 4 : header_len[qp->op];
            uint32_t k = need - qp->hdr_have;
            if (k > len)
                k = (uint32_t)len;
            memcpy(qp->hdr + qp->hdr_have, data, k);
            qp->hdr_have += k;
            data += k;
            len -= k;
            if (qp->hdr_have == 4 && need == 4) {
                if (check_control(qp))
                    return;
                continue; /* now the whole header */
            }
            if (qp->hdr_have < need)
                return;
            qp->crc_state = qp->crc ? rs_crc32c(0, qp->hdr, need) : 0;
            qp->hdr_have = 0;
            begin_segment(qp);
        } else if (qp->rx == RX_PAYLOAD) {
            uint32_t k = qp->remaining < len ? qp->remaining : (uint32_t)len;
            if (qp->crc)
                qp->crc_state = rs_crc32c(qp->crc_state, data, k);
            place(qp, data, k);
            if (qp->rx == RX_DISCARD)
                return;
            data += k;
            len -= k;
            qp->remaining -= k;
            if (!qp->remaining) {
                qp->rx = RX_TRAILER;
                qp->trailer_have = 0;
            }
        } else { /* RX_TRAILER */
            if (qp->trailer_have == 0)
                qp->trailer_need = pad_of(qp->ulpdu_len) + CRC_LEN;
            uint32_t k = qp->trailer_need - qp->trailer_have;
            if (k > len)
                k = (uint32_t)len;
            memcpy(qp->trailer + qp->trailer_have, data, k);
            qp->trailer_have += k;
            data += k;
            len -= k;
            if (qp->trailer_have < qp->trailer_need)
                return;
            uint32_t pad = qp->trailer_need - CRC_LEN;
            if (qp->crc) {
                uint32_t c = rs_crc32c(qp->crc_state, qp->trailer, pad);
                uint32_t wire = (uint32_t)qp->trailer[pad] | (uint32_t)qp->trailer[pad + 1] << 8 |
                                (uint32_t)qp->trailer[pad + 2] << 16 |
                                (uint32_t)qp->trailer[pad + 3] << 24;
                if (c != wire) {
                    protocol_error(qp, L_LLP, 0, M_CRC, 0, "received CRC mismatch");
                    return;
                }
            }
            qp->rx = RX_HDR;
            qp->trailer_have = 0;
            end_segment(qp);
        }
    }
}

static void rs_qp_rx_in_lock(rs_qp *qp, const uint8_t *data, size_t len)
{
    rx(qp, data, len);
    settle(qp);
}

/* ------------------------------------------------------------------ deregistration */
static void qp_revoke(rs_qp *qp, uint32_t stag)
{
    if (qp->state != RS_QP_RTS)
        return;
    int reads = 0, receiving = 0, sending = 0, writing = 0, responding = 0;
    for (uint32_t i = 0; i < qp->orq_count; i++) {
        uint64_t seq = qp->orq_seq[(qp->orq_head + i) % MAX_ORD_IRD];
        if (seq == UINT64_MAX)
            continue;
        sq_entry *e = sq_at(qp, seq);
        if (e->wr.num_sge && e->wr.sg_list[0].lkey == stag) {
            e->status = RS_WC_LOC_PROT_ERR;
            e->done = 1;
            reads = 1;
        }
    }
    if (qp->send_open)
        for (uint32_t i = 0; i < qp->send_wr.num_sge; i++)
            receiving |= qp->send_wr.sg_list[i].lkey == stag;
    if (qp->cur == CUR_SQ) {
        sq_entry *e = sq_at(qp, qp->cur_seq);
        for (uint32_t i = 0; !e->data && i < e->wr.num_sge; i++)
            sending |= e->wr.sg_list[i].lkey == stag;
        if (sending) {
            e->status = RS_WC_LOC_PROT_ERR;
            e->done = 1;
        }
    } else if (qp->cur == CUR_IRQ) {
        responding = qp->cur_irq.src_stag == stag;
    }
    for (uint32_t i = 0; i < qp->irq_count; i++)
        responding |= qp->irq[(qp->irq_head + i) % MAX_ORD_IRD].src_stag == stag;
    writing = qp->rx == RX_PAYLOAD && qp->op == OP_WRITE && qp->stag == stag;
    if (!(reads || receiving || sending || writing || responding))
        return;
    if (receiving) {
        qp->send_open = 0;
        complete(qp, qp->rcq, qp->send_wr.wr_id, RS_WC_LOC_PROT_ERR, RS_WC_RECV, 0, 0, 0, 0);
    }
    char message[96];
    snprintf(message, sizeof message,
             "local protection error: memory region %#010x deregistered while in use", stag);
    local_error(qp, RS_ERR_REVOKED, message);
}

static int rs_mem_remove_in_lock(rs_mem *mem, uint32_t stag)
{
    uint32_t index = stag >> 8;
    uint32_t s = slot_of(mem, index);
    for (;; s = (s + 1) & (mem->cap - 1)) {
        if (!mem->slots[s])
            return -ENOENT;
        if (mem->slots[s]->stag >> 8 == index)
            break;
    }
    if (mem->slots[s]->stag != stag)
        return -ENOENT;
    mem->slots[s]->valid = 0;
    mem->v.epoch++;
    for (rs_qp *qp = mem->qps; qp; qp = qp->next_in_mem) {
        qp_revoke(qp, stag);
        settle(qp);
    }
    free(mem->slots[s]);
    mem->slots[s] = NULL;
    mem->count--;
    /* backward-shift: move later entries of the cluster into the hole */
    uint32_t hole = s;
    for (uint32_t j = (s + 1) & (mem->cap - 1); mem->slots[j]; j = (j + 1) & (mem->cap - 1)) {
        uint32_t home = slot_of(mem, mem->slots[j]->stag >> 8);
        int moves = hole <= j ? (home <= hole || home > j) : (home <= hole && home > j);
        if (moves) {
            mem->slots[hole] = mem->slots[j];
            mem->slots[j] = NULL;
            hole = j;
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ the socket */
#define RX_READ (256 * 1024)

/* The socket failed: ERROR, with what Python's OSError would say of err. */
static void socket_failed(rs_qp *qp, int err)
{
    char message[128];
    snprintf(message, sizeof message, "[Errno %d] %s", err, strerror(err));
    enter_error(qp, RS_ERR_USER, message, 0, 0, 0);
    /* Nothing framed can be written any more: what waited is dropped (never counted as
     * sent), a Terminate too, so the transmit side has nothing left and the connection
     * closes now instead of waiting for a peer's FIN that may never come. */
    qp->tx_off = qp->tx_len;
    if (qp->state == RS_QP_TERMINATE) {
        qp->state = RS_QP_ERROR;
        qp->v.news |= RS_NEWS_STATE;
    }
    publish(qp);
}

static int64_t rs_qp_read_fd_in_lock(rs_qp *qp, int fd)
{
    if (!qp->rxbuf && !(qp->rxbuf = malloc(RX_READ)))
        return -ENOMEM;
    ssize_t n = recv(fd, qp->rxbuf, RX_READ, MSG_DONTWAIT);
    if (n < 0) {
        int err = errno;
        if (err != EAGAIN && err != EWOULDBLOCK && err != EINTR)
            socket_failed(qp, err);
        return -err;
    }
    if (n == 0) { /* the words of the Python engine's connection_lost() */
        enter_error(qp, RS_ERR_USER, "connection closed by peer", 0, 0, 0);
        return 0;
    }
    rs_qp_rx(qp, qp->rxbuf, (size_t)n);
    return n;
}

int64_t rs_qp_wait_read_fd(rs_qp *qp, int fd, int others, int timeout_ms)
{
    struct pollfd fds[2] = {{fd, POLLIN, 0}, {others, POLLIN, 0}};
    int n = poll(fds, 2, timeout_ms);
    if (n < 0)
        return -errno;
    if (!fds[0].revents || fds[1].revents)
        return -EBUSY; /* the time is up, or the others go first */
    return rs_qp_read_fd(qp, fd);
}

uint32_t rs_qp_wait_poll_fd(rs_qp *qp, int fd, uint64_t spin_ns, int others, int timeout_ms, rs_cq *cq,
                           rs_wc *out, uint32_t n, rs_wc_sum *sum, uint64_t quiet_owed, int64_t *got)
{
    int64_t r = spin_ns ? rs_qp_spin_fd(qp, fd, spin_ns) : -EAGAIN;
    if (r == -EAGAIN || r == -EWOULDBLOCK)
        r = rs_qp_wait_read_fd(qp, fd, others, timeout_ms);
    got[0] = r;
    got[1] = 0;
    if (r <= 0 || (qp->v.news & ~RS_NEWS_CQ) || cq->v.overrun)
        return 0; /* nothing read, or news the caller looks at first */
    uint32_t k = rs_cq_poll_sum(cq, out, n, sum);
    if (k && quiet_owed && qp->scq == cq && qp->rcq == cq && !cq->v.count && !qp->v.tx_ready &&
        qp->v.rx_owed < quiet_owed) {
        qp->v.news = 0; /* (the completions it speaks of are in the rows) */
        got[1] = 1;
    }
    return k;
}

int64_t rs_qp_serve_wait(rs_qp *qp, int fd, int wake)
{
    pthread_mutex_t *lock = &qp->mem->lock;
    for (;;) {
        pthread_mutex_lock(lock);
        if (qp->tx_len > qp->tx_off) /* the socket was full: what waits goes on */
            rs_qp_flush_fd(qp, fd);
        int ready = qp->rcq->v.count || qp->scq->v.count || qp->state != RS_QP_RTS ||
                    (qp->v.news & ~RS_NEWS_CQ);
        short events = POLLIN | (qp->tx_len > qp->tx_off ? POLLOUT : 0);
        pthread_mutex_unlock(lock);
        if (ready)
            return 1;
        struct pollfd fds[2] = {{fd, events, 0}, {wake, POLLIN, 0}};
        if (poll(fds, 2, -1) < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        if (fds[1].revents)
            return -EINTR;
        if (fds[0].revents & ~POLLOUT) /* bytes, the peer's FIN or an error */
            rs_qp_read_fd(qp, fd);
    }
}

/* The last turn's answer (rs_qp_serve_slot): its Receive given back, its Send posted.
 * 0 when there was none or it went; 1 when the QP refused it (not in RTS); -EINVAL
 * when it or the slots are not as the turn left them, or the receive queue is full. */
static int slots_answer(rs_qp *qp, rs_slots *s)
{
    uint32_t len = s->reply_len, slot = s->send_slot, recv = s->recv_slot;
    int lone = s->lone;
    s->lone = 0;
    s->reply_len = RS_NO_REPLY;
    if (!lone || len == RS_NO_REPLY)
        return 0;
    /* (the entry's check keeps nreposts below repost_every, and a free slot means the
     * ring of those out has room) */
    if (len > s->send_size || !s->nfree || s->free[s->nfree - 1] != slot || slot >= s->nsend ||
        recv >= s->nrecv || s->room < 1)
        return -EINVAL;
    s->reposts[s->nreposts++] = recv;
    if (s->nreposts == s->repost_every) {
        for (uint32_t k = 0; k < s->nreposts; k++) {
            rs_recv_wr w;
            memset(&w, 0, sizeof w);
            w.wr_id = s->reposts[k];
            w.num_sge = 1;
            w.sg_list[0].addr = s->recv_addr + (uint64_t)s->reposts[k] * s->recv_size;
            w.sg_list[0].length = s->recv_size;
            w.sg_list[0].lkey = s->recv_lkey;
            if (post_recv(qp, &w, 1) != 1) { /* (a full queue: the owner's count is wrong) */
                memmove(s->reposts, s->reposts + k, (s->nreposts - k) * sizeof *s->reposts);
                s->nreposts -= k;
                return -EINVAL;
            }
        }
        s->nreposts = 0;
    }
    int signaled = s->unsignaled + 1 >= s->signal_every;
    rs_send_wr w;
    int why;
    memset(&w, 0, sizeof w);
    w.wr_id = s->send_base + slot;
    w.opcode = RS_WR_SEND;
    w.flags = signaled ? RS_SIGNALED : 0;
    w.num_sge = 1;
    w.sg_list[0].addr = s->send_addr + (uint64_t)slot * s->send_size;
    w.sg_list[0].length = len;
    w.sg_list[0].lkey = s->send_lkey;
    if (qp->state != RS_QP_RTS || post_send(qp, &w, 1, &why) != 1)
        return 1;
    s->nfree--;
    s->unacked[(s->head + s->nunacked) % s->nsend] = slot;
    s->nunacked++;
    s->room--;
    s->unsignaled = signaled ? 0 : s->unsignaled + 1;
    return 0;
}

/* The successful completion of the Send from slot: it and every Send from a slot
 * before it are free. 0 when no Send from that slot is known to be out (the row is
 * left to the owner). */
static int slots_release(rs_slots *s, uint32_t slot)
{
    uint32_t i;
    for (i = 0; i < s->nunacked && s->unacked[(s->head + i) % s->nsend] != slot; i++)
        ;
    if (i == s->nunacked)
        return 0;
    for (uint32_t k = 0; k <= i; k++) {
        s->free[s->nfree++] = s->unacked[s->head];
        s->head = (s->head + 1) % s->nsend;
        s->room++;
    }
    s->nunacked -= i + 1;
    return 1;
}

/* The next completion of cq that is not a Send's from a slot into out[0] (those before
 * it free their slots): 1, and whether it is a Receive with a Send slot free for its
 * answer (s->lone); 0 when there is none. One at a time, so that each Receive of a
 * burst is answered in a turn of its own, in order. */
static uint32_t slots_poll(rs_slots *s, rs_cq *cq, rs_wc *out, rs_wc_sum *sum)
{
    const rs_wc *w = &out[0];
    do {
        if (!rs_cq_poll(cq, out, 1))
            return 0;
    } while (w->status == RS_WC_SUCCESS && w->opcode == RS_WC_SEND && w->wr_id >= s->send_base &&
             w->wr_id - s->send_base < s->nsend &&
             slots_release(s, (uint32_t)(w->wr_id - s->send_base)));
    sum_rows(out, 1, sum);
    s->lone = w->status == RS_WC_SUCCESS && w->opcode == RS_WC_RECV && w->wr_id < s->nrecv &&
              s->nfree && s->room >= 1;
    if (s->lone) {
        s->recv_slot = (uint32_t)w->wr_id;
        s->recv_len = w->byte_len;
        s->send_slot = s->free[s->nfree - 1];
    }
    return 1;
}

/* rs_qp_serve_wait and a poll, until the poll takes a row (their count) or the QP has
 * news for its owner's event loop (0): rs_qp_serve_poll's poll of up to n rows, or with
 * slots (rs_qp_serve_slot) slots_poll's of one. */
static int64_t serve_rows(rs_qp *qp, int fd, int wake, rs_slots *s, rs_wc *out, uint32_t n, rs_wc_sum *sum)
{
    pthread_mutex_t *lock = &qp->mem->lock;
    for (;;) {
        int64_t waited = rs_qp_serve_wait(qp, fd, wake);
        if (waited < 0)
            return waited;
        pthread_mutex_lock(lock);
        rs_cq *cq = qp->rcq;
        uint32_t k = 0;
        if (qp->state == RS_QP_RTS && !(qp->v.news & ~RS_NEWS_CQ) && !cq->v.overrun) {
            qp->v.news = 0; /* (the completions it speaks of are in the rows, or freed slots) */
            k = s ? slots_poll(s, cq, out, sum) : rs_cq_poll_sum(cq, out, n, sum);
        }
        int others = qp->state != RS_QP_RTS || (qp->v.news & ~RS_NEWS_CQ) || cq->v.overrun;
        pthread_mutex_unlock(lock);
        if (k)
            return k;
        if (others)
            return 0;
    }
}

int64_t rs_qp_serve_poll(rs_qp *qp, int fd, int wake, rs_wc *out, uint32_t n, rs_wc_sum *sum)
{
    if (qp->scq != qp->rcq)
        return -EINVAL; /* (a served QP has one CQ: its caller checked) */
    return serve_rows(qp, fd, wake, NULL, out, n, sum);
}

int64_t rs_qp_serve_slot(rs_qp *qp, int fd, int wake, rs_slots *s, rs_wc *out, rs_wc_sum *sum)
{
    pthread_mutex_t *lock = &qp->mem->lock;
    /* (every Send slot free or out at most once: what is freed always fits the stack) */
    if (qp->scq != qp->rcq || s->nfree + (uint64_t)s->nunacked > s->nsend || s->head >= s->nsend ||
        s->nreposts >= s->repost_every || !s->signal_every)
        return -EINVAL;
    pthread_mutex_lock(lock);
    int answered = slots_answer(qp, s);
    if (answered == 0) {
        settle(qp);
        rs_qp_flush_fd(qp, fd);
    }
    pthread_mutex_unlock(lock);
    if (answered)
        return answered < 0 ? answered : 0;
    return serve_rows(qp, fd, wake, s, out, 1, sum);
}

int64_t rs_qp_spin_fd(rs_qp *qp, int fd, uint64_t ns)
{
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        int64_t n = rs_qp_read_fd(qp, fd);
        if (n != -EAGAIN && n != -EWOULDBLOCK)
            return n;
        clock_gettime(CLOCK_MONOTONIC, &t);
        uint64_t spent = (uint64_t)(t.tv_sec - t0.tv_sec) * 1000000000u +
                         (uint64_t)(t.tv_nsec - t0.tv_nsec);
        if (spent >= ns)
            return -EAGAIN;
        sched_yield(); /* a peer polling on this CPU takes its turn */
    }
}

static uint64_t rx_owed(rs_qp *qp)
{
    if (qp->state != RS_QP_RTS)
        return 0;
    uint64_t owed = 0;
    if (qp->rx == RX_PAYLOAD && qp->op != OP_READ_RESPONSE)
        owed = qp->remaining; /* (a Read Response's is counted with its Read below) */
    for (uint32_t i = 0; i < qp->orq_count; i++) {
        uint64_t seq = qp->orq_seq[(qp->orq_head + i) % MAX_ORD_IRD];
        if (seq == UINT64_MAX)
            continue; /* the RTR's zero-length Read */
        const sq_entry *e = sq_at(qp, seq);
        if (e->length > e->received)
            owed += e->length - e->received;
    }
    return owed;
}

static uint32_t rs_qp_post_send_fd_in_lock(rs_qp *qp, const rs_send_wr *wrs, uint32_t n, int *why, int fd,
                                            int64_t *wrote)
{
    uint32_t taken = post_send(qp, wrs, n, why);
    settle(qp);
    *wrote = rs_qp_flush_fd(qp, fd);
    return taken;
}

static void rs_qp_run_hook_in_lock(rs_qp *qp)
{
    run_hook(qp, qp->scq, 1);
    settle(qp);
}

static void rs_qp_run_hook_fd_in_lock(rs_qp *qp, int fd, int64_t *wrote)
{
    rs_qp_run_hook_in_lock(qp);
    *wrote = rs_qp_flush_fd(qp, fd);
}

static uint32_t rs_qp_run_direct_in_lock(rs_qp *qp, int fd, int64_t *wrote)
{
    rs_qp_run_hook_fd_in_lock(qp, fd, wrote);
    return *wrote != 0 || qp->v.news != 0;
}

static int64_t rs_qp_flush_fd_in_lock(rs_qp *qp, int fd)
{
    int64_t w;
    while ((w = rs_qp_write_fd(qp, fd)) > 0 || w == -EINTR)
        ;
    return w;
}

/* Send what waits in the transmit buffer with the payloads frame_direct left in their
 * regions between its bytes, in one sendmsg; what TCP does not take now is copied into
 * the buffer, so nothing refers to a region once the call returns (a deregistration
 * waits for the device's lock). The wire is the same bytes as from the buffer alone. */
static int64_t direct_flush(rs_qp *qp, int fd)
{
    size_t waiting = qp->tx_len - qp->tx_off;
    uint32_t n = qp->direct_n;
    qp->direct_n = 0;
    uint64_t payloads = qp->direct_bytes;
    qp->direct_bytes = 0;
    /* Room for all of it first (it may move the buffer's bytes): nothing can fail once
     * part of it went. */
    if (qp->direct[n - 1].at > waiting || !tx_room(qp, waiting + payloads)) {
        /* (never: the buffer holds every header noted; or no memory) the headers framed
         * cannot go without their payloads */
        socket_failed(qp, ENOMEM);
        return -ENOMEM;
    }
    const uint8_t *tx = qp->tx + qp->tx_off;
    struct iovec iov[2 * DIRECT_MAX + 1];
    int k = 0;
    size_t at = 0;
    for (uint32_t i = 0; i < n; i++) {
        iov[k++] = (struct iovec){(void *)(tx + at), qp->direct[i].at - at};
        iov[k++] = (struct iovec){(void *)qp->direct[i].from, qp->direct[i].len};
        at = qp->direct[i].at;
    }
    iov[k++] = (struct iovec){(void *)(tx + at), waiting - at};
    struct msghdr m = {.msg_iov = iov, .msg_iovlen = (size_t)k};
    ssize_t w = sendmsg(fd, &m, MSG_DONTWAIT | MSG_NOSIGNAL);
    int err = w < 0 ? errno : 0;
    if (w < 0 && err != EAGAIN && err != EWOULDBLOCK && err != EINTR) {
        socket_failed(qp, err); /* (what waited is dropped: this too) */
        return -err;
    }
    size_t skip = w < 0 ? 0 : (size_t)w, rest = 0;
    uint8_t *dst = qp->tx + qp->tx_len;
    for (int i = 0; i < k; i++) {
        if (skip >= iov[i].iov_len) {
            skip -= iov[i].iov_len;
            continue;
        }
        memcpy(dst + rest, (const uint8_t *)iov[i].iov_base + skip, iov[i].iov_len - skip);
        rest += iov[i].iov_len - skip;
        skip = 0;
    }
    qp->tx_off = qp->tx_len;
    qp->tx_len += rest;
    if (w < 0)
        return -err;
    qp->tx_taken += (uint64_t)w;
    return w;
}

static int64_t rs_qp_write_fd_in_lock(rs_qp *qp, int fd)
{
    size_t len;
    qp->direct_fd = fd; /* (large Writes framed now stay in their regions) */
    const uint8_t *p = rs_qp_tx(qp, &len);
    qp->direct_fd = -1;
    if (qp->direct_n) {
        int64_t w = direct_flush(qp, fd);
        rs_qp_tx_done(qp, 0); /* (their work requests may complete) */
        return w;
    }
    if (!p)
        return 0;
    ssize_t n = send(fd, p, len, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n < 0) {
        int err = errno;
        if (err != EAGAIN && err != EWOULDBLOCK && err != EINTR)
            socket_failed(qp, err);
        return -err;
    }
    rs_qp_tx_done(qp, (size_t)n);
    return n;
}

/* ------------------------------------------------------------------ one caller at a time
 * Each call above that reads or changes a QP, a CQ's ring, an SRQ or the memory table
 * runs under its device's lock (the table's; a CQ or SRQ takes its QPs'): cffi calls C
 * without the GIL, and a QP served from a thread of its own (rs_qp_serve_wait) runs
 * beside the event loop's calls on the device's other QPs, its registrations and
 * deregistrations. Recursive: a call may make another (rs_qp_post_send_fd writes). */
#define LOCKED(type, name, lock, params, args)                                            \
    type name params                                                                       \
    {                                                                                      \
        pthread_mutex_t *held = (lock);                                                    \
        if (held)                                                                          \
            pthread_mutex_lock(held);                                                      \
        type r = name##_in_lock args;                                                      \
        if (held)                                                                          \
            pthread_mutex_unlock(held);                                                    \
        return r;                                                                          \
    }
#define LOCKED_VOID(name, lock, params, args)                                              \
    void name params                                                                       \
    {                                                                                      \
        pthread_mutex_t *held = (lock);                                                    \
        pthread_mutex_lock(held);                                                          \
        name##_in_lock args;                                                               \
        pthread_mutex_unlock(held);                                                        \
    }
LOCKED(int, rs_mem_add, &mem->lock, (rs_mem *mem, uint32_t stag, uint8_t *base, uint64_t iova, uint64_t length, uint32_t access, uint64_t pd), (mem, stag, base, iova, length, access, pd))
LOCKED(int, rs_mem_valid, &mem->lock, (rs_mem *mem, uint32_t stag), (mem, stag))
LOCKED(int, rs_mem_remove, &mem->lock, (rs_mem *mem, uint32_t stag), (mem, stag))
LOCKED(uint32_t, rs_cq_poll, cq->lock, (rs_cq *cq, rs_wc *out, uint32_t n), (cq, out, n))
LOCKED(uint32_t, rs_cq_poll_sum, cq->lock, (rs_cq *cq, rs_wc *out, uint32_t n, rs_wc_sum *sum), (cq, out, n, sum))
LOCKED(uint32_t, rs_srq_post, srq->lock, (rs_srq *srq, const rs_recv_wr *wrs, uint32_t n), (srq, wrs, n))
LOCKED(uint32_t, rs_srq_post_at, srq->lock, (rs_srq *srq, const rs_recv_wr *table, uint32_t n, const uint32_t *at, uint32_t count), (srq, table, n, at, count))
LOCKED_VOID(rs_qp_set_error, &qp->mem->lock, (rs_qp *qp, uint32_t kind, const char *message), (qp, kind, message))
LOCKED(int, rs_qp_start, &qp->mem->lock, (rs_qp *qp, int crc, uint32_t ird, uint32_t ord, uint32_t max_fpdu, int rtr, int wait_rtr), (qp, crc, ird, ord, max_fpdu, rtr, wait_rtr))
LOCKED(uint32_t, rs_qp_post_send, &qp->mem->lock, (rs_qp *qp, const rs_send_wr *wrs, uint32_t n, int *why), (qp, wrs, n, why))
LOCKED(uint32_t, rs_qp_post_recv, &qp->mem->lock, (rs_qp *qp, const rs_recv_wr *wrs, uint32_t n), (qp, wrs, n))
LOCKED(uint32_t, rs_qp_post_recv_at, &qp->mem->lock, (rs_qp *qp, const rs_recv_wr *table, uint32_t n, const uint32_t *at, uint32_t count), (qp, table, n, at, count))
LOCKED(const uint8_t *, rs_qp_tx, &qp->mem->lock, (rs_qp *qp, size_t *len), (qp, len))
LOCKED_VOID(rs_qp_tx_done, &qp->mem->lock, (rs_qp *qp, size_t n), (qp, n))
LOCKED_VOID(rs_qp_rx, &qp->mem->lock, (rs_qp *qp, const uint8_t *data, size_t len), (qp, data, len))
LOCKED(int64_t, rs_qp_read_fd, &qp->mem->lock, (rs_qp *qp, int fd), (qp, fd))
LOCKED(uint32_t, rs_qp_post_send_fd, &qp->mem->lock, (rs_qp *qp, const rs_send_wr *wrs, uint32_t n, int *why, int fd, int64_t *wrote), (qp, wrs, n, why, fd, wrote))
LOCKED(int64_t, rs_qp_flush_fd, &qp->mem->lock, (rs_qp *qp, int fd), (qp, fd))
LOCKED_VOID(rs_qp_run_hook, &qp->mem->lock, (rs_qp *qp), (qp))
LOCKED_VOID(rs_qp_run_hook_fd, &qp->mem->lock, (rs_qp *qp, int fd, int64_t *wrote), (qp, fd, wrote))
static LOCKED(uint32_t, rs_qp_run_direct, &qp->mem->lock, (rs_qp *qp, int fd, int64_t *wrote), (qp, fd, wrote))
LOCKED(int64_t, rs_qp_write_fd, &qp->mem->lock, (rs_qp *qp, int fd), (qp, fd))

uint32_t rs_run(void *runner)
{
    rs_runner *r = runner;
    if (r->qp == NULL || r->fd < 0)
        return 1;
    return rs_qp_run_direct(r->qp, r->fd, &r->wrote);
}

uintptr_t rs_run_address(void) { return (uintptr_t)rs_run; }
