"""Work requests in the native engine's C layout: checked as ``post_send`` and
``post_recv`` check them, packed with :mod:`struct` into ``rs_send_wr[]`` and
``rs_recv_wr[]``.

Packing costs a ``pack_into`` per request (about half a microsecond), where filling
cffi structs field by field cost about 20 µs (``benchmarks/engine_core.py``). A
prepared batch (:class:`~rdmashim.verbs.wr.SendBatch`, ``RecvBatch``) keeps each
entry packed, so a post of it copies bytes and checks only what may have changed
since (a region closed, the queue's room).

The checks are those of the Python provider, in its order, with its messages: the
QP's state, ``wr_id``, the opcode, the SGE limit, the queue's room, the request's
own fields, inline length, and SGEs naming no registered region. Inline bytes given
as ``bytes`` are marked ``RS_INLINE_RAW`` with their process address, which only this
module sets; an inline SGE is copied by the C side from its region.
"""

from __future__ import annotations

import errno
import struct
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from rdmashim.verbs.enums import SendFlags, WROpcode
from rdmashim.verbs.errors import NotSupported, VerbsError, refused_wr
from rdmashim.verbs.softiwarp.memory import MemoryTable
from rdmashim.verbs.softiwarp.native import MAX_SGE, ffi, lib
from rdmashim.verbs.wr import SGE, RecvWR, SendWR, recv_problem, send_problem, wr_id_problem

_HEAD = struct.Struct("<QIIQIII4x")
"""``rs_send_wr`` up to its ``sg_list``: wr_id, opcode, flags, remote_addr, rkey,
invalidate_rkey, num_sge."""
_RECV_HEAD = struct.Struct("<QI4x")
_SGE = struct.Struct("<QII")
SEND_SIZE = _HEAD.size + MAX_SGE * _SGE.size
RECV_SIZE = _RECV_HEAD.size + MAX_SGE * _SGE.size
if lib is not None:  # the layout cffi compiled must be the one packed here
    assert ffi.sizeof("rs_send_wr") == SEND_SIZE and ffi.sizeof("rs_recv_wr") == RECV_SIZE
    assert ffi.offsetof("rs_send_wr", "sg_list") == _HEAD.size
    assert ffi.offsetof("rs_recv_wr", "sg_list") == _RECV_HEAD.size

_U32 = 0xFFFFFFFF
_U64 = 0xFFFFFFFFFFFFFFFF
_INLINE = int(SendFlags.INLINE)
_RAW = 16  # RS_INLINE_RAW
_FLAGS = int(SendFlags.FENCE | SendFlags.SIGNALED | SendFlags.SOLICITED | SendFlags.INLINE)
_SUPPORTED = frozenset(
    {WROpcode.SEND, WROpcode.SEND_WITH_INV, WROpcode.RDMA_WRITE, WROpcode.RDMA_READ}
)
_WIRE_LIMITS = (
    "length, rkey, invalidate_rkey or remote_addr + length do not fit the wire "
    "(32, 32, 32 and 64 bits)"
)


def unregistered(sges: Sequence[SGE], memory: MemoryTable) -> str | None:
    """Why a request cannot be posted when one of its SGEs names no registered region."""
    for s in sges:
        if s.length and memory.lookup(s.lkey) is None:
            return f"{s}: lkey {s.lkey:#x} names no registered memory region (was its MR closed?)"
    return None


class _Packed:
    """One send request in C layout, with what its post still checks."""

    __slots__ = ("data", "invalid", "length", "nsge", "opcode", "raw", "sges", "unsupported")

    def __init__(self, w: SendWR) -> None:
        self.data = b""
        self.raw: tuple[SGE | bytes | bytearray | memoryview, ...] | None = None
        """An inline list holding raw bytes: every part, packed when posted (:meth:`now`)."""
        self.sges: tuple[SGE, ...] = ()
        """The SGEs of registered memory the post checks (none for raw inline bytes)."""
        self.length = 0
        self.nsge = len(w.sg_list)
        opcode = w.opcode
        self.opcode = opcode
        self.unsupported = (
            None if opcode in _SUPPORTED else f"{opcode.name} is not an iWARP operation"
        )
        self.invalid: str | None = send_problem(w)
        if self.unsupported or self.invalid or self.nsge > MAX_SGE:
            return
        flags = int(w.send_flags) & _FLAGS
        parts = tuple(w.sg_list)
        inline = bool(flags & _INLINE) and opcode is not WROpcode.RDMA_READ
        sges = [p for p in parts if isinstance(p, SGE)]
        if len(sges) != len(parts):
            if not inline:
                self.invalid = "raw bytes need INLINE"
                return
            flags |= _RAW
        self.sges = tuple(sges)
        length = sum(len(p) if not isinstance(p, SGE) else p.length for p in parts)
        self.length = length
        rkey, inv, raddr = w.rkey, w.invalidate_rkey, w.remote_addr
        if not (
            length <= _U32 and 0 <= rkey <= _U32 and 0 <= inv <= _U32
            and 0 <= raddr <= _U64 + 1 - max(length, 1)
        ):  # fmt: skip
            self.invalid = _WIRE_LIMITS
            return
        if opcode is not WROpcode.SEND_WITH_INV:
            inv = 0
        out = bytearray(SEND_SIZE)
        _HEAD.pack_into(out, 0, w.wr_id & _U64, int(opcode), flags, raddr, rkey, inv, len(parts))
        for k, p in enumerate(self.sges):
            _SGE.pack_into(out, _HEAD.size + k * _SGE.size, p.addr, p.length, p.lkey)
        self.data = bytes(out)
        if flags & _RAW:
            self.raw = parts

    def now(self, keep: list[Any], memory: MemoryTable) -> bytes:
        """The request as C takes it now: raw inline bytes get their addresses, valid
        while ``keep`` holds them (the post's call; a bytearray may change, or move,
        between posts). An SGE among raw bytes is copied from its region here (checked
        by the post before)."""
        if self.raw is None:
            return self.data
        out = bytearray(self.data)
        for k, p in enumerate(self.raw):
            if isinstance(p, SGE):
                region = memory.lookup(p.lkey)
                assert region is not None
                start = p.addr - region.addr
                p = region.view[start : start + p.length].tobytes()
            buf = ffi.from_buffer(p)
            keep.append(buf)
            _SGE.pack_into(
                out, _HEAD.size + k * _SGE.size, int(ffi.cast("uintptr_t", buf)), len(p), 0
            )
        return bytes(out)


def _refuse(
    i: int, p: _Packed, wr: SendWR, limit: int, room: int, max_wr: int, max_inline: int,
    memory: MemoryTable, inline_sges: bool,
) -> VerbsError | None:  # fmt: skip
    """The error of request ``i`` of a post, if it is refused (the Python provider's order)."""
    if not 0 <= wr.wr_id <= _U64:
        return refused_wr(errno.EINVAL, "post_send", i, wr_id_problem(wr.wr_id) or "")
    if p.unsupported:
        return NotSupported("post_send", f"work request {i}: {p.unsupported}")
    most = 1 if p.opcode is WROpcode.RDMA_READ else limit
    if p.nsge > most:
        return refused_wr(errno.EINVAL, "post_send", i, f"{p.nsge} SGEs > {most}")
    if i >= room:
        return refused_wr(errno.ENOMEM, "post_send", i, f"send queue full ({max_wr})")
    if p.invalid:
        return refused_wr(errno.EINVAL, "post_send", i, p.invalid)
    if inline_sges:
        if p.length > max_inline:
            return refused_wr(
                errno.EINVAL, "post_send", i, f"{p.length} inline bytes > {max_inline}"
            )
        for s in p.sges:
            region = memory.lookup(s.lkey)
            if region is None or not 0 <= s.addr - region.addr <= region.length - s.length:
                return refused_wr(errno.EINVAL, "post_send", i, f"inline SGE {s} outside a region")
        return None
    problem = unregistered(p.sges, memory)
    return refused_wr(errno.EINVAL, "post_send", i, problem) if problem else None


class SendPlan:
    """The packed form of a list of send requests (one post), or of a batch's entries
    (:meth:`~rdmashim.verbs.wr.SendBatch.prepared`: kept and posted again)."""

    def __init__(self, n: int) -> None:
        self.packed: list[_Packed | None] = [None] * n

    def set(self, i: int, wr: SendWR) -> None:
        """Pack entry ``i`` from ``wr`` (again, after it changed)."""
        self.packed[i] = _Packed(wr)

    def post(
        self, wrs: Sequence[SendWR], entries: Sequence[int], room: int, max_wr: int,
        limit: int, max_inline: int, memory: MemoryTable, submit: Callable[[Any, int], int],
    ) -> VerbsError | None:  # fmt: skip
        """Post ``entries`` (``wrs[k]`` is entry ``entries[k]``'s request) through
        ``submit(array, n)``, which returns how many C took. The error of the first
        refused, if any (those before it are posted)."""
        chosen: list[bytes] = []
        keep: list[Any] = []
        refused: VerbsError | None = None
        packed = self.packed
        for k, i in enumerate(entries):
            p = packed[i]
            assert p is not None
            flags = int(wrs[k].send_flags)
            inline = bool(flags & _INLINE) and p.opcode is not WROpcode.RDMA_READ
            refused = _refuse(k, p, wrs[k], limit, room, max_wr, max_inline, memory, inline)
            if refused is not None:
                break
            chosen.append(p.now(keep, memory))
        if chosen:
            blob = chosen[0] if len(chosen) == 1 else b"".join(chosen)
            taken = submit(ffi.from_buffer("rs_send_wr[]", blob), len(chosen))
            if taken < len(chosen):  # C refused one the checks above passed: its reason
                return refused_wr(errno.EINVAL, "post_send", taken, "refused by the engine")
        return refused


class RecvPlan:
    """The packed form of receive requests (one post, or a batch's entries kept)."""

    def __init__(self, n: int) -> None:
        self.data: list[bytes] = [b""] * n
        self.sges: list[tuple[SGE, ...]] = [()] * n
        self.refused: dict[int, str] = {}

    def set(self, i: int, wr: RecvWR) -> None:
        """Pack entry ``i`` from ``wr``."""
        problem = recv_problem(wr)
        sges = tuple(wr.sg_list)
        if problem or len(sges) > MAX_SGE:
            self.refused[i] = problem or f"{len(sges)} SGEs > {MAX_SGE}"
            return
        self.refused.pop(i, None)
        out = bytearray(RECV_SIZE)
        _RECV_HEAD.pack_into(out, 0, wr.wr_id, len(sges))
        for k, s in enumerate(sges):
            _SGE.pack_into(out, _RECV_HEAD.size + k * _SGE.size, s.addr, s.length, s.lkey)
        self.data[i] = bytes(out)
        self.sges[i] = sges

    def post(
        self, operation: str, entries: Sequence[int], max_sge: int, name: str, max_wr: int,
        memory: MemoryTable, submit: Callable[[Any, int], int],
    ) -> VerbsError | None:  # fmt: skip
        """Post ``entries`` through ``submit(array, n)`` (how many C took: the rest found
        the queue full); the error of the first refused, if any."""
        chosen: list[bytes] = []
        refused: VerbsError | None = None
        for k, i in enumerate(entries):
            if i in self.refused:
                refused = refused_wr(errno.EINVAL, operation, k, self.refused[i])
                break
            sges = self.sges[i]
            if len(sges) > max_sge:
                refused = refused_wr(errno.EINVAL, operation, k, f"{len(sges)} SGEs > {max_sge}")
                break
            if problem := unregistered(sges, memory):
                refused = refused_wr(errno.EINVAL, operation, k, problem)
                break
            chosen.append(self.data[i])
        if chosen:
            taken = submit(ffi.from_buffer("rs_recv_wr[]", b"".join(chosen)), len(chosen))
            if taken < len(chosen):
                return refused_wr(errno.ENOMEM, operation, taken, f"{name} full ({max_wr})")
        return refused


_Plan = TypeVar("_Plan", SendPlan, RecvPlan)


def plan_of(kind: type[_Plan], wrs: Sequence[Any]) -> _Plan:
    """The packed form (``SendPlan`` or ``RecvPlan``) of one post's list."""
    plan = kind(len(wrs))
    for i, w in enumerate(wrs):
        plan.set(i, w)
    return plan
