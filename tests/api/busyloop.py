"""Watching trio's run loop sleep, for the busy-polling tests.

Before each wait for I/O the run loop tells its instruments how long it may
sleep: 0 when a task is ready to run. A wait that busy-polls keeps its task
ready, so the loop never sleeps until the wait ends or its polling time is up.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager

import trio


class LoopSleeps(trio.abc.Instrument):
    """Counts the run loop's waits for I/O that may sleep, and when the first came."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.sleeps = 0
        self.first_sleep = math.inf
        """Seconds from the start to the first wait that could sleep."""

    def before_io_wait(self, timeout: float) -> None:
        if timeout > 0:
            if not self.sleeps:
                self.first_sleep = time.perf_counter() - self.start
            self.sleeps += 1


@contextmanager
def loop_sleeps() -> Iterator[LoopSleeps]:
    """A :class:`LoopSleeps` installed for the block."""
    watch = LoopSleeps()
    trio.lowlevel.add_instrument(watch)
    try:
        yield watch
    finally:
        trio.lowlevel.remove_instrument(watch)
