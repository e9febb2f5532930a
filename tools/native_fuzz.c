/* libFuzzer harness for the native engine's receive path (providers/softiwarp/_engine.c).
 *
 * Build it with the engine under the fuzzer, AddressSanitizer and UBSan (clang):
 *
 *   clang -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all \
 *       -I providers/softiwarp tools/native_fuzz.c providers/softiwarp/_engine.c \
 *       providers/softiwarp/_accel.c -o native_fuzz
 *   ./native_fuzz -max_total_time=60 CORPUS_DIR
 *
 * One input is one connection: byte 0 chooses CRC, how the stream is cut (the same
 * stream fed whole, in 1, 3, 17 or 1000-byte pieces ...) and whether a region is
 * deregistered in the middle of it (byte 1 says which and where); the rest is the
 * byte stream a peer sends after MPA setup. The responder is the wire fuzzer's
 * (tools/fuzz_wire.py): regions of fixed STags and tagged offsets (see table[]
 * below, mirrored by tests/test_native_fuzz.py, which writes the seed corpus from
 * fuzz_wire's generator), four receives posted, an RDMA Read outstanding. After the
 * stream the harness drains what the engine sends and its completions, then checks
 * the guard zones around every region, the regions no peer may write, and that a
 * region deregistered mid-stream did not change after its rs_mem_remove returned.
 * A broken check aborts (a crash for libFuzzer); so does any sanitizer report.
 * -DRS_FUZZ_SELFTEST builds the engine without one bounds check, which the test
 * requires the harness to catch.
 */
#include "_accel.h"
#include "_engine.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define GUARD 64
#define FILL 0x5A
#define RECV_SIZE 512
#define RECVS 4
#define READ_LEN 64
#define READ_STAG 0x00ABCD42u
#define READ_TO 0x700000001000ull

typedef struct {
    const char *name;
    uint32_t length, access, pd;
    uint64_t iova;
    int frozen; /* no peer may change it */
} region_spec;

/* STag of region i: (i + 1) << 8 | 0x42; its TO: iova (0: 0x10000 * (i + 1)). */
static const region_spec table[] = {
    {"rw", 4096, RS_LOCAL_WRITE | RS_REMOTE_WRITE | RS_REMOTE_READ, 1, 0, 0},
    {"wo", 4096, RS_LOCAL_WRITE | RS_REMOTE_WRITE, 1, 0, 0},
    {"ro", 4096, RS_REMOTE_READ, 1, 0, 1},
    {"local", 4096, RS_LOCAL_WRITE, 1, 0, 1},
    {"high", 4096, RS_LOCAL_WRITE | RS_REMOTE_WRITE | RS_REMOTE_READ, 1, 0xFFFFFFFFFFFFF000ull, 0},
    {"big", 128 * 1024, RS_LOCAL_WRITE | RS_REMOTE_WRITE | RS_REMOTE_READ, 1, 0, 0},
    {"other", 4096, RS_LOCAL_WRITE | RS_REMOTE_WRITE | RS_REMOTE_READ, 2, 0, 1},
    {"recv", RECV_SIZE * RECVS, RS_LOCAL_WRITE, 1, 0, 0},
    {"sink", READ_LEN, RS_LOCAL_WRITE, 1, 0, 0},
};
#define NREGIONS (sizeof table / sizeof table[0])

static uint32_t stag_of(size_t i) { return (uint32_t)(i + 1) << 8 | 0x42; }
static uint64_t iova_of(size_t i) { return table[i].iova ? table[i].iova : 0x10000ull * (i + 1); }

static void check(int ok, const char *what, const char *region)
{
    if (!ok) {
        fprintf(stderr, "ORACLE: %s (%s)\n", what, region);
        abort();
    }
}

static void drain(rs_qp *qp, rs_cq **cqs)
{
    rs_wc wcs[64];
    size_t len;
    for (int rounds = 0; rounds < 10000; rounds++) {
        const uint8_t *p = rs_qp_tx(qp, &len);
        if (!p)
            break;
        rs_qp_tx_done(qp, len);
    }
    for (int i = 0; i < 4; i++)
        while (rs_cq_poll(cqs[i], wcs, 64))
            ;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static const size_t cuts[] = {0, 1, 3, 17, 64, 1000, 4096, 65536};
    if (size < 2)
        return 0;
    int crc = data[0] & 1;
    size_t cut = cuts[(data[0] >> 1) & 7];
    /* Pieces under 64 bytes cut a stream of at most 1 KiB: each piece is a call and a
     * drain, and longer streams cut so fine took half the run's time, finding nothing
     * more (the same coverage in a minute at twice the executions: docs/security.md). */
    if (cut && cut < 64 && size > 1024)
        cut = 1000;
    int revoke = (data[0] & 0x10) != 0;
    /* Bit 5: CQs of 2 entries, so completions overrun them (the QP fails at the end of
     * the call that overran: settle() in _engine.c). */
    uint32_t cqe = (data[0] & 0x20) ? 2 : 256;
    size_t victim = data[1] % NREGIONS;
    data += 2;
    size -= 2;
    size_t revoke_at = revoke ? size / 2 : (size_t)-1;

    /* One arena for the process (a malloc per input made ASan the cost), filled anew. */
    static uint8_t *arena, *snapshot;
    static size_t total;
    if (!arena) {
        for (size_t i = 0; i < NREGIONS; i++)
            total += table[i].length + 2 * GUARD;
        arena = malloc(total);
        snapshot = malloc(128 * 1024);
        if (!arena || !snapshot)
            abort();
    }
    memset(arena, FILL, total);
    uint8_t *base[NREGIONS];
    size_t pos = 0;
    rs_mem *mem = rs_mem_new();
    for (size_t i = 0; i < NREGIONS; i++) {
        base[i] = arena + pos + GUARD;
        pos += table[i].length + 2 * GUARD;
        if (rs_mem_add(mem, stag_of(i), base[i], iova_of(i), table[i].length, table[i].access,
                       table[i].pd))
            abort();
    }
    rs_cq *cqs[4];
    for (int i = 0; i < 4; i++)
        cqs[i] = rs_cq_new(cqe);
    rs_qp *qp = rs_qp_new(mem, 1, 1, cqs[0], cqs[1], NULL, 16, RECVS, 0);
    if (rs_qp_start(qp, crc, 4, 4, 65536, 0, 0))
        abort();
    rs_recv_wr recvs[RECVS];
    memset(recvs, 0, sizeof recvs);
    for (uint32_t i = 0; i < RECVS; i++) {
        recvs[i].wr_id = i;
        recvs[i].num_sge = 1;
        recvs[i].sg_list[0] = (rs_sge){iova_of(7) + i * RECV_SIZE, RECV_SIZE, stag_of(7)};
    }
    rs_qp_post_recv(qp, recvs, RECVS);
    rs_send_wr read;
    memset(&read, 0, sizeof read);
    read.wr_id = 1;
    read.opcode = RS_WR_RDMA_READ;
    read.flags = RS_SIGNALED;
    read.remote_addr = READ_TO;
    read.rkey = READ_STAG;
    read.num_sge = 1;
    read.sg_list[0] = (rs_sge){iova_of(8), READ_LEN, stag_of(8)};
    int why;
    rs_qp_post_send(qp, &read, 1, &why);
    drain(qp, cqs);

    /* The stream, in pieces (its own copy each, so ASan sees a read past a piece). */
    int removed = 0;
    for (size_t off = 0; off < size;) {
        if (off >= revoke_at && !removed) {
            rs_mem_remove(mem, stag_of(victim));
            memcpy(snapshot, base[victim], table[victim].length);
            removed = 1;
        }
        size_t n = cut ? cut : size;
        if (n > size - off)
            n = size - off;
        if (!removed && off < revoke_at && n > revoke_at - off)
            n = revoke_at - off; /* the piece ends where the region goes */
        uint8_t *piece = malloc(n);
        if (!piece)
            abort();
        memcpy(piece, data + off, n);
        rs_qp_rx(qp, piece, n);
        free(piece);
        off += n;
        drain(qp, cqs);
    }
    drain(qp, cqs);

    static uint8_t fill[4096];
    if (!fill[0])
        memset(fill, FILL, sizeof fill);
    for (size_t i = 0; i < NREGIONS; i++) {
        check(!memcmp(base[i] - GUARD, fill, GUARD), "guard zone before a region changed",
              table[i].name);
        check(!memcmp(base[i] + table[i].length, fill, GUARD), "guard zone after a region changed",
              table[i].name);
        if (table[i].frozen) /* (each frozen region is 4096 bytes) */
            check(!memcmp(base[i], fill, table[i].length), "a region no peer may write changed",
                  table[i].name);
    }
    if (removed)
        check(!memcmp(snapshot, base[victim], table[victim].length),
              "a region changed after rs_mem_remove returned", table[victim].name);
    rs_qp_free(qp);
    for (int i = 0; i < 4; i++)
        rs_cq_free(cqs[i]);
    rs_mem_free(mem);
    return 0;
}
