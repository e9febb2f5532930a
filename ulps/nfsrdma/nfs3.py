"""The NFSv3 program (RFC 1813, program 100003 version 3) over local directories.

:class:`Nfs3Program` serves one or more :class:`~.export.Export`\\ s. Each
call runs in a :class:`~.nfs3_call.Call` that holds the objects it opened and
its failure arm. The procedures that only look (GETATTR, ACCESS, LOOKUP,
READLINK, FSSTAT, FSINFO, PATHCONF) run on the event loop: a hop to a worker
thread and back costs several times what they do. One whose handle's object
is not where the handle cache says (a search of the export could take long)
starts again in a worker thread, as every other procedure runs (file system
calls that move data block, an fsync for long). This module has the data
procedures (LOOKUP, READLINK, READ, WRITE, COMMIT); the others are in
:mod:`.nfs3_attrs`, :mod:`.nfs3_dirs` and :mod:`.nfs3_readdir`, registered in
:data:`~.nfs3_call.PROCEDURES`.

WRITE's verifier is random per program instance: a restarted server's
verifier differs, so clients resend UNSTABLE data it never committed.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Sequence

import trio

from rdmashim.ulps.nfsrdma import nfs3_attrs, nfs3_dirs, nfs3_readdir  # noqa: F401 (procedures)
from rdmashim.ulps.nfsrdma.export import MAY_EXEC, MAY_READ, MAY_WRITE, Export, Node
from rdmashim.ulps.nfsrdma.handles import SearchNeeded
from rdmashim.ulps.nfsrdma.nfs3_call import (
    MAXFILESIZE,
    PROCEDURES,
    RTMAX,
    WTMAX,
    Body,
    Call,
    Entry,
    PostOp,
    ServerState,
    procedure,
)
from rdmashim.ulps.nfsrdma.nfs3_types import (
    COMMIT,
    DATA_SYNC,
    FILE_SYNC,
    LOOKUP,
    NFS3_OK,
    NFS3ERR_ACCES,
    NFS3ERR_FBIG,
    NFS3ERR_INVAL,
    NFS3ERR_ISDIR,
    NFS3ERR_NOTDIR,
    NFS_PROGRAM,
    NFS_V3,
    NULL,
    READ,
    READLINK,
    WRITE,
    NfsError,
    pack_fh,
    status_of_errno,
    unpack_diropargs,
    unpack_enum,
    unpack_fh,
)
from rdmashim.ulps.nfsrdma.service import CallContext, ProcUnavailable, Reply
from rdmashim.ulps.nfsrdma.xdr import Unpacker

log = logging.getLogger(__name__)

_OK = NFS3_OK.to_bytes(4, "big")
"""The status of a call that succeeded, encoded."""


class Nfs3Program:
    """NFS version 3 over ``exports``; ``threads`` bounds the calls running in worker threads
    at once; ``inline`` False runs every procedure in a worker thread (for an export on a
    file system whose metadata calls may hang, such as a network mount)."""

    number = NFS_PROGRAM
    versions = (NFS_V3, NFS_V3)

    def __init__(
        self, exports: Export | Sequence[Export], *, threads: int = 8, inline: bool = True
    ) -> None:
        self.state = ServerState([exports] if isinstance(exports, Export) else list(exports))
        self._limiter = trio.CapacityLimiter(threads)
        self.inline = inline

    @property
    def exports(self) -> Sequence[Export]:
        """What is served."""
        return self.state.exports

    def dispatch_now(self, ctx: CallContext, args: Unpacker, reply: Reply) -> bool:
        """NULL, and a procedure that only looks, carried out here (see
        :class:`~.service.InlineProgram`); False for the others, and for one whose
        handle needs a search of the export."""
        if ctx.proc == NULL:
            return True
        entry = PROCEDURES.get(ctx.proc)
        if entry is None:
            raise ProcUnavailable(ctx.proc)
        if not (entry.inline and self.inline):
            return False
        start = args.pos
        try:
            self.run(entry, ctx, args, reply, search=False)
        except SearchNeeded:  # nothing was encoded yet: the call starts again in a thread
            args.pos = start
            return False
        return True

    async def dispatch(self, ctx: CallContext, args: Unpacker, reply: Reply) -> None:
        """Run procedure ``ctx.proc`` here or in a worker thread (see the module doc and
        :class:`~.service.Program`)."""
        if not self.dispatch_now(ctx, args, reply):
            entry = PROCEDURES[ctx.proc]
            await trio.to_thread.run_sync(self.run, entry, ctx, args, reply, limiter=self._limiter)

    def run(
        self, entry: Entry, ctx: CallContext, args: Unpacker, reply: Reply, *, search: bool = True
    ) -> None:
        """One call, synchronously: the status, then the result or the failure arm
        (``search`` False: :class:`~.handles.SearchNeeded` where a handle needs a search)."""
        call = Call(self.state, ctx, entry.fresh_fail() if entry.fail else [], search=search)
        try:
            try:
                body = entry.run(call, args)
            except NfsError as exc:
                status = exc.status
                log.debug("proc %d: %s", ctx.proc, exc)
            except OSError as exc:
                status = status_of_errno(exc.errno)
                log.debug("proc %d: %s", ctx.proc, exc)
            else:
                reply.packer.data += _OK
                body(reply)
                return
            reply.packer.uint(status)
            call.pack_fail(reply.packer)
        finally:
            call.close()


@procedure(LOOKUP, "a", inline=True)
def lookup(call: Call, args: Unpacker) -> Body:
    """LOOKUP: a name in a directory (``..`` at the export's root is the root)."""
    fh, name = unpack_diropargs(args)
    parent = call.node(fh)
    dir_post = call.fail[0] = PostOp(parent)
    if not parent.is_dir:
        raise NfsError(NFS3ERR_NOTDIR)
    call.caller.require(parent.st, MAY_EXEC)
    child = call.child(parent, name)
    handle = call.ex.handle(child)

    def body(reply: Reply) -> None:
        pack_fh(reply.packer, handle)
        PostOp(child).pack(reply.packer, call.export)
        dir_post.pack(reply.packer, call.export)

    return body


@procedure(READLINK, "a", inline=True)
def readlink(call: Call, args: Unpacker) -> Body:
    """READLINK: a symbolic link's target (DDP-eligible), never followed."""
    node = call.node(unpack_fh(args))
    post = call.fail[0] = PostOp(node)
    if not stat.S_ISLNK(node.st.st_mode):
        raise NfsError(NFS3ERR_INVAL)
    target = os.readlink(b"", dir_fd=node.fd)

    def body(reply: Reply) -> None:
        post.pack(reply.packer, call.export)
        reply.opaque_ddp(target)

    return body


def _regular(node: Node) -> None:
    if node.is_dir:
        raise NfsError(NFS3ERR_ISDIR)
    if not stat.S_ISREG(node.st.st_mode):
        raise NfsError(NFS3ERR_INVAL)


@procedure(READ, "a")
def read(call: Call, args: Unpacker) -> Body:
    """READ: up to ``count`` (at most rtmax) bytes at ``offset``, DDP-eligible, and eof."""
    fh, offset, count = unpack_fh(args), args.uhyper(), args.uint()
    node = call.node(fh)
    post = call.fail[0] = PostOp(node)
    _regular(node)
    caller = call.caller
    if not caller.may(node.st, MAY_READ, owner_override=True) and not caller.may(node.st, MAY_EXEC):
        raise NfsError(NFS3ERR_ACCES)
    fd = call.fd(node.reopen(os.O_RDONLY))
    buffer = memoryview(call.state.read_buffers.take(RTMAX, zero=False))
    data = buffer[: min(count, RTMAX) if offset <= MAXFILESIZE else 0]
    if data:  # (the buffer's bytes past what is read, an earlier READ's, are not sent)
        data = data[: os.preadv(fd, [data], offset)]
    eof = offset + len(data) >= os.fstat(fd).st_size

    def body(reply: Reply) -> None:
        post.pack(reply.packer, call.export)
        reply.packer.uint(len(data))
        reply.packer.boolean(eof)
        reply.opaque_ddp(data)

    return body


def _sync(fd: int, stable: int) -> None:
    if stable == DATA_SYNC:
        os.fdatasync(fd)
    elif stable == FILE_SYNC:
        os.fsync(fd)


@procedure(WRITE, "w")
def write(call: Call, args: Unpacker) -> Body:
    """WRITE: ``count`` bytes at ``offset``; DATA_SYNC and FILE_SYNC reach the disk first."""
    fh, offset, count = unpack_fh(args), args.uhyper(), args.uint()
    stable = unpack_enum(args, 3, "stable_how")
    data = args.opaque_view(WTMAX)
    node = call.node(fh)
    wcc = call.fail[0] = call.wcc(node)
    call.ex.writable()
    _regular(node)
    if count > len(data):
        raise NfsError(NFS3ERR_INVAL, f"count {count} of {len(data)} bytes")
    if offset + count > MAXFILESIZE:
        raise NfsError(NFS3ERR_FBIG)
    call.caller.require(node.st, MAY_WRITE, owner_override=True)
    fd = call.fd(node.reopen(os.O_WRONLY))
    done = 0
    while done < count:
        done += os.pwrite(fd, data[done:count], offset + done)
    _sync(fd, stable)
    verifier = call.state.write_verifier

    def body(reply: Reply) -> None:
        wcc.pack(reply.packer, call.export)
        reply.packer.uint(count)
        reply.packer.uint(stable)
        reply.packer.fopaque(verifier, 8)

    return body


@procedure(COMMIT, "w")
def commit(call: Call, args: Unpacker) -> Body:
    """COMMIT: everything written to the file reaches the disk (the whole file is synced)."""
    fh, _offset, _count = unpack_fh(args), args.uhyper(), args.uint()
    node = call.node(fh)
    wcc = call.fail[0] = call.wcc(node)
    _regular(node)
    _sync(call.fd(node.reopen(os.O_RDONLY)), FILE_SYNC)
    verifier = call.state.write_verifier

    def body(reply: Reply) -> None:
        wcc.pack(reply.packer, call.export)
        reply.packer.fopaque(verifier, 8)

    return body
