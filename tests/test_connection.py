"""MPA setup on a real TCP stream: reject with private data, markers, limits, timeouts; the
socket settings the engine keeps (how far its writes run ahead of the peer)."""

from __future__ import annotations

import socket

import pytest
import trio

from rdmashim import QPState
from rdmashim.providers.softiwarp import mpa
from rdmashim.providers.softiwarp.connection import (
    MPA_REPLY_TIMEOUT,
    MPA_REQUEST_TIMEOUT,
    MpaOptions,
    MpaRejected,
    MpaTimeout,
    accept_qp,
    connect_qp,
    read_request,
    reject,
)
from rdmashim.providers.softiwarp.driver import SEND_MARK_MAX, SEND_MARK_MIN, SLOW_WAIT
from rdmashim.providers.softiwarp.terminate import LlpCode, ProtocolError

from pairs import make_pair


async def _listener() -> tuple[trio.SocketListener, int]:
    (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
    return listener, listener.socket.getsockname()[1]


def _qp(ctx):
    pd = ctx.alloc_pd()
    cq = ctx.create_cq(16)
    return pd.create_qp(send_cq=cq, recv_cq=cq)


@pytest.mark.skipif(not hasattr(socket, "TCP_NOTSENT_LOWAT"), reason="no TCP_NOTSENT_LOWAT here")
async def test_unsent_bytes_follow_how_long_the_peer_takes(ctx) -> None:
    """The socket's TCP_NOTSENT_LOWAT on a real connection: 16 KiB at first, doubled by
    each long wait for room up to 1 MiB, halved by each short one back to 16 KiB."""
    client, _server = await make_pair(ctx)
    link = client.qp._link

    def mark() -> int:
        return int(link.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT))

    assert mark() == SEND_MARK_MIN
    seen = []
    for _ in range(8):
        link._pace(SLOW_WAIT)
        seen.append(mark())
    assert seen == [min(SEND_MARK_MIN << k, SEND_MARK_MAX) for k in range(1, 9)]
    assert seen[-1] == SEND_MARK_MAX
    link._pace(SLOW_WAIT / 10)
    assert mark() == SEND_MARK_MAX // 2
    for _ in range(8):
        link._pace(0.0)
    assert mark() == SEND_MARK_MIN


async def test_private_data_both_ways(ctx) -> None:
    listener, port = await _listener()
    client_qp, server_qp = _qp(ctx), _qp(ctx)
    seen = {}

    async def serve() -> None:
        stream = await listener.accept()
        request = await read_request(stream)
        seen["request"] = request.private_data
        await accept_qp(server_qp, stream, request, private_data=b"S" * 252)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve)
        result = await connect_qp(
            client_qp, await trio.open_tcp_stream("127.0.0.1", port), private_data=b"C" * 252
        )
    assert seen["request"] == b"C" * 252
    assert result.private_data == b"S" * 252
    assert client_qp.state == server_qp.state == QPState.RTS


async def test_private_data_limit(ctx) -> None:
    listener, port = await _listener()
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    with pytest.raises(ValueError, match="252"):
        await connect_qp(_qp(ctx), stream, private_data=b"x" * 253)
    # MPA rev 1 has no IRD/ORD block: the whole 256 bytes are the ULP's.
    frame = mpa.StartFrame(reply=False, revision=1, enhanced=False, private_data=b"x" * 256)
    assert len(mpa.encode_start_frame(frame)) == 20 + 256
    await listener.aclose()


async def test_reject_carries_private_data(ctx) -> None:
    listener, port = await _listener()

    async def serve() -> None:
        stream = await listener.accept()
        request = await read_request(stream)
        assert request.private_data == b"may I?"
        await reject(stream, request, b"no, go away")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve)
        qp = _qp(ctx)
        with pytest.raises(MpaRejected) as info:
            await connect_qp(
                qp, await trio.open_tcp_stream("127.0.0.1", port), private_data=b"may I?"
            )
    assert info.value.private_data == b"no, go away"
    assert qp.state == QPState.INIT


async def test_marker_request_is_rejected(ctx) -> None:
    listener, port = await _listener()

    async def serve() -> None:
        stream = await listener.accept()
        request = await read_request(stream)
        with pytest.raises(ProtocolError) as info:
            await accept_qp(_qp(ctx), stream, request)
        assert info.value.code.ecode == LlpCode.INVALID_REQ_REP

    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve)
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(mpa.encode_start_frame(mpa.StartFrame(reply=False, markers=True)))
        data = b""
        while len(data) < 24:
            chunk = await stream.receive_some()
            if not chunk:
                break
            data += chunk
        reply, _ = mpa.parse_start_frame(data, reply=True)
        assert reply.reject and not reply.markers


async def test_not_mpa_at_all(ctx) -> None:
    listener, port = await _listener()

    async def serve() -> None:
        stream = await listener.accept()
        await stream.send_all(b"HTTP/1.1 400 Bad Request\r\n\r\n")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve)
        with pytest.raises(ProtocolError, match="MPA ID Rep Frame"):
            await connect_qp(_qp(ctx), await trio.open_tcp_stream("127.0.0.1", port))


async def test_initiator_times_out(ctx, autojump_clock) -> None:
    listener, port = await _listener()
    start = trio.current_time()
    with pytest.raises(MpaTimeout):
        await connect_qp(_qp(ctx), await trio.open_tcp_stream("127.0.0.1", port))
    assert trio.current_time() - start == pytest.approx(MPA_REPLY_TIMEOUT)
    await listener.aclose()


async def test_responder_times_out(ctx, autojump_clock) -> None:
    listener, port = await _listener()
    client = await trio.open_tcp_stream("127.0.0.1", port)
    stream = await listener.accept()
    start = trio.current_time()
    with pytest.raises(MpaTimeout):
        await read_request(stream)
    assert trio.current_time() - start == pytest.approx(MPA_REQUEST_TIMEOUT)
    await client.aclose()
    await listener.aclose()


async def test_peer_closes_during_setup(ctx) -> None:
    listener, port = await _listener()

    async def serve() -> None:
        stream = await listener.accept()
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve)
        with pytest.raises(ConnectionResetError):
            await connect_qp(_qp(ctx), await trio.open_tcp_stream("127.0.0.1", port))


async def test_ird_ord_negotiated_down(ctx) -> None:
    client, server = await make_pair(
        ctx, client_options=MpaOptions(ird=8, ord=100), server_options=MpaOptions(ird=4, ord=2)
    )
    # The responder serves at most 4 of the initiator's Reads, issues at most 2.
    assert server.qp.query().max_dest_rd_atomic == 4
    assert server.qp.query().max_rd_atomic == 2
    assert client.qp.query().max_rd_atomic == 4
    assert client.qp.query().max_dest_rd_atomic == 8
