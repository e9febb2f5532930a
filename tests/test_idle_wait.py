"""A CQ waiter that waits for its connection in a system call of its own while trio has
nothing else to do (``rdmashim.verbs.idle``), on both engines.

The wait watches trio's own epoll descriptor beside the socket and ends at the run's
next deadline, so nothing else in the run waits for it: a timer, another socket, a
callback from a thread and Ctrl-C each get their turn at once. Each liveness bound
below is a fraction of ``idle.MAX_WAIT``, the wait's safety net: a wait that did not
watch what it must would hold the run for that long and fail the test.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import queue
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

import rdmashim
from rdmashim import (
    Access,
    QPCap,
    QPState,
    SendFlags,
    SendWR,
    WCArray,
    WCOpcode,
    WCStatus,
    WROpcode,
)
from rdmashim.providers.softiwarp import driver, engines, native, native_link
from rdmashim.providers.softiwarp.connection import accept_qp, connect_qp, read_request
from rdmashim.ulps.rds.node import RdsNode
from rdmashim.ulps.rds.settings import RdsSettings
from rdmashim.verbs import idle, lending
from rdmashim.verbs.wr import RecvWR

from pairs import Side, make_pair
from rdsnodes import close, free_port, nodes, transports

BOUND = idle.MAX_WAIT / 3
"""Seconds within which what the run must do happens, however the waiter waits."""
PEER_BOUND = BOUND * 6
"""Seconds a peer in a run of its own (:func:`_peer_in_its_own_run`) lives at most."""


# ---------------------------------------------------------------- the loop probe
async def test_the_run_loop_is_known_on_this_trio() -> None:
    """The pinned trio's run loop is what the idle wait reads (a trio upgrade that
    changes its private state fails here, not silently in the benchmarks)."""
    if not hasattr(__import__("select"), "epoll"):
        pytest.skip("no epoll on this platform: tasks wait through trio")
    loop = idle.current()
    assert loop is not None
    assert idle.current() is loop  # (one per run)
    assert loop.budget_ms() == int(idle.MAX_WAIT * 1000)


async def test_no_budget_while_another_task_is_ready_or_a_deadline_is_due() -> None:
    loop = idle.current()
    if loop is None:
        pytest.skip("no idle waits on this platform")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.sleep, 0)
        assert loop.budget_ms() == 0  # (the new task is ready and has not run)
    # (each scope only sets the run's next deadline: no await in it)
    with trio.move_on_after(0.25):  # noqa: ASYNC100
        assert 0 < loop.budget_ms() <= 250
    with trio.move_on_after(0.0005):  # noqa: ASYNC100
        assert loop.budget_ms() == 1  # (under a millisecond: a whole one, as trio's epoll)
    with trio.move_on_after(0.0001):  # noqa: ASYNC100
        time.sleep(0.001)  # noqa: ASYNC251 (the deadline passes with no checkpoint)
        assert loop.budget_ms() == 0  # (due: trio keeps the time)


def test_no_idle_wait_under_a_mock_clock() -> None:
    async def main() -> idle.IdleLoop | None:
        return idle.current()

    assert trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0)) is None


async def test_an_idle_wait_gives_trio_the_first_turn() -> None:
    """Both the waiter's socket and one that trio watches are readable: the idle wait
    reads nothing (trio goes first), on either engine's wait."""
    loop = idle.current()
    if loop is None:
        pytest.skip("no idle waits on this platform")
    ours, ours_peer = socket.socketpair()
    other, other_peer = socket.socketpair()
    wait = lending.WaitPoint()
    wait.open(ours.fileno())
    try:
        ours_peer.send(b"x")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.lowlevel.wait_readable, other)
            await trio.sleep(0.01)  # (it waits now: trio watches that socket)
            assert wait.block()  # (only ours is readable)
            other_peer.send(b"y")
            assert not wait.block()
            if native.AVAILABLE:  # (C reads only when ours alone is readable: no QP here)
                found = wait.idle()
                assert found is not None
                n = native.lib.rs_qp_wait_read_fd(native.ffi.NULL, ours.fileno(), *found)
                assert n == -errno.EBUSY
    finally:
        wait.close()
        for sock in (ours, ours_peer, other, other_peer):
            sock.close()


# ---------------------------------------------------------------- the waits, both engines
BOTH_ENGINES = pytest.mark.usefixtures("each_engine")  # native and Python


def _recv(side: Side, n: int = 8) -> Any:
    """Post ``n`` receives of 64 bytes, slot ``i`` of the region returned for wr_id ``i``."""
    mr = side.reg(64 * n)
    side.qp.post_recv([RecvWR(i, [mr.sge(64 * i, 64)]) for i in range(n)])
    return mr


def _send(side: Side) -> None:
    src = side.reg(b"ping")
    side.qp.post_send(SendWR(1, WROpcode.SEND, [src.sge()], SendFlags.SIGNALED))


@pytest.fixture
def idle_waits(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Every idle wait the test's waiters began in its own thread (not a peer's in a run
    of its own): (trio's epoll descriptor, ms)."""
    seen: list[tuple[int, int]] = []
    real = lending.WaitPoint.idle
    ours = threading.get_ident()

    def spy(self: lending.WaitPoint) -> tuple[int, int] | None:
        found = real(self)
        if found is not None and threading.get_ident() == ours:
            seen.append(found)
        return found

    monkeypatch.setattr(lending.WaitPoint, "idle", spy)
    return seen


async def _lend(
    nursery: trio.Nursery, client: Side, server: Side, idle_waits: list[tuple[int, int]]
) -> None:
    """A few messages, each sent by a task once the client's waiter waits: its receive
    task parks and the socket stays lent to the waiter, whose next wait (with no wait
    through trio in between) may be idle."""

    async def send() -> None:
        _send(server)

    for _ in range(3):
        nursery.start_soon(send)
        (wc,) = await client.recv_cq.poll_wait(1)
        assert wc.status == WCStatus.SUCCESS
    idle_waits.clear()


@contextlib.contextmanager
def _from_a_thread(
    source: str, then: Callable[[], object]
) -> Iterator[tuple[threading.Timer, Callable[[], Awaitable[None]]]]:
    """Work that comes from another thread 50 ms after the timer starts, and runs
    ``then``: a byte to a socket trio watches (read by the task given), or a callback
    handed to the run (the task given does nothing)."""
    mine, theirs = socket.socketpair()
    sock = trio.socket.from_stdlib_socket(mine)

    async def reader() -> None:
        if source == "socket":
            assert await sock.recv(1) == b"x"
            then()

    if source == "socket":
        timer = threading.Timer(0.05, theirs.send, (b"x",))
    else:
        token = trio.lowlevel.current_trio_token()
        timer = threading.Timer(0.05, token.run_sync_soon, (then,))
    try:
        yield timer, reader
    finally:
        timer.cancel()
        sock.close()
        theirs.close()


@dataclasses.dataclass
class Waits:
    """How the CQ waiters of the test's own thread waited (not a peer's in a run of its
    own, :func:`_peer_in_its_own_run`)."""

    idle: list[object] = dataclasses.field(default_factory=list)
    """What each idle wait returned (``driver.BUSY``: nothing read; the native engine's
    waits that also polled, :meth:`.NativeLink.wait_poll`: the completions taken)."""
    through_trio: int = 0
    """Waits through trio (``WaitPoint.wait_readable``)."""

    def reads(self) -> int:
        """Idle waits that read."""
        return sum(got is not driver.BUSY for got in self.idle)


@pytest.fixture
def waits(monkeypatch: pytest.MonkeyPatch) -> Waits:
    """How the test's own waiters waited (:class:`Waits`)."""
    seen = Waits()
    ours = threading.get_ident()
    for cls in (driver.Link, native_link.NativeLink):
        real = vars(cls)["_read_idle"]

        def spy(self: Any, _real: Any = real) -> object:
            got = _real(self)
            if threading.get_ident() == ours:
                seen.idle.append(got)
            return got

        monkeypatch.setattr(cls, "_read_idle", spy)
    real_one_call = native_link.NativeLink.wait_poll

    def one_call(self: Any, *args: Any) -> int:
        got = real_one_call(self, *args)
        if got and threading.get_ident() == ours:
            seen.idle.append(got)  # (an idle wait, a read and a poll in one call into C)
        return got

    monkeypatch.setattr(native_link.NativeLink, "wait_poll", one_call)
    real_wait = lending.WaitPoint.wait_readable

    async def wait_readable(self: lending.WaitPoint) -> None:
        if threading.get_ident() == ours:
            seen.through_trio += 1
        await real_wait(self)

    monkeypatch.setattr(lending.WaitPoint, "wait_readable", wait_readable)
    return seen


@contextlib.asynccontextmanager
async def _peer_in_its_own_run(
    main: Callable[[Callable[[int], None]], Awaitable[None]],
) -> AsyncIterator[int]:
    """Run ``main(say_port)`` in a run of its own, in a thread (what it sends comes while
    this run has nothing to do); yields the port it says; at the end, waits for it and
    raises what it raised."""
    ports: queue.Queue[int | BaseException] = queue.Queue()

    async def bounded(say_port: Callable[[int], None]) -> None:
        with trio.fail_after(PEER_BOUND):  # (a stuck peer fails the test, not hangs it)
            await main(say_port)

    def run() -> None:
        try:
            trio.run(bounded, ports.put)
        except BaseException as exc:  # (raised below, in the test)
            ports.put(exc)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        port = await trio.to_thread.run_sync(ports.get)
        assert isinstance(port, int), port
        yield port
    finally:
        await trio.to_thread.run_sync(thread.join)
    assert ports.empty(), ports.get()


Peer = Callable[[Callable[[int], None]], Awaitable[None]]
"""A peer's run: ``main(say_port)`` (:func:`_peer_in_its_own_run`)."""


def _echo(rounds: int, *, then_close: bool = False, solicited: int = 0) -> Peer:
    """A peer that sends each of ``rounds`` Sends' 8 bytes back (the first ``solicited``
    of them with SE); with ``then_close`` it destroys its QP when the next one comes,
    without answering."""

    async def main(say_port: Callable[[int], None]) -> None:
        async with rdmashim.open_device("siw_lo") as ctx:
            pd = ctx.alloc_pd()
            cq = ctx.create_cq(64)
            qp = pd.create_qp(send_cq=cq, recv_cq=cq, cap=QPCap(max_inline_data=64))
            mr = pd.reg_mr(bytearray(64 * 16), Access.LOCAL_WRITE)
            recvs = [RecvWR(i, [mr.sge(64 * i, 64)]) for i in range(16)]
            qp.post_recv(recvs)
            (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
            say_port(listener.socket.getsockname()[1])
            stream = await listener.accept()
            await accept_qp(qp, stream, await read_request(stream))
            for i in range(rounds):
                (wc,) = await cq.poll_wait(1)
                assert wc.status == WCStatus.SUCCESS, wc
                flags = SendFlags.INLINE | (SendFlags.SOLICITED if i < solicited else 0)
                echo = SendWR(0, WROpcode.SEND, [mr.sge(64 * wc.wr_id, 8)], flags)
                qp.post_send(echo)  # (inline: copied now, so the slot may take the next)
                qp.post_recv(recvs[wc.wr_id])
            if then_close:
                await cq.poll_wait(1)
                qp.close()
            await qp.wait_closed()

    return main


async def _client_of(ctx: Any, port: int, channel: Any = None) -> tuple[Side, Any]:
    """A QP of its own PD, completing on one CQ of its own (on ``channel`` when given; so
    its CQ waiter reads its connection), connected to ``port``, and the region its 16
    receives, posted before, take messages into (64 bytes a slot)."""
    pd = ctx.alloc_pd()
    cq = ctx.create_cq(64, channel)
    qp = pd.create_qp(send_cq=cq, recv_cq=cq, cap=QPCap(max_inline_data=64))
    side = Side(ctx, pd, cq, cq, qp, channel)
    slots = _recv(side, 16)
    await connect_qp(qp, await trio.open_tcp_stream("127.0.0.1", port))
    return side, slots


@BOTH_ENGINES
async def test_a_ping_pong_reads_its_messages_in_idle_waits(ctx: Any, waits: Waits) -> None:
    """The peer answers from its own run: the answer comes while this run is idle."""
    if idle.current() is None:
        pytest.skip("no idle waits on this platform")
    rounds = 50
    async with _peer_in_its_own_run(_echo(rounds)) as port:
        client, _ = await _client_of(ctx, port)
        qp, cq, src = client.qp, client.recv_cq, client.reg(b"p" * 8)
        with trio.fail_after(BOUND * 3):
            for _ in range(rounds):
                qp.post_send(SendWR(0, WROpcode.SEND, [src.sge()], SendFlags.INLINE))
                wc = (await cq.poll_wait(1))[0]
                assert wc.status == WCStatus.SUCCESS
                qp.post_recv(RecvWR(wc.wr_id, [client.reg(64).sge()]))
        qp.close()
    # (the peer, a thread of this process, may answer before the waiter looks, which
    # then does not wait at all; but a wait is an idle one)
    assert waits.reads() and waits.through_trio <= rounds // 5, waits


@BOTH_ENGINES
async def test_a_timer_fires_while_a_cq_waiter_waits_idle(
    ctx: Any, idle_waits: list[tuple[int, int]]
) -> None:
    client, server = await make_pair(ctx)
    _recv(client, 16)
    fired = trio.Event()

    async def later() -> None:
        await trio.sleep(0.05)
        fired.set()
        _send(server)  # (what ends the waiter's wait)

    with trio.fail_after(BOUND):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(later)
            await _lend(nursery, client, server, idle_waits)
            wcs = await client.recv_cq.poll_wait(1)
    assert fired.is_set()
    assert wcs[0].status == WCStatus.SUCCESS
    assert idle_waits


@BOTH_ENGINES
async def test_a_task_woken_with_the_waiter_runs_while_it_waits_idle(ctx: Any) -> None:
    """A 4 MiB Send between two QPs of one run: the receiver's waiter and the sender's
    transmit task (waiting for room in its socket) are woken by the same wait for I/O,
    and trio runs that batch in a random order: a task of it that has not run yet is in
    no run queue. The waiter must not wait idle while it is about to run."""
    client, server = await make_pair(ctx)
    size = 4 << 20
    src = client.reg(b"s" * size)
    dst = server.reg(size)
    for round_ in range(3):
        server.qp.post_recv(RecvWR(round_, [dst.sge()]))
        client.qp.post_send(SendWR(round_, WROpcode.SEND, [src.sge()], SendFlags(0)))
        with trio.fail_after(BOUND):
            (wc,) = await server.recv_cq.poll_wait(1)
        assert wc.status == WCStatus.SUCCESS and wc.byte_len == size


@BOTH_ENGINES
@pytest.mark.parametrize("source", ["socket", "callback"])
async def test_work_from_another_thread_runs_while_a_cq_waiter_waits_idle(
    ctx: Any, idle_waits: list[tuple[int, int]], source: str
) -> None:
    """Another socket that trio watches becomes readable, or a thread hands the run a
    callback: its task, or the callback, runs (and sends what ends the wait)."""
    client, server = await make_pair(ctx)
    _recv(client, 16)
    with _from_a_thread(source, lambda: _send(server)) as (timer, reader), trio.fail_after(BOUND):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            await _lend(nursery, client, server, idle_waits)
            timer.start()
            wcs = await client.recv_cq.poll_wait(1)
    assert wcs[0].status == WCStatus.SUCCESS
    assert idle_waits


@BOTH_ENGINES
async def test_a_cancelled_cq_waiter_waiting_idle_leaves_at_its_deadline(
    ctx: Any, idle_waits: list[tuple[int, int]]
) -> None:
    client, server = await make_pair(ctx)
    _recv(client, 16)
    async with trio.open_nursery() as nursery:
        await _lend(nursery, client, server, idle_waits)
        start = trio.current_time()
        with trio.move_on_after(0.1) as scope:
            await client.recv_cq.poll_wait(1)
    assert scope.cancelled_caught
    assert trio.current_time() - start < BOUND
    assert not client.recv_cq.poll(1)
    assert idle_waits and idle_waits[0][1] <= 100


@BOTH_ENGINES
async def test_a_stream_read_in_idle_waits_leaves_other_tasks_their_turn(
    ctx: Any, idle_waits: list[tuple[int, int]]
) -> None:
    """A peer that sends without pause: the waiter's socket is readable at every wait,
    so its waits end with a read, idle or not, and do not yield to trio by themselves;
    another task whose socket becomes readable still gets its turn."""
    client, server = await make_pair(ctx)
    _recv(client, 64)
    src = server.reg(b"m" * 32)
    other_read = trio.Event()
    with _from_a_thread("socket", other_read.set) as (timer, reader), trio.fail_after(BOUND):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            await trio.sleep(0.01)  # (it waits for its socket now)
            timer.start()
            sent = got = 0
            while not other_read.is_set():
                while sent - got < 48:  # (the client's 64 receives are never short)
                    server.qp.post_send(SendWR(0, WROpcode.SEND, [src.sge()], SendFlags(0)))
                    sent += 1
                for wc in client.recv_cq.poll(64):
                    assert wc.status == WCStatus.SUCCESS
                    client.qp.post_recv(RecvWR(wc.wr_id, [client.reg(64).sge()]))
                    got += 1
                if sent > got and not len(client.recv_cq):  # (else: all came, send more)
                    await client.recv_cq.wait()
    assert got > 0


# ---------------------------------------------------------------- one call into C (native)
@pytest.fixture
def native_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Devices opened during the test get the native engine (what these tests look at)."""
    if not native.AVAILABLE:
        pytest.skip(f"native engine unavailable: {native.WHY_NOT}")
    monkeypatch.setenv(engines.ENV_ENGINE, "native")


@pytest.fixture
def one_call(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The completions each of the test's own waits took in one call into C
    (:meth:`.NativeLink.wait_poll`; 0: it waited the other way)."""
    seen: list[int] = []
    real = native_link.NativeLink.wait_poll
    ours = threading.get_ident()

    def spy(self: Any, *args: Any) -> int:
        got = real(self, *args)
        if threading.get_ident() == ours:
            seen.append(got)
        return got

    monkeypatch.setattr(native_link.NativeLink, "wait_poll", spy)
    return seen


@contextlib.contextmanager
def _closing(side: Side) -> Iterator[None]:
    """Destroy the QP at the end, whatever happened (so the peer's run ends too)."""
    try:
        yield
    finally:
        side.qp.close()


async def _ping(side: Side, slots: Any, i: int, api: str) -> None:
    """Send ``i`` and take its echo through ``api``: in its slot, in order."""
    out = side.reg(struct.pack("<Q", i))
    side.qp.post_send(SendWR(i, WROpcode.SEND, [out.sge()], SendFlags.INLINE))
    if api == "poll_wait":
        (wc,) = await side.recv_cq.poll_wait(4)
        status, opcode, wr_id, length = wc.status, wc.opcode, wc.wr_id, wc.byte_len
    else:
        wcs = WCArray(4)
        assert await side.recv_cq.poll_wait_into(wcs) == 1
        status, opcode, wr_id, length = wcs.status[0], wcs.opcode[0], wcs.wr_id[0], wcs.byte_len[0]
    assert (status, opcode, length) == (WCStatus.SUCCESS, WCOpcode.RECV, 8)
    assert struct.unpack_from("<Q", slots.buf, 64 * wr_id)[0] == i
    side.qp.post_recv(RecvWR(wr_id, [slots.sge(64 * wr_id, 64)]))


@pytest.mark.usefixtures("native_only")
@pytest.mark.parametrize("busy_poll", [0.0, 50e-6])
@pytest.mark.parametrize("api", ["poll_wait", "poll_wait_into"])
async def test_a_ping_pong_waits_reads_and_polls_in_one_call_into_c(
    ctx: Any, one_call: list[int], api: str, busy_poll: float
) -> None:
    """The peer echoes from its own run: once the socket is lent to the waiter, its waits
    (busy polling first, when asked) wait, read and poll in one call into C, and every
    echo comes back whole, in order, in the slot its completion names."""
    rounds = 200
    async with _peer_in_its_own_run(_echo(rounds)) as port:
        client, slots = await _client_of(ctx, port)
        client.recv_cq.busy_poll = busy_poll
        with _closing(client), trio.fail_after(BOUND * 3):
            for i in range(rounds):
                await _ping(client, slots, i, api)
    # (every 16th wait in a row goes through trio's turn, and the first ones lend)
    assert sum(1 for got in one_call if got == 1) >= rounds // 2, one_call


@BOTH_ENGINES
async def test_a_busy_polled_ping_pong_lets_a_task_that_became_ready_run(ctx: Any) -> None:
    """Busy polling reads each answer before the spin ends, so no wait goes through trio;
    a task that became ready meanwhile still runs within READS_BEFORE_YIELD waits (once,
    every busy-polled wait of a new connection kept its own task from ever running, and
    with it the waits from being one call)."""
    every = lending.READS_BEFORE_YIELD
    rounds = 4 * every
    async with _peer_in_its_own_run(_echo(rounds)) as port:
        client, slots = await _client_of(ctx, port)
        client.recv_cq.busy_poll = 200e-6  # (one slice: the answer comes within it)
        at = [0]
        ran_at: list[int] = []

        async def note() -> None:
            ran_at.append(at[0])

        with _closing(client), trio.fail_after(BOUND * 3):
            async with trio.open_nursery() as nursery:
                for i in range(rounds):
                    at[0] = i
                    if i == every:
                        nursery.start_soon(note)
                    await _ping(client, slots, i, "poll_wait")
                done = list(ran_at)
    assert len(done) == 1 and done[0] <= 3 * every, done


@pytest.mark.usefixtures("native_only")
async def test_an_armed_cq_gets_its_event_for_a_completion_taken_in_one_call(
    ctx: Any, one_call: list[int]
) -> None:
    rounds = 64
    armed_in_one_call: list[bool] = []
    async with _peer_in_its_own_run(_echo(rounds)) as port:
        channel = ctx.create_comp_channel()
        client, slots = await _client_of(ctx, port, channel)
        cq = client.recv_cq
        with _closing(client), trio.fail_after(BOUND):
            for i in range(rounds):
                cq.req_notify()
                delivered, calls = cq.events_delivered, len(one_call)
                await _ping(client, slots, i, "poll_wait_into")
                # Every armed completion reports its event, however it was taken. (The
                # events are taken after the loop: a wait for one lets trio wait for I/O,
                # which hands the socket back, and the next wait could not be one call.)
                assert cq.events_delivered == delivered + 1
                armed_in_one_call.append(len(one_call) > calls and one_call[-1] == 1)
            for _ in range(rounds):
                assert await channel.get_cq_event() is cq
    assert any(armed_in_one_call), one_call


@pytest.mark.usefixtures("native_only")
async def test_a_one_call_wait_that_took_every_completion_leaves_nothing_to_hand_on(
    ctx: Any, one_call: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the one call's rows are all the CQ had and no one waits to be told, C clears
    the news and Python hands nothing on (no ``_took``); what it did not hand on is not
    reported later either: the solicited echoes taken so are not the next solicited
    completion of a CQ armed afterwards, and its next completion is."""
    took: list[int] = []
    real_took = native_link.NativeLink._took

    def spy(self: Any, n: int) -> bool | None:
        took.append(n)
        return real_took(self, n)

    monkeypatch.setattr(native_link.NativeLink, "_took", spy)
    rounds = 64
    quiet = 0
    async with _peer_in_its_own_run(_echo(rounds + 2, solicited=rounds)) as port:
        channel = ctx.create_comp_channel()
        client, slots = await _client_of(ctx, port, channel)
        cq = client.recv_cq
        with _closing(client), trio.fail_after(BOUND):
            for i in range(rounds):
                calls, reads = len(one_call), len(took)
                await _ping(client, slots, i, "poll_wait_into")
                quiet += len(one_call) > calls and one_call[-1] == 1 and len(took) == reads
            assert len(cq) == 0 and cq.poll() == []
            cq.req_notify(solicited_only=True)
            await _ping(client, slots, rounds, "poll_wait_into")  # (no SE)
            assert cq.events_delivered == 0
            cq.req_notify()
            await _ping(client, slots, rounds + 1, "poll_wait_into")
            assert cq.events_delivered == 1
            assert await channel.get_cq_event() is cq
    assert quiet >= rounds // 2, (quiet, one_call)


@pytest.mark.usefixtures("native_only")
async def test_a_task_driving_a_cq_runs_its_handler_in_one_hop(ctx: Any) -> None:
    """The native engine hands a read's completions to the handler of the CQ (the QP's
    only one) that the reading task drives (``CQ.drive_until``) from inside the read's
    processing (``NativeLink._handed_to_driver``), not through the context's queue of
    due handlers; each echo still calls it once, armed again by the handler, and every
    echo is taken whole."""
    rounds = 16
    routes: list[set[str]] = []
    got: list[int] = []
    async with _peer_in_its_own_run(_echo(rounds)) as port:
        client, slots = await _client_of(ctx, port)
        cq = client.recv_cq

        def handler(cq: Any) -> None:
            routes.append({frame.name for frame in traceback.extract_stack()})
            for wc in cq.poll(rounds):
                assert wc.status == WCStatus.SUCCESS
                got.append(struct.unpack_from("<Q", slots.buf, 64 * wc.wr_id)[0])
                client.qp.post_recv(RecvWR(wc.wr_id, [slots.sge(64 * wc.wr_id, 64)]))
            cq.req_notify()

        cq.set_handler(handler)
        cq.req_notify()
        with _closing(client), trio.fail_after(BOUND):
            for i in range(rounds):
                out = client.reg(struct.pack("<Q", i))
                client.qp.post_send(SendWR(i, WROpcode.SEND, [out.sge()], SendFlags.INLINE))
                assert await cq.drive_until(lambda i=i: len(got) > i)  # type: ignore[misc]
            cq.set_handler(None)
    assert got == list(range(rounds))
    one_hop = [r for r in routes if "_handed_to_driver" in r and "_dispatch" not in r]
    assert len(one_hop) >= rounds // 2, routes


@pytest.mark.usefixtures("native_only")
@pytest.mark.parametrize("api", ["poll_wait", "poll_wait_into"])
async def test_the_peer_closing_during_a_one_call_wait_flushes_the_receives(
    ctx: Any, one_call: list[int], api: str
) -> None:
    """The peer destroys its QP while the client waits in one call into C: the wait ends
    with the client's receives flushed, nothing hangs, and the QP is in ERR."""
    rounds = 64  # (enough for some of the waits to be one call, whatever else runs)
    async with _peer_in_its_own_run(_echo(rounds, then_close=True)) as port:
        client, slots = await _client_of(ctx, port)
        with _closing(client), trio.fail_after(BOUND):
            for i in range(rounds):
                await _ping(client, slots, i, api)
            assert any(one_call)
            calls = len(one_call)
            out = client.reg(8)
            client.qp.post_send(SendWR(0, WROpcode.SEND, [out.sge()], SendFlags.INLINE))
            flushed: list[WCStatus] = []
            while len(flushed) < 16:
                flushed += [wc.status for wc in await client.recv_cq.poll_wait(16)]
            await client.qp.wait_closed()
            assert len(one_call) > calls  # (the wait that met the end began as one call)
            assert flushed == [WCStatus.WR_FLUSH_ERR] * 16
            assert client.qp.state == QPState.ERR


# ---------------------------------------------------------------- Ctrl-C
_WAIT_FOREVER = textwrap.dedent(
    """
    import sys, trio, rdmashim
    sys.path.insert(0, sys.argv[1])
    from pairs import make_pair
    from rdmashim import SendFlags, SendWR, WROpcode
    from rdmashim.verbs.wr import RecvWR

    async def main():
        async with rdmashim.open_device("siw_lo") as ctx:
            client, server = await make_pair(ctx)
            mr, src = client.reg(128), server.reg(b"lend")
            client.qp.post_recv([RecvWR(i, [mr.sge(64 * i, 64)]) for i in range(2)])
            server.qp.post_send(SendWR(0, WROpcode.SEND, [src.sge()], SendFlags(0)))
            await client.recv_cq.poll_wait(1)  # (the socket stays lent: the next wait is idle)
            print("waiting", flush=True)
            await client.recv_cq.poll_wait(1)

    trio.run(main)
    """
)


@BOTH_ENGINES
def test_ctrl_c_ends_a_cq_waiter_waiting_idle(tmp_path: Path) -> None:
    script = tmp_path / "wait_forever.py"
    script.write_text(_WAIT_FOREVER)
    tests = str(Path(__file__).parent)
    proc = subprocess.Popen(
        [sys.executable, str(script), tests],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ.copy(),
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "waiting"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=BOUND)
    finally:
        proc.kill()
    assert proc.returncode != 0
    assert "KeyboardInterrupt" in err, err


@BOTH_ENGINES
async def test_a_links_tasks_are_protected_from_ctrl_c(
    ctx: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C reaches the main task, never a link's task halfway through its work (as
    trio's own tasks): a CQ handler, which the receive task runs, and the transmit
    task's waits for room run with trio's KeyboardInterrupt protection on."""
    protected: dict[str, list[bool]] = {"receive": [], "transmit": []}
    pace = driver.Link._pace

    def watched_pace(self: driver.Link, waited: float) -> None:
        if trio.lowlevel.current_task().coro.cr_code.co_name == "_tx_loop":  # (not the start)
            protected["transmit"].append(trio.lowlevel.currently_ki_protected())
        pace(self, waited)

    monkeypatch.setattr(driver.Link, "_pace", watched_pace)
    client, server = await make_pair(ctx)
    server.recv_cq.set_handler(
        lambda cq: protected["receive"].append(trio.lowlevel.currently_ki_protected())
    )
    server.recv_cq.req_notify()
    size = 4 << 20  # (more than the socket holds: the transmit task waits for room)
    src, dst = client.reg(b"s" * size), server.reg(size)
    server.qp.post_recv(RecvWR(0, [dst.sge()]))
    client.qp.post_send(SendWR(0, WROpcode.SEND, [src.sge()], SendFlags.SIGNALED))
    with trio.fail_after(BOUND):
        while not protected["receive"]:  # noqa: ASYNC110 (the handler runs in another task)
            await trio.sleep(0.001)
    assert protected["receive"] and all(protected["receive"]), protected
    assert protected["transmit"] and all(protected["transmit"]), protected


# ---------------------------------------------------------------- RDS
def _rds_echo(
    transport: str, rounds: int, port: int
) -> Callable[[Callable[[int], None]], Awaitable[None]]:
    """An RDS node on ``port`` that echoes ``rounds`` messages."""

    async def main(say_port: Callable[[int], None]) -> None:
        (node,) = await nodes(["127.0.0.2"], transport, port=port)  # type: ignore[arg-type]
        try:
            sock = node.bind(5000)
            say_port(node.port)
            for _ in range(rounds):
                data, source = await sock.recvfrom()
                await sock.sendto(data, source)
        finally:
            await close([node])

    return main


@transports
async def test_an_rds_ping_pong_reads_in_idle_waits(
    transport: str, idle_waits: list[tuple[int, int]]
) -> None:
    """RDS over either transport, the peer node in its own run: the answers come while
    this run waits idle (RDS/TCP's session waits in a poll of its own, RDMA's CQ waiter
    through the engine's link). This node's waits block at once (a polling wait often
    sees the answer before it would wait)."""
    if idle.current() is None:
        pytest.skip("no idle waits on this platform")
    rounds = 50
    port = free_port("127.0.0.1", "127.0.0.2")
    async with _peer_in_its_own_run(_rds_echo(transport, rounds, port)) as port:
        node = RdsNode(
            "127.0.0.1", port, transport=transport,  # type: ignore[arg-type]
            settings=RdsSettings(busy_poll=0.0),
        )  # fmt: skip
        async with node:
            sock = node.bind(4000)
            with trio.fail_after(BOUND * 3):
                for i in range(rounds):
                    await sock.sendto(b"m%d" % i, ("127.0.0.2", 5000))
                    assert (await sock.recvfrom())[0] == b"m%d" % i
    assert len(idle_waits) >= rounds // 2, idle_waits
