"""An NFSv3 client over RPC-over-RDMA or TCP: paths, listings, and whole-file transfers.

::

    async with NfsClient.connect("server", "/srv/export") as nfs:
        for name, attrs in await nfs.listdir("/"):
            ...
        with open("copy", "wb") as sink:
            await nfs.read_file("/big", sink, progress=lambda done, total: ...)

:meth:`NfsClient.connect` finds the ports through rpcbind (the defaults when
it is not there), mounts the export with MOUNT v3 over TCP for the root
handle and asks FSINFO for the largest READ and WRITE. Over RDMA a NULL
call opens the connection, which is made again when it goes unanswered (a
kernel siw under the server can leave the first Send unread). Paths are inside the
export and looked up one component at a time. Files move in rtmax/wtmax
sized pieces with :data:`IN_FLIGHT` calls outstanding; over RDMA the READ
data lands in a Write chunk and the WRITE data goes as a Read chunk (RFC
8267). Writes are UNSTABLE, then COMMIT; a piece whose write verifier is
not the COMMIT's is written again, stable. Every status other than NFS3_OK
is an :class:`NfsError` naming it, raised as itself from a transfer's pieces
too. A bad argument (a path that is not a str, a mode outside ``0o7777``, a
negative size, a source without ``read``) raises TypeError or ValueError
naming it before anything goes to the server.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Literal, Protocol

import trio

from rdmashim.ulps.nfsrdma import nfs3_types as t
from rdmashim.ulps.nfsrdma.mount import MNT3_OK, MNTPATHLEN, MOUNTPROC_EXPORT, MOUNTPROC_MNT
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
from rdmashim.ulps.nfsrdma.tcp import connect_tcp
from rdmashim.ulps.nfsrdma.xdr import Unpacker
from rdmashim.verbs.errors import integer
from rdmashim.verbs.tasks import unwrapping_nursery

log = logging.getLogger(__name__)

NFS_TCP_PORT = 2049
NFS_RDMA_PORT = 20049
IN_FLIGHT = 4
"""READ or WRITE calls outstanding at once during a transfer."""
COMMIT_EVERY = 32 << 20
"""Bytes written UNSTABLE before a COMMIT (kept until then, to rewrite on a verifier change)."""
RDMA_PROBE_SECONDS = 3.0
"""How long the NULL call that opens an RPC-over-RDMA connection may go unanswered."""
RDMA_RETRY_PAUSE = 0.2
"""Seconds a connection made again waits before its first Send."""
RDMA_ATTEMPTS = 4
"""RPC-over-RDMA connections made before giving up on a server that answers no NULL call."""
READDIR_MAX = 32768
"""The READDIRPLUS maxcount asked for (over RDMA, the size of the Reply chunk offered)."""
Proto = Literal["rdma", "tcp"]
Progress = Callable[[int, int], object]
Data = bytes | bytearray | memoryview
"""Called with (bytes done, bytes in all) as a transfer goes."""

_STATUS_TEXT: dict[int, str] = {
    t.NFS3ERR_PERM: "not owner",
    t.NFS3ERR_NOENT: "no such file or directory",
    t.NFS3ERR_IO: "I/O error",
    t.NFS3ERR_NXIO: "no such device or address",
    t.NFS3ERR_ACCES: "permission denied",
    t.NFS3ERR_EXIST: "file exists",
    t.NFS3ERR_XDEV: "cross-device link",
    t.NFS3ERR_NODEV: "no such device",
    t.NFS3ERR_NOTDIR: "not a directory",
    t.NFS3ERR_ISDIR: "is a directory",
    t.NFS3ERR_INVAL: "invalid argument",
    t.NFS3ERR_FBIG: "file too large",
    t.NFS3ERR_NOSPC: "no space left on device",
    t.NFS3ERR_ROFS: "read-only file system",
    t.NFS3ERR_MLINK: "too many links",
    t.NFS3ERR_NAMETOOLONG: "file name too long",
    t.NFS3ERR_NOTEMPTY: "directory not empty",
    t.NFS3ERR_DQUOT: "disk quota exceeded",
    t.NFS3ERR_STALE: "stale file handle",
    t.NFS3ERR_REMOTE: "too many levels of remote in path",
    t.NFS3ERR_BADHANDLE: "illegal file handle",
    t.NFS3ERR_NOT_SYNC: "update synchronization mismatch",
    t.NFS3ERR_BAD_COOKIE: "stale READDIR cookie",
    t.NFS3ERR_NOTSUPP: "operation not supported",
    t.NFS3ERR_TOOSMALL: "buffer or request too small",
    t.NFS3ERR_SERVERFAULT: "server fault",
    t.NFS3ERR_BADTYPE: "type not supported by the server",
    t.NFS3ERR_JUKEBOX: "try again later",
}


def status_name(status: int) -> str:
    """``NFS3ERR_NOENT`` for 2 (``nfsstat3 N`` for a value RFC 1813 does not name)."""
    try:
        return t.Nfsstat3(status).name
    except ValueError:
        return f"nfsstat3 {status}"


class NfsError(t.NfsError):
    """A call answered with an ``nfsstat3`` other than NFS3_OK: ``NFS3ERR_NOENT: ...: /path``."""

    def __init__(self, status: int, path: str = "") -> None:
        super().__init__(status)
        self.path = path
        text = _STATUS_TEXT.get(status, "error")
        self.args = (f"{status_name(status)}: {text}{': ' + path if path else ''}",)

    def __str__(self) -> str:
        return str(self.args[0])


class MountError(OSError):
    """MOUNT refused the export (its ``mountstat3``) or does not list it."""


class Sink(Protocol):
    """Where :meth:`NfsClient.read_file` puts the bytes (a binary file will do).

    ``data`` is a view of the bytes where they arrived (over RDMA, the memory
    the server wrote them into): copy it, or keep it (its memory is then not
    reused for later READs).
    """

    def write(self, data: memoryview, /) -> object: ...


class Source(Protocol):
    """Where :meth:`NfsClient.write_file` takes the bytes from (a binary file will do)."""

    def read(self, size: int, /) -> bytes | bytearray | memoryview: ...


class _Collect:
    """A :class:`Sink` keeping every byte (for :meth:`NfsClient.read_bytes`)."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data: memoryview, /) -> None:
        self.data += data


class _Pieces:
    """A :class:`Source` over bytes in memory, handed out without copying."""

    def __init__(self, view: memoryview) -> None:
        self.view = view

    def read(self, size: int, /) -> memoryview:
        piece, self.view = self.view[:size], self.view[size:]
        return piece


Call = Callable[..., Awaitable[Unpacker]]


def default_cred() -> AuthSys:
    """AUTH_SYS as this process: its uid, gid and groups, the host's name."""
    groups = tuple(g for g in os.getgroups() if g != os.getgid())[:16]
    stamp = int(time.time()) & 0xFFFF_FFFF
    return AuthSys(stamp, socket.gethostname()[:255], os.getuid(), os.getgid(), groups)


def _components(path: str) -> list[str]:
    if not isinstance(path, str):
        raise TypeError(f"an NFS path is a str, not {type(path).__name__}")
    if "\0" in path:
        raise ValueError(f"NFS path {path!r} holds a NUL")
    return [c for c in path.split("/") if c and c != "."]


def _checked(value: object, what: str, low: int, high: int, show: str = "d") -> int:
    """``value`` as an int in ``low..high`` (shown in format ``show``); TypeError or
    ValueError naming ``what``."""
    number = integer(value)
    if number is None:
        raise TypeError(f"{what} must be an integer, not {type(value).__name__}")
    if not low <= number <= high:
        raise ValueError(f"{what} {number:#{show}} outside {low:#{show}}..{high:#{show}}")
    return number


def _callable_attr(obj: object, name: str, what: str) -> None:
    if not callable(getattr(obj, name, None)):
        raise TypeError(f"{what} must have a {name}() method ({type(obj).__name__} has none)")


def _check_progress(progress: object) -> None:
    if progress is not None and not callable(progress):
        raise TypeError(f"progress must be callable, not {type(progress).__name__}")


MAX_MODE = 0o7777
"""The permission bits a mode may hold (with setuid, setgid and sticky)."""


def _args(*fill: Callable[[Reply], None]) -> Reply:
    reply = Reply()
    for item in fill:
        item(reply)
    return reply


async def rpcbind_port_of(host: str, rpcbind_port: int, prog: int, netid: str) -> int | None:
    """The port rpcbind at ``host`` names for ``prog`` v3 over ``netid`` (None: not there).

    TCP is asked with the portmapper's GETPORT. Any other netid is looked for in
    rpcbind's DUMP: rpcbind's GETADDR answers for the netid of the transport
    the query came on and ignores the one asked for (rpcbind and libtirpc do), so
    over TCP it would name the TCP port for ``rdma``.
    """
    try:
        async with connect_tcp(host, rpcbind_port) as rpcbind:
            if netid == "tcp":

                def query(r: Reply) -> None:
                    for value in (prog, 3, IPPROTO_TCP, 0):
                        r.packer.uint(value)

                found = await rpcbind.call(RPCBIND_PROG, PMAP_VERS, PMAPPROC_GETPORT, _args(query))
                port = found.uint()
                return port or None
            u = await rpcbind.call(RPCBIND_PROG, RPCB_VERS4, PROC_DUMP, Reply())
            while u.boolean():
                binding = unpack_binding(u)
                if (binding.prog, binding.vers, binding.netid) == (prog, 3, netid) and binding.port:
                    return binding.port
            return None
    except OSError as exc:
        log.info("no rpcbind at %s port %d: %s", host, rpcbind_port, exc)
        return None


@asynccontextmanager
async def _answering_rdma(
    host: str, port: int, backend: str | None, cred: AuthSys
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
    :data:`RDMA_ATTEMPTS` connections in all.
    """
    for attempt in range(1, RDMA_ATTEMPTS + 1):
        async with RpcRdmaClient.connect(host, port, backend=backend) as rdma:
            if attempt > 1:
                await trio.sleep(RDMA_RETRY_PAUSE)  # past siw's window after its MPA Reply
            with trio.move_on_after(RDMA_PROBE_SECONDS) as probe:
                await rdma.call(t.NFS_PROGRAM, 3, t.NULL, Reply(), cred)
            if not probe.cancelled_caught:
                yield rdma
                return
        log.warning(
            "no answer to NULL over RDMA from %s port %d in %.0f s (connection %d of %d)",
            host, port, RDMA_PROBE_SECONDS, attempt, RDMA_ATTEMPTS,
        )  # fmt: skip
    raise TimeoutError(
        f"{host} port {port}: no answer to NFS NULL over RDMA on {RDMA_ATTEMPTS} connections"
    )


async def _mount_port(host: str, rpcbind_port: int, mount_port: int | None) -> int:
    if mount_port is not None:
        return mount_port
    found = await rpcbind_port_of(host, rpcbind_port, t.MOUNT_PROGRAM, "tcp")
    if found is None:
        raise MountError(
            f"no MOUNT v3 port: rpcbind at {host} port {rpcbind_port} is not there or names none"
        )
    return found


async def list_exports(
    host: str, *, rpcbind_port: int = RPCBIND_PORT, mount_port: int | None = None
) -> list[str]:
    """The export names MOUNT's EXPORT procedure lists at ``host``."""
    port = await _mount_port(host, rpcbind_port, mount_port)
    async with connect_tcp(host, port, cred=default_cred()) as mount:
        u = await mount.call(t.MOUNT_PROGRAM, 3, MOUNTPROC_EXPORT, Reply())
        names = []
        while u.boolean():
            names.append(u.string(MNTPATHLEN))
            while u.boolean():
                u.string(MNTPATHLEN)  # a client group
        return names


def split_remote(exports: list[str], path: str) -> tuple[str, str]:
    """(export, path inside it): the longest export name that is a prefix of ``path``."""
    wanted = _components(path)
    best: str | None = None
    for name in exports:
        parts = _components(name)
        if wanted[: len(parts)] == parts and (best is None or len(parts) > len(_components(best))):
            best = name
    if best is None:
        raise MountError(
            f"{path}: in no export (the server exports {', '.join(exports) or 'none'})"
        )
    return best, "/" + "/".join(wanted[len(_components(best)) :])


class NfsClient:
    """NFSv3 calls on one mounted export (make one with :meth:`connect`)."""

    def __init__(self, call: Call, root: bytes, rtmax: int, wtmax: int) -> None:
        self._call = call
        self.root = root
        """The export's root handle (from MOUNT)."""
        self.rtmax = rtmax
        self.wtmax = wtmax
        self.rdma: RpcRdmaClient | None = None
        """The RPC-over-RDMA connection (its sizes, credits, counters); None over TCP."""

    @classmethod
    @asynccontextmanager
    async def connect(
        cls,
        host: str,
        export: str,
        *,
        proto: Proto = "rdma",
        port: int | None = None,
        rpcbind_port: int = RPCBIND_PORT,
        mount_port: int | None = None,
        cred: AuthSys | None = None,
        backend: str | None = None,
    ) -> AsyncIterator[NfsClient]:
        """Mount ``export`` at ``host`` and yield a client over ``proto`` (closed on leaving)."""
        if not isinstance(export, str):
            raise TypeError(f"the export is a str, not {type(export).__name__}")
        if proto not in ("rdma", "tcp"):
            raise ValueError(f"proto {proto!r} is neither 'rdma' nor 'tcp'")
        for what, value in (("port", port), ("rpcbind_port", rpcbind_port),
                            ("mount_port", mount_port)):  # fmt: skip
            if value is not None:
                _checked(value, what, 1, 65535)
        cred = cred or default_cred()
        mport = await _mount_port(host, rpcbind_port, mount_port)
        async with connect_tcp(host, mport, cred=cred) as mount:
            u = await mount.call(
                t.MOUNT_PROGRAM, 3, MOUNTPROC_MNT, _args(lambda r: r.packer.string(export))
            )
            status = u.uint()
            if status != MNT3_OK:
                raise MountError(f"MOUNT {export}: {NfsError(status)}")
            root = t.unpack_fh(u)
        if port is None:
            port = await rpcbind_port_of(host, rpcbind_port, t.NFS_PROGRAM, proto)
            port = port or (NFS_RDMA_PORT if proto == "rdma" else NFS_TCP_PORT)
        if proto == "tcp":
            async with connect_tcp(host, port, cred=cred) as rpc:

                async def call_tcp(proc: int, args: Reply, **_: int) -> Unpacker:
                    return await rpc.call(t.NFS_PROGRAM, 3, proc, args)

                yield await cls._start(call_tcp, root)
        else:
            async with _answering_rdma(host, port, backend, cred) as rdma:

                async def call_rdma(proc: int, args: Reply, **sizes: int) -> Unpacker:
                    return await rdma.call(t.NFS_PROGRAM, 3, proc, args, cred, **sizes)

                client = await cls._start(call_rdma, root)
                client.rdma = rdma
                yield client

    @classmethod
    async def _start(cls, call: Call, root: bytes) -> NfsClient:
        client = cls(call, root, 0, 0)
        u = await client._ok(t.FSINFO, "/", lambda r: t.pack_fh(r.packer, root))
        t.unpack_post_op_attr(u)
        rtmax, _rtpref, _rtmult, wtmax = u.uint(), u.uint(), u.uint(), u.uint()
        client.rtmax, client.wtmax = max(rtmax, 4096), max(wtmax, 4096)
        return client

    async def _ok(
        self, proc: int, path: str, *fill: Callable[[Reply], None], **sizes: int
    ) -> Unpacker:
        """Call ``proc``; the Unpacker after an NFS3_OK status, else :class:`NfsError`."""
        u = await self._call(proc, _args(*fill), **sizes)
        status = u.uint()
        if status != t.NFS3_OK:
            raise NfsError(status, path)
        return u

    # ------------------------------------------------------------- names
    async def lookup(self, path: str) -> bytes:
        """The handle of ``path`` (inside the export), looked up one component at a time."""
        fh, walked = self.root, ""
        for name in _components(path):
            walked += "/" + name  # an error names the component that failed

            def fill(r: Reply, directory: bytes = fh, entry: str = name) -> None:
                t.pack_diropargs(r.packer, directory, entry)

            fh = t.unpack_fh(await self._ok(t.LOOKUP, walked, fill))
        return fh

    async def _parent(self, path: str) -> tuple[bytes, str]:
        parts = _components(path)
        if not parts:
            raise NfsError(t.NFS3ERR_INVAL, path or "/")
        return await self.lookup("/".join(parts[:-1])), parts[-1]

    async def getattr(self, path: str) -> t.Fattr3:
        """The attributes of ``path``."""
        fh = await self.lookup(path)
        return await self._getattr(fh, path)

    async def _getattr(self, fh: bytes, path: str) -> t.Fattr3:
        return t.unpack_fattr3(await self._ok(t.GETATTR, path, lambda r: t.pack_fh(r.packer, fh)))

    async def listdir(self, path: str) -> list[tuple[str, t.Fattr3]]:
        """The entries of directory ``path`` (not ``.`` and ``..``) with their attributes."""
        fh = await self.lookup(path)
        entries: list[tuple[str, t.Fattr3]] = []
        cookie, verifier = 0, bytes(8)
        while True:

            def fill(r: Reply, c: int = cookie, v: bytes = verifier) -> None:
                t.pack_fh(r.packer, fh)
                r.packer.uhyper(c)
                r.packer.fopaque(v, 8)
                r.packer.uint(READDIR_MAX)  # dircount
                r.packer.uint(READDIR_MAX)  # maxcount

            u = await self._ok(t.READDIRPLUS, path, fill, reply_size_hint=READDIR_MAX + 512)
            t.unpack_post_op_attr(u)
            verifier = u.fopaque(8)
            while u.boolean():
                u.uhyper()  # fileid
                name = t.unpack_name(u)
                cookie = u.uhyper()
                attrs = t.unpack_post_op_attr(u)
                handle = t.unpack_post_op_fh3(u)
                if name in (".", ".."):
                    continue
                if attrs is None:
                    child = handle or await self.lookup(f"{path}/{name}")
                    attrs = await self._getattr(child, f"{path}/{name}")
                entries.append((name, attrs))
            if u.boolean():  # eof
                return entries

    async def mkdir(self, path: str, mode: int = 0o755) -> bytes:
        """Make directory ``path``; its handle."""
        mode = _checked(mode, "mode", 0, MAX_MODE, "o")
        parent, name = await self._parent(path)
        u = await self._ok(
            t.MKDIR, path,
            lambda r: t.pack_diropargs(r.packer, parent, name),
            lambda r: t.pack_sattr3(r.packer, t.Sattr3(mode=mode)),
        )  # fmt: skip
        return t.unpack_post_op_fh3(u) or await self.lookup(path)

    async def remove(self, path: str) -> None:
        """Remove the file (not directory) ``path``."""
        await self._unlink(t.REMOVE, path)

    async def rmdir(self, path: str) -> None:
        """Remove the empty directory ``path``."""
        await self._unlink(t.RMDIR, path)

    async def _unlink(self, proc: int, path: str) -> None:
        parent, name = await self._parent(path)
        await self._ok(proc, path, lambda r: t.pack_diropargs(r.packer, parent, name))

    async def rename(self, path: str, new_path: str) -> None:
        """Rename ``path`` to ``new_path`` (replacing what the server lets it replace)."""
        parent, name = await self._parent(path)
        new_parent, new_name = await self._parent(new_path)
        await self._ok(
            t.RENAME, path,
            lambda r: t.pack_diropargs(r.packer, parent, name),
            lambda r: t.pack_diropargs(r.packer, new_parent, new_name),
        )  # fmt: skip

    # ------------------------------------------------------------- files
    async def read_file(self, path: str, sink: Sink, progress: Progress | None = None) -> int:
        """Copy file ``path`` into ``sink`` in order; the bytes copied."""
        _callable_attr(sink, "write", "the sink")
        _check_progress(progress)
        fh = await self.lookup(path)
        total = (await self._getattr(fh, path)).size
        done = next_piece = 0
        pending: dict[int, list[memoryview]] = {}
        window = trio.Semaphore(IN_FLIGHT)
        if progress:
            progress(0, total)

        async def fetch(offset: int, count: int) -> None:
            nonlocal done, next_piece
            pending[offset] = await self._read_range(fh, path, offset, count)
            while next_piece in pending:  # in order: each piece written frees its place
                for data in pending.pop(next_piece):  # short if the file shrank meanwhile
                    sink.write(data)
                    done += len(data)
                next_piece += self.rtmax
                window.release()
                if progress:
                    progress(done, total)

        async with unwrapping_nursery() as nursery:
            for offset in range(0, total, self.rtmax):
                await window.acquire()
                nursery.start_soon(fetch, offset, min(self.rtmax, total - offset))
        return done

    async def _read_range(self, fh: bytes, path: str, offset: int, count: int) -> list[memoryview]:
        """``count`` bytes at ``offset`` (fewer only at the end of the file), as they arrived."""
        parts: list[memoryview] = []
        while count > 0:

            def fill(r: Reply, at: int = offset, n: int = count) -> None:
                t.pack_fh(r.packer, fh)
                r.packer.uhyper(at)
                r.packer.uint(n)

            u = await self._ok(t.READ, path, fill, ddp_reply_size=count)
            t.unpack_post_op_attr(u)
            u.uint()  # count
            eof = u.boolean()
            data = u.opaque_view(count)
            parts.append(data)
            offset, count = offset + len(data), count - len(data)
            if eof or not data:
                break
        return parts

    async def write_file(
        self,
        path: str,
        source: Source,
        size: int,
        progress: Progress | None = None,
        mode: int = 0o644,
    ) -> int:
        """Create (or truncate) file ``path`` and write ``size`` bytes of ``source``; the bytes."""
        size = _checked(size, "size", 0, 2**64 - 1)
        mode = _checked(mode, "mode", 0, MAX_MODE, "o")
        _callable_attr(source, "read", "the source")
        _check_progress(progress)
        parent, name = await self._parent(path)
        u = await self._ok(
            t.CREATE, path,
            lambda r: t.pack_diropargs(r.packer, parent, name),
            lambda r: r.packer.uint(t.UNCHECKED),
            lambda r: t.pack_sattr3(r.packer, t.Sattr3(mode=mode, size=0)),
        )  # fmt: skip
        fh = t.unpack_post_op_fh3(u) or await self.lookup(path)
        done = 0
        if progress:
            progress(0, size)
        uncommitted: list[tuple[int, Data, bytes]] = []  # (offset, data, write verifier)
        window = trio.Semaphore(IN_FLIGHT)

        async def put(offset: int, data: Data) -> None:
            nonlocal done
            try:
                verifier = await self._write_range(fh, path, offset, data, t.UNSTABLE)
            finally:
                window.release()
            uncommitted.append((offset, data, verifier))
            done += len(data)
            if progress:
                progress(done, size)

        offset = 0
        while offset < size:
            async with unwrapping_nursery() as nursery:
                batch_end = min(size, offset + COMMIT_EVERY)
                while offset < batch_end:
                    asked = min(self.wtmax, batch_end - offset)
                    data = source.read(asked)
                    if not isinstance(data, (bytes, bytearray, memoryview)):
                        raise TypeError(f"source.read gave {type(data).__name__}, not bytes")
                    if len(data) > asked:
                        raise ValueError(f"source.read({asked}) gave {len(data)} bytes")
                    if not data:
                        raise EOFError(f"the source ended at {offset} of {size} bytes")
                    await window.acquire()
                    nursery.start_soon(put, offset, data)
                    offset += len(data)
            await self._commit(fh, path, uncommitted)
            uncommitted.clear()
        return done

    async def read_bytes(self, path: str, progress: Progress | None = None) -> bytes:
        """The whole of file ``path`` (:meth:`read_file` into memory)."""
        sink = _Collect()
        await self.read_file(path, sink, progress)
        return bytes(sink.data)

    async def write_bytes(
        self,
        path: str,
        data: Data,
        progress: Progress | None = None,
        mode: int = 0o644,
    ) -> int:
        """Create (or truncate) file ``path`` holding ``data`` (:meth:`write_file`); the bytes."""
        try:
            view = memoryview(data).cast("B")
        except TypeError:
            raise TypeError(f"data must be bytes-like, not {type(data).__name__}") from None
        return await self.write_file(path, _Pieces(view), len(view), progress, mode)

    async def _write_range(
        self, fh: bytes, path: str, offset: int, data: Data, stable: int
    ) -> bytes:
        """Write all of ``data`` at ``offset``; the write verifier of the last reply."""
        view = memoryview(data)
        verifier = b""
        while view:

            def fill(r: Reply, at: int = offset, chunk: memoryview = view) -> None:
                t.pack_fh(r.packer, fh)
                r.packer.uhyper(at)
                r.packer.uint(len(chunk))
                r.packer.uint(stable)
                r.opaque_ddp(chunk)  # a Read chunk over RDMA

            u = await self._ok(t.WRITE, path, fill)
            t.unpack_wcc_data(u)
            count = u.uint()
            u.uint()  # committed
            verifier = u.fopaque(8)
            if count == 0:
                raise NfsError(t.NFS3ERR_IO, path)
            view, offset = view[count:], offset + count
        return verifier

    async def _commit(self, fh: bytes, path: str, written: list[tuple[int, Data, bytes]]) -> None:
        """COMMIT; write again (stable) what the server may have lost (its verifier changed)."""

        def fill(r: Reply) -> None:
            t.pack_fh(r.packer, fh)
            r.packer.uhyper(0)
            r.packer.uint(0)  # to the end of the file

        u = await self._ok(t.COMMIT, path, fill)
        t.unpack_wcc_data(u)
        verifier = u.fopaque(8)
        for offset, data, seen in written:
            if seen != verifier:
                log.info("write verifier changed: writing %d bytes at %d again", len(data), offset)
                await self._write_range(fh, path, offset, data, t.FILE_SYNC)


__all__ = [
    "IN_FLIGHT",
    "MountError",
    "NfsClient",
    "NfsError",
    "Sink",
    "Source",
    "default_cred",
    "list_exports",
    "split_remote",
    "status_name",
]
