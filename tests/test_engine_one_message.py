"""The one transmit path of the Python engine: whatever is posted (one Send, a list
of one, a list, a batch, an RDMA Write with its Send), the bytes on the wire are
exactly those ``Engine.produce()`` returned, and the Sends leave inside
``post_send`` (the driver writes at once what the engine framed).

Also checked: over real loopback TCP to a peer that does not read, Sends and
Writes posted while the socket is full wait behind the partly written one and
reach the peer whole and in order, their signaled completions in order; a small
Send without INLINE is copied when posted (one past :data:`COPY_SEND_MAX` is not;
one from a region of another PD fails with LOC_PROT_ERR); other Sends (FENCE, raw
bytes, two SGEs) arrive too; one receive posted alone meets the same refusals as in
a list (queue full, too many SGEs, an SRQ) and is flushed in ERR. With the compiled
and the Python kernels.
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
    WCStatus,
    WROpcode,
)
from rdmashim.providers.softiwarp.connection import connect_qp, read_request
from rdmashim.providers.softiwarp.ddp import UNTAGGED_HDR_LEN
from rdmashim.providers.softiwarp.jobs import EngineState, RecvJob, SendJob, SendRun
from rdmashim.providers.softiwarp.kernels import PyKernels
from rdmashim.providers.softiwarp.mpa import encode_start_frame
from rdmashim.providers.softiwarp.negotiation import MpaOptions, answer_request
from rdmashim.providers.softiwarp.posting import COPY_SEND_MAX, SendTemplate

from pairs import make_pair

pytestmark = pytest.mark.usefixtures("engine_kernels")  # compiled and Python kernels

INLINE = SendFlags.INLINE
SIG = SendFlags.SIGNALED
BOUND = 10.0
"""Seconds any wait here may take (they take milliseconds)."""


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
    """RDMA Writes each posted with a Send after them go out from ``post_send`` while
    the socket takes them; posted while it is full, they wait behind the partly
    written one.
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
    client.qp.post_send(SendWR(5, WROpcode.SEND, [src.sge(0, size)], SIG))
    src.buf[:] = bytes(size)  # the copy was taken when posted
    with trio.fail_after(BOUND):
        (wc,) = await server.recv_cq.poll_wait(1)
        (swc,) = await client.send_cq.poll_wait(1)
    assert wc.status == swc.status == WCStatus.SUCCESS and swc.wr_id == 5
    assert bytes(dst.buf) == data


async def test_a_batch_of_small_sends_without_inline_goes_as_one_run(ctx: Any) -> None:
    client, server = await make_pair(ctx)
    src = client.reg(bytes(range(64)))
    dst = server.reg(64 * 8)
    server.qp.post_recv([RecvWR(i, [dst.sge(64 * i, 64)]) for i in range(8)])
    batch = SendBatch([SendWR(i, WROpcode.SEND, [src.sge(i, 64 - i)], SIG) for i in range(8)])
    posted: list[Any] = []
    engine = client.qp.engine
    real_post = engine.post_send
    engine.post_send = lambda job: (posted.append(job), real_post(job))  # type: ignore[method-assign]
    client.qp.post_send_batch(batch)
    assert [type(job) for job in posted] == [SendRun]
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
    assert not SendTemplate(wr).copied
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


@pytest.mark.parametrize("post", ["one", "list-of-one", "list", "batch", "write-and-send"])
async def test_every_byte_on_the_wire_comes_from_produce(
    ctx: Any, post: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No route around the engine: what the peer's socket receives is byte for byte
    what ``produce()`` returned, and it was produced inside ``post_send``."""
    pd, _, qp, peer = await _qp_to_mute_peer(ctx, 64)
    engine = qp.engine
    produced = bytearray()
    real_produce = engine.produce

    def produce(*args: Any) -> Any:
        out = real_produce(*args)
        produced.extend(b"".join(bytes(c) for c in out))
        return out

    monkeypatch.setattr(engine, "produce", produce)
    src = pd.reg_mr(bytearray(b"0123456789abcdef" * 4), Access.LOCAL_WRITE)
    send = SendWR(1, WROpcode.SEND, [src.sge(0, 16)], INLINE | SIG)
    copied = SendWR(2, WROpcode.SEND, [src.sge(16, 16)], SIG)
    write = SendWR(3, WROpcode.RDMA_WRITE, [src.sge(0, 64)], SIG, 0x1000, 0x55)
    if post == "one":
        qp.post_send(send)
    elif post == "list-of-one":
        qp.post_send([send])
    elif post == "list":
        qp.post_send([send, copied, send])
    elif post == "batch":
        qp.post_send_batch(SendBatch([send, copied]))
    else:
        qp.post_send([write, send])
    assert produced and not qp._link._pending  # framed by the engine, written in the call
    received = bytearray()
    with trio.fail_after(BOUND):
        while len(received) < len(produced):
            received += await peer.receive_some(65536)
    assert received == produced
    qp.close()
    await peer.aclose()
