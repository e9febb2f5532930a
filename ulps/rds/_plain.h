/* RDS's plain-message receive path in C (see _plain.c and docs/rds.md).
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
#define RP_PROBE_PORT 1
#define RP_CONG_BITMAP 1
#define RP_EXT_RDMA 2      /* the extension header of a message chasing an RDMA operation */

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
} rp_rx;

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
/* cdef-end */

#endif
