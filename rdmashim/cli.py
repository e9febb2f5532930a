"""The ``rdmashim`` command: devices, devinfo, a loopback demo, rping's ping, rds-tools.

Arguments are checked by their types (:mod:`rdmashim.cliargs`) before a
command starts; every command ends through :func:`rdmashim.cliargs.run_command`
(one line on error, 130 on Ctrl-C). ``python -m rdmashim`` runs the same.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence

import rdmashim
from rdmashim import ping_defaults as rping
from rdmashim.cliargs import (
    Parser,
    UsageError,
    backend,
    check_backend_env,
    duration,
    host,
    integer,
    port,
    run_command,
    size,
)
from rdmashim.nfstools.cli import add_nfs
from rdmashim.perftools.cli import add_perf
from rdmashim.rdstools.cli import add_rds
from rdmashim.registry import backend_status

DEMO_MAX_SIZE = 1 << 30
"""The demo's largest operation: it holds four buffers of this size in memory."""
DEMO_MAX_COUNT = 1 << 31
"""The demo's largest count (its operations are built one by one, none held in advance)."""
INT_MAX = (1 << 31) - 1
"""rping's counts are C ints."""


def _cmd_devices(args: argparse.Namespace) -> int:
    print(f"    {'device':<16}{'node GUID':<22}backend")
    print(f"    {'------':<16}{'---------':<22}-------")
    for info, problem in backend_status():
        if problem is not None:
            print(f"    ({info.name} unavailable: {problem})")
            continue
        for dev in rdmashim.get_device_list(backend=info.name):
            hca = getattr(dev, "sits_on", None)  # a layered backend names the HCA under it
            on = f" on {hca}" if hca else ""
            print(f"    {dev.name:<16}{dev.node_guid:016x}      {info.name}{on}")
    return 0


def _cmd_devinfo(args: argparse.Namespace) -> int:
    import trio

    from rdmashim.devinfo import devinfo_lines, list_lines

    if args.list:
        names = [dev.name for dev in rdmashim.get_device_list(backend=args.backend)]
        lines = list_lines(names)
    else:
        lines = trio.run(devinfo_lines, args.device, args.backend, args.port, args.verbose)
    print("\n".join(lines))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    import trio

    from rdmashim.demo import run_demo

    progress = sys.stderr.isatty() and not args.quiet
    return trio.run(run_demo, args.size, args.count, not args.no_crc, progress)


def _cmd_ping(args: argparse.Namespace) -> int:
    import trio

    from rdmashim import ping

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
        config = ping.PingConfig(
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
        raise UsageError(str(exc)) from None
    result = trio.run(ping.run, config)
    if args.debug:
        print(f"rdmashim ping: {result.pings} pings of {result.size} B", file=sys.stderr)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = Parser(prog="rdmashim", description=rdmashim.__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=rdmashim.__version__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("devices", help="list RDMA devices of every backend (like ibv_devices)")
    p.set_defaults(func=_cmd_devices)
    p = sub.add_parser("devinfo", help="device limits and port state (like ibv_devinfo)")
    p.add_argument(
        "-d", "--ib-dev", "--device", dest="device", default=None,
        help="use device DEV (default: every device of the backend)",
    )  # fmt: skip
    p.add_argument(
        "-i", "--ib-port", dest="port", type=integer(1, 255), default=None,
        help="show only port PORT of the device (default: every port)",
    )  # fmt: skip
    p.add_argument("-l", "--list", action="store_true", help="print only the device names")
    p.add_argument(
        "-v", "--verbose", action="store_true", help="print every attribute the device reports"
    )
    p.add_argument(
        "-b", "--backend", type=backend, default=None,
        help="backend (default: RDMASHIM_BACKEND, else softiwarp)",
    )  # fmt: skip
    p.set_defaults(func=_cmd_devinfo)
    p = sub.add_parser(
        "demo", help="two queue pairs over loopback TCP: Send, RDMA Write and Read, verified"
    )
    p.add_argument(
        "-s", "--size", type=size(1, DEMO_MAX_SIZE), default=1 << 20,
        help="bytes per RDMA operation, 1 .. 1G (suffixes K, M, G; default 1M)",
    )  # fmt: skip
    p.add_argument(
        "-n", "--count", type=integer(1, DEMO_MAX_COUNT), default=256,
        help="RDMA Writes and Reads each (at least 1; default 256)",
    )  # fmt: skip
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
    p.add_argument(
        "-a", dest="address", type=host, default=None,
        help="address or host name (server: to listen on)",
    )  # fmt: skip
    p.add_argument("-p", dest="port", type=port, default=rping.PORT, help="port (default 7174)")
    p.add_argument(
        "-C", dest="count", type=integer(0, INT_MAX), default=0,
        help="ping count (client; 0: forever)",
    )  # fmt: skip
    p.add_argument(
        "-S", dest="size", type=integer(rping.MIN_SIZE, rping.MAX_SIZE), default=rping.DEFAULT_SIZE,
        help=f"ping data size, {rping.MIN_SIZE} .. {rping.MAX_SIZE} (default 64)",
    )  # fmt: skip
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
        "--timeout", type=duration(), default=None,
        help="seconds to wait for the peer at each step (suffixes ms, us)",
    )  # fmt: skip
    p.set_defaults(func=_cmd_ping)
    add_rds(sub)
    add_nfs(sub)
    add_perf(sub)
    for name, choice in sub.choices.items():
        choice.set_defaults(prog=f"rdmashim {name}")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``rdmashim`` console script (and of ``python -m rdmashim``)."""
    # The library's log records (a peer unreachable, a message dropped) are not the
    # command's output: without -d they go nowhere, not to stderr beside the error line.
    logging.getLogger("rdmashim").addHandler(logging.NullHandler())
    parser = _parser()
    parsed: list[tuple[argparse.Namespace, list[str]]] = []
    status = run_command("rdmashim", lambda: parsed.append(parser.parse_known_args(argv)))
    if status or not parsed:  # an error, or -h: argparse has printed what it had to
        return status
    args, extra = parsed[0]
    start = time.perf_counter()

    def body() -> int:
        if extra:
            raise UsageError(f"unrecognized arguments: {' '.join(extra)}")
        check_backend_env()
        return int(args.func(args))

    try:
        return run_command(args.prog, body)
    finally:
        if os.environ.get("RDMASHIM_TIMING"):
            print(f"({time.perf_counter() - start:.3f} s)", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
