"""A loopback demo of the built-in engine: the newcomer's first run.

A server (``rdmashim.cm.serve``) and a client (``open_connection``) in one
process, connected through the rdma_cm over a real TCP connection on
127.0.0.1 with MPA: the server's accept carries its target buffer's address
and key, the client's first Send its source buffer's; the client RDMA-Writes
the target and the server RDMA-Reads the source; every byte is verified and
the rates are reported.
"""

from __future__ import annotations

import struct
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import trio

from rdmashim import Access, RecvWR, SendFlags, SendWR, WROpcode
from rdmashim.cliargs import rate
from rdmashim.clisignals import Signals
from rdmashim.cm import ConnectionRequest, TransportOptions, open_connection, serve
from rdmashim.verbs.abc import CQ, MR, QP

_DEPTH = 8
_BUFFER = struct.Struct("!QIQ")
"""Where a buffer is: address, rkey, length."""
_SIG = SendFlags.SIGNALED
_REMOTE = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ


@dataclass
class _Phase:
    """The operations under way, for the progress line and for what Ctrl-C reports."""

    label: str = ""
    done: int = 0
    total: int = 0
    started: float = 0.0
    progress: bool = False

    def interrupted(self, size: int, count: int) -> str:
        """What Ctrl-C reports: how many of the ``count`` operations under way were done."""
        if not self.label:
            return "interrupted before any RDMA operation"
        elapsed = time.perf_counter() - self.started
        done = min(self.done, count)  # the Writes' closing zero-length Read is not one
        mbytes = rate(done * size / 1e6, elapsed)
        speed = f", {mbytes:.1f} MB/s" if mbytes is not None else ""
        return (
            f"interrupted: {self.label} {done} of {count} x {size} B done in {elapsed:.3f} s{speed}"
        )


def _report(label: str, count: int, size: int, elapsed: float, ok: bool, phase: _Phase) -> None:
    _progress(phase.progress, "")
    mbytes = rate(count * size / 1e6, elapsed)
    speed = f"{mbytes:8.1f} MB/s" if mbytes is not None else "too fast to time"
    verdict = "verified" if ok else "WRONG"
    print(f"{label} {count} x {size} B: {speed}, data {verdict}", flush=True)


def _progress(enabled: bool, text: str) -> None:
    if enabled:
        sys.stderr.write("\r" + text.ljust(60))
        sys.stderr.flush()


async def _pump(
    qp: QP, cq: CQ, make: Callable[[int], SendWR], total: int, label: str, size: int, phase: _Phase
) -> float:
    """Post ``make(0) .. make(total - 1)`` keeping ``_DEPTH`` outstanding; the elapsed seconds."""
    phase.label, phase.total, phase.done = label, total, 0
    phase.started = start = time.perf_counter()
    posted = 0
    while phase.done < total:
        while posted < total and posted - phase.done < _DEPTH:
            qp.post_send(make(posted))
            posted += 1
        for wc in await cq.poll_wait(_DEPTH):
            wc.raise_for_status()
            phase.done += 1
        if phase.done % 16 == 0:
            _progress(phase.progress, f"{label}: {phase.done}/{total} x {size} B")
    return time.perf_counter() - start


async def run_demo(size: int, count: int, crc: bool, progress: bool) -> int:
    """Run the demo and print what happened; returns the exit status.

    ``size`` and ``count`` are at least 1 (the CLI checks them). Ctrl-C ends
    the demo with 130 (SIGTERM: 143) after a line on how far it came.
    """
    if size < 1 or count < 1:
        raise ValueError(f"the demo needs a size and a count of at least 1 (not {size}, {count})")
    phase = _Phase(progress=progress)
    signals = Signals()
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            await nursery.start(signals.watch, scope.cancel)
            status = await _run(size, count, crc, phase)
            nursery.cancel_scope.cancel()
    if scope.cancelled_caught:
        _progress(progress, "")
        print(phase.interrupted(size, count), flush=True)
        return signals.status
    return status


async def _run(size: int, count: int, crc: bool, phase: _Phase) -> int:
    options = TransportOptions(crc=crc)
    source_bytes = (bytes(range(251)) * (size // 251 + 1))[:size]
    server_mrs: dict[str, MR] = {}
    timings: dict[str, float] = {}
    reads_may_start = trio.Event()
    reads_done = trio.Event()

    async def handler(request: ConnectionRequest) -> None:
        target = request.pd.reg_mr(bytearray(size), _REMOTE)
        sink = request.pd.reg_mr(bytearray(size), _REMOTE)
        hello = request.pd.reg_mr(bytearray(64), Access.LOCAL_WRITE)
        server_mrs.update(target=target, sink=sink)
        request.qp.post_recv(RecvWR(1, [hello.sge()]))  # before accepting
        conn = await request.accept(private_data=_BUFFER.pack(target.addr, target.rkey, size))
        wc = (await conn.recv_cq.poll_wait(1))[0].raise_for_status()
        addr, rkey, _ = _BUFFER.unpack_from(hello.buf)
        print(
            f"server: {wc.byte_len}-byte Send from {conn.peer_addr[0]}: source {addr:#x}/{rkey:#x}"
        )
        await reads_may_start.wait()
        timings["read"] = await _pump(
            conn.qp, conn.send_cq,
            lambda i: SendWR(i, WROpcode.RDMA_READ, [sink.sge()], _SIG, addr, rkey),
            count, "RDMA Read", size, phase,
        )  # fmt: skip
        reads_done.set()
        await conn.wait_disconnected()

    async with trio.open_nursery() as nursery:
        local, port = await nursery.start(
            partial(serve, handler, 0, host="127.0.0.1", options=options)
        )
        async with open_connection(
            "127.0.0.1", port, private_data=b"rdmashim demo", options=options
        ) as conn:
            print(
                f"client: connected to {local}:{port} on {conn.context.device.name} "
                f"({conn.context.backend}), MPA CRC {'on' if crc else 'off'}",
                flush=True,
            )
            t_addr, t_rkey, _ = _BUFFER.unpack(conn.private_data)
            source = conn.pd.reg_mr(bytearray(source_bytes), _REMOTE)
            msg = conn.pd.reg_mr(bytearray(_BUFFER.pack(source.addr, source.rkey, size)))
            conn.qp.post_send(SendWR(1, WROpcode.SEND, [msg.sge()], _SIG))  # active side first
            (await conn.send_cq.poll_wait(1))[0].raise_for_status()

            def write(i: int) -> SendWR:
                # A Write completes once sent; the zero-length Read behind the last one
                # completes only after the server placed every byte.
                if i < count:
                    return SendWR(i, WROpcode.RDMA_WRITE, [source.sge()], _SIG, t_addr, t_rkey)
                return SendWR(i, WROpcode.RDMA_READ, [], _SIG, t_addr, t_rkey)

            elapsed = await _pump(
                conn.qp, conn.send_cq, write, count + 1, "RDMA Write", size, phase
            )
            ok_write = bytes(server_mrs["target"].buf) == source_bytes
            _report("RDMA Write", count, size, elapsed, ok_write, phase)
            reads_may_start.set()
            await reads_done.wait()
            ok_read = bytes(server_mrs["sink"].buf) == source_bytes
            _report("RDMA Read ", count, size, timings["read"], ok_read, phase)
        print("client: disconnected")
        nursery.cancel_scope.cancel()
    return 0 if ok_write and ok_read else 1
