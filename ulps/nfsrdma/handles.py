"""NFSv3 file handles: what they carry, how they are authenticated, how they are resolved.

A handle is 41 opaque bytes: a format byte, the export's id, the object's
device, inode number and generation (``FS_IOC_GETVERSION`` where the file
system has one, else 0), then the first 16 bytes of an HMAC-SHA256 of all
that under the export's secret key. The key lives in a file in the server's
state directory, so handles survive a restart; a handle whose MAC does not
match (forged, altered, from another server) is NFS3ERR_BADHANDLE.

:class:`Resolver` maps an object's identity back to an open ``O_PATH`` file
descriptor: it keeps an inode -> path cache, re-walks the cached path one
component at a time (``O_NOFOLLOW``, relative to the export's root
descriptor, so nothing outside the export is reachable), and when the path
no longer leads to that inode searches the export breadth first, up to a
bound. An object it cannot find, or whose generation changed (the inode was
reused), is NFS3ERR_STALE. The export's root's generation is asked once: the
resolver holds the root open, so its inode cannot be reused meanwhile. A caller that must
not block for long (the event loop) asks :meth:`Resolver.find` not to
search, and gets :class:`SearchNeeded` where a search would begin.

:class:`HandleCodec` remembers the handles it has verified (a bounded
cache keyed by the handle's bytes), so a client's handles cost one MAC each
until the cache fills.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import logging
import os
import stat
import struct
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from rdmashim.ulps.nfsrdma.nfs3_types import NFS3ERR_BADHANDLE, NFS3ERR_STALE, NfsError

log = logging.getLogger(__name__)

_FORMAT: Final = 1
_BODY = struct.Struct(">BIQQI")
_MAC_SIZE: Final = 16
HANDLE_SIZE: Final = _BODY.size + _MAC_SIZE
KEY_SIZE: Final = 32
VERIFIED_CACHE: Final = 4096
"""Handles :class:`HandleCodec` keeps as verified (all forgotten when it is full)."""
_FS_IOC_GETVERSION: Final = 0x80087601

PATH_FLAGS: Final = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
"""How every object is opened: a reference to the object itself, never a symlink's target."""

RelPath = tuple[str, ...]
"""A path inside an export, as its components."""


@dataclass(frozen=True, slots=True)
class ObjectId:
    """What a handle names: an object's device, inode number and generation."""

    dev: int
    ino: int
    gen: int


def export_id_of(name: str) -> int:
    """The 32-bit id of an export, from its name (stable across restarts)."""
    return int.from_bytes(hashlib.sha256(name.encode("utf-8", "surrogateescape")).digest()[:4])


def load_key(state_dir: Path, export_id: int) -> bytes:
    """The export's secret key from ``state_dir``, created (mode 0600) on first use."""
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / f"export-{export_id:08x}.key"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        key = path.read_bytes()
        if len(key) != KEY_SIZE:
            raise ValueError(f"{path}: {len(key)} bytes, a key has {KEY_SIZE}") from None
        return key
    key = os.urandom(KEY_SIZE)
    try:
        os.write(fd, key)
        os.fsync(fd)
    finally:
        os.close(fd)
    log.info("new handle key %s", path)
    return key


def generation(fd: int, st: os.stat_result) -> int:
    """The inode generation of the object ``fd`` (``O_PATH``) refers to; 0 if unknown.

    Only regular files and directories are opened to ask (opening a device
    could have side effects).
    """
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        return 0
    try:
        real = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError:
        return 0
    try:
        raw = fcntl.ioctl(real, _FS_IOC_GETVERSION, bytes(8))
    except OSError:
        return 0
    finally:
        os.close(real)
    return int.from_bytes(raw[:4], "little") if raw else 0


class SearchNeeded(Exception):
    """:meth:`Resolver.find` without searching: the cached path no longer leads to the object."""


class HandleCodec:
    """Makes and checks the handles of one export."""

    def __init__(self, export_id: int, key: bytes) -> None:
        self.export_id = export_id
        self._key = key
        self._verified: dict[bytes, ObjectId] = {}

    def _mac(self, body: bytes) -> bytes:
        return hmac.new(self._key, body, hashlib.sha256).digest()[:_MAC_SIZE]

    def encode(self, oid: ObjectId) -> bytes:
        """The handle of ``oid``."""
        body = _BODY.pack(_FORMAT, self.export_id, oid.dev, oid.ino, oid.gen & 0xFFFFFFFF)
        return body + self._mac(body)

    def decode(self, fh: bytes) -> ObjectId:
        """The object a handle names; NfsError(BADHANDLE) unless this export made it."""
        oid = self._verified.get(fh)
        if oid is not None:
            return oid
        if len(fh) != HANDLE_SIZE:
            raise NfsError(NFS3ERR_BADHANDLE, f"{len(fh)}-byte handle")
        body, mac = fh[: _BODY.size], fh[_BODY.size :]
        fmt, export_id, dev, ino, gen = _BODY.unpack(body)
        if fmt != _FORMAT or export_id != self.export_id:
            raise NfsError(NFS3ERR_BADHANDLE, "not this export's handle")
        if not hmac.compare_digest(mac, self._mac(body)):
            raise NfsError(NFS3ERR_BADHANDLE, "handle MAC mismatch")
        oid = ObjectId(dev, ino, gen)
        if len(self._verified) >= VERIFIED_CACHE:
            self._verified.clear()
        self._verified[bytes(fh)] = oid
        return oid


def handle_export_id(fh: bytes) -> int | None:
    """The export id a handle claims (unchecked), None if it is not one of ours."""
    if len(fh) != HANDLE_SIZE or fh[0] != _FORMAT:
        return None
    return int(_BODY.unpack(fh[: _BODY.size])[1])


class Resolver:
    """Finds an export's objects by identity: a bounded inode -> path cache, then a search.

    ``root_fd`` is an ``O_PATH`` descriptor of the export's root; every walk
    starts there and opens one component at a time without following links.
    """

    def __init__(self, root_fd: int, *, cache_size: int = 65536, search_limit: int = 100_000):
        self.root_fd = root_fd
        root = os.stat(root_fd)
        self.root_key = (root.st_dev, root.st_ino)
        self.root_gen = generation(root_fd, root)
        self._cache: OrderedDict[tuple[int, int], RelPath] = OrderedDict()
        self._cache_size = cache_size
        self._search_limit = search_limit
        self._lock = threading.Lock()

    def walk(self, path: RelPath) -> int:
        """An ``O_PATH`` descriptor of ``path``, opened component by component, no links."""
        fd = os.dup(self.root_fd)
        try:
            for i, name in enumerate(path):
                flags = PATH_FLAGS if i == len(path) - 1 else PATH_FLAGS | os.O_DIRECTORY
                nxt = os.open(name, flags, dir_fd=fd)
                os.close(fd)
                fd = nxt
        except BaseException:
            os.close(fd)
            raise
        return fd

    def remember(self, st: os.stat_result, path: RelPath) -> None:
        """Note where an object is (after a lookup, create, rename, listing)."""
        key = (st.st_dev, st.st_ino)
        with self._lock:
            self._cache[key] = path
            self._cache.move_to_end(key)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)

    def cached(self, st: os.stat_result) -> RelPath | None:
        """Where an object was last seen."""
        if (st.st_dev, st.st_ino) == self.root_key:
            return ()
        with self._lock:
            return self._cache.get((st.st_dev, st.st_ino))

    def _try(self, oid: ObjectId, path: RelPath) -> tuple[int, os.stat_result] | None:
        try:
            fd = self.walk(path)
        except OSError:
            return None
        st = os.stat(fd)
        if (st.st_dev, st.st_ino) == (oid.dev, oid.ino):
            return fd, st
        os.close(fd)
        return None

    def find(self, oid: ObjectId, *, search: bool = True) -> tuple[int, os.stat_result, RelPath]:
        """An ``O_PATH`` descriptor, the stat and the path of ``oid``; NfsError(STALE) if gone.

        With ``search`` False, :class:`SearchNeeded` where the export would be searched.
        """
        key = (oid.dev, oid.ino)
        if key == self.root_key:
            self._check_root(oid)
            fd = os.dup(self.root_fd)
            return fd, os.stat(fd), ()
        with self._lock:
            path = self._cache.get(key)
        found = self._try(oid, path) if path is not None else None
        if found is None:
            if not search:
                raise SearchNeeded(oid)
            path = self._search(oid)
            found = self._try(oid, path) if path is not None else None
        if found is None or path is None:
            raise NfsError(NFS3ERR_STALE, f"no inode {oid.ino}")
        fd, st = found
        if oid.gen and generation(fd, st) not in (0, oid.gen):
            os.close(fd)
            raise NfsError(NFS3ERR_STALE, f"inode {oid.ino} reused")
        self.remember(st, path)
        return fd, st, path

    def stat(self, oid: ObjectId, *, search: bool = True) -> os.stat_result:
        """The attributes of ``oid`` now, as :meth:`find` finds it, holding nothing open
        (the root's are asked of the descriptor the resolver holds)."""
        if (oid.dev, oid.ino) == self.root_key:
            self._check_root(oid)
            return os.stat(self.root_fd)
        fd, st, _ = self.find(oid, search=search)
        os.close(fd)
        return st

    def _check_root(self, oid: ObjectId) -> None:
        """NfsError(STALE) if ``oid`` names the root's inode of another generation (the
        root is held open by ``root_fd``: its generation stays what it was)."""
        if oid.gen and self.root_gen not in (0, oid.gen):
            raise NfsError(NFS3ERR_STALE, f"inode {oid.ino} reused")

    def _search(self, oid: ObjectId) -> RelPath | None:
        """Breadth first through the export (not across devices), at most the bound."""
        queue: deque[RelPath] = deque([()])
        seen = 0
        while queue:
            parent = queue.popleft()
            try:
                fd = self.walk(parent)
                listing = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
                os.close(fd)
            except OSError:
                continue
            try:
                with os.scandir(listing) as entries:
                    for entry in entries:
                        seen += 1
                        if seen > self._search_limit:
                            log.warning("handle search stopped after %d entries", seen - 1)
                            return None
                        path = (*parent, entry.name)
                        with contextlib.suppress(OSError):
                            st = entry.stat(follow_symlinks=False)
                            if st.st_dev != oid.dev:
                                continue
                            if st.st_ino == oid.ino:
                                return path
                            if stat.S_ISDIR(st.st_mode):
                                self.remember(st, path)
                                queue.append(path)
            finally:
                os.close(listing)
        return None
