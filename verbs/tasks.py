"""A nursery for background work that leaves the caller's exceptions alone.

trio wraps an exception raised in a nursery's body in an ExceptionGroup. The
objects that own background tasks (an opened device, a CM event channel) use
:func:`service_nursery` instead, so ``except ConnectionRejected:`` around
their ``async with`` block works as a user expects. Leaving the block cancels
the background tasks; an error in one of them still comes out as a group.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio


@asynccontextmanager
async def service_nursery() -> AsyncIterator[trio.Nursery]:
    """A nursery whose tasks are cancelled when the block ends; see the module docstring."""
    manager = trio.open_nursery()
    nursery = await manager.__aenter__()
    try:
        yield nursery
    except BaseException as exc:
        nursery.cancel_scope.cancel()
        if isinstance(exc, trio.Cancelled):
            if await manager.__aexit__(type(exc), exc, exc.__traceback__):
                return
            raise
        await manager.__aexit__(None, None, None)
        raise
    nursery.cancel_scope.cancel()
    await manager.__aexit__(None, None, None)
