"""rpcbind (RFC 1833): which port serves which RPC program, for mount.nfs and rpcinfo.

:class:`Registry` holds the bindings (program, version, netid, universal
address); the NFS server fills it (NFS 100003 v3 on ``tcp`` 2049 and ``rdma``
20049, MOUNT 100005 v3 on its port). :class:`Rpcbind` is the program
(100000) answering for it: version 2 (the portmapper: SET, UNSET, GETPORT,
DUMP with protocol numbers and ports) and versions 3 and 4 (SET, UNSET,
GETADDR, DUMP, GETTIME, and v4's GETVERSADDR with netids and universal
addresses "h1.h2.h3.h4.p1.p2"), over TCP and UDP alike. GETADDR answers a
binding on a wildcard address (0.0.0.0, ::) with the address the query came
to, as the system's rpcbind does: a client elsewhere can use that, not
0.0.0.0. SET and UNSET are taken from loopback callers only, like the
system's rpcbind does.

When the system's rpcbind holds port 111, :func:`register_with_rpcbind`
publishes our bindings there instead (RPCBPROC_SET, or PMAPPROC_SET for a
portmapper that knows only version 2), over its local socket
(``/run/rpcbind.sock``, where it knows us as ``superuser`` when we are root)
as libtirpc's servers do, else over TCP.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import trio

from rdmashim.ulps.nfsrdma.rpc import ProgMismatch, ProgUnavail
from rdmashim.ulps.nfsrdma.service import AuthSys, CallContext, ProcUnavailable, Reply
from rdmashim.ulps.nfsrdma.tcp import RpcTcpClient, connect_tcp, rpc_client_on
from rdmashim.ulps.nfsrdma.xdr import Packer, Unpacker

log = logging.getLogger(__name__)

RPCBIND_PROG = 100000
RPCBIND_PORT = 111
RPCBIND_VERSIONS = (2, 3, 4)
LOCAL_SOCKET = Path("/run/rpcbind.sock")
"""The system rpcbind's local (AF_LOCAL) socket."""
NFS_PROG = 100003
MOUNT_PROG = 100005

PMAP_VERS = 2
RPCB_VERS = 3
RPCB_VERS4 = 4

# procedures of version 2 (PMAPPROC_*) and of versions 3 and 4 (RPCBPROC_*)
PROC_NULL, PROC_SET, PROC_UNSET, PROC_GETADDR, PROC_DUMP = range(5)
PMAPPROC_GETPORT = PROC_GETADDR
RPCBPROC_GETTIME = 6
RPCBPROC_GETVERSADDR = 9

IPPROTO_TCP = 6
IPPROTO_UDP = 17
_PROTOCOLS = {IPPROTO_TCP: "tcp", IPPROTO_UDP: "udp"}
"""The netids the portmapper's protocol numbers stand for."""
_NETID_PROTOCOLS = {netid: prot for prot, netid in _PROTOCOLS.items()}

MAX_STRING = 1024
"""The bound of a netid, universal address or owner string."""


def uaddr(host: str, port: int) -> str:
    """The universal address (RFC 5665) of ``host``:``port``: the host, then ".p1.p2"."""
    if not 0 <= port <= 0xFFFF:
        raise ValueError(f"port {port}")
    return f"{ipaddress.ip_address(host)}.{port >> 8}.{port & 0xFF}"


def merged_uaddr(address: str, local: str) -> str:
    """``address`` with a wildcard host (0.0.0.0, ::) replaced by ``local``, the address
    a query came to; as it is when ``local`` is unknown, a wildcard or of the other family."""
    try:
        host, port = parse_uaddr(address)
        ours = ipaddress.ip_address(local)
    except ValueError:
        return address
    if isinstance(ours, ipaddress.IPv6Address) and ours.ipv4_mapped:
        ours = ours.ipv4_mapped
    bound = ipaddress.ip_address(host)
    if not bound.is_unspecified or ours.is_unspecified or bound.version != ours.version:
        return address
    return uaddr(str(ours), port)


def parse_uaddr(address: str) -> tuple[str, int]:
    """The host and port of a universal address; ValueError if it is not one."""
    host, sep, rest = address.rpartition(".")
    host, sep2, high = host.rpartition(".")
    if not (sep and sep2 and high.isdecimal() and rest.isdecimal()):
        raise ValueError(f"not a universal address: {address!r}")
    p1, p2 = int(high), int(rest)
    if p1 > 255 or p2 > 255:
        raise ValueError(f"not a universal address: {address!r}")
    return str(ipaddress.ip_address(host)), p1 << 8 | p2


@dataclass(frozen=True, slots=True)
class Binding:
    """One registration (``rpcb``): a program version served over ``netid`` at ``uaddr``."""

    prog: int
    vers: int
    netid: str
    uaddr: str
    owner: str = "superuser"

    @property
    def port(self) -> int:
        """The port of the universal address (0 if it has none)."""
        try:
            return parse_uaddr(self.uaddr)[1]
        except ValueError:
            return 0


def pack_binding(p: Packer, binding: Binding) -> None:
    """An ``rpcb``."""
    p.uint(binding.prog)
    p.uint(binding.vers)
    p.string(binding.netid)
    p.string(binding.uaddr)
    p.string(binding.owner)


def unpack_binding(u: Unpacker) -> Binding:
    """An ``rpcb``."""
    return Binding(
        prog=u.uint(),
        vers=u.uint(),
        netid=u.string(MAX_STRING),
        uaddr=u.string(MAX_STRING),
        owner=u.string(MAX_STRING),
    )


class Registry:
    """The bindings an :class:`Rpcbind` answers for, in the order they were set."""

    def __init__(self) -> None:
        self._bindings: list[Binding] = []

    def bindings(self) -> list[Binding]:
        """Every binding."""
        return list(self._bindings)

    def set(self, binding: Binding) -> bool:
        """Add ``binding``; False if its program, version and netid are bound already."""
        if any(
            (b.prog, b.vers, b.netid) == (binding.prog, binding.vers, binding.netid)
            for b in self._bindings
        ):
            return False
        self._bindings.append(binding)
        return True

    def add(self, prog: int, vers: int, netid: str, port: int, host: str = "0.0.0.0") -> bool:
        """Add the binding of ``prog``/``vers`` on ``netid`` at ``host``:``port``."""
        return self.set(Binding(prog, vers, netid, uaddr(host, port)))

    def unset(self, prog: int, vers: int, netid: str = "") -> bool:
        """Remove the bindings of ``prog``/``vers`` on ``netid`` (every netid if empty)."""
        kept = [
            b
            for b in self._bindings
            if (b.prog, b.vers) != (prog, vers) or (netid and b.netid != netid)
        ]
        removed = len(kept) != len(self._bindings)
        self._bindings = kept
        return removed

    def lookup(self, prog: int, vers: int, netid: str, *, exact: bool = False) -> Binding | None:
        """The binding of ``prog``/``vers`` on ``netid``; unless ``exact``, another
        version of the program on ``netid`` when that one is not bound (its
        server then answers PROG_MISMATCH with the versions it has)."""
        fallback = None
        for b in self._bindings:
            if b.prog == prog and b.netid == netid:
                if b.vers == vers:
                    return b
                fallback = fallback or b
        return None if exact else fallback


def _loopback(host: str) -> bool:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        address = address.ipv4_mapped
    return address.is_loopback


def _is_local(ctx: CallContext) -> bool:
    return _loopback(ctx.peer[0])


def _owner(ctx: CallContext) -> str:
    if ctx.cred is None:
        return "unknown"
    return "superuser" if ctx.cred.uid == 0 else str(ctx.cred.uid)


class Rpcbind:
    """The rpcbind program (100000, versions 2 to 4) over a :class:`Registry`."""

    number = RPCBIND_PROG
    versions = (PMAP_VERS, RPCB_VERS4)

    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    async def dispatch(self, ctx: CallContext, args: Unpacker, reply: Reply) -> None:
        """Answer one rpcbind or portmapper call."""
        if ctx.proc == PROC_NULL:
            pass  # void arguments: trailing bytes are ignored, as the other programs do
        elif ctx.vers == PMAP_VERS:
            self._portmapper(ctx, args, reply.packer)
        else:
            self._rpcbind(ctx, args, reply.packer)

    def _portmapper(self, ctx: CallContext, args: Unpacker, out: Packer) -> None:
        if ctx.proc == PROC_DUMP:  # void arguments (pyNfsClient sends eight bytes anyway)
            for b in self.registry.bindings():
                prot = _NETID_PROTOCOLS.get(b.netid)
                if prot is not None:
                    out.boolean(True)
                    for value in (b.prog, b.vers, prot, b.port):
                        out.uint(value)
            out.boolean(False)
            return
        if ctx.proc not in (PROC_SET, PROC_UNSET, PMAPPROC_GETPORT):
            raise ProcUnavailable(ctx.proc)
        prog, vers, prot, port = args.uint(), args.uint(), args.uint(), args.uint()
        args.done()
        netid = _PROTOCOLS.get(prot, "")
        if ctx.proc == PMAPPROC_GETPORT:
            found = self.registry.lookup(prog, vers, netid) if netid else None
            out.uint(found.port if found else 0)
        elif ctx.proc == PROC_SET:
            taken = bool(netid) and 0 < port <= 0xFFFF and _is_local(ctx)
            if taken:
                owner = _owner(ctx)
                taken = self.registry.set(Binding(prog, vers, netid, uaddr("0.0.0.0", port), owner))
            out.boolean(taken)
        else:  # a portmapper UNSET removes the version on every protocol
            out.boolean(_is_local(ctx) and self.registry.unset(prog, vers))

    def _rpcbind(self, ctx: CallContext, args: Unpacker, out: Packer) -> None:
        if ctx.proc in (PROC_DUMP, RPCBPROC_GETTIME):  # void arguments
            if ctx.proc == RPCBPROC_GETTIME:
                out.uint(int(time.time()) & 0xFFFF_FFFF)
                return
            for b in self.registry.bindings():
                out.boolean(True)
                pack_binding(out, b)
            out.boolean(False)
            return
        if ctx.proc not in (PROC_SET, PROC_UNSET, PROC_GETADDR, RPCBPROC_GETVERSADDR) or (
            ctx.proc == RPCBPROC_GETVERSADDR and ctx.vers < RPCB_VERS4
        ):
            raise ProcUnavailable(ctx.proc)
        wanted = unpack_binding(args)
        args.done()
        if ctx.proc == PROC_SET:
            binding = Binding(wanted.prog, wanted.vers, wanted.netid, wanted.uaddr, _owner(ctx))
            out.boolean(_is_local(ctx) and _valid(binding) and self.registry.set(binding))
        elif ctx.proc == PROC_UNSET:
            out.boolean(
                _is_local(ctx) and self.registry.unset(wanted.prog, wanted.vers, wanted.netid)
            )
        else:
            netid = wanted.netid or ctx.transport
            exact = ctx.proc == RPCBPROC_GETVERSADDR
            found = self.registry.lookup(wanted.prog, wanted.vers, netid, exact=exact)
            out.string(merged_uaddr(found.uaddr, ctx.local) if found else "")


def _valid(binding: Binding) -> bool:
    return bool(binding.netid) and binding.port != 0


def _owner_cred() -> AuthSys:
    return AuthSys(
        int(time.time()) & 0xFFFF_FFFF, socket.gethostname()[:255], os.getuid(), os.getgid()
    )


async def register_with_rpcbind(
    bindings: Iterable[Binding],
    host: str = "127.0.0.1",
    port: int = RPCBIND_PORT,
    *,
    unset: bool = False,
    local_socket: Path | None = LOCAL_SOCKET,
) -> list[bool]:
    """Publish ``bindings`` with the rpcbind at ``host``:``port`` (or withdraw them: ``unset``).

    Each binding first replaces any stale one of the same program, version
    and netid. A portmapper that speaks only version 2 gets PMAPPROC_SET /
    UNSET (and cannot hold netids other than tcp and udp). Returns, per
    binding, whether rpcbind took it. The system's rpcbind (port 111 on
    this host) is reached through ``local_socket`` when it answers there.
    """
    done: list[bool] = []
    async with _rpcbind_client(host, port, local_socket) as client:
        for b in bindings:
            try:
                request = Reply()
                pack_binding(request.packer, b)
                await client.call(RPCBIND_PROG, RPCB_VERS4, PROC_UNSET, request)
                if not unset:
                    results = await client.call(RPCBIND_PROG, RPCB_VERS4, PROC_SET, request)
                    done.append(results.boolean())
                else:
                    done.append(True)
            except (ProgMismatch, ProgUnavail):
                done.append(await _portmapper_set(client, b, unset))
    return done


@asynccontextmanager
async def _rpcbind_client(
    host: str, port: int, local_socket: Path | None
) -> AsyncIterator[RpcTcpClient]:
    """A client of the rpcbind at ``host``:``port``: over ``local_socket`` when that is the
    system's (port 111 on a loopback address) and it answers there, else over TCP."""
    stream: trio.abc.Stream | None = None
    if local_socket is not None and port == RPCBIND_PORT and _loopback(host):
        try:
            stream = await trio.open_unix_socket(local_socket)
        except OSError as exc:
            log.info("rpcbind's local socket %s: %s; asking over TCP", local_socket, exc)
    if stream is None:
        stream = await trio.open_tcp_stream(host, port)
    async with rpc_client_on(stream, cred=_owner_cred()) as client:
        yield client


async def _portmapper_set(client: RpcTcpClient, b: Binding, unset: bool) -> bool:
    prot = _NETID_PROTOCOLS.get(b.netid)
    if prot is None:
        return False
    request = Reply()
    for value in (b.prog, b.vers, prot, b.port):
        request.packer.uint(value)
    await client.call(RPCBIND_PROG, PMAP_VERS, PROC_UNSET, request)
    if unset:
        return True
    return (await client.call(RPCBIND_PROG, PMAP_VERS, PROC_SET, request)).boolean()


async def getport(
    host: str, prog: int, vers: int, netid: str = "tcp", port: int = RPCBIND_PORT
) -> int | None:
    """The port the portmapper (rpcbind version 2) at ``host``:``port`` names for
    ``prog``/``vers`` over ``netid`` (tcp or udp); None when it names none."""
    request = Reply()
    for value in (prog, vers, _NETID_PROTOCOLS[netid], 0):
        request.packer.uint(value)
    async with connect_tcp(host, port) as client:
        found = (await client.call(RPCBIND_PROG, PMAP_VERS, PMAPPROC_GETPORT, request)).uint()
    return found or None
