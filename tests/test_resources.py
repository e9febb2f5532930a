"""Resource exhaustion gets the verbs answer, not a crash, through the public API over
real connections (``serve`` and ``open_connection`` on loopback), both sides checked:
a CQ overrun, work requests past the queue sizes, registration past a memory
bound, a Send with no receive posted, more Read Requests than IRD."""

from __future__ import annotations

import errno
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import pytest
import trio

from rdmashim import (
    Access,
    AsyncEventType,
    QPCap,
    QPState,
    RecvWR,
    SendFlags,
    SendWR,
    VerbsError,
    WCStatus,
    WROpcode,
)
from rdmashim.cm import (
    Connection,
    ConnectionRequest,
    TransportOptions,
    open_connection,
    serve,
)
from rdmashim.providers.softiwarp.terminate import (
    DdpUntaggedCode,
    RdmapCode,
    RdmapType,
    ddp_untagged,
    rdmap,
)

SIG = SendFlags.SIGNALED
BOUND = 10.0
"""Seconds any of these answers may take (generous; they take milliseconds)."""


@dataclass
class Pair:
    """Both ends of a connection, and what the server's ``prepare`` registered."""

    client: Connection
    server: Connection
    server_mr: Any = None


@asynccontextmanager
async def connected(
    *,
    prepare: Callable[[ConnectionRequest], Any] | None = None,
    responder_resources: int | None = None,
    **client_kwargs: Any,
) -> AsyncIterator[Pair]:
    """A connection from ``open_connection(**client_kwargs)`` to ``serve``; ``prepare``
    runs on the server's request before it accepts (its result is ``server_mr``)."""
    send, receive = trio.open_memory_channel[tuple[Connection, Any]](1)

    async def handler(request: ConnectionRequest) -> None:
        prepared = prepare(request) if prepare is not None else None
        conn = await request.accept(responder_resources=responder_resources)
        await send.send((conn, prepared))
        await conn.wait_disconnected()

    async with trio.open_nursery() as nursery:
        addr = await nursery.start(partial(serve, handler, 0, host="127.0.0.1"))
        async with open_connection("127.0.0.1", addr[1], **client_kwargs) as client:
            with trio.fail_after(BOUND):
                server, prepared = await receive.receive()
            yield Pair(client, server, prepared)
        nursery.cancel_scope.cancel()


async def drain(cq: Any, n: int) -> list:
    wcs: list = []
    with trio.fail_after(BOUND):
        while len(wcs) < n:
            wcs += await cq.poll_wait()
    return wcs


def post_receives(n: int) -> Callable[[ConnectionRequest], Any]:
    def prepare(request: ConnectionRequest) -> Any:
        mr = request.pd.reg_mr(bytearray(64 * n), Access.LOCAL_WRITE)
        request.qp.post_recv([RecvWR(i, [mr.sge(64 * i, 64)]) for i in range(n)])
        return mr

    return prepare


async def both_ended(pair: Pair) -> None:
    """Both QPs are in ERR and both sides saw the connection end (CM DISCONNECTED)."""
    with trio.fail_after(BOUND):
        await pair.client.wait_disconnected()
        await pair.server.wait_disconnected()
    assert pair.client.qp.state == pair.server.qp.state == QPState.ERR


async def test_cq_overrun_reports_cq_err_and_fails_its_qps() -> None:
    """More completions than the CQ holds: CQ_ERR on the CQ, the QP completing into it
    goes to ERR (QP_FATAL), polling says EOVERFLOW; the peer sees the connection end."""
    async with connected(prepare=post_receives(8), cqe=4) as pair:
        client = pair.client
        src = client.pd.reg_mr(b"overrun!", Access(0))
        client.qp.post_send([SendWR(i, WROpcode.SEND, [src.sge()], SIG) for i in range(8)])
        with trio.fail_after(BOUND):
            first = await client.context.get_async_event()
            second = await client.context.get_async_event()
        assert (first.event_type, first.element) == (AsyncEventType.CQ_ERR, client.send_cq)
        assert (second.event_type, second.element) == (AsyncEventType.QP_FATAL, client.qp)
        assert isinstance(client.qp.error, VerbsError)
        assert client.qp.error.errno == errno.EOVERFLOW
        with pytest.raises(VerbsError) as info:
            client.send_cq.poll()
        assert info.value.errno == errno.EOVERFLOW
        await both_ended(pair)
        # The server got what was sent before the client's QP failed, or a flush.
        for wc in pair.server.recv_cq.poll(16):
            assert wc.status in (WCStatus.SUCCESS, WCStatus.WR_FLUSH_ERR)


async def test_posting_past_the_queue_sizes_is_enomem_naming_the_request() -> None:
    """A list of work requests longer than the queue: ENOMEM with ``bad_wr`` the index of
    the first refused; those before it are posted (and go out); both QPs stay in RTS."""
    cap = QPCap(max_send_wr=4, max_recv_wr=2)
    async with connected(prepare=post_receives(8), cap=cap) as pair:
        client, server = pair.client, pair.server
        buf = client.pd.reg_mr(bytearray(64), Access.LOCAL_WRITE)
        with pytest.raises(VerbsError) as info:
            client.qp.post_recv([RecvWR(i, [buf.sge(0, 64)]) for i in range(3)])
        assert (info.value.errno, info.value.bad_wr) == (errno.ENOMEM, 2)
        assert "receive queue full (2)" in str(info.value)
        src = client.pd.reg_mr(b"five sends", Access(0))
        with pytest.raises(VerbsError) as info:
            client.qp.post_send([SendWR(i, WROpcode.SEND, [src.sge()], SIG) for i in range(6)])
        assert (info.value.errno, info.value.bad_wr) == (errno.ENOMEM, 4)
        assert "send queue full (4)" in str(info.value)
        sent = await drain(client.send_cq, 4)
        assert [(w.wr_id, w.status) for w in sent] == [(i, WCStatus.SUCCESS) for i in range(4)]
        got = await drain(server.recv_cq, 4)
        assert [w.status for w in got] == [WCStatus.SUCCESS] * 4
        # The two receives the client did post take the server's two Sends.
        reply = server.pd.reg_mr(b"back", Access(0))
        server.qp.post_send([SendWR(i, WROpcode.SEND, [reply.sge()], SIG) for i in range(2)])
        got = await drain(client.recv_cq, 2)
        assert [(w.wr_id, w.status) for w in got] == [(0, WCStatus.SUCCESS), (1, WCStatus.SUCCESS)]
        assert client.qp.state == server.qp.state == QPState.RTS


async def test_registering_past_the_memory_bound_is_enomem() -> None:
    async with connected(prepare=post_receives(1)) as pair:
        ctx = pair.client.context
        ctx.max_registered_bytes = ctx.registered_bytes + (1 << 20)
        first = pair.client.pd.reg_mr(bytearray(600 << 10), Access.LOCAL_WRITE)
        with pytest.raises(VerbsError) as info:
            pair.client.pd.reg_mr(bytearray(600 << 10), Access.LOCAL_WRITE)
        assert info.value.errno == errno.ENOMEM
        assert "max_registered_bytes" in str(info.value)
        first.close()  # deregistering gives the room back
        second = pair.client.pd.reg_mr(bytearray(600 << 10), Access.LOCAL_WRITE)
        # The connection is unharmed: a Send from the new region arrives.
        second.buf[:5] = b"still"
        pair.client.qp.post_send(SendWR(1, WROpcode.SEND, [second.sge(0, 5)], SIG))
        (wc,) = await drain(pair.server.recv_cq, 1)
        assert wc.status == WCStatus.SUCCESS and bytes(pair.server_mr.buf[:5]) == b"still"
        assert pair.client.qp.state == pair.server.qp.state == QPState.RTS


async def test_send_with_no_receive_posted_is_a_no_buffer_terminate() -> None:
    async with connected() as pair:
        src = pair.client.pd.reg_mr(b"nobody listens", Access(0))
        pair.client.qp.post_send(SendWR(1, WROpcode.SEND, [src.sge()], SIG))
        await both_ended(pair)
        code = ddp_untagged(DdpUntaggedCode.MSN_NO_BUFFER)
        assert pair.server.qp.error.code == code
        assert pair.client.qp.remote_terminate == code
        (wc,) = await drain(pair.client.send_cq, 1)  # handed to TCP before the Terminate
        assert (wc.wr_id, wc.status) == (1, WCStatus.SUCCESS)
        assert pair.server.recv_cq.poll() == []


async def test_more_read_requests_than_ird_is_a_terminate_and_rem_op_err() -> None:
    """MPA rev 1 has no IRD/ORD exchange: the client issues 4 Reads at once against a
    responder serving 1. The responder terminates (RDMAP remote operation, catastrophic
    stream, quoting the Read Request); the Read it quotes completes with REM_OP_ERR."""

    def readable(request: ConnectionRequest) -> Any:
        return request.pd.reg_mr(bytearray(b"r" * 64), Access.LOCAL_WRITE | Access.REMOTE_READ)

    async with connected(
        prepare=readable, responder_resources=1, options=TransportOptions(revision=1)
    ) as pair:
        client, target = pair.client, pair.server_mr
        assert pair.server.qp.query().max_dest_rd_atomic == 1
        sink = client.pd.reg_mr(bytearray(64), Access.LOCAL_WRITE)
        reads = [
            SendWR(i, WROpcode.RDMA_READ, [sink.sge(16 * i, 16)], SIG, target.iova, target.rkey)
            for i in range(4)
        ]
        client.qp.post_send(reads)
        await both_ended(pair)
        code = rdmap(RdmapType.REMOTE_OPERATION, RdmapCode.CATASTROPHIC_STREAM)
        assert pair.server.qp.error.code == code
        assert client.qp.remote_terminate == code
        wcs = await drain(client.send_cq, 4)
        statuses = {w.wr_id: w.status for w in wcs}
        assert statuses[1] == WCStatus.REM_OP_ERR, statuses  # the second Read is quoted
        assert statuses[0] in (WCStatus.SUCCESS, WCStatus.WR_FLUSH_ERR)
        assert {statuses[2], statuses[3]} == {WCStatus.WR_FLUSH_ERR}
