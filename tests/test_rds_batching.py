"""RDS's batching paths: ``recvfrom_nowait``, answers to a burst of delivered
messages, which a session on the Python path holds back to post together
(``Session.pump_sends``; on the C path each goes from C at once), and
acknowledgements held back for a message to carry them (``ACK_DELAY``)."""

from __future__ import annotations

import errno
from typing import Any

import pytest
import trio
import trio.testing
from api.busyloop import loop_sleeps

from rdmashim.ulps.rds.node import RdsError, RdsSocket
from rdmashim.ulps.rds.rdma_flow import ACK_DELAY
from rdmashim.ulps.rds.rdma_session import BURST_MAX, OPENING_MAX, Session
from rdmashim.ulps.rds.settings import RdsSettings

from rdsnodes import close, nodes, transports, wait_until

pytestmark = pytest.mark.usefixtures("rds_paths")  # C and Python plain paths

BURST = 24
SMALL_BURST = BURST_MAX // 2
"""A burst whose answers all fit the hold (BURST_MAX)."""


@transports
async def test_recvfrom_nowait_takes_what_is_here_in_order(transport: str) -> None:
    a, b = await nodes(["127.0.0.1", "127.0.0.2"], transport)
    try:
        sa, sb = a.bind(4000), b.bind(5000)
        with pytest.raises(trio.WouldBlock):
            sb.recvfrom_nowait()
        with trio.fail_after(20):
            for i in range(5):
                await sa.sendto(b"m%d" % i, ("127.0.0.2", 5000))
            first = await sb.recvfrom()
            got = [first]
            while len(got) < 5:
                try:
                    got.append(sb.recvfrom_nowait())
                except trio.WouldBlock:
                    got.append(await sb.recvfrom())
        assert got == [(b"m%d" % i, ("127.0.0.1", 4000)) for i in range(5)]
        assert sb.queued_bytes == 0
        with pytest.raises(trio.WouldBlock):
            sb.recvfrom_nowait()
        sb.close()
        with pytest.raises(RdsError) as info:
            sb.recvfrom_nowait()
        assert info.value.errno == errno.EBADF
    finally:
        await close([a, b])


@transports
async def test_answers_to_a_burst_arrive_when_the_answerer_stops_receiving(
    transport: str,
) -> None:
    """The requests, queued before the connection is up, go out in one post and come
    in together; the server answers every one in one turn and then waits on something
    else (not ``recvfrom``): the answers held back for the burst must still go out,
    in order."""
    a, b = await nodes(["127.0.0.1", "127.0.0.2"], transport)
    try:
        sa, sb = a.bind(4000), b.bind(5000)
        answered = trio.Event()

        async def server() -> None:
            data, sender = await sb.recvfrom()
            count = 0
            while True:
                await sb.sendto(b"re:" + data, sender)
                count += 1
                if count == BURST:
                    break
                try:
                    data, sender = sb.recvfrom_nowait()
                except trio.WouldBlock:
                    data, sender = await sb.recvfrom()
            answered.set()
            await trio.sleep_forever()

        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(server)
                for i in range(BURST):
                    sa.sendto_nowait(b"q%d" % i, ("127.0.0.2", 5000))
                got = [await sa.recvfrom() for _ in range(BURST)]
                await answered.wait()
                nursery.cancel_scope.cancel()
        assert got == [(b"re:q%d" % i, ("127.0.0.2", 5000)) for i in range(BURST)]
    finally:
        await close([a, b])


async def test_a_burst_is_answered_first_at_once_then_together_when_the_receiver_waits(
    monkeypatch: pytest.MonkeyPatch, rds_paths: str
) -> None:
    """The first answer to a burst is posted at once, so that the peer starts on it;
    the others wait, and the receiver posts them together itself when it goes back
    to ``recvfrom`` with no message left anywhere (not the session's task, later). On
    the C path every answer goes at once, from C (held back, they cost more than the
    posts they save: rds stress ``t=4 d=8`` 0.87-1.02 -> 1.03-1.09 of raw TCP)."""
    held = rds_paths == "python"
    answered_by: list[tuple[Any, int]] = []
    answer_burst = Session.answer_burst

    def spy(session: Session) -> None:
        answered_by.append((trio.lowlevel.current_task(), len(session.rds.unsent)))
        answer_burst(session)

    monkeypatch.setattr(Session, "answer_burst", spy)
    a, b = await nodes(["127.0.0.1", "127.0.0.2"])
    try:
        sa, sb = a.bind(4000), b.bind(5000)
        for i in range(SMALL_BURST):  # queued before the connection is up: one post, one read
            sa.sendto_nowait(b"q%d" % i, ("127.0.0.2", 5000))
        with trio.fail_after(20):
            data, sender = await sb.recvfrom()
            assert len(sb.received) == SMALL_BURST - 1  # the burst: one handler run delivered all
            rds = b.connections()[0]
            await sb.sendto(b"re:" + data, sender)
            assert not rds.unsent  # posted at once
            for _ in range(SMALL_BURST - 1):
                data, sender = sb.recvfrom_nowait()
                await sb.sendto(b"re:" + data, sender)
            # held back for the rest of the burst (Python's path), or gone (C's)
            assert len(rds.unsent) == (SMALL_BURST - 1 if held else 0)
            with trio.move_on_after(0.5):
                await sb.recvfrom()
            if held:
                assert answered_by[:1] == [(trio.lowlevel.current_task(), SMALL_BURST - 1)]
            assert not rds.unsent
            got = [await sa.recvfrom() for _ in range(SMALL_BURST)]
        assert got == [(b"re:q%d" % i, ("127.0.0.2", 5000)) for i in range(SMALL_BURST)]
    finally:
        await close([a, b])


@pytest.mark.parametrize("senders", [1, 2])
async def test_a_large_burst_from_several_sockets_is_answered_all_together(
    senders: int, rds_paths: str
) -> None:
    """A burst of more than OPENING_MAX messages from several sockets has no answer
    posted at once: all go together when the receiver waits again. From one socket
    (one conversation, whose two ends would take turns) the first still goes at once.
    On the C path each goes at once, from C."""
    held = rds_paths == "python"
    size = OPENING_MAX + 4
    assert size <= BURST_MAX  # (else the hold posts some itself)
    a, b = await nodes(["127.0.0.1", "127.0.0.2"])
    try:
        socks, sb = [a.bind(4000 + k) for k in range(senders)], b.bind(5000)
        for i in range(size):  # queued before the connection is up: one post, one read
            socks[i % senders].sendto_nowait(b"q%d" % i, ("127.0.0.2", 5000))
        with trio.fail_after(20):
            data, sender = await sb.recvfrom()
            assert len(sb.received) == size - 1  # the burst: one handler run delivered all
            rds = b.connections()[0]
            await sb.sendto(b"re:" + data, sender)
            assert len(rds.unsent) == (0 if senders == 1 or not held else 1)
            for _ in range(size - 1):
                data, sender = sb.recvfrom_nowait()
                await sb.sendto(b"re:" + data, sender)
            assert len(rds.unsent) == (size - (1 if senders == 1 else 0) if held else 0)
            with trio.move_on_after(0.5):
                await sb.recvfrom()
            assert not rds.unsent
            for k, sock in enumerate(socks):
                got = [await sock.recvfrom() for _ in range(k, size, senders)]
                assert got == [
                    (b"re:q%d" % i, ("127.0.0.2", 5000)) for i in range(k, size, senders)
                ]
    finally:
        await close([a, b])


async def test_answers_held_for_a_burst_survive_the_session_breaking(rds_paths: str) -> None:
    """The session breaks while it holds answers back: the node lets go of it (a peer
    that reconnects over and over cannot pile dead sessions up there), and the answers,
    still queued, go out over the next session, once each and in order. (On the C path
    none is held: the ones C sent and the peer has yet to acknowledge are the ones the
    next session sends again, once each and in order.)"""
    a, b = await nodes(["127.0.0.1", "127.0.0.2"])
    try:
        sa, sb = a.bind(4000), b.bind(5000)
        for i in range(SMALL_BURST):
            sa.sendto_nowait(b"q%d" % i, ("127.0.0.2", 5000))
        with trio.fail_after(30):
            data, sender = await sb.recvfrom()
            await sb.sendto(b"re:" + data, sender)
            for _ in range(SMALL_BURST - 1):
                data, sender = sb.recvfrom_nowait()
                await sb.sendto(b"re:" + data, sender)
            rds = b.connections()[0]
            session = rds.session
            held = [session] if rds_paths == "python" else []
            assert isinstance(session, Session) and list(b._bursts) == held
            session.cut()
            got = [await sa.recvfrom() for _ in range(SMALL_BURST)]
            await trio.testing.wait_all_tasks_blocked()
        assert got == [(b"re:q%d" % i, ("127.0.0.2", 5000)) for i in range(SMALL_BURST)]
        assert rds.session is not session and session not in b._bursts
        if held:  # (they went over the next session; C's may all have gone before the cut)
            assert rds.counters.sessions == 2
    finally:
        await close([a, b])


async def test_closing_a_socket_that_holds_messages_keeps_the_bursts_going() -> None:
    """A socket closed with messages unread drops them, and no longer counts as one
    whose owner has yet to answer: the next burst is still posted by its receiver."""
    a, b = await nodes(["127.0.0.1", "127.0.0.2"])
    try:
        sa, sb, doomed = a.bind(4000), b.bind(5000), b.bind(5001)
        with trio.fail_after(20):
            for i in range(3):
                await sa.sendto(b"lost %d" % i, ("127.0.0.2", 5001))
            await sa.sendto(b"after", ("127.0.0.2", 5000))
            assert (await sb.recvfrom())[0] == b"after"  # in order: the three are there
            assert len(doomed.received) == 3
            doomed.close()
            assert not doomed.received
            with pytest.raises(RdsError) as err:
                doomed.recvfrom_nowait()
            assert err.value.errno == errno.EBADF
            assert b._inboxes.counts.holding == 0
            await sa.sendto(b"ping", ("127.0.0.2", 5000))
            assert (await sb.recvfrom())[0] == b"ping"
            assert b._inboxes.counts.holding == 0
    finally:
        await close([a, b])


async def test_bursts_both_ways_many_sockets() -> None:
    """Several client sockets keep requests in flight and several server sockets answer
    them in bursts: every answer comes back once, in order per socket."""
    a, b = await nodes(["127.0.0.1", "127.0.0.2"])
    rounds, depth, tasks = 40, 8, 4
    try:
        servers = [b.bind(5000 + i) for i in range(tasks)]
        clients = [a.bind(4000 + i) for i in range(tasks)]
        seen: list[list[bytes]] = [[] for _ in range(tasks)]

        async def serve(sock: RdsSocket) -> None:
            while True:
                try:
                    data, sender = sock.recvfrom_nowait()
                except trio.WouldBlock:
                    data, sender = await sock.recvfrom()
                await sock.sendto(data, sender)

        async def client(i: int) -> None:
            sock, dest = clients[i], servers[i].address
            sent = 0
            for _ in range(depth):
                await sock.sendto(b"%d:%d" % (i, sent), dest)
                sent += 1
            while len(seen[i]) < rounds * depth:
                data, _ = await sock.recvfrom()
                seen[i].append(data)
                if sent < rounds * depth:
                    await sock.sendto(b"%d:%d" % (i, sent), dest)
                    sent += 1

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for sock in servers:
                    nursery.start_soon(serve, sock)
                async with trio.open_nursery() as clients_nursery:
                    for i in range(tasks):
                        clients_nursery.start_soon(client, i)
                nursery.cancel_scope.cancel()
        for i in range(tasks):
            assert seen[i] == [b"%d:%d" % (i, n) for n in range(rounds * depth)]
    finally:
        await close([a, b])


async def test_a_steady_exchange_sends_no_bare_acks() -> None:
    """In a ping-pong every message carries the acknowledgement of the one before: a bare
    ack goes only when no message of ours followed a receive within ACK_DELAY, so only
    a round that slow may cost one. The echo answers a quarter of ACK_DELAY late: a
    timer that fired ACK_DELAY after the first of many receives would find one
    unanswered most times."""
    a, b = await nodes(["127.0.0.1", "127.0.0.2"])
    try:
        sa, sb = a.bind(4000), b.bind(5000)

        async def echo() -> None:
            while True:
                data, sender = await sb.recvfrom()
                await trio.sleep(ACK_DELAY / 4)
                await sb.sendto(data, sender)

        slow = 0
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(echo)
                await sa.sendto(b"hello", ("127.0.0.2", 5000))  # the session comes up
                await sa.recvfrom()
                acks_before = [n.connections()[0].counters.acks_sent for n in (a, b)]
                for i in range(100):
                    start = trio.current_time()
                    await sa.sendto(b"%d" % i, ("127.0.0.2", 5000))
                    assert await sa.recvfrom() == (b"%d" % i, ("127.0.0.2", 5000))
                    slow += trio.current_time() - start > ACK_DELAY
                nursery.cancel_scope.cancel()
        acks_after = [n.connections()[0].counters.acks_sent for n in (a, b)]
        acks = [n - m for n, m in zip(acks_after, acks_before, strict=True)]
        assert sum(acks) <= slow, f"bare acks {acks} in a ping-pong with {slow} slow rounds"
    finally:
        await close([a, b])


@pytest.mark.parametrize("reader", [True, False], ids=["read", "unread"])
async def test_messages_nobody_answers_are_acknowledged_on_their_own(reader: bool) -> None:
    """No message of the receiver's carries the acknowledgement: a bare one goes
    ACK_DELAY after the first message once a reader goes back to waiting, and at the
    latest ACK_BACKSTOP after that when none does (a socket nobody reads): well within
    a hundred times ACK_DELAY here."""
    a, b = await nodes(["127.0.0.1", "127.0.0.2"])
    try:
        sa, sb = a.bind(4000), b.bind(5000)
        with trio.fail_after(30):
            for i in range(5):
                await sa.sendto(b"%d" % i, ("127.0.0.2", 5000))
            if reader:
                for _ in range(5):
                    await sb.recvfrom()
            else:
                await wait_until(lambda: len(sb.received) == 5, 10, "five messages at b")
        await trio.sleep(ACK_DELAY * 100)
        assert not a.connections()[0].unacked
        assert b.connections()[0].counters.acks_sent >= 1
    finally:
        await close([a, b])


@transports
async def test_a_reader_driving_its_session_wakes_for_what_comes_another_way(
    transport: str,
) -> None:
    """With one session up, a socket's waiting reader reads that connection itself
    (``CQ.drive_until``, ``TcpSession.drive_until``): a message from the node's own
    address, the socket closing, and a message over a second peer's session must still
    end its wait."""
    a, b, c = await nodes(["127.0.0.1", "127.0.0.2", "127.0.0.3"], transport)
    try:
        sa, sb, sc = a.bind(4000), b.bind(5000), c.bind(6000)
        other, closing = a.bind(4001), a.bind(4002)
        got: list[tuple[bytes, tuple[str, int]]] = []
        errors: list[int] = []

        async def receive(sock: RdsSocket) -> None:
            try:
                got.append(await sock.recvfrom())
            except RdsError as exc:
                errors.append(exc.errno)

        async def while_driving(sock: RdsSocket, act: Any) -> None:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(receive, sock)
                await trio.sleep(0.05)
                assert sock._driving is not None, "the reader does not drive the session"
                await act()

        async def close_it() -> None:
            closing.close()

        with trio.fail_after(30):
            await sa.sendto(b"up", ("127.0.0.2", 5000))  # the one session
            await sb.recvfrom()
            await while_driving(sa, lambda: other.sendto(b"local", ("127.0.0.1", 4000)))
            await while_driving(closing, close_it)
            await while_driving(sa, lambda: sc.sendto(b"third", ("127.0.0.1", 4000)))
        assert got == [(b"local", ("127.0.0.1", 4001)), (b"third", ("127.0.0.3", 6000))]
        assert errors == [errno.EBADF]
        assert a._table.drivable() is None  # two peers now: a reader parks instead
    finally:
        await close([a, b, c])


@transports
@pytest.mark.parametrize(("peers", "busy_poll"), [(1, 30.0), (2, 30.0), (1, 0.0), (2, 0.0)])
async def test_a_busy_polling_reader_keeps_the_loop_awake(
    transport: str, peers: int, busy_poll: float
) -> None:
    """``RdsSettings.busy_poll``: a reader waiting for a message polls (driving its
    node's one session, or the socket's queue with two peers up), so trio's run loop
    never sleeps until the message comes; without it, the loop sleeps meanwhile."""
    addresses = ["127.0.0.1", "127.0.0.2", "127.0.0.3"][: peers + 1]
    everyone = await nodes(addresses, transport, RdsSettings(busy_poll=busy_poll))
    a = everyone[0]
    try:
        sa = a.bind(4000)
        senders = [node.bind(5000) for node in everyone[1:]]

        async def send_later() -> None:
            await trio.sleep(0.05)
            await senders[-1].sendto(b"late", ("127.0.0.1", 4000))

        with trio.fail_after(30):
            for sender in senders:  # the sessions up
                await sender.sendto(b"up", ("127.0.0.1", 4000))
                await sa.recvfrom()
            assert (a._table.drivable() is not None) == (peers == 1)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(send_later)
                with loop_sleeps() as watch:
                    data, _ = await sa.recvfrom()
        assert data == b"late"
        assert (watch.sleeps == 0) == bool(busy_poll), watch.sleeps
    finally:
        await close(everyone)


def test_busy_poll_setting_is_checked() -> None:
    with pytest.raises(ValueError, match="busy_poll"):
        RdsSettings(busy_poll=-1)
