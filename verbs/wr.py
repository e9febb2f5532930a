"""Work requests, scatter/gather elements and work completions, one by one or in batches.

:class:`SendWR`, :class:`RecvWR` and :class:`WC` are the plain API: one object
per work request and per completion. :class:`SendBatch`, :class:`RecvBatch`
and :class:`WCArray` are the batch API (issue 13): a list of work requests
filled once and posted again and again with one call
(``qp.post_send_batch``, ``qp.post_recv_batch``, ``srq.post_recv_batch``), and
a preallocated array that ``cq.poll_into`` fills, one list per field, with no
object per completion. Backends keep what they derive from a batch entry (a
checked template, a C struct) with the batch and redo it only for entries set
since (:meth:`SendBatch.prepared`). :data:`WC_ROW` is the layout of the fixed binary
rows ``cq.poll_rows`` writes completions as, for C code that reads them.
"""

from __future__ import annotations

import errno
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, Protocol, TypeAlias, TypeVar

from rdmashim.verbs.enums import SendFlags, WCFlags, WCOpcode, WCStatus, WROpcode
from rdmashim.verbs.errors import CompletionError, VerbsError

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from rdmashim.verbs.abc import AH


class SGE(NamedTuple):
    """One scatter/gather element: ``length`` bytes at ``addr`` in the region of ``lkey``."""

    addr: int
    length: int
    lkey: int


InlineData: TypeAlias = bytes | bytearray | memoryview
"""What an inline send's ``sg_list`` may hold besides SGEs."""


@dataclass(slots=True)
class SendWR:
    """A send queue work request (``ibv_send_wr``).

    ``sg_list`` holds SGEs, or, with ``SendFlags.INLINE``, may hold plain bytes-like
    objects whose contents are copied at post time. ``remote_addr``/``rkey`` name
    the peer's buffer for RDMA Write and Read, and the peer's 8 bytes for an atomic
    operation; ``invalidate_rkey`` the STag a Send with Invalidate invalidates at
    the peer. ``compare_add`` is what ATOMIC_CMP_AND_SWP compares with (``swap``
    replaces it when equal) and what ATOMIC_FETCH_AND_ADD adds; the original value
    lands in the 8-byte SGE (devices whose ``atomic_cap`` is not NONE).
    On a UD QP a Send names its destination: the address handle ``ah``
    (:meth:`PD.create_ah <rdmashim.verbs.abc.PD.create_ah>`), the peer's QP
    number ``remote_qpn`` and the Q_Key ``remote_qkey`` (``ibv_send_wr.wr.ud``);
    other QP types ignore them.
    """

    wr_id: int = 0
    opcode: WROpcode = WROpcode.SEND
    sg_list: Sequence[SGE | InlineData] = ()
    send_flags: SendFlags = SendFlags.SIGNALED
    remote_addr: int = 0
    rkey: int = 0
    invalidate_rkey: int = 0
    imm_data: int = 0
    compare_add: int = 0
    swap: int = 0
    ah: AH | None = None
    remote_qpn: int = 0
    remote_qkey: int = 0


@dataclass(slots=True)
class RecvWR:
    """A receive queue work request (``ibv_recv_wr``)."""

    wr_id: int = 0
    sg_list: Sequence[SGE] = ()


_U32 = 0xFFFFFFFF
_U64 = 0xFFFFFFFFFFFFFFFF
_SEND_FLAGS = int(SendFlags.FENCE | SendFlags.SIGNALED | SendFlags.SOLICITED | SendFlags.INLINE)


def sge_problem(sges: Iterable[object]) -> str | None:
    """What makes one of ``sges`` impossible to post, or None: a field outside what
    ``struct ibv_sge`` holds (``addr`` 64 bits, ``length`` and ``lkey`` 32, none
    negative). Anything but an SGE (inline bytes) is not looked at."""
    for s in sges:
        if isinstance(s, SGE) and not (
            0 <= s.addr <= _U64 and 0 <= s.length <= _U32 and 0 <= s.lkey <= _U32
        ):
            return f"{s!r}: addr, length or lkey outside 64, 32 and 32 bits"
    return None


def wr_id_problem(wr_id: int) -> str | None:
    """Why ``wr_id`` cannot be posted (``ibv_*_wr.wr_id`` is 64 bits, unsigned), or None."""
    if not 0 <= wr_id <= _U64:
        return f"wr_id {wr_id} outside 0..2**64-1"
    return None


def send_problem(w: SendWR) -> str | None:
    """What makes a send request impossible to post whatever the QP and its ``wr_id``
    (an SGE's field outside its C type, a flag ``ibv_send_flags`` lacks), or None."""
    flags = int(w.send_flags)
    if flags & ~_SEND_FLAGS:  # (a negative value too)
        return f"send_flags {flags:#x} holds bits that are no SendFlags"
    return sge_problem(w.sg_list)


def request_problem(w: SendWR | RecvWR) -> str | None:
    """What makes a work request impossible to post whatever the QP, or None: for a
    receive :func:`recv_problem`, for a send its ``wr_id`` or :func:`send_problem`."""
    if isinstance(w, RecvWR):
        return recv_problem(w)
    return wr_id_problem(w.wr_id) or send_problem(w)


def recv_problem(w: RecvWR) -> str | None:
    """What makes a receive request impossible to post (its ``sg_list`` holds SGEs
    only, each field within its C type), or None."""
    sges: Sequence[object] = w.sg_list  # (a caller may pass anything)
    for s in sges:
        if not isinstance(s, SGE):
            return f"a receive's sg_list holds SGEs, not {type(s).__name__}"
    return wr_id_problem(w.wr_id) or sge_problem(w.sg_list)


class WC(NamedTuple):
    """A work completion (``ibv_wc``); a named tuple, so cheap to make and compare."""

    wr_id: int
    status: WCStatus
    opcode: WCOpcode
    byte_len: int = 0
    qp_num: int = 0
    wc_flags: WCFlags = WCFlags.NONE
    invalidated_rkey: int = 0
    vendor_err: int = 0
    solicited: bool = False
    """Whether the message was a Send with Solicited Event (what ``req_notify(True)`` waits for)."""
    imm_data: int = 0
    """Immediate data (host order) when ``wc_flags`` has ``WITH_IMM``; iWARP without RFC
    7306 carries none."""
    src_qp: int = 0
    """A UD receive's sender QP number (``wc_flags`` has ``GRH`` when the buffer's first
    40 bytes hold the datagram's Global Route Header, as on RoCE); 0 on other QPs."""

    def raise_for_status(self) -> WC:
        """Return self if the work request succeeded, else raise :class:`CompletionError`."""
        if self.status != WCStatus.SUCCESS:
            raise CompletionError(self, self.status)
        return self


_W = TypeVar("_W", SendWR, RecvWR)
_W_contra = TypeVar("_W_contra", SendWR, RecvWR, contravariant=True)
_P = TypeVar("_P", bound="Prepared[Any]")


def requests_of(wr: _W | Iterable[_W], kind: type[_W], operation: str) -> list[_W]:
    """The requests a post was given: ``wr`` alone, or the list of them, each checked to
    be a ``kind`` (a TypeError naming the first that is not)."""
    if isinstance(wr, kind):
        return [wr]
    try:
        wrs = list(wr)  # type: ignore[arg-type]  # (not a kind: an iterable, or refused)
    except TypeError:
        raise TypeError(
            f"{operation}: expected a {kind.__name__} or a list of them, not a {type(wr).__name__}"
        ) from None
    for i, w in enumerate(wrs):
        if not isinstance(w, kind):
            raise TypeError(
                f"{operation}: work request {i} is a {type(w).__name__}, not a {kind.__name__}"
            )
    return wrs


class Prepared(Protocol[_W_contra]):
    """What a backend derives from a batch's entries (see :meth:`SendBatch.prepared`)."""

    def set(self, i: int, wr: _W_contra) -> None:
        """Derive entry ``i`` from its work request ``wr`` (again, after it changed)."""


def _copy_send(w: SendWR) -> SendWR:
    return SendWR(
        w.wr_id, w.opcode, tuple(w.sg_list), w.send_flags, w.remote_addr, w.rkey,
        w.invalidate_rkey, w.imm_data, w.compare_add, w.swap, w.ah, w.remote_qpn, w.remote_qkey,
    )  # fmt: skip


def _copy_recv(w: RecvWR) -> RecvWR:
    return RecvWR(w.wr_id, tuple(w.sg_list))


class _Batch(Generic[_W]):
    """The batch mechanics both kinds share: entries, their change log, prepared forms."""

    __slots__ = ("_changed", "_prepared", "_wrs")
    _copy: Callable[[_W], _W]

    def __init__(self, wrs: Iterable[_W]) -> None:
        copy = self._copy
        self._wrs: list[_W] = [copy(w) for w in wrs]
        self._changed: list[int] = []
        """The entries set since the prepared forms last all caught up, in order (a
        post derives only these again, however long the batch)."""
        self._prepared: dict[object, tuple[list[int], Any]] = {}
        """Each form and how far into :attr:`_changed` it has caught up (-1: not at all,
        the log having started afresh)."""

    def __len__(self) -> int:
        return len(self._wrs)

    def __getitem__(self, i: int) -> _W:
        """A copy of entry ``i`` (changing it changes nothing here: use ``batch[i] = wr``)."""
        return self._copy(self._wrs[i])

    def __setitem__(self, i: int, wr: _W) -> None:
        """Replace entry ``i`` with (a copy of) ``wr``."""
        self._wrs[i] = self._copy(wr)
        self._touch(i)

    def _touch(self, i: int) -> None:
        changed = self._changed
        changed.append(i)
        if len(changed) > len(self._wrs) + 16:  # more than a form's rebuild: each rebuilds
            for seen, _ in self._prepared.values():
                seen[0] = -1
            changed.clear()

    def prepared(self, key: object, factory: Callable[[int], _P]) -> _P:
        """The backend's derived form of this batch, ``factory(len(batch))`` filled by its
        ``set`` for every entry, the first time ``key`` asks; later only the entries set
        since are derived again. For backends: ``key`` names what the form depends on
        (the backend, a context's memory table)."""
        found = self._prepared.get(key)
        wrs, changed = self._wrs, self._changed
        if found is None:
            form = factory(len(wrs))
            seen = [-1]
            self._prepared[key] = (seen, form)
        else:
            seen, form = found
            if seen[0] == len(changed):
                return form
        if seen[0] < 0:
            for i, w in enumerate(wrs):
                form.set(i, w)
        else:
            for i in changed[seen[0] :]:
                form.set(i, wrs[i])
        if len(self._prepared) == 1:  # (the usual case: the log starts afresh)
            changed.clear()
        seen[0] = len(changed)
        return form

    def select(
        self, operation: str, count: int | None, indices: Sequence[int] | None
    ) -> Sequence[int]:
        """The entries a post takes, in order: the first ``count`` (all if None), or
        ``indices``; EINVAL (nothing posted) for both, a count or an index out of range."""
        n = len(self._wrs)
        if indices is None:
            if count is None:
                return range(n)
            if 0 <= count <= n:
                return range(count)
            raise VerbsError(errno.EINVAL, operation, f"count {count} outside 0..{n}")
        if count is not None:
            raise VerbsError(errno.EINVAL, operation, "give count or indices, not both")
        if indices and not (min(indices) >= 0 and max(indices) < n):
            raise VerbsError(errno.EINVAL, operation, f"an index outside 0..{n - 1}")
        return indices

    def wrs(self, entries: Sequence[int]) -> list[_W]:
        """The work requests of ``entries`` (what a plain post of them would take)."""
        wrs = self._wrs
        if isinstance(entries, range) and entries.start == 0 and entries.step == 1:
            return wrs[: entries.stop]
        return [wrs[i] for i in entries]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._wrs!r})"


class SendBatch(_Batch[SendWR]):
    """Send work requests filled once and posted many times (``qp.post_send_batch``).

    ``SendBatch(wrs)`` copies the requests (an ``sg_list`` becomes a tuple);
    ``batch.set(i, ...)`` changes fields of entry ``i`` and ``batch[i] = wr``
    replaces it, both without making objects the next post must rebuild for
    the other entries. Posting the first ``count`` entries (or the entries
    ``indices`` names, in that order) means exactly what ``post_send`` of that
    list of :class:`SendWR` means: ``bad_wr`` is the position in it of the
    first request refused, the ones before stay posted, inline data is copied
    when posted (an inline bytearray or region may change between posts), the
    QP's limits are checked at every post and an SGE of a region deregistered
    since is refused as ``post_send`` refuses it.
    """

    __slots__ = ()
    _copy = staticmethod(_copy_send)

    def set(
        self,
        i: int,
        *,
        wr_id: int | None = None,
        opcode: WROpcode | None = None,
        sg_list: Sequence[SGE | InlineData] | None = None,
        send_flags: SendFlags | None = None,
        remote_addr: int | None = None,
        rkey: int | None = None,
        invalidate_rkey: int | None = None,
        imm_data: int | None = None,
    ) -> None:
        """Change the given fields of entry ``i`` (``ibv_wr_*`` style, without a new
        :class:`SendWR`); ``sg_list`` is copied to a tuple."""
        w = self._wrs[i]
        if wr_id is not None:
            w.wr_id = wr_id
        if opcode is not None:
            w.opcode = opcode
        if sg_list is not None:
            w.sg_list = tuple(sg_list)
        if send_flags is not None:
            w.send_flags = send_flags
        if remote_addr is not None:
            w.remote_addr = remote_addr
        if rkey is not None:
            w.rkey = rkey
        if invalidate_rkey is not None:
            w.invalidate_rkey = invalidate_rkey
        if imm_data is not None:
            w.imm_data = imm_data
        self._touch(i)


class RecvBatch(_Batch[RecvWR]):
    """Receive work requests filled once and posted many times (``post_recv_batch``).

    A server re-posts the receives that completed by their entries, e.g.
    ``qp.post_recv_batch(batch, indices=wcs.wr_id[:n])`` when each entry's
    ``wr_id`` is its index. Posting means exactly what ``post_recv`` of the
    same list of :class:`RecvWR` means (``bad_wr``, limits, flushing on a QP
    in ERR).
    """

    __slots__ = ()
    _copy = staticmethod(_copy_recv)

    def set(
        self, i: int, *, wr_id: int | None = None, sg_list: Sequence[SGE] | None = None
    ) -> None:
        """Change the given fields of entry ``i``; ``sg_list`` is copied to a tuple."""
        w = self._wrs[i]
        if wr_id is not None:
            w.wr_id = wr_id
        if sg_list is not None:
            w.sg_list = tuple(sg_list)
        self._touch(i)


class WCArray:
    """Preallocated room for ``n`` completions, one list per :class:`WC` field.

    ``n = cq.poll_into(wcs)`` fills entries ``0..n-1``: ``wcs.wr_id[i]``,
    ``wcs.status[i]``, ``wcs.opcode[i]``, ``wcs.byte_len[i]``, ``wcs.qp_num[i]``,
    ``wcs.wc_flags[i]``, ``wcs.invalidated_rkey[i]``, ``wcs.vendor_err[i]``,
    ``wcs.solicited[i]``, ``wcs.imm_data[i]`` and ``wcs.src_qp[i]`` hold what the fields of a
    :class:`WC` would (status, opcode and flags as their enum members); entries
    from ``n`` on keep older values. No object is made per completion; slices
    such as ``wcs.wr_id[:n]`` or ``wcs.status[:n].count(WCStatus.SUCCESS)``
    work on many at C speed. ``wcs[i]`` makes the :class:`WC` of entry ``i``
    for the rare completion that wants one.
    """

    __slots__ = (*WC._fields, "columns", "native")

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"a WCArray holds at least 1 completion, not {n}")
        self.wr_id: list[int] = [0] * n
        self.status: list[WCStatus] = [WCStatus.SUCCESS] * n
        self.opcode: list[WCOpcode] = [WCOpcode.SEND] * n
        self.byte_len: list[int] = [0] * n
        self.qp_num: list[int] = [0] * n
        self.wc_flags: list[WCFlags] = [WCFlags.NONE] * n
        self.invalidated_rkey: list[int] = [0] * n
        self.vendor_err: list[int] = [0] * n
        self.solicited: list[bool] = [False] * n
        self.imm_data: list[int] = [0] * n
        self.src_qp: list[int] = [0] * n
        self.columns: tuple[list[Any], ...] = tuple(getattr(self, f) for f in WC._fields)
        """The lists in the order of :class:`WC`'s fields."""
        self.native: Any = None
        """Scratch a backend keeps with the array (rdma-core: its ``struct ibv_wc[n]``)."""

    def __len__(self) -> int:
        return len(self.wr_id)

    def __getitem__(self, i: int) -> WC:
        """The completion in entry ``i`` as a :class:`WC`."""
        return WC(*[column[i] for column in self.columns])

    def fill(self, rows: Sequence[tuple[Any, ...]], start: int = 0) -> None:
        """Store ``rows`` (:class:`WC` or tuples of its fields, in its order) in entries
        ``start, start + 1, ...`` (for backends; they fit: ``start + len(rows) <= len(self)``)."""
        k = len(rows)
        columns = self.columns
        if k == 1:  # (a CQ handler's one completion) field by field: no zip of the rows
            for column, value in zip(columns, rows[0], strict=True):
                column[start] = value
        elif k:
            end = start + k
            for column, values in zip(columns, zip(*rows, strict=True), strict=True):
                column[start:end] = values


WC_ROW: struct.Struct = struct.Struct("@QIIIIIII4x")
"""One completion as ``cq.poll_rows`` writes it: the native engine's C ``rs_wc`` row, in
native byte order and alignment, 40 bytes::

    uint64_t wr_id;
    uint32_t status, opcode, byte_len, qp_num, wc_flags, invalidated_rkey, solicited;
    uint32_t (padding; its value is unspecified)

``status``, ``opcode`` and ``wc_flags`` are the ints of :class:`WCStatus`,
:class:`WCOpcode` and :class:`WCFlags` (libibverbs' values); ``solicited`` is 0 or 1.
A row has no ``imm_data``, ``src_qp`` or ``vendor_err``: ``poll_into`` and ``poll`` give
them. ``WC_ROW.unpack_from(rows, i * WC_ROW.size)`` reads row ``i`` in Python."""


def row_view(rows: Buffer, operation: str = "poll_rows") -> memoryview:
    """``rows`` as a flat byte view to write :data:`WC_ROW` rows into (for backends).

    EINVAL (:class:`VerbsError`, naming the problem) when ``rows`` is not a buffer, is
    read-only, is not C-contiguous or holds less than one row; a contiguous buffer of
    any item type or shape (an ``array``, a 2-D ``numpy`` array) is taken as its bytes.
    """
    try:
        view = memoryview(rows)
    except TypeError:
        problem = f"rows must be a writable buffer, not {type(rows).__name__}"
        raise VerbsError(errno.EINVAL, operation, problem) from None
    if view.readonly:
        raise VerbsError(errno.EINVAL, operation, "rows is a read-only buffer")
    if not view.c_contiguous:
        raise VerbsError(errno.EINVAL, operation, "rows is not a C-contiguous buffer")
    if view.format != "B" or view.ndim != 1:
        try:
            view = view.cast("B")
        except TypeError:
            problem = f"rows of item format {view.format!r} cannot be taken as bytes"
            raise VerbsError(errno.EINVAL, operation, problem) from None
    if view.nbytes < WC_ROW.size:
        problem = f"rows holds {view.nbytes} bytes, less than one {WC_ROW.size}-byte row"
        raise VerbsError(errno.EINVAL, operation, problem)
    return view


def pack_rows(rows: memoryview, wcs: Iterable[Sequence[Any]], start: int = 0) -> int:
    """Write ``wcs`` (:class:`WC` or tuples of its fields, in its order) as :data:`WC_ROW`
    rows ``start, start + 1, ...`` of ``rows`` (a :func:`row_view`; they fit); how many
    (for backends whose completions are not rows already)."""
    pack = WC_ROW.pack_into
    size = WC_ROW.size
    at = start * size
    for w in wcs:
        pack(rows, at, w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[8])
        at += size
    return at // size - start
