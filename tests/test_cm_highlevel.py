"""open_connection / serve: the trio-style layer over the CM."""

from __future__ import annotations

import contextlib
import errno
import socket
import struct
from functools import partial
from typing import Any

import pytest
import trio

from rdmashim import Access, RecvWR, SendFlags, SendWR, WCStatus, WROpcode
from rdmashim.cm import (
    CMError,
    Connection,
    ConnectionRejected,
    ConnectionRequest,
    ConnectionUnreachable,
    EventChannel,
    open_connection,
    open_device_for,
    serve,
)
from rdmashim.providers.softiwarp import mpa

SIG = SendFlags.SIGNALED


async def echo_handler(request: ConnectionRequest) -> None:
    """Accept, echo each Send back once, until the peer disconnects."""
    buf = request.pd.reg_mr(bytearray(4096), Access.LOCAL_WRITE)
    request.qp.post_recv([RecvWR(i, [buf.sge(256 * i, 256)]) for i in range(16)])
    if request.private_data == b"go away":
        await request.reject(b"rejected: " + request.private_data)
        return
    conn = await request.accept(private_data=b"echo " + request.private_data)
    async with trio.open_nursery() as nursery:

        async def echo() -> None:
            while True:
                for wc in await conn.recv_cq.poll_wait():
                    if wc.opcode != 128:  # a send completion
                        continue
                    if wc.status != WCStatus.SUCCESS:
                        return
                    off = 256 * wc.wr_id
                    conn.qp.post_send(SendWR(0, WROpcode.SEND, [buf.sge(off, wc.byte_len)]))
                    conn.qp.post_recv(RecvWR(wc.wr_id, [buf.sge(off, 256)]))

        nursery.start_soon(echo)
        await conn.wait_disconnected()
        nursery.cancel_scope.cancel()


async def test_open_connection_and_serve() -> None:
    async with trio.open_nursery() as nursery:
        addr = await nursery.start(serve, echo_handler, 0)
        port = addr[1]
        for n in range(3):  # several connections, one after another
            async with open_connection("127.0.0.1", port, private_data=b"c%d" % n) as conn:
                assert conn.private_data == b"echo c%d" % n
                assert conn.context.device.name == "siw_lo"
                rbuf = conn.pd.reg_mr(bytearray(256), Access.LOCAL_WRITE)
                conn.qp.post_recv(RecvWR(1, [rbuf.sge()]))
                msg = conn.pd.reg_mr(bytearray(b"marco %d" % n))
                conn.qp.post_send(SendWR(2, WROpcode.SEND, [msg.sge()], SIG))
                with trio.fail_after(10):
                    wcs: list = []
                    while not any(w.wr_id == 1 for w in wcs):
                        wcs += await conn.recv_cq.poll_wait()
                assert bytes(rbuf.buf[:7]) == (b"marco %d" % n)[:7]
        nursery.cancel_scope.cancel()


async def test_reject_and_refuse_raise() -> None:
    async with trio.open_nursery() as nursery:
        addr = await nursery.start(serve, echo_handler, 0)
        with pytest.raises(ConnectionRejected) as info:
            async with open_connection("127.0.0.1", addr[1], private_data=b"go away"):
                pass
        assert info.value.private_data == b"rejected: go away"
        nursery.cancel_scope.cancel()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ConnectionRejected) as info:
        async with open_connection("127.0.0.1", port):
            pass
    assert info.value.errno == errno.ECONNREFUSED


async def test_handler_that_does_not_answer_rejects() -> None:
    async def silent(request: Any) -> None:
        return

    async with trio.open_nursery() as nursery:
        addr = await nursery.start(serve, silent, 0)
        with pytest.raises(ConnectionRejected):
            async with open_connection("127.0.0.1", addr[1]):
                pass
        nursery.cancel_scope.cancel()


async def test_connections_share_a_pd() -> None:
    """With ``pd=``, every connection's QP lives on it: one region serves them all."""
    rw = Access.LOCAL_WRITE | Access.REMOTE_WRITE
    async with open_device_for("127.0.0.1") as ctx:
        assert ctx.device.name == "siw_lo"
        pd = ctx.alloc_pd()
        board = pd.reg_mr(bytearray(64), rw, iova=0)  # registered before any connection
        accepted: list[Any] = []

        async def handler(request: ConnectionRequest) -> None:
            accepted.append(request.pd)
            conn = await request.accept()
            await conn.wait_disconnected()

        async with trio.open_nursery() as nursery:
            addr = await nursery.start(partial(serve, handler, 0, host="127.0.0.1", pd=pd))
            for n in range(2):
                async with open_connection("127.0.0.1", addr[1], pd=pd) as conn:
                    assert conn.pd is pd and conn.context is ctx
                    src = pd.reg_mr(b"conn %d" % n, Access(0))
                    conn.qp.post_send(
                        SendWR(1, WROpcode.RDMA_WRITE, [src.sge()], SIG, 8 * n, board.rkey)
                    )
                    with trio.fail_after(10):
                        (wc,) = await conn.send_cq.poll_wait()
                    assert wc.status == WCStatus.SUCCESS
                # Closing a connection destroys its QP and CQ but leaves the shared PD.
                with pytest.raises(OSError):
                    conn.qp.post_recv(RecvWR(1, [board.sge()]))
                with pytest.raises(OSError):
                    conn.send_cq.req_notify()
                pd.reg_mr(bytearray(8)).close()
            nursery.cancel_scope.cancel()
        assert accepted == [pd, pd]
        assert bytes(board.buf[:14]) == b"conn 0\0\0conn 1"


async def test_open_device_for_an_address_that_is_not_local() -> None:
    with pytest.raises(OSError) as info:
        async with open_device_for("192.0.2.77"):
            pass
    assert info.value.errno == errno.EADDRNOTAVAIL


def closed_port() -> int:
    """A port nobody listens on (bound once, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_cm_error_the_handler_makes_itself_comes_out_of_serve() -> None:
    """Only the handler's own ``accept`` failing is serve's to take; a CMError the
    handler runs into elsewhere (a connection of its own) is the handler's error
    (before, every CMError was logged at INFO and dropped)."""

    async def forwarder(request: ConnectionRequest) -> None:
        await request.accept()
        async with open_connection("127.0.0.1", closed_port()):
            pass

    with trio.fail_after(10), pytest.raises(BaseExceptionGroup) as info:
        async with trio.open_nursery() as nursery:
            addr = await nursery.start(serve, forwarder, 0)
            async with open_connection("127.0.0.1", addr[1]) as conn:
                await conn.wait_disconnected()
            await trio.sleep_forever()
    assert info.group_contains(ConnectionRejected, depth=None)


async def test_a_peer_gone_before_accept_is_logged_and_serve_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A hand-made initiator sends its MPA Request and resets the connection while the
    handler holds the request; the handler's accept fails with a CMError, which serve
    logs at INFO, and the next connection is served."""
    reset, accepting = trio.Event(), trio.Event()
    handlers: list[str] = []

    async def patient(request: ConnectionRequest) -> None:
        if request.private_data == b"gone":
            await reset.wait()
            await trio.sleep(0.1)  # the reset has arrived
            handlers.append("late accept")
            accepting.set()
        await request.accept()
        handlers.append("accepted")

    caplog.set_level("INFO", logger="rdmashim.cm")
    async with trio.open_nursery() as nursery:
        addr = await nursery.start(serve, patient, 0)
        with trio.fail_after(10):
            sock = trio.socket.socket()
            await sock.connect(("127.0.0.1", addr[1]))
            await sock.send(
                mpa.encode_start_frame(mpa.StartFrame(reply=False, private_data=b"gone"))
            )
            await trio.sleep(0.1)  # the listener has read the request
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()  # a reset
            reset.set()
            await accepting.wait()
            async with open_connection("127.0.0.1", addr[1]):
                pass
        nursery.cancel_scope.cancel()
    assert handlers == ["late accept", "accepted"]
    assert any("not set up" in r.getMessage() for r in caplog.records), caplog.text


async def _setup_failure(host: str, port: int, **kwargs: Any) -> CMError:
    with trio.fail_after(10), pytest.raises(CMError) as info:
        async with open_connection(host, port, **kwargs):
            pytest.fail("connected")
    return info.value


async def test_setup_errors_say_where_and_what_happened() -> None:
    """Each failure names the host and port and what happened, once (before: ``[Errno
    111] REJECTED on <CMId ROUTE_RESOLVED ...> (status -111): [Errno 111] Error
    connecting to ...``, the errno twice and the id's state at the time of printing)."""
    port = closed_port()
    refused = await _setup_failure("127.0.0.1", port)
    assert str(refused) == f"connect to 127.0.0.1:{port} refused: nothing listening"
    assert isinstance(refused, ConnectionRejected) and refused.errno == errno.ECONNREFUSED

    unknown = await _setup_failure("no-such-host.invalid", 7471)
    assert str(unknown).startswith("cannot resolve host 'no-such-host.invalid': ")
    assert "Errno" not in str(unknown) and unknown.errno == errno.EADDRNOTAVAIL

    async def refuse(request: ConnectionRequest) -> None:
        await request.reject(b"full, try later" if request.private_data else b"")

    async with trio.open_nursery() as nursery:
        addr = await nursery.start(serve, refuse, 0)
        said = await _setup_failure("127.0.0.1", addr[1], private_data=b"please")
        silent = await _setup_failure("localhost", addr[1])
        nursery.cancel_scope.cancel()
    assert str(said) == (
        f"connect to 127.0.0.1:{addr[1]} rejected by the peer, which said b'full, try later'"
    )
    assert str(silent) == f"connect to localhost:{addr[1]} rejected by the peer (no private data)"


async def test_setup_timeouts_say_what_was_not_answered() -> None:
    """A listener whose accept queue is full drops the SYN (UNREACHABLE once
    ``connect_timeout`` passes); a TCP listener that never answers the MPA Request
    (CONNECT_ERROR once the engine's ``mpa_reply_timeout`` passes)."""
    with socket.socket() as full:
        full.bind(("127.0.0.1", 0))
        full.listen(0)
        port = full.getsockname()[1]
        waiting = [socket.socket() for _ in range(3)]
        for sock in waiting:
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                sock.connect(("127.0.0.1", port))
        await trio.sleep(0.1)
        unanswered = await _setup_failure("127.0.0.1", port, connect_timeout=0.5)
        for sock in waiting:
            sock.close()
    assert isinstance(unanswered, ConnectionUnreachable)
    assert str(unanswered) == f"connect to 127.0.0.1:{port} timed out: no answer from the peer"

    def impatient(conn: Connection) -> None:
        conn.id.mpa_reply_timeout = 0.5  # type: ignore[attr-defined]  # the engine's

    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen()
        port = mute.getsockname()[1]
        silent = await _setup_failure("127.0.0.1", port, prepare=impatient)
    assert str(silent) == f"connect to 127.0.0.1:{port} failed: no MPA Reply within 0.5 s"
    assert silent.errno == errno.ETIMEDOUT


async def test_a_failed_resolution_event_reads_plainly() -> None:
    """The low-level event names its kind, errno and reason once, no id state."""
    async with EventChannel() as channel:
        cm_id = channel.create_id()
        cm_id.resolve_addr(None, ("no-such-host.invalid", 1))
        with trio.fail_after(10):
            event = await channel.get_event()
        event.ack()
    assert str(event).startswith("ADDR_ERROR (EADDRNOTAVAIL): ")
    assert "Errno" not in str(event) and "CMId" not in str(event)
