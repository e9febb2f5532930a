"""rdma_cm over the built-in engine on loopback: one test per event type."""

from __future__ import annotations

import contextlib
import errno
import socket
from typing import Any

import pytest
import trio

import rdmashim
from rdmashim import Access, QPState, RecvWR, SendFlags, SendWR, VerbsError, WCStatus, WROpcode
from rdmashim.cm import CMEventType, ConnParam, EventChannel, PortSpace, TransportOptions
from rdmashim.providers.softiwarp import mpa

E = CMEventType
SIG = SendFlags.SIGNALED


async def expect(channel: EventChannel, kind: CMEventType, seconds: float = 10) -> Any:
    with trio.fail_after(seconds):
        event = await channel.get_event()
    event.ack()
    assert event.event == kind, f"expected {kind.name}, got {event}"
    return event


def setup_qp(cm_id: Any) -> dict[str, Any]:
    ctx = cm_id.context
    pd = ctx.alloc_pd()
    cq = ctx.create_cq(256)
    qp = cm_id.create_qp(pd, send_cq=cq, recv_cq=cq, cap=rdmashim.QPCap(max_recv_wr=16))
    buf = pd.reg_mr(bytearray(256), Access.LOCAL_WRITE)
    qp.post_recv([RecvWR(i, [buf.sge(16 * i, 16)]) for i in range(8)])
    return {"pd": pd, "cq": cq, "qp": qp, "buf": buf}


async def listen(channel: EventChannel, host: str = "127.0.0.1") -> tuple[Any, int]:
    listener = channel.create_id()
    listener.bind_addr((host, 0))
    listener.listen()
    return listener, listener.local_addr[1]


async def resolve(channel: EventChannel, host: str, port: int) -> Any:
    cm_id = channel.create_id()
    cm_id.resolve_addr(None, (host, port))
    await expect(channel, E.ADDR_RESOLVED)
    cm_id.resolve_route()
    await expect(channel, E.ROUTE_RESOLVED)
    return cm_id


async def connected_pair(channel: EventChannel) -> tuple[Any, Any, dict, dict]:
    _, port = await listen(channel)
    client = await resolve(channel, "127.0.0.1", port)
    c = setup_qp(client)
    client.connect(ConnParam(private_data=b"hello"))
    request = await expect(channel, E.CONNECT_REQUEST)
    server = request.id
    s = setup_qp(server)
    server.accept(ConnParam(private_data=b"welcome"))
    events = {(await channel.get_event()).id for _ in range(2)}
    assert events == {client, server}
    return client, server, c, s


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1"])
async def test_addr_and_route_resolved_pick_the_loopback_device(host: str) -> None:
    async with EventChannel() as channel:
        cm_id = await resolve(channel, host, 4791)
        assert cm_id.context.device.name == "siw_lo"
        assert cm_id.peer_addr[1] == 4791
        assert cm_id.context.query_device().max_private_data == 252


async def test_addr_error_for_unknown_host() -> None:
    async with EventChannel() as channel:
        cm_id = channel.create_id()
        cm_id.resolve_addr(None, ("no-such-host.invalid", 1))
        event = await expect(channel, E.ADDR_ERROR)
        assert event.status < 0 and event.id is cm_id


async def test_connect_request_established_and_traffic() -> None:
    async with EventChannel() as channel:
        _, port = await listen(channel)
        client = await resolve(channel, "127.0.0.1", port)
        c = setup_qp(client)
        client.connect(ConnParam(private_data=b"hello", responder_resources=4, initiator_depth=2))
        request = await expect(channel, E.CONNECT_REQUEST)
        assert request.private_data == b"hello"
        assert request.param.responder_resources == 2  # the peer wants to issue 2 Reads
        assert request.param.initiator_depth == 4
        server = request.id
        assert request.listen_id is not None and server is not request.listen_id
        assert server.peer_addr[0] == "127.0.0.1" and server.local_addr[1] == port
        s = setup_qp(server)
        server.accept(ConnParam(private_data=b"welcome"))
        first = await expect(channel, E.ESTABLISHED)
        second = await expect(channel, E.ESTABLISHED)
        by_id = {first.id: first, second.id: second}
        assert by_id[client].private_data == b"welcome"
        assert client.qp.state == server.qp.state == QPState.RTS
        msg = c["pd"].reg_mr(bytearray(b"ping"))
        client.qp.post_send(SendWR(1, WROpcode.SEND, [msg.sge()], SIG))
        with trio.fail_after(5):
            wc = (await s["cq"].poll_wait(1))[0]
        assert wc.byte_len == 4 and bytes(s["buf"].buf[:4]) == b"ping"


async def test_rejected_with_private_data() -> None:
    async with EventChannel() as channel:
        _, port = await listen(channel)
        client = await resolve(channel, "127.0.0.1", port)
        setup_qp(client)
        client.connect(ConnParam(private_data=b"let me in"))
        request = await expect(channel, E.CONNECT_REQUEST)
        request.id.reject(b"not today")
        event = await expect(channel, E.REJECTED)
        assert event.id is client and event.private_data == b"not today"
        assert event.status == -errno.ECONNRESET


async def test_closed_port_is_rejected() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nobody listens here
    async with EventChannel() as channel:
        client = await resolve(channel, "127.0.0.1", port)
        setup_qp(client)
        client.connect()
        event = await expect(channel, E.REJECTED)
        assert event.status == -errno.ECONNREFUSED


async def _fake_server(reply: bytes | None) -> tuple[trio.SocketListener, int]:
    (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
    return listener, listener.socket.getsockname()[1]


@pytest.mark.parametrize(
    "reply",
    [
        b"HTTP/1.1 400 Bad Request\r\n\r\n....",
        mpa.encode_start_frame(mpa.StartFrame(reply=True, markers=True)),
        mpa.encode_start_frame(mpa.StartFrame(reply=True, revision=1, enhanced=False, crc=True)),
    ],
    ids=["bad-key", "markers", "revision-downgrade-accepted"],
)
async def test_connect_error_for_bad_mpa_reply(reply: bytes) -> None:
    listener, port = await _fake_server(reply)
    async with EventChannel() as channel, trio.open_nursery() as nursery:

        async def answer() -> None:
            stream = await listener.accept()
            await stream.receive_some(4096)
            await stream.send_all(reply)
            await trio.sleep_forever()

        nursery.start_soon(answer)
        client = await resolve(channel, "127.0.0.1", port)
        setup_qp(client)
        client.connect()
        event = await channel.get_event()
        if reply[16] == 0x40:  # a rev-1 reply to our rev-2 request is fine (RFC 6581)
            assert event.event == E.ESTABLISHED
        else:
            assert event.event == E.CONNECT_ERROR, event
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("seconds", [None, 3.0])
async def test_connect_error_when_mpa_reply_never_comes(
    autojump_clock: Any, seconds: float | None
) -> None:
    """No Reply: CONNECT_ERROR after ``mpa_reply_timeout`` (siw's MPAREQ_TIMEOUT, 10 s)."""
    listener, port = await _fake_server(None)
    async with EventChannel() as channel:
        client = await resolve(channel, "127.0.0.1", port)
        assert client.mpa_reply_timeout == 10.0
        if seconds is not None:
            client.mpa_reply_timeout = seconds
        setup_qp(client)
        client.connect()
        start = trio.current_time()
        event = await expect(channel, E.CONNECT_ERROR, seconds=60)
        assert event.status == -errno.ETIMEDOUT
        assert trio.current_time() - start == pytest.approx(seconds or 10, abs=0.5)
    await listener.aclose()


@pytest.mark.parametrize("seconds", [None, 2.0])
async def test_listener_drops_a_connection_whose_mpa_request_never_completes(
    autojump_clock: Any, seconds: float | None
) -> None:
    """Half an MPA Request, then silence: the listener closes the connection after its
    ``mpa_request_timeout`` (siw's MPAREP_TIMEOUT, 5 s) and reports nothing."""
    async with EventChannel() as channel:
        listener, port = await listen(channel)
        assert listener.mpa_request_timeout == 5.0
        if seconds is not None:
            listener.mpa_request_timeout = seconds
        stranger = trio.socket.socket()
        await stranger.connect(("127.0.0.1", port))
        await stranger.send(mpa.encode_start_frame(mpa.StartFrame(reply=False))[:10])
        start = trio.current_time()
        with trio.fail_after(60):
            with contextlib.suppress(ConnectionResetError):
                assert await stranger.recv(64) == b""
        assert trio.current_time() - start == pytest.approx(seconds or 5.0, abs=0.5)
        stranger.close()
        with pytest.raises(trio.WouldBlock):
            channel.get_event_nowait()


@pytest.mark.parametrize("who", ["client", "server"])
async def test_disconnected_from_either_side_then_timewait_exit(who: str) -> None:
    async with EventChannel() as channel:
        client, server, c, s = await connected_pair(channel)
        msg = c["pd"].reg_mr(bytearray(b"before"))
        client.qp.post_send(SendWR(1, WROpcode.SEND, [msg.sge()], SIG))
        with trio.fail_after(5):
            done = (await c["cq"].poll_wait(1))[0]
            got = (await s["cq"].poll_wait(1))[0]
        assert done.status == got.status == WCStatus.SUCCESS
        (client if who == "client" else server).disconnect()
        kinds: dict[Any, list] = {client: [], server: []}
        with trio.fail_after(10):
            while sum(len(v) for v in kinds.values()) < 4:
                event = await channel.get_event()
                event.ack()
                kinds[event.id].append(event.event)
        assert kinds[client] == kinds[server] == [E.DISCONNECTED, E.TIMEWAIT_EXIT]
        # Completed work stayed completed; only the receives still posted are flushed.
        flushed = c["cq"].poll(100) + s["cq"].poll(100)
        assert {w.status for w in flushed} == {WCStatus.WR_FLUSH_ERR}
        assert len([w for w in flushed if w.qp_num == server.qp.qp_num]) == 7
        assert client.qp.state == server.qp.state == QPState.ERR


async def test_device_removal() -> None:
    async with rdmashim.open_device("siw_lo") as ctx, EventChannel([ctx]) as channel:
        cm_id = await resolve(channel, "127.0.0.1", 4791)
        assert cm_id.context is ctx
        ctx.close()
        await expect(channel, E.DEVICE_REMOVAL)


async def test_udp_port_space_and_multicast_not_supported() -> None:
    async with EventChannel() as channel:
        cm_id = channel.create_id(ps=PortSpace.UDP)
        with pytest.raises(OSError, match="UDP") as info:
            cm_id.resolve_addr(None, ("127.0.0.1", 1))
        assert info.value.errno == errno.EOPNOTSUPP
        tcp_id = await resolve(channel, "127.0.0.1", 1)
        with pytest.raises(OSError, match="multicast"):
            tcp_id.join_multicast(("224.0.0.1", 0))


async def test_state_errors_name_the_problem() -> None:
    async with EventChannel() as channel:
        cm_id = channel.create_id()
        with pytest.raises(OSError, match="IDLE"):
            cm_id.connect()
        cm_id = await resolve(channel, "127.0.0.1", 1)
        with pytest.raises(OSError, match="need the id's QP"):
            cm_id.connect()
        setup_qp(cm_id)
        with pytest.raises(OSError, match="private data"):
            cm_id.connect(ConnParam(private_data=b"x" * 253))


@pytest.mark.parametrize("rtr", [mpa.RTR.WRITE, mpa.RTR.READ])
async def test_peer_to_peer_rtr_then_passive_side_sends_first(rtr: mpa.RTR) -> None:
    async with EventChannel() as channel:
        listener, port = await listen(channel)
        listener.options = TransportOptions(p2p=True)
        client = await resolve(channel, "127.0.0.1", port)
        client.options = TransportOptions(p2p=True, rtr=rtr)
        c = setup_qp(client)
        client.connect()
        request = await expect(channel, E.CONNECT_REQUEST)
        server = request.id
        s = setup_qp(server)
        server.accept()
        ids = {(await expect(channel, E.ESTABLISHED)).id for _ in range(2)}
        assert ids == {client, server}
        # With the RTR exchanged, the passive side may send first.
        msg = s["pd"].reg_mr(bytearray(b"server first"))
        server.qp.post_send(SendWR(1, WROpcode.SEND, [msg.sge()], SIG))
        with trio.fail_after(5):
            wc = (await c["cq"].poll_wait(1))[0]
        assert bytes(c["buf"].buf[: wc.byte_len]) == b"server first"[:16]


@pytest.mark.parametrize(
    ("host", "err", "words"),
    [
        ("localhost", errno.EINVAL, "is not an IP address"),
        ("192.0.2.77", errno.EADDRNOTAVAIL, "is not a local address"),
    ],
)
async def test_bind_addr_takes_a_local_ip_address(host: str, err: int, words: str) -> None:
    async with EventChannel() as channel:
        cm_id = channel.create_id()
        with pytest.raises(VerbsError) as info:
            cm_id.bind_addr((host, 0))
        assert info.value.errno == err
        assert words in str(info.value)
        cm_id.bind_addr(("127.0.0.1", 0))  # the id is still usable
