"""Buffers reused from call to call, each handed out again only when nothing else refers
to it.

A megabyte made afresh for every call costs more than the call's own copy of it: the
allocator gives freed memory of that size back to the system, so each new buffer's
pages are faulted in and zeroed again (an NFS READ of 1 MiB spent about 40% of its
server's CPU there). A pool keeps a few buffers and hands one out again once the
pool holds the only reference to it: a view, an unpacker, a registration or a reply
still being sent pins its buffer, and the pool makes a new one meanwhile.

Used for the chunks of RPC-over-RDMA (:mod:`.rdma_endpoint`: a requester's Write
chunk, a responder's call stream) and for READ's data (:mod:`.nfs3`). A pool may be
shared by threads.
"""

from __future__ import annotations

import functools
import sys
import threading

POOL_BUFFERS = 8
"""Buffers a pool keeps for reuse by default (more may be out at once, unkept)."""
_ONLY_THE_POOL = 2
"""``sys.getrefcount`` of a pooled buffer no one holds: the pool's list and the argument."""


class BufferPool:
    """Up to ``keep`` buffers, each handed out again only when nothing else refers to it."""

    def __init__(self, keep: int = POOL_BUFFERS) -> None:
        self.keep = keep
        self._buffers: list[bytearray] = []
        self._lock = threading.Lock()
        self.made = 0
        """Buffers allocated (kept or not): a measure of reuse."""

    def take(self, size: int, *, zero: bool = True) -> bytearray:
        """A buffer of at least ``size`` bytes no one else refers to: a kept one (zeroed,
        unless ``zero`` is False: the caller uses only bytes it wrote) or a new one."""
        with self._lock:  # (two threads must not both find the same buffer free)
            buffers, smaller = self._buffers, -1
            for i in range(len(buffers)):
                if sys.getrefcount(buffers[i]) == _ONLY_THE_POOL:
                    if len(buffers[i]) >= size:
                        reused = buffers[i]
                        if zero:
                            with memoryview(reused) as view:
                                view[:] = _zeros(len(reused))
                        return reused
                    smaller = i
            self.made += 1
            fresh = bytearray(size)
            if len(buffers) < self.keep:
                buffers.append(fresh)
            elif smaller >= 0:
                buffers[smaller] = fresh
            return fresh


@functools.lru_cache(maxsize=4)
def _zeros(n: int) -> bytes:
    """``n`` zero bytes, kept for the few buffer sizes a pool has."""
    return bytes(n)
