"""``CQ.busy_poll``: a CQ's waits poll for a while before they block, on every backend.

A wait that polls sees its completion with the run loop never asleep, lets the
other tasks and their timers run meanwhile, blocks once its time is up (and
still wakes for the completion), and is cancelled as any wait is. Values other
than seconds >= 0 are refused.
"""

from __future__ import annotations

import errno
import math
import time
from typing import Any

import pytest
import trio
from api.busyloop import loop_sleeps
from api.support import TIMEOUT, Cm, ok

from rdmashim import SendWR, VerbsError, WROpcode

DELAY = 0.05
"""Seconds before the message the waits wait for is sent."""


async def _wait_for_send_after(pair: Any, delay: float, busy_poll: float, ticks: int = 1) -> Any:
    """The server's recv CQ polls ``busy_poll`` seconds; the client sends after ``delay``
    (``ticks`` timers of ``delay / ticks`` seconds, one after the other); the run loop's
    sleeps while the server waits."""
    client, server = pair.client, pair.server
    server.post_recvs(server.reg(16), 1, 16, first_id=7)
    msg = client.reg(b"x")
    server.recv_cq.busy_poll = busy_poll

    async def send_later() -> None:
        for _ in range(ticks):
            await trio.sleep(delay / ticks)
        client.qp.post_send(SendWR(1, WROpcode.SEND, [msg.sge()]))

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send_later)
            with loop_sleeps() as watch:
                (wc,) = ok(await server.recv_cq.poll_wait(1))
    assert (wc.wr_id, wc.byte_len) == (7, 1)
    return watch


async def test_a_polling_wait_never_lets_the_loop_sleep(cm: Cm) -> None:
    watch = await _wait_for_send_after(await cm.pair(), DELAY, busy_poll=TIMEOUT)
    assert watch.sleeps == 0


async def test_a_blocking_wait_lets_the_loop_sleep(cm: Cm) -> None:
    """The control: the same wait without polling sleeps until the message comes."""
    watch = await _wait_for_send_after(await cm.pair(), DELAY, busy_poll=0)
    assert watch.sleeps >= 1


async def test_a_polling_wait_blocks_when_its_time_is_up(cm: Cm) -> None:
    poll = 0.02
    watch = await _wait_for_send_after(await cm.pair(), 10 * poll, busy_poll=poll)
    assert watch.sleeps >= 1
    assert watch.first_sleep >= poll  # polled first, then slept before the message came


async def test_other_tasks_and_timers_run_while_a_wait_polls(cm: Cm) -> None:
    """The message is sent by another task once five of its timers have fired one after
    the other: a polling wait that starved the other tasks or their timers would never
    see it (``fail_after`` ends the test). No count of ticks in a fixed time: a loaded
    machine makes that a race."""
    await _wait_for_send_after(await cm.pair(), DELAY, busy_poll=math.inf, ticks=5)


async def test_a_polling_wait_is_cancelled_as_any_wait(cm: Cm) -> None:
    pair = await cm.pair()
    cq = pair.server.recv_cq
    cq.busy_poll = math.inf
    start = time.perf_counter()
    with trio.move_on_after(DELAY) as scope:
        await cq.poll_wait(1)
    assert scope.cancelled_caught
    assert time.perf_counter() - start < TIMEOUT


async def test_closing_the_cq_ends_a_polling_wait(cm: Cm) -> None:
    """A wait that would poll for ever ends when its CQ is closed (after its QP), as a
    blocking one does: EBADF."""
    pair = await cm.pair()
    server = pair.server
    server.recv_cq.busy_poll = math.inf
    errors: list[int] = []

    async def wait() -> None:
        with pytest.raises(VerbsError) as info:
            await server.recv_cq.poll_wait(1)
        errors.append(info.value.errno)

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait)
            await trio.sleep(DELAY)
            server.qp.close()
            server.recv_cq.close()
    assert errors == [errno.EBADF]


async def test_busy_poll_takes_seconds_at_or_above_zero(device: Any) -> None:
    cq = device.create_cq(4)
    try:
        assert cq.busy_poll == 0.0
        for good in (50e-6, 1, math.inf, 0):
            cq.busy_poll = good
            assert cq.busy_poll == good
        for bad in (-1e-6, math.nan, "50", None, True):
            with pytest.raises(ValueError, match="busy_poll"):
                cq.busy_poll = bad
        assert cq.busy_poll == 0
    finally:
        cq.close()
