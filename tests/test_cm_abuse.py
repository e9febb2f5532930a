"""The CM under abuse: strangers that send garbage, stall, or reset at every byte of
MPA setup must not take the listener down nor keep a good client out.

Real sockets on loopback. A stranger is a plain TCP socket; a reset is a close
with ``SO_LINGER`` 0.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import logging
import resource
import socket
import struct
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio

from rdmashim import Access, QPState
from rdmashim.cm import CMError, ConnectionRequest, open_connection, serve
from rdmashim.providers.softiwarp import ddp, mpa
from rdmashim.providers.softiwarp.cm_id import CMId
from rdmashim.providers.softiwarp.connection import MPA_REPLY_TIMEOUT
from rdmashim.providers.softiwarp.engine import Engine

LOOPBACK = "127.0.0.1"
GOOD_CLIENT_BOUND = 20.0
"""Seconds a good client may take to connect while the abuse goes on (a generous
bound for a slow, shared machine; the measured time is printed with ``-s``)."""


async def accept_and_wait(request: ConnectionRequest) -> None:
    """A server handler: accept and hold the connection until the peer leaves."""
    conn = await request.accept(private_data=b"welcome")
    await conn.wait_disconnected()


def _reset(sock: trio.socket.SocketType) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


async def stranger(port: int, data: bytes, *, reset: bool = True) -> None:
    """Connect, send ``data``, and leave with a reset (or a FIN)."""
    sock = trio.socket.socket()
    try:
        await sock.connect((LOOPBACK, port))
        if data:
            await sock.send(data)
    finally:
        if reset:
            _reset(sock)
        else:
            sock.close()


async def good_client(port: int) -> float:
    """Connect with open_connection; returns the seconds it took."""
    start = trio.current_time()
    with trio.fail_after(GOOD_CLIENT_BOUND):
        async with open_connection(LOOPBACK, port, private_data=b"good") as conn:
            assert conn.private_data == b"welcome"
            took = trio.current_time() - start
    return took


async def start_server(nursery: trio.Nursery, **kwargs: Any) -> int:
    addr = await nursery.start(partial(serve, accept_and_wait, 0, host=LOOPBACK, **kwargs))
    return addr[1]


async def test_garbage_then_reset_leaves_serve_running() -> None:
    """The issue's crash: bytes that are not an MPA Request, then a reset."""
    async with trio.open_nursery() as nursery:
        port = await start_server(nursery)
        for data in (b"GET / HTTP/1.0\r\n\r\n", b"MPA ID Req Frame\xff\xff\xff\xff", b"\0", b""):
            for _ in range(20):
                await stranger(port, data)
        await trio.sleep(0.5)  # the server reads each and fails it
        await good_client(port)
        nursery.cancel_scope.cancel()


REQUEST = mpa.encode_start_frame(mpa.StartFrame(reply=False, ird=16, ord=16, private_data=b"abuse"))
"""A valid MPA Request (rev 2, IRD/ORD block, private data) whose bytes strangers cut."""


async def _closed_by_server(sock: trio.socket.SocketType) -> bool:
    """Whether the server closes ``sock`` (EOF or reset) within half a second."""
    with trio.move_on_after(0.5):
        try:
            return await sock.recv(64) == b""
        except ConnectionResetError:
            return True
    return False


async def test_pending_bound_drops_the_oldest_stalled_connection(caplog: Any) -> None:
    """Past ``max_pending``, the oldest connection still owing its MPA Request goes, with
    one warning (not one per connection), and a good client still gets in."""
    caplog.set_level(logging.WARNING, logger="rdmashim.providers.softiwarp.cm_id")
    async with trio.open_nursery() as nursery:
        port = await start_server(nursery, max_pending=4)
        stalled = []
        for _ in range(10):
            sock = trio.socket.socket()
            await sock.connect((LOOPBACK, port))
            await sock.send(REQUEST[:10])
            stalled.append(sock)
            await trio.sleep(0.05)  # accepted in this order
        await good_client(port)
        closed = [await _closed_by_server(sock) for sock in stalled]
        assert closed[:6] == [True] * 6  # the oldest went first (one more for the client)
        assert closed[-3:] == [False] * 3  # the newest still wait (their 5 s are not over)
        warnings = [r for r in caplog.records if "max_pending (4)" in r.getMessage()]
        assert len(warnings) == 1, warnings
        for sock in stalled:
            sock.close()
        nursery.cancel_scope.cancel()


async def test_pending_bound_refuses_new_connections_when_requests_are_unanswered() -> None:
    """CONNECT_REQUESTs the application holds count too; beyond the bound a new
    connection is closed at once (its client fails fast) and the held ones live on."""
    answer = trio.Event()

    async def slow_handler(request: ConnectionRequest) -> None:
        await answer.wait()
        await accept_and_wait(request)

    async with trio.open_nursery() as nursery:
        addr = await nursery.start(partial(serve, slow_handler, 0, host=LOOPBACK, max_pending=2))
        port = addr[1]
        held: list[float] = []
        both_in = trio.Event()

        async def held_client() -> None:
            held.append(await good_client(port))
            if len(held) == 2:
                both_in.set()

        nursery.start_soon(held_client)
        nursery.start_soon(held_client)
        await trio.sleep(1)
        start = trio.current_time()
        with pytest.raises(CMError), trio.fail_after(5):
            async with open_connection(LOOPBACK, port):
                pass
        assert trio.current_time() - start < 5
        answer.set()
        with trio.fail_after(GOOD_CLIENT_BOUND):
            await both_in.wait()
        nursery.cancel_scope.cancel()


ABUSERS = 1000
REPLY = mpa.encode_start_frame(mpa.StartFrame(reply=True, ird=16, ord=16, private_data=b"no"))


def _abuse_plan() -> list[tuple[bytes, str]]:
    """(bytes sent, how the connection ends) for each abusive connection: the Request
    cut at every byte and then a reset, a FIN or a stall until the test ends; the
    whole Request then a reset (the peer vanishes before the accept); garbage."""
    kinds = [(REQUEST[:k], end) for k in range(len(REQUEST)) for end in ("reset", "fin", "stall")]
    kinds += [(REQUEST, "reset"), (b"\xff" * 64, "reset"), (bytes(range(256)), "fin")]
    kinds += [(b"MPA ID Rep Frame" + REQUEST[16:], "reset")]
    return [kinds[i % len(kinds)] for i in range(ABUSERS)]


async def _abuse(port: int, data: bytes, end: str, stall: trio.Event) -> None:
    sock = trio.socket.socket()
    try:
        with trio.move_on_after(5):  # a full backlog: the connect waits, then gives up
            await sock.connect((LOOPBACK, port))
            if data:
                await sock.send(data)
        if end == "stall":
            await stall.wait()
    except OSError:
        pass  # the server dropped us first: fine
    finally:
        if end == "fin":
            sock.close()
        else:
            _reset(sock)


async def test_good_client_connects_while_a_thousand_strangers_abuse_the_listener(
    caplog: Any,
) -> None:
    """A thousand connections cut the MPA Request at every byte (reset or FIN), stall
    with half a Request, or send garbage; good clients that connect meanwhile get in
    within GOOD_CLIENT_BOUND, and afterwards nothing of the strangers is left."""
    caplog.set_level(logging.INFO, logger="rdmashim.providers.softiwarp.cm_id")
    took: list[float] = []
    async with trio.open_nursery() as nursery:
        port = await start_server(nursery)
        stall = trio.Event()
        async with trio.open_nursery() as abusers:
            for i, (data, end) in enumerate(_abuse_plan()):
                abusers.start_soon(_abuse, port, data, end, stall)
                await trio.lowlevel.checkpoint()
                if i % 200 == 100:
                    took.append(await good_client(port))
            took.append(await good_client(port))
            stall.set()
        took.append(await good_client(port))
        nursery.cancel_scope.cancel()
    print(f"good clients connected in {max(took):.3f} s at most ({len(took)} clients)")
    assert max(took) < GOOD_CLIENT_BOUND
    messages = [r.getMessage() for r in caplog.records]
    dropped = sum("dropping connection from" in m for m in messages)
    print(f"{dropped} strangers dropped for what they sent")
    assert dropped > ABUSERS // 2
    assert sum("max_pending (256)" in m for m in messages) == 1  # the bound held, one warning
    gc.collect()  # nothing of any connection is left (the log records hold the listener)
    left = [
        o
        for o in gc.get_objects()
        if isinstance(o, Engine) or (isinstance(o, CMId) and o.peer_addr is not None)
    ]
    assert left == [], left


async def _fake_responder(
    listener: trio.SocketListener, reply: bytes, end: str, task_status: Any
) -> None:
    """Accept one connection, read the Request, send ``reply``, then reset or stall."""
    task_status.started()
    stream = await listener.accept()
    await stream.receive_some(4096)
    if reply:
        await stream.send_all(reply)
    if end == "stall":
        await trio.sleep_forever()
    _reset(stream.socket)


@pytest.mark.parametrize("end", ["reset", "stall"])
async def test_our_initiator_against_a_reply_cut_at_every_byte(
    autojump_clock: Any, end: str
) -> None:
    """A fake server cuts its MPA Reply at every byte: our initiator reports a
    connection failure each time, in at most mpa_reply_timeout, and nothing else."""
    (listener,) = await trio.open_tcp_listeners(0, host=LOOPBACK)
    port = listener.socket.getsockname()[1]
    for k in range(len(REPLY)):
        async with trio.open_nursery() as nursery:
            await nursery.start(_fake_responder, listener, REPLY[:k], end)
            start = trio.current_time()
            with pytest.raises(CMError) as info, trio.fail_after(30):
                async with open_connection(LOOPBACK, port):
                    pass
            seconds = trio.current_time() - start
            if end == "stall":
                assert info.value.event.status == -errno.ETIMEDOUT
                assert seconds == pytest.approx(MPA_REPLY_TIMEOUT, abs=0.5)
            else:
                assert seconds < 1, (k, seconds)
            nursery.cancel_scope.cancel()
    await listener.aclose()


async def _mpa_handshake(port: int) -> tuple[trio.SocketStream, mpa.StartFrame]:
    """A hand-made initiator: TCP, our MPA Request, the server's Reply."""
    stream = await trio.open_tcp_stream(LOOPBACK, port)
    await stream.send_all(REQUEST)
    data = b""
    with trio.fail_after(GOOD_CLIENT_BOUND):
        while (parsed := mpa.parse_start_frame(data, reply=True)) is None:
            data += await stream.receive_some(4096)
    return stream, parsed[0]


async def test_an_error_inside_one_connection_fails_only_that_connection() -> None:
    """A Read Request whose sink offset plus length passes 2^64 (the issue's engine crash,
    struct.error in the responder): whatever the engine makes of it, an error in one
    QP's link ends that connection only; the process, the listener and a connection
    already established go on."""
    regions: list[Any] = []

    async def handler(request: ConnectionRequest) -> None:
        access = Access.LOCAL_WRITE | Access.REMOTE_READ
        regions.append(request.pd.reg_mr(bytearray(1 << 17), access))
        await accept_and_wait(request)

    async with trio.open_nursery() as nursery:
        addr = await nursery.start(partial(serve, handler, 0, host=LOOPBACK))
        port = addr[1]
        async with open_connection(LOOPBACK, port) as bystander:
            stream, reply = await _mpa_handshake(port)
            target = regions[-1]
            read = ddp.encode_read_request(
                1, 0x100, (1 << 64) - 16, 1 << 17, target.rkey, target.iova
            )
            await stream.send_all(b"".join(ddp.encode_fpdu(read, crc=reply.crc)))
            with trio.fail_after(GOOD_CLIENT_BOUND):  # the responder ends this connection
                with contextlib.suppress(trio.BrokenResourceError):
                    while await stream.receive_some(1 << 16):
                        pass
            await stream.aclose()
            assert bystander.qp.state == QPState.RTS
            await good_client(port)
        nursery.cancel_scope.cancel()


async def _idle_connection(port: int) -> trio.socket.SocketType | None:
    """A connection that never sends a byte (None when the server's backlog is full)."""
    sock = trio.socket.socket()
    with trio.move_on_after(2):
        await sock.connect((LOOPBACK, port))
        return sock
    sock.close()
    return None


async def test_serve_accepts_again_after_emfile(tmp_path: Path) -> None:
    """A burst of idle connections exhausts the server's descriptors (accept: EMFILE);
    once they are gone, serve() accepts and completes a good connection again."""
    logfile = tmp_path / "server.log"
    server = await trio.lowlevel.open_process(
        [sys.executable, __file__, "serve", "48", str(logfile)], stdout=subprocess.PIPE
    )
    idle: list[trio.socket.SocketType] = []
    try:
        port = await _read_port(server)
        with trio.fail_after(30):
            while "Too many open files" not in logfile.read_text():
                sock = await _idle_connection(port)
                if sock is not None:
                    idle.append(sock)
                await trio.sleep(0.01)
        assert len(idle) < 200
        for sock in idle:
            _reset(sock)
        took = await good_client(port)
        print(f"good client connected {took:.3f} s after {len(idle)} idle connections")
        assert server.returncode is None
        assert "retrying every 0.1 s" in logfile.read_text()
    finally:
        for sock in idle:
            sock.close()
        server.kill()
        await server.wait()


async def _read_port(process: trio.Process) -> int:
    """The port a child server prints on its first line."""
    assert process.stdout is not None
    line = b""
    with trio.fail_after(30):
        while not line.endswith(b"\n"):
            chunk = await process.stdout.receive_some(64)
            assert chunk, "the server process ended before listening"
            line += chunk
    return int(line)


def _serve_with_few_files(nofile: int, logfile: str) -> None:
    """Child process: serve on loopback with RLIMIT_NOFILE lowered to ``nofile``."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
    logging.basicConfig(filename=logfile, level=logging.INFO)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            port = await start_server(nursery)
            print(port, flush=True)

    trio.run(main)


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
    _serve_with_few_files(int(sys.argv[2]), sys.argv[3])
