"""The ``rdmashim`` command: devices, devinfo, a loopback demo, and rping's ping."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

import trio

import rdmashim
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
        "--timeout", type=float, default=None, help="seconds to wait for the peer at each step"
    )
    p.set_defaults(func=_cmd_ping)
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
