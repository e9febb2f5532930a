"""The ``rdmashim`` command: devices, devinfo, a loopback demo, rping's ping, rds-tools."""

from __future__ import annotations

import argparse
import ipaddress
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

import trio

import rdmashim
from rdmashim.rds_defaults import ALL_TABLES, ECHO_PORT, INFO_TABLES, RDS_CM_PORT, STRESS_PORT
from rdmashim.registry import backend_status


def _cmd_devices(args: argparse.Namespace) -> int:
    print(f"    {'device':<16}{'node GUID':<22}backend")
    print(f"    {'------':<16}{'---------':<22}-------")
    for info, problem in backend_status():
        if problem is not None:
            print(f"    ({info.name} unavailable: {problem})")
            continue
        for dev in rdmashim.get_device_list(backend=info.name):
            print(f"    {dev.name:<16}{dev.node_guid:016x}      {info.name}")
    return 0


async def _devinfo(name: str | None, backend: str | None) -> None:
    async with rdmashim.open_device(name, backend=backend) as ctx:
        attr = ctx.query_device()
        port = ctx.query_port(1)
        print(f"hca_id:\t{ctx.device.name}")
        print(f"\tbackend:\t\t\t{ctx.backend}")
        print(f"\ttransport:\t\t\t{attr.transport.name} ({attr.transport.value})")
        print(f"\tnetdev:\t\t\t\t{port.netdev}")
        print(f"\tfw_ver:\t\t\t\t{attr.fw_ver}")
        print(f"\tnode_guid:\t\t\t{attr.node_guid:016x}")
        print(f"\tvendor_id:\t\t\t{attr.vendor_id:#x}")
        print(f"\tphys_port_cnt:\t\t\t{attr.phys_port_cnt}")
        for field in (
            "max_mr_size", "max_qp", "max_qp_wr", "max_sge", "max_sge_rd", "max_cq", "max_cqe",
            "max_mr", "max_pd", "max_qp_rd_atom", "max_qp_init_rd_atom", "max_srq", "max_srq_wr",
            "max_srq_sge", "max_inline_data", "max_mw", "max_private_data",
        ):  # fmt: skip
            print(f"\t{field + ':':<32}{getattr(attr, field)}")
        print(f"\tatomic_cap:\t\t\t{attr.atomic_cap.name}")
        print(f"\tactive_side_sends_first:\t{attr.active_side_sends_first}")
        print("\t\tport:\t1")
        print(f"\t\t\tstate:\t\t{port.state.name} ({port.state.value})")
        print(f"\t\t\tmax_mtu:\t{128 << port.max_mtu} ({port.max_mtu.value})")
        print(f"\t\t\tactive_mtu:\t{128 << port.active_mtu} ({port.active_mtu.value})")
        print(f"\t\t\tlink_layer:\t{port.link_layer}")


def _cmd_devinfo(args: argparse.Namespace) -> int:
    trio.run(_devinfo, args.device, args.backend)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from rdmashim.demo import run_demo

    progress = sys.stderr.isatty() and not args.quiet
    return trio.run(run_demo, args.size, args.count, not args.no_crc, progress)


def _cmd_ping(args: argparse.Namespace) -> int:
    import logging

    from rdmashim.ping import PingConfig, PingError, run

    if args.debug:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        logger = logging.getLogger("rdmashim")
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
    prefix = "server ping data: " if args.server else "ping data: "

    def show(_ping: int, data: bytes) -> None:
        print(prefix + data.decode("latin-1"), flush=True)

    try:
        config = PingConfig(
            server=args.server,
            address=args.address,
            port=args.port,
            count=args.count,
            size=args.size,
            validate=args.validate,
            crc=args.crc,
            p2p=args.p2p,
            revision=args.mpa_rev,
            timeout=args.timeout,
            on_data=show if args.verbose else None,
        )
    except ValueError as exc:
        print(f"rdmashim ping: {exc}", file=sys.stderr)
        return 2
    try:
        result = trio.run(run, config)
    except PingError as exc:
        print(f"rdmashim ping: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    if args.debug:
        print(f"rdmashim ping: {result.pings} pings of {result.size} B", file=sys.stderr)
    return 0


# ------------------------------------------------------------------ rds: rds-tools on our RDS
async def _wait_for_signal() -> None:
    """Return at the first SIGINT or SIGTERM."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            return


async def _rds_ping(args: argparse.Namespace) -> int:
    from rdmashim import rds_tools as rt

    if args.serve:
        if not args.local:
            raise rt.RdsToolError("--serve needs -I LOCAL_IP, the address to answer on")
        async with rt.open_node(args.local, args.cm_port) as node, trio.open_nursery() as nursery:
            await nursery.start(rt.serve_echo, node, args.port)
            await nursery.start(rt.serve_info, node)
            print(
                f"rds ping responder on {node.address}: echo on RDS port {args.port}, "
                f"rds-info on RDS port {rt.INFO_PORT}, rdma_cm port {node.port}; Ctrl-C to stop",
                flush=True,
            )
            await _wait_for_signal()
            if args.info:
                print(rt.format_info(node), end="")
            nursery.cancel_scope.cancel()
        return 0
    if not args.dest:
        raise rt.RdsToolError("the address to ping is missing")
    local = args.local or rt.guess_source(args.dest)
    async with rt.open_node(local, args.cm_port) as node:
        stats = await rt.ping(
            node, args.dest, port=args.port, count=args.count, interval=args.interval,
            on_reply=lambda reply: print(rt.format_ping_reply(reply), flush=True),
        )  # fmt: skip
        await rt.drain(node, 1.0)
        if args.info:
            print(rt.format_info(node), end="")
    return 0 if stats.received else 1


async def _rds_stress(args: argparse.Namespace) -> int:
    from rdmashim import rds_tools as rt

    async with rt.open_node(args.local, args.cm_port) as node, trio.open_nursery() as nursery:
        await nursery.start(rt.serve_info, node)
        if args.server is None:
            print(
                f"rds stress passive on {node.address} port {args.port} "
                f"(rdma_cm port {node.port}): waiting for an active side",
                flush=True,
            )
            result = rt.PassiveResult()
            with trio.CancelScope() as scope:
                nursery.start_soon(_cancel_on_signal, scope)
                await rt.stress_passive(node, args.port, once=True, result=result)
            seconds = result.seconds or 1e-9
            peers = sorted({ip for ip, _ in result.tasks})
            print(
                f"{'interrupted' if scope.cancel_called else 'run over'}: "
                f"{result.requests} requests in, {result.acks} acks out from "
                f"{len(result.tasks)} task(s) at {', '.join(peers) or '-'}; "
                f"{result.requests / seconds:.0f} req/s, "
                f"{(result.rx_bytes + result.tx_bytes) / 1024 / seconds:.2f} K/s, "
                f"{result.rdma_bytes / 1024 / seconds:.2f} RDMA K/s "
                f"({result.rdma_failures} failed) over {result.seconds:.2f} s"
            )
        else:
            try:
                cfg = rt.StressConfig(
                    args.server, args.port, args.req_bytes, args.ack_bytes, args.tasks,
                    args.depth, args.seconds, args.rdma_bytes, args.rdma_read,
                )  # fmt: skip
            except ValueError as exc:
                print(f"rdmashim rds stress: {exc}", file=sys.stderr)
                return 2
            stop = trio.Event()
            nursery.start_soon(_stop_on_signal, stop)
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

            def started() -> None:
                print(".")
                print(rt.STRESS_COLUMNS, flush=True)

            def second(sample: rt.StressSample) -> None:
                if not args.summary_only:
                    print(rt.format_stress_row(sample), flush=True)

            try:
                result = await rt.stress_active(
                    node, cfg, on_start=started, on_second=second, stop=stop
                )
            except rt.RdsToolError:
                print(flush=True)  # end the "Starting up" line
                raise
            print("-" * 45)
            print(rt.format_stress_row(result.total, average=True), flush=True)
        if args.info:
            print(rt.format_info(node), end="")
        nursery.cancel_scope.cancel()
    return 0


async def _cancel_on_signal(scope: trio.CancelScope) -> None:
    await _wait_for_signal()
    scope.cancel()


async def _stop_on_signal(stop: trio.Event) -> None:
    """The first Ctrl-C stops sending (the run ends cleanly), the second one raises."""
    await _wait_for_signal()
    stop.set()
    await _wait_for_signal()
    raise KeyboardInterrupt


async def _rds_info(args: argparse.Namespace) -> int:
    from rdmashim import rds_tools as rt

    tables = "".join(t for t in INFO_TABLES if getattr(args, f"table_{t}")) or ALL_TABLES
    local = args.local or rt.guess_source(args.dest)
    async with rt.open_node(local, args.cm_port) as node:
        text = await rt.query_info(node, args.dest, tables, within=args.timeout)
        await rt.drain(node, 1.0)
    print(text, end="")
    return 0


async def _rds_demo(args: argparse.Namespace) -> int:
    from rdmashim import rds_tools as rt

    live = sys.stderr.isatty() and not args.quiet
    width = [0]

    def status(text: str) -> None:
        if live:
            sys.stderr.write("\r" + text.ljust(width[0]))
            sys.stderr.flush()
            width[0] = len(text)

    def progress(p: rt.DemoProgress) -> None:
        rate = p.bytes / p.elapsed / 1e6 if p.elapsed else 0.0
        status(
            f"{p.elapsed:5.1f} s  {p.phase:<8}  {p.delivered:>8} messages delivered  "
            f"{rate:6.1f} MB/s  cuts {p.cuts}"
        )

    def event(text: str) -> None:
        status("")
        if live:
            sys.stderr.write("\r")
        print(text, flush=True)

    result = await rt.run_rds_demo(
        nodes=args.nodes, seconds=args.seconds, size=args.size, cuts=args.cuts,
        first_address=args.address, cm_port=args.cm_port, on_progress=progress, on_event=event,
    )  # fmt: skip
    event(
        f"sent {result.sent} messages, delivered {result.delivered}: lost {result.lost}, "
        f"duplicated {result.duplicated}, out of order {result.out_of_order}, "
        f"corrupt {result.corrupt}"
    )
    print(
        f"throughput: {result.msgs_per_s:.0f} messages/s, {result.mbytes_per_s:.2f} MB/s "
        f"({result.size}-byte messages, {result.seconds:.1f} s from first send to last delivery)"
    )
    print("connections, each node's view:")
    print(
        f"  {'local':>11} -> {'peer':<11} {'sessions':>8} {'reconnects':>10} {'resent':>7} "
        f"{'dups dropped':>12} {'sent':>8} {'received':>8}"
    )
    reconnects = 0
    for local, peer, c in result.connections:
        if ipaddress.ip_address(local) < ipaddress.ip_address(peer):  # one view per pair
            reconnects += c["sessions"] - 1
        print(
            f"  {local:>11} -> {peer:<11} {c['sessions']:>8} {c['sessions'] - 1:>10} "
            f"{c['retransmits']:>7} {c['recv_drop_old_seq']:>12} {c['send_messages']:>8} "
            f"{c['recv_messages']:>8}"
        )
    if args.info:
        print(result.info, end="")
    cut_ok = len(result.cuts) == args.cuts
    if result.ok and cut_ok:
        print(
            f"OK: every message arrived exactly once, in order and intact, through "
            f"{len(result.cuts)} cut(s) and {reconnects} reconnection(s)"
        )
        return 0
    print(f"FAILED: {len(result.cuts)} of {args.cuts} cuts made; see the counts above")
    return 1


def _cmd_rds(args: argparse.Namespace) -> int:
    from rdmashim.rds_tools import RdsToolError

    runner = {"ping": _rds_ping, "stress": _rds_stress, "info": _rds_info, "demo": _rds_demo}
    try:
        try:
            return trio.run(runner[args.rds_command], args)
        except BaseExceptionGroup as group:  # a nursery's: report its one error plainly
            leaves = _leaves(group)
            if len(leaves) == 1:
                raise leaves[0] from None
            raise
    except (RdsToolError, ValueError, OSError) as exc:
        print(f"rdmashim rds {args.rds_command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in _leaves(sub)]
    return [exc]


def _interval(text: str) -> float:
    from rdmashim.rds_tools import parse_interval

    try:
        return parse_interval(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_rds(sub: Any) -> None:
    rds = sub.add_parser(
        "rds",
        help="rds-tools on rdmashim's RDS: ping, stress, info, and a messaging demo",
        description="rds-tools (rds-ping, rds-stress, rds-info) on rdmashim's RDS over the "
        "built-in engine. Every node needs its own IP address (any 127.x.y.z on Linux); "
        "nodes find each other on the rdma_cm port (--cm-port, the same on all nodes).",
    )
    rsub = rds.add_subparsers(dest="rds_command", required=True)
    cm = argparse.ArgumentParser(add_help=False)
    cm.add_argument(
        "--cm-port", type=int, default=RDS_CM_PORT,
        help=f"rdma_cm port of every node (default {RDS_CM_PORT})",
    )  # fmt: skip
    cm.add_argument("--info", action="store_true", help="print rds-info's tables at the end")

    p = rsub.add_parser(
        "ping",
        parents=[cm],
        help="rds-ping: an empty message every second, the round trip of each",
        description="rds-ping on rdmashim's RDS. Linux answers RDS pings in the kernel (port "
        f"0); here the pinged node runs `rdmashim rds ping --serve -I IP`, which echoes "
        f"messages on RDS port {ECHO_PORT} (and answers `rdmashim rds info`).",
    )
    p.add_argument("dest", nargs="?", help="address of the node to ping")
    p.add_argument("-I", dest="local", help="local address (default: as routing picks)")
    p.add_argument("-c", dest="count", type=int, default=0, help="stop after COUNT pings")
    p.add_argument(
        "-i", dest="interval", type=_interval, default=1.0,
        help="seconds between pings (default 1; suffixes ms, msec, us, usec)",
    )  # fmt: skip
    p.add_argument(
        "-p", dest="port", type=int, default=ECHO_PORT,
        help=f"RDS port of the echo responder (default {ECHO_PORT})",
    )  # fmt: skip
    p.add_argument("--serve", action="store_true", help="be the pinged side (needs -I)")

    p = rsub.add_parser(
        "stress",
        parents=[cm],
        help="rds-stress: request/ack messaging with per-second figures",
        description="rds-stress on rdmashim's RDS. Passive: `-r LOCAL_IP`; it answers each "
        "request with an ack and exits when the active side's run is over. Active: "
        "`-r LOCAL_IP -s SERVER_IP`. Columns: tsks, tx/s (requests sent), tx+rx K/s "
        "(request and ack bytes), rw+rr K/s (RDMA Write and Read bytes, with -D), tx us/c "
        "(microseconds per sendto), rtt us (request to ack), "
        "cpu % (this process's CPU time per wall-clock time).",
    )
    p.add_argument("-r", dest="local", required=True, help="local address")
    p.add_argument("-s", dest="server", help="send to this address (the active side)")
    p.add_argument(
        "-p", dest="port", type=int, default=STRESS_PORT,
        help=f"RDS port of the passive side; active tasks use the next ones (default "
        f"{STRESS_PORT})",
    )  # fmt: skip
    p.add_argument("-q", dest="req_bytes", type=int, default=1024, help="request bytes (1024)")
    p.add_argument("-a", dest="ack_bytes", type=int, default=16, help="ack bytes (16)")
    p.add_argument("-t", dest="tasks", type=int, default=1, help="tasks (sockets) (1)")
    p.add_argument("-d", dest="depth", type=int, default=1, help="requests in flight per task")
    p.add_argument(
        "-T", dest="seconds", type=float, default=0.0, help="seconds to run (0: until Ctrl-C)"
    )
    p.add_argument(
        "-D", dest="rdma_bytes", type=int, default=0,
        help="each request offers a buffer of this many bytes (by RDS cookie) that its ack "
        "RDMA Writes into (0: none)",
    )  # fmt: skip
    p.add_argument(
        "--rdma-read", action="store_true", help="with -D, the ack RDMA Reads the buffer instead"
    )
    p.add_argument("-z", dest="summary_only", action="store_true", help="only the summary")

    p = rsub.add_parser(
        "info",
        parents=[cm],
        help="rds-info: the tables of a node run by `rds ping --serve` or `rds stress`",
        description="rds-info's tables of a running node. A node lives inside its process, "
        "so this asks it over RDS (port 10000): the nodes of `rdmashim rds ping --serve` "
        "and `rdmashim rds stress` answer, and so does any program that runs "
        "rdmashim.rds_tools.serve_info. The query's own connection shows in the answer. "
        "Programs can print their own nodes' tables with rdmashim.rds_tools.format_info.",
    )
    p.add_argument("dest", help="address of the node to ask")
    p.add_argument("-I", dest="local", help="local address (default: as routing picks)")
    for letter, what in INFO_TABLES.items():
        p.add_argument(f"-{letter}", dest=f"table_{letter}", action="store_true", help=what)
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer")
    p.set_defaults(info=False)

    p = rsub.add_parser(
        "demo",
        help="several nodes on loopback messaging all-to-all through connection cuts",
        description="RDS nodes on 127.0.0.1, .2, ... in this process; every socket sends to "
        "every other; connections are cut underneath mid-run; every message is checked to "
        "arrive exactly once, in order and intact.",
    )
    p.add_argument("-n", "--nodes", type=int, default=4, help="nodes (default 4)")
    p.add_argument("-T", "--seconds", type=float, default=8.0, help="seconds of sending (8)")
    p.add_argument("-s", "--size", type=int, default=1024, help="message bytes (1024)")
    p.add_argument("--cuts", type=int, default=2, help="connection cuts during the run (2)")
    p.add_argument("--address", default="127.0.0.1", help="first node's address (127.0.0.1)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress line")
    p.add_argument(
        "--cm-port", type=int, default=0, help="rdma_cm port of the nodes (default: a free one)"
    )
    p.add_argument("--info", action="store_true", help="print rds-info's tables at the end")
    rds.set_defaults(func=_cmd_rds)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``rdmashim`` console script."""
    parser = argparse.ArgumentParser(prog="rdmashim", description=rdmashim.__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=rdmashim.__version__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("devices", help="list RDMA devices of every backend (like ibv_devices)")
    p.set_defaults(func=_cmd_devices)
    p = sub.add_parser("devinfo", help="device limits and port state (like ibv_devinfo)")
    p.add_argument("-d", "--device", default=None, help="device name (default: siw_lo)")
    p.add_argument("-b", "--backend", default=os.environ.get("RDMASHIM_BACKEND"))
    p.set_defaults(func=_cmd_devinfo)
    p = sub.add_parser(
        "demo", help="two queue pairs over loopback TCP: Send, RDMA Write and Read, verified"
    )
    p.add_argument("-s", "--size", type=int, default=1 << 20, help="bytes per RDMA operation")
    p.add_argument("-n", "--count", type=int, default=256, help="RDMA Writes and Reads each")
    p.add_argument("--no-crc", action="store_true", help="do not request MPA CRC32c")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress line")
    p.set_defaults(func=_cmd_demo)
    p = sub.add_parser(
        "ping",
        help="rping's ping (RDMA Read, then Write, of a message); talks to rdma-core's rping",
        description="rping (rdma-core) on the built-in engine: either side may be the real "
        "rping. The client sends its buffer's address; the server RDMA-Reads it and "
        "RDMA-Writes it back into the client's sink.",
    )
    role = p.add_mutually_exclusive_group(required=True)
    role.add_argument("-s", dest="server", action="store_true", help="server side")
    role.add_argument("-c", dest="server", action="store_false", help="client side")
    p.add_argument("-a", dest="address", default=None, help="address (server: to listen on)")
    p.add_argument("-p", dest="port", type=int, default=7174, help="port (default 7174)")
    p.add_argument("-C", dest="count", type=int, default=0, help="ping count (client; 0: forever)")
    p.add_argument("-S", dest="size", type=int, default=64, help="ping data size (default 64)")
    p.add_argument("-v", dest="verbose", action="store_true", help="display ping data to stdout")
    p.add_argument("-V", dest="validate", action="store_true", help="validate ping data")
    p.add_argument("-d", dest="debug", action="store_true", help="debug output (stderr)")
    p.add_argument(
        "--crc",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="request MPA CRC32c (default: on; CRC is used when either side asks)",
    )
    p.add_argument("--p2p", action="store_true", help="MPA peer-to-peer mode (RFC 6581 RTR)")
    p.add_argument(
        "--mpa-rev", type=int, choices=(1, 2), default=2, help="MPA revision to request (default 2)"
    )
    p.add_argument(
        "--timeout", type=float, default=None, help="seconds to wait for the peer at each step"
    )
    p.set_defaults(func=_cmd_ping)
    _add_rds(sub)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        return int(args.func(args))
    except (OSError, ImportError) as exc:
        print(f"rdmashim {args.command}: {exc}", file=sys.stderr)
        return 1
    finally:
        if os.environ.get("RDMASHIM_TIMING"):
            print(f"({time.perf_counter() - start:.3f} s)", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
