"""Completion queues and completion channels of the built-in engine (siw's
``siw_cq.c``).

A :class:`CQ` keeps the completions the engine hands it in order (one ``WC`` each,
or a run of receive completions kept column by column), wakes its waiters, reports
to its channel or handler when armed, and fails its QPs when it overruns. Waiting
on it may read the connection of the one QP completing into it in place of that
connection's receive task (see ``docs/softiwarp.md``, "Progress").
"""

from __future__ import annotations

import errno
import logging
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import trio

from rdmashim.providers.softiwarp.jobs import (
    RecvRun,
)
from rdmashim.providers.softiwarp.resource import Resource
from rdmashim.verbs import abc, lending
from rdmashim.verbs.busypoll import BusyPoll, spin_until
from rdmashim.verbs.enums import (
    QPState,
    WCFlags,
    WCOpcode,
    WCStatus,
)
from rdmashim.verbs.errors import (
    VerbsError,
    check_cq_target,
)
from rdmashim.verbs.events import AsyncEventType
from rdmashim.verbs.wr import (
    WC,
    WC_ROW,
    WCArray,
    pack_rows,
    row_view,
)

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from rdmashim.providers.softiwarp.driver import Link
    from rdmashim.providers.softiwarp.qp_needs import EngineView
    from rdmashim.verbs.enums import QPState
    from rdmashim.verbs.slots import Slots

log = logging.getLogger(__name__)


class CQContext(abc.Context, Protocol):
    """What a CQ asks of its device context (the provider's ``Context``, which imports
    this module: a CQ names it only so)."""

    _dispatching: bool
    """A handler runs (the context's dispatch, or a driver's one hop:
    :meth:`.NativeLink._handed_to_driver`)."""

    @property
    def nursery(self) -> trio.Nursery: ...

    @property
    def _drivers(self) -> set[trio.lowlevel.Task]: ...

    def _post_async(self, event_type: AsyncEventType, element: abc.CQ | abc.QP) -> None: ...

    def _handler_due(self, cq: CQ) -> None: ...

    def _dispatch_due(self) -> None: ...


class CompletingQP(abc.QP, Protocol):
    """What a CQ asks of a QP completing into it (``qp.QPBase``, which imports this
    module: a CQ names it only so)."""

    @property
    def state(self) -> QPState: ...

    @property
    def engine(self) -> EngineView: ...

    @property
    def _link(self) -> Link | None: ...

    @property
    def send_cq(self) -> CQ: ...

    @property
    def recv_cq(self) -> CQ: ...


class CompChannel(Resource):
    """A completion channel (``ibv_comp_channel``); events are awaited, not polled.

    ``fd`` is None for the built-in engine (its completions never leave the
    process); backends with a kernel channel expose its file descriptor.
    """

    _kind = "completion channel"
    fd: int | None = None

    def __init__(self) -> None:
        self._send, self._recv = trio.open_memory_channel[CQ](1 << 16)

    def _notify(self, cq: CQ) -> None:
        if not self._closed:
            self._send.send_nowait(cq)

    async def get_cq_event(self) -> CQ:
        """Wait for the next event and return the CQ it is for (acknowledge it later)."""
        self._check_open("get_cq_event")
        return await self._recv.receive()

    def close(self) -> None:
        """Close the channel."""
        if not self._closed:
            self._leave_parent()
            self._send.close()


class CQ(Resource):
    """A completion queue (``ibv_cq``)."""

    _kind = "completion queue"
    busy_poll = BusyPoll()

    def __init__(self, context: CQContext, cqe: int, channel: CompChannel | None) -> None:
        self.context = context
        self.cqe = cqe
        self.channel = channel
        self._entries: deque[WC | RecvRun] = deque()
        """Completions in order: one :class:`WC` each, or runs of receive completions
        kept column by column (never empty)."""
        self._count = 0
        """Completions in ``_entries``."""
        self._armed = False
        self._solicited_only = False
        self._overrun = False
        self._waiter: trio.Event | None = None
        """What tasks in :meth:`wait` with no connection to read wait on (None: none
        waits; a completion that comes then sets nothing: a call less on its path)."""
        self._reader: lending.WaitPoint | None = None
        """Where a task in :meth:`wait` that reads a connection in place of its receive task
        waits (its :attr:`~.driver.Link.wait_point`: interrupted, it looks again)."""
        self._qps: dict[int, CompletingQP] = {}
        """The QPs completing into this CQ (they go to ERR if it overruns)."""
        self.events_acked = 0
        self.events_delivered = 0
        self.handler: abc.CQHandler | None = None

    def set_handler(self, handler: abc.CQHandler | None) -> None:
        """Call ``handler(self)`` for the completion that follows each :meth:`req_notify`.

        It runs in the task that made the completion: a received message's in the
        connection's receive task, right after the bytes it read are processed (no
        task switch); others (a post's send completions, flushes) in the context's
        dispatcher task soon after. A handler that posts or polls finds its new
        completions reported the same way once it re-armed. An exception in it is
        logged and moves the QPs completing here to ERR (their ``error`` is it).
        """
        self._check_open("set_handler")
        check_cq_target("set_handler", self.channel, handler)
        self.handler = handler

    def _handler_run(self) -> None:
        handler = self.handler
        if handler is None or self._closed:
            return
        try:
            handler(self)
        except Exception as exc:
            log.exception("completion handler %r failed; its CQ's QPs go to ERR", handler)
            for qp in list(self._qps.values()):
                if qp.state is not QPState.ERR:
                    qp.engine.set_error(exc)

    def _push(self, wc: WC) -> None:
        if self._count >= self.cqe:
            self._overflow(wc)
            return
        self._entries.append(wc)
        self._count += 1
        self._arrived(self._armed and (wc.solicited or wc.status != WCStatus.SUCCESS))

    def _push_all(self, wcs: list[WC]) -> None:
        """Queue completions in order as :meth:`_push` of each, with one wakeup and at
        most one event or handler call for them all."""
        if len(wcs) > self.cqe - self._count:
            for wc in wcs:  # up to the overrun (rare): each as it comes
                self._push(wc)
            return
        self._entries.extend(wcs)
        self._count += len(wcs)
        self._arrived(
            self._armed
            and (
                not self._solicited_only
                or any(wc.solicited or wc.status != WCStatus.SUCCESS for wc in wcs)
            )
        )

    def _push_run(self, run: RecvRun) -> None:
        """Queue a run of successful receive completions as :meth:`_push_all` of them,
        kept as the run (one entry)."""
        if len(run) > self.cqe - self._count:
            for wc in run.take(len(run)):  # up to the overrun (rare): each as it comes
                self._push(wc)
            return
        self._entries.append(run)
        self._count += len(run)
        self._arrived(
            self._armed
            and (not self._solicited_only or (run.solicited is not None and True in run.solicited))
        )

    def _overflow(self, lost: object) -> None:
        """More than ``cqe`` completions: ``lost`` (the one that did not fit, or None when
        the native engine's ring counted the loss) is reported, the QPs go to ERR."""
        if not self._overrun:
            self._overrun = True
            log.error("CQ overrun: %d entries; completion %r lost", self.cqe, lost)
            self.context._post_async(AsyncEventType.CQ_ERR, self)
            # Not from inside the engine that is completing: on the next tick.
            self.context.nursery.start_soon(self._fail_qps)

    def _wake_waiters(self) -> None:
        """Wake the tasks in :meth:`wait` that read no connection."""
        waiter, self._waiter = self._waiter, None
        if waiter is not None:
            waiter.set()

    def _arrived(self, notable: bool) -> None:
        """Completions were queued: wake waiters; an armed CQ reports them if one of them
        is ``notable`` (solicited or an error) or it was armed for any (callers work out
        ``notable`` only for an armed CQ)."""
        if self._waiter is not None:  # (else no call: this runs for every completion)
            self._wake_waiters()
        if self._reader is not None:
            self._reader.interrupt()
        if self._armed and (not self._solicited_only or notable):
            self._armed = False
            if self.channel is not None:
                self.events_delivered += 1
                self.channel._notify(self)
            elif self.handler is not None:
                self.context._handler_due(self)

    async def _fail_qps(self) -> None:
        """After an overrun: every QP completing here goes to ERR (QP_FATAL each)."""
        cause = self.overrun_error()
        for qp in list(self._qps.values()):
            if qp.state is not QPState.ERR or self._failed_by_overrun(qp):
                qp.engine.set_error(cause)
                self.context._post_async(AsyncEventType.QP_FATAL, qp)

    def overrun_error(self) -> VerbsError:
        """What a QP failed by this CQ's overrun has as its ``error``."""
        return VerbsError(errno.EOVERFLOW, "cq", f"CQ overrun: more than {self.cqe} completions")

    def _failed_by_overrun(self, qp: CompletingQP) -> bool:
        """Whether ``qp`` is in ERR because of this CQ's overrun already (the native
        engine fails the QP whose completion did not fit at once)."""
        return False

    def poll(self, num_entries: int = 16) -> list[WC]:
        """Take up to ``num_entries`` completions, oldest first (never blocks).

        After an overrun (more completions than ``cqe``; the context reported CQ_ERR)
        it raises EOVERFLOW."""
        if self._closed:
            self._check_open("poll_cq")
        if self._overrun:
            raise VerbsError(errno.EOVERFLOW, "poll_cq", f"more than {self.cqe} completions queued")
        return self._take(num_entries)

    def _take(self, num_entries: int) -> list[WC]:
        entries = self._entries
        taken: list[WC] = []
        left = max(0, min(num_entries, self._count))  # (none for fewer than none)
        self._count -= left
        while left:
            entry = entries[0]
            if entry.__class__ is RecvRun:
                n = min(left, len(entry))
                taken += entry.take(n)
                if not entry:
                    entries.popleft()
            else:
                n = 1
                taken.append(entries.popleft())  # type: ignore[arg-type]
            left -= n
        return taken

    def poll_into(self, wcs: WCArray, num_entries: int | None = None) -> int:
        """Take up to ``num_entries`` (default ``len(wcs)``) completions into ``wcs``; how many.

        The CQ keeps the engine's completions as they come (one named tuple each, or
        the columns of a run of receives); this moves their fields into the array's
        lists (a run's a column at a time) and keeps none of them."""
        self._check_open("poll_cq")
        if self._overrun:
            raise VerbsError(errno.EOVERFLOW, "poll_cq", f"more than {self.cqe} completions queued")
        total = self._count if num_entries is None else min(num_entries, self._count)
        if total <= 0:  # (an empty CQ: a handler's last poll after re-arming; or none asked)
            return 0
        total = min(total, len(wcs.wr_id))
        entries = self._entries
        self._count -= total
        pos = 0
        rows: list[WC] = []
        while pos + len(rows) < total:
            entry = entries[0]
            if entry.__class__ is not RecvRun:
                rows.append(entries.popleft())  # type: ignore[arg-type]
                continue
            if rows:
                wcs.fill(rows, pos)
                pos += len(rows)
                rows = []
            run: RecvRun = entry
            n = min(total - pos, len(run))
            start = run.start
            fill_run(wcs, pos, run, start, start + n)
            run.start += n
            if not run:
                entries.popleft()
            pos += n
        if rows:
            wcs.fill(rows, pos)
        return total

    def poll_rows(self, rows: Buffer, num_entries: int | None = None) -> int:
        """Take up to ``num_entries`` (default: as many as fit) completions into ``rows`` as
        :data:`~rdmashim.verbs.wr.WC_ROW` rows; how many (each packed from its ``WC``, a
        run's taken as ``poll`` takes them)."""
        self._check_open("poll_cq")
        if self._overrun:
            raise VerbsError(errno.EOVERFLOW, "poll_cq", f"more than {self.cqe} completions queued")
        view = row_view(rows)
        fit = view.nbytes // WC_ROW.size
        return pack_rows(view, self._take(fit if num_entries is None else min(num_entries, fit)))

    async def poll_wait_into(self, wcs: WCArray, num_entries: int | None = None) -> int:
        """Wait for completions and take up to ``num_entries`` of them into ``wcs``."""
        await self.wait()
        return self.poll_into(wcs, num_entries)

    def req_notify(self, solicited_only: bool = False) -> None:
        """Arm the CQ: the next (solicited) completion sends one event to the channel or
        calls the handler once (completions already queued do not count)."""
        self._check_open("req_notify_cq")
        self._armed = True
        self._solicited_only = solicited_only

    def ack_events(self, n: int) -> None:
        """Acknowledge ``n`` events taken from the channel."""
        self.events_acked += n

    async def wait(self) -> None:
        """Wait until the CQ holds at least one completion.

        When one connected QP completes here, no CQ of it has a handler and no other
        task reads its connection already, the waiting task reads that connection
        itself in place of its receive task: a received message that completes here
        wakes it in one hop. Otherwise the receive task wakes it.
        """
        self._check_open("wait")
        while not self._count:
            link = self._sole_link()
            if link is not None and link.can_read:
                self._reader = link.wait_point
                try:
                    await link.read_until(self._ready, spin=self.busy_poll)
                finally:
                    self._reader = None
            elif not await spin_until(self._ready, self.busy_poll):
                if (waiter := self._waiter) is None:
                    waiter = self._waiter = trio.Event()
                await waiter.wait()
            if self._closed:
                self._check_open("wait")

    async def drive_until(self, ready: Callable[[], object]) -> bool:
        """Wait until ``ready()`` is true, reading the connection of the only QP completing
        here in this task and running this CQ's handler after each read (so a message
        the handler hands on wakes nobody else); True then, or when the connection
        ended. :meth:`interrupt_wait` makes it look at ``ready`` again. False at once
        when this CQ serves other than one connected QP or another task reads it: wait
        some other way."""
        self._check_open("drive_until")
        qp = self._only_qp()
        link = qp._link if qp is not None else None
        if link is None or not link.can_read:
            return False
        context = self.context
        task = trio.lowlevel.current_task()
        context._drivers.add(task)
        self._reader = link.wait_point
        try:
            await link.read_until(ready, after_read=context._dispatch_due, spin=self.busy_poll)
        finally:
            self._reader = None
            context._drivers.discard(task)
        return True

    def interrupt_wait(self) -> None:
        """Make a :meth:`drive_until` in progress look at its ``ready`` again now (what it
        waits for came another way)."""
        if self._reader is not None:
            self._reader.interrupt()

    async def serve_in_thread(
        self, wcs: WCArray, on_completions: Callable[[WCArray, int], bool],
        slots: Slots | None = None,
    ) -> bool:  # fmt: skip
        """Not with the Python engine (False): its engine runs in the event loop's
        thread. The native engine's CQ can (:class:`~.native_cq.NativeCQ`)."""
        return False

    def set_native_handler(self, function: int, context: int, owner: object = None) -> bool:
        """Not with the Python engine (False): its completions are Python's; use
        :meth:`set_handler`. The native engine's CQ calls one (:class:`~.native_cq.NativeCQ`)."""
        self._check_open("set_native_handler")
        return False

    def _sole_link(self) -> Link | None:
        """The connection of the only QP completing here, unless a CQ of it has a handler
        (a handler runs in the receive task, after the batch it read)."""
        qps = self._qps
        if len(qps) != 1:
            return None
        (qp,) = qps.values()  # (inline, not _only_qp: every wait asks)
        if qp.send_cq.handler is not None or qp.recv_cq.handler is not None:
            return None
        return qp._link

    def _only_qp(self) -> CompletingQP | None:
        """The QP completing here, when there is exactly one."""
        return next(iter(self._qps.values())) if len(self._qps) == 1 else None

    def _ready(self) -> bool:
        return bool(self._count) or self._closed

    async def poll_wait(self, num_entries: int = 16) -> list[WC]:
        """Wait for completions and take up to ``num_entries`` of them (at least one)."""
        await self.wait()
        return self.poll(num_entries)

    def __len__(self) -> int:
        return self._count

    def close(self) -> None:
        """Destroy the CQ."""
        if not self._closed:
            self._leave_parent()
            self._wake_waiters()
            if self._reader is not None:
                self._reader.interrupt()


def fill_run(wcs: WCArray, pos: int, run: RecvRun, start: int, stop: int) -> None:
    """Entries ``start:stop`` of a run into ``wcs`` from entry ``pos`` on, a column at a
    time."""
    n = stop - start
    end = pos + n
    wcs.wr_id[pos:end] = run.wr_ids[start:stop]
    wcs.status[pos:end] = [WCStatus.SUCCESS] * n
    wcs.opcode[pos:end] = [WCOpcode.RECV] * n
    wcs.byte_len[pos:end] = run.byte_lens[start:stop]
    wcs.qp_num[pos:end] = [run.qp_num] * n
    wcs.wc_flags[pos:end] = [WCFlags.NONE] * n
    zeros = [0] * n
    wcs.invalidated_rkey[pos:end] = zeros
    wcs.vendor_err[pos:end] = zeros
    wcs.solicited[pos:end] = run.solicited_of(start, stop)
    wcs.imm_data[pos:end] = zeros
