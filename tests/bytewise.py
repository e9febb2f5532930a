"""h11's ``tr()`` for our decoders: whole input, one byte at a time, trailing data."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

TRAILING = b"\x00\x22\x41\x43 trailing FPDU bytes, PAD and CRC"


def tr(decode: Callable[[Any], tuple[Any, int] | None], data: bytes, expected: Any) -> None:
    """Run ``decode`` on the whole input, fed one byte at a time (None until the last
    byte), and with trailing data (which the consumed count must leave alone), over
    bytes, bytearray and memoryview buffers."""
    assert decode(data) == (expected, len(data))
    buf = bytearray()
    for i, byte in enumerate(data):
        assert decode(buf) is None, f"complete after {i} of {len(data)} bytes"
        assert decode(memoryview(bytes(buf))) is None
        buf.append(byte)
    assert decode(buf) == (expected, len(data))
    for trailing in (b"\0", TRAILING, data):
        assert decode(data + trailing) == (expected, len(data))
        assert decode(bytearray(data + trailing)) == (expected, len(data))
        assert decode(memoryview(data + trailing)) == (expected, len(data))
    # a view into the middle of a larger buffer
    big = b"xyz" + data + TRAILING
    assert decode(memoryview(big)[3:]) == (expected, len(data))
