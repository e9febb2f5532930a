"""A nursery for background work that leaves the caller's exceptions alone.

trio wraps an exception raised in a nursery's body in an ExceptionGroup. The
objects that own background tasks (an opened device, a CM event channel) use
:func:`service_nursery` instead, so ``except ConnectionRejected:`` around
their ``async with`` block works as a user expects. Leaving the block cancels
the background tasks; an error in one of them still comes out as a group.
Work split into tasks that the caller waits for (a file moved in pieces) uses
:func:`unwrapping_nursery`: its first error comes out as itself.
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


def leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups, in order; ``exc`` itself otherwise."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in leaves(sub)]
    return [exc]


@asynccontextmanager
async def unwrapping_nursery() -> AsyncIterator[trio.Nursery]:
    """A nursery whose failure comes out as its first error itself, not in an
    ExceptionGroup, so ``except NfsError:`` around a call that runs its pieces in
    tasks works as a user expects. Several errors: the first, the group chained as its
    cause. A cancellation alone passes as it came."""
    try:
        async with trio.open_nursery() as nursery:
            yield nursery
    except BaseExceptionGroup as group:
        real = [leaf for leaf in leaves(group) if not isinstance(leaf, trio.Cancelled)]
        if not real:
            raise
        raise real[0] from (group if len(real) > 1 else None)
