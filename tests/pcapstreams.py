"""Read TCP byte streams out of a pcap (Ethernet, IPv4/IPv6), for tests on recorded traffic."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

_GLOBAL = struct.Struct("<IHHiIII")
_RECORD = struct.Struct("<IIII")


@dataclass
class Stream:
    """The bytes one side of a TCP connection sent, in sequence order, retransmissions dropped.

    Segments are kept by their offset from the stream's start (the SYN's sequence
    number + 1, else the first segment's), modulo 2**32, so a stream whose
    sequence numbers wrap stays in order. ``gap`` is where the capture lost
    bytes (tcpdump dropped packets): :meth:`data` ends there, and ``gap_frame``
    is the capture's frame number (1-based, as tshark counts) of the first
    segment after the loss.
    """

    src: tuple[str, int]
    dst: tuple[str, int]
    first: float
    base: int | None = None
    _segments: dict[int, tuple[bytes, int]] = field(default_factory=dict)
    gap: int | None = None
    gap_frame: int | None = None

    def add(self, seq: int, payload: bytes, frame: int = 0) -> None:
        """A segment with sequence number ``seq``, in the capture's frame ``frame``."""
        if self.base is None:
            self.base = seq
        offset = (seq - self.base) & 0xFFFFFFFF
        if offset < 1 << 31:  # not data from before the start (a reordered retransmission)
            self._segments.setdefault(offset, (payload, frame))

    def frame_at(self, offset: int) -> int:
        """The frame that carried the stream's byte at ``offset`` (captured: before
        :attr:`gap`)."""
        return max((o, f) for o, (_, f) in self._segments.items() if o <= offset)[1]

    def data(self) -> bytes:
        out = bytearray()
        self.gap = self.gap_frame = None
        for off in sorted(self._segments):
            chunk, _ = self._segments[off]
            if off > len(out):
                self.gap = len(out)
                self.gap_frame = min(f for o, (_, f) in self._segments.items() if o >= off)
                break
            if off + len(chunk) > len(out):
                out[off:] = chunk
        return bytes(out)


def tcp_streams(path: Path) -> list[Stream]:
    """Every directed TCP stream with payload in ``path``, by time of its first segment."""
    raw = path.read_bytes()
    magic, *_, link = _GLOBAL.unpack_from(raw)
    if magic != 0xA1B2C3D4 or link != 1:
        raise ValueError(f"{path}: not a little-endian Ethernet pcap")
    pos = _GLOBAL.size
    streams: dict[tuple, Stream] = {}
    number = 0
    while pos + _RECORD.size <= len(raw):
        number += 1
        sec, usec, caplen, _ = _RECORD.unpack_from(raw, pos)
        frame = raw[pos + _RECORD.size : pos + _RECORD.size + caplen]
        pos += _RECORD.size + caplen
        ethertype = struct.unpack_from("!H", frame, 12)[0]
        if ethertype == 0x0800:
            ip = frame[14:]
            ihl = (ip[0] & 0x0F) * 4
            total = struct.unpack_from("!H", ip, 2)[0]
            if ip[9] != 6:
                continue
            src = ".".join(map(str, ip[12:16]))
            dst = ".".join(map(str, ip[16:20]))
            tcp = ip[ihl:total]
        elif ethertype == 0x86DD:
            ip = frame[14:]
            if ip[6] != 6:
                continue
            plen = struct.unpack_from("!H", ip, 4)[0]
            src, dst = ip[8:24].hex(), ip[24:40].hex()
            tcp = ip[40 : 40 + plen]
        else:
            continue
        sport, dport, seq = struct.unpack_from("!HHI", tcp)
        payload = tcp[(tcp[12] >> 4) * 4 :]
        syn = tcp[13] & 0x02
        if not (payload or syn):
            continue
        key = ((src, sport), (dst, dport))
        stream = streams.setdefault(key, Stream(key[0], key[1], sec + usec / 1e6))
        if syn:
            stream.base = (seq + 1) & 0xFFFFFFFF
        elif payload:
            stream.add(seq, payload, number)
    return sorted(streams.values(), key=lambda s: s.first)
