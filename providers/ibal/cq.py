"""Completion queues: ``ib_create_cq`` ... ``ib_destroy_cq``, one-shot notification, linked polls.

IBAL's CQ reports completions through either a callback (``pfn_comp_cb``,
raised on the callback thread) or a wait object (:class:`WaitObject`,
signalled from the progress thread) — exactly one of the two. Notification
is one-shot: ``ib_rearm_cq`` asks for one notification at the next
(solicited) completion, ``ib_rearm_n_cq`` for one once at least ``n``
completions are queued; a completion while the CQ is not armed notifies
nobody. The portable CQ sits on the CA's one completion channel; the CA's
reader task hands its events to :meth:`IbCq.completion_event`.

``ib_poll_cq`` fills ``ib_wc_t`` entries taken from a caller's linked free
list and moves them, in completion order, to the done list.
"""

from __future__ import annotations

import contextlib
import errno
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum, IntFlag
from typing import Any

import trio

from rdmashim.providers.ibal.al import DestroyCallback
from rdmashim.providers.ibal.ca import EventCallback, IbCa, SharedQueue, close_quietly
from rdmashim.providers.ibal.linked import walk
from rdmashim.providers.ibal.status import IbError, IbStatus
from rdmashim.verbs.enums import WCFlags, WCOpcode, WCStatus
from rdmashim.verbs.wr import WC

CompCallback = Callable[["IbCq", Any], None]
"""``ib_pfn_comp_cb_t``: called with the CQ and its ``cq_context``."""


class WaitObject:
    """A wait object (``cl_waitobj_handle_t``): an event threads or trio tasks wait on.

    ``signal()`` sets it; a successful wait resets it again unless it was made
    with ``manual_reset``. Thread-safe; the CQ signals it from the progress thread.
    """

    def __init__(self, manual_reset: bool = False) -> None:
        self.manual_reset = manual_reset
        self._cond = threading.Condition()
        self._signaled = False
        self._trio_waiters: list[tuple[trio.lowlevel.TrioToken, trio.Event]] = []

    def signal(self) -> None:
        """Set the object, waking every waiter."""
        with self._cond:
            self._signaled = True
            self._cond.notify_all()
            waiters, self._trio_waiters = self._trio_waiters, []
        for token, event in waiters:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(event.set)

    def reset(self) -> None:
        """Clear the object."""
        with self._cond:
            self._signaled = False

    def _consume(self) -> bool:
        if not self._signaled:
            return False
        if not self.manual_reset:
            self._signaled = False
        return True

    def wait(self, timeout_us: int | None = None) -> IbStatus:
        """Wait up to ``timeout_us`` microseconds (None: forever): IB_SUCCESS or IB_TIMEOUT."""
        timeout = None if timeout_us is None else timeout_us / 1e6
        with self._cond:
            signaled = self._cond.wait_for(self._consume, timeout)
        return IbStatus.IB_SUCCESS if signaled else IbStatus.IB_TIMEOUT

    async def wait_async(self) -> None:
        """Wait from a trio task (cancellable) until the object is signalled."""
        while True:
            with self._cond:
                if self._consume():
                    return
                event = trio.Event()
                entry = (trio.lowlevel.current_trio_token(), event)
                self._trio_waiters.append(entry)
            try:
                await event.wait()
            finally:
                with self._cond:
                    if entry in self._trio_waiters:
                        self._trio_waiters.remove(entry)


class ib_wc_status_t(IntEnum):
    """``ib_wc_status_t``, value for value."""

    IB_WCS_SUCCESS = 0
    IB_WCS_LOCAL_LEN_ERR = 1
    IB_WCS_LOCAL_OP_ERR = 2
    IB_WCS_LOCAL_PROTECTION_ERR = 3
    IB_WCS_WR_FLUSHED_ERR = 4
    IB_WCS_MEM_WINDOW_BIND_ERR = 5
    IB_WCS_REM_ACCESS_ERR = 6
    IB_WCS_REM_OP_ERR = 7
    IB_WCS_RNR_RETRY_ERR = 8
    IB_WCS_TIMEOUT_RETRY_ERR = 9
    IB_WCS_REM_INVALID_REQ_ERR = 10
    IB_WCS_BAD_RESP_ERR = 11
    IB_WCS_LOCAL_ACCESS_ERR = 12
    IB_WCS_GENERAL_ERR = 13
    IB_WCS_UNMATCHED_RESPONSE = 14
    IB_WCS_CANCELED = 15
    IB_WCS_REM_ABORT_ERR = 16
    IB_WCS_UNKNOWN = 17


class ib_wc_type_t(IntEnum):
    """``ib_wc_type_t``, value for value."""

    IB_WC_SEND = 0
    IB_WC_RDMA_WRITE = 1
    IB_WC_RDMA_READ = 2
    IB_WC_COMPARE_SWAP = 3
    IB_WC_FETCH_ADD = 4
    IB_WC_MW_BIND = 5
    IB_WC_NOP = 6
    IB_WC_UNKNOWN1 = 7
    IB_WC_RECV = 128
    IB_WC_RECV_RDMA_WRITE = 129
    IB_WC_LSO = 130
    IB_WC_LOCAL_INV = 131
    IB_WC_FAST_REG_MR = 132
    IB_WC_UNKNOWN2 = 133


class ib_recv_opt_t(IntFlag):
    """``ib_recv_opt_t``: which optional fields of a receive completion are valid."""

    NONE = 0
    IB_RECV_OPT_IMMEDIATE = 0x1
    IB_RECV_OPT_FORWARD = 0x2
    IB_RECV_OPT_GRH_VALID = 0x4
    IB_RECV_OPT_INVALIDATE = 0x8


S = ib_wc_status_t
_STATUS: dict[WCStatus, ib_wc_status_t] = {
    WCStatus.SUCCESS: S.IB_WCS_SUCCESS,
    WCStatus.LOC_LEN_ERR: S.IB_WCS_LOCAL_LEN_ERR,
    WCStatus.LOC_QP_OP_ERR: S.IB_WCS_LOCAL_OP_ERR,
    WCStatus.LOC_EEC_OP_ERR: S.IB_WCS_LOCAL_OP_ERR,
    WCStatus.LOC_PROT_ERR: S.IB_WCS_LOCAL_PROTECTION_ERR,
    WCStatus.WR_FLUSH_ERR: S.IB_WCS_WR_FLUSHED_ERR,
    WCStatus.MW_BIND_ERR: S.IB_WCS_MEM_WINDOW_BIND_ERR,
    WCStatus.BAD_RESP_ERR: S.IB_WCS_BAD_RESP_ERR,
    WCStatus.LOC_ACCESS_ERR: S.IB_WCS_LOCAL_ACCESS_ERR,
    WCStatus.REM_INV_REQ_ERR: S.IB_WCS_REM_INVALID_REQ_ERR,
    WCStatus.REM_ACCESS_ERR: S.IB_WCS_REM_ACCESS_ERR,
    WCStatus.REM_OP_ERR: S.IB_WCS_REM_OP_ERR,
    WCStatus.RETRY_EXC_ERR: S.IB_WCS_TIMEOUT_RETRY_ERR,
    WCStatus.RNR_RETRY_EXC_ERR: S.IB_WCS_RNR_RETRY_ERR,
    WCStatus.REM_ABORT_ERR: S.IB_WCS_REM_ABORT_ERR,
    WCStatus.RESP_TIMEOUT_ERR: S.IB_WCS_TIMEOUT_RETRY_ERR,
}
"""IBAL's status for each verbs status (the rest: IB_WCS_GENERAL_ERR)."""

T = ib_wc_type_t
_TYPE: dict[WCOpcode, ib_wc_type_t] = {
    WCOpcode.SEND: T.IB_WC_SEND,
    WCOpcode.RDMA_WRITE: T.IB_WC_RDMA_WRITE,
    WCOpcode.RDMA_READ: T.IB_WC_RDMA_READ,
    WCOpcode.COMP_SWAP: T.IB_WC_COMPARE_SWAP,
    WCOpcode.FETCH_ADD: T.IB_WC_FETCH_ADD,
    WCOpcode.BIND_MW: T.IB_WC_MW_BIND,
    WCOpcode.LOCAL_INV: T.IB_WC_LOCAL_INV,
    WCOpcode.RECV: T.IB_WC_RECV,
    WCOpcode.RECV_RDMA_WITH_IMM: T.IB_WC_RECV_RDMA_WRITE,
}


@dataclass(slots=True)
class ib_wc_conn_t:
    """``ib_wc_t.recv.conn``: a connected QP's receive details.

    ``immediate_data`` is in host order; with IB_RECV_OPT_INVALIDATE it holds
    the STag the sender invalidated (the field IBAL shares between the two).
    """

    recv_opt: ib_recv_opt_t = ib_recv_opt_t.NONE
    immediate_data: int = 0


@dataclass(slots=True)
class ib_wc_recv_t:
    """``ib_wc_t.recv`` (connected QPs only: the datagram variants do not arise here)."""

    conn: ib_wc_conn_t = field(default_factory=ib_wc_conn_t)


@dataclass(slots=True)
class ib_wc_t:
    """``ib_wc_t``: one work completion, linked to the next through ``p_next``."""

    p_next: ib_wc_t | None = None
    wr_id: int = 0
    wc_type: ib_wc_type_t = ib_wc_type_t.IB_WC_SEND
    length: int = 0
    vendor_specific: int = 0
    status: ib_wc_status_t = ib_wc_status_t.IB_WCS_SUCCESS
    recv: ib_wc_recv_t = field(default_factory=ib_wc_recv_t)
    qp_num: int = 0
    """An extension: the number of the QP the completion is for (``ibv_wc.qp_num``;
    IBAL's connected completions leave that to the ``wr_id``)."""

    def fill(self, wc: WC) -> None:
        """Set this entry from a portable completion."""
        self.wr_id = wc.wr_id
        self.wc_type = _TYPE.get(wc.opcode, ib_wc_type_t.IB_WC_UNKNOWN2)
        self.length = wc.byte_len
        self.vendor_specific = wc.vendor_err
        self.status = _STATUS.get(wc.status, ib_wc_status_t.IB_WCS_GENERAL_ERR)
        self.qp_num = wc.qp_num
        conn = self.recv.conn
        conn.recv_opt = ib_recv_opt_t.NONE
        conn.immediate_data = 0
        if wc.wc_flags & WCFlags.WITH_IMM:
            conn.recv_opt |= ib_recv_opt_t.IB_RECV_OPT_IMMEDIATE
            conn.immediate_data = wc.imm_data
        if wc.wc_flags & WCFlags.WITH_INV:
            conn.recv_opt |= ib_recv_opt_t.IB_RECV_OPT_INVALIDATE
            conn.immediate_data = wc.invalidated_rkey


def wc_list(n: int) -> ib_wc_t | None:
    """A free list of ``n`` fresh ``ib_wc_t`` entries for :func:`ib_poll_cq` (None if 0)."""
    head = None
    for _ in range(n):
        head = ib_wc_t(p_next=head)
    return head


@dataclass(slots=True)
class ib_cq_create_t:
    """``ib_cq_create_t``: the size, and either a completion callback or a wait object.

    ``ib_create_cq`` sets ``size`` to the size the CQ got (at least the one asked).
    """

    size: int
    pfn_comp_cb: CompCallback | None = None
    h_wait_obj: WaitObject | None = None


_ONE_SHOT = -1


class IbCq(SharedQueue):
    """A completion queue (``ib_cq_handle_t``); ``cq`` is the portable CQ, ``ca`` its CA."""

    invalid = IbStatus.IB_INVALID_CQ_HANDLE
    release_late = True

    def __init__(
        self,
        ca: IbCa,
        portable: Any,
        create: ib_cq_create_t,
        cq_context: Any,
        pfn_cq_event_cb: EventCallback,
    ) -> None:
        super().__init__(ca.al, ca, cq_context, pfn_cq_event_cb)
        self.ca = ca
        self.cq = portable
        self.pfn_comp_cb = create.pfn_comp_cb
        self.h_wait_obj = create.h_wait_obj
        self._arm = 0
        """0: not armed; -1: armed for the next completion; n > 0: for n queued."""
        self._local: deque[WC] = deque()
        """Completions the facade makes itself (receives flushed from an unbound QP)."""
        ca.register(portable, self)

    # ------------------------------------------------------------------ notification
    def rearm(self, solicited: bool) -> None:
        """The ``ib_rearm_cq`` body (progress thread)."""
        self.check("ib_rearm_cq")
        self._arm = _ONE_SHOT
        self.cq.req_notify(bool(solicited))

    def rearm_n(self, n: int) -> None:
        """The ``ib_rearm_n_cq`` body (progress thread)."""
        self.check("ib_rearm_n_cq")
        if not 1 <= n <= self.cq.cqe:
            raise IbError(IbStatus.IB_INVALID_PARAMETER, "ib_rearm_n_cq", f"n {n} not in 1..size")
        self._arm = n
        self.cq.req_notify(False)

    def completion_event(self) -> None:
        """The portable CQ reported a completion: notify if the arming asks for it."""
        if self._arm == 0 or self.destroyed:
            return
        if self._arm > 0 and self.peek() < self._arm:
            self.cq.req_notify(False)  # arm again, then look once more (none slips by)
            if self.peek() < self._arm:
                return
        self._arm = 0
        if self.h_wait_obj is not None:
            self.h_wait_obj.signal()
        elif self.pfn_comp_cb is not None:  # ib_create_cq saw to exactly one of the two
            self.al.callback(self.pfn_comp_cb, self, self.user_context)

    def inject(self, wcs: list[WC]) -> None:
        """Queue completions the facade made (flushed receives), notifying if armed."""
        self._local.extend(wcs)
        if wcs:
            self.completion_event()

    # ------------------------------------------------------------------ polling
    def peek(self) -> int:
        """The ``ib_peek_cq`` body: completions queued now."""
        self.check("ib_peek_cq")
        return len(self._local) + len(self.cq)

    def take(self, n: int) -> list[WC]:
        """Up to ``n`` completions, oldest first (the facade's own before the HCA's)."""
        self.check("ib_poll_cq")
        local = self._local
        out = [local.popleft() for _ in range(min(n, len(local)))]
        if len(out) < n:
            out += self.cq.poll(n - len(out))
        return out

    def modify(self, size: int) -> int:
        """The ``ib_modify_cq`` body: resize if the HCA can."""
        self.check("ib_modify_cq")
        limit = self.ca.context.query_device().max_cqe
        if not 1 <= size <= limit:
            raise IbError(IbStatus.IB_INVALID_CQ_SIZE, "ib_modify_cq", f"{size} not in 1..{limit}")
        if size < self.peek():
            raise IbError(IbStatus.IB_OVERFLOW, "ib_modify_cq", "more completions queued")
        resize = getattr(self.cq, "resize", None)
        if resize is None:
            raise IbError(IbStatus.IB_UNSUPPORTED, "ib_modify_cq", "the HCA cannot resize a CQ")
        resize(size)
        return int(self.cq.cqe)

    def _close_resources(self) -> None:
        self.ca.unregister(self.cq)
        close_quietly(self.cq)


def ib_create_cq(
    h_ca: IbCa,
    create: ib_cq_create_t,
    cq_context: Any = None,
    pfn_cq_event_cb: EventCallback = None,
) -> IbCq:
    """Create a CQ on the CA (``ib_create_cq``); ``create.size`` becomes the size it got.

    IB_INVALID_SETTING unless exactly one of ``pfn_comp_cb`` and ``h_wait_obj``
    is given; IB_INVALID_CQ_SIZE for a size of 0 or past the CA's ``max_cqes``.
    """
    h_ca.check("ib_create_cq")
    if (create.pfn_comp_cb is None) == (create.h_wait_obj is None):
        raise IbError(
            IbStatus.IB_INVALID_SETTING, "ib_create_cq", "give a callback or a wait object"
        )
    if create.size < 1:
        raise IbError(IbStatus.IB_INVALID_CQ_SIZE, "ib_create_cq", "size 0")
    return h_ca.al.call("ib_create_cq", _create_cq, h_ca, create, cq_context, pfn_cq_event_cb)


def _create_cq(
    ca: IbCa, create: ib_cq_create_t, cq_context: Any, pfn_cq_event_cb: EventCallback
) -> IbCq:
    ca.check("ib_create_cq")
    try:
        portable = ca.context.create_cq(create.size, ca.channel)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            raise IbError(IbStatus.IB_INVALID_CQ_SIZE, "ib_create_cq", str(exc)) from exc
        raise
    create.size = int(portable.cqe)
    return IbCq(ca, portable, create, cq_context, pfn_cq_event_cb)


def ib_rearm_cq(h_cq: IbCq, solicited: bool = False) -> None:
    """Ask for one notification at the next (``solicited``: next solicited) completion."""
    h_cq.al.call("ib_rearm_cq", h_cq.rearm, solicited)


def ib_rearm_n_cq(h_cq: IbCq, n_cqes: int) -> None:
    """Ask for one notification at a completion that finds ``n_cqes`` or more queued.

    Completions queued before the call notify nobody by themselves: the
    notification comes with a later completion (``ib_rearm_n_cq``'s rule).
    """
    h_cq.al.call("ib_rearm_n_cq", h_cq.rearm_n, n_cqes)


def ib_peek_cq(h_cq: IbCq) -> int:
    """How many completions the CQ holds (``ib_peek_cq``)."""
    return h_cq.al.call("ib_peek_cq", h_cq.peek)


def ib_poll_cq(
    h_cq: IbCq, free_list: ib_wc_t | None, done_list: ib_wc_t | None = None
) -> tuple[IbStatus, ib_wc_t | None, ib_wc_t | None]:
    """Poll into the free list's entries (``ib_poll_cq``): ``(status, free, done)``.

    As many completions as the free list has entries are taken, oldest first;
    their entries move, in that order, to the end of ``done_list`` (a new list
    if None), the rest stay on ``free``. IB_SUCCESS if at least one completion
    was polled — with ``free`` now None there are potentially more — else
    IB_NOT_FOUND (an empty free list polls nothing). Other statuses raise.
    """
    entries = list(walk(free_list))
    wcs = h_cq.al.call("ib_poll_cq", h_cq.take, len(entries)) if entries else []
    n = len(wcs)
    for entry, wc in zip(entries, wcs, strict=False):
        entry.fill(wc)
    if n == 0:
        return IbStatus.IB_NOT_FOUND, free_list, done_list
    entries[n - 1].p_next = None
    if done_list is None:
        done_list = entries[0]
    else:
        *_, tail = walk(done_list)
        tail.p_next = entries[0]
    rest = entries[n] if n < len(entries) else None
    return IbStatus.IB_SUCCESS, rest, done_list


def ib_query_cq(h_cq: IbCq) -> int:
    """The CQ's size (``ib_query_cq``)."""
    h_cq.check("ib_query_cq")
    return int(h_cq.cq.cqe)


def ib_modify_cq(h_cq: IbCq, size: int) -> int:
    """Resize the CQ (``ib_modify_cq``); returns the size it got.

    IB_UNSUPPORTED where the HCA cannot resize (neither portable backend can).
    """
    return h_cq.al.call("ib_modify_cq", h_cq.modify, size)


def ib_destroy_cq(h_cq: IbCq, pfn_destroy_cb: DestroyCallback = None) -> None:
    """Destroy the CQ (``ib_destroy_cq``); IB_RESOURCE_BUSY while QPs use it."""
    h_cq.destroy_idle("ib_destroy_cq", pfn_destroy_cb)
