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

import errno
from collections.abc import Iterator

import pytest
import trio

from rdmashim.providers.softiwarp import native
from rdmashim.ulps.rds import plain, rdma_hooked, rdma_session
from rdmashim.ulps.rds.node import RdsError, RdsNode
from rdmashim.ulps.rds.rdma import RdmaOp, RdmaStatus
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
        taken, numbered = session._unfolded.next_recv, session._plain.hook.gate.next_seq
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
        assert (
            hook.gate.open
            and hook.gate.unsynced >= ROUNDS - 2
            and session.rds.next_seq < hook.gate.next_seq
        )
        (rds,) = b_node.connections()
        assert not hook.gate.open and not hook.gate.unsynced and rds.next_seq == hook.gate.next_seq
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
                    before = direct.hook.gate.unsynced
                    await a.sendto(bytes([i % 256]) * size, b.address)
                    if direct.hook.gate.unsynced > before:
                        went.append(i)
        assert 0 < len(went) < len(sizes), "the gate took none of them, or all"


async def test_answers_chasing_rdma_writes_go_in_one_call_into_c() -> None:
    """rds-stress ``-D``'s shape: each request offers a registered buffer by cookie, and
    its answer chases an RDMA Write into it. Once one went from C, the next go through
    the gate in one call into C; their data is in place when each answer arrives, and
    their operations end when the connection hears of them: SUCCESS for those the peer
    acknowledged, by the node's counters or by a wait (which brings in a Write still in
    the gate's log first)."""
    pattern = bytes(range(256)) * 16
    async with RdsNode(LOW, 0) as a_node, RdsNode(HIGH, a_node.port) as b_node:
        a, b = a_node.bind(4000), b_node.bind(5000)
        buffers = [bytearray(len(pattern)) for _ in range(ROUNDS)]
        cookies = [a.get_mr(buf) for buf in buffers]
        ops: list[RdmaOp] = []
        through_gate = 0

        async def answer() -> None:
            nonlocal through_gate
            for _ in range(ROUNDS):
                data, sender = await b.recvfrom()
                (entry,) = b_node._table.entries.values()
                op = RdmaOp.write_to(int(data), pattern)
                before = entry.rds.direct.hook.gate.unsynced if entry.rds.direct else 0
                await b.sendto(b"done", sender, rdma=op)
                direct = entry.rds.direct
                through_gate += direct is not None and direct.hook.gate.unsynced > before
                ops.append(op)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(answer)
            await trio.sleep(0.05)
            for i in range(ROUNDS):
                await a.sendto(b"%d" % cookies[i], b.address)
                assert await a.recvfrom() == (b"done", b.address)
                assert buffers[i] == pattern, f"answer {i} came before its Write's data"
        assert through_gate >= ROUNDS - 2, "the Writes did not go through the gate"
        assert ops[-1]._watch is not None and not ops[-1].done  # (in the gate's log)
        await a.sendto(b"bye", b.address)  # (it carries a's acknowledgement of them all)
        with trio.fail_after(10):
            assert await ops[-1].wait() == RdmaStatus.SUCCESS  # (brought in, then watched)
        (rds,) = b_node.connections()
        assert rds.counters.rdma_writes == ROUNDS
        assert rds.counters.rdma_bytes == ROUNDS * len(pattern)
        await wait_until(lambda: all(op.done for op in ops), 10, "every Write ended")
        assert {op.status for op in ops} == {RdmaStatus.SUCCESS}


async def test_writes_in_the_gates_log_when_the_session_ends_are_kept() -> None:
    """Messages chasing RDMA Writes that went through the gate, in its log when their
    session breaks, are brought in as it ends: the next session settles them from the
    peer's acknowledgement (never sending one again: the kernel's rule), and goes on."""
    pattern = b"w" * 4096
    async with RdsNode(LOW, 0) as a_node, RdsNode(HIGH, a_node.port) as b_node:
        a, b = a_node.bind(4000), b_node.bind(5000)
        await ping_pong(a, b, 2)  # (b's session sends from C: its gate opens)
        cookie = a.get_mr(bytearray(len(pattern)))
        (entry,) = b_node._table.entries.values()
        session = entry.rds.session
        assert isinstance(session, Session)
        ops = []
        for _ in range(3):
            op = RdmaOp.write_to(cookie, pattern)
            await b.sendto(b"chasing", a.address, rdma=op)
            ops.append(op)
        assert session._plain is not None and session._plain.hook.gate.unsynced, "none in the log"
        for _ in ops:  # (a has them, and holds its acknowledgement: no backstop here)
            assert await a.recvfrom() == (b"chasing", b.address)
        assert session._plain.hook.gate.unsynced >= len(ops) and not any(op.done for op in ops)
        a_node._table.entries[next(iter(a_node._table.entries))].rds.session.cut()
        await wait_until(lambda: session.lost, 10, "the session ended")
        assert not session._plain.hook.gate.unsynced and not session._plain.log  # (brought in)
        await wait_until(lambda: entry.rds.session not in (None, session), 10, "reconnected")
        # The new session began from the peer's acknowledgement (it had them all: done),
        # and none was sent again.
        assert [op.status for op in ops] == [RdmaStatus.SUCCESS] * 3
        await ping_pong(a, b, 3)
        with pytest.raises(trio.WouldBlock):
            a.recvfrom_nowait()


async def test_a_cookie_naming_no_address_is_refused_by_name() -> None:
    """A cookie too wide for a 64-bit address (one a peer sent, say) is refused with
    EINVAL, whether the message would go through the gate or the connection, and the
    session goes on (it was an OverflowError out of cffi)."""
    async with RdsNode(LOW, 0) as a_node, RdsNode(HIGH, a_node.port) as b_node:
        a, b = a_node.bind(4000), b_node.bind(5000)
        await ping_pong(a, b, 3)
        (entry,) = b_node._table.entries.values()
        assert entry.rds.direct is not None  # (the gate is open)
        for _ in range(2):  # (the first closes the gate on its way through Python)
            with pytest.raises(RdsError) as info:
                await b.sendto(b"w", a.address, rdma=RdmaOp.write_to(1 << 100, b"z"))
            assert info.value.errno == errno.EINVAL and "no 64-bit address" in str(info.value)
        await ping_pong(a, b, 3)
