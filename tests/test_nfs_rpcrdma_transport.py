"""RPC-over-RDMA v1 end to end: ``serve_rdma`` and ``RpcRdmaClient`` over the built-in engine.

A test program served by :class:`RpcServer` over real loopback connections:
short calls, DDP-eligible arguments in Read chunks, results in Write chunks,
Long Calls and Long Replies, credits, and peers speaking raw transport
headers (another version, bad chunks, garbage, too many calls).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio

from rdmashim.cm import Connection, ConnectionRequest, open_connection, serve
from rdmashim.providers.softiwarp import engines
from rdmashim.ulps.nfsrdma import rdma_server
from rdmashim.ulps.nfsrdma.rdma_client import (
    POOL_BUFFERS,
    BufferPool,
    RpcRdmaClient,
    TransportError,
)
from rdmashim.ulps.nfsrdma.rdma_endpoint import (
    ConnectionLost,
    Endpoint,
    rdma_wr,
    receives_for,
    send_wr,
)
from rdmashim.ulps.nfsrdma.rdma_server import serve_rdma
from rdmashim.ulps.nfsrdma.rpc import (
    NULL_AUTH,
    CallHeader,
    RpcServer,
    accepted_reply,
    pack_call_header,
    unpack_call_header,
)
from rdmashim.ulps.nfsrdma.rpcrdma import (
    ConnectPrivate,
    ErrCode,
    Header,
    Proc,
    ReadSegment,
    Segment,
    decode,
)
from rdmashim.ulps.nfsrdma.service import CallContext, ProcUnavailable, Reply
from rdmashim.ulps.nfsrdma.xdr import Unpacker
from rdmashim.verbs import Access, QPCap, RecvWR, SendWR, WCStatus, WROpcode
from rdmashim.verbs.slots import Slots

HOST = "127.0.0.1"
PROG = 0x20000123
NULL, ECHO, SUM, READ, WRITE, BIG, SLEEP = range(7)
TIMEOUT = 30


def pattern(n: int, seed: int) -> bytes:
    """``n`` bytes that differ for every seed and offset."""
    block = bytes((i * 131 + seed * 17 + (i >> 8)) & 0xFF for i in range(4099))
    return (block * (n // len(block) + 1))[:n]


class Bench:
    """The test program: echo, sum, read N bytes (DDP), write bytes (DDP), big reply, sleep."""

    number = PROG
    versions = (1, 1)

    def __init__(self) -> None:
        self.running = 0
        self.peak = 0

    async def dispatch(self, ctx: CallContext, args: Unpacker, reply: Reply) -> None:
        """Carry out ``ctx.proc``."""
        if ctx.proc == SLEEP:
            self.running += 1
            self.peak = max(self.peak, self.running)
            await trio.sleep(args.uint() / 1000)
            self.running -= 1
            reply.packer.uint(ctx.xid)
            args.done()
        else:
            self.now(ctx, args, reply)

    def now(self, ctx: CallContext, args: Unpacker, reply: Reply) -> None:
        """Carry out any procedure but ``SLEEP``."""
        p = reply.packer
        if ctx.proc == NULL:
            pass
        elif ctx.proc == ECHO:
            p.opaque(args.opaque_view())
        elif ctx.proc == SUM:
            p.uhyper(sum(args.array(args.uint)))
        elif ctx.proc == READ:
            n, seed = args.uint(), args.uint()
            p.uint(seed)
            reply.opaque_ddp(pattern(n, seed))
        elif ctx.proc == WRITE:
            data = args.opaque_view()
            tag = args.uint()
            p.uint(len(data))
            p.fopaque(hashlib.sha256(data).digest(), 32)
            p.uint(tag)
        elif ctx.proc == BIG:
            n, seed = args.uint(), args.uint()
            p.opaque(pattern(n, seed))
        else:
            raise ProcUnavailable(ctx.proc)
        args.done()


class InlineBench(Bench):
    """:class:`Bench` answering at once every procedure but ``SLEEP`` (an
    ``InlineProgram``, as NFS is)."""

    def dispatch_now(self, ctx: CallContext, args: Unpacker, reply: Reply) -> bool:
        if ctx.proc == SLEEP:
            return False
        self.now(ctx, args, reply)
        return True


def args_of(*words: int) -> Reply:
    r = Reply()
    for w in words:
        r.packer.uint(w)
    return r


@asynccontextmanager
async def server(bench: Bench | None = None, **kw: int) -> AsyncIterator[tuple[int, Bench]]:
    bench = Bench() if bench is None else bench
    async with trio.open_nursery() as nursery:
        addr = await nursery.start(lambda task_status: serve_rdma(
            RpcServer([bench]), 0, HOST, task_status=task_status, **kw
        ))  # fmt: skip
        assert addr is not None
        yield addr[1], bench
        nursery.cancel_scope.cancel()


@pytest.fixture
async def port() -> AsyncIterator[int]:
    async with server() as (p, _):
        yield p


async def test_short_calls(port: int) -> None:
    with trio.fail_after(TIMEOUT):
        async with RpcRdmaClient.connect(HOST, port) as client:
            assert (await client.call(PROG, 1, NULL, Reply())).remaining() == 0
            echo = Reply()
            echo.packer.opaque(b"hello, rdma")
            u = await client.call(PROG, 1, ECHO, echo)
            assert u.opaque() == b"hello, rdma"
            u.done()
            nums = Reply()
            nums.packer.array(list(range(100)), nums.packer.uint)
            assert (await client.call(PROG, 1, SUM, nums)).uhyper() == 4950
            assert client.call_inline == client.reply_inline == 4096
            assert client.granted == 32


async def test_short_calls_register_nothing_and_wait_for_no_completion(
    port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A short call and its reply go through the Send slots registered with the
    connection: no region is registered and no task waits for a Send's completion, on
    either side (before, the responder registered every reply and waited for its Send)."""
    registered: list[int] = []
    waited: list[int] = []
    real_register, real_post = Endpoint.register, Endpoint.post

    def register(ep: Endpoint, buffer: memoryview, access: Access = Access.NONE) -> object:
        registered.append(len(memoryview(buffer)))
        return real_register(ep, buffer, access)

    async def post(ep: Endpoint, wrs: list[SendWR]) -> None:
        waited.append(len(wrs))
        await real_post(ep, wrs)

    with trio.fail_after(TIMEOUT):
        async with RpcRdmaClient.connect(HOST, port) as client:
            monkeypatch.setattr(Endpoint, "register", register)
            monkeypatch.setattr(Endpoint, "post", post)
            for i in range(200):
                echo = Reply()
                echo.packer.opaque(i.to_bytes(4, "big") * 100)
                assert (await client.call(PROG, 1, ECHO, echo)).opaque() == echo.packer.data[4:]
    assert (registered, waited) == ([], [])


@pytest.mark.parametrize("size", [1, 4, 4095, 99_999, 1 << 20])
async def test_write_data_goes_in_a_read_chunk(port: int, size: int) -> None:
    data = pattern(size, 3)
    args = Reply()
    args.opaque_ddp(data)
    args.packer.uint(0xC0FFEE)  # after the item: its roundup must be put back
    with trio.fail_after(TIMEOUT):
        async with RpcRdmaClient.connect(HOST, port) as client:
            u = await client.call(PROG, 1, WRITE, args)
    assert u.uint() == size
    assert u.fopaque(32) == hashlib.sha256(data).digest()
    assert u.uint() == 0xC0FFEE
    u.done()


async def test_call_buffers_reused_on_one_connection_hold_each_calls_bytes(port: int) -> None:
    """The responder reuses the buffer a call's Read chunks were pulled into: each call
    sees its own bytes, and the roundup after a chunk is zero even where the call before
    had data (a non-zero roundup would be GARBAGE_ARGS)."""
    with trio.fail_after(TIMEOUT):
        async with RpcRdmaClient.connect(HOST, port) as client:
            for size in (4099, 5, 4098, 7, 65_537, 65_538, 1):
                data = bytes([0xFF - size % 7]) * size
                args = Reply()
                args.opaque_ddp(data)
                args.packer.uint(size)
                u = await client.call(PROG, 1, WRITE, args)
                assert (u.uint(), u.fopaque(32), u.uint()) == (
                    size,
                    hashlib.sha256(data).digest(),
                    size,
                )


async def test_read_chunks_are_pulled_with_no_task_waiting(
    port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call's RDMA Reads are posted where the call arrived and the call is taken on
    from their completion: nothing waits for them in a task of its own (before, each
    call with Read chunks got a task that waited for its Reads)."""
    waited: list[int] = []
    real_post = Endpoint.post

    async def post(ep: Endpoint, wrs: list[SendWR]) -> None:
        waited.append(len(wrs))
        await real_post(ep, wrs)

    monkeypatch.setattr(Endpoint, "post", post)
    with trio.fail_after(TIMEOUT):
        async with RpcRdmaClient.connect(HOST, port) as client:
            for size in (1, 4099, 1 << 20):
                data = pattern(size, 5)
                args = Reply()
                args.opaque_ddp(data)
                args.packer.uint(size)
                u = await client.call(PROG, 1, WRITE, args)
                assert (u.uint(), u.fopaque(32)) == (size, hashlib.sha256(data).digest())
    assert waited == []


async def test_call_buffers_are_the_listeners_reused_by_its_next_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The buffers calls with Read chunks are pulled into belong to the listener, not to
    a connection: a client that connects again (or another client) finds them there
    (before, each connection made its own, and a kernel client with more WRITEs out
    than a connection kept made one per call)."""
    pools: list[BufferPool] = []

    class Counted(BufferPool):
        def __init__(self, keep: int = POOL_BUFFERS) -> None:
            super().__init__(keep)
            pools.append(self)

    monkeypatch.setattr(rdma_server, "BufferPool", Counted)
    data = pattern(70_000, 9)
    with trio.fail_after(TIMEOUT):
        async with server() as (port, _):
            for _ in range(3):
                async with RpcRdmaClient.connect(HOST, port) as client:
                    for _ in range(2):
                        args = Reply()
                        args.opaque_ddp(data)
                        args.packer.uint(0)
                        u = await client.call(PROG, 1, WRITE, args)
                        assert (u.uint(), u.fopaque(32)) == (
                            len(data),
                            hashlib.sha256(data).digest(),
                        )
    assert [pool.made for pool in pools] == [1]


@pytest.mark.parametrize(("size", "room"), [(0, 16), (5, 8), (200_003, 256 * 1024), (3000, 0)])
async def test_read_data_lands_in_the_write_chunk(port: int, size: int, room: int) -> None:
    with trio.fail_after(TIMEOUT):
        async with RpcRdmaClient.connect(HOST, port) as client:
            u = await client.call(PROG, 1, READ, args_of(size, 9), ddp_reply_size=room)
    assert u.uint() == 9
    assert u.opaque() == pattern(size, 9)
    u.done()


@pytest.mark.parametrize("allowed", [True, False])
async def test_send_with_invalidate_when_allowed(port: int, allowed: bool) -> None:
    with trio.fail_after(TIMEOUT):
        async with RpcRdmaClient.connect(HOST, port, remote_invalidate=allowed) as client:
            u = await client.call(PROG, 1, READ, args_of(10, 1), ddp_reply_size=64)
            assert (u.uint(), u.opaque()) == (1, pattern(10, 1))
            await client.call(PROG, 1, NULL, Reply())  # no chunk: nothing to invalidate
            args = Reply()
            args.opaque_ddp(b"data")
            args.packer.uint(0)
            await client.call(PROG, 1, WRITE, args)
            await client.call(
                PROG, 1, READ, args_of(10, 1), ddp_reply_size=64, reply_size_hint=1 << 13
            )
            assert client.invalidated == (2 if allowed else 0)  # two R_Keys: none


async def test_result_larger_than_the_write_chunk_is_err_chunk(port: int) -> None:
    with trio.fail_after(TIMEOUT):
        async with RpcRdmaClient.connect(HOST, port) as client:
            with pytest.raises(TransportError) as info:
                await client.call(PROG, 1, READ, args_of(5000, 1), ddp_reply_size=4096)
            assert info.value.code == ErrCode.ERR_CHUNK
            assert (await client.call(PROG, 1, READ, args_of(4096, 1), ddp_reply_size=4096)).uint()


async def test_long_reply_uses_the_reply_chunk(port: int) -> None:
    with trio.fail_after(TIMEOUT):
        async with RpcRdmaClient.connect(HOST, port) as client:
            u = await client.call(PROG, 1, BIG, args_of(50_001, 4), reply_size_hint=64 * 1024)
            assert u.opaque() == pattern(50_001, 4)
            u.done()
            with pytest.raises(TransportError) as info:  # no Reply chunk offered
                await client.call(PROG, 1, BIG, args_of(50_001, 4))
            assert info.value.code == ErrCode.ERR_CHUNK
            with pytest.raises(TransportError):  # a Reply chunk too small
                await client.call(PROG, 1, BIG, args_of(50_001, 4), reply_size_hint=40_000)
            u = await client.call(PROG, 1, BIG, args_of(100, 4), reply_size_hint=64 * 1024)
            assert u.opaque() == pattern(100, 4)  # fits inline: the offered chunk stays unused


async def test_long_call_goes_in_the_position_zero_read_chunk(port: int) -> None:
    big = pattern(30_001, 6)
    args = Reply()
    args.packer.opaque(big)  # not DDP-eligible: the whole call is a Long Call
    with trio.fail_after(TIMEOUT):
        async with RpcRdmaClient.connect(HOST, port) as client:
            u = await client.call(PROG, 1, ECHO, args, reply_size_hint=40_000)
            assert u.opaque() == big
            nums = Reply()
            nums.packer.array([7] * 3000, nums.packer.uint)  # 12 KB of arguments
            assert (await client.call(PROG, 1, SUM, nums)).uhyper() == 21000


async def test_small_inline_sizes_are_honoured() -> None:
    async with server(inline_size=1024) as (port, _):
        with trio.fail_after(TIMEOUT):
            async with RpcRdmaClient.connect(HOST, port, inline_size=2048) as client:
                assert client.call_inline == client.reply_inline == 1024
                u = await client.call(PROG, 1, BIG, args_of(1500, 2), reply_size_hint=2048)
                assert u.opaque() == pattern(1500, 2)
                echo = Reply()
                echo.packer.opaque(pattern(1500, 1))
                u = await client.call(PROG, 1, ECHO, echo, reply_size_hint=2048)
                assert u.opaque() == pattern(1500, 1)


async def test_credits_bound_outstanding_calls() -> None:
    async with server(credits=4) as (port, bench):
        with trio.fail_after(TIMEOUT):
            async with RpcRdmaClient.connect(HOST, port, credits=16) as client:
                results: dict[int, int] = {}

                async def one(i: int) -> None:
                    results[i] = (await client.call(PROG, 1, SLEEP, args_of(20))).uint()

                async with trio.open_nursery() as nursery:
                    for i in range(40):
                        nursery.start_soon(one, i)
                assert len(results) == 40 and len(set(results.values())) == 40  # 40 xids
                assert client.granted == 4
                assert client.peak_outstanding == 4
                assert bench.peak == 4
                assert client.outstanding == 0


async def test_a_call_that_leads_and_is_cancelled_hands_the_lead_on(port: int) -> None:
    """The waiting call that takes the connection's completions (the leader: here the
    first to wait) is cancelled while five others wait: one of them leads then, and
    every reply comes. Then the connection serves calls as before."""
    with trio.fail_after(TIMEOUT):
        async with RpcRdmaClient.connect(HOST, port) as client:
            await client.call(PROG, 1, NULL, Reply())  # (the server's credits: 32)
            results: dict[int, int] = {}

            async def one(i: int, ms: int) -> None:
                results[i] = (await client.call(PROG, 1, SLEEP, args_of(ms))).uint()

            async with trio.open_nursery() as nursery:
                first = trio.CancelScope()

                async def leader() -> None:
                    with first:
                        await one(-1, 500)

                nursery.start_soon(leader)
                await trio.sleep(0.02)
                led_by = client._leader
                assert led_by is not None
                for i in range(5):
                    nursery.start_soon(one, i, 50 + 20 * i)
                await trio.sleep(0.02)
                assert client._leader is led_by and len(client._waiting) == 6
                first.cancel()
            assert first.cancelled_caught and -1 not in results
            assert sorted(results) == list(range(5))
            assert client._leader is None and not client._waiting
            assert (await client.call(PROG, 1, NULL, Reply())).remaining() == 0


async def test_concurrent_mixed_calls(port: int) -> None:
    with trio.fail_after(TIMEOUT):
        async with RpcRdmaClient.connect(HOST, port) as client:

            async def read(i: int) -> None:
                u = await client.call(PROG, 1, READ, args_of(10_000 + i, i), ddp_reply_size=1 << 15)
                assert u.uint() == i and u.opaque() == pattern(10_000 + i, i)

            async def write(i: int) -> None:
                args = Reply()
                args.opaque_ddp(pattern(7000 + i, i))
                args.packer.uint(i)
                u = await client.call(PROG, 1, WRITE, args)
                assert u.uint() == 7000 + i
                assert u.fopaque(32) == hashlib.sha256(pattern(7000 + i, i)).digest()

            async with trio.open_nursery() as nursery:
                for i in range(20):
                    nursery.start_soon(read, i)
                    nursery.start_soon(write, i)


# ---------------------------------------------------------------- raw transport headers


class Raw:
    """A connection that speaks raw transport headers to the server."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.recv_mr = conn.pd.reg_mr(bytearray(8 * 4096), Access.LOCAL_WRITE)
        self.send_mr = conn.pd.reg_mr(bytearray(64 * 4096), Access.LOCAL_WRITE)
        self.next = 0

    def post_receives(self) -> None:
        self.conn.qp.post_recv([RecvWR(i, [self.recv_mr.sge(i * 4096, 4096)]) for i in range(8)])

    def send(self, data: bytes) -> None:
        slot = self.next % 64
        self.next += 1
        self.send_mr.buf[slot * 4096 : slot * 4096 + len(data)] = data
        self.conn.qp.post_send(
            SendWR(1000 + slot, sg_list=[self.send_mr.sge(slot * 4096, len(data))])
        )

    async def receive(self) -> bytes | None:
        """The next message, None when the connection ended."""
        while True:
            for wc in await self.conn.recv_cq.poll_wait(1):
                if wc.status != WCStatus.SUCCESS:
                    return None
                if wc.wr_id < 8:
                    data = bytes(self.recv_mr.buf[wc.wr_id * 4096 : wc.wr_id * 4096 + wc.byte_len])
                    self.conn.qp.post_recv(
                        RecvWR(wc.wr_id, [self.recv_mr.sge(wc.wr_id * 4096, 4096)])
                    )
                    return data


@asynccontextmanager
async def raw(port: int, private: bytes | None = None) -> AsyncIterator[Raw]:
    if private is None:
        private = ConnectPrivate(4096, 4096).encode()
    async with open_connection(HOST, port, private_data=private) as conn:
        r = Raw(conn)  # the server sends nothing before our first call
        r.post_receives()
        yield r
    r.recv_mr.close()
    r.send_mr.close()


def words(*values: int) -> bytes:
    return b"".join(v.to_bytes(4, "big") for v in values)


def call_message(xid: int, proc: int, args: bytes = b"") -> bytes:
    r = Reply()
    pack_call_header(r.packer, CallHeader(xid, PROG, 1, proc, NULL_AUTH))
    return bytes(r.packer.data) + args


async def test_other_version_gets_err_vers(port: int) -> None:
    with trio.fail_after(TIMEOUT):
        async with raw(port) as r:
            r.send(words(77, 2, 1, 0, 0, 0, 0) + call_message(77, NULL))
            assert await r.receive() == words(77, 1, 32, 4, ErrCode.ERR_VERS, 1, 1)
            r.send(Header(78, 1).encode() + call_message(78, NULL))  # still served
            reply = await r.receive()
            assert reply is not None and reply[:16] == words(78, 1, 32, 0)


@pytest.mark.parametrize(
    "header",
    [
        words(5, 1, 1, Proc.RDMA_MSGP, 0, 0, 0),
        words(5, 1, 1, Proc.RDMA_DONE),
        words(5, 1, 1, 9),
        words(5, 1, 1, 0, 2, 0, 0),  # a bad discriminant
        words(5, 1, 1, 0, 0, 0),  # short
        Header(5, 1, Proc.RDMA_NOMSG).encode(),  # a Long Call without its chunk
        Header(5, 1, read_list=(ReadSegment(0, Segment(1, 8, 0)),)).encode(),  # PZRC in MSG
        Header(5, 1, read_list=(ReadSegment(4000, Segment(1, 8, 0)),)).encode(),  # past the end
        Header(5, 1, read_list=(ReadSegment(40, Segment(1, 0xFFFFFFFF, 0)),)).encode(),  # huge
        words(5, 1, 1, Proc.RDMA_ERROR, ErrCode.ERR_CHUNK),  # an error sent to a responder
    ],
)
async def test_bad_chunks_get_err_chunk(port: int, header: bytes) -> None:
    with trio.fail_after(TIMEOUT):
        async with raw(port) as r:
            r.send(header + call_message(5, NULL))
            assert await r.receive() == words(5, 1, 32, 4, ErrCode.ERR_CHUNK)


async def test_garbage_closes_the_connection_and_others_go_on(port: int) -> None:
    with trio.fail_after(TIMEOUT):
        async with RpcRdmaClient.connect(HOST, port) as good:
            for garbage in (b"", b"\x01\x02\x03", bytes(15)):
                async with raw(port, private=b"not ours") as r:
                    r.send(garbage)
                    assert await r.receive() is None
                assert (await good.call(PROG, 1, SUM, args_of(2, 40, 2))).uhyper() == 42


async def test_more_calls_than_credits(port: int) -> None:
    with trio.fail_after(TIMEOUT):
        async with RpcRdmaClient.connect(HOST, port) as good:
            async with raw(port) as r:
                for xid in range(100, 140):  # 40 calls on 32 credits, each 50 ms long
                    r.send(Header(xid, 40).encode() + call_message(xid, SLEEP, words(50)))
                answered = 0
                while (reply := await r.receive()) is not None:
                    assert reply[4:16] == words(1, 32, 0)
                    answered += 1
                assert answered <= 32  # the connection ended instead of answering more
            assert (await good.call(PROG, 1, SUM, args_of(1, 5))).uhyper() == 5


async def test_without_private_data_the_thresholds_are_1024(port: int) -> None:
    with trio.fail_after(TIMEOUT):
        async with raw(port, private=b"") as r:
            r.send(Header(9, 1).encode() + call_message(9, BIG, words(2000, 1)))
            assert await r.receive() == words(9, 1, 32, 4, ErrCode.ERR_CHUNK)
            r.send(Header(10, 1).encode() + call_message(10, BIG, words(900, 1)))
            reply = await r.receive()
            assert reply is not None and len(reply) == 28 + 24 + 4 + 900
            assert reply[-900:] == pattern(900, 1)


async def test_read_chunks_over_the_call_bound_get_err_chunk() -> None:
    async with server(max_call_size=64 * 1024) as (port, _):
        with trio.fail_after(TIMEOUT):
            async with RpcRdmaClient.connect(HOST, port) as client:
                for size, ok in ((64 * 1024, True), (64 * 1024 + 1, False)):
                    args = Reply()
                    args.opaque_ddp(pattern(size, 5))
                    args.packer.uint(0)
                    if ok:
                        assert (await client.call(PROG, 1, WRITE, args)).uint() == size
                    else:
                        with pytest.raises(TransportError) as info:
                            await client.call(PROG, 1, WRITE, args)
                        assert info.value.code == ErrCode.ERR_CHUNK
                assert (await client.call(PROG, 1, SUM, args_of(1, 8))).uhyper() == 8


# ---------------------------------------------------------------- Write-chunk memory reuse


async def test_read_data_held_by_the_caller_is_never_reused(port: int) -> None:
    with trio.fail_after(TIMEOUT):
        async with RpcRdmaClient.connect(HOST, port) as client:
            u = await client.call(PROG, 1, READ, args_of(5000, 1), ddp_reply_size=8192)
            assert u.uint() == 1
            held = u.opaque_view()  # a view of where the server wrote it
            del u
            for seed in range(2, POOL_BUFFERS + 4):  # more calls than the pool keeps buffers
                u = await client.call(PROG, 1, READ, args_of(5000, seed), ddp_reply_size=8192)
                assert (u.uint(), u.opaque()) == (seed, pattern(5000, seed))
            assert bytes(held) == pattern(5000, 1)
            # the held buffer, and two taking turns (the last reply is held until the next)
            assert client.pool.made == 3
            del held, u
            for seed in range(3):
                u = await client.call(PROG, 1, READ, args_of(5000, seed), ddp_reply_size=8192)
                assert (u.uint(), u.opaque()) == (seed, pattern(5000, seed))
            assert client.pool.made == 3


async def _late_writer(request: ConnectionRequest) -> None:
    """Answer READ calls, but write junk into the previous call's Write chunk before replying."""
    ep = Endpoint(request, 4096, 4)
    junk = request.pd.reg_mr(bytearray(b"\xee" * 5000), Access.LOCAL_WRITE)
    data = request.pd.reg_mr(bytearray(5000), Access.LOCAL_WRITE)
    replies = request.pd.reg_mr(bytearray(4096), Access.LOCAL_WRITE)
    chunks: list[Segment] = []
    await request.accept(private_data=ConnectPrivate(4096, 4096).encode())

    async def answer(message: bytes) -> None:
        header, start = decode(message)
        assert isinstance(header, Header)
        u = Unpacker(message, start)
        seed = (unpack_call_header(u), u.uint(), u.uint())[2]
        (segment,) = header.write_list[0]
        data.buf[:] = pattern(5000, seed)
        wrs = [rdma_wr(WROpcode.RDMA_WRITE, data, 0, 5000, segment.offset, segment.handle)]
        if chunks:  # then a late Write: the previous call is long answered
            old = chunks[-1]
            wrs.append(rdma_wr(WROpcode.RDMA_WRITE, junk, 0, 5000, old.offset, old.handle))
        chunks.append(segment)
        reply = accepted_reply(header.xid)
        reply.packer.uint(seed)
        reply.packer.uint(5000)  # the READ data's length: its bytes are in the Write chunk
        written = ((Segment(segment.handle, 5000, segment.offset),),)
        wire = Header(header.xid, 4, write_list=written).encode() + reply.packer.data
        replies.buf[: len(wire)] = wire
        wrs.append(send_wr(replies, len(wire)))
        await ep.post(wrs)

    async with trio.open_nursery() as nursery:

        def on_receive(slot: int, length: int, wc: object) -> None:
            nursery.start_soon(answer, bytes(ep.slot_view(slot, length)))
            ep.repost(slot)

        with contextlib.suppress(ConnectionLost):
            await ep.run(on_receive)
        nursery.cancel_scope.cancel()
    for mr in (junk, data, replies):
        mr.close()
    ep.close()


async def test_a_late_write_cannot_reach_a_later_calls_data() -> None:
    """The memory is reused, but under a new R_Key: the old one ends the connection."""
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            cap = QPCap(max_send_wr=128, max_recv_wr=receives_for(4))
            addr = await nursery.start(
                lambda task_status: serve(
                    _late_writer, 0, host=HOST, cap=cap, task_status=task_status
                )
            )
            assert addr is not None
            async with RpcRdmaClient.connect(HOST, addr[1], credits=4) as client:
                u = await client.call(PROG, 1, READ, args_of(5000, 1), ddp_reply_size=5000)
                assert (u.uint(), u.opaque()) == (1, pattern(5000, 1))
                del u  # the buffer is free: the next call gets the same memory
                with pytest.raises(ConnectionLost):  # the junk hit a key that no longer is
                    await client.call(PROG, 1, READ, args_of(5000, 2), ddp_reply_size=5000)
                assert client.pool.made == 1  # the second call had the first one's memory
            nursery.cancel_scope.cancel()


async def test_a_write_chunk_of_more_segments_than_the_send_queue_holds(port: int) -> None:
    """A result spread over 200 segments needs 200 RDMA Writes, more than the send queue
    holds (128): they go a batch at a time, then the reply."""
    segments, each = 200, 16
    with trio.fail_after(TIMEOUT):
        async with raw(port) as r:
            target = bytearray(segments * each)
            mr = r.conn.pd.reg_mr(target, Access.LOCAL_WRITE | Access.REMOTE_WRITE)
            chunk = tuple(Segment(mr.rkey, each, mr.iova + i * each) for i in range(segments))
            header = Header(5, 32, Proc.RDMA_MSG, (), (chunk,), None)
            r.send(header.encode() + call_message(5, READ, words(segments * each, 8)))
            reply = await r.receive()
            assert reply is not None, r.conn.qp.error
            returned = decode(reply)[0]
            assert isinstance(returned, Header) and returned.write_list == (chunk,)
            assert bytes(target) == pattern(segments * each, 8)
            mr.close()


async def _raw_replies(calls: list[bytes]) -> list[bytes | None]:
    """The server's replies to ``calls`` (transport headers and all), one at a time."""
    replies: list[bytes | None] = []
    with trio.fail_after(TIMEOUT):
        async with server(InlineBench()) as (port, _), raw(port) as r:
            for call in calls:
                r.send(call)
                replies.append(await r.receive())
    return replies


async def test_answers_from_slots_are_the_bytes_the_python_path_sends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the backend answers from the endpoint's slots in C (the native engine), a
    plain call's reply is the same message, byte for byte, as when Python posts it; and
    the calls it does not answer there (a reply too long to go inline, a call that waits,
    a header with chunks or of another version, a procedure the program lacks) get the
    same answers too."""
    calls = [Header(xid, 32).encode() + call_message(xid, NULL) for xid in range(1, 20)]
    for xid, size in enumerate((0, 1, 3, 100, 1000, 3000, 4000), start=100):
        calls.append(
            Header(xid, 32).encode()
            + call_message(xid, ECHO, words(size) + bytes(-(-size // 4) * 4))
        )
    calls += [
        Header(200, 32).encode() + call_message(200, SUM, words(3, 1, 2, 3)),
        Header(201, 32).encode() + call_message(201, BIG, words(8000, 1)),  # (not inline)
        Header(202, 32).encode() + call_message(202, SLEEP, words(5)),  # (in a task)
        words(203, 2, 32, 0, 0, 0, 0) + call_message(203, NULL),  # (another version)
        Header(204, 32).encode() + call_message(204, 99),
        *(
            Header(xid, 32).encode() + call_message(xid, SUM, words(1, xid))
            for xid in range(300, 340)
        ),
    ]
    answered = 0
    real = rdma_server._Responder.answer

    def answer(responder: rdma_server._Responder, slot: int, length: int, send: int) -> int:
        nonlocal answered
        answered += 1
        return real(responder, slot, length, send)

    monkeypatch.setattr(rdma_server._Responder, "answer", answer)
    from_slots = await _raw_replies(calls)
    from_c, answered = answered, 0
    monkeypatch.setattr(Slots, "usable", lambda _: False)
    from_python = await _raw_replies(calls)
    assert answered == 0
    assert from_slots == from_python and None not in from_slots
    if engines.chosen()[0] == "native":
        assert from_c >= 60  # (the slots answered there)
