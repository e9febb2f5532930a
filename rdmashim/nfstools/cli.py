"""``rdmashim nfs serve``: export a directory over NFSv3, on RPC-over-RDMA and TCP.

The parser checks every argument before anything starts; the server is
:func:`rdmashim.ulps.nfsrdma.server.serve_nfs`. It prints what it serves and the
command that mounts it, then serves until Ctrl-C (exit 130, quietly). The
client commands (``ls``, ``stat``, ``get``, ``put``, ``mkdir``, ``rm``) are
added from :mod:`.client_cli`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rdmashim.cliargs import Parser, UsageError, backend, host, integer
from rdmashim.nfstools.client_cli import add_client

DEFAULT_HOST = "0.0.0.0"


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
        "(with MOUNT v3), and rpcbind on --rpcbind-port (or, when that port is taken, "
        "registered with the rpcbind there). Root squash is on; clients may use any "
        "port (the kernel's RDMA client does not use a reserved one).",
    )
    p.add_argument("dir", type=Path, help="the directory to export")
    p.add_argument("--ro", action="store_true", help="a read-only export (NFS3ERR_ROFS)")
    p.add_argument(
        "--no-root-squash", action="store_true",
        help="let AUTH_SYS uid 0 act as root (default: squashed to nobody)",
    )  # fmt: skip
    p.add_argument("--host", type=host, default=DEFAULT_HOST, help="address to serve on")
    p.add_argument("--rdma-port", type=integer(0, 65535), default=20049, help="RDMA port")
    p.add_argument("--tcp-port", type=integer(0, 65535), default=2049, help="TCP port")
    p.add_argument("--rpcbind-port", type=integer(0, 65535), default=111, help="rpcbind port")
    p.add_argument("--no-rdma", action="store_true", help="serve TCP only")
    p.add_argument("--state-dir", type=Path, default=None, help="where handle keys are kept")
    p.add_argument("-b", "--backend", type=backend, default=None, help="RDMA backend")
    p.add_argument("-d", dest="debug", action="store_true", help="log to stderr")
    p.set_defaults(func=_serve)
    add_client(nsub)
    for name, choice in nsub.choices.items():
        choice.set_defaults(prog=f"rdmashim nfs {name}")


def _serve(args: argparse.Namespace) -> int:
    import logging
    import sys

    import trio

    from rdmashim.ulps.nfsrdma.server import ServerConfig, mount_command, serve_nfs

    if not args.dir.is_dir():
        raise UsageError(f"{args.dir}: not a directory")
    if args.debug:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    config = ServerConfig(
        args.dir, read_only=args.ro, root_squash=not args.no_root_squash, host=args.host,
        tcp_port=args.tcp_port, rdma_port=None if args.no_rdma else args.rdma_port,
        rpcbind_port=args.rpcbind_port, backend=args.backend,
    )  # fmt: skip
    if args.state_dir is not None:
        config.state_dir = args.state_dir

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            serving = await nursery.start(serve_nfs, config)
            where = "0.0.0.0" if args.host == DEFAULT_HOST else args.host
            rdma = f"RDMA port {serving.rdma_port}, " if serving.rdma_port else ""
            rpcbind = (
                f"rpcbind port {serving.rpcbind_port}"
                if serving.rpcbind_port
                else "registered with the system's rpcbind (or none)"
            )
            print(
                f"serving {serving.export}{' read-only' if args.ro else ''} on {where}: "
                f"NFSv3 on {rdma}TCP port {serving.tcp_port} (with MOUNT v3), {rpcbind}",
                flush=True,
            )
            print(f"mount it with: {mount_command('SERVER', serving)}", flush=True)

    trio.run(main)
    return 0
