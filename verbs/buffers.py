"""Pinning Python buffers: the real address and a byte view of any buffer-protocol object.

Registering memory never copies it: cffi's ``from_buffer`` exports the object's
buffer (so a ``bytearray`` cannot be resized while registered) and gives the
address the rdma-core backend hands to the kernel. The built-in engine uses the
same addresses, so SGEs and remote addresses mean the same on every backend.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import cffi

from rdmashim.verbs.errors import VerbsError
from rdmashim.verbs.wr import SGE

_ffi = cffi.FFI()


@dataclass(eq=False, slots=True)
class PinnedBuffer:
    """A buffer held in place: ``view`` is a flat byte view starting at ``addr``."""

    addr: int
    length: int
    view: memoryview
    _cdata: Any

    def release(self) -> None:
        """Let the buffer move again (idempotent)."""
        if self._cdata is not None:
            _ffi.release(self._cdata)
            self._cdata = None
            self.view.release()


def pin(obj: Any, *, writable: bool, operation: str = "reg_mr") -> PinnedBuffer:
    """Pin ``obj`` (bytes, bytearray, memoryview, mmap, array, numpy array, ...)."""
    try:
        view = memoryview(obj)
    except TypeError as exc:
        raise VerbsError(errno.EINVAL, operation, f"{type(obj).__name__} is not a buffer") from exc
    if not view.c_contiguous:
        raise VerbsError(errno.EINVAL, operation, "buffer is not contiguous")
    if writable and view.readonly:
        raise VerbsError(errno.EACCES, operation, "write access requested on a read-only buffer")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    cdata = _ffi.from_buffer("char[]", view, require_writable=writable)
    addr = int(_ffi.cast("uintptr_t", cdata))
    return PinnedBuffer(addr, view.nbytes, view, cdata)


def address_of(obj: Any) -> int:
    """The address of the first byte of a buffer-protocol object (without pinning it)."""
    pinned = pin(obj, writable=False, operation="address_of")
    try:
        return pinned.addr
    finally:
        pinned.release()


class PinnedRegion:
    """What a memory region of any backend offers over its pinned buffer.

    A backend's MR sets ``_pinned`` and provides ``iova``, ``lkey`` and
    ``_check_open``; this gives it ``addr``, ``length``, ``buf`` and ``sge()``.
    """

    _pinned: PinnedBuffer
    iova: int
    lkey: int
    _check_open: Callable[[str], None]

    @property
    def addr(self) -> int:
        """Address of the first byte."""
        return self._pinned.addr

    @property
    def length(self) -> int:
        """Length in bytes."""
        return self._pinned.length

    @property
    def buf(self) -> memoryview:
        """A byte view of the registered memory."""
        self._check_open("buf")
        return self._pinned.view

    def sge(self, offset: int = 0, length: int | None = None) -> SGE:
        """An SGE over ``[offset, offset + length)`` of this region."""
        if length is None:
            length = self.length - offset
        if offset < 0 or length < 0 or offset + length > self.length:
            raise ValueError(f"[{offset}, +{length}) outside the {self.length}-byte region")
        return SGE(self.iova + offset, length, self.lkey)
