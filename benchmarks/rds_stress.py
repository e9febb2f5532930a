#!/usr/bin/env python3
"""`rdmashim rds stress` beside raw TCP request/response messaging, in one run.

Two processes on loopback, trio at both ends. This script is the active side;
it starts the passive side as a subprocess (a fresh interpreter running this
file with ``--serve``), which runs an RDS node (``rdmashim.rdstools.
stress.stress_passive``, the code behind ``rdmashim rds stress -r IP``) and a raw TCP
listener that does the same job.

The work, for each case (``-q`` request bytes, ``-a`` ack bytes, ``-t`` tasks,
``-d`` depth): every task keeps ``depth`` requests outstanding; the passive
side answers each request with an ack; each request and ack carries a 16-byte
header (task, sequence number, ack size) and the active side checks that the
acks come back in order.

- **ours**: ``rdmashim.rdstools.stress.stress_active`` (what ``rdmashim rds stress
  -s`` runs): one RDS socket per task, all over the one RDS connection between
  the two nodes (built-in soft-iWARP engine, rdma_cm, MPA with CRC32c).
  Both sides take the messages already queued on a socket without waiting
  (``recvfrom_nowait``, rds-stress's ``MSG_DONTWAIT`` loop), so a burst of
  requests is answered in one turn and the node posts the acks together.
- **raw TCP**: one trio TCP stream per task (``TCP_NODELAY``, as trio sets
  it); the passive side reads exactly ``q`` bytes and answers with ``a``
  bytes that echo the header; the active side reads exactly ``a`` bytes.

With ``D`` (rds-stress's ``-D``) each of our acks also RDMA-writes ``D``
bytes into a buffer its request offered by RDS cookie; raw TCP moves the same
bytes as ``D`` more bytes in each ack.

Each side waits as it does by default: ours polls ``RdsSettings.busy_poll`` (10 µs,
as librdmacm's rsockets) before it blocks, raw TCP's trio blocks at once;
``--busy-poll US`` makes both poll that long (0: both block at once). ``--cpu N`` runs
both processes on one CPU: then no message's wake-up crosses CPUs, which on a VM whose
idle vCPUs halt is most of a ping-pong's round trip.

Samples alternate ours, raw, ours, raw, ...; the medians of ``--repeat``
samples and their ratio (ours/raw) are reported. Figures are rds-stress's:
``tx/s`` (requests per second), ``tx+rx K/s`` (request and ack bytes, KiB/s),
``rtt us`` (mean request-to-ack time), ``cpu %`` (the active process's CPU
time per wall-clock time). ``cpu us/tx`` is each process's CPU time per request
(active, then passive: user and system, all threads), ours and raw's: unlike the
ratio it hardly moves with the machine's speed of the moment, it tells a gap in
CPU (ours does more work a request) from one in latency (the same work, a longer
path from a message to its answer), and which end's work it is.

Usage::

    python benchmarks/rds_stress.py [--quick] [--repeat N] [--duration S] [--json FILE]
                                    [--transport rdma|tcp] [--cases 1,3]

``--transport tcp`` runs our nodes over RDS/TCP (Linux ``rds_tcp``'s wire)
instead of the engine; the ``-D`` case needs RDMA and is left out.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import time
from collections import deque
from collections.abc import Awaitable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import trio

from rdmashim.rdstools.common import open_node
from rdmashim.rdstools.defaults import STRESS_PORT
from rdmashim.rdstools.info import serve_info
from rdmashim.rdstools.stress import (
    OP_ACK,
    OP_REQ,
    STRESS_HEADER,
    STRESS_MAGIC,
    PassiveResult,
    StressConfig,
    stress_active,
    stress_passive,
)
from rdmashim.ulps.rds.node import RdsNode
from rdmashim.ulps.rds.settings import RdsSettings, Transport

from report import cpu_line, engine_line, process_cpu, rds_path_line, run_meta
from streams import read_exact, stop_process

CLIENT_IP = "127.0.0.1"
SERVER_IP = "127.0.0.2"
RAW_SETUP = struct.Struct("!II")
"""Raw TCP: the client's first 8 bytes: request size, ack size."""
HEADER = STRESS_HEADER
RESULT_LINE = "-" * 140
MEDIAN_KEYS = (
    "tx_per_s", "kbytes_per_s", "rdma_kbytes_per_s", "rtt_us", "tx_us_per_call", "cpu_percent",
    "cpu_us_per_tx", "passive_cpu_us_per_tx",
)  # fmt: skip


@dataclass(frozen=True)
class Case:
    req: int
    ack: int
    tasks: int
    depth: int
    rdma: int = 0
    """``-D``: bytes each ack RDMA-writes into its request's buffer (raw TCP: in the ack)."""

    @property
    def label(self) -> str:
        extra = f" D={self.rdma // 1024}K" if self.rdma else ""
        return f"q={self.req} a={self.ack} t={self.tasks} d={self.depth}{extra}"


CASES = [
    Case(1024, 256, 1, 1),
    Case(1024, 256, 4, 8),
    Case(64, 16, 4, 8),
    Case(64, 16, 1, 4, rdma=65536),
    Case(64, 16, 1, 4),  # (case 4 without its RDMA: how much of it is the RDMA)
]


def cases(transport: Transport, chosen: list[int] | None = None) -> list[Case]:
    """The cases that run on ``transport`` (over TCP, none with RDMA); ``chosen``: only
    these (1-based numbers in :data:`CASES`)."""
    picked = CASES if not chosen else [CASES[i - 1] for i in chosen]
    return [c for c in picked if transport == "rdma" or not c.rdma]


# =============================================================================================
# passive process
# =============================================================================================


async def raw_passive(busy_poll: float, stream: trio.SocketStream) -> None:
    sock = stream.socket
    async with stream:
        setup = memoryview(bytearray(RAW_SETUP.size))
        if not await read_exact(sock, setup):
            return
        req, ack = RAW_SETUP.unpack(setup)
        request = memoryview(bytearray(req))
        answer = bytearray(ack)
        while await read_exact(sock, request, busy_poll):
            magic, _op, _, task, seq, ack_bytes = HEADER.unpack_from(request)
            HEADER.pack_into(answer, 0, magic, OP_ACK, 0, task, seq, ack_bytes)
            await stream.send_all(answer)


def polls(busy_poll_us: float | None) -> tuple[float, float]:
    """Seconds each wait polls before it blocks, (ours, raw TCP's): ``--busy-poll`` for
    both, or each one's default (ours ``RdsSettings``', rsockets' 10 µs; raw TCP's trio
    blocks at once)."""
    if busy_poll_us is None:
        return RdsSettings().busy_poll, 0.0
    return busy_poll_us / 1e6, busy_poll_us / 1e6


async def serve_main(cm_port: int, transport: Transport, busy_poll_us: float | None) -> None:
    ours_poll, raw_poll = polls(busy_poll_us)
    async with trio.open_nursery() as nursery:
        listeners = await trio.open_tcp_listeners(0, host=SERVER_IP)
        raw_port = listeners[0].socket.getsockname()[1]
        nursery.start_soon(trio.serve_listeners, partial(raw_passive, raw_poll), listeners)
        settings = RdsSettings(busy_poll=ours_poll)
        async with open_node(SERVER_IP, cm_port, transport, settings) as node:
            await nursery.start(serve_info, node)
            result = PassiveResult()
            await nursery.start(lambda task_status: stress_passive(
                node, STRESS_PORT, once=False, result=result, task_status=task_status
            ))  # fmt: skip
            print(f"READY {raw_port}", flush=True)
            # Until the client closes our stdin.
            await trio.to_thread.run_sync(sys.stdin.read, abandon_on_cancel=True)
            nursery.cancel_scope.cancel()


# =============================================================================================
# active process
# =============================================================================================


@dataclass
class Sample:
    tx_per_s: float
    kbytes_per_s: float
    rdma_kbytes_per_s: float
    """Ours: the RDMA bytes (rw+rr K/s); raw TCP: 0 (they are in kbytes_per_s)."""
    rtt_us: float
    tx_us_per_call: float
    cpu_percent: float
    requests: int
    seconds: float
    passive_cpu: float = 0.0
    """The passive process's CPU seconds in the sample (``--serve``'s, from ``/proc``)."""

    @property
    def cpu_us_per_tx(self) -> float:
        """The active process's CPU time per request (us)."""
        return self.cpu_percent / 100 * self.seconds / max(1, self.requests) * 1e6

    @property
    def passive_cpu_us_per_tx(self) -> float:
        """The passive process's CPU time per request (us)."""
        return self.passive_cpu / max(1, self.requests) * 1e6


async def measured(sample: Awaitable[Sample], passive: int) -> Sample:
    """``sample`` with the CPU time the passive process (pid ``passive``) used meanwhile."""
    before = process_cpu(passive)
    result = await sample
    result.passive_cpu = process_cpu(passive) - before
    return result


async def ours(node: RdsNode, case: Case, duration: float) -> Sample:
    cfg = StressConfig(
        SERVER_IP, STRESS_PORT, case.req, case.ack, case.tasks, case.depth, duration,
        rdma_bytes=case.rdma,
    )  # fmt: skip
    total = (await stress_active(node, cfg)).total
    return Sample(
        total.tx_per_s, total.kbytes_per_s, total.rdma_kbytes_per_s, total.rtt_us,
        total.tx_us_per_call, total.cpu_percent, total.requests, total.seconds,
    )  # fmt: skip


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


async def raw(raw_port: int, case: Case, duration: float, busy_poll: float) -> Sample:
    streams = []
    ack = case.ack + case.rdma
    for _ in range(case.tasks):
        stream = await trio.open_tcp_stream(SERVER_IP, raw_port)
        await stream.send_all(RAW_SETUP.pack(case.req, ack))
        streams.append(stream)
    totals = {"requests": 0, "bytes": 0, "rtts": 0, "rtt_us": 0.0, "calls": 0, "send_us": 0.0}
    stop = [False]
    perf = time.perf_counter

    async def task(i: int, stream: trio.SocketStream) -> None:
        sock = stream.socket
        request = bytearray(case.req)
        answer = memoryview(bytearray(ack))
        pending: deque[tuple[int, float]] = deque()
        seq = 0

        async def send_one() -> None:
            nonlocal seq
            seq += 1
            HEADER.pack_into(request, 0, STRESS_MAGIC, OP_REQ, 0, i, seq, ack)
            t0 = perf()
            await stream.send_all(request)
            t1 = perf()
            pending.append((seq, t0))
            totals["requests"] += 1
            totals["bytes"] += case.req
            totals["calls"] += 1
            totals["send_us"] += (t1 - t0) * 1e6

        for _ in range(case.depth):
            await send_one()
        while pending:
            if not await read_exact(sock, answer, busy_poll):
                raise EOFError("raw passive side closed")
            t = perf()
            _, op, _, task_no, ack_seq, _ = HEADER.unpack_from(answer)
            expected, sent_at = pending.popleft()
            if (op, task_no, ack_seq) != (OP_ACK, i, expected):
                raise RuntimeError(f"raw task {i}: ack {ack_seq}, expected {expected}")
            totals["bytes"] += ack
            totals["rtts"] += 1
            totals["rtt_us"] += (t - sent_at) * 1e6
            if not stop[0]:
                await send_one()

    cpu0, t0 = _cpu(), perf()
    async with trio.open_nursery() as nursery:
        for i, stream in enumerate(streams):
            nursery.start_soon(task, i, stream)
        await trio.sleep(duration)
        stop[0] = True
    seconds, cpu = perf() - t0, _cpu() - cpu0
    for stream in streams:
        await stream.aclose()
    return Sample(
        totals["requests"] / seconds,
        totals["bytes"] / 1024 / seconds,
        0.0,
        totals["rtt_us"] / max(1, totals["rtts"]),
        totals["send_us"] / max(1, totals["calls"]),
        100 * cpu / seconds,
        totals["requests"],
        seconds,
    )


def _status(text: str) -> None:
    if sys.stderr.isatty():
        sys.stderr.write("\r" + text.ljust(70))
        sys.stderr.flush()


async def client_main(
    cm_port: int, raw_port: int, passive: int, args: argparse.Namespace
) -> list[dict]:
    results = []
    ours_poll, raw_poll = polls(args.busy_poll)
    settings = RdsSettings(busy_poll=ours_poll)
    async with open_node(CLIENT_IP, cm_port, args.transport, settings) as node:
        for case in cases(args.transport, args.cases):
            samples: dict[str, list[Sample]] = {"ours": [], "raw": []}
            for i in range(args.repeat):
                _status(f"{case.label}: sample {i + 1}/{args.repeat} (ours)")
                with trio.fail_after(10 * args.duration + 60):
                    samples["ours"].append(await measured(ours(node, case, args.duration), passive))
                _status(f"{case.label}: sample {i + 1}/{args.repeat} (raw)")
                with trio.fail_after(10 * args.duration + 60):
                    samples["raw"].append(
                        await measured(raw(raw_port, case, args.duration, raw_poll), passive)
                    )
            med = {
                side: {
                    key: statistics.median(getattr(s, key) for s in samples[side])
                    for key in MEDIAN_KEYS
                }
                for side in samples
            }
            results.append(
                {
                    "case": asdict(case),
                    "label": case.label,
                    "median": med,
                    "ratio_tx_per_s": med["ours"]["tx_per_s"] / med["raw"]["tx_per_s"],
                    "ratio_rtt": med["ours"]["rtt_us"] / med["raw"]["rtt_us"],
                    "samples": {side: [asdict(s) for s in samples[side]] for side in samples},
                }
            )
        _status("")
        if sys.stderr.isatty():
            sys.stderr.write("\r")
    return results


def print_table(results: list[dict], args: argparse.Namespace) -> None:
    print(RESULT_LINE)
    over = "RDS/TCP" if args.transport == "tcp" else "RDS over the built-in engine"
    print(f" rdmashim rds stress ({over}) vs raw TCP request/ack (trio both ends, two processes,")
    print(" loopback)")
    print(engine_line(width=0) if args.transport == "rdma" else " Engine: none (RDS/TCP)")
    print(rds_path_line(width=0))
    print(cpu_line(width=0))
    ours_poll, raw_poll = polls(args.busy_poll)
    print(
        f" {args.repeat} samples of {args.duration:g} s per side, alternating; medians; "
        f"ratio = ours/raw; waits poll {ours_poll * 1e6:g} us (ours), {raw_poll * 1e6:g} us "
        "(raw) before they block"
        + ("" if args.cpu is None else f"; both processes on CPU {args.cpu}")
    )
    print(RESULT_LINE)
    print(
        f" {'case':<24}{'ours tx/s':>10}{'raw tx/s':>10}{'ratio':>7}"
        f"{'ours K/s':>11}{'ours rw':>10}{'raw K/s':>11}{'ours rtt':>10}{'raw rtt':>9}"
        f"{'ours cpu%':>10}{'cpu us/tx: ours':>16}{'raw':>6}{'passive: ours':>14}{'raw':>6}"
    )
    for r in results:
        o, w = r["median"]["ours"], r["median"]["raw"]
        print(
            f" {r['label']:<24}{o['tx_per_s']:>10.0f}{w['tx_per_s']:>10.0f}"
            f"{r['ratio_tx_per_s']:>7.3f}{o['kbytes_per_s']:>11.1f}"
            f"{o['rdma_kbytes_per_s']:>10.0f}{w['kbytes_per_s']:>11.1f}"
            f"{o['rtt_us']:>10.0f}{w['rtt_us']:>9.0f}{o['cpu_percent']:>10.1f}"
            f"{o['cpu_us_per_tx']:>16.1f}{w['cpu_us_per_tx']:>6.1f}"
            f"{o['passive_cpu_us_per_tx']:>14.1f}{w['passive_cpu_us_per_tx']:>6.1f}"
        )
    print(RESULT_LINE)
    for r in results:
        print(
            f" {r['label']}: ours tx/s "
            + ", ".join(f"{s['tx_per_s']:.0f}" for s in r["samples"]["ours"])
            + "; raw "
            + ", ".join(f"{s['tx_per_s']:.0f}" for s in r["samples"]["raw"])
        )


def _free_port() -> int:
    """A TCP port free on both addresses (the RDS nodes' common rdma_cm port)."""
    for _ in range(100):
        with socket.socket() as a, socket.socket() as b:
            a.bind((CLIENT_IP, 0))
            port = a.getsockname()[1]
            try:
                b.bind((SERVER_IP, port))
            except OSError:
                continue
            return port
    raise RuntimeError("no port free on both addresses")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="3 samples of 1 s per side")
    p.add_argument("--repeat", type=int, help="samples per side (default 5)")
    p.add_argument("--duration", type=float, help="seconds per sample (default 3)")
    p.add_argument("--json", metavar="FILE", help="write every sample to FILE")
    p.add_argument(
        "--transport",
        choices=("rdma", "tcp"),
        default="rdma",
        help="our nodes' transport (default rdma: the built-in engine)",
    )
    p.add_argument(
        "--cases",
        type=lambda text: [int(n) for n in text.split(",")],
        help="run only these cases, by number (e.g. 1,3; default all)",
    )
    p.add_argument(
        "--busy-poll",
        type=float,
        default=None,
        metavar="US",
        help="microseconds each wait for a message polls before it blocks, ours "
        "(RdsSettings.busy_poll) and raw TCP's (the socket) alike (default: each its own, "
        "ours 10 as rsockets, raw TCP's trio none)",
    )
    p.add_argument(
        "--cpu",
        type=int,
        metavar="N",
        help="run both processes on CPU N only (Linux): no wake-up crosses CPUs",
    )
    p.add_argument("--serve", type=int, metavar="CM_PORT", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.busy_poll is not None and not 0 <= args.busy_poll <= 1e6:
        p.error(f"--busy-poll {args.busy_poll:g} outside 0..1000000")
    if args.serve is not None:
        trio.run(serve_main, args.serve, args.transport, args.busy_poll)
        return 0
    if args.cpu is not None:
        try:
            os.sched_setaffinity(0, {args.cpu})  # (the passive process inherits it)
        except (OSError, ValueError, AttributeError) as exc:
            p.error(f"--cpu {args.cpu}: {exc}")
    args.repeat = args.repeat or (3 if args.quick else 5)
    args.duration = args.duration or (1.0 if args.quick else 3.0)
    ours_poll, raw_poll = polls(args.busy_poll)
    cm_port = _free_port()
    cmd = [sys.executable, str(Path(__file__).resolve()), "--serve", str(cm_port)]
    cmd += ["--transport", args.transport]
    if args.busy_poll is not None:
        cmd += ["--busy-poll", str(args.busy_poll)]
    server = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    meta = {
        **run_meta(),
        "repeat": args.repeat,
        "duration_s": args.duration,
        "transport": args.transport,
        "busy_poll_us": {"ours": ours_poll * 1e6, "raw": raw_poll * 1e6},
        "cpu": args.cpu,
    }
    try:
        assert server.stdout is not None
        line = server.stdout.readline().decode().split()
        if len(line) != 2 or line[0] != "READY":
            raise RuntimeError(f"passive side did not start (said {line!r})")
        results = trio.run(client_main, cm_port, int(line[1]), server.pid, args)
    finally:
        stop_process(server)
    meta["loadavg_end"] = os.getloadavg()
    print_table(results, args)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
