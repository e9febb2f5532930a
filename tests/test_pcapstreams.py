"""``tests/pcapstreams.py``: TCP streams rebuilt from a capture, sequence wrap and lost bytes."""

from __future__ import annotations

import struct
from pathlib import Path

from pcapstreams import tcp_streams

A, B = bytes([10, 0, 0, 1]), bytes([10, 0, 0, 2])


def frame(seq: int, payload: bytes = b"", syn: bool = False) -> bytes:
    """An Ethernet/IPv4/TCP frame from A:1000 to B:2000."""
    tcp = struct.pack("!HHIIBBHHH", 1000, 2000, seq, 0, 5 << 4, 0x02 if syn else 0x18, 65535, 0, 0)
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(tcp) + len(payload), 0, 0, 64, 6, 0, A, B)
    return bytes(12) + b"\x08\x00" + ip + tcp + payload


def pcap(path: Path, frames: list[bytes]) -> Path:
    out = struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 65535, 1)
    for i, f in enumerate(frames):
        out += struct.pack("<IIII", i, 0, len(f), len(f)) + f
    path.write_bytes(out)
    return path


def test_a_stream_whose_sequence_numbers_wrap_stays_in_order(tmp_path: Path) -> None:
    isn = 0xFFFF_FFF0
    frames = [frame(isn, syn=True), frame(isn + 1, b"a" * 10)]
    frames += [frame((isn + 11) & 0xFFFF_FFFF, b"b" * 10), frame(isn + 1, b"a" * 10)]  # a resend
    (stream,) = tcp_streams(pcap(tmp_path / "wrap.pcap", frames))
    assert stream.data() == b"a" * 10 + b"b" * 10 and stream.gap is None


def test_lost_bytes_end_the_stream_where_they_were_lost(tmp_path: Path) -> None:
    frames = [frame(100, b"x" * 5), frame(105, b"y" * 5), frame(120, b"z" * 5)]  # 110..119 lost
    (stream,) = tcp_streams(pcap(tmp_path / "gap.pcap", frames))
    assert stream.data() == b"x" * 5 + b"y" * 5 and stream.gap == 10
    assert stream.gap_frame == 3  # the frame after the loss, counted as tshark counts
    assert stream.frame_at(7) == 2 and stream.frame_at(0) == 1  # (what carried a byte)
