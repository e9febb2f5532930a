/* RDS's plain-message path in C: receive and send over RDMA and TCP (see _plain.c
 * and docs/rds.md).
 *
 * Everything between the cdef markers is also read by plain_build.py as cffi
 * declarations, so it holds only integer #defines, plain structs and prototypes.
 * The code knows no verbs backend: it reads completions as rows of the portable
 * layout (verbs.wr.WC_ROW) and a session's receive buffer as bytes.
 */
#ifndef RDMASHIM_RDS_PLAIN_H
#define RDMASHIM_RDS_PLAIN_H

#include <stddef.h>
#include <stdint.h>

/* cdef-begin */
#define RP_HEADER_LEN 48
#define RP_FRAG_SIZE 4096
#define RP_MAX_MSG_SIZE 1048576 /* RDS_MAX_MSG_SIZE */
#define RP_PROBE_PORT 1
#define RP_CONG_BITMAP 1
#define RP_EXT_RDMA 2      /* the extension header of a message chasing an RDMA operation */
#define RP_CONG_MAP_BYTES 8192 /* RDS_CONG_MAP_BYTES: a bit a port */
#define RP_UNSYNCED_MAX 1024   /* messages through the gate Python has not brought in, at most */

#define RP_ACK_REQUIRED 2  /* RdsFlag.ACK_REQUIRED */
#define RP_MAX_CREDIT 255  /* RDS_MAX_ADV_CREDIT: credits one header grants at most */
#define RP_SEND_SOLICITED 4  /* SendFlags (the verbs table's send.flags) */
#define RP_SEND_SIGNALED 2
#define RP_SEND_INLINE 8
#define RP_POST_SEND 0       /* the verbs table's send.opcode */
#define RP_POST_RDMA_WRITE 1

/* Why rp_scan stopped (rp_rx.stop) */
#define RP_DONE 0          /* every row taken */
#define RP_NOT_PLAIN 1     /* the row is not a plain message: RdmaFlow takes it */
#define RP_FOR_PYTHON 2    /* plain, but its delivery is Python's (a ping, a probe, no
                            * socket, a socket over its bound, a number out of turn) */

/* One completion: the layout of verbs.wr.WC_ROW (the native engine's rs_wc is the same;
 * its header is not included here: RDS knows no backend) */
typedef struct {
    uint64_t wr_id;
    uint32_t status;
    uint32_t opcode;
    uint32_t byte_len;
    uint32_t qp_num;
    uint32_t wc_flags;
    uint32_t invalidated_rkey;
    uint32_t solicited;
} rp_row;

/* One message in a socket's receive queue */
typedef struct rp_msg {
    struct rp_msg *next;
    uint64_t seq;
    uint32_t len;
    uint16_t sport;
    uint16_t family;        /* 4 or 6: how much of peer is the address */
    char peer[16];          /* the sender's address */
    char data[];
} rp_msg;

/* A socket's receive queue: messages oldest first */
typedef struct {
    rp_msg *head;
    rp_msg *tail;
    uint64_t count;
    uint64_t nbytes;
    uint64_t *holding;      /* the node's count of inboxes holding messages */
    uint32_t use_once;      /* the socket's live use-once registrations (Python counts
                             * them): only while it has one does a message chasing an
                             * RDMA operation need Python, to end the one it names */
    uint16_t port;          /* the port it is bound to */
} rp_inbox;

/* A node's ports: the inbox each bound port's messages go to (it owns them) */
typedef struct {
    uint64_t holding;       /* inboxes that hold messages */
    rp_inbox **pages[256];  /* port >> 8 -> 256 inboxes, made when first bound */
} rp_ports;

/* One session's receive state, for one scan: what it reads and what it leaves */
typedef struct {
    uint64_t next_recv;     /* in/out: the sequence number due next */
    uint64_t ack;           /* out: the highest h_ack seen (valid when rows were taken) */
    uint64_t credits;       /* out: credits the peer granted */
    uint64_t messages;      /* out: messages delivered */
    uint64_t bytes;         /* out: their payload bytes */
    uint32_t chasers;       /* out: messages queued that chase an RDMA operation */
    int64_t talk;           /* in/out: as RdmaFlow.talk */
    uint32_t stop;          /* out: RP_* */
    uint32_t nreposts;      /* in/out: entries of reposts filled: the rows taken */
    uint32_t nwoken;        /* in/out: entries of woken filled (and of chased) */
    uint32_t slot;          /* in: bytes per receive buffer */
    uint64_t rcvbuf;        /* in: a socket over this is congested (Python marks it) */
    uint64_t rcvbuf_limit;  /* in: a message over this is dropped (Python drops it) */
    uint16_t family;        /* in: the peer's address */
    char peer[16];
    uint32_t has_ack;       /* out: a header was taken (ack is set) */
} rp_rx;

/* One session's flow counters (RdmaFlow.state; rdma_flow.FlowState on the Python path):
 * Python's RdmaFlow, rp_send and rp_handle all change them */
typedef struct {
    int64_t send_credits;   /* the peer's receives we may still send into */
    int64_t advertise;      /* our receives posted again, not yet granted to the peer */
    uint64_t acked_to_peer; /* the last sequence number a header of ours acknowledged */
    double ack_at;          /* when an acknowledgement held back goes alone (inf: none) */
    uint32_t ack_countdown; /* messages before the next one asks for an acknowledgement */
    uint32_t flow_control;  /* Sends wait for the peer's credits */
} rp_flow;

/* The RDMA Write a plain message sent in C chases (rp_send_write): posted just before
 * its Send, from its send buffer's entry (length 0: none) */
typedef struct {
    uint64_t addr;          /* the local bytes, registered (lkey) */
    uint64_t remote_addr;   /* where in the peer's region (rkey) */
    uint32_t length;
    uint32_t lkey;
    uint32_t rkey;
    uint32_t pad;
} rp_write;

/* verbs' native completion handler ABI (docs/verbs.md, "Native completion handlers"):
 * declared here as RDS knows no backend */
typedef struct {
    uint64_t wr_id;
    uint64_t addr;
    uint32_t length;
    uint32_t lkey;
} rp_recv;
typedef struct {
    uint64_t wr_id;
    uint64_t addr;
    uint32_t length;
    uint32_t lkey;
    uint32_t flags;
    uint32_t opcode;        /* RP_POST_SEND, RP_POST_RDMA_WRITE */
    uint64_t remote_addr;
    uint32_t rkey;
} rp_send_wr;
typedef struct {
    uint32_t (*poll)(void *cq, rp_row *rows, uint32_t n);
    uint32_t (*post_recv)(void *qp, const rp_recv *wrs, uint32_t n);
    uint32_t (*post_send)(void *qp, const rp_send_wr *wrs, uint32_t n);
} rp_verbs;

/* The gate of a socket's sendto in one call into C (rp_sendto over RDMA, rp_stream_sendto
 * over TCP): the connection's outgoing numbers and bounds, kept in C while Python keeps
 * the gate open (plain.SendGate) */
typedef struct {
    uint32_t open;          /* in: a sendto may send (Python closes it before it sends,
                             * queues or folds anything, and brings in what went) */
    uint32_t unsynced;      /* in/out: messages sent through the gate that Python has not
                             * yet numbered and kept for the peer's acknowledgement */
    uint64_t next_seq;      /* in/out: the connection's next sequence number */
    uint64_t queued_bytes;  /* in/out: its bytes queued or not yet acknowledged, and */
    uint64_t queued;        /* messages, as RdsConnection.has_room counts them (acks
                             * lower them only when Python brings them in: until then C
                             * sees less room) */
    uint64_t sndbuf;        /* in: has_room's bounds (sndbuf also bounds a message) */
    uint64_t max_queued;
    const unsigned char *peer_cong; /* in: the peer's congestion map (RP_CONG_MAP_BYTES) */
} rp_gate;

/* One session's completions taken by its CQ's native handler (rp_handle): the scan's
 * state and outs (which add up until Python folds them into the session), and what the
 * handler left to Python */
typedef struct {
    rp_rx *rx;
    rp_ports *ports;
    rp_row *rows;           /* where it polls, room rows */
    uint32_t room;
    const char *recv;       /* the session's receive buffers, recv_len bytes */
    uint64_t recv_len;
    uint32_t *reposts;      /* the scan's lists (room entries each) */
    uint16_t *woken;
    int64_t *chased;
    uint64_t recv_addr;     /* receive buffer i is recv_addr + i * rx->slot (lkey recv_lkey) */
    uint32_t recv_lkey;
    uint32_t repost_batch;  /* receives go back in lists of at least this many */
    uint32_t posted;        /* out: receives it posted again (counted in flow->advertise
                             * as it posts them, when flow_control) */
    uint32_t left;          /* out: rows[left..polled) are Python's, in order */
    uint32_t polled;
    uint32_t held;          /* it asked (or Python holds it): it takes nothing until
                             * Python, having taken what waits, clears this */
    uint32_t sends_waiting; /* in: Python's sends wait for credits or room: it asks at
                             * every row it takes (their credits and acks) */
    uint32_t quiet_port;    /* in: the port whose reader drives the session (0: none):
                             * a plain message for it wakes no one */
    uint32_t grant_at;      /* in: it asks once flow->advertise reaches this (0: never):
                             * the credits of that many receives are due to the peer */
    uint64_t ack_watch;     /* in: it asks once an acknowledgement reaches this sequence
                             * number (0: none): a message whose RDMA operation ends then */
    /* Plain messages sent in C (rp_send), from a ring of send buffers of their own */
    rp_flow *flow;
    char *send;             /* send_slots buffers of rx->slot bytes, registered: */
    uint64_t send_addr;     /* buffer i at send_addr + i * rx->slot, lkey send_lkey */
    uint32_t send_lkey;
    uint32_t send_slots;    /* 0: no Sends in C */
    uint64_t send_wr;       /* buffer i's Send is work request send_wr + i */
    uint32_t send_head;     /* the buffer the next one takes */
    uint32_t send_busy;     /* buffers posted (or staged) and not known complete */
    uint32_t unsignaled;    /* Sends posted unsignaled since the last signaled one */
    uint32_t signal_every;  /* at least one Send in this many is signaled */
    uint32_t ack_every;     /* at least one message in this many asks for an ack */
    uint32_t max_inline;    /* Sends up to this long go inline */
    uint32_t staged;        /* out: Sends written and not yet posted (the next run posts
                             * them): buffers send_head - staged .. send_head - 1 */
    uint32_t refused;       /* out: the QP refused a staged Send (it is leaving RTS) */
    uint64_t sent;          /* out: messages rp_send took */
    rp_write *writes;       /* send_slots entries: the Write each buffer's message chases;
                             * buffer i's Write is work request send_wr + send_slots + i */
    rp_gate gate;           /* a socket's sendto in one call (rp_sendto) */
    uint32_t (*run)(void *ctx);     /* in: posts what was staged and writes it, 0 when that
                                     * is all (the QP's native runner; NULL: none) */
    void *run_ctx;
} rp_hook;


/* RDS/TCP's sends through the gate (rp_stream_sendto): written to the connection's socket */
typedef struct {
    rp_gate gate;
    int32_t fd;             /* in: the connection's socket */
    uint32_t partial;       /* out: the socket took only this many bytes of the last
                             * message (header included): the gate closed, and Python
                             * writes the rest before anything else */
    uint64_t written;       /* in/out: bytes written through the gate since Python last
                             * brought them in */
} rp_stream_tx;


/* RDS/TCP's reads in C (rp_stream_read): the socket read into a buffer of the session's,
 * and the whole plain messages at its front taken as rp_stream takes them */
typedef struct {
    rp_rx *rx;
    rp_ports *ports;
    uint16_t *woken;        /* room for woken_room ports */
    uint32_t woken_room;
    int32_t fd;             /* in: the connection's socket (-1: gone, nothing is read) */
    char *buf;              /* in: cap bytes, the session's */
    uint64_t cap;
    uint64_t got;           /* out: bytes the read brought (0: see error, or the end of
                             * the stream) */
    int32_t error;          /* out: the read's errno (0: none) */
} rp_stream_rx;


rp_ports *rp_ports_new(void);
void rp_ports_free(rp_ports *ports);
rp_inbox *rp_open(rp_ports *ports, uint16_t port);
void rp_close(rp_ports *ports, rp_inbox *box);
int rp_push(rp_inbox *box, uint64_t seq, uint16_t sport, uint16_t family, const char *peer,
             const char *data, uint32_t len);
rp_msg *rp_take(rp_inbox *box);
void rp_clear(rp_inbox *box);
void rp_free(rp_msg *msg);
uint32_t rp_scan(rp_rx *rx, rp_ports *ports, const rp_row *rows, uint32_t n,
                 const char *recv, uint64_t recv_len, uint32_t *reposts, uint32_t room,
                 uint16_t *woken, int64_t *chased, uint32_t woken_room);
/* RDS/TCP's stream (no fragments, and TCP's acks and flow control: the headers' are
 * zero): take the whole plain messages at the front of buf's len bytes into their
 * inboxes, as rp_scan takes a row's (no checksum, extension header or congestion map,
 * numbered next, for a bound port under its bounds); the bytes taken, whole messages
 * only. rx->stop: RP_DONE (the rest is an incomplete message, or none), RP_NOT_PLAIN or
 * RP_FOR_PYTHON (the message at the end of what it took is Python's). */
uint64_t rp_stream(rp_rx *rx, rp_ports *ports, const char *buf, uint64_t len, uint16_t *woken,
                   uint32_t woken_room);
/* Read the connection's socket once (no wait) into st->buf and take the whole plain
 * messages at its front as rp_stream does: the bytes taken (buf[taken..got) are the
 * rest, for Python's decoder: a message in part, or one that is not plain and what
 * follows it). Only when the stream's next byte begins a message: nothing of it is
 * buffered elsewhere, and no header was taken whose payload is still to come. */
uint64_t rp_stream_read(rp_stream_rx *st);
/* The native handler (set on the session's CQ with hook as its context): polls, takes
 * runs of plain messages as rp_scan, posts their receives again in lists of
 * repost_batch; non-zero (and held) when Python must look: a row it did not take, a
 * reader to wake, credits and acks while sends wait, credits to grant, an RDMA
 * operation's end. A run of several messages for the driving reader is not one: its
 * answers go from C one by one, as a ping-pong's do. */
uint32_t rp_handle(void *hook, const rp_verbs *verbs, void *cq, void *qp, uint32_t qp_num);
uintptr_t rp_handle_address(void);
/* Write a plain message (one fragment, no extension, numbered seq) and our ack and
 * credits into the next free send buffer, as RdmaFlow.fill writes the only message
 * queued, and stage its Send for the next run of rp_handle (qp.run_native_handler):
 * 1; 0 when it may not go in C now (the handler is held, no credit or buffer is free,
 * it is too long): Python sends it. The caller sends in C only what Python would send
 * next with nothing else queued. */
uint32_t rp_send(rp_hook *hook, uint64_t seq, uint16_t sport, uint16_t dport,
                 const char *data, uint32_t len);
/* rp_send for a message chasing an RDMA Write of length bytes at laddr (lkey) into the
 * peer's region (rkey, remote_addr): its header carries the R_Key in an RDMA extension,
 * and the Write is posted, unsignaled, just before its Send. 0 as rp_send's, and also
 * when the Write is empty or longer than RP_MAX_MSG_SIZE. */
uint32_t rp_send_write(rp_hook *hook, uint64_t seq, uint16_t sport, uint16_t dport,
                       const char *data, uint32_t len, uint64_t laddr, uint32_t lkey,
                       uint32_t length, uint64_t remote_addr, uint32_t rkey);
/* A socket's sendto of a plain message (from sport to dport, len bytes) in one call:
 * numbered next (hook->gate.next_seq), staged as rp_send stages it and posted by hook->run,
 * when Python keeps the gate open (hook->gate.open), the connection has room (has_room's
 * bounds, from C's counts), the peer's port is not congested and fewer than
 * RP_UNSYNCED_MAX wait for Python to bring them in: 1, or 2 when the QP's Python must
 * still run the native handler (no runner, or it said so); the caller keeps the message
 * for Python, in order. Else 0, nothing changed: Python's sendto takes it. */
uint32_t rp_sendto(rp_hook *hook, uint16_t sport, uint16_t dport, const char *data,
                   uint32_t len);
/* rp_sendto for a message chasing an RDMA Write (rp_send_write's arguments): the same
 * gate, bounds and answers. */
uint32_t rp_sendto_write(rp_hook *hook, uint16_t sport, uint16_t dport, const char *data,
                         uint32_t len, uint64_t laddr, uint32_t lkey, uint32_t length,
                         uint64_t remote_addr, uint32_t rkey);
/* RDS/TCP's sendto of a plain message (from sport to dport, len bytes) in one call:
 * numbered next (gate.next_seq) and written to the socket with its header (h_ack and
 * h_credit zero, as StreamSender frames it) when the gate lets it through, as rp_sendto's
 * does: 1; 2 when the socket took only part of it (tx->partial bytes: the gate is closed
 * now, and Python must write the rest first); the caller keeps the message for Python,
 * in order. Else 0, nothing written or changed (the gate refuses, the socket is full or
 * broken): Python's sendto takes it, and its write says which. */
uint32_t rp_stream_sendto(rp_stream_tx *tx, uint16_t sport, uint16_t dport, const char *data,
                          uint32_t len);
/* The sequence number of the message whose chased Write is work request wr_id (a failed
 * one's completion), read from its send buffer; -1 when wr_id is not one of them. */
int64_t rp_write_seq(rp_hook *hook, uint64_t wr_id);
/* A successful Send completion that Python polled: 1 when it was one of rp_send's (its
 * buffer and every earlier one are free again), else 0. */
uint32_t rp_sent(rp_hook *hook, uint64_t wr_id);
/* cdef-end */

#endif
