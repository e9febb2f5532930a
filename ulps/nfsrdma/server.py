"""One NFS server: NFSv3, MOUNT v3 and NLM over TCP and RPC-over-RDMA, and rpcbind, in one process.

:func:`serve_nfs` exports a directory the way ``mount -t nfs -o
vers=3,proto=rdma,port=20049 host:/export /mnt`` expects to find it: the NFS
program on RPC-over-RDMA (20049) and on TCP (2049), MOUNT and the lock
manager (NLM v1, v3, v4: :mod:`.nlm`) on the same TCP port, and rpcbind on
111 telling clients where they are. When port 111 is
taken (a system rpcbind runs), the server registers its programs with that
rpcbind instead. One :class:`~.rpc.RpcServer` answers on every listener.
"""

from __future__ import annotations

import errno
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import trio

from rdmashim.ulps.nfsrdma.export import Export
from rdmashim.ulps.nfsrdma.mount import MountProgram
from rdmashim.ulps.nfsrdma.nfs3 import Nfs3Program
from rdmashim.ulps.nfsrdma.nlm import NlmProgram
from rdmashim.ulps.nfsrdma.nlm_types import NLM_PROG, SERVED_VERSIONS
from rdmashim.ulps.nfsrdma.rdma_server import serve_rdma
from rdmashim.ulps.nfsrdma.rpc import RpcServer
from rdmashim.ulps.nfsrdma.rpcbind import (
    MOUNT_PROG,
    NFS_PROG,
    RPCBIND_PORT,
    Binding,
    Registry,
    Rpcbind,
    register_with_rpcbind,
)
from rdmashim.ulps.nfsrdma.tcp import serve_tcp

log = logging.getLogger(__name__)

NFS_TCP_PORT = 2049
NFS_RDMA_PORT = 20049
"""IANA's nfsrdma port, the Linux client's default with ``proto=rdma``."""
DEFAULT_STATE_DIR = Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local" / "state"))
"""Where handle keys live (``rdmashim/nfs`` under it), so handles survive a restart."""


@dataclass
class ServerConfig:
    """What :func:`serve_nfs` serves and where (port 0: any free port; None: not served)."""

    path: Path
    read_only: bool = False
    root_squash: bool = True
    host: str = "0.0.0.0"
    tcp_port: int | None = NFS_TCP_PORT
    rdma_port: int | None = NFS_RDMA_PORT
    rpcbind_port: int | None = RPCBIND_PORT
    backend: str | None = None
    """The portable backend of the RDMA listener (None: RDMASHIM_BACKEND, else softiwarp)."""
    state_dir: Path = field(default_factory=lambda: DEFAULT_STATE_DIR / "rdmashim" / "nfs")
    nlm_grace: float = 0.0
    """Seconds after the start in which NLM takes only reclaimed locks (see :mod:`.nlm`)."""


@dataclass
class Serving:
    """What :func:`serve_nfs` reports when it has started: the export and its ports."""

    export: str
    tcp_port: int | None
    rdma_port: int | None
    rpcbind_port: int | None
    """Our own rpcbind's port, None if the programs went to the system's rpcbind."""
    registered: list[Binding]


async def serve_nfs(
    config: ServerConfig, *, task_status: trio.TaskStatus[Serving] = trio.TASK_STATUS_IGNORED
) -> None:
    """Serve ``config.path`` until cancelled (with ``nursery.start``, it gives :class:`Serving`)."""
    config.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    export = Export(
        config.path,
        state_dir=config.state_dir,
        read_only=config.read_only,
        root_squash=config.root_squash,
    )
    registry = Registry()
    nlm = NlmProgram(export, grace=config.nlm_grace)
    server = RpcServer([Nfs3Program(export), MountProgram(export), nlm, Rpcbind(registry)])
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(nlm.run)
            tcp_port = rdma_port = rpcbind_port = None
            if config.tcp_port is not None:
                listeners = await nursery.start(serve_tcp, server, config.tcp_port, config.host)
                tcp_port = listeners[0].socket.getsockname()[1]
                registry.add(NFS_PROG, 3, "tcp", tcp_port)
                for vers in (1, 2, 3):
                    registry.add(MOUNT_PROG, vers, "tcp", tcp_port)
                for vers in SERVED_VERSIONS:
                    registry.add(NLM_PROG, vers, "tcp", tcp_port)
            if config.rdma_port is not None:
                addr = await nursery.start(
                    lambda task_status: serve_rdma(
                        server, config.rdma_port or 0, config.host,
                        backend=config.backend, task_status=task_status,
                    )
                )  # fmt: skip
                rdma_port = int(addr[1]) if addr is not None else config.rdma_port
                registry.add(NFS_PROG, 3, "rdma", rdma_port)
            if config.rpcbind_port is not None:
                rpcbind_port = await _rpcbind(nursery, server, registry, config)
            task_status.started(
                Serving(export.name, tcp_port, rdma_port, rpcbind_port, registry.bindings())
            )
            await trio.sleep_forever()
    finally:
        export.close()


async def _rpcbind(
    nursery: trio.Nursery, server: RpcServer, registry: Registry, config: ServerConfig
) -> int | None:
    """Our rpcbind on its port, or (port taken) our programs registered with the one there."""
    port = config.rpcbind_port or 0
    try:
        listeners = await nursery.start(serve_tcp, server, port, config.host)
    except OSError as exc:
        if exc.errno not in (errno.EADDRINUSE, errno.EACCES):
            raise
        log.info("port %d is taken (%s): registering with the rpcbind there", port, exc)
        try:
            done = await register_with_rpcbind(registry.bindings(), port=port)
        except OSError as why:  # nobody there (port 111 needs root to bind)
            log.warning(
                "no rpcbind on port %d (%s): clients must name the ports (port=, mountport=)",
                port, why,
            )  # fmt: skip
            return None
        for binding, ok in zip(registry.bindings(), done, strict=True):
            if not ok:
                log.warning("rpcbind on %d refused %s", port, binding)
        return None
    return int(listeners[0].socket.getsockname()[1])


def mount_command(host: str, serving: Serving) -> str:
    """The command a Linux client mounts the export with over RDMA (TCP if none)."""
    if serving.rdma_port is not None:
        return (
            f"mount -t nfs -o vers=3,proto=rdma,port={serving.rdma_port} "
            f"{host}:{serving.export} /mnt"
        )
    return f"mount -t nfs -o vers=3,proto=tcp,port={serving.tcp_port} {host}:{serving.export} /mnt"


__all__ = [
    "NFS_RDMA_PORT",
    "NFS_TCP_PORT",
    "ServerConfig",
    "Serving",
    "mount_command",
    "serve_nfs",
]
