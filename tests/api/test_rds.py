"""RDS on the chosen backend: the ULP runs on whatever the portable API runs on.

Three nodes on the addresses in ``RDMASHIM_API_RDS_HOSTS`` (comma-separated;
default 127.0.0.1-3, as the built-in engine serves any loopback address; the
siw VM adds two addresses to eth0 and names those three) message all to all,
use RDMA by cookie, and lose nothing when a connection's QP is moved to ERR
underneath.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import trio
from api.support import TIMEOUT, pattern

from rdmashim import QPState
from rdmashim.ulps.rds.node import RdsNode
from rdmashim.ulps.rds.rdma import RdmaOp, RdmaStatus

HOSTS = os.environ.get("RDMASHIM_API_RDS_HOSTS", "127.0.0.1,127.0.0.2,127.0.0.3").split(",")


@asynccontextmanager
async def running_nodes() -> AsyncIterator[list[RdsNode]]:
    """A node on each address, all on the first one's (free) rdma_cm port."""
    async with AsyncExitStack() as stack:
        out: list[RdsNode] = []
        port = 0
        for address in HOSTS:
            node = await stack.enter_async_context(RdsNode(address, port))
            port = node.port
            out.append(node)
        yield out


async def test_all_to_all_in_order_with_fragments() -> None:
    async with running_nodes() as nodes:
        await all_to_all(nodes)


async def all_to_all(nodes: list[RdsNode]) -> None:
    socks = [node.bind(4000) for node in nodes]
    sizes = [1, 100, 4096, 4097, 20000]
    with trio.fail_after(6 * TIMEOUT):
        for sock in socks:
            for other in socks:
                if other is not sock:
                    for i, size in enumerate(sizes):
                        await sock.sendto(pattern(size, i), other.address)
        for sock in socks:
            got: dict[tuple[str, int], list[bytes]] = {}
            for _ in range(len(sizes) * (len(socks) - 1)):
                data, sender = await sock.recvfrom()
                got.setdefault(sender, []).append(data)
            assert sorted(got) == sorted(o.address for o in socks if o is not sock)
            for messages in got.values():
                assert messages == [pattern(size, i) for i, size in enumerate(sizes)]
    for node in nodes:
        assert len(node.connections()) == len(nodes) - 1  # one per pair of nodes


async def test_rdma_write_and_read_by_cookie() -> None:
    async with running_nodes() as nodes:
        await rdma_by_cookie(nodes)


async def rdma_by_cookie(nodes: list[RdsNode]) -> None:
    owner, user = nodes[0].bind(5000), nodes[1].bind(5001)
    target = bytearray(256 * 1024)
    target[-1000:] = pattern(1000, 9)
    cookie = owner.get_mr(target)
    data = pattern(100_000, 3)
    with trio.fail_after(4 * TIMEOUT):
        write = RdmaOp.write_to(cookie, data, offset=1000)
        await user.sendto(b"written", owner.address, rdma=write)
        assert await owner.recvfrom() == (b"written", user.address)
        assert target[1000 : 1000 + len(data)] == data
        back = bytearray(1000)
        read = RdmaOp.read_into(cookie, back, offset=len(target) - 1000)
        await user.sendto(b"read", owner.address, rdma=read)
        assert await write.wait() == await read.wait() == RdmaStatus.SUCCESS
        assert back == pattern(1000, 9)
        assert (await owner.recvfrom())[0] == b"read"


async def test_qp_error_underneath_loses_nothing() -> None:
    async with running_nodes() as nodes:
        await cuts(nodes)


async def cuts(nodes: list[RdsNode]) -> None:
    a, b = nodes[0].bind(6000), nodes[1].bind(6001)
    count, cut_at = 600, (150, 300, 450)
    received: list[bytes] = []

    async def receive() -> None:
        while len(received) < count:
            received.append((await b.recvfrom())[0])

    def live_session() -> Any:
        (rds,) = nodes[0].connections()
        session = rds.session
        if session is None or session.lost or session.qp.state is not QPState.RTS:
            return None
        return session

    with trio.fail_after(10 * TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(receive)
            for i in range(count):
                if i in cut_at:
                    while (session := live_session()) is None:  # noqa: ASYNC110 - plain state
                        await trio.sleep(0.01)
                    session.qp.modify(qp_state=QPState.ERR)
                await a.sendto(b"%d" % i + bytes(i % 5000), b.address)
    assert received == [b"%d" % i + bytes(i % 5000) for i in range(count)]
    (rds,) = nodes[0].connections()
    assert rds.counters.sessions >= 1 + len(cut_at)
