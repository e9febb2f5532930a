"""The trio-style layer over the CM: ``open_connection`` and ``serve``.

::

    async with rdmashim.cm.open_connection("server", 7471, private_data=b"hi") as conn:
        conn.qp.post_send(...)

    async def handler(request):
        request.qp.post_recv(...)            # before accepting: the peer may send at once
        conn = await request.accept(private_data=b"welcome")
        ...

    async with trio.open_nursery() as nursery:
        server = await nursery.start(rdmashim.cm.serve, handler, 7471)

Each connection brings its own PD, CQ and QP on the device the route chose;
the handler (or the caller of ``open_connection``) posts receives and work
requests on them. Leaving the block (or the handler returning) disconnects.

One CQ takes both queues' completions by default (``conn.cq``; ``conn.send_cq``
and ``conn.recv_cq`` are that same CQ): a program polling it sees its own
signaled Sends, Writes and Reads complete beside its receives. With
``separate_cqs=True`` a connection has two, as librdmacm's ``rdma_create_ep``
makes them: sends complete in ``send_cq``, receives in ``recv_cq``.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import NamedTuple

import trio

from rdmashim.cm.abc import CMId
from rdmashim.cm.addressing import SockAddr
from rdmashim.cm.channel import EventChannel
from rdmashim.cm.errors import CMError, setup_error
from rdmashim.cm.types import (
    DEFAULT_MAX_PENDING,
    CMEvent,
    CMEventType,
    ConnParam,
    TransportOptions,
)
from rdmashim.verbs.abc import CQ, PD, QP, Context
from rdmashim.verbs.attrs import QPCap
from rdmashim.verbs.errors import VerbsError

log = logging.getLogger(__name__)

E = CMEventType
PORT_CLASH_ATTEMPTS = 3
"""Connects :func:`open_connection` tries when the local port the CM chose is in use."""
CLOSE_TIMEOUT = 5.0
"""Seconds ``aclose`` waits for the connection to close before dropping it."""


class _Router:
    """Delivers a channel's events to whoever waits on their id."""

    def __init__(self, channel: EventChannel) -> None:
        self.channel = channel
        self._queues: dict[
            CMId, tuple[trio.MemorySendChannel[CMEvent], trio.MemoryReceiveChannel[CMEvent]]
        ] = {}
        self.requests_send, self.requests = trio.open_memory_channel[CMEvent](64)

    def watch(self, cm_id: CMId) -> None:
        self._queues[cm_id] = trio.open_memory_channel[CMEvent](64)

    def forget(self, cm_id: CMId) -> None:
        """Stop routing ``cm_id``'s events; whoever waits on them gets EndOfChannel."""
        queue = self._queues.pop(cm_id, None)
        if queue is not None:
            queue[0].close()

    async def next(self, cm_id: CMId) -> CMEvent:
        queue = self._queues.get(cm_id)
        if queue is None:
            raise trio.EndOfChannel(f"{cm_id} is no longer routed")
        return await queue[1].receive()

    async def run(self) -> None:
        async for event in self.channel:
            event.ack()
            if event.event == E.CONNECT_REQUEST:
                self.watch(event.id)
                await self.requests_send.send(event)
            elif event.id in self._queues:
                self._queues[event.id][0].send_nowait(event)
            del event  # else the loop keeps the last event's id alive until the next


class _OnId:
    """What a connection and a connection request tell about their CM id, and the
    verbs resources they hold."""

    __slots__ = {
        "_resources": "The verbs resources made for the connection, and whether the PD was.",
        "_router": "Delivers the id's CM events.",
        "id": "The CM id (``rdma_cm_id``): addresses, state, negotiated transport options.",
        "pd": "The protection domain of the QP: register the connection's regions here.",
        "private_data": "What the peer sent with its connect (a request) or its accept.",
        "qp": "The queue pair: ``post_send``, ``post_recv`` and their batches.",
        "recv_cq": "The CQ receives complete in: ``send_cq`` too, unless ``separate_cqs``.",
        "send_cq": "The CQ the QP's Sends, RDMA Writes and Reads complete in.",
    }

    def __init__(
        self, cm_id: CMId, resources: _Resources, private_data: bytes, router: _Router
    ) -> None:
        self.id = cm_id
        self.pd, self.send_cq, self.recv_cq, self.qp, _ = self._resources = resources
        self.private_data = private_data
        self._router = router

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id.local_addr} with {self.id.peer_addr}>"

    def _release(self) -> None:
        """Destroy the QP and CQs, and the PD unless it is shared, and stop routing the
        id's events (idempotent)."""
        self._router.forget(self.id)
        self.qp.close()
        self.send_cq.close()
        self.recv_cq.close()
        if self._resources.own_pd:
            self.pd.close()

    @property
    def cq(self) -> CQ:
        """The connection's one CQ, where its Sends, Writes and Reads and its receives
        all complete (tell them apart by ``wc.opcode``): ``send_cq`` and ``recv_cq``
        are both this CQ unless the connection was made with ``separate_cqs=True``,
        when there is none (AttributeError)."""
        if self.send_cq is not self.recv_cq:
            raise AttributeError("this connection has separate CQs: use send_cq and recv_cq")
        return self.send_cq

    @property
    def context(self) -> Context:
        """The device context: the one the route chose, or the request arrived on."""
        return _context_of(self.id)

    @property
    def local_addr(self) -> SockAddr:
        """Our (address, port)."""
        return _address(self.id.local_addr)

    @property
    def peer_addr(self) -> SockAddr:
        """The peer's (address, port)."""
        return _address(self.id.peer_addr)


class Connection(_OnId):
    """An established connection and the verbs resources it runs on (from
    :func:`open_connection`, or a :func:`serve` handler's ``accept``).

    Post work on ``qp``, poll ``cq`` (or ``send_cq`` and ``recv_cq``), register
    regions on ``pd``; ``private_data`` is what the peer said in its accept (or
    connect). Leaving ``open_connection``'s block, or the handler returning,
    closes it.
    """

    __slots__ = {
        "_closed": "Set when the TCP connection is gone too (TIMEWAIT_EXIT).",
        "_disconnected": "Set when the connection ended, from either side.",
        "_released": "Whether aclose ran.",
    }

    def __init__(
        self, cm_id: CMId, resources: _Resources, private_data: bytes, router: _Router
    ) -> None:
        super().__init__(cm_id, resources, private_data, router)
        self._disconnected = trio.Event()
        self._closed = trio.Event()
        self._released = False

    async def _follow(self) -> None:
        while not self._closed.is_set():
            try:
                event = await self._router.next(self.id)
            except trio.EndOfChannel:  # released
                self._disconnected.set()
                self._closed.set()
                return
            if event.event == E.DISCONNECTED:
                self._disconnected.set()
            elif event.event in (E.TIMEWAIT_EXIT, E.DEVICE_REMOVAL):
                self._disconnected.set()
                self._closed.set()

    async def wait_disconnected(self) -> None:
        """Wait until the connection ends (from either side)."""
        await self._disconnected.wait()

    async def aclose(self) -> None:
        """Disconnect, wait (boundedly) for the TCP connection to close and destroy the
        QP and CQ, and the PD unless shared (idempotent)."""
        if self._released:
            return
        self._released = True
        if not self._disconnected.is_set():
            self.id.disconnect()
        with trio.move_on_after(CLOSE_TIMEOUT):
            await self.qp.wait_closed()  # the TCP connection is gone (TIMEWAIT_EXIT follows)
        self.id.destroy()
        self._release()


@asynccontextmanager
async def open_device_for(address: str, *, backend: str | None = None) -> AsyncIterator[Context]:
    """The device context the CM uses for the local ``address``, open in the block.

    A PD allocated on it can be shared by :func:`open_connection` and
    :func:`serve` connections from and to that address (``pd=``).
    """
    async with EventChannel(backend=backend) as channel:
        cm_id = channel.create_id()
        cm_id.resolve_addr((address, 0), (address, 0))
        event = await channel.get_event()
        event.ack()
        if event.event != E.ADDR_RESOLVED:
            raise setup_error(event, address, 0)
        try:
            yield _context_of(cm_id)
        finally:
            cm_id.destroy()


def _address(addr: SockAddr | None) -> SockAddr:
    """An address a connected (or requested) id always has."""
    assert addr is not None, "a connection's id has both addresses"
    return addr


def _context_of(cm_id: CMId) -> Context:
    """The device context of a resolved (or requested) id."""
    context = cm_id.context
    if context is None:
        raise VerbsError(errno.EINVAL, "cm", f"{cm_id} has no device context")
    return context


class _Resources(NamedTuple):
    """What a connection runs on; ``own_pd``: the PD was made for it (else it is shared)."""

    pd: PD
    send_cq: CQ
    recv_cq: CQ
    qp: QP
    own_pd: bool


@dataclass(frozen=True)
class _Plan:
    """What each connection gets: its QP's ``cap``, CQs of ``cqe`` entries (one for both
    queues, or one each with ``separate_cqs``), on ``pd`` or a PD of its own."""

    cap: QPCap | None
    cqe: int
    pd: PD | None
    separate_cqs: bool

    def make(self, cm_id: CMId) -> _Resources:
        """The PD, send CQ, receive CQ and QP of a connection on the id's device."""
        context = _context_of(cm_id)
        conn_pd = context.alloc_pd() if self.pd is None else self.pd
        made: list[CQ] = []
        try:
            made.append(context.create_cq(self.cqe))
            if self.separate_cqs:
                made.append(context.create_cq(self.cqe))
            send_cq, recv_cq = made[0], made[-1]
            qp = cm_id.create_qp(conn_pd, send_cq=send_cq, recv_cq=recv_cq, cap=self.cap)
        except BaseException:
            for cq in made:
                cq.close()
            if self.pd is None:
                conn_pd.close()
            raise
        return _Resources(conn_pd, send_cq, recv_cq, qp, own_pd=self.pd is None)


def _contexts_of(pd: PD | None) -> tuple[Context, ...]:
    """The device context a shared PD brings to the event channel."""
    return () if pd is None else (pd.context,)


async def _expect(
    router: _Router, cm_id: CMId, kind: CMEventType, peer: SockAddr, *, passive: bool = False
) -> CMEvent:
    """The next event of ``cm_id`` if it is ``kind``, else its :class:`CMError` naming
    ``peer`` (what the user connects to, or where an accepted connection comes from)."""
    event = await router.next(cm_id)
    if event.event != kind:
        raise setup_error(event, str(peer[0]), int(peer[1]), passive=passive)
    return event


@asynccontextmanager
async def open_connection(
    host: str,
    port: int,
    *,
    private_data: bytes = b"",
    cap: QPCap | None = None,
    cqe: int = 256,
    responder_resources: int = 16,
    initiator_depth: int = 16,
    options: TransportOptions | None = None,
    connect_timeout: float = 10.0,
    prepare: Callable[[Connection], None] | None = None,
    pd: PD | None = None,
    separate_cqs: bool = False,
    backend: str | None = None,
    source: str | None = None,
) -> AsyncIterator[Connection]:
    """Connect to ``host``:``port`` and yield the :class:`Connection`.

    ``prepare(conn)`` runs after the QP exists and before connecting (post
    receives there when the peer may send first); when the local port the CM
    chose is in use, the attempt is dropped (its QP and CQ destroyed) and
    ``prepare`` runs again for the next one. The connection gets a PD of
    its own unless ``pd`` is given: then its QP is created on that PD (whose
    device the route must choose), so regions registered there serve it too.
    ``backend`` picks the backend (default: ``pd``'s, else ``RDMASHIM_BACKEND``);
    ``options`` sets up the transport (MPA CRC, revision, peer-to-peer), where the
    backend lets the application choose (else NotSupported). The connection's
    completions go to one CQ of ``cqe`` entries (``conn.cq``, which ``send_cq`` and
    ``recv_cq`` both are), or with ``separate_cqs`` to a send CQ and a receive CQ of
    ``cqe`` entries each. ``source`` (an IP address of this host) connects from that
    address and its device; by default the routing table picks them, as it does
    for TCP. Raises :class:`ConnectionRejected`,
    :class:`ConnectionUnreachable` or :class:`CMError`.
    """
    plan = _Plan(cap, cqe, pd, separate_cqs)
    async with EventChannel(_contexts_of(pd), backend=backend) as channel:
        router = _Router(channel)
        channel.nursery.start_soon(router.run)
        for attempt in range(1, PORT_CLASH_ATTEMPTS + 1):
            cm_id = channel.create_id()
            router.watch(cm_id)
            cm_id.resolve_addr(None if source is None else (source, 0), (host, port))
            await _expect(router, cm_id, E.ADDR_RESOLVED, (host, port))
            cm_id.resolve_route()
            await _expect(router, cm_id, E.ROUTE_RESOLVED, (host, port))
            conn = Connection(cm_id, plan.make(cm_id), b"", router)
            if options is not None:
                cm_id.options = options
            cm_id.connect_timeout = connect_timeout
            if prepare is not None:
                prepare(conn)
            try:
                cm_id.connect(ConnParam(private_data, responder_resources, initiator_depth))
                break
            except VerbsError as exc:
                if exc.errno != errno.EADDRINUSE or attempt == PORT_CLASH_ATTEMPTS:
                    raise
                # The kernel's rdma_cm picked a local port whose TCP connection to this
                # peer is still in TIME_WAIT (siw connects inside rdma_connect): a new
                # id gets a new port.
                log.info("connect to %s:%d: local port in use, again with a new one", host, port)
                cm_id.destroy()
                conn._release()
        event = await _expect(router, cm_id, E.ESTABLISHED, (host, port))
        # Cancelled while ESTABLISHED came (a task beside ours failed): the channel's
        # device tasks are closing the context under us; raise Cancelled here rather
        # than hand out a connection whose PD is already gone.
        await trio.lowlevel.checkpoint_if_cancelled()
        conn.private_data = event.private_data
        channel.nursery.start_soon(conn._follow)
        try:
            yield conn
        finally:
            with trio.CancelScope(shield=True):
                await conn.aclose()


class ConnectionRequest(_OnId):
    """An incoming connection, given to a :func:`serve` handler.

    The PD, CQ(s) and QP exist already: post receives before accepting (the peer
    may send as soon as it is connected). ``private_data`` is what the peer sent
    with its connect, ``param`` its IRD/ORD wishes; then ``await accept(...)``
    (which returns the :class:`Connection`) or ``await reject(...)``.
    """

    __slots__ = {
        "_answered": "Whether accept or reject was called.",
        "_connection": "The connection once accepted.",
        "_setup_failure": "The CMError accept raised because the peer went away.",
        "param": "The peer's wishes from our side: the RDMA Reads it wants us to serve "
        "(``responder_resources``) and to issue (``initiator_depth``).",
    }

    def __init__(self, event: CMEvent, resources: _Resources, router: _Router) -> None:
        super().__init__(event.id, resources, event.private_data, router)
        assert event.param is not None, "a CONNECT_REQUEST carries the peer's parameters"
        self.param = event.param
        self._connection: Connection | None = None
        self._answered = False
        self._setup_failure: CMError | None = None

    async def accept(
        self,
        *,
        private_data: bytes = b"",
        responder_resources: int | None = None,
        initiator_depth: int | None = None,
    ) -> Connection:
        """Accept; returns the connection once ESTABLISHED."""
        self._answered = True
        self.id.accept(
            ConnParam(
                private_data,
                self.param.responder_resources
                if responder_resources is None
                else responder_resources,
                self.param.initiator_depth if initiator_depth is None else initiator_depth,
            )
        )
        try:
            await _expect(self._router, self.id, E.ESTABLISHED, self.peer_addr, passive=True)
        except CMError as exc:
            self._setup_failure = exc
            raise
        conn = Connection(self.id, self._resources, self.private_data, self._router)
        self._router.channel.nursery.start_soon(conn._follow)
        self._connection = conn
        return conn

    async def reject(self, private_data: bytes = b"") -> None:
        """Reject with ``private_data``."""
        self._answered = True
        self.id.reject(private_data)
        await trio.lowlevel.checkpoint()

    async def aclose(self) -> None:
        """Close the accepted connection, or else release the id and the QP, CQ and
        (unless shared) PD made for the request (idempotent). A request still
        unanswered is rejected first."""
        if not self._answered:
            await self.reject(b"")
        if self._connection is not None:
            await self._connection.aclose()
        else:
            self.id.destroy()
            self._release()


async def serve(
    handler: Callable[[ConnectionRequest], Awaitable[None]],
    port: int,
    *,
    host: str = "0.0.0.0",
    cap: QPCap | None = None,
    cqe: int = 256,
    options: TransportOptions | None = None,
    handler_nursery: trio.Nursery | None = None,
    pd: PD | None = None,
    separate_cqs: bool = False,
    backend: str | None = None,
    max_pending: int = DEFAULT_MAX_PENDING,
    task_status: trio.TaskStatus[SockAddr | None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Listen on ``host``:``port`` and run ``handler(request)`` for each connection.

    Use with ``nursery.start``: it reports the listening (address, port). A
    handler that returns without accepting or rejecting rejects; an accepted
    connection is closed when its handler returns. Every connection's QP is
    created on ``pd`` when given (as for :func:`open_connection`), and ``backend``,
    ``options``, ``cqe`` and ``separate_cqs`` work as there. At most ``max_pending``
    connections wait for their MPA Request or for their handler's answer (see
    :attr:`CMId.max_pending`).

    A handler's exception is not contained: its connection is closed, and the
    exception comes out of ``serve`` (which then stops, closing every connection),
    or out of ``handler_nursery`` when given, whatever else fails meanwhile (a
    client that sees the closed connection fails too: both come out). A handler
    that must keep the listener going catches its errors itself. The one exception
    ``serve`` takes is the :class:`CMError` of the handler's own ``accept`` when the
    peer went away before the connection was established: logged at INFO, nothing
    else happens.
    """
    plan = _Plan(cap, cqe, pd, separate_cqs)
    async with EventChannel(_contexts_of(pd), backend=backend) as channel:
        router = _Router(channel)
        channel.nursery.start_soon(router.run)
        listen_id = channel.create_id()
        if options is not None:
            listen_id.options = options
        listen_id.max_pending = max_pending
        listen_id.bind_addr((host, port))
        listen_id.listen()
        task_status.started(listen_id.local_addr)
        async with trio.open_nursery() as own_nursery:
            nursery = handler_nursery or own_nursery
            async for event in router.requests:
                _start_handler(nursery, handler, event, router, plan)
                del event  # else the loop keeps the last connection alive until the next


def _start_handler(
    nursery: trio.Nursery,
    handler: Callable[[ConnectionRequest], Awaitable[None]],
    event: CMEvent,
    router: _Router,
    plan: _Plan,
) -> None:
    """Make a CONNECT_REQUEST's resources and run ``handler`` on it (or reject it)."""
    try:
        resources = plan.make(event.id)
    except VerbsError as exc:  # e.g. the request came in on another device
        log.warning("connection from %s refused: %s", event.id.peer_addr, exc)
        try:
            event.id.reject(b"")
        except VerbsError as failed:  # (destroying the id drops the request all the same)
            log.info("rejecting the connection from %s failed: %s", event.id.peer_addr, failed)
        event.id.destroy()
        router.forget(event.id)
        return
    request = ConnectionRequest(event, resources, router)
    nursery.start_soon(_run_handler, handler, request)


async def _run_handler(
    handler: Callable[[ConnectionRequest], Awaitable[None]], request: ConnectionRequest
) -> None:
    """Run ``handler``, then close its connection. Its exceptions go on (see :func:`serve`)
    but for the one its own ``accept`` raised because the peer went away."""
    failed = True
    try:
        await handler(request)
        failed = False
    except CMError as exc:
        if exc is not request._setup_failure:
            raise
        failed = False
        log.info("connection from %s not set up: %s", request.peer_addr, exc)
    finally:
        with trio.CancelScope(shield=True):
            try:
                await request.aclose()
            except Exception:
                if not failed:
                    raise
                # The handler's own error is the news; closing after it failed too.
                log.exception("closing the connection from %s failed", request.peer_addr)
