"""The MOUNT program (RFC 1813 appendix I, program 100005) for the NFSv3 exports.

Versions 1 to 3 are served: DUMP, UMNT, UMNTALL and EXPORT have the same
XDR in all three (``showmount`` asks version 1), but MNT hands out a handle
only in version 3; version 1 and 2 MNT answer EACCES, since their fixed
32-byte NFSv2 handles cannot carry ours (and NFSv2 is not served).
Version 2's PATHCONF is not offered (PROC_UNAVAIL).

MNT takes an export's name, or a directory below it (walked component by
component, never through a link), checks the caller's address against the
export's clients, and records the mount for DUMP; the list lives in memory.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Sequence
from typing import Final

from rdmashim.ulps.nfsrdma.export import Export
from rdmashim.ulps.nfsrdma.nfs3_types import MOUNT_PROGRAM, NfsError, pack_fh
from rdmashim.ulps.nfsrdma.service import AUTH_NONE, AUTH_SYS, CallContext, ProcUnavailable, Reply
from rdmashim.ulps.nfsrdma.xdr import Packer, Unpacker

log = logging.getLogger(__name__)

MNTPATHLEN: Final = 1024
MNT3_OK: Final = 0
MNT3ERR_NOENT: Final = 2
MNT3ERR_ACCES: Final = 13
MNT3ERR_NOTDIR: Final = 20
MNT3ERR_IO: Final = 5
_MOUNTSTAT3: Final = frozenset({1, 2, 5, 13, 20, 22, 63, 10004, 10006})
"""The ``mountstat3`` values (a subset of the ``nfsstat3`` ones)."""

MOUNTPROC_NULL, MOUNTPROC_MNT, MOUNTPROC_DUMP, MOUNTPROC_UMNT = range(4)
MOUNTPROC_UMNTALL, MOUNTPROC_EXPORT = 4, 5
AUTH_FLAVORS: Final = (AUTH_SYS, AUTH_NONE)


def _split(path: str) -> list[str]:
    return [c for c in path.split("/") if c and c != "."]


MAX_MOUNT_RECORDS = 4096
"""Mount records DUMP keeps (the oldest is forgotten first)."""


class MountProgram:
    """MOUNT v1-v3 for ``exports`` (the same :class:`~.export.Export` objects NFS serves)."""

    number = MOUNT_PROGRAM
    versions = (1, 3)

    def __init__(self, exports: Export | Sequence[Export]) -> None:
        self.exports = [exports] if isinstance(exports, Export) else list(exports)
        self.mounts: dict[tuple[str, str], None] = {}
        """(host, path) of each mount, once each, oldest first, for DUMP (at most
        :data:`MAX_MOUNT_RECORDS`: a client that mounts again and again without UMNT
        cannot grow it)."""

    async def dispatch(self, ctx: CallContext, args: Unpacker, reply: Reply) -> None:
        """Decode, do, encode one MOUNT call (see :class:`~.service.Program`)."""
        p = reply.packer
        if ctx.proc == MOUNTPROC_NULL:
            return
        if ctx.proc == MOUNTPROC_MNT:
            self._mnt(ctx, args.string(MNTPATHLEN), p)
        elif ctx.proc == MOUNTPROC_DUMP:
            for host, path in self.mounts:
                p.boolean(True)
                p.string(host)
                p.string(path)
            p.boolean(False)
        elif ctx.proc == MOUNTPROC_UMNT:
            self.mounts.pop((ctx.peer[0], _normal(args.string(MNTPATHLEN))), None)
        elif ctx.proc == MOUNTPROC_UMNTALL:
            self.mounts = {m: None for m in self.mounts if m[0] != ctx.peer[0]}
        elif ctx.proc == MOUNTPROC_EXPORT:
            self._export(p)
        else:
            raise ProcUnavailable(ctx.proc)

    def _export(self, p: Packer) -> None:
        for export in self.exports:
            p.boolean(True)
            p.string(export.name)
            for group in export.clients:
                p.boolean(True)
                p.string(group)
            p.boolean(False)
        p.boolean(False)

    def _find(self, path: str) -> tuple[Export, list[str]] | None:
        """The export holding ``path`` (the longest name that is a prefix) and the rest."""
        wanted = _split(path)
        best: tuple[Export, list[str]] | None = None
        for export in self.exports:
            name = _split(export.name)
            if wanted[: len(name)] == name and (best is None or len(name) > len(best[1])):
                best = (export, name)
        return None if best is None else (best[0], wanted[len(best[1]) :])

    def _mnt(self, ctx: CallContext, path: str, p: Packer) -> None:
        status, fh = self._mount(ctx, path)
        p.uint(status)
        if status == MNT3_OK:
            assert fh is not None
            pack_fh(p, fh)
            p.array(AUTH_FLAVORS, p.uint)
            entry = (ctx.peer[0], _normal(path))
            self.mounts.pop(entry, None)  # the newest mount goes last
            self.mounts[entry] = None
            if len(self.mounts) > MAX_MOUNT_RECORDS:
                del self.mounts[next(iter(self.mounts))]

    def _mount(self, ctx: CallContext, path: str) -> tuple[int, bytes | None]:
        found = self._find(path)
        if found is None:
            return MNT3ERR_NOENT, None
        export, rest = found
        if ctx.vers != 3 or not export.allows(ctx.peer[0]):
            return MNT3ERR_ACCES, None
        node = export.root()
        try:
            for name in rest:
                child = export.child(node, name)
                os.close(node.fd)
                node = child
            if not stat.S_ISDIR(node.st.st_mode):
                return MNT3ERR_NOTDIR, None
            return MNT3_OK, export.handle(node)
        except OSError as exc:
            return _mountstat(NfsError.of(exc)), None
        except NfsError as exc:
            return _mountstat(exc), None
        finally:
            os.close(node.fd)


def _mountstat(exc: NfsError) -> int:
    log.debug("MNT: %s", exc)
    return exc.status if exc.status in _MOUNTSTAT3 else MNT3ERR_IO


def _normal(path: str) -> str:
    return "/" + "/".join(_split(path))
