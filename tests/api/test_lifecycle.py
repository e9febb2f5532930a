"""Closing and garbage collection: verbs objects and CM ids closed in any order, twice,
with work outstanding or a connection live, or simply dropped; nothing crashes, a
closed object refuses use, and whatever was posted still completes."""

from __future__ import annotations

import gc
import logging
import random
from typing import Any

import pytest
import trio
from api.support import SIG, TIMEOUT, Cm, E, check_cut_send_queue, drain, ok

import rdmashim
from rdmashim import QPCap, QPState, RecvWR, SendWR, VerbsError, WCStatus, WROpcode
from rdmashim.cm import EventChannel

ORDERS = ["children-first", "parents-first", "seed-1", "seed-2", "seed-3", "leave-open"]


def build(ctx: Any) -> dict[str, Any]:
    """One of each verbs object, in creation order (an SRQ where the device has them)."""
    objs: dict[str, Any] = {"pd": ctx.alloc_pd()}
    objs["mr"] = objs["pd"].reg_mr(bytearray(4096))
    objs["channel"] = ctx.create_comp_channel()
    objs["send_cq"] = ctx.create_cq(16, objs["channel"])
    objs["recv_cq"] = ctx.create_cq(16)
    objs["send_cq"].req_notify()
    if ctx.query_device().max_srq:
        objs["srq"] = objs["pd"].create_srq(16, 1)
        objs["srq_qp"] = objs["pd"].create_qp(
            send_cq=objs["send_cq"], recv_cq=objs["recv_cq"], srq=objs["srq"]
        )
    objs["qp"] = objs["pd"].create_qp(
        send_cq=objs["send_cq"], recv_cq=objs["recv_cq"], cap=QPCap(max_send_wr=8, max_recv_wr=8)
    )
    return objs


def close_order(names: list[str], order: str) -> list[str]:
    if order == "children-first":
        return names[::-1]
    if order == "parents-first":
        return names
    if order == "leave-open":
        return []
    shuffled = list(names)
    random.Random(order).shuffle(shuffled)
    return shuffled


@pytest.mark.parametrize("order", ORDERS)
async def test_close_in_any_order(order: str) -> None:
    async with rdmashim.open_device() as ctx:
        objs = build(ctx)
        seq = close_order(list(objs), order)
        for name in seq + seq:  # twice: closing is idempotent
            objs[name].close()
        if "pd" in seq:
            with pytest.raises(VerbsError):
                objs["pd"].reg_mr(bytearray(8))
        if "recv_cq" in seq:
            with pytest.raises(VerbsError):
                objs["recv_cq"].poll()
        if "qp" in seq:
            with pytest.raises(VerbsError):
                objs["qp"].post_recv(RecvWR(1, []))
        # The context itself is still good.
        fresh = build(ctx)
        assert fresh["qp"].query().qp_state in (QPState.RESET, QPState.INIT)
    # Leaving the device closes whatever is left, and the objects say so.
    with pytest.raises(VerbsError):
        objs["pd"].reg_mr(bytearray(8))
    with pytest.raises(VerbsError):
        fresh["qp"].post_recv(RecvWR(1, []))


async def test_dropped_objects_are_collected_without_harm(caplog: Any) -> None:
    async with rdmashim.open_device() as ctx:
        for _ in range(3):
            build(ctx)  # every reference dropped at once
            gc.collect()
        for _ in range(3):
            cycle = build(ctx)
            cycle["itself"] = cycle  # collected together: parents may be finalized first
            del cycle
            gc.collect()
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
        keep = build(ctx)
        qp, mr = keep.pop("qp"), keep.pop("mr")
        del keep  # a QP and an MR hold their PD, CQs and channel
        gc.collect()
        assert qp.query().qp_num == qp.qp_num
        mr.buf[:4] = b"live"
        assert bytes(mr.buf[:4]) == b"live"
    gc.collect()


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
async def test_closing_a_live_connection_in_any_order(cm: Cm, seed: int) -> None:
    pair = await cm.pair()
    client, server = pair.client, pair.server
    client.post_recvs(client.reg(8 * 16), 8, 16)
    server.post_recvs(server.reg(8 * 16), 8, 16)
    src, dst = client.reg(1 << 20), server.reg(1 << 20)
    client.qp.post_send(
        [SendWR(i, WROpcode.RDMA_WRITE, [src.sge()], SIG, dst.addr, dst.rkey) for i in range(16)]
    )
    objs = {
        "qp": server.qp, "dst": dst, "send_cq": server.send_cq, "recv_cq": server.recv_cq,
        "pd": server.pd, "id": server.id,
    }  # fmt: skip
    names = list(objs)
    random.Random(seed).shuffle(names)
    for name in names:
        obj = objs[name]
        obj.destroy() if name == "id" else obj.close()
    # The client sees the connection end; all it posted comes back.
    await pair.events.until(client.id, E.DISCONNECTED)
    sent = await drain(client.send_cq, 16)
    assert [w.wr_id for w in sent] == list(range(16))
    check_cut_send_queue([w.status for w in sent])
    client.id.disconnect()
    flushed = await drain(client.recv_cq, 8)
    assert {w.status for w in flushed} == {WCStatus.WR_FLUSH_ERR}


async def test_dropping_a_registered_buffer_with_work_outstanding(pair) -> None:
    client, server = pair.client, pair.server
    server.post_recvs(server.reg(20 * 64), 20, 64)

    def post() -> None:
        src = client.pd.reg_mr(bytearray(b"s" * 64))
        client.qp.post_send([SendWR(i, WROpcode.SEND, [src.sge()], SIG) for i in range(20)])

    post()  # the region's only reference is gone when this returns
    gc.collect()
    wcs = await drain(client.send_cq, 20)
    assert [w.wr_id for w in wcs] == list(range(20))
    # Sent from the region, or refused because it went away; never lost, never a crash.
    allowed = {WCStatus.SUCCESS, WCStatus.LOC_PROT_ERR, WCStatus.LOC_QP_OP_ERR}
    assert {w.status for w in wcs} <= allowed | {WCStatus.WR_FLUSH_ERR}


@pytest.mark.parametrize("first", ["listener", "client", "server"])
async def test_destroying_cm_ids_in_any_order(cm: Cm, first: str) -> None:
    pair = await cm.pair()
    client, server = pair.client, pair.server
    if first == "listener":
        cm.listener.destroy()
        # Established connections outlive their listener.
        rbuf = server.reg(16)
        server.qp.post_recv(RecvWR(1, [rbuf.sge()]))
        client.qp.post_send(SendWR(2, WROpcode.SEND, [client.reg(b"after").sge()], SIG))
        ok(await drain(server.recv_cq, 1))
        assert bytes(rbuf.buf[:5]) == b"after"
        client.id.destroy()
        await pair.events.until(server.id, E.DISCONNECTED)
        server.id.destroy()
    else:
        gone, other = (client, server) if first == "client" else (server, client)
        gone.id.destroy()
        await pair.events.until(other.id, E.DISCONNECTED)
        other.id.destroy()
        cm.listener.destroy()
    for cm_id in (client.id, server.id, cm.listener):
        cm_id.destroy()  # idempotent


async def test_leaving_the_channel_with_work_in_flight() -> None:
    """Leaving the event channel's block with a live connection and Writes in flight
    ends everything cleanly and promptly."""
    with trio.fail_after(TIMEOUT):
        async with EventChannel() as channel:
            pair = await Cm(channel).pair()
            src, dst = pair.client.reg(1 << 20), pair.server.reg(1 << 20)
            pair.server.post_recvs(pair.server.reg(64), 4, 16)
            pair.client.qp.post_send(
                [
                    SendWR(i, WROpcode.RDMA_WRITE, [src.sge()], SIG, dst.addr, dst.rkey)
                    for i in range(32)
                ]
            )
            ok(await drain(pair.client.send_cq, 1))  # the rest is on its way
