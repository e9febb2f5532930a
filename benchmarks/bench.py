#!/usr/bin/env python3
"""rdmashim benchmarks: the soft-iWARP engine beside raw Python TCP, in one run.

Two processes on one machine: this script is the client; it starts the server
as a subprocess (a fresh interpreter running this file with ``--serve``). Both
ends run trio and talk over 127.0.0.1. Every figure is printed beside raw TCP
doing the same work in the same run (trio sockets, ``recv_into`` preallocated
buffers), as a ratio; each measurement is repeated ``--repeat`` times,
alternating ours and raw, and the medians are reported.

Benchmarks (``--only`` takes these names):

``write-bw``
    RDMA Write of 1 MiB from one MR into the server's MR, ``depth`` Writes
    outstanding. The window ends with a small RDMA Read, which completes only
    after every earlier Write has been placed at the server.
    Raw: ``send_all`` of 1 MiB chunks; the server ``recv_into`` a 1 MiB buffer,
    and answers the byte count after the client's EOF (the window ends there).
``read-bw``
    RDMA Read of 1 MiB from the server's MR, ``depth`` Reads outstanding.
    Raw: the client sends an 8-byte request per 1 MiB, ``depth`` outstanding;
    the server answers each with ``send_all`` of 1 MiB.
``send-rate``
    64 B Sends (inline), posted in batches of 64 per ``post_send_batch`` call
    (a reusable ``SendBatch``), unsignaled but for the last of each batch. The
    server keeps 4096 receives posted and re-posts the completed ones with one
    ``post_recv_batch`` per poll (``poll_wait_into`` a ``WCArray``: no WC object
    per message); it returns credits (its count of receives) in 8 B Sends, so
    no Send ever arrives without a receive. The window ends when the
    server reports every message received.
    Raw: one ``send_all`` of 64 x 64 B per batch; the server ``recv_into`` a
    256 KiB buffer and answers the byte count after the client's EOF.
``send-lat``
    8 B Send ping-pong (inline, the client sends first); half the round trip,
    median over the iterations of a sample. Raw: 8 B echo over TCP. Every wait
    blocks (trio sleeps in ``epoll_wait``).
``send-lat-poll``
    The same, with every wait polling ``--busy-poll`` microseconds (50) before it
    blocks, as perftest's latency tools poll their CQ: ours sets ``CQ.busy_poll``,
    raw TCP polls its socket as long (:mod:`rdmashim.verbs.busypoll`). No CPU goes
    idle between messages, so neither side pays for waking one.

``req-ack`` and ``req-write``
    What ``rds_stress.py``'s unbatched cases ask of the engine, with no ULP on it:
    the client Sends a request (1024 B, one in flight; 64 B, four in flight), and
    the server answers each with a Send (256 B; 16 B), ``req-write`` first placing
    64 KiB in the client's MR with an RDMA Write named in the request. No RDS: the
    most any ULP on this engine can reach in the same pattern (transactions per
    second). Raw: the same requests and answers (64 KiB + 16 B) over TCP.

Ratios are ours/raw: above 1 is better for bandwidth and rate, worse (slower)
for latency.

The floor: send-lat and send-lat-poll are also printed against this machine's
latency floor, measured in the same run, alternating with ours and raw: an 8-byte
TCP ping-pong in C over 127.0.0.1 (``floor.c``, compiled when the run starts;
both ends blocking in ``recv`` for send-lat, both spinning on non-blocking
``recv`` for send-lat-poll), as ours/floor. Without a C compiler the rows say
why not (:mod:`floor`).

``--path veth`` (root and iproute2) runs the server and the client in two network
namespaces joined by a veth pair with a 1500-byte MTU (:mod:`vethpath`), and
sizes our FPDUs to the connection's MSS, one FPDU per TCP segment, as Linux siw
sends them (``--fpdu`` sets the size on either path); by default it runs
``write-bw``.

Usage::

    python benchmarks/bench.py [--quick] [--json FILE] [--repeat N] [--no-crc] [--only NAME]
    python benchmarks/bench.py --profile DIR --only write-bw   # cProfile both ends
    sudo python benchmarks/bench.py --path veth                # MSS-sized FPDUs over a veth
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

import rdmashim
from rdmashim import (
    Access,
    QPCap,
    RecvBatch,
    RecvWR,
    SendBatch,
    SendFlags,
    SendWR,
    WCArray,
    WCOpcode,
    WCStatus,
    WROpcode,
)
from rdmashim.providers.softiwarp.connection import MpaOptions, accept_qp, connect_qp, read_request

import floor
import vethpath
from report import Status, cpu_line, engine_line, run_meta, top_functions
from streams import count_to_eof, read_exact, stop_process

HOST = "127.0.0.1"
DEVICE = "siw_lo"
MiB = 1 << 20
MAX_FPDU = 65536
"""The engine's largest FPDU (and its default)."""

BULK_SIZE = MiB
DEPTH = 8
"""RDMA Writes/Reads (and raw read requests) outstanding in the bandwidth tests."""
MSG_SIZE = 64
BATCH = 64
"""SendWRs per post_send_batch call (and 64 B messages per raw send) in send-rate."""
MAX_BATCHES = 16
"""Signaled batches the send-rate client keeps outstanding."""
SERVER_RECVS = 4096
"""Receives the send-rate server keeps posted (the client's initial credit)."""
CREDIT_STEP = 512
"""The send-rate server returns credits after this many receives (or on a solicited one)."""
CLIENT_CREDIT_RECVS = 64
LAT_SIZE = 8
LAT_RECVS = 16
"""Receives each side of send-lat keeps posted; the server posts the answer before it
posts the ping's receive again (as :data:`REQ_RECVS` says)."""
BUSY_POLL_US = 50.0
"""send-lat-poll's busy polling, microseconds (the value Linux's documentation suggests
for ``net.core.busy_read``)."""
RAW_STAGING = 256 * 1024
REQ_RECVS = 16
"""Receives each side of req-ack / req-write keeps posted (above any depth used). A
receive is posted again after the answer (or the next request) it brought: with this
many posted the peer never finds none, and only what an end does between a message's
arrival and its post is on the round trip's path (``docs/verbs.md``, "Answer first")."""
REQ_SLOT = 1024
"""Bytes of each of those receives."""
REQ_SIGNAL = 8
"""req-ack / req-write signal one Send in this many (the others complete with it)."""
REQ_HDR = struct.Struct("!IIQI")
"""A request's head: answer bytes, RDMA Write bytes, the client's buffer and its rkey."""
RAW_REQ_HDR = struct.Struct("!cxHI")
"""Raw TCP's mode header for req-ack / req-write: b"Q", request and answer bytes."""
RAW_HDR = struct.Struct("!8s")
REQ = struct.Struct("!Q")
PRIV_REQ = struct.Struct("!cBBI")
"""Client -> server MPA private data: mode, CRC, profile this connection, max FPDU
(0: the connection's MSS)."""
PRIV_REP = struct.Struct("!QII")
"""Server -> client MPA private data: MR address, rkey, initial credits."""
ALL_ACCESS = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ

RESULT_LINE = "-" * 96


class BenchError(RuntimeError):
    """A benchmark could not run to the end (failed completion, lost peer, ...)."""


def fpdu_size(stream: trio.SocketStream, wanted: int) -> int:
    """The largest FPDU our side sends on ``stream``: ``wanted``, or for 0 the
    connection's MSS rounded down to 8 bytes, as Linux siw sizes its FPDUs (one
    FPDU per TCP segment, ``siw_update_tcpseg``)."""
    if wanted:
        return wanted
    mss = stream.getsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG)
    return max(64, min(MAX_FPDU, mss & ~7))


def _check(wc: Any, qp: Any) -> None:
    if wc.status != WCStatus.SUCCESS:
        raise BenchError(
            f"work request {wc.wr_id} completed with {WCStatus(wc.status).name}"
            f" (QP error: {qp.error!r})"
        )


# =============================================================================================
# server process
# =============================================================================================


class Server:
    """The passive side: one RDMA listener, one raw TCP listener, a handler per connection."""

    def __init__(self, ctx: Any, profile_dir: Path | None, busy_poll: float) -> None:
        self.ctx = ctx
        self.profile_dir = profile_dir
        self.busy_poll = busy_poll

    async def accept_loop(self, listener: trio.SocketListener, handler: Callable) -> None:
        async with trio.open_nursery() as nursery:
            while True:
                stream = await listener.accept()
                nursery.start_soon(self._guard, handler, stream)

    async def _guard(self, handler: Callable, stream: trio.SocketStream) -> None:
        try:
            await handler(stream)
        except Exception as exc:  # keep serving the next connection
            print(f"bench server: {handler.__name__}: {exc!r}", file=sys.stderr)

    # ------------------------------------------------------------------ RDMA
    async def rdma(self, stream: trio.SocketStream) -> None:
        req = await read_request(stream)
        mode, crc, profile, fpdu = PRIV_REQ.unpack_from(req.private_data)
        options = MpaOptions(crc=bool(crc), max_fpdu=fpdu_size(stream, fpdu))
        ctx = self.ctx
        pd = ctx.alloc_pd()
        cq = ctx.create_cq(4 * SERVER_RECVS)
        prof = cProfile.Profile() if profile else None
        try:
            if mode in (b"W", b"R"):
                mr = pd.reg_mr(bytearray(BULK_SIZE), ALL_ACCESS)
                qp = pd.create_qp(send_cq=cq, recv_cq=cq, cap=QPCap(max_send_wr=4, max_recv_wr=1))
                await accept_qp(
                    qp,
                    stream,
                    req,
                    private_data=PRIV_REP.pack(mr.addr, mr.rkey, 0),
                    options=options,
                )
                if prof:
                    prof.enable()
                await qp.wait_closed()
            elif mode == b"S":
                await self._send_rate(pd, cq, stream, req, options, prof)
            elif mode in (b"L", b"P"):
                busy_poll = self.busy_poll if mode == b"P" else 0.0
                await self._send_lat(pd, cq, stream, req, options, prof, busy_poll)
            elif mode == b"Q":
                await self._req_ack(pd, cq, stream, req, options, prof)
            else:
                raise BenchError(f"unknown mode {mode!r}")
        finally:
            if prof:
                prof.disable()
                self._dump(prof, mode)
            pd.close()
            cq.close()

    def _dump(self, prof: cProfile.Profile, mode: bytes) -> None:
        if self.profile_dir is None:
            return
        path = self.profile_dir / f"server-{mode.decode()}.pstats"
        tmp = path.with_suffix(".tmp")
        prof.dump_stats(tmp)
        tmp.replace(path)

    async def _run_until_closed(self, qp: Any, loop: Callable[[], Awaitable[None]]) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(loop)
            await qp.wait_closed()
            nursery.cancel_scope.cancel()

    async def _send_rate(
        self, pd: Any, cq: Any, stream: Any, req: Any, options: MpaOptions, prof: Any
    ) -> None:
        cap = QPCap(max_send_wr=256, max_recv_wr=SERVER_RECVS, max_inline_data=64, max_send_sge=1)
        qp = pd.create_qp(send_cq=cq, recv_cq=cq, cap=cap)
        mr = pd.reg_mr(bytearray(SERVER_RECVS * MSG_SIZE), Access.LOCAL_WRITE)
        recvs = RecvBatch(RecvWR(i, [mr.sge(i * MSG_SIZE, MSG_SIZE)]) for i in range(SERVER_RECVS))
        qp.post_recv_batch(recvs)  # before accepting: no Send may find the queue empty
        await accept_qp(
            qp, stream, req, private_data=PRIV_REP.pack(0, 0, SERVER_RECVS), options=options
        )
        if prof:
            prof.enable()
        count = bytearray(REQ.size)
        credit = SendBatch([SendWR(0, WROpcode.SEND, [count], SendFlags.INLINE)])
        wcs = WCArray(SERVER_RECVS)

        async def loop() -> None:
            received = last_credit = 0
            status, wr_id, solicited = wcs.status, wcs.wr_id, wcs.solicited
            while True:
                n = await cq.poll_wait_into(wcs)
                if status[:n].count(WCStatus.SUCCESS) != n:
                    return  # flushed: the client went away
                qp.post_recv_batch(recvs, indices=wr_id[:n])  # wr_id i is entry i
                received += n
                if received - last_credit >= CREDIT_STEP or True in solicited[:n]:
                    REQ.pack_into(count, 0, received)  # inline: copied when posted
                    qp.post_send_batch(credit)
                    last_credit = received

        await self._run_until_closed(qp, loop)

    async def _send_lat(
        self,
        pd: Any,
        cq: Any,
        stream: Any,
        req: Any,
        options: MpaOptions,
        prof: Any,
        busy_poll: float,
    ) -> None:
        cap = QPCap(max_send_wr=64, max_recv_wr=LAT_RECVS, max_inline_data=64)
        qp = pd.create_qp(send_cq=cq, recv_cq=cq, cap=cap)
        cq.busy_poll = busy_poll
        rmr = pd.reg_mr(bytearray(LAT_RECVS * 64), Access.LOCAL_WRITE)
        smr = pd.reg_mr(bytearray(64), Access.LOCAL_WRITE)
        recv_wrs = [RecvWR(i, [rmr.sge(i * 64, 64)]) for i in range(LAT_RECVS)]
        qp.post_recv(recv_wrs)
        await accept_qp(
            qp, stream, req, private_data=PRIV_REP.pack(0, 0, LAT_RECVS), options=options
        )
        if prof:
            prof.enable()
        pong = SendWR(0, WROpcode.SEND, [smr.sge(0, LAT_SIZE)], SendFlags.INLINE)

        async def loop() -> None:
            while True:
                for wc in await cq.poll_wait(LAT_RECVS):
                    if wc.status != WCStatus.SUCCESS:
                        return
                    qp.post_send(pong)  # (the answer first: see LAT_RECVS)
                    qp.post_recv(recv_wrs[wc.wr_id])

        await self._run_until_closed(qp, loop)

    async def _req_ack(
        self, pd: Any, cq: Any, stream: Any, req: Any, options: MpaOptions, prof: Any
    ) -> None:
        """Answer each request with a Send, after an RDMA Write when it names one."""
        cap = QPCap(max_send_wr=8 * REQ_RECVS, max_recv_wr=REQ_RECVS, max_inline_data=64)
        qp = pd.create_qp(send_cq=cq, recv_cq=cq, cap=cap)
        rmr = pd.reg_mr(bytearray(REQ_RECVS * REQ_SLOT), Access.LOCAL_WRITE)
        smr = pd.reg_mr(bytearray(_req_pattern(max(REQ_SLOT, REQ_WRITE.rdma))), Access.LOCAL_WRITE)
        recvs = RecvBatch(RecvWR(i, [rmr.sge(i * REQ_SLOT, REQ_SLOT)]) for i in range(REQ_RECVS))
        qp.post_recv_batch(recvs)
        await accept_qp(
            qp, stream, req, private_data=PRIV_REP.pack(0, 0, REQ_RECVS), options=options
        )
        if prof:
            prof.enable()
        wcs = WCArray(REQ_RECVS)
        posts: dict[tuple[int, int, int, int, bool], list[SendWR]] = {}

        def answer(head: tuple[int, int, int, int], signaled: bool) -> list[SendWR]:
            # (the same request is answered with the same WRs: the engine keeps their
            # templates, as RDS's send slots have it do)
            ack, rdma, addr, rkey = head
            if ack > REQ_SLOT or rdma > len(smr.buf):  # (a client's bytes: checked)
                raise BenchError(f"request for a {ack} B answer and a {rdma} B Write: refused")
            flags = SendFlags.SIGNALED if signaled else SendFlags(0)
            wrs = [SendWR(0, WROpcode.SEND, [smr.sge(0, ack)], flags)]
            if rdma:
                wrs.insert(0, SendWR(0, WROpcode.RDMA_WRITE, [smr.sge(0, rdma)], SendFlags(0),
                                     addr, rkey))  # fmt: skip
            return wrs

        async def loop() -> None:
            answered = 0
            buf = rmr.buf
            while True:
                n = await cq.poll_wait_into(wcs)
                for i in range(n):
                    if wcs.status[i] != WCStatus.SUCCESS:
                        return  # flushed: the client went away
                    if wcs.opcode[i] != WCOpcode.RECV:
                        continue
                    slot = wcs.wr_id[i]
                    if wcs.byte_len[i] < REQ_HDR.size:
                        raise BenchError(f"a {wcs.byte_len[i]} B request: no room for its head")
                    head = REQ_HDR.unpack_from(buf, slot * REQ_SLOT)
                    answered += 1
                    key = (*head, answered % REQ_SIGNAL == 0)
                    wrs = posts.get(key)
                    if wrs is None:
                        if len(posts) >= 64:  # (a client naming ever new heads)
                            posts.clear()
                        wrs = posts[key] = answer(head, key[-1])
                    qp.post_send(wrs)
                    qp.post_recv_batch(recvs, indices=(slot,))  # (after it: see REQ_RECVS)

        await self._run_until_closed(qp, loop)

    # ------------------------------------------------------------------ raw TCP
    async def raw(self, stream: trio.SocketStream) -> None:
        sock = stream.socket
        hdr = bytearray(RAW_HDR.size)
        async with stream:
            if not await read_exact(sock, memoryview(hdr)):
                return
            mode = RAW_HDR.unpack(hdr)[0][:1]
            if mode in (b"W", b"S"):
                buf = memoryview(bytearray(BULK_SIZE if mode == b"W" else RAW_STAGING))
                await stream.send_all(REQ.pack(await count_to_eof(sock, buf)))
            elif mode == b"R":
                src = memoryview(bytearray(BULK_SIZE))
                reqs = memoryview(bytearray(REQ.size * 64))
                pending = 0
                while n := await sock.recv_into(reqs):
                    pending += n
                    for _ in range(pending // REQ.size):
                        await stream.send_all(src)
                    pending %= REQ.size
            elif mode in (b"L", b"P"):
                busy_poll = self.busy_poll if mode == b"P" else 0.0
                buf = memoryview(bytearray(LAT_SIZE))
                while await read_exact(sock, buf, busy_poll):
                    await stream.send_all(buf)
            elif mode == b"Q":
                _, size, answer_size = RAW_REQ_HDR.unpack(hdr)
                if not size or answer_size > MiB + REQ_SLOT:  # (a client's bytes: checked)
                    raise BenchError(f"raw requests of {size} B, answers of {answer_size} B")
                request = memoryview(bytearray(size))
                answer = memoryview(bytearray(answer_size))
                while await read_exact(sock, request):
                    await stream.send_all(answer)
            else:
                raise BenchError(f"unknown raw mode {mode!r}")


async def _wait_stdin_eof() -> None:
    async with trio.lowlevel.FdStream(os.dup(sys.stdin.fileno())) as stdin:
        while await stdin.receive_some(4096):
            pass


async def serve_main(profile_dir: Path | None, host: str, device: str, busy_poll: float) -> None:
    async with rdmashim.open_device(device) as ctx:
        server = Server(ctx, profile_dir, busy_poll)
        rdma_l = (await trio.open_tcp_listeners(0, host=host))[0]
        raw_l = (await trio.open_tcp_listeners(0, host=host))[0]
        ports = rdma_l.socket.getsockname()[1], raw_l.socket.getsockname()[1]
        print(f"READY {ports[0]} {ports[1]}", flush=True)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.accept_loop, rdma_l, server.rdma)
            nursery.start_soon(server.accept_loop, raw_l, server.raw)
            await _wait_stdin_eof()  # the client closes our stdin when it is done
            nursery.cancel_scope.cancel()


# =============================================================================================
# client
# =============================================================================================


@dataclass
class Config:
    duration: float
    lat_iters: int
    lat_warmup: int
    crc: bool
    rdma_port: int
    raw_port: int
    profile: bool = False
    host: str = HOST
    device: str = DEVICE
    fpdu: int = MAX_FPDU
    """Our largest FPDU; 0: the connection's MSS (as Linux siw)."""
    path: str = "loopback"
    busy_poll: float = BUSY_POLL_US / 1e6
    """Seconds send-lat-poll's waits poll before they block, ours and raw TCP's alike."""
    floor_binary: floor.FloorBinary | None = None
    """The compiled latency floor (floor.c), or None: ``floor_why`` says why not."""
    floor_why: str = "not measured in this run"


@dataclass
class Conn:
    """The client's end of one RDMA connection."""

    pd: Any
    cq: Any
    qp: Any
    remote_addr: int
    rkey: int
    credits: int
    mrs: dict[str, Any] = field(default_factory=dict)
    max_fpdu: int = MAX_FPDU

    async def aclose(self) -> None:
        self.qp.close()
        with trio.move_on_after(10):
            await self.qp.wait_closed()
        self.pd.close()
        self.cq.close()


async def rdma_connect(
    ctx: Any,
    cfg: Config,
    mode: bytes,
    cap: QPCap,
    mrs: dict[str, tuple[int, Access]],
    pre: Callable[[Conn], None] = lambda conn: None,
) -> Conn:
    pd = ctx.alloc_pd()
    cq = ctx.create_cq(4 * SERVER_RECVS)
    qp = pd.create_qp(send_cq=cq, recv_cq=cq, cap=cap)
    conn = Conn(pd, cq, qp, 0, 0, 0)
    conn.mrs = {name: pd.reg_mr(bytearray(size), access) for name, (size, access) in mrs.items()}
    pre(conn)
    stream = await trio.open_tcp_stream(cfg.host, cfg.rdma_port)
    conn.max_fpdu = fpdu_size(stream, cfg.fpdu)
    res = await connect_qp(
        qp,
        stream,
        private_data=PRIV_REQ.pack(mode, cfg.crc, cfg.profile, cfg.fpdu),
        options=MpaOptions(crc=cfg.crc, max_fpdu=conn.max_fpdu),
    )
    conn.remote_addr, conn.rkey, conn.credits = PRIV_REP.unpack_from(res.private_data)
    return conn


async def raw_connect(cfg: Config, mode: bytes) -> trio.SocketStream:
    stream = await trio.open_tcp_stream(cfg.host, cfg.raw_port)  # trio sets TCP_NODELAY
    await stream.send_all(RAW_HDR.pack(mode))
    return stream


def _bw(nbytes: int, seconds: float) -> dict[str, float]:
    return {"value": nbytes / seconds / MiB, "bytes": nbytes, "seconds": seconds}


class _Prof:
    """Optional cProfile over a benchmark's timed window (``--profile``)."""

    def __init__(self, on: bool) -> None:
        self.profile = cProfile.Profile() if on else None

    def start(self) -> None:
        if self.profile:
            self.profile.enable()

    def stop(self) -> None:
        if self.profile:
            self.profile.disable()


# ------------------------------------------------------------------ write-bw / read-bw
async def ours_bulk(ctx: Any, cfg: Config, prof: _Prof, opcode: WROpcode) -> dict[str, float]:
    mode = b"W" if opcode is WROpcode.RDMA_WRITE else b"R"
    conn = await rdma_connect(
        ctx,
        cfg,
        mode,
        QPCap(max_send_wr=2 * DEPTH + 2, max_recv_wr=1),
        {"local": (BULK_SIZE, Access.LOCAL_WRITE), "probe": (64, Access.LOCAL_WRITE)},
    )
    qp, cq = conn.qp, conn.cq
    try:
        wr = SendWR(
            1, opcode, [conn.mrs["local"].sge()], SendFlags.SIGNALED, conn.remote_addr, conn.rkey
        )
        prof.start()
        t0 = time.perf_counter()
        deadline = t0 + cfg.duration
        qp.post_send([wr] * DEPTH)
        outstanding = DEPTH
        done = 0
        while outstanding:
            wcs = await cq.poll_wait(DEPTH)
            for wc in wcs:
                _check(wc, qp)
            done += len(wcs)
            outstanding -= len(wcs)
            if time.perf_counter() < deadline:
                qp.post_send([wr] * len(wcs))
                outstanding += len(wcs)
        if opcode is WROpcode.RDMA_WRITE:
            # A Read completes after all earlier Writes were placed at the server.
            probe = SendWR(
                2, WROpcode.RDMA_READ, [conn.mrs["probe"].sge(0, 8)],
                SendFlags.SIGNALED, conn.remote_addr, conn.rkey,
            )  # fmt: skip
            qp.post_send(probe)
            _check((await cq.poll_wait(1))[0], qp)
        elapsed = time.perf_counter() - t0
        prof.stop()
    finally:
        await conn.aclose()
    return {**_bw(done * BULK_SIZE, elapsed), "max_fpdu": conn.max_fpdu}


async def ours_write(ctx: Any, cfg: Config, prof: _Prof) -> dict[str, float]:
    return await ours_bulk(ctx, cfg, prof, WROpcode.RDMA_WRITE)


async def ours_read(ctx: Any, cfg: Config, prof: _Prof) -> dict[str, float]:
    return await ours_bulk(ctx, cfg, prof, WROpcode.RDMA_READ)


async def raw_write(ctx: Any, cfg: Config, prof: _Prof) -> dict[str, float]:
    stream = await raw_connect(cfg, b"W")
    async with stream:
        chunk = memoryview(bytearray(BULK_SIZE))
        answer = memoryview(bytearray(REQ.size))
        t0 = time.perf_counter()
        deadline = t0 + cfg.duration
        sent = 0
        while time.perf_counter() < deadline:
            await stream.send_all(chunk)
            sent += BULK_SIZE
        await stream.send_eof()
        if not await read_exact(stream.socket, answer):
            raise BenchError("raw server closed without its count")
        elapsed = time.perf_counter() - t0
    if REQ.unpack(answer)[0] != sent:
        raise BenchError(f"raw server counted {REQ.unpack(answer)[0]} bytes, sent {sent}")
    return _bw(sent, elapsed)


async def raw_read(ctx: Any, cfg: Config, prof: _Prof) -> dict[str, float]:
    stream = await raw_connect(cfg, b"R")
    sock = stream.socket
    async with stream:
        dst = memoryview(bytearray(BULK_SIZE))
        request = REQ.pack(BULK_SIZE)
        t0 = time.perf_counter()
        deadline = t0 + cfg.duration
        await stream.send_all(request * DEPTH)
        outstanding = DEPTH
        done = got = 0
        while outstanding:
            n = await sock.recv_into(dst[got:])
            if not n:
                raise BenchError("raw server closed mid-read")
            got += n
            if got == BULK_SIZE:
                got = 0
                done += 1
                outstanding -= 1
                if time.perf_counter() < deadline:
                    await stream.send_all(request)
                    outstanding += 1
        elapsed = time.perf_counter() - t0
    return _bw(done * BULK_SIZE, elapsed)


# ------------------------------------------------------------------ send-rate
async def ours_send_rate(ctx: Any, cfg: Config, prof: _Prof) -> dict[str, float]:
    credits = RecvBatch(())

    def pre(conn: Conn) -> None:
        nonlocal credits
        cmr = conn.mrs["credit"]
        credits = RecvBatch(RecvWR(i, [cmr.sge(i * 8, 8)]) for i in range(CLIENT_CREDIT_RECVS))
        conn.qp.post_recv_batch(credits)

    cap = QPCap(
        max_send_wr=BATCH * MAX_BATCHES + 8, max_recv_wr=CLIENT_CREDIT_RECVS, max_inline_data=64
    )
    conn = await rdma_connect(
        ctx, cfg, b"S", cap,
        {"msg": (MSG_SIZE, Access.LOCAL_WRITE), "credit": (8 * CLIENT_CREDIT_RECVS, ALL_ACCESS)},
        pre,
    )  # fmt: skip
    qp, cq = conn.qp, conn.cq
    credit_buf = conn.mrs["credit"].buf
    try:
        sge = conn.mrs["msg"].sge(0, MSG_SIZE)
        quiet = SendWR(0, WROpcode.SEND, [sge], SendFlags.INLINE)
        last = SendWR(1, WROpcode.SEND, [sge], SendFlags.INLINE | SendFlags.SIGNALED)
        batch = SendBatch([quiet] * (BATCH - 1) + [last])
        flags = SendFlags.INLINE | SendFlags.SIGNALED | SendFlags.SOLICITED
        marker = SendBatch([SendWR(2, WROpcode.SEND, [sge], flags)])
        wcs = WCArray(256)
        window = conn.credits
        granted, confirmed, outstanding = window, 0, 0

        async def handle() -> None:
            nonlocal granted, confirmed, outstanding
            n = await cq.poll_wait_into(wcs)
            for i in range(n):
                if wcs.status[i] != WCStatus.SUCCESS:
                    _check(wcs[i], qp)
                if wcs.opcode[i] == WCOpcode.RECV:
                    slot = wcs.wr_id[i]
                    count = REQ.unpack_from(credit_buf, slot * 8)[0]
                    qp.post_recv_batch(credits, indices=(slot,))
                    if count > confirmed:
                        confirmed = count
                        granted = window + count
                else:
                    outstanding -= 1

        prof.start()
        t0 = time.perf_counter()
        deadline = t0 + cfg.duration
        sent = 0
        while time.perf_counter() < deadline:
            while outstanding < MAX_BATCHES and granted - sent >= BATCH:
                qp.post_send_batch(batch)
                sent += BATCH
                outstanding += 1
            await handle()
        # Close the window: one solicited message makes the server report its count now.
        while granted - sent < 1 or outstanding >= MAX_BATCHES:
            await handle()
        qp.post_send_batch(marker)
        sent += 1
        outstanding += 1
        while confirmed < sent:
            await handle()
        elapsed = time.perf_counter() - t0
        prof.stop()
    finally:
        await conn.aclose()
    if confirmed != sent:
        raise BenchError(f"server counted {confirmed} messages, sent {sent}")
    return {"value": sent / elapsed / 1e6, "messages": sent, "seconds": elapsed}


async def raw_send_rate(ctx: Any, cfg: Config, prof: _Prof) -> dict[str, float]:
    stream = await raw_connect(cfg, b"S")
    async with stream:
        batch = bytes(MSG_SIZE * BATCH)
        answer = memoryview(bytearray(REQ.size))
        t0 = time.perf_counter()
        deadline = t0 + cfg.duration
        sent = 0
        while time.perf_counter() < deadline:
            await stream.send_all(batch)
            sent += BATCH
        await stream.send_eof()
        if not await read_exact(stream.socket, answer):
            raise BenchError("raw server closed without its count")
        elapsed = time.perf_counter() - t0
    if REQ.unpack(answer)[0] != sent * MSG_SIZE:
        raise BenchError(f"raw server counted {REQ.unpack(answer)[0]} bytes, sent {sent} msgs")
    return {"value": sent / elapsed / 1e6, "messages": sent, "seconds": elapsed}


# ------------------------------------------------------------------ send-lat
def _lat_stats(half_rtts_ns: list[int]) -> dict[str, float]:
    us = sorted(t / 1000 for t in half_rtts_ns)
    n = len(us)
    return {
        "value": statistics.median(us),
        "n_iterations": n,
        "t_min": us[0],
        "t_max": us[-1],
        "t_typical": statistics.median(us),
        "t_avg": statistics.fmean(us),
        "t_stdev": statistics.pstdev(us),
        "percentile_99": us[min(n - 1, int(n * 0.99))],
        "percentile_99.9": us[min(n - 1, int(n * 0.999))],
    }


async def ours_send_lat(ctx: Any, cfg: Config, prof: _Prof) -> dict[str, float]:
    return await _ours_lat(ctx, cfg, prof, b"L", 0.0)


async def ours_send_lat_poll(ctx: Any, cfg: Config, prof: _Prof) -> dict[str, float]:
    return await _ours_lat(ctx, cfg, prof, b"P", cfg.busy_poll)


async def _ours_lat(
    ctx: Any, cfg: Config, prof: _Prof, mode: bytes, busy_poll: float
) -> dict[str, float]:
    recv_wrs: list[RecvWR] = []

    def pre(conn: Conn) -> None:
        rmr = conn.mrs["recv"]
        recv_wrs.extend(RecvWR(i, [rmr.sge(i * 64, 64)]) for i in range(LAT_RECVS))
        conn.qp.post_recv(recv_wrs)

    cap = QPCap(max_send_wr=64, max_recv_wr=LAT_RECVS, max_inline_data=64)
    conn = await rdma_connect(
        ctx,
        cfg,
        mode,
        cap,
        {"send": (64, Access.LOCAL_WRITE), "recv": (64 * LAT_RECVS, Access.LOCAL_WRITE)},
        pre,
    )
    qp, cq = conn.qp, conn.cq
    cq.busy_poll = busy_poll
    samples: list[int] = []
    clock = time.perf_counter_ns
    try:
        ping = SendWR(0, WROpcode.SEND, [conn.mrs["send"].sge(0, LAT_SIZE)], SendFlags.INLINE)
        prof.start()
        for i in range(cfg.lat_warmup + cfg.lat_iters):
            t = clock()
            qp.post_send(ping)
            wc = (await cq.poll_wait(1))[0]
            dt = clock() - t
            _check(wc, qp)
            qp.post_recv(recv_wrs[wc.wr_id])
            if i >= cfg.lat_warmup:
                samples.append(dt // 2)
        prof.stop()
    finally:
        await conn.aclose()
    return _lat_stats(samples)


async def raw_send_lat(ctx: Any, cfg: Config, prof: _Prof) -> dict[str, float]:
    return await _raw_lat(cfg, b"L", 0.0)


async def raw_send_lat_poll(ctx: Any, cfg: Config, prof: _Prof) -> dict[str, float]:
    return await _raw_lat(cfg, b"P", cfg.busy_poll)


async def _raw_lat(cfg: Config, mode: bytes, busy_poll: float) -> dict[str, float]:
    stream = await raw_connect(cfg, mode)
    sock = stream.socket
    samples: list[int] = []
    clock = time.perf_counter_ns
    async with stream:
        ping = bytes(LAT_SIZE)
        pong = memoryview(bytearray(LAT_SIZE))
        for i in range(cfg.lat_warmup + cfg.lat_iters):
            t = clock()
            await stream.send_all(ping)
            if not await read_exact(sock, pong, busy_poll):
                raise BenchError("raw server closed mid-ping-pong")
            dt = clock() - t
            if i >= cfg.lat_warmup:
                samples.append(dt // 2)
    return _lat_stats(samples)


# ------------------------------------------------------------------ req-ack / req-write
@dataclass(frozen=True)
class ReqCase:
    """One request/answer pattern: request and answer bytes, requests in flight, and
    the bytes of the RDMA Write that comes before each answer (0: none)."""

    request: int
    answer: int
    depth: int
    rdma: int = 0


REQ_ACK = ReqCase(1024, 256, 1)
"""rds stress's ``-q 1024 -a 256 -t 1 -d 1``, without RDS."""
REQ_WRITE = ReqCase(64, 16, 4, 65536)
"""rds stress's ``-q 64 -a 16 -t 1 -d 4 -D 65536``, without RDS."""


def _req_pattern(size: int) -> bytes:
    """What the server's answers and Writes carry (the client checks its Writes landed)."""
    return bytes(range(256)) * (size // 256) + bytes(range(size % 256))


def _tx(done: int, seconds: float, depth: int) -> dict[str, float]:
    return {
        "value": done / seconds,
        "transactions": done,
        "seconds": seconds,
        "rtt_us": depth * seconds / max(1, done) * 1e6,
    }


async def ours_req(ctx: Any, cfg: Config, case: ReqCase, prof: _Prof) -> dict[str, float]:
    recv_wrs = RecvBatch(())

    def pre(conn: Conn) -> None:
        nonlocal recv_wrs
        rmr = conn.mrs["recv"]
        recv_wrs = RecvBatch(RecvWR(i, [rmr.sge(i * REQ_SLOT, REQ_SLOT)]) for i in range(REQ_RECVS))
        conn.qp.post_recv_batch(recv_wrs)

    cap = QPCap(max_send_wr=8 * REQ_RECVS, max_recv_wr=REQ_RECVS, max_inline_data=64)
    conn = await rdma_connect(
        ctx, cfg, b"Q", cap,
        {
            "request": (case.request, Access.LOCAL_WRITE),
            "recv": (REQ_RECVS * REQ_SLOT, Access.LOCAL_WRITE),
            "sink": (max(1, case.rdma), ALL_ACCESS),
        },
        pre,
    )  # fmt: skip
    qp, cq = conn.qp, conn.cq
    try:
        sink = conn.mrs["sink"]
        REQ_HDR.pack_into(conn.mrs["request"].buf, 0, case.answer, case.rdma, sink.addr, sink.rkey)
        sge = conn.mrs["request"].sge(0, case.request)
        quiet = SendWR(0, WROpcode.SEND, [sge], SendFlags(0))
        signaled = SendWR(0, WROpcode.SEND, [sge], SendFlags.SIGNALED)
        wcs = WCArray(REQ_RECVS)
        prof.start()
        t0 = time.perf_counter()
        deadline = t0 + cfg.duration
        sent = done = 0
        for _ in range(case.depth):
            sent += 1
            qp.post_send(signaled if sent % REQ_SIGNAL == 0 else quiet)
        while done < sent:
            n = await cq.poll_wait_into(wcs)
            for i in range(n):
                if wcs.status[i] != WCStatus.SUCCESS:
                    _check(wcs[i], qp)
                if wcs.opcode[i] != WCOpcode.RECV:
                    continue
                done += 1
                if time.perf_counter() < deadline:
                    sent += 1
                    qp.post_send(signaled if sent % REQ_SIGNAL == 0 else quiet)
                qp.post_recv_batch(recv_wrs, indices=(wcs.wr_id[i],))
        elapsed = time.perf_counter() - t0
        prof.stop()
        if case.rdma and sink.buf != _req_pattern(case.rdma):
            raise BenchError("the server's RDMA Writes did not land in the client's MR")
    finally:
        await conn.aclose()
    return _tx(done, elapsed, case.depth)


async def raw_req(cfg: Config, case: ReqCase) -> dict[str, float]:
    answer_size = case.answer + case.rdma
    stream = await raw_connect(cfg, RAW_REQ_HDR.pack(b"Q", case.request, answer_size))
    async with stream:
        request = bytes(case.request)
        answer = memoryview(bytearray(answer_size))
        t0 = time.perf_counter()
        deadline = t0 + cfg.duration
        sent = done = 0
        for _ in range(case.depth):
            await stream.send_all(request)
            sent += 1
        while done < sent:
            if not await read_exact(stream.socket, answer):
                raise BenchError("raw server closed mid-request")
            done += 1
            if time.perf_counter() < deadline:
                await stream.send_all(request)
                sent += 1
        elapsed = time.perf_counter() - t0
    return _tx(done, elapsed, case.depth)


async def ours_req_ack(ctx: Any, cfg: Config, prof: _Prof) -> dict[str, float]:
    return await ours_req(ctx, cfg, REQ_ACK, prof)


async def raw_req_ack(ctx: Any, cfg: Config, prof: _Prof) -> dict[str, float]:
    return await raw_req(cfg, REQ_ACK)


async def ours_req_write(ctx: Any, cfg: Config, prof: _Prof) -> dict[str, float]:
    return await ours_req(ctx, cfg, REQ_WRITE, prof)


async def raw_req_write(ctx: Any, cfg: Config, prof: _Prof) -> dict[str, float]:
    return await raw_req(cfg, REQ_WRITE)


# ------------------------------------------------------------------ the table
@dataclass(frozen=True)
class Bench:
    name: str
    ours: Callable[[Any, Config, _Prof], Awaitable[dict[str, float]]]
    raw: Callable[[Any, Config, _Prof], Awaitable[dict[str, float]]]
    msg_size: int
    depth: str
    unit: str
    higher_is_better: bool
    server_mode: str
    floor_mode: str = ""
    """The latency floor this row is printed against: floor.c's mode (block, poll), or none."""


BENCHES = [
    Bench("write-bw", ours_write, raw_write, BULK_SIZE, str(DEPTH), "MiB/sec", True, "W"),
    Bench("read-bw", ours_read, raw_read, BULK_SIZE, str(DEPTH), "MiB/sec", True, "R"),
    Bench(
        "send-rate",
        ours_send_rate,
        raw_send_rate,
        MSG_SIZE,
        f"{BATCH}x{MAX_BATCHES}",
        "Mmsg/sec",
        True,
        "S",
    ),
    Bench("send-lat", ours_send_lat, raw_send_lat, LAT_SIZE, "1", "usec", False, "L", "block"),
    Bench(
        "send-lat-poll",
        ours_send_lat_poll,
        raw_send_lat_poll,
        LAT_SIZE,
        "1",
        "usec",
        False,
        "P",
        "poll",
    ),
    Bench("req-ack", ours_req_ack, raw_req_ack, REQ_ACK.request, "1", "tx/sec", True, "Q"),
    Bench("req-write", ours_req_write, raw_req_write, REQ_WRITE.request, "4", "tx/sec", True, "Q"),
]
BY_NAME = {b.name: b for b in BENCHES}


def _perftest_keys(bench: Bench, detail: dict[str, float]) -> dict[str, float]:
    """perftest's JSON key names for one sample."""
    if bench.unit == "usec":
        keys = ("t_min", "t_max", "t_typical", "t_avg", "t_stdev")
        out = {k: detail[k] for k in keys}
        out["percentile_99"] = detail["percentile_99"]
        out["percentile_99.9"] = detail["percentile_99.9"]
        return {"MsgSize": bench.msg_size, "n_iterations": detail["n_iterations"], **out}
    if bench.unit == "tx/sec":
        return {
            "MsgSize": bench.msg_size,
            "n_iterations": detail["transactions"],
            "MsgRate": detail["value"] / 1e6,
        }
    if bench.name == "send-rate":
        rate = detail["value"]
        return {
            "MsgSize": bench.msg_size,
            "n_iterations": detail["messages"],
            "BW_average": rate * 1e6 * bench.msg_size / MiB,
            "MsgRate": rate,
        }
    return {
        "MsgSize": bench.msg_size,
        "n_iterations": detail["bytes"] // bench.msg_size,
        "BW_average": detail["value"],
        "MsgRate": detail["value"] * MiB / bench.msg_size / 1e6,
    }


async def run_samples(
    ctx: Any, cfg: Config, benches: list[Bench], repeat: int, status: Status
) -> list[dict[str, Any]]:
    results = []
    for bench in benches:
        details: dict[str, list] = {"ours": [], "raw": []}
        limit = max(60.0, 10 * cfg.duration + 60)
        floors: list[float] = []
        floor_why = cfg.floor_why
        binary = cfg.floor_binary if bench.floor_mode else None
        for i in range(repeat):
            for side, fn in (("ours", bench.ours), ("raw", bench.raw)):
                status.show(f"{bench.name}: sample {i + 1}/{repeat} ({side})")
                with trio.fail_after(limit):
                    details[side].append(await fn(ctx, cfg, _Prof(False)))
            if binary is not None:
                status.show(f"{bench.name}: sample {i + 1}/{repeat} (floor)")
                try:
                    floors.append(await floor.measure(binary, bench.floor_mode,
                                                      cfg.lat_iters, cfg.lat_warmup))  # fmt: skip
                except floor.FloorUnavailable as exc:
                    floor_why, binary = str(exc), None
        ours = statistics.median(d["value"] for d in details["ours"])
        raw = statistics.median(d["value"] for d in details["raw"])
        result: dict[str, Any] = {
            "name": bench.name,
            "msg_size": bench.msg_size,
            "depth": bench.depth,
            "unit": bench.unit,
            "ours_median": ours,
            "raw_median": raw,
            "ratio": ours / raw,
            "ratio_meaning": (
                "ours/raw throughput (>1: faster than raw TCP)"
                if bench.higher_is_better
                else "ours/raw time (>1: slower than raw TCP)"
            ),
            "ours": [d["value"] for d in details["ours"]],
            "raw": [d["value"] for d in details["raw"]],
            "samples": details,
            "perftest": {
                side: [_perftest_keys(bench, d) for d in details[side]] for side in ("ours", "raw")
            },
        }
        if bench.floor_mode:
            result.update(_floor_fields(bench.floor_mode, ours, floors, repeat, floor_why))
        results.append(result)
    status.clear()
    return results


def _floor_fields(
    mode: str, ours: float, floors: list[float], repeat: int, why: str
) -> dict[str, Any]:
    """A latency row's floor: the median of its samples and ours/floor, or why there is none
    (no compiler, or the helper failed in a sample: then no figure at all)."""
    if len(floors) < repeat:
        return {"floor_mode": mode, "floor_unavailable": why}
    median = statistics.median(floors)
    return {
        "floor_mode": mode,
        "floor_median": median,
        "floor_ratio": ours / median,
        "floor_ratio_meaning": f"ours/floor time (floor.c, {mode}: C over loopback TCP)",
        "floor": floors,
    }


def print_header(
    args: argparse.Namespace, cfg: Config, meta: dict[str, Any], benches: list[Bench]
) -> None:
    crc = "ON" if cfg.crc else "OFF"
    print(RESULT_LINE)
    print(f" rdmashim soft-iWARP vs raw Python TCP (trio on both ends, two processes, {cfg.path})")
    print(RESULT_LINE)
    print(f" Device          : {cfg.device:<16}Transport type : IWARP")
    print(f" Connection type : RC              CRC            : {crc}")
    fpdu = f"{cfg.fpdu} B" if cfg.fpdu else "MSS (as siw)"
    print(f" Max FPDU (ours) : {fpdu}")
    print(engine_line())
    print(f" Repeats         : {args.repeat:<16}Reported       : median of repeats")
    dur = f"{cfg.duration:g} s/sample"
    print(f" Duration        : {dur:<16}Lat. iterations: {cfg.lat_iters}")
    print(f" Python          : {meta['python']:<16}CPUs           : {meta['nproc']}")
    print(cpu_line())
    busy = f"{cfg.busy_poll * 1e6:g} us"
    print(f" Date            : {meta['date']:<32}Busy poll (-poll): {busy}")
    if cfg.floor_binary is not None:
        print(f" Floor (C)       : {cfg.floor_binary.command} (8 B TCP ping-pong, 127.0.0.1)")
    elif any(b.floor_mode for b in benches):
        print(f" Floor (C)       : n/a ({cfg.floor_why})")


def _floor_cells(r: dict[str, Any]) -> str:
    """A row's floor and ours/floor, or why not; nothing for rows without a floor."""
    if "floor_median" in r:
        return f"{r['floor_median']:>8.2f}  {r['floor_ratio']:>9.2f}x"
    if "floor_unavailable" in r:
        return f"floor: n/a ({r['floor_unavailable']})"
    return ""


def print_table(results: list[dict[str, Any]]) -> None:
    """The medians, their ratio, the floor of the latency rows, and the FPDU size our side
    sent."""
    floors = any("floor_mode" in r for r in results)
    print(RESULT_LINE)
    head = (
        f" {'benchmark':<14}{'#bytes':>6}  {'depth':<7}{'ours':>12}  {'raw TCP':>12}  "
        f"{'ours/raw':>9}  {'unit':<9}" + (f"{'floor':>8}  {'ours/floor':>10}" if floors else "")
    )
    print(head.rstrip())
    for r in results:
        prec = 4 if r["unit"] == "Mmsg/sec" else 2
        print(
            f" {r['name']:<14}{r['msg_size']:>6}  {r['depth']:<7}"
            f"{r['ours_median']:>12.{prec}f}  {r['raw_median']:>12.{prec}f}  "
            f"{r['ratio']:>9.3f}  {r['unit']:<9}{_floor_cells(r)}".rstrip()
        )
    print(RESULT_LINE)
    print(" ratio: ours/raw; for usec (latency, half round trip) above 1 means slower than raw TCP")
    if floors:
        print(" floor: usec, half round trip of an 8 B TCP ping-pong in C over 127.0.0.1")
        print(" (benchmarks/floor.c), both ends blocking for send-lat, busy-polling for")
        print(" send-lat-poll; ours/floor: how many times the floor ours takes")
    ours = [d for r in results for d in r["samples"]["ours"]]
    sizes = sorted({d["max_fpdu"] for d in ours if "max_fpdu" in d})
    if sizes:
        print(f" our FPDUs: at most {', '.join(map(str, sizes))} bytes on the wire each")


# ------------------------------------------------------------------ profiling
def _wait_for_file(path: Path, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


async def run_profiles(
    ctx: Any, cfg: Config, benches: list[Bench], profile_dir: Path
) -> list[dict[str, float]]:
    """One profiled sample of ours per benchmark, profiling both processes.

    The server profiles each connection from accept to close and writes
    ``server-<mode>.pstats`` when it ends; we wait for that file before the next
    benchmark, so two server profilers never overlap.
    """
    details = []
    for bench in benches:
        server_file = profile_dir / f"server-{bench.server_mode}.pstats"
        server_file.unlink(missing_ok=True)
        prof = _Prof(True)
        with trio.fail_after(10 * cfg.duration + 60):
            details.append(await bench.ours(ctx, cfg, prof))
        assert prof.profile is not None
        prof.profile.dump_stats(profile_dir / f"client-{bench.name}.pstats")
        if await trio.to_thread.run_sync(_wait_for_file, server_file, 30.0):
            server_file.replace(profile_dir / f"server-{bench.name}.pstats")
    return details


def report_profiles(benches: list[Bench], details: list[dict], profile_dir: Path) -> None:
    """Print the top functions of both processes' profiles."""
    for bench, detail in zip(benches, details, strict=True):
        print(f"== {bench.name}: ours {detail['value']:.4g} {bench.unit} (profiled, slower)")
        for label in ("client", "server"):
            path = profile_dir / f"{label}-{bench.name}.pstats"
            print(f"-- {label} process, top 15 by tottime ({path})")
            print(top_functions(path, 15) if path.exists() else "   (no profile written)")


# ------------------------------------------------------------------ main
def _meta(cfg: Config, args: argparse.Namespace) -> dict[str, Any]:
    return {
        **run_meta(),
        "path": cfg.path,
        "device": cfg.device,
        "host": cfg.host,
        "max_fpdu": cfg.fpdu or "mss",
        "crc": cfg.crc,
        "repeat": args.repeat,
        "duration_s": cfg.duration,
        "lat_iterations": cfg.lat_iters,
        "lat_warmup": cfg.lat_warmup,
        "busy_poll_us": cfg.busy_poll * 1e6,
        "bulk_size": BULK_SIZE,
        "depth": DEPTH,
        "send_batch": BATCH,
        "send_max_batches": MAX_BATCHES,
        "server_recvs": SERVER_RECVS,
        "credit_step": CREDIT_STEP,
        "floor": (
            {"source": "benchmarks/floor.c", "command": cfg.floor_binary.command}
            if cfg.floor_binary is not None
            else {"unavailable": cfg.floor_why}
        ),
    }


async def client_main(
    args: argparse.Namespace, cfg: Config, benches: list[Bench]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    async with rdmashim.open_device(cfg.device) as ctx:
        if args.profile:
            return {}, await run_profiles(ctx, cfg, benches, Path(args.profile))
        meta = _meta(cfg, args)
        print_header(args, cfg, meta, benches)
        sys.stdout.flush()
        results = await run_samples(ctx, cfg, benches, args.repeat, Status())
        meta["loadavg_end"] = os.getloadavg()
        print_table(results)
        return meta, results


def _busy_poll_arg(text: str) -> float:
    """``--busy-poll``: microseconds, 0 .. 1e6."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of microseconds") from None
    if not 0 <= value <= 1e6:
        raise argparse.ArgumentTypeError(f"{value:g} outside 0..1000000")
    return value


def _fpdu_arg(text: str) -> int:
    """``--fpdu``: bytes, or ``mss`` (0)."""
    if text.lower() == "mss":
        return 0
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a size nor 'mss'") from None
    if not 64 <= value <= MAX_FPDU:
        raise argparse.ArgumentTypeError(f"{value} outside 64..{MAX_FPDU}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="soft-iWARP benchmarks beside raw Python TCP (two processes, loopback)."
    )
    p.add_argument("--quick", action="store_true", help="short samples (0.3 s, 3 repeats)")
    p.add_argument("--json", metavar="FILE", help="write every sample to FILE")
    p.add_argument("--repeat", type=int, help="samples per side, alternating (default 5)")
    p.add_argument("--crc", action=argparse.BooleanOptionalAction, default=True, help="MPA CRC32c")
    p.add_argument(
        "--only",
        action="append",
        choices=[b.name for b in BENCHES],
        help="run only this benchmark (repeatable)",
    )
    p.add_argument("--duration", type=float, help="seconds per bandwidth/rate sample")
    p.add_argument("--iters", type=int, help="ping-pong iterations per latency sample")
    p.add_argument(
        "--busy-poll",
        type=_busy_poll_arg,
        default=BUSY_POLL_US,
        metavar="US",
        help="send-lat-poll: microseconds each wait polls before it blocks, ours "
        f"(CQ.busy_poll) and raw TCP's (the socket) alike (default {BUSY_POLL_US:g})",
    )
    p.add_argument(
        "--profile",
        metavar="DIR",
        help="run one profiled sample of ours per benchmark (both processes) and "
        "print the top 15 functions by tottime; no table",
    )
    p.add_argument(
        "--path",
        choices=["loopback", "veth"],
        default="loopback",
        help="loopback (default), or veth: server and client in two network namespaces "
        "joined by a veth pair with a 1500-byte MTU (needs root and iproute2; runs write-bw "
        "unless --only says otherwise)",
    )
    p.add_argument(
        "--fpdu",
        type=_fpdu_arg,
        default=None,
        help="our largest FPDU in bytes (64..65536), or 'mss': one FPDU per TCP segment, "
        "as Linux siw sends them (default: 65536 on loopback, mss on veth)",
    )
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--profile-dir", help=argparse.SUPPRESS)
    p.add_argument("--host", default=HOST, help=argparse.SUPPRESS)
    p.add_argument("--device", default=DEVICE, help=argparse.SUPPRESS)
    p.add_argument("--netns-server", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.repeat is None:
        args.repeat = 3 if args.quick else 5
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    return args


def prepare_floor(cfg: Config, benches: list[Bench], directory: Path) -> None:
    """Compile floor.c into ``directory`` when a latency row of this run needs it (not when
    profiling); else, or when it cannot be compiled, ``cfg.floor_why`` says why not."""
    if cfg.profile or not any(b.floor_mode for b in benches):
        return
    if cfg.path != "loopback":
        cfg.floor_why = "measured on loopback only; this run is over a veth pair"
        return
    try:
        cfg.floor_binary = floor.build(directory)
    except floor.FloorUnavailable as exc:
        cfg.floor_why = str(exc)


def run_on_veth(argv: list[str]) -> int:
    """``--path veth``: build the namespaces and run this script's client in one of them
    (it starts its server in the other); delete them afterwards."""
    why = vethpath.unavailable()
    if why is not None:
        print(f"bench.py --path veth: {why}", file=sys.stderr)
        return 2
    with vethpath.veth_path() as net:
        cmd = [*vethpath.netns_exec(net.client_ns), sys.executable, str(Path(__file__).resolve()),
               *argv, "--netns-server", net.server_ns]  # fmt: skip
        return subprocess.run(cmd, check=False).returncode


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.serve:
        profile_dir = Path(args.profile_dir) if args.profile_dir else None
        trio.run(serve_main, profile_dir, args.host, args.device, args.busy_poll / 1e6)
        return 0
    veth = args.path == "veth"
    if veth and args.netns_server is None:
        return run_on_veth(argv)
    duration = args.duration or (0.3 if args.quick else 1.5)
    iters = args.iters or (300 if args.quick else 2000)
    if args.profile:
        duration = args.duration or 2.0
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    only = args.only or (["write-bw"] if veth else None)
    benches = [b for b in BENCHES if not only or b.name in only]
    host = vethpath.SERVER_ADDR if veth else HOST
    device = f"siw_{vethpath.CLIENT_IF}" if veth else DEVICE
    server_device = f"siw_{vethpath.SERVER_IF}" if veth else DEVICE
    cmd = [sys.executable, str(Path(__file__).resolve()), "--serve", "--host", host,
           "--device", server_device, "--busy-poll", str(args.busy_poll)]  # fmt: skip
    if args.netns_server is not None:
        cmd = [*vethpath.netns_exec(args.netns_server), *cmd]
    if args.profile:
        cmd += ["--profile-dir", str(Path(args.profile).resolve())]
    server = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert server.stdout is not None
        line = server.stdout.readline().decode().split()
        if len(line) != 3 or line[0] != "READY":
            raise BenchError(f"server did not start (said {line!r})")
        cfg = Config(
            duration=duration,
            lat_iters=iters,
            lat_warmup=max(20, iters // 10),
            crc=args.crc,
            rdma_port=int(line[1]),
            raw_port=int(line[2]),
            profile=bool(args.profile),
            host=host,
            device=device,
            fpdu=args.fpdu if args.fpdu is not None else (0 if veth else MAX_FPDU),
            path=f"veth, MTU {vethpath.MTU}, two namespaces" if veth else "loopback",
            busy_poll=args.busy_poll / 1e6,
        )
        with tempfile.TemporaryDirectory(prefix="rdmashim-floor-") as tmp:
            prepare_floor(cfg, benches, Path(tmp))
            meta, results = trio.run(client_main, args, cfg, benches)
    finally:
        stop_process(server)
    if args.profile:
        report_profiles(benches, results, Path(args.profile))
    elif args.json:
        doc = {"meta": meta, "results": results}
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
