/* The soft-iWARP engine's compiled data-path kernels (see _accel.c).
 *
 * Everything between the cdef markers is also read by accel_build.py as the
 * cffi declarations, so it holds only integer #defines and prototypes.
 */
#ifndef RDMASHIM_ACCEL_H
#define RDMASHIM_ACCEL_H

#include <stddef.h>
#include <stdint.h>

/* cdef-begin */
#define RS_UNTAGGED_HDR_LEN 20
#define RS_CRC_LEN 4
#define RS_SEND_MIN 24
#define RS_MAX_SEND_PAYLOAD 65517
#define RS_MSG_WORDS 3
#define RS_TAGGED_HDR_LEN 16
#define RS_TAGGED_MIN 20
#define RS_MAX_TAGGED_PAYLOAD 65521

/* Fill the CRC tables and pick the fastest CRC method the CPU has (idempotent). */
void rs_init(void);

/* How rs_crc32c computes: RS_CRC_TABLE (tables), RS_CRC_INSN (the CPU's CRC32
 * instruction) or RS_CRC_FOLD (carry-less multiplication on 512-bit vectors for long
 * buffers, the instruction for the rest). */
#define RS_CRC_TABLE 0
#define RS_CRC_INSN 1
#define RS_CRC_FOLD 2
int rs_crc32c_hw(void);

/* CRC32c of data[0:len], continuing from a previous result `crc` (0 to start),
 * as the crc32c package's crc32c(data, crc). rs_crc32c_sw always uses the
 * slicing-by-8 table. */
uint32_t rs_crc32c(uint32_t crc, const uint8_t *data, size_t len);
uint32_t rs_crc32c_sw(uint32_t crc, const uint8_t *data, size_t len);

/* Frame n one-FPDU untagged Sends into out[0:out_cap].
 * Message i: payload lens[i] bytes taken in turn from data[0:data_len], RDMAP
 * control byte ctrls[i] (Send, Send with Invalidate, with SE or not),
 * invalidate STag invs[i], MSN msn + i (mod 2^32), MO 0, QN 0, last flag set;
 * then zero PAD and the CRC32c (LSB first), or a zero CRC field when crc is 0.
 * Returns the bytes written, or -1 (out unspecified) when a control byte is
 * not a Send's, a payload does not fit one FPDU, the payloads do not add up
 * to data_len or out is too small. */
int64_t rs_frame_sends(uint8_t *out, size_t out_cap, const uint8_t *data, size_t data_len,
                       const uint32_t *lens, const uint8_t *ctrls, const uint32_t *invs,
                       size_t n, uint32_t msn, int crc);

/* Scan buf[start:end] for a run of whole one-FPDU Sends (or Sends with SE):
 * DDP control "untagged, last, version 1", QN 0, MO 0, MSNs msn, msn + 1, ...,
 * a ULPDU length that holds the header, the whole FPDU present and, when crc
 * is set, a matching CRC. Stops at the first FPDU that is anything else.
 * For each message found writes RS_MSG_WORDS words to out: the payload's
 * offset in buf, its length, 1 if solicited. At most out_cap / RS_MSG_WORDS
 * messages. Returns their count; *stop is the offset after the last one
 * (start when none). Nothing is read outside buf[start:end]. */
size_t rs_scan_sends(const uint8_t *buf, size_t buf_len, size_t start, size_t end,
                     uint32_t msn, int crc, uint32_t *out, size_t out_cap, size_t *stop);

/* Copy the payloads of n scanned messages (msgs: RS_MSG_WORDS words each, as
 * rs_scan_sends wrote them; msg_words of them) out of buf[0:buf_len] into
 * their targets. Message i fills the next nsegs[i] segments in turn; segment
 * s is bases[s][offs[s]:offs[s] + lens[s]] in a buffer of caps[s] bytes.
 * Returns 0, or -1 when an offset or length is out of its bounds, the
 * segments run out or cannot hold a payload (the messages before it are
 * placed: that is the caller's bug, never the peer's). */
int rs_place(const uint8_t *buf, size_t buf_len, const uint32_t *msgs, size_t msg_words,
             size_t n, uint8_t *const *bases, const uint64_t *caps, const uint64_t *offs,
             const uint64_t *lens, size_t nseg, const uint32_t *nsegs, size_t nsegs_len);

/* Copy the payloads of n scanned messages (msgs: RS_MSG_WORDS words each, as
 * rs_scan_sends wrote them; msg_words of them) out of buf[0:buf_len] into one buffer
 * dst[0:dst_len]: message i to dst[spans[2i]:], into a receive of spans[2i+1] bytes
 * there. Returns 0, or -1 (placing nothing) when a message lies outside buf or is
 * longer than its receive, or a receive passes dst_len. */
int rs_place_in(const uint8_t *buf, size_t buf_len, const uint32_t *msgs, size_t msg_words,
                size_t n, uint8_t *dst, size_t dst_len, const uint64_t *spans);

/* Frame data[0:data_len] as tagged FPDUs (RDMAP control byte ctrl: RDMA Write or
 * Read Response) to STag stag at TO to, chunk payload bytes each (the final one
 * fewer; one empty FPDU when data_len is 0), into out[0:out_cap]: header, payload
 * (only when copy is set), zero PAD, CRC32c over header, payload and PAD (LSB
 * first; a zero field when crc is 0). Without copy, the caller sends each FPDU's
 * payload from data between its header and its PAD. The final FPDU has the DDP
 * last flag when last is set. Returns the bytes written, or -1 (out unspecified)
 * when ctrl is not a tagged opcode's, chunk is 0 or above RS_MAX_TAGGED_PAYLOAD,
 * to + data_len passes 2^64 or out is too small. */
int64_t rs_frame_tagged(uint8_t *out, size_t out_cap, const uint8_t *data, size_t data_len,
                        uint8_t ctrl, uint32_t stag, uint64_t to, size_t chunk, int last,
                        int crc, int copy);

/* Place the run of whole tagged FPDUs at buf[start:end] whose payloads land in the
 * range [to, to + dst_len - off) of the caller's checked memory, TO `to` being
 * dst[off]. Each FPDU must have DDP control "tagged, version 1" (last or not,
 * reserved bits zero), RDMAP control byte ctrl, STag stag, a ULPDU length that
 * holds the header, its payload inside the range, the whole FPDU present and,
 * when crc is set, a matching CRC; with in_order, the first FPDU's TO is `to`,
 * each next one's follows the one before, and an FPDU with the last flag must
 * end the range and ends the run. Stops before the first FPDU that is anything
 * else, placing nothing of it, except that an FPDU whose CRC alone fails has its
 * payload placed (inside the range) before the run stops at it: the CRC is checked
 * in the pass that copies, as siw places before it checks. Returns the offset after the run (start when
 * none, or when start/end are not a window of buf); result[0] is the TO after
 * the run's payload in order (`to` otherwise), result[1] 1 when the run ended
 * with the last flag in order. Returns -1 when off > dst_len, ctrl is not a
 * tagged opcode's or the range passes 2^64 (the caller's bug). */
int64_t rs_place_tagged(const uint8_t *buf, size_t buf_len, size_t start, size_t end,
                        uint8_t ctrl, uint32_t stag, uint64_t to, uint8_t *dst, size_t dst_len,
                        size_t off, int crc, int in_order, uint64_t *result);
/* Copy n pieces in turn into out (the sum of lens bytes): piece i is lens[i] bytes
 * at srcs[i]. Local memory only, which the caller checked: each piece lies inside
 * a buffer it holds (a registered region's). */
void rs_gather(uint8_t *out, uint8_t *const *srcs, const uint32_t *lens, size_t n);

/* cdef-end */

#endif
