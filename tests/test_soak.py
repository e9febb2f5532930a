"""Soak: thousands of connections opened and closed against ``serve`` leave memory flat.

Each connection is opened with ``open_connection`` (every tenth does a Send and
gets it echoed back) and closed; the server and the clients run in this
process, so the figure covers both ends of the CM and the engine below them.
The resident size is read from ``/proc/self/statm`` after a garbage collection
and glibc's ``malloc_trim(0)`` (so freed heap pages count as freed), once after
a warm-up and once at the end; the QPs and engines still alive are counted.
"""

from __future__ import annotations

import gc
import time
import weakref
from functools import partial
from typing import Any

import pytest
import trio

from rdmashim import Access, RecvWR, SendFlags, SendWR, WCStatus, WROpcode
from rdmashim.cm import ConnectionRequest, open_connection, serve
from rdmashim.providers.softiwarp.engine import Engine
from rdmashim.providers.softiwarp.native_link import NativeEngine

from residency import resident_bytes

WARM_UP = 500
MAX_GROWTH_PER_CONNECTION = 2048
"""Bytes of resident size a connection may leave behind (a leak of its QP's engine
alone would leave its 256 KiB staging buffer)."""
ROUND_TRIP_EVERY = 10


def live_engines() -> int:
    """Engines alive: the Python engine's, or the native engine's Python side (whose C
    state lives exactly as long: ``NativeQP._release`` frees it)."""
    gc.collect()
    return sum(1 for obj in gc.get_objects() if isinstance(obj, Engine | NativeEngine))


async def echo_once(qps: weakref.WeakSet, request: ConnectionRequest) -> None:
    """Accept; echo the first Send back (if one comes) and wait for the peer to leave."""
    qps.add(request.qp)
    buf = request.pd.reg_mr(bytearray(64), Access.LOCAL_WRITE)
    request.qp.post_recv(RecvWR(1, [buf.sge()]))
    conn = await request.accept()
    with trio.move_on_after(10):
        async with trio.open_nursery() as nursery:

            async def echo() -> None:
                (wc,) = await conn.recv_cq.poll_wait(1)
                if wc.status == WCStatus.SUCCESS:
                    conn.qp.post_send(SendWR(2, WROpcode.SEND, [buf.sge(0, wc.byte_len)]))

            nursery.start_soon(echo)
            await conn.wait_disconnected()
            nursery.cancel_scope.cancel()


async def one_connection(port: int, qps: weakref.WeakSet, round_trip: bool) -> None:
    async with open_connection("127.0.0.1", port) as conn:
        qps.add(conn.qp)
        if not round_trip:
            return
        buf = conn.pd.reg_mr(bytearray(64), Access.LOCAL_WRITE)
        conn.qp.post_recv(RecvWR(1, [buf.sge(32, 32)]))
        buf.buf[:4] = b"ping"
        conn.qp.post_send(SendWR(2, WROpcode.SEND, [buf.sge(0, 4)], SendFlags.SIGNALED))
        received = False
        with trio.fail_after(10):
            while not received:
                for wc in await conn.send_cq.poll_wait():
                    assert wc.status == WCStatus.SUCCESS, wc
                    received = received or wc.wr_id == 1
        assert bytes(buf.buf[32:36]) == b"ping"


async def _until_released(qps: weakref.WeakSet, seconds: float = 10) -> None:
    """Give the last connection's server side (its handler, its socket's linger) time
    to finish: wait until no QP is alive, for at most ``seconds``."""
    for _ in range(int(seconds / 0.05)):
        gc.collect()
        if not qps:
            return
        await trio.sleep(0.05)


async def soak(total: int) -> dict[str, Any]:
    qps: weakref.WeakSet = weakref.WeakSet()
    figures: dict[str, Any] = {}
    async with trio.open_nursery() as nursery:
        addr = await nursery.start(partial(serve, partial(echo_once, qps), 0, host="127.0.0.1"))
        start = time.monotonic()
        for i in range(total):
            await one_connection(addr[1], qps, i % ROUND_TRIP_EVERY == 0)
            if i + 1 == WARM_UP:
                await _until_released(qps)
                figures["rss_warm"] = resident_bytes()
        figures["seconds"] = time.monotonic() - start
        await _until_released(qps)
        figures["rss_end"] = resident_bytes()
        figures["live_qps"] = len(qps)
        figures["live_engines"] = live_engines()
        nursery.cancel_scope.cancel()
    figures["per_connection"] = (figures["rss_end"] - figures["rss_warm"]) / (total - WARM_UP)
    print(
        f"\n{total} connections in {figures['seconds']:.1f} s: resident "
        f"{figures['rss_warm'] / 1024:.0f} KiB after {WARM_UP}, "
        f"{figures['rss_end'] / 1024:.0f} KiB at the end, "
        f"{figures['per_connection']:.0f} bytes per connection; "
        f"live QPs {figures['live_qps']}, engines {figures['live_engines']}"
    )
    return figures


def _check(figures: dict[str, Any]) -> None:
    assert figures["per_connection"] < MAX_GROWTH_PER_CONNECTION
    assert figures["live_qps"] == 0, "QPs of closed connections are still referenced"
    assert figures["live_engines"] == 0, "engines of closed connections are still referenced"


async def test_soak_2000_connections_leave_memory_flat() -> None:
    _check(await soak(2000))


@pytest.mark.slow
async def test_soak_10000_connections_leave_memory_flat() -> None:
    _check(await soak(10000))
