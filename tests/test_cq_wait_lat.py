"""The one-hop CQ wait of the built-in engine: a task waiting on a CQ that one QP
completes into reads that QP's socket in place of the connection's receive task.

Over real loopback TCP, with the compiled and the Python kernels: every message
arrives, in order, across many ping-pongs; a cancelled wait leaves the connection
whole and the receive task reading again (it answers Reads and places Writes while
nobody waits); Read Responses and Writes that arrive while a waiter reads are
handled; completions made by other tasks wake the waiter; closing the CQ or the QP,
the peer going away, or a bug met while the waiter reads, ends the wait; CQs fed by
several QPs, and QPs with a CQ handler, keep the receive task's wakeup.
"""

from __future__ import annotations

import errno
import socket
import struct
from typing import Any

import pytest
import trio
import trio.lowlevel
import trio.testing

from rdmashim import RecvWR, SendFlags, SendWR, VerbsError, WCStatus, WROpcode

from pairs import Side, make_pair

pytestmark = pytest.mark.usefixtures("engine_kernels")  # compiled and Python kernels

SIG = SendFlags.SIGNALED
INLINE = SendFlags.INLINE
SUCCESS = WCStatus.SUCCESS
BOUND = 10.0
"""Seconds any wait here may take (they take milliseconds)."""
SLOT = 64


def reading(cq: Any, side: Side) -> bool:
    """Whether a task waiting on ``cq`` reads ``side``'s connection itself."""
    return cq._reader is not None and cq._reader is side.qp._link.wait_point


def post_slots(side: Side, mr: Any, n: int, first: int = 0) -> None:
    side.qp.post_recv([RecvWR(i, [mr.sge(i * SLOT, SLOT)]) for i in range(first, first + n)])


class Waiter:
    """A task waiting in ``poll_wait`` on a CQ: what it got (or the error it met)."""

    def __init__(self) -> None:
        self.wcs: list = []
        self.error: VerbsError | None = None
        self.done = trio.Event()

    async def ended(self) -> None:
        with trio.fail_after(BOUND):
            await self.done.wait()


async def blocked_waiter(nursery: trio.Nursery, cq: Any) -> Waiter:
    """Start a task that waits on ``cq`` and keeps what it polls; return once it waits."""
    waiter = Waiter()

    async def wait() -> None:
        try:
            with trio.fail_after(BOUND):
                waiter.wcs += await cq.poll_wait(16)
        except VerbsError as exc:
            waiter.error = exc
        waiter.done.set()

    nursery.start_soon(wait)
    await trio.testing.wait_all_tasks_blocked()
    return waiter


async def test_ping_pong_delivers_every_message_in_order_to_the_reading_waiter(ctx: Any) -> None:
    """Both ends wait in ``poll_wait`` (one CQ at the client, a receive CQ at the server);
    each 8-byte Send carries its sequence number and each side checks it."""
    rounds = 400
    async with trio.open_nursery() as nursery:
        client, server = await make_pair(ctx, client_cq=ctx.create_cq(64))
        cmr, smr = client.reg(SLOT * 8), server.reg(SLOT * 8)
        post_slots(client, cmr, 7)  # slot 7 holds what the side sends
        post_slots(server, smr, 7)
        seen = {"client": False, "server": False}
        done = False

        async def echo() -> None:
            for i in range(rounds):
                wc = (await server.recv_cq.poll_wait(1))[0]
                wc.raise_for_status()
                slot = smr.buf[wc.wr_id * SLOT : wc.wr_id * SLOT + 8]
                assert struct.unpack("<Q", slot)[0] == i
                smr.buf[SLOT * 7 : SLOT * 7 + 8] = struct.pack("<Q", i + 1000)
                post_slots(server, smr, 1, wc.wr_id)
                server.qp.post_send(SendWR(i, WROpcode.SEND, [smr.sge(SLOT * 7, 8)], INLINE))

        async def watch() -> None:
            # Between the other tasks' steps: a waiting side's wait reads its socket.
            while not done:
                seen["client"] |= reading(client.send_cq, client)
                seen["server"] |= reading(server.recv_cq, server)
                await trio.lowlevel.checkpoint()

        nursery.start_soon(echo)
        nursery.start_soon(watch)
        with trio.fail_after(BOUND):
            for i in range(rounds):
                cmr.buf[SLOT * 7 : SLOT * 7 + 8] = struct.pack("<Q", i)
                client.qp.post_send(SendWR(i, WROpcode.SEND, [cmr.sge(SLOT * 7, 8)], INLINE))
                wc = (await client.send_cq.poll_wait(1))[0]
                wc.raise_for_status()
                assert wc.opcode.name == "RECV" and wc.byte_len == 8
                slot = cmr.buf[wc.wr_id * SLOT : wc.wr_id * SLOT + 8]
                assert struct.unpack("<Q", slot)[0] == i + 1000
                post_slots(client, cmr, 1, wc.wr_id)
        done = True
        assert seen == {"client": True, "server": True}
        nursery.cancel_scope.cancel()


async def test_a_cancelled_wait_hands_the_socket_back_to_the_receive_task(ctx: Any) -> None:
    """Waits cancelled at once, mid-wait and while Sends stream in lose nothing; between
    waits the receive task answers the peer's Reads and places its Writes."""
    async with trio.open_nursery() as nursery:
        client, server = await make_pair(ctx)
        cmr, smr = client.reg(SLOT * 64), server.reg(SLOT * 64)
        post_slots(client, cmr, 64)
        for timeout in (0, 0.01, 0.05):
            with trio.move_on_after(timeout):
                await client.recv_cq.poll_wait(1)
            assert not client.qp._link._waiter_reads
        # Nobody waits at the client: its receive task must place and answer.
        smr.buf[:16] = b"written by peer!"
        server.qp.post_send(
            SendWR(1, WROpcode.RDMA_WRITE, [smr.sge(0, 16)], SIG, cmr.addr, cmr.rkey)
        )
        server.qp.post_send(
            SendWR(2, WROpcode.RDMA_READ, [smr.sge(SLOT, 16)], SIG, cmr.addr, cmr.rkey)
        )
        with trio.fail_after(BOUND):
            wcs = [*await server.send_cq.poll_wait(2)]
            while len(wcs) < 2:
                wcs += await server.send_cq.poll_wait(2)
        assert [(w.wr_id, w.status) for w in wcs] == [(1, WCStatus.SUCCESS), (2, WCStatus.SUCCESS)]
        assert bytes(cmr.buf[:16]) == bytes(smr.buf[SLOT : SLOT + 16]) == b"written by peer!"
        # Sends streaming in while waits keep being cancelled: each arrives once, in order.
        got: list[int] = []

        async def stream() -> None:
            for i in range(48):
                smr.buf[SLOT * 2 : SLOT * 2 + 8] = struct.pack("<Q", i)
                server.qp.post_send(SendWR(i, WROpcode.SEND, [smr.sge(SLOT * 2, 8)], INLINE))
                await trio.sleep(0.001 * (i % 3))

        nursery.start_soon(stream)
        with trio.fail_after(BOUND):
            while len(got) < 48:
                with trio.move_on_after(0.0005 * (len(got) % 4)):
                    for wc in await client.recv_cq.poll_wait(4):
                        wc.raise_for_status()
                        got.append(struct.unpack("<Q", cmr.buf[wc.wr_id * SLOT :][:8])[0])
        assert got == list(range(48))
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("then", ["sleeps", "spins"])
async def test_a_wait_that_got_its_completion_lends_the_socket_until_the_loop_waits(
    ctx: Any, then: str
) -> None:
    """A wait that returns with its completion leaves the receive task parked (the
    socket lent to the next wait, no task switch); when the task does something else
    instead (sleeps: the loop would block in its wait for I/O; spins on checkpoints:
    it never blocks), the receive task reads again and answers the peer's Write and
    Read."""
    client, server = await make_pair(ctx)
    cmr, smr = client.reg(SLOT * 4), server.reg(SLOT * 4)
    link = client.qp._link
    for round_ in range(3):
        post_slots(client, cmr, 1)
        cmr.buf[:16] = bytes(16)
        smr.buf[SLOT : SLOT + 16] = b"written by peer!"
        lent: list[bool] = []
        answered = trio.Event()

        async def client_side(lent: list[bool], answered: trio.Event) -> None:
            (wc,) = await client.recv_cq.poll_wait(1)
            wc.raise_for_status()
            lent.append(link._loan.active and link._rx_parked is not None)
            # What the peer does now needs the client's receive task (and completes
            # nothing at the peer before that: the loop may block).
            server.qp.post_send(
                SendWR(1, WROpcode.RDMA_WRITE, [smr.sge(SLOT, 16)], 0, cmr.addr, cmr.rkey)
            )
            server.qp.post_send(
                SendWR(2, WROpcode.RDMA_READ, [smr.sge(SLOT * 2, 16)], SIG, cmr.addr, cmr.rkey)
            )
            if then == "sleeps":
                await answered.wait()
            while not answered.is_set():
                await trio.lowlevel.checkpoint()

        async def server_side(answered: trio.Event) -> None:
            (wc,) = await server.send_cq.poll_wait(2)
            assert (wc.wr_id, wc.status) == (2, SUCCESS)
            answered.set()

        with trio.fail_after(BOUND):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(client_side, lent, answered)
                nursery.start_soon(server_side, answered)
                await trio.testing.wait_all_tasks_blocked()  # the receive tasks parked
                server.qp.post_send(SendWR(round_, WROpcode.SEND, [smr.sge(0, 8)], INLINE))
        assert lent == [True]
        assert bytes(smr.buf[SLOT * 2 : SLOT * 2 + 16]) == b"written by peer!"
        assert bytes(cmr.buf[:16]) == b"written by peer!"
        assert not link._loan.active


async def test_read_responses_and_writes_arriving_while_a_waiter_reads(ctx: Any) -> None:
    """The client waits for a Send on its receive CQ while its own Read's Response and the
    peer's Write arrive: the Read completes on the send CQ (waking that CQ's waiter), the
    Write is placed, and the waiter returns with the Send that follows."""
    async with trio.open_nursery() as nursery:
        client, server = await make_pair(ctx)
        cmr, smr = client.reg(SLOT * 4), server.reg(bytes(range(64)) * 4)
        post_slots(client, cmr, 1)
        waiter = await blocked_waiter(nursery, client.recv_cq)
        assert reading(client.recv_cq, client)
        read_done: list = []
        client.qp.post_send(
            SendWR(7, WROpcode.RDMA_READ, [cmr.sge(SLOT, 64)], SIG, smr.addr, smr.rkey)
        )
        with trio.fail_after(BOUND):
            read_done += await client.send_cq.poll_wait(1)  # another task's wait: an Event
        assert read_done[0].wr_id == 7 and read_done[0].status is WCStatus.SUCCESS
        assert bytes(cmr.buf[SLOT : SLOT * 2]) == bytes(range(64))
        server.qp.post_send(
            SendWR(8, WROpcode.RDMA_WRITE, [smr.sge(0, 32)], 0, cmr.addr + SLOT * 2, cmr.rkey)
        )
        server.qp.post_send(SendWR(9, WROpcode.SEND, [smr.sge(SLOT, 8)], SIG))
        await waiter.ended()
        assert [(w.wr_id, w.byte_len) for w in waiter.wcs] == [(0, 8)]
        assert bytes(cmr.buf[SLOT * 2 : SLOT * 2 + 32]) == bytes(range(32))
        assert bytes(cmr.buf[:8]) == bytes(range(8))
        nursery.cancel_scope.cancel()


async def test_a_completion_made_by_another_task_wakes_the_reading_waiter(ctx: Any) -> None:
    """One CQ for sends and receives: a Send posted by another task completes there while
    the waiter reads, with nothing received; the waiter returns with it."""
    async with trio.open_nursery() as nursery:
        client, server = await make_pair(ctx, client_cq=ctx.create_cq(16))
        cmr, smr = client.reg(SLOT), server.reg(SLOT)
        post_slots(server, smr, 1)
        waiter = await blocked_waiter(nursery, client.send_cq)
        assert reading(client.send_cq, client)
        client.qp.post_send(SendWR(5, WROpcode.SEND, [cmr.sge(0, 8)], SIG))
        await waiter.ended()
        assert [(w.wr_id, w.status) for w in waiter.wcs] == [(5, WCStatus.SUCCESS)]
        with trio.fail_after(BOUND):
            wc = (await server.recv_cq.poll_wait(1))[0]
        assert wc.status is WCStatus.SUCCESS
        nursery.cancel_scope.cancel()


async def test_cqs_fed_by_several_qps_or_with_a_handler_are_woken_by_the_receive_task(
    ctx: Any,
) -> None:
    """Two QPs completing into one CQ: the waiter does not read (one socket at a time)
    and gets both QPs' messages; a QP whose send CQ has a handler keeps the handler in
    the receive task, so its receive CQ's waiter does not read either."""
    async with trio.open_nursery() as nursery:
        shared = ctx.create_cq(16)
        pairs = [await make_pair(ctx, client_cq=shared) for _ in range(2)]
        mrs = []
        for client, server in pairs:
            mr = client.reg(SLOT * 2)
            post_slots(client, mr, 2)
            mrs.append((mr, server.reg(b"from %d" % len(mrs))))
        waiter = await blocked_waiter(nursery, shared)
        assert shared._reader is None
        for (_, server), (_, smr) in zip(pairs, mrs, strict=True):
            server.qp.post_send(SendWR(1, WROpcode.SEND, [smr.sge()], SIG))
        await waiter.ended()
        got = waiter.wcs
        with trio.fail_after(BOUND):
            while len(got) < 2:
                got += await shared.poll_wait(2)
        assert sorted(w.qp_num for w in got) == sorted(c.qp.qp_num for c, _ in pairs)

        client, server = await make_pair(ctx)
        calls: list = []
        handled = trio.Event()

        def handler(cq: Any) -> None:
            calls.append((cq, trio.lowlevel.current_task() in ctx._receivers))
            handled.set()

        client.send_cq.set_handler(handler)
        cmr, smr = client.reg(SLOT), server.reg(SLOT)
        post_slots(client, cmr, 1)
        waiter = await blocked_waiter(nursery, client.recv_cq)
        assert client.recv_cq._reader is None
        client.send_cq.req_notify()
        client.qp.post_send(SendWR(3, WROpcode.RDMA_READ, [cmr.sge(0, 8)], SIG, smr.addr, smr.rkey))
        server.qp.post_send(SendWR(4, WROpcode.SEND, [smr.sge(0, 8)], 0))
        await waiter.ended()
        with trio.fail_after(BOUND):
            await handled.wait()
        # The handler ran once, in a receive task (right after the Read Response).
        assert calls == [(client.send_cq, True)] and [w.byte_len for w in waiter.wcs] == [8]
        nursery.cancel_scope.cancel()


async def test_a_waiter_on_a_channel_cq_reads_and_the_channel_still_gets_its_event(
    ctx: Any,
) -> None:
    async with trio.open_nursery() as nursery:
        client, server = await make_pair(ctx, channel=True)
        cmr, smr = client.reg(SLOT), server.reg(SLOT)
        post_slots(client, cmr, 1)
        client.recv_cq.req_notify()
        waiter = await blocked_waiter(nursery, client.recv_cq)
        assert reading(client.recv_cq, client)
        server.qp.post_send(SendWR(1, WROpcode.SEND, [smr.sge(0, 8)], 0))
        with trio.fail_after(BOUND):
            assert await client.channel.get_cq_event() is client.recv_cq
        await waiter.ended()
        assert [w.status for w in waiter.wcs] == [WCStatus.SUCCESS]
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("how", ["fin", "reset"])
async def test_the_peer_going_away_flushes_the_reading_waiters_receives(ctx: Any, how: str) -> None:
    """The peer's socket ends (a FIN, or a reset as when its process is killed) while the
    client's waiter reads: its receives complete with WR_FLUSH_ERR; nothing hangs."""
    async with trio.open_nursery() as nursery:
        client, server = await make_pair(ctx)
        post_slots(client, client.reg(SLOT * 3), 3)
        waiter = await blocked_waiter(nursery, client.recv_cq)
        assert reading(client.recv_cq, client)
        sock = server.qp._link.sock
        if how == "reset":
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
        else:
            sock.shutdown(socket.SHUT_RDWR)
        await waiter.ended()
        got = waiter.wcs
        with trio.fail_after(BOUND):
            while len(got) < 3:
                got += await client.recv_cq.poll_wait(3)
            await client.qp.wait_closed()
        assert [(w.wr_id, w.status) for w in got] == [(i, WCStatus.WR_FLUSH_ERR) for i in range(3)]
        assert not client.qp._link._waiter_reads
        nursery.cancel_scope.cancel()


async def test_closing_the_cq_or_the_qp_ends_a_reading_wait(ctx: Any) -> None:
    async with trio.open_nursery() as nursery:
        client, server = await make_pair(ctx)
        post_slots(client, client.reg(SLOT), 1)
        waiter = await blocked_waiter(nursery, client.recv_cq)
        assert reading(client.recv_cq, client)
        client.qp.close()  # its posted receive is flushed to the waiter
        await waiter.ended()
        assert [w.status for w in waiter.wcs] == [WCStatus.WR_FLUSH_ERR]

        client, server = await make_pair(ctx)
        waiter = await blocked_waiter(nursery, client.recv_cq)
        assert reading(client.recv_cq, client)
        link = client.qp._link
        client.recv_cq.close()
        await waiter.ended()
        assert waiter.error is not None and waiter.error.errno == errno.EBADF
        assert not link._waiter_reads
        # The connection goes on: the server's Send lands in the client's memory by Write.
        cmr = client.reg(SLOT)
        smr = server.reg(b"still here")
        server.qp.post_send(SendWR(1, WROpcode.RDMA_WRITE, [smr.sge()], 0, cmr.addr, cmr.rkey))
        server.qp.post_send(SendWR(2, WROpcode.RDMA_READ, [smr.sge(0, 1)], SIG, cmr.addr, cmr.rkey))
        with trio.fail_after(BOUND):
            wc = (await server.send_cq.poll_wait(1))[0]
        assert wc.status is WCStatus.SUCCESS and bytes(cmr.buf[:10]) == b"still here"
        nursery.cancel_scope.cancel()


async def test_a_bug_met_while_a_waiter_reads_ends_only_that_connection(ctx: Any) -> None:
    """An unexpected error in the processing a waiter runs (a bug of ours, injected here)
    ends the connection as one in the receive task does: the QP goes to ERR with it, the
    waiter gets its receive flushed, and the other connection of the context goes on."""
    async with trio.open_nursery() as nursery:
        client, server = await make_pair(ctx)
        other_client, other_server = await make_pair(ctx)
        post_slots(client, client.reg(SLOT), 1)
        waiter = await blocked_waiter(nursery, client.recv_cq)
        assert reading(client.recv_cq, client)
        bug = RuntimeError("injected bug")

        def received(nbytes: int) -> None:
            raise bug

        client.qp.engine.received = received  # type: ignore[method-assign]
        smr = server.reg(SLOT)
        server.qp.post_send(SendWR(1, WROpcode.SEND, [smr.sge(0, 8)], 0))
        await waiter.ended()
        got = waiter.wcs
        with trio.fail_after(BOUND):
            while not got:
                got += await client.recv_cq.poll_wait(1)
            await client.qp.wait_closed()
        assert [w.status for w in got] == [WCStatus.WR_FLUSH_ERR]
        error = client.qp.error  # as the link's nursery raised it: in a group
        assert bug in getattr(error, "exceptions", (error,))
        omr, tmr = other_client.reg(SLOT), other_server.reg(b"still fine")
        post_slots(other_client, omr, 1)
        other_server.qp.post_send(SendWR(2, WROpcode.SEND, [tmr.sge()], 0))
        with trio.fail_after(BOUND):
            wc = (await other_client.recv_cq.poll_wait(1))[0]
        assert wc.status is WCStatus.SUCCESS and bytes(omr.buf[:10]) == b"still fine"
        nursery.cancel_scope.cancel()
