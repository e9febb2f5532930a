"""RPC record marking (RFC 5531 §11): how RPC messages are framed on a TCP stream.

A record (one RPC message) is sent as one or more fragments, each behind a
four-byte big-endian header: the top bit says "last fragment of the record",
the other 31 bits are the fragment's length. :class:`RecordDecoder` is
sans-IO: fed the bytes a stream delivered, it returns the records completed
so far, and raises :class:`RecordTooLarge` as soon as a fragment header
announces a record over its bound (before any of those bytes arrive), which a
transport answers by closing the connection. :func:`record_marks` frames a
message for sending.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

_HEADER = struct.Struct(">I")
LAST_FRAGMENT = 0x8000_0000
"""The header bit of a record's last fragment."""
MAX_FRAGMENT = LAST_FRAGMENT - 1
"""The longest fragment a header can announce."""

DEFAULT_MAX_RECORD = 4 << 20
"""The default bound of a record: room for an NFS READ or WRITE of 1 MiB and more."""


class RecordTooLarge(ValueError):
    """A fragment header announced a record longer than the decoder's bound."""


class RecordDecoder:
    """Reassembles the records of one stream from the bytes it delivers."""

    def __init__(self, max_record: int = DEFAULT_MAX_RECORD) -> None:
        self.max_record = max_record
        self._head = bytearray()  # a fragment header's bytes so far (fewer than 4)
        self._record = bytearray()  # the fragments of the current record so far
        self._fragment_left: int | None = None  # bytes of the current fragment still due
        self._last = False
        self._started = False  # a fragment header of the current record has been read
        self.pending = False
        """Whether part of a record has arrived (its header at least) and not all of it."""

    def feed(self, data: bytes | bytearray | memoryview) -> list[bytearray | memoryview]:
        """Take in ``data``; returns the records it completed, in order. Each byte of a
        record is copied once, from ``data`` into the record, but for the usual case of
        ``data`` that is one whole record of one fragment and nothing before it: that
        record is a view of ``data`` (which the caller then leaves as it is)."""
        view = memoryview(data).cast("B")
        at, end = 0, len(view)
        if self._fragment_left is None and not self._head and not self._started and end >= 4:
            (word,) = _HEADER.unpack_from(view)
            if word == LAST_FRAGMENT | (end - 4) and end - 4 <= self.max_record:
                return [view[4:]]
        records: list[bytearray | memoryview] = []
        while True:
            if self._fragment_left is None:
                head = self._head
                taken = min(4 - len(head), end - at)
                head += view[at : at + taken]
                at += taken
                if len(head) < 4:
                    self.pending = self._started or bool(head)
                    return records
                (word,) = _HEADER.unpack(head)
                head.clear()
                length = word & MAX_FRAGMENT
                if len(self._record) + length > self.max_record:
                    raise RecordTooLarge(
                        f"fragment of {length} bytes after {len(self._record)}:"
                        f" record over {self.max_record} bytes"
                    )
                self._fragment_left = length
                self._started = True
                self._last = bool(word & LAST_FRAGMENT)
            take = min(self._fragment_left, end - at)
            self._record += view[at : at + take]
            at += take
            self._fragment_left -= take
            if self._fragment_left:
                self.pending = True
                return records
            self._fragment_left = None
            if self._last:
                records.append(self._record)
                self._record = bytearray()
                self._started = False


def record_marks(
    buffers: Sequence[bytes | bytearray | memoryview], max_fragment: int = MAX_FRAGMENT
) -> list[bytes | bytearray | memoryview]:
    """``buffers`` (one message) as a record: fragment headers and data, to send in order.

    Fragments are at most ``max_fragment`` bytes; an empty message is one
    empty last fragment.
    """
    if not 0 < max_fragment <= MAX_FRAGMENT:
        raise ValueError(f"fragment size {max_fragment}")
    total = sum(map(len, buffers))
    if total <= max_fragment:
        return [_HEADER.pack(LAST_FRAGMENT | total), *buffers]
    data = memoryview(b"".join(buffers))
    out: list[bytes | bytearray | memoryview] = []
    for start in range(0, total, max_fragment):
        chunk = data[start : start + max_fragment]
        last = LAST_FRAGMENT if start + max_fragment >= total else 0
        out += [_HEADER.pack(last | len(chunk)), chunk]
    return out
