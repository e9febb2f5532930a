"""FPDUs: MPA framing (RFC 5044 §4) around DDP (RFC 5041) and RDMAP (RFC 5040) headers.

An FPDU on the wire is::

    ULPDU_Length (2) | DDP/RDMAP header | payload | PAD (0-3) | CRC32c (4, LSB first)

``ULPDU_Length`` counts the DDP/RDMAP header and payload. The CRC covers
everything before it; without negotiated CRC the field is zero. Header lengths
below include the two length bytes, as Linux siw counts them.

Pure functions and frozen dataclasses; nothing here does I/O.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import NamedTuple

from crc32c import crc32c

from rdmashim.providers.softiwarp.terminate import DdpTaggedCode as _TC
from rdmashim.providers.softiwarp.terminate import DdpUntaggedCode as _UC
from rdmashim.providers.softiwarp.terminate import (
    LlpCode,
    ProtocolError,
    RdmapCode,
    RdmapType,
    TermCode,
    ddp_tagged,
    ddp_untagged,
    llp,
    rdmap,
)


class Opcode(IntEnum):
    """RDMAP opcodes."""

    WRITE = 0
    READ_REQUEST = 1
    READ_RESPONSE = 2
    SEND = 3
    SEND_INV = 4
    SEND_SE = 5
    SEND_SE_INV = 6
    TERMINATE = 7


class QN(IntEnum):
    """Untagged DDP queue numbers used by RDMAP."""

    SEND = 0
    READ_REQUEST = 1
    TERMINATE = 2


DDP_TAGGED = 0x80
DDP_LAST = 0x40
DDP_RESERVED = 0x3C
DDP_VERSION = 0x01
RDMAP_VERSION = 0x40
RDMAP_RESERVED = 0x30

MAX_ULPDU = 0xFFFF
CTRL_LEN = 4
TAGGED_HDR_LEN = 16
UNTAGGED_HDR_LEN = 20
READ_REQUEST_HDR_LEN = 48
TERMINATE_HDR_LEN = UNTAGGED_HDR_LEN
TRAILER_CRC_LEN = 4

HEADER_LEN = {
    Opcode.WRITE: TAGGED_HDR_LEN,
    Opcode.READ_REQUEST: READ_REQUEST_HDR_LEN,
    Opcode.READ_RESPONSE: TAGGED_HDR_LEN,
    Opcode.SEND: UNTAGGED_HDR_LEN,
    Opcode.SEND_INV: UNTAGGED_HDR_LEN,
    Opcode.SEND_SE: UNTAGGED_HDR_LEN,
    Opcode.SEND_SE_INV: UNTAGGED_HDR_LEN,
    Opcode.TERMINATE: TERMINATE_HDR_LEN,
}
_OPCODES = tuple(Opcode)
HEADER_LEN_BY_OPCODE: tuple[int, ...] = tuple(HEADER_LEN[Opcode(i)] for i in range(8))
TAGGED_OPCODES = frozenset({Opcode.WRITE, Opcode.READ_RESPONSE})
SEND_OPCODES = frozenset({Opcode.SEND, Opcode.SEND_INV, Opcode.SEND_SE, Opcode.SEND_SE_INV})

CTRL = struct.Struct("!HBB")
TAGGED = struct.Struct("!HBBIQ")
UNTAGGED = struct.Struct("!HBBIIII")
READ_REQUEST = struct.Struct("!HBBIIIIIQIIQ")
_TERM_CTRL = struct.Struct("!I")
CRC_FIELD = struct.Struct("<I")
ZERO_PAD = (b"", b"\0", b"\0\0", b"\0\0\0")
ZERO_CRC = bytes(TRAILER_CRC_LEN)
"""The CRC field of an FPDU sent without CRC."""


CTRL_SEND = RDMAP_VERSION | Opcode.SEND
"""RDMAP control byte of a Send (and, below, of the other opcodes the data path tests)."""
CTRL_SEND_SE = RDMAP_VERSION | Opcode.SEND_SE
CTRL_WRITE = RDMAP_VERSION | Opcode.WRITE
CTRL_READ_RESPONSE = RDMAP_VERSION | Opcode.READ_RESPONSE
DDP_UNTAGGED_LAST = DDP_LAST | DDP_VERSION
"""DDP control byte of an untagged last segment (reserved bits zero)."""
DDP_TAGGED_MIDDLE = DDP_TAGGED | DDP_VERSION
"""DDP control byte of a tagged segment that does not end its message."""
DDP_TAGGED_LAST = DDP_TAGGED | DDP_LAST | DDP_VERSION

SEND_MIN = UNTAGGED_HDR_LEN + TRAILER_CRC_LEN
"""Fewest bytes that hold a whole Send FPDU (header and CRC field, no payload)."""
TAGGED_MIN = TAGGED_HDR_LEN + TRAILER_CRC_LEN
"""Fewest bytes that hold a whole tagged FPDU (header and CRC field, no payload)."""
MAX_SEND_PAYLOAD = MAX_ULPDU - (UNTAGGED_HDR_LEN - 2)
"""Most payload one untagged FPDU carries."""
MAX_TAGGED_PAYLOAD = MAX_ULPDU - (TAGGED_HDR_LEN - 2)
"""Most payload one tagged FPDU carries."""
MAX_FPDU = 65536
"""Largest FPDU we send: the 16-bit ULPDU length allows 65535 + 2 + pad + CRC bytes."""
U32_MAX = 0xFFFFFFFF
"""Largest value of a 32-bit wire field (STag, MO, length); MSNs count modulo 2^32."""
TO_LIMIT = 1 << 64
"""Tagged offsets are 64 bits: a segment or Read whose TO + length passes this wraps."""


SEND_CTRL_OF = tuple(
    RDMAP_VERSION | op for op in (Opcode.SEND, Opcode.SEND_INV, Opcode.SEND_SE, Opcode.SEND_SE_INV)
)
"""The RDMAP control byte of a Send at index ``2 * solicited + invalidate``: with SE
when solicited, with Invalidate when invalidate."""


def pad_len(ulpdu_len: int) -> int:
    """PAD bytes after a ULPDU so that the FPDU (length field included) ends 4-aligned."""
    return -(ulpdu_len + 2) & 3


def trailer_len(ulpdu_len: int) -> int:
    """Bytes after a ULPDU of ``ulpdu_len`` bytes: PAD and the CRC field."""
    return pad_len(ulpdu_len) + TRAILER_CRC_LEN


def fpdu_len(ulpdu_len: int) -> int:
    """Bytes of the FPDU carrying a ULPDU of ``ulpdu_len`` bytes: length field, ULPDU,
    PAD and CRC field (the first three end 4-aligned)."""
    return 2 + ulpdu_len + pad_len(ulpdu_len) + TRAILER_CRC_LEN


def max_payload(max_fpdu: int, header_len: int) -> int:
    """The most payload bytes an FPDU of at most ``max_fpdu`` bytes carries after a
    header of ``header_len`` bytes (length field included), a multiple of 4."""
    return (max_fpdu - header_len - TRAILER_CRC_LEN) & ~3


class Header(NamedTuple):
    """A decoded DDP/RDMAP header. Fields not used by the opcode are zero.

    ``ulpdu_len`` is the MPA length field: header (less its 2 length bytes) plus payload.
    """

    opcode: Opcode
    last: bool
    ulpdu_len: int
    stag: int = 0
    to: int = 0
    inv_stag: int = 0
    qn: int = 0
    msn: int = 0
    mo: int = 0
    sink_stag: int = 0
    sink_to: int = 0
    read_size: int = 0
    src_stag: int = 0
    src_to: int = 0

    @property
    def tagged(self) -> bool:
        """Whether this is a tagged DDP segment (Write, Read Response)."""
        return self.opcode in TAGGED_OPCODES

    @property
    def header_len(self) -> int:
        """Bytes of header on the wire, the MPA length field included."""
        return HEADER_LEN_BY_OPCODE[self.opcode]

    @property
    def payload_len(self) -> int:
        """Payload bytes after the header."""
        return self.ulpdu_len + 2 - self.header_len


def _ctrl_bytes(opcode: int, last: bool) -> tuple[int, int]:
    ddp = (DDP_TAGGED if opcode in TAGGED_OPCODES else 0) | (DDP_LAST if last else 0) | DDP_VERSION
    return ddp, RDMAP_VERSION | opcode


def encode_tagged(opcode: Opcode, last: bool, stag: int, to: int, payload_len: int) -> bytes:
    """Header of a tagged segment (Write or Read Response) carrying ``payload_len`` bytes."""
    ddp, rdmap_ctrl = _ctrl_bytes(opcode, last)
    return TAGGED.pack(TAGGED_HDR_LEN - 2 + payload_len, ddp, rdmap_ctrl, stag, to)


def encode_untagged(
    opcode: Opcode, last: bool, qn: int, msn: int, mo: int, payload_len: int, inv_stag: int = 0
) -> bytes:
    """Header of an untagged segment (a Send variant or Terminate)."""
    ddp, rdmap_ctrl = _ctrl_bytes(opcode, last)
    return UNTAGGED.pack(UNTAGGED_HDR_LEN - 2 + payload_len, ddp, rdmap_ctrl, inv_stag, qn, msn, mo)


def encode_send(
    payload: bytes | bytearray | memoryview, ctrl: int, inv_stag: int, msn: int, crc: bool
) -> bytes:
    """A whole one-segment Send FPDU in one buffer: RDMAP control byte ``ctrl`` (a Send
    variant's), ``inv_stag``, QN 0, MSN ``msn``, MO 0, last; ``payload``, PAD and the
    CRC field (zero when ``crc`` is false). The caller keeps ``payload`` within one FPDU."""
    ulpdu_len = UNTAGGED_HDR_LEN - 2 + len(payload)
    header = UNTAGGED.pack(ulpdu_len, DDP_UNTAGGED_LAST, ctrl, inv_stag, QN.SEND, msn, 0)
    body = header + payload + ZERO_PAD[pad_len(ulpdu_len)]
    return body + (CRC_FIELD.pack(crc32c(body)) if crc else ZERO_CRC)


def encode_read_request(
    msn: int, sink_stag: int, sink_to: int, size: int, src_stag: int, src_to: int
) -> bytes:
    """A whole RDMA Read Request ULPDU (untagged, QN 1, one segment)."""
    ddp, rdmap_ctrl = _ctrl_bytes(Opcode.READ_REQUEST, True)
    return READ_REQUEST.pack(
        READ_REQUEST_HDR_LEN - 2, ddp, rdmap_ctrl, 0, QN.READ_REQUEST, msn, 0,
        sink_stag, sink_to, size, src_stag, src_to,
    )  # fmt: skip


def parse_header(
    data: bytes | bytearray | memoryview, offset: int = 0, end: int | None = None
) -> Header | None:
    """Decode the DDP/RDMAP header at ``data[offset:end]`` (starting at the MPA length).

    Returns None when more bytes are needed; raises :class:`ProtocolError` with the
    Terminate code RFC 5040/5041 prescribe for a header that is not valid.
    """
    avail = (len(data) if end is None else end) - offset
    if avail < CTRL_LEN:
        return None
    ulpdu_len, ddp, rdmap_ctrl = CTRL.unpack_from(data, offset)
    tagged = bool(ddp & DDP_TAGGED)
    if ddp & 0x03 != DDP_VERSION:
        code = ddp_tagged(_TC.VERSION) if tagged else ddp_untagged(_UC.VERSION)
        raise ProtocolError(f"DDP version {ddp & 3}", code)
    if rdmap_ctrl & 0xC0 != RDMAP_VERSION:
        raise ProtocolError(
            f"RDMAP version {rdmap_ctrl >> 6}",
            rdmap(RdmapType.REMOTE_OPERATION, RdmapCode.VERSION),
        )
    op = rdmap_ctrl & 0x0F
    if op > Opcode.TERMINATE:
        raise ProtocolError(
            f"RDMAP opcode {op}", rdmap(RdmapType.REMOTE_OPERATION, RdmapCode.OPCODE)
        )
    opcode = _OPCODES[op]
    if tagged != (opcode in TAGGED_OPCODES):
        raise ProtocolError(
            f"{opcode.name} with DDP tagged flag {int(tagged)}",
            rdmap(RdmapType.REMOTE_OPERATION, RdmapCode.OPCODE),
        )
    hdr_len = HEADER_LEN_BY_OPCODE[opcode]
    if ulpdu_len + 2 < hdr_len:
        raise ProtocolError(
            f"ULPDU length {ulpdu_len} shorter than the {opcode.name} header",
            llp(LlpCode.FPDU_START),
        )
    if avail < hdr_len:
        return None
    last = bool(ddp & DDP_LAST)
    if tagged:
        _, _, _, stag, to = TAGGED.unpack_from(data, offset)
        return Header(opcode, last, ulpdu_len, stag=stag, to=to)
    if opcode is Opcode.READ_REQUEST:
        (_, _, _, _, qn, msn, mo, sink_stag, sink_to, size, src_stag, src_to) = (
            READ_REQUEST.unpack_from(data, offset)
        )
        return Header(
            opcode, last, ulpdu_len, qn=qn, msn=msn, mo=mo, sink_stag=sink_stag,
            sink_to=sink_to, read_size=size, src_stag=src_stag, src_to=src_to,
        )  # fmt: skip
    _, _, _, inv_stag, qn, msn, mo = UNTAGGED.unpack_from(data, offset)
    return Header(opcode, last, ulpdu_len, 0, 0, inv_stag, qn, msn, mo)


def trailer(ulpdu_len: int, crc: int | None) -> bytes:
    """PAD and CRC field closing an FPDU; ``crc`` None writes the zero CRC field."""
    return ZERO_PAD[pad_len(ulpdu_len)] + (CRC_FIELD.pack(crc) if crc is not None else ZERO_CRC)


def fpdu_crc(parts: Sequence[bytes | bytearray | memoryview]) -> int:
    """CRC32c over an FPDU's header, payload pieces and PAD (pass the PAD as a part)."""
    value = 0
    for part in parts:
        value = crc32c(part, value)
    return value


def encode_fpdu(
    header: bytes, payload: Sequence[bytes | bytearray | memoryview] = (), *, crc: bool
) -> list[bytes | bytearray | memoryview]:
    """The buffers of one FPDU (header, payload pieces, trailer) for a gathering send."""
    ulpdu_len = struct.unpack_from("!H", header)[0]
    pad = ZERO_PAD[pad_len(ulpdu_len)]
    value = None
    if crc:
        value = crc32c(pad, fpdu_crc([header, *payload]))
    return [header, *payload, trailer(ulpdu_len, value)]


def check_trailer(crc_state: int, pad_and_crc: bytes | bytearray | memoryview) -> bool:
    """Whether a received PAD + CRC field matches the CRC32c running over the FPDU so far."""
    pad = pad_and_crc[:-4]
    (wire,) = CRC_FIELD.unpack_from(pad_and_crc, len(pad))
    return bool(crc32c(pad, crc_state) == wire)


@dataclass(frozen=True, slots=True)
class Terminate:
    """The body of a Terminate message (RFC 5040 §4.8).

    ``copied_header`` is the terminated FPDU's header from its MPA length field on,
    when the Terminate carries it (the M/D/R flags say what it covers).
    """

    code: TermCode
    ddp_header_copied: bool = False
    rdmap_header_copied: bool = False
    copied_header: bytes = b""


def encode_terminate(term: Terminate) -> bytes:
    """Header and body of a Terminate ULPDU (QN 2, MSN 1, MO 0)."""
    word = (term.code.layer & 0xF) << 28 | (term.code.etype & 0xF) << 24
    word |= (term.code.ecode & 0xFF) << 16
    if term.copied_header:
        word |= 0x8000  # M: the DDP segment length below is valid
    if term.ddp_header_copied:
        word |= 0x4000
    if term.rdmap_header_copied:
        word |= 0x2000
    body = _TERM_CTRL.pack(word) + term.copied_header
    return encode_untagged(Opcode.TERMINATE, True, QN.TERMINATE, 1, 0, len(body)) + body


def parse_terminate(body: bytes | bytearray | memoryview) -> Terminate:
    """Decode a Terminate message body (what follows its untagged DDP header)."""
    if len(body) < 4:
        raise ProtocolError(
            f"Terminate body of {len(body)} bytes",
            rdmap(RdmapType.REMOTE_OPERATION, RdmapCode.OPCODE),
        )
    (word,) = _TERM_CTRL.unpack_from(body)
    code = TermCode(word >> 28, (word >> 24) & 0xF, (word >> 16) & 0xFF)
    return Terminate(
        code,
        ddp_header_copied=bool(word & 0x4000),
        rdmap_header_copied=bool(word & 0x2000),
        copied_header=bytes(body[4:]) if word & 0x8000 else b"",
    )
