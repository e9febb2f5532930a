"""Where the built-in engine runs completion handlers (the API suite checks what they do).

A received message's completion calls the handler in the connection's receive
task, right after the bytes are processed: no task switch between the bytes
and the handler. Completions of a post made outside a handler call it soon
after from the context's dispatcher task, never inside the post.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio
from api.busyloop import loop_sleeps
from api.support import SIG, TIMEOUT, Cm, drain, ok

from rdmashim import SendWR, WROpcode
from rdmashim.cm import EventChannel


@pytest.fixture
async def cm() -> Any:
    async with EventChannel() as channel:
        yield Cm(channel)


class Steps(trio.abc.Instrument):
    """Records the tasks trio steps, in order."""

    def __init__(self) -> None:
        self.stepped: list[trio.lowlevel.Task] = []

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.stepped.append(task)


async def test_receive_handler_runs_in_the_receive_task(cm: Cm) -> None:
    pair = await cm.pair()
    client, server = pair.client, pair.server
    server.post_recvs(server.reg(16), 1, 16)
    seen: list[tuple[trio.lowlevel.Task, int]] = []
    steps = Steps()

    def handler(cq: Any) -> None:
        seen.append((trio.lowlevel.current_task(), len(steps.stepped)))

    server.recv_cq.set_handler(handler)
    server.recv_cq.req_notify()
    msg = client.reg(b"x")
    trio.lowlevel.add_instrument(steps)
    try:
        client.qp.post_send(SendWR(1, WROpcode.SEND, [msg.sge()]))
        with trio.fail_after(TIMEOUT):
            while not seen:  # noqa: ASYNC110 (the handler runs in another task)
                await trio.sleep(0.001)
    finally:
        trio.lowlevel.remove_instrument(steps)
    task, at = seen[0]
    assert task.coro.cr_code.co_name == "_rx_loop"
    # The step that ran the handler is the receive task's own: it read the bytes.
    assert steps.stepped[at - 1] is task
    ok(await drain(server.recv_cq, 1))


async def test_post_completions_call_the_handler_after_the_post(cm: Cm) -> None:
    pair = await cm.pair()
    client, server = pair.client, pair.server
    server.post_recvs(server.reg(16), 1, 16)
    tasks: list[trio.lowlevel.Task] = []
    client.send_cq.set_handler(lambda cq: tasks.append(trio.lowlevel.current_task()))
    client.send_cq.req_notify()
    client.qp.post_send(SendWR(1, WROpcode.SEND, [client.reg(b"y").sge()], SIG))
    assert tasks == []  # never inside the post
    with trio.fail_after(TIMEOUT):
        while not tasks:  # noqa: ASYNC110
            await trio.sleep(0.001)
    assert tasks[0] is not trio.lowlevel.current_task()
    ok(await drain(client.send_cq, 1))


async def test_a_task_driving_the_cq_reads_and_runs_the_handler_itself(cm: Cm) -> None:
    """``drive_until``: the waiting task reads the connection and runs the handler after
    the read, so what the handler hands on needs no other task."""
    pair = await cm.pair()
    client, server = pair.client, pair.server
    server.post_recvs(server.reg(16), 1, 16)
    seen: list[trio.lowlevel.Task] = []

    def handler(cq: Any) -> None:
        seen.append(trio.lowlevel.current_task())
        drain(cq)

    server.recv_cq.set_handler(handler)
    server.recv_cq.req_notify()
    msg = client.reg(b"x")

    async def send_soon() -> None:
        await trio.sleep(0.05)
        client.qp.post_send(SendWR(1, WROpcode.SEND, [msg.sge()]))

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send_soon)
            assert await server.recv_cq.drive_until(lambda: seen)
    assert seen == [trio.lowlevel.current_task()]


async def test_drive_until_looks_again_on_interrupt_and_refuses_a_cq_without_one_qp(
    cm: Cm,
) -> None:
    """What a driving task waits for may come another way (nothing arrives on its
    connection): ``interrupt_wait`` makes it look at ``ready`` again."""
    pair = await cm.pair()
    server = pair.server
    server.recv_cq.set_handler(lambda cq: None)
    flag: list[bool] = []
    ended: list[bool] = []

    async def drive() -> None:
        ended.append(await server.recv_cq.drive_until(lambda: flag))

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(drive)
            await trio.sleep(0.05)
            server.recv_cq.interrupt_wait()
            await trio.sleep(0.05)
            assert not ended  # looked again: not ready, so it waits on
            flag.append(True)
            server.recv_cq.interrupt_wait()
    assert ended == [True]
    lone = server.qp.context.create_cq(4)
    try:
        assert not await lone.drive_until(lambda: False)  # no QP completes there
    finally:
        lone.close()


async def test_busy_polling_waits_where_the_receive_task_reads(cm: Cm) -> None:
    """A CQ with a handler is read by the receive task, not by its waiter: ``busy_poll``
    then keeps the waiter polling the CQ while the receive task reads (the run loop
    never sleeps), and ``drive_until`` polls its connection the same way."""
    pair = await cm.pair()
    client, server = pair.client, pair.server
    server.post_recvs(server.reg(32), 2, 16)
    msg = client.reg(b"x")
    seen: list[trio.lowlevel.Task] = []
    server.recv_cq.set_handler(lambda cq: seen.append(trio.lowlevel.current_task()))
    server.recv_cq.busy_poll = TIMEOUT

    async def send_soon() -> None:
        await trio.sleep(0.05)
        client.qp.post_send(SendWR(1, WROpcode.SEND, [msg.sge()]))

    for wait in ("poll_wait", "drive_until"):
        server.recv_cq.req_notify()
        with trio.fail_after(TIMEOUT):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(send_soon)
                with loop_sleeps() as watch:
                    if wait == "poll_wait":
                        ok(await server.recv_cq.poll_wait(1))
                    else:
                        assert await server.recv_cq.drive_until(lambda: len(seen) == 2)
        assert watch.sleeps == 0, wait
    # The receive task ran the handler for the first; the driving task, for the second.
    assert seen[0].coro.cr_code.co_name == "_rx_loop"
    assert seen[1] is trio.lowlevel.current_task()
