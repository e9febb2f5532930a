"""NFSv3 procedures about attributes: GETATTR, SETATTR, ACCESS, FSSTAT, FSINFO, PATHCONF.

:func:`apply_sattr` is also how CREATE, MKDIR, SYMLINK and MKNOD set the
attributes of what they made. Every change goes through the object's own
descriptor (``/proc/self/fd``), never through a path a client could swap.
"""

from __future__ import annotations

import os
import stat
import time

from rdmashim.ulps.nfsrdma.export import MAY_EXEC, MAY_READ, MAY_WRITE, Caller, Node
from rdmashim.ulps.nfsrdma.nfs3_call import (
    DTPREF,
    MAXFILESIZE,
    RTMAX,
    WTMAX,
    Body,
    Call,
    PostOp,
    procedure,
)
from rdmashim.ulps.nfsrdma.nfs3_types import (
    ACCESS,
    ACCESS3_DELETE,
    ACCESS3_EXECUTE,
    ACCESS3_EXTEND,
    ACCESS3_LOOKUP,
    ACCESS3_MODIFY,
    ACCESS3_READ,
    FSF3_CANSETTIME,
    FSF3_HOMOGENEOUS,
    FSF3_LINK,
    FSF3_SYMLINK,
    FSINFO,
    FSSTAT,
    GETATTR,
    NAME_MAX,
    NFS3ERR_FBIG,
    NFS3ERR_INVAL,
    NFS3ERR_ISDIR,
    NFS3ERR_NOT_SYNC,
    NFS3ERR_PERM,
    PATHCONF,
    SERVER_TIME,
    SETATTR,
    NfsError,
    Sattr3,
    TimeSet,
    unpack_fh,
    unpack_sattr3,
    unpack_time,
)
from rdmashim.ulps.nfsrdma.service import Reply
from rdmashim.ulps.nfsrdma.xdr import Unpacker

_MODIFYING = ACCESS3_MODIFY | ACCESS3_EXTEND | ACCESS3_DELETE


def _time_ns(value: TimeSet, current: int, now: int) -> int:
    if value is None:
        return current
    if value == SERVER_TIME:
        return now
    return value[0] * 1_000_000_000 + value[1]


def _check_sattr(caller: Caller, st: os.stat_result, s: Sattr3) -> None:
    """Whether the caller may make these changes (as the kernel would decide for it)."""
    if s.size is not None:
        if stat.S_ISDIR(st.st_mode):
            raise NfsError(NFS3ERR_ISDIR)
        if not stat.S_ISREG(st.st_mode):
            raise NfsError(NFS3ERR_INVAL)
        if s.size > MAXFILESIZE:
            raise NfsError(NFS3ERR_FBIG)
        caller.require(st, MAY_WRITE, owner_override=True)
    if s.mode is not None:
        caller.require_owner(st)
    if s.uid is not None and s.uid != st.st_uid and not caller.is_root:
        raise NfsError(NFS3ERR_PERM)
    if s.gid is not None and s.gid != st.st_gid and not caller.is_root:
        caller.require_owner(st)
        if s.gid not in caller.groups:
            raise NfsError(NFS3ERR_PERM)
    client_time = any(t not in (None, SERVER_TIME) for t in (s.atime, s.mtime))
    if client_time:
        caller.require_owner(st)
    elif (s.atime is not None or s.mtime is not None) and caller.uid != st.st_uid:
        caller.require(st, MAY_WRITE)


def apply_sattr(call: Call, node: Node, s: Sattr3) -> None:
    """Set the attributes ``s`` asks for, if the caller may; restats ``node``."""
    st = node.st
    _check_sattr(call.caller, st, s)
    proc = f"/proc/self/fd/{node.fd}"
    if s.size is not None:
        os.ftruncate(call.fd(node.reopen(os.O_WRONLY)), s.size)
    if s.uid is not None or s.gid is not None:
        os.chown(proc, -1 if s.uid is None else s.uid, -1 if s.gid is None else s.gid)
    if s.mode is not None and not stat.S_ISLNK(st.st_mode):
        mode = s.mode & 0o7777
        if not call.caller.is_root and st.st_gid not in call.caller.groups:
            mode &= ~stat.S_ISGID
        os.chmod(proc, mode)
    if s.atime is not None or s.mtime is not None:
        now = time.time_ns()
        times = (_time_ns(s.atime, st.st_atime_ns, now), _time_ns(s.mtime, st.st_mtime_ns, now))
        os.utime(proc, ns=times)
    node.restat()


@procedure(GETATTR, "", inline=True)
def getattr_(call: Call, args: Unpacker) -> Body:
    """GETATTR: the attributes of an object."""
    st = call.stat(unpack_fh(args))
    attrs = call.ex.fattr3_bytes(st)

    def body(reply: Reply) -> None:
        reply.packer.data += attrs

    return body


@procedure(SETATTR, "w")
def setattr_(call: Call, args: Unpacker) -> Body:
    """SETATTR: change attributes, if the guard (the object's ctime) still holds."""
    fh, new = unpack_fh(args), unpack_sattr3(args)
    guard = args.optional(lambda: unpack_time(args))
    node = call.node(fh)
    wcc = call.fail[0] = call.wcc(node)
    call.ex.writable()
    if guard is not None and guard != call.fattr(node).ctime:
        raise NfsError(NFS3ERR_NOT_SYNC)
    apply_sattr(call, node, new)
    return lambda reply: wcc.pack(reply.packer, call.export)


def granted(caller: Caller, st: os.stat_result, read_only: bool) -> int:
    """The ACCESS3 bits the mode bits, owner and groups of ``st`` grant ``caller``."""
    r, w, x = (caller.may(st, want) for want in (MAY_READ, MAY_WRITE, MAY_EXEC))
    bits = ACCESS3_READ if r else 0
    if stat.S_ISDIR(st.st_mode):
        bits |= (ACCESS3_LOOKUP if x else 0) | (_MODIFYING if w and x else 0)
    else:
        bits |= (ACCESS3_MODIFY | ACCESS3_EXTEND if w else 0) | (ACCESS3_EXECUTE if x else 0)
    return bits & ~_MODIFYING if read_only else bits


@procedure(ACCESS, "a", inline=True)
def access(call: Call, args: Unpacker) -> Body:
    """ACCESS: which of the asked-for rights the caller has."""
    fh, wanted = unpack_fh(args), args.uint()
    node = call.node(fh)
    post = call.fail[0] = PostOp(node)
    bits = granted(call.caller, node.st, call.ex.read_only) & wanted

    def body(reply: Reply) -> None:
        post.pack(reply.packer, call.export)
        reply.packer.uint(bits)

    return body


@procedure(FSSTAT, "a", inline=True)
def fsstat(call: Call, args: Unpacker) -> Body:
    """FSSTAT: space and inodes of the file system holding the export."""
    node = call.node(unpack_fh(args))
    post = call.fail[0] = PostOp(node)
    vfs = os.fstatvfs(node.fd)
    sizes = (vfs.f_blocks, vfs.f_bfree, vfs.f_bavail)
    counts = [n * vfs.f_frsize for n in sizes] + [vfs.f_files, vfs.f_ffree, vfs.f_favail]

    def body(reply: Reply) -> None:
        post.pack(reply.packer, call.export)
        for n in counts:
            reply.packer.uhyper(n)
        reply.packer.uint(0)  # invarsec: may change at any time

    return body


@procedure(FSINFO, "a", inline=True)
def fsinfo(call: Call, args: Unpacker) -> Body:
    """FSINFO: transfer sizes, the largest file, time resolution, properties."""
    node = call.node(unpack_fh(args))
    post = call.fail[0] = PostOp(node)

    def body(reply: Reply) -> None:
        p = reply.packer
        post.pack(p, call.export)
        for n in (RTMAX, RTMAX, 4096, WTMAX, WTMAX, 4096, DTPREF):
            p.uint(n)
        p.uhyper(MAXFILESIZE)
        p.uint(0)  # time_delta: 1 ns
        p.uint(1)
        p.uint(FSF3_LINK | FSF3_SYMLINK | FSF3_HOMOGENEOUS | FSF3_CANSETTIME)

    return body


@procedure(PATHCONF, "a", inline=True)
def pathconf(call: Call, args: Unpacker) -> Body:
    """PATHCONF: link count and name limits, POSIX behaviours."""
    node = call.node(unpack_fh(args))
    post = call.fail[0] = PostOp(node)
    name_max = min(os.fstatvfs(node.fd).f_namemax, NAME_MAX)

    def body(reply: Reply) -> None:
        p = reply.packer
        post.pack(p, call.export)
        p.uint(65000)  # linkmax
        p.uint(name_max)
        for flag in (True, True, False, True):  # no_trunc, chown_restricted, case_*
            p.boolean(flag)

    return body
