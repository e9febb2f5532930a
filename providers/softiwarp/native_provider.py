"""The built-in transport's verbs objects over the native engine (``docs/native-engine.md``).

A device opened with the native engine (:func:`~.provider.open_device` chooses, see
:mod:`.engines`) keeps every connected QP's protocol state in C (``_engine.c``): the
posted work, the received bytes' parsing, checks and placement, the Terminates and
the completions, in C rings. What stays in Python is what a verbs user sees (the
objects, their checks and errors) and the I/O driver (:class:`~.driver.Link`: trio
waits for the socket; a CQ waiter reads it in place of the receive task), which
here asks C to read and write the socket (one call each, ``rs_qp_read_fd`` and
``rs_qp_flush_fd``). A post on a QP whose socket has room is one call too
(``rs_qp_post_send_fd``): C takes the requests, frames them and writes the bytes.

After every call into C that may complete work (a post, a read, a write, a
deregistration), :meth:`NativeQP._sync` looks at what C says happened since (the
news in the QP's view: completions, a move to ERROR, the peer's RTR) and, for
completions, compares each CQ's counters with what it saw, and wakes, notifies and
hands on exactly as the Python engine's callbacks do; so CQ waiting, arming,
channels and handlers are the provider's own (:class:`~.cq.CQ`). What it looks at
is read from C's memory, not asked for by a call (``rs_qp_view``, ``rs_cq_view``,
``rs_mem_view`` in ``_engine.h``): a crossing into C costs several times a read.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import socket as _stdlib_socket
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import trio

from rdmashim.providers.softiwarp import native, native_serve
from rdmashim.providers.softiwarp.cq import CQ, CompChannel
from rdmashim.providers.softiwarp.jobs import EngineConfig
from rdmashim.providers.softiwarp.native import ffi, lib
from rdmashim.providers.softiwarp.native_cq import NativeCQ
from rdmashim.providers.softiwarp.native_link import NativeEngine, NativeLink
from rdmashim.providers.softiwarp.native_memory import NativeMemoryTable
from rdmashim.providers.softiwarp.native_wr import SHORT, PlanCache, RecvPlan, SendPlan, plan_of
from rdmashim.providers.softiwarp.provider import PD, Context
from rdmashim.providers.softiwarp.qp import SRQ, QPBase
from rdmashim.verbs.attrs import QPCap
from rdmashim.verbs.enums import QPState
from rdmashim.verbs.errors import VerbsError, refused_wr
from rdmashim.verbs.slots import Slots
from rdmashim.verbs.wr import RecvBatch, RecvWR, SendBatch, SendWR, WCArray, requests_of

log = logging.getLogger(__name__)

_NEWS_CQ, _NEWS_STATE, _NEWS_RTR = (
    (lib.RS_NEWS_CQ, lib.RS_NEWS_STATE, lib.RS_NEWS_RTR) if lib is not None else (0, 0, 0)
)
"""C's own numbers (``_engine.h``), bound once."""
_ONE = range(1)


class NativeSRQ(SRQ):
    """A shared receive queue in C (``rs_srq``)."""

    def __init__(self, pd: PD, max_wr: int, max_sge: int) -> None:
        super().__init__(pd, max_wr, max_sge)
        self._ptr = lib.rs_srq_new(max_wr)
        if self._ptr == ffi.NULL:
            raise VerbsError(errno.ENOMEM, "create_srq", f"max_wr={max_wr}")

    def _post(self, plan: RecvPlan, entries: Sequence[int]) -> None:
        memory = self.pd.context.memory
        assert isinstance(memory, NativeMemoryTable)
        refused = plan.post(
            "post_srq_recv", entries, self.max_sge, "SRQ", self.max_wr,
            memory, memory.native.view.epoch, self._ptr, srq=True,
        )  # fmt: skip
        if refused is not None:
            raise refused

    def post_recv(self, wr: RecvWR | Iterable[RecvWR]) -> None:
        """Post one receive work request or a list of them."""
        self._check_open("post_srq_recv")
        wrs = requests_of(wr, RecvWR, "post_srq_recv")
        self._post(plan_of(RecvPlan, wrs), range(len(wrs)))

    def post_recv_batch(
        self, batch: RecvBatch, count: int | None = None, *, indices: Sequence[int] | None = None
    ) -> None:
        """Post entries of a prepared batch (see :meth:`NativeQP.post_recv_batch`)."""
        self._check_open("post_srq_recv")
        entries = batch.select("post_srq_recv", count, indices)
        self._post(batch.prepared(RecvPlan, RecvPlan), entries)

    def close(self) -> None:
        """Destroy the SRQ (C frees it with the last QP using it)."""
        if not self._closed:
            self._leave_parent()
            lib.rs_srq_free(self._ptr)


class NativeQP(QPBase):
    """A reliable-connected queue pair whose protocol state is in C (``rs_qp``)."""

    def __init__(
        self, pd: PD, send_cq: NativeCQ, recv_cq: NativeCQ, cap: QPCap, srq: NativeSRQ | None,
        sq_sig_all: bool,
    ) -> None:  # fmt: skip
        super().__init__(pd, send_cq, recv_cq, cap, srq, sq_sig_all)
        memory = self.context.memory
        assert isinstance(memory, NativeMemoryTable)
        core = native.NativeQP(
            memory.native, pd, self.qp_num, send_cq.ring, recv_cq.ring,
            max_send_wr=cap.max_send_wr, max_recv_wr=cap.max_recv_wr, sq_sig_all=sq_sig_all,
            srq=None if srq is None else srq._ptr,
        )  # fmt: skip
        self._ptr = core._ptr
        self._memview = memory.native.view
        self.engine: NativeEngine = NativeEngine(self, core, memory)
        self._view = core.view
        self._link: NativeLink | None = None
        self._fatal_seen = False
        self._awaiting_rtr = False
        self._cqs = (send_cq,) if send_cq is recv_cq else (send_cq, recv_cq)
        self._send_plans = PlanCache(SendPlan)
        self._recv_plans = PlanCache(RecvPlan)
        self._plan_key = (id(memory), cap.max_send_sge, cap.max_inline_data)
        """What a batch's entry posted here was checked against, but the epoch
        (``SendPlan.singles``)."""
        self._recv_key = (id(memory), cap.max_recv_sge)
        """The same for a receive batch's entry (``RecvPlan.singles``)."""
        self._served_by: int | None = None
        """The thread serving the QP (:meth:`serve_in_thread`), by its ident."""
        self.context._native_qps.add(self)  # type: ignore[attr-defined]

    # ---------------------------------------------------------------- the C side's news
    def _sync(self) -> None:
        """After a call into C: hand on new completions, RTR, and a move to ERROR."""
        view = self._view
        news = view.news
        if not news:
            return
        if self._served_by is not None:
            self._sync_served(news)
            return
        view.news = 0
        if news & _NEWS_CQ:
            for cq in self._cqs:
                cq._sync()
        if news & _NEWS_RTR and self._awaiting_rtr and not lib.rs_qp_rtr_pending(self._ptr):
            self._awaiting_rtr = False
            self.engine.on_ready()
        if news & _NEWS_STATE and not self._fatal_seen and lib.rs_qp_state(self._ptr) >= 2:
            self._fatal_seen = True
            engine = self.engine
            if engine.error is None:
                engine.error = engine.explain()
            self._state = QPState.ERR
            for listener in self.error_listeners:
                listener(engine.error)
            if self._link is not None:
                self._link.failed()
                self._sync()  # (what its write did)

    def _sync_served(self, news: int) -> None:
        """:meth:`_sync` while a thread serves the QP: that thread hands on new
        completions; any other news (and a CQ overrun) waits for the event loop, to
        which the thread gives the QP back when it sees them."""
        if news != _NEWS_CQ or threading.get_ident() != self._served_by:
            return
        cq = self._cqs[0]  # (a served QP has one)
        if not cq._view.overrun:
            self._view.news = 0
            cq._sync()

    async def serve_in_thread(
        self, cq: NativeCQ, wcs: WCArray, on_completions: Callable[[WCArray, int], bool],
        slots: Slots | None = None,
    ) -> bool:  # fmt: skip
        """:meth:`.NativeCQ.serve_in_thread` of this QP's only CQ (see
        :mod:`.native_serve`); False at once unless the QP is connected, no task reads
        it, it has no SRQ, ``cq`` is its send and receive CQ and has no channel or
        handler."""
        link = self._link
        if (
            link is None or not link.can_read or self.srq is not None or self._cqs != (cq,)
            or self._state is not QPState.RTS or cq.channel is not None or cq.handler is not None
            or cq._hooked
        ):  # fmt: skip
            return False
        link._expect(0)  # (the thread waits for any byte: a mark set for a large one goes)
        wake = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        answering = None if slots is None else native_serve.Answering(slots)
        thread = native_serve.Service(self._ptr, link._fd, wake, cq, wcs, on_completions, answering)
        self._served_by = -1  # (the thread's own ident once it runs: the event loop's is not)
        try:
            await link.lend_to_thread(functools.partial(thread.run, self), thread.interrupt)
        finally:
            self._served_by = None
            os.close(wake)
            cq._sync()  # (the thread's polls left the CQ's count to C)
            self._sync()  # what the thread left for the event loop
        return True

    # ---------------------------------------------------------------- posting
    def _post_sends(self, wrs: Sequence[SendWR], plan: SendPlan, entries: Sequence[int]) -> None:
        state = self._state
        if state is not QPState.RTS and state is not QPState.ERR:
            if len(entries):
                raise refused_wr(
                    errno.ENOTCONN, "post_send", 0, f"QP {self.qp_num} is {state.name}"
                )
            return
        cap = self.cap
        room = cap.max_send_wr - self.engine.sq_depth if state is QPState.RTS else len(entries)
        memory = self.context.memory
        refused = plan.post(
            wrs, entries, room, cap.max_send_wr, cap.max_send_sge, cap.max_inline_data,
            memory, self._memview.epoch, self.engine.submit_send, self._plan_key,
        )  # fmt: skip
        self._sync()
        if refused is not None:
            raise refused

    def post_send(self, wr: SendWR | Iterable[SendWR]) -> None:
        """Post one send work request or a list of them (never blocks); errors as the
        Python engine's provider raises them. A request posted again is packed once."""
        if self._closed:
            self._check_open("post_send")
        if type(wr) is list and len(wr) == 1 and type(wr[0]) is SendWR:
            wr = wr[0]  # (a list of one: as the request alone, with no copy made)
        elif not isinstance(wr, SendWR):
            wrs = requests_of(wr, SendWR, "post_send")
            if len(wrs) != 1:
                self._post_sends(wrs, self._send_plans.of_list(wrs), range(len(wrs)))
                return
            wr = wrs[0]  # (a list of one: as the request alone)
        plan = self._send_plans.of(wr)
        quick = plan.quick
        if (
            quick is not None and quick[0] == self._memview.epoch
            and self._state is QPState.RTS and self._view.sq_depth < self.cap.max_send_wr
            and self.engine.submit_send(quick[1], 1)
        ):  # fmt: skip
            if self._view.news:  # (posted again, checked before: straight to C)
                self._sync()
            return
        self._post_sends((wr,), plan, _ONE)

    def run_native_handler(self) -> bool:
        """Run the native handler of the send CQ (``cq.set_native_handler``) now, inside
        one call into C, and write what it posted on this QP; False when none is set."""
        if self._closed:
            self._check_open("run_native_handler")
        if not self._cqs[0]._hooked:  # (the send CQ)
            return False
        self.engine.run_hook()
        if self._view.news:
            self._sync()
        return True

    def native_runner(self) -> tuple[int, int] | None:
        """``rs_run`` and this QP's runner (``rs_runner``): a C call that does what
        :meth:`run_native_handler` does, for a ULP's C (see ``docs/verbs.md``)."""
        return int(lib.rs_run_address()), int(ffi.cast("uintptr_t", self.engine.runner))

    def post_send_batch(
        self, batch: SendBatch, count: int | None = None, *, indices: Sequence[int] | None = None
    ) -> None:
        """Post entries of a prepared batch: each is packed once, posted by copy. An
        entry posted alone again, unchanged, goes straight to C (its checks passed
        at this memory epoch), and so do a few posted together again (``SHORT``)."""
        self._check_open("post_send")
        plan = batch.prepared(SendPlan, SendPlan)
        if indices is not None and count is None and 0 < (n := len(indices)) <= SHORT:
            found = plan.singles.get(indices[0] if n == 1 else tuple(indices))
            if (
                found is not None and found[0] == (self._memview.epoch, self._plan_key)
                and self._state is QPState.RTS
                and self._view.sq_depth + n <= self.cap.max_send_wr
            ):  # fmt: skip
                taken = self.engine.submit_send(found[1], n)
                if self._view.news:
                    self._sync()
                if taken == n:
                    return
                if taken:  # (C refused one the checks passed when noted)
                    raise refused_wr(errno.EINVAL, "post_send", taken, "refused by the engine")
                # (none taken: the post below finds out why and says so)
        entries = batch.select("post_send", count, indices)
        self._post_sends(batch.wrs(entries), plan, entries)

    def _post_recvs(self, plan: RecvPlan, entries: Sequence[int]) -> None:
        if self.srq is not None:
            raise VerbsError(errno.EINVAL, "post_recv", "QP uses an SRQ; post to the SRQ")
        cap = self.cap
        refused = plan.post(
            "post_recv", entries, cap.max_recv_sge, "receive queue", cap.max_recv_wr,
            self.context.memory, self._memview.epoch, self._ptr,
        )  # fmt: skip
        if self._state is QPState.ERR:  # flushed at once
            self._sync()
        if refused is not None:
            raise refused

    def post_recv(self, wr: RecvWR | Iterable[RecvWR]) -> None:
        """Post one receive work request or a list of them (never blocks)."""
        if self._closed:
            self._check_open("post_recv")
        if not isinstance(wr, RecvWR):
            wrs = requests_of(wr, RecvWR, "post_recv")
            if len(wrs) != 1:
                self._post_recvs(self._recv_plans.of_list(wrs), range(len(wrs)))
                return
            wr = wrs[0]  # (a list of one: as the request alone)
        plan = self._recv_plans.of(wr)
        quick = plan.quick
        if (
            quick is not None and quick[0] == self._memview.epoch and self.srq is None
            and self._state is QPState.RTS and lib.rs_qp_post_recv(self._ptr, quick[1], 1)
        ):  # fmt: skip
            return  # (posted again, checked before: straight to C)
        self._post_recvs(plan, _ONE)

    def post_recv_batch(
        self, batch: RecvBatch, count: int | None = None, *, indices: Sequence[int] | None = None
    ) -> None:
        """Post entries of a prepared batch (packed once, posted by copy). An entry
        reposted alone, unchanged, goes straight to C (its checks passed at this memory
        epoch)."""
        self._check_open("post_recv")
        plan = batch.prepared(RecvPlan, RecvPlan)
        if indices is not None and len(indices) == 1 and count is None:
            found = plan.singles.get(indices[0])
            if (
                found is not None and found[0] == (self._memview.epoch, self._recv_key)
                and self.srq is None and self._state is QPState.RTS
                and lib.rs_qp_post_recv(self._ptr, found[1], 1)
            ):  # fmt: skip
                return
        self._post_recvs(plan, batch.select("post_recv", count, indices))

    # ---------------------------------------------------------------- connection
    def when_ready(self, callback: Callable[[], None]) -> None:
        """P2P responder: ``callback`` runs when the initiator's RTR arrives."""
        self.engine.on_ready = callback

    def connect(self, config: EngineConfig, sock: trio.socket.SocketType, leftover: bytes) -> None:
        """MPA is done: C takes the connection, a :class:`NativeLink` its socket."""
        self.engine.start(config)
        sock.setsockopt(_stdlib_socket.IPPROTO_TCP, _stdlib_socket.TCP_NODELAY, True)
        link = self._link = self.engine.link = NativeLink(self.engine, sock, leftover)
        link.after_receive = self.context._after_receive
        self._state = QPState.RTS
        self.context.nursery.start_soon(self._run_link, link)

    async def _run_link(self, link: NativeLink) -> None:
        try:
            await link.run()
        finally:
            self._release()

    def close(self) -> None:
        """Destroy the QP: outstanding work is flushed and the connection dropped."""
        if self._closed:
            return
        self.engine.runner.qp = ffi.NULL  # (rs_run touches it no more)
        if lib.rs_qp_state(self._ptr) != 3:
            self.engine.set_error(ConnectionAbortedError("QP destroyed"))
        self._leave_cqs()
        self._release()

    def _release(self) -> None:
        """Free the C state once the QP is closed and its connection is gone."""
        link = self._link
        if self._closed and (link is None or link.closed.is_set()) and self._ptr is not None:
            self.context._native_qps.discard(self)  # type: ignore[attr-defined]
            self.engine.core.close()
            self._ptr = self.engine.ptr = None


class NativeContext(Context):
    """A device opened with the native engine."""

    def __init__(self, device: Any, nursery: trio.Nursery) -> None:
        super().__init__(device, nursery)
        self.memory = NativeMemoryTable(after_removal=self._sync_qps)
        self._native_qps: set[NativeQP] = set()

    @property
    def engine(self) -> str:
        """Which engine serves this context."""
        return "native"

    def _sync_qps(self) -> None:
        for qp in list(self._native_qps):
            if qp._ptr is not None:
                if qp._link is not None:
                    qp._link.kick()
                qp._sync()

    def _new_cq(self, cqe: int, channel: CompChannel | None) -> CQ:
        return NativeCQ(self, cqe, channel)

    def _new_qp(
        self, pd: PD, send: CQ, recv: CQ, cap: QPCap, srq: SRQ | None, sq_sig_all: bool
    ) -> Any:
        if not isinstance(send, NativeCQ) or not isinstance(recv, NativeCQ):
            raise VerbsError(errno.EINVAL, "create_qp", "a CQ of another engine")
        if srq is not None and not isinstance(srq, NativeSRQ):
            raise VerbsError(errno.EINVAL, "create_qp", "an SRQ of another engine")
        return NativeQP(pd, send, recv, cap, srq, sq_sig_all)

    def _new_srq(self, pd: PD, max_wr: int, max_sge: int) -> SRQ:
        return NativeSRQ(pd, max_wr, max_sge)

    def close(self) -> None:
        """Close the context and everything in it, then its C memory table."""
        if not self._closed:
            super().close()
            memory = self.memory
            assert isinstance(memory, NativeMemoryTable)
            memory.native.close()
