"""The Network Lock Manager's XDR (program 100021): versions 1, 3 and 4, pure codecs.

NLM version 4 (RFC 1813, "NLM protocol" section; the Open Group's XNFS
"Network Lock Manager Protocol") is what an NFSv3 client speaks; versions 1
and 3 carry the same structures with 32-bit offsets and lengths instead of
64-bit ones, and fewer status values. Every function here takes the version
and encodes or decodes the matching form; nothing does I/O.

Cookies and owner handles (``netobj``) are at most 1024 bytes, names
(``caller_name``) at most 1024 (``LM_MAXSTRLEN``); longer is an
:class:`~.xdr.XdrError` (GARBAGE_ARGS).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Final

from rdmashim.ulps.nfsrdma.nfs3_types import unpack_enum
from rdmashim.ulps.nfsrdma.xdr import Packer, Unpacker

NLM_PROG: Final = 100021
NLM_V1: Final = 1
NLM_V3: Final = 3
NLM_V4: Final = 4
SERVED_VERSIONS: Final = (NLM_V1, NLM_V3, NLM_V4)
"""The versions registered with rpcbind (version 2 never existed as a protocol of its own)."""

LM_MAXSTRLEN: Final = 1024
MAXNETOBJ_SZ: Final = 1024

# procedures (the same numbers in every version; 20 and up from version 3)
NLMPROC_NULL: Final = 0
NLMPROC_TEST: Final = 1
NLMPROC_LOCK: Final = 2
NLMPROC_CANCEL: Final = 3
NLMPROC_UNLOCK: Final = 4
NLMPROC_GRANTED: Final = 5
NLMPROC_TEST_MSG: Final = 6
NLMPROC_GRANTED_RES: Final = 15
NLMPROC_SHARE: Final = 20
NLMPROC_UNSHARE: Final = 21
NLMPROC_NM_LOCK: Final = 22
NLMPROC_FREE_ALL: Final = 23


class Nlm4Stat(IntEnum):
    """``nlm4_stats`` (version 4); versions 1 and 3 know only the first six."""

    GRANTED = 0
    DENIED = 1
    DENIED_NOLOCKS = 2
    BLOCKED = 3
    DENIED_GRACE_PERIOD = 4
    DEADLCK = 5
    ROFS = 6
    STALE_FH = 7
    FBIG = 8
    FAILED = 9


def wire_stat(stat: Nlm4Stat, vers: int) -> int:
    """``stat`` as version ``vers`` says it: before 4, DEADLCK is DENIED and the
    version-4-only statuses are DENIED_NOLOCKS (what Linux's lockd answers too)."""
    if vers == NLM_V4 or stat <= Nlm4Stat.DENIED_GRACE_PERIOD:
        return int(stat)
    return int(Nlm4Stat.DENIED if stat is Nlm4Stat.DEADLCK else Nlm4Stat.DENIED_NOLOCKS)


class ShareMode(IntEnum):
    """``fsh4_mode``: what a DOS share reservation denies others."""

    DENY_NONE = 0
    DENY_READ = 1
    DENY_WRITE = 2
    DENY_READ_WRITE = 3


class ShareAccess(IntEnum):
    """``fsh4_access``: what a DOS share reservation opens the file for."""

    NONE = 0
    READ = 1
    WRITE = 2
    READ_WRITE = 3


@dataclass(frozen=True, slots=True)
class Lock:
    """``nlm4_lock``: a byte range of a file, as one owner (``caller_name``, ``svid``) names it."""

    caller_name: str
    fh: bytes
    oh: bytes
    svid: int
    offset: int
    length: int
    """0: from ``offset`` to the end of the file, however far it grows."""


@dataclass(frozen=True, slots=True)
class LockArgs:
    """``nlm4_lockargs`` (LOCK, NM_LOCK)."""

    cookie: bytes
    block: bool
    exclusive: bool
    lock: Lock
    reclaim: bool = False
    state: int = 0


@dataclass(frozen=True, slots=True)
class TestArgs:
    """``nlm4_testargs`` (TEST, and GRANTED, the server's callback)."""

    cookie: bytes
    exclusive: bool
    lock: Lock


@dataclass(frozen=True, slots=True)
class CancArgs:
    """``nlm4_cancargs`` (CANCEL)."""

    cookie: bytes
    block: bool
    exclusive: bool
    lock: Lock


@dataclass(frozen=True, slots=True)
class UnlockArgs:
    """``nlm4_unlockargs`` (UNLOCK)."""

    cookie: bytes
    lock: Lock


@dataclass(frozen=True, slots=True)
class Share:
    """``nlm4_share``: a DOS share reservation of a file by one owner."""

    caller_name: str
    fh: bytes
    oh: bytes
    mode: ShareMode
    access: ShareAccess


@dataclass(frozen=True, slots=True)
class ShareArgs:
    """``nlm4_shareargs`` (SHARE, UNSHARE)."""

    cookie: bytes
    share: Share
    reclaim: bool = False


@dataclass(frozen=True, slots=True)
class Notify:
    """``nlm4_notify`` (FREE_ALL): a host that has rebooted and its new NSM state."""

    name: str
    state: int


@dataclass(frozen=True, slots=True)
class Holder:
    """``nlm4_holder``: who holds the lock a TEST ran into."""

    exclusive: bool
    svid: int
    oh: bytes
    offset: int
    length: int


# -- encoders (what a client sends, and the server's results) ---------------------------------


def _pack_range(p: Packer, offset: int, length: int, vers: int) -> None:
    if vers == NLM_V4:
        p.uhyper(offset)
        p.uhyper(length)
    else:
        p.uint(offset)
        p.uint(length)


def _unpack_range(u: Unpacker, vers: int) -> tuple[int, int]:
    if vers == NLM_V4:
        return u.uhyper(), u.uhyper()
    return u.uint(), u.uint()


def pack_lock(p: Packer, lock: Lock, vers: int) -> None:
    """An ``nlm4_lock`` (``nlm_lock`` before version 4)."""
    p.string(lock.caller_name)
    p.opaque(lock.fh)
    p.opaque(lock.oh)
    p.int32(lock.svid)
    _pack_range(p, lock.offset, lock.length, vers)


def unpack_lock(u: Unpacker, vers: int) -> Lock:
    """An ``nlm4_lock`` (``nlm_lock`` before version 4)."""
    caller = u.string(LM_MAXSTRLEN)
    fh, oh, svid = u.opaque(MAXNETOBJ_SZ), u.opaque(MAXNETOBJ_SZ), u.int32()
    offset, length = _unpack_range(u, vers)
    return Lock(caller, fh, oh, svid, offset, length)


def pack_lockargs(p: Packer, args: LockArgs, vers: int) -> None:
    """An ``nlm4_lockargs``."""
    p.opaque(args.cookie)
    p.boolean(args.block)
    p.boolean(args.exclusive)
    pack_lock(p, args.lock, vers)
    p.boolean(args.reclaim)
    p.int32(args.state)


def unpack_lockargs(u: Unpacker, vers: int) -> LockArgs:
    """An ``nlm4_lockargs``."""
    cookie, block, exclusive = u.opaque(MAXNETOBJ_SZ), u.boolean(), u.boolean()
    lock = unpack_lock(u, vers)
    return LockArgs(cookie, block, exclusive, lock, u.boolean(), u.int32())


def pack_testargs(p: Packer, args: TestArgs, vers: int) -> None:
    """An ``nlm4_testargs``."""
    p.opaque(args.cookie)
    p.boolean(args.exclusive)
    pack_lock(p, args.lock, vers)


def unpack_testargs(u: Unpacker, vers: int) -> TestArgs:
    """An ``nlm4_testargs``."""
    cookie, exclusive = u.opaque(MAXNETOBJ_SZ), u.boolean()
    return TestArgs(cookie, exclusive, unpack_lock(u, vers))


def pack_cancargs(p: Packer, args: CancArgs, vers: int) -> None:
    """An ``nlm4_cancargs``."""
    p.opaque(args.cookie)
    p.boolean(args.block)
    p.boolean(args.exclusive)
    pack_lock(p, args.lock, vers)


def unpack_cancargs(u: Unpacker, vers: int) -> CancArgs:
    """An ``nlm4_cancargs``."""
    cookie, block, exclusive = u.opaque(MAXNETOBJ_SZ), u.boolean(), u.boolean()
    return CancArgs(cookie, block, exclusive, unpack_lock(u, vers))


def pack_unlockargs(p: Packer, args: UnlockArgs, vers: int) -> None:
    """An ``nlm4_unlockargs``."""
    p.opaque(args.cookie)
    pack_lock(p, args.lock, vers)


def unpack_unlockargs(u: Unpacker, vers: int) -> UnlockArgs:
    """An ``nlm4_unlockargs``."""
    cookie = u.opaque(MAXNETOBJ_SZ)
    return UnlockArgs(cookie, unpack_lock(u, vers))


def pack_shareargs(p: Packer, args: ShareArgs) -> None:
    """An ``nlm4_shareargs`` (the same in versions 3 and 4)."""
    p.opaque(args.cookie)
    share = args.share
    p.string(share.caller_name)
    p.opaque(share.fh)
    p.opaque(share.oh)
    p.uint(share.mode)
    p.uint(share.access)
    p.boolean(args.reclaim)


def unpack_shareargs(u: Unpacker) -> ShareArgs:
    """An ``nlm4_shareargs``; a mode or access outside its enum is an XdrError."""
    cookie = u.opaque(MAXNETOBJ_SZ)
    caller, fh, oh = u.string(LM_MAXSTRLEN), u.opaque(MAXNETOBJ_SZ), u.opaque(MAXNETOBJ_SZ)
    mode = ShareMode(unpack_enum(u, len(ShareMode), "fsh4_mode"))
    access = ShareAccess(unpack_enum(u, len(ShareAccess), "fsh4_access"))
    return ShareArgs(cookie, Share(caller, fh, oh, mode, access), u.boolean())


def pack_notify(p: Packer, notify: Notify) -> None:
    """An ``nlm4_notify``."""
    p.string(notify.name)
    p.int32(notify.state)


def unpack_notify(u: Unpacker) -> Notify:
    """An ``nlm4_notify`` (its name is at most ``LM_MAXSTRLEN + 1`` bytes)."""
    return Notify(u.string(LM_MAXSTRLEN + 1), u.int32())


def pack_res(p: Packer, cookie: bytes, stat: Nlm4Stat, vers: int) -> None:
    """An ``nlm4_res``: the cookie and a status (LOCK, CANCEL, UNLOCK, GRANTED)."""
    p.opaque(cookie)
    p.uint(wire_stat(stat, vers))


def unpack_res(u: Unpacker) -> tuple[bytes, Nlm4Stat]:
    """An ``nlm4_res``; a status outside the enum is an XdrError."""
    cookie = u.opaque(MAXNETOBJ_SZ)
    return cookie, Nlm4Stat(unpack_enum(u, len(Nlm4Stat), "nlm4_stats"))


def pack_testres(
    p: Packer, cookie: bytes, stat: Nlm4Stat, holder: Holder | None, vers: int
) -> None:
    """An ``nlm4_testres``: the holder follows DENIED.

    Before version 4 the holder's range is clipped to 32 bits (a range past
    4 GiB, or to the end, reads as to the end from its clipped offset).
    """
    p.opaque(cookie)
    p.uint(wire_stat(stat, vers))
    if stat is Nlm4Stat.DENIED:
        assert holder is not None, "DENIED carries the holder"
        p.boolean(holder.exclusive)
        p.int32(holder.svid)
        p.opaque(holder.oh)
        offset, length = holder.offset, holder.length
        if vers != NLM_V4:
            offset = min(offset, 0xFFFF_FFFF)
            length = length if offset + length <= 0xFFFF_FFFF else 0
        _pack_range(p, offset, length, vers)


def unpack_testres(u: Unpacker, vers: int) -> tuple[bytes, Nlm4Stat, Holder | None]:
    """An ``nlm4_testres``."""
    cookie = u.opaque(MAXNETOBJ_SZ)
    stat = Nlm4Stat(unpack_enum(u, len(Nlm4Stat), "nlm4_stats"))
    if stat is not Nlm4Stat.DENIED:
        return cookie, stat, None
    exclusive, svid, oh = u.boolean(), u.int32(), u.opaque(MAXNETOBJ_SZ)
    offset, length = _unpack_range(u, vers)
    return cookie, stat, Holder(exclusive, svid, oh, offset, length)


def pack_shareres(p: Packer, cookie: bytes, stat: Nlm4Stat, vers: int) -> None:
    """An ``nlm4_shareres`` (its ``sequence`` is unused: always 0)."""
    pack_res(p, cookie, stat, vers)
    p.int32(0)


def unpack_shareres(u: Unpacker) -> tuple[bytes, Nlm4Stat]:
    """An ``nlm4_shareres``: the cookie and status (the sequence is dropped)."""
    cookie, stat = unpack_res(u)
    u.int32()
    return cookie, stat
