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
is an :class:`NfsError` naming it and the object (for NOTDIR, the one that is
no directory), with a hint where one helps (a root caller refused: root
squash), raised as itself from a transfer's pieces too; a server that cannot
be reached is a :class:`ServerUnreachable` naming rpcbind, MOUNT or NFS, the
port and where it came from (:mod:`.client_connect`, :mod:`.client_errors`).
A bad argument (a path that is not a str, a mode outside ``0o7777``, a
negative size, a source without ``read``) raises TypeError or ValueError
naming it before anything goes to the server.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Literal, Protocol

import trio

from rdmashim.ulps.nfsrdma import nfs3_types as t
from rdmashim.ulps.nfsrdma.client_connect import (
    answering_rdma,
    components,
    default_cred,
    list_exports,
    mount,
    nfs_over_tcp,
    nfs_port,
    split_remote,
)
from rdmashim.ulps.nfsrdma.client_connect import call_args as _args
from rdmashim.ulps.nfsrdma.client_errors import (
    MountError,
    NfsError,
    ServerUnreachable,
    status_hint,
    status_name,
)
from rdmashim.ulps.nfsrdma.rdma_client import RpcRdmaClient
from rdmashim.ulps.nfsrdma.rpcbind import RPCBIND_PORT
from rdmashim.ulps.nfsrdma.service import AuthSys, Reply
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
READDIR_MAX = 32768
"""The READDIRPLUS maxcount asked for (over RDMA, the size of the Reply chunk offered)."""
Proto = Literal["rdma", "tcp"]
Progress = Callable[[int, int], object]
"""Called with (bytes done, bytes in all) as a transfer goes."""
Data = bytes | bytearray | memoryview


class Sink(Protocol):
    """Where :meth:`NfsClient.read_file` puts the bytes (a binary file will do).

    ``data`` is a view of the bytes where they arrived (over RDMA, the memory
    the server wrote them into): copy it, or keep it (its memory is then not
    reused for later READs).
    """

    def write(self, data: memoryview, /) -> object: ...


class Source(Protocol):
    """Where :meth:`NfsClient.write_file` takes the bytes from (a binary file will do).

    A source that also has ``readinto`` (a binary file, ``io.BytesIO``) is read with it,
    into buffers the client reuses from one COMMIT to the next, rather than with ``read``,
    which makes a new object of a MiB for every piece."""

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


def _next_piece(
    source: Source,
    asked: int,
    readinto: Callable[[memoryview], object] | None,
    spare: memoryview | None,
) -> Data:
    """The next ``asked`` bytes of ``source`` at most: with the source's ``readinto``,
    read into ``spare`` (a buffer of the caller's); else ``source.read``'s."""
    if readinto is not None and spare is not None:
        got = readinto(spare[:asked])
        if type(got) is not int:  # (None: a non-blocking source had nothing)
            raise TypeError(f"source.readinto gave {type(got).__name__}, not a count")
        if not 0 <= got <= asked:
            raise ValueError(f"source.readinto of {asked} bytes said it read {got}")
        return spare[:got]
    data = source.read(asked)
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"source.read gave {type(data).__name__}, not bytes")
    if len(data) > asked:
        raise ValueError(f"source.read({asked}) gave {len(data)} bytes")
    return data


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
        self.uid: int | None = None
        """The AUTH_SYS uid the calls carry (errors hint at what it may do about them)."""

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
        root = await mount(
            host, export, rpcbind_port=rpcbind_port, mount_port=mount_port, cred=cred
        )
        default = NFS_RDMA_PORT if proto == "rdma" else NFS_TCP_PORT
        origin = "the NFS port given"
        if port is None:
            port, origin = await nfs_port(host, rpcbind_port, proto, default)
        if proto == "tcp":
            async with nfs_over_tcp(host, port, cred, origin) as rpc:

                async def call_tcp(proc: int, args: Reply, **_: int) -> Unpacker:
                    return await rpc.call(t.NFS_PROGRAM, 3, proc, args)

                yield await cls._start(call_tcp, root, cred.uid)
        else:
            async with answering_rdma(host, port, backend, cred, origin) as rdma:

                async def call_rdma(proc: int, args: Reply, **sizes: int) -> Unpacker:
                    return await rdma.call(t.NFS_PROGRAM, 3, proc, args, cred, **sizes)

                client = await cls._start(call_rdma, root, cred.uid)
                client.rdma = rdma
                yield client

    @classmethod
    async def _start(cls, call: Call, root: bytes, uid: int) -> NfsClient:
        client = cls(call, root, 0, 0)
        client.uid = uid
        u = await client._ok(t.FSINFO, "/", lambda r: t.pack_fh(r.packer, root))
        t.unpack_post_op_attr(u)
        rtmax, _rtpref, _rtmult, wtmax = u.uint(), u.uint(), u.uint(), u.uint()
        client.rtmax, client.wtmax = max(rtmax, 4096), max(wtmax, 4096)
        return client

    async def _ok(
        self,
        proc: int,
        path: str,
        *fill: Callable[[Reply], None],
        parent: str | None = None,
        **sizes: int,
    ) -> Unpacker:
        """Call ``proc``; the Unpacker after an NFS3_OK status, else :class:`NfsError`
        about ``path`` (about ``parent``, the directory the call names, for NOTDIR)."""
        u = await self._call(proc, _args(*fill), **sizes)
        status = u.uint()
        if status != t.NFS3_OK:
            about = parent if status == t.NFS3ERR_NOTDIR and parent is not None else path
            hint = status_hint(status, self.uid) if self.uid is not None else ""
            raise NfsError(status, about, hint)
        return u

    # ------------------------------------------------------------- names
    async def lookup(self, path: str) -> bytes:
        """The handle of ``path`` (inside the export), looked up one component at a time."""
        fh, walked = self.root, ""
        for name in components(path):
            above, walked = walked or "/", f"{walked}/{name}"  # errors name where it failed

            def fill(r: Reply, directory: bytes = fh, entry: str = name) -> None:
                t.pack_diropargs(r.packer, directory, entry)

            fh = t.unpack_fh(await self._ok(t.LOOKUP, walked, fill, parent=above))
        return fh

    async def _parent(self, path: str) -> tuple[bytes, str, str]:
        """The handle of ``path``'s directory, the last name, and the directory's path."""
        parts = components(path)
        if not parts:
            raise NfsError(t.NFS3ERR_INVAL, path or "/")
        directory = "/" + "/".join(parts[:-1])
        return await self.lookup(directory), parts[-1], directory

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
        parent, name, directory = await self._parent(path)
        u = await self._ok(
            t.MKDIR, path,
            lambda r: t.pack_diropargs(r.packer, parent, name),
            lambda r: t.pack_sattr3(r.packer, t.Sattr3(mode=mode)),
            parent=directory,
        )  # fmt: skip
        return t.unpack_post_op_fh3(u) or await self.lookup(path)

    async def remove(self, path: str) -> None:
        """Remove the file (not directory) ``path``."""
        await self._unlink(t.REMOVE, path)

    async def rmdir(self, path: str) -> None:
        """Remove the empty directory ``path``."""
        await self._unlink(t.RMDIR, path)

    async def _unlink(self, proc: int, path: str) -> None:
        parent, name, directory = await self._parent(path)
        await self._ok(
            proc, path, lambda r: t.pack_diropargs(r.packer, parent, name), parent=directory
        )

    async def rename(self, path: str, new_path: str) -> None:
        """Rename ``path`` to ``new_path`` (replacing what the server lets it replace)."""
        parent, name, _ = await self._parent(path)
        new_parent, new_name, _ = await self._parent(new_path)
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
        parent, name, directory = await self._parent(path)
        u = await self._ok(
            t.CREATE, path,
            lambda r: t.pack_diropargs(r.packer, parent, name),
            lambda r: r.packer.uint(t.UNCHECKED),
            lambda r: t.pack_sattr3(r.packer, t.Sattr3(mode=mode, size=0)),
            parent=directory,
        )  # fmt: skip
        fh = t.unpack_post_op_fh3(u) or await self.lookup(path)
        done = 0
        if progress:
            progress(0, size)
        uncommitted: list[tuple[int, Data, bytes]] = []  # (offset, data, write verifier)
        window = trio.Semaphore(IN_FLIGHT)
        readinto = getattr(source, "readinto", None)
        readinto = readinto if callable(readinto) else None
        # With readinto: a buffer for each piece of a COMMIT's batch, the next batch's once
        # that COMMIT is done (no call holds a piece of it then).
        spares: list[memoryview] = []

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
                piece = 0
                while offset < batch_end:
                    asked = min(self.wtmax, batch_end - offset)
                    if readinto is not None and piece == len(spares):
                        spares.append(memoryview(bytearray(self.wtmax)))
                    spare = spares[piece] if readinto is not None else None
                    data = _next_piece(source, asked, readinto, spare)
                    piece += 1
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
    "ServerUnreachable",
    "Sink",
    "Source",
    "default_cred",
    "list_exports",
    "split_remote",
    "status_name",
]
