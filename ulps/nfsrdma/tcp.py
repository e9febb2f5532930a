"""ONC RPC over TCP (RFC 5531 §11): a server for an :class:`~.rpc.RpcServer` and a client.

Each message travels as a record (:mod:`.record`). The server gives every
connection a thread of its own that reads and writes the socket blocking: a
call its program answers at once (an NFS GETATTR, every error reply:
:meth:`~.rpc.RpcServer.call_now`) is answered by that thread, the replies to
all such calls of one read sent together, with no event-loop wake-up at all
(one costs several times such a call: a trio task woken by epoll costs our
server 25 to 45 us of CPU a message here, a thread blocked in ``read`` 6 to
10 us). Any other call is handed to a task of its own in the event loop, up
to ``max_in_flight`` at once per connection (then the thread stops reading,
so TCP pushes back); the task hands its reply back to the thread (an
eventfd wakes it), which sends it. Replies go out in the order they are
ready. A connection whose peer misbehaves (a record over ``max_record``, a
record that takes longer than ``record_timeout`` to arrive, a broken
stream) is closed; the others go on. Cancelling :func:`serve_tcp` shuts
every connection's socket down, which ends its thread.

A thread is dearer than a task, so at most ``max_connections`` connections are
served at once: one more makes room by closing the connection idle the longest
(no call being received or carried out), as the kernel's NFS server does; when
none is idle, the new one is closed. A client whose connection was closed so
connects again (NFS clients do).

:class:`RpcTcpClient` runs any number of calls on one connection at once and
matches the replies by xid; :func:`connect_tcp` opens one (:func:`rpc_client_on`
runs one on a stream opened otherwise, such as a local socket).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import select
import socket
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from rdmashim.ulps.nfsrdma.record import (
    DEFAULT_MAX_RECORD,
    RecordDecoder,
    RecordTooLarge,
    record_marks,
)
from rdmashim.ulps.nfsrdma.rpc import (
    OpaqueAuth,
    PendingCall,
    RpcServer,
    decode_reply,
    encode_call,
)
from rdmashim.ulps.nfsrdma.service import AuthSys, Reply
from rdmashim.ulps.nfsrdma.xdr import Unpacker
from rdmashim.verbs.buffers import IOV_MAX, advance
from rdmashim.verbs.tasks import service_nursery

logger = logging.getLogger(__name__)

RECEIVE_SIZE = 1 << 16
"""The most bytes taken from a stream at once."""
DEFAULT_MAX_IN_FLIGHT = 32
"""Calls of one connection carried out at once by default."""
DEFAULT_RECORD_TIMEOUT = 60.0
"""Seconds a record may take to arrive once its first byte has, by default."""
DEFAULT_MAX_CONNECTIONS = 128
"""Connections (each with a thread) served at once by default (see the module doc)."""


class RpcConnectionError(ConnectionError):
    """The connection of an :class:`RpcTcpClient` is closed or broken; the call has no reply."""


def _peer(stream: trio.SocketStream) -> tuple[str, int]:
    address = stream.socket.getpeername()
    return str(address[0]), int(address[1])


Buffers = list[bytes | bytearray | memoryview]
"""A message's record as buffers to send in order (its data where the program left it)."""
LARGE = 64 * 1024
"""A buffer of a call this large (a WRITE's data) is sent from where it lies."""


def _coalesced(buffers: Buffers) -> Buffers:
    """``buffers`` with each run of small ones joined, the large ones as they are: a
    call goes out in as few sends as its data allows, with no copy of a WRITE's data."""
    out: Buffers = []
    run: Buffers = []
    for buffer in buffers:
        if len(buffer) < LARGE:
            run.append(buffer)
            continue
        if run:
            out.append(b"".join(run))
            run = []
        out.append(buffer)
    if run:
        out.append(b"".join(run))
    return out


def write_all(fd: int, buffers: Buffers) -> None:
    """Send ``buffers`` in order, whole, into the blocking socket ``fd`` with ``writev``:
    a READ's data goes from the buffer it was read into, not copied into one message
    first."""
    while buffers:
        buffers = advance(buffers, os.writev(fd, buffers[:IOV_MAX]))


class _Connection:
    """One accepted connection, read and written by a thread of its own (see the module doc)."""

    def __init__(
        self,
        server: RpcServer,
        stream: trio.SocketStream,
        max_record: int,
        max_in_flight: int,
        record_timeout: float,
    ) -> None:
        self.server = server
        self.stream = stream
        self.peer = _peer(stream)
        self.local = str(stream.socket.getsockname()[0])
        self.decoder = RecordDecoder(max_record)
        self.max_in_flight = max_in_flight
        self.record_timeout = record_timeout
        self.fd = stream.socket.fileno()
        self._wake = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        """Written when a reply made in a task is due (or the connection is to stop)."""
        self._done: deque[Buffers | None] = deque()  # replies made in tasks (None: none made)
        self._outstanding = 0  # calls handed to tasks whose replies the thread has not taken
        self._stopping = False
        self._token = trio.lowlevel.current_trio_token()
        self._nursery: trio.Nursery | None = None
        self.last_read = time.monotonic()
        """When bytes last came (the thread sets it; :meth:`idle_since` reads it)."""

    def idle_since(self) -> float | None:
        """When the connection last did anything, if it is idle now (no call being
        received or carried out, its thread waiting for the peer); None if it is not."""
        if self._outstanding or self.decoder.pending or self._stopping:
            return None
        return self.last_read

    def close_for_room(self) -> None:
        """Close the connection for a new one (its thread ends; see the module doc)."""
        logger.info("tcp %s: closed, idle the longest, to make room for a new one", self.peer)
        self._stopping = True
        with contextlib.suppress(OSError):  # wakes the thread's read
            self.stream.socket.shutdown(socket.SHUT_RDWR)

    async def serve(self) -> None:
        """Answer calls until the peer closes, breaks the rules or the stream breaks."""
        try:
            async with self.stream, trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._stop_when_cancelled)
                await trio.to_thread.run_sync(self._run, limiter=trio.CapacityLimiter(1))
                nursery.cancel_scope.cancel()
        except* Exception:  # (no thread to be had, ...): this connection only
            logger.exception("tcp %s: connection failed", self.peer)
        finally:
            os.close(self._wake)

    async def _stop_when_cancelled(self) -> None:
        try:
            await trio.sleep_forever()
        finally:
            self._stopping = True
            with contextlib.suppress(OSError):  # wakes a read or write in progress
                self.stream.socket.shutdown(socket.SHUT_RDWR)
            os.eventfd_write(self._wake, 1)

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        try:
            os.set_blocking(self.fd, True)
            self._serve_calls()
        except RecordTooLarge as exc:
            logger.warning("tcp %s: %s; closing", self.peer, exc)
        except OSError as exc:
            if not self._stopping:
                logger.info("tcp %s: connection lost: %s", self.peer, exc)
        except Exception:  # a bug must not take the other connections down
            logger.exception("tcp %s: connection failed", self.peer)

    def _serve_calls(self) -> None:
        """Read calls and answer them until the peer's end (and every reply sent)."""
        poller = select.poll()
        poller.register(self._wake, select.POLLIN)
        reading, watching = True, False  # the peer may send more; the socket is polled
        started = 0.0  # when the record being received began to arrive
        while not self._stopping:
            take = reading and self._outstanding < self.max_in_flight
            if take and not self._outstanding and not self.decoder.pending:
                data = os.read(self.fd, RECEIVE_SIZE)  # nothing else to wait for: block here
            elif not take and not self._outstanding:
                return  # the peer's end, every call answered
            else:
                if take != watching:
                    watching = take
                    if take:
                        poller.register(self.fd, select.POLLIN)
                    else:
                        poller.unregister(self.fd)
                timeout = None
                if take and self.decoder.pending:
                    timeout = (started + self.record_timeout - time.monotonic()) * 1000
                    if timeout <= 0:
                        logger.warning(
                            "tcp %s: a record took over %.0f s; closing",
                            self.peer,
                            self.record_timeout,
                        )
                        return
                events = dict(poller.poll(timeout))
                if self._wake in events:
                    self._send_done()
                if not take or self.fd not in events:
                    continue
                data = os.read(self.fd, RECEIVE_SIZE)
            if not data:
                reading = False  # the calls in flight are still answered
                continue
            self.last_read = time.monotonic()
            was_pending = self.decoder.pending
            records = self.decoder.feed(data)
            if self.decoder.pending and (records or not was_pending):
                started = time.monotonic()
            ready: Buffers = []
            for record in records:
                answer = self.server.call_now(memoryview(record), self.peer, "tcp", self.local)
                if isinstance(answer, PendingCall):
                    self._outstanding += 1
                    self._token.run_sync_soon(self._start, answer)
                elif answer is not None:
                    ready += record_marks(answer.inline())
            if ready:
                write_all(self.fd, ready)

    def _send_done(self) -> None:
        """Send the replies the tasks made since the last look."""
        os.eventfd_read(self._wake)
        replies: Buffers = []
        while self._done:
            reply = self._done.popleft()
            self._outstanding -= 1
            if reply is not None:
                replies += reply
        if replies:
            write_all(self.fd, replies)

    # ------------------------------------------------------------------ the tasks
    def _start(self, call: PendingCall) -> None:
        """(In the event loop.) Carry out ``call`` in a task of its own."""
        assert self._nursery is not None
        with contextlib.suppress(RuntimeError):  # the connection ended: nobody takes the reply
            self._nursery.start_soon(self._answer, call)

    async def _answer(self, call: PendingCall) -> None:
        reply = None
        try:
            reply = record_marks((await call.finish()).inline())
        finally:
            self._done.append(reply)
            os.eventfd_write(self._wake, 1)


async def serve_tcp(
    server: RpcServer,
    port: int,
    host: str | None = "0.0.0.0",
    *,
    max_record: int = DEFAULT_MAX_RECORD,
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    record_timeout: float = DEFAULT_RECORD_TIMEOUT,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``server`` on TCP ``port`` of ``host`` (None: every address) until cancelled.

    Started with ``nursery.start``, it returns the listeners (like
    :func:`trio.serve_tcp`): port 0 picks a free port, which
    ``listeners[0].socket.getsockname()[1]`` tells.
    """
    listeners = await trio.open_tcp_listeners(port, host=host)
    task_status.started(listeners)
    await serve_tcp_listeners(
        server, listeners, max_record=max_record, max_in_flight=max_in_flight,
        record_timeout=record_timeout, max_connections=max_connections,
    )  # fmt: skip


async def serve_tcp_listeners(
    server: RpcServer,
    listeners: list[trio.SocketListener],
    *,
    max_record: int = DEFAULT_MAX_RECORD,
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    record_timeout: float = DEFAULT_RECORD_TIMEOUT,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
) -> None:
    """:func:`serve_tcp` on ``listeners`` opened already (closed when it ends)."""
    if max_connections < 1:
        raise ValueError(f"max_connections={max_connections}: at least one is served")
    logger.info("ONC RPC over TCP on %s", [listener.socket.getsockname() for listener in listeners])
    served: set[_Connection] = set()

    async def handle(stream: trio.SocketStream) -> None:
        if len(served) >= max_connections and not _make_room(served):
            logger.warning(
                "tcp: %d connections served, none of them idle (max_connections): "
                "a new one closed", len(served),
            )  # fmt: skip
            await stream.aclose()
            return
        try:
            connection = _Connection(server, stream, max_record, max_in_flight, record_timeout)
        except OSError as exc:  # gone already, or no descriptor left for its eventfd
            logger.info("tcp: a connection not served: %s", exc)
            await stream.aclose()
            return
        served.add(connection)
        try:
            await connection.serve()
        finally:
            served.discard(connection)

    await trio.serve_listeners(handle, listeners)


def _make_room(served: set[_Connection]) -> bool:
    """Close the connection of ``served`` idle the longest; False when none is idle."""
    idle = [(since, id(c), c) for c in served if (since := c.idle_since()) is not None]
    if not idle:
        return False
    victim = min(idle)[2]
    served.discard(victim)
    victim.close_for_room()
    return True


class RpcTcpClient:
    """ONC RPC calls over one TCP connection, many at once, replies matched by xid.

    :meth:`run` must run (in a nursery) to receive the replies;
    :func:`connect_tcp` does that for you.
    """

    def __init__(
        self,
        stream: trio.abc.Stream,
        *,
        cred: OpaqueAuth | AuthSys | None = None,
        max_record: int = DEFAULT_MAX_RECORD,
    ) -> None:
        self.stream = stream
        self.cred = cred
        """The credential of calls that give none (None: AUTH_NONE)."""
        self._max_record = max_record
        self._next_xid = random.getrandbits(32)
        self._waiting: dict[int, _Waiter] = {}
        self._send_lock = trio.Lock()
        self._broken: str | None = None

    def _new_xid(self) -> int:
        while True:
            xid = self._next_xid
            self._next_xid = (xid + 1) & 0xFFFF_FFFF
            if xid not in self._waiting:
                return xid

    async def call(
        self,
        prog: int,
        vers: int,
        proc: int,
        args: Reply | None = None,
        cred: OpaqueAuth | AuthSys | None = None,
    ) -> Unpacker:
        """Call ``prog``/``vers``/``proc`` with ``args``; returns the results to decode.

        A reply that is not SUCCESS raises its :class:`~.rpc.RpcError`; a
        lost connection :class:`RpcConnectionError`.
        """
        if self._broken is not None:
            raise RpcConnectionError(self._broken)
        xid = self._new_xid()
        waiter = self._waiting[xid] = _Waiter()
        try:
            message = encode_call(xid, prog, vers, proc, cred or self.cred, args or Reply())
            async with self._send_lock:
                if self._broken is not None:
                    raise RpcConnectionError(self._broken)
                try:
                    for part in _coalesced(record_marks(message.inline())):
                        await self.stream.send_all(part)
                except trio.Cancelled:
                    self._fail("a call was cancelled while it was being sent")
                    raise
                except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                    self._fail(f"connection lost: {exc}")
                    raise RpcConnectionError(self._broken) from exc
            await waiter.done.wait()
        finally:
            del self._waiting[xid]
        if waiter.record is None:
            raise RpcConnectionError(self._broken)
        return decode_reply(waiter.record)[1]

    def _fail(self, reason: str) -> None:
        if self._broken is None:
            self._broken = reason
        for waiter in self._waiting.values():
            waiter.done.set()

    async def run(self) -> None:
        """Receive replies and hand each to its call, until the connection ends."""
        decoder = RecordDecoder(self._max_record)
        try:
            while data := await self.stream.receive_some(RECEIVE_SIZE):
                for record in decoder.feed(data):
                    self._deliver(record)
            self._fail("the server closed the connection")
        except (trio.BrokenResourceError, trio.ClosedResourceError, RecordTooLarge) as exc:
            self._fail(f"connection lost: {exc}")
        finally:
            self._fail("the client is closed")

    def _deliver(self, record: bytearray | memoryview) -> None:
        xid = int.from_bytes(record[:4], "big") if len(record) >= 4 else None
        waiter = self._waiting.get(xid) if xid is not None else None
        if waiter is None or waiter.done.is_set():
            logger.warning("rpc client: a reply of %d bytes for no call (xid %s)", len(record), xid)
            return
        waiter.record = record
        waiter.done.set()


class _Waiter:
    """A call waiting for its reply."""

    __slots__ = ("done", "record")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.record: bytearray | memoryview | None = None


@asynccontextmanager
async def connect_tcp(
    host: str,
    port: int,
    *,
    cred: OpaqueAuth | AuthSys | None = None,
    max_record: int = DEFAULT_MAX_RECORD,
) -> AsyncIterator[RpcTcpClient]:
    """An :class:`RpcTcpClient` connected to ``host``:``port``, closed when the block ends."""
    stream = await trio.open_tcp_stream(host, port)
    async with rpc_client_on(stream, cred=cred, max_record=max_record) as client:
        yield client


@asynccontextmanager
async def rpc_client_on(
    stream: trio.abc.Stream,
    *,
    cred: OpaqueAuth | AuthSys | None = None,
    max_record: int = DEFAULT_MAX_RECORD,
) -> AsyncIterator[RpcTcpClient]:
    """An :class:`RpcTcpClient` running on ``stream`` (a record-marked byte stream: TCP,
    or a local socket such as rpcbind's), closed with it when the block ends."""
    async with stream, service_nursery() as nursery:
        client = RpcTcpClient(stream, cred=cred, max_record=max_record)
        nursery.start_soon(client.run)
        yield client
