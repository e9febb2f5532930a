/* The native engine's core (see _engine.c and docs/native-engine.md).
 *
 * Everything between the cdef markers is also read by accel_build.py as cffi
 * declarations, so it holds only integer #defines, plain structs, opaque types
 * and prototypes.
 */
#ifndef RDMASHIM_ENGINE_H
#define RDMASHIM_ENGINE_H

#include <stddef.h>
#include <stdint.h>

/* cdef-begin */
#define RS_MAX_SGE 6
#define RS_MAX_INLINE 65536

/* Access bits (Access) */
#define RS_LOCAL_WRITE 1
#define RS_REMOTE_WRITE 2
#define RS_REMOTE_READ 4
#define RS_REMOTE_ATOMIC 8

/* Work request opcodes (WROpcode) the engine carries */
#define RS_WR_RDMA_WRITE 0
#define RS_WR_SEND 2
#define RS_WR_RDMA_READ 4
#define RS_WR_SEND_WITH_INV 9

/* Send flags (SendFlags) */
#define RS_FENCE 1
#define RS_SIGNALED 2
#define RS_SOLICITED 4
#define RS_INLINE 8
#define RS_INLINE_RAW 16  /* with RS_INLINE: each SGE's addr is a process address given by
                           * the provider (a caller's bytes), not registered memory; the
                           * provider sets it only for its own InlineData, never a user's */

/* Completion statuses (WCStatus) and opcodes (WCOpcode) */
#define RS_WC_SUCCESS 0
#define RS_WC_LOC_LEN_ERR 1
#define RS_WC_LOC_PROT_ERR 4
#define RS_WC_WR_FLUSH_ERR 5
#define RS_WC_REM_INV_REQ_ERR 9
#define RS_WC_REM_ACCESS_ERR 10
#define RS_WC_REM_OP_ERR 11
#define RS_WC_SEND 0
#define RS_WC_RDMA_WRITE 1
#define RS_WC_RDMA_READ 2
#define RS_WC_RECV 128
#define RS_WC_WITH_INV 8

/* QP states */
#define RS_QP_IDLE 0
#define RS_QP_RTS 1
#define RS_QP_TERMINATE 2
#define RS_QP_ERROR 3

/* Why a QP went to ERROR (rs_qp_error's kind) */
#define RS_ERR_NONE 0
#define RS_ERR_PROTOCOL 1      /* the peer broke the protocol: we sent a Terminate */
#define RS_ERR_REMOTE 2        /* the peer sent a Terminate */
#define RS_ERR_LOCAL 3         /* a local protection error (a WR named bad memory) */
#define RS_ERR_REVOKED 4       /* a region in use was deregistered */
#define RS_ERR_USER 5          /* moved to ERROR by the user, destroyed, or the connection lost */
#define RS_ERR_CQ_OVERRUN 6    /* a CQ it completes into overflowed */

typedef struct rs_mem rs_mem;
typedef struct rs_cq rs_cq;
typedef struct rs_srq rs_srq;
typedef struct rs_qp rs_qp;

typedef struct {
    uint64_t addr;
    uint32_t length;
    uint32_t lkey;
} rs_sge;

typedef struct {
    uint64_t wr_id;
    uint32_t opcode;
    uint32_t flags;
    uint64_t remote_addr;
    uint32_t rkey;
    uint32_t invalidate_rkey;
    uint32_t num_sge;
    rs_sge sg_list[6];
} rs_send_wr;

typedef struct {
    uint64_t wr_id;
    uint32_t num_sge;
    rs_sge sg_list[6];
} rs_recv_wr;

typedef struct {
    uint64_t wr_id;
    uint32_t status;
    uint32_t opcode;
    uint32_t byte_len;
    uint32_t qp_num;
    uint32_t wc_flags;
    uint32_t invalidated_rkey;
    uint32_t solicited;
} rs_wc;

/* What rs_cq_poll_sum found in the completions it took: bits of odd say a column is
 * not the usual (a status not success, a flag, ...); opcode and qp_num are the first
 * completion's, the same in all when RS_SUM_OPCODES / RS_SUM_QPS are clear. */
#define RS_SUM_STATUS 1
#define RS_SUM_FLAGS 2
#define RS_SUM_SOLICITED 4
#define RS_SUM_INV 8
#define RS_SUM_OPCODES 16
#define RS_SUM_QPS 32
#define RS_SUM_LENGTHS 64      /* a byte_len is not 0 */
typedef struct {
    uint32_t odd;
    uint32_t opcode;
    uint32_t qp_num;
} rs_wc_sum;

typedef struct {
    uint32_t kind;          /* RS_ERR_* */
    uint32_t layer;         /* the Terminate code sent or received */
    uint32_t etype;
    uint32_t ecode;
    char message[160];      /* what happened, for qp.error */
} rs_error;

/* What a provider reads of the memory table, a CQ and a QP without a call (a call into
 * C costs several times a read of its memory): each *_view_of pointer stays valid while
 * its object lives, and C keeps the view current; a QP's computed fields (rx_owed,
 * tx_ready) are brought up to date at the end of every call on it, and when a
 * deregistration stops it. The provider may clear news; it writes nothing else. */
typedef struct {
    uint64_t epoch;         /* regions removed or invalidated ever: what was checked valid
                             * stays so while it holds */
} rs_mem_view;

typedef struct {
    uint64_t pushed;        /* completions pushed ever */
    uint64_t notable;       /* of them, solicited or not a success (a provider compares
                             * both with what it saw to know what arrived) */
    uint32_t count;         /* queued now */
    int32_t overrun;        /* a completion did not fit */
    uint32_t wanted;        /* its native handler asked for the provider's attention (the
                             * provider clears it when it hands the CQ on) */
} rs_cq_view;

typedef struct {
    uint32_t news;          /* RS_NEWS_* gathered since the provider cleared it */
    uint32_t sq_depth;      /* send WRs posted and not completed */
    uint64_t rx_owed;       /* payload bytes the peer owes now: the rest of the FPDU being
                             * received and of the responses to the outstanding Reads (a
                             * lower bound of what will arrive: a reader may wait for that
                             * much before it looks, SO_RCVLOWAT) */
    int32_t tx_ready;       /* bytes framed wait to be sent, or work to be framed */
} rs_qp_view;

/* rs_mem_free, rs_cq_free and rs_srq_free may come before rs_qp_free of the QPs using
 * the object: it is freed with the last of them. */

/* Memory: one table per device. Regions are named by their STag (lkey = rkey);
 * base is where the first byte is in this process, iova its tagged offset. */
rs_mem *rs_mem_new(void);
void rs_mem_free(rs_mem *mem);
int rs_mem_add(rs_mem *mem, uint32_t stag, uint8_t *base, uint64_t iova, uint64_t length,
               uint32_t access, uint64_t pd);
/* Deregister: every QP of the table stops using the region before this returns
 * (work started on it completes LOC_PROT_ERR and the QP goes to ERROR). */
int rs_mem_remove(rs_mem *mem, uint32_t stag);
int rs_mem_valid(rs_mem *mem, uint32_t stag);
rs_mem_view *rs_mem_view_of(rs_mem *mem);

/* Completion queues: a ring of cqe entries. */
rs_cq *rs_cq_new(uint32_t cqe);
void rs_cq_free(rs_cq *cq);
uint32_t rs_cq_poll(rs_cq *cq, rs_wc *out, uint32_t n);
rs_cq_view *rs_cq_view_of(rs_cq *cq);
/* rs_cq_poll, and what the completions taken have in common (*sum). */
uint32_t rs_cq_poll_sum(rs_cq *cq, rs_wc *out, uint32_t n, rs_wc_sum *sum);
/* A native completion handler (cq.set_native_handler; verbs/native_handler.h declares the
 * same ABI for a ULP's C, docs/verbs.md "Native completion handlers" explains it). At the end of every call on a QP that leaves
 * completions in a CQ with a handler, the engine calls
 *     want = fn(context, verbs, cq, qp, qp_num)
 * inside that call (the QP's lock held, without the GIL where the call is made
 * without it), never from inside the handler itself. The handler polls and posts only
 * through verbs: poll takes up to n completions into rows (rs_wc is a WC_ROW row),
 * post_recv posts n single-buffer receives and post_send n single-buffer Sends (or RDMA
 * Writes and Reads of one local buffer) on the QP
 * whose call ran (qp_num), checked as any post's (a Send's memory when it is framed, a
 * receive's when data is placed in it); how many were taken. A non-zero want sets
 * the CQ view's wanted: the provider then hands the CQ on as for a completion that was
 * reported. fn NULL removes the handler. */
typedef struct {
    uint64_t wr_id;
    uint64_t addr;
    uint32_t length;
    uint32_t lkey;
} rs_hook_recv;
typedef struct {
    uint64_t wr_id;
    uint64_t addr;
    uint32_t length;
    uint32_t lkey;
    uint32_t flags;         /* RS_FENCE, RS_SIGNALED, RS_SOLICITED, RS_INLINE */
    uint32_t opcode;        /* RS_HOOK_SEND (0), RS_HOOK_RDMA_WRITE, RS_HOOK_RDMA_READ */
    uint64_t remote_addr;   /* an RDMA Write's or Read's peer buffer */
    uint32_t rkey;
} rs_hook_send;
#define RS_HOOK_SEND 0
#define RS_HOOK_RDMA_WRITE 1
#define RS_HOOK_RDMA_READ 2
typedef struct {
    uint32_t (*poll)(rs_cq *cq, rs_wc *rows, uint32_t n);
    uint32_t (*post_recv)(rs_qp *qp, const rs_hook_recv *wrs, uint32_t n);
    uint32_t (*post_send)(rs_qp *qp, const rs_hook_send *wrs, uint32_t n);
} rs_hook_verbs;
void rs_cq_set_hook(rs_cq *cq, void *fn, void *context);
/* Run the native handler of qp's send CQ now, whether completions wait or not (the
 * provider's qp.run_native_handler: a ULP's C staged Sends for it to post), then as
 * every call ends; the _fd form writes what waits to be sent into fd, as
 * rs_qp_post_send_fd does (*wrote: 0, or how a write ended, -errno). */
void rs_qp_run_hook(rs_qp *qp);
void rs_qp_run_hook_fd(rs_qp *qp, int fd, int64_t *wrote);
/* What a ULP's C calls to run the handler of a QP's send CQ and write what it posted
 * (the provider's qp.native_runner: rs_run with a runner as its context), with no
 * Python: the QP (NULL once it is freed) and its connection's socket (-1 while there is
 * none, and once it closes), kept current by the provider. */
typedef struct {
    rs_qp *qp;
    int fd;
    int64_t wrote;          /* how its last write ended: 0, or -errno */
} rs_runner;
/* rs_qp_run_hook_fd on the runner's QP and socket: 0 when that is all, 1 when the
 * provider's Python must still run it (qp.run_native_handler): the socket was full or
 * failed, the QP has news for its owner, or there is no QP or socket (then nothing ran). */
uint32_t rs_run(void *runner);
uintptr_t rs_run_address(void);

rs_srq *rs_srq_new(uint32_t max_wr);
void rs_srq_free(rs_srq *srq);
/* Post n receives; returns how many were taken (the rest: the queue is full). */
uint32_t rs_srq_post(rs_srq *srq, const rs_recv_wr *wrs, uint32_t n);

/* What happened in a QP's calls since the provider last cleared its view's news (bits). */
#define RS_NEWS_CQ 1           /* it pushed a completion (to either CQ) */
#define RS_NEWS_STATE 2        /* it left RTS */
#define RS_NEWS_RTR 4          /* the peer's RTR arrived */
/* A post at indices that names an entry outside its table: nothing posted. */
#define RS_BAD_INDEX 4294967295u

/* A queue pair; srq may be NULL (its own receive queue of max_recv_wr). */
rs_qp *rs_qp_new(rs_mem *mem, uint64_t pd, uint32_t qp_num, rs_cq *send_cq, rs_cq *recv_cq,
                 rs_srq *srq, uint32_t max_send_wr, uint32_t max_recv_wr, int sq_sig_all);
void rs_qp_free(rs_qp *qp);
/* Enter RTS with what MPA negotiated. rtr: 0 none, 1 send a zero-length Write,
 * 2 send a zero-length Read Request; wait_rtr: hold transmission until the
 * peer's RTR arrives. Returns -1 for a max_fpdu outside 64..65536. */
int rs_qp_start(rs_qp *qp, int crc, uint32_t ird, uint32_t ord, uint32_t max_fpdu, int rtr,
                int wait_rtr);
/* Post n send WRs; inline data (RS_INLINE) is copied now. Returns how many were
 * taken; *why says why the next was not (0: all taken; else an errno). */
uint32_t rs_qp_post_send(rs_qp *qp, const rs_send_wr *wrs, uint32_t n, int *why);
uint32_t rs_qp_post_recv(rs_qp *qp, const rs_recv_wr *wrs, uint32_t n);
/* Post entries at[0..count) of table[0..n) (a prepared batch, posted at indices), in
 * order; how many were taken, or RS_BAD_INDEX (nothing posted) for an index >= n. */
uint32_t rs_qp_post_recv_at(rs_qp *qp, const rs_recv_wr *table, uint32_t n, const uint32_t *at,
                            uint32_t count);
uint32_t rs_srq_post_at(rs_srq *srq, const rs_recv_wr *table, uint32_t n, const uint32_t *at,
                        uint32_t count);
/* rs_qp_post_send, then rs_qp_flush_fd: a post and the way of its bytes to TCP in one
 * call (*wrote: what rs_qp_flush_fd returned). */
uint32_t rs_qp_post_send_fd(rs_qp *qp, const rs_send_wr *wrs, uint32_t n, int *why, int fd,
                            int64_t *wrote);
/* Received bytes: all of data[0:len] is taken (after an error it is discarded). */
void rs_qp_rx(rs_qp *qp, const uint8_t *data, size_t len);
/* The bytes to send now: *len bytes at the returned pointer (NULL, 0 when none);
 * valid until the next call on the QP. rs_qp_tx_done says n of them went to TCP
 * (a Send or Write completes once its last byte has). */
const uint8_t *rs_qp_tx(rs_qp *qp, size_t *len);
void rs_qp_tx_done(rs_qp *qp, size_t n);
/* The socket side: read what the connected socket fd has (one read of up to 256 KiB)
 * and take it, or write what is ready to send. Each returns the bytes moved, 0 at the
 * peer's FIN (a read) or when nothing is ready (a write), or -errno (-EAGAIN: the
 * socket has nothing, or no room). A failed socket moves the QP to ERROR. */
int64_t rs_qp_read_fd(rs_qp *qp, int fd);
int64_t rs_qp_write_fd(rs_qp *qp, int fd);
/* rs_qp_write_fd until C has nothing more to send (0) or the socket is full or failed
 * (-errno: -EAGAIN, or the error that moved the QP to ERROR). */
int64_t rs_qp_flush_fd(rs_qp *qp, int fd);
/* Busy polling: rs_qp_read_fd again and again (yielding the CPU between tries) until it
 * reads something, the connection ends, or ns nanoseconds pass (-EAGAIN then). */
int64_t rs_qp_spin_fd(rs_qp *qp, int fd, uint64_t ns);
/* The caller's event loop has nothing else to do: wait (cffi calls without the GIL)
 * until fd or the loop's own descriptor others is readable, or timeout_ms passes; then
 * rs_qp_read_fd when fd is readable and others is not. -EBUSY when nothing was read
 * (others is readable: the loop goes first; or the time is up). */
int64_t rs_qp_wait_read_fd(rs_qp *qp, int fd, int others, int timeout_ms);
/* A task waiting for completions of cq, the QP's only CQ, in one call: rs_qp_spin_fd
 * for spin_ns (none when 0), then, when that read nothing, rs_qp_wait_read_fd; what the
 * read returned in got[0]; then, when it read something and the QP has no news but
 * completions and cq no overrun, a poll of cq into out as rs_cq_poll_sum. The rows
 * taken (0: none; the caller looks at the news first). got[1] is 1 when nothing but
 * the rows is left for the caller to hand on, and the QP's news are cleared: quiet_owed
 * is not 0 (the caller has no one to wake or notify), the poll took every completion
 * of cq, cq is both the QP's send and receive CQ, nothing waits to be sent, and the
 * peer owes fewer than quiet_owed bytes (the caller's mark for waiting for them). */
uint32_t rs_qp_wait_poll_fd(rs_qp *qp, int fd, uint64_t spin_ns, int others, int timeout_ms, rs_cq *cq,
                           rs_wc *out, uint32_t n, rs_wc_sum *sum, uint64_t quiet_owed,
                           int64_t *got);
/* A thread of its own serves the QP (cffi calls without the GIL): wait until either of
 * its CQs holds a completion, it left RTS or has other news than completions (1: look),
 * or wake is readable (-EINTR: its owner takes it back), or poll fails (-errno);
 * meanwhile read fd as it is readable, and write what waits to be sent as it has room.
 * Every call on a QP, CQ, SRQ or memory table runs under its device's lock, so such a
 * thread and the event loop's calls on the device do not meet. */
int64_t rs_qp_serve_wait(rs_qp *qp, int fd, int wake);
/* One turn of a thread serving the QP, in one call: rs_qp_serve_wait, then a poll of
 * its CQ (the QP's only one: send and receive) into out, up to n rows, with what they
 * have in common in sum (rs_cq_poll_sum). The rows taken (at least one); 0 when the QP
 * has news only its owner's event loop acts on (it left RTS, the peer's RTR, a CQ
 * overrun), which are left for it; -errno as rs_qp_serve_wait (-EINTR: woken). The
 * completion news it hands on in its rows are cleared. */
int64_t rs_qp_serve_poll(rs_qp *qp, int fd, int wake, rs_wc *out, uint32_t n, rs_wc_sum *sum);
/* Messages answered from slots (rs_qp_serve_slot; verbs/slots.py is the Python side):
 * Receive slot i is recv_size bytes at recv_addr + i * recv_size, posted as wr_id i;
 * Send slot j is send_size bytes at send_addr + j * send_size, sent as wr_id
 * send_base + j. The free Send slots are a stack (free[nfree - 1] is taken next), the
 * ones posted and not known complete a ring in the order posted (unacked, from head),
 * and every signal_every-th Send is signaled: its completion frees it and every Send
 * before it. Receives given back wait in reposts until repost_every are there, then
 * are posted in one go. room is what the send queue has room for. Its owner hands the
 * whole state to C before a turn and reads it back after; C changes it only in turns. */
typedef struct {
    uint64_t recv_addr;
    uint32_t recv_lkey, recv_size, nrecv;
    uint64_t send_addr;
    uint32_t send_lkey, send_size, nsend;
    uint64_t send_base;
    uint32_t signal_every, repost_every;
    uint32_t *free;         /* nsend entries */
    uint32_t nfree;
    uint32_t *unacked;      /* a ring of nsend entries */
    uint32_t head, nunacked;
    uint32_t *reposts;      /* repost_every entries */
    uint32_t nreposts;
    uint32_t unsignaled;    /* Sends since the last signaled one */
    int64_t room;
    /* A turn's news: lone is 1 when its one row is a successful Receive of recv_len
     * bytes in Receive slot recv_slot, and Send slot send_slot (free[nfree - 1]) is free
     * for its answer; reply_len, set by the owner before the next turn, is the answer's
     * length in send_slot (RS_NO_REPLY: none; the Receive stays the owner's). */
    uint32_t lone, recv_slot, recv_len, send_slot, reply_len;
} rs_slots;
#define RS_NO_REPLY 4294967295
/* A turn of a thread serving the QP from slots: the answer of the last turn's lone
 * Receive (s->reply_len) is posted from its Send slot and the Receive given back, what
 * waits is written, then rs_qp_serve_poll of one completion at a time, except that
 * the completions of Sends from slots free their slots here and are not rows. 1 when
 * out[0] holds a completion (s->lone says whether it is a lone Receive: each Receive
 * of a burst gets a turn of its own); 0 when the QP has news for its owner's event
 * loop (or the answer could not be posted: the QP left RTS); -EINVAL when
 * s->reply_len does not fit its slot, the slots are not as the last turn left them or
 * do not add up (more Send slots free and out than there are); -errno as
 * rs_qp_serve_wait. */
int64_t rs_qp_serve_slot(rs_qp *qp, int fd, int wake, rs_slots *s, rs_wc *out, rs_wc_sum *sum);
/* Move to ERROR (the user, a destroy, or the connection lost): flush everything. */
void rs_qp_set_error(rs_qp *qp, uint32_t kind, const char *message);
int rs_qp_state(rs_qp *qp);
void rs_qp_error(rs_qp *qp, rs_error *out);
rs_qp_view *rs_qp_view_of(rs_qp *qp);
/* Whether the peer's RTR is still awaited (rs_qp_start's wait_rtr). */
int rs_qp_rtr_pending(rs_qp *qp);
/* Bytes received ever (rs_qp_rx and rs_qp_read_fd). */
uint64_t rs_qp_rx_total(rs_qp *qp);
/* cdef-end */

#endif
