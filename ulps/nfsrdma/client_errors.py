"""What the NFS client raises, in words that say what went wrong and, where it can, what to do.

- :class:`NfsError`: a call answered with an ``nfsstat3`` other than NFS3_OK,
  ``NFS3ERR_ACCES: permission denied: /path``, with a hint when there is one
  (a root caller refused: the server's root squash).
- :class:`MountError`: MOUNT refused the export, or the server lists no such
  export (the message lists those it has).
- :class:`ServerUnreachable`: rpcbind, MOUNT or NFS could not be reached; it
  names which, the host and port, where the port came from and why
  (``NFS over TCP at 10.0.0.2 port 2049 (named by rpcbind): connection
  refused: nothing listens there``).
"""

from __future__ import annotations

import errno
import os

import trio

from rdmashim.ulps.nfsrdma import nfs3_types as t

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

ROOT_SQUASH_HINT = (
    "you are root, whom NFS servers map to nobody unless the export allows root: "
    "rdmashim nfs serve --no-root-squash, no_root_squash in knfsd's /etc/exports"
)
"""Said with NFS3ERR_ACCES or NFS3ERR_PERM when the caller's AUTH_SYS uid is 0."""


def status_name(status: int) -> str:
    """``NFS3ERR_NOENT`` for 2 (``nfsstat3 N`` for a value RFC 1813 does not name)."""
    try:
        return t.Nfsstat3(status).name
    except ValueError:
        return f"nfsstat3 {status}"


def status_hint(status: int, uid: int) -> str:
    """What a caller with ``uid`` may do about ``status`` ("" when nothing is known)."""
    if uid == 0 and status in (t.NFS3ERR_ACCES, t.NFS3ERR_PERM):
        return ROOT_SQUASH_HINT
    return ""


class NfsError(t.NfsError):
    """A call answered with an ``nfsstat3`` other than NFS3_OK:
    ``NFS3ERR_NOENT: no such file or directory: /path``, then ``(hint)`` if any."""

    def __init__(self, status: int, path: str = "", hint: str = "") -> None:
        super().__init__(status)
        self.path = path
        """The object the status is about (for NOTDIR, the one that is not a directory)."""
        self.hint = hint
        """What to do about it, when that is known ("" otherwise)."""
        text = _STATUS_TEXT.get(status, "error")
        where = f": {path}" if path else ""
        self.args = (f"{status_name(status)}: {text}{where}{f' ({hint})' if hint else ''}",)

    def __str__(self) -> str:
        return str(self.args[0])


class MountError(OSError):
    """MOUNT refused the export (its ``mountstat3``) or does not list it."""


class ServerUnreachable(ConnectionError):
    """A server's program could not be reached; ``program`` names it (``rpcbind``,
    ``MOUNT``, ``NFS over TCP``, ``NFS over RDMA``), the message says where, why
    (``reason``) and, as ``hint``, where the port came from or what to do."""

    def __init__(self, program: str, host: str, port: int, reason: str, hint: str = "") -> None:
        super().__init__(f"{program} at {host} port {port}: {reason}{f' ({hint})' if hint else ''}")
        self.program = program
        self.host = host
        self.port = port
        self.reason = reason
        self.hint = hint


_REASONS = {
    errno.ECONNREFUSED: "connection refused: nothing listens there",
    errno.EHOSTUNREACH: "no route to the host",
    errno.ENETUNREACH: "no route to the network",
    errno.ETIMEDOUT: "the host did not answer",
}


def connect_failure(exc: BaseException) -> str:
    """Why a connection could not be made, in a few words (trio gathers the reasons of
    its attempts in the cause of the error it raises)."""
    if isinstance(exc, trio.TooSlowError):
        return "the host did not answer"
    found = [exc]
    if isinstance(exc.__cause__, BaseExceptionGroup):
        found += list(exc.__cause__.exceptions)
    for leaf in reversed(found):
        code = getattr(leaf, "errno", None)
        if code in _REASONS:
            return _REASONS[code]
        if code:
            return os.strerror(code).lower()
    return str(exc)


__all__ = [
    "ROOT_SQUASH_HINT",
    "MountError",
    "NfsError",
    "ServerUnreachable",
    "connect_failure",
    "status_hint",
    "status_name",
]
