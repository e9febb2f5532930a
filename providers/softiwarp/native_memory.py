"""The native engine's memory table: every region in Python's table and in C's.

The engine in C checks and places into regions through its own table
(``rs_mem`` in ``_engine.c``); the verbs objects and the work request checks
(:mod:`.native_wr`) look regions up in Python's (:class:`~.memory.MemoryTable`).
:class:`NativeMemoryTable` keeps the two the same: a region is added to both, and
removed from C first, which stops every QP using it, so no byte is placed into a
region after its ``close()`` returns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from rdmashim.providers.softiwarp import native
from rdmashim.providers.softiwarp.memory import MemoryTable, Region
from rdmashim.providers.softiwarp.native import ffi
from rdmashim.verbs.enums import Access


@dataclass(slots=True)
class NativeMemoryTable(MemoryTable):
    """The device's memory table, mirrored into the C table the engine checks: a region
    is added to both, and deregistered from C first (which stops every QP using it,
    ``rs_mem_remove``), then from Python."""

    native: native.NativeMemory = field(default_factory=native.NativeMemory)
    after_removal: Callable[[], None] = lambda: None
    """Called after each deregistration (the context syncs its QPs)."""

    def register(self, pd: object, view: memoryview, addr: int, access: Access) -> Region:
        """Add a region to both tables."""
        region = MemoryTable.register(self, pd, view, addr, access)
        where = ffi.from_buffer(view)  # (view is pinned by the MR: the address holds)
        base = int(ffi.cast("uintptr_t", where))
        ffi.release(where)
        try:
            self.native.add(region.stag, base, addr, view.nbytes, access, pd)
        except BaseException:
            MemoryTable.deregister(self, region)
            raise
        return region

    def deregister(self, region: Region) -> None:
        """Remove a region from C (no QP uses it after this), then from Python."""
        self.native.remove(region.stag)
        MemoryTable.deregister(self, region)
        self.after_removal()

    def lookup(self, stag: int) -> Region | None:
        """The valid region ``stag`` names (a Send with Invalidate invalidates in C)."""
        region = MemoryTable.lookup(self, stag)
        if region is not None and not self.native.valid(stag):
            region.valid = False
            return None
        return region
