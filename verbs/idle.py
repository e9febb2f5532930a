"""Waiting for one socket in a system call of its own while trio has nothing else to do.

A task that waits for its socket through trio pays for trio's wait for I/O: a
registration (``epoll_ctl``), the ``epoll_wait``, then a pass of the run loop that
wakes the task and resumes it through every frame it waits in. When no other task
is ready and nobody waits for the run to go idle, the task may instead wait in one
system call of its own (``poll``, without the GIL) on its socket **and on trio's own
epoll descriptor**: any other socket that trio watches, a signal, a callback from a
thread (trio's wake-up socket is in that epoll set) ends its wait at once, and so
does the run's next deadline (the call's timeout), and trio then takes over as
usual. A message that arrives is read by the waiting task right after the kernel
wakes it. Measured on the native engine (``benchmarks/bench.py --only send-lat``,
alternated before and after, ``docs/native-engine.md``), this took a half round
trip from 1.41 times raw trio TCP's to 0.86.

This reads trio's run loop's private state (its run queue, deadlines, clock and epoll
descriptor). Where that state is not what this module knows (another trio version,
another I/O backend such as kqueue or IOCP, guest mode, a clock other than trio's
own, or any attribute it reads missing), :func:`current` says None and tasks wait
through trio as before; ``tests/test_idle_wait.py`` fails when the installed trio no
longer matches (the project asks for trio >= 0.25; this was written against 0.35).
"""

from __future__ import annotations

import math
import select
from typing import Any

import trio

MAX_WAIT = 5.0
"""Seconds one idle wait lasts at most when the run has no deadline (a safety net:
trio's epoll descriptor ends it when anything else happens)."""


MAX_TASKS = 64
"""Tasks in the run above which no task waits idle (each wait looks at every task for
one that is about to run: about 0.04 us a task)."""


class IdleLoop:
    """This trio run's loop as a task that would wait in a system call sees it."""

    __slots__ = ("_runner", "epoll_fd")

    def __init__(self, runner: Any, epoll_fd: int) -> None:
        self._runner = runner
        self.epoll_fd = epoll_fd
        """trio's epoll descriptor: readable when anything trio watches is ready."""

    def budget_ms(self) -> int:
        """Milliseconds the calling task may wait in a system call of its own: 0 when
        another task is ready (queued, or in the batch the loop is running), someone
        waits for the run to go idle, the run has more than :data:`MAX_TASKS` tasks, or
        its next deadline is due (trio keeps the time then)."""
        runner = self._runner
        if runner.runq or runner.waiting_for_idle:
            return 0
        # The run loop takes its run queue in batches: tasks of this batch that have not
        # run yet are in no queue, only marked as about to be resumed.
        tasks = runner.tasks
        if len(tasks) > MAX_TASKS:
            return 0
        for task in tasks:
            if task._next_send_fn is not None:
                return 0
        left: float = runner.deadlines.next_deadline() - runner.clock.current_time()
        if left <= 0:
            return 0
        # Rounded up, as trio's own wait is (``epoll.poll`` rounds its timeout up to
        # whole milliseconds): a deadline less than one away is waited for a whole one
        # either way, and waiting here for it keeps a ping-pong's waits idle when a
        # timer is near (an RDS session's acknowledgement timer).
        return math.ceil(min(left, MAX_WAIT) * 1000)


_LOOP: trio.lowlevel.RunVar[IdleLoop | None] = trio.lowlevel.RunVar("rdmashim_idle_loop")


def current() -> IdleLoop | None:
    """This run's :class:`IdleLoop`, or None where an idle wait is not possible here."""
    try:
        return _LOOP.get()
    except LookupError:
        found = _probe()
        _LOOP.set(found)
        return found


def _probe() -> IdleLoop | None:
    """The run's loop when it is the kind this module knows: trio's own clock and its
    epoll backend, not in guest mode."""
    if not hasattr(select, "epoll"):
        return None
    try:
        from trio._core._run import GLOBAL_RUN_CONTEXT, SystemClock

        runner = GLOBAL_RUN_CONTEXT.runner
        epoll = runner.io_manager._epoll  # (another backend has none: AttributeError)
        if runner.is_guest or type(runner.clock) is not SystemClock:
            return None  # (a MockClock's autojump, too, needs trio's own idle waits)
        loop = IdleLoop(runner, epoll.fileno())
        loop.budget_ms()  # (every attribute it reads is there)
    except (ImportError, AttributeError, TypeError):
        return None
    return loop
