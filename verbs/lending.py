"""A socket lent to a waiting task, given back to its reader before trio waits for I/O.

A task that waits for a message may read a connection's socket in place of the
connection's reader task, so the socket wakes it directly (no task switch per
message). When its wait ends with what it waited for, it usually waits again
before the run loop next waits for I/O (a ping-pong) and takes the socket on;
the reader task, parked meanwhile, need not wake in between. The socket is
*lent*: :class:`Lender`, one per trio run, gives every socket still lent back
to its reader (:meth:`Lent.hand_back`) when the run loop is about to wait for
I/O. The built-in engine's :class:`~rdmashim.providers.softiwarp.driver.Link` and
RDS/TCP's session lend so, each through a :class:`Loan`; the task a socket is lent
to waits for it on a :class:`WaitPoint`.
"""

from __future__ import annotations

import os
import select
from typing import Protocol

import trio

from rdmashim.verbs import idle

READS_BEFORE_YIELD = 16
"""Reads in a row that found bytes waiting (a long stream), with no wait between them,
after which a reader yields to the other tasks. A wait through trio, or an idle one
(:meth:`WaitPoint.block`, which begins only while trio has nothing to do and ends when
it has), starts the count again: a yield after such a wait would only delay the
answer to the message it brought. A busy poll's reads count: a due turn is taken at
the start of the next wait, while the peer works on our last message."""


class Lent(Protocol):
    """What lends its socket: :meth:`hand_back` wakes its parked reader task."""

    def hand_back(self) -> None: ...


class Lender(trio.abc.Instrument):
    """Gives lent sockets back to their readers when the trio run loop is about to
    wait for I/O (installed by :meth:`Loan.lend` when a socket is first lent): a waiter
    that did not wait again by then left the socket, and its reader reads it from the
    next loop pass on."""

    def __init__(self) -> None:
        self.lent: set[Lent] = set()

    def before_io_wait(self, timeout: float) -> None:
        """Called by trio before each wait for I/O (``timeout`` 0 when tasks are ready)."""
        if not self.lent:
            return
        lent, self.lent = self.lent, set()
        for item in lent:
            item.hand_back()
        if timeout > 0:
            # The loop was about to sleep with the readers now ready: wake it.
            trio.lowlevel.current_trio_token().run_sync_soon(_nothing)


def _nothing() -> None:
    """What :class:`Lender` runs to end the loop's wait for I/O at once."""


_LENDER: trio.lowlevel.RunVar[Lender] = trio.lowlevel.RunVar("rdmashim_lender")


def _lender_of_run() -> Lender:
    """This trio run's :class:`Lender`, installed on first use."""
    try:
        return _LENDER.get()
    except LookupError:
        found = Lender()
        trio.lowlevel.add_instrument(found)
        _LENDER.set(found)
        return found


class Loan:
    """One socket's lending: whether it is lent now, and this run's :class:`Lender`,
    kept (a RunVar lookup costs about 0.3 us, once a message; a socket lives in one
    run). The owner's :meth:`Lent.hand_back` calls :meth:`returned`."""

    __slots__ = ("_lender", "_owner", "active")

    def __init__(self, owner: Lent) -> None:
        self._owner = owner
        self._lender: Lender | None = None
        self.active = False
        """Lent: the reader stays parked until the lender hands the socket back."""

    def lend(self) -> None:
        """Leave the reader parked; the lender hands the socket back before trio next
        waits for I/O unless :meth:`end` comes first."""
        lender = self._lender
        if lender is None:
            lender = self._lender = _lender_of_run()
        lender.lent.add(self._owner)
        self.active = True

    def end(self) -> bool:
        """Take the socket off the lender (a new wait takes it on, or the connection
        ends); whether it was lent."""
        if not self.active:
            return False
        assert self._lender is not None
        self._lender.lent.discard(self._owner)
        self.active = False
        return True

    def returned(self) -> None:
        """The lender handed the socket back."""
        self.active = False


class WaitPoint:
    """What a task reading a socket in place of its reader waits on: a descriptor of its
    own (a ``dup`` of the socket's), so that :meth:`interrupt` ends that wait, and no
    other, with ``notify_closing``; a cancel scope per wait costs more than the task
    switch the wait saves."""

    __slots__ = ("_blocked", "_fd", "_lender", "_looked", "_loop", "_poller")

    def __init__(self) -> None:
        self._fd = -1
        self._blocked = False
        self._loop: idle.IdleLoop | None = None
        """This run's loop for idle waits (None: not possible here)."""
        self._looked = False
        self._lender: Lender | None = None
        self._poller: select.poll | None = None

    def open(self, fd: int) -> None:
        """Start serving the socket ``fd`` (:meth:`close` ends it)."""
        self._fd = os.dup(fd)

    async def wait_readable(self) -> None:
        """Wait until the socket is readable, :meth:`interrupt` or :meth:`close`."""
        self._blocked = True
        try:
            await trio.lowlevel.wait_readable(self._fd)
        except trio.ClosedResourceError:
            pass  # interrupt(), or the connection ended
        finally:
            self._blocked = False

    def idle(self) -> tuple[int, int] | None:
        """``(trio's epoll descriptor, milliseconds)`` when the task may wait for the
        socket in a system call of its own now (:mod:`~rdmashim.verbs.idle`): no other
        task is ready and no other socket is lent (its reader is parked, so trio does not
        watch it); None when it must wait through trio."""
        if not self._looked:  # (a socket lives in one run)
            self._looked = True
            self._loop, self._lender = idle.current(), _lender_of_run()
        loop = self._loop
        if loop is None or self._lender is None or self._lender.lent:
            return None
        ms = loop.budget_ms()
        return (loop.epoll_fd, ms) if ms > 0 else None

    def block(self) -> bool:
        """Wait for the socket in a system call of its own (see :meth:`idle`); whether
        it is readable now. False at once when the task must wait through trio, and as
        soon as anything trio watches is ready (trio's turn first, then)."""
        found = self.idle()
        if found is None:
            return False
        epoll_fd, ms = found
        poller = self._poller
        if poller is None:
            poller = self._poller = select.poll()
            poller.register(self._fd, select.POLLIN)
            poller.register(epoll_fd, select.POLLIN)
        events = poller.poll(ms)
        return len(events) == 1 and events[0][0] == self._fd

    def interrupt(self) -> None:
        """End a wait in progress now (what it waits for came another way)."""
        if self._blocked:
            self._blocked = False
            trio.lowlevel.notify_closing(self._fd)

    def close(self) -> None:
        """End any wait and let the descriptor go (idempotent)."""
        if self._fd >= 0:
            trio.lowlevel.notify_closing(self._fd)
            os.close(self._fd)
            self._fd = -1
