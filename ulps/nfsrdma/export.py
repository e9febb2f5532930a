"""An exported directory and the rules that keep NFS clients inside it.

Every object is reached through an ``O_PATH | O_NOFOLLOW`` descriptor
(:class:`Node`), opened one component at a time relative to its directory's
descriptor: a path never leaves the export (``..`` at the root is the root),
the server never follows a symbolic link, and a link swapped in while an
operation runs cannot redirect it (the operation works on the descriptor it
already holds; data is read and written by reopening that descriptor through
``/proc/self/fd``, which names the object itself, and a symlink cannot be
reopened so at all).

The server typically runs as root, so it checks permissions itself, as the
AUTH_SYS caller (:class:`Caller`, after root squash) against the mode bits,
owner and groups; a read-only export refuses every change with
NFS3ERR_ROFS; names are checked for ``/``, NUL, length and ``.``/``..``.
"""

from __future__ import annotations

import ipaddress
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rdmashim.ulps.nfsrdma.handles import (
    PATH_FLAGS,
    HandleCodec,
    ObjectId,
    RelPath,
    Resolver,
    export_id_of,
    generation,
    load_key,
)
from rdmashim.ulps.nfsrdma.nfs3_types import (
    NAME_MAX,
    NFS3ERR_ACCES,
    NFS3ERR_NAMETOOLONG,
    NFS3ERR_NOTDIR,
    NFS3ERR_PERM,
    NFS3ERR_ROFS,
    Fattr3,
    NfsError,
    fattr3_bytes,
    fattr_of_stat,
)
from rdmashim.ulps.nfsrdma.service import AuthSys

NOBODY = 65534
MAY_READ, MAY_WRITE, MAY_EXEC = 4, 2, 1
ENCODED_ATTRS = 1024
"""Encoded ``fattr3``\\ s an :class:`Export` keeps (all are dropped when it is full)."""


@dataclass(frozen=True, slots=True)
class Caller:
    """Whom the server acts for: the AUTH_SYS identity after squashing."""

    uid: int
    gid: int
    groups: frozenset[int]

    @property
    def is_root(self) -> bool:
        """Whether permission checks are skipped (an unsquashed uid 0)."""
        return self.uid == 0

    def may(self, st: os.stat_result, want: int, *, owner_override: bool = False) -> bool:
        """Whether the mode bits of ``st`` grant ``want`` (MAY_* bits) to this caller.

        ``owner_override`` grants the owner everything (NFS clients check
        access at open time; a write through an open file the owner has since
        made read-only must succeed).
        """
        if owner_override and self.uid == st.st_uid:
            return True
        if self.is_root:
            return not want & MAY_EXEC or stat.S_ISDIR(st.st_mode) or bool(st.st_mode & 0o111)
        if self.uid == st.st_uid:
            bits = st.st_mode >> 6
        elif st.st_gid in self.groups:
            bits = st.st_mode >> 3
        else:
            bits = st.st_mode
        return (bits & want & 7) == want

    def require(self, st: os.stat_result, want: int, *, owner_override: bool = False) -> None:
        """NfsError(ACCES) unless :meth:`may`."""
        if not self.may(st, want, owner_override=owner_override):
            raise NfsError(NFS3ERR_ACCES)

    def require_owner(self, st: os.stat_result) -> None:
        """NfsError(PERM) unless the caller owns the object (or is root)."""
        if not self.is_root and self.uid != st.st_uid:
            raise NfsError(NFS3ERR_PERM)

    def may_unlink(self, dir_st: os.stat_result, victim: os.stat_result) -> None:
        """Removing or renaming ``victim`` from a directory: write+search, the sticky bit."""
        self.require(dir_st, MAY_WRITE | MAY_EXEC)
        sticky = dir_st.st_mode & stat.S_ISVTX
        if sticky and not self.is_root and self.uid not in (dir_st.st_uid, victim.st_uid):
            raise NfsError(NFS3ERR_ACCES)


@dataclass(slots=True)
class Node:
    """An object of the export, held open (``O_PATH``) for one call."""

    fd: int
    st: os.stat_result
    path: RelPath

    def restat(self) -> os.stat_result:
        """Its attributes now."""
        self.st = os.stat(self.fd)
        return self.st

    @property
    def is_dir(self) -> bool:
        """Whether it is a directory."""
        return stat.S_ISDIR(self.st.st_mode)

    def reopen(self, flags: int) -> int:
        """A real descriptor of this very object (never a symlink's target: ELOOP)."""
        return os.open(f"/proc/self/fd/{self.fd}", flags | os.O_CLOEXEC | os.O_NOCTTY)

    def listing(self) -> int:
        """A descriptor to read this directory's entries from."""
        return os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self.fd)


def check_name(name: str, dots: int | None) -> None:
    """A ``filename3`` one component long; ``.``/``..`` are NfsError(``dots``) unless None."""
    if len(name.encode("utf-8", "surrogateescape")) > NAME_MAX:
        raise NfsError(NFS3ERR_NAMETOOLONG)
    if not name or "/" in name or "\0" in name:
        raise NfsError(NFS3ERR_ACCES, f"bad name {name!r}")
    if dots is not None and name in (".", ".."):
        raise NfsError(dots, f"name {name!r}")


class Export:
    """A local directory served over NFS, with its handle key and safety settings.

    ``name`` is the path clients mount (default: ``path`` made absolute);
    ``clients`` lists the hosts allowed (addresses, networks such as
    ``"10.0.0.0/8"``, or ``"*"``; empty: everyone), reported by MOUNT's EXPORT
    as its groups. ``state_dir`` keeps the secret that authenticates handles.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        state_dir: str | os.PathLike[str],
        name: str | None = None,
        read_only: bool = False,
        root_squash: bool = True,
        anon_uid: int = NOBODY,
        anon_gid: int = NOBODY,
        clients: Sequence[str] = (),
        search_limit: int = 100_000,
    ) -> None:
        self.path = Path(path).resolve()
        self.name = name or str(self.path)
        self.read_only = read_only
        self.root_squash = root_squash
        self.anon_uid = anon_uid
        self.anon_gid = anon_gid
        self.clients = tuple(clients)
        self._networks = [ipaddress.ip_network(c, strict=False) for c in clients if c != "*"]
        self.export_id = export_id_of(self.name)
        self.codec = HandleCodec(self.export_id, load_key(Path(state_dir), self.export_id))
        root_fd = os.open(self.path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        self.resolver = Resolver(root_fd, search_limit=search_limit)
        self._encoded: dict[tuple[int, ...], bytes] = {}
        """Encoded ``fattr3``\\ s by the stat fields they are made of (:meth:`fattr3_bytes`)."""

    def close(self) -> None:
        """Release the root descriptor."""
        os.close(self.resolver.root_fd)

    def allows(self, host: str) -> bool:
        """Whether ``host`` (an address) may use this export."""
        if not self.clients or "*" in self.clients:
            return True
        try:
            addr = ipaddress.ip_address(host)
        except ValueError:
            return False
        return any(addr in net for net in self._networks)

    def caller(self, cred: AuthSys | None) -> Caller:
        """The identity to act as for a credential (AUTH_NONE: the anonymous user)."""
        if cred is None:
            return Caller(self.anon_uid, self.anon_gid, frozenset([self.anon_gid]))
        uid, gid, gids = cred.uid, cred.gid, cred.gids
        if self.root_squash:
            uid = self.anon_uid if uid == 0 else uid
            gid = self.anon_gid if gid == 0 else gid
            gids = tuple(self.anon_gid if g == 0 else g for g in gids)
        return Caller(uid, gid, frozenset((gid, *gids)))

    def writable(self) -> None:
        """NfsError(ROFS) on a read-only export."""
        if self.read_only:
            raise NfsError(NFS3ERR_ROFS)

    def fattr(self, st: os.stat_result) -> Fattr3:
        """The NFS attributes of an object of this export."""
        return fattr_of_stat(st, self.export_id)

    def fattr3_bytes(self, st: os.stat_result) -> bytes:
        """The encoded ``fattr3`` of ``st``, kept by every field of ``st`` it is made of:
        an object whose stat is unchanged in all of them is not encoded again, and any
        change (a time to the nanosecond, the size, blocks, mode, owner, links) is."""
        key = (
            st.st_ino, st.st_mode, st.st_nlink, st.st_uid, st.st_gid, st.st_size, st.st_blocks,
            st.st_rdev, st.st_atime_ns, st.st_mtime_ns, st.st_ctime_ns,
        )  # fmt: skip
        encoded = self._encoded.get(key)
        if encoded is None:
            if len(self._encoded) >= ENCODED_ATTRS:
                self._encoded.clear()
            encoded = self._encoded[key] = fattr3_bytes(st, self.export_id)
        return encoded

    def handle(self, node: Node) -> bytes:
        """The handle of ``node``."""
        st = node.st
        return self.codec.encode(ObjectId(st.st_dev, st.st_ino, generation(node.fd, st)))

    def stat(self, fh: bytes, *, search: bool = True) -> os.stat_result:
        """The attributes of the object a handle names now, holding nothing open (errors
        as :meth:`node`)."""
        return self.resolver.stat(self.codec.decode(fh), search=search)

    def node(self, fh: bytes, *, search: bool = True) -> Node:
        """The object a handle names: BADHANDLE if not ours, STALE if it is gone
        (``search`` False: :class:`~.handles.SearchNeeded` where the export would be searched)."""
        fd, st, path = self.resolver.find(self.codec.decode(fh), search=search)
        return Node(fd, st, path)

    def root(self) -> Node:
        """The export's root directory."""
        fd = os.dup(self.resolver.root_fd)
        return Node(fd, os.stat(fd), ())

    def child(self, parent: Node, name: str) -> Node:
        """``name`` in directory ``parent``, not followed if a link; ``..`` at the root is it."""
        if not parent.is_dir:
            raise NfsError(NFS3ERR_NOTDIR)
        check_name(name, None)
        if name == "." or (name == ".." and not parent.path):
            return Node(os.dup(parent.fd), parent.st, parent.path)
        fd = os.open(name, PATH_FLAGS, dir_fd=parent.fd)
        try:
            st = os.stat(fd)
        except BaseException:
            os.close(fd)
            raise
        if name == "..":
            path = self.resolver.cached(st)
            return Node(fd, st, parent.path[:-1] if path is None else path)
        node = Node(fd, st, (*parent.path, name))
        self.resolver.remember(st, node.path)
        return node
