"""ONC RPC over TCP on real loopback sockets: the server, the client, hostile peers."""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import struct
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
from nfsecho import ECHO, ECHO_DDP, ECHO_PROG, NULL, SLEEP, WHOAMI, Echo

from rdmashim.ulps.nfsrdma.record import RecordDecoder, record_marks
from rdmashim.ulps.nfsrdma.rpc import (
    CallHeader,
    GarbageArgs,
    ProcUnavail,
    ProgUnavail,
    RpcServer,
    decode_reply,
    pack_call_header,
)
from rdmashim.ulps.nfsrdma.service import AuthSys, Reply
from rdmashim.ulps.nfsrdma.tcp import (
    LARGE,
    RpcConnectionError,
    RpcTcpClient,
    _coalesced,
    connect_tcp,
    serve_tcp,
    write_all,
)
from rdmashim.ulps.nfsrdma.xdr import Packer
from rdmashim.verbs.buffers import IOV_MAX


def args(*, blob: bytes | None = None, uint: int | None = None) -> Reply:
    reply = Reply()
    if blob is not None:
        reply.packer.opaque(blob)
    if uint is not None:
        reply.packer.uint(uint)
    return reply


@pytest.fixture
async def port(nursery: trio.Nursery) -> AsyncIterator[int]:
    listeners = await nursery.start(
        lambda task_status: serve_tcp(
            RpcServer([Echo()]),
            0,
            "127.0.0.1",
            max_record=1 << 16,
            record_timeout=1.0,
            task_status=task_status,
        )
    )
    yield listeners[0].socket.getsockname()[1]


async def test_calls_and_results(port: int) -> None:
    async with connect_tcp("127.0.0.1", port) as client:
        assert (await client.call(ECHO_PROG, 1, NULL)).remaining() == 0
        results = await client.call(ECHO_PROG, 1, ECHO, args(blob=b"hello"))
        assert results.opaque() == b"hello"
        results = await client.call(ECHO_PROG, 2, ECHO_DDP, args(blob=b"spliced inline"))
        assert results.opaque() == b"spliced inline"
        results = await client.call(ECHO_PROG, 1, WHOAMI, cred=AuthSys(1, "me", 42, 42))
        assert (results.string(), results.uint()) == ("tcp", 42)


async def test_errors_come_back_as_rpc_errors(port: int) -> None:
    async with connect_tcp("127.0.0.1", port) as client:
        with pytest.raises(ProgUnavail):
            await client.call(100003, 3, NULL)
        with pytest.raises(ProcUnavail):
            await client.call(ECHO_PROG, 1, 77)
        with pytest.raises(GarbageArgs):
            await client.call(ECHO_PROG, 1, ECHO, args(uint=1 << 30))
        assert (
            await client.call(ECHO_PROG, 1, ECHO, args(blob=b"still fine"))
        ).opaque() == b"still fine"


async def test_a_large_message_in_many_segments(port: int) -> None:
    blob = bytes(range(256)) * 200
    async with connect_tcp("127.0.0.1", port) as client:
        assert (await client.call(ECHO_PROG, 1, ECHO, args(blob=blob))).opaque() == blob


async def test_concurrent_calls_on_one_connection_are_answered_out_of_order(port: int) -> None:
    finished: list[int] = []
    async with connect_tcp("127.0.0.1", port) as client:

        async def sleep(ms: int) -> None:
            assert (await client.call(ECHO_PROG, 1, SLEEP, args(uint=ms))).uint() == ms
            finished.append(ms)

        async with trio.open_nursery() as nursery:
            for ms in (300, 200, 100, 0):
                nursery.start_soon(sleep, ms)
                await trio.sleep(0.01)
    assert finished == [0, 100, 200, 300]


async def test_many_connections_and_many_calls(port: int) -> None:
    async def session(n: int) -> None:
        async with connect_tcp("127.0.0.1", port) as client, trio.open_nursery() as nursery:
            for i in range(20):
                blob = f"{n}:{i}".encode()

                async def one(blob: bytes = blob) -> None:
                    assert (await client.call(ECHO_PROG, 1, ECHO, args(blob=blob))).opaque() == blob

                nursery.start_soon(one)

    async with trio.open_nursery() as nursery:
        for n in range(10):
            nursery.start_soon(session, n)


async def raw_exchange(port: int, data: bytes) -> bytes:
    """Send ``data`` on a fresh connection, return everything until the server closes."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(data)
        received = b""
        with trio.fail_after(5):
            while chunk := await stream.receive_some():
                received += chunk
    return received


def null_call(xid: int) -> bytes:
    p = Packer()
    pack_call_header(p, CallHeader(xid, ECHO_PROG, 1, NULL))
    return b"".join(record_marks([p.data]))


async def test_a_record_over_the_bound_closes_only_that_connection(port: int) -> None:
    async with connect_tcp("127.0.0.1", port) as good:
        # a fragment header announcing 2 GiB: the server closes without waiting for it
        assert await raw_exchange(port, struct.pack(">I", 0xFFFF_FFFF)) == b""
        assert (await good.call(ECHO_PROG, 1, ECHO, args(blob=b"ok"))).opaque() == b"ok"


async def test_records_that_are_not_calls_get_no_reply(port: int) -> None:
    garbage = b"".join(b"".join(record_marks([b"\xff" * n])) for n in range(9))
    received = await raw_exchange_half_close(port, garbage + null_call(3))
    assert [decode_reply(r)[0] for r in RecordDecoder().feed(received)] == [3]


async def test_garbage_costs_only_its_connection(port: int) -> None:
    async with connect_tcp("127.0.0.1", port) as good:
        with trio.move_on_after(0.5):  # bytes that are no record: the server waits, then cuts
            await raw_exchange(port, bytes(range(256)) * 3)
        assert (await good.call(ECHO_PROG, 1, NULL)).remaining() == 0


async def test_replies_to_pipelined_raw_calls_then_eof(port: int) -> None:
    received = await raw_exchange_half_close(port, null_call(7) + null_call(8))
    decoder = RecordDecoder()
    xids = sorted(decode_reply(record)[0] for record in decoder.feed(received))
    assert xids == [7, 8]


async def raw_exchange_half_close(port: int, data: bytes) -> bytes:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(data)
        await stream.send_eof()
        received = b""
        with trio.fail_after(5):
            while chunk := await stream.receive_some():
                received += chunk
    return received


async def test_a_slow_record_is_cut_off(port: int) -> None:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    call = null_call(9)
    async with stream, connect_tcp("127.0.0.1", port) as good:
        with trio.fail_after(5):
            for byte in call[:-1]:  # slowloris: a byte every 0.2 s, over the 1 s record bound
                try:
                    await stream.send_all(bytes([byte]))
                except trio.BrokenResourceError:
                    break
                assert (await good.call(ECHO_PROG, 1, NULL)).remaining() == 0
                await trio.sleep(0.2)
            assert await stream.receive_some() == b""  # closed by the server


async def test_the_client_fails_pending_calls_when_the_server_goes(nursery: trio.Nursery) -> None:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]

    async def accept_then_close() -> None:
        stream = await listeners[0].accept()
        await stream.receive_some()
        await stream.aclose()

    nursery.start_soon(accept_then_close)
    async with connect_tcp("127.0.0.1", port) as client:
        with pytest.raises(RpcConnectionError):
            await client.call(ECHO_PROG, 1, NULL)
        with pytest.raises(RpcConnectionError):
            await client.call(ECHO_PROG, 1, NULL)
    await listeners[0].aclose()


async def test_a_reply_for_no_call_is_ignored(nursery: trio.Nursery) -> None:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]

    async def answer_twice() -> None:
        stream = await listeners[0].accept()
        record = RecordDecoder().feed(await stream.receive_some())[0]
        reply = Packer()
        reply.data += bytes(record[:4]) + bytes.fromhex("0000000100000000000000000000000000000000")
        stray = b"\0\0\0\0" + reply.data[4:]
        await stream.send_all(
            b"".join(record_marks([stray])) + b"".join(record_marks([reply.data]))
        )
        await trio.sleep_forever()

    nursery.start_soon(answer_twice)
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    client = RpcTcpClient(stream)
    client._next_xid = 5  # the stray reply's xid 0 belongs to no call
    nursery.start_soon(client.run)
    assert (await client.call(ECHO_PROG, 1, NULL)).remaining() == 0
    await stream.aclose()


async def test_stopping_the_server_ends_threads_blocked_in_read_and_in_write() -> None:
    """A connection's thread waits in the kernel: one idle (in ``read``), one in ``write``
    of replies its peer does not read. Cancelling ``serve_tcp`` shuts both sockets down,
    which ends both threads at once."""
    call = Packer()
    pack_call_header(call, CallHeader(1, ECHO_PROG, 1, ECHO))
    call.opaque(bytes(32 << 10))
    calls = b"".join(record_marks([call.data])) * 200  # 6.4 MB of replies
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(serve_tcp, RpcServer([Echo()]), 0, "127.0.0.1")
            port = listeners[0].socket.getsockname()[1]
            idle = await trio.open_tcp_stream("127.0.0.1", port)
            sock = trio.socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            await sock.connect(("127.0.0.1", port))
            stuck = trio.SocketStream(sock)
            with trio.move_on_after(1):  # the server stops reading once its write blocks
                await stuck.send_all(calls)
            await trio.sleep(0.2)
            nursery.cancel_scope.cancel()
        async with idle, stuck:
            assert await idle.receive_some() == b""  # closed by the server


async def test_a_connection_without_a_descriptor_for_its_thread_costs_only_itself(
    port: int,
) -> None:
    """The server accepts a connection but has no descriptor left for its thread's
    eventfd (RLIMIT_NOFILE): that connection is closed, the server goes on."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    sock = trio.socket.socket()
    highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 2, hard))
    fillers: list[int] = []
    try:
        with contextlib.suppress(OSError):  # every descriptor taken ...
            while True:
                fillers.append(os.open("/dev/null", os.O_RDONLY))
        os.close(fillers.pop())  # ... but the one accept takes
        await sock.connect(("127.0.0.1", port))
        refused = trio.SocketStream(sock)
        with trio.fail_after(5):
            assert await refused.receive_some() == b""  # closed by the server
    finally:
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    await refused.aclose()
    async with connect_tcp("127.0.0.1", port) as good:
        assert (await good.call(ECHO_PROG, 1, NULL)).remaining() == 0


def sleep_call(xid: int, ms: int) -> bytes:
    p = Packer()
    pack_call_header(p, CallHeader(xid, ECHO_PROG, 1, SLEEP))
    p.uint(ms)
    return b"".join(record_marks([p.data]))


@asynccontextmanager
async def capped(max_connections: int) -> AsyncIterator[int]:
    """A server of at most ``max_connections`` connections; its port."""
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            lambda task_status: serve_tcp(
                RpcServer([Echo()]), 0, "127.0.0.1", max_connections=max_connections,
                task_status=task_status,
            )
        )  # fmt: skip
        yield listeners[0].socket.getsockname()[1]
        nursery.cancel_scope.cancel()


async def answered(stream: trio.SocketStream, call: bytes) -> bool:
    """Whether ``call`` on ``stream`` gets a reply (False: the server closed it)."""
    with trio.fail_after(5):
        with contextlib.suppress(trio.BrokenResourceError):
            await stream.send_all(call)
        return bool(await stream.receive_some())


async def test_a_connection_past_the_limit_closes_the_one_idle_the_longest() -> None:
    """At most two connections: a third is served, and the one that has been idle the
    longest is closed for it (the other idle one goes on)."""
    async with capped(2) as port:
        first = await trio.open_tcp_stream("127.0.0.1", port)
        second = await trio.open_tcp_stream("127.0.0.1", port)
        async with first, second:
            assert await answered(first, null_call(1))
            await trio.sleep(0.05)
            assert await answered(second, null_call(2))
            async with await trio.open_tcp_stream("127.0.0.1", port) as third:
                assert await answered(third, null_call(3))
                with trio.fail_after(5):
                    assert await first.receive_some() == b""  # closed for the third
                assert await answered(second, null_call(4))
                assert await answered(third, null_call(5))


async def test_a_connection_past_the_limit_is_closed_when_none_is_idle() -> None:
    """At most two connections, each with a call being carried out: a third is closed at
    once, and the two calls are answered."""
    async with capped(2) as port:
        busy = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(2)]
        for n, stream in enumerate(busy):
            await stream.send_all(sleep_call(n, 700))
        await trio.sleep(0.2)  # (both calls taken up)
        async with await trio.open_tcp_stream("127.0.0.1", port) as third:
            with trio.fail_after(0.4):  # before either call is answered
                assert await third.receive_some() == b""
        for stream in busy:
            async with stream:
                with trio.fail_after(5):
                    assert await stream.receive_some()


def test_write_all_sends_every_buffer_in_order_through_partial_writes() -> None:
    """The server's replies go out with writev from where their data lies: more buffers
    than one writev takes, an empty one, and more bytes than the socket holds at once
    (writev returns part, ending inside a buffer), arrive whole and in order."""
    small = [bytes([i % 251]) * (i % 7 + 1) for i in range(IOV_MAX + 500)]
    big = bytearray(os.urandom(3 << 20))
    buffers: list[bytes | bytearray | memoryview] = [*small, b"", memoryview(big)[5:], b"end", b""]
    expected = b"".join(buffers)
    ours, theirs = socket.socketpair()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
    got = bytearray()

    def drain() -> None:
        while chunk := theirs.recv(1 << 16):
            got.extend(chunk)

    with ours, theirs:
        reader = threading.Thread(target=drain)
        reader.start()
        write_all(ours.fileno(), buffers)
        ours.shutdown(socket.SHUT_WR)
        reader.join(timeout=30)
    assert bytes(got) == expected


def test_a_call_sends_large_data_from_where_it_lies() -> None:
    """A call's small buffers go out joined (one send for a GETATTR's record), a WRITE's
    data as it is: the client does not copy it into one message first."""
    data = memoryview(bytearray(LARGE))
    parts = _coalesced([b"mark", b"header", data, b"pad", b"more"])
    assert parts[0] == b"markheader"
    assert parts[1] is data
    assert parts[2] == b"padmore"
    assert _coalesced([b"mark", b"call"]) == [b"markcall"]
