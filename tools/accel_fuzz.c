/* Fuzz driver for the soft-iWARP engine's compiled kernels (providers/softiwarp/_accel.c).
 *
 * Build it with the kernels under AddressSanitizer and UndefinedBehaviorSanitizer:
 *
 *   gcc -g -O1 -fsanitize=address,undefined -fno-sanitize-recover=all \
 *       -I providers/softiwarp tools/accel_fuzz.c providers/softiwarp/_accel.c -o accel_fuzz
 *   ./accel_fuzz SECONDS [SEED]
 *
 * Each round frames a valid run of Sends with rs_frame_sends (checked by a scan
 * that must take all of it), mutates it (byte writes, truncation, garbage,
 * splices) or replaces it with random bytes, and runs rs_scan_sends over random
 * windows, rs_place into random, partly invalid targets and rs_place_in into one
 * guarded buffer at random, partly invalid offsets; rs_frame_sends gets
 * random, partly inconsistent arguments too, and the hardware CRC32c is compared
 * with the table. Likewise for tagged runs: rs_frame_tagged frames one (which
 * rs_place_tagged must take back whole, in order, into a buffer of exactly its
 * size), which is mutated or replaced and placed by rs_place_tagged over random
 * windows into guarded targets with random ranges and offsets. Inputs sit in buffers of exactly their size (ASan sees any read
 * past them); outputs have canary zones on both sides, checked after every call.
 * Any sanitizer report aborts; any broken invariant prints "ORACLE:" and exits 1.
 * tests/test_accel_fuzz.py runs it; -DRS_FUZZ_SELFTEST builds the kernels with a
 * deliberate overread, which the test requires ASan to catch.
 */
#include "_accel.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define GUARD 32
#define CANARY 0xA5
#define MAX_MSGS 48
#define MAX_SEGS 160

static uint64_t rng_state;

static uint64_t rnd(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static size_t below(size_t n)
{
    return n ? (size_t)(rnd() % n) : 0;
}

static void oracle(const char *what, uint64_t round)
{
    fprintf(stderr, "ORACLE: %s (round %llu)\n", what, (unsigned long long)round);
    exit(1);
}

/* A guarded output buffer: GUARD canary bytes, cap usable bytes, GUARD canary bytes. */
static uint8_t *guarded(size_t cap)
{
    uint8_t *raw = malloc(cap + 2 * GUARD);
    if (!raw) {
        perror("malloc");
        exit(2);
    }
    memset(raw, CANARY, cap + 2 * GUARD);
    return raw + GUARD;
}

static void check_guards(uint8_t *buf, size_t cap, uint64_t round)
{
    for (size_t i = 0; i < GUARD; i++)
        if (buf[-1 - (long)i] != CANARY || buf[cap + i] != CANARY)
            oracle("write outside an output buffer", round);
}

static void release(uint8_t *buf)
{
    free(buf - GUARD);
}

/* An input buffer of exactly len bytes (ASan reports any read past it). */
static uint8_t *exact(size_t len)
{
    uint8_t *buf = malloc(len ? len : 1);
    if (!buf) {
        perror("malloc");
        exit(2);
    }
    return buf;
}

static uint8_t *exact_copy(const uint8_t *data, size_t len)
{
    uint8_t *copy = exact(len);
    if (len)
        memcpy(copy, data, len);
    return copy;
}

static uint8_t *random_bytes(size_t len)
{
    uint8_t *buf = exact(len);
    for (size_t i = 0; i < len; i++)
        buf[i] = (uint8_t)rnd();
    return buf;
}

/* A valid run of Sends; returns its length (*out malloc'd, exactly that long). */
static size_t valid_run(uint8_t **out, size_t *count, uint32_t msn, int crc, uint64_t round)
{
    size_t n = 1 + below(MAX_MSGS);
    uint32_t lens[MAX_MSGS], invs[MAX_MSGS];
    uint8_t ctrls[MAX_MSGS];
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        lens[i] = (uint32_t)(below(8) ? below(120) : below(3000));
        invs[i] = (uint32_t)rnd();
        ctrls[i] = below(2) ? 0x45 : 0x43; /* Send with SE, Send */
        total += lens[i];
    }
    uint8_t *data = random_bytes(total);
    size_t cap = total + n * (RS_SEND_MIN + 3);
    uint8_t *framed = guarded(cap);
    int64_t len = rs_frame_sends(framed, cap, data, total, lens, ctrls, invs, n, msn, crc);
    check_guards(framed, cap, round);
    if (len < 0)
        oracle("rs_frame_sends refused valid Sends", round);
    *out = exact_copy(framed, (size_t)len);
    release(framed);
    free(data);
    *count = n;
    return (size_t)len;
}

static void mutate(uint8_t **buf, size_t *len)
{
    size_t edits = 1 + below(4);
    for (size_t e = 0; e < edits && *len; e++) {
        switch (below(6)) {
        case 0: /* a random byte */
            (*buf)[below(*len)] = (uint8_t)rnd();
            break;
        case 1: /* a bit */
            (*buf)[below(*len)] ^= (uint8_t)(1u << below(8));
            break;
        case 2: /* a length field: the first two bytes of some FPDU-aligned word */
            (*buf)[below(*len) & ~(size_t)3] = (uint8_t)rnd();
            break;
        case 3: { /* truncation */
            size_t keep = below(*len);
            uint8_t *shorter = exact_copy(*buf, keep);
            free(*buf);
            *buf = shorter;
            *len = keep;
            break;
        }
        case 4: { /* a run of garbage */
            size_t at = below(*len), n = below(40);
            for (size_t i = at; i < *len && i < at + n; i++)
                (*buf)[i] = (uint8_t)rnd();
            break;
        }
        default: { /* splice: the tail again, shifted */
            size_t from = below(*len), to = below(*len);
            size_t n = *len - (from > to ? from : to);
            memmove(*buf + to, *buf + from, n);
            break;
        }
        }
    }
}

/* Mutate a run, or (one time in five) replace it with random bytes. */
static void mutate_or_replace(uint8_t **buf, size_t *len)
{
    if (below(5) == 0) {
        free(*buf);
        *len = below(600);
        *buf = random_bytes(*len);
    } else {
        mutate(buf, len);
    }
}

static void scan_and_place(const uint8_t *buf, size_t len, uint32_t msn, int crc, uint64_t round)
{
    size_t start = below(8) ? 0 : below(len + 1);
    size_t end = below(4) ? len : start + below(len - start + 1);
#ifdef RS_FUZZ_SELFTEST
    end = len; /* where the deliberate overread leaves the buffer */
#endif
    size_t words = below(4) ? (end - start) / RS_SEND_MIN * RS_MSG_WORDS + below(4) : below(30);
    uint32_t *msgs = (uint32_t *)(void *)guarded(words * sizeof(uint32_t));
    size_t stop = (size_t)-1;
    size_t n = rs_scan_sends(buf, len, start, end, msn, crc, msgs, words, &stop);
    check_guards((uint8_t *)msgs, words * sizeof(uint32_t), round);
    if (n > words / RS_MSG_WORDS || stop < start || stop > end)
        oracle("rs_scan_sends result out of bounds", round);
    size_t pos = start;
    for (size_t i = 0; i < n; i++) {
        size_t off = msgs[i * RS_MSG_WORDS], plen = msgs[i * RS_MSG_WORDS + 1];
        size_t fpdu = (RS_UNTAGGED_HDR_LEN + plen + 3) / 4 * 4 + RS_CRC_LEN;
        if (off != pos + RS_UNTAGGED_HDR_LEN || pos + fpdu > end || msgs[i * RS_MSG_WORDS + 2] > 1)
            oracle("a scanned message outside the window", round);
        pos += fpdu;
    }
    if (pos != stop)
        oracle("stop is not the end of the last message", round);

    /* Targets: segments in their own guarded buffers, mostly valid. */
    size_t nseg = below(MAX_SEGS);
    uint8_t *bases[MAX_SEGS];
    uint64_t caps[MAX_SEGS], offs[MAX_SEGS], lens[MAX_SEGS];
    for (size_t s = 0; s < nseg; s++) {
        caps[s] = below(4) ? below(200) : below(4000);
        bases[s] = guarded((size_t)caps[s]);
        offs[s] = below(10) ? below((size_t)caps[s] + 1) : below(8000);
        lens[s] = below(10) ? below((size_t)(caps[s] - (offs[s] <= caps[s] ? offs[s] : 0)) + 1)
                            : below(8000);
    }
    size_t nmsg = n + (below(8) ? 0 : below(3));
    uint32_t *nsegs = (uint32_t *)(void *)guarded((nmsg ? nmsg : 1) * sizeof(uint32_t));
    for (size_t i = 0; i < nmsg; i++)
        nsegs[i] = (uint32_t)(below(6) ? 1 : below(4));
    int rc = rs_place(buf, len, msgs, words, nmsg, bases, caps, offs, lens, nseg, nsegs, nmsg);
    if (rc != 0 && rc != -1)
        oracle("rs_place returned something else than 0 or -1", round);
    check_guards((uint8_t *)nsegs, (nmsg ? nmsg : 1) * sizeof(uint32_t), round);
    for (size_t s = 0; s < nseg; s++) {
        check_guards(bases[s], (size_t)caps[s], round);
        release(bases[s]);
    }
    release((uint8_t *)nsegs);

    /* One target buffer: receives at random offsets and sizes, mostly inside it. */
    size_t cap = below(4) ? below(400) : below(20000);
    uint8_t *dst = guarded(cap);
    /* spans: (offset, room) per receive */
    uint64_t *spans = (uint64_t *)(void *)guarded((nmsg ? nmsg : 1) * 2 * sizeof(uint64_t));
    int fits = nmsg <= n;
    for (size_t i = 0; i < nmsg; i++) {
        uint64_t at = below(10) ? below(cap + 1) : rnd() >> below(64);
        uint64_t room = below(10) ? below(cap - (at <= cap ? at : cap) + 1) : rnd() >> below(64);
        spans[2 * i] = at;
        spans[2 * i + 1] = room;
        if (i < n && (msgs[i * RS_MSG_WORDS + 1] > room || at > cap || room > cap - at))
            fits = 0;
    }
    rc = rs_place_in(buf, len, msgs, words, nmsg, dst, cap, spans);
    if (rc != (fits ? 0 : -1))
        oracle("rs_place_in did not refuse exactly what does not fit", round);
    for (size_t i = 0; rc && i < cap; i++)
        if (dst[i] != CANARY)
            oracle("rs_place_in placed something of what it refused", round);
    check_guards(dst, cap, round);
    check_guards((uint8_t *)spans, (nmsg ? nmsg : 1) * 2 * sizeof(uint64_t), round);
    release((uint8_t *)spans);
    release(dst);
    release((uint8_t *)msgs);
}

static void frame_randomly(uint64_t round)
{
    size_t n = below(12);
    uint32_t lens[12], invs[12];
    uint8_t ctrls[12];
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        lens[i] = (uint32_t)(below(10) ? below(200) : rnd() % 70000);
        invs[i] = (uint32_t)rnd();
        ctrls[i] = (uint8_t)(below(10) ? 0x43 + below(4) : rnd());
        total += lens[i];
    }
    size_t data_len = below(4) ? total : below(total + 100);
    uint8_t *data = random_bytes(data_len);
    size_t need = total + n * (RS_SEND_MIN + 3);
    size_t cap = below(3) ? need : below(need + 1);
    uint8_t *out = guarded(cap);
    int64_t w = rs_frame_sends(out, cap, data, data_len, lens, ctrls, invs, n, (uint32_t)rnd(),
                               (int)below(2));
    check_guards(out, cap, round);
    if (w > (int64_t)cap || w < -1)
        oracle("rs_frame_sends wrote more than its buffer", round);
    release(out);
    free(data);
}

/* A valid tagged run; returns its length (*out malloc'd, exactly that long). */
static size_t valid_tagged(uint8_t **out, uint8_t ctrl, uint32_t stag, uint64_t to, int crc,
                           uint64_t round)
{
    size_t total = below(4) ? below(3000) : below(20000);
    size_t chunk = below(4) ? 1 + below(1500) : RS_MAX_TAGGED_PAYLOAD - below(3);
    uint8_t *data = random_bytes(total);
    size_t cap = total + (total / chunk + 1) * (RS_TAGGED_MIN + 3);
    uint8_t *framed = guarded(cap);
    int64_t len = rs_frame_tagged(framed, cap, data, total, ctrl, stag, to, chunk, 1, crc, 1);
    check_guards(framed, cap, round);
    if (len < 0)
        oracle("rs_frame_tagged refused a valid run", round);
    uint8_t *dst = guarded(total);
    uint64_t result[2];
    int64_t stop = rs_place_tagged(framed, (size_t)len, 0, (size_t)len, ctrl, stag, to, dst, total,
                                   0, crc, 1, result);
    check_guards(dst, total, round);
    if (stop != len || result[0] != to + total || result[1] != 1 ||
        (total && memcmp(dst, data, total) != 0))
        oracle("a valid tagged run was not placed whole", round);
    *out = exact_copy(framed, (size_t)len);
    release(dst);
    release(framed);
    free(data);
    return (size_t)len;
}

static void place_tagged_randomly(const uint8_t *buf, size_t len, uint8_t ctrl, uint32_t stag,
                                  uint64_t to, int crc, uint64_t round)
{
    size_t start = below(8) ? 0 : below(len + 1);
    size_t end = below(4) ? len : start + below(len - start + 1);
    if (below(10) == 0) { /* a window that is not one */
        start = below(len + 10);
        end = below(len + 10);
    }
    size_t cap = below(4) ? below(200) : below(30000);
    size_t off = below(10) ? below(cap + 1) : below(cap + 50);
    uint64_t at = below(4) ? to : below(2) ? to + below(3000) - 1500 : rnd();
    uint8_t *dst = guarded(cap);
    uint64_t result[2] = {0, 0};
    int in_order = (int)below(2);
    int64_t stop = rs_place_tagged(buf, len, start, end, ctrl, stag, at, dst, cap, off, crc,
                                   in_order, result);
    check_guards(dst, cap, round);
    if (stop == -1) {
        if (off <= cap && (cap - off == 0 || cap - off - 1 <= UINT64_MAX - at))
            oracle("rs_place_tagged refused a valid range", round);
    } else if (start > end || end > len) {
        if ((size_t)stop != start)
            oracle("rs_place_tagged took bytes outside its window", round);
    } else if ((size_t)stop < start || (size_t)stop > end || result[0] < at ||
               result[0] - at > cap - off || result[1] > 1) {
        oracle("rs_place_tagged result out of bounds", round);
    }
    release(dst);
}

static void frame_tagged_randomly(uint64_t round)
{
    size_t total = below(10) ? below(3000) : below(70000);
    size_t data_len = below(4) ? total : below(total + 1);
    uint8_t *data = random_bytes(data_len);
    size_t chunk = below(10) ? 1 + below(2000) : below(70000);
    size_t need = data_len + (data_len / (chunk ? chunk : 1) + 1) * (RS_TAGGED_MIN + 3);
    size_t cap = below(3) ? need : below(need + 1);
    uint8_t *out = guarded(cap);
    uint8_t ctrl = below(4) ? (below(2) ? 0x40 : 0x42) : (uint8_t)rnd();
    uint64_t to = below(4) ? rnd() >> 8 : UINT64_MAX - below(5000);
    int64_t w = rs_frame_tagged(out, cap, data, data_len, ctrl, (uint32_t)rnd(), to, chunk,
                                (int)below(2), (int)below(2), (int)below(2));
    check_guards(out, cap, round);
    if (w > (int64_t)cap || w < -1)
        oracle("rs_frame_tagged wrote more than its buffer", round);
    release(out);
    free(data);
}

static void crc_both(uint64_t round)
{
    size_t len = below(4) ? below(300) : below(2) ? below(3000) : below(20000);
    uint8_t *data = random_bytes(len);
    size_t skip = below(len + 1);
    uint32_t seed = (uint32_t)rnd();
    if (rs_crc32c(seed, data + skip, len - skip) != rs_crc32c_sw(seed, data + skip, len - skip))
        oracle("the CRC32c by the CPU and by the table disagree", round);
    free(data);
}

static const char *const crc_method[] = {"table", "SSE4.2", "VPCLMULQDQ"};

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: %s SECONDS [SEED]\n", argv[0]);
        return 2;
    }
    double seconds = atof(argv[1]);
    rng_state = argc > 2 ? strtoull(argv[2], NULL, 0) : (uint64_t)time(NULL);
    rng_state |= 1;
    fprintf(stderr, "accel_fuzz: seed %llu, %.0f s, CRC32c %s\n", (unsigned long long)rng_state,
            seconds, crc_method[rs_crc32c_hw()]);
    clock_t begin = clock();
    uint64_t round = 0;
    while ((double)(clock() - begin) / CLOCKS_PER_SEC < seconds) {
        uint32_t msn = below(4) ? (uint32_t)rnd() : 0xFFFFFFFFu - (uint32_t)below(40);
        int crc = (int)below(2);
#ifdef RS_FUZZ_SELFTEST
        crc = 1; /* the deliberate overread is in the CRC check */
#endif
        uint8_t *buf;
        size_t count;
        size_t len = valid_run(&buf, &count, msn, crc, round);
        size_t stop;
        uint32_t *all = (uint32_t *)(void *)exact(count * RS_MSG_WORDS * sizeof(uint32_t));
        if (rs_scan_sends(buf, len, 0, len, msn, crc, all, count * RS_MSG_WORDS, &stop) != count ||
            stop != len)
            oracle("a valid run was not taken whole", round);
        free(all);
        mutate_or_replace(&buf, &len);
        for (int k = 0; k < 4; k++)
            scan_and_place(buf, len, msn, crc, round);
        free(buf);
        frame_randomly(round);

        uint8_t ctrl = below(2) ? 0x40 : 0x42;
        uint32_t stag = (uint32_t)rnd();
        uint64_t to = below(4) ? rnd() >> (below(64)) : UINT64_MAX - below(30000) - 20000;
        len = valid_tagged(&buf, ctrl, stag, to, crc, round);
        mutate_or_replace(&buf, &len);
        for (int k = 0; k < 4; k++)
            place_tagged_randomly(buf, len, ctrl, stag, to, crc, round);
        free(buf);
        frame_tagged_randomly(round);
        crc_both(round);
        round++;
    }
    printf("rounds %llu\n", (unsigned long long)round);
    return 0;
}
