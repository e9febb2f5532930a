"""XDR of the NFSv3 and MOUNT v3 structures (RFC 1813) and their constants.

Pure encode/decode pairs over :mod:`.xdr` for the structures the NFS and
MOUNT programs share: file handles, attributes (``fattr3``, ``sattr3``,
``wcc_data``), directory operation arguments; plus the procedure numbers,
the ``nfsstat3`` values and the errno -> ``nfsstat3`` mapping. Decoders bound
every length (a handle at 64 bytes, a name at :data:`NAME_LIMIT`, a path at
:data:`PATH_LIMIT`) and reject unknown enum values with
:class:`~.xdr.XdrError`, so a malformed call is GARBAGE_ARGS.
"""

from __future__ import annotations

import errno
import os
import stat
import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import Final, Literal

from rdmashim.ulps.nfsrdma.xdr import Packer, Unpacker, XdrError

NFS_PROGRAM: Final = 100003
NFS_V3: Final = 3
MOUNT_PROGRAM: Final = 100005

FHSIZE3: Final = 64
"""The largest NFSv3 file handle."""
NAME_MAX: Final = 255
"""The longest name the server accepts (longer: NFS3ERR_NAMETOOLONG)."""
PATH_MAX: Final = 4095
"""The longest symbolic link target or MOUNT path the server accepts."""
NAME_LIMIT: Final = 1024
"""Longer names on the wire are undecodable (GARBAGE_ARGS), not NAMETOOLONG."""
PATH_LIMIT: Final = 8192
"""Longer paths on the wire are undecodable (GARBAGE_ARGS)."""

# Procedures (RFC 1813 section 3).
(NULL, GETATTR, SETATTR, LOOKUP, ACCESS, READLINK, READ, WRITE, CREATE, MKDIR, SYMLINK) = range(11)
(MKNOD, REMOVE, RMDIR, RENAME, LINK, READDIR, READDIRPLUS, FSSTAT, FSINFO, PATHCONF) = range(11, 21)
COMMIT: Final = 21


class Nfsstat3(IntEnum):
    """``nfsstat3``: the status of an NFSv3 procedure (RFC 1813 section 2.6)."""

    NFS3_OK = 0
    NFS3ERR_PERM = 1
    NFS3ERR_NOENT = 2
    NFS3ERR_IO = 5
    NFS3ERR_NXIO = 6
    NFS3ERR_ACCES = 13
    NFS3ERR_EXIST = 17
    NFS3ERR_XDEV = 18
    NFS3ERR_NODEV = 19
    NFS3ERR_NOTDIR = 20
    NFS3ERR_ISDIR = 21
    NFS3ERR_INVAL = 22
    NFS3ERR_FBIG = 27
    NFS3ERR_NOSPC = 28
    NFS3ERR_ROFS = 30
    NFS3ERR_MLINK = 31
    NFS3ERR_NAMETOOLONG = 63
    NFS3ERR_NOTEMPTY = 66
    NFS3ERR_DQUOT = 69
    NFS3ERR_STALE = 70
    NFS3ERR_REMOTE = 71
    NFS3ERR_BADHANDLE = 10001
    NFS3ERR_NOT_SYNC = 10002
    NFS3ERR_BAD_COOKIE = 10003
    NFS3ERR_NOTSUPP = 10004
    NFS3ERR_TOOSMALL = 10005
    NFS3ERR_SERVERFAULT = 10006
    NFS3ERR_BADTYPE = 10007
    NFS3ERR_JUKEBOX = 10008


# The statuses as names of their own, as RFC 1813 writes them.
NFS3_OK: Final = Nfsstat3.NFS3_OK
NFS3ERR_PERM: Final = Nfsstat3.NFS3ERR_PERM
NFS3ERR_NOENT: Final = Nfsstat3.NFS3ERR_NOENT
NFS3ERR_IO: Final = Nfsstat3.NFS3ERR_IO
NFS3ERR_NXIO: Final = Nfsstat3.NFS3ERR_NXIO
NFS3ERR_ACCES: Final = Nfsstat3.NFS3ERR_ACCES
NFS3ERR_EXIST: Final = Nfsstat3.NFS3ERR_EXIST
NFS3ERR_XDEV: Final = Nfsstat3.NFS3ERR_XDEV
NFS3ERR_NODEV: Final = Nfsstat3.NFS3ERR_NODEV
NFS3ERR_NOTDIR: Final = Nfsstat3.NFS3ERR_NOTDIR
NFS3ERR_ISDIR: Final = Nfsstat3.NFS3ERR_ISDIR
NFS3ERR_INVAL: Final = Nfsstat3.NFS3ERR_INVAL
NFS3ERR_FBIG: Final = Nfsstat3.NFS3ERR_FBIG
NFS3ERR_NOSPC: Final = Nfsstat3.NFS3ERR_NOSPC
NFS3ERR_ROFS: Final = Nfsstat3.NFS3ERR_ROFS
NFS3ERR_MLINK: Final = Nfsstat3.NFS3ERR_MLINK
NFS3ERR_NAMETOOLONG: Final = Nfsstat3.NFS3ERR_NAMETOOLONG
NFS3ERR_NOTEMPTY: Final = Nfsstat3.NFS3ERR_NOTEMPTY
NFS3ERR_DQUOT: Final = Nfsstat3.NFS3ERR_DQUOT
NFS3ERR_STALE: Final = Nfsstat3.NFS3ERR_STALE
NFS3ERR_REMOTE: Final = Nfsstat3.NFS3ERR_REMOTE
NFS3ERR_BADHANDLE: Final = Nfsstat3.NFS3ERR_BADHANDLE
NFS3ERR_NOT_SYNC: Final = Nfsstat3.NFS3ERR_NOT_SYNC
NFS3ERR_BAD_COOKIE: Final = Nfsstat3.NFS3ERR_BAD_COOKIE
NFS3ERR_NOTSUPP: Final = Nfsstat3.NFS3ERR_NOTSUPP
NFS3ERR_TOOSMALL: Final = Nfsstat3.NFS3ERR_TOOSMALL
NFS3ERR_SERVERFAULT: Final = Nfsstat3.NFS3ERR_SERVERFAULT
NFS3ERR_BADTYPE: Final = Nfsstat3.NFS3ERR_BADTYPE
NFS3ERR_JUKEBOX: Final = Nfsstat3.NFS3ERR_JUKEBOX


_ERRNO_STATUS: Final = {
    errno.EPERM: NFS3ERR_PERM,
    errno.ENOENT: NFS3ERR_NOENT,
    errno.EIO: NFS3ERR_IO,
    errno.ENXIO: NFS3ERR_NXIO,
    errno.EACCES: NFS3ERR_ACCES,
    errno.EEXIST: NFS3ERR_EXIST,
    errno.EXDEV: NFS3ERR_XDEV,
    errno.ENODEV: NFS3ERR_NODEV,
    errno.ENOTDIR: NFS3ERR_NOTDIR,
    errno.EISDIR: NFS3ERR_ISDIR,
    errno.EINVAL: NFS3ERR_INVAL,
    errno.EFBIG: NFS3ERR_FBIG,
    errno.EOVERFLOW: NFS3ERR_FBIG,
    errno.ENOSPC: NFS3ERR_NOSPC,
    errno.EROFS: NFS3ERR_ROFS,
    errno.EMLINK: NFS3ERR_MLINK,
    errno.ENAMETOOLONG: NFS3ERR_NAMETOOLONG,
    errno.ENOTEMPTY: NFS3ERR_NOTEMPTY,
    errno.EDQUOT: NFS3ERR_DQUOT,
    errno.ESTALE: NFS3ERR_STALE,
    errno.EREMOTE: NFS3ERR_REMOTE,
    errno.ENOTSUP: NFS3ERR_NOTSUPP,
    errno.ENOSYS: NFS3ERR_NOTSUPP,
    errno.ELOOP: NFS3ERR_INVAL,
    errno.EBUSY: NFS3ERR_ACCES,
    errno.ETXTBSY: NFS3ERR_ACCES,
    errno.EAGAIN: NFS3ERR_JUKEBOX,
    errno.ETIMEDOUT: NFS3ERR_JUKEBOX,
    errno.ENOMEM: NFS3ERR_JUKEBOX,
}


def status_enum(status: int) -> int:
    """``status`` as an :class:`Nfsstat3` member, or as it is if RFC 1813 does not name it."""
    try:
        return Nfsstat3(status)
    except ValueError:
        return status


def status_of_errno(code: int | None) -> int:
    """The ``nfsstat3`` for an errno (NFS3ERR_IO for one with no better match)."""
    return _ERRNO_STATUS.get(code or errno.EIO, NFS3ERR_IO)


class FType3(IntEnum):
    """``ftype3``: the type of a file system object (its ``int`` is the wire value)."""

    REG = 1
    DIR = 2
    BLK = 3
    CHR = 4
    LNK = 5
    SOCK = 6
    FIFO = 7


NF3REG, NF3DIR, NF3BLK, NF3CHR, NF3LNK, NF3SOCK, NF3FIFO = FType3
_FTYPE_OF_FMT: Final = {
    stat.S_IFREG: NF3REG,
    stat.S_IFDIR: NF3DIR,
    stat.S_IFBLK: NF3BLK,
    stat.S_IFCHR: NF3CHR,
    stat.S_IFLNK: NF3LNK,
    stat.S_IFSOCK: NF3SOCK,
    stat.S_IFIFO: NF3FIFO,
}

# ACCESS bits.
ACCESS3_READ: Final = 0x01
ACCESS3_LOOKUP: Final = 0x02
ACCESS3_MODIFY: Final = 0x04
ACCESS3_EXTEND: Final = 0x08
ACCESS3_DELETE: Final = 0x10
ACCESS3_EXECUTE: Final = 0x20

# stable_how (WRITE) and createmode3 (CREATE).
UNSTABLE, DATA_SYNC, FILE_SYNC = range(3)
UNCHECKED, GUARDED, EXCLUSIVE = range(3)

# FSINFO properties.
FSF3_LINK: Final = 0x1
FSF3_SYMLINK: Final = 0x2
FSF3_HOMOGENEOUS: Final = 0x8
FSF3_CANSETTIME: Final = 0x10

Time = tuple[int, int]
"""An ``nfstime3``: seconds and nanoseconds."""
SERVER_TIME: Final = "server"
"""A ``set_atime``/``set_mtime`` of SET_TO_SERVER_TIME."""
TimeSet = Time | Literal["server"] | None
"""A ``set_atime``/``set_mtime``: None is DONT_CHANGE."""


@dataclass(frozen=True, slots=True)
class Fattr3:
    """The attributes of a file system object (``fattr3``)."""

    ftype: FType3
    mode: int
    nlink: int
    uid: int
    gid: int
    size: int
    used: int
    rdev: tuple[int, int]
    fsid: int
    fileid: int
    atime: Time
    mtime: Time
    ctime: Time

    def wcc(self) -> WccAttr:
        """The subset a ``wcc_data`` carries before an operation."""
        return WccAttr(self.size, self.mtime, self.ctime)


@dataclass(frozen=True, slots=True)
class WccAttr:
    """The pre-operation attributes of ``wcc_data``."""

    size: int
    mtime: Time
    ctime: Time


@dataclass(frozen=True, slots=True)
class Sattr3:
    """Attributes to set (``sattr3``); None leaves one unchanged."""

    mode: int | None = None
    uid: int | None = None
    gid: int | None = None
    size: int | None = None
    atime: TimeSet = None
    mtime: TimeSet = None


_FATTR3: Final = struct.Struct(">5I2Q2I2Q6I")
"""A ``fattr3`` on the wire, its 17 fields flat (rdev and the times two words each)."""
FATTR3_SIZE: Final = _FATTR3.size
"""Bytes of an encoded ``fattr3``."""


def _stat_words(st: os.stat_result, fsid: int) -> tuple[int, ...]:
    """The 17 flat fields of the ``fattr3`` of ``st``, in wire order."""
    mode = st.st_mode
    a_s, a_n = divmod(max(st.st_atime_ns, 0), 1_000_000_000)
    m_s, m_n = divmod(max(st.st_mtime_ns, 0), 1_000_000_000)
    c_s, c_n = divmod(max(st.st_ctime_ns, 0), 1_000_000_000)
    rdev = st.st_rdev
    return (
        _FTYPE_OF_FMT.get(stat.S_IFMT(mode), NF3REG), stat.S_IMODE(mode), st.st_nlink,
        st.st_uid, st.st_gid, st.st_size, st.st_blocks * 512, os.major(rdev), os.minor(rdev),
        fsid, st.st_ino, min(a_s, 0xFFFFFFFF), a_n, min(m_s, 0xFFFFFFFF), m_n,
        min(c_s, 0xFFFFFFFF), c_n,
    )  # fmt: skip


def fattr_of_stat(st: os.stat_result, fsid: int) -> Fattr3:
    """The ``fattr3`` of an ``os.stat_result``; ``fsid`` names the export."""
    ftype, mode, nlink, uid, gid, size, used, major, minor, _, fileid, *t = _stat_words(st, fsid)
    return Fattr3(
        FType3(ftype), mode, nlink, uid, gid, size, used, (major, minor), fsid, fileid,
        (t[0], t[1]), (t[2], t[3]), (t[4], t[5]),
    )  # fmt: skip


def fattr3_bytes(st: os.stat_result, fsid: int) -> bytes:
    """The encoded ``fattr3`` of ``st`` (what :func:`pack_fattr3` of
    :func:`fattr_of_stat` writes, without the :class:`Fattr3` between)."""
    return _FATTR3.pack(*_stat_words(st, fsid))


def pack_time(p: Packer, t: Time) -> None:
    """An ``nfstime3``."""
    p.uint(t[0])
    p.uint(t[1])


def unpack_time(u: Unpacker) -> Time:
    """An ``nfstime3``."""
    return (u.uint(), u.uint())


def pack_fattr3_bytes(a: Fattr3) -> bytes:
    """A ``fattr3``, encoded."""
    return _FATTR3.pack(
        a.ftype, a.mode, a.nlink, a.uid, a.gid, a.size, a.used, *a.rdev, a.fsid, a.fileid,
        *a.atime, *a.mtime, *a.ctime,
    )  # fmt: skip


def pack_fattr3(p: Packer, a: Fattr3) -> None:
    """A ``fattr3``."""
    p.data += pack_fattr3_bytes(a)


def _ftype(value: int) -> FType3:
    try:
        return FType3(value)
    except ValueError:
        raise XdrError(f"ftype3 {value}") from None


def unpack_fattr3(u: Unpacker) -> Fattr3:
    """A ``fattr3``."""
    w = u.fields(_FATTR3)
    return Fattr3(
        _ftype(w[0]), w[1], w[2], w[3], w[4], w[5], w[6], (w[7], w[8]), w[9], w[10],
        (w[11], w[12]), (w[13], w[14]), (w[15], w[16]),
    )  # fmt: skip


def pack_post_op_attr(p: Packer, a: Fattr3 | None) -> None:
    """A ``post_op_attr``."""
    p.optional(a, lambda v: pack_fattr3(p, v))


def unpack_post_op_attr(u: Unpacker) -> Fattr3 | None:
    """A ``post_op_attr``."""
    return u.optional(lambda: unpack_fattr3(u))


def _pack_wcc_attr(p: Packer, w: WccAttr) -> None:
    p.uhyper(w.size)
    pack_time(p, w.mtime)
    pack_time(p, w.ctime)


def pack_wcc_data(p: Packer, pre: WccAttr | None, post: Fattr3 | None) -> None:
    """A ``wcc_data``: pre-operation size and times, post-operation attributes."""
    p.optional(pre, lambda w: _pack_wcc_attr(p, w))
    pack_post_op_attr(p, post)


def unpack_wcc_data(u: Unpacker) -> tuple[WccAttr | None, Fattr3 | None]:
    """A ``wcc_data``."""
    pre = u.optional(lambda: WccAttr(u.uhyper(), unpack_time(u), unpack_time(u)))
    return pre, unpack_post_op_attr(u)


def pack_fh(p: Packer, fh: bytes) -> None:
    """An ``nfs_fh3``."""
    p.opaque(fh)


def unpack_fh(u: Unpacker) -> bytes:
    """An ``nfs_fh3``: at most 64 bytes."""
    return u.opaque(FHSIZE3)


def pack_post_op_fh3(p: Packer, fh: bytes | None) -> None:
    """A ``post_op_fh3``."""
    p.optional(fh, lambda v: pack_fh(p, v))


def unpack_post_op_fh3(u: Unpacker) -> bytes | None:
    """A ``post_op_fh3``."""
    return u.optional(lambda: unpack_fh(u))


def unpack_name(u: Unpacker) -> str:
    """A ``filename3`` (checked for length and content by the export, not here)."""
    return u.string(NAME_LIMIT)


def unpack_path(u: Unpacker) -> str:
    """An ``nfspath3`` or MOUNT ``dirpath``."""
    return u.string(PATH_LIMIT)


def pack_diropargs(p: Packer, fh: bytes, name: str) -> None:
    """A ``diropargs3``: a directory's handle and a name in it."""
    pack_fh(p, fh)
    p.string(name)


def unpack_diropargs(u: Unpacker) -> tuple[bytes, str]:
    """A ``diropargs3``."""
    return unpack_fh(u), unpack_name(u)


def unpack_enum(u: Unpacker, count: int, what: str) -> int:
    """An enum whose values are ``0 .. count - 1``."""
    value = u.uint()
    if value >= count:
        raise XdrError(f"{what} {value}")
    return value


def _pack_time_set(p: Packer, t: TimeSet) -> None:
    if t is None:
        p.uint(0)
    elif t == SERVER_TIME:
        p.uint(1)
    else:
        p.uint(2)
        pack_time(p, t)


def _unpack_time_set(u: Unpacker) -> TimeSet:
    how = unpack_enum(u, 3, "time_how")
    if how == 0:
        return None
    return SERVER_TIME if how == 1 else unpack_time(u)


def pack_sattr3(p: Packer, s: Sattr3) -> None:
    """A ``sattr3``."""
    for value in (s.mode, s.uid, s.gid):
        p.optional(value, p.uint)
    p.optional(s.size, p.uhyper)
    _pack_time_set(p, s.atime)
    _pack_time_set(p, s.mtime)


def unpack_sattr3(u: Unpacker) -> Sattr3:
    """A ``sattr3``."""
    mode, uid, gid = (u.optional(u.uint) for _ in range(3))
    size = u.optional(u.uhyper)
    return Sattr3(mode, uid, gid, size, _unpack_time_set(u), _unpack_time_set(u))


class NfsError(Exception):
    """A procedure's failure with an ``nfsstat3`` (its result, not a fault)."""

    def __init__(self, status: int, detail: str = "") -> None:
        super().__init__(f"nfsstat3 {status}{': ' + detail if detail else ''}")
        self.status: int = status_enum(status)
        """An :class:`Nfsstat3` (a plain ``int`` for a value RFC 1813 does not name)."""

    @classmethod
    def of(cls, exc: OSError) -> NfsError:
        """The NFS error for a failed system call."""
        return cls(status_of_errno(exc.errno), str(exc))
