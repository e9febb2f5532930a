"""Queue pairs and shared receive queues: creation within the device's limits, query,
moving a QP to ERR (everything outstanding flushed, in order), SRQs shared by QPs."""

from __future__ import annotations

import errno

import pytest
from api.support import SIG, Cm, E, check_cut_send_queue, drain, ok, quiet

from rdmashim import (
    QPCap,
    QPState,
    QPType,
    RecvWR,
    SendWR,
    Transport,
    VerbsError,
    WCStatus,
    WROpcode,
)


async def test_create_and_query(device) -> None:
    attr = device.query_device()
    pd, cq = device.alloc_pd(), device.create_cq(64)
    cap = QPCap(
        max_send_wr=min(64, attr.max_qp_wr),
        max_recv_wr=min(32, attr.max_qp_wr),
        max_send_sge=min(2, attr.max_sge),
        max_recv_sge=min(3, attr.max_sge),
    )
    qp = pd.create_qp(send_cq=cq, recv_cq=cq, cap=cap)
    other = pd.create_qp(send_cq=cq, recv_cq=device.create_cq(8), sq_sig_all=True)
    q = qp.query()
    assert q.qp_num == qp.qp_num != other.qp_num
    assert q.qp_type == QPType.RC
    # Not connected yet: libibverbs creates QPs in RESET, rdma_cm moves them to INIT.
    assert q.qp_state in (QPState.RESET, QPState.INIT)
    assert not q.sq_sig_all and other.query().sq_sig_all
    for field in ("max_send_wr", "max_recv_wr", "max_send_sge", "max_recv_sge"):
        assert getattr(q.cap, field) >= getattr(cap, field), field  # rounded up, never down


@pytest.mark.parametrize(
    "field", ["max_send_wr", "max_recv_wr", "max_send_sge", "max_recv_sge", "max_inline_data"]
)
async def test_create_beyond_the_device_limits(device, field: str) -> None:
    attr = device.query_device()
    limit = {
        "max_send_wr": attr.max_qp_wr,
        "max_recv_wr": attr.max_qp_wr,
        "max_send_sge": attr.max_sge,
        "max_recv_sge": attr.max_sge,
        "max_inline_data": attr.max_inline_data,
    }[field]
    pd, cq = device.alloc_pd(), device.create_cq(8)
    with pytest.raises(VerbsError) as info:
        pd.create_qp(send_cq=cq, recv_cq=cq, cap=QPCap(**{field: limit + 1}))
    assert info.value.errno == errno.EINVAL


async def test_iwarp_has_reliable_connected_qps_only(device) -> None:
    if device.query_device().transport != Transport.IWARP:
        pytest.skip("not an iWARP device")
    pd, cq = device.alloc_pd(), device.create_cq(8)
    for qp_type in (QPType.UD, QPType.UC):
        with pytest.raises(VerbsError) as info:
            pd.create_qp(send_cq=cq, recv_cq=cq, qp_type=qp_type)
        assert info.value.errno in (errno.EOPNOTSUPP, errno.EINVAL)


async def test_unconnected_qp_to_err(device) -> None:
    pd, cq = device.alloc_pd(), device.create_cq(8)
    qp = pd.create_qp(send_cq=cq, recv_cq=cq)
    qp.modify(qp_state=QPState.ERR)
    assert qp.query().qp_state == QPState.ERR
    assert await quiet(cq) == []  # nothing was posted, nothing is flushed


async def test_err_flushes_receives_in_order(cm: Cm) -> None:
    pair = await cm.pair()
    client, server = pair.client, pair.server
    rbuf = server.reg(8 * 16)
    server.post_recvs(rbuf, 8, 16, first_id=100)
    server.qp.modify(qp_state=QPState.ERR)
    assert server.qp.query().qp_state == QPState.ERR
    wcs = await drain(server.recv_cq, 8)
    assert [(w.wr_id, w.status) for w in wcs] == [
        (100 + i, WCStatus.WR_FLUSH_ERR) for i in range(8)
    ]
    assert all(w.qp_num == server.qp.qp_num for w in wcs)
    # The connection is gone: the peer is told.
    await pair.events.expect(client.id, E.DISCONNECTED)


async def test_err_flushes_the_send_queue_after_what_completed(cm: Cm) -> None:
    pair = await cm.pair()
    client, server = pair.client, pair.server
    src = client.reg(1 << 20)
    dst = server.reg(1 << 20)
    n = 200  # within the pair's 256 send WRs; a backend that posts slowly (ibal over
    # rdma-core, where each call crosses threads) once saw all of 64 MiB leave first
    client.qp.post_send(
        [SendWR(i, WROpcode.RDMA_WRITE, [src.sge()], SIG, dst.addr, dst.rkey) for i in range(n)]
    )
    client.qp.modify(qp_state=QPState.ERR)
    wcs = await drain(client.send_cq, n)
    assert [w.wr_id for w in wcs] == list(range(n))
    statuses = [w.status for w in wcs]
    assert statuses[-1] == WCStatus.WR_FLUSH_ERR  # 200 MiB cannot all have left at once
    check_cut_send_queue(statuses)
    await pair.events.expect(server.id, E.DISCONNECTED)


# ---------------------------------------------------------------- shared receive queues


async def _srq_attr(cm: Cm):
    attr = await cm.device_attr()
    if attr.max_srq == 0:
        pytest.skip("the device has no shared receive queues")
    return attr


async def test_srq_limits(device) -> None:
    attr = device.query_device()
    if attr.max_srq == 0:
        pytest.skip("the device has no shared receive queues")
    pd = device.alloc_pd()
    pd.create_srq(min(64, attr.max_srq_wr), 1).close()
    for max_wr, max_sge in ((attr.max_srq_wr + 1, 1), (16, attr.max_srq_sge + 1)):
        with pytest.raises(VerbsError) as info:
            pd.create_srq(max_wr, max_sge)
        assert info.value.errno == errno.EINVAL


async def test_srq_feeds_two_connections(cm: Cm) -> None:
    await _srq_attr(cm)
    first = await cm.pair(srq=True)
    srq, pd = first.server.srq, first.server.pd
    second = await cm.pair(server_srq=srq, server_pd=pd)
    assert second.server.srq is srq
    rbuf = first.server.reg(8 * 32)
    first.server.post_recvs(rbuf, 8, 32, first_id=10)
    with pytest.raises(VerbsError):  # a QP on an SRQ has no receive queue of its own
        first.server.qp.post_recv(RecvWR(1, [rbuf.sge(0, 8)]))
    for pair, tag in ((first, b"one"), (second, b"two"), (first, b"one"), (second, b"two")):
        msg = pair.client.reg(tag)
        pair.client.qp.post_send(SendWR(0, WROpcode.SEND, [msg.sge()], SIG))
        ok(await drain(pair.client.send_cq, 1))
    # Both QPs take receives from the one SRQ, in the SRQ's order.
    wcs = ok(await drain(first.server.recv_cq, 2)) + ok(await drain(second.server.recv_cq, 2))
    assert sorted(w.wr_id for w in wcs) == [10, 11, 12, 13]
    for w in wcs:
        tag = b"one" if w.qp_num == first.server.qp.qp_num else b"two"
        assert w.qp_num in (first.server.qp.qp_num, second.server.qp.qp_num)
        off = (w.wr_id - 10) * 32
        assert bytes(rbuf.buf[off : off + w.byte_len]) == tag


async def test_srq_receives_outlive_a_failed_qp(cm: Cm) -> None:
    """Receives on an SRQ belong to the SRQ: one QP going to ERR does not flush them."""
    await _srq_attr(cm)
    first = await cm.pair(srq=True)
    srq, pd = first.server.srq, first.server.pd
    second = await cm.pair(server_srq=srq, server_pd=pd)
    rbuf = first.server.reg(4 * 16)
    first.server.post_recvs(rbuf, 4, 16)
    first.client.id.disconnect()
    await pair_disconnected(first)
    assert await quiet(first.server.recv_cq) == []
    msg = second.client.reg(b"still here")
    second.client.qp.post_send(SendWR(1, WROpcode.SEND, [msg.sge()], SIG))
    (wc,) = ok(await drain(second.server.recv_cq, 1))
    assert wc.wr_id == 0 and bytes(rbuf.buf[: wc.byte_len]) == b"still here"


async def pair_disconnected(pair) -> None:
    for end in (pair.client, pair.server):
        await pair.events.expect(end.id, E.DISCONNECTED)
