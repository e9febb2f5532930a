"""ONC RPC over TCP (RFC 5531 §11): a server for an :class:`~.rpc.RpcServer` and a client.

Each message travels as a record (:mod:`.record`). The server reads the calls
of every connection in one task. A call its program answers at once (an NFS
GETATTR, every error reply: :meth:`~.rpc.RpcServer.call_now`) is answered by
that task, the replies to all such calls of one read sent together; any other
call is answered in a task of its own, up to ``max_in_flight`` at once per
connection (then it stops reading, so TCP pushes back). Replies go out in the
order they are ready. A connection whose
peer misbehaves (a record over ``max_record``, a record that takes longer
than ``record_timeout`` to arrive, a broken stream) is closed; the others go
on.

:class:`RpcTcpClient` runs any number of calls on one connection at once and
matches the replies by xid; :func:`connect_tcp` opens one (:func:`rpc_client_on`
runs one on a stream opened otherwise, such as a local socket).
"""

from __future__ import annotations

import logging
import math
import os
import random
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
from rdmashim.verbs.tasks import service_nursery

logger = logging.getLogger(__name__)

RECEIVE_SIZE = 1 << 16
"""The most bytes taken from a stream at once."""
DEFAULT_MAX_IN_FLIGHT = 32
"""Calls of one connection carried out at once by default."""
DEFAULT_RECORD_TIMEOUT = 60.0
"""Seconds a record may take to arrive once its first byte has, by default."""
BURST = 16
"""Reads in a row a connection takes without a checkpoint (then it lets others run)."""


class RpcConnectionError(ConnectionError):
    """The connection of an :class:`RpcTcpClient` is closed or broken; the call has no reply."""


def _peer(stream: trio.SocketStream) -> tuple[str, int]:
    address = stream.socket.getpeername()
    return str(address[0]), int(address[1])


def _framed(reply: Reply) -> bytes:
    return b"".join(record_marks(reply.inline()))


class _Connection:
    """One accepted connection: reads its calls, answers each in its own task."""

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
        self.in_flight = trio.Semaphore(max_in_flight)
        self.record_timeout = record_timeout
        self.send_lock = trio.Lock()
        self.fd = stream.socket.fileno()
        """Read and written directly (non-blocking): a call and its reply need no
        checkpoint when the socket has the bytes and room (trio's stream takes two)."""

    async def serve(self) -> None:
        """Answer calls until the peer closes, breaks the rules or the stream breaks."""
        try:
            async with self.stream, trio.open_nursery() as nursery:
                await self._read_calls(nursery)
        except* RecordTooLarge as group:
            logger.warning("tcp %s: %s; closing", self.peer, group.exceptions[0])
        except* (trio.BrokenResourceError, trio.ClosedResourceError) as group:
            logger.info("tcp %s: connection lost: %s", self.peer, group.exceptions[0])
        except* Exception:  # a bug must not take the other connections down
            logger.exception("tcp %s: connection failed", self.peer)

    async def _read_calls(self, nursery: trio.Nursery) -> None:
        started = 0.0  # when the record being received began to arrive
        burst = 0  # reads in a row that found bytes at once
        while True:
            data = self._read_now() if burst < BURST else None
            if data is None:  # nothing there: wait (a checkpoint) for some
                burst = 0
                deadline = started + self.record_timeout if self.decoder.pending else math.inf
                with trio.move_on_at(deadline):
                    await trio.lowlevel.wait_readable(self.fd)
                    data = self._read_now()
                if data is None:
                    if trio.current_time() < deadline:
                        continue
                    logger.warning(
                        "tcp %s: a record took over %.0f s; closing", self.peer, self.record_timeout
                    )
                    nursery.cancel_scope.cancel()
                    return
            burst += 1
            if not data:
                return  # the calls in flight are still answered
            was_pending = self.decoder.pending
            records = self.decoder.feed(data)
            if self.decoder.pending and (records or not was_pending):
                started = trio.current_time()
            ready: list[bytes | bytearray | memoryview] = []
            for record in records:
                answer = self.server.call_now(memoryview(record), self.peer, "tcp", self.local)
                if isinstance(answer, PendingCall):
                    await self.in_flight.acquire()
                    nursery.start_soon(self._answer, answer)
                elif answer is not None:
                    ready += record_marks(answer.inline())
            if ready:
                await self._send(b"".join(ready))

    def _read_now(self) -> bytes | None:
        """What the socket holds now (b"" at the peer's end), None if nothing yet."""
        try:
            return os.read(self.fd, RECEIVE_SIZE)
        except BlockingIOError:
            return None
        except OSError as exc:
            raise trio.BrokenResourceError(f"receive failed: {exc}") from exc

    async def _send(self, data: bytes) -> None:
        """Send ``data`` whole, one reply after another: at once when the socket takes it."""
        lock = self.send_lock
        if lock.locked():
            await lock.acquire()
        else:
            lock.acquire_nowait()  # no checkpoint: the socket may take it all now
        try:
            view = memoryview(data)
            while view:
                try:
                    view = view[os.write(self.fd, view) :]
                except BlockingIOError:
                    await trio.lowlevel.wait_writable(self.fd)
                except OSError as exc:
                    raise trio.BrokenResourceError(f"send failed: {exc}") from exc
        finally:
            lock.release()

    async def _answer(self, call: PendingCall) -> None:
        try:
            await self._send(_framed(await call.finish()))
        finally:
            self.in_flight.release()


async def serve_tcp(
    server: RpcServer,
    port: int,
    host: str | None = "0.0.0.0",
    *,
    max_record: int = DEFAULT_MAX_RECORD,
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    record_timeout: float = DEFAULT_RECORD_TIMEOUT,
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
        record_timeout=record_timeout,
    )  # fmt: skip


async def serve_tcp_listeners(
    server: RpcServer,
    listeners: list[trio.SocketListener],
    *,
    max_record: int = DEFAULT_MAX_RECORD,
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    record_timeout: float = DEFAULT_RECORD_TIMEOUT,
) -> None:
    """:func:`serve_tcp` on ``listeners`` opened already (closed when it ends)."""
    logger.info("ONC RPC over TCP on %s", [listener.socket.getsockname() for listener in listeners])

    async def handle(stream: trio.SocketStream) -> None:
        await _Connection(server, stream, max_record, max_in_flight, record_timeout).serve()

    await trio.serve_listeners(handle, listeners)


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
                    await self.stream.send_all(_framed(message))
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

    def _deliver(self, record: bytearray) -> None:
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
        self.record: bytearray | None = None


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
