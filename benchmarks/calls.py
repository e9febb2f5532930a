"""What one ping-pong message costs at each end in calls: ours beside raw TCP.

Both ends of an 8-byte ping-pong run in this one process (ours: two QPs of the
built-in transport over loopback TCP, inline unsignaled Sends, each receive
reposted as it completes; raw: two trio sockets, ``send_all`` and a receive of 8
bytes), once timed and once under cProfile. It prints, per message at each end,
the calls made, grouped by where they go (each file of ours, trio, builtins and
compiled code, of which the calls into the engine's C), and the CPU time of a
round trip (both ends). Call counts do not depend on what else the machine runs;
CPU time does: compare it only within one run, on a quiet machine.

cProfile counts an ``async`` function once at its call and again each time it is
resumed, the same way for both sides.

Usage::

    python benchmarks/calls.py                # 4,000 round trips each
    python benchmarks/calls.py --iters 500 --top 20
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import socket
import sysconfig
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path

import trio

import rdmashim
from rdmashim import QPCap, RecvWR, SendFlags, SendWR, WROpcode
from rdmashim.providers.softiwarp.connection import accept_qp, connect_qp, read_request

from report import engine_line

PACKAGE_ROOT = Path(rdmashim.__file__).resolve().parent.parent
STDLIB = Path(sysconfig.get_paths()["stdlib"]).resolve()
SIZE = 8
COMPILED = "compiled: the engine (_accel)"
BUILTIN = "builtins, other compiled code"

Loop = Callable[[int], Awaitable[None]]
"""A client's ping-pong of ``n`` round trips."""


@asynccontextmanager
async def ours() -> AsyncIterator[Loop]:
    """Two connected QPs and a server task answering each message; the client's loop."""
    async with rdmashim.open_device() as ctx, trio.open_nursery() as nursery:
        cap = QPCap(max_send_wr=64, max_recv_wr=16, max_inline_data=64)
        ends = []
        for _ in range(2):
            pd = ctx.alloc_pd()
            cq = ctx.create_cq(64)
            qp = pd.create_qp(send_cq=ctx.create_cq(64), recv_cq=cq, cap=cap)
            mr = pd.reg_mr(bytearray(64))
            recv = RecvWR(1, [mr.sge(0, 64)])
            send = SendWR(2, WROpcode.SEND, [mr.sge(0, SIZE)], SendFlags.INLINE)
            qp.post_recv(recv)
            ends.append((qp, cq, recv, send))
        (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listener.socket.getsockname()[1]

        async def accept() -> None:
            stream = await listener.accept()
            await accept_qp(ends[1][0], stream, await read_request(stream))

        async with trio.open_nursery() as setup:
            setup.start_soon(accept)
            await connect_qp(ends[0][0], await trio.open_tcp_stream("127.0.0.1", port))
        await listener.aclose()

        async def serve() -> None:
            qp, cq, recv, send = ends[1]
            while True:
                await cq.poll_wait(1)
                qp.post_recv(recv)
                qp.post_send(send)

        async def loop(n: int) -> None:
            qp, cq, recv, send = ends[0]
            for _ in range(n):
                qp.post_send(send)
                await cq.poll_wait(1)
                qp.post_recv(recv)

        nursery.start_soon(serve)
        yield loop
        nursery.cancel_scope.cancel()


async def _read(sock: trio.socket.SocketType, buf: memoryview) -> None:
    got = 0
    while got < len(buf):
        n = await sock.recv_into(buf[got:])
        if not n:
            raise EOFError("the raw TCP peer closed")
        got += n


@asynccontextmanager
async def raw() -> AsyncIterator[Loop]:
    """Two connected trio sockets and a task echoing each message; the client's loop."""
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    listener.listen()
    client = trio.socket.socket()
    await client.connect(listener.getsockname())
    server, _ = await listener.accept()
    listener.close()
    for sock in (client, server):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    async with trio.open_nursery() as nursery:

        async def serve() -> None:
            stream, buf = trio.SocketStream(server), memoryview(bytearray(SIZE))
            while True:
                await _read(server, buf)
                await stream.send_all(buf)

        async def loop(n: int) -> None:
            stream, buf, msg = trio.SocketStream(client), memoryview(bytearray(SIZE)), bytes(SIZE)
            for _ in range(n):
                await stream.send_all(msg)
                await _read(client, buf)

        nursery.start_soon(serve)
        yield loop
        nursery.cancel_scope.cancel()


def group(filename: str, name: str) -> str:
    """Where a profiled function is: a file of ours, a library, or compiled code."""
    if filename == "~":
        return COMPILED if "_accel" in name else BUILTIN
    path = Path(filename)
    if "site-packages" in path.parts:
        return path.parts[path.parts.index("site-packages") + 1]
    for root, label in ((PACKAGE_ROOT, ""), (STDLIB, "python: ")):
        if path.resolve().is_relative_to(root):
            return label + str(path.resolve().relative_to(root))
    return path.name


async def measure(
    side: Callable[[], AbstractAsyncContextManager[Loop]], iters: int
) -> tuple[float, Counter[str], Counter[tuple[str, str]]]:
    """CPU seconds a round trip, and calls a message at each end by group and by function."""
    async with side() as loop:
        await loop(200)  # warm up
        start = time.process_time()
        await loop(iters)
        cpu = (time.process_time() - start) / iters
        prof = cProfile.Profile()
        prof.enable()
        await loop(iters)
        prof.disable()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    groups: Counter[str] = Counter()
    functions: Counter[tuple[str, str]] = Counter()
    messages = 2 * iters
    for (filename, _, name), (_, calls, *_) in stats.items():
        where = group(filename, name)
        groups[where] += calls / messages
        functions[(where, name)] += calls / messages
    return cpu, groups, functions


async def run(iters: int, top: int) -> None:
    print("# calls a message at each end: an 8-byte ping-pong, both ends in this process")
    print(f"#{engine_line()}")
    results = {}
    for name, side in (("ours", ours), ("raw TCP", raw)):
        results[name] = await measure(side, iters)
    names = sorted(
        set(results["ours"][1]) | set(results["raw TCP"][1]),
        key=lambda g: -max(results[n][1][g] for n in results),
    )
    print(f"{'where':48} {'ours':>8} {'raw TCP':>8}")
    for g in names:
        row = [results[n][1][g] for n in results]
        if max(row) >= 0.5:
            print(f"{g[:48]:48} {row[0]:8.1f} {row[1]:8.1f}")
    totals = [sum(results[n][1].values()) for n in results]
    print(f"{'all calls':48} {totals[0]:8.1f} {totals[1]:8.1f}")
    cpu = [results[n][0] * 1e6 for n in results]
    print(f"{'CPU a round trip, both ends (us)':48} {cpu[0]:8.1f} {cpu[1]:8.1f}")
    print(f"ours/raw: calls {totals[0] / totals[1]:.2f}, CPU {cpu[0] / cpu[1]:.2f}")
    if top:
        print(f"\n# ours: the {top} functions called most a message")
        for (where, name), calls in results["ours"][2].most_common(top):
            print(f"{calls:6.2f}  {where}: {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=4000, help="round trips a measurement")
    parser.add_argument("--top", type=int, default=0, help="also list ours' N most called")
    args = parser.parse_args()
    if args.iters < 1:
        parser.error("--iters must be at least 1")
    trio.run(run, args.iters, args.top)


if __name__ == "__main__":
    main()
