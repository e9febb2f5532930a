"""A loopback demo of the built-in engine: the newcomer's first run.

Two queue pairs in one process, connected over a real TCP connection on
127.0.0.1 with MPA, exchange a Send carrying the target buffer's address and
key, then RDMA Write and RDMA Read it, verify every byte and report rates.
"""

from __future__ import annotations

import struct
import sys
import time

import trio

import rdmashim
from rdmashim import Access, QPCap, RecvWR, SendFlags, SendWR, WROpcode
from rdmashim.verbs.softiwarp.connection import (
    MpaOptions,
    accept_qp,
    connect_qp,
    read_request,
)

_DEPTH = 8
_SIG = SendFlags.SIGNALED
_REMOTE = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ


def _report(label: str, count: int, size: int, elapsed: float, ok: bool, progress: bool) -> None:
    _progress(progress, "")
    rate = count * size / elapsed / 1e6
    verdict = "verified" if ok else "WRONG"
    print(f"{label} {count} x {size} B: {rate:8.1f} MB/s, data {verdict}")


def _progress(enabled: bool, text: str) -> None:
    if enabled:
        sys.stderr.write("\r" + text.ljust(60))
        sys.stderr.flush()


async def _pump(qp, cq, wrs: list[SendWR], label: str, size: int, progress: bool) -> float:
    """Post ``wrs`` keeping ``_DEPTH`` outstanding; return the elapsed seconds."""
    start = time.perf_counter()
    posted = done = 0
    while done < len(wrs):
        while posted < len(wrs) and posted - done < _DEPTH:
            qp.post_send(wrs[posted])
            posted += 1
        for wc in await cq.poll_wait(_DEPTH):
            wc.raise_for_status()
            done += 1
        if done % 16 == 0:
            _progress(progress, f"{label}: {done}/{len(wrs)} x {size} B")
    return time.perf_counter() - start


async def run_demo(size: int, count: int, crc: bool, progress: bool) -> int:
    """Run the demo and print what happened; returns the exit status."""
    options = MpaOptions(crc=crc)
    async with rdmashim.open_device("siw_lo") as ctx:
        print(f"device {ctx.device.name} ({ctx.backend}), MPA CRC {'on' if crc else 'off'}")
        sides = []
        for _ in range(2):
            pd = ctx.alloc_pd()
            cq = ctx.create_cq(1024)
            qp = pd.create_qp(send_cq=cq, recv_cq=cq, cap=QPCap(max_send_wr=64, max_recv_wr=64))
            sides.append((pd, cq, qp))
        (cpd, ccq, cqp), (spd, scq, sqp) = sides
        target = spd.reg_mr(bytearray(size), _REMOTE)
        hello = spd.reg_mr(bytearray(64), Access.LOCAL_WRITE)
        sqp.post_recv(RecvWR(1, [hello.sge()]))

        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]

        async def serve() -> None:
            stream = await listeners[0].accept()
            request = await read_request(stream)
            await accept_qp(sqp, stream, request, options=options)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve)
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            result = await connect_qp(cqp, stream, private_data=b"rdmashim demo", options=options)
        await listeners[0].aclose()
        print(
            f"connected on 127.0.0.1:{port}: MPA rev {result.revision}, "
            f"IRD/ORD {result.ird}/{result.ord}"
        )

        # The active side sends first: tell the server where our source buffer is.
        source = cpd.reg_mr(bytearray((bytes(range(251)) * (size // 251 + 1))[:size]), _REMOTE)
        msg = cpd.reg_mr(bytearray(struct.pack("!QIQ", source.addr, source.rkey, size)))
        cqp.post_send(SendWR(1, WROpcode.SEND, [msg.sge()], _SIG))
        (await ccq.poll_wait(1))[0].raise_for_status()
        wc = (await scq.poll_wait(1))[0].raise_for_status()
        addr, rkey, _ = struct.unpack_from("!QIQ", hello.buf)
        print(
            f"server received a {wc.byte_len}-byte Send: source buffer at {addr:#x}, rkey {rkey:#x}"
        )

        writes = [
            SendWR(i, WROpcode.RDMA_WRITE, [source.sge()], _SIG, target.addr, target.rkey)
            for i in range(count)
        ]
        # A Write completes once sent; the zero-length Read behind it completes only
        # after the server placed every byte.
        writes.append(SendWR(count, WROpcode.RDMA_READ, [], _SIG, target.addr, target.rkey))
        elapsed = await _pump(cqp, ccq, writes, "RDMA Write", size, progress)
        ok_write = bytes(target.buf) == bytes(source.buf)
        _report("RDMA Write", count, size, elapsed, ok_write, progress)

        sink = spd.reg_mr(bytearray(size), _REMOTE)
        reads = [
            SendWR(i, WROpcode.RDMA_READ, [sink.sge()], _SIG, addr, rkey) for i in range(count)
        ]
        elapsed = await _pump(sqp, scq, reads, "RDMA Read", size, progress)
        ok_read = bytes(sink.buf) == bytes(source.buf)
        _report("RDMA Read ", count, size, elapsed, ok_read, progress)
        cqp.modify(qp_state=rdmashim.QPState.ERR)
        await sqp.wait_closed()
        print(f"disconnected: server QP {sqp.state.name}")
        return 0 if ok_write and ok_read else 1
