"""Teardown after a fault, in any order: closing a connection's MRs, QP, CQs, PD and CM id
after the peer sent or received a Terminate, reset the connection, or the QP flushed,
returns cleanly on every backend; no view of the user's buffer outlives its MRs (the
buffer can be resized again); and the listener serves the next connection.

The regions are registered the way an application does it: slices of one
``bytearray`` arena, receives posted into them before the fault.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import trio
from api.support import SIG, TIMEOUT, Cm, End, Pair, drain, ok

from rdmashim import RecvWR, SendWR, WCStatus, WROpcode
from rdmashim.cm import CMEventType

FAULTS = ["terminate-sent", "terminate-received", "peer-reset", "flush"]
ORDERS = ["children-first", "parents-first", "seed-1", "seed-2", "seed-3"]
SLOT = 1024
SLOTS = 4


def arena_regions(end: End, arena: bytearray) -> list[Any]:
    """One MR per slot of ``arena`` (memoryview slices, as a ULP carves its pool)."""
    view = memoryview(arena)
    mrs = [end.pd.reg_mr(view[i * SLOT : (i + 1) * SLOT]) for i in range(SLOTS)]
    view.release()
    return mrs


def too_long(end: End, first_id: int) -> None:
    """Post a Send that fits the peer's receive, then one longer than any receive."""
    small, big = end.reg(b"x" * 16), end.reg(b"y" * (SLOT * 4))
    end.qp.post_send(
        [
            SendWR(first_id, WROpcode.SEND, [small.sge()], SIG),
            SendWR(first_id + 1, WROpcode.SEND, [big.sge()], SIG),
        ]
    )


async def first_failure(cq: Any) -> Any:
    """The first completion that is not SUCCESS."""
    with trio.fail_after(TIMEOUT):
        while True:
            for wc in await cq.poll_wait():
                if wc.status is not WCStatus.SUCCESS:
                    return wc


async def fault(kind: str, pair: Pair, mrs: list[Any]) -> None:
    client, server = pair.client, pair.server
    for i, mr in enumerate(mrs):
        server.qp.post_recv(RecvWR(i, [mr.sge()]))
    client.post_recvs(client.reg(SLOTS * SLOT), SLOTS, SLOT)
    if kind == "terminate-sent":  # the server refuses the client's Send
        too_long(client, 100)
        await first_failure(server.recv_cq)
    elif kind == "terminate-received":  # the client refuses the server's Send
        too_long(server, 100)
        await first_failure(client.recv_cq)
    elif kind == "peer-reset":  # the client goes away with Writes and a Read in flight
        src = client.reg(SLOT)
        client.qp.post_send(
            [
                SendWR(1, WROpcode.RDMA_WRITE, [src.sge()], SIG, mrs[0].addr, mrs[0].rkey),
                SendWR(2, WROpcode.RDMA_READ, [src.sge()], SIG, mrs[1].addr, mrs[1].rkey),
            ]
        )
        client.id.destroy()
        await pair.events.until(server.id, CMEventType.DISCONNECTED)
    else:  # flush: the server disconnects with its receives and a Read outstanding
        src = client.reg(SLOT)
        server.qp.post_send(SendWR(7, WROpcode.RDMA_READ, [mrs[3].sge()], SIG, src.addr, src.rkey))
        server.id.disconnect()
        await first_failure(server.recv_cq)


def close_order(names: list[str], order: str) -> list[str]:
    if order == "children-first":
        return names[::-1]
    if order == "parents-first":
        return names
    shuffled = list(names)
    random.Random(order).shuffle(shuffled)
    return shuffled


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("kind", FAULTS)
async def test_teardown_after_a_fault_in_any_order(cm: Cm, kind: str, order: str) -> None:
    pair = await cm.pair()
    server = pair.server
    arena = bytearray(SLOTS * SLOT)
    mrs = arena_regions(server, arena)
    await fault(kind, pair, mrs)
    objs: dict[str, Any] = {f"mr{i}": mr for i, mr in enumerate(mrs)}
    objs |= {f"own{i}": mr for i, mr in enumerate(server.mrs)}
    objs |= {"qp": server.qp, "send_cq": server.send_cq, "recv_cq": server.recv_cq}
    objs |= {"pd": server.pd, "id": server.id}
    names = close_order(list(objs), order)
    for name in names + names:  # and again: closing is idempotent
        obj = objs[name]
        obj.destroy() if name == "id" else obj.close()
    del objs, mrs
    arena.extend(b"more")  # no view of the arena is left anywhere (it may move)
    pair.client.id.destroy()
    # The listener is still good: the next connection exchanges a Send.
    after = await cm.pair()
    rbuf = after.server.reg(16)
    after.server.qp.post_recv(RecvWR(1, [rbuf.sge()]))
    after.client.qp.post_send(SendWR(2, WROpcode.SEND, [after.client.reg(b"next").sge()], SIG))
    ok(await drain(after.server.recv_cq, 1))
    assert bytes(rbuf.buf[:4]) == b"next"
