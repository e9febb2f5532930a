"""What an RDS-over-RDMA session on the C path leaves unfolded, and where it folds it in.

A reader driving its session has its plain messages taken by the CQ's native handler in
C; the session folds what C took (numbers, counters, acknowledgements of our messages)
only when something needs it (``rdma_hooked.py``). These tests make a ping-pong that
leaves the state unfolded (the backstop timer pushed out of the way), check that it is
(so the tests can fail), and then hold the places that must fold to it: counters read
through the node, and the session's end, after which the next session numbers on from
where C got to (else the peer's resends would be delivered twice).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import trio

from rdmashim.providers.softiwarp import native
from rdmashim.ulps.rds import plain, rdma_hooked, rdma_session
from rdmashim.ulps.rds.node import RdsNode
from rdmashim.ulps.rds.rdma_session import Session
from rdmashim.ulps.rds.sockets import RdsSocket
from rdmashim.verbs import QPState

from rdsnodes import wait_until

pytestmark = [
    pytest.mark.skipif(
        plain.COMPILED is None, reason=f"RDS's plain path in C is not built: {plain.WHY_NOT}"
    ),
    pytest.mark.skipif(
        not native.AVAILABLE, reason=f"no native engine (its native handler): {native.WHY_NOT}"
    ),
]

LOW, HIGH = "127.0.0.1", "127.0.0.2"
ROUNDS = 50


@pytest.fixture(autouse=True)
def _no_backstop(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The session's backstop fold comes after the test, not during it."""
    monkeypatch.setattr(rdma_hooked, "ACK_BACKSTOP", 600.0)
    monkeypatch.setattr(rdma_session, "ACK_BACKSTOP", 600.0)
    yield


async def ping_pong(a: RdsSocket, b: RdsSocket, rounds: int) -> None:
    """``a`` asks, ``b``'s reader answers each request (its driven wait takes it in C)."""

    async def answer() -> None:
        for _ in range(rounds):
            data, sender = await b.recvfrom()
            await b.sendto(data[::-1], sender)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(answer)
        await trio.sleep(0.05)  # (the reader drives its session before the first request)
        for i in range(rounds):
            request = f"request {i}".encode()
            await a.sendto(request, b.address)
            assert await a.recvfrom() == (request[::-1], b.address)


def unfolded_session(node: RdsNode) -> Session:
    """The node's only session, checked to hold messages C took that Python has not
    folded in: the connection's numbers lag C's."""
    (entry,) = node._table.entries.values()  # (private: no public call may fold)
    session = entry.rds.session
    assert isinstance(session, Session) and session._hooked
    rx = session._unfolded
    assert rx.has_ack and entry.rds.next_recv < rx.next_recv, "nothing was left unfolded"
    return session


async def test_counters_read_through_the_node_are_current() -> None:
    async with RdsNode(LOW, 0) as a_node, RdsNode(HIGH, a_node.port) as b_node:
        a, b = a_node.bind(4000), b_node.bind(5000)
        await ping_pong(a, b, ROUNDS)
        session = unfolded_session(b_node)
        stale = session.rds.counters.recv_messages
        (rds,) = b_node.connections()
        assert stale < ROUNDS == rds.counters.recv_messages
        assert rds.next_recv == session._unfolded.next_recv


async def test_a_session_that_ends_leaves_its_numbers_current() -> None:
    async with RdsNode(LOW, 0) as a_node, RdsNode(HIGH, a_node.port) as b_node:
        a, b = a_node.bind(4000), b_node.bind(5000)
        await ping_pong(a, b, ROUNDS)
        session = unfolded_session(b_node)
        taken, numbered = session._unfolded.next_recv, session._plain.hook.next_seq
        assert session.rds.next_seq < numbered, "no answer went through the gate"
        session.qp.modify(qp_state=QPState.ERR)
        await wait_until(lambda: session.lost, 10, "the session ended")
        await wait_until(lambda: session.rds.session not in (None, session), 10, "reconnected")
        assert session.rds.next_recv == taken
        assert session.rds.next_seq == numbered  # (else the peer drops what comes as old)
        # The new session goes on, and nothing the peer sends again is delivered twice.
        await ping_pong(a, b, 5)
        await trio.sleep(0.1)
        with pytest.raises(trio.WouldBlock):
            b.recvfrom_nowait()


async def test_a_ping_pongs_answers_go_in_one_call_into_c() -> None:
    """Once a plain answer went from C with nothing before it, the next ones go through the
    gate of ``sendto`` in one call into C: the connection hears of them when it is read
    (here through the node), numbered in order and counted."""
    async with RdsNode(LOW, 0) as a_node, RdsNode(HIGH, a_node.port) as b_node:
        a, b = a_node.bind(4000), b_node.bind(5000)
        await ping_pong(a, b, ROUNDS)
        session = unfolded_session(b_node)
        hook = session._plain.hook
        assert hook.open and hook.unsynced >= ROUNDS - 2 and session.rds.next_seq < hook.next_seq
        (rds,) = b_node.connections()
        assert not hook.open and not hook.unsynced and rds.next_seq == hook.next_seq
        assert rds.counters.send_messages == ROUNDS
        seqs = [m.seq for m in rds.unacked]
        assert seqs == list(range(rds.next_seq - len(seqs), rds.next_seq))


async def test_messages_through_the_gate_and_through_python_keep_their_order() -> None:
    """A socket's messages of any size in a pipeline, some through the gate in C, some
    (too long for one fragment, or while Python's wait) through the connection's queue:
    the peer gets them all, in order."""
    went: list[int] = []
    async with RdsNode(LOW, 0) as a_node, RdsNode(HIGH, a_node.port) as b_node:
        a, b = a_node.bind(4000), b_node.bind(5000)
        await ping_pong(a, b, 2)  # (the sessions' handlers are in C now)
        (entry,) = a_node._table.entries.values()
        direct = entry.rds.direct
        assert direct is not None
        sizes = [(i * 7919) % 9000 if i % 5 == 0 else i % 300 for i in range(400)]

        async def receive() -> None:
            for i, size in enumerate(sizes):
                data, _ = await b.recvfrom()
                assert data == bytes([i % 256]) * size, f"message {i}"

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(receive)
                for i, size in enumerate(sizes):
                    before = direct.hook.unsynced
                    await a.sendto(bytes([i % 256]) * size, b.address)
                    if direct.hook.unsynced > before:
                        went.append(i)
        assert 0 < len(went) < len(sizes), "the gate took none of them, or all"
