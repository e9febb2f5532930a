/* libFuzzer harness for RDS's plain-message receive path (ulps/rds/_plain.c).
 *
 * Build it under the fuzzer, AddressSanitizer and UBSan (clang):
 *
 *   clang -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all \
 *       -I ulps/rds tools/rds_plain_fuzz.c ulps/rds/_plain.c -o rds_plain_fuzz
 *   ./rds_plain_fuzz -max_total_time=60 CORPUS_DIR
 *
 * One input is one poll: byte 0 says how many rows (1..32), then come the rows as
 * rp_row bytes (a peer chooses the receive buffers' bytes; the engine chooses the rows,
 * but the harness lets the input choose them too, lengths and work request ids
 * included), then the bytes of the receive buffers. The buffers are allocated to their
 * exact size, so a read past them is ASan's. Rows are taken as a session takes them:
 * a scan, and a row it leaves skipped (Python's), then the next scan. After each scan
 * the harness checks what the scan says against the inboxes: the messages it queued,
 * their bytes and lengths, the buffers to post again and the ports woken, and at the
 * end every inbox's count and bytes against its list and the node's holding count.
 * Then the same rows go to the CQ's native handler (rp_handle) through a stand-in verbs
 * table that hands them over in chunks the input chooses, as a session's CQ does, with
 * the harness doing what Python does when it asks (the row it left is Python's; it folds
 * and releases): every receive it posts must name a buffer of the session, and it must
 * poll nothing while held. Between its runs the harness sends plain messages in C
 * (rp_send, lengths the input chooses, some too long; rp_send_write, chasing RDMA Writes
 * of lengths it chooses, some empty or too long; and rp_sendto and rp_sendto_write, a
 * socket's sendto through the gate, to a congested port or not, under bounds the input
 * chooses), which
 * the next run posts: every Send it posts must be one it staged, in order, naming its
 * own send buffer with the length of the header written there, after the Write its
 * message chases (unsignaled, as staged, its R_Key in the header's extension); and the
 * input's Send completions (their work requests moved near the send buffers' ids, some
 * past them) free the buffers. Last, the receive buffers' bytes are an RDS/TCP stream
 * (rp_stream, the message it leaves skipped as Python's; or, for some inputs, read from a
 * socket in reads of a size the input chooses, rp_stream_read): what it takes must be
 * whole messages, counted as delivered.
 * A broken check aborts (a crash for libFuzzer). -DRP_FUZZ_SELFTEST builds _plain.c
 * without its receive-buffer bounds check, which tests/test_rds_plain_fuzz.py
 * requires the harness to catch.
 */
#include "_plain.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define SLOTS 8
#define SLOT (RP_HEADER_LEN + 256)
#define ROWS_MAX 32

static const uint16_t bound[] = {9, 4000, 4001, 65535};

#define BASE 0x10000000u
#define LKEY 77

/* The stand-in CQ: the input's rows, chunk at a time */
typedef struct {
    const rp_row *rows;
    uint32_t n, at, chunk;
    int held; /* the handler said it holds: it must not poll */
} fake_cq;

static uint32_t fake_poll(void *cq, rp_row *out, uint32_t room)
{
    fake_cq *c = cq;
    if (c->held)
        abort(); /* (CHECK is defined below) */
    uint32_t k = c->n - c->at;
    k = k < room ? k : room;
    k = k < c->chunk ? k : c->chunk;
    memcpy(out, c->rows + c->at, k * sizeof *out);
    c->at += k;
    return k;
}

static uint32_t posted_total;

#define CHECK(cond)                                                                        \
    do {                                                                                   \
        if (!(cond)) {                                                                     \
            fprintf(stderr, "ORACLE: %s (line %d)\n", #cond, __LINE__);                   \
            abort();                                                                       \
        }                                                                                  \
    } while (0)

static uint32_t fake_post(void *qp, const rp_recv *wrs, uint32_t n)
{
    (void)qp;
    for (uint32_t k = 0; k < n; k++) {
        CHECK(wrs[k].wr_id < SLOTS && wrs[k].length == SLOT && wrs[k].lkey == LKEY);
        CHECK(wrs[k].addr == BASE + wrs[k].wr_id * SLOT);
    }
    posted_total += n;
    return n;
}

#define SEND_SLOTS 4
#define SEND_BASE 0x20000000u
#define SEND_LKEY 78
#define SEND_WR (1ull << 33)

static const char *send_ring;
static uint64_t send_next; /* the buffer the next Send posted must name (counted up) */
static uint32_t write_len[SEND_SLOTS]; /* the Write each buffer's message chases (0: none) */
static uint32_t write_rkey[SEND_SLOTS];
#define WRITE_BASE 0x30000000u
#define WRITE_LKEY 79

static uint32_t be32_at(const unsigned char *b)
{
    return (uint32_t)b[0] << 24 | (uint32_t)b[1] << 16 | (uint32_t)b[2] << 8 | b[3];
}

static uint32_t fake_post_send(void *qp, const rp_send_wr *wrs, uint32_t n)
{
    (void)qp;
    for (uint32_t k = 0; k < n; k++) {
        uint64_t slot = send_next % SEND_SLOTS;
        const unsigned char *b = (const unsigned char *)send_ring + slot * SLOT;
        if (write_len[slot]) { /* its Write first, unsignaled, as staged */
            CHECK(wrs[k].opcode == RP_POST_RDMA_WRITE && k + 1 < n);
            CHECK(wrs[k].wr_id == SEND_WR + SEND_SLOTS + slot && wrs[k].lkey == WRITE_LKEY);
            CHECK(wrs[k].addr == WRITE_BASE + slot && wrs[k].length == write_len[slot]);
            CHECK(wrs[k].rkey == write_rkey[slot] && wrs[k].remote_addr == write_rkey[slot] * 3ull);
            CHECK(!(wrs[k].flags & RP_SEND_SIGNALED));
            CHECK(b[32] == RP_EXT_RDMA && be32_at(b + 33) == write_rkey[slot] && b[37] == 0);
            write_len[slot] = 0;
            k++;
        } else {
            CHECK(b[32] == 0);
        }
        send_next++;
        uint32_t len = be32_at(b + 16);
        CHECK(wrs[k].opcode == RP_POST_SEND);
        CHECK(wrs[k].wr_id == SEND_WR + slot && wrs[k].lkey == SEND_LKEY);
        CHECK(wrs[k].addr == SEND_BASE + slot * SLOT && wrs[k].length == RP_HEADER_LEN + len);
        CHECK(wrs[k].length <= SLOT && (wrs[k].flags & RP_SEND_SOLICITED));
    }
    return n;
}

static const rp_verbs fake_verbs = {fake_poll, fake_post, fake_post_send};

/* The QP's native runner, standing in: the handler's next run posts what was staged. */
static uint32_t fake_runs, fake_says;
static uint32_t fake_run(void *ctx)
{
    (void)ctx;
    fake_runs++;
    return fake_says;
}

/* Send a few plain messages in C, as the input says (its bytes for their payloads), some
 * chasing an RDMA Write (of a length the input says: some empty, some too long). */
static void send_some(rp_hook *h, const char *bytes, size_t len, uint32_t *dice)
{
    uint32_t k = *dice % 3;
    while (k--) {
        *dice = *dice * 1103515245u + 12345u;
        uint32_t size = (*dice >> 16) % (SLOT - RP_HEADER_LEN + 8); /* some too long */
        uint32_t busy = h->send_busy, staged = h->staged, slot = h->send_head;
        uint64_t seq = 1000 + h->sent;
        uint32_t took, length = 0, chases = 0, rkey = *dice >> 3;
        /* a chased Write's length: some empty, some too long */
        uint32_t wlen = *dice & 8 ? (*dice >> 4) % 3 : RP_MAX_MSG_SIZE + (*dice >> 4) % 3 - 1;
        if (*dice & 4) {
            length = wlen, chases = 1;
            took = rp_send_write(h, seq, 4000, 7, bytes, size <= len ? size : 0,
                                 WRITE_BASE + slot, WRITE_LKEY, length, rkey * 3ull, rkey);
        } else if (*dice & 16) { /* a socket's sendto through the gate (port 9 congested),
                                  * some chasing a Write */
            uint16_t dport = *dice & 32 ? 9 : 7;
            uint64_t unsynced = h->gate.unsynced, queued = h->gate.queued;
            uint32_t runs = fake_runs, went;
            fake_says = *dice >> 7 & 1;
            h->gate.next_seq = seq;
            h->run = *dice & 64 ? fake_run : NULL; /* (NULL: Python must post it) */
            if (*dice & 256) {
                length = wlen, chases = 1;
                went = rp_sendto_write(h, 4000, dport, bytes, size <= len ? size : 0,
                                       WRITE_BASE + slot, WRITE_LKEY, length, rkey * 3ull, rkey);
            } else {
                went = rp_sendto(h, 4000, dport, bytes, size <= len ? size : 0);
            }
            took = went != 0;
            CHECK(fake_runs == runs + (took && h->run != NULL));
            CHECK(!took || went == (h->run != NULL && !fake_says ? 1u : 2u));
            CHECK(!took || (dport == 7 && size <= h->gate.sndbuf));
            CHECK(h->gate.next_seq == seq + took && h->gate.unsynced == unsynced + took);
            CHECK(h->gate.queued == queued + took && h->gate.unsynced <= RP_UNSYNCED_MAX);
        } else {
            took = rp_send(h, seq, 4000, 7, bytes, size <= len ? size : 0);
        }
        CHECK(!took || !chases || (length && length <= RP_MAX_MSG_SIZE));
        CHECK(took ? h->send_busy == busy + 1 && h->staged == staged + 1
                   : h->send_busy == busy && h->staged == staged);
        CHECK(h->send_busy <= SEND_SLOTS && (!took || size <= SLOT - RP_HEADER_LEN));
        if (took) {
            write_len[slot] = length;
            write_rkey[slot] = rkey;
            CHECK(rp_write_seq(h, SEND_WR + SEND_SLOTS + slot) == (int64_t)seq);
        }
        CHECK(rp_write_seq(h, SEND_WR + slot) == -1 && rp_write_seq(h, SEND_WR + 2 * SEND_SLOTS) == -1);
    }
}

/* The rows again, through the native handler; what Python does when it asks. */
static void handle(rp_ports *ports, rp_rx *rx, const rp_row *rows, uint32_t n, const char *recv,
                   size_t recv_len, uint32_t chunk, uint16_t quiet)
{
    rp_row polled[ROWS_MAX];
    uint32_t reposts[ROWS_MAX];
    uint16_t woken[ROWS_MAX];
    int64_t chased[ROWS_MAX];
    rp_flow flow = {.flow_control = chunk & 1, .send_credits = chunk * 2, .advertise = chunk * 40};
    char *ring = malloc(SEND_SLOTS * SLOT); /* exact: a write past it is ASan's */
    send_ring = ring;
    send_next = 0;
    rp_write writes[SEND_SLOTS];
    memset(writes, 0, sizeof writes);
    static unsigned char cong[RP_CONG_MAP_BYTES];
    cong[9 >> 3] = 1u << (9 & 7);
    memset(write_len, 0, sizeof write_len);
    rp_hook h = {
        .rx = rx, .ports = ports, .rows = polled, .room = ROWS_MAX, .recv = recv,
        .recv_len = recv_len, .reposts = reposts, .woken = woken, .chased = chased,
        .recv_addr = BASE, .recv_lkey = LKEY, .repost_batch = 4, .quiet_port = quiet,
        .flow = &flow, .send = ring, .send_addr = SEND_BASE, .send_lkey = SEND_LKEY,
        .send_slots = SEND_SLOTS, .send_wr = SEND_WR, .signal_every = 2, .ack_every = 8,
        .max_inline = 64, .writes = writes, .gate = {.open = 1, .sndbuf = 64 + chunk * 40,
        .max_queued = 1 + chunk, .peer_cong = cong},
    };
    uint32_t dice = chunk * 2654435761u + n;
    /* The input's Send completions as ours (some past our buffers) */
    rp_row *ours = malloc(n * sizeof *ours);
    memcpy(ours, rows, n * sizeof *ours);
    for (uint32_t k = 0; k < n; k++)
        if (ours[k].opcode == 0)
            ours[k].wr_id = SEND_WR + ours[k].wr_id % (SEND_SLOTS + 2);
    rows = ours;
    fake_cq cq = {rows, n, 0, chunk, 0};
    posted_total = 0;
    uint32_t turns = 0;
    while (cq.at < n && turns++ <= n) {
        send_some(&h, recv, recv_len, &dice);
        uint64_t sent = h.sent;
        uint32_t ask = rp_handle(&h, &fake_verbs, &cq, NULL, 0);
        CHECK(h.staged == 0 && send_next == sent && !h.refused);
        CHECK(h.send_busy <= SEND_SLOTS);
        CHECK(h.posted == posted_total && h.left <= h.polled && h.polled <= ROWS_MAX);
        CHECK(rx->nreposts < ROWS_MAX && rx->nwoken <= ROWS_MAX);
        for (uint32_t k = 0; k < rx->nwoken; k++)
            CHECK(woken[k] != quiet || chased[k] >= 0 || quiet == 0);
        if (!ask) {
            CHECK(!h.held && cq.at == n); /* it took all there was */
            break;
        }
        CHECK(h.held);
        cq.held = 1; /* (while Python looks: the handler must not poll) */
        CHECK(rp_handle(&h, &fake_verbs, &cq, NULL, 0) == 1);
        cq.held = 0;
        /* Python: the rows left (the first is Python's, the others it scans again: here,
         * skipped), what it took folded in, the handler released */
        h.left = h.polled = 0;
        rx->has_ack = 0;
        rx->messages = rx->bytes = rx->nreposts = rx->nwoken = rx->chasers = 0;
        rx->credits = 0;
        h.posted = posted_total = 0;
        h.held = 0;
    }
    free(ours);
    free(ring);
}

/* The bytes as an RDS/TCP stream: runs of plain messages in C, each message it leaves
 * skipped (Python's), until an incomplete one. */
static void stream(rp_ports *ports, rp_rx *rx, const char *bytes, size_t len)
{
    uint16_t woken[ROWS_MAX];
    size_t pos = 0;
    while (pos < len) {
        rx->messages = rx->bytes = rx->nwoken = 0;
        uint64_t took = rp_stream(rx, ports, bytes + pos, len - pos, woken, ROWS_MAX);
        CHECK(took <= len - pos && rx->nwoken == rx->messages && rx->nwoken <= ROWS_MAX);
        CHECK(took == rx->bytes + rx->messages * RP_HEADER_LEN);
        pos += took;
        if (rx->stop == RP_DONE || len - pos < RP_HEADER_LEN)
            break;
        const unsigned char *h = (const unsigned char *)bytes + pos;
        uint32_t size = (uint32_t)h[16] << 24 | (uint32_t)h[17] << 16 | (uint32_t)h[18] << 8 | h[19];
        if (size > len - pos - RP_HEADER_LEN)
            break;
        pos += RP_HEADER_LEN + size;
    }
}

/* The bytes as an RDS/TCP stream read from a socket in C (rp_stream_read), cap bytes a
 * read: each read takes whole plain messages only, counted as delivered, and the first
 * one that leaves bytes (a message in part, or Python's) ends it, as the decoder then
 * takes over. A socket gone reads nothing. */
static void stream_read(rp_ports *ports, rp_rx *rx, const char *bytes, size_t len, uint64_t cap)
{
    int fds[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, fds) == 0);
    CHECK(write(fds[1], bytes, len) == (ssize_t)len);
    uint16_t woken[ROWS_MAX];
    char *buf = malloc(cap);
    rp_stream_rx st = {rx, ports, woken, ROWS_MAX, fds[0], buf, cap, 0, 0};
    for (;;) {
        rx->messages = rx->bytes = rx->nwoken = 0;
        uint64_t took = rp_stream_read(&st);
        CHECK(st.got <= cap && took <= st.got && rx->nwoken == rx->messages);
        CHECK(took == rx->bytes + rx->messages * RP_HEADER_LEN);
        if (st.got == 0 || took < st.got)
            break;
    }
    st.fd = -1;
    CHECK(rp_stream_read(&st) == 0 && st.got == 0 && st.error == EBADF);
    free(buf);
    close(fds[0]);
    close(fds[1]);
}

/* A session's scan state at its start: the message in the first buffer is due. */
static void init_rx(rp_rx *rx, const char *recv)
{
    memset(rx, 0, sizeof(*rx));
    rx->slot = SLOT;
    rx->rcvbuf = 600;
    rx->rcvbuf_limit = 900;
    rx->talk = -1;
    rx->family = 4;
    memcpy(rx->peer, "\x0a\x00\x00\x02", 4);
    for (int k = 0; k < 8; k++)
        rx->next_recv = rx->next_recv << 8 | (unsigned char)recv[k];
}

/* Every inbox's count and bytes against its list (no message longer than limit), and
 * the node's count of inboxes holding messages. */
static void check_inboxes(rp_inbox *const *boxes, const rp_ports *ports, uint64_t limit)
{
    uint64_t nonempty = 0;
    for (size_t b = 0; b < sizeof(bound) / sizeof(bound[0]); b++) {
        uint64_t count = 0, bytes = 0;
        const rp_msg *last = NULL;
        for (const rp_msg *msg = boxes[b]->head; msg != NULL; msg = msg->next) {
            CHECK(msg->len <= limit);
            count++;
            bytes += msg->len;
            last = msg;
        }
        CHECK(count == boxes[b]->count && bytes == boxes[b]->nbytes && last == boxes[b]->tail);
        nonempty += count != 0;
    }
    CHECK(nonempty == ports->holding);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    uint32_t n = data[0] % ROWS_MAX + 1;
    if (size < 1 + n * sizeof(rp_row))
        return 0;
    rp_row *rows = malloc(n * sizeof(rp_row));
    memcpy(rows, data + 1, n * sizeof(rp_row));
    size_t rest = size - 1 - n * sizeof(rp_row);
    size_t recv_len = SLOTS * SLOT;
    char *recv = malloc(recv_len);
    memset(recv, 0, recv_len);
    memcpy(recv, data + 1 + n * sizeof(rp_row), rest < recv_len ? rest : recv_len);

    rp_ports *ports = rp_ports_new();
    rp_inbox *boxes[sizeof(bound) / sizeof(bound[0])];
    for (size_t i = 0; i < sizeof(bound) / sizeof(bound[0]); i++) {
        boxes[i] = rp_open(ports, bound[i]);
        boxes[i]->use_once = (uint32_t)(i & 1); /* (4000 and 65535 have use-once ones) */
    }
    CHECK(rp_open(ports, bound[0]) == NULL); /* one inbox a port */

    rp_rx rx;
    init_rx(&rx, recv);
    uint32_t reposts[ROWS_MAX];
    uint16_t woken[ROWS_MAX];
    int64_t chased[ROWS_MAX];
    uint32_t i = 0;
    while (i < n) {
        uint64_t before = 0;
        for (size_t b = 0; b < sizeof(bound) / sizeof(bound[0]); b++)
            before += boxes[b]->count;
        rx.messages = rx.bytes = rx.nreposts = rx.nwoken = rx.chasers = 0;
        uint32_t took = rp_scan(&rx, ports, rows + i, n - i, recv, recv_len, reposts, ROWS_MAX,
                                woken, chased, ROWS_MAX);
        CHECK(took <= n - i);
        CHECK(rx.nreposts == took && rx.nwoken == rx.messages);
        uint64_t after = 0;
        for (size_t b = 0; b < sizeof(bound) / sizeof(bound[0]); b++)
            after += boxes[b]->count;
        CHECK(after - before == rx.messages);
        for (uint32_t k = 0; k < rx.nreposts; k++)
            CHECK(reposts[k] < SLOTS);
        uint32_t chasers = 0;
        for (uint32_t k = 0; k < rx.nwoken; k++)
            chasers += chased[k] >= 0 && chased[k] <= 0xffffffffLL;
        CHECK(chasers == rx.chasers);
        for (uint32_t k = 0; k < rx.nwoken; k++) {
            int found = 0;
            for (size_t b = 0; b < sizeof(bound) / sizeof(bound[0]); b++) {
                found |= woken[k] == bound[b];
                /* a chaser is handed on only where a use-once registration may end */
                CHECK(woken[k] != bound[b] || chased[k] < 0 || boxes[b]->use_once);
            }
            CHECK(found);
        }
        CHECK(took == n - i ? rx.stop == RP_DONE : rx.stop != RP_DONE);
        i += took + (took < n - i); /* the row it left is Python's */
    }
    check_inboxes(boxes, ports, SLOT - RP_HEADER_LEN);

    init_rx(&rx, recv);
    handle(ports, &rx, rows, n, recv, recv_len, data[0] / ROWS_MAX % 8 + 1,
           data[0] & 1 ? bound[1] : 0);
    check_inboxes(boxes, ports, SLOT - RP_HEADER_LEN);
    init_rx(&rx, recv);
    if (data[0] & 2)
        stream_read(ports, &rx, recv, rest < recv_len ? rest : recv_len,
                    RP_HEADER_LEN + data[0] * 7u);
    else
        stream(ports, &rx, recv, rest < recv_len ? rest : recv_len);
    check_inboxes(boxes, ports, recv_len);
    rp_msg *msg = rp_take(boxes[1]);
    if (msg != NULL)
        rp_free(msg);
    rp_close(ports, boxes[2]);
    CHECK(rp_open(ports, bound[2]) != NULL); /* the port is free again */
    rp_ports_free(ports);
    free(recv);
    free(rows);
    return 0;
}
