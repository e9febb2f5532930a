"""Engine pairs over real loopback TCP: every operation, sizes across FPDU and TCP boundaries."""

from __future__ import annotations

import array
import mmap
import os

import pytest
import trio

from rdmashim import (
    Access,
    QPCap,
    RecvWR,
    SendFlags,
    SendWR,
    WCFlags,
    WCOpcode,
    WCStatus,
    WROpcode,
)
from rdmashim.providers.softiwarp.connection import MpaOptions
from rdmashim.providers.softiwarp.ddp import MAX_FPDU

from pairs import Side, make_pair, settle

pytestmark = pytest.mark.usefixtures("engine_kernels")  # compiled and Python kernels

SIG = SendFlags.SIGNALED
# Payload bytes per full FPDU for tagged (Write/Read Response) and untagged (Send) segments.
TAGGED_CHUNK = MAX_FPDU - 16 - 4
UNTAGGED_CHUNK = MAX_FPDU - 20 - 4
SIZES = [
    0, 1, 3, 4, 5, 1460, 4096,
    UNTAGGED_CHUNK - 1, UNTAGGED_CHUNK, UNTAGGED_CHUNK + 1,
    TAGGED_CHUNK - 1, TAGGED_CHUNK, TAGGED_CHUNK + 1,
    2 * TAGGED_CHUNK + 7, 1 << 20, (1 << 20) + 3,
]  # fmt: skip


def pattern(n: int, seed: int = 0) -> bytes:
    return (bytes((i * 31 + seed) & 0xFF for i in range(256)) * (n // 256 + 1))[:n]


async def one(cq) -> object:
    with trio.fail_after(30):
        return (await cq.poll_wait(1))[0]


@pytest.mark.parametrize("size", SIZES)
async def test_send_sizes(pair: tuple[Side, Side], size: int) -> None:
    client, server = pair
    data = pattern(size, 1)
    rbuf = server.reg(size + 16)
    server.qp.post_recv(RecvWR(5, [rbuf.sge()]))
    sbuf = client.reg(data)
    client.qp.post_send(SendWR(6, WROpcode.SEND, [sbuf.sge()] if size else [], SIG))
    wc = await one(server.recv_cq)
    assert (wc.wr_id, wc.status, wc.opcode, wc.byte_len) == (
        5,
        WCStatus.SUCCESS,
        WCOpcode.RECV,
        size,
    )
    assert wc.qp_num == server.qp.qp_num
    assert bytes(rbuf.buf[:size]) == data
    wc = await one(client.send_cq)
    assert (wc.wr_id, wc.status, wc.opcode) == (6, WCStatus.SUCCESS, WCOpcode.SEND)


@pytest.mark.parametrize("size", SIZES)
async def test_write_and_read_sizes(pair: tuple[Side, Side], size: int) -> None:
    client, server = pair
    data = pattern(size, 2)
    src = client.reg(data or 1)
    dst = server.reg(size + 8)
    sge = [src.sge(0, size)]
    client.qp.post_send(SendWR(1, WROpcode.RDMA_WRITE, sge, SIG, dst.addr + 4, dst.rkey))
    wc = await one(client.send_cq)
    assert (wc.status, wc.opcode) == (WCStatus.SUCCESS, WCOpcode.RDMA_WRITE)
    back = client.reg(size + 1)
    client.qp.post_send(
        SendWR(2, WROpcode.RDMA_READ, [back.sge(0, size)], SIG, dst.addr + 4, dst.rkey)
    )
    wc = await one(client.send_cq)
    assert (wc.status, wc.opcode, wc.byte_len) == (WCStatus.SUCCESS, WCOpcode.RDMA_READ, size)
    assert bytes(dst.buf[4 : 4 + size]) == data
    assert bytes(dst.buf[:4]) == bytes(4) and bytes(dst.buf[4 + size :]) == bytes(4)
    assert bytes(back.buf[:size]) == data


@pytest.mark.slow
async def test_16mib_write_read_send(pair: tuple[Side, Side]) -> None:
    client, server = pair
    size = 16 << 20
    data = os.urandom(size)
    src = client.reg(data)
    dst = server.reg(size)
    client.qp.post_send(SendWR(1, WROpcode.RDMA_WRITE, [src.sge()], SIG, dst.addr, dst.rkey))
    assert (await one(client.send_cq)).status == WCStatus.SUCCESS
    back = server.reg(size)
    server.qp.post_send(SendWR(2, WROpcode.RDMA_READ, [back.sge()], SIG, src.addr, src.rkey))
    assert (await one(server.send_cq)).status == WCStatus.SUCCESS
    rbuf = server.reg(size)
    server.qp.post_recv(RecvWR(3, [rbuf.sge()]))
    client.qp.post_send(SendWR(4, WROpcode.SEND, [src.sge()], SIG))
    assert (await one(server.recv_cq)).byte_len == size
    assert bytes(dst.buf) == bytes(back.buf) == bytes(rbuf.buf) == data


async def test_multi_sge_send_scatters(pair: tuple[Side, Side]) -> None:
    client, server = pair
    parts = [pattern(n, n) for n in (1, 1000, 70000, 3, 4096, 65520)]
    mrs = [client.reg(p) for p in parts]
    total = b"".join(parts)
    # Receive into six SGEs of other sizes, out of one region with gaps between them.
    rmr = server.reg(len(total) + 600)
    cuts = [7, 50000, 90000, 100000, 120000, len(total)]
    sges, start = [], 0
    for i, end in enumerate(cuts):
        sges.append(rmr.sge(start + 100 * i, end - start))
        start = end
    server.qp.post_recv(RecvWR(9, sges))
    client.qp.post_send(SendWR(1, WROpcode.SEND, [m.sge() for m in mrs], SIG))
    wc = await one(server.recv_cq)
    assert wc.byte_len == len(total)
    got = b"".join(bytes(rmr.buf[s.addr - rmr.addr : s.addr - rmr.addr + s.length]) for s in sges)
    assert got == total
    assert (await one(client.send_cq)).status == WCStatus.SUCCESS


async def test_multi_sge_write(pair: tuple[Side, Side]) -> None:
    client, server = pair
    parts = [pattern(n, n) for n in (5, 65536, 131071)]
    mrs = [client.reg(p) for p in parts]
    dst = server.reg(sum(map(len, parts)))
    client.qp.post_send(
        SendWR(1, WROpcode.RDMA_WRITE, [m.sge() for m in mrs], SIG, dst.addr, dst.rkey)
    )
    assert (await one(client.send_cq)).status == WCStatus.SUCCESS
    await settle(client, dst)
    assert bytes(dst.buf) == b"".join(parts)


async def test_reads_beyond_ord_wait_their_turn(ctx) -> None:
    opts = MpaOptions(ird=2, ord=2)
    client, server = await make_pair(ctx, client_options=opts, server_options=opts)
    assert client.qp.query().max_rd_atomic == 2
    src = server.reg(pattern(40000, 3))
    sinks = [client.reg(40000) for _ in range(12)]
    client.qp.post_send(
        [
            SendWR(i, WROpcode.RDMA_READ, [m.sge()], SIG, src.addr, src.rkey)
            for i, m in enumerate(sinks)
        ]
    )
    wcs = []
    while len(wcs) < 12:
        wcs += await client.send_cq.poll_wait()
    assert [w.wr_id for w in wcs] == list(range(12))
    assert all(w.status == WCStatus.SUCCESS for w in wcs)
    assert all(bytes(m.buf) == bytes(src.buf) for m in sinks)


async def test_completions_in_post_order_across_read(pair: tuple[Side, Side]) -> None:
    client, server = pair
    big = server.reg(pattern(4 << 20))
    sink = client.reg(4 << 20)
    small = client.reg(b"x" * 10)
    dst = server.reg(10)
    client.qp.post_send(
        [
            SendWR(1, WROpcode.RDMA_READ, [sink.sge()], SIG, big.addr, big.rkey),
            SendWR(2, WROpcode.RDMA_WRITE, [small.sge()], SIG, dst.addr, dst.rkey),
            SendWR(3, WROpcode.RDMA_WRITE, [small.sge()], SIG, dst.addr, dst.rkey),
        ]
    )
    ids = []
    while len(ids) < 3:
        ids += [w.wr_id for w in await client.send_cq.poll_wait()]
    assert ids == [1, 2, 3]


async def test_fence_waits_for_reads(pair: tuple[Side, Side]) -> None:
    client, server = pair
    src = server.reg(pattern(1 << 20, 4))
    sink = client.reg(1 << 20)
    dst = server.reg(1 << 20)
    client.qp.post_send(
        [
            SendWR(1, WROpcode.RDMA_READ, [sink.sge()], SIG, src.addr, src.rkey),
            # Fenced: writes back what the Read brought, only after the Read completed.
            SendWR(2, WROpcode.RDMA_WRITE, [sink.sge()], SIG | SendFlags.FENCE, dst.addr, dst.rkey),
        ]
    )
    wcs = [await one(client.send_cq), await one(client.send_cq)]
    assert [w.status for w in wcs] == [WCStatus.SUCCESS] * 2
    await settle(client, dst)
    assert bytes(dst.buf) == bytes(src.buf)


async def test_srq_feeds_receives(ctx) -> None:
    client, server = await make_pair(ctx, srq=True)
    srq = server.qp.srq
    bufs = [server.reg(64) for _ in range(4)]
    srq.post_recv([RecvWR(10 + i, [b.sge()]) for i, b in enumerate(bufs)])
    msgs = [client.reg(f"message {i}".encode()) for i in range(4)]
    client.qp.post_send([SendWR(i, WROpcode.SEND, [m.sge()], SIG) for i, m in enumerate(msgs)])
    wcs = []
    while len(wcs) < 4:
        wcs += await server.recv_cq.poll_wait()
    assert [w.wr_id for w in wcs] == [10, 11, 12, 13]
    assert [bytes(b.buf[: w.byte_len]) for b, w in zip(bufs, wcs, strict=True)] == [
        f"message {i}".encode() for i in range(4)
    ]
    with pytest.raises(OSError, match="SRQ"):
        server.qp.post_recv(RecvWR(1, [bufs[0].sge()]))


async def test_inline_send_copies_at_post(pair: tuple[Side, Side]) -> None:
    client, server = pair
    rbuf = server.reg(64)
    server.qp.post_recv(RecvWR(1, [rbuf.sge()]))
    src = client.reg(b"inline payload!!")
    client.qp.post_send(SendWR(2, WROpcode.SEND, [src.sge()], SIG | SendFlags.INLINE))
    src.buf[:6] = b"CHANGE"  # the engine already holds its own copy
    wc = await one(server.recv_cq)
    assert bytes(rbuf.buf[: wc.byte_len]) == b"inline payload!!"
    # Inline data may also be plain bytes, with no registered memory at all.
    server.qp.post_recv(RecvWR(3, [rbuf.sge()]))
    client.qp.post_send(SendWR(4, WROpcode.SEND, [b"raw ", b"bytes"], SIG | SendFlags.INLINE))
    wc = await one(server.recv_cq)
    assert bytes(rbuf.buf[: wc.byte_len]) == b"raw bytes"


async def test_inline_limit(pair: tuple[Side, Side]) -> None:
    client, _ = pair
    with pytest.raises(OSError, match="inline") as info:
        client.qp.post_send(SendWR(1, WROpcode.SEND, [b"x" * 65], SIG | SendFlags.INLINE))
    assert info.value.errno == 22


async def test_unsignaled_complete_silently(pair: tuple[Side, Side]) -> None:
    client, server = pair
    dst = server.reg(100)
    src = client.reg(b"a" * 100)
    wrs = [
        SendWR(i, WROpcode.RDMA_WRITE, [src.sge()], SendFlags.NONE, dst.addr, dst.rkey)
        for i in range(5)
    ]
    wrs.append(SendWR(99, WROpcode.RDMA_WRITE, [src.sge()], SIG, dst.addr, dst.rkey))
    client.qp.post_send(wrs)
    wc = await one(client.send_cq)
    assert wc.wr_id == 99
    await trio.sleep(0.05)
    assert client.send_cq.poll() == []


async def test_sq_sig_all(ctx) -> None:
    client, server = await make_pair(ctx, sq_sig_all=True)
    assert client.qp.query().sq_sig_all
    dst = server.reg(10)
    src = client.reg(b"0123456789")
    client.qp.post_send(
        SendWR(3, WROpcode.RDMA_WRITE, [src.sge()], SendFlags.NONE, dst.addr, dst.rkey)
    )
    assert (await one(client.send_cq)).wr_id == 3


async def test_solicited_event_and_send_with_invalidate(ctx) -> None:
    client2, server2 = await make_pair(ctx, channel=True)
    channel, cq = server2.channel, server2.recv_cq
    rbuf = server2.reg(64)
    server2.qp.post_recv([RecvWR(i, [rbuf.sge()]) for i in range(3)])
    victim = server2.reg(4096)
    msg = client2.reg(b"hi")
    cq.req_notify(solicited_only=True)
    client2.qp.post_send(SendWR(1, WROpcode.SEND, [msg.sge()], SIG))
    await one(client2.send_cq)
    await trio.sleep(0.05)
    assert len(cq) == 1  # completed, but no event: not solicited
    with trio.move_on_after(0.05):
        await channel.get_cq_event()
        pytest.fail("event for an unsolicited completion")
    client2.qp.post_send(SendWR(2, WROpcode.SEND, [msg.sge()], SIG | SendFlags.SOLICITED))
    with trio.fail_after(5):
        assert await channel.get_cq_event() is cq
    cq.ack_events(1)
    wcs = cq.poll()
    assert [w.solicited for w in wcs] == [False, True]
    client2.qp.post_send(
        SendWR(3, WROpcode.SEND_WITH_INV, [msg.sge()], SIG, invalidate_rkey=victim.rkey)
    )
    wc = await one(cq)
    assert wc.wc_flags & WCFlags.WITH_INV and wc.invalidated_rkey == victim.rkey


@pytest.mark.parametrize("crc", [True, False])
async def test_crc_negotiated_when_either_side_asks(ctx, crc: bool) -> None:
    client, server = await make_pair(
        ctx, client_options=MpaOptions(crc=crc), server_options=MpaOptions(crc=not crc)
    )
    assert client.qp.engine.config.crc and server.qp.engine.config.crc
    client, server = await make_pair(
        ctx, client_options=MpaOptions(crc=False), server_options=MpaOptions(crc=False)
    )
    assert not client.qp.engine.config.crc and not server.qp.engine.config.crc
    dst = server.reg(200000)
    src = client.reg(pattern(200000))
    client.qp.post_send(SendWR(1, WROpcode.RDMA_WRITE, [src.sge()], SIG, dst.addr, dst.rkey))
    await one(client.send_cq)
    await settle(client, dst)
    assert bytes(dst.buf) == bytes(src.buf)


@pytest.mark.parametrize(
    ("client_opts", "server_opts"),
    [
        (MpaOptions(revision=1), MpaOptions()),
        (MpaOptions(p2p=True), MpaOptions(p2p=True)),
        (
            MpaOptions(p2p=True, rtr=__import__("rdmashim").providers.softiwarp.mpa.RTR.READ),
            MpaOptions(p2p=True),
        ),
        (MpaOptions(p2p=True), MpaOptions(p2p=False)),
    ],
    ids=["rev1", "p2p-write-rtr", "p2p-read-rtr", "p2p-declined"],
)
async def test_setup_variants_carry_traffic(ctx, client_opts, server_opts) -> None:
    client, server = await make_pair(ctx, client_options=client_opts, server_options=server_opts)
    # In P2P mode the responder may send first once the RTR has arrived.
    rbuf = client.reg(100)
    client.qp.post_recv(RecvWR(1, [rbuf.sge()]))
    if server_opts.p2p and client_opts.p2p:
        server.qp.post_send(SendWR(2, WROpcode.SEND, [server.reg(b"first").sge()], SIG))
        assert (await one(client.recv_cq)).byte_len == 5
    src = client.reg(pattern(70000))
    dst = server.reg(70000)
    client.qp.post_send(SendWR(3, WROpcode.RDMA_WRITE, [src.sge()], SIG, dst.addr, dst.rkey))
    client.qp.post_send(SendWR(4, WROpcode.RDMA_READ, [rbuf.sge(0, 100)], SIG, dst.addr, dst.rkey))
    assert (await one(client.send_cq)).status == WCStatus.SUCCESS
    assert (await one(client.send_cq)).status == WCStatus.SUCCESS
    assert bytes(rbuf.buf) == bytes(src.buf[:100])


async def test_register_any_buffer(ctx) -> None:
    pd = ctx.alloc_pd()
    arr = array.array("d", [1.5] * 1000)
    mr = pd.reg_mr(arr, Access.LOCAL_WRITE | Access.REMOTE_WRITE)
    assert mr.length == 8000 and mr.lkey == mr.rkey
    with mmap.mmap(-1, 1 << 16) as m:
        mr2 = pd.reg_mr(m, Access.LOCAL_WRITE)
        assert mr2.length == 1 << 16
        mr2.close()
    ro = pd.reg_mr(b"read only", Access.REMOTE_READ)
    assert bytes(ro.buf) == b"read only"
    with pytest.raises(OSError, match="read-only") as info:
        pd.reg_mr(b"read only", Access.LOCAL_WRITE)
    assert info.value.errno == 13
    with pytest.raises(OSError, match="LOCAL_WRITE"):
        pd.reg_mr(bytearray(10), Access.REMOTE_WRITE)
    buf = bytearray(100)
    mr3 = pd.reg_mr(buf)
    with pytest.raises(BufferError):
        buf.extend(b"x")  # pinned while registered
    mr3.close()
    buf.extend(b"x")
    mr3.close()  # idempotent


async def test_zero_based_regions(pair: tuple[Side, Side]) -> None:
    """A region registered with ``iova`` is addressed from it, locally and remotely."""
    client, server = pair
    rw = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ
    dst = server.pd.reg_mr(bytearray(64), rw, iova=0)
    src = client.pd.reg_mr(bytearray(b"zero-based"), Access.LOCAL_WRITE, iova=1 << 40)
    assert (dst.iova, src.iova) == (0, 1 << 40) and dst.addr != 0
    assert src.sge(2).addr == (1 << 40) + 2
    client.qp.post_send(SendWR(1, WROpcode.RDMA_WRITE, [src.sge()], SIG, 8, dst.rkey))
    assert (await one(client.send_cq)).status == WCStatus.SUCCESS
    back = client.pd.reg_mr(bytearray(4), Access.LOCAL_WRITE, iova=7)
    client.qp.post_send(SendWR(2, WROpcode.RDMA_READ, [back.sge()], SIG, 12, dst.rkey))
    assert (await one(client.send_cq)).status == WCStatus.SUCCESS
    assert bytes(dst.buf[8:18]) == b"zero-based" and bytes(back.buf) == b"-bas"
    # The region's buffer address means nothing to the peer now: out of bounds.
    client.qp.post_send(SendWR(3, WROpcode.RDMA_READ, [back.sge()], SIG, dst.addr, dst.rkey))
    assert (await one(client.send_cq)).status == WCStatus.REM_ACCESS_ERR
    with pytest.raises(OSError, match="64 bits"):
        server.pd.reg_mr(bytearray(16), rw, iova=(1 << 64) - 8)


async def test_posting_errors(pair: tuple[Side, Side]) -> None:
    client, _ = pair
    mr = client.reg(100)
    with pytest.raises(OSError) as info:
        client.qp.post_send([SendWR(1, WROpcode.SEND, [mr.sge()] * 7, SIG)])
    assert info.value.errno == 22 and info.value.bad_wr == 0
    with pytest.raises(OSError, match="not an iWARP operation"):
        client.qp.post_send(SendWR(1, WROpcode.ATOMIC_FETCH_AND_ADD, [mr.sge()], SIG))
    with pytest.raises(OSError, match="SGEs"):
        client.qp.post_send(SendWR(1, WROpcode.RDMA_READ, [mr.sge(0, 10), mr.sge(10, 10)], SIG))
    fresh = client.pd.create_qp(send_cq=client.send_cq, recv_cq=client.recv_cq)
    with pytest.raises(OSError) as info:
        fresh.post_send(SendWR(1, WROpcode.SEND, [mr.sge()], SIG))
    assert info.value.errno == 107  # ENOTCONN before the CM connected it
    with pytest.raises(OSError, match="iWARP has RC only"):
        client.pd.create_qp(send_cq=client.send_cq, recv_cq=client.recv_cq, qp_type=4)
    with pytest.raises(OSError, match="max_send_sge"):
        client.pd.create_qp(
            send_cq=client.send_cq, recv_cq=client.recv_cq, cap=QPCap(max_send_sge=7)
        )
