"""``--vs-tcp``: the same transfer over a plain TCP connection, beside ours.

Ours only (perftest has nothing like it), so both ends must be ``rdmashim
perf`` with ``--vs-tcp``; they find each other in the version exchange
(:func:`~rdmashim.perftools.wire.decode_peer`). After the perftest run,
the server listens on a TCP port it announced there, and for each size of the
run the client opens one connection (setup outside the timed window), sends a
:data:`HEADER` and then:

* ``write_bw`` / ``send_bw``: as many messages of ``size`` bytes as ours
  sent (``iters`` per QP), one ``send`` each (as ours posts one work request
  each); after its EOF the server answers the byte count, which ends the
  window;
* ``read_bw``: one request byte per message, at most ``tx_depth``
  outstanding; the server answers each with ``size`` bytes.

With ``-D`` the client sends (or requests) for that many seconds instead of
``iters`` messages. Both ends run trio, with ``TCP_NODELAY`` as trio sets it.
"""

from __future__ import annotations

import os
import struct
import time
from functools import partial

import trio

from rdmashim.perftools import report
from rdmashim.perftools.measure import Progress
from rdmashim.perftools.options import PerfConfig
from rdmashim.verbs.busypoll import spin_until

HEADER = struct.Struct("!cxxxI")
"""Client -> server, per size: ``W`` (the client sends) or ``R`` (the server sends), size."""
COUNT = struct.Struct("!Q")
"""Server -> client after a ``W`` transfer: the bytes it received."""
STAGING = 1 << 20
"""Bytes each receive may take at most."""


class RawTcpError(Exception):
    """The raw TCP side of a ``--vs-tcp`` run failed."""


async def read_exact(
    sock: trio.socket.SocketType, view: memoryview, busy_poll: float = 0.0
) -> bool:
    """Fill ``view`` from ``sock``; False on EOF before the first byte, EOFError on EOF
    after it. With ``busy_poll`` (seconds) each receive first tries non-blocking
    reads for that long, yielding between tries, as ``CQ.busy_poll`` makes our engine's
    waits do (:mod:`rdmashim.verbs.busypoll`)."""
    got = 0
    while got < len(view):
        read = None
        if busy_poll:  # our engine's busy polling reads the socket so too
            read = await spin_until(partial(_read_now, sock.fileno(), view[got:]), busy_poll)
        n = read[0] if read is not None else await sock.recv_into(view[got:])
        if not n:
            if got:
                raise EOFError("the peer closed the connection mid-message")
            return False
        got += n
    return True


def _read_now(fd: int, view: memoryview) -> tuple[int] | None:
    """One non-blocking read into ``view``: (bytes read,), 0 at EOF; None when nothing
    waits."""
    try:
        return (os.readv(fd, [view]),)
    except BlockingIOError:
        return None


async def count_to_eof(sock: trio.socket.SocketType, buf: memoryview) -> int:
    """Receive into ``buf`` (over and over) until EOF; the bytes received."""
    total = 0
    while n := await sock.recv_into(buf):
        total += n
    return total


async def serve(listener: trio.SocketListener, count: int) -> None:
    """Serve ``count`` transfers (one connection each, one per size of the run)."""
    for _ in range(count):
        stream = await listener.accept()
        async with stream:
            sock = stream.socket
            head = memoryview(bytearray(HEADER.size))
            if not await read_exact(sock, head):
                raise RawTcpError("the client closed the raw TCP connection before its header")
            mode, size = HEADER.unpack(head)
            if mode == b"W":
                buf = memoryview(bytearray(min(max(size, 4096), STAGING)))
                await stream.send_all(COUNT.pack(await count_to_eof(sock, buf)))
            elif mode == b"R":
                message = memoryview(bytearray(size))
                requests = memoryview(bytearray(4096))
                while n := await sock.recv_into(requests):
                    for _ in range(n):
                        await stream.send_all(message)
            else:
                raise RawTcpError(f"unknown raw TCP transfer {mode!r}")


async def _send(stream: trio.SocketStream, config: PerfConfig, size: int,
                progress: Progress | None) -> int:  # fmt: skip
    """Send the messages (``iters``, or for ``-D`` seconds); the count of them."""
    message = memoryview(bytearray(size))
    deadline = time.monotonic() + config.duration if config.duration else float("inf")
    sent = 0
    total = config.iters * config.num_qps
    while (config.duration is not None or sent < total) and time.monotonic() < deadline:
        await stream.send_all(message)
        sent += 1
        if progress is not None:
            progress(1)
    await stream.send_eof()
    answer = memoryview(bytearray(COUNT.size))
    if not await read_exact(stream.socket, answer) or COUNT.unpack(answer)[0] != sent * size:
        raise RawTcpError(f"the raw TCP server did not count the {sent * size} bytes sent")
    return sent


async def _receive(stream: trio.SocketStream, config: PerfConfig, size: int,
                   progress: Progress | None) -> int:  # fmt: skip
    """Request messages (``tx_depth`` outstanding) and receive them; the count of them."""
    sock = stream.socket
    buf = memoryview(bytearray(min(max(size, 4096), STAGING)))
    deadline = time.monotonic() + config.duration if config.duration else float("inf")
    limit = config.iters * config.num_qps if config.duration is None else None
    asked = min(config.tx_depth, limit) if limit is not None else config.tx_depth
    await stream.send_all(bytes(asked))
    got = done = 0
    while done < asked:
        n = await sock.recv_into(buf)
        if not n:
            raise RawTcpError("the raw TCP server closed mid-transfer")
        got += n
        finished, got = divmod(got, size)
        if not finished:
            continue
        done += finished
        if progress is not None:
            progress(finished)
        more = finished if time.monotonic() < deadline else 0
        if limit is not None:
            more = min(more, limit - asked)
        if more:
            await stream.send_all(bytes(more))
            asked += more
    return done


async def measure(host: str, port: int, config: PerfConfig, size: int,
                  progress: Progress | None = None) -> report.BwResult:  # fmt: skip
    """One size over a fresh connection; its row (no peak, as a ``-D`` run has none)."""
    reading = config.verb == "read"
    stream = await trio.open_tcp_stream(host, port)
    async with stream:
        await stream.send_all(HEADER.pack(b"R" if reading else b"W", size))
        start = time.perf_counter_ns()
        moved = await (_receive if reading else _send)(stream, config, size, progress)
        end = time.perf_counter_ns()
    return report.bw_span_result(size, moved, start, end, gbits=config.gbits)


__all__ = ["HEADER", "RawTcpError", "count_to_eof", "measure", "read_exact", "serve"]
