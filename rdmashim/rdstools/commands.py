"""What ``rdmashim rds ping|stress|info|demo`` run: the commands over :mod:`rdmashim.rdstools`.

Each ``rds_*`` coroutine takes the parsed arguments (:mod:`rdmashim.rdstools.cli`
checked them) and returns the exit status; the commands print, the library
does not. Ctrl-C ends each with status 130 after what it measured; a run
that did not start reports no figures.
"""

from __future__ import annotations

import argparse
import ipaddress
import sys

import trio

from rdmashim.cliargs import UsageError, rate
from rdmashim.clisignals import Signals
from rdmashim.rdstools.common import RdsToolError, drain, guess_source, open_node, port_name
from rdmashim.rdstools.defaults import ALL_TABLES, INFO_PORT, INFO_TABLES
from rdmashim.rdstools.demo import DemoProgress, run_rds_demo
from rdmashim.rdstools.info import format_info, query_info, serve_info
from rdmashim.rdstools.ping import format_ping_reply, ping, serve_echo
from rdmashim.rdstools.stress import (
    STRESS_COLUMNS,
    PassiveResult,
    StressConfig,
    StressSample,
    format_stress_row,
    stress_active,
    stress_passive,
)
from rdmashim.ulps.rds.node import RdsNode
from rdmashim.ulps.rds.settings import RdsSettings

MAX_RDMA_BUFFERS = 1 << 30
"""Bytes the active side of ``rds stress -D`` may hold in buffers (one per request in flight)."""


def _check_other(local: str | None, dest: str | None) -> None:
    """The node a tool talks to runs in another process, so on another address."""
    if local is not None and local == dest:
        raise UsageError(
            f"{dest} is this node's own address: the other node needs its own (any 127.x.y.z)"
        )


async def rds_ping(args: argparse.Namespace) -> int:
    if args.serve and not args.local:
        raise UsageError("--serve needs -I LOCAL_IP, the address to answer on")
    if not args.serve and not args.dest:
        raise UsageError("the address to ping is missing")
    _check_other(args.local, None if args.serve else args.dest)
    if args.serve:
        signals = Signals()
        async with (
            open_node(args.local, args.cm_port, args.transport) as node,
            trio.open_nursery() as nursery,
        ):
            await nursery.start(signals.watch)
            await nursery.start(serve_echo, node, args.port)
            await nursery.start(serve_info, node)
            print(
                f"rds ping responder on {node.address}: echo on RDS port {args.port}, "
                f"rds-info on RDS port {INFO_PORT}, {port_name(node.transport)} {node.port}; "
                "Ctrl-C to stop",
                flush=True,
            )
            await signals.stopped.wait()
            if args.info:
                print(format_info(node), end="")
            nursery.cancel_scope.cancel()
        return signals.status
    local = args.local or guess_source(args.dest)
    async with open_node(local, args.cm_port, args.transport) as node:
        stats = await ping(
            node, args.dest, port=args.port, count=args.count, interval=args.interval,
            on_reply=lambda reply: print(format_ping_reply(reply), flush=True),
        )  # fmt: skip
        await drain(node, 1.0)
        if args.info:
            print(format_info(node), end="")
    if not stats.received:
        raise RdsToolError(
            f"no reply from {args.dest} RDS port {args.port} to {stats.sent} ping(s) "
            f"(is `rdmashim rds ping --serve -I {args.dest}` running there?)"
        )
    return 0


async def rds_stress(args: argparse.Namespace) -> int:
    cfg = None
    _check_other(args.local, args.server)
    if args.server is not None:
        try:
            cfg = StressConfig(
                args.server, args.port, args.req_bytes, args.ack_bytes, args.tasks,
                args.depth, args.seconds, args.rdma_bytes, args.rdma_read,
            )  # fmt: skip
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        if cfg.rdma_bytes and args.transport != "rdma":
            raise UsageError(f"-D (RDMA bytes) needs --transport rdma, not {args.transport}")
        buffers = cfg.tasks * cfg.depth * cfg.rdma_bytes
        if buffers > MAX_RDMA_BUFFERS:
            raise UsageError(
                f"-t {cfg.tasks} x -d {cfg.depth} x -D {cfg.rdma_bytes} = {buffers} bytes of "
                f"RDMA buffers, more than {MAX_RDMA_BUFFERS >> 20} MiB"
            )
    settings = RdsSettings() if args.busy_poll is None else RdsSettings(busy_poll=args.busy_poll)
    async with (
        open_node(args.local, args.cm_port, args.transport, settings) as node,
        trio.open_nursery() as nursery,
    ):
        await nursery.start(serve_info, node)
        if cfg is None:
            status = await _stress_passive(node, args, nursery)
        else:
            status = await _stress_active(node, cfg, args, nursery)
        if args.info:
            print(format_info(node), end="")
        nursery.cancel_scope.cancel()
    return status


async def _stress_passive(node: RdsNode, args: argparse.Namespace, nursery: trio.Nursery) -> int:
    signals = Signals()
    scope = trio.CancelScope()
    await nursery.start(signals.watch, scope.cancel)
    print(
        f"rds stress passive on {node.address} port {args.port} "
        f"({port_name(node.transport)} {node.port}): waiting for an active side",
        flush=True,
    )
    result = PassiveResult()
    with scope:
        await stress_passive(node, args.port, once=True, result=result)
    how = "interrupted" if scope.cancelled_caught else "run over"
    if not result.requests:
        print(f"{how}: no run started (no request arrived)")
        return signals.status
    seconds = result.elapsed()
    peers = sorted({ip for ip, _ in result.tasks})
    figures = ""
    per_s = rate(result.requests, seconds)
    if per_s is not None:
        kbytes = (result.rx_bytes + result.tx_bytes) / 1024
        figures = (
            f"{per_s:.0f} req/s, {kbytes / seconds:.2f} K/s, "
            f"{result.rdma_bytes / 1024 / seconds:.2f} RDMA K/s "
        )
    print(
        f"{how}: {result.requests} requests in, {result.acks} acks out from "
        f"{len(result.tasks)} task(s) at {', '.join(peers) or '-'}; {figures}"
        f"({result.rdma_failures} failed) over {seconds:.2f} s"
    )
    return signals.status


async def _stress_active(
    node: RdsNode, cfg: StressConfig, args: argparse.Namespace, nursery: trio.Nursery
) -> int:
    started = [False]
    signals = Signals()

    def on_first() -> None:
        """Before the run, a signal ends at once; during it, it ends the run cleanly (the
        summary is printed); a second one ends at once (Signals)."""
        if not started[0]:
            raise KeyboardInterrupt

    await nursery.start(signals.watch, on_first)
    print(
        f"rds stress: {node.address} -> {cfg.dest} port {cfg.port}, {cfg.tasks} task(s), "
        f"depth {cfg.depth}, {cfg.req_bytes} B requests, {cfg.ack_bytes} B acks, "
        + (
            f"{cfg.rdma_bytes} B RDMA {'Read' if cfg.rdma_read else 'Write'} per ack, "
            if cfg.rdma_bytes
            else ""
        )
        + (f"{cfg.seconds:g} s" if cfg.seconds else "until Ctrl-C"),
        flush=True,
    )
    print("Starting up", end="", flush=True)

    def on_start() -> None:
        started[0] = True
        print(".")
        print(STRESS_COLUMNS, flush=True)

    def second(sample: StressSample) -> None:
        if not args.summary_only:
            print(format_stress_row(sample), flush=True)

    try:
        result = await stress_active(
            node, cfg, on_start=on_start, on_second=second, stop=signals.stopped
        )
    except BaseException:
        print(flush=True)  # end the "Starting up" or the last row's line
        raise
    print("-" * 45)
    print(format_stress_row(result.total, average=True), flush=True)
    return signals.status


async def rds_info(args: argparse.Namespace) -> int:
    tables = "".join(t for t in INFO_TABLES if getattr(args, f"table_{t}")) or ALL_TABLES
    _check_other(args.local, args.dest)
    local = args.local or guess_source(args.dest)
    async with open_node(local, args.cm_port, args.transport) as node:
        text = await query_info(node, args.dest, tables, within=args.timeout)
        await drain(node, 1.0)
    print(text, end="")
    return 0


async def rds_demo(args: argparse.Namespace) -> int:
    try:
        last = ipaddress.IPv4Address(args.address) + (args.nodes - 1)
    except (ValueError, ipaddress.AddressValueError):
        raise UsageError(f"{args.nodes} nodes from {args.address} are no IPv4 addresses") from None
    if not last.is_loopback:
        raise UsageError(f"{args.nodes} nodes from {args.address} leave 127.0.0.0/8")
    live = sys.stderr.isatty() and not args.quiet
    width = [0]

    def status(text: str) -> None:
        if live:
            sys.stderr.write("\r" + text.ljust(width[0]))
            sys.stderr.flush()
            width[0] = len(text)

    def progress(p: DemoProgress) -> None:
        mbytes = rate(p.bytes / 1e6, p.elapsed) or 0.0
        status(
            f"{p.elapsed:5.1f} s  {p.phase:<8}  {p.delivered:>8} messages delivered  "
            f"{mbytes:6.1f} MB/s  cuts {p.cuts}"
        )

    def event(text: str) -> None:
        status("")
        if live:
            sys.stderr.write("\r")
        print(text, flush=True)

    result = await run_rds_demo(
        nodes=args.nodes, seconds=args.seconds, size=args.size, cuts=args.cuts,
        first_address=args.address, cm_port=args.cm_port, transport=args.transport,
        on_progress=progress, on_event=event,
    )  # fmt: skip
    event(
        f"sent {result.sent} messages, delivered {result.delivered}: lost {result.lost}, "
        f"duplicated {result.duplicated}, out of order {result.out_of_order}, "
        f"corrupt {result.corrupt}"
    )
    if rate(1, result.seconds) is not None:
        print(
            f"throughput: {result.msgs_per_s:.0f} messages/s, {result.mbytes_per_s:.2f} MB/s "
            f"({result.size}-byte messages, {result.seconds:.1f} s from first send to last "
            "delivery)"
        )
    print("connections, each node's view:")
    print(
        f"  {'local':>11} -> {'peer':<11} {'sessions':>8} {'reconnects':>10} {'resent':>7} "
        f"{'dups dropped':>12} {'sent':>8} {'received':>8}"
    )
    reconnects = 0
    for local, peer, c in result.connections:
        if ipaddress.IPv4Address(local) < ipaddress.IPv4Address(peer):  # one view per pair
            reconnects += c["sessions"] - 1
        print(
            f"  {local:>11} -> {peer:<11} {c['sessions']:>8} {c['sessions'] - 1:>10} "
            f"{c['retransmits']:>7} {c['recv_drop_old_seq']:>12} {c['send_messages']:>8} "
            f"{c['recv_messages']:>8}"
        )
    if args.info:
        print(result.info, end="")
    if not result.ok:
        print("FAILED: messages were lost, duplicated, out of order or corrupt; see the counts")
        return 1
    cuts = f"{len(result.cuts)} cut(s)"
    if len(result.cuts) < args.cuts:
        cuts = f"{len(result.cuts)} of the {args.cuts} cuts asked (the run ended before the rest)"
    print(
        f"OK: every message arrived exactly once, in order and intact, through "
        f"{cuts} and {reconnects} reconnection(s)"
    )
    return 0
