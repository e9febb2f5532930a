"""RDS under strangers: everything a peer can make a node hold is bounded and expires.

The strangers here are not RDS nodes but bare rdma_cm connections (the
built-in engine, real loopback TCP) that speak RDS's wire by hand: they claim
any source address in the private data (Linux RDS takes it from there too),
grant the node no credits, ping it, or connect and go. What they can make
the node allocate is bounded by :class:`RdsSettings`, and goes away after
``peer_idle_expiry``.
"""

from __future__ import annotations

import errno
import gc
import ipaddress
import itertools
import logging
import math
import tracemalloc
import weakref
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import trio

from rdmashim.cm import ConnectionRejected, open_connection
from rdmashim.ulps.rds.connection import RdsConnection
from rdmashim.ulps.rds.node import RdsNode
from rdmashim.ulps.rds.peers import droppable
from rdmashim.ulps.rds.rdma_flow import RECV_SLOTS
from rdmashim.ulps.rds.rdma_session import Session
from rdmashim.ulps.rds.settings import RdsSettings
from rdmashim.ulps.rds.wire import RDS_FRAG_SIZE, RDS_HEADER_LEN, ConnectPrivate, RdsHeader
from rdmashim.verbs import Access, QPCap, RecvWR, SendFlags, SendWR, WROpcode

from rdsnodes import wait_until
from residency import resident_bytes

pytestmark = pytest.mark.usefixtures("rds_paths")  # C and Python plain paths

LOW = "127.0.0.1"
SLOT = RDS_HEADER_LEN + 64
FULL = RDS_HEADER_LEN + RDS_FRAG_SIZE


@dataclass
class Stranger:
    """A bare rdma_cm connection to a node that speaks RDS by hand."""

    conn: Any
    mr: Any
    sent: int = 0

    async def send(
        self, headers: list[RdsHeader], node_rds: RdsConnection | None, payload: bytes = b""
    ) -> None:
        """Send RDS messages (``headers``, each followed by ``payload``), one Send each,
        and wait until the node took them all (when its connection is given: a Send
        with no receive posted would end the connection, and a stranger that never
        reads our credits cannot know)."""
        for i, header in enumerate(headers):
            base = (i % 64) * SLOT
            self.mr.buf[base : base + RDS_HEADER_LEN] = header.encode()
            self.mr.buf[base + RDS_HEADER_LEN : base + RDS_HEADER_LEN + len(payload)] = payload
            last = i % 64 == 63 or i == len(headers) - 1
            self.conn.qp.post_send(
                SendWR(
                    i, WROpcode.SEND, [self.mr.sge(base, RDS_HEADER_LEN + len(payload))],
                    SendFlags.SIGNALED if last else SendFlags(0),
                )
            )  # fmt: skip
            self.sent += 1
            if last:
                await self.conn.send_cq.poll_wait(1)
                if node_rds is not None:
                    await wait_until(
                        lambda: node_rds.next_recv > self.sent, 10, "the node took them"
                    )


@asynccontextmanager
async def stranger(node: RdsNode, claimed: str, *, credit: int = 8) -> AsyncIterator[Stranger]:
    """Connect to ``node`` claiming to be the RDS node at ``claimed``, granting
    ``credit`` (receives it posts, and never posts again). One credit grants none for
    data (the last is kept for a credit update); 0 would turn flow control off, as
    Linux's ``rds_ib_set_flow_control``."""
    private = ConnectPrivate(
        ipaddress.ip_address(claimed), node.address, ack_seq=0, credit=credit
    ).encode()
    cap = QPCap(max_send_wr=128, max_recv_wr=RECV_SLOTS, max_send_sge=1, max_recv_sge=1)
    mrs = []

    def prepare(conn: Any) -> None:
        recv = conn.pd.reg_mr(bytearray(max(credit, 1) * FULL), Access.LOCAL_WRITE)
        conn.qp.post_recv([RecvWR(i, [recv.sge(i * FULL, FULL)]) for i in range(credit)])
        mrs.append(recv)

    async with open_connection(
        LOW, node.port, private_data=private, cap=cap, prepare=prepare
    ) as conn:
        mr = conn.pd.reg_mr(bytearray(64 * SLOT), Access.LOCAL_WRITE)
        try:
            yield Stranger(conn, mr)
        finally:
            mr.close()
            for recv in mrs:
                recv.close()


def ping(seq: int) -> RdsHeader:
    return RdsHeader(seq, 0, 0, 7, 0)  # sport 7, dport 0: an RDS ping


@asynccontextmanager
async def node_with(settings: RdsSettings) -> AsyncIterator[RdsNode]:
    async with RdsNode(LOW, 0, settings=settings) as node:
        yield node


# ---------------------------------------------------------------------- queues
async def test_a_peer_granting_no_credits_cannot_make_us_queue_without_bound() -> None:
    """It pings 400 times and never grants a credit: at most ``max_queued_messages``
    pongs wait, the rest are dropped and counted; a sender to it then gets
    ``trio.WouldBlock`` from ``sendto_nowait`` (Linux: EAGAIN) and waits in
    ``sendto``."""
    settings = RdsSettings(max_queued_messages=32, sndbuf=64 * 1024)
    async with node_with(settings) as node:
        sock = node.bind(4000)
        with trio.fail_after(30):
            async with stranger(node, "127.0.0.2", credit=1) as peer:
                await wait_until(lambda: node.connections(), 5, "the session")
                (rds,) = node.connections()
                await peer.send([ping(seq) for seq in range(1, 401)], rds)
                assert rds.queued_messages == settings.max_queued_messages
                assert rds.counters.replies_dropped == 400 - settings.max_queued_messages
                with pytest.raises(trio.WouldBlock):
                    sock.sendto_nowait(b"x", ("127.0.0.2", 5000))
                with trio.move_on_after(0.3) as waited:
                    await sock.sendto(b"x", ("127.0.0.2", 5000))
                assert waited.cancelled_caught
                assert rds.queued_messages == settings.max_queued_messages
                assert rds.queued_bytes <= settings.sndbuf


async def test_bytes_to_a_peer_granting_no_credits_stop_at_sndbuf() -> None:
    """What we keep for a peer that takes nothing stops at ``sndbuf`` bytes (plus the
    message that crossed it): then ``sendto_nowait`` says ``trio.WouldBlock``. A
    message over ``sndbuf`` is EMSGSIZE, as in Linux."""
    settings = RdsSettings(sndbuf=256 * 1024)
    size = 40_000
    async with node_with(settings) as node:
        sock = node.bind(4000)
        with trio.fail_after(30):
            async with stranger(node, "127.0.0.2", credit=1):
                await wait_until(lambda: node.connections(), 5, "the session")
                (rds,) = node.connections()
                with pytest.raises(trio.WouldBlock):
                    for _ in range(100):
                        sock.sendto_nowait(bytes(size), ("127.0.0.2", 5000))
                assert settings.sndbuf <= rds.queued_bytes < settings.sndbuf + size + 8192
        with pytest.raises(OSError) as raised:  # bigger than the buffer: never fits (Linux)
            sock.sendto_nowait(bytes(settings.sndbuf + 1), ("127.0.0.2", 5000))
        assert raised.value.errno == errno.EMSGSIZE


async def test_a_peer_ignoring_our_congestion_map_cannot_fill_a_socket() -> None:
    """Past ``rcvbuf`` the port is congested; past ``rcvbuf_limit`` messages for it are
    dropped and counted."""
    settings = RdsSettings(rcvbuf=1024, rcvbuf_limit=4096)
    async with node_with(settings) as node:
        sock = node.bind(5000)
        with trio.fail_after(30):
            async with stranger(node, "127.0.0.2") as peer:
                await wait_until(lambda: node.connections(), 5, "the entry")
                (rds,) = node.connections()
                await wait_until(lambda: rds.session is not None, 5, "the session")
                headers = [RdsHeader(seq, 0, 64, 9, 5000) for seq in range(1, 101)]
                await peer.send(headers, rds, bytes(64))
        assert sock.queued_bytes == settings.rcvbuf_limit
        assert node.drops_rcvbuf_full == 100 - settings.rcvbuf_limit // 64
        assert node.congestion.test(5000)


async def test_congestion_maps_waiting_to_go_out_are_one() -> None:
    """A peer that makes our ports flip (filling and draining them) while it takes
    nothing finds one map waiting, the newest, not one per change."""
    rds = RdsConnection(ipaddress.ip_address(LOW), _ip(2), lambda *a: None)
    for i in range(100):
        rds.queue_map(bytes([i]) * 8192)
    assert rds.map_out == bytes([99]) * 8192 and not rds.unsent  # outside the sequence
    assert not rds.pending  # the node's own message: worth no reconnect


async def test_a_closed_socket_takes_its_waiting_messages_along() -> None:
    """Linux's rds_release: what the socket sent that the peer has not acknowledged
    goes; a sender to a peer that takes nothing is not stuck with it for good."""
    async with node_with(RdsSettings()) as node:
        sock, other = node.bind(4000), node.bind(4001)
        with trio.fail_after(30):
            async with stranger(node, "127.0.0.2", credit=1):
                await wait_until(lambda: node.connections(), 5, "the entry")
                (rds,) = node.connections()
                await wait_until(lambda: rds.session is not None, 5, "the session")
                for _ in range(10):
                    sock.sendto_nowait(b"x" * 100, ("127.0.0.2", 5000))
                other.sendto_nowait(b"y", ("127.0.0.2", 5000))
                assert rds.queued_messages == 11  # the map waits apart (map_out)
                sock.close()
                assert [m.data for m in rds.unsent] == [b"y"]
                assert rds.queued_bytes == 1


# ---------------------------------------------------------------------- peer entries
async def test_strangers_leave_no_peer_state_behind_after_expiry() -> None:
    """40 strangers, each claiming another 127.0.0.x, connect, send a message and
    go; ``max_peers`` 8 holds the entries to 8 meanwhile, and ``peer_idle_expiry``
    clears the rest. No reconnect is attempted to any of them."""
    settings = RdsSettings(max_peers=8, peer_idle_expiry=0.5)
    async with node_with(settings) as node:
        inbox = node.bind(5000)
        with trio.fail_after(60):
            for i in range(40):
                claimed = f"127.0.0.{i + 2}"
                async with stranger(node, claimed) as peer:
                    await wait_until(
                        lambda c=claimed: ipaddress.ip_address(c) in node._peers, 5, "the entry"
                    )
                    await peer.send([RdsHeader(1, 0, 0, 9, 5000)], None)
                    assert (await inbox.recvfrom())[1] == (claimed, 9)
                assert len(node._peers) <= settings.max_peers
            await wait_until(lambda: not node._peers, 5, "expiry")
        assert node.peers_expired == 40
        assert connections_of(node) == 0


async def test_an_expired_entry_is_not_found_again_by_the_address_object_last_used() -> None:
    """The table remembers the address object it looked up last (a sender's, whose hash
    costs a Python call) with its entry; once that entry is dropped, the address finds
    nothing, then the new entry, and an equal address object finds the same one."""
    async with node_with(RdsSettings(peer_idle_expiry=1.0)) as node:
        table = node._table
        peer = ipaddress.ip_address("127.0.0.9")
        entry = table.lookup(peer)
        assert table.known(ipaddress.ip_address("127.0.0.9")) is entry is table.known(peer)
        table.expire(trio.current_time() + 3600)
        assert peer not in table.entries and node.peers_expired == 1
        assert table.known(peer) is None
        again = table.lookup(peer)
        assert again is not entry and table.known(peer) is again


async def test_at_max_peers_with_none_idle_a_new_one_is_rejected() -> None:
    settings = RdsSettings(max_peers=3)
    async with node_with(settings) as node:
        with trio.fail_after(30):
            async with stranger(node, "127.0.0.2"), stranger(node, "127.0.0.3"):
                async with stranger(node, "127.0.0.4"):
                    await wait_until(lambda: len(node._peers) == 3, 5, "three sessions")
                    with pytest.raises(ConnectionRejected):
                        async with stranger(node, "127.0.0.5"):
                            pass
                    sock = node.bind(4000)
                    with pytest.raises(OSError, match="max_peers"):
                        await sock.sendto(b"x", ("127.0.0.9", 4000))
                await wait_until(lambda: droppable(node._peers[_ip(4)]), 5, "idle")
                async with stranger(node, "127.0.0.5"):  # the idle one makes room
                    await wait_until(lambda: _ip(5) in node._peers, 5, "the new entry")
                    assert _ip(4) not in node._peers and len(node._peers) == 3


async def test_a_peer_whose_rds_rejects_us_is_tried_until_it_takes_us(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A reject from the peer's RDS (its ``rdma_reject``: here it has no room, for a
    kernel it is busy with its own connect) is an answer: the node keeps trying past
    ``give_up_after`` and drops nothing; the message arrives once the peer takes it."""
    caplog.set_level(logging.INFO, logger="rdmashim.ulps.rds")
    fast = RdsSettings(reconnect_min=0.02, reconnect_max=0.1, give_up_after=2)
    async with (
        node_with(RdsSettings(max_peers=1)) as full,
        RdsNode("127.0.0.2", full.port, settings=fast) as sender,
    ):
        inbox = full.bind(5000)
        with trio.fail_after(30):
            async with stranger(full, "127.0.0.3"):  # its one entry, live
                await wait_until(lambda: len(full._peers) == 1, 5, "the stranger's session")
                await sender.bind(4000).sendto(b"let me in", (str(full.address), 5000))

                def rejected() -> int:
                    return caplog.text.count("rejected by its RDS")

                await wait_until(lambda: rejected() > 2 * fast.give_up_after, 10, "rejects")
                (rds,) = sender.connections()
                assert rds.pending and rds.counters.sessions == 0
                assert "unreachable" not in caplog.text
            # The stranger left; its entry, idle, makes room.
            assert await inbox.recvfrom() == (b"let me in", ("127.0.0.2", 4000))


def _ip(last: int) -> Any:
    return ipaddress.ip_address(f"127.0.0.{last}")


async def test_an_idle_session_is_closed() -> None:
    async with node_with(RdsSettings(peer_idle_expiry=0.5)) as node:
        with trio.fail_after(10):
            async with stranger(node, "127.0.0.2") as peer:
                start = trio.current_time()
                await peer.conn.wait_disconnected()
                assert trio.current_time() - start >= 0.5
            await wait_until(lambda: not node._peers, 5, "expiry")


# ---------------------------------------------------------------------- reconnects
async def test_reconnects_to_a_dead_peer_back_off(caplog: pytest.LogCaptureFixture) -> None:
    """A peer reached once and then gone is retried while a message waits for it,
    each attempt in the upper half of a window that doubles from
    ``reconnect_min`` to ``reconnect_max``; the message arrives once it is back."""
    settings = RdsSettings(reconnect_min=0.05, reconnect_max=0.8)
    caplog.set_level(logging.INFO, logger="rdmashim.ulps.rds")
    async with node_with(settings) as a:
        sock = a.bind(4000)
        b = RdsNode("127.0.0.2", a.port)
        async with b:
            inbox = b.bind(5000)
            await sock.sendto(b"first", ("127.0.0.2", 5000))
            with trio.fail_after(10):
                await inbox.recvfrom()
                (rds,) = a.connections()
                await wait_until(lambda: not rds.unacked, 5, "the ack")
        caplog.clear()
        await sock.sendto(b"second", ("127.0.0.2", 5000))
        await trio.sleep(6)
        attempts = [r.created for r in caplog.records if "RDS connect to" in r.getMessage()]
        gaps = [y - x for x, y in itertools.pairwise(attempts)]
        windows = [min(settings.reconnect_min * 2**k, settings.reconnect_max) for k in range(99)]
        print("reconnect gaps (s):", [round(g, 3) for g in gaps])
        assert 7 <= len(attempts) <= 14, attempts
        for gap, window in zip(gaps, windows, strict=False):
            assert window / 2 - 0.01 <= gap <= window + 0.5, (gaps, window)
        async with RdsNode("127.0.0.2", a.port) as b:
            inbox = b.bind(5000)
            with trio.fail_after(5):
                assert (await inbox.recvfrom())[0] == b"second"


# ---------------------------------------------------------------------- soak
def connections_of(node: RdsNode) -> int:
    """The node's peer connections still alive after a collection, in its table or not."""
    gc.collect()
    return sum(
        isinstance(o, RdsConnection) and getattr(o.deliver, "__self__", None) is node
        for o in gc.get_objects()
    )


async def soak(count: int, *, trace: bool = False) -> dict[str, float]:
    """``count`` strangers connect, send a message and go; what stays of them.

    The resident size of a process that had more memory before says little (freed
    memory is reused, not returned); with ``trace``, the Python heap still in use
    after the run (tracemalloc) says what was kept."""
    settings = RdsSettings(peer_idle_expiry=0.3)
    sessions: weakref.WeakSet[Session] = weakref.WeakSet()
    original = Session.__init__

    def tracked(self: Session, *args: Any) -> None:
        original(self, *args)
        sessions.add(self)

    Session.__init__ = tracked  # type: ignore[method-assign]
    try:
        async with node_with(settings) as node:
            inbox = node.bind(5000)
            warm = count // 10
            before = 0
            start = trio.current_time()
            for i in range(count + warm):
                if i == warm:  # allocators and caches settled: the baseline
                    gc.collect()
                    before = resident_bytes()
                    if trace:
                        tracemalloc.start()
                claimed = f"127.0.{1 + i // 250}.{2 + i % 250}"
                async with stranger(node, claimed) as peer:
                    await peer.send([RdsHeader(1, 0, 0, 9, 5000)], None)
                    await inbox.recvfrom()
            seconds = trio.current_time() - start
            await wait_until(lambda: not node._peers, 10, "expiry")
            gc.collect()
            after = resident_bytes()
            heap = tracemalloc.get_traced_memory()[0] if trace else 0
            tracemalloc.stop()
            return {
                "connections": count,
                "seconds": round(seconds, 1),
                "rss_growth_per_connection": round((after - before) / count),
                "heap_growth_per_connection": round(heap / count),
                "rds_sessions_alive": len(sessions),
                "rds_connections_alive": sum(
                    isinstance(o, RdsConnection) for o in gc.get_objects()
                ),
                "peers_expired": node.peers_expired,
            }
    finally:
        Session.__init__ = original  # type: ignore[method-assign]


RSS_PER_CONNECTION = 2048
"""Resident size a connection may leave behind (one engine's staging buffer is 256 KiB)."""
HEAP_PER_CONNECTION = 4 * 1024
"""Python heap a soak may keep per connection (interned strings, caches)."""


async def test_soak_300_strangers_leave_no_rds_object_and_no_heap() -> None:
    stats = await soak(300, trace=True)
    print("RDS soak:", stats)
    assert stats["rds_sessions_alive"] == 0 and stats["rds_connections_alive"] == 0
    assert stats["peers_expired"] == 330
    assert stats["heap_growth_per_connection"] < HEAP_PER_CONNECTION


@pytest.mark.slow
async def test_soak_10000_strangers() -> None:
    stats = await soak(10_000)
    print("RDS soak:", stats)
    assert stats["rds_sessions_alive"] == 0 and stats["rds_connections_alive"] == 0
    assert stats["rss_growth_per_connection"] < RSS_PER_CONNECTION


@pytest.mark.parametrize(
    "fault",
    [
        {"sndbuf": math.nan}, {"max_queued_messages": 1.5}, {"rcvbuf": True},
        {"rcvbuf_limit": math.nan}, {"max_peers": "8"}, {"give_up_after": math.nan},
        {"peer_idle_expiry": math.nan}, {"unreachable_for": math.nan},
        {"reconnect_min": math.nan},
    ],
    ids=repr,
)  # fmt: skip
def test_settings_that_no_comparison_bounds_are_refused(fault: dict) -> None:
    """NaN passes every ``x < 1`` check (each comparison with it is false) and would
    leave a bound that nothing reaches (a NaN sndbuf: senders never wait); a float or
    a bool is no count. Refused when the settings are made, naming the field."""
    with pytest.raises(ValueError, match=r"RdsSettings"):
        RdsSettings(**fault)
