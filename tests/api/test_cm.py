"""Connection management: resolution, private data both ways and its limit, reject,
refused and unreachable peers, disconnect from either side, and the trio-style
``open_connection`` / ``serve`` layer."""

from __future__ import annotations

import errno
import socket
from typing import Any

import pytest
import trio
from api.support import HOST, SIG, TIMEOUT, Cm, E, drain, make_end, ok, quiet

import rdmashim
from rdmashim import (
    WC,
    DeviceAttr,
    QPCap,
    QPState,
    RecvWR,
    SendWR,
    Transport,
    VerbsError,
    WCOpcode,
    WCStatus,
    WROpcode,
)
from rdmashim.cm import (
    Connection,
    ConnectionRejected,
    ConnectionRequest,
    ConnParam,
    EventChannel,
    open_connection,
    serve,
)


def closed_port() -> int:
    """A port nobody listens on (bound once, then released)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def exact_or_padded(got: bytes, sent: bytes, transport: Transport) -> bool:
    """iWARP (MPA) delivers private data exactly; IB pads it to the message's size."""
    if transport == Transport.IWARP:
        return got == sent
    return got[: len(sent)] == sent and not any(got[len(sent) :])


IB_CM_PRIVATE_DATA = {"accept": 196, "reject": 148}
"""What the IB CM's REP and REJ carry (IBTA: their private data fields; the kernel's
``ib_cm.h``); a connect's REQ carries ``max_private_data`` (92 bytes less rdma_cm's header)."""


def private_data_limit(attr: DeviceAttr, operation: str) -> int:
    """The private data ``operation`` may carry: one limit on iWARP (MPA's, less its
    IRD/ORD block), one per IB CM message on IB and RoCE."""
    if attr.transport == Transport.IWARP or operation == "connect":
        return attr.max_private_data
    return IB_CM_PRIVATE_DATA[operation]


async def test_resolve_picks_a_listed_device(cm: Cm) -> None:
    cm_id = await cm.resolve(4791)
    assert cm_id.context.device.name in {d.name for d in rdmashim.get_device_list()}
    assert cm_id.peer_addr[:2] == (HOST, 4791)
    assert cm_id.context.query_port(1).state.name == "ACTIVE"


async def test_unknown_host_is_addr_error(cm: Cm) -> None:
    cm_id = cm.channel.create_id()
    cm_id.resolve_addr(None, ("no-such-host.invalid", 1))
    event = await cm.events.expect(cm_id, E.ADDR_ERROR)
    assert event.status < 0


@pytest.mark.parametrize("size", ["empty", "small", "max"])
async def test_private_data_both_ways(cm: Cm, size: str) -> None:
    attr = await cm.device_attr()
    n, m = {
        "empty": (0, 0),
        "small": (5, 5),
        "max": (private_data_limit(attr, "connect"), private_data_limit(attr, "accept")),
    }[size]
    hello = bytes(range(256))[: n - 1] + b"!" if n else b""
    welcome = bytes(reversed(bytes(range(256))[: m - 1] + b"?")) if m else b""
    pair = await cm.pair(private_data=hello, accept_data=welcome)
    assert exact_or_padded(pair.connect_event.private_data, hello, attr.transport)
    assert exact_or_padded(pair.client_established.private_data, welcome, attr.transport)
    assert pair.connect_event.listen_id is cm.listener
    assert pair.server.id is not cm.listener
    assert pair.server.id.peer_addr[0] == HOST
    assert pair.server.id.local_addr[1] == cm.port


async def test_private_data_beyond_the_limit_is_refused(cm: Cm) -> None:
    attr = await cm.device_attr()

    def too_long(operation: str) -> bytes:
        return b"x" * (private_data_limit(attr, operation) + 1)

    client_id = await cm.resolve(cm.listen())
    make_end(client_id, cap=None, sq_sig_all=False, cqe=16, comp_channel=False)
    with pytest.raises(VerbsError) as info:
        client_id.connect(ConnParam(private_data=too_long("connect")))
    assert info.value.errno == errno.EINVAL
    client_id.connect(ConnParam(private_data=b"ok"))
    request = await cm.events.request()
    make_end(request.id, cap=None, sq_sig_all=False, cqe=16, comp_channel=False)
    with pytest.raises(VerbsError) as info:
        request.id.accept(ConnParam(private_data=too_long("accept")))
    assert info.value.errno == errno.EINVAL
    with pytest.raises(VerbsError) as info:
        request.id.reject(too_long("reject"))
    assert info.value.errno == errno.EINVAL
    request.id.accept(ConnParam(private_data=b"fine"))
    event = await cm.events.expect(client_id, E.ESTABLISHED)
    assert exact_or_padded(event.private_data, b"fine", attr.transport)


async def test_reject_with_private_data(cm: Cm) -> None:
    attr = await cm.device_attr()
    client_id = await cm.resolve(cm.listen())
    make_end(client_id, cap=None, sq_sig_all=False, cqe=16, comp_channel=False)
    client_id.connect(ConnParam(private_data=b"let me in"))
    request = await cm.events.request()
    assert exact_or_padded(request.private_data, b"let me in", attr.transport)
    request.id.reject(b"not today")
    event = await cm.events.expect(client_id, E.REJECTED)
    # iWARP: an MPA Reject (-ECONNRESET; -ECONNREFUSED where a driver says so); IB and
    # RoCE: the backend maps the IB CM's reject reason to the same errno.
    assert event.status in (-errno.ECONNRESET, -errno.ECONNREFUSED), event
    assert exact_or_padded(event.private_data, b"not today", attr.transport)
    # The listener goes on: the next connection is accepted.
    pair = await cm.pair(private_data=b"again")
    assert exact_or_padded(pair.connect_event.private_data, b"again", attr.transport)


async def test_connect_to_a_closed_port_is_refused(cm: Cm) -> None:
    client_id = await cm.resolve(closed_port())
    make_end(client_id, cap=None, sq_sig_all=False, cqe=16, comp_channel=False)
    # Kernel siw makes the TCP connection inside rdma_connect() (siw_cm.c: "connect()
    # is called in blocking mode"); the backend still reports the refusal as an event.
    client_id.connect()
    event = await cm.events.expect(client_id, E.REJECTED)
    assert event.status == -errno.ECONNREFUSED


async def test_listening_twice_on_one_port_fails(cm: Cm) -> None:
    port = cm.listen()
    other = cm.channel.create_id()
    with pytest.raises(VerbsError) as info:
        other.bind_addr((HOST, port))
        other.listen()
    assert info.value.errno == errno.EADDRINUSE


@pytest.mark.parametrize("who", ["client", "server"])
async def test_disconnect_from_either_side(cm: Cm, who: str) -> None:
    pair = await cm.pair()
    client, server = pair.client, pair.server
    for end in (client, server):
        end.post_recvs(end.reg(4 * 16), 4, 16)
    # Work completed before the disconnect stays completed.
    client.qp.post_send(SendWR(1, WROpcode.SEND, [client.reg(b"before").sge()], SIG))
    ok(await drain(client.send_cq, 1))
    ok(await drain(server.recv_cq, 1))
    active, passive = (client, server) if who == "client" else (server, client)
    active.id.disconnect()
    assert active.qp.query().qp_state == QPState.ERR
    for end in (active, passive):
        await pair.events.expect(end.id, E.DISCONNECTED)
    passive.id.disconnect()  # what a librdmacm application does on DISCONNECTED
    assert passive.qp.query().qp_state == QPState.ERR
    flushed = await drain(client.recv_cq, 4) + await drain(server.recv_cq, 3)
    assert {w.status for w in flushed} == {WCStatus.WR_FLUSH_ERR}


async def test_many_connections_on_one_listener(cm: Cm) -> None:
    pairs = [await cm.pair(private_data=b"%d" % i) for i in range(6)]
    for i, pair in enumerate(pairs):
        rbuf = pair.server.reg(16)
        pair.server.qp.post_recv(RecvWR(i, [rbuf.sge()]))
        pair.client.qp.post_send(SendWR(i, WROpcode.SEND, [pair.client.reg(b"c%d" % i).sge()], SIG))
    for i, pair in enumerate(pairs):
        (wc,) = ok(await drain(pair.server.recv_cq, 1))
        assert wc.wr_id == i and wc.qp_num == pair.server.qp.qp_num
    assert len({p.server.qp.qp_num for p in pairs}) == 6


async def test_two_event_channels() -> None:
    """Client and server in separate event channels, as in two programs."""
    async with EventChannel() as server_channel, EventChannel() as client_channel:
        server_cm, client_cm = Cm(server_channel), Cm(client_channel)
        port = server_cm.listen()
        client_id = await client_cm.resolve(port)
        client = make_end(client_id, cap=None, sq_sig_all=False, cqe=16, comp_channel=False)
        client_id.connect(ConnParam(private_data=b"two"))
        with pytest.raises(trio.TooSlowError):
            await client_cm.events.request(limit=0.05)  # requests go to the listener's channel
        request = await server_cm.events.request()
        server = make_end(request.id, cap=None, sq_sig_all=False, cqe=16, comp_channel=False)
        rbuf = server.reg(16)
        server.qp.post_recv(RecvWR(1, [rbuf.sge()]))
        request.id.accept()
        await client_cm.events.expect(client_id, E.ESTABLISHED)
        await server_cm.events.expect(request.id, E.ESTABLISHED)
        client.qp.post_send(SendWR(1, WROpcode.SEND, [client.reg(b"hi").sge()], SIG))
        (wc,) = ok(await drain(server.recv_cq, 1))
        assert bytes(rbuf.buf[: wc.byte_len]) == b"hi"


# ---------------------------------------------------------------- open_connection / serve


async def _echo(request: ConnectionRequest) -> None:
    """Accept (or reject what asks for it) and echo every Send until disconnected."""
    buf = request.pd.reg_mr(bytearray(16 * 256))
    request.qp.post_recv([RecvWR(i, [buf.sge(256 * i, 256)]) for i in range(16)])
    if request.private_data.startswith(b"go away"):
        await request.reject(b"rejected: " + request.private_data)
        return
    conn = await request.accept(private_data=b"echo " + request.private_data)
    async with trio.open_nursery() as nursery:

        async def echo() -> None:
            while True:
                for wc in await conn.recv_cq.poll_wait():
                    if wc.status != WCStatus.SUCCESS:
                        return
                    if wc.opcode >= 128:  # a receive (not our own send completing)
                        off = 256 * wc.wr_id
                        conn.qp.post_send(SendWR(0, WROpcode.SEND, [buf.sge(off, wc.byte_len)]))
                        conn.qp.post_recv(RecvWR(wc.wr_id, [buf.sge(off, 256)]))

        nursery.start_soon(echo)
        await conn.wait_disconnected()
        nursery.cancel_scope.cancel()


async def test_open_connection_and_serve(cm: Cm) -> None:
    transport = (await cm.device_attr()).transport
    async with trio.open_nursery() as nursery:
        addr = await nursery.start(serve, _echo, 0)
        for n in range(3):  # one after another on one listener
            async with open_connection(HOST, addr[1], private_data=b"c%d" % n) as conn:
                # On IB the handler echoes the REQ's private data padded to its 56 bytes.
                assert exact_or_padded(conn.private_data, b"echo c%d" % n, transport)
                assert conn.context.device.name in {d.name for d in rdmashim.get_device_list()}
                rbuf = conn.pd.reg_mr(bytearray(256))
                conn.qp.post_recv(RecvWR(1, [rbuf.sge()]))
                msg = conn.pd.reg_mr(bytearray(b"marco %d" % n))
                conn.qp.post_send(SendWR(2, WROpcode.SEND, [msg.sge()], SIG))
                with trio.fail_after(TIMEOUT):
                    wcs: list = []
                    while not any(w.wr_id == 1 for w in wcs):
                        wcs += ok(await conn.recv_cq.poll_wait())
                assert bytes(rbuf.buf[:7]) == b"marco %d" % n
        nursery.cancel_scope.cancel()


async def test_serve_rejects_and_open_connection_raises(cm: Cm) -> None:
    transport = (await cm.device_attr()).transport
    async with trio.open_nursery() as nursery:
        addr = await nursery.start(serve, _echo, 0)
        with pytest.raises(ConnectionRejected) as info:
            async with open_connection(HOST, addr[1], private_data=b"go away"):
                pytest.fail("connected")
        assert exact_or_padded(info.value.private_data, b"rejected: go away", transport)
        assert info.value.errno in (errno.ECONNRESET, errno.ECONNREFUSED)

        async def silent(request: ConnectionRequest) -> None:
            return  # neither accepts nor rejects: serve rejects

        addr2 = await nursery.start(serve, silent, 0)
        with pytest.raises(ConnectionRejected):
            async with open_connection(HOST, addr2[1]):
                pytest.fail("connected")
        nursery.cancel_scope.cancel()


async def test_open_connection_to_a_closed_port() -> None:
    with pytest.raises(ConnectionRejected) as info:
        async with open_connection(HOST, closed_port()):
            pytest.fail("connected")
    assert info.value.errno == errno.ECONNREFUSED


async def test_a_cancelled_handlers_cleanup_still_has_its_device() -> None:
    """Cancelling ``serve`` reaches its handlers and the tasks that hold its devices open
    at once; a handler's cleanup that still uses its connection (a last poll) must find
    the device open: it closes when the listener's channel does, after the handlers."""
    accepted = trio.Event()
    polled: list[int] = []

    async def handler(request: ConnectionRequest) -> None:
        conn = await request.accept()
        accepted.set()
        try:
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                await trio.sleep(0.05)  # the tasks holding devices run meanwhile
            polled.append(len(conn.recv_cq.poll()))

    async with trio.open_nursery() as nursery:
        addr = await nursery.start(serve, handler, 0)
        async with open_connection(HOST, addr[1]):
            with trio.fail_after(TIMEOUT):
                await accepted.wait()
            nursery.cancel_scope.cancel()
    assert polled == [0]


async def test_a_connection_whose_queue_pair_cannot_be_made_is_refused(cm: Cm) -> None:
    """serve() makes each connection's QP before its handler runs: a QP the device
    cannot have (more work requests than it allows) refuses that connection, and the
    listener goes on serving the next."""
    attr = await cm.device_attr()
    handled: list[bytes] = []

    async def handler(request: ConnectionRequest) -> None:
        handled.append(request.private_data)
        await request.reject()

    too_deep = QPCap(max_send_wr=attr.max_qp_wr + 1, max_recv_wr=1)
    async with trio.open_nursery() as nursery:
        addr = await nursery.start(lambda task_status: serve(
            handler, 0, host=HOST, cap=too_deep, task_status=task_status
        ))  # fmt: skip
        for n in range(2):
            with trio.fail_after(TIMEOUT), pytest.raises(ConnectionRejected):
                async with open_connection(HOST, addr[1], private_data=b"%d" % n):
                    pytest.fail("connected")
        nursery.cancel_scope.cancel()
    assert handled == []


async def test_handler_sees_the_peer_disconnect() -> None:
    done = trio.Event()

    async def handler(request: ConnectionRequest) -> None:
        conn = await request.accept()
        with trio.fail_after(TIMEOUT):
            await conn.wait_disconnected()
        done.set()

    async with trio.open_nursery() as nursery:
        addr = await nursery.start(serve, handler, 0)
        async with open_connection(HOST, addr[1]):
            pass
        with trio.fail_after(TIMEOUT):
            await done.wait()
        nursery.cancel_scope.cancel()


def _post_recv(end: Connection | ConnectionRequest) -> Any:
    """Post a receive; the region it names (keep it: a region collected is closed, and
    on rdma-core a kernel provider then ends the QP when the Send arrives)."""
    mr = end.pd.reg_mr(bytearray(16))
    end.qp.post_recv(RecvWR(1, [mr.sge()]))
    return mr


async def _exchange(conn: Connection, first: bool) -> tuple[list[WC], list[WC]]:
    """A signaled Send each way, ours ``first`` or after the peer's arrived (a receive is
    posted already); what send_cq and recv_cq gave, the same list twice for one CQ."""
    msg = conn.pd.reg_mr(bytearray(b"ping"))

    def send() -> None:
        conn.qp.post_send(SendWR(2, WROpcode.SEND, [msg.sge()], SIG))

    if first:
        send()
    if conn.send_cq is conn.recv_cq:
        wcs = [] if first else ok(await drain(conn.cq, 1))
        if not first:
            send()
        wcs += ok(await drain(conn.cq, 2 if first else 1))
        return wcs, wcs
    received = ok(await drain(conn.recv_cq, 1))
    if not first:
        send()
    sent = ok(await drain(conn.send_cq, 1))
    return sent + await quiet(conn.send_cq), received + await quiet(conn.recv_cq)


def _check_cqs(conn: Connection, wcs: tuple[list[WC], list[WC]], separate: bool) -> None:
    sent, received = wcs
    if separate:
        assert conn.send_cq is not conn.recv_cq
        with pytest.raises(AttributeError, match="separate CQs"):
            conn.cq  # noqa: B018
        assert ([w.opcode for w in sent], [w.opcode for w in received]) == (
            [WCOpcode.SEND], [WCOpcode.RECV]
        )  # fmt: skip
    else:
        assert conn.cq is conn.send_cq is conn.recv_cq
        assert sorted(w.opcode for w in sent) == [WCOpcode.SEND, WCOpcode.RECV]


@pytest.mark.parametrize("separate", [False, True], ids=["one-CQ", "separate-CQs"])
async def test_a_connections_cqs_are_what_their_names_say(separate: bool) -> None:
    """By default a connection has one CQ, ``conn.cq``, which ``send_cq`` and ``recv_cq``
    both are: Sends and receives complete there. With ``separate_cqs=True`` (librdmacm's
    ``rdma_create_ep`` shape) a Send completes in ``send_cq`` only, a receive in
    ``recv_cq`` only, and ``conn.cq`` says there is no one CQ. Both ends alike (before,
    a connection had one CQ under two names, and no way to have two)."""
    served = trio.Event()

    async def handler(request: ConnectionRequest) -> None:
        region = _post_recv(request)
        conn = await request.accept()
        _check_cqs(conn, await _exchange(conn, first=False), separate)
        served.set()
        await conn.wait_disconnected()
        region.close()

    async with trio.open_nursery() as nursery:
        addr = await nursery.start(lambda task_status: serve(
            handler, 0, separate_cqs=separate, task_status=task_status
        ))  # fmt: skip
        with trio.fail_after(TIMEOUT):
            async with open_connection(HOST, addr[1], separate_cqs=separate) as conn:
                region = _post_recv(conn)
                _check_cqs(conn, await _exchange(conn, first=True), separate)
                region.close()
                await served.wait()
        nursery.cancel_scope.cancel()


class HandlerBug(Exception):
    """What the handler of ``test_a_handlers_exception_reaches_the_caller_of_serve`` raises."""


@pytest.mark.parametrize("delay", [0.0, 0.05], ids=["at-once", "after-50ms"])
@pytest.mark.parametrize("where", ["serve's nursery", "handler_nursery"], ids=["serve", "handler"])
async def test_a_handlers_exception_reaches_the_caller_of_serve(delay: float, where: str) -> None:
    """A handler that raises after accepting closes its connection; the client, which
    then sees its receive flushed (or its connect fail), fails too, unless the handler's
    error cancelled it first (a handler in the caller's nursery cancels it at once). The
    handler's error always comes out of the nursery, and the client's beside it when it
    raised one: neither hides the other (before, serve's event channel closing under
    the cancellation raised only Cancelled, and the handler's error was lost)."""
    client_failed = False

    async def handler(request: ConnectionRequest) -> None:
        await request.accept()
        await trio.sleep(delay)
        raise HandlerBug("the handler's own mistake")

    with trio.fail_after(TIMEOUT), pytest.raises(BaseExceptionGroup) as info:
        async with trio.open_nursery() as nursery:
            extra = {"handler_nursery": nursery} if where == "handler_nursery" else {}
            addr = await nursery.start(lambda task_status: serve(
                handler, 0, task_status=task_status, **extra
            ))  # fmt: skip
            async with open_connection(HOST, addr[1]) as conn:
                buf = conn.pd.reg_mr(bytearray(16))
                conn.qp.post_recv(RecvWR(1, [buf.sge()]))
                (wc,) = await drain(conn.recv_cq, 1)
                assert wc.status == WCStatus.WR_FLUSH_ERR  # the handler's end closed it
                client_failed = True
                raise ConnectionError("the client saw the connection end")
    errors = _leaves(info.value)
    assert [e for e in errors if isinstance(e, HandlerBug)], errors
    # The client fails as it sees the end: in its block, or (the handler was quick)
    # while open_connection still waited for ESTABLISHED, a CMError.
    assert all(isinstance(e, HandlerBug | ConnectionError) for e in errors), errors
    assert not client_failed or [e for e in errors if type(e) is ConnectionError], errors


BAD_ADDRESSES = [
    (HOST, -1), (HOST, 70000), (HOST, 1.5), (HOST, "80"), (HOST, True), (None, 1), (5, 1),
    (HOST,), "host:1",
]  # fmt: skip
"""Socket addresses no CM takes: a port past 65535 would wrap in ``htons`` (70000 is
4464), a float be cut, a host that is no string resolve to something."""


@pytest.mark.parametrize("addr", BAD_ADDRESSES, ids=repr)
async def test_addresses_of_the_wrong_shape_are_einval(cm: Cm, addr: object) -> None:
    """``resolve_addr`` and ``bind_addr`` of an address C cannot hold are EINVAL at once,
    naming the part that is wrong, and the id stays usable (it resolves a good one)."""
    cm_id = cm.channel.create_id()
    for call in (lambda: cm_id.resolve_addr(None, addr), lambda: cm_id.bind_addr(addr)):
        with pytest.raises(VerbsError) as info:
            call()
        assert info.value.errno == errno.EINVAL, info.value
    cm_id.resolve_addr(None, (HOST, cm.listen()))
    await cm.events.expect(cm_id, E.ADDR_RESOLVED)
    cm_id.destroy()


@pytest.mark.parametrize(
    "fault",
    [
        {"port": 70000}, {"port": 1.5}, {"host": None}, {"connect_timeout": -1},
        {"connect_timeout": float("nan")}, {"private_data": "text"},
        {"responder_resources": -1},
    ],
    ids=repr,
)  # fmt: skip
async def test_open_connection_refuses_what_it_cannot_send_at_once(cm: Cm, fault: dict) -> None:
    """``open_connection`` with a port or host C cannot hold, a connect timeout that is
    not above 0, private data that is no bytes or a negative IRD raises EINVAL before
    anything goes out (a port of 70000 used to reach port 4464, a NaN timeout to fail
    inside the connection's task)."""
    args = {"host": HOST, "port": cm.listen()} | fault
    host, port = args.pop("host"), args.pop("port")
    with trio.fail_after(TIMEOUT), pytest.raises(VerbsError) as info:
        async with open_connection(host, port, **args):
            pass
    assert info.value.errno == errno.EINVAL, info.value


@pytest.mark.parametrize(
    "param",
    [ConnParam(retry_count=256), ConnParam(rnr_retry_count=-1), ConnParam(qp_num=1 << 32),
     ConnParam(srq=1.5)],  # type: ignore[arg-type]
    ids=["retry_count 256", "rnr_retry_count -1", "qp_num 2**32", "srq 1.5"],
)  # fmt: skip
async def test_conn_params_struct_rdma_conn_param_cannot_hold_are_einval(
    cm: Cm, param: ConnParam
) -> None:
    cm_id = await cm.resolve(cm.listen())
    make_end(cm_id, cap=None, sq_sig_all=False, cqe=16, comp_channel=False)
    with pytest.raises(VerbsError) as info:
        cm_id.connect(param)
    assert info.value.errno == errno.EINVAL, info.value
    cm_id.destroy()


@pytest.mark.parametrize("fault", [{"port": 70000}, {"port": -1}, {"max_pending": 0}], ids=repr)
async def test_serve_refuses_a_port_or_a_queue_it_cannot_have(fault: dict) -> None:
    args = {"port": 0} | fault
    port = args.pop("port")

    async def handler(request: ConnectionRequest) -> None:
        await request.reject()

    with trio.fail_after(TIMEOUT), pytest.raises(ExceptionGroup) as info:
        async with trio.open_nursery() as nursery:
            await nursery.start(lambda task_status: serve(
                handler, port, host=HOST, task_status=task_status, **args
            ))  # fmt: skip
    errors = list(_leaves(info.value))
    assert [type(e) for e in errors] == [VerbsError] and errors[0].errno == errno.EINVAL, errors


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out += _leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc]
    return out
