"""``rdmashim nfs serve``: export a directory over NFSv3, on RPC-over-RDMA and TCP.

The parser checks every argument before anything starts; the server is
:func:`rdmashim.ulps.nfsrdma.server.serve_nfs`. Once every port is open it prints
what it serves, on a line starting ``serving `` (the ready signal scripts wait
for), and the command that mounts it, then serves until Ctrl-C or SIGTERM
(exit 130 or 143, quietly, its programs withdrawn from a system rpcbind). The
client commands (``ls``, ``stat``, ``get``, ``put``, ``mkdir``, ``rm``) are
added from :mod:`.client_cli`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from rdmashim.cliargs import Parser, UsageError, backend, host, integer
from rdmashim.nfstools.client_cli import add_client
from rdmashim.ulps.nfsrdma.tcp import DEFAULT_MAX_CONNECTIONS

if TYPE_CHECKING:
    from rdmashim.ulps.nfsrdma.server import Serving

DEFAULT_HOST = "0.0.0.0"
READY_PREFIX = "serving "
"""How the line that says the server is ready starts."""


def add_nfs(sub: argparse._SubParsersAction[Parser]) -> None:
    """The ``nfs`` command and its subcommands, on the subparsers ``sub`` of ``rdmashim``."""
    nfs = sub.add_parser(
        "nfs",
        help="an NFSv3 server and client over RPC-over-RDMA and TCP",
        description="NFSv3 (RFC 1813) over RPC-over-RDMA (RFC 8166) and TCP, on any backend.",
    )
    nsub = nfs.add_subparsers(dest="nfs_command", required=True)
    p = nsub.add_parser(
        "serve",
        help="export a directory (NFS on RDMA 20049 and TCP 2049, MOUNT, rpcbind)",
        description="Export DIR over NFSv3: RPC-over-RDMA on --rdma-port, TCP on --tcp-port "
        "(with MOUNT v3 and NLM), and rpcbind on --rpcbind-port over TCP and UDP (or, when "
        "that port is taken, registered with the rpcbind there, and withdrawn at the end). "
        "Root squash is on; clients may use any port (the kernel's RDMA client does not "
        "use a reserved one).",
        epilog=f"Ready signal: once every port is open it prints one line that starts with "
        f"'{READY_PREFIX}' (the export, the address and each port, and which rpcbind "
        "answers), then the mount command; a script waits for that line. It serves until "
        "Ctrl-C or SIGTERM (exit status 130 or 143).",
    )
    p.add_argument("dir", type=Path, help="the directory to export")
    p.add_argument("--ro", action="store_true", help="a read-only export (NFS3ERR_ROFS)")
    p.add_argument(
        "--no-root-squash", action="store_true",
        help="let AUTH_SYS uid 0 act as root (default: squashed to nobody)",
    )  # fmt: skip
    p.add_argument(
        "--host",
        type=host,
        default=DEFAULT_HOST,
        help="address to serve on (default: %(default)s, every IPv4 address)",
    )
    for flag, default, what in (
        ("--rdma-port", 20049, "RPC-over-RDMA"),
        ("--tcp-port", 2049, "NFS, MOUNT and NLM over TCP"),
        ("--rpcbind-port", 111, "rpcbind, over TCP and UDP"),
    ):
        p.add_argument(
            flag, type=integer(0, 65535), default=default,
            help=f"{what}; 0 picks a free port (default: %(default)s)",
        )  # fmt: skip
    p.add_argument("--no-rdma", action="store_true", help="serve TCP only")
    p.add_argument(
        "--max-tcp-connections", type=integer(1, 65536), default=DEFAULT_MAX_CONNECTIONS,
        help="TCP connections served at once (each has a thread); one more closes the one "
        "idle the longest (default: %(default)s)",
    )  # fmt: skip
    p.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="where handle keys are kept (default: $XDG_STATE_HOME/rdmashim/nfs, "
        "$XDG_STATE_HOME being ~/.local/state if unset)",
    )
    p.add_argument(
        "-b",
        "--backend",
        type=backend,
        default=None,
        help="RDMA backend (default: RDMASHIM_BACKEND, else softiwarp)",
    )
    p.add_argument("-d", dest="debug", action="store_true", help="log to stderr")
    p.set_defaults(func=_serve)
    add_client(nsub)
    for name, choice in nsub.choices.items():
        choice.set_defaults(prog=f"rdmashim nfs {name}")


def _serve(args: argparse.Namespace) -> int:
    import logging
    import sys

    import trio

    from rdmashim.clisignals import Signals
    from rdmashim.ulps.nfsrdma.server import ServerConfig, mount_command, serve_nfs

    if not args.dir.is_dir():
        raise UsageError(f"{args.dir}: not a directory")
    if args.debug:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    config = ServerConfig(
        args.dir, read_only=args.ro, root_squash=not args.no_root_squash, host=args.host,
        tcp_port=args.tcp_port, rdma_port=None if args.no_rdma else args.rdma_port,
        rpcbind_port=args.rpcbind_port, backend=args.backend,
        max_tcp_connections=args.max_tcp_connections,
    )  # fmt: skip
    if args.state_dir is not None:
        config.state_dir = args.state_dir

    signals = Signals()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(signals.watch, nursery.cancel_scope.cancel)
            serving = await nursery.start(serve_nfs, config)
            rdma = f"RDMA port {serving.rdma_port}, " if serving.rdma_port else ""
            print(
                f"{READY_PREFIX}{serving.export}{' read-only' if args.ro else ''} on {args.host}: "
                f"NFSv3 on {rdma}TCP port {serving.tcp_port} (with MOUNT v3), "
                f"{_rpcbind_said(serving, args.rpcbind_port)}",
                flush=True,
            )
            print(f"mount it with: {mount_command('SERVER', serving)}", flush=True)

    trio.run(main)
    return signals.status


def _rpcbind_said(serving: Serving, port: int) -> str:
    """Which rpcbind tells clients the ports, for the ready line."""
    if serving.rpcbind_port is not None:
        return f"rpcbind port {serving.rpcbind_port}"
    if serving.system_rpcbind is not None:
        return f"registered with the system's rpcbind on port {serving.system_rpcbind}"
    return (
        f"no rpcbind (port {port} is not ours and none answers there): clients must "
        "name the ports (port=, mountport=)"
    )
