"""One NFS server: NFSv3, MOUNT v3 and NLM over TCP and RPC-over-RDMA, and rpcbind, in one process.

:func:`serve_nfs` exports a directory the way ``mount -t nfs -o
vers=3,proto=rdma,port=20049 host:/export /mnt`` expects to find it: the NFS
program on RPC-over-RDMA (20049) and on TCP (2049), MOUNT and the lock
manager (NLM v1, v3, v4: :mod:`.nlm`) on the same TCP port, and rpcbind on
port 111, TCP and UDP, telling clients where they are (itself included, as
``rpcinfo -p`` expects). When port 111 is taken (a system rpcbind runs),
the server registers its programs with that rpcbind instead, and withdraws
them when it ends. One :class:`~.rpc.RpcServer` answers on every TCP and
RDMA listener; the UDP socket answers rpcbind only.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from rdmashim.ulps.nfsrdma.export import Export
from rdmashim.ulps.nfsrdma.mount import MountProgram
from rdmashim.ulps.nfsrdma.nfs3 import Nfs3Program
from rdmashim.ulps.nfsrdma.nlm import NlmProgram
from rdmashim.ulps.nfsrdma.nlm_types import NLM_PROG, SERVED_VERSIONS
from rdmashim.ulps.nfsrdma.rdma_server import serve_rdma
from rdmashim.ulps.nfsrdma.rpc import RpcError, RpcServer
from rdmashim.ulps.nfsrdma.rpcbind import (
    MOUNT_PROG,
    NFS_PROG,
    RPCBIND_PORT,
    RPCBIND_PROG,
    RPCBIND_VERSIONS,
    Binding,
    Registry,
    Rpcbind,
    register_with_rpcbind,
)
from rdmashim.ulps.nfsrdma.tcp import DEFAULT_MAX_CONNECTIONS, serve_tcp, serve_tcp_listeners
from rdmashim.ulps.nfsrdma.udp import open_udp, serve_udp

if TYPE_CHECKING:
    from rdmashim.cm.addressing import SockAddr

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
    max_tcp_connections: int = DEFAULT_MAX_CONNECTIONS
    """TCP connections served at once (one more closes the one idle the longest: see
    :mod:`.tcp`)."""


@dataclass
class Serving:
    """What :func:`serve_nfs` reports when it has started: the export and its ports."""

    export: str
    tcp_port: int | None
    rdma_port: int | None
    rpcbind_port: int | None
    """Our own rpcbind's port (TCP and UDP), None if it does not run (the port was taken)."""
    registered: list[Binding]
    """What our rpcbind answers for, or what we offered the system's."""
    system_rpcbind: int | None = None
    """The port of the system's rpcbind our programs were registered with (None: not)."""


NFS_PROGRAMS = [(NFS_PROG, 3), *((MOUNT_PROG, v) for v in (1, 2, 3))]
"""What the TCP port serves besides NLM (MOUNT versions 1 and 2 for ``showmount``)."""
REGISTER_SECONDS = 10.0
"""How long the system's rpcbind may take to register our programs (then: none there)."""
UNREGISTER_SECONDS = 5.0
"""How long withdrawing our programs from the system's rpcbind may take at the end."""
RPCBIND_PORT_ATTEMPTS = 8
"""Free TCP ports tried for rpcbind port 0 before one is free over UDP too."""


async def serve_nfs(
    config: ServerConfig, *, task_status: trio.TaskStatus[Serving] = trio.TASK_STATUS_IGNORED
) -> None:
    """Serve ``config.path`` until cancelled (with ``nursery.start``, it gives :class:`Serving`).

    With our own rpcbind it answers for itself (program 100000 versions 2-4 on
    its TCP and UDP port) and every program; with the system's, our programs
    are registered there and withdrawn again when the server ends.
    """
    config.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    export = Export(
        config.path,
        state_dir=config.state_dir,
        read_only=config.read_only,
        root_squash=config.root_squash,
    )
    registry = Registry()
    nlm = NlmProgram(export, grace=config.nlm_grace)
    rpcbind = Rpcbind(registry)
    server = RpcServer([Nfs3Program(export), MountProgram(export), nlm, rpcbind])
    published: list[Binding] = []  # what the system's rpcbind took
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(nlm.run)
            tcp_port = rdma_port = rpcbind_port = None
            if config.rpcbind_port is not None:
                rpcbind_port = await _serve_rpcbind(nursery, server, rpcbind, config)
            if config.tcp_port is not None:
                serve = partial(serve_tcp, max_connections=config.max_tcp_connections)
                listeners = await nursery.start(serve, server, config.tcp_port, config.host)
                tcp_port = listeners[0].socket.getsockname()[1]
                served = [*NFS_PROGRAMS, *((NLM_PROG, v) for v in SERVED_VERSIONS)]
                for listener in listeners:
                    _add(registry, served, "tcp", listener.socket.getsockname())
            if config.rdma_port is not None:
                addr = await nursery.start(
                    lambda task_status: serve_rdma(
                        server, config.rdma_port or 0, config.host,
                        backend=config.backend, task_status=task_status,
                    )
                )  # fmt: skip
                rdma_port = int(addr[1]) if addr is not None else config.rdma_port
                host = str(addr[0]) if addr is not None else "0.0.0.0"
                _add(registry, [(NFS_PROG, 3)], "rdma", (host, rdma_port))
            if config.rpcbind_port is not None and rpcbind_port is None:
                published = await _publish(registry.bindings(), config.rpcbind_port)
            task_status.started(
                Serving(
                    export.name, tcp_port, rdma_port, rpcbind_port, registry.bindings(),
                    config.rpcbind_port if published else None,
                )
            )  # fmt: skip
            await trio.sleep_forever()
    finally:
        if published and config.rpcbind_port is not None:
            await _withdraw(published, config.rpcbind_port)
        export.close()


def _add(
    registry: Registry, programs: Iterable[tuple[int, int]], proto: str, where: SockAddr
) -> None:
    """Bind ``programs`` on ``proto`` (``tcp6`` for an IPv6 address...) at ``where``."""
    host, port = str(where[0]), int(where[1])
    netid = proto + "6" if ":" in host else proto
    for prog, vers in programs:
        registry.add(prog, vers, netid, port, host)


async def _serve_rpcbind(
    nursery: trio.Nursery, server: RpcServer, rpcbind: Rpcbind, config: ServerConfig
) -> int | None:
    """Our rpcbind on TCP and UDP, registered as itself; None when its port is taken
    (a system rpcbind runs) or is not ours to take (111 needs root)."""
    port = config.rpcbind_port or 0
    try:
        listeners, datagrams = await _rpcbind_sockets(port, config.host)
    except OSError as exc:
        if exc.errno not in (errno.EADDRINUSE, errno.EACCES):
            raise
        log.info("port %d is taken (%s): registering with the rpcbind there", port, exc)
        return None
    nursery.start_soon(serve_tcp_listeners, server, listeners)
    over_udp = RpcServer([rpcbind])  # the other programs are not served over UDP
    versions = [(RPCBIND_PROG, v) for v in RPCBIND_VERSIONS]
    for listener in listeners:
        _add(rpcbind.registry, versions, "tcp", listener.socket.getsockname())
    for sock in datagrams:
        _add(rpcbind.registry, versions, "udp", sock.getsockname())
        nursery.start_soon(serve_udp, over_udp, sock)
    return int(listeners[0].socket.getsockname()[1])


async def _rpcbind_sockets(
    port: int, host: str
) -> tuple[list[trio.SocketListener], list[trio.socket.SocketType]]:
    """TCP listeners and UDP sockets on the same port number (port 0: one free for both)."""
    for attempt in range(1, RPCBIND_PORT_ATTEMPTS + 1):
        listeners = await trio.open_tcp_listeners(port, host=host)
        datagrams: list[trio.socket.SocketType] = []
        try:
            for listener in listeners:
                address, bound = listener.socket.getsockname()[:2]
                datagrams.append(await open_udp(listener.socket.family, address, bound))
        except OSError as exc:
            for sock in datagrams:
                sock.close()
            for listener in listeners:
                await listener.aclose()
            if port or exc.errno != errno.EADDRINUSE or attempt == RPCBIND_PORT_ATTEMPTS:
                raise
            continue
        return listeners, datagrams
    raise AssertionError("unreachable: the last attempt returns or raises")


async def _publish(bindings: list[Binding], port: int) -> list[Binding]:
    """``bindings`` registered with the system's rpcbind on ``port``: those it took."""
    done: list[bool] | None = None
    why: object = f"no answer in {REGISTER_SECONDS:.0f} s"
    with trio.move_on_after(REGISTER_SECONDS):
        try:
            done = await register_with_rpcbind(bindings, port=port)
        except (OSError, RpcError) as exc:  # nobody there (port 111 needs root to bind)
            why = exc
    if done is None:
        log.warning(
            "no rpcbind on port %d (%s): clients must name the ports (port=, mountport=)",
            port, why,
        )  # fmt: skip
        return []
    for binding, ok in zip(bindings, done, strict=True):
        if not ok:
            log.warning("the rpcbind on port %d refused %s", port, binding)
    return [binding for binding, ok in zip(bindings, done, strict=True) if ok]


async def _withdraw(bindings: list[Binding], port: int) -> None:
    """Unregister ``bindings`` from the system's rpcbind, even while being cancelled."""
    with trio.CancelScope(shield=True) as scope:
        scope.deadline = trio.current_time() + UNREGISTER_SECONDS
        try:
            await register_with_rpcbind(bindings, port=port, unset=True)
        except (OSError, RpcError) as why:
            log.warning("our programs stay registered with the rpcbind on %d: %s", port, why)
    if scope.cancelled_caught:
        log.warning("the rpcbind on port %d did not answer the unregistration in time", port)


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
