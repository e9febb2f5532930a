"""``rdmashim rds ping|stress|info|demo``: rds-tools' command lines.

The parser only: every argument is checked by its type before a node starts;
the commands themselves are :mod:`rdmashim.rdstools.commands`, imported when one
runs (so a bad argument is refused without loading the RDS machinery).
"""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable

from rdmashim.cliargs import Parser, duration, host, integer, port, size
from rdmashim.rdstools.defaults import (
    DEMO_MIN_SIZE,
    ECHO_PORT,
    INFO_TABLES,
    MIN_STRESS_BYTES,
    RDS_CM_PORT,
    RDS_MAX_MSG_SIZE,
    RDS_PORT,
    STRESS_PORT,
    TRANSPORTS,
)
from rdmashim.ulps.rds.settings import BUSY_POLL

MAX_TASKS = 256
MAX_DEPTH = 4096
MAX_DEMO_NODES = 64
MAX_CUTS = 1000
MIN_INTERVAL = 1e-3
"""rds ping's shortest interval between pings (a flood is not a ping)."""


def _run(name: str) -> Callable[[argparse.Namespace], int]:
    """The command body: coroutine ``name`` of :mod:`rdmashim.rdstools.commands` under trio."""

    def body(args: argparse.Namespace) -> int:
        import trio

        from rdmashim.rdstools import commands

        command: Callable[[argparse.Namespace], Awaitable[int]] = getattr(commands, name)
        return trio.run(command, args)

    return body


def add_rds(sub: argparse._SubParsersAction[Parser]) -> None:
    """The ``rds`` command and its subcommands, on the subparsers ``sub`` of ``rdmashim``."""
    rds = sub.add_parser(
        "rds",
        help="rds-tools on rdmashim's RDS: ping, stress, info, and a messaging demo",
        description="rds-tools (rds-ping, rds-stress, rds-info) on rdmashim's RDS over the "
        "built-in engine (--transport rdma) or over TCP as Linux's rds_tcp (--transport tcp). "
        "Every node needs its own IP address (any 127.x.y.z on Linux); nodes find each other "
        "on one port (--cm-port: rdma_cm's, or TCP's; the same on all nodes).",
    )
    rsub = rds.add_subparsers(dest="rds_command", required=True)
    cm = Parser(add_help=False)
    cm.add_argument(
        "--cm-port", type=integer(1, 65535), default=None,
        help=f"rdma_cm (or TCP) port of every node (default Linux's: {RDS_PORT} for IPv4 over "
        f"rdma, {RDS_CM_PORT} for IPv6 and over tcp)",
    )  # fmt: skip
    cm.add_argument(
        "--transport", choices=TRANSPORTS, default="rdma",
        help="rdma: the built-in engine's RC queue pairs; tcp: TCP, as Linux's rds_tcp "
        "(default rdma)",
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
    p.add_argument("dest", nargs="?", type=host, help="address of the node to ping")
    p.add_argument("-I", dest="local", type=host, help="local address (default: as routing picks)")
    p.add_argument(
        "-c", dest="count", type=integer(0), default=0, help="stop after COUNT pings (0: never)"
    )
    p.add_argument(
        "-i", dest="interval", type=duration(least=MIN_INTERVAL), default=1.0,
        help="seconds between pings, at least 1 ms (default 1; suffixes ms, msec, us, usec)",
    )  # fmt: skip
    p.add_argument(
        "-p", dest="port", type=port, default=ECHO_PORT,
        help=f"RDS port of the echo responder (default {ECHO_PORT})",
    )  # fmt: skip
    p.add_argument("--serve", action="store_true", help="be the pinged side (needs -I)")
    p.set_defaults(func=_run("rds_ping"))

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
    msg = size(MIN_STRESS_BYTES, RDS_MAX_MSG_SIZE)
    p.add_argument("-r", dest="local", type=host, required=True, help="local address")
    p.add_argument("-s", dest="server", type=host, help="send to this address (the active side)")
    p.add_argument(
        "-p", dest="port", type=integer(1, 65534), default=STRESS_PORT,
        help=f"RDS port of the passive side; active tasks use the next ones (default "
        f"{STRESS_PORT})",
    )  # fmt: skip
    p.add_argument("-q", dest="req_bytes", type=msg, default=1024, help="request bytes (1024)")
    p.add_argument("-a", dest="ack_bytes", type=msg, default=16, help="ack bytes (16)")
    p.add_argument(
        "-t", dest="tasks", type=integer(1, MAX_TASKS), default=1,
        help=f"tasks (sockets), 1 .. {MAX_TASKS} (1)",
    )  # fmt: skip
    p.add_argument(
        "-d", dest="depth", type=integer(1, MAX_DEPTH), default=1,
        help=f"requests in flight per task, 1 .. {MAX_DEPTH} (1)",
    )  # fmt: skip
    p.add_argument(
        "-T", dest="seconds", type=duration(zero=True), default=0.0,
        help="seconds to run (0: until Ctrl-C)",
    )  # fmt: skip
    p.add_argument(
        "-D", dest="rdma_bytes", type=size(0, RDS_MAX_MSG_SIZE), default=0,
        help="each request offers a buffer of this many bytes (by RDS cookie) that its ack "
        "RDMA Writes into (0: none)",
    )  # fmt: skip
    p.add_argument(
        "--rdma-read", action="store_true", help="with -D, the ack RDMA Reads the buffer instead"
    )
    p.add_argument(
        "--busy-poll", type=duration(zero=True), default=None, metavar="TIME",
        help="how long a wait for a message polls before it blocks (RdsSettings.busy_poll; "
        f"suffixes ms, msec, us, usec; 0: block at once; default {BUSY_POLL * 1e6:g}us, as "
        "librdmacm's rsockets poll)",
    )  # fmt: skip
    p.add_argument("-z", dest="summary_only", action="store_true", help="only the summary")
    p.set_defaults(func=_run("rds_stress"))

    p = rsub.add_parser(
        "info",
        parents=[cm],
        help="rds-info: the tables of a node run by `rds ping --serve` or `rds stress`",
        description="rds-info's tables of a running node. A node lives inside its process, "
        "so this asks it over RDS (port 10000): the nodes of `rdmashim rds ping --serve` "
        "and `rdmashim rds stress` answer, and so does any program that runs "
        "rdmashim.rdstools.info.serve_info. The query's own connection shows in the answer. "
        "Programs can print their own nodes' tables with rdmashim.rdstools.info.format_info.",
    )
    p.add_argument("dest", type=host, help="address of the node to ask")
    p.add_argument("-I", dest="local", type=host, help="local address (default: as routing picks)")
    for letter, what in INFO_TABLES.items():
        p.add_argument(f"-{letter}", dest=f"table_{letter}", action="store_true", help=what)
    p.add_argument(
        "--timeout", type=duration(), default=5.0, help="seconds to wait for the answer (5)"
    )
    p.set_defaults(info=False, func=_run("rds_info"))

    p = rsub.add_parser(
        "demo",
        help="several nodes on loopback messaging all-to-all through connection cuts",
        description="RDS nodes on 127.0.0.1, .2, ... in this process; every socket sends to "
        "every other; connections are cut underneath mid-run; every message is checked to "
        "arrive exactly once, in order and intact.",
    )
    p.add_argument(
        "-n", "--nodes", type=integer(2, MAX_DEMO_NODES), default=4,
        help=f"nodes, 2 .. {MAX_DEMO_NODES} (default 4)",
    )  # fmt: skip
    p.add_argument(
        "-T", "--seconds", type=duration(), default=8.0, help="seconds of sending (more than 0; 8)"
    )
    p.add_argument(
        "-s", "--size", type=size(DEMO_MIN_SIZE, RDS_MAX_MSG_SIZE), default=1024,
        help=f"message bytes, {DEMO_MIN_SIZE} .. {RDS_MAX_MSG_SIZE} (1024)",
    )  # fmt: skip
    p.add_argument(
        "--cuts", type=integer(0, MAX_CUTS), default=2, help="connection cuts during the run (2)"
    )
    p.add_argument(
        "--address", type=host, default="127.0.0.1", help="first node's address (127.0.0.1)"
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress line")
    p.add_argument(
        "--cm-port", type=port, default=0,
        help="rdma_cm (or TCP) port of the nodes (default: a free one)",
    )  # fmt: skip
    p.add_argument(
        "--transport", choices=TRANSPORTS, default="rdma",
        help="rdma (the built-in engine) or tcp (as Linux's rds_tcp; default rdma)",
    )  # fmt: skip
    p.add_argument("--info", action="store_true", help="print rds-info's tables at the end")
    p.set_defaults(func=_run("rds_demo"))
    for name, choice in rsub.choices.items():
        choice.set_defaults(prog=f"rdmashim rds {name}")
