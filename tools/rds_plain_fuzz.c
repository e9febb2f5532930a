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
 * A broken check aborts (a crash for libFuzzer). -DRP_FUZZ_SELFTEST builds _plain.c
 * without its receive-buffer bounds check, which tests/test_rds_plain_fuzz.py
 * requires the harness to catch.
 */
#include "_plain.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SLOTS 8
#define SLOT (RP_HEADER_LEN + 256)
#define ROWS_MAX 32

static const uint16_t bound[] = {9, 4000, 4001, 65535};

#define CHECK(cond)                                                                        \
    do {                                                                                   \
        if (!(cond)) {                                                                     \
            fprintf(stderr, "ORACLE: %s (line %d)\n", #cond, __LINE__);                   \
            abort();                                                                       \
        }                                                                                  \
    } while (0)

static void check_inbox(const rp_inbox *box, uint64_t *nonempty)
{
    uint64_t count = 0, bytes = 0;
    const rp_msg *last = NULL;
    for (const rp_msg *msg = box->head; msg != NULL; msg = msg->next) {
        CHECK(msg->len <= SLOT - RP_HEADER_LEN && msg->len <= RP_FRAG_SIZE);
        count++;
        bytes += msg->len;
        last = msg;
    }
    CHECK(count == box->count && bytes == box->nbytes && last == box->tail);
    *nonempty += count != 0;
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
    for (size_t i = 0; i < sizeof(bound) / sizeof(bound[0]); i++)
        boxes[i] = rp_open(ports, bound[i]);
    CHECK(rp_open(ports, bound[0]) == NULL); /* one inbox a port */

    rp_rx rx;
    memset(&rx, 0, sizeof(rx));
    rx.slot = SLOT;
    rx.rcvbuf = 600;
    rx.rcvbuf_limit = 900;
    rx.talk = -1;
    rx.family = 4;
    memcpy(rx.peer, "\x0a\x00\x00\x02", 4);
    for (int k = 0; k < 8; k++) /* the message in the first buffer is due */
        rx.next_recv = rx.next_recv << 8 | (unsigned char)recv[k];
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
            for (size_t b = 0; b < sizeof(bound) / sizeof(bound[0]); b++)
                found |= woken[k] == bound[b];
            CHECK(found);
        }
        CHECK(took == n - i ? rx.stop == RP_DONE : rx.stop != RP_DONE);
        i += took + (took < n - i); /* the row it left is Python's */
    }
    uint64_t nonempty = 0;
    for (size_t b = 0; b < sizeof(bound) / sizeof(bound[0]); b++)
        check_inbox(boxes[b], &nonempty);
    CHECK(nonempty == ports->holding);
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
