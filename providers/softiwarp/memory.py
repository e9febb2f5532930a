"""The engine's memory table: STags, protection domains and access checks.

An STag is a 24-bit index and an 8-bit key, as in Linux siw; the lkey and the
rkey of a region are the same STag. Tagged offsets (TO) are virtual addresses.
Index and key are drawn at random (from the operating system's CSPRNG, as
``secrets`` does), so a peer that was never given an STag cannot derive one from
those it saw.
"""

from __future__ import annotations

import os
import threading
import weakref
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from rdmashim.providers.softiwarp.terminate import (
    DdpTaggedCode,
    RdmapCode,
    RdmapType,
    TermCode,
    ddp_tagged,
    rdmap,
)
from rdmashim.verbs.enums import Access

_INDEX_SPACE = 1 << 24
_POOL_BYTES = 4096


class _RandomWords:
    """32-bit words from ``os.urandom``, fetched :data:`_POOL_BYTES` at a time: one
    system call per 1024 registrations rather than two each (registering a buffer
    per RDMA operation is common). Safe across threads; a forked child draws afresh
    (the pool it inherited is its parent's)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool = b""
        self._pos = 0
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._lock = threading.Lock()
        self._pool, self._pos = b"", 0

    def draw(self) -> int:
        """A uniformly random integer below 2**32."""
        with self._lock:
            pos = self._pos
            if pos + 4 > len(self._pool):
                self._pool, pos = os.urandom(_POOL_BYTES), 0
            self._pos = pos + 4
            return int.from_bytes(self._pool[pos : pos + 4], "little")


_RANDOM = _RandomWords()
_REMOTE = int(Access.REMOTE_READ | Access.REMOTE_WRITE | Access.REMOTE_ATOMIC)


class Violation(Enum):
    """Why an access to registered memory was refused."""

    INVALID_STAG = "invalid STag"
    PD_MISMATCH = "STag of another protection domain"
    ACCESS = "access rights violation"
    BOUNDS = "base or bounds violation"

    def ddp_code(self) -> TermCode:
        """Terminate code for a tagged placement (DDP layer; Linux siw's mapping)."""
        return ddp_tagged(
            {
                Violation.INVALID_STAG: DdpTaggedCode.INVALID_STAG,
                Violation.PD_MISMATCH: DdpTaggedCode.STAG_NOT_ASSOC,
                # RFC 5041 has no code for missing rights; siw reports an invalid STag.
                Violation.ACCESS: DdpTaggedCode.INVALID_STAG,
                Violation.BOUNDS: DdpTaggedCode.BASE_BOUNDS,
            }[self]
        )

    def rdmap_code(self) -> TermCode:
        """Terminate code for an RDMA Read source (RDMAP layer, remote protection)."""
        return rdmap(
            RdmapType.REMOTE_PROTECTION,
            {
                Violation.INVALID_STAG: RdmapCode.INVALID_STAG,
                Violation.PD_MISMATCH: RdmapCode.STAG_NOT_ASSOC,
                Violation.ACCESS: RdmapCode.ACCESS_RIGHTS,
                Violation.BOUNDS: RdmapCode.BASE_BOUNDS,
            }[self],
        )


class AccessViolation(Exception):
    """An access to registered memory that the region does not allow."""

    def __init__(self, violation: Violation, stag: int, addr: int, length: int) -> None:
        super().__init__(f"{violation.value}: STag {stag:#010x} [{addr:#x}, +{length}]")
        self.violation = violation


@dataclass(eq=False, slots=True)
class Region:
    """A registered region as the engine sees it."""

    stag: int
    addr: int
    length: int
    access: Access
    pd: object
    view: memoryview
    valid: bool = True
    rights: int = 0
    """``access`` as a plain int (the data path tests bits without enum arithmetic)."""
    handle: object = None
    """The compiled kernels' reference to ``view`` (``kernels.Kernels.handle``), made on
    first use; dropped at deregistration, which releases the buffer it holds."""

    def __post_init__(self) -> None:
        self.rights = int(self.access)


class Holder(Protocol):
    """What may hold views of registered memory beyond one call (an engine's message in
    progress, a driver's bytes not yet written): told of each deregistration, it drops
    every view it holds into that region before the deregistration returns."""

    def revoke(self, region: Region) -> None:
        """``region`` is being deregistered: drop every view of it held."""


@dataclass(slots=True)
class MemoryTable:
    """All regions of one device, by STag index.

    Deregistration is the one release point of a region's memory: the table marks the
    region invalid (no check passes for it from then on) and has every :class:`Holder`
    watching the table drop its views of the region, so nothing is placed into it, or
    read from it, after :meth:`deregister` returns.
    """

    _regions: dict[int, Region] = field(default_factory=dict)
    _tokens: dict[object, object] = field(default_factory=dict)
    _holders: weakref.WeakSet[Holder] = field(default_factory=weakref.WeakSet)

    def watch(self, holder: Holder) -> None:
        """Tell ``holder`` of every deregistration from now on (for as long as it lives)."""
        self._holders.add(holder)

    def unwatch(self, holder: Holder) -> None:
        """Stop telling ``holder`` (it holds no view any more, and never will)."""
        self._holders.discard(holder)

    def token(self, pd: object) -> object:
        """An object that stays the same for ``pd`` until a region is deregistered or
        invalidated: what the engine checked of a region of ``pd`` under one token (that
        it is valid, in the PD, with its rights and bounds) holds while the token does."""
        token = self._tokens.get(pd)
        if token is None:
            token = self._tokens[pd] = object()
        return token

    def register(self, pd: object, view: memoryview, addr: int, access: Access) -> Region:
        """Add a region under a random unused STag (never 0 and never 1, the RTR STag)."""
        if len(self._regions) >= _INDEX_SPACE - 1:
            raise MemoryError("no free STag index left")
        while True:  # a random index and key; index 0 holds STags 0 and 1
            stag = _RANDOM.draw()
            if (index := stag >> 8) and index not in self._regions:
                break
        region = Region(stag, addr, view.nbytes, access, pd, view)
        self._regions[index] = region
        return region

    def deregister(self, region: Region) -> None:
        """Remove a region; its STag is invalid from now on, and no holder keeps a view
        of it."""
        region.valid = False
        self._tokens.clear()
        self._regions.pop(region.stag >> 8, None)
        for holder in list(self._holders):
            holder.revoke(region)
        region.handle = None

    def lookup(self, stag: int) -> Region | None:
        """The valid region an STag names, or None."""
        region = self._regions.get(stag >> 8)
        if region is None or region.stag != stag or not region.valid:
            return None
        return region

    def locate(
        self, stag: int, pd: object, addr: int, length: int, access: int
    ) -> tuple[Region, int]:
        """The region ``stag`` and the offset of ``[addr, addr + length)`` in it, checked for
        ``access`` (``Access`` bits; the data path passes them as a plain int)."""
        region = self._regions.get(stag >> 8)  # lookup(), inlined: once per message
        if region is None or region.stag != stag or not region.valid:
            raise AccessViolation(Violation.INVALID_STAG, stag, addr, length)
        if region.pd is not pd:
            raise AccessViolation(Violation.PD_MISMATCH, stag, addr, length)
        if int(access) & ~region.rights:
            raise AccessViolation(Violation.ACCESS, stag, addr, length)
        offset = addr - region.addr
        if offset < 0 or length < 0 or offset + length > region.length:
            raise AccessViolation(Violation.BOUNDS, stag, addr, length)
        return region, offset

    def resolve(self, stag: int, pd: object, addr: int, length: int, access: int) -> memoryview:
        """The bytes ``[addr, addr + length)`` of the region ``stag``, checked as by
        :meth:`locate`."""
        region, offset = self.locate(stag, pd, addr, length, access)
        return region.view[offset : offset + length]

    def invalidate(self, stag: int, pd: object) -> Violation | None:
        """Invalidate an STag for a Send with Invalidate; the violation if it cannot be.

        A region without remote access rights was never offered to a peer, so no peer
        may invalidate it (Linux siw allows any region of the PD; we refuse these).
        """
        region = self.lookup(stag)
        if region is None:
            return Violation.INVALID_STAG
        if region.pd is not pd:
            return Violation.PD_MISMATCH
        if not region.rights & _REMOTE:
            return Violation.ACCESS
        region.valid = False
        self._tokens.clear()
        return None
