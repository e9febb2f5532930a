"""RDS wire formats, laid out as Linux's ``net/rds`` lays them out.

Pure values and functions over bytes, nothing here does I/O:

* :class:`RdsHeader`: the 48-byte ``struct rds_header`` (``rds.h``) in front of
  every RDS message and of every standalone ACK, with its extension headers
  (:class:`VersionExt`, :class:`RdmaExt`, :class:`RdmaDestExt`, :class:`NpathsExt`,
  :class:`GenNumExt`) in the 16-byte ``h_exthdr`` area;
* :func:`checksum` / :func:`verify_checksum`: ``h_csum``, the IPv4 header checksum
  over the 48 bytes (``rds_message_make_checksum`` / ``rds_message_verify_checksum``);
* :class:`ConnectPrivate`: the rdma_cm private data of RDS over RDMA
  (``struct rds_ib_connect_private`` and ``struct rds6_ib_connect_private``, ``ib.h``);
* :class:`CongestionMap`: the 65536-bit per-address congestion map and its 8 KiB
  wire image (``cong.c``).

Header layout (all big-endian)::

    offset  size  field
         0     8  h_sequence
         8     8  h_ack
        16     4  h_len          payload bytes that follow the header
        20     2  h_sport
        22     2  h_dport
        24     1  h_flags        RdsFlag
        25     1  h_credit
        26     4  h_padding      sent as zero, ignored on receipt
        30     2  h_csum         0: not checked
        32    16  h_exthdr       extension headers

Extension headers are a type byte followed by a body whose size the type implies
(no length byte), packed back to back from the start of ``h_exthdr``; a NONE (0)
type byte ends them, or the end of the 16 bytes (a list that fills the area
exactly has no NONE byte). Reading follows ``rds_message_next_extension``: it stops
at NONE, at a type of 16 or more, and at a body that would run past the area,
and it never fails. Bytes after the point where it stops are ignored.

One difference, on purpose: Linux's size table is zero for the types it does not
define below 16 (4 and 7..15 in mainline), so it reads such a type as an extension
with no body and goes on with the next byte. The peers that send those types give
them bodies (Oracle UEK's RDMA_BYTES 4 with 8 bytes, CAP_BITS 7, SPORT_IDX 8,
CSUM 9, and the 2025 RDMA_BYTES patches for mainline), so going on would read body
bytes as types. Here any type without a known size ends the list, as a type of 16
or more does in Linux.
"""

from __future__ import annotations

import builtins
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from enum import IntEnum, IntFlag
from ipaddress import IPv4Address, IPv6Address, ip_address
from typing import ClassVar

# ---------------------------------------------------------------------------------------
# Constants (net/rds/rds.h, rdma_transport.h, ib.h)
# ---------------------------------------------------------------------------------------

RDS_PROTOCOL_3_0 = 0x0300
RDS_PROTOCOL_3_1 = 0x0301
RDS_PROTOCOL_VERSION = RDS_PROTOCOL_3_1
"""The version Linux mainline speaks: 3.1."""

RDS_PORT = 18634
"""The historical RDMA-CM listener port, kept by Linux for old peers."""
RDS_CM_PORT = 16385
"""The RDMA-CM listener port since Linux's IPv6 work (also RDS/TCP's)."""
RDS_TCP_PORT = RDS_CM_PORT

RDS_FRAG_SHIFT = 12
RDS_FRAG_SIZE = 1 << RDS_FRAG_SHIFT
"""Receive fragment size: each receive buffer holds a header and this much payload."""
RDS_MAX_MSG_SIZE = 1 << 20
"""Largest payload (``h_len``) of one RDS message, RDMA or not."""

RDS_CONG_MAP_BITS = 65536
"""One bit per RDS port."""
RDS_CONG_MAP_BYTES = RDS_CONG_MAP_BITS // 8

RDS_HEADER_LEN = 48
RDS_HEADER_EXT_SPACE = 16
RDS_MAX_ADV_CREDIT = 255
RDS_FLAG_PROBE_PORT = 1
"""The port (sport 1 / dport 0, or the reverse) of the multipath handshake probe."""

RDS_IB_SUPPORTED_PROTOCOLS = 0x0003
"""``dp_protocol_minor_mask``: minor versions 0 and 1 of major 3."""
RDS_RDMA_REJ_INCOMPAT = 1
"""Reject private data meaning "incompatible protocol version"."""

IWARP_MAX_PRIVATE_DATA = 252
"""Private data an rdma_cm connect/accept can carry over iWARP: MPA's 256 bytes
less the 4-byte MPA v2 IRD/ORD block."""

CONNECT_PRIVATE_V4_LEN = 28
"""Bytes of fields in ``struct rds_ib_connect_private``."""
CONNECT_PRIVATE_V4_SIZE = 32
"""What 64-bit Linux sends: ``sizeof`` of that struct, which the ``__be64`` in the
common part pads to a multiple of 8 (four zero bytes after ``dp_credit``)."""
CONNECT_PRIVATE_V6_LEN = 52
"""Bytes of fields in ``struct rds6_ib_connect_private``."""
CONNECT_PRIVATE_V6_SIZE = 56
"""``sizeof(struct rds6_ib_connect_private)`` on 64-bit Linux, InfiniBand's whole
rdma_cm REQ private data."""


def protocol(major: int, minor: int) -> int:
    """The 16-bit protocol version, ``RDS_PROTOCOL(major, minor)``."""
    return (major << 8) | minor


def protocol_major(version: int) -> int:
    return version >> 8


def protocol_minor(version: int) -> int:
    return version & 0xFF


class RdsProtocolError(ValueError):
    """Bytes from the peer that are not valid RDS; the message names the problem."""


class RdsFlag(IntFlag):
    """``h_flags``. Other bits (Oracle UEK's heartbeat 0x08/0x10, the extension
    flag 0x20) are kept as they came."""

    NONE = 0
    CONG_BITMAP = 0x01
    ACK_REQUIRED = 0x02
    RETRANSMITTED = 0x04


class RdsExtType(IntEnum):
    """Extension header types whose body size is known (``RDS_EXTHDR_*``)."""

    NONE = 0
    VERSION = 1
    RDMA = 2
    RDMA_DEST = 3
    NPATHS = 5
    GEN_NUM = 6


def _check_uint(name: str, value: int, bits: int) -> None:
    if not 0 <= value < (1 << bits):
        raise ValueError(f"{name}={value} does not fit in {bits} bits")


# ---------------------------------------------------------------------------------------
# Extension headers
# ---------------------------------------------------------------------------------------

_U16 = struct.Struct("!H")
_U32 = struct.Struct("!I")
_U32X2 = struct.Struct("!II")


@dataclass(frozen=True, slots=True)
class VersionExt:
    """RDS_EXTHDR_VERSION: the protocol version (``__be32 h_version``). Linux no longer
    sends it over RDMA, where the CM private data carries the version."""

    version: int = RDS_PROTOCOL_VERSION

    TYPE: ClassVar[RdsExtType] = RdsExtType.VERSION
    SIZE: ClassVar[int] = 4

    def body(self) -> bytes:
        _check_uint("version", self.version, 32)
        return _U32.pack(self.version)

    @classmethod
    def from_body(cls, buf: bytes) -> VersionExt:
        return cls(_U32.unpack(buf)[0])


@dataclass(frozen=True, slots=True)
class RdmaExt:
    """RDS_EXTHDR_RDMA: the R_Key of the RDMA operation this message follows
    (``__be32 h_rdma_rkey``); the receiver lets go of a use-once MR."""

    rkey: int

    TYPE: ClassVar[RdsExtType] = RdsExtType.RDMA
    SIZE: ClassVar[int] = 4

    def body(self) -> bytes:
        _check_uint("rkey", self.rkey, 32)
        return _U32.pack(self.rkey)

    @classmethod
    def from_body(cls, buf: bytes) -> RdmaExt:
        return cls(_U32.unpack(buf)[0])


@dataclass(frozen=True, slots=True)
class RdmaDestExt:
    """RDS_EXTHDR_RDMA_DEST: where the sender wants the peer to RDMA
    (``__be32 h_rdma_rkey``, ``__be32 h_rdma_offset``)."""

    rkey: int
    offset: int = 0

    TYPE: ClassVar[RdsExtType] = RdsExtType.RDMA_DEST
    SIZE: ClassVar[int] = 8

    @property
    def cookie(self) -> int:
        """The 64-bit RDMA cookie the receiver hands to the application:
        R_Key in the low 32 bits, offset in the high 32 (``rds_rdma_make_cookie``)."""
        return self.rkey | (self.offset << 32)

    @classmethod
    def from_cookie(cls, cookie: int) -> RdmaDestExt:
        _check_uint("cookie", cookie, 64)
        return cls(cookie & 0xFFFFFFFF, cookie >> 32)

    def body(self) -> bytes:
        _check_uint("rkey", self.rkey, 32)
        _check_uint("offset", self.offset, 32)
        return _U32X2.pack(self.rkey, self.offset)

    @classmethod
    def from_body(cls, buf: bytes) -> RdmaDestExt:
        return cls(*_U32X2.unpack(buf))


@dataclass(frozen=True, slots=True)
class NpathsExt:
    """RDS_EXTHDR_NPATHS: the number of paths, in the multipath handshake probe
    (2 bytes, big-endian)."""

    npaths: int

    TYPE: ClassVar[RdsExtType] = RdsExtType.NPATHS
    SIZE: ClassVar[int] = 2

    def body(self) -> bytes:
        _check_uint("npaths", self.npaths, 16)
        return _U16.pack(self.npaths)

    @classmethod
    def from_body(cls, buf: bytes) -> NpathsExt:
        return cls(_U16.unpack(buf)[0])


@dataclass(frozen=True, slots=True)
class GenNumExt:
    """RDS_EXTHDR_GEN_NUM: the sender's connection generation number, in the
    handshake probe (4 bytes, big-endian)."""

    gen_num: int

    TYPE: ClassVar[RdsExtType] = RdsExtType.GEN_NUM
    SIZE: ClassVar[int] = 4

    def body(self) -> bytes:
        _check_uint("gen_num", self.gen_num, 32)
        return _U32.pack(self.gen_num)

    @classmethod
    def from_body(cls, buf: bytes) -> GenNumExt:
        return cls(_U32.unpack(buf)[0])


Extension = VersionExt | RdmaExt | RdmaDestExt | NpathsExt | GenNumExt
EXTENSION_TYPES: tuple[type[Extension], ...] = (
    VersionExt,
    RdmaExt,
    RdmaDestExt,
    NpathsExt,
    GenNumExt,
)
_EXT_BY_TYPE: dict[int, type[Extension]] = {int(cls.TYPE): cls for cls in EXTENSION_TYPES}


def extensions_len(extensions: Iterable[Extension]) -> int:
    """Bytes the extensions take in ``h_exthdr``: a type byte and the body each."""
    return sum(1 + ext.SIZE for ext in extensions)


def encode_extensions(extensions: Iterable[Extension]) -> bytes:
    """The 16-byte ``h_exthdr`` area: the extensions back to back, then NONE bytes.

    Raises ValueError when they do not fit in the 16 bytes.
    """
    out = bytearray()
    for ext in extensions:
        if type(ext) not in _EXT_BY_TYPE.values():
            raise ValueError(f"{ext!r} is not an RDS extension header")
        out.append(ext.TYPE)
        out += ext.body()
    if len(out) > RDS_HEADER_EXT_SPACE:
        raise ValueError(
            f"extension headers need {len(out)} bytes, the RDS header has {RDS_HEADER_EXT_SPACE}"
        )
    return bytes(out) + bytes(RDS_HEADER_EXT_SPACE - len(out))


def parse_extensions(area: bytes | bytearray | memoryview) -> tuple[Extension, ...]:
    """The extension headers at the front of a 16-byte ``h_exthdr`` area.

    Stops, without error, at NONE, at a type without a known size and at a body
    that would run past the area (see the module notes).
    """
    found: list[Extension] = []
    pos = 0
    end = min(len(area), RDS_HEADER_EXT_SPACE)
    while pos < end:
        cls = _EXT_BY_TYPE.get(area[pos])
        if cls is None:
            break
        pos += 1
        if pos + cls.SIZE > end:
            break
        found.append(cls.from_body(bytes(area[pos : pos + cls.SIZE])))
        pos += cls.SIZE
    return tuple(found)


# ---------------------------------------------------------------------------------------
# Header checksum
# ---------------------------------------------------------------------------------------

_CSUM_OFFSET = 30
_CSUM_SHIFT = 8 * (RDS_HEADER_LEN - _CSUM_OFFSET - 2)


def _header_int(header: bytes | bytearray | memoryview) -> int:
    if len(header) < RDS_HEADER_LEN:
        raise ValueError(f"an RDS header has {RDS_HEADER_LEN} bytes, got {len(header)}")
    return int.from_bytes(header[:RDS_HEADER_LEN], "big")


def _fold(value: int) -> int:
    """The ones' complement sum of the 16-bit words of ``value``'s big-endian bytes.

    2**16 is 1 modulo 0xFFFF, so the sum is ``value % 0xFFFF``, written 0xFFFF
    rather than 0 when any word is non-zero (end-around carry never gives 0 then).
    """
    folded = value % 0xFFFF
    return 0xFFFF if folded == 0 and value else folded


def checksum(header: bytes | bytearray | memoryview) -> int:
    """``h_csum`` for the first 48 bytes of ``header``, whatever its ``h_csum`` holds.

    The IPv4 header checksum (``ip_fast_csum``) over the header with ``h_csum``
    zero, as ``rds_message_make_checksum`` computes it. A header whose sum comes
    out 0 cannot be told from an unchecked one; an all-zero header gives 0xFFFF.
    """
    value = _header_int(header)
    value &= ~(0xFFFF << _CSUM_SHIFT)
    return 0xFFFF ^ _fold(value)


def verify_checksum(header: bytes | bytearray | memoryview) -> bool:
    """Whether ``h_csum`` of the first 48 bytes is 0 (not checked) or matches them
    (``rds_message_verify_checksum``)."""
    value = _header_int(header)
    if not (value >> _CSUM_SHIFT) & 0xFFFF:
        return True
    return _fold(value) == 0xFFFF


# ---------------------------------------------------------------------------------------
# The RDS header
# ---------------------------------------------------------------------------------------

HEADER_STRUCT = _HDR = struct.Struct("!QQIHHBB4xH16s")
"""The 48-byte header's fields: sequence, ack, length, sport, dport, flags, credit,
checksum (after 4 pad bytes) and the 16-byte extension area (a shorter one is padded
with NONE bytes). The send path packs its headers straight into its buffers with
``HEADER_STRUCT.pack_into``, fields it knows to fit and no :class:`RdsHeader`
(``struct.error`` if they do not)."""
assert _HDR.size == RDS_HEADER_LEN
FLAGS_BY_VALUE = tuple(RdsFlag(value) for value in range(256))
"""``h_flags`` by value: an index is cheaper than an enum call per header."""
_CONG_BITMAP = int(RdsFlag.CONG_BITMAP)


@dataclass(slots=True)
class RdsHeader:
    """``struct rds_header``. Fields keep the C names less their ``h_`` prefix
    (``h_len`` is ``length``, ``h_csum`` ``checksum``).

    ``checksum`` is the raw ``h_csum`` field: :meth:`encode` writes it as it is
    (0, unchecked, is what RDS/TCP sends) and :meth:`with_checksum` fills it in.
    Not frozen, unlike the other records here: :meth:`decode` makes one for every
    received message, and a frozen dataclass's ``__init__`` costs five times as
    much (1.1 against 0.2 us, timed); treat it as a value all the same.
    """

    sequence: int = 0
    ack: int = 0
    length: int = 0
    sport: int = 0
    dport: int = 0
    flags: RdsFlag = RdsFlag.NONE
    credit: int = 0
    checksum: int = 0
    extensions: tuple[Extension, ...] = ()

    def encode(self) -> bytes:
        """The 48 header bytes; raises ValueError for a header RDS cannot carry."""
        if not 0 <= self.length <= RDS_MAX_MSG_SIZE:
            raise ValueError(f"length={self.length} is outside 0..RDS_MAX_MSG_SIZE")
        area = encode_extensions(self.extensions) if self.extensions else b""
        try:
            return _HDR.pack(
                self.sequence, self.ack, self.length, self.sport, self.dport, self.flags,
                self.credit, self.checksum, area,
            )  # fmt: skip
        except struct.error:  # a field too wide: say which
            self._check_fields()
            raise

    def _check_fields(self) -> None:
        _check_uint("sequence", self.sequence, 64)
        _check_uint("ack", self.ack, 64)
        _check_uint("sport", self.sport, 16)
        _check_uint("dport", self.dport, 16)
        _check_uint("flags", self.flags, 8)
        _check_uint("credit", self.credit, 8)
        _check_uint("checksum", self.checksum, 16)

    def with_checksum(self) -> RdsHeader:
        """This header with ``checksum`` set to the value of its other fields."""
        return replace(self, checksum=checksum(replace(self, checksum=0).encode()))

    @classmethod
    def decode(
        cls, buf: bytes | bytearray | memoryview, *, verify: bool = True
    ) -> RdsHeader | None:
        """The header at the front of ``buf``, or None when it holds fewer than 48 bytes.

        Raises :class:`RdsProtocolError` for a non-zero ``h_csum`` that does not
        match (unless ``verify`` is false), an ``h_len`` over RDS_MAX_MSG_SIZE, and
        a congestion map update whose ``h_len`` is not RDS_CONG_MAP_BYTES (Linux
        drops those as "completely corrupt"). Padding and the bytes after the last
        extension header are ignored.
        """
        if len(buf) < RDS_HEADER_LEN:
            return None
        seq, ack, length, sport, dport, flags, credit, csum, area = _HDR.unpack_from(buf)
        if verify and csum and not verify_checksum(buf):
            raise RdsProtocolError(
                f"RDS header checksum 0x{csum:04x} does not match its bytes (0x{checksum(buf):04x})"
            )
        if length > RDS_MAX_MSG_SIZE:
            raise RdsProtocolError(
                f"RDS message length {length} exceeds RDS_MAX_MSG_SIZE ({RDS_MAX_MSG_SIZE})"
            )
        if flags & _CONG_BITMAP and length != RDS_CONG_MAP_BYTES:  # (an int: no Flag call)
            raise RdsProtocolError(
                f"RDS congestion map update of {length} bytes, not {RDS_CONG_MAP_BYTES}"
            )
        extensions = parse_extensions(area) if area[0] else ()  # (the common case: none)
        return cls(seq, ack, length, sport, dport, FLAGS_BY_VALUE[flags], credit, csum, extensions)


# ---------------------------------------------------------------------------------------
# rdma_cm private data
# ---------------------------------------------------------------------------------------

_CMN = "BBHBBHQI"
_PD_V4 = struct.Struct("!4s4s" + _CMN)
_PD_V6 = struct.Struct("!16s16s" + _CMN)
assert _PD_V4.size == CONNECT_PRIVATE_V4_LEN
assert _PD_V6.size == CONNECT_PRIVATE_V6_LEN
assert CONNECT_PRIVATE_V6_SIZE <= IWARP_MAX_PRIVATE_DATA


@dataclass(frozen=True, slots=True)
class ConnectPrivate:
    """The private data of an RDS rdma_cm connect request and its accept.

    IPv4 (``struct rds_ib_connect_private``), big-endian::

        0 dp_saddr (4)  4 dp_daddr (4)
        8 protocol_major (1)  9 protocol_minor (1)  10 protocol_minor_mask (2)
        12 tos (1)  13 reserved (1)  14 frag_size (2)
        16 ack_seq (8)  24 credit (4)           = 28 bytes (32 with padding)

    IPv6 (``struct rds6_ib_connect_private``): 16-byte addresses, then the same
    20 bytes at offset 32 (52 bytes, 56 with padding).

    ``tos`` is the connection's type of service (mainline ``ricpc_dp_toss``);
    ``frag_size`` is Oracle UEK's ``ricpc_frag_sz``, mainline's zero
    ``ripc_reserved2`` (0: RDS_FRAG_SIZE). A non-zero ``credit`` turns on flow
    control and gives the first credits; ``ack_seq`` is the last sequence number
    the sender received, so the peer can drop what was acked before a reconnect.
    A ``protocol_major`` of 0 is how Linux recognises a peer older than 3.1.
    Which of the two layouts applies follows the rdma_cm id's address family.
    """

    saddr: IPv4Address | IPv6Address
    daddr: IPv4Address | IPv6Address
    protocol_major: int = RDS_PROTOCOL_VERSION >> 8
    protocol_minor: int = RDS_PROTOCOL_VERSION & 0xFF
    protocol_minor_mask: int = RDS_IB_SUPPORTED_PROTOCOLS
    tos: int = 0
    reserved: int = 0
    frag_size: int = 0
    ack_seq: int = 0
    credit: int = 0

    def __post_init__(self) -> None:
        for name in ("saddr", "daddr"):
            value = getattr(self, name)
            if not isinstance(value, IPv4Address | IPv6Address):
                object.__setattr__(self, name, ip_address(value))
        if self.saddr.version != self.daddr.version:
            raise ValueError(f"saddr {self.saddr} and daddr {self.daddr} are of two families")

    @property
    def ipv6(self) -> bool:
        return self.saddr.version == 6

    @property
    def version(self) -> int:
        return protocol(self.protocol_major, self.protocol_minor)

    def encode(self, *, packed: bool = False) -> bytes:
        """The private data as 64-bit Linux sends it (32 bytes for IPv4, 56 for
        IPv6, the struct's tail padding zero), or without the padding (28 / 52,
        what a 32-bit kernel sends) when ``packed``. Raises ValueError for a field
        out of range."""
        _check_uint("protocol_major", self.protocol_major, 8)
        _check_uint("protocol_minor", self.protocol_minor, 8)
        _check_uint("protocol_minor_mask", self.protocol_minor_mask, 16)
        _check_uint("tos", self.tos, 8)
        _check_uint("reserved", self.reserved, 8)
        _check_uint("frag_size", self.frag_size, 16)
        _check_uint("ack_seq", self.ack_seq, 64)
        _check_uint("credit", self.credit, 32)
        layout = _PD_V6 if self.ipv6 else _PD_V4
        data = layout.pack(
            self.saddr.packed,
            self.daddr.packed,
            self.protocol_major,
            self.protocol_minor,
            self.protocol_minor_mask,
            self.tos,
            self.reserved,
            self.frag_size,
            self.ack_seq,
            self.credit,
        )
        if not packed:
            size = CONNECT_PRIVATE_V6_SIZE if self.ipv6 else CONNECT_PRIVATE_V4_SIZE
            data += bytes(size - len(data))
        if len(data) > IWARP_MAX_PRIVATE_DATA:  # pragma: no cover - 56 <= 252
            raise ValueError(f"{len(data)} bytes of private data exceed iWARP's limit")
        return data

    @classmethod
    def decode(cls, buf: bytes | bytearray | memoryview, *, ipv6: bool) -> ConnectPrivate:
        """The private data of a connection whose rdma_cm id is IPv6 (``ipv6``) or IPv4.

        Bytes after the fields (the struct's padding, InfiniBand CM's zero fill)
        are ignored. Raises :class:`RdsProtocolError` when ``buf`` is too short.
        """
        layout = _PD_V6 if ipv6 else _PD_V4
        if len(buf) < layout.size:
            raise RdsProtocolError(
                f"RDS {'IPv6' if ipv6 else 'IPv4'} connect private data of {len(buf)} bytes,"
                f" needs {layout.size}"
            )
        saddr, daddr, major, minor, mask, tos, reserved, frag, ack_seq, credit = layout.unpack_from(
            buf
        )
        addr = IPv6Address if ipv6 else IPv4Address
        return cls(
            saddr=addr(saddr),
            daddr=addr(daddr),
            protocol_major=major,
            protocol_minor=minor,
            protocol_minor_mask=mask,
            tos=tos,
            reserved=reserved,
            frag_size=frag,
            ack_seq=ack_seq,
            credit=credit,
        )


# ---------------------------------------------------------------------------------------
# Congestion map
# ---------------------------------------------------------------------------------------

_WORDS = struct.Struct(f"<{RDS_CONG_MAP_BYTES // 8}Q")


def _check_port(port: int) -> None:
    if not 0 <= port < RDS_CONG_MAP_BITS:
        raise ValueError(f"port {port} is outside 0..65535")


def _bits(words: tuple[int, ...]) -> Iterator[int]:
    for index, word in enumerate(words):
        base = index * 64
        while word:
            low = word & -word
            yield base + low.bit_length() - 1
            word ^= low


class CongestionMap:
    """Which ports of one address are congested: one bit per port.

    The wire image is 8 KiB with port ``p`` in bit ``p % 8`` (value ``1 << p % 8``)
    of byte ``p // 8``: Linux's little-endian bit numbering (``__set_bit_le`` on the
    map pages in ``rds_cong_set_bit``), the same as bit ``p % 64`` of the
    little-endian 64-bit word ``p // 64`` that the receive side compares word by
    word. It travels as the payload of a message with RdsFlag.CONG_BITMAP.

    Unlike the other values here a map is mutable: the receive path sets and
    clears bits as sockets' queues fill and drain, like Linux's map, rather than
    copying 8 KiB per change. :meth:`copy` takes a snapshot to :meth:`diff` against.
    """

    __slots__ = ("_bits",)

    def __init__(self, congested: Iterable[int] = ()) -> None:
        self._bits = bytearray(RDS_CONG_MAP_BYTES)
        for port in congested:
            self.set(port)

    def set(self, port: int) -> None:
        _check_port(port)
        self._bits[port >> 3] |= 1 << (port & 7)

    def clear(self, port: int) -> None:
        _check_port(port)
        self._bits[port >> 3] &= ~(1 << (port & 7)) & 0xFF

    @property
    def bits(self) -> bytearray:
        """The map's bytes themselves (its wire image), for C to read in place."""
        return self._bits

    def test(self, port: int) -> bool:
        if not 0 <= port < RDS_CONG_MAP_BITS:  # (_check_port inline: a test per message)
            _check_port(port)
        return bool(self._bits[port >> 3] & (1 << (port & 7)))

    def __contains__(self, port: object) -> bool:
        return isinstance(port, int) and 0 <= port < RDS_CONG_MAP_BITS and self.test(port)

    def __iter__(self) -> Iterator[int]:
        """The congested ports, in ascending order."""
        return _bits(_WORDS.unpack(self._bits))

    def __bool__(self) -> bool:
        return any(self._bits)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CongestionMap):
            return NotImplemented
        return self._bits == other._bits

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        ports = list(self)
        shown = ", ".join(map(str, ports[:8])) + (", ..." if len(ports) > 8 else "")
        return f"CongestionMap([{shown}])"

    def copy(self) -> CongestionMap:
        new = CongestionMap()
        new._bits[:] = self._bits
        return new

    def diff(self, other: CongestionMap) -> builtins.set[int]:
        """The ports whose bit differs between the two maps."""
        if self._bits == other._bits:
            return set()
        changed = int.from_bytes(self._bits, "little") ^ int.from_bytes(other._bits, "little")
        return set(_bits(_WORDS.unpack(changed.to_bytes(RDS_CONG_MAP_BYTES, "little"))))

    def encode(self) -> bytes:
        """The 8 KiB wire image."""
        return bytes(self._bits)

    @classmethod
    def decode(cls, buf: bytes | bytearray | memoryview) -> CongestionMap | None:
        """The map in the first 8 KiB of ``buf``, or None when it is shorter."""
        if len(buf) < RDS_CONG_MAP_BYTES:
            return None
        new = cls()
        new._bits[:] = buf[:RDS_CONG_MAP_BYTES]
        return new
