/* RDS's plain-message path in C: the sockets' receive queues; one call that takes a
 * poll's plain messages into them (rp_scan, and rp_handle, the CQ's native handler, around
 * it), one that takes them from an RDS/TCP stream (rp_stream), and one that sends a plain
 * message over RDMA (rp_send, posted by rp_handle's next run; rp_sendto, a socket's sendto
 * with the connection's numbering, in one call) and over TCP (rp_stream_sendto; and
 * rp_stream_read, a read of the socket and rp_stream in one call).
 *
 * Python's RdmaFlow.receive_at and RdsNode._deliver are the reference: a message is
 * plain when it is a received Send of one fragment with no checksum, no extension
 * header but the RDMA one of a message chasing an RDMA operation, and no congestion
 * map, numbered next, for a bound port whose socket has room under rcvbuf. rp_scan
 * takes such rows in order (and bare acks), adds their credits and acks to the
 * session's state, queues their payloads on their sockets and lists their receive
 * buffers for reposting; at the first row that is anything else it
 * stops and says why, and Python takes that row as it takes every row without this
 * module. Every read of the receive buffer is checked against its length first.
 * RdmaFlow.fill is rp_send's reference, StreamDecoder's Python path rp_stream's.
 */
#include "_plain.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>

#define RP_RECV 128 /* WCOpcode.RECV */
#define RP_SEND 0   /* WCOpcode.SEND */

static uint64_t be64(const unsigned char *p)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v = v << 8 | p[i];
    return v;
}

static uint32_t be32(const unsigned char *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

static uint16_t be16(const unsigned char *p) { return (uint16_t)(p[0] << 8 | p[1]); }

static void put64(unsigned char *p, uint64_t v)
{
    for (int i = 7; i >= 0; i--, v >>= 8)
        p[i] = (unsigned char)v;
}

static void put32(unsigned char *p, uint32_t v)
{
    p[0] = (unsigned char)(v >> 24);
    p[1] = (unsigned char)(v >> 16);
    p[2] = (unsigned char)(v >> 8);
    p[3] = (unsigned char)v;
}

static void put16(unsigned char *p, uint16_t v)
{
    p[0] = (unsigned char)(v >> 8);
    p[1] = (unsigned char)v;
}

rp_ports *rp_ports_new(void) { return calloc(1, sizeof(rp_ports)); }

static rp_inbox **place(rp_ports *ports, uint16_t port, int make)
{
    rp_inbox **page = ports->pages[port >> 8];
    if (page == NULL) {
        if (!make)
            return NULL;
        page = ports->pages[port >> 8] = calloc(256, sizeof(rp_inbox *));
        if (page == NULL)
            return NULL;
    }
    return &page[port & 0xff];
}

static rp_inbox *lookup(const rp_ports *ports, uint16_t port)
{
    rp_inbox **page = ports->pages[port >> 8];
    return page == NULL ? NULL : page[port & 0xff];
}

/* A new inbox bound to port (NULL: no memory, or the port has one). */
rp_inbox *rp_open(rp_ports *ports, uint16_t port)
{
    rp_inbox **at = place(ports, port, 1);
    if (at == NULL || *at != NULL)
        return NULL;
    rp_inbox *box = calloc(1, sizeof(rp_inbox));
    if (box == NULL)
        return NULL;
    box->holding = &ports->holding;
    box->port = port;
    *at = box;
    return box;
}

/* Unbind box, drop its messages and free it. */
void rp_close(rp_ports *ports, rp_inbox *box)
{
    rp_inbox **at = place(ports, box->port, 0);
    if (at != NULL && *at == box)
        *at = NULL;
    rp_clear(box);
    free(box);
}

void rp_ports_free(rp_ports *ports)
{
    if (ports == NULL)
        return;
    for (int i = 0; i < 256; i++) {
        if (ports->pages[i] == NULL)
            continue;
        for (int j = 0; j < 256; j++) {
            if (ports->pages[i][j] != NULL) {
                rp_clear(ports->pages[i][j]);
                free(ports->pages[i][j]);
            }
        }
        free(ports->pages[i]);
    }
    free(ports);
}

/* Queue a message made already (not NULL) on box. */
static void append(rp_inbox *box, rp_msg *msg)
{
    msg->next = NULL;
    if (box->tail == NULL) {
        box->head = msg;
        (*box->holding)++;
    } else {
        box->tail->next = msg;
    }
    box->tail = msg;
    box->count++;
    box->nbytes += msg->len;
}

static rp_msg *make(uint64_t seq, uint16_t sport, uint16_t family, const char *peer,
                    const char *data, uint32_t len)
{
    rp_msg *msg = malloc(sizeof(rp_msg) + (len ? len : 1));
    if (msg == NULL)
        return NULL;
    msg->seq = seq;
    msg->len = len;
    msg->sport = sport;
    msg->family = family;
    memcpy(msg->peer, peer, sizeof(msg->peer));
    if (len)
        memcpy(msg->data, data, len);
    return msg;
}

int rp_push(rp_inbox *box, uint64_t seq, uint16_t sport, uint16_t family, const char *peer,
            const char *data, uint32_t len)
{
    rp_msg *msg = make(seq, sport, family, peer, data, len);
    if (msg == NULL)
        return -1;
    append(box, msg);
    return 0;
}

rp_msg *rp_take(rp_inbox *box)
{
    rp_msg *msg = box->head;
    if (msg == NULL)
        return NULL;
    box->head = msg->next;
    if (box->head == NULL) {
        box->tail = NULL;
        (*box->holding)--;
    }
    box->count--;
    box->nbytes -= msg->len;
    msg->next = NULL;
    return msg;
}

void rp_clear(rp_inbox *box)
{
    rp_msg *msg;
    while ((msg = rp_take(box)) != NULL)
        free(msg);
}

void rp_free(rp_msg *msg) { free(msg); }

/* The numbered message at h, of len payload bytes after its header, made for its inbox
 * (*box) when C delivers it: due next, for a bound port (not a ping or probe) whose
 * socket holds it under its bounds. NULL (rx->stop RP_FOR_PYTHON): Python's. */
static rp_msg *due(rp_rx *rx, rp_ports *ports, const unsigned char *h, uint32_t len,
                   rp_inbox **box)
{
    uint64_t seq = be64(h);
    uint16_t sport = be16(h + 20), dport = be16(h + 22);
    rx->stop = RP_FOR_PYTHON;
    if (dport == 0 || (dport == RP_PROBE_PORT && sport == 0) || seq != rx->next_recv)
        return NULL;
    *box = lookup(ports, dport);
    if (*box == NULL || (*box)->nbytes + len > rx->rcvbuf_limit
        || (*box)->nbytes + len > rx->rcvbuf)
        return NULL;
    rp_msg *msg = make(seq, sport, rx->family, rx->peer, (const char *)h + RP_HEADER_LEN, len);
    if (msg != NULL) /* (else Python's copy fails as it fails) */
        rx->stop = RP_DONE;
    return msg;
}

/* Queue a message due() made on its inbox and count it; chased[k] (when chased is not
 * NULL) is the R_Key the k-th message queued chases (-1: none, or its socket has no
 * use-once registration), for Python to mark its socket's registration used (Linux's
 * use-once cookies end there). */
static void deliver(rp_rx *rx, rp_inbox *box, rp_msg *msg, int64_t rkey, uint16_t *woken,
                    int64_t *chased)
{
    int64_t talk = (int64_t)msg->sport << 16 | box->port;
    if (talk != rx->talk && msg->sport)
        rx->talk = rx->talk == -1 ? talk : -2;
    rx->next_recv = msg->seq + 1;
    append(box, msg);
    rx->messages++;
    rx->bytes += msg->len;
    if (chased != NULL) {
        if (!box->use_once)
            rkey = -1; /* (nothing of its socket's ends: no Python needed) */
        chased[rx->nwoken] = rkey;
        rx->chasers += rkey >= 0;
    }
    woken[rx->nwoken++] = box->port;
}

uint32_t rp_scan(rp_rx *rx, rp_ports *ports, const rp_row *rows, uint32_t n,
                 const char *recv, uint64_t recv_len, uint32_t *reposts, uint32_t room,
                 uint16_t *woken, int64_t *chased, uint32_t woken_room)
{
    uint32_t i;
    rx->stop = RP_DONE;
    for (i = 0; i < n; i++) {
        const rp_row *row = &rows[i];
        if (rx->nreposts >= room || rx->nwoken >= woken_room) {
            rx->stop = RP_FOR_PYTHON; /* (no room for what it would list) */
            return i;
        }
        if (row->status != 0 || row->opcode != RP_RECV || row->byte_len < RP_HEADER_LEN
            || row->byte_len > rx->slot
#ifndef RP_FUZZ_SELFTEST /* (the fuzz harness's own test: a missing bounds check is found) */
            || row->wr_id >= recv_len / rx->slot
#endif
        ) {
            rx->stop = RP_NOT_PLAIN;
            return i;
        }
        const unsigned char *h = (const unsigned char *)recv + row->wr_id * rx->slot;
        uint64_t ack = be64(h + 8);
        uint32_t len = be32(h + 16);
        uint16_t sport = be16(h + 20), dport = be16(h + 22);
        uint8_t flags = h[24], credit = h[25];
        uint16_t csum = be16(h + 30);
        int64_t rkey = -1;
        if (h[32] == RP_EXT_RDMA && h[37] == 0) /* the only extension: an RDMA one */
            rkey = be32(h + 33);
        if (csum != 0 || (h[32] != 0 && rkey < 0) || len != row->byte_len - RP_HEADER_LEN
            || len > RP_FRAG_SIZE || (flags & RP_CONG_BITMAP)) {
            rx->stop = RP_NOT_PLAIN;
            return i;
        }
        rp_inbox *box = NULL;
        rp_msg *msg = NULL;
        if (sport || dport || len) { /* else a bare ack */
            msg = due(rx, ports, h, len, &box);
            if (msg == NULL)
                return i;
        }
        rx->credits += credit;
        if (!rx->has_ack || ack > rx->ack) {
            rx->ack = ack;
            rx->has_ack = 1;
        }
        reposts[rx->nreposts++] = (uint32_t)row->wr_id;
        if (msg != NULL)
            deliver(rx, box, msg, rkey, woken, chased);
    }
    return i;
}

uint64_t rp_stream(rp_rx *rx, rp_ports *ports, const char *buf, uint64_t len, uint16_t *woken,
                   uint32_t woken_room)
{
    uint64_t pos = 0;
    rx->stop = RP_DONE;
    while (len - pos >= RP_HEADER_LEN) {
        if (rx->nwoken >= woken_room) {
            rx->stop = RP_FOR_PYTHON; /* (no room for what it would list) */
            break;
        }
        const unsigned char *h = (const unsigned char *)buf + pos;
        uint32_t size = be32(h + 16);
        if (be16(h + 30) != 0 || h[32] != 0 || (h[24] & RP_CONG_BITMAP) || size > RP_MAX_MSG_SIZE) {
            rx->stop = RP_NOT_PLAIN;
            break;
        }
        if (len - pos - RP_HEADER_LEN < size)
            break; /* the rest of it is still to come */
        rp_inbox *box = NULL;
        rp_msg *msg = due(rx, ports, h, size, &box);
        if (msg == NULL)
            break;
        deliver(rx, box, msg, -1, woken, NULL);
        pos += RP_HEADER_LEN + size;
    }
    return pos;
}

uint64_t rp_stream_read(rp_stream_rx *st)
{
    st->got = 0;
    st->error = 0;
    if (st->fd < 0) {
        st->error = EBADF;
        return 0;
    }
    ssize_t n = recv(st->fd, st->buf, st->cap, MSG_DONTWAIT);
    if (n < 0) {
        st->error = errno;
        return 0;
    }
    st->got = (uint64_t)n;
    return rp_stream(st->rx, st->ports, st->buf, (uint64_t)n, st->woken, st->woken_room);
}

/* Post the receives listed (all, or none when the QP refuses the first: it is leaving
 * RTS, and Python's fold posts them again, which the QP then flushes) */
static void repost(rp_hook *h, const rp_verbs *verbs, void *qp)
{
    rp_rx *rx = h->rx;
    rp_recv wrs[64];
    uint32_t done = 0;
    while (done < rx->nreposts) {
        uint32_t n = rx->nreposts - done < 64 ? rx->nreposts - done : 64;
        for (uint32_t k = 0; k < n; k++) {
            uint32_t i = h->reposts[done + k];
            wrs[k].wr_id = i;
            wrs[k].addr = h->recv_addr + (uint64_t)i * rx->slot;
            wrs[k].length = rx->slot;
            wrs[k].lkey = h->recv_lkey;
        }
        uint32_t posted = verbs->post_recv(qp, wrs, n);
        done += posted;
        if (posted < n)
            break;
    }
    if (done) {
        memmove(h->reposts, h->reposts + done, (rx->nreposts - done) * sizeof *h->reposts);
        rx->nreposts -= done;
        h->posted += done;
        if (h->flow->flow_control) /* (RdmaFlow.reposted: credits to grant) */
            h->flow->advertise += done;
    }
}

/* The entries post_staged() fills at most: a Send and the Write it chases a message */
#define RP_STAGED_MAX 8

uint32_t rp_send(rp_hook *h, uint64_t seq, uint16_t sport, uint16_t dport, const char *data,
                 uint32_t len)
{
    rp_flow *f = h->flow;
    rp_rx *rx = h->rx;
    uint32_t size = RP_HEADER_LEN + len;
    if (h->held || h->refused || len > RP_FRAG_SIZE || size > rx->slot
        || h->send_busy >= h->send_slots || h->staged >= RP_STAGED_MAX
        || (f->flow_control && f->send_credits <= 1))
        return 0;
    uint32_t slot = h->send_head;
    unsigned char *b = (unsigned char *)h->send + (uint64_t)slot * rx->slot;
    int64_t credit = f->advertise > RP_MAX_CREDIT ? RP_MAX_CREDIT : f->advertise;
    f->advertise -= credit;
    uint64_t ack = rx->next_recv - 1; /* (C's: Python's catches up when it folds) */
    f->acked_to_peer = ack;
    f->ack_at = INFINITY; /* this one carries it */
    f->ack_countdown = h->ack_every ? h->ack_every - 1 : 0; /* (the last one queued asks) */
    put64(b, seq);
    put64(b + 8, ack);
    put32(b + 16, len);
    put16(b + 20, sport);
    put16(b + 22, dport);
    b[24] = RP_ACK_REQUIRED;
    b[25] = (unsigned char)credit;
    memset(b + 26, 0, RP_HEADER_LEN - 26);
    if (len)
        memcpy(b + RP_HEADER_LEN, data, len);
    if (f->flow_control)
        f->send_credits -= 1;
    if (h->writes != NULL)
        h->writes[slot].length = 0; /* (the buffer's new message chases nothing yet) */
    h->send_head = (slot + 1) % h->send_slots;
    h->send_busy++;
    h->staged++;
    h->sent++;
    return 1;
}

uint32_t rp_send_write(rp_hook *h, uint64_t seq, uint16_t sport, uint16_t dport,
                       const char *data, uint32_t len, uint64_t laddr, uint32_t lkey,
                       uint32_t length, uint64_t remote_addr, uint32_t rkey)
{
    if (h->writes == NULL || length == 0 || length > RP_MAX_MSG_SIZE)
        return 0;
    uint32_t slot = h->send_head;
    if (!rp_send(h, seq, sport, dport, data, len))
        return 0;
    unsigned char *b = (unsigned char *)h->send + (uint64_t)slot * h->rx->slot;
    b[32] = RP_EXT_RDMA; /* (the rest of the area is zero: the list ends after it) */
    put32(b + 33, rkey);
    rp_write *w = &h->writes[slot];
    w->addr = laddr;
    w->remote_addr = remote_addr;
    w->length = length;
    w->lkey = lkey;
    w->rkey = rkey;
    return 1;
}

/* Whether the gate refuses a len-byte message to dport now */
static int gate_refuses(const rp_gate *g, uint16_t dport, uint32_t len)
{
    return !g->open || g->peer_cong == NULL || g->unsynced >= RP_UNSYNCED_MAX
           || g->queued_bytes >= g->sndbuf || g->queued >= g->max_queued || len > g->sndbuf
           || g->peer_cong[dport >> 3] & 1u << (dport & 7);
}

/* A len-byte message went through the gate, numbered g->next_seq: count it */
static void gate_count(rp_gate *g, uint32_t len)
{
    g->next_seq++;
    g->queued_bytes += len;
    g->queued++;
    g->unsynced++;
}

/* A len-byte message went through the gate of an RDMA session: count it, and post it */
static uint32_t gate_sent(rp_hook *h, uint32_t len)
{
    gate_count(&h->gate, len);
    return h->run == NULL || h->run(h->run_ctx) ? 2 : 1;
}

uint32_t rp_sendto(rp_hook *h, uint16_t sport, uint16_t dport, const char *data, uint32_t len)
{
    if (gate_refuses(&h->gate, dport, len)
        || !rp_send(h, h->gate.next_seq, sport, dport, data, len))
        return 0;
    return gate_sent(h, len);
}

uint32_t rp_sendto_write(rp_hook *h, uint16_t sport, uint16_t dport, const char *data,
                         uint32_t len, uint64_t laddr, uint32_t lkey, uint32_t length,
                         uint64_t remote_addr, uint32_t rkey)
{
    if (gate_refuses(&h->gate, dport, len)
        || !rp_send_write(h, h->gate.next_seq, sport, dport, data, len, laddr, lkey, length,
                          remote_addr, rkey))
        return 0;
    return gate_sent(h, len);
}

uint32_t rp_stream_sendto(rp_stream_tx *tx, uint16_t sport, uint16_t dport, const char *data,
                          uint32_t len)
{
    rp_gate *g = &tx->gate;
    if (gate_refuses(g, dport, len))
        return 0;
    unsigned char b[RP_HEADER_LEN] = {0};
    put64(b, g->next_seq);
    put32(b + 16, len);
    put16(b + 20, sport);
    put16(b + 22, dport);
    struct iovec iov[2] = {{b, RP_HEADER_LEN}, {(void *)data, len}};
    struct msghdr m = {.msg_iov = iov, .msg_iovlen = len ? 2 : 1};
    ssize_t n = sendmsg(tx->fd, &m, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n <= 0)
        return 0;
    gate_count(g, len);
    tx->written += (uint64_t)n;
    if ((uint64_t)n == RP_HEADER_LEN + (uint64_t)len)
        return 1;
    tx->partial = (uint32_t)n;
    g->open = 0; /* (nothing may go before the rest) */
    return 2;
}

int64_t rp_write_seq(rp_hook *h, uint64_t wr_id)
{
    uint64_t first = h->send_wr + h->send_slots;
    if (h->writes == NULL || wr_id < first || wr_id - first >= h->send_slots)
        return -1;
    return (int64_t)be64((const unsigned char *)h->send + (wr_id - first) * h->rx->slot);
}

uint32_t rp_sent(rp_hook *h, uint64_t wr_id)
{
    if (wr_id < h->send_wr || wr_id - h->send_wr >= h->send_slots)
        return 0;
    uint32_t slot = (uint32_t)(wr_id - h->send_wr);
    uint32_t in_flight = h->send_busy - h->staged;
    uint32_t oldest = (h->send_head + h->send_slots - h->send_busy) % h->send_slots;
    uint32_t done = (slot + h->send_slots - oldest) % h->send_slots + 1;
    if (done <= in_flight) /* (else not one in flight: nothing to free) */
        h->send_busy -= done;
    return 1;
}

/* Post the Sends rp_send staged, oldest first, each after the Write it chases (if any):
 * signaled one in signal_every, and while few buffers are left; inline when short (none
 * taken: the QP is leaving RTS, and the session ends; their messages are Python's to
 * send again). */
static void post_staged(rp_hook *h, const rp_verbs *verbs, void *qp)
{
    rp_send_wr wrs[2 * RP_STAGED_MAX];
    uint32_t n = h->staged, slot = (h->send_head + h->send_slots - n) % h->send_slots, m = 0;
    for (uint32_t k = 0; k < n; k++, slot = (slot + 1) % h->send_slots) {
        const rp_write *w = h->writes != NULL ? &h->writes[slot] : NULL;
        if (w != NULL && w->length) /* unsignaled: done when a later Send is */
            wrs[m++] = (rp_send_wr){.wr_id = h->send_wr + h->send_slots + slot,
                                    .addr = w->addr, .length = w->length, .lkey = w->lkey,
                                    .opcode = RP_POST_RDMA_WRITE,
                                    .remote_addr = w->remote_addr, .rkey = w->rkey};
        const unsigned char *b = (const unsigned char *)h->send + (uint64_t)slot * h->rx->slot;
        uint32_t length = RP_HEADER_LEN + be32(b + 16);
        uint32_t flags = RP_SEND_SOLICITED;
        if (++h->unsignaled >= h->signal_every || h->send_slots - h->send_busy < h->signal_every) {
            flags |= RP_SEND_SIGNALED;
            h->unsignaled = 0;
        }
        if (length <= h->max_inline)
            flags |= RP_SEND_INLINE;
        wrs[m++] = (rp_send_wr){.wr_id = h->send_wr + slot,
                                .addr = h->send_addr + (uint64_t)slot * h->rx->slot,
                                .length = length, .lkey = h->send_lkey, .flags = flags,
                                .opcode = RP_POST_SEND};
    }
    h->staged = 0;
    if (verbs->post_send(qp, wrs, m) != m)
        h->refused = 1;
}

/* Take row i when it is the successful completion of one of rp_send's Sends. */
static int took_sent(rp_hook *h, const rp_row *row)
{
    return row->status == 0 && row->opcode == RP_SEND && rp_sent(h, row->wr_id);
}

uint32_t rp_handle(void *hook, const rp_verbs *verbs, void *cq, void *qp, uint32_t qp_num)
{
    rp_hook *h = hook;
    rp_rx *rx = h->rx;
    (void)qp_num; /* (a session's CQ serves its one QP) */
    if (h->staged)
        post_staged(h, verbs, qp);
    if (h->refused)
        h->held = 1;
    if (h->held)
        return 1;
    uint32_t ask = 0, taken = 0;
    for (;;) {
        uint32_t n = verbs->poll(cq, h->rows, h->room);
        if (n == 0)
            break;
        uint32_t woken_before = rx->nwoken;
        uint32_t took = 0;
        for (;;) { /* runs of plain messages, and our Sends' completions between them */
            took += rp_scan(rx, h->ports, h->rows + took, n - took, h->recv, h->recv_len,
                            h->reposts, h->room, h->woken, h->chased, h->room);
            if (took == n || rx->stop != RP_NOT_PLAIN || !took_sent(h, &h->rows[took]))
                break;
            took++;
        }
        /* A message for the port whose reader drives the session wakes no one: it
         * looks once the read that brought it returns. */
        uint32_t kept = woken_before;
        for (uint32_t k = woken_before; k < rx->nwoken; k++) {
            if (h->woken[k] == h->quiet_port && h->chased[k] < 0 && h->quiet_port)
                continue;
            h->woken[kept] = h->woken[k];
            h->chased[kept++] = h->chased[k];
        }
        rx->nwoken = kept;
        taken += took;
        h->flow->send_credits += (int64_t)rx->credits; /* (sends in C spend them at once) */
        rx->credits = 0;
        if (rx->nreposts >= h->repost_batch)
            repost(h, verbs, qp);
        if (took < n) {
            h->left = took;
            h->polled = n;
            ask = 1;
            break;
        }
    }
    if (rx->nwoken || (h->sends_waiting && taken)
        || (h->grant_at && h->flow->advertise >= (int64_t)h->grant_at)
        || (h->ack_watch && rx->has_ack && rx->ack >= h->ack_watch))
        ask = 1;
    if (ask)
        h->held = 1;
    return ask;
}

uintptr_t rp_handle_address(void) { return (uintptr_t)rp_handle; }
