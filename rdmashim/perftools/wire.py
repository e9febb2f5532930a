"""perftest's out-of-band exchange, as pure codecs (sans-IO).

perftest (linux-rdma/perftest, 4.5 and later; tested against 4.5-0.17, which
calls itself "6.06" on the wire) talks to its peer before, between and after
the measurement. With ``-R`` every message is one RDMA Send on a separate
"comm" RC connection made with the rdma_cm on the test's port; the client
sends first and the server answers each message with one of the same size
(:func:`ctx_xchg_data` in perftest). The messages, in order:

1. the version string: 16 bytes, NUL padded (:data:`VERSION_SIZE`);
2. the cycle buffer (page size) and the cache line size: two messages of one
   big-endian ``int`` each; both sides take the larger;
3. the port MTU: two bytes, the ``enum ibv_mtu`` value as decimal text and a NUL
   (``"3\\0"`` for 1024); both sides take the smaller;
4. a number of "handshakes": each side's ``struct pingpong_dest`` (56 bytes,
   :class:`Dest`), its integers big-endian;
5. after a bandwidth test, the client's report (:class:`BwReport`): five
   messages of 8 bytes each, integers big-endian and IEEE doubles byte-swapped
   to big-endian.

For ``send_bw`` on iWARP (no RNR retry) the receiver returns credits by RDMA
Write of a 4-byte counter in its own (x86: little-endian) byte order
(:data:`CREDIT`).

Ours only: the version message carries :data:`TCP_TAG`, a raw TCP port and a
flag after its NUL, where perftest, which reads the version up to the NUL,
never looks; so an rdmashim peer is told apart from perftest in the first
exchange without changing a byte perftest reads (``--vs-tcp`` and the closing
order use it).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

VERSION = "6.06"
"""The perftest version we speak (4.5-0.17's exchange; it sends "6.06")."""
MIN_VERSION = 5.70
"""perftest refuses peers older than this (``check_version_compatibility``)."""
VERSION_SIZE = 16
"""``MAX_VERSION``: the version message is a 16-byte char array."""
INT = struct.Struct("!i")
"""The cycle buffer and cache line messages."""
MTU_SIZE = 2
"""The MTU message: one decimal digit and a NUL (perftest sends ``char[2]``)."""
U64 = struct.Struct("!Q")
F64 = struct.Struct("!d")
CREDIT = struct.Struct("<I")
"""A ``send_bw`` credit: the receiver's count of receives, RDMA-written in host (x86) order."""
MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}
"""``enum ibv_mtu`` to bytes."""
TCP_TAG = b"rdmashim"
"""After the version's NUL: this tag, then :data:`PEER` (our raw TCP port, 0 for none,
and whether we ask the peer for the raw TCP comparison of ``--vs-tcp``)."""
PEER = struct.Struct("!HB")


@dataclass(frozen=True)
class Peer:
    """What the version message says of the peer beyond perftest's version."""

    rdmashim: bool
    """Whether the peer is ``rdmashim perf`` (perftest puts nothing after the NUL)."""
    tcp_port: int | None = None
    """The raw TCP port an rdmashim server with ``--vs-tcp`` serves."""
    wants_tcp: bool = False
    """Whether an rdmashim client asks for the ``--vs-tcp`` comparison."""


class WireError(ValueError):
    """A message of the exchange that perftest would not have sent."""


def encode_version(
    version: str = VERSION, *, tcp_port: int = 0, wants_tcp: bool = False, tagged: bool = True
) -> bytes:
    """The version message: ASCII, NUL padded to 16 bytes; ours (``tagged``) carries
    :data:`TCP_TAG` and :data:`PEER` after the NUL (``tagged=False``: perftest's bytes)."""
    raw = version.encode("ascii") + b"\0"
    if tagged:
        raw += TCP_TAG + PEER.pack(tcp_port, int(wants_tcp))
    if len(raw) > VERSION_SIZE:
        raise ValueError(f"version {version!r} is too long")
    return raw.ljust(VERSION_SIZE, b"\0")


def decode_peer(data: bytes) -> Peer:
    """What an rdmashim peer put after its version (perftest puts nothing there)."""
    extra = data.split(b"\0", 1)[1] if b"\0" in data else b""
    if not extra.startswith(TCP_TAG) or len(extra) < len(TCP_TAG) + PEER.size:
        return Peer(rdmashim=False)
    port, wants = PEER.unpack_from(extra, len(TCP_TAG))
    return Peer(True, int(port) or None, bool(wants))


def decode_version(data: bytes) -> str:
    """The peer's version text (up to its first NUL)."""
    if len(data) != VERSION_SIZE:
        raise WireError(f"version message of {len(data)} bytes (perftest sends {VERSION_SIZE})")
    return data.split(b"\0", 1)[0].decode("ascii", "replace")


def version_number(text: str) -> float:
    """The leading number of a version string, as C's ``atof`` reads it (0.0 if none)."""
    end = 0
    while end < len(text) and (text[end].isdigit() or (text[end] == "." and "." not in text[:end])):
        end += 1
    try:
        return float(text[:end])
    except ValueError:
        return 0.0


def encode_int(value: int) -> bytes:
    """A cycle buffer or cache line message."""
    return INT.pack(value)


def decode_int(data: bytes) -> int:
    if len(data) != INT.size:
        raise WireError(f"integer message of {len(data)} bytes (perftest sends {INT.size})")
    return int(INT.unpack(data)[0])


def encode_mtu(mtu_enum: int) -> bytes:
    """The MTU message for ``enum ibv_mtu`` value ``mtu_enum`` (1..5)."""
    if mtu_enum not in MTU_BYTES:
        raise ValueError(f"no ibv_mtu {mtu_enum}")
    return str(mtu_enum).encode() + b"\0"


def decode_mtu(data: bytes) -> int:
    """The peer's ``enum ibv_mtu`` (0 if it sent none that perftest would accept)."""
    if len(data) != MTU_SIZE:
        raise WireError(f"MTU message of {len(data)} bytes (perftest sends {MTU_SIZE})")
    text = data.split(b"\0", 1)[0]
    value = int(text) if text.isdigit() else 0
    return value if value in MTU_BYTES else 0


_DEST = struct.Struct("!iiiiI4xQ16sIi")


@dataclass(frozen=True)
class Dest:
    """``struct pingpong_dest``: what each side tells the other about one QP.

    On iWARP, ``lid`` is 0 and ``gid`` the port GID (the MAC address in its first
    six bytes); ``qpn``/``psn`` are informational (the rdma_cm connected the QPs).
    ``rkey``/``vaddr`` name the buffer the peer may write to or read from (for
    ``send_bw`` on iWARP: the 4-byte credit counter). The four padding bytes after
    ``rkey`` are sent as zeros and ignored when read.
    """

    lid: int = 0
    out_reads: int = 0
    qpn: int = 0
    psn: int = 0
    rkey: int = 0
    vaddr: int = 0
    gid: bytes = bytes(16)
    srqn: int = 0
    gid_index: int = 0

    SIZE = _DEST.size

    def encode(self) -> bytes:
        return _DEST.pack(
            self.lid, self.out_reads, self.qpn, self.psn, self.rkey, self.vaddr,
            self.gid.ljust(16, b"\0")[:16], self.srqn, self.gid_index,
        )  # fmt: skip

    @classmethod
    def decode(cls, data: bytes) -> Dest:
        if len(data) != _DEST.size:
            raise WireError(f"pingpong_dest of {len(data)} bytes (perftest sends {_DEST.size})")
        return cls(*_DEST.unpack(data))


@dataclass(frozen=True)
class BwReport:
    """``struct bw_report_data`` as exchanged after a bandwidth test (5 messages)."""

    size: int
    iters: int
    bw_peak: float
    bw_avg: float
    msg_rate: float

    def encode(self) -> list[bytes]:
        """The five messages, in perftest's order."""
        return [
            U64.pack(self.size), U64.pack(self.iters),
            F64.pack(self.bw_peak), F64.pack(self.bw_avg), F64.pack(self.msg_rate),
        ]  # fmt: skip

    @classmethod
    def decode(cls, messages: list[bytes]) -> BwReport:
        if len(messages) != 5 or any(len(m) != 8 for m in messages):
            raise WireError("a bandwidth report is five 8-byte messages")
        size, iters = (int(U64.unpack(m)[0]) for m in messages[:2])
        peak, avg, rate = (float(F64.unpack(m)[0]) for m in messages[2:])
        return cls(size, iters, peak, avg, rate)


__all__ = [
    "CREDIT",
    "MIN_VERSION",
    "MTU_BYTES",
    "MTU_SIZE",
    "PEER",
    "TCP_TAG",
    "VERSION",
    "VERSION_SIZE",
    "BwReport",
    "Dest",
    "Peer",
    "WireError",
    "decode_int",
    "decode_mtu",
    "decode_peer",
    "decode_version",
    "encode_int",
    "encode_mtu",
    "encode_version",
    "version_number",
]
