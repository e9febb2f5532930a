"""RPC-over-RDMA v1 end to end: ``serve_rdma`` and ``RpcRdmaClient`` over the built-in engine.

A test program served by :class:`RpcServer` over real loopback connections:
short calls, DDP-eligible arguments in Read chunks, results in Write chunks,
Long Calls and Long Replies, credits, and peers speaking raw transport
headers (another version, bad chunks, garbage, too many calls).
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio

from rdmashim.cm import Connection, open_connection
from rdmashim.ulps.nfsrdma.rdma_client import RpcRdmaClient, TransportError
from rdmashim.ulps.nfsrdma.rdma_server import serve_rdma
from rdmashim.ulps.nfsrdma.rpc import NULL_AUTH, CallHeader, RpcServer, pack_call_header
from rdmashim.ulps.nfsrdma.rpcrdma import (
    ConnectPrivate,
    ErrCode,
    Header,
    Proc,
    ReadSegment,
    Segment,
)
from rdmashim.ulps.nfsrdma.service import CallContext, ProcUnavailable, Reply
from rdmashim.ulps.nfsrdma.xdr import Unpacker
from rdmashim.verbs import Access, RecvWR, SendWR, WCStatus

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
        elif ctx.proc == SLEEP:
            self.running += 1
            self.peak = max(self.peak, self.running)
            await trio.sleep(args.uint() / 1000)
            self.running -= 1
            p.uint(ctx.xid)
        else:
            raise ProcUnavailable(ctx.proc)
        args.done()


def args_of(*words: int) -> Reply:
    r = Reply()
    for w in words:
        r.packer.uint(w)
    return r


@asynccontextmanager
async def server(**kw: int) -> AsyncIterator[tuple[int, Bench]]:
    bench = Bench()
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
