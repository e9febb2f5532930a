"""Pinning Python buffers: the real address and a byte view of any buffer-protocol object.

Registering memory never copies it: CPython's ``PyObject_GetBuffer`` (the
buffer protocol's C call, reached through ctypes, so the base install needs no
cffi) exports the object's buffer, so a ``bytearray`` cannot be resized while
registered, and gives the address the rdma-core backend hands to the kernel.
The built-in engine uses the same addresses, so SGEs and remote addresses mean
the same on every backend.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rdmashim.verbs.errors import VerbsError
from rdmashim.verbs.wr import SGE

if TYPE_CHECKING:
    from typing_extensions import Buffer

log = logging.getLogger(__name__)

IOV_MAX = os.sysconf("SC_IOV_MAX")
"""The most buffers one ``writev`` or ``sendmsg`` takes."""


def advance(
    bufs: list[bytes | bytearray | memoryview], n: int
) -> list[bytes | bytearray | memoryview]:
    """Drop the first ``n`` bytes of a list of byte buffers (bytes, or byte-format views:
    what a ``writev`` of them took): ``bufs`` itself when nothing goes, else a new list
    whose first buffer, if it went in part, is a view of its rest."""
    i = 0
    count = len(bufs)
    while i < count:
        size = len(bufs[i])
        if n < size:
            break
        n -= size
        i += 1
    rest = bufs[i:] if i else bufs
    if n:
        rest = rest.copy() if rest is bufs else rest
        rest[0] = memoryview(rest[0])[n:]
    return rest


PYBUF_SIMPLE = 0
PYBUF_WRITABLE = 0x0001


class _PyBuffer(ctypes.Structure):
    """CPython's ``Py_buffer`` (in the stable ABI since 3.11)."""

    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_void_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_get_buffer.restype = ctypes.c_int
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = [ctypes.POINTER(_PyBuffer)]
_release_buffer.restype = None


@dataclass(eq=False, slots=True)
class PinnedBuffer:
    """A buffer held in place: ``view`` is a flat byte view starting at ``addr``."""

    addr: int
    length: int
    view: memoryview
    _export: _PyBuffer | None

    def release(self) -> None:
        """Let the buffer move again (idempotent); never raises.

        The view is released too unless somebody still holds a buffer of it (the
        user's own ``numpy.frombuffer(mr.buf)``, say): that view then lives until its
        last holder lets go, as any memoryview does, but no longer pins the buffer
        for the registration."""
        if self._export is not None:
            _release_buffer(ctypes.byref(self._export))
            self._export = None
            try:
                self.view.release()
            except BufferError:
                log.debug("a view of a released buffer is still exported; it stays")


def pin(obj: Buffer, *, writable: bool, operation: str = "reg_mr") -> PinnedBuffer:
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
    export = _PyBuffer()
    # Raises (BufferError, TypeError) when the object will not export as asked.
    _get_buffer(view, ctypes.byref(export), PYBUF_WRITABLE if writable else PYBUF_SIMPLE)
    return PinnedBuffer(export.buf or 0, view.nbytes, view, export)


def address_of(obj: Buffer) -> int:
    """The address of the first byte of a buffer-protocol object (without pinning it)."""
    pinned = pin(obj, writable=False, operation="address_of")
    try:
        return pinned.addr
    finally:
        pinned.release()


class PinnedRegion(ABC):
    """What a memory region of any backend offers over its pinned buffer.

    A backend's MR sets ``_pinned`` and provides ``iova``, ``lkey`` and
    ``_check_open``; this gives it ``addr``, ``length``, ``buf`` and ``sge()``.
    """

    _pinned: PinnedBuffer
    _check_open: Callable[[str], None]

    @property
    @abstractmethod
    def iova(self) -> int:
        """The address of the first byte for work requests and the peer."""

    @property
    @abstractmethod
    def lkey(self) -> int:
        """Local key."""

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
