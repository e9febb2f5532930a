"""RDS RDMA by cookie: a registered buffer, messages that write into or read from it."""

from __future__ import annotations

import errno
import mmap
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio

from rdmashim.ulps.rds.node import RdsError, RdsNode, RdsSocket
from rdmashim.ulps.rds.rdma import SOURCES_KEPT, RdmaOp, RdmaStatus, cookie_offset, cookie_rkey
from rdmashim.ulps.rds.rdma_ops import RdmaPosts
from rdmashim.ulps.rds.rdma_session import RDMA_DEPTH, SEND_SLOTS, SIGNAL_EVERY, Session
from rdmashim.ulps.rds.wire import RdmaExt
from rdmashim.verbs import SendBatch, WCStatus
from rdmashim.verbs.buffers import address_of

from rdsnodes import close, nodes, wait_until

pytestmark = pytest.mark.usefixtures("rds_paths")  # C and Python plain paths

A, B = "127.0.0.1", "127.0.0.2"


async def test_write_and_read_by_cookie() -> None:
    a, b = await nodes([A, B])
    try:
        sa, sb = a.bind(4000), b.bind(5000)
        target = bytearray(1 << 20)
        cookie = sb.get_mr(target)
        # The offset is the buffer's within its page (the region's iova), as in Linux.
        assert cookie_offset(cookie) == address_of(target) % mmap.PAGESIZE
        assert sb.registered(cookie)
        with trio.fail_after(20):
            # The owner hands out its cookie in an ordinary message.
            await sb.sendto(cookie.to_bytes(8, "big"), (A, 4000))
            data, _ = await sa.recvfrom()
            theirs = int.from_bytes(data, "big")
            payload = os.urandom(300_000)
            write = RdmaOp.write_to(theirs, payload, offset=4096, token=11)
            await sa.sendto(b"written", (B, 5000), rdma=write)
            # When the chasing message arrives, the data is in place.
            assert await sb.recvfrom() == (b"written", (A, 4000))
            assert target[4096 : 4096 + len(payload)] == payload
            assert await write.wait() == RdmaStatus.SUCCESS and write.token == 11
            # And a read brings bytes of the peer's buffer here.
            target[:5] = b"hello"
            back = bytearray(5 + len(payload))
            read = RdmaOp.read_into(theirs, memoryview(back)[5:], offset=4096)
            head = RdmaOp.read_into(theirs, memoryview(back)[:5])
            await sa.sendto(b"read 1", (B, 5000), rdma=read)
            await sa.sendto(b"read 2", (B, 5000), rdma=head)
            assert await read.wait() == await head.wait() == RdmaStatus.SUCCESS
            assert bytes(back) == b"hello" + payload
            assert [await sb.recvfrom() for _ in range(2)] == [
                (b"read 1", (A, 4000)),
                (b"read 2", (A, 4000)),
            ]
        counters = a.connections()[0].counters
        assert (counters.rdma_writes, counters.rdma_reads) == (1, 2)
        assert counters.rdma_bytes == 3 * len(payload) + 5 - len(payload)
    finally:
        await close([a, b])


async def test_rdma_entries_posted_again_unchanged_are_not_set_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Writes into the same few buffers from one source, as rds stress ``-D`` makes:
    operation ``n`` takes batch entry ``n % RDMA_DEPTH`` and that entry's work request
    id, so once each entry has held its buffer's write it is posted as packed (no
    ``SendBatch.set``); a Read among them takes its entry as any operation, and every
    Write lands and every Read brings the buffer's bytes."""
    sets: list[int] = []
    real_set = SendBatch.set

    def spy(self: SendBatch, i: int, **fields: object) -> None:
        if i >= SEND_SLOTS:
            sets.append(i)
        real_set(self, i, **fields)  # type: ignore[arg-type]

    monkeypatch.setattr(SendBatch, "set", spy)
    a, b = await nodes([A, B])
    try:
        sa, sb = a.bind(4000), b.bind(5000)
        targets = [bytearray(256) for _ in range(4)]
        cookies = [sb.get_mr(t) for t in targets]
        source = bytes(range(256))
        rounds = 8 * RDMA_DEPTH
        with trio.fail_after(30):
            for i in range(rounds):
                target = targets[i % 4]
                target[:] = bytes(range(255, -1, -1))
                read = i % 37 == 36  # (a Read now and then: its entry changes, and back)
                back = bytearray(256)
                op = (
                    RdmaOp.read_into(cookies[i % 4], back)
                    if read
                    else RdmaOp.write_to(cookies[i % 4], source)
                )
                await sa.sendto(b"%d" % i, (B, 5000), rdma=op)
                assert await sb.recvfrom() == (b"%d" % i, (A, 4000))
                assert await op.wait() == RdmaStatus.SUCCESS
                assert (back if read else target) == (bytes(range(255, -1, -1)) if read else source)
        # Each entry set once for its buffer's Write, and again around each Read.
        reads = sum(1 for i in range(rounds) if i % 37 == 36)
        assert len(sets) <= RDMA_DEPTH + 2 * reads, sets
    finally:
        await close([a, b])


async def test_a_bytes_source_is_registered_once() -> None:
    """Writes from one ``bytes`` share one registration, kept while the node runs (a
    pool of at most SOURCES_KEPT, idle ones making room); a bytearray's is its own."""
    a, b = await nodes([A, B])
    try:
        sa, sb = a.bind(4000), b.bind(5000)
        board = bytearray(64 * 40)
        cookie = sb.get_mr(board)
        source = b"%064d" % 7
        with trio.fail_after(20):
            ops = [RdmaOp.write_to(cookie, source, offset=64 * i) for i in range(40)]
            for i, op in enumerate(ops):
                await sa.sendto(b"%d" % i, (B, 5000), rdma=op)
            for _ in ops:
                await sb.recvfrom()
            assert [await op.wait() for op in ops] == [RdmaStatus.SUCCESS] * 40
            assert bytes(board) == source * 40
            assert a._sources is not None and len(a._sources) == 1
            mutable = RdmaOp.write_to(cookie, bytearray(b"m" * 64))
            await sa.sendto(b"m", (B, 5000), rdma=mutable)
            await sb.recvfrom()
            assert await mutable.wait() == RdmaStatus.SUCCESS and board[:64] == b"m" * 64
            assert len(a._sources) == 1
            for i in range(SOURCES_KEPT + 4):  # others come and go: at most so many kept
                op = RdmaOp.write_to(cookie, b"%064d" % (100 + i))
                await sa.sendto(b"n", (B, 5000), rdma=op)
                await sb.recvfrom()
                assert await op.wait() == RdmaStatus.SUCCESS
                assert board[:64] == b"%064d" % (100 + i)
            assert len(a._sources) <= SOURCES_KEPT
    finally:
        await close([a, b])


async def test_many_operations_in_flight_keep_message_order() -> None:
    a, b = await nodes([A, B])
    try:
        sa, sb = a.bind(4000), b.bind(5000)
        board = bytearray(64 * 100)
        cookie = sb.get_mr(board)
        ops = [RdmaOp.write_to(cookie, b"%063d" % i + b"\n", offset=64 * i) for i in range(100)]
        with trio.fail_after(20):
            for i, op in enumerate(ops):
                await sa.sendto(b"%d" % i, (B, 5000), rdma=op)
                await sa.sendto(b"plain %d" % i, (B, 5000))
            got = [(await sb.recvfrom())[0] for _ in range(200)]
            assert {await op.wait() for op in ops} == {RdmaStatus.SUCCESS}
        assert got == [m for i in range(100) for m in (b"%d" % i, b"plain %d" % i)]
        assert bytes(board) == b"".join(b"%063d" % i + b"\n" for i in range(100))
    finally:
        await close([a, b])


async def test_writes_go_unsignaled_and_leave_with_the_next_send(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As Linux posts an RDMA Write without ``RDS_RDMA_NOTIFY_ME``: no completion of its
    own (its operation is done when the peer acknowledges the message); the session
    forgets it once a Send posted after it completes, so none stays counted against
    the RDMA operations it keeps in flight. A Read still completes on its own. On the C
    path the Writes go from C with their messages (Python keeps none of those), and the
    Sends after the ones Python posted may be C's, which end nothing in Python: those
    wait for Python's next signaled Send (fewer than SIGNAL_EVERY, so never all its
    RDMA room)."""
    seen: list[tuple[int, WCStatus]] = []
    original = RdmaPosts.done

    def spy(self: RdmaPosts, wr_id: int, status: WCStatus) -> None:
        seen.append((wr_id, status))
        original(self, wr_id, status)

    monkeypatch.setattr(RdmaPosts, "done", spy)
    a, b = await nodes([A, B])
    try:
        sa, sb = a.bind(4000), b.bind(5000)
        board = bytearray(64 * 40)
        cookie = sb.get_mr(board)
        with trio.fail_after(20):
            for i in range(40):
                op = RdmaOp.write_to(cookie, b"%064d" % i, offset=64 * i)
                await sa.sendto(b"%d" % i, (B, 5000), rdma=op)
                assert (await sb.recvfrom())[0] == b"%d" % i
                assert await op.wait() == RdmaStatus.SUCCESS
            session = a.connections()[0].session
            assert isinstance(session, Session)
            assert len(session.rdma.inflight) < SIGNAL_EVERY  # the newest wait for a signal
            if session._hooked:  # (the first may go before the session's handler is in C)
                assert session._plain is not None and session._plain.hook.sent >= 39
                assert session.rds.counters.rdma_writes == 40
            else:
                assert session.rdma.inflight
            read = RdmaOp.read_into(cookie, bytearray(64), offset=64 * 39)
            await sa.sendto(b"read", (B, 5000), rdma=read)
            assert (await sb.recvfrom())[0] == b"read"
            assert await read.wait() == RdmaStatus.SUCCESS
            for _ in range(SIGNAL_EVERY):  # a signaled Send after every Write
                await sa.sendto(b"plain", (B, 5000))
                await sb.recvfrom()
            if session._hooked:  # (these went from C: Python's Writes wait for its next
                # signaled Send, which comes within SIGNAL_EVERY of Python's own)
                assert len(session.rdma.inflight) < SIGNAL_EVERY and not session.rdma.reads
            else:
                await wait_until(lambda: not session.rdma.inflight, 10, "the Writes forgotten")
        assert bytes(read.buffer) == b"%064d" % 39
        assert bytes(board) == b"".join(b"%064d" % i for i in range(40))
        assert [status for _, status in seen] == [WCStatus.SUCCESS]  # the Read's alone
    finally:
        await close([a, b])


@asynccontextmanager
async def registered(
    size: int,
) -> AsyncIterator[tuple[RdsNode, RdsSocket, RdsSocket, bytearray, int]]:
    """Two nodes' sockets, the second's ``size`` bytes registered: the first node, its
    socket, the second's, the bytes and their cookie."""
    a, b = await nodes([A, B])
    try:
        sa, sb = a.bind(4000), b.bind(5000)
        board = bytearray(size)
        yield a, sa, sb, board, sb.get_mr(board)
    finally:
        await close([a, b])


async def test_a_write_nobody_waits_for_still_gets_its_status() -> None:
    """An operation whose status is only read (rds-stress's way), not awaited: it has its
    status soon after the peer acknowledged its message, with no more traffic (on the C
    path at the session's next fold: its backstop at the latest); awaited, at once."""
    async with registered(32) as (_, sa, sb, board, cookie):
        with trio.fail_after(20):
            for i in range(3):
                op = RdmaOp.write_to(cookie, b"%032d" % i)
                await sa.sendto(b"read me", (B, 5000), rdma=op)
                assert await sb.recvfrom() == (b"read me", (A, 4000))
                if i == 1:
                    assert await op.wait() == RdmaStatus.SUCCESS
                else:
                    await wait_until(lambda: op.done, 5, "the Write's status")  # noqa: B023
                    assert op.status == RdmaStatus.SUCCESS
        assert board == b"%032d" % 2


async def test_use_once_registration_ends_with_the_chasing_message() -> None:
    """...on either receive path; the socket's count of use-once registrations (where
    the path looks before it hands a chaser on) follows them."""
    a, b = await nodes([A, B])
    try:
        sa, sb = a.bind(4000), b.bind(5000)
        target = bytearray(16)
        kept = sb.get_mr(bytearray(16))
        cookie = sb.get_mr(target, use_once=True)
        counts = sb.received.counts
        assert counts.use_once == 1
        with trio.fail_after(20):
            op = RdmaOp.write_to(cookie, b"once")
            await sa.sendto(b"", (B, 5000), rdma=op)
            await sb.recvfrom()
        assert target[:4] == b"once" and not sb.registered(cookie)
        assert counts.use_once == 0 and sb.registered(kept)
        with pytest.raises(RdsError) as info:
            sb.free_mr(cookie)
        assert info.value.errno == errno.EINVAL
        again = sb.get_mr(target, use_once=True)
        sb.free_mr(again)
        assert counts.use_once == 0
    finally:
        await close([a, b])


async def test_bad_cookie_breaks_only_that_message() -> None:
    """An RDMA access the peer refuses fails the operation, drops its message (never
    sent twice, as Linux) and the connection comes back for everything else."""
    async with registered(100) as (a, sa, sb, buf, cookie):
        with trio.fail_after(30):
            await sa.sendto(b"before", (B, 5000))
            assert (await sb.recvfrom())[0] == b"before"
            sb.free_mr(cookie)  # the peer's cookie is stale now
            bad_read = RdmaOp.read_into(cookie, bytearray(10))
            await sa.sendto(b"never 1", (B, 5000), rdma=bad_read)
            assert await bad_read.wait() == RdmaStatus.REMOTE_ERROR
            assert "REM_ACCESS_ERR" in bad_read.detail
            bad_write = RdmaOp.write_to(cookie, b"x" * 10)
            await sa.sendto(b"never 2", (B, 5000), rdma=bad_write)
            assert await bad_write.wait() == RdmaStatus.DROPPED
            await sa.sendto(b"after", (B, 5000))
            assert (await sb.recvfrom())[0] == b"after"
        assert buf == bytearray(100)
        assert not sb.received  # nothing else arrived
        counters = a.connections()[0].counters
        assert counters.rdma_failures == 1 and counters.rdma_dropped == 1
        assert counters.sessions >= 3


async def test_rdma_errors_name_the_problem() -> None:
    a, b = await nodes([A, B])
    try:
        sa = a.bind(4000)
        cookie = sa.get_mr(bytearray(8))
        with pytest.raises(RdsError) as info:
            await sa.sendto(b"", (A, 4001), rdma=RdmaOp.write_to(cookie, b"x"))
        assert info.value.errno == errno.EOPNOTSUPP  # no RDMA over the loopback transport
        with pytest.raises(RdsError, match="remote offset"):
            await sa.sendto(b"", (B, 5000), rdma=RdmaOp.write_to(cookie, b"x", offset=-1))
        with pytest.raises(RdsError, match="no 64-bit address"):  # (a peer's cookie, say)
            await sa.sendto(b"", (B, 5000), rdma=RdmaOp.write_to(1 << 100, b"x"))
        op = RdmaOp.write_to(cookie, b"x")
        sa.sendto_nowait(b"", (B, 5000), rdma=op)
        with pytest.raises(RdsError, match="already sent"):
            sa.sendto_nowait(b"", (B, 5000), rdma=op)
        with pytest.raises(RdsError):
            sa.free_mr(cookie ^ (1 << 40))  # the right key with a wrong offset
        sa.close()
        assert not sa.registered(cookie)  # closing a socket ends its registrations
        with pytest.raises(RdsError):
            sa.get_mr(bytearray(8))
    finally:
        await close([a, b])


async def test_closing_the_node_cancels_what_never_ran() -> None:
    a, b = await nodes([A, B])
    sa = a.bind(4000)
    cookie = b.bind(5000).get_mr(bytearray(8))
    await close([b])  # the peer is gone: nothing will run
    op = RdmaOp.write_to(cookie, b"x")
    sa.sendto_nowait(b"", (B, 5000), rdma=op)
    await close([a])
    assert op.status in (RdmaStatus.CANCELED, RdmaStatus.DROPPED)
    assert op.status == await op.wait()


def test_cookie_layout_is_linuxs() -> None:
    assert cookie_rkey(0x1234_5678_9ABC_DEF0) == 0x9ABC_DEF0
    assert cookie_offset(0x1234_5678_9ABC_DEF0) == 0x1234_5678
    assert RdmaExt(0x9ABC_DEF0).body() == bytes.fromhex("9abcdef0")
