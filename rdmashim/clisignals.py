"""Ctrl-C and SIGTERM for the commands that run under trio (see :mod:`rdmashim.cliargs`)."""

from __future__ import annotations

import signal
from collections.abc import Callable

import trio


class Signals:
    """SIGINT and SIGTERM caught by a trio command: ``status`` is 128 + the signal's number.

    ``await nursery.start(signals.watch, on_first)`` returns once the signals are
    caught (from then on Ctrl-C no longer raises KeyboardInterrupt by itself);
    the first one sets ``stopped`` and calls ``on_first()``, which ends what
    runs (cancels it, or raises KeyboardInterrupt); a second one raises
    KeyboardInterrupt, for a user who does not want to wait for the end.
    """

    def __init__(self) -> None:
        self.status = 0
        self.stopped = trio.Event()

    async def watch(
        self,
        on_first: Callable[[], None] = lambda: None,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            task_status.started()
            async for signum in signals:
                if self.stopped.is_set():
                    raise KeyboardInterrupt
                self.status = 128 + signum
                self.stopped.set()
                on_first()


__all__ = ["Signals"]
