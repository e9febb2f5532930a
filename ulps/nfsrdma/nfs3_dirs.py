"""NFSv3 procedures that change a directory: CREATE, MKDIR, SYMLINK, MKNOD, REMOVE, RMDIR,
RENAME, LINK.

Each works on names relative to the directory's descriptor, never follows
a link (``O_NOFOLLOW``; a link at the name is the link), checks the caller's
write and search permission on the directory (and the sticky bit), and
gives a new object to the caller (the directory's group if it is setgid).

An EXCLUSIVE CREATE keeps its verifier in the new file's mtime and atime
seconds (as knfsd does) until the client sets them: a retransmitted create
finds the file with its verifier and succeeds. MKNOD makes FIFOs and
sockets; device nodes are NFS3ERR_NOTSUPP (a client must not create
devices on the server), other types NFS3ERR_BADTYPE.
"""

from __future__ import annotations

import os
import stat

from rdmashim.ulps.nfsrdma.export import MAY_EXEC, MAY_READ, MAY_WRITE, Node, check_name
from rdmashim.ulps.nfsrdma.nfs3_attrs import apply_sattr
from rdmashim.ulps.nfsrdma.nfs3_call import Body, Call, PostOp, procedure
from rdmashim.ulps.nfsrdma.nfs3_types import (
    CREATE,
    EXCLUSIVE,
    GUARDED,
    LINK,
    MKDIR,
    MKNOD,
    NF3BLK,
    NF3CHR,
    NF3FIFO,
    NF3SOCK,
    NFS3ERR_ACCES,
    NFS3ERR_BADTYPE,
    NFS3ERR_EXIST,
    NFS3ERR_INVAL,
    NFS3ERR_NAMETOOLONG,
    NFS3ERR_NOENT,
    NFS3ERR_NOTDIR,
    NFS3ERR_NOTEMPTY,
    NFS3ERR_NOTSUPP,
    PATH_MAX,
    REMOVE,
    RENAME,
    RMDIR,
    SYMLINK,
    NfsError,
    Sattr3,
    pack_post_op_fh3,
    unpack_diropargs,
    unpack_enum,
    unpack_fh,
    unpack_path,
    unpack_sattr3,
)
from rdmashim.ulps.nfsrdma.service import Reply
from rdmashim.ulps.nfsrdma.xdr import Unpacker

_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _directory(call: Call, fh: bytes, name: str, slot: int = 0, dots: int = NFS3ERR_EXIST) -> Node:
    """The directory a name is changed in: writable export, a directory, a good name, w+x."""
    parent = call.node(fh)
    call.fail[slot] = call.wcc(parent)
    call.ex.writable()
    if not parent.is_dir:
        raise NfsError(NFS3ERR_NOTDIR)
    check_name(name, dots)
    call.caller.require(parent.st, MAY_WRITE | MAY_EXEC)
    return parent


def _made(call: Call, parent: Node, name: str, attrs: Sattr3 | None) -> Body:
    """The result of making ``name``: given to the caller, ``attrs`` applied."""
    node = call.child(parent, name)
    if attrs is not None:
        caller = call.caller
        gid = parent.st.st_gid if parent.st.st_mode & stat.S_ISGID else caller.gid
        if os.geteuid() == 0:
            os.chown(f"/proc/self/fd/{node.fd}", caller.uid, gid)
            node.restat()
        apply_sattr(call, node, attrs)
    handle = call.ex.handle(node)
    dir_wcc = call.fail[0]

    def body(reply: Reply) -> None:
        pack_post_op_fh3(reply.packer, handle)
        PostOp(node).pack(reply.packer, call.export)
        dir_wcc.pack(reply.packer, call.export)

    return body


def _verifier_times(verifier: bytes) -> tuple[int, int]:
    """The (atime, mtime) in ns that hold an EXCLUSIVE create's verifier."""
    return (int.from_bytes(verifier[4:]) * 10**9, int.from_bytes(verifier[:4]) * 10**9)


@procedure(CREATE, "w")
def create(call: Call, args: Unpacker) -> Body:
    """CREATE: a regular file, UNCHECKED, GUARDED or EXCLUSIVE."""
    fh, name = unpack_diropargs(args)
    how = unpack_enum(args, 3, "createmode3")
    verifier = args.fopaque(8) if how == EXCLUSIVE else b""
    attrs = unpack_sattr3(args) if how != EXCLUSIVE else Sattr3()
    parent = _directory(call, fh, name)
    try:
        fd = os.open(name, _NEW_FILE, 0o600, dir_fd=parent.fd)
    except FileExistsError:
        if how == GUARDED:
            raise NfsError(NFS3ERR_EXIST) from None
        node = call.child(parent, name)
        if not stat.S_ISREG(node.st.st_mode):
            raise NfsError(NFS3ERR_EXIST) from None
        if how == EXCLUSIVE:
            times = (node.st.st_atime_ns, node.st.st_mtime_ns)
            if times != _verifier_times(verifier):
                raise NfsError(NFS3ERR_EXIST) from None
            return _made(call, parent, name, None)
        resize = Sattr3(size=attrs.size) if attrs.size is not None else None
        return _made(call, parent, name, resize)
    os.close(fd)
    if how == EXCLUSIVE:
        os.utime(name, ns=_verifier_times(verifier), dir_fd=parent.fd, follow_symlinks=False)
        return _made(call, parent, name, Sattr3())
    return _made(call, parent, name, attrs if attrs.mode is not None else _with_mode(attrs, 0o644))


def _with_mode(attrs: Sattr3, mode: int) -> Sattr3:
    return Sattr3(mode, attrs.uid, attrs.gid, attrs.size, attrs.atime, attrs.mtime)


@procedure(MKDIR, "w")
def mkdir(call: Call, args: Unpacker) -> Body:
    """MKDIR: a directory."""
    fh, name = unpack_diropargs(args)
    attrs = unpack_sattr3(args)
    parent = _directory(call, fh, name)
    os.mkdir(name, 0o700, dir_fd=parent.fd)
    return _made(call, parent, name, attrs if attrs.mode is not None else _with_mode(attrs, 0o755))


@procedure(SYMLINK, "w")
def symlink(call: Call, args: Unpacker) -> Body:
    """SYMLINK: a symbolic link, its target stored as given (the server never follows it)."""
    fh, name = unpack_diropargs(args)
    attrs, target = unpack_sattr3(args), unpack_path(args)
    parent = _directory(call, fh, name)
    if len(target.encode("utf-8", "surrogateescape")) > PATH_MAX:
        raise NfsError(NFS3ERR_NAMETOOLONG)
    if "\0" in target:
        raise NfsError(NFS3ERR_INVAL, "NUL in a symlink target")
    os.symlink(target, name, dir_fd=parent.fd)
    return _made(call, parent, name, Sattr3(uid=attrs.uid, gid=attrs.gid))


@procedure(MKNOD, "w")
def mknod(call: Call, args: Unpacker) -> Body:
    """MKNOD: a FIFO or a socket (devices: NOTSUPP; other types: BADTYPE)."""
    fh, name = unpack_diropargs(args)
    ftype = unpack_enum(args, 8, "ftype3")
    if ftype == 0:
        raise NfsError(NFS3ERR_BADTYPE)
    attrs = unpack_sattr3(args) if ftype in (NF3CHR, NF3BLK, NF3SOCK, NF3FIFO) else Sattr3()
    if ftype in (NF3CHR, NF3BLK):
        args.uint(), args.uint()  # specdata3
    parent = _directory(call, fh, name)
    if ftype in (NF3CHR, NF3BLK):
        raise NfsError(NFS3ERR_NOTSUPP, "no device nodes")
    if ftype not in (NF3SOCK, NF3FIFO):
        raise NfsError(NFS3ERR_BADTYPE)
    kind = stat.S_IFIFO if ftype == NF3FIFO else stat.S_IFSOCK
    os.mknod(name, kind | 0o600, dir_fd=parent.fd)
    return _made(call, parent, name, attrs if attrs.mode is not None else _with_mode(attrs, 0o644))


def _victim(call: Call, parent: Node, name: str) -> Node:
    """The object at ``name`` the caller wants to remove or rename away (sticky bit)."""
    victim = call.child(parent, name)
    call.caller.may_unlink(parent.st, victim.st)
    return victim


def _dir_result(call: Call) -> Body:
    tails = list(call.fail)

    def body(reply: Reply) -> None:
        for tail in tails:
            tail.pack(reply.packer, call.export)

    return body


@procedure(REMOVE, "w")
def remove(call: Call, args: Unpacker) -> Body:
    """REMOVE: a non-directory."""
    fh, name = unpack_diropargs(args)
    parent = _directory(call, fh, name, dots=NFS3ERR_ACCES)
    _victim(call, parent, name)
    os.unlink(name, dir_fd=parent.fd)
    return _dir_result(call)


@procedure(RMDIR, "w")
def rmdir(call: Call, args: Unpacker) -> Body:
    """RMDIR: an empty directory (``.``: INVAL, ``..``: EXIST, as RFC 1813 says)."""
    fh, name = unpack_diropargs(args)
    parent = _directory(call, fh, name, dots=NFS3ERR_INVAL)
    if name == "..":
        raise NfsError(NFS3ERR_EXIST)
    _victim(call, parent, name)
    try:
        os.rmdir(name, dir_fd=parent.fd)
    except FileExistsError:
        raise NfsError(NFS3ERR_NOTEMPTY) from None
    return _dir_result(call)


@procedure(RENAME, "ww")
def rename(call: Call, args: Unpacker) -> Body:
    """RENAME: within one export; the target, if any, is replaced."""
    from_fh, from_name = unpack_diropargs(args)
    to_fh, to_name = unpack_diropargs(args)
    source = _directory(call, from_fh, from_name, dots=NFS3ERR_INVAL)
    target = _directory(call, to_fh, to_name, slot=1, dots=NFS3ERR_INVAL)
    moved = _victim(call, source, from_name)
    try:
        _victim(call, target, to_name)
    except NfsError as exc:
        if exc.status != NFS3ERR_NOENT:
            raise
    os.rename(from_name, to_name, src_dir_fd=source.fd, dst_dir_fd=target.fd)
    call.ex.resolver.remember(moved.st, (*target.path, to_name))
    return _dir_result(call)


@procedure(LINK, "aw")
def link(call: Call, args: Unpacker) -> Body:
    """LINK: a new name for a file (the caller must own it or may read and write it)."""
    fh = unpack_fh(args)
    dir_fh, name = unpack_diropargs(args)
    node = call.node(fh)
    call.fail[0] = PostOp(node)
    parent = _directory(call, dir_fh, name, slot=1)
    caller = call.caller
    if caller.uid != node.st.st_uid and not caller.may(node.st, MAY_READ | MAY_WRITE):
        raise NfsError(NFS3ERR_ACCES)
    os.link(f"/proc/self/fd/{node.fd}", name, dst_dir_fd=parent.fd, follow_symlinks=True)
    return _dir_result(call)
