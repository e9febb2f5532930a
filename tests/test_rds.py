"""RDS sockets on both transports (the built-in engine, and TCP): nodes on loopback addresses."""

from __future__ import annotations

import errno
import os
import random
from ipaddress import ip_address
from typing import Any

import pytest
import trio
import trio.lowlevel

from rdmashim.ulps.rds.connection import RdsConnection
from rdmashim.ulps.rds.node import RdsError
from rdmashim.ulps.rds.settings import RdsSettings
from rdmashim.ulps.rds.wire import RDS_MAX_MSG_SIZE, RdsFlag, RdsHeader

from rdsnodes import close, nodes, transports

pytestmark = pytest.mark.usefixtures("rds_paths")  # C and Python plain paths


@transports
async def test_messages_both_ways_in_order(transport: str) -> None:
    a, b = await nodes(["127.0.0.1", "127.0.0.2"], transport)
    try:
        sa, sb = a.bind(4000), b.bind(5000)
        with trio.fail_after(20):
            for i in range(200):
                await sa.sendto(b"a%d" % i, ("127.0.0.2", 5000))
                await sb.sendto(b"b%d" % i, ("127.0.0.1", 4000))
            got_b = [await sb.recvfrom() for _ in range(200)]
            got_a = [await sa.recvfrom() for _ in range(200)]
        assert [d for d, _ in got_b] == [b"a%d" % i for i in range(200)]
        assert {s for _, s in got_b} == {("127.0.0.1", 4000)}
        assert [d for d, _ in got_a] == [b"b%d" % i for i in range(200)]
        # One connection per pair of nodes, whichever side spoke first.
        assert len(a.connections()) == len(b.connections()) == 1
    finally:
        await close([a, b])


@transports
async def test_two_readers_of_one_socket_each_get_a_message(transport: str) -> None:
    """Two tasks wait in ``recvfrom`` on one socket, one driving the session, the other
    parked; two messages come: each reader gets one. (The driving reader's messages
    taken in C wake no one, as it looks after each read: the reader that finds another
    waiting wakes the parked one. Without that, the parked one waited for ever over
    TCP.)"""
    a, b = await nodes(["127.0.0.1", "127.0.0.2"], transport)
    try:
        sa, sb = a.bind(4000), b.bind(5000)
        await sa.sendto(b"warm up", ("127.0.0.2", 5000))
        await sb.recvfrom()
        for round_ in range(20):
            got: list[bytes] = []

            async def reader() -> None:
                got.append((await sb.recvfrom())[0])  # noqa: B023 - awaited in this round

            with trio.fail_after(10):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(reader)
                    nursery.start_soon(reader)
                    await trio.sleep(0.001)  # (both wait: one drives, one is parked)
                    await sa.sendto(b"x%d" % round_, ("127.0.0.2", 5000))
                    await sa.sendto(b"y%d" % round_, ("127.0.0.2", 5000))
            assert sorted(got) == [b"x%d" % round_, b"y%d" % round_]
    finally:
        await close([a, b])


async def test_rdma_sessions_run_between_the_nodes_own_addresses() -> None:
    """Whichever node connects, it connects from its own address, as Linux RDS does
    (``rdma_resolve_addr`` from the connection's local address), not from the one
    the routing table would pick: the higher address speaks first here, so it
    connects, to the lower one, which on loopback routing would source."""
    a, b = await nodes(["127.0.0.1", "127.0.0.2"], "rdma")
    try:
        sa, sb = a.bind(4000), b.bind(5000)
        with trio.fail_after(20):
            await sb.sendto(b"from the higher address", ("127.0.0.1", 4000))
            assert (await sa.recvfrom())[0] == b"from the higher address"
        for node, here, there in ((a, "127.0.0.1", "127.0.0.2"), (b, "127.0.0.2", "127.0.0.1")):
            (rds,) = node.connections()
            conn = rds.session.conn
            assert (conn.local_addr[0], conn.peer_addr[0]) == (here, there)
    finally:
        await close([a, b])


@transports
async def test_a_sender_waiting_for_room_wakes_as_acks_come(transport: str) -> None:
    """With room for 4 messages, 300 sends wait for the peer's acknowledgements again
    and again; each one that frees room wakes them (the sends would hang otherwise)."""
    settings = RdsSettings(max_queued_messages=4)
    a, b = await nodes(["127.0.0.1", "127.0.0.2"], transport, settings)
    try:
        sa, sb = a.bind(4000), b.bind(5000)
        got: list[bytes] = []
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:

                async def receive() -> None:
                    while len(got) < 300:
                        got.append((await sb.recvfrom())[0])

                nursery.start_soon(receive)
                for i in range(300):
                    await sa.sendto(b"m%d" % i, ("127.0.0.2", 5000))
                    assert a.connections()[0].queued_messages <= 4
        assert got == [b"m%d" % i for i in range(300)]
    finally:
        await close([a, b])


@transports
async def test_all_to_all_three_nodes_large_messages(transport: str) -> None:
    addrs = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
    all_nodes = await nodes(addrs, transport)
    try:
        socks = [n.bind(p) for n in all_nodes for p in (4000, 4001)]
        rng = random.Random(7)
        sizes = [0, 1, 4095, 4096, 4097, 100_000, RDS_MAX_MSG_SIZE]
        plan: dict[tuple, list[bytes]] = {}
        with trio.fail_after(60):
            for src in socks:
                for dst in socks:
                    if dst is src:
                        continue
                    msgs = [rng.randbytes(rng.choice(sizes)) for _ in range(4)]
                    plan[(src.address, dst.address)] = msgs
                    for m in msgs:
                        await src.sendto(m, dst.address)
            received: dict[tuple, list[bytes]] = {}
            total = sum(len(v) for v in plan.values())
            async with trio.open_nursery() as nursery:
                count = [0]

                async def drain(sock: Any) -> None:
                    while count[0] < total:
                        data, sender = await sock.recvfrom()
                        received.setdefault((sender, sock.address), []).append(data)
                        count[0] += 1
                        if count[0] == total:
                            nursery.cancel_scope.cancel()

                for s in socks:
                    nursery.start_soon(drain, s)
        assert received == plan
    finally:
        await close(all_nodes)


class _Index:
    """An integer that is no int (as numpy's): ``operator.index`` takes it."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


async def test_ports_and_destinations_of_the_wrong_shape_are_einval() -> None:
    """A port that is no integer (a float, a string, a bool) and a destination that
    is no (address, port) pair are EINVAL at bind and sendto, naming the value; the
    node closes cleanly after (a float port used to be bound, and the node's close
    then failed in its congestion map). An integer of another type is taken."""
    (a,) = await nodes(["127.0.0.1"])
    try:
        for port in (1.5, "4000", None, True):
            with pytest.raises(RdsError, match=r"port .* is not") as info:
                a.bind(port)  # type: ignore[arg-type]
            assert info.value.errno == errno.EINVAL
        s = a.bind(4000)
        for dest in [
            ("127.0.0.2", 5.5), ("127.0.0.2", "80"), ("127.0.0.2",), None, "127.0.0.2",
            ("127.0.0.2", [80]), ("127.0.0.2", 70000),
        ]:  # fmt: skip
            with pytest.raises(RdsError) as info:
                s.sendto_nowait(b"x", dest)  # type: ignore[arg-type]
            assert info.value.errno == errno.EINVAL, dest
            with pytest.raises(RdsError):
                await s.sendto(b"x", dest)  # type: ignore[arg-type]
        assert a.bind(_Index(4001)).port == 4001  # type: ignore[arg-type]
        with pytest.raises(RdsError, match="cookie 'a'"):
            s.free_mr("a")  # type: ignore[arg-type]
        assert sorted(sock.port for sock in a.sockets()) == [4000, 4001]
    finally:
        await close([a])


@transports
async def test_errors_name_the_problem(transport: str) -> None:
    (a,) = await nodes(["127.0.0.1"], transport)
    try:
        s = a.bind(4000)
        with pytest.raises(RdsError) as info:
            a.bind(4000)
        assert info.value.errno == errno.EADDRINUSE
        with pytest.raises(RdsError) as info:
            await s.sendto(b"x" * (RDS_MAX_MSG_SIZE + 1), ("127.0.0.2", 1))
        assert info.value.errno == errno.EMSGSIZE
        with pytest.raises(RdsError, match="not an IP address"):
            await s.sendto(b"x", ("nowhere", 1))
        # Nobody at 127.0.0.9: the first message queues, then the node gives up on it.
        await s.sendto(b"x", ("127.0.0.9", 4000))
        with trio.fail_after(10):
            while True:
                try:
                    await s.sendto(b"x", ("127.0.0.9", 4000))
                except RdsError as exc:
                    assert exc.errno == errno.EHOSTUNREACH
                    break
                await trio.sleep(0.1)
        s.close()
        with pytest.raises(RdsError) as info:
            await s.sendto(b"x", ("127.0.0.2", 1))
        assert info.value.errno == errno.EBADF
    finally:
        await close([a])


@transports
@pytest.mark.parametrize("cuts", [3])
async def test_connection_cut_underneath_loses_nothing(cuts: int, transport: str) -> None:
    a, b = await nodes(["127.0.0.1", "127.0.0.2"], transport)
    try:
        sa, sb = a.bind(4000), b.bind(4000)
        n = 3000
        done_cuts = 0
        received: list[bytes] = []
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:

                async def receive() -> None:
                    while len(received) < n:
                        data, _ = await sb.recvfrom()
                        received.append(data)

                nursery.start_soon(receive)
                for i in range(n):
                    await sa.sendto(b"%d" % i + os.urandom(i % 64), ("127.0.0.2", 4000))
                    if i and i % (n // (cuts + 1)) == 0:
                        # Cut a live session: wait for one (a backend whose connection
                        # setup is slow may not have one up yet; the cut must happen).
                        while True:
                            session = a.connections()[0].session
                            if session is not None and not session.lost:
                                break
                            await trio.sleep(0.005)
                        session.cut()  # underneath
                        done_cuts += 1
                    if i % 50 == 0:
                        await trio.lowlevel.checkpoint()
        assert [int(m.split(b"\0")[0][: len(b"%d" % i)]) for i, m in enumerate(received)] == list(
            range(n)
        )
        rds = a.connections()[0]
        assert done_cuts == cuts
        assert rds.counters.sessions == done_cuts + 1
        # Every session began with each node's congestion map: a port that drained
        # while no session was up must not stay congested at the peer.
        for node in (a, b):
            counters = node.connections()[0].counters
            assert counters.cong_updates_sent == counters.sessions, counters
    finally:
        await close([a, b])


@transports
async def test_slow_receiver_congests_its_port_and_memory_stays_bounded(transport: str) -> None:
    from rdmashim.ulps.rds.settings import RCVBUF, SNDBUF

    a, b = await nodes(["127.0.0.1", "127.0.0.2"], transport)
    try:
        sa, sb = a.bind(4000), b.bind(4000)
        chunk = 256 * 1024
        n = 64  # 16 MiB in all, four times what the receiver will hold
        peak = 0
        with trio.fail_after(60):
            async with a.monitor_congestion() as updates, trio.open_nursery() as nursery:

                async def send_all() -> None:
                    for i in range(n):
                        await sa.sendto(i.to_bytes(4, "big") * (chunk // 4), ("127.0.0.2", 4000))

                nursery.start_soon(send_all)
                peer, ports = await updates.receive()  # the receiver is full: port congested
                assert (peer, ports) == ("127.0.0.2", {4000})
                assert 4000 in a.peer_congestion("127.0.0.2")
                with pytest.raises(RdsError) as info:
                    sa.sendto_nowait(b"x", ("127.0.0.2", 4000))
                assert info.value.errno == errno.ENOBUFS
                got = []
                while len(got) < n:  # a slow reader: nothing lost, nothing reordered
                    peak = max(peak, sb.queued_bytes)
                    data, _ = await sb.recvfrom()
                    got.append(int.from_bytes(data[:4], "big"))
                    await trio.sleep(0.001)
        assert got == list(range(n))
        assert peak <= RCVBUF + SNDBUF + chunk
        assert not a.peer_congestion("127.0.0.2")
    finally:
        await close([a, b])


async def test_a_new_entry_for_a_peer_numbers_above_the_last_one() -> None:
    """A node that restarts (or forgets a peer) starts its sequence above every number
    its former self sent, so a peer keeping its receive state (Linux keeps
    ``cp_next_rx_seq`` until the module unloads) takes what it sends again after a
    reconnect, flagged RETRANSMITTED, for new messages."""
    first = RdsConnection(ip_address("10.0.0.1"), ip_address("10.0.0.2"), lambda *a: None)
    for port in range(1000):
        first.queue(port, 1, b"x")
    second = RdsConnection(ip_address("10.0.0.1"), ip_address("10.0.0.2"), lambda *a: None)
    assert second.next_seq > first.next_seq > 1000


async def test_a_peer_numbering_from_1_again_is_taken_as_restarted() -> None:
    """Linux starts at 1 whenever its module loads: a first transmission below the
    number due is a restarted peer (delivered), a retransmission below it a
    duplicate (dropped), and a first message is taken wherever it starts."""
    got: list[bytes] = []
    rds = RdsConnection(
        ip_address("10.0.0.1"), ip_address("10.0.0.2"), lambda *a: got.append(a[-1])
    )

    def header(seq: int, flags: RdsFlag = RdsFlag.NONE) -> RdsHeader:
        return RdsHeader(seq, 0, 1, 4000, 4000, flags)

    for seq, flags, data in [(50, RdsFlag.NONE, b"a"), (51, RdsFlag.NONE, b"b"),
                             (1, RdsFlag.NONE, b"c"), (1, RdsFlag.RETRANSMITTED, b"d"),
                             (2, RdsFlag.RETRANSMITTED, b"e")]:  # fmt: skip
        rds.received(header(seq, flags), data)
    assert got == [b"a", b"b", b"c", b"e"]
    c = rds.counters
    assert (c.peer_restarts, c.recv_seq_gaps, c.recv_drop_old_seq, rds.next_recv) == (1, 0, 1, 3)
