"""The native engine's completion queue: entries in a C ring, polled into a caller's
``WCArray`` (``docs/native-engine.md``, "Polling").

C says what the completions of one poll have in common (``rs_cq_poll_sum``); a column
alike in all of them is stored whole, and a poll of a few is decoded row by row.
``poll_rows`` needs no decoding: an ``rs_wc`` is a ``WC_ROW`` row, so C polls straight
into the caller's buffer.
"""

from __future__ import annotations

import errno
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from rdmashim.providers.softiwarp import native
from rdmashim.providers.softiwarp.cq import CQ, CompChannel, CompletingQP
from rdmashim.providers.softiwarp.native import ffi, lib
from rdmashim.providers.softiwarp.provider import Context
from rdmashim.verbs.enums import WCFlags, WCOpcode, WCStatus
from rdmashim.verbs.errors import VerbsError
from rdmashim.verbs.wr import WC, WC_ROW, WCArray, row_view

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from rdmashim.verbs.slots import Slots

_SUCCESS = WCStatus.SUCCESS
_OPCODES = {int(o): o for o in WCOpcode}
_STATUSES = {int(s): s for s in WCStatus}
_NONE = WCFlags.NONE
_FLAGS = {0: _NONE, int(WCFlags.WITH_INV): WCFlags.WITH_INV}
"""The flags a native completion carries (the C side sets none other)."""
_WC = ffi.sizeof("rs_wc") if ffi is not None else 0
assert ffi is None or WC_ROW.size == _WC  # (an rs_wc is a portable row: wr.WC_ROW)
_new = tuple.__new__
_SUM = ("STATUS", "FLAGS", "SOLICITED", "INV", "OPCODES", "QPS", "LENGTHS")
_SUM_STATUS, _SUM_FLAGS, _SUM_SOLICITED, _SUM_INV, _SUM_OPCODES, _SUM_QPS, _SUM_LENGTHS = (
    [getattr(lib, "RS_SUM_" + name) for name in _SUM] if lib is not None else [0] * len(_SUM)
)  # (C's own bits, _engine.h)
Serve = Callable[
    ["NativeCQ", WCArray, Callable[[WCArray, int], bool], "Slots | None"], Awaitable[bool]
]
"""``NativeQP.serve_in_thread``."""
_FEW = 4
"""Polls of at most this many completions are decoded row by row (cheaper than columns)."""


def _rows_of(wcs: WCArray) -> _Rows:
    """The C rows ``wcs`` is filled from (made, or made larger, when first needed)."""
    rows = wcs.native
    if rows is None or not isinstance(rows, _Rows) or len(rows) < len(wcs):
        rows = wcs.native = _Rows(len(wcs))
    return rows


class NativeCQ(CQ):
    """A completion queue whose entries are in a C ring (``rs_cq``)."""

    def __init__(self, context: Context, cqe: int, channel: CompChannel | None) -> None:
        super().__init__(context, cqe, channel)
        self.ring = native.NativeCQ(cqe)
        self._ptr = self.ring._ptr
        self._view = self.ring.view
        self._pushed = 0
        self._notable = 0
        self._rows = ffi.new("rs_wc[]", 64)
        self._raw = memoryview(ffi.buffer(self._rows))
        self._sum = ffi.new("rs_wc_sum *")
        """What a :meth:`poll_wait`'s rows have in common (C says; unused here)."""
        self._row_buffer: object = None
        """The buffer the last :meth:`poll_rows` wrote into (held: its pointer below
        stays valid while it is; a bytearray cannot be resized meanwhile)."""
        self._row_view: memoryview | None = None
        self._row_ptr: Any = None
        """``rs_wc *`` into :attr:`_row_buffer` (``ffi.from_buffer``, made once for it)."""
        self._row_fit = 0
        """Rows :attr:`_row_buffer` holds."""
        self._row_direct = True
        """Whether C may poll into :attr:`_row_ptr` itself (it is aligned as ``rs_wc``)."""
        self._hook_owner: object = None
        """What the native handler's context lives in (:meth:`set_native_handler`), kept
        alive while C may call the handler."""
        self._hooked = False

    def _sync(self) -> None:
        """Completions C pushed since the last look: wake, notify, hand on. With a native
        handler, only what it asked to be handed on (it took the rest)."""
        view = self._view
        pushed = view.pushed
        if pushed == self._pushed:
            return
        self._pushed = pushed
        notable = view.notable
        was, self._notable = self._notable, notable
        self._count = view.count
        if view.overrun and not self._overrun:
            self._overflow(None)
        if self._hooked:  # (only what the native handler asked for, or left)
            if view.wanted or self._count:
                view.wanted = 0
                self._arrived(True)  # (as a solicited completion: an armed handler runs)
            return
        self._arrived(notable != was)

    def set_native_handler(self, function: int, context: int, owner: object = None) -> bool:
        """Have C call ``function`` (the address of a C function of the ABI in
        ``docs/verbs.md``, "Native completion handlers") with ``context`` at the end of every
        call into the engine that leaves completions here; ``owner``, which holds the
        memory ``context`` points to, is kept alive meanwhile. 0 removes it. True."""
        self._check_open("set_native_handler")
        if function < 0 or context < 0:
            raise VerbsError(errno.EINVAL, "set_native_handler", "addresses are not negative")
        lib.rs_cq_set_hook(
            self._ptr, ffi.cast("void *", function), ffi.cast("void *", context if function else 0)
        )
        self._hooked = bool(function)
        self._hook_owner = owner if function else None
        return True

    def _failed_by_overrun(self, qp: CompletingQP) -> bool:
        engine = getattr(qp, "engine", None)  # (a native QP: a CQ serves its own engine's)
        return bool(getattr(engine, "kind", 0) == lib.RS_ERR_CQ_OVERRUN)

    def _take(self, num_entries: int) -> list[WC]:
        n = min(num_entries, self._count)
        if n <= 0:
            return []
        self._room(n)
        got = lib.rs_cq_poll(self._ptr, self._rows, n)
        self._count = self._view.count
        return self._made(got)

    def _room(self, n: int) -> None:
        """Make :attr:`_rows` hold at least ``n`` rows."""
        if n > len(self._rows):
            self._rows = ffi.new("rs_wc[]", n)
            self._raw = memoryview(ffi.buffer(self._rows))

    def _made(self, n: int) -> list[WC]:
        """The first ``n`` of :attr:`_rows` as WCs."""
        # Rows unpacked whole and WCs made as tuples (``WC._make``'s way): a third of
        # the time of reading each field from cffi and calling WC().
        return [
            _new(WC, (wr_id, _STATUSES[st], _OPCODES[op], length, qp, _FLAGS[flags], inv,
                      0, sol != 0, 0, 0))
            for wr_id, st, op, length, qp, flags, inv, sol in WC_ROW.iter_unpack(
                self._raw[: n * _WC]
            )
        ]  # fmt: skip

    def poll_into(self, wcs: WCArray, num_entries: int | None = None) -> int:
        """Take up to ``num_entries`` (default ``len(wcs)``) completions into ``wcs``
        (C copies them into the array's scratch, then a column at a time)."""
        if self._closed:
            self._check_open("poll_cq")
        if self._overrun:
            raise VerbsError(errno.EOVERFLOW, "poll_cq", f"more than {self.cqe} completions queued")
        limit = len(wcs) if num_entries is None else min(num_entries, len(wcs))
        n = min(limit, self._count)
        if n <= 0:
            return 0
        rows = _rows_of(wcs)
        got = lib.rs_cq_poll_sum(self._ptr, rows.c, n, rows.sum)
        self._count = self._view.count
        rows.decode_into(wcs, got)
        return int(got)

    def poll_rows(self, rows: Buffer, num_entries: int | None = None) -> int:
        """Take up to ``num_entries`` (default: as many as fit) completions into ``rows``
        as :data:`~rdmashim.verbs.wr.WC_ROW` rows: one ``rs_cq_poll`` straight into the
        buffer (its pointer made once and kept while the same buffer comes again)."""
        if self._closed:
            self._check_open("poll_cq")
        if self._overrun:
            raise VerbsError(errno.EOVERFLOW, "poll_cq", f"more than {self.cqe} completions queued")
        if rows is not self._row_buffer:
            self._hold_rows(rows)
        fit = self._row_fit
        n = min(fit if num_entries is None else min(num_entries, fit), self._count)
        if n <= 0:
            return 0
        if self._row_direct:
            got = lib.rs_cq_poll(self._ptr, self._row_ptr, n)
        else:  # (an rs_wc * must be aligned: C polls into the scratch, then a copy)
            self._room(n)
            got = lib.rs_cq_poll(self._ptr, self._rows, n)
            ffi.memmove(self._row_ptr, self._rows, got * _WC)
        self._count = self._view.count
        return int(got)

    def _hold_rows(self, rows: Buffer) -> None:
        """Check ``rows`` and keep it with its ``rs_wc *`` (the one held before let go)."""
        view = row_view(rows)
        ptr = ffi.from_buffer("rs_wc[]", view, require_writable=True)
        self._release_rows()
        self._row_buffer, self._row_view, self._row_ptr = rows, view, ptr
        self._row_fit = view.nbytes // _WC
        self._row_direct = int(ffi.cast("uintptr_t", ptr)) % ffi.alignof("rs_wc") == 0

    def _release_rows(self) -> None:
        """Let the buffer :meth:`poll_rows` holds go (it may be resized again)."""
        ptr, view = self._row_ptr, self._row_view
        self._row_buffer = self._row_view = self._row_ptr = None
        self._row_fit = 0
        if ptr is not None:
            ffi.release(ptr)
        if view is not None:
            view.release()

    def _wait_poll(self, out: Any, summary: Any, n: int) -> int:
        """In a ping-pong (the only QP's socket lent to the task that waited here last,
        and trio with nothing else to do), the wait, the read and the poll of up to ``n``
        rows into ``out`` in one call into C (:meth:`.NativeLink.wait_poll`): the rows
        taken; 0 when nothing was (wait as any CQ does). Not tried while the link's last
        idle wait found trio with work: a wait that cannot be one call costs a few
        attribute reads more, not a second try of it."""
        if self._count or self._closed or n <= 0:
            return 0
        link: Any = self._sole_link()
        if link is None or not link.idle_ok or link._waiter_reads or link._rx_stopped:
            return 0
        return int(link.wait_poll(self, out, summary, n, self.busy_poll))

    async def poll_wait_into(self, wcs: WCArray, num_entries: int | None = None) -> int:
        """Wait for completions and take up to ``num_entries`` of them into ``wcs`` (in
        a ping-pong, one call into C: :meth:`_wait_poll`)."""
        rows = _rows_of(wcs)
        got = self._wait_poll(
            rows.c, rows.sum, len(wcs) if num_entries is None else min(num_entries, len(wcs))
        )
        if got:
            rows.decode_into(wcs, got)
            return got
        await self.wait()
        return self.poll_into(wcs, num_entries)

    async def poll_wait(self, num_entries: int = 16) -> list[WC]:
        """Wait for completions and take up to ``num_entries`` of them (at least one; in
        a ping-pong, one call into C: :meth:`_wait_poll`)."""
        n = min(num_entries, self.cqe)  # (never more: an overrun fails the QPs)
        if n > len(self._rows):
            self._room(n)
        got = self._wait_poll(self._rows, self._sum, n)
        if got:
            return self._made(got)
        await self.wait()
        return self.poll(num_entries)

    def serve_poll(self, qp: Any, fd: int, wake: int, wcs: WCArray) -> int:
        """One turn of a thread serving ``qp`` (an ``rs_qp`` whose only CQ this is; its
        socket ``fd``): wait and poll in one call into C (``rs_qp_serve_poll``), the
        completions taken into ``wcs``. Their count; 0 when the QP has news for the
        event loop, below 0 when woken through ``wake``. :meth:`_sync` afterwards: the
        Python side's count is not kept meanwhile."""
        rows = _rows_of(wcs)
        got = int(lib.rs_qp_serve_poll(qp, fd, wake, rows.c, len(wcs), rows.sum))
        if got > 0:
            rows.decode_into(wcs, got)
        return got

    def rows_for(self, wcs: WCArray) -> _Rows:
        """The C rows ``wcs`` is filled from (a thread answering from slots calls
        ``rs_qp_serve_slot`` with them, :mod:`.native_serve`)."""
        return _rows_of(wcs)

    async def serve_in_thread(
        self, wcs: WCArray, on_completions: Callable[[WCArray, int], bool],
        slots: Slots | None = None,
    ) -> bool:  # fmt: skip
        """Take completions in a thread of its own (:mod:`.native_serve`) when one
        connected QP completes here, answering from ``slots`` while they are usable;
        False at once otherwise."""
        self._check_open("serve_in_thread")
        # (a NativeQP's, which imports this module: asked for by name)
        serve: Serve | None = getattr(self._only_qp(), "serve_in_thread", None)
        return False if serve is None else await serve(self, wcs, on_completions, slots)

    def close(self) -> None:
        """Destroy the CQ (its ring lives while a QP still completes into it; its native
        handler is not called again)."""
        if not self._closed:
            if self._hooked:
                self.set_native_handler(0, 0)
            super().close()
            self.ring.close()
            self._release_rows()


class _Rows:
    """A ``WCArray``'s scratch for the native engine: ``rs_wc[n]``, what C found the
    completions of a poll to have in common (``rs_wc_sum``), and the columns."""

    def __init__(self, n: int) -> None:
        self.c = ffi.new("rs_wc[]", n)
        self.sum = ffi.new("rs_wc_sum *")
        raw = ffi.buffer(self.c)
        self.u32 = memoryview(raw).cast("I")
        self.u64 = memoryview(raw).cast("Q")
        self.n = n
        self._same: dict[tuple[type, object, int], list[Any]] = {}

    def __len__(self) -> int:
        return self.n

    def _column(self, k: int, n: int) -> list[int]:
        step = _WC // 4
        return self.u32[k : k + step * n : step].tolist()

    def same(self, value: object, n: int) -> list[Any]:
        """``[value] * n``, made once (a column all of whose entries are alike)."""
        key = (type(value), value, n)  # (0, False and WCStatus.SUCCESS are equal)
        found = self._same.get(key)
        if found is None:
            if len(self._same) > 64:
                self._same.clear()
            found = self._same[key] = [value] * n
        return found

    def decode_into(self, wcs: WCArray, n: int) -> None:
        """Store the first ``n`` rows in ``wcs``'s columns; a column C found alike in
        all of them (the usual: success, no flags, one opcode, one QP) is stored
        whole, not converted entry by entry."""
        if n <= _FEW:  # (a ping-pong's, a request's): field by field, no columns made
            for k in range(n):
                self._decode_row(wcs, k)
            return
        odd, same = self.sum.odd, self.same
        wcs.wr_id[0:n] = self.u64[0 : n * (_WC // 8) : _WC // 8].tolist()
        if odd & _SUM_STATUS:
            wcs.status[0:n] = list(map(_STATUSES.__getitem__, self._column(2, n)))
        else:
            wcs.status[0:n] = same(_SUCCESS, n)
        if odd & _SUM_OPCODES:
            wcs.opcode[0:n] = list(map(_OPCODES.__getitem__, self._column(3, n)))
        else:
            wcs.opcode[0:n] = same(_OPCODES[self.sum.opcode], n)
        wcs.byte_len[0:n] = self._column(4, n) if odd & _SUM_LENGTHS else same(0, n)
        wcs.qp_num[0:n] = self._column(5, n) if odd & _SUM_QPS else same(self.sum.qp_num, n)
        if odd & _SUM_FLAGS:
            wcs.wc_flags[0:n] = list(map(_FLAGS.__getitem__, self._column(6, n)))
        else:
            wcs.wc_flags[0:n] = same(_NONE, n)
        wcs.invalidated_rkey[0:n] = self._column(7, n) if odd & _SUM_INV else same(0, n)
        if odd & _SUM_SOLICITED:
            wcs.solicited[0:n] = list(map(bool, self._column(8, n)))
        else:
            wcs.solicited[0:n] = same(False, n)
        zeros = same(0, n)
        wcs.vendor_err[0:n] = zeros
        wcs.imm_data[0:n] = zeros
        wcs.src_qp[0:n] = zeros

    def _decode_row(self, wcs: WCArray, k: int) -> None:
        u32, at = self.u32, k * (_WC // 4)
        wcs.wr_id[k] = self.u64[k * (_WC // 8)]
        wcs.status[k] = _STATUSES[u32[at + 2]]
        wcs.opcode[k] = _OPCODES[u32[at + 3]]
        wcs.byte_len[k] = u32[at + 4]
        wcs.qp_num[k] = u32[at + 5]
        wcs.wc_flags[k] = _FLAGS[u32[at + 6]]
        wcs.invalidated_rkey[k] = u32[at + 7]
        wcs.solicited[k] = bool(u32[at + 8])
        wcs.vendor_err[k] = wcs.imm_data[k] = wcs.src_qp[k] = 0
