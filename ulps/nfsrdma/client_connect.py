"""How the NFS client finds and reaches a server: rpcbind, MOUNT, and the NFS connection.

:func:`rpcbind_port_of` asks rpcbind where a program is; :func:`list_exports`
and :func:`mount` speak MOUNT v3 (over TCP); :func:`open_stream` and
:func:`answering_rdma` connect to NFS. Each failure says where and what:
a connection that cannot be made is a :class:`~.client_errors.ServerUnreachable`
naming the program, the host, the port and where that port came from (given,
named by rpcbind, the default); MOUNT's refusals are
:class:`~.client_errors.MountError` naming the export, and an export the
server does not have lists those it has.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import trio

from rdmashim.ulps.nfsrdma import nfs3_types as t
from rdmashim.ulps.nfsrdma.client_errors import (
    MountError,
    NfsError,
    ServerUnreachable,
    connect_failure,
)
from rdmashim.ulps.nfsrdma.mount import (
    MNT3_OK,
    MNT3ERR_ACCES,
    MNT3ERR_NOENT,
    MNTPATHLEN,
    MOUNTPROC_EXPORT,
    MOUNTPROC_MNT,
)
from rdmashim.ulps.nfsrdma.rdma_client import RpcRdmaClient
from rdmashim.ulps.nfsrdma.rpcbind import (
    IPPROTO_TCP,
    PMAP_VERS,
    PMAPPROC_GETPORT,
    PROC_DUMP,
    RPCB_VERS4,
    RPCBIND_PORT,
    RPCBIND_PROG,
    unpack_binding,
)
from rdmashim.ulps.nfsrdma.service import AuthSys, Reply
from rdmashim.ulps.nfsrdma.tcp import RpcTcpClient, rpc_client_on

log = logging.getLogger(__name__)

CONNECT_SECONDS = 15.0
"""How long a TCP connection to rpcbind, MOUNT or NFS may take to open."""
RDMA_PROBE_SECONDS = 3.0
"""How long the NULL call that opens an RPC-over-RDMA connection may go unanswered."""
RDMA_RETRY_PAUSE = 0.2
"""Seconds a connection made again waits before its first Send."""
RDMA_ATTEMPTS = 4
"""RPC-over-RDMA connections made before giving up on a server that answers no NULL call."""
NO_RPCBIND = "no rpcbind there? then give the MOUNT and NFS ports"
"""The hint when rpcbind cannot be reached."""


def default_cred() -> AuthSys:
    """AUTH_SYS as this process: its uid, gid and groups, the host's name."""
    groups = tuple(g for g in os.getgroups() if g != os.getgid())[:16]
    stamp = int(time.time()) & 0xFFFF_FFFF
    return AuthSys(stamp, socket.gethostname()[:255], os.getuid(), os.getgid(), groups)


def components(path: str) -> list[str]:
    """The names of an NFS path (TypeError if it is not a str, ValueError for a NUL)."""
    if not isinstance(path, str):
        raise TypeError(f"an NFS path is a str, not {type(path).__name__}")
    if "\0" in path:
        raise ValueError(f"NFS path {path!r} holds a NUL")
    return [c for c in path.split("/") if c and c != "."]


def call_args(*fill: Callable[[Reply], None]) -> Reply:
    """A call's arguments, written by each of ``fill`` in turn."""
    reply = Reply()
    for item in fill:
        item(reply)
    return reply


async def open_stream(program: str, host: str, port: int, origin: str = "") -> trio.SocketStream:
    """A TCP connection to ``program`` at ``host``:``port``; else ServerUnreachable, which
    says ``origin`` (where the port came from) too."""
    try:
        with trio.fail_after(CONNECT_SECONDS):
            return await trio.open_tcp_stream(host, port)
    except (OSError, trio.TooSlowError) as exc:
        raise ServerUnreachable(program, host, port, connect_failure(exc), origin) from exc


@asynccontextmanager
async def _rpc(
    program: str, host: str, port: int, cred: AuthSys | None = None, origin: str = ""
) -> AsyncIterator[RpcTcpClient]:
    async with rpc_client_on(await open_stream(program, host, port, origin), cred=cred) as rpc:
        yield rpc


async def rpcbind_port_of(host: str, rpcbind_port: int, prog: int, netid: str) -> int | None:
    """The port rpcbind at ``host`` names for ``prog`` v3 over ``netid`` (None: none);
    ServerUnreachable when rpcbind cannot be reached.

    TCP is asked with the portmapper's GETPORT. Any other netid is looked for in
    rpcbind's DUMP: rpcbind's GETADDR answers for the netid of the transport
    the query came on and ignores the one asked for (rpcbind and libtirpc do), so
    over TCP it would name the TCP port for ``rdma``.
    """
    async with _rpc("rpcbind", host, rpcbind_port, origin=NO_RPCBIND) as rpcbind:
        if netid == "tcp":

            def query(r: Reply) -> None:
                for value in (prog, 3, IPPROTO_TCP, 0):
                    r.packer.uint(value)

            found = await rpcbind.call(RPCBIND_PROG, PMAP_VERS, PMAPPROC_GETPORT, call_args(query))
            return found.uint() or None
        u = await rpcbind.call(RPCBIND_PROG, RPCB_VERS4, PROC_DUMP, Reply())
        while u.boolean():
            binding = unpack_binding(u)
            if (binding.prog, binding.vers, binding.netid) == (prog, 3, netid) and binding.port:
                return binding.port
        return None


async def nfs_port(host: str, rpcbind_port: int, proto: str, default: int) -> tuple[int, str]:
    """The NFS port over ``proto`` that rpcbind names, else ``default``; and where it came from."""
    try:
        found = await rpcbind_port_of(host, rpcbind_port, t.NFS_PROGRAM, proto)
    except ServerUnreachable as exc:
        log.info("%s: taking NFS's default port %d", exc, default)
        return default, f"the default port: no rpcbind at {host} port {rpcbind_port}"
    if found is None:
        return default, f"the default port: rpcbind names none for {proto}"
    return found, "the port rpcbind names for NFS"


async def _mount_port(host: str, rpcbind_port: int, mount_port: int | None) -> tuple[int, str]:
    if mount_port is not None:
        return mount_port, "the MOUNT port given"
    found = await rpcbind_port_of(host, rpcbind_port, t.MOUNT_PROGRAM, "tcp")
    if found is None:
        raise MountError(
            f"rpcbind at {host} port {rpcbind_port} names no MOUNT v3 over TCP "
            "(is an NFS server running there?)"
        )
    return found, "the port rpcbind names for MOUNT"


async def _exports(mount: RpcTcpClient) -> list[str]:
    u = await mount.call(t.MOUNT_PROGRAM, 3, MOUNTPROC_EXPORT, Reply())
    names = []
    while u.boolean():
        names.append(u.string(MNTPATHLEN))
        while u.boolean():
            u.string(MNTPATHLEN)  # a client group
    return names


async def list_exports(
    host: str, *, rpcbind_port: int = RPCBIND_PORT, mount_port: int | None = None
) -> list[str]:
    """The export names MOUNT's EXPORT procedure lists at ``host``."""
    port, origin = await _mount_port(host, rpcbind_port, mount_port)
    async with _rpc("MOUNT", host, port, default_cred(), origin) as mount:
        return await _exports(mount)


async def mount(
    host: str, export: str, *, rpcbind_port: int, mount_port: int | None, cred: AuthSys
) -> bytes:
    """MOUNT v3's MNT of ``export``: its root handle, else MountError saying why."""
    port, origin = await _mount_port(host, rpcbind_port, mount_port)
    async with _rpc("MOUNT", host, port, cred, origin) as rpc:
        u = await rpc.call(
            t.MOUNT_PROGRAM, 3, MOUNTPROC_MNT, call_args(lambda r: r.packer.string(export))
        )
        status = u.uint()
        if status == MNT3_OK:
            return t.unpack_fh(u)
        if status == MNT3ERR_NOENT:
            names = ", ".join(await _exports(rpc)) or "nothing"
            raise MountError(f"MOUNT {export}: no such export or directory (it exports {names})")
        if status == MNT3ERR_ACCES:
            raise MountError(f"MOUNT {export}: permission denied (not exported to this host)")
        raise MountError(f"MOUNT {export}: {NfsError(status)}")


def split_remote(exports: list[str], path: str) -> tuple[str, str]:
    """(export, path inside it): the longest export name that is a prefix of ``path``."""
    wanted = components(path)
    best: str | None = None
    for name in exports:
        parts = components(name)
        if wanted[: len(parts)] == parts and (best is None or len(parts) > len(components(best))):
            best = name
    if best is None:
        raise MountError(
            f"{path}: in no export (the server exports {', '.join(exports) or 'nothing'})"
        )
    return best, "/" + "/".join(wanted[len(components(best)) :])


@asynccontextmanager
async def answering_rdma(
    host: str, port: int, backend: str | None, cred: AuthSys, origin: str = ""
) -> AsyncIterator[RpcRdmaClient]:
    """An RPC-over-RDMA connection whose first call, NFS NULL, was answered.

    The Linux kernel's siw (6.1) under a server sometimes leaves the first Send
    unread when it comes soon after siw's MPA Reply (see "The siw responder
    race" in docs/interop.md): it is read only when the next TCP segment
    arrives, and a client holding its one credit sends none. Against knfsd in
    an emulated guest, where that window is wide, half the connections stalled
    so. A NULL call unanswered after :data:`RDMA_PROBE_SECONDS` is taken for
    that: the connection is closed (its FIN wakes siw) and made again, and this
    time the NULL waits :data:`RDMA_RETRY_PAUSE` first, at most
    :data:`RDMA_ATTEMPTS` connections in all. A connection that cannot be made
    is a ServerUnreachable naming ``origin``.
    """
    for attempt in range(1, RDMA_ATTEMPTS + 1):
        connected = False
        try:
            async with RpcRdmaClient.connect(host, port, backend=backend) as rdma:
                connected = True
                if attempt > 1:
                    await trio.sleep(RDMA_RETRY_PAUSE)  # past siw's window after its MPA Reply
                with trio.move_on_after(RDMA_PROBE_SECONDS) as probe:
                    await rdma.call(t.NFS_PROGRAM, 3, t.NULL, Reply(), cred)
                if not probe.cancelled_caught:
                    yield rdma
                    return
        except ConnectionError as exc:
            if connected:
                raise
            raise ServerUnreachable("NFS over RDMA", host, port, str(exc), origin) from exc
        log.warning(
            "no answer to NULL over RDMA from %s port %d in %.0f s (connection %d of %d)",
            host, port, RDMA_PROBE_SECONDS, attempt, RDMA_ATTEMPTS,
        )  # fmt: skip
    raise TimeoutError(
        f"{host} port {port}: no answer to NFS NULL over RDMA on {RDMA_ATTEMPTS} connections"
    )


@asynccontextmanager
async def nfs_over_tcp(
    host: str, port: int, cred: AuthSys, origin: str = ""
) -> AsyncIterator[RpcTcpClient]:
    """An RPC connection to NFS over TCP (ServerUnreachable naming ``origin`` if none)."""
    async with _rpc("NFS over TCP", host, port, cred, origin) as rpc:
        yield rpc


__all__ = [
    "answering_rdma",
    "call_args",
    "components",
    "default_cred",
    "list_exports",
    "mount",
    "nfs_over_tcp",
    "nfs_port",
    "open_stream",
    "rpcbind_port_of",
    "split_remote",
]
