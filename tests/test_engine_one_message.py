"""The one-message paths of the built-in engine: ``post_send`` of one inline Send
when nothing is queued frames it and writes it at once (``QP._send_now``), and
``post_recv`` of one request queues it without the list's general checks.

Checked: the FPDU it makes is byte for byte the one the queued path makes (plain,
with SE, with Invalidate's field, CRC on and off); over real loopback TCP to a peer
that does not read, Sends posted while the socket is full are queued behind the
partly written one and reach the peer whole and in order, their signaled
completions in order; a small Send without INLINE is copied when posted and takes
the same path (one past :data:`COPY_SEND_MAX` does not; one from a region of another
PD fails as the general path says); requests the path does not take (FENCE, raw
bytes, two SGEs) still go the general way; one receive posted alone meets the same
refusals as in a list (queue full, too many SGEs, an SRQ) and is flushed in ERR.
An RDMA Write at the head of a post (RDS's RDMA by cookie: a Write and its Send) is
framed and written at once with the Sends after it: byte for byte what the queued
path sends; one it cannot frame so is left to that path; posted while the socket is
full, Writes and Sends wait behind the partly written one and arrive whole and in
order. With the compiled and the Python kernels.
"""

from __future__ import annotations

import errno
import socket
from typing import Any

import pytest
import trio
from test_engine_sansio import Host

from rdmashim import (
    SGE,
    Access,
    QPCap,
    QPState,
    RecvWR,
    SendBatch,
    SendFlags,
    SendWR,
    VerbsError,
    WCOpcode,
    WCStatus,
    WROpcode,
)
from rdmashim.verbs.softiwarp.connection import connect_qp, read_request
from rdmashim.verbs.softiwarp.ddp import UNTAGGED_HDR_LEN
from rdmashim.verbs.softiwarp.engine import WRITE_NOW_MAX, EngineState, RecvJob, SendJob, SendRun
from rdmashim.verbs.softiwarp.kernels import PyKernels
from rdmashim.verbs.softiwarp.mpa import encode_start_frame
from rdmashim.verbs.softiwarp.negotiation import MpaOptions, answer_request
from rdmashim.verbs.softiwarp.provider import COPY_SEND_MAX, _SendTemplate

from pairs import make_pair

pytestmark = pytest.mark.usefixtures("engine_kernels")  # compiled and Python kernels

INLINE = SendFlags.INLINE
SIG = SendFlags.SIGNALED
BOUND = 10.0
"""Seconds any wait here may take (they take milliseconds)."""


@pytest.mark.parametrize("crc", [True, False])
@pytest.mark.parametrize(
    ("flags", "inv", "size"),
    [(0, 0, 8), (int(SendFlags.SOLICITED), 0, 1), (0, 0x1234, 0), (0, 7, 63)],
)
def test_frame_send_matches_the_queued_path(crc: bool, flags: int, inv: int, size: int) -> None:
    payload = bytes(range(size))
    queued, now = Host(crc).engine, Host(crc).engine
    opcode = WROpcode.SEND_WITH_INV if inv else WROpcode.SEND
    for k in range(3):  # the MSN advances the same way on both
        queued.post_send(SendJob(k, opcode, flags, (), payload, size, 0, 0, inv))
        want = b"".join(bytes(c) for c in queued.produce())
        queued.sent(len(want))
        assert now.tx_idle
        got = bytes(now.frame_send(payload, SendRun.ctrl(flags, bool(inv)), inv))
        now.took_send(k, flags, payload, len(got), True)
        assert got == want
    assert now.bytes_sent == queued.bytes_sent


@pytest.mark.parametrize("inline", [True, False])
def test_a_plain_send_leaves_the_invalidate_stag_field_zero(inline: bool) -> None:
    """RFC 5040 reserves the field in a Send without Invalidate: an invalidate_rkey set
    on the request does not reach the wire (it did, found by the native engine's
    differential test)."""
    host = Host(True)
    src = host.region(b"payload")
    sges = (SGE(src.addr, 7, src.stag),)
    job = SendJob(1, WROpcode.SEND, 0, sges, b"payload" if inline else None, 7, 0, 0, 0x1234)
    host.engine.post_send(job)
    wire = b"".join(bytes(c) for c in host.engine.produce())
    assert wire[3] & 0x0F == 3 and wire[4:8] == bytes(4), wire[:20].hex()


@pytest.mark.parametrize("crc", [True, False])
@pytest.mark.parametrize("size", [0, 5, 4096, 65536])
def test_frame_write_matches_the_queued_path(crc: bool, size: int) -> None:
    """An RDMA Write framed at once, and a run of Sends after it, are byte for byte
    what the queued path sends, and complete as it does."""
    queued, now = Host(crc), Host(crc)
    data = bytes(i % 251 for i in range(size))
    for host in (queued, now):
        src = host.region(data or b"\0")
        job = SendJob(
            7, WROpcode.RDMA_WRITE, int(SIG), (SGE(src.addr, size, src.stag),), None, size,
            0x1000, 0x55,
        )  # fmt: skip
        run = SendRun()
        run.add(8, SendRun.ctrl(0, False), 0, b"after", 0)
        if host is queued:
            host.engine.post_send(job)
            host.engine.post_send(run)
            want = b"".join(bytes(c) for c in host.engine.produce())
            host.engine.sent(len(want))
        else:
            assert host.engine.tx_idle
            framed = host.engine.frame_write(job)
            assert framed is not None
            fpdus, nbytes = framed
            wrote = b"".join(bytes(c) for c in fpdus)
            assert nbytes == len(wrote)
            got = wrote + bytes(host.engine.frame_run(run))
            host.engine.took_write(job, len(got), True)
            host.engine.took_run(run, 0, True)
    assert got == want
    assert now.engine.bytes_sent == queued.engine.bytes_sent
    assert (
        [(w.wr_id, w.opcode) for w in now.send_wcs]
        == [(w.wr_id, w.opcode) for w in queued.send_wcs]
        == [(7, WCOpcode.RDMA_WRITE)]
    )


def test_frame_write_leaves_what_the_general_path_reports() -> None:
    """A Write whose local memory does not resolve, or whose fields do not fit the
    wire, is left to the queued path (which reports it); so is one past WRITE_NOW_MAX."""
    host = Host(True)
    src = host.region(64)
    bad_key = SendJob(1, WROpcode.RDMA_WRITE, 0, (SGE(src.addr, 8, src.stag + 1),), None, 8, 0, 5)
    too_far = SendJob(
        2, WROpcode.RDMA_WRITE, 0, (SGE(src.addr, 8, src.stag),), None, 8, 2**64 - 4, 5
    )
    big = host.region(WRITE_NOW_MAX + 1)
    too_big = SendJob(
        3, WROpcode.RDMA_WRITE, 0, (SGE(big.addr, WRITE_NOW_MAX + 1, big.stag),), None,
        WRITE_NOW_MAX + 1, 0, 5,
    )  # fmt: skip
    for job in (bad_key, too_far, too_big):
        assert host.engine.frame_write(job) is None
    assert host.engine.tx_idle and host.engine.bytes_sent == 0


async def _qp_to_mute_peer(ctx: Any, sq_depth: int) -> tuple[Any, Any, Any, trio.SocketStream]:
    """A QP connected (MPA, CRC on) to a plain socket this test reads when it wants."""
    pd = ctx.alloc_pd()
    cq = ctx.create_cq(4096)
    cap = QPCap(max_send_wr=sq_depth, max_inline_data=64, max_send_sge=2)
    qp = pd.create_qp(send_cq=cq, recv_cq=cq, cap=cap)
    (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listener.socket.getsockname()[1]
    peer: list[trio.SocketStream] = []

    async def serve() -> None:
        stream = await listener.accept()
        stream.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        req = await read_request(stream)
        reply, _ = answer_request(req.frame, MpaOptions(), b"")
        await stream.send_all(encode_start_frame(reply))
        peer.append(stream)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve)
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        stream.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        await connect_qp(qp, stream)
    await listener.aclose()
    return pd, cq, qp, peer[0]


async def test_sends_while_the_socket_is_full_stay_whole_and_in_order(ctx: Any) -> None:
    pd, cq, qp, peer = await _qp_to_mute_peer(ctx, 8192)
    mr = pd.reg_mr(bytearray(64), Access.LOCAL_WRITE)
    link = qp._link
    posted = 0
    partial_seen = False
    expected: list[bytes] = []
    # Post until the socket took part of a Send, then some more behind it.
    extra = 0
    while extra < 50:
        data = posted.to_bytes(4, "little") * 16
        mr.buf[:] = data
        flags = INLINE | SIG if posted % 3 == 0 else INLINE
        qp.post_send(SendWR(posted, WROpcode.SEND, [mr.sge(0, 64)], flags))
        expected.append(data)
        posted += 1
        if link._pending:
            partial_seen = True
        if partial_seen:
            extra += 1
        assert posted < 7000, "the socket never filled"
    assert partial_seen
    received = bytearray()
    want = posted * (UNTAGGED_HDR_LEN + 64 + 4)
    with trio.fail_after(BOUND):
        while len(received) < want:
            received += await peer.receive_some(65536)
    assert len(received) == want
    pos = 0
    kernels = PyKernels()
    stop, msgs = kernels.scan_sends(received, 0, len(received), 1, True)
    assert stop == len(received)
    assert len(msgs) // 3 == posted
    for k in range(posted):
        pos, length = msgs[3 * k], msgs[3 * k + 1]
        assert received[pos : pos + length] == expected[k]
    wr_ids = []
    with trio.fail_after(BOUND):
        while len(wr_ids) < (posted + 2) // 3:
            for wc in await cq.poll_wait(64):
                assert wc.status == WCStatus.SUCCESS
                wr_ids.append(wc.wr_id)
    assert wr_ids == list(range(0, posted, 3))
    qp.close()
    await peer.aclose()


async def test_writes_while_the_socket_is_full_stay_whole_and_in_order(ctx: Any) -> None:
    """RDMA Writes each posted with a Send after them go out at once while the socket
    takes them; posted while it is full, they wait behind the partly written one.
    A receiving engine (sans-IO, fed what the peer's socket got) finds every Write in
    place and every Send, in order, with no error; completions come in order."""
    pd, cq, qp, peer = await _qp_to_mute_peer(ctx, 8192)
    host = Host(True)
    size, most = 3000, 300
    sink = host.region(size * most)
    rbuf = host.region(64 * most)
    for k in range(most):
        host.rq.append(RecvJob(k, (SGE(rbuf.addr + 64 * k, 64, rbuf.stag),), 64))
    src = pd.reg_mr(bytearray(size * most), Access.LOCAL_WRITE)
    note = pd.reg_mr(bytearray(8 * most), Access.LOCAL_WRITE)
    took: list[int] = []
    engine = qp.engine
    real_took = engine.took_write
    engine.took_write = lambda job, n, whole: (took.append(job.wr_id), real_took(job, n, whole))  # type: ignore[method-assign]
    posted = extra = 0
    partial_seen = False
    while extra < 20:
        k = posted
        src.buf[size * k : size * (k + 1)] = bytes([k % 251]) * size
        note.buf[8 * k : 8 * k + 8] = k.to_bytes(8, "little")
        write = SendWR(
            1000 + k, WROpcode.RDMA_WRITE, [src.sge(size * k, size)],
            SIG if k % 3 == 0 else SendFlags(0), sink.addr + size * k, sink.stag,
        )  # fmt: skip
        send = SendWR(k, WROpcode.SEND, [note.sge(8 * k, 8)], INLINE | (SIG if k % 2 else 0))
        qp.post_send([write, send])
        posted += 1
        if qp._link._pending:
            partial_seen = True
        if partial_seen:
            extra += 1
        assert posted < most, "the socket never filled"
    assert partial_seen
    assert 1000 in took  # the first went out at once
    assert 1000 + posted - 1 not in took  # the last waited behind the partly written one
    with trio.fail_after(BOUND):
        while len(host.recv_wcs) < posted:
            host.engine.receive_data(await peer.receive_some(65536))
    assert host.engine.state is EngineState.RTS
    assert [(w.wr_id, w.status, w.byte_len) for w in host.recv_wcs] == [
        (k, WCStatus.SUCCESS, 8) for k in range(posted)
    ]
    for k in range(posted):
        assert bytes(rbuf.view[64 * k : 64 * k + 8]) == k.to_bytes(8, "little")
        assert bytes(sink.view[size * k : size * (k + 1)]) == bytes([k % 251]) * size
    signaled = [
        ((1000 + k,) if k % 3 == 0 else ()) + ((k,) if k % 2 else ()) for k in range(posted)
    ]
    want = [w for ids in signaled for w in ids]
    wcs: list[Any] = []
    with trio.fail_after(BOUND):
        while len(wcs) < len(want):
            wcs += await cq.poll_wait(64)
    assert [(w.wr_id, w.status) for w in wcs] == [(w, WCStatus.SUCCESS) for w in want]
    qp.close()
    await peer.aclose()


@pytest.mark.parametrize(
    ("parts", "flags"),
    [
        ([b"raw bytes"], INLINE | SIG),
        ([(0, 0)], INLINE | SIG | SendFlags.FENCE),
        ([(0, 4), (4, 4)], INLINE | SIG),
        ([(0, 4), (4, 4)], SIG),
    ],
    ids=["bytes", "fence", "two-sges", "two-sges-not-inline"],
)
async def test_other_sends_take_the_general_path(
    ctx: Any, parts: list[Any], flags: SendFlags
) -> None:
    client, server = await make_pair(ctx)
    src = client.reg(b"abcdefgh")
    dst = server.reg(64)
    sges = [p if isinstance(p, bytes) else src.sge(*p) for p in parts]
    wr = SendWR(5, WROpcode.SEND, sges, flags)
    server.qp.post_recv(RecvWR(9, [dst.sge(0, 64)]))
    assert not client.qp._send_now(wr)
    client.qp.post_send(wr)
    with trio.fail_after(BOUND):
        (wc,) = await server.recv_cq.poll_wait(1)
        (swc,) = await client.send_cq.poll_wait(1)
    assert wc.status == swc.status == WCStatus.SUCCESS
    want = b"raw bytes" if isinstance(parts[0], bytes) else b"abcdefgh"[: wc.byte_len]
    assert bytes(dst.buf[: wc.byte_len]) == want
    assert swc.wr_id == 5


@pytest.mark.parametrize("size", [8, COPY_SEND_MAX])
async def test_a_small_send_without_inline_is_copied_and_written_at_once(
    ctx: Any, size: int
) -> None:
    client, server = await make_pair(ctx)
    data = bytes(i % 251 for i in range(size))
    src = client.reg(data)
    dst = server.reg(size)
    server.qp.post_recv(RecvWR(9, [dst.sge(0, size)]))
    assert client.qp._send_now(SendWR(5, WROpcode.SEND, [src.sge(0, size)], SIG))
    src.buf[:] = bytes(size)  # the copy was taken when posted
    with trio.fail_after(BOUND):
        (wc,) = await server.recv_cq.poll_wait(1)
        (swc,) = await client.send_cq.poll_wait(1)
    assert wc.status == swc.status == WCStatus.SUCCESS and swc.wr_id == 5
    assert bytes(dst.buf) == data


@pytest.mark.parametrize("as_list", [False, True], ids=["request", "list-of-one"])
async def test_one_send_in_a_list_takes_the_latency_path(
    ctx: Any, as_list: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A list holding one Send is framed by ``frame_send`` and written at once, as the
    request alone is (the general path would queue a job and frame it in ``produce``)."""
    client, server = await make_pair(ctx)
    src = client.reg(b"one of a list")
    dst = server.reg(64)
    engine = client.qp.engine
    framed: list[int] = []
    original = engine.frame_send

    def frame_send(payload: bytes, *args: Any) -> Any:
        framed.append(len(payload))
        return original(payload, *args)

    monkeypatch.setattr(engine, "frame_send", frame_send)
    server.qp.post_recv(RecvWR(9, [dst.sge(0, 64)]))
    wr = SendWR(5, WROpcode.SEND, [src.sge()], SIG)
    client.qp.post_send([wr] if as_list else wr)
    assert framed == [13] and engine.tx_idle
    with trio.fail_after(BOUND):
        (wc,) = await server.recv_cq.poll_wait(1)
        (swc,) = await client.send_cq.poll_wait(1)
    assert wc.status == swc.status == WCStatus.SUCCESS and swc.wr_id == 5
    assert bytes(dst.buf[: wc.byte_len]) == b"one of a list"


async def test_a_batch_of_small_sends_without_inline_goes_as_one_run(ctx: Any) -> None:
    client, server = await make_pair(ctx)
    src = client.reg(bytes(range(64)))
    dst = server.reg(64 * 8)
    server.qp.post_recv([RecvWR(i, [dst.sge(64 * i, 64)]) for i in range(8)])
    batch = SendBatch([SendWR(i, WROpcode.SEND, [src.sge(i, 64 - i)], SIG) for i in range(8)])
    posted: list[Any] = []
    engine = client.qp.engine
    real_post, real_took = engine.post_send, engine.took_run
    engine.post_send = lambda job: (posted.append(job), real_post(job))  # type: ignore[method-assign]
    engine.took_run = lambda run, n, whole: (posted.append(run), real_took(run, n, whole))  # type: ignore[method-assign]
    client.qp.post_send_batch(batch)
    assert [type(job) for job in posted] == [SendRun]  # queued, or written at once
    got: list[Any] = []
    with trio.fail_after(BOUND):
        while len(got) < 8:
            got += await server.recv_cq.poll_wait(8)
    for wc in got:
        i = wc.wr_id
        assert wc.status == WCStatus.SUCCESS and wc.byte_len == 64 - i
        assert bytes(dst.buf[64 * i : 64 * i + 64 - i]) == bytes(range(i, 64))


async def test_a_send_without_inline_past_the_copy_limit_is_not_copied(ctx: Any) -> None:
    client, server = await make_pair(ctx)
    size = COPY_SEND_MAX + 4
    src, dst = client.reg(size), server.reg(size)
    server.qp.post_recv(RecvWR(9, [dst.sge(0, size)]))
    wr = SendWR(5, WROpcode.SEND, [src.sge(0, size)], SIG)
    assert not client.qp._send_now(wr)
    assert not _SendTemplate(wr).copied
    server.qp.post_recv(RecvWR(10, [dst.sge(0, size)]))
    client.qp.post_send([wr, wr])
    got: list[Any] = []
    with trio.fail_after(BOUND):
        while len(got) < 2:
            got += await server.recv_cq.poll_wait(2)
    assert [(wc.status, wc.byte_len) for wc in got] == [(WCStatus.SUCCESS, size)] * 2


@pytest.mark.parametrize("post", ["one", "list", "batch"])
async def test_a_copied_send_from_another_pd_fails_as_the_general_path_says(
    ctx: Any, post: str
) -> None:
    client, server = await make_pair(ctx)
    other = ctx.alloc_pd().reg_mr(bytearray(b"abcdefgh"), Access.LOCAL_WRITE)
    dst = server.reg(64)
    server.qp.post_recv(RecvWR(9, [dst.sge(0, 64)]))
    wr = SendWR(5, WROpcode.SEND, [other.sge(0, 8)], SIG)
    assert not client.qp._send_now(wr)
    if post == "batch":  # the batch's plan sees the PD differ and leaves it to the general path
        client.qp.post_send_batch(SendBatch([wr, wr]))
    else:
        client.qp.post_send([wr, wr] if post == "list" else wr)
    with trio.fail_after(BOUND):
        swc = (await client.send_cq.poll_wait(1))[0]
    assert swc.wr_id == 5 and swc.status == WCStatus.LOC_PROT_ERR


async def test_one_receive_meets_the_refusals_of_a_list(ctx: Any) -> None:
    _, server = await make_pair(ctx, cap=QPCap(max_recv_wr=2, max_recv_sge=1))
    buf = server.reg(64)
    server.qp.post_recv(RecvWR(1, [buf.sge(0, 32)]))
    with pytest.raises(VerbsError) as info:
        server.qp.post_recv(RecvWR(2, [buf.sge(0, 16), buf.sge(16, 16)]))
    assert info.value.errno == errno.EINVAL and info.value.bad_wr == 0
    server.qp.post_recv(RecvWR(3, [buf.sge(32, 32)]))
    with pytest.raises(VerbsError) as info:
        server.qp.post_recv(RecvWR(4, [buf.sge(0, 32)]))
    assert info.value.errno == errno.ENOMEM and "receive queue full (2)" in str(info.value)
    server.qp.modify(qp_state=QPState.ERR)
    server.qp.post_recv(RecvWR(5, [buf.sge(0, 32)]))  # in ERR: flushed at once
    with trio.fail_after(BOUND):
        wcs: list = []
        while len(wcs) < 3:
            wcs += await server.recv_cq.poll_wait(8)
    assert sorted((w.wr_id, w.status) for w in wcs) == [
        (1, WCStatus.WR_FLUSH_ERR), (3, WCStatus.WR_FLUSH_ERR), (5, WCStatus.WR_FLUSH_ERR),
    ]  # fmt: skip
    _, srq_server = await make_pair(ctx, srq=True)
    with pytest.raises(VerbsError) as info:
        srq_server.qp.post_recv(RecvWR(6, [buf.sge(0, 32)]))
    assert info.value.errno == errno.EINVAL
