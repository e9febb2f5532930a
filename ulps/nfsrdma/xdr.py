"""XDR (RFC 4506): the encoding every ONC RPC message and NFS structure uses.

Pure functions over bytes: :class:`Packer` appends big-endian 4-byte-aligned
items to a buffer; :class:`Unpacker` reads them back from a memoryview and
raises :class:`XdrError` (never ``struct.error`` or ``IndexError``) for
anything short, misaligned, over a length bound or with non-zero padding, so
a caller can answer GARBAGE_ARGS. Variable-length items take a ``limit``: a
peer's length field is checked against it before anything is read or
allocated.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")

_U32 = struct.Struct(">I")
_I32 = struct.Struct(">i")
_U64 = struct.Struct(">Q")
_I64 = struct.Struct(">q")

MAX_LENGTH = 1 << 30
"""The bound of a variable-length item when the caller gives none."""


class XdrError(ValueError):
    """Bytes that are not the XDR encoding of what was asked for."""


def pad(n: int) -> int:
    """Bytes of zero padding after ``n`` bytes of opaque data."""
    return -n & 3


class Packer:
    """Appends XDR items to a ``bytearray`` (``data``, which may start with ``head``)."""

    __slots__ = ("data",)

    def __init__(self, head: bytes = b"") -> None:
        self.data = bytearray(head)

    def uint(self, value: int) -> None:
        """An unsigned 32-bit integer."""
        self.data += _U32.pack(value)

    def int32(self, value: int) -> None:
        """A signed 32-bit integer."""
        self.data += _I32.pack(value)

    def uhyper(self, value: int) -> None:
        """An unsigned 64-bit integer."""
        self.data += _U64.pack(value)

    def hyper(self, value: int) -> None:
        """A signed 64-bit integer."""
        self.data += _I64.pack(value)

    def boolean(self, value: bool) -> None:
        """A boolean (an enum of 0 and 1)."""
        self.data += _U32.pack(1 if value else 0)

    def fopaque(self, value: bytes | bytearray | memoryview, size: int) -> None:
        """Fixed-length opaque data of exactly ``size`` bytes, then its padding."""
        if len(value) != size:
            raise XdrError(f"fixed opaque of {len(value)} bytes, {size} expected")
        self.data += value
        self.data += bytes(pad(size))

    def opaque(self, value: bytes | bytearray | memoryview) -> None:
        """Variable-length opaque data: its length, the bytes, the padding."""
        n = len(value)
        self.data += _U32.pack(n)
        self.data += value
        self.data += bytes(pad(n))

    def string(self, value: str | bytes) -> None:
        """A string: opaque bytes (str is encoded as UTF-8, with surrogate escapes kept)."""
        self.opaque(value.encode("utf-8", "surrogateescape") if isinstance(value, str) else value)

    def array(self, items: Sequence[T], pack_item: Callable[[T], None]) -> None:
        """A variable-length array: its count, then each item."""
        self.uint(len(items))
        for item in items:
            pack_item(item)

    def optional(self, item: T | None, pack_item: Callable[[T], None]) -> None:
        """An optional item (``*type``): a boolean, then the item if present."""
        self.boolean(item is not None)
        if item is not None:
            pack_item(item)

    def getvalue(self) -> bytes:
        """What was packed."""
        return bytes(self.data)


class Unpacker:
    """Reads XDR items from ``data`` starting at ``pos``; :class:`XdrError` on bad input."""

    __slots__ = ("_view", "pos")

    def __init__(self, data: bytes | bytearray | memoryview, pos: int = 0) -> None:
        self._view = memoryview(data).cast("B")
        self.pos = pos

    def _take(self, n: int) -> memoryview:
        end = self.pos + n
        if n < 0 or end > len(self._view):
            raise XdrError(f"{n} bytes wanted at offset {self.pos}, {self.remaining()} left")
        chunk = self._view[self.pos : end]
        self.pos = end
        return chunk

    def remaining(self) -> int:
        """Bytes not read yet."""
        return len(self._view) - self.pos

    def uint(self) -> int:
        """An unsigned 32-bit integer."""
        pos = self.pos
        if pos + 4 > len(self._view):
            self._take(4)  # (raises)
        self.pos = pos + 4
        value: int = _U32.unpack_from(self._view, pos)[0]
        return value

    def fields(self, layout: struct.Struct) -> tuple[Any, ...]:
        """Fixed-size items read at once, as ``layout`` (big-endian) lays them out."""
        return layout.unpack(self._take(layout.size))

    def int32(self) -> int:
        """A signed 32-bit integer."""
        return int(_I32.unpack(self._take(4))[0])

    def uhyper(self) -> int:
        """An unsigned 64-bit integer."""
        return int(_U64.unpack(self._take(8))[0])

    def hyper(self) -> int:
        """A signed 64-bit integer."""
        return int(_I64.unpack(self._take(8))[0])

    def boolean(self) -> bool:
        """A boolean; any value but 0 and 1 is an error."""
        value = self.uint()
        if value > 1:
            raise XdrError(f"boolean {value}")
        return value == 1

    def _padding(self, n: int) -> None:
        if any(self._take(pad(n))):
            raise XdrError("non-zero XDR padding")

    def fopaque_view(self, size: int) -> memoryview:
        """Fixed-length opaque data as a view into the input (no copy)."""
        view, start = self._view, self.pos
        end = start + size
        padded = end + pad(size)
        if size < 0 or padded > len(view) or any(view[end:padded]):  # (_take and _padding
            data = self._take(size)  # say what is wrong)
            self._padding(size)
            return data
        self.pos = padded
        return view[start:end]

    def fopaque(self, size: int) -> bytes:
        """Fixed-length opaque data of ``size`` bytes."""
        return bytes(self.fopaque_view(size))

    def opaque_view(self, limit: int = MAX_LENGTH) -> memoryview:
        """Variable-length opaque data as a view into the input; longer than ``limit``: error."""
        n = self.uint()
        if n > limit:
            raise XdrError(f"opaque of {n} bytes, at most {limit} allowed")
        return self.fopaque_view(n)

    def opaque(self, limit: int = MAX_LENGTH) -> bytes:
        """Variable-length opaque data, at most ``limit`` bytes."""
        return bytes(self.opaque_view(limit))

    def string(self, limit: int = MAX_LENGTH) -> str:
        """A string of at most ``limit`` bytes, decoded as UTF-8 with surrogate escapes."""
        return self.opaque(limit).decode("utf-8", "surrogateescape")

    def array(self, unpack_item: Callable[[], T], limit: int = MAX_LENGTH) -> list[T]:
        """A variable-length array of at most ``limit`` items."""
        n = self.uint()
        if n > limit:
            raise XdrError(f"array of {n} items, at most {limit} allowed")
        if n > self.remaining() // 4:  # every item takes at least four bytes
            raise XdrError(f"array of {n} items in {self.remaining()} bytes")
        return [unpack_item() for _ in range(n)]

    def optional(self, unpack_item: Callable[[], T]) -> T | None:
        """An optional item (``*type``)."""
        return unpack_item() if self.boolean() else None

    def rest_view(self) -> memoryview:
        """Everything not read yet, as a view (for an embedded message)."""
        return self._take(self.remaining())

    def done(self) -> None:
        """Raise :class:`XdrError` if bytes are left over."""
        if self.remaining():
            raise XdrError(f"{self.remaining()} bytes left over")
