"""The portable verbs over IBAL, part 2: CQs, completion channels, QPs and SRQs.

A CQ is ``ib_create_cq`` with a completion callback: the callback (on the
AL's callback thread) hands the notification to the application's trio loop,
where it wakes ``wait`` and, when the application armed the CQ, queues the CQ
on its completion channel or calls its completion handler (``set_handler``).
``req_notify`` is ``ib_rearm_cq`` (one-shot, as verbs), ``poll`` is
``ib_poll_cq`` over a free list of ``ib_wc_t`` the CQ reuses. A QP is
``ib_create_qp``: unbound, moved to INIT as rdma_cm does, bound to its
connection by the CM (:mod:`.port_cm`). Posting converts the portable work
requests to one linked ``ib_send_wr_t``/``ib_recv_wr_t`` chain; a refusal's
``failed_wr`` becomes ``bad_wr``, the index in the list given.

A batch (``post_send_batch``/``post_recv_batch``) keeps its entries converted
to ``ib_*_wr_t`` (entries set since are converted again) and posts the chosen
ones linked into one chain; ``poll_into`` is ``ib_poll_cq`` over the same free
list as ``poll``, each entry's fields written to the array; ``poll_rows`` packs them
as ``WC_ROW`` rows.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import itertools
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Self, TypeVar

import trio

from rdmashim.providers.ibal.cq import (
    IbCq,
    ib_cq_create_t,
    ib_create_cq,
    ib_destroy_cq,
    ib_peek_cq,
    ib_poll_cq,
    ib_rearm_cq,
    ib_recv_opt_t,
    ib_wc_status_t,
    ib_wc_t,
    ib_wc_type_t,
)
from rdmashim.providers.ibal.linked import walk
from rdmashim.providers.ibal.port_device import PD, Context, own_pd, raise_verbs, verbs_errors
from rdmashim.providers.ibal.qp import (
    IbQp,
    ib_create_qp,
    ib_destroy_qp,
    ib_modify_qp,
    ib_post_recv,
    ib_post_send,
    ib_qp_create_t,
    ib_qp_mod_t,
    ib_qp_state_t,
    ib_query_qp,
)
from rdmashim.providers.ibal.srq import (
    IbSrq,
    ib_create_srq,
    ib_destroy_srq,
    ib_post_srq_recv,
    ib_srq_attr_t,
)
from rdmashim.providers.ibal.status import IbError
from rdmashim.providers.ibal.wr import (
    ib_local_ds_t,
    ib_recv_wr_t,
    ib_remote_ops_t,
    ib_send_opt_t,
    ib_send_wr_t,
    ib_wr_type_t,
)
from rdmashim.verbs.attrs import QPAttr, QPCap
from rdmashim.verbs.backend import own
from rdmashim.verbs.busypoll import BusyPoll, spin_until
from rdmashim.verbs.enums import QPState, QPType, SendFlags, WCFlags, WCOpcode, WCStatus, WROpcode
from rdmashim.verbs.errors import NotSupported, VerbsError, check_cq_target, refused_wr
from rdmashim.verbs.wr import (
    SGE,
    WC,
    WC_ROW,
    RecvBatch,
    RecvWR,
    SendBatch,
    SendWR,
    WCArray,
    pack_rows,
    request_problem,
    requests_of,
    row_view,
)

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from rdmashim.verbs import abc
    from rdmashim.verbs.slots import Slots

_QP_NUMBERS = itertools.count(1)
"""QP numbers of this backend: IBAL's QP exists before the HCA's, so it numbers its own."""

# ---------------------------------------------------------------------------- completions
_WC_STATUS: dict[int, WCStatus] = {}
for _portable, _ib in (
    (WCStatus.SUCCESS, ib_wc_status_t.IB_WCS_SUCCESS),
    (WCStatus.LOC_LEN_ERR, ib_wc_status_t.IB_WCS_LOCAL_LEN_ERR),
    (WCStatus.LOC_QP_OP_ERR, ib_wc_status_t.IB_WCS_LOCAL_OP_ERR),
    (WCStatus.LOC_PROT_ERR, ib_wc_status_t.IB_WCS_LOCAL_PROTECTION_ERR),
    (WCStatus.WR_FLUSH_ERR, ib_wc_status_t.IB_WCS_WR_FLUSHED_ERR),
    (WCStatus.MW_BIND_ERR, ib_wc_status_t.IB_WCS_MEM_WINDOW_BIND_ERR),
    (WCStatus.REM_ACCESS_ERR, ib_wc_status_t.IB_WCS_REM_ACCESS_ERR),
    (WCStatus.REM_OP_ERR, ib_wc_status_t.IB_WCS_REM_OP_ERR),
    (WCStatus.RNR_RETRY_EXC_ERR, ib_wc_status_t.IB_WCS_RNR_RETRY_ERR),
    (WCStatus.RETRY_EXC_ERR, ib_wc_status_t.IB_WCS_TIMEOUT_RETRY_ERR),
    (WCStatus.REM_INV_REQ_ERR, ib_wc_status_t.IB_WCS_REM_INVALID_REQ_ERR),
    (WCStatus.BAD_RESP_ERR, ib_wc_status_t.IB_WCS_BAD_RESP_ERR),
    (WCStatus.LOC_ACCESS_ERR, ib_wc_status_t.IB_WCS_LOCAL_ACCESS_ERR),
    (WCStatus.REM_ABORT_ERR, ib_wc_status_t.IB_WCS_REM_ABORT_ERR),
):
    _WC_STATUS[_ib] = _portable
_WC_OPCODE: dict[int, WCOpcode] = {
    ib_wc_type_t.IB_WC_SEND: WCOpcode.SEND,
    ib_wc_type_t.IB_WC_RDMA_WRITE: WCOpcode.RDMA_WRITE,
    ib_wc_type_t.IB_WC_RDMA_READ: WCOpcode.RDMA_READ,
    ib_wc_type_t.IB_WC_COMPARE_SWAP: WCOpcode.COMP_SWAP,
    ib_wc_type_t.IB_WC_FETCH_ADD: WCOpcode.FETCH_ADD,
    ib_wc_type_t.IB_WC_MW_BIND: WCOpcode.BIND_MW,
    ib_wc_type_t.IB_WC_LOCAL_INV: WCOpcode.LOCAL_INV,
    ib_wc_type_t.IB_WC_RECV: WCOpcode.RECV,
    ib_wc_type_t.IB_WC_RECV_RDMA_WRITE: WCOpcode.RECV_RDMA_WITH_IMM,
}


def to_wc(entry: ib_wc_t, qp_numbers: dict[int, int]) -> WC:
    """The portable completion of an ``ib_wc_t`` (``qp_numbers``: HCA's -> this backend's)."""
    return WC(*wc_fields(entry, qp_numbers))


def wc_fields(entry: ib_wc_t, qp_numbers: dict[int, int]) -> tuple[Any, ...]:
    """The fields of :func:`to_wc`'s completion, in :class:`WC`'s order."""
    conn = entry.recv.conn
    flags = WCFlags.NONE
    imm = inv = 0
    if conn.recv_opt & ib_recv_opt_t.IB_RECV_OPT_IMMEDIATE:
        flags |= WCFlags.WITH_IMM
        imm = conn.immediate_data
    if conn.recv_opt & ib_recv_opt_t.IB_RECV_OPT_INVALIDATE:
        flags |= WCFlags.WITH_INV
        inv = conn.immediate_data
    return (
        entry.wr_id,
        _WC_STATUS.get(entry.status, WCStatus.GENERAL_ERR),
        _WC_OPCODE.get(entry.wc_type, WCOpcode.RECV),
        entry.length,
        qp_numbers.get(entry.qp_num, entry.qp_num),
        flags,
        inv,
        entry.vendor_specific,
        False,
        imm,
        0,
    )


log = logging.getLogger(__name__)


class CompChannel:
    """A completion channel: CQs whose armed notification fired, in order."""

    fd = None

    def __init__(self, context: Context) -> None:
        self.context = context
        self._in, self._out = trio.open_memory_channel["abc.CQ"](1 << 16)

    def push(self, cq: CQ) -> None:
        """Queue an event of ``cq`` (on the application's loop)."""
        with contextlib.suppress(trio.WouldBlock, trio.ClosedResourceError):
            self._in.send_nowait(cq)

    async def get_cq_event(self) -> abc.CQ:
        """Wait for the next event; returns its CQ."""
        try:
            return await self._out.receive()
        except trio.EndOfChannel:
            raise VerbsError(errno.EBADF, "get_cq_event", "channel closed") from None

    def close(self) -> None:
        """Close the channel."""
        self._in.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class CQ:
    """A completion queue: ``ib_create_cq`` with a completion callback (``h_cq``)."""

    busy_poll = BusyPoll()

    def __init__(
        self,
        context: Context,
        cqe: int,
        channel: abc.CompChannel | None,
        handler: abc.CQHandler | None = None,
    ) -> None:
        self.context = context
        self.channel = own(channel, CompChannel, "create_cq") if channel is not None else None
        check_cq_target("create_cq", channel, handler)
        self.handler = handler
        with verbs_errors("create_cq"):
            self.h_cq: IbCq = ib_create_cq(
                context.ca,
                ib_cq_create_t(cqe, self._completion),
                self,
                context.event_handler(self),
            )
        self.cqe = self.h_cq.cq.cqe
        self._free: list[ib_wc_t] = []
        self._app_armed = False
        self._waiters: list[trio.Event] = []
        self._acked = 0
        self.closed = False

    # ------------------------------------------------------------------ notification
    def _completion(self, h_cq: IbCq, cq_context: object) -> None:
        """The completion callback (callback thread): notify on the application's loop."""
        self.context.to_app(self._notified)

    def _notified(self) -> None:
        waiters, self._waiters = self._waiters, []
        for event in waiters:
            event.set()
        if not self._app_armed or self.closed:
            return
        if self.channel is not None:
            self._app_armed = False
            self.channel.push(self)
        elif self.handler is not None:
            self._app_armed = False
            try:
                self.handler(self)
            except Exception:
                log.exception("completion handler %r failed; its CQ's QPs go to ERR", self.handler)
                for h_qp in list(self.h_cq.users):
                    qp = h_qp.user_context
                    if isinstance(qp, QP) and not qp.closed and qp.state is not QPState.ERR:
                        with contextlib.suppress(VerbsError):
                            qp.modify(qp_state=QPState.ERR)

    def set_handler(self, handler: abc.CQHandler | None) -> None:
        """Call ``handler(self)`` on the application's loop for the completion that
        follows each arming (IBAL's ``pfn_comp_cb``, as the channel's events come)."""
        if self.closed:
            raise VerbsError(errno.EBADF, "set_handler", "CQ closed")
        check_cq_target("set_handler", self.channel, handler)
        self.handler = handler

    def req_notify(self, solicited_only: bool = False) -> None:
        """``ib_rearm_cq``: one channel event at the next (solicited) completion."""
        self._app_armed = True
        self._rearm(solicited_only and not self._waiters)

    def _rearm(self, solicited: bool) -> None:
        with verbs_errors("req_notify"):
            ib_rearm_cq(self.h_cq, solicited)

    def ack_events(self, n: int) -> None:
        """Acknowledge ``n`` channel events."""
        self._acked += n

    async def drive_until(self, ready: Callable[[], object]) -> bool:
        """Not here: IBAL's callbacks run the handler (False)."""
        return False

    def interrupt_wait(self) -> None:
        """Nothing waits in :meth:`drive_until` here."""

    async def serve_in_thread(
        self, wcs: WCArray, on_completions: Callable[[WCArray, int], bool],
        slots: Slots | None = None,
    ) -> bool:  # fmt: skip
        """Not here (False): IBAL's callbacks deliver the completions."""
        return False

    def set_native_handler(self, function: int, context: int, owner: object = None) -> bool:
        """Not here (False): IBAL's callbacks deliver the completions; use
        :meth:`set_handler`."""
        return False

    async def wait(self) -> None:
        """Wait until the CQ holds a completion (polls it for :attr:`busy_poll` seconds,
        then arms IBAL's notification if needed)."""
        while not await spin_until(self._closed_or_ready, self.busy_poll):
            event = trio.Event()
            self._waiters.append(event)
            self._rearm(False)
            if len(self):
                return
            await event.wait()
        if self.closed:
            raise VerbsError(errno.EBADF, "wait", "CQ closed")

    def _closed_or_ready(self) -> bool:
        return self.closed or bool(len(self))

    async def poll_wait(self, num_entries: int = 16) -> list[WC]:
        """Wait for completions and take up to ``num_entries`` (at least one)."""
        while True:
            wcs = self.poll(num_entries)
            if wcs:
                return wcs
            await self.wait()

    async def poll_wait_into(self, wcs: WCArray, num_entries: int | None = None) -> int:
        """Wait for completions and take up to ``num_entries`` into ``wcs`` (at least one)."""
        while True:
            n = self.poll_into(wcs, num_entries)
            if n:
                return n
            await self.wait()

    # ------------------------------------------------------------------ polling
    def poll(self, num_entries: int = 16) -> list[WC]:
        """``ib_poll_cq`` over the CQ's reused free list."""
        numbers = self.context.qp_numbers
        return [to_wc(entry, numbers) for entry in self._poll(num_entries)]

    def poll_into(self, wcs: WCArray, num_entries: int | None = None) -> int:
        """``ib_poll_cq`` over the CQ's free list, the entries' fields into ``wcs``."""
        limit = len(wcs) if num_entries is None else min(num_entries, len(wcs))
        numbers = self.context.qp_numbers
        entries = self._poll(limit)
        wcs.fill([wc_fields(entry, numbers) for entry in entries])
        return len(entries)

    def poll_rows(self, rows: Buffer, num_entries: int | None = None) -> int:
        """``ib_poll_cq`` over the CQ's free list, the entries packed into ``rows`` as
        :data:`~rdmashim.verbs.wr.WC_ROW` rows."""
        view = row_view(rows)
        fit = view.nbytes // WC_ROW.size
        numbers = self.context.qp_numbers
        entries = self._poll(fit if num_entries is None else min(num_entries, fit))
        return pack_rows(view, [wc_fields(entry, numbers) for entry in entries])

    def _poll(self, num_entries: int) -> list[ib_wc_t]:
        """The entries of the free list ``ib_poll_cq`` filled, in order."""
        if num_entries <= 0:
            return []
        free = self._free
        while len(free) < num_entries:
            free.append(ib_wc_t())
        _link(free[:num_entries])
        try:
            _, _, done = ib_poll_cq(self.h_cq, free[0])
        except IbError as exc:
            raise_verbs("poll_cq", exc)
        if done is None:
            return []
        numbers = self.context.qp_numbers
        entries = list(walk(done))
        if any(e.qp_num not in numbers for e in entries):
            self._learn_numbers()
        return entries

    def _learn_numbers(self) -> None:
        """Map the HCA numbers of the context's bound QPs to theirs."""
        for pd in list(self.context.pds):
            for qp in list(pd.qps):
                bound = qp.h_qp.qp
                if bound is not None:
                    self.context.qp_numbers[int(bound.qp_num)] = qp.qp_num

    def __len__(self) -> int:
        """``ib_peek_cq``."""
        if self.closed:
            return 0
        with verbs_errors("poll_cq"):
            return ib_peek_cq(self.h_cq)

    def close(self) -> None:
        """``ib_destroy_cq``."""
        if self.closed:
            return
        self.closed = True
        if not self.h_cq.destroyed:
            _close_users(self.h_cq.users)
            with verbs_errors("destroy_cq"):
                ib_destroy_cq(self.h_cq)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close_users(users: set[IbQp]) -> None:
    """Close the QPs using a CQ or SRQ being closed (verbs lets a queue go first; IBAL
    wants its QPs destroyed before it)."""
    for h_qp in list(users):
        if not h_qp.destroyed and isinstance(h_qp.user_context, QP):
            h_qp.user_context.close()


# ---------------------------------------------------------------------------- work requests
_SEND_TYPE = {
    WROpcode.SEND: (ib_wr_type_t.WR_SEND, ib_send_opt_t.NONE),
    WROpcode.SEND_WITH_IMM: (ib_wr_type_t.WR_SEND, ib_send_opt_t.IB_SEND_OPT_IMMEDIATE),
    WROpcode.SEND_WITH_INV: (ib_wr_type_t.WR_SEND, ib_send_opt_t.IB_SEND_OPT_INVALIDATE),
    WROpcode.RDMA_WRITE: (ib_wr_type_t.WR_RDMA_WRITE, ib_send_opt_t.NONE),
    WROpcode.RDMA_WRITE_WITH_IMM: (
        ib_wr_type_t.WR_RDMA_WRITE,
        ib_send_opt_t.IB_SEND_OPT_IMMEDIATE,
    ),
    WROpcode.RDMA_READ: (ib_wr_type_t.WR_RDMA_READ, ib_send_opt_t.NONE),
    WROpcode.LOCAL_INV: (ib_wr_type_t.WR_LOCAL_INV, ib_send_opt_t.NONE),
}
_SEND_OPT = (
    (SendFlags.SIGNALED, ib_send_opt_t.IB_SEND_OPT_SIGNALED),
    (SendFlags.FENCE, ib_send_opt_t.IB_SEND_OPT_FENCE),
    (SendFlags.SOLICITED, ib_send_opt_t.IB_SEND_OPT_SOLICITED),
    (SendFlags.INLINE, ib_send_opt_t.IB_SEND_OPT_INLINE),
)


def _ds(i: int, operation: str, sges: Sequence[object]) -> list[ib_local_ds_t]:
    out = []
    for s in sges:
        if not isinstance(s, SGE):
            raise _bad(
                NotSupported(operation, "inline bytes: IBAL takes registered memory only"), i
            )
        out.append(ib_local_ds_t(s.addr, s.length, s.lkey))
    return out


def _bad(exc: VerbsError, i: int) -> VerbsError:
    exc.bad_wr = i
    return exc


_L = TypeVar("_L", ib_wc_t, ib_send_wr_t, ib_recv_wr_t)


def _link(items: list[_L]) -> list[_L]:
    """Chain ``items`` through ``p_next``, in order (the last ends the chain)."""
    for a, b in itertools.pairwise(items):
        a.p_next = b
    if items:
        items[-1].p_next = None
    return items


def _send_wr(i: int, w: SendWR) -> ib_send_wr_t:
    problem = request_problem(w)
    if problem:
        raise refused_wr(errno.EINVAL, "post_send", i, problem)
    kind = _SEND_TYPE.get(WROpcode(w.opcode))
    if kind is None:
        raise _bad(NotSupported("post_send", f"{WROpcode(w.opcode).name} over IBAL"), i)
    opt = kind[1]
    for flag, ib in _SEND_OPT:
        if w.send_flags & flag:
            opt |= ib
    return ib_send_wr_t(
        wr_id=w.wr_id, ds_array=_ds(i, "post_send", w.sg_list), wr_type=kind[0],
        send_opt=opt, immediate_data=w.imm_data, invalidate_rkey=w.invalidate_rkey,
        remote_ops=ib_remote_ops_t(w.remote_addr, w.rkey),
    )  # fmt: skip


def _recv_wr(i: int, w: RecvWR) -> ib_recv_wr_t:
    problem = request_problem(w)
    if problem:
        raise refused_wr(errno.EINVAL, "post_recv", i, problem)
    return ib_recv_wr_t(wr_id=w.wr_id, ds_array=_ds(i, "post_recv", w.sg_list))


def send_chain(wrs: list[SendWR]) -> list[ib_send_wr_t]:
    """The linked ``ib_send_wr_t`` of each portable request, in order."""
    return _link([_send_wr(i, w) for i, w in enumerate(wrs)])


def recv_chain(wrs: list[RecvWR]) -> list[ib_recv_wr_t]:
    """The linked ``ib_recv_wr_t`` of each portable request, in order."""
    return _link([_recv_wr(i, w) for i, w in enumerate(wrs)])


class _Converted(list[Any]):
    """A batch's entries as ``ib_*_wr_t``, or the error converting one raised."""

    def __init__(self, n: int, convert: Callable[[int, Any], Any]) -> None:
        super().__init__([None] * n)
        self._convert = convert

    def set(self, i: int, wr: Any) -> None:
        try:
            self[i] = self._convert(i, wr)
        except VerbsError as exc:
            self[i] = exc

    def chain(self, entries: Sequence[int]) -> list[Any]:
        """The chain posting ``entries`` takes (an entry chosen twice is copied); an
        entry that could not be converted raises its error, naming its position, before
        anything is posted (as the plain post's conversion does)."""
        chosen: list[Any] = []
        seen: set[int] = set()
        for k, i in enumerate(entries):
            wr = self[i]
            if isinstance(wr, VerbsError):
                exc = copy.copy(wr)
                exc.bad_wr = k
                raise exc
            chosen.append(copy.copy(wr) if i in seen else wr)
            seen.add(i)
        return _link(chosen)


def _converted(convert: Callable[[int, Any], Any]) -> Callable[[int], _Converted]:
    return lambda n: _Converted(n, convert)


_SEND_FORM = _converted(_send_wr)
_RECV_FORM = _converted(_recv_wr)


def _post_batch(
    operation: str, batch: SendBatch | RecvBatch, form: Callable[[int], _Converted],
    count: int | None, indices: Sequence[int] | None, call: object, handle: object,
) -> None:  # fmt: skip
    """Post the chosen entries of ``batch`` with the IBAL ``call``, as :func:`post` does a
    list (its entries kept converted under the ``form``)."""
    entries = batch.select(operation, count, indices)
    post(operation, batch.prepared(form, form).chain(entries), call, handle)


def post(operation: str, chain: Sequence[object], call: object, handle: object) -> None:
    """Post ``chain`` with the IBAL ``call``; a refusal raises with ``bad_wr`` its index."""
    if not chain:
        return
    try:
        call(handle, chain[0])  # type: ignore[operator]
    except IbError as exc:
        index = next((i for i, w in enumerate(chain) if w is exc.failed_wr), 0)
        try:
            raise_verbs(operation, exc)
        except VerbsError as verr:
            verr.bad_wr = index
            raise


# ---------------------------------------------------------------------------- QPs
_TO_IB_STATE = {
    QPState.RESET: ib_qp_state_t.IB_QPS_RESET,
    QPState.INIT: ib_qp_state_t.IB_QPS_INIT,
    QPState.RTR: ib_qp_state_t.IB_QPS_RTR,
    QPState.RTS: ib_qp_state_t.IB_QPS_RTS,
    QPState.SQD: ib_qp_state_t.IB_QPS_SQD,
    QPState.SQE: ib_qp_state_t.IB_QPS_SQERR,
    QPState.ERR: ib_qp_state_t.IB_QPS_ERROR,
}
_FROM_IB_STATE = {ib: portable for portable, ib in _TO_IB_STATE.items()}


class QP:
    """A queue pair: ``ib_create_qp`` (``h_qp``), unbound until its CM id connects it."""

    def __init__(
        self,
        pd: abc.PD,
        send_cq: abc.CQ,
        recv_cq: abc.CQ,
        cap: QPCap | None,
        srq: abc.SRQ | None,
        sq_sig_all: bool,
    ) -> None:
        self.pd: PD = own_pd(pd, "create_qp")
        self.context: Context = self.pd.context
        self.send_cq = own(send_cq, CQ, "create_qp")
        self.recv_cq = own(recv_cq, CQ, "create_qp")
        self.srq = own(srq, SRQ, "create_qp") if srq is not None else None
        cap = cap or QPCap()
        if cap.max_inline_data:
            raise VerbsError(errno.EINVAL, "create_qp", "max_inline_data > 0 (the device's)")
        self.cap = cap
        self.sq_sig_all = sq_sig_all
        self.qp_type = QPType.RC
        create = ib_qp_create_t(
            sq_depth=cap.max_send_wr, rq_depth=0 if srq is not None else cap.max_recv_wr,
            sq_sge=cap.max_send_sge, rq_sge=cap.max_recv_sge, sq_max_inline=cap.max_inline_data,
            h_sq_cq=self.send_cq.h_cq, h_rq_cq=self.recv_cq.h_cq,
            h_srq=self.srq.h_srq if self.srq is not None else None, sq_signaled=sq_sig_all,
        )  # fmt: skip
        with verbs_errors("create_qp"):
            self.h_qp: IbQp = ib_create_qp(
                self.pd.h_pd, create, self, self.context.event_handler(self)
            )
            ib_modify_qp(self.h_qp, ib_qp_mod_t(ib_qp_state_t.IB_QPS_INIT))
        self.qp_num = next(_QP_NUMBERS)
        """This backend's number (the HCA numbers its QP only when the connection binds it)."""
        self.pd.qps.add(self)
        self.closed = False
        self._gone = trio.Event()

    @property
    def state(self) -> QPState:
        """``ib_query_qp``'s state."""
        if self.h_qp.destroyed:
            return QPState.ERR
        return _FROM_IB_STATE.get(self.h_qp.state, QPState.ERR)

    @property
    def error(self) -> Exception | None:
        """Why the HCA's QP went to ERR, if it did."""
        bound = self.h_qp.qp
        return None if bound is None else bound.error

    def post_send(self, wr: SendWR | Iterable[SendWR]) -> None:
        """``ib_post_send`` of the requests as one chain."""
        post("post_send", send_chain(requests_of(wr, SendWR, "post_send")), ib_post_send, self.h_qp)

    def post_recv(self, wr: RecvWR | Iterable[RecvWR]) -> None:
        """``ib_post_recv`` of the requests as one chain."""
        if self.srq is not None:
            raise VerbsError(errno.EINVAL, "post_recv", "QP uses an SRQ; post to the SRQ")
        post("post_recv", recv_chain(requests_of(wr, RecvWR, "post_recv")), ib_post_recv, self.h_qp)

    def post_send_batch(
        self, batch: SendBatch, count: int | None = None, *, indices: Sequence[int] | None = None
    ) -> None:
        """``ib_post_send`` of the chosen entries' kept ``ib_send_wr_t``, linked."""
        _post_batch("post_send", batch, _SEND_FORM, count, indices, ib_post_send, self.h_qp)

    def post_recv_batch(
        self, batch: RecvBatch, count: int | None = None, *, indices: Sequence[int] | None = None
    ) -> None:
        """``ib_post_recv`` of the chosen entries' kept ``ib_recv_wr_t``, linked."""
        if self.srq is not None:
            raise VerbsError(errno.EINVAL, "post_recv", "QP uses an SRQ; post to the SRQ")
        _post_batch("post_recv", batch, _RECV_FORM, count, indices, ib_post_recv, self.h_qp)

    def run_native_handler(self) -> bool:
        """Not here (False): IBAL calls no native handler (``cq.set_native_handler``)."""
        return False

    def native_runner(self) -> tuple[int, int] | None:
        """None: no native handler to run (see :meth:`run_native_handler`)."""
        return None

    def query(self) -> QPAttr:
        """``ib_query_qp``."""
        with verbs_errors("query_qp"):
            a = ib_query_qp(self.h_qp)
        return QPAttr(
            qp_state=_FROM_IB_STATE.get(a.state, QPState.ERR), qp_type=QPType.RC,
            qp_num=self.qp_num,
            cap=self.cap, max_rd_atomic=a.init_depth, max_dest_rd_atomic=a.resp_res,
            sq_sig_all=self.sq_sig_all,
        )  # fmt: skip

    def modify(self, *, qp_state: QPState, qkey: int | None = None) -> None:
        """``ib_modify_qp`` (a connected QP only goes to ERR: the connection moves it);
        ``qkey`` is for UD QPs, which IBAL over iWARP lacks (EINVAL)."""
        if self.closed:
            raise VerbsError(errno.EBADF, "modify_qp", "QP closed")
        if qkey is not None:
            raise VerbsError(errno.EINVAL, "modify_qp", "qkey: no UD QPs over iWARP")
        with verbs_errors("modify_qp"):
            ib_modify_qp(self.h_qp, ib_qp_mod_t(_TO_IB_STATE[QPState(qp_state)]))

    def connection_ended(self) -> None:
        """The CM saw the connection end (``wait_closed`` returns)."""
        self._gone.set()

    async def wait_closed(self) -> None:
        """Wait until the connection is gone (the CM's DISCONNECTED) or the QP closed."""
        await self._gone.wait()

    def close(self) -> None:
        """``ib_destroy_qp`` (its outstanding work is flushed)."""
        if self.closed:
            return
        self.closed = True
        self._gone.set()
        if not self.h_qp.destroyed:
            with contextlib.suppress(IbError):
                ib_destroy_qp(self.h_qp)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SRQ:
    """A shared receive queue: ``ib_create_srq`` (``h_srq``)."""

    def __init__(self, pd: PD, max_wr: int, max_sge: int) -> None:
        self.pd = pd
        self.max_wr = max_wr
        self.max_sge = max_sge
        with verbs_errors("create_srq"):
            self.h_srq: IbSrq = ib_create_srq(
                pd.h_pd, ib_srq_attr_t(max_wr, max_sge, 0), self, pd.context.event_handler(self)
            )
        self.closed = False

    def post_recv(self, wr: RecvWR | Iterable[RecvWR]) -> None:
        """``ib_post_srq_recv`` of the requests as one chain."""
        post(
            "post_srq_recv",
            recv_chain(requests_of(wr, RecvWR, "post_srq_recv")),
            ib_post_srq_recv,
            self.h_srq,
        )

    def post_recv_batch(
        self, batch: RecvBatch, count: int | None = None, *, indices: Sequence[int] | None = None
    ) -> None:
        """``ib_post_srq_recv`` of the chosen entries' kept ``ib_recv_wr_t``, linked."""
        _post_batch(
            "post_srq_recv", batch, _RECV_FORM, count, indices, ib_post_srq_recv, self.h_srq
        )

    def close(self) -> None:
        """``ib_destroy_srq``."""
        if self.closed:
            return
        self.closed = True
        if not self.h_srq.destroyed:
            _close_users(self.h_srq.users)
            with verbs_errors("destroy_srq"):
                ib_destroy_srq(self.h_srq)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["CQ", "QP", "SRQ", "CompChannel", "to_wc"]
