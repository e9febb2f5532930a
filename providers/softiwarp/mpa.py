"""MPA start frames: the Request, Reply and Reject of RFC 5044 §7.1, with RFC 6581's
enhanced connection setup (IRD/ORD and peer-to-peer ready-to-receive).

Pure functions over bytes: :func:`encode_start_frame` and :func:`parse_start_frame`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from rdmashim.cm.types import RTR
from rdmashim.providers.softiwarp.terminate import LlpCode, ProtocolError, llp

REQ_KEY = b"MPA ID Req Frame"
REP_KEY = b"MPA ID Rep Frame"
HEADER_LEN = 20
MAX_PRIVATE_DATA = 256
"""RFC 6581 / Linux: the whole private data, the 4-byte v2 IRD/ORD block included."""
V2_BLOCK_LEN = 4
IRD_ORD_MASK = 0x3FFF

FLAG_MARKERS = 0x80
FLAG_CRC = 0x40
FLAG_REJECT = 0x20
FLAG_ENHANCED = 0x10
_FLAG_P2P = 0x8000
_FLAG_SEND_RTR = 0x4000
_FLAG_WRITE_RTR = 0x8000
_FLAG_READ_RTR = 0x4000

_HDR = struct.Struct("!16sBBH")
_V2 = struct.Struct("!HH")


@dataclass(frozen=True, slots=True)
class StartFrame:
    """An MPA Request or Reply.

    ``private_data`` is the ULP's private data; with ``enhanced`` (rev 2 only) the
    4-byte IRD/ORD block precedes it on the wire and is carried by ``ird``, ``ord``,
    ``p2p`` and ``rtr``.
    """

    reply: bool
    revision: int = 2
    markers: bool = False
    crc: bool = False
    reject: bool = False
    enhanced: bool = True
    ird: int = 0
    ord: int = 0
    p2p: bool = False
    rtr: RTR = RTR.NONE
    private_data: bytes = b""

    @property
    def max_private_data(self) -> int:
        """ULP private data this frame can hold."""
        return MAX_PRIVATE_DATA - (V2_BLOCK_LEN if self.enhanced else 0)


def encode_start_frame(frame: StartFrame) -> bytes:
    """The bytes of an MPA Request or Reply; raises ValueError for a frame MPA cannot carry."""
    if frame.revision not in (1, 2):
        raise ValueError(f"MPA revision {frame.revision} is not 1 or 2")
    if frame.enhanced and frame.revision != 2:
        raise ValueError("enhanced connection setup needs MPA revision 2")
    if len(frame.private_data) > frame.max_private_data:
        raise ValueError(
            f"{len(frame.private_data)} bytes of private data exceed MPA's {frame.max_private_data}"
        )
    flags = (
        (FLAG_MARKERS if frame.markers else 0)
        | (FLAG_CRC if frame.crc else 0)
        | (FLAG_REJECT if frame.reject else 0)
        | (FLAG_ENHANCED if frame.enhanced else 0)
    )
    pd = frame.private_data
    if frame.enhanced:
        if not (0 <= frame.ird <= IRD_ORD_MASK and 0 <= frame.ord <= IRD_ORD_MASK):
            raise ValueError("IRD and ORD must fit in 14 bits")
        ird = frame.ird | (_FLAG_P2P if frame.p2p else 0)
        ird |= _FLAG_SEND_RTR if frame.rtr & RTR.SEND else 0
        ord_ = frame.ord | (_FLAG_WRITE_RTR if frame.rtr & RTR.WRITE else 0)
        ord_ |= _FLAG_READ_RTR if frame.rtr & RTR.READ else 0
        pd = _V2.pack(ird, ord_) + pd
    key = REP_KEY if frame.reply else REQ_KEY
    return _HDR.pack(key, flags, frame.revision, len(pd)) + pd


def parse_start_frame(
    data: bytes | bytearray | memoryview, *, reply: bool
) -> tuple[StartFrame, int] | None:
    """Decode an MPA Request (``reply=False``) or Reply from the front of ``data``.

    Returns the frame and the bytes it used, or None when more bytes are needed.
    Raises :class:`ProtocolError` (LLP / invalid request-reply) for bytes that are
    not the expected start frame.
    """
    if len(data) < HEADER_LEN:
        expected = REP_KEY if reply else REQ_KEY
        if bytes(data[:16]) != expected[: min(16, len(data))]:
            raise ProtocolError(f"not an {expected.decode()}", llp(LlpCode.INVALID_REQ_REP))
        return None
    key, flags, revision, pd_len = _HDR.unpack_from(data)
    expected = REP_KEY if reply else REQ_KEY
    if key != expected:
        raise ProtocolError(
            f"expected {expected.decode()!r}, got key {key!r}", llp(LlpCode.INVALID_REQ_REP)
        )
    if revision not in (1, 2):
        raise ProtocolError(f"MPA revision {revision} unsupported", llp(LlpCode.INVALID_REQ_REP))
    if pd_len > MAX_PRIVATE_DATA:
        raise ProtocolError(
            f"private data length {pd_len} exceeds {MAX_PRIVATE_DATA}",
            llp(LlpCode.INVALID_REQ_REP),
        )
    if len(data) < HEADER_LEN + pd_len:
        return None
    pd = bytes(data[HEADER_LEN : HEADER_LEN + pd_len])
    enhanced = revision == 2 and bool(flags & FLAG_ENHANCED)
    ird = ord_ = 0
    p2p = False
    rtr = RTR.NONE
    if enhanced:
        if pd_len < V2_BLOCK_LEN:
            raise ProtocolError(
                "MPA v2 enhanced frame without its IRD/ORD block", llp(LlpCode.INVALID_REQ_REP)
            )
        ird_word, ord_word = _V2.unpack_from(pd)
        pd = pd[V2_BLOCK_LEN:]
        ird, ord_ = ird_word & IRD_ORD_MASK, ord_word & IRD_ORD_MASK
        p2p = bool(ird_word & _FLAG_P2P)
        rtr = (
            (RTR.SEND if ird_word & _FLAG_SEND_RTR else RTR.NONE)
            | (RTR.WRITE if ord_word & _FLAG_WRITE_RTR else RTR.NONE)
            | (RTR.READ if ord_word & _FLAG_READ_RTR else RTR.NONE)
        )
    frame = StartFrame(
        reply=reply,
        revision=revision,
        markers=bool(flags & FLAG_MARKERS),
        crc=bool(flags & FLAG_CRC),
        reject=bool(flags & FLAG_REJECT),
        enhanced=enhanced,
        ird=ird,
        ord=ord_,
        p2p=p2p,
        rtr=rtr,
        private_data=pd,
    )
    return frame, HEADER_LEN + pd_len
