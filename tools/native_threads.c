/* Three threads on one device's native engine, for ThreadSanitizer
 * (tests/test_native_threads.py builds it with -fsanitize=thread and runs it).
 *
 * A thread serves QP A as CQ.serve_in_thread does: it waits and polls A's CQ in
 * rs_qp_serve_poll and answers each message (its bytes reversed) with a Send, reposting
 * the Receive; or, run as "native_threads slots", as it does answering from slots: each
 * turn is rs_qp_serve_slot, which posts the last answer from its Send slot, gives the
 * Receive back and frees the Send slots itself, the thread only writing the answer. The
 * main thread drives QP B, the peer, over the other end of a socket
 * pair: it sends messages, reads and polls for the answers and checks each one. A
 * third thread registers and deregisters regions in the same memory table all along
 * (another PD), as the event loop does for the device's other connections. Every call
 * into the engine takes the device's lock, so ThreadSanitizer must find no race, and
 * every answer must be right. Exit status 0 when so; 1 with what went wrong. */
#include "_engine.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#define MESSAGES 5000
#define SLOTS 8
#define SIZE 64
#define IN_FLIGHT 4

enum { STAG_A_RECV = 0x100, STAG_A_SEND = 0x200, STAG_B_RECV = 0x300, STAG_B_SEND = 0x400 };

static rs_mem *mem;
static rs_cq *cq_a, *cq_b;
static rs_qp *qp_a, *qp_b;
static int fds[2], wake;
static uint8_t a_recv[SLOTS * SIZE], a_send[2 * SLOTS * SIZE], b_recv[SLOTS * SIZE],
    b_send[SLOTS * SIZE];
static atomic_int done;

static void fail(const char *what)
{
    fprintf(stderr, "native_threads: %s\n", what);
    exit(1);
}

static uint64_t at(const uint8_t *p) { return (uint64_t)(uintptr_t)p; }

static void add(uint32_t stag, uint8_t *base, size_t length, uint64_t pd)
{
    if (rs_mem_add(mem, stag, base, at(base), length, RS_LOCAL_WRITE, pd))
        fail("rs_mem_add");
}

static void post_recv(rs_qp *qp, const uint8_t *buf, uint32_t stag, uint32_t slot)
{
    rs_recv_wr w;
    memset(&w, 0, sizeof w);
    w.wr_id = slot;
    w.num_sge = 1;
    w.sg_list[0] = (rs_sge){at(buf + slot * SIZE), SIZE, stag};
    if (rs_qp_post_recv(qp, &w, 1) != 1)
        fail("rs_qp_post_recv");
}

static void post_send(rs_qp *qp, int fd, const uint8_t *buf, uint32_t stag, uint32_t slot,
                      uint32_t length)
{
    rs_send_wr w;
    memset(&w, 0, sizeof w);
    w.wr_id = slot;
    w.opcode = RS_WR_SEND;
    w.flags = RS_SIGNALED;
    w.num_sge = 1;
    w.sg_list[0] = (rs_sge){at(buf + slot * SIZE), length, stag};
    int why;
    int64_t wrote;
    if (rs_qp_post_send_fd(qp, &w, 1, &why, fd, &wrote) != 1)
        fail("rs_qp_post_send_fd");
}

/* The serving thread: A's messages answered as they come, until the main thread is done. */
static void *serve(void *unused)
{
    (void)unused;
    rs_wc wcs[16];
    rs_wc_sum sum;
    for (;;) {
        int64_t n = rs_qp_serve_poll(qp_a, fds[0], wake, wcs, 16, &sum);
        if (n == -EINTR)
            return NULL; /* woken: the main thread takes the QP back */
        if (n <= 0 || rs_qp_state(qp_a) != RS_QP_RTS)
            fail("the served QP left RTS");
        for (int64_t i = 0; i < n; i++) {
            if (wcs[i].status != RS_WC_SUCCESS)
                fail("a completion of A failed");
            if (wcs[i].opcode != RS_WC_RECV)
                continue;
            uint32_t slot = (uint32_t)wcs[i].wr_id, length = wcs[i].byte_len;
            for (uint32_t k = 0; k < length; k++)
                a_send[slot * SIZE + k] = a_recv[slot * SIZE + length - 1 - k];
            post_recv(qp_a, a_recv, STAG_A_RECV, slot);
            post_send(qp_a, fds[0], a_send, STAG_A_SEND, slot, length);
        }
    }
}

/* The serving thread answering from slots: Receive slot i is A's wr_id i, Send slot j
 * (twice as many) wr_id SLOTS + j; C posts, reposts and frees, the thread writes. */
static void *serve_slots(void *unused)
{
    (void)unused;
    uint32_t free_slots[2 * SLOTS], unacked[2 * SLOTS], reposts[2];
    rs_slots s;
    memset(&s, 0, sizeof s);
    s.recv_addr = at(a_recv);
    s.recv_lkey = STAG_A_RECV;
    s.recv_size = SIZE;
    s.nrecv = SLOTS;
    s.send_addr = at(a_send);
    s.send_lkey = STAG_A_SEND;
    s.send_size = SIZE;
    s.nsend = 2 * SLOTS;
    s.send_base = SLOTS;
    s.signal_every = 4;
    s.repost_every = 2;
    s.free = free_slots;
    s.unacked = unacked;
    s.reposts = reposts;
    for (uint32_t j = 0; j < 2 * SLOTS; j++)
        free_slots[s.nfree++] = j;
    s.room = 32;
    s.reply_len = RS_NO_REPLY;
    rs_wc wc;
    rs_wc_sum sum;
    for (;;) {
        int64_t n = rs_qp_serve_slot(qp_a, fds[0], wake, &s, &wc, &sum);
        if (n == -EINTR)
            return NULL;
        if (n <= 0 || rs_qp_state(qp_a) != RS_QP_RTS)
            fail("the served QP left RTS");
        if (!s.lone)
            fail("a completion of A other than a lone Receive");
        for (uint32_t k = 0; k < s.recv_len; k++)
            a_send[s.send_slot * SIZE + k] = a_recv[s.recv_slot * SIZE + s.recv_len - 1 - k];
        s.reply_len = s.recv_len;
    }
}

/* The event loop's part: other regions of the device come and go all along. */
static void *churn(void *unused)
{
    (void)unused;
    static uint8_t other[16][256];
    uint32_t round = 0;
    while (!atomic_load(&done)) {
        for (uint32_t i = 0; i < 16; i++)
            add(0x10000 + ((round % 64) * 16 + i) * 0x100, other[i], sizeof other[i], 2);
        for (uint32_t i = 0; i < 16; i++)
            if (rs_mem_remove(mem, 0x10000 + ((round % 64) * 16 + i) * 0x100))
                fail("rs_mem_remove");
        if (!rs_mem_valid(mem, STAG_A_RECV))
            fail("A's region was lost");
        round++;
    }
    return NULL;
}

int main(int argc, char **argv)
{
    int slots = argc > 1 && !strcmp(argv[1], "slots");
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, fds) || (wake = eventfd(0, EFD_NONBLOCK)) < 0)
        fail("socketpair or eventfd");
    mem = rs_mem_new();
    cq_a = rs_cq_new(64);
    cq_b = rs_cq_new(64);
    add(STAG_A_RECV, a_recv, sizeof a_recv, 1);
    add(STAG_A_SEND, a_send, sizeof a_send, 1);
    add(STAG_B_RECV, b_recv, sizeof b_recv, 1);
    add(STAG_B_SEND, b_send, sizeof b_send, 1);
    qp_a = rs_qp_new(mem, 1, 1, cq_a, cq_a, NULL, 32, SLOTS, 0);
    qp_b = rs_qp_new(mem, 1, 2, cq_b, cq_b, NULL, 32, SLOTS, 0);
    if (!qp_a || !qp_b || rs_qp_start(qp_a, 1, 4, 4, 65536, 0, 0) ||
        rs_qp_start(qp_b, 1, 4, 4, 65536, 0, 0))
        fail("QPs");
    for (uint32_t slot = 0; slot < SLOTS; slot++) {
        post_recv(qp_a, a_recv, STAG_A_RECV, slot);
        post_recv(qp_b, b_recv, STAG_B_RECV, slot);
    }
    pthread_t server, churner;
    if (pthread_create(&server, NULL, slots ? serve_slots : serve, NULL) ||
        pthread_create(&churner, NULL, churn, NULL))
        fail("pthread_create");

    uint32_t sent = 0, answered = 0;
    rs_wc wcs[16];
    while (answered < MESSAGES) {
        while (sent < MESSAGES && sent - answered < IN_FLIGHT) {
            uint32_t slot = sent % SLOTS, length = 1 + sent % SIZE;
            for (uint32_t k = 0; k < length; k++)
                b_send[slot * SIZE + k] = (uint8_t)(sent + k);
            post_send(qp_b, fds[1], b_send, STAG_B_SEND, slot, length);
            sent++;
        }
        struct pollfd p = {fds[1], POLLIN, 0};
        if (poll(&p, 1, 10000) != 1)
            fail("no answer within 10 s");
        int64_t r = rs_qp_read_fd(qp_b, fds[1]);
        if (r <= 0 && r != -EAGAIN)
            fail("B's connection ended");
        rs_qp_flush_fd(qp_b, fds[1]);
        uint32_t n = rs_cq_poll(cq_b, wcs, 16);
        for (uint32_t i = 0; i < n; i++) {
            if (wcs[i].status != RS_WC_SUCCESS)
                fail("a completion of B failed");
            if (wcs[i].opcode != RS_WC_RECV)
                continue;
            uint32_t slot = (uint32_t)wcs[i].wr_id, length = 1 + answered % SIZE;
            if (wcs[i].byte_len != length)
                fail("an answer of the wrong length");
            for (uint32_t k = 0; k < length; k++)
                if (b_recv[slot * SIZE + k] != (uint8_t)(answered + length - 1 - k))
                    fail("an answer with the wrong bytes");
            post_recv(qp_b, b_recv, STAG_B_RECV, slot);
            answered++;
        }
    }
    atomic_store(&done, 1);
    uint64_t one = 1;
    if (write(wake, &one, sizeof one) != sizeof one)
        fail("eventfd write");
    pthread_join(server, NULL);
    pthread_join(churner, NULL);
    rs_qp_free(qp_a);
    rs_qp_free(qp_b);
    rs_cq_free(cq_a);
    rs_cq_free(cq_b);
    rs_mem_free(mem);
    printf("native_threads: %u messages answered by the serving thread%s\n", answered,
           slots ? " from slots" : "");
    return 0;
}
