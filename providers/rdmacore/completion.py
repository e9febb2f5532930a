"""Completion channels and completion queues over libibverbs, awaited without busy polling.

A channel's file descriptor is non-blocking and awaited with
``trio.lowlevel.wait_readable``. :meth:`CQ.wait` arms the CQ
(``req_notify``), polls once more and only then waits, so a completion that
lands between the last poll and the arming is never missed. A CQ created
without a channel gets a private one, so every CQ can be awaited.

Events read from a channel are counted per CQ and acknowledged
(``ibv_ack_cq_events``) by :meth:`CQ.ack_events`, by :meth:`CQ.wait` for the
events it consumes itself, and at the latest when the CQ is destroyed (which
libibverbs requires).

:meth:`CQ.set_handler` gives a CQ (one without a channel: it waits on its
private one) a completion handler: a trio system task waits on the channel's
fd; for each event (``ibv_get_cq_event``, acknowledged at once) that follows
an arming by :meth:`CQ.req_notify` it calls the handler, one hop from the
kernel's event. The task ends with the CQ or when the handler is removed.

:meth:`CQ.poll_into` polls straight into a ``struct ibv_wc[n]`` the
:class:`~rdmashim.verbs.wr.WCArray` keeps (:class:`WCBuffer`) and copies each
field to the array's list with one strided slice of the buffer: no object per
completion. :meth:`CQ.poll_rows` polls into one the CQ keeps and copies each field
into the caller's :data:`~rdmashim.verbs.wr.WC_ROW` rows the same way, memory to
memory (:func:`rows_from`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import weakref
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import trio

from rdmashim.providers.rdmacore import lib
from rdmashim.providers.rdmacore.base import Resource
from rdmashim.providers.rdmacore.cdefs import ffi
from rdmashim.verbs.busypoll import BusyPoll, spin_until
from rdmashim.verbs.enums import WCFlags, WCOpcode, WCStatus
from rdmashim.verbs.errors import VerbsError, check_cq_target
from rdmashim.verbs.wr import WC, WC_ROW, WCArray, pack_rows, row_view

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from rdmashim.providers.rdmacore.device import Context
    from rdmashim.verbs import abc
    from rdmashim.verbs.slots import Slots

log = logging.getLogger(__name__)

_STATUS = {s.value: s for s in WCStatus}
_OPCODE = {o.value: o for o in WCOpcode}
_FLAGS = [WCFlags(f) for f in range(16)]
_WITH_INV = int(WCFlags.WITH_INV)
_WITH_IMM = int(WCFlags.WITH_IMM)
_SUCCESS = WCStatus.SUCCESS
_WC_SIZE: int = ffi.sizeof("struct ibv_wc")
assert _WC_SIZE % 8 == 0  # the columns below are strided slices of 8- and 4-byte views


def _status(raw: int) -> WCStatus:
    return _STATUS.get(raw, WCStatus.GENERAL_ERR)


def _opcode(raw: int) -> WCOpcode:
    opcode = _OPCODE.get(raw)
    if opcode is None:  # undefined in error completions; keep the send/receive distinction
        opcode = WCOpcode.RECV if raw & WCOpcode.RECV else WCOpcode.SEND
    return opcode


class WCBuffer:
    """A ``struct ibv_wc[n]`` in a bytearray, with 8- and 4-byte views for the columns."""

    def __init__(self, n: int) -> None:
        self.raw = bytearray(n * _WC_SIZE)
        self.c = ffi.from_buffer("struct ibv_wc[]", self.raw)
        view = memoryview(self.raw)
        self.u64, self.u32, self.i32 = view.cast("Q"), view.cast("I"), view.cast("i")

    def __len__(self) -> int:
        return len(self.raw) // _WC_SIZE

    def column(self, field: str, n: int, signed: bool = False) -> list[int]:
        """Field ``field`` of entries ``0..n-1``."""
        offset = ffi.offsetof("struct ibv_wc", field)
        if field == "wr_id":
            step = _WC_SIZE // 8
            values: list[int] = self.u64[offset // 8 : offset // 8 + step * n : step].tolist()
        else:
            step = _WC_SIZE // 4
            view = self.i32 if signed else self.u32
            values = view[offset // 4 : offset // 4 + step * n : step].tolist()
        return values


def decode_into(wcs: WCArray, buf: WCBuffer, start: int, n: int) -> None:
    """Entries ``0..n-1`` of ``buf`` into entries ``start..start+n-1`` of ``wcs``, as
    :func:`decode_wc` decodes each (a column at a time; per entry only for errors and
    immediate data or invalidation)."""
    if n <= 0:
        return
    end = start + n
    wcs.wr_id[start:end] = buf.column("wr_id", n)
    status = buf.column("status", n, signed=True)
    opcode = buf.column("opcode", n, signed=True)
    if any(status):
        wcs.status[start:end] = [_status(s) for s in status]
        wcs.opcode[start:end] = [_opcode(o) for o in opcode]
    else:
        wcs.status[start:end] = [_SUCCESS] * n
        try:
            wcs.opcode[start:end] = list(map(_OPCODE.__getitem__, opcode))
        except KeyError:
            wcs.opcode[start:end] = [_opcode(o) for o in opcode]
    wcs.byte_len[start:end] = buf.column("byte_len", n)
    wcs.qp_num[start:end] = buf.column("qp_num", n)
    wcs.vendor_err[start:end] = buf.column("vendor_err", n)
    wcs.src_qp[start:end] = buf.column("src_qp", n)
    flags = buf.column("wc_flags", n)
    if any(flags):
        shared = buf.column("imm_data", n)
        wcs.wc_flags[start:end] = [_FLAGS[f & 0xF] for f in flags]
        wcs.invalidated_rkey[start:end] = [
            u if f & _WITH_INV else 0 for u, f in zip(shared, flags, strict=True)
        ]
        wcs.imm_data[start:end] = [
            socket.ntohl(u) if f & _WITH_IMM else 0 for u, f in zip(shared, flags, strict=True)
        ]
    else:
        wcs.wc_flags[start:end] = [WCFlags.NONE] * n
        wcs.invalidated_rkey[start:end] = wcs.imm_data[start:end] = [0] * n
    wcs.solicited[start:end] = [False] * n  # struct ibv_wc does not say


_ROW_U32 = WC_ROW.size // 4
"""A row's length in 4-byte words: wr_id (0, 1), status 2, opcode 3, byte_len 4, qp_num
5, wc_flags 6, invalidated_rkey 7, solicited 8, padding 9."""
_AT = {
    field: ffi.offsetof("struct ibv_wc", field) // 4
    for field in ("status", "opcode", "byte_len", "qp_num", "wc_flags", "invalidated_rkey")
}
"""Where each field of a ``struct ibv_wc`` is, in 4-byte words."""
_WR_ID_AT = ffi.offsetof("struct ibv_wc", "wr_id") // 8
_KNOWN_OPCODES = frozenset(_OPCODE)
assert WC_ROW.size % 8 == 0


def rows_from(buf: WCBuffer, n: int, rows: memoryview, start: int) -> list[int]:
    """Entries ``0..n-1`` of ``buf`` into :data:`~rdmashim.verbs.wr.WC_ROW` rows
    ``start..start+n-1`` of ``rows`` (a byte view that holds them), converted as
    :func:`decode_wc` converts each: a field a strided copy from memory to memory, per
    entry only for errors, unknown opcodes and flags. The entries with an error status."""
    if n <= 0:
        return []
    size, step, r = WC_ROW.size, _WC_SIZE // 4, _ROW_U32
    out = rows[start * size : (start + n) * size]
    u32 = out.cast("I")

    def column(field: str) -> memoryview:
        at = _AT[field]
        return buf.u32[at : at + step * n : step]

    out.cast("Q")[:: size // 8] = buf.u64[_WR_ID_AT : _WR_ID_AT + (step // 2) * n : step // 2]
    u32[2::r], u32[3::r] = column("status"), column("opcode")
    u32[4::r], u32[5::r] = column("byte_len"), column("qp_num")
    zeros = memoryview(bytes(4 * n)).cast("I")
    u32[8::r] = u32[9::r] = zeros
    flags = column("wc_flags")
    if any(flags):
        shared = column("invalidated_rkey")
        for k, f in enumerate(flags):
            u32[6 + r * k] = f & 0xF
            u32[7 + r * k] = shared[k] if f & _WITH_INV else 0
    else:
        u32[6::r] = u32[7::r] = zeros
    failed: list[int] = []
    statuses, opcodes = u32[2::r], u32[3::r]
    if any(statuses):
        signed = buf.i32[_AT["opcode"] :: step]
        for k, st in enumerate(statuses):
            if st:
                failed.append(k)
                u32[2 + r * k] = _status(st)
                u32[3 + r * k] = _opcode(signed[k])
    if not _KNOWN_OPCODES.issuperset(opcodes.tolist()):  # (a success of another kind)
        for k, op in enumerate(opcodes):
            if op not in _OPCODE:
                u32[3 + r * k] = _opcode(op)
    return failed


def notify_closing(fd: int) -> None:
    """Wake trio tasks waiting on ``fd`` before it is closed (none if trio is not running)."""
    with contextlib.suppress(RuntimeError):
        trio.lowlevel.notify_closing(fd)


def decode_wc(wc: Any) -> WC:
    """A :class:`WC` from a ``struct ibv_wc`` (unknown codes become GENERAL_ERR / SEND|RECV).

    ``imm_data`` is in network byte order in the struct (libibverbs passes the
    wire bytes through) and is returned in host order, as ``SendWR.imm_data``
    takes it.
    """
    flags = wc.wc_flags
    return WC(
        wc.wr_id,
        _status(wc.status),
        _opcode(wc.opcode),
        wc.byte_len,
        wc.qp_num,
        WCFlags(flags & 0xF),
        wc.invalidated_rkey if flags & _WITH_INV else 0,
        wc.vendor_err,
        imm_data=socket.ntohl(wc.imm_data) if flags & _WITH_IMM else 0,
        src_qp=wc.src_qp,
    )


class CompChannel(Resource):
    """A completion channel (``ibv_comp_channel``) whose ``fd`` trio waits on."""

    _kind = "completion channel"

    def __init__(self, context: Context) -> None:
        super().__init__(context)
        self.context = context
        self._ptr = lib.check_ptr(
            lib.verbs().ibv_create_comp_channel(context._ptr), "ibv_create_comp_channel"
        )
        self.fd: int = self._ptr.fd
        os.set_blocking(self.fd, False)
        self._cqs: weakref.WeakValueDictionary[int, CQ] = weakref.WeakValueDictionary()
        self._ready: deque[CQ] = deque()
        self._reading = False
        self._arrived = trio.Event()
        self._created()

    def _register(self, cq: CQ) -> None:
        self._cqs[lib.address(cq._ptr)] = cq

    def _drain(self) -> None:
        """Read every event waiting on the fd and hand each to its CQ."""
        v = lib.verbs()
        cq_out = ffi.new("struct ibv_cq **")
        ctx_out = ffi.new("void **")
        while True:
            if v.ibv_get_cq_event(self._ptr, cq_out, ctx_out) != 0:
                err = lib.last_errno()
                if err in (errno.EAGAIN, errno.EWOULDBLOCK):
                    return
                raise VerbsError(err, "ibv_get_cq_event")
            cq = self._cqs.get(lib.address(cq_out[0]))
            if cq is None:
                v.ibv_ack_cq_events(cq_out[0], 1)
                log.warning("completion event for an unknown CQ acknowledged and dropped")
                continue
            cq._event_arrived()

    async def _await_events(self) -> None:
        """Wait until the fd has been read once more (one task reads, the others wait)."""
        self._check_open("get_cq_event")
        if self._reading:
            await self._arrived.wait()
            return
        self._reading = True
        try:
            await trio.lowlevel.wait_readable(self.fd)
        except trio.ClosedResourceError as exc:
            raise VerbsError(errno.EBADF, "get_cq_event", "completion channel closed") from exc
        finally:
            self._reading = False
            arrived, self._arrived = self._arrived, trio.Event()
            arrived.set()
        self._drain()

    async def get_cq_event(self) -> CQ:
        """Wait for the next event and return the CQ it is for (acknowledge it later)."""
        while not self._ready:
            await self._await_events()
        return self._ready.popleft()

    def _destroy(self) -> None:
        notify_closing(self.fd)
        lib.check(lib.verbs().ibv_destroy_comp_channel(self._ptr), "ibv_destroy_comp_channel")


class CQ(Resource):
    """A completion queue (``ibv_cq``); ``cqe`` is the size the provider gave it."""

    _kind = "completion queue"
    busy_poll = BusyPoll()

    def __init__(self, context: Context, cqe: int, channel: CompChannel | None) -> None:
        self.handler: abc.CQHandler | None = None
        self._app_armed = False
        """Armed by :meth:`req_notify` (not only by :meth:`wait`): the handler is due."""
        self._handler_task = False
        events = channel if channel is not None else CompChannel(context)
        super().__init__(context, events)
        self.context = context
        self.channel = channel
        self._events = events
        try:
            self._ptr = lib.check_ptr(
                lib.verbs().ibv_create_cq(context._ptr, cqe, ffi.NULL, events._ptr, 0),
                "ibv_create_cq",
            )
        except VerbsError:
            if channel is None:
                events.close()
            raise
        self.cqe: int = self._ptr.cqe
        ops = context._ptr.ops
        self._poll_cq = ops.poll_cq
        self._req_notify_cq = ops.req_notify_cq
        self._wc = ffi.new("struct ibv_wc[]", 16)
        self._row_wcs: WCBuffer | None = None
        """What :meth:`poll_rows` polls into before the rows (grown as needed)."""
        self._buffer: deque[WC] = deque()
        self._unacked = 0
        self._waiters = 0
        self._wakeups = 0
        self.events_delivered = 0
        self.events_acked = 0
        events._register(self)
        self._created()

    def _event_arrived(self) -> None:
        self._unacked += 1
        self.events_delivered += 1
        handler = self.handler if self._app_armed else None
        if self._waiters:
            self._wakeups += 1
            self.ack_events(1)
        elif self.handler is not None:
            self.ack_events(1)
        else:
            self._events._ready.append(self)
        if handler is not None:
            self._app_armed = False
            try:
                handler(self)
            except Exception as exc:
                log.exception("completion handler %r failed; its CQ's QPs go to ERR", handler)
                self.context._cq_handler_failed(self, exc)

    def set_handler(self, handler: abc.CQHandler | None) -> None:
        """Call ``handler(self)`` for the event that follows each :meth:`req_notify`, from
        a task waiting on the CQ's private channel (see the module docstring). An
        exception in it is logged and moves the QPs completing here to ERR."""
        self._check_open("set_handler")
        check_cq_target("set_handler", self.channel, handler)
        self.handler = handler
        if handler is not None and not self._handler_task:
            self._handler_task = True
            trio.lowlevel.spawn_system_task(self._handler_loop, name=f"cq-handler-{id(self):x}")

    async def _handler_loop(self) -> None:
        """Read the private channel while the CQ has a handler (the events call it)."""
        try:
            while self.handler is not None and not self._closed:
                await self._events._await_events()
        except VerbsError as exc:  # the CQ or its channel closed
            log.debug("completion handler task ends: %s", exc)
        except Exception:  # a system task must not raise: it would end the trio run
            log.exception("completion handler task failed")
        finally:
            self._handler_task = False

    def _poll_cq_into(self, limit: int, array: Any) -> int:
        n: int = self._poll_cq(self._ptr, limit, array)
        if n < 0:
            raise VerbsError(-n if n < -1 else errno.EIO, "poll_cq", "CQ overrun or error")
        return n

    def _failed(self, qp_num: int, wr_id: int, status: WCStatus) -> None:
        """A completion with an error status: its QP is in ERR now."""
        self.context._qp_failed(qp_num, ConnectionError(f"work request {wr_id} {status.name}"))

    def _poll_native(self, limit: int) -> int:
        if len(self._wc) < limit:
            self._wc = ffi.new("struct ibv_wc[]", limit)
        n = self._poll_cq_into(limit, self._wc)
        wcs = self._wc
        for i in range(n):
            wc = decode_wc(wcs[i])
            if wc.status is not WCStatus.SUCCESS:
                self._failed(wc.qp_num, wc.wr_id, wc.status)
            self._buffer.append(wc)
        return n

    def poll_into(self, wcs: WCArray, num_entries: int | None = None) -> int:
        """``ibv_poll_cq`` straight into the array's ``struct ibv_wc[n]``; how many.

        Completions an earlier :meth:`wait` or ``len()`` took from the CQ come first."""
        self._check_open("poll_cq")
        limit = len(wcs) if num_entries is None else max(0, min(num_entries, len(wcs)))
        n = 0
        buffered = self._buffer
        if buffered:
            n = min(limit, len(buffered))
            wcs.fill([buffered.popleft() for _ in range(n)])
        if n < limit:
            buf = wcs.native
            if not isinstance(buf, WCBuffer) or len(buf) < len(wcs):
                buf = wcs.native = WCBuffer(len(wcs))
            got = self._poll_cq_into(limit - n, buf.c)
            decode_into(wcs, buf, n, got)
            status = wcs.status
            if status[n : n + got].count(_SUCCESS) != got:
                for i in range(n, n + got):
                    if status[i] is not _SUCCESS:
                        self._failed(wcs.qp_num[i], wcs.wr_id[i], status[i])
            n += got
        return n

    def poll_rows(self, rows: Buffer, num_entries: int | None = None) -> int:
        """``ibv_poll_cq`` into the CQ's ``struct ibv_wc[n]``, each field then copied into
        ``rows`` as :data:`~rdmashim.verbs.wr.WC_ROW` rows (:func:`rows_from`); how many.

        Completions an earlier :meth:`wait` or ``len()`` took from the CQ come first."""
        self._check_open("poll_cq")
        view = row_view(rows)
        fit = view.nbytes // WC_ROW.size
        limit = fit if num_entries is None else max(0, min(num_entries, fit))
        n = 0
        buffered = self._buffer
        if buffered and limit:
            n = pack_rows(view, [buffered.popleft() for _ in range(min(limit, len(buffered)))])
        if n < limit:
            buf = self._row_wcs
            if buf is None or len(buf) < limit - n:
                buf = self._row_wcs = WCBuffer(limit - n)
            got = self._poll_cq_into(limit - n, buf.c)
            for k in rows_from(buf, got, view, n):
                wc = decode_wc(buf.c[k])
                self._failed(wc.qp_num, wc.wr_id, wc.status)
            n += got
        return n

    def poll(self, num_entries: int = 16) -> list[WC]:
        """Take up to ``num_entries`` completions, oldest first (never blocks)."""
        self._check_open("poll_cq")
        buffered = self._buffer
        if len(buffered) < num_entries:
            self._poll_native(num_entries - len(buffered))
        n = min(num_entries, len(buffered))
        return [buffered.popleft() for _ in range(n)]

    def req_notify(self, solicited_only: bool = False) -> None:
        """Arm the CQ: the next (solicited) completion sends one event to the channel or
        calls the handler once."""
        self._check_open("req_notify_cq")
        self._app_armed = True
        self._arm(solicited_only)

    def _arm(self, solicited_only: bool = False) -> None:
        lib.check(self._req_notify_cq(self._ptr, int(solicited_only)), "req_notify_cq")

    def ack_events(self, n: int) -> None:
        """Acknowledge ``n`` events taken from the channel."""
        self._check_open("ack_cq_events")
        if not 0 <= n <= self._unacked:
            raise VerbsError(
                errno.EINVAL, "ack_cq_events", f"{n} events, {self._unacked} unacknowledged"
            )
        if n:
            lib.verbs().ibv_ack_cq_events(self._ptr, n)
            self._unacked -= n
            self.events_acked += n

    async def drive_until(self, ready: Callable[[], object]) -> bool:
        """Not here: the handler runs in the completion channel's task (False)."""
        return False

    def interrupt_wait(self) -> None:
        """Nothing waits in :meth:`drive_until` here."""

    async def serve_in_thread(
        self, wcs: WCArray, on_completions: Callable[[WCArray, int], bool],
        slots: Slots | None = None,
    ) -> bool:  # fmt: skip
        """Not here (False): a thread of ours would wait in ``ibv_get_cq_event``; not built."""
        return False

    def set_native_handler(self, function: int, context: int, owner: object = None) -> bool:
        """Not here (False): libibverbs calls no handler of ours; use :meth:`set_handler`."""
        return False

    async def wait(self) -> None:
        """Wait until the CQ holds at least one completion (arm, poll again, then wait)."""
        self._check_open("wait")
        if not self._buffer:
            await self._polling(lambda: self._poll_native(16))

    async def _polling(self, poll: Callable[[], int]) -> int:
        """Call ``poll`` until it takes something (for :attr:`busy_poll` seconds over and
        over, then arming the CQ, polling once more and waiting for the channel between
        tries); returns what it took."""
        self._waiters += 1
        try:
            polled = partial(self._poll_open, poll)
            while not (n := await spin_until(polled, self.busy_poll)):
                seen = self._wakeups
                self._arm()
                if n := poll():
                    return n
                while self._wakeups == seen:
                    await self._events._await_events()
                    self._check_open("wait")
            return n
        finally:
            self._waiters -= 1

    def _poll_open(self, poll: Callable[[], int]) -> int:
        """``poll()``, unless the CQ was closed (a task closed it while another polled)."""
        self._check_open("wait")
        return poll()

    async def poll_wait(self, num_entries: int = 16) -> list[WC]:
        """Wait for completions and take up to ``num_entries`` of them (at least one)."""
        await self.wait()
        return self.poll(num_entries)

    async def poll_wait_into(self, wcs: WCArray, num_entries: int | None = None) -> int:
        """Wait for completions and take up to ``num_entries`` of them into ``wcs``: polls
        into the array itself while waiting, so no completion becomes an object."""
        self._check_open("wait")
        return await self._polling(lambda: self.poll_into(wcs, num_entries))

    def __len__(self) -> int:
        """Completions ready to be polled (reads the CQ)."""
        while self._poll_native(64):
            pass
        return len(self._buffer)

    def _destroy(self) -> None:
        ready = self._events._ready
        if self in ready:
            self._events._ready = deque(cq for cq in ready if cq is not self)
        if self._unacked:
            lib.verbs().ibv_ack_cq_events(self._ptr, self._unacked)
            self.events_acked += self._unacked
            self._unacked = 0
        lib.check(lib.verbs().ibv_destroy_cq(self._ptr), "ibv_destroy_cq")
        if self.channel is None:
            self._events._children.discard(self)
            self._events.close()
