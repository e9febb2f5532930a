"""Operations over a CM-connected pair: Send/Recv, RDMA Write and Read, immediate data,
multiple SGEs, inline data, unsignaled work, 1 MiB transfers, many outstanding requests
and the ordering rules a ULP relies on."""

from __future__ import annotations

import errno
import itertools
import sys

import pytest
from api.support import SIG, Cm, Pair, drain, is_linux_siw, ok, pattern, quiet, settle

import rdmashim
from rdmashim import (
    Access,
    AtomicCap,
    NotSupported,
    QPCap,
    QPState,
    RecvBatch,
    RecvWR,
    SendBatch,
    SendFlags,
    SendWR,
    VerbsError,
    WCFlags,
    WCOpcode,
    WCStatus,
    WROpcode,
)

MiB = 1 << 20


async def test_pair_is_connected_on_a_listed_device(pair: Pair) -> None:
    names = {d.name for d in rdmashim.get_device_list()}
    for end in (pair.client, pair.server):
        assert end.ctx.device.name in names
        attr = end.qp.query()
        assert attr.qp_state == QPState.RTS
        assert attr.qp_num == end.qp.qp_num
    # Over loopback both ends are on one device, and so are two QPs of it.
    assert pair.client.ctx.device.name == pair.server.ctx.device.name
    assert pair.client.qp.qp_num != pair.server.qp.qp_num


@pytest.mark.parametrize("size", [0, 1, 1000, 70000])
async def test_send_recv(pair: Pair, size: int) -> None:
    client, server = pair.client, pair.server
    data = pattern(size, 1)
    rbuf = server.reg(size + 16)
    server.qp.post_recv(RecvWR(5, [rbuf.sge()]))
    src = client.reg(data or b"-")
    client.qp.post_send(SendWR(6, WROpcode.SEND, [src.sge(0, size)] if size else [], SIG))
    (wc,) = await drain(server.recv_cq, 1)
    assert (wc.wr_id, wc.status, wc.opcode, wc.byte_len) == (
        5, WCStatus.SUCCESS, WCOpcode.RECV, size,
    )  # fmt: skip
    assert wc.qp_num == server.qp.qp_num
    assert not wc.wc_flags & WCFlags.WITH_IMM
    assert bytes(rbuf.buf[:size]) == data and bytes(rbuf.buf[size:]) == bytes(16)
    (wc,) = await drain(client.send_cq, 1)
    assert (wc.wr_id, wc.status, wc.opcode) == (6, WCStatus.SUCCESS, WCOpcode.SEND)
    assert wc.qp_num == client.qp.qp_num


async def test_both_directions(pair: Pair) -> None:
    for a, b in ((pair.client, pair.server), (pair.server, pair.client)):
        rbuf = b.reg(64)
        b.qp.post_recv(RecvWR(1, [rbuf.sge()]))
        a.qp.post_send(SendWR(2, WROpcode.SEND, [a.reg(b"to the other side").sge()], SIG))
        ok(await drain(a.send_cq, 1))
        (wc,) = ok(await drain(b.recv_cq, 1))
        assert bytes(rbuf.buf[: wc.byte_len]) == b"to the other side"


async def _post_or_skip(qp, wr: SendWR) -> None:
    try:
        qp.post_send(wr)
    except NotSupported as exc:
        assert exc.errno == errno.EOPNOTSUPP
        pytest.skip(f"{wr.opcode.name} not supported here: {exc}")


async def test_send_with_immediate(pair: Pair) -> None:
    client, server = pair.client, pair.server
    rbuf = server.reg(64)
    server.qp.post_recv(RecvWR(1, [rbuf.sge()]))
    msg = client.reg(b"with imm")
    await _post_or_skip(
        client.qp, SendWR(2, WROpcode.SEND_WITH_IMM, [msg.sge()], SIG, imm_data=0x12345678)
    )
    (wc,) = ok(await drain(server.recv_cq, 1))
    assert wc.opcode == WCOpcode.RECV and wc.wc_flags & WCFlags.WITH_IMM
    assert getattr(wc, "imm_data", None) == 0x12345678
    assert bytes(rbuf.buf[: wc.byte_len]) == b"with imm"


async def test_write_with_immediate(pair: Pair) -> None:
    client, server = pair.client, pair.server
    dst = server.reg(64)
    server.qp.post_recv(RecvWR(1, [server.reg(16).sge()]))
    src = client.reg(b"written")
    await _post_or_skip(
        client.qp,
        SendWR(2, WROpcode.RDMA_WRITE_WITH_IMM, [src.sge()], SIG, dst.addr, dst.rkey, imm_data=7),
    )
    (wc,) = ok(await drain(server.recv_cq, 1))
    assert wc.opcode == WCOpcode.RECV_RDMA_WITH_IMM and wc.wc_flags & WCFlags.WITH_IMM
    assert getattr(wc, "imm_data", None) == 7
    assert bytes(dst.buf[:7]) == b"written"


async def test_atomics(pair: Pair) -> None:
    """Fetch-and-add and compare-and-swap on the peer's 8 bytes, in order, each
    returning the value it found (the target in host byte order, as rxe keeps it)."""
    client, server = pair.client, pair.server
    if client.ctx.query_device().atomic_cap == AtomicCap.NONE:
        pytest.skip("the device reports no atomic operations (atomic_cap NONE)")
    target = server.reg((40).to_bytes(8, sys.byteorder), Access.LOCAL_WRITE | Access.REMOTE_ATOMIC)
    found = client.reg(3 * 8)
    add, cas = WROpcode.ATOMIC_FETCH_AND_ADD, WROpcode.ATOMIC_CMP_AND_SWP
    remote = (SIG, target.addr, target.rkey)
    client.qp.post_send(
        [
            SendWR(1, add, [found.sge(0, 8)], *remote, compare_add=2),
            SendWR(2, cas, [found.sge(8, 8)], *remote, compare_add=42, swap=7),
            SendWR(3, cas, [found.sge(16, 8)], *remote, compare_add=42, swap=9),
        ]
    )
    wcs = ok(await drain(client.send_cq, 3))
    assert [(w.wr_id, w.opcode, w.byte_len) for w in wcs] == [
        (1, WCOpcode.FETCH_ADD, 8), (2, WCOpcode.COMP_SWAP, 8), (3, WCOpcode.COMP_SWAP, 8),
    ]  # fmt: skip
    values = [int.from_bytes(found.buf[i : i + 8], sys.byteorder) for i in (0, 8, 16)]
    assert values == [40, 42, 7]  # the third compare failed: 7 stays
    assert int.from_bytes(target.buf, sys.byteorder) == 7


@pytest.mark.parametrize("size", [1, 4096, 100003])
async def test_rdma_write_places_exactly(pair: Pair, size: int) -> None:
    client, server = pair.client, pair.server
    data = pattern(size, 2)
    src = client.reg(data)
    dst = server.reg(size + 8)
    client.qp.post_send(SendWR(1, WROpcode.RDMA_WRITE, [src.sge()], SIG, dst.addr + 4, dst.rkey))
    (wc,) = ok(await drain(client.send_cq, 1))
    assert (wc.wr_id, wc.opcode) == (1, WCOpcode.RDMA_WRITE)
    await settle(client, dst)
    assert bytes(dst.buf[4 : 4 + size]) == data
    assert bytes(dst.buf[:4]) == bytes(4) and bytes(dst.buf[4 + size :]) == bytes(4)
    assert await quiet(server.recv_cq) == []  # a Write consumes no receive


@pytest.mark.parametrize("size", [1, 4096, 100003])
async def test_rdma_read(pair: Pair, size: int) -> None:
    client, server = pair.client, pair.server
    data = pattern(size + 10, 3)
    src = server.reg(data)
    sink = client.reg(size + 2)
    client.qp.post_send(
        SendWR(9, WROpcode.RDMA_READ, [sink.sge(1, size)], SIG, src.addr + 10, src.rkey)
    )
    (wc,) = ok(await drain(client.send_cq, 1))
    assert (wc.wr_id, wc.opcode, wc.byte_len) == (9, WCOpcode.RDMA_READ, size)
    assert bytes(sink.buf[1 : 1 + size]) == data[10:]
    assert sink.buf[0] == 0 and sink.buf[size + 1] == 0


async def test_rdma_read_of_read_only_memory(pair: Pair) -> None:
    """A peer may read what was registered read-only (``bytes``), with REMOTE_READ."""
    client, server = pair.client, pair.server
    published = b"published, read only " * 100
    src = server.pd.reg_mr(published, Access.REMOTE_READ)
    server.mrs.append(src)
    sink = client.reg(len(published))
    client.qp.post_send(SendWR(1, WROpcode.RDMA_READ, [sink.sge()], SIG, src.addr, src.rkey))
    ok(await drain(client.send_cq, 1))
    assert bytes(sink.buf) == published


async def test_multi_sge_gather_and_scatter(cm: Cm) -> None:
    attr = await cm.device_attr()
    n = min(attr.max_sge, 4)
    if n < 2:
        pytest.skip(f"the device has max_sge={attr.max_sge}")
    cap = QPCap(max_send_wr=16, max_recv_wr=16, max_send_sge=n, max_recv_sge=n)
    pair = await cm.pair(cap=cap)
    client, server = pair.client, pair.server
    parts = [pattern(size, size) for size in (1, 1000, 70000, 3)[:n]]
    mrs = [client.reg(p) for p in parts]
    total = b"".join(parts)
    # Receive into n SGEs of other sizes, with gaps between them, in one region.
    rmr = server.reg(len(total) + 100 * n)
    cuts = [0, *(len(total) * i // n + 3 for i in range(1, n)), len(total)]
    sges = [rmr.sge(lo + 100 * i, hi - lo) for i, (lo, hi) in enumerate(itertools.pairwise(cuts))]
    server.qp.post_recv(RecvWR(1, sges))
    client.qp.post_send(SendWR(2, WROpcode.SEND, [m.sge() for m in mrs], SIG))
    (wc,) = ok(await drain(server.recv_cq, 1))
    assert wc.byte_len == len(total)
    got = b"".join(bytes(rmr.buf[s.addr - rmr.addr :][: s.length]) for s in sges)
    assert got == total
    ok(await drain(client.send_cq, 1))
    # A gathered Write lands contiguously.
    dst = server.reg(len(total))
    client.qp.post_send(
        SendWR(3, WROpcode.RDMA_WRITE, [m.sge() for m in mrs], SIG, dst.addr, dst.rkey)
    )
    ok(await drain(client.send_cq, 1))
    await settle(client, dst)
    assert bytes(dst.buf) == total
    # A Read scatters into as many SGEs as the device allows for Reads.
    k = min(attr.max_sge_rd, n)
    sinks = [client.reg(len(total) // k + 1) for _ in range(k)]
    cuts = [len(total) * i // k for i in range(k + 1)]
    read_sges = [
        m.sge(0, hi - lo) for m, (lo, hi) in zip(sinks, itertools.pairwise(cuts), strict=True)
    ]
    client.qp.post_send(SendWR(4, WROpcode.RDMA_READ, read_sges, SIG, dst.addr, dst.rkey))
    (wc,) = ok(await drain(client.send_cq, 1))
    assert wc.byte_len == len(total)
    assert (
        b"".join(bytes(s.buf[: sg.length]) for s, sg in zip(sinks, read_sges, strict=True)) == total
    )


async def test_more_sges_than_the_device_allows_fail_at_post(pair: Pair) -> None:
    client = pair.client
    attr = client.ctx.query_device()
    mr = client.reg(64)
    sges = [mr.sge(i, 1) for i in range(attr.max_sge + 1)]
    with pytest.raises(VerbsError) as info:
        client.qp.post_send(SendWR(1, WROpcode.SEND, sges, SIG))
    assert info.value.errno == errno.EINVAL
    assert await quiet(client.send_cq) == []


U64 = (1 << 64) - 1
FAULTS = ["wr_id -1", "wr_id 2**64", "sge length -4", "sge lkey 2**32", "send flag 0x100"]


def _faulty(fault: str, sge: rdmashim.SGE, flags: SendFlags) -> tuple[int, object, SendFlags]:
    """The wr_id, the SGE and the send flags of a request with ``fault``."""
    wr_id, item = 7, sge
    if fault == "wr_id -1":
        wr_id = -1
    elif fault == "wr_id 2**64":
        wr_id = U64 + 1
    elif fault == "sge length -4":
        item = rdmashim.SGE(sge.addr, -4, sge.lkey)
    elif fault == "sge lkey 2**32":
        item = rdmashim.SGE(sge.addr, sge.length, 1 << 32)
    elif fault == "send flag 0x100":
        flags = SendFlags(int(flags) | 0x100)
    else:
        item = b"8 bytes!"  # not an SGE
    return wr_id, item, flags


@pytest.mark.parametrize("fault", [*FAULTS, "receive of bytes"])
async def test_fields_c_cannot_hold_are_refused_at_post(pair: Pair, fault: str) -> None:
    """A work request with a field outside its C type (``wr_id``, ``ibv_sge``'s), a
    send flag ``ibv_send_flags`` lacks or a receive SGE that is no SGE is refused at
    post (EINVAL, ``bad_wr`` its index: one request, or the second of a list of
    receives); nothing of it completes or reaches the wire, and the connection goes on
    (before, the engine took a negative length and sent the peer a Terminate)."""
    client, server = pair.client, pair.server
    src, dst = client.reg(pattern(8, 5)), server.reg(64)
    wr_id, item, _ = _faulty(fault, dst.sge(8, 8), SIG)
    if fault != "send flag 0x100":
        bad = RecvWR(wr_id, [item])  # type: ignore[list-item]
        for post in ([bad], [RecvWR(1, [dst.sge(0, 8)]), bad]):
            with pytest.raises(VerbsError) as info:
                server.qp.post_recv(post[0] if len(post) == 1 else post)
            assert info.value.errno == errno.EINVAL, info.value
            assert info.value.bad_wr == len(post) - 1
    if fault != "receive of bytes":
        wr_id, item, flags = _faulty(fault, src.sge(0, 8), SIG)
        with pytest.raises(VerbsError) as info:
            client.qp.post_send(SendWR(wr_id, WROpcode.SEND, [item], flags))  # type: ignore[list-item]
        assert info.value.errno == errno.EINVAL, info.value
        assert info.value.bad_wr == 0
    server.qp.post_recv(RecvWR(2, [dst.sge(16, 8)]))
    client.qp.post_send(SendWR(3, WROpcode.SEND, [src.sge(0, 8)], SIG))
    assert [w.wr_id for w in ok(await drain(client.send_cq, 1))] == [3]
    (got,) = ok(await drain(server.recv_cq, 1))
    assert got.wr_id in (1, 2) and got.byte_len == 8
    assert await quiet(client.send_cq) == []


@pytest.mark.parametrize("fault", [*FAULTS, "receive of bytes"])
async def test_a_batch_entry_c_cannot_hold_is_refused_when_a_post_reaches_it(
    pair: Pair, fault: str
) -> None:
    """The same faults in a prepared batch: a post that reaches the entry raises
    EINVAL with ``bad_wr`` its position; the entries before it went (the built-in
    engine, rdma-core) or none did (IBAL's facade converts the whole list first)."""
    client, server = pair.client, pair.server
    src, dst = client.reg(pattern(16, 6)), server.reg(64)
    if fault != "send flag 0x100":
        wr_id, item, _ = _faulty(fault, dst.sge(8, 8), SIG)
        recvs = RecvBatch([RecvWR(1, [dst.sge(0, 8)]), RecvWR(wr_id, [item])])  # type: ignore[list-item]
        with pytest.raises(VerbsError) as info:
            server.qp.post_recv_batch(recvs)
        assert info.value.errno == errno.EINVAL and info.value.bad_wr == 1, info.value
        server.qp.post_recv_batch(recvs, 1)  # the good entry alone posts
    else:
        server.qp.post_recv(RecvWR(1, [dst.sge(0, 8)]))
        server.qp.post_recv(RecvWR(1, [dst.sge(0, 8)]))
    if fault != "receive of bytes":
        wr_id, item, flags = _faulty(fault, src.sge(8, 8), SIG)
        sends = SendBatch(
            [
                SendWR(3, WROpcode.SEND, [src.sge(0, 8)], SIG),
                SendWR(wr_id, WROpcode.SEND, [item], flags),
            ]  # type: ignore[list-item]
        )
        with pytest.raises(VerbsError) as info:
            client.qp.post_send_batch(sends)
        assert info.value.errno == errno.EINVAL and info.value.bad_wr == 1, info.value
    client.qp.post_send(SendWR(4, WROpcode.SEND, [src.sge(0, 8)], SIG))
    done = ok(await drain(client.send_cq, 1))
    if done[0].wr_id == 3:  # the entry before the refused one went
        done += ok(await drain(client.send_cq, 1))
    assert [w.wr_id for w in done][-1:] == [4]
    got = ok(await drain(server.recv_cq, len(done)))
    assert [w.byte_len for w in got] == [8] * len(done)
    assert await quiet(client.send_cq) == []


async def test_inline_send(cm: Cm) -> None:
    limit = (await cm.device_attr()).max_inline_data
    if limit < 16:
        pytest.skip(f"the device has max_inline_data={limit}")
    pair = await cm.pair(cap=QPCap(max_send_wr=16, max_recv_wr=16, max_inline_data=limit))
    client, server = pair.client, pair.server
    assert client.qp.query().cap.max_inline_data >= limit
    rbuf = server.reg(3 * (limit + 16))
    server.post_recvs(rbuf, 3, limit + 16)
    src = client.reg(b"inline payload!!")
    client.qp.post_send(SendWR(1, WROpcode.SEND, [src.sge()], SIG | SendFlags.INLINE))
    src.buf[:6] = b"CHANGE"  # copied when posted: this must not be sent
    (wc,) = ok(await drain(server.recv_cq, 1))
    assert bytes(rbuf.buf[: wc.byte_len]) == b"inline payload!!"
    # Inline data may be plain bytes, with no registered memory at all.
    client.qp.post_send(SendWR(2, WROpcode.SEND, [b"raw bytes"], SIG | SendFlags.INLINE))
    (wc,) = ok(await drain(server.recv_cq, 1))
    off = limit + 16
    assert bytes(rbuf.buf[off : off + wc.byte_len]) == b"raw bytes"
    # Exactly the limit is fine.
    full = pattern(limit, 9)
    client.qp.post_send(SendWR(3, WROpcode.SEND, [full], SIG | SendFlags.INLINE))
    (wc,) = ok(await drain(server.recv_cq, 1))
    assert bytes(rbuf.buf[2 * off : 2 * off + wc.byte_len]) == full
    ok(await drain(client.send_cq, 3))
    # One byte more is refused at post time.
    with pytest.raises(VerbsError) as info:
        client.qp.post_send(SendWR(4, WROpcode.SEND, [full + b"!"], SIG | SendFlags.INLINE))
    assert info.value.errno == errno.EINVAL


async def test_unsignaled_work_completes_silently(pair: Pair) -> None:
    client, server = pair.client, pair.server
    assert not client.qp.query().sq_sig_all
    dst = server.reg(100)
    src = client.reg(b"a" * 100)
    rbuf = server.reg(64)
    server.post_recvs(rbuf, 2, 32)
    none = SendFlags.NONE
    wrs = [SendWR(i, WROpcode.RDMA_WRITE, [src.sge()], none, dst.addr, dst.rkey) for i in range(5)]
    wrs.append(SendWR(10, WROpcode.SEND, [src.sge(0, 8)], none))
    wrs.append(SendWR(99, WROpcode.SEND, [src.sge(0, 8)], SIG))
    client.qp.post_send(wrs)
    (wc,) = ok(await drain(client.send_cq, 1))
    assert wc.wr_id == 99
    # Receives complete whether or not the peer signals its sends.
    assert [w.wr_id for w in ok(await drain(server.recv_cq, 2))] == [0, 1]
    assert await quiet(client.send_cq) == []


async def test_sq_sig_all(cm: Cm) -> None:
    pair = await cm.pair(sq_sig_all=True)
    client, server = pair.client, pair.server
    assert client.qp.query().sq_sig_all
    dst = server.reg(10)
    src = client.reg(b"0123456789")
    client.qp.post_send(
        [
            SendWR(i, WROpcode.RDMA_WRITE, [src.sge()], SendFlags.NONE, dst.addr, dst.rkey)
            for i in range(3)
        ]
    )
    assert [w.wr_id for w in ok(await drain(client.send_cq, 3))] == [0, 1, 2]


async def test_one_mib_send_write_read(pair: Pair) -> None:
    client, server = pair.client, pair.server
    if client.ctx.query_port(1).max_msg_sz < MiB:
        pytest.skip("the port's max_msg_sz is below 1 MiB")
    data = pattern(MiB, 5)
    src = client.reg(data)
    rbuf = server.reg(MiB)
    server.qp.post_recv(RecvWR(1, [rbuf.sge()]))
    client.qp.post_send(SendWR(1, WROpcode.SEND, [src.sge()], SIG))
    (wc,) = ok(await drain(server.recv_cq, 1))
    assert wc.byte_len == MiB and bytes(rbuf.buf) == data
    dst = server.reg(MiB)
    client.qp.post_send(SendWR(2, WROpcode.RDMA_WRITE, [src.sge()], SIG, dst.addr, dst.rkey))
    back = client.reg(MiB)
    # The Read follows the Write on the same QP: it returns what the Write placed.
    client.qp.post_send(SendWR(3, WROpcode.RDMA_READ, [back.sge()], SIG, dst.addr, dst.rkey))
    wcs = ok(await drain(client.send_cq, 3))
    assert [w.wr_id for w in wcs] == [1, 2, 3] and wcs[2].byte_len == MiB
    assert bytes(dst.buf) == data and bytes(back.buf) == data


async def test_many_outstanding_requests_complete_in_order(cm: Cm) -> None:
    depth = min((await cm.device_attr()).max_qp_wr, 512)
    pair = await cm.pair(cap=QPCap(max_send_wr=depth, max_recv_wr=depth), cqe=2 * depth)
    client, server = pair.client, pair.server
    size = 64
    rbuf = server.reg(depth * size)
    server.post_recvs(rbuf, depth, size)
    src = client.reg(b"".join(i.to_bytes(4, "big") * (size // 4) for i in range(depth)))
    client.qp.post_send(
        [SendWR(i, WROpcode.SEND, [src.sge(i * size, size)], SIG) for i in range(depth)]
    )
    sent = ok(await drain(client.send_cq, depth))
    got = ok(await drain(server.recv_cq, depth))
    assert [w.wr_id for w in sent] == list(range(depth))
    assert [w.wr_id for w in got] == list(range(depth))
    # Message i landed in receive i: messages arrive in the order they were posted.
    assert bytes(rbuf.buf) == bytes(src.buf)


async def test_write_then_send_places_the_write_first(pair: Pair) -> None:
    """The classic "write the data, then send the notice": when the Send's receive
    completes, the Write before it is in place."""
    client, server = pair.client, pair.server
    data = pattern(MiB // 2, 6)
    src = client.reg(data)
    dst = server.reg(len(data))
    rbuf = server.reg(16)
    server.qp.post_recv(RecvWR(1, [rbuf.sge()]))
    client.qp.post_send(
        [
            SendWR(1, WROpcode.RDMA_WRITE, [src.sge()], SendFlags.NONE, dst.addr, dst.rkey),
            SendWR(2, WROpcode.SEND, [client.reg(b"done").sge()], SIG),
        ]
    )
    ok(await drain(server.recv_cq, 1))
    assert bytes(dst.buf) == data
    assert [w.wr_id for w in ok(await drain(client.send_cq, 1))] == [2]


async def test_send_queue_completes_in_post_order_across_reads(pair: Pair) -> None:
    client, server = pair.client, pair.server
    big = server.reg(pattern(2 * MiB, 7))
    sink = client.reg(2 * MiB)
    small = client.reg(b"x" * 10)
    dst = server.reg(10)
    rbuf = server.reg(16)
    server.qp.post_recv(RecvWR(1, [rbuf.sge()]))
    client.qp.post_send(
        [
            SendWR(1, WROpcode.RDMA_READ, [sink.sge()], SIG, big.addr, big.rkey),
            SendWR(2, WROpcode.RDMA_WRITE, [small.sge()], SIG, dst.addr, dst.rkey),
            SendWR(3, WROpcode.SEND, [small.sge()], SIG),
        ]
    )
    wcs = ok(await drain(client.send_cq, 3))
    if [w.wr_id for w in wcs] != [1, 2, 3] and is_linux_siw(client.ctx.query_device()):
        pytest.xfail(
            "kernel siw completes Writes and Sends when sent and a Read when its response "
            "arrives, so a later Write's completion overtakes an earlier Read's (siw_qp_tx.c "
            "vs siw_qp_rx.c siw_rdmap_complete); verbs require send queue order"
        )
    assert [w.wr_id for w in wcs] == [1, 2, 3]
    assert [w.opcode for w in wcs] == [WCOpcode.RDMA_READ, WCOpcode.RDMA_WRITE, WCOpcode.SEND]
    assert bytes(sink.buf) == bytes(big.buf)


async def test_reads_beyond_the_negotiated_depth_wait_their_turn(pair: Pair) -> None:
    client, server = pair.client, pair.server
    ord_ = client.qp.query().max_rd_atomic
    assert ord_ >= 1
    n = ord_ + 4
    src = server.reg(pattern(40000, 8))
    sinks = [client.reg(40000) for _ in range(n)]
    client.qp.post_send(
        [
            SendWR(i, WROpcode.RDMA_READ, [m.sge()], SIG, src.addr, src.rkey)
            for i, m in enumerate(sinks)
        ]
    )
    wcs = ok(await drain(client.send_cq, n))
    assert [w.wr_id for w in wcs] == list(range(n))
    assert all(bytes(m.buf) == bytes(src.buf) for m in sinks)
