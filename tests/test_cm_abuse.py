"""The CM under abuse: strangers that send garbage, stall, or reset at every byte of
MPA setup must not take the listener down nor keep a good client out.

Real sockets on loopback. A stranger is a plain TCP socket; a reset is a close
with ``SO_LINGER`` 0.
"""

from __future__ import annotations

import socket
import struct
from functools import partial
from typing import Any

import trio

from rdmashim.cm import ConnectionRequest, open_connection, serve

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
