"""Queue pairs and shared receive queues of the built-in engine.

:class:`QPBase` is what both engines' QPs share (attributes, state, ``query``,
``modify``, waiting for the end); :class:`QP` is the Python engine's: ``post_send``
checks the requests (:mod:`.posting`) and hands the engine its jobs, and the
driver writes what the engine frames of them at once; ``post_recv`` queues
receive jobs; ``connect`` starts the engine and its :class:`~.driver.Link`.
:class:`SRQ` is a receive queue several QPs take from.
"""

from __future__ import annotations

import errno
from abc import abstractmethod
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import trio

from rdmashim.providers.softiwarp.engine import Engine
from rdmashim.providers.softiwarp.jobs import (
    EngineConfig,
    EngineState,
    Ready,
    RecvJob,
    RecvRun,
    SendJob,
    SendRun,
)
from rdmashim.providers.softiwarp.memory import Region
from rdmashim.providers.softiwarp.posting import (
    RUN_BYTES,
    TEMPLATES_KEPT,
    U64,
    WIRE_LIMITS,
    KeptRecv,
    RunPlan,
    SendTemplate,
    SendTemplates,
    batch_jobs,
    fields_of,
    inline_bytes,
    queue_recvs,
    recv_job,
    recv_jobs,
    unregistered,
)
from rdmashim.providers.softiwarp.resource import Resource
from rdmashim.providers.softiwarp.terminate import TermCode
from rdmashim.verbs.attrs import QPAttr, QPCap
from rdmashim.verbs.enums import (
    QPState,
    QPType,
    WCOpcode,
    WROpcode,
)
from rdmashim.verbs.errors import (
    NotSupported,
    VerbsError,
    refused_wr,
)
from rdmashim.verbs.wr import (
    WC,
    RecvBatch,
    RecvWR,
    SendBatch,
    SendWR,
    recv_problem,
    requests_of,
    wr_id_problem,
)

if TYPE_CHECKING:
    from rdmashim.providers.softiwarp.cq import CQ
    from rdmashim.providers.softiwarp.driver import Link
    from rdmashim.providers.softiwarp.qp_needs import EngineView, QPDomain


class QPBase(Resource):
    """What both engines' queue pairs share (``ibv_qp``): the attributes, the state a
    user sees, ``query``, ``modify`` and waiting for the connection's end."""

    _kind = "queue pair"
    engine: EngineView
    _link: Link | None

    def __init__(
        self, pd: QPDomain, send_cq: CQ, recv_cq: CQ, cap: QPCap, srq: SRQ | None, sq_sig_all: bool
    ) -> None:
        self.pd = pd
        self.context = pd.context
        self.send_cq = send_cq
        self.recv_cq = recv_cq
        self.cap = cap
        self.srq = srq
        self.sq_sig_all = sq_sig_all
        self.qp_num = next(self.context._qp_numbers)
        self._link = None
        self._state = QPState.INIT
        send_cq._qps[id(self)] = recv_cq._qps[id(self)] = self
        self.error_listeners: list[Callable[[Exception], None]] = []
        """Called with the cause when the QP goes to ERR (the CM reports DISCONNECTED)."""

    @property
    def qp_type(self) -> QPType:
        """Always RC on iWARP."""
        return QPType.RC

    @property
    def state(self) -> QPState:
        """Current state: INIT until connected, RTS, then ERR."""
        return self._state

    @property
    def error(self) -> Exception | None:
        """Why the QP went to ERR (a Terminate's code, a lost connection, ...), if it did."""
        return self.engine.error

    @property
    def remote_terminate(self) -> TermCode | None:
        """The error code of a Terminate the peer sent, if it sent one."""
        return self.engine.remote_terminate

    def query(self) -> QPAttr:
        """Current attributes."""
        cfg = self.engine.config
        return QPAttr(
            qp_state=self._state,
            qp_type=QPType.RC,
            qp_num=self.qp_num,
            cap=self.cap,
            max_rd_atomic=cfg.ord,
            max_dest_rd_atomic=cfg.ird,
            sq_sig_all=self.sq_sig_all,
        )

    def modify(self, *, qp_state: QPState, qkey: int | None = None) -> None:
        """Change state; a user may only move a QP to ERR (the CM moves it to RTS).
        ``qkey`` is for UD QPs, which iWARP lacks (EINVAL)."""
        self._check_open("modify_qp")
        if QPState(qp_state) is not QPState.ERR or qkey is not None:
            raise VerbsError(
                errno.EINVAL,
                "modify_qp",
                f"{QPState(qp_state).name}: iWARP QPs are connected by the CM",
            )
        self.engine.set_error()

    async def wait_closed(self) -> None:
        """Wait until the connection is gone (after ERR, once the socket is closed)."""
        if self._link is not None:
            await self._link.closed.wait()

    @abstractmethod
    def post_send(self, wr: SendWR | Iterable[SendWR]) -> None:
        """Post one send work request or a list of them (never blocks)."""

    @abstractmethod
    def post_recv(self, wr: RecvWR | Iterable[RecvWR]) -> None:
        """Post one receive work request or a list of them (never blocks)."""

    @abstractmethod
    def post_send_batch(
        self, batch: SendBatch, count: int | None = None, *, indices: Sequence[int] | None = None
    ) -> None:
        """Post entries of a prepared send batch."""

    @abstractmethod
    def post_recv_batch(
        self, batch: RecvBatch, count: int | None = None, *, indices: Sequence[int] | None = None
    ) -> None:
        """Post entries of a prepared receive batch."""

    @abstractmethod
    def connect(self, config: EngineConfig, sock: trio.socket.SocketType, leftover: bytes) -> None:
        """MPA is done (``leftover``: the bytes read past its frames): enter RTS and run
        the connection."""

    @abstractmethod
    def when_ready(self, callback: Callable[[], None]) -> None:
        """P2P responder: ``callback`` runs when the initiator's RTR arrives."""

    def run_native_handler(self) -> bool:
        """Not with the Python engine (False): it calls no native handler. The native
        engine's QP runs it (:class:`~.native_provider.NativeQP`)."""
        self._check_open("run_native_handler")
        return False

    def native_runner(self) -> tuple[int, int] | None:
        """None: no native handler to run (see :meth:`run_native_handler`)."""
        return None

    def _leave_cqs(self) -> None:
        self.send_cq._qps.pop(id(self), None)
        self.recv_cq._qps.pop(id(self), None)
        self._leave_parent()


class QP(QPBase):
    """A reliable-connected queue pair on the Python engine."""

    def __init__(
        self, pd: QPDomain, send_cq: CQ, recv_cq: CQ, cap: QPCap, srq: SRQ | None, sq_sig_all: bool
    ) -> None:
        super().__init__(pd, send_cq, recv_cq, cap, srq, sq_sig_all)
        self._rq: deque[RecvJob] = deque()
        self._templates: dict[int, SendTemplate] = {}
        """By the id of the request posted: its template (:meth:`_template`)."""
        self._recvs: dict[int, KeptRecv] = {}
        """By the id of a receive request posted alone (without an SRQ): what its last
        post checked (:meth:`post_recv`)."""
        self.engine: QPEngine = QPEngine(
            qp_num=self.qp_num,
            pd=pd,
            memory=self.context.memory,
            recv_queue=srq._queue if srq is not None else self._rq,
            sq_sig_all=sq_sig_all,
        )
        self.engine.qp = self
        self._on_ready: Callable[[], None] = lambda: None
        """What :meth:`when_ready` was given."""

    def _deliver(self) -> None:
        """Take the engine's outbox: each completion into its CQ, in order (a receive's
        into the receive CQ, the rest into the send CQ); the initiator's RTR runs the
        :meth:`when_ready` callback; the QP's failure moves it to ERR, tells its error
        listeners, flushes its receive queue and has the link send the Terminate."""
        engine = self.engine
        send_cq, recv_cq = self.send_cq, self.recv_cq
        one_cq = send_cq is recv_cq  # (then no completion's opcode need be looked at)
        while engine.outbox:  # (a failure's flushes add more)
            out, engine.outbox = engine.outbox, []
            for item in out:
                if isinstance(item, WC):
                    if one_cq or item.opcode is not WCOpcode.RECV:
                        send_cq._push(item)
                    else:
                        recv_cq._push(item)
                elif isinstance(item, RecvRun):
                    recv_cq._push_run(item)
                elif isinstance(item, list):
                    send_cq._push_all(item)
                elif isinstance(item, Ready):
                    self._on_ready()
                else:
                    self._failed(item.error)

    def _failed(self, exc: Exception) -> None:
        for listener in self.error_listeners:
            listener(exc)
        self._state = QPState.ERR
        jobs = list(self._rq)
        self._rq.clear()
        self.engine.flush_recv(jobs)
        if self._link is not None:
            self._link.failed()

    # ---------------------------------------------------------------- posting
    def post_send(self, wr: SendWR | Iterable[SendWR]) -> None:
        """Post one send work request or a list of them (never blocks).

        Errors in the request itself raise :class:`VerbsError` naming the request
        (``bad_wr``); those before it stay posted. Errors found while processing
        come back as completions.
        """
        if self._closed:
            self._check_open("post_send")
        wrs = (wr,) if wr.__class__ is SendWR else requests_of(wr, SendWR, "post_send")
        self._post_sends(wrs, list(map(self._template, wrs)))

    def _template(self, w: SendWR) -> SendTemplate:
        """The template of ``w``: one made when this object was posted before, while the
        fields it was made of are the same (RDS posts the requests of its send slots
        again and again, a list may repeat a request), else a new one. Two are kept per
        request, the last and the one before: a slot's flags alternate (signaled or
        not), and each miss would work the request out again."""
        kept = self._templates
        t = kept.get(id(w))
        fields = fields_of(w)
        if t is not None:  # (a kept one's made_of is never None)
            if t.made_of == fields:
                return t
            prior = t.prior
            if prior is not None and prior.made_of == fields:  # the flags of before again
                t.prior = None
                prior.prior = t
                kept[id(w)] = prior
                return prior
        new = SendTemplate(w, fields)
        if fields is not None:
            if t is not None:
                t.prior = None
                new.prior = t
            elif len(kept) >= TEMPLATES_KEPT:
                kept.clear()
            kept[id(w)] = new
        return new

    def post_send_batch(
        self, batch: SendBatch, count: int | None = None, *, indices: Sequence[int] | None = None
    ) -> None:
        """Post the first ``count`` entries of a prepared batch (all if None), or the
        entries ``indices`` names, as :meth:`post_send` of that list.

        What does not depend on the QP (the opcode, flags, SGEs, wire limits, the
        region an inline SGE names) is worked out once per entry and kept with the
        batch; each post checks the QP's limits and state, copies inline data and
        makes the engine's job.
        """
        self._check_open("post_send")
        entries = batch.select("post_send", count, indices)
        memory = self.context.memory
        # By the table's id: the templates hold the table, so the id is not reused meanwhile.
        templates = batch.prepared(id(memory), lambda n: SendTemplates(n, memory))
        if isinstance(entries, range):
            wrs = batch.wrs(entries)
            if not self._post_run(wrs, templates.plan(entries.stop)):
                self._post_sends(wrs, templates[: entries.stop])
        else:
            self._post_sends(batch.wrs(entries), [templates[i] for i in entries])

    def _post_run(self, wrs: Sequence[SendWR], plan: RunPlan | None) -> bool:
        """Post ``wrs`` as one run by their batch's ``plan`` when the QP's state and
        limits let every entry pass (what :meth:`_post_sends` would make of them); False
        (nothing posted) otherwise."""
        if plan is None or self._state is not QPState.RTS:
            return False
        cap = self.cap
        engine = self.engine
        if (
            len(wrs) > cap.max_send_wr - engine.sq_depth
            or cap.max_send_sge < 1
            or plan.longest > engine.small_send_max
            or plan.longest_inline > cap.max_inline_data
            or (plan.pd is not None and plan.pd is not self.pd)
        ):
            return False
        engine.post_send(plan.run(wrs))
        self._kick()
        return True

    def _post_sends(self, wrs: Sequence[SendWR], templates: Sequence[SendTemplate]) -> None:
        """Post ``wrs`` (``templates[i]`` made from ``wrs[i]``) in order; the first refused
        raises with ``bad_wr`` its index and the ones before stay posted (and go out)."""
        state = self._state
        if state is not QPState.RTS and state is not QPState.ERR:
            if wrs:
                raise refused_wr(
                    errno.ENOTCONN, "post_send", 0, f"QP {self.qp_num} is {state.name}"
                )
            return
        cap = self.cap
        # Posting to the engine in RTS only queues: the depth grows by one per job.
        room = cap.max_send_wr - self.engine.sq_depth if state is QPState.RTS else len(wrs)
        max_sge, max_inline = cap.max_send_sge, cap.max_inline_data
        post = self.engine.post_send
        memory = self.context.memory
        most = self.engine.small_send_max
        pd = self.pd
        run: SendRun | None = None
        try:
            several = len(templates) > 1
            for i, t in enumerate(templates):
                if not 0 <= wrs[i].wr_id <= U64:
                    raise refused_wr(
                        errno.EINVAL, "post_send", i, wr_id_problem(wrs[i].wr_id) or ""
                    )
                ctrl = t.run_ctrl
                src = t.source
                if (
                    ctrl
                    and i < room
                    and t.nsge <= max_sge
                    and src is not None
                    and (region := src.region) is not None
                    and region.valid
                    and src.length <= most
                    and (t.copied or src.length <= max_inline)
                    and t.remote_addr <= U64 + 1 - src.length
                    and (not t.copied or region.pd is pd)
                ):
                    # The common case: every check below passes.
                    inline: bytes | None = region.view[src.offset : src.end].tobytes()
                    length = src.length
                else:
                    if t.unsupported:
                        raise NotSupported("post_send", f"work request {i}: {t.unsupported}")
                    limit = 1 if t.opcode is WROpcode.RDMA_READ else max_sge
                    if t.nsge > limit:
                        raise refused_wr(errno.EINVAL, "post_send", i, f"{t.nsge} SGEs > {limit}")
                    if i >= room:
                        raise refused_wr(
                            errno.ENOMEM, "post_send", i, f"send queue full ({cap.max_send_wr})"
                        )
                    inline = None
                    parts = t.inline
                    if parts is None:
                        if t.invalid:
                            raise refused_wr(errno.EINVAL, "post_send", i, t.invalid)
                        length = t.length
                        if problem := unregistered(t.local, memory):
                            raise refused_wr(errno.EINVAL, "post_send", i, problem)
                        if src is not None:  # copied when posted: its region looked up now
                            inline = src.read(memory, pd)
                    else:
                        # The engine sends the copy; the SGEs are not kept.
                        if src is not None and (data := src.read(memory)) is not None:
                            inline = data  # looked up (again)
                        elif len(parts) == 1:
                            inline = inline_bytes(i, parts[0], memory)
                        else:
                            inline = b"".join([inline_bytes(i, p, memory) for p in parts])
                        length = len(inline)
                        if length > max_inline:
                            raise refused_wr(
                                errno.EINVAL, "post_send", i,
                                f"{length} inline bytes > {max_inline}",
                            )  # fmt: skip
                        if not (t.keys_fit and t.remote_addr <= U64 + 1 - length):
                            raise refused_wr(errno.EINVAL, "post_send", i, WIRE_LIMITS)
                # A job of its own (a post of one: a run of one costs more), or one more
                # entry of a run.
                if not several or not ctrl or inline is None or length > most:
                    job = SendJob(
                        wrs[i].wr_id, t.opcode, t.flags, t.local, inline, length,
                        t.remote_addr, t.rkey, t.invalidate_rkey,
                    )  # fmt: skip
                    if run is not None:
                        post(run)
                        run = None
                    post(job)
                    continue
                if run is None or run.size >= RUN_BYTES:
                    if run is not None:
                        post(run)
                    run = SendRun()
                run.add(wrs[i].wr_id, ctrl, t.flags, inline, t.invalidate_rkey)
        finally:  # the requests before a refused one are posted: they go out now
            if run is not None:
                post(run)
            self._kick()

    def _kick(self) -> None:
        """Work was posted: the driver writes what the engine frames of it now (and the
        completions of a post to a QP in ERR are handed on)."""
        if self._link is not None:
            self._link.kick()
        if self.engine.outbox:
            self._deliver()

    def post_recv(self, wr: RecvWR | Iterable[RecvWR]) -> None:
        """Post one receive work request or a list of them (never blocks).

        A request posted alone again (a receive reposted as it completes) takes the
        job of its last post while its fields are the same and no region was
        deregistered since (its lkeys still name registered memory), the QP is not in
        ERR and its queue has room: what a first post would do, without the checks.
        """
        if self._closed:
            self._check_open("post_recv")
        memory = self.context.memory
        if wr.__class__ is RecvWR:  # one request: no list to make
            kept = self._recvs.get(id(wr))
            if (
                kept is not None
                and kept.token is memory.token(self.pd)
                and kept.job.wr_id == wr.wr_id
                and kept.job.sges == tuple(wr.sg_list)
                and self._state is not QPState.ERR
                and len(self._rq) < self.cap.max_recv_wr
            ):
                self._rq.append(kept.job)
                return
            token = memory.token(self.pd)  # (before the check: what it found holds under it)
            job = recv_job(wr)
            problem = recv_problem(wr) if job is None else unregistered(job.sges, memory)
            if job is None or problem:
                raise refused_wr(errno.EINVAL, "post_recv", 0, problem or "")
            self._post_recvs((job,), len(job.sges))
            if len(self._recvs) >= TEMPLATES_KEPT:
                self._recvs.clear()
            self._recvs[id(wr)] = KeptRecv(wr, job, token)
            return
        jobs, refused = recv_jobs("post_recv", requests_of(wr, RecvWR, "post_recv"), memory)
        self._post_recvs(jobs)
        if refused is not None:
            raise refused

    def post_recv_batch(
        self, batch: RecvBatch, count: int | None = None, *, indices: Sequence[int] | None = None
    ) -> None:
        """Post the first ``count`` entries of a prepared batch (all if None), or the
        entries ``indices`` names, as :meth:`post_recv` of that list (the engine's
        receive jobs are made once per entry and posted again each time)."""
        self._check_open("post_recv")
        jobs, max_nsge, refused = batch_jobs(batch, "post_recv", count, indices)
        self._post_recvs(jobs, max_nsge)
        if refused is not None:
            raise refused

    def _post_recvs(self, jobs: Sequence[RecvJob], max_nsge: int | None = None) -> None:
        if self.srq is not None:
            raise VerbsError(errno.EINVAL, "post_recv", "QP uses an SRQ; post to the SRQ")
        cap = self.cap
        try:
            queue_recvs(
                "post_recv", self._rq, jobs, cap.max_recv_wr, cap.max_recv_sge,
                "receive queue", max_nsge,
                self.engine.flush_recv if self._state is QPState.ERR else None,
            )  # fmt: skip
        finally:
            if self.engine.outbox:  # (flushed: a QP in ERR)
                self._deliver()

    # ---------------------------------------------------------------- state
    def when_ready(self, callback: Callable[[], None]) -> None:
        """P2P responder: ``callback`` runs when the initiator's RTR arrives."""
        self._on_ready = callback

    def connect(self, config: EngineConfig, sock: trio.socket.SocketType, leftover: bytes) -> None:
        """MPA is done: the engine enters RTS and a :class:`~.driver.Link` runs the socket."""
        from rdmashim.providers.softiwarp.driver import Link

        self.engine.start(config)
        link = Link(self.engine, sock, leftover)
        self._attach(link)
        self.context.nursery.start_soon(link.run)

    def _attach(self, link: Link) -> None:
        self._link = link
        link.after_receive = self.context._after_receive
        link.deliver = self._deliver
        self._state = QPState.RTS if self.engine.state is EngineState.RTS else self._state

    def close(self) -> None:
        """Destroy the QP: outstanding work is flushed and the connection dropped."""
        if self._closed:
            return
        if self.engine.state is not EngineState.ERROR:
            self.engine.set_error(ConnectionAbortedError("QP destroyed"))
        self._leave_cqs()


class QPEngine(Engine):
    """The engine of a :class:`QP`: the QP and its link take the outbox after each call
    they make into it; the two inputs that reach it from elsewhere, ``set_error`` (a
    user's ``modify`` to ERR, the CM's disconnect, a CQ's overrun or failed handler)
    and ``revoke`` (a region deregistered), hand theirs to the QP before they return."""

    qp: QP

    def set_error(self, exc: Exception | None = None) -> None:
        """See :meth:`~.qp_state.QPEngineState.set_error`."""
        super().set_error(exc)
        self.qp._deliver()

    def revoke(self, region: Region) -> None:
        """See :meth:`~.qp_state.QPEngineState.revoke`."""
        super().revoke(region)
        self.qp._deliver()


class SRQ(Resource):
    """A shared receive queue (``ibv_srq``)."""

    _kind = "shared receive queue"

    def __init__(self, pd: QPDomain, max_wr: int, max_sge: int) -> None:
        self.pd = pd
        self.max_wr = max_wr
        self.max_sge = max_sge
        self._queue: deque[RecvJob] = deque()

    def post_recv(self, wr: RecvWR | Iterable[RecvWR]) -> None:
        """Post one receive work request or a list of them."""
        self._check_open("post_srq_recv")
        jobs, refused = recv_jobs(
            "post_srq_recv", requests_of(wr, RecvWR, "post_srq_recv"), self.pd.context.memory
        )
        self._post_jobs(jobs)
        if refused is not None:
            raise refused

    def post_recv_batch(
        self, batch: RecvBatch, count: int | None = None, *, indices: Sequence[int] | None = None
    ) -> None:
        """Post entries of a prepared batch (see :meth:`QP.post_recv_batch`)."""
        self._check_open("post_srq_recv")
        jobs, max_nsge, refused = batch_jobs(batch, "post_srq_recv", count, indices)
        self._post_jobs(jobs, max_nsge)
        if refused is not None:
            raise refused

    def _post_jobs(self, jobs: Sequence[RecvJob], max_nsge: int | None = None) -> None:
        queue_recvs("post_srq_recv", self._queue, jobs, self.max_wr, self.max_sge, "SRQ", max_nsge)

    def close(self) -> None:
        """Destroy the SRQ."""
        self._leave_parent()
