/* Compiled data-path kernels of the soft-iWARP engine (rdmashim.providers.softiwarp).
 *
 * The pure-Python versions in kernels.py are the reference: these functions
 * do exactly what they do, only faster. The receive side parses bytes a peer
 * sent, so every length is checked before use; nothing here allocates, every
 * output goes to a buffer the caller sized, and results are counts and offsets.
 * The wire format is RFC 5044 (MPA FPDU), 5041 (DDP) and 5040 (RDMAP).
 */
#include "_accel.h"

#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(RS_NO_HW_CRC)
#include <immintrin.h>
#define RS_HAVE_HW_CRC 1
#endif

#define DDP_UNTAGGED_LAST 0x41 /* DDP control: untagged, last segment, version 1 */
#define RDMAP_SEND 0x43        /* RDMAP control: version 1, opcode Send */
#define RDMAP_SEND_INV 0x44
#define RDMAP_SEND_SE 0x45
#define RDMAP_SEND_SE_INV 0x46
#define RDMAP_WRITE 0x40
#define RDMAP_READ_RESPONSE 0x42
#define DDP_TAGGED_MIDDLE 0x81 /* DDP control: tagged, version 1 */
#define DDP_TAGGED_LAST 0xC1   /* DDP control: tagged, last segment, version 1 */
#define CRC32C_POLY 0x82F63B78u /* reflected Castagnoli polynomial */
#define CRC32C_POLY_NORMAL 0x1EDC6F41u /* the same, highest power first (x^32 implied) */

#define CRC_LANE 128       /* bytes per lane of the three-way hardware CRC */
#define CRC_LONG_LANE 2048 /* the same for long buffers */

static uint32_t crc_table[8][256];
static uint32_t crc_shift[4][256];      /* raw CRC state advanced over CRC_LANE zero bytes */
static uint32_t crc_shift_long[4][256]; /* the same over CRC_LONG_LANE zero bytes */
static int crc_ready;
static int crc_hw; /* RS_CRC_TABLE, RS_CRC_INSN or RS_CRC_FOLD */

/* The raw CRC state v advanced over a lane of zero bytes (a linear map of v). */
static inline uint32_t shift_state(uint32_t table[4][256], uint32_t v)
{
    return table[0][v & 0xff] ^ table[1][(v >> 8) & 0xff] ^ table[2][(v >> 16) & 0xff] ^
           table[3][v >> 24];
}

/* Fill table for shift_state over lane zero bytes (crc_table[0] must be ready). */
static void make_shift(uint32_t table[4][256], int lane)
{
    uint32_t basis[32]; /* each bit of a state, advanced over the lane */
    for (int bit = 0; bit < 32; bit++) {
        uint32_t c = 1u << bit;
        for (int k = 0; k < lane; k++)
            c = crc_table[0][c & 0xff] ^ (c >> 8);
        basis[bit] = c;
    }
    for (int k = 0; k < 4; k++)
        for (uint32_t b = 0; b < 256; b++) {
            uint32_t v = 0;
            for (int j = 0; j < 8; j++)
                if (b & (1u << j))
                    v ^= basis[8 * k + j];
            table[k][b] = v;
        }
}

#ifdef RS_HAVE_HW_CRC
/* Carry-less folding (the CPU's vector multiply without carries): a 128-bit block A
 * of the message, bit j of its little-endian value standing for x^(127 - j) (the
 * reflected order of the CRC), is worth A * x^D mod P where it stands D bits
 * earlier than the block it is folded onto. With A = L x^64 + H (L its low 64 bits),
 * that is L (x^(D+64) mod P) + H (x^D mod P): two 64 x 32-bit products that fit in
 * 128 bits, XORed onto the later block. A reflected product comes out one bit
 * higher (times x), hence the keys x^(D+63) and x^(D-1). */
static uint64_t fold_near[2]; /* keys to fold a block onto the next one (D = 128) */
static uint64_t fold_lane[2]; /* over one 512-bit vector (D = 512) */
static uint64_t fold_far[2];  /* over the four vectors the main loop holds (D = 2048) */

/* x^e mod P as a reflected 64-bit key: the term x^d at bit 63 - d. */
static uint64_t fold_key(unsigned e)
{
    uint64_t r = 1;
    for (unsigned i = 0; i < e; i++) {
        r <<= 1;
        if (r >> 32)
            r ^= (1ull << 32) | CRC32C_POLY_NORMAL;
    }
    uint64_t key = 0;
    for (int d = 0; d < 32; d++)
        if (r >> d & 1)
            key |= 1ull << (63 - d);
    return key;
}

static void fold_keys(uint64_t keys[2], unsigned distance)
{
    keys[0] = fold_key(distance + 63); /* for the low half */
    keys[1] = fold_key(distance - 1);  /* for the high half */
}
#endif

void rs_init(void)
{
    if (crc_ready)
        return;
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = (c & 1) ? (c >> 1) ^ CRC32C_POLY : c >> 1;
        crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++)
            crc_table[t][i] = (crc_table[t - 1][i] >> 8) ^ crc_table[0][crc_table[t - 1][i] & 0xff];
    make_shift(crc_shift, CRC_LANE);
    make_shift(crc_shift_long, CRC_LONG_LANE);
#ifdef RS_HAVE_HW_CRC
    __builtin_cpu_init();
    if (__builtin_cpu_supports("sse4.2"))
        crc_hw = RS_CRC_INSN;
    if (crc_hw && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("vpclmulqdq")) {
        fold_keys(fold_near, 128);
        fold_keys(fold_lane, 512);
        fold_keys(fold_far, 4 * 512);
        crc_hw = RS_CRC_FOLD;
    }
#endif
    crc_ready = 1;
}

int rs_crc32c_hw(void)
{
    rs_init();
    return crc_hw;
}

static inline uint32_t load_le32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static inline uint32_t load_be32(const uint8_t *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | (uint32_t)p[3];
}

static inline uint32_t load_be16(const uint8_t *p)
{
    return (uint32_t)p[0] << 8 | (uint32_t)p[1];
}

static inline uint64_t load_be64(const uint8_t *p)
{
    return (uint64_t)load_be32(p) << 32 | load_be32(p + 4);
}

static inline void store_be32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)(v >> 24);
    p[1] = (uint8_t)(v >> 16);
    p[2] = (uint8_t)(v >> 8);
    p[3] = (uint8_t)v;
}

static inline void store_le32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    p[2] = (uint8_t)(v >> 16);
    p[3] = (uint8_t)(v >> 24);
}

uint32_t rs_crc32c_sw(uint32_t crc, const uint8_t *data, size_t len)
{
    rs_init();
    crc = ~crc;
    while (len >= 8) {
        uint32_t lo = crc ^ load_le32(data);
        uint32_t hi = load_le32(data + 4);
        crc = crc_table[7][lo & 0xff] ^ crc_table[6][(lo >> 8) & 0xff] ^
              crc_table[5][(lo >> 16) & 0xff] ^ crc_table[4][lo >> 24] ^
              crc_table[3][hi & 0xff] ^ crc_table[2][(hi >> 8) & 0xff] ^
              crc_table[1][(hi >> 16) & 0xff] ^ crc_table[0][hi >> 24];
        data += 8;
        len -= 8;
    }
    while (len--)
        crc = crc_table[0][(crc ^ *data++) & 0xff] ^ (crc >> 8);
    return ~crc;
}

#ifdef RS_HAVE_HW_CRC
/* The raw state c over the blocks of three lanes of lane bytes at *data; advances
 * *data and *len past them. */
__attribute__((target("sse4.2"))) static uint64_t crc_lanes(uint64_t c, const uint8_t **data,
                                                            size_t *len, size_t lane,
                                                            uint32_t table[4][256])
{
    const uint8_t *p = *data;
    size_t n = *len;
    while (n >= 3 * lane) {
        uint64_t c1 = 0, c2 = 0;
        for (size_t i = 0; i < lane; i += 8) {
            uint64_t w0, w1, w2;
            memcpy(&w0, p + i, 8);
            memcpy(&w1, p + lane + i, 8);
            memcpy(&w2, p + 2 * lane + i, 8);
            c = _mm_crc32_u64(c, w0);
            c1 = _mm_crc32_u64(c1, w1);
            c2 = _mm_crc32_u64(c2, w2);
        }
        c = shift_state(table, (uint32_t)c) ^ (uint32_t)c1;
        c = shift_state(table, (uint32_t)c) ^ (uint32_t)c2;
        p += 3 * lane;
        n -= 3 * lane;
    }
    *data = p;
    *len = n;
    return c;
}

__attribute__((target("sse4.2"))) static uint32_t crc32c_hw(uint32_t crc, const uint8_t *data,
                                                             size_t len)
{
    uint64_t c = ~crc;
    /* Three lanes at once (the instruction's latency is three times its throughput),
     * joined by advancing the states before them over the lanes that follow. */
    c = crc_lanes(c, &data, &len, CRC_LONG_LANE, crc_shift_long);
    c = crc_lanes(c, &data, &len, CRC_LANE, crc_shift);
    while (len >= 8) {
        uint64_t word;
        memcpy(&word, data, 8); /* unaligned load; x86 is little-endian like the CRC */
        c = _mm_crc32_u64(c, word);
        data += 8;
        len -= 8;
    }
    uint32_t c32 = (uint32_t)c;
    while (len--)
        c32 = _mm_crc32_u8(c32, *data++);
    return ~c32;
}

#define FOLD_TARGET __attribute__((target("avx512f,vpclmulqdq,pclmul,sse4.2")))
#define FOLD_MIN 512 /* shorter buffers take crc32c_hw (the fold's set-up costs more) */

FOLD_TARGET static inline __m128i fold16(__m128i a, __m128i keys, __m128i next)
{
    __m128i lo = _mm_clmulepi64_si128(a, keys, 0x00), hi = _mm_clmulepi64_si128(a, keys, 0x11);
    return _mm_xor_si128(_mm_xor_si128(lo, hi), next);
}

FOLD_TARGET static inline __m512i fold64(__m512i a, __m512i keys, __m512i next)
{
    __m512i lo = _mm512_clmulepi64_epi128(a, keys, 0x00);
    __m512i hi = _mm512_clmulepi64_epi128(a, keys, 0x11);
    return _mm512_ternarylogic_epi64(lo, hi, next, 0x96); /* lo ^ hi ^ next */
}

/* The CRC32c of data[0:len] (len >= FOLD_MIN) by folding: four 512-bit accumulators
 * take 256 bytes a round, the state to continue from XORed into the first 4 bytes;
 * they fold into one 128-bit block A, whose CRC (the instruction's, from a zero
 * state) continues over the bytes left, since the message is A x^(8 * rest) + rest
 * mod P. With dst (else NULL), the bytes are also copied there as they are read. */
FOLD_TARGET static uint32_t crc32c_fold(uint32_t crc, uint8_t *dst, const uint8_t *data,
                                        size_t len)
{
    __m512i acc[4];
    for (int i = 0; i < 4; i++) {
        acc[i] = _mm512_loadu_si512(data + 64 * i);
        if (dst)
            _mm512_storeu_si512(dst + 64 * i, acc[i]);
    }
    acc[0] = _mm512_xor_si512(acc[0], _mm512_zextsi128_si512(_mm_cvtsi32_si128((int)~crc)));
    data += 256;
    len -= 256;
    dst = dst ? dst + 256 : NULL;
    __m512i far = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)fold_far));
    while (len >= 256) {
        for (int i = 0; i < 4; i++) {
            __m512i next = _mm512_loadu_si512(data + 64 * i);
            if (dst)
                _mm512_storeu_si512(dst + 64 * i, next);
            acc[i] = fold64(acc[i], far, next);
        }
        data += 256;
        len -= 256;
        dst = dst ? dst + 256 : NULL;
    }
    __m512i lane = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)fold_lane));
    __m512i v = fold64(fold64(fold64(acc[0], lane, acc[1]), lane, acc[2]), lane, acc[3]);
    __m128i near = _mm_loadu_si128((const __m128i *)fold_near);
    __m128i a = _mm512_extracti32x4_epi32(v, 0);
    a = fold16(a, near, _mm512_extracti32x4_epi32(v, 1));
    a = fold16(a, near, _mm512_extracti32x4_epi32(v, 2));
    a = fold16(a, near, _mm512_extracti32x4_epi32(v, 3));
    for (; len >= 16; data += 16, len -= 16) {
        __m128i next = _mm_loadu_si128((const __m128i *)data);
        if (dst) {
            _mm_storeu_si128((__m128i *)dst, next);
            dst += 16;
        }
        a = fold16(a, near, next);
    }
    if (dst)
        memcpy(dst, data, len);
    uint64_t c = _mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(a));
    c = _mm_crc32_u64(c, (uint64_t)_mm_extract_epi64(a, 1));
    return crc32c_hw(~(uint32_t)c, data, len);
}
#endif

uint32_t rs_crc32c(uint32_t crc, const uint8_t *data, size_t len)
{
    rs_init();
#ifdef RS_HAVE_HW_CRC
    if (crc_hw == RS_CRC_FOLD && len >= FOLD_MIN)
        return crc32c_fold(crc, NULL, data, len);
    if (crc_hw)
        return crc32c_hw(crc, data, len);
#endif
    return rs_crc32c_sw(crc, data, len);
}

/* rs_crc32c of src[0:len] continuing from crc, with src copied to dst (not overlapping)
 * in the same pass where the CPU allows it. */
static uint32_t crc32c_copy(uint32_t crc, uint8_t *dst, const uint8_t *src, size_t len)
{
#ifdef RS_HAVE_HW_CRC
    if (crc_hw == RS_CRC_FOLD && len >= FOLD_MIN)
        return crc32c_fold(crc, dst, src, len);
#endif
    if (len)
        memcpy(dst, src, len);
    return rs_crc32c(crc, src, len);
}

/* The CRC32c of the FPDU f[0:body] whose payload f[header_len:header_len + n] is copied
 * from `from` to `to` in the pass that sums it (one of the two is that part of f). */
static uint32_t fpdu_crc_copy(const uint8_t *f, size_t header_len, uint8_t *to,
                              const uint8_t *from, size_t n, size_t body)
{
    uint32_t c = rs_crc32c(0, f, header_len);
    c = crc32c_copy(c, to, from, n);
    return rs_crc32c(c, f + header_len + n, body - header_len - n);
}

/* PAD bytes after a ULPDU so that the FPDU (with its 2 length bytes) ends 4-aligned. */
static inline size_t pad_len(size_t ulpdu_len)
{
    return (4 - ((ulpdu_len + 2) & 3)) & 3;
}

/* After the header_len bytes of header at f: the payload, zero PAD up to body bytes,
 * and the CRC field. */
static void fill_fpdu(uint8_t *f, size_t header_len, const uint8_t *payload, size_t n,
                      size_t body, int crc)
{
    memset(f + header_len + n, 0, body - header_len - n);
    if (!crc) {
        if (n)
            memcpy(f + header_len, payload, n);
        store_le32(f + body, 0);
        return;
    }
    store_le32(f + body, fpdu_crc_copy(f, header_len, f + header_len, payload, n, body));
}

/* The FPDU of one Send (control byte ctrl, invalidate STag inv, MSN msn) carrying the
 * len bytes at src, written at f (cap bytes there): its size, or 0 when the control
 * byte is not a Send's, the payload does not fit one FPDU or f is too small. */
static size_t frame_one_send(uint8_t *f, size_t cap, uint8_t ctrl, uint32_t inv, uint32_t msn,
                             const uint8_t *src, size_t len, int crc)
{
    if (ctrl != RDMAP_SEND && ctrl != RDMAP_SEND_INV && ctrl != RDMAP_SEND_SE &&
        ctrl != RDMAP_SEND_SE_INV)
        return 0;
    if (len > RS_MAX_SEND_PAYLOAD)
        return 0;
    size_t ulpdu_len = RS_UNTAGGED_HDR_LEN - 2 + len;
    size_t body = RS_UNTAGGED_HDR_LEN + len + pad_len(ulpdu_len);
    if (cap < body + RS_CRC_LEN)
        return 0;
    f[0] = (uint8_t)(ulpdu_len >> 8);
    f[1] = (uint8_t)ulpdu_len;
    f[2] = DDP_UNTAGGED_LAST;
    f[3] = ctrl;
    store_be32(f + 4, inv);
    store_be32(f + 8, 0);   /* QN: Send queue */
    store_be32(f + 12, msn); /* MSN */
    store_be32(f + 16, 0);  /* MO */
    fill_fpdu(f, RS_UNTAGGED_HDR_LEN, src, len, body, crc);
    return body + RS_CRC_LEN;
}

int64_t rs_frame_sends(uint8_t *out, size_t out_cap, const uint8_t *data, size_t data_len,
                       const uint32_t *lens, const uint8_t *ctrls, const uint32_t *invs,
                       size_t n, uint32_t msn, int crc)
{
    size_t o = 0; /* bytes written to out */
    size_t d = 0; /* payload bytes taken from data */
    for (size_t i = 0; i < n; i++) {
        size_t len = lens[i];
        if (len > data_len - d)
            return -1;
        size_t w = frame_one_send(out + o, out_cap - o, ctrls[i], invs[i], msn + (uint32_t)i,
                                  data + d, len, crc);
        if (!w)
            return -1;
        o += w;
        d += len;
    }
    if (d != data_len)
        return -1;
    return (int64_t)o;
}

size_t rs_scan_sends(const uint8_t *buf, size_t buf_len, size_t start, size_t end,
                     uint32_t msn, int crc, uint32_t *out, size_t out_cap, size_t *stop)
{
    size_t count = 0;
    size_t most = out_cap / RS_MSG_WORDS;
    size_t pos = start;
    *stop = start;
    /* Offsets go out as 32-bit words: the whole buffer must be addressable by them. */
    if (start > end || end > buf_len || buf_len > UINT32_MAX)
        return 0;
    while (count < most && end - pos >= RS_SEND_MIN) {
        const uint8_t *f = buf + pos;
        size_t ulpdu_len = load_be16(f);
        uint8_t ctrl = f[3];
        if (f[2] != DDP_UNTAGGED_LAST || (ctrl != RDMAP_SEND && ctrl != RDMAP_SEND_SE) ||
            load_be32(f + 8) != 0 || load_be32(f + 16) != 0 || load_be32(f + 12) != msn ||
            ulpdu_len < RS_UNTAGGED_HDR_LEN - 2)
            break;
        size_t body = ulpdu_len + 2 + pad_len(ulpdu_len);
#ifdef RS_FUZZ_SELFTEST
        /* A deliberate off-by-four for the fuzz harness's self-test: the CRC field
         * of the last FPDU may lie past end. The fuzz test builds this variant
         * and requires AddressSanitizer to catch it. */
        if (body > end - pos)
            break;
#else
        if (body + RS_CRC_LEN > end - pos)
            break;
#endif
        if (crc && rs_crc32c(0, f, body) != load_le32(f + body))
            break;
        out[count * RS_MSG_WORDS] = (uint32_t)(pos + RS_UNTAGGED_HDR_LEN);
        out[count * RS_MSG_WORDS + 1] = (uint32_t)(ulpdu_len - (RS_UNTAGGED_HDR_LEN - 2));
        out[count * RS_MSG_WORDS + 2] = ctrl == RDMAP_SEND_SE;
        count++;
        msn++;
        pos += body + RS_CRC_LEN;
    }
    *stop = pos;
    return count;
}

int rs_place(const uint8_t *buf, size_t buf_len, const uint32_t *msgs, size_t msg_words,
             size_t n, uint8_t *const *bases, const uint64_t *caps, const uint64_t *offs,
             const uint64_t *lens, size_t nseg, const uint32_t *nsegs, size_t nsegs_len)
{
    size_t s = 0; /* next segment */
    if (n > msg_words / RS_MSG_WORDS || n > nsegs_len)
        return -1;
    for (size_t i = 0; i < n; i++) {
        size_t off = msgs[i * RS_MSG_WORDS];
        size_t left = msgs[i * RS_MSG_WORDS + 1];
        if (off > buf_len || left > buf_len - off || nsegs[i] > nseg - s)
            return -1;
        const uint8_t *src = buf + off;
        for (size_t end = s + nsegs[i]; s < end; s++) {
            if (offs[s] > caps[s] || lens[s] > caps[s] - offs[s])
                return -1;
            size_t take = left < lens[s] ? left : (size_t)lens[s];
            if (take)
                memcpy(bases[s] + offs[s], src, take);
            src += take;
            left -= take;
        }
        if (left)
            return -1;
    }
    return 0;
}

/* Whether [to, to + len) stays below 2^64. */
static inline int fits_to(uint64_t to, uint64_t len)
{
    return len == 0 || len - 1 <= UINT64_MAX - to;
}

int rs_place_in(const uint8_t *buf, size_t buf_len, const uint32_t *msgs, size_t msg_words,
                size_t n, uint8_t *dst, size_t dst_len, const uint64_t *spans)
{
    if (n > msg_words / RS_MSG_WORDS)
        return -1;
    for (size_t i = 0; i < n; i++) { /* every check first: all or nothing is placed */
        size_t off = msgs[i * RS_MSG_WORDS];
        size_t len = msgs[i * RS_MSG_WORDS + 1];
        uint64_t at = spans[2 * i], room = spans[2 * i + 1];
        if (off > buf_len || len > buf_len - off || len > room || at > dst_len ||
            room > dst_len - at)
            return -1;
    }
    for (size_t i = 0; i < n; i++) {
        size_t len = msgs[i * RS_MSG_WORDS + 1];
        if (len)
            memcpy(dst + spans[2 * i], buf + msgs[i * RS_MSG_WORDS], len);
    }
    return 0;
}

int64_t rs_frame_tagged(uint8_t *out, size_t out_cap, const uint8_t *data, size_t data_len,
                        uint8_t ctrl, uint32_t stag, uint64_t to, size_t chunk, int last,
                        int crc, int copy)
{
    if ((ctrl != RDMAP_WRITE && ctrl != RDMAP_READ_RESPONSE) || chunk == 0 ||
        chunk > RS_MAX_TAGGED_PAYLOAD || !fits_to(to, data_len))
        return -1;
    size_t o = 0; /* bytes written to out */
    size_t d = 0; /* payload bytes framed */
    for (;;) {
        size_t n = data_len - d < chunk ? data_len - d : chunk;
        int final = d + n == data_len;
        size_t ulpdu_len = RS_TAGGED_HDR_LEN - 2 + n;
        size_t pad = pad_len(ulpdu_len);
        size_t body = RS_TAGGED_HDR_LEN + (copy ? n : 0) + pad; /* bytes in out */
        if (out_cap - o < body + RS_CRC_LEN)
            return -1;
        uint8_t *f = out + o;
        uint64_t at = to + d;
        f[0] = (uint8_t)(ulpdu_len >> 8);
        f[1] = (uint8_t)ulpdu_len;
        f[2] = final && last ? DDP_TAGGED_LAST : DDP_TAGGED_MIDDLE;
        f[3] = ctrl;
        store_be32(f + 4, stag);
        store_be32(f + 8, (uint32_t)(at >> 32));
        store_be32(f + 12, (uint32_t)at);
        if (copy) {
            fill_fpdu(f, RS_TAGGED_HDR_LEN, data + d, n, body, crc);
        } else {
            memset(f + RS_TAGGED_HDR_LEN, 0, pad);
            uint32_t c = 0;
            if (crc) {
                c = rs_crc32c(0, f, RS_TAGGED_HDR_LEN);
                c = rs_crc32c(c, data + d, n);
                c = rs_crc32c(c, f + RS_TAGGED_HDR_LEN, pad);
            }
            store_le32(f + body, c);
        }
        o += body + RS_CRC_LEN;
        d += n;
        if (final)
            return (int64_t)o;
    }
}

int64_t rs_place_tagged(const uint8_t *buf, size_t buf_len, size_t start, size_t end,
                        uint8_t ctrl, uint32_t stag, uint64_t to, uint8_t *dst, size_t dst_len,
                        size_t off, int crc, int in_order, uint64_t *result)
{
    if ((ctrl != RDMAP_WRITE && ctrl != RDMAP_READ_RESPONSE) || off > dst_len)
        return -1;
    uint64_t span = dst_len - off; /* bytes of the range */
    if (!fits_to(to, span))
        return -1;
    uint64_t done = 0; /* in order: payload bytes placed */
    result[0] = to;
    result[1] = 0;
    if (start > end || end > buf_len)
        return (int64_t)start;
    size_t pos = start;
    while (end - pos >= RS_TAGGED_MIN) {
        const uint8_t *f = buf + pos;
        size_t ulpdu_len = load_be16(f);
        if ((f[2] != DDP_TAGGED_MIDDLE && f[2] != DDP_TAGGED_LAST) || f[3] != ctrl ||
            load_be32(f + 4) != stag || ulpdu_len < RS_TAGGED_HDR_LEN - 2)
            break;
        uint64_t n = ulpdu_len - (RS_TAGGED_HDR_LEN - 2);
        uint64_t got = load_be64(f + 8);
        if (got < to)
            break;
        uint64_t rel = got - to; /* where the payload goes in the range */
        if (rel > span || n > span - rel)
            break;
        int final = f[2] == DDP_TAGGED_LAST;
        if (in_order && (rel != done || (final && rel + n != span)))
            break;
        size_t body = ulpdu_len + 2 + pad_len(ulpdu_len);
        if (body + RS_CRC_LEN > end - pos)
            break;
        /* The payload is placed, then the CRC checked (as siw does): one pass over it. A
         * mismatch ends the run at this FPDU, placed inside the checked range; the
         * engine's general path then fails the connection with its Terminate. */
        const uint8_t *payload = f + RS_TAGGED_HDR_LEN;
        if (crc) {
            uint8_t *to = dst + off + rel;
            if (fpdu_crc_copy(f, RS_TAGGED_HDR_LEN, to, payload, (size_t)n, body) !=
                load_le32(f + body))
                break;
        } else if (n) {
            memcpy(dst + off + rel, payload, (size_t)n);
        }
        pos += body + RS_CRC_LEN;
        if (in_order) {
            done += n;
            if (final) {
                result[1] = 1;
                break;
            }
        }
    }
    result[0] = to + done;
    return (int64_t)pos;
}

void rs_gather(uint8_t *out, uint8_t *const *srcs, const uint32_t *lens, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        memcpy(out, srcs[i], lens[i]);
        out += lens[i];
    }
}
