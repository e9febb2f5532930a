"""Busy polling: a CQ's waiting calls keep polling for a while before they block.

A task that blocks until a completion comes lets its CPU go idle, and waking an
idle CPU costs time: microseconds on a busy machine, tens of them in a VM whose
idle vCPUs halt. A ping-pong pays that twice per round trip. Polling instead, as
perftest's latency tools do by default and as Linux's ``SO_BUSY_POLL`` does for a
socket, keeps the CPU awake and sees the completion as soon as it is there, at
the price of the CPU time spent polling.

``CQ.busy_poll`` (seconds, on every backend) says how long :meth:`wait`,
:meth:`poll_wait`, :meth:`poll_wait_into` and :meth:`drive_until` poll after
the last thing that arrived before they block: 0 (the default) blocks at once,
``math.inf`` never blocks. Between tries the polling task yields to the other
tasks (trio's run loop then looks at the sockets without sleeping) and to the
other processes waiting for its CPU (``sched_yield``), so no task starves,
cancellation and deadlines act as in a blocking wait, and two processes polling
on one CPU still take turns.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

import trio

T = TypeVar("T")


def check_busy_poll(value: object) -> float:
    """``value`` as seconds of busy polling; ValueError unless it is a number >= 0."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or math.isnan(value)
        or value < 0
    ):
        raise ValueError(f"busy_poll: seconds >= 0 (math.inf: never block), not {value!r}")
    return float(value)


class BusyPoll:
    """The ``busy_poll`` attribute of a CQ class: seconds, checked when set, 0 at first."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = "_" + name

    def __get__(self, obj: object, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        return getattr(obj, self._name, 0.0)

    def __set__(self, obj: object, value: float) -> None:
        setattr(obj, self._name, check_busy_poll(value))


async def spin_until(ready: Callable[[], T], seconds: float) -> T:
    """Call ``ready()`` until it returns something true or ``seconds`` (real time) pass,
    yielding to the other tasks between calls; what it returned last. Never yields
    when the first call returns something true or ``seconds`` is 0."""
    got = ready()
    if got or not seconds:
        return got
    deadline = time.perf_counter() + seconds
    while True:
        await pause()
        got = ready()
        if got or time.perf_counter() >= deadline:
            return got


async def pause() -> None:
    """Between two polls: let the other tasks run (trio's run loop then looks at the
    sockets without sleeping), then any other process waiting for this CPU (so busy
    polling on a CPU shared with its peer does not hold the peer up)."""
    await trio.lowlevel.checkpoint()
    os.sched_yield()
