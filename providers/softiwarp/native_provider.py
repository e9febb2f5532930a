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
from typing import Any, Literal

import trio

from rdmashim.providers.softiwarp import native, native_serve
from rdmashim.providers.softiwarp.cq import CQ, CompChannel
from rdmashim.providers.softiwarp.driver import BUSY, Busy, Link
from rdmashim.providers.softiwarp.jobs import EngineConfig, EngineState
from rdmashim.providers.softiwarp.memory import Region
from rdmashim.providers.softiwarp.native import ffi, lib
from rdmashim.providers.softiwarp.native_cq import NativeCQ
from rdmashim.providers.softiwarp.native_memory import NativeMemoryTable
from rdmashim.providers.softiwarp.native_wr import PlanCache, RecvPlan, SendPlan, plan_of
from rdmashim.providers.softiwarp.provider import PD, Context
from rdmashim.providers.softiwarp.qp import SRQ, QPBase
from rdmashim.providers.softiwarp.terminate import ProtocolError, TermCode
from rdmashim.verbs import lending
from rdmashim.verbs.attrs import QPCap
from rdmashim.verbs.enums import QPState
from rdmashim.verbs.errors import VerbsError, refused_wr
from rdmashim.verbs.wr import RecvBatch, RecvWR, SendBatch, SendWR, WCArray, requests_of

log = logging.getLogger(__name__)

_STATES = (EngineState.IDLE, EngineState.RTS, EngineState.TERMINATE, EngineState.ERROR)
_RX_READ = 256 * 1024
"""What one ``rs_qp_read_fd`` reads at most (``RX_READ`` in ``_engine.c``)."""
_EAGAIN = -errno.EAGAIN
_EINTR = -errno.EINTR
_EBUSY = -errno.EBUSY
_ERR_REMOTE = 2
_ERR_USER = 5
# C's own numbers (_engine.h), bound once
_ERR_CQ_OVERRUN = lib.RS_ERR_CQ_OVERRUN if lib is not None else 0
_NEWS_CQ, _NEWS_STATE, _NEWS_RTR = (
    (lib.RS_NEWS_CQ, lib.RS_NEWS_STATE, lib.RS_NEWS_RTR) if lib is not None else (0, 0, 0)
)
_ONE = range(1)
LOWAT_MIN, LOWAT_MAX = 16 * 1024, 1024 * 1024
"""Owed bytes from which a reader waits for them before it looks, and at most how many."""
SPIN_SLICE = 200e-6
"""Seconds a busy-polling waiter spins in C before the other tasks get a turn."""


class NativeEngine:
    """One QP's C state, seen as the Python engine is by the connection setup, the CM
    and the :class:`~.driver.Link` (state, start, errors, bytes in)."""

    def __init__(self, owner: NativeQP, core: native.NativeQP, memory: NativeMemoryTable) -> None:
        self._owner = owner
        self.core = core
        self.ptr = core._ptr
        self.view = core.view
        self.qp_num = core.qp_num
        self.memory = memory
        self.config = EngineConfig()
        self.on_ready: Callable[[], None] = lambda: None
        """P2P responder: called when the initiator's RTR arrives (the CM's ESTABLISHED)."""
        self.error: Exception | None = None
        self.remote_terminate: TermCode | None = None

    @property
    def state(self) -> EngineState:
        """The protocol state."""
        return _STATES[lib.rs_qp_state(self.ptr)]

    @property
    def tx_ready(self) -> bool:
        """Whether bytes wait to be sent."""
        return bool(self.view.tx_ready)

    @property
    def bytes_received(self) -> int:
        """Bytes received ever (busy polling watches it)."""
        return int(lib.rs_qp_rx_total(self.ptr))

    @property
    def sq_depth(self) -> int:
        """Send work requests posted and not completed."""
        return int(self.view.sq_depth)

    def start(self, config: EngineConfig) -> None:
        """Enter RTS with what MPA negotiated."""
        self.core.start(config)
        self.config = config
        self._owner._awaiting_rtr = config.wait_for_rtr

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Bytes from the peer (those read with the MPA exchange)."""
        self.core.receive(data)
        self._owner._sync()

    def set_error(self, exc: Exception | None = None) -> None:
        """Move to ERROR (the user, the CM, a failed handler): flush everything."""
        self._fail(exc or ConnectionAbortedError("QP moved to ERROR"))

    def connection_lost(self, exc: Exception | None = None) -> None:
        """The TCP connection closed or failed."""
        self._fail(exc or ConnectionResetError("connection closed by peer"))

    def _fail(self, exc: Exception) -> None:
        if lib.rs_qp_state(self.ptr) == 3:  # ERROR already
            return
        self.error = self.error or exc
        lib.rs_qp_set_error(self.ptr, _ERR_USER, str(exc).encode()[:150])
        self._owner._sync()

    @property
    def kind(self) -> int:
        """Why C moved the QP to ERROR (``RS_ERR_*``; 0 while it has not)."""
        return int(self.core.error[0])

    def explain(self) -> Exception:
        """Why C moved the QP to ERROR, as the Python engine says it."""
        kind, code, message = self.core.error
        if kind == _ERR_CQ_OVERRUN:
            full = [cq for cq in self._owner._cqs if cq._view.overrun]
            return full[0].overrun_error() if full else VerbsError(errno.EOVERFLOW, "cq", message)
        if kind == _ERR_REMOTE:
            self.remote_terminate = code
            meaning = code.meaning
            text = (
                f"the peer ended the connection: {meaning}"
                if meaning
                else "the peer ended the connection with a Terminate"
            )
            return ProtocolError(text, code)
        if kind == _ERR_USER:
            return ConnectionResetError(message)
        return ProtocolError(message, code)


class NativeLink(Link):
    """The trio I/O of one native QP: the socket's bytes go to C and back in one call."""

    def __init__(self, engine: NativeEngine, sock: trio.socket.SocketType, leftover: bytes) -> None:
        super().__init__(engine, sock, leftover)  # type: ignore[arg-type]
        self._ptr = engine.ptr
        self._view = engine.view
        self._sync = engine._owner._sync
        self._lowat = 1
        """The socket's SO_RCVLOWAT (:meth:`_expect`)."""
        self._got = ffi.new("int64_t *")
        """What ``rs_qp_wait_poll_fd``'s read returned."""
        self._trio_first = False
        """:meth:`wait_poll` found trio with work (or its time up): the wait that follows
        goes through trio at once, not through another idle ``poll``."""
        self.idle_ok = True
        """Whether the last idle wait read (or was never tried): :meth:`wait_poll` is
        tried only then (both ends of a ping-pong in one run never wait idle)."""

    def revoke(self, region: Region) -> None:
        """C holds what waits to be written: nothing here views a region."""

    def flush(self) -> None:
        """Write what C framed until it has nothing more or the socket is full."""
        self._pending = []
        n = lib.rs_qp_flush_fd(self._ptr, self._fd)
        if n:
            self.stopped_by(n)
        elif lib.rs_qp_state(self._ptr) == 3:
            self._tx_wakeup.set()  # let the transmit task end the connection
        self._sync()

    def stopped_by(self, n: int) -> None:
        """A write into the socket ended with ``-errno`` ``n``: the socket is full
        (``-EAGAIN``: the transmit task waits for room and goes on) or failed (C is in
        ERROR: the transmit task ends the connection)."""
        if self.threaded:  # (C keeps it: the serving thread's wait writes it, or sees ERROR)
            return
        if n == _EAGAIN:
            self._pending = [b""]  # (what the transmit task waits to write)
        self._tx_wakeup.set()

    def _read(self) -> bool | None:
        """Read once into C; whether the socket is (probably) empty now, None at its end."""
        return self._took(lib.rs_qp_read_fd(self._ptr, self._fd))

    def _read_idle(self) -> bool | Literal[Busy.BUSY] | None:
        """The wait and the read in one call into C, without the GIL (see
        :meth:`.driver.Link._read_idle`)."""
        if self._trio_first:
            self._trio_first = False
            return BUSY
        found = self._wait.idle()
        n = _EBUSY if found is None else lib.rs_qp_wait_read_fd(self._ptr, self._fd, *found)
        self.idle_ok = n != _EBUSY
        if n == _EBUSY:
            return BUSY
        return self._took(n)

    def wait_poll(self, cq: NativeCQ, out: Any, summary: Any, n: int, spin: float) -> int:
        """A waiter's next wait when it takes the socket on again (a ping-pong): the
        busy polling for ``spin`` seconds, the idle wait, the read and the poll of up to
        ``n`` completions of ``cq`` (this QP's only CQ) into the C rows ``out`` (what
        they have in common in ``summary``) in one call into C
        (``rs_qp_wait_poll_fd``). The rows taken; 0 when nothing was, or when this wait
        must go through :meth:`read_until`: the socket was not lent to the waiter or its
        last read did not empty it, the other tasks are due a turn
        (:data:`~rdmashim.verbs.lending.READS_BEFORE_YIELD`), trio has other work, or
        ``spin`` is longer than one slice (:data:`SPIN_SLICE`). What was read is
        processed as :meth:`read_until`'s reads are, and the socket lent again.
        """
        loan = self._loan
        if (
            not loan.active or not self._drained or spin > SPIN_SLICE
            or self._streak >= lending.READS_BEFORE_YIELD
        ):  # fmt: skip
            return 0
        loan.end()
        found = self._wait.idle()
        taken = 0
        if found is None:
            self.idle_ok = False
        else:
            got = self._got
            taken = lib.rs_qp_wait_poll_fd(
                self._ptr, self._fd, int(spin * 1e9), found[0], found[1], cq._ptr,
                out, n, summary, got,
            )  # fmt: skip
            if got[0] == _EBUSY:
                self.idle_ok = False
                self._trio_first = True
            else:
                self._streak += 1
                self._took(got[0])
        if self._rx_stopped:
            self.hand_back()  # (the receive task ends the connection)
        else:
            loan.lend()
        return int(taken)

    async def _spin(self, seconds: float) -> bool | None:
        """Busy polling in C, without the GIL: read until bytes come, for at most
        ``seconds`` (and :data:`SPIN_SLICE`, then the other tasks run)."""
        ns = int(min(seconds, SPIN_SLICE) * 1e9)
        n = lib.rs_qp_spin_fd(self._ptr, self._fd, ns)
        if n == _EAGAIN:
            await trio.lowlevel.checkpoint()
        return self._took(n)

    def _took(self, n: int) -> bool | None:
        """What a read into C of ``n`` bytes (or -errno) means: whether the socket is
        (probably) empty now, None at its end."""
        if n == _EAGAIN:
            self._drained = True
            return True
        if n == _EINTR:
            return False
        if n <= 0:  # the peer's FIN or a socket error: C moved to ERROR
            self._rx_stopped = True
            self.flush()
            return None
        view = self._view
        if view.tx_ready and not self._pending:  # Read Responses, ...
            self.flush()  # (it syncs)
        else:
            self._sync()
        owed = view.rx_owed
        if owed >= LOWAT_MIN or self._lowat != 1:  # (else the mark stays 1: nothing to do)
            self._expect(owed)
        self._drained = drained = n < _RX_READ
        return drained

    def _expect(self, owed: int) -> None:
        """Let the socket say it is readable only once ``owed`` bytes (what the peer
        owes: the rest of an FPDU, of the responses to our Reads; at most
        :data:`LOWAT_MAX`) are there, not at every segment: a peer that sends a large
        response in small pieces (Linux siw: one FPDU a TCP segment) wakes its reader a
        few times, not once a segment. Only bytes that must come are waited for, and a
        FIN or an error wakes the reader whatever the mark."""
        mark = min(owed, LOWAT_MAX) if owed >= LOWAT_MIN else 1
        if mark != self._lowat:
            self._lowat = mark
            self.sock.setsockopt(_stdlib_socket.SOL_SOCKET, _stdlib_socket.SO_RCVLOWAT, mark)


class NativeSRQ(SRQ):
    """A shared receive queue in C (``rs_srq``)."""

    def __init__(self, pd: PD, max_wr: int, max_sge: int) -> None:
        super().__init__(pd, max_wr, max_sge)
        self._ptr = lib.rs_srq_new(max_wr)
        if self._ptr == ffi.NULL:
            raise VerbsError(errno.ENOMEM, "create_srq", f"max_wr={max_wr}")

    def _submit(self, table: Any, n: int, at: Any) -> int:
        if at is None:
            return int(lib.rs_srq_post(self._ptr, table, n))
        return int(lib.rs_srq_post_at(self._ptr, table, len(table), at, n))

    def _post(self, plan: RecvPlan, entries: Sequence[int]) -> None:
        memory = self.pd.context.memory
        assert isinstance(memory, NativeMemoryTable)
        refused = plan.post(
            "post_srq_recv", entries, self.max_sge, "SRQ", self.max_wr,
            memory, memory.native.view.epoch, self._submit,
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
        self._wrote = ffi.new("int64_t *")
        """Where ``rs_qp_post_send_fd`` says how its writes ended."""
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
        self, cq: NativeCQ, wcs: WCArray, on_completions: Callable[[WCArray, int], bool]
    ) -> bool:
        """:meth:`.NativeCQ.serve_in_thread` of this QP's only CQ (see
        :mod:`.native_serve`); False at once unless the QP is connected, no task reads
        it, it has no SRQ, ``cq`` is its send and receive CQ and has no channel or
        handler."""
        link = self._link
        if (
            link is None or not link.can_read or self.srq is not None or self._cqs != (cq,)
            or self._state is not QPState.RTS or cq.channel is not None or cq.handler is not None
        ):  # fmt: skip
            return False
        link._expect(0)  # (the thread waits for any byte: a mark set for a large one goes)
        wake = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        thread = native_serve.Service(self._ptr, link._fd, wake, cq, wcs, on_completions)
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
    def _submit_send(self, array: Any, n: int) -> int:
        """Give C ``n`` packed requests; when the socket has room, C writes their
        bytes in the same call. How many C took."""
        why, link = self.engine.core._why, self._link
        if link is None or link._pending:  # not connected, or the transmit task waits
            return int(lib.rs_qp_post_send(self._ptr, array, n, why))
        wrote = self._wrote
        taken = lib.rs_qp_post_send_fd(self._ptr, array, n, why, link._fd, wrote)
        if wrote[0]:
            link.stopped_by(wrote[0])
        return int(taken)

    def _submit_recv(self, table: Any, n: int, at: Any) -> int:
        if at is None:
            return int(lib.rs_qp_post_recv(self._ptr, table, n))
        return int(lib.rs_qp_post_recv_at(self._ptr, table, len(table), at, n))

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
            memory, self._memview.epoch, self._submit_send, self._plan_key,
        )  # fmt: skip
        self._sync()
        if refused is not None:
            raise refused

    def post_send(self, wr: SendWR | Iterable[SendWR]) -> None:
        """Post one send work request or a list of them (never blocks); errors as the
        Python engine's provider raises them. A request posted again is packed once."""
        if self._closed:
            self._check_open("post_send")
        if not isinstance(wr, SendWR):
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
            and self._submit_send(quick[1], 1)
        ):  # fmt: skip
            self._sync()  # (posted again, checked before: straight to C)
            return
        self._post_sends((wr,), plan, _ONE)

    def post_send_batch(
        self, batch: SendBatch, count: int | None = None, *, indices: Sequence[int] | None = None
    ) -> None:
        """Post entries of a prepared batch: each is packed once, posted by copy. An
        entry posted alone again, unchanged, goes straight to C (its checks passed
        at this memory epoch)."""
        self._check_open("post_send")
        plan = batch.prepared(SendPlan, SendPlan)
        if indices is not None and len(indices) == 1 and count is None:
            found = plan.singles.get(indices[0])
            if (
                found is not None and found[0] == (self._memview.epoch, self._plan_key)
                and self._state is QPState.RTS and self._view.sq_depth < self.cap.max_send_wr
                and self._submit_send(found[1], 1)
            ):  # fmt: skip
                self._sync()
                return
        entries = batch.select("post_send", count, indices)
        self._post_sends(batch.wrs(entries), plan, entries)

    def _post_recvs(self, plan: RecvPlan, entries: Sequence[int]) -> None:
        if self.srq is not None:
            raise VerbsError(errno.EINVAL, "post_recv", "QP uses an SRQ; post to the SRQ")
        cap = self.cap
        refused = plan.post(
            "post_recv", entries, cap.max_recv_sge, "receive queue", cap.max_recv_wr,
            self.context.memory, self._memview.epoch, self._submit_recv,
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
        link = self._link = NativeLink(self.engine, sock, leftover)
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
                qp._sync()
                if qp._link is not None:
                    qp._link.kick()

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
