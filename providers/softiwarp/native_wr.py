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
from array import array
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from rdmashim.providers.softiwarp.memory import MemoryTable
from rdmashim.providers.softiwarp.native import MAX_SGE, ffi, lib
from rdmashim.providers.softiwarp.posting import unregistered
from rdmashim.verbs.enums import SendFlags, WROpcode
from rdmashim.verbs.errors import NotSupported, VerbsError, refused_wr
from rdmashim.verbs.wr import SGE, RecvWR, SendWR, recv_problem, send_problem, wr_id_problem

_FIRST = range(1)
"""The entries of a post of one request."""
SHORT = 4
"""Lists of at most this many entries posted together are noted as one entry alone is
(:attr:`_Plan.singles`)."""
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
_QP_RECV: tuple[Any, Any] = (
    (lib.rs_qp_post_recv, lib.rs_qp_post_recv_at) if lib is not None else (None, None)
)
"""C's receive posts to a QP (all entries, at indices), bound once."""
_RAW = 16  # RS_INLINE_RAW
_FLAGS = int(SendFlags.FENCE | SendFlags.SIGNALED | SendFlags.SOLICITED | SendFlags.INLINE)
_SUPPORTED = frozenset(
    {WROpcode.SEND, WROpcode.SEND_WITH_INV, WROpcode.RDMA_WRITE, WROpcode.RDMA_READ}
)
_WIRE_LIMITS = (
    "length, rkey, invalidate_rkey or remote_addr + length do not fit the wire "
    "(32, 32, 32 and 64 bits)"
)


class _Packed:
    """One send request in C layout, with what its post still checks."""

    __slots__ = (
        "data", "inline", "invalid", "length", "nsge", "opcode", "raw", "sges", "unsupported",
        "wr_id", "wr_id_ok",
    )  # fmt: skip

    def __init__(self, w: SendWR) -> None:
        self.data = b""
        self.wr_id = w.wr_id
        self.wr_id_ok = isinstance(w.wr_id, int) and 0 <= w.wr_id <= _U64
        self.inline = False
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
        self.inline = inline = bool(flags & _INLINE) and opcode is not WROpcode.RDMA_READ
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
        _HEAD.pack_into(
            out,
            0,
            w.wr_id & _U64 if self.wr_id_ok else 0,
            int(opcode),
            flags,
            raddr,
            rkey,
            inv,
            len(parts),
        )
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
    i: int, p: _Packed, limit: int, room: int, max_wr: int, max_inline: int,
    memory: MemoryTable,
) -> VerbsError | None:  # fmt: skip
    """The error of request ``i`` of a post, if it is refused (the Python provider's order)."""
    if not p.wr_id_ok:
        return refused_wr(errno.EINVAL, "post_send", i, wr_id_problem(p.wr_id) or "")
    if p.unsupported:
        return NotSupported("post_send", f"work request {i}: {p.unsupported}")
    most = 1 if p.opcode is WROpcode.RDMA_READ else limit
    if p.nsge > most:
        return refused_wr(errno.EINVAL, "post_send", i, f"{p.nsge} SGEs > {most}")
    if i >= room:
        return refused_wr(errno.ENOMEM, "post_send", i, f"send queue full ({max_wr})")
    if p.invalid:
        return refused_wr(errno.EINVAL, "post_send", i, p.invalid)
    if p.inline:
        if p.length > max_inline:
            too_long = f"{p.length} inline bytes > {max_inline}"
            return refused_wr(errno.EINVAL, "post_send", i, too_long)
        for s in p.sges:
            region = memory.lookup(s.lkey)
            if region is None or not 0 <= s.addr - region.addr <= region.length - s.length:
                return refused_wr(errno.EINVAL, "post_send", i, f"inline SGE {s} outside a region")
        return None
    problem = unregistered(p.sges, memory)
    return refused_wr(errno.EINVAL, "post_send", i, problem) if problem else None


class _Summary:
    """What a plan's entries add up to, for the fast path of a post: one check of the
    whole plan against the QP's limits and the memory table, not one per request."""

    __slots__ = ("clean", "keys", "loose", "max_inline", "max_nsge", "max_read_nsge")

    def __init__(self) -> None:
        self.clean = True
        """No entry is refused whatever the QP, and none holds raw inline bytes."""
        self.keys: set[int] = set()
        """The lkeys a post must find registered."""
        self.max_nsge = self.max_read_nsge = self.max_inline = 0
        self.loose = False
        """Entries changed since it was made and it followed them without a look at the
        others: it may still count what they replaced (more keys, larger maxima, an
        entry refused), so a post it fails makes it anew before it gives up."""


def _count(summary: _Summary, p: _Packed) -> bool:
    """Add request ``p`` to ``summary``; whether its keys were there already."""
    if p.unsupported or p.invalid or p.raw is not None or not p.wr_id_ok:
        summary.clean = False
        return True
    if p.opcode is WROpcode.RDMA_READ:
        summary.max_read_nsge = max(summary.max_read_nsge, p.nsge)
    else:
        summary.max_nsge = max(summary.max_nsge, p.nsge)
    if p.inline:
        summary.max_inline = max(summary.max_inline, p.length)
        return True
    keys = summary.keys
    known = True
    for s in p.sges:
        if s.length and s.lkey not in keys:
            keys.add(s.lkey)
            known = False
    return known


class _Plan:
    """Packed entries and what the fast path needs to know of them."""

    def __init__(self) -> None:
        self._summary: _Summary | None = None
        self._checked: tuple[int, int] | None = None
        """(memory table, epoch) at which every key was last found registered."""
        self._arrays: dict[int, Any] = {}
        """The first ``n`` entries packed together as a C array, by ``n``."""
        self.quick: tuple[int, Any] | None = None
        """(memory epoch, C array of the first entry): a post of that entry alone passed
        every check but the queue's room at that epoch, so the QP whose plan this is
        may hand the array to C itself while the epoch holds (a request posted again)."""
        self.singles: dict[object, tuple[tuple[int, object], Any]] = {}
        """A batch's :attr:`quick` for each entry posted alone (by its index), and for
        each short list of entries posted together (by their indices' tuple, up to
        :data:`SHORT` of them: an RDMA operation and the Send behind it): ((memory
        epoch, the QP's :meth:`SendPlan.post` ``key``), the entries' C array). A batch
        is posted to any QP, so the key says whose checks it passed (its memory table
        and limits)."""

    def _changed(self) -> None:
        self._summary = None
        self._checked = None
        self._arrays.clear()
        self.quick = None
        self.singles = {}

    def _fast_array(
        self, ctype: str, data: Sequence[bytes], entries: Sequence[int], epoch: int
    ) -> Any:
        """:meth:`_array` for a post on the fast path, noting :attr:`quick` for a post
        of the first entry alone."""
        array = self._array(ctype, data, entries)
        if entries == _FIRST:
            self.quick = (epoch, array)
        return array

    def _keys_ok(self, keys: set[int], memory: MemoryTable, epoch: int) -> bool:
        """Whether every key names a registered region (cached while no region is
        removed or invalidated: the C table's epoch)."""
        mark = (id(memory), epoch)
        if self._checked == mark:
            return True
        if all(memory.lookup(k) is not None for k in keys):
            self._checked = mark
            return True
        return False

    def _array(self, ctype: str, data: Sequence[bytes], entries: Sequence[int]) -> Any:
        """The C array (of ``ctype``) of ``entries`` packed together; kept for the
        first ``n`` entries, which a post of a whole list or batch takes each time."""
        if isinstance(entries, range) and entries.start == 0 and entries.step == 1:
            n = entries.stop
            array = self._arrays.get(n)
            if array is None:
                array = self._arrays[n] = ffi.from_buffer(ctype, b"".join(data[:n]))
            return array
        return ffi.from_buffer(ctype, b"".join(map(data.__getitem__, entries)))


class SendPlan(_Plan):
    """The packed form of a list of send requests (one post), or of a batch's entries
    (:meth:`~rdmashim.verbs.wr.SendBatch.prepared`: kept and posted again)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.packed: list[_Packed | None] = [None] * n
        self._data: list[bytes] = [b""] * n

    def set(self, i: int, wr: SendWR) -> None:
        """Pack entry ``i`` from ``wr`` (again, after it changed). What the other
        entries' posts found stays known: a batch one entry of which changes from post
        to post (an RDMA Write's address) costs that entry, not a look at them all."""
        p = self.packed[i] = _Packed(wr)
        self._data[i] = p.data
        summary = self._summary
        if summary is None:
            self._changed()
            return
        self._arrays.clear()
        singles = self.singles
        singles.pop(i, None)
        if singles:  # (lists noted with this entry in them)
            for listed in [k for k in singles if type(k) is tuple and i in k]:
                del singles[listed]
        if i == 0:
            self.quick = None
        summary.loose = True
        if not _count(summary, p):
            self._checked = None  # (a key not checked yet)

    def _summarize(self) -> _Summary:
        out = _Summary()
        for p in self.packed:
            assert p is not None
            _count(out, p)
            if not out.clean:
                break
        self._summary = out
        return out

    def _fits(
        self, summary: _Summary, n: int, room: int, limit: int, max_inline: int,
        memory: MemoryTable, epoch: int,
    ) -> bool:  # fmt: skip
        """Whether a post of ``n`` entries takes the fast path (the summary's checks)."""
        return (
            summary.clean and n <= room and summary.max_nsge <= limit
            and summary.max_read_nsge <= 1 and summary.max_inline <= max_inline
            and self._keys_ok(summary.keys, memory, epoch)
        )  # fmt: skip

    def post(
        self, wrs: Sequence[SendWR], entries: Sequence[int], room: int, max_wr: int,
        limit: int, max_inline: int, memory: MemoryTable, epoch: int,
        submit: Callable[[Any, int], int], key: object = None,
    ) -> VerbsError | None:  # fmt: skip
        """Post ``entries`` (``wrs[k]`` is entry ``entries[k]``'s request) through
        ``submit(array, n)``, which returns how many C took. The error of the first
        refused, if any (those before it are posted).

        The fast path: when the plan's summary passes the QP's limits, the post fits
        the queue and the keys are registered (checked once per memory epoch), the
        entries' packed bytes go to C with no per-request Python. One entry posted so
        is noted in :attr:`singles` under ``key`` (what the checks depended on, other
        than the epoch and the room; None: not noted)."""
        n = len(entries)
        summary = self._summary or self._summarize()
        start = 0
        if self._fits(summary, n, room, limit, max_inline, memory, epoch) or (
            summary.loose
            and self._fits(self._summarize(), n, room, limit, max_inline, memory, epoch)
        ):
            if not n:
                return None
            array = self._fast_array("rs_send_wr[]", self._data, entries, epoch)
            start = submit(array, n)
            if start == n:
                if n <= SHORT and key is not None:
                    self.singles[entries[0] if n == 1 else tuple(entries)] = ((epoch, key), array)
                return None
        chosen: list[bytes] = []
        keep: list[Any] = []
        refused: VerbsError | None = None
        packed = self.packed
        for k in range(start, n):
            p = packed[entries[k]]
            assert p is not None
            refused = _refuse(k, p, limit, room, max_wr, max_inline, memory)
            if refused is not None:
                break
            chosen.append(p.now(keep, memory))
        if chosen:
            blob = chosen[0] if len(chosen) == 1 else b"".join(chosen)
            taken = submit(ffi.from_buffer("rs_send_wr[]", blob), len(chosen))
            if taken < len(chosen):  # C refused one the checks above passed
                return refused_wr(errno.EINVAL, "post_send", start + taken, "refused by the engine")
        elif start < n and refused is None:  # (C refused the fast path's entry `start`)
            return refused_wr(errno.EINVAL, "post_send", start, "refused by the engine")
        return refused


class RecvPlan(_Plan):
    """The packed form of receive requests (one post, or a batch's entries kept)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.data: list[bytes] = [b""] * n
        self.sges: list[tuple[SGE, ...]] = [()] * n
        self.refused: dict[int, str] = {}
        self._table: Any = None
        """Every entry packed in one C array (posts at indices take from it)."""

    def _changed(self) -> None:
        super()._changed()
        self._table = None

    def set(self, i: int, wr: RecvWR) -> None:
        """Pack entry ``i`` from ``wr``."""
        self._changed()
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

    def _summarize(self) -> _Summary:
        out = _Summary()
        out.clean = not self.refused
        for sges in self.sges:
            out.max_nsge = max(out.max_nsge, len(sges))
            out.keys.update(s.lkey for s in sges if s.length)
        self._summary = out
        return out

    def post(
        self, operation: str, entries: Sequence[int], max_sge: int, name: str, max_wr: int,
        memory: MemoryTable, epoch: int, ptr: Any, srq: bool = False,
    ) -> VerbsError | None:  # fmt: skip
        """Post ``entries`` to the receive queue of the C QP ``ptr`` (or to the C SRQ
        ``ptr``): the first ``n`` entries of a C array, or its entries at ``n`` indices
        (``uint32_t[]``); C says how many it took (the rest found the queue full). The
        error of the first refused, if any. The fast path as
        :meth:`SendPlan.post`'s; entries that are not the batch's first ``n`` go to C as
        indices into the whole batch, packed once (one such entry: as the address of
        its own, with ``at`` None, noted in :attr:`singles` under ``(id(memory),
        max_sge)``)."""
        post, post_at = (lib.rs_srq_post, lib.rs_srq_post_at) if srq else _QP_RECV
        summary = self._summary or self._summarize()
        count = len(entries)
        refused: VerbsError | None = None
        if (
            summary.clean and summary.max_nsge <= max_sge
            and self._keys_ok(summary.keys, memory, epoch)
        ):  # fmt: skip
            if not count:
                return None
            if isinstance(entries, range) and entries.start == 0 and entries.step == 1:
                first = self._fast_array("rs_recv_wr[]", self.data, entries, epoch)
                taken = post(ptr, first, count)
            else:
                if self._table is None:
                    self._table = ffi.from_buffer("rs_recv_wr[]", b"".join(self.data))
                if count == 1:  # (a receive reposted as it completed): its own entry
                    single = self._table + entries[0]
                    taken = post(ptr, single, 1)
                    self.singles[entries[0]] = ((epoch, (id(memory), max_sge)), single)
                else:
                    at = ffi.from_buffer("uint32_t[]", array("I", entries))
                    taken = post_at(ptr, self._table, len(self._table), at, count)
        else:
            chosen, refused = self._checked_entries(operation, entries, max_sge, memory)
            count = len(chosen)
            if not count:
                return refused
            taken = post(ptr, ffi.from_buffer("rs_recv_wr[]", b"".join(chosen)), count)
        if taken < count:
            return refused_wr(errno.ENOMEM, operation, taken, f"{name} full ({max_wr})")
        return refused

    def _checked_entries(
        self, operation: str, entries: Sequence[int], max_sge: int, memory: MemoryTable
    ) -> tuple[list[bytes], VerbsError | None]:
        chosen: list[bytes] = []
        for k, i in enumerate(entries):
            if i in self.refused:
                return chosen, refused_wr(errno.EINVAL, operation, k, self.refused[i])
            sges = self.sges[i]
            if len(sges) > max_sge:
                return chosen, refused_wr(
                    errno.EINVAL, operation, k, f"{len(sges)} SGEs > {max_sge}"
                )
            if problem := unregistered(sges, memory):
                return chosen, refused_wr(errno.EINVAL, operation, k, problem)
            chosen.append(self.data[i])
        return chosen, None


_P = TypeVar("_P", SendPlan, RecvPlan)


def plan_of(kind: type[_P], wrs: Sequence[Any]) -> _P:
    """The packed form (``SendPlan`` or ``RecvPlan``) of one post's list."""
    plan = kind(len(wrs))
    for i, w in enumerate(wrs):
        plan.set(i, w)
    return plan


_KEPT = 1024
"""Requests and lists whose plans a :class:`PlanCache` keeps (then it starts afresh)."""
_LIST_MAX = 16
"""Lists of at most this many requests are kept too (longer ones: a prepared batch)."""


def _fields(w: SendWR | RecvWR) -> tuple[object, ...]:
    if isinstance(w, SendWR):
        return (
            w.wr_id, w.opcode, tuple(w.sg_list), w.send_flags, w.remote_addr, w.rkey,
            w.invalidate_rkey,
        )  # fmt: skip
    return (w.wr_id, tuple(w.sg_list))


class PlanCache(Generic[_P]):
    """The plans of requests posted again and again (a ping-pong's reply, RDS's send
    slots, a receive reposted when it completed, a short list of them posted
    together): one per request object or list of them, while their fields stay what
    they were (a changed field makes a new one). The cache holds the objects, so an
    ``id`` it keys by is never another object's."""

    def __init__(self, kind: type[_P]) -> None:
        self.kind: type[_P] = kind
        self.kept: dict[object, tuple[object, tuple[object, ...], _P]] = {}

    def of(self, wr: SendWR | RecvWR) -> _P:
        """The plan of ``wr`` alone."""
        fields = _fields(wr)
        found = self.kept.get(id(wr))
        if found is not None and found[0] is wr and found[1] == fields:
            return found[2]
        return self._keep(id(wr), wr, fields, (wr,))

    def of_list(self, wrs: Sequence[SendWR] | Sequence[RecvWR]) -> _P:
        """The plan of the requests ``wrs`` posted together, in this order."""
        if len(wrs) == 1:
            return self.of(wrs[0])
        if len(wrs) > _LIST_MAX:
            return plan_of(self.kind, wrs)
        kept: tuple[SendWR | RecvWR, ...] = tuple(wrs)
        fields = tuple(map(_fields, kept))
        key = tuple(map(id, kept))
        found = self.kept.get(key)
        if found is not None and found[1] == fields:
            return found[2]
        return self._keep(key, kept, fields, kept)

    def _keep(
        self, key: object, held: object, fields: tuple[object, ...], wrs: Sequence[Any]
    ) -> _P:
        plan = plan_of(self.kind, wrs)
        if len(self.kept) >= _KEPT:
            self.kept.clear()
        self.kept[key] = (held, fields, plan)
        return plan
