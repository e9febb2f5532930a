"""RPC-over-RDMA version 1 (RFC 8166) headers and RFC 8797 connection private data.

Pure codecs over bytes. A transport header opens every Send: four words
(``xid``, ``vers``, ``credit``, ``proc``), then for RDMA_MSG and RDMA_NOMSG
the three chunk lists: the Read list (a linked list of ``position`` +
segment), the Write list (a linked list of Write chunks, each an array of
segments) and the optional Reply chunk (an array of segments); an
RDMA_ERROR carries its error code instead (and for ERR_VERS the versions
spoken). A segment is ``handle`` (the R_Key), ``length`` and a 64-bit
``offset`` (the address in the peer's region).

Every count a peer sends is checked against a bound before anything is
built from it, and every malformed header is an :class:`~.xdr.XdrError`
(:class:`VersionMismatch` when only the version is wrong, so a responder can
answer ERR_VERS). RDMA_MSGP and RDMA_DONE (RFC 5666 only) are refused.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import Final

from rdmashim.ulps.nfsrdma.xdr import Packer, Unpacker, XdrError

RPCRDMA_VERSION = 1
DEFAULT_INLINE = 1024
"""RFC 8166 §3.3.3: the inline threshold in each direction without RFC 8797 private data."""
MAX_READ_SEGMENTS = 256
"""Entries of a Read list (every segment of every Read chunk)."""
MAX_WRITE_CHUNKS = 16
"""Write chunks in a Write list."""
MAX_CHUNK_SEGMENTS = 256
"""Segments in one Write chunk or in the Reply chunk."""
FIXED_LEN = 16
"""Bytes of the four fixed header words."""
MIN_HEADER_LEN = 28
"""An RDMA_MSG header with three empty lists (Linux ``RPCRDMA_HDRLEN_MIN``)."""


class Proc(IntEnum):
    """``rdma_proc`` (RFC 8166 §4.2.1)."""

    RDMA_MSG = 0
    RDMA_NOMSG = 1
    RDMA_MSGP = 2
    RDMA_DONE = 3
    RDMA_ERROR = 4


class ErrCode(IntEnum):
    """``rpcrdma_errcode`` of an RDMA_ERROR."""

    ERR_VERS = 1
    ERR_CHUNK = 2


class VersionMismatch(XdrError):
    """A header of another RPC-over-RDMA version: answer ERR_VERS (its xid is kept)."""

    def __init__(self, xid: int, vers: int) -> None:
        super().__init__(f"RPC-over-RDMA version {vers}, only {RPCRDMA_VERSION} spoken")
        self.xid = xid
        self.vers = vers


@dataclass(frozen=True, slots=True)
class Segment:
    """An RDMA segment: ``length`` bytes at ``offset`` in the region of R_Key ``handle``."""

    handle: int
    length: int
    offset: int

    def pack(self, p: Packer) -> None:
        """Append the segment's three fields."""
        p.uint(self.handle)
        p.uint(self.length)
        p.uhyper(self.offset)

    @classmethod
    def unpack(cls, u: Unpacker) -> Segment:
        """Read one segment."""
        return cls(u.uint(), u.uint(), u.uhyper())


@dataclass(frozen=True, slots=True)
class ReadSegment:
    """One entry of the Read list: a segment whose data belongs at ``position`` of the call."""

    position: int
    segment: Segment


Chunk = tuple[Segment, ...]
"""A Write chunk or the Reply chunk: segments filled in order."""


def chunk_length(chunk: Chunk) -> int:
    """The bytes a chunk holds (the sum of its segments' lengths)."""
    return sum(s.length for s in chunk)


def read_chunks(read_list: tuple[ReadSegment, ...]) -> list[tuple[int, Chunk]]:
    """The Read list as chunks: runs of segments with the same position, in order."""
    out: list[tuple[int, Chunk]] = []
    for entry in read_list:
        if out and out[-1][0] == entry.position:
            out[-1] = (entry.position, (*out[-1][1], entry.segment))
        else:
            out.append((entry.position, (entry.segment,)))
    return out


@dataclass(frozen=True, slots=True)
class Header:
    """An RDMA_MSG or RDMA_NOMSG transport header."""

    xid: int
    credit: int
    proc: Proc = Proc.RDMA_MSG
    read_list: tuple[ReadSegment, ...] = ()
    write_list: tuple[Chunk, ...] = ()
    reply_chunk: Chunk | None = None

    def encode(self) -> bytes:
        """The header's bytes (the RPC message, if inline, follows them)."""
        if self.proc not in (Proc.RDMA_MSG, Proc.RDMA_NOMSG):
            raise ValueError(f"{self.proc!r} is not a chunk-carrying header")
        p = _fixed(self.xid, RPCRDMA_VERSION, self.credit, self.proc)
        for entry in self.read_list:
            p.boolean(True)
            p.uint(entry.position)
            entry.segment.pack(p)
        p.boolean(False)
        for chunk in self.write_list:
            p.boolean(True)
            p.array(chunk, lambda s: s.pack(p))
        p.boolean(False)
        p.optional(self.reply_chunk, lambda c: p.array(c, lambda s: s.pack(p)))
        return p.getvalue()


@dataclass(frozen=True, slots=True)
class ErrorHeader:
    """An RDMA_ERROR: ERR_VERS with the versions spoken, or ERR_CHUNK."""

    xid: int
    credit: int
    code: ErrCode
    low: int = RPCRDMA_VERSION
    high: int = RPCRDMA_VERSION

    def encode(self) -> bytes:
        """The header's bytes (5 words for ERR_CHUNK, 7 for ERR_VERS)."""
        p = _fixed(self.xid, RPCRDMA_VERSION, self.credit, Proc.RDMA_ERROR)
        p.uint(self.code)
        if self.code == ErrCode.ERR_VERS:
            p.uint(self.low)
            p.uint(self.high)
        return p.getvalue()


Message = Header | ErrorHeader


def _fixed(xid: int, vers: int, credit: int, proc: int) -> Packer:
    p = Packer()
    for word in (xid, vers, credit, proc):
        p.uint(word)
    return p


_PLAIN = struct.Struct(">7I")
PLAIN_LEN: Final = _PLAIN.size
"""Bytes of a plain header: an RDMA_MSG whose three chunk lists are empty."""


def plain_header(xid: int, credit: int) -> bytes:
    """A plain header's bytes (what :meth:`Header.encode` gives for no chunks)."""
    return _PLAIN.pack(xid, RPCRDMA_VERSION, credit, Proc.RDMA_MSG, 0, 0, 0)


def write_plain_header(out: memoryview | bytearray, xid: int, credit: int) -> None:
    """:func:`plain_header` written at the start of ``out``."""
    _PLAIN.pack_into(out, 0, xid, RPCRDMA_VERSION, credit, Proc.RDMA_MSG, 0, 0, 0)


def peek_plain(data: bytes | bytearray | memoryview) -> tuple[int, int] | None:
    """The xid and credit of a plain header at the start of ``data`` (the RPC message
    follows at :data:`PLAIN_LEN`), None for any other start (:func:`decode` it)."""
    if len(data) < PLAIN_LEN:
        return None
    xid, vers, credit, proc, reads, writes, reply = _PLAIN.unpack_from(data)
    if vers != RPCRDMA_VERSION or proc != Proc.RDMA_MSG or reads or writes or reply:
        return None
    return xid, credit


def peek_fixed(data: bytes | bytearray | memoryview) -> tuple[int, int, int, int]:
    """The four fixed words (xid, vers, credit, proc); XdrError if fewer than 16 bytes."""
    u = Unpacker(data)
    return u.uint(), u.uint(), u.uint(), u.uint()


def _segments(u: Unpacker, what: str) -> Chunk:
    n = u.uint()
    if n > MAX_CHUNK_SEGMENTS:
        raise XdrError(f"{what} of {n} segments, at most {MAX_CHUNK_SEGMENTS} allowed")
    if n * 16 > u.remaining():
        raise XdrError(f"{what} of {n} segments in {u.remaining()} bytes")
    return tuple(Segment.unpack(u) for _ in range(n))


def decode(data: bytes | bytearray | memoryview) -> tuple[Message, int]:
    """Decode a transport header: (header, offset of the RPC message that follows).

    Raises :class:`VersionMismatch` for another version, :class:`~.xdr.XdrError`
    for anything else malformed (short, a list over its bound, an unknown or
    RFC 5666-only procedure, an unknown error code).
    """
    u = Unpacker(data)
    xid, vers, credit, proc = u.uint(), u.uint(), u.uint(), u.uint()
    if vers != RPCRDMA_VERSION:
        raise VersionMismatch(xid, vers)
    if proc == Proc.RDMA_ERROR:
        code = u.uint()
        if code == ErrCode.ERR_VERS:
            return ErrorHeader(xid, credit, ErrCode.ERR_VERS, u.uint(), u.uint()), u.pos
        if code == ErrCode.ERR_CHUNK:
            return ErrorHeader(xid, credit, ErrCode.ERR_CHUNK), u.pos
        raise XdrError(f"RDMA_ERROR with unknown error code {code}")
    if proc not in (Proc.RDMA_MSG, Proc.RDMA_NOMSG):
        name = Proc(proc).name if proc in Proc._value2member_map_ else str(proc)
        raise XdrError(f"procedure {name} not supported")
    read_list: list[ReadSegment] = []
    while u.boolean():
        if len(read_list) == MAX_READ_SEGMENTS:
            raise XdrError(f"Read list over {MAX_READ_SEGMENTS} segments")
        read_list.append(ReadSegment(u.uint(), Segment.unpack(u)))
    write_list: list[Chunk] = []
    while u.boolean():
        if len(write_list) == MAX_WRITE_CHUNKS:
            raise XdrError(f"Write list over {MAX_WRITE_CHUNKS} chunks")
        write_list.append(_segments(u, "Write chunk"))
    reply = _segments(u, "Reply chunk") if u.boolean() else None
    header = Header(xid, credit, Proc(proc), tuple(read_list), tuple(write_list), reply)
    return header, u.pos


# ---------------------------------------------------------------- RFC 8797 private data
CP_MAGIC = 0xF6AB0E18
CP_VERSION = 1
CP_F_SND_W_INV_OK = 1
"""``cp_flags`` bit 0: the sender of the private data accepts Send With Invalidate."""
_CP = struct.Struct(">IBBBB")
CP_LEN = _CP.size
MIN_CP_SIZE, MAX_CP_SIZE = 1024, 256 * 1024
"""Sizes private data can express: 1 to 256 KiB in 1 KiB steps."""


@dataclass(frozen=True, slots=True)
class ConnectPrivate:
    """RFC 8797 connection private data: the sender's inline sizes and flags."""

    send_size: int
    """The largest Send the sender makes (bytes)."""
    recv_size: int
    """The largest Send the sender can receive (its Receive buffers, bytes)."""
    remote_invalidate: bool = False
    """Whether the sender accepts Send With Invalidate."""

    def encode(self) -> bytes:
        """The 8 bytes: magic, version, flags, send and receive sizes as KiB - 1."""
        return _CP.pack(
            CP_MAGIC, CP_VERSION, CP_F_SND_W_INV_OK if self.remote_invalidate else 0,
            _encode_size(self.send_size), _encode_size(self.recv_size),
        )  # fmt: skip

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> ConnectPrivate:
        """Decode the first 8 bytes (more may follow: a CM may pad private data).

        XdrError when the data is short, the magic is not RFC 8797's or the
        version is not 1 (then the peer's sizes are the 1024-byte default).
        """
        if len(data) < CP_LEN:
            raise XdrError(f"{len(data)} bytes of private data, {CP_LEN} needed")
        magic, version, flags, send, recv = _CP.unpack_from(data)
        if magic != CP_MAGIC:
            raise XdrError(f"private data magic {magic:#010x} is not RPC-over-RDMA's")
        if version != CP_VERSION:
            raise XdrError(f"private data version {version}, {CP_VERSION} expected")
        return cls((send + 1) << 10, (recv + 1) << 10, bool(flags & CP_F_SND_W_INV_OK))


def _encode_size(size: int) -> int:
    if not MIN_CP_SIZE <= size <= MAX_CP_SIZE or size % 1024:
        raise ValueError(f"inline size {size} is not a multiple of 1 KiB in 1..256 KiB")
    return (size >> 10) - 1


def peer_sizes(private_data: bytes | bytearray | memoryview) -> ConnectPrivate:
    """The peer's sizes from its private data, or the RFC 8166 defaults without any."""
    try:
        return ConnectPrivate.decode(private_data)
    except XdrError:
        return ConnectPrivate(DEFAULT_INLINE, DEFAULT_INLINE)
