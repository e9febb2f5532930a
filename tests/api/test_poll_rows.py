"""``cq.poll_rows``: a poll's completions as ``WC_ROW`` rows in the caller's buffer.

The same traffic polled by ``poll_rows`` gives, row by row and field by field, what
``poll_into`` gives of a twin run (and what the traffic posted says: wr_ids, opcodes,
lengths, statuses), error and flush completions included; ``poll_rows``, ``poll`` and
``poll_into`` mixed take each completion once, in order; ``num_entries`` limits; misuse
is EINVAL, naming the problem. What is one backend's own (the native engine's row is C's
``rs_wc``, polled in place; rdma-core's rows from ``ibv_wc`` without a device; the
built-in engine's overrun) is in ``tests/test_poll_rows.py``.
"""

from __future__ import annotations

import array
import errno
from collections.abc import Callable
from typing import Any

import pytest
import trio
from api.support import (
    SIG,
    TIMEOUT,
    Cm,
    Pair,
    Row,
    is_linux_rxe,
    pattern,
    queued_receives,
    row_of,
    rows_of,
)

import rdmashim
from rdmashim import (
    WC_ROW,
    RecvWR,
    SendFlags,
    SendWR,
    VerbsError,
    WCArray,
    WCFlags,
    WCOpcode,
    WCStatus,
    WROpcode,
)
from rdmashim.cm import CMEventType

SIZE = WC_ROW.size


def solicited_reported() -> bool:
    """Whether the backend's completions say a Send was solicited (``struct ibv_wc`` and
    IBAL's ``ib_wc_t`` do not; the built-in engine does)."""
    return rdmashim.chosen_backend() == "softiwarp"


def by_rows(cq: Any) -> list[Row]:
    """What one ``poll_rows`` into a 3-row buffer takes (a poll may take part of what is
    queued)."""
    rows = bytearray(3 * SIZE)
    return rows_of(rows, cq.poll_rows(rows))


def by_array(cq: Any) -> list[Row]:
    """What one ``poll_into`` a 3-entry array takes."""
    wcs = WCArray(3)
    return [row_of(wcs[i]) for i in range(cq.poll_into(wcs))]


async def collect(cq: Any, n: int, take: Callable[[Any], list[Row]]) -> list[Row]:
    """At least ``n`` completions, taken by ``take`` as they come (polled: no wait takes
    any); the last poll may take more."""
    got: list[Row] = []
    with trio.fail_after(TIMEOUT):
        while len(got) < n:
            new = take(cq)
            if not new:
                await trio.sleep(0.002)
            got += new
    return got


def named(rows: list[Row], pair: Pair) -> list[Row]:
    """``rows`` with their QP number replaced by the side it names (twin runs differ in
    nothing else)."""
    sides = {pair.client.qp.qp_num: "client", pair.server.qp.qp_num: "server"}
    return [(*r[:4], sides.get(r[4], r[4]), *r[5:]) for r in rows]


# ------------------------------------------------------------------------------ the traffic
SENDS = 8
SOLICITED = {1, 4, 7}


async def traffic(cm: Cm, take: Callable[[Any], list[Row]]) -> tuple[list[Row], list[Row]]:
    """Sends (some solicited), an RDMA Write and Read, then a Send too long for its
    receive (an error at the server, the connection ends, the receive behind it is
    flushed): the client's send completions and the server's receive completions, as
    ``take`` polls them."""
    pair = await cm.pair()
    client, server = pair.client, pair.server
    server.post_recvs(server.reg(64 * SENDS), SENDS, 64, first_id=100)
    src = client.reg(pattern(64, 3))
    target = server.reg(64)
    sink = client.reg(64)
    client.qp.post_send(
        [
            SendWR(i, WROpcode.SEND, [src.sge(0, 3 * i)],
                   SIG | (SendFlags.SOLICITED if i in SOLICITED else SendFlags.NONE))
            for i in range(SENDS)
        ]
        + [
            SendWR(20, WROpcode.RDMA_WRITE, [src.sge(0, 16)], SIG, target.addr, target.rkey),
            SendWR(21, WROpcode.RDMA_READ, [sink.sge(0, 32)], SIG, target.addr, target.rkey),
        ]
    )  # fmt: skip
    sent = await collect(client.send_cq, SENDS + 2, take)
    received = await collect(server.recv_cq, SENDS, take)
    # An error and a flush: a 40-byte Send into an 8-byte receive ends the connection
    # (as test_errors.py's: on InfiniBand once the error is polled); the receive behind
    # it is flushed.
    short, spare = server.reg(8), server.reg(64)
    server.qp.post_recv([RecvWR(200, [short.sge()]), RecvWR(201, [spare.sge()])])
    client.qp.post_send(SendWR(30, WROpcode.SEND, [src.sge(0, 40)], SIG))
    failed = await collect(server.recv_cq, 1, take)
    for end in (client, server):
        await pair.events.expect(end.id, CMEventType.DISCONNECTED)
    for end in (client, server):
        end.id.disconnect()
    received += failed + await collect(server.recv_cq, 2 - len(failed), take)
    assert len(sent) == SENDS + 2 and len(received) == SENDS + 2
    return named(sent, pair), named(received, pair)


async def test_rows_are_what_poll_into_gives(cm: Cm) -> None:
    """A twin run of the same traffic polled by ``poll_into`` gives the same completions,
    field by field; both are what the traffic posted says."""
    rows_sent, rows_received = await traffic(cm, by_rows)
    array_sent, array_received = await traffic(cm, by_array)
    assert rows_sent == array_sent
    assert rows_received == array_received
    sol = solicited_reported()
    rxe = is_linux_rxe(await cm.device_attr())
    grh = int(WCFlags.GRH) if rxe else 0  # (RoCE: every receive has a GRH)
    ops = [WCOpcode.SEND] * SENDS + [WCOpcode.RDMA_WRITE, WCOpcode.RDMA_READ]
    assert [(r[0], r[1], r[2], r[4], r[5]) for r in rows_sent] == [
        (wr_id, WCStatus.SUCCESS, op, "client", 0)
        for wr_id, op in zip([*range(SENDS), 20, 21], ops, strict=True)
    ]
    assert rows_received[:SENDS] == [
        (100 + i, 0, WCOpcode.RECV, 3 * i, "server", grh, 0, int(sol and i in SOLICITED))
        for i in range(SENDS)
    ]
    failed, flushed = rows_received[SENDS:]
    statuses = {WCStatus.LOC_LEN_ERR}
    if rxe:
        statuses.add(WCStatus.LOC_QP_OP_ERR)  # (rxe's way: test_errors.py's receive_failure)
    assert failed[0] == 200 and failed[1] in statuses and failed[4] == "server", failed
    assert (flushed[0], flushed[1], flushed[4]) == (201, WCStatus.WR_FLUSH_ERR, "server")


async def test_polls_mixed_take_each_completion_once_in_order(pair: Pair) -> None:
    """``poll_rows``, ``poll`` and ``poll_into`` in turn on one CQ: each completion taken
    once, in order; ``num_entries`` limits (0 or below takes none, more than fit takes
    what fits); rows past those taken keep what they held."""
    n = 12
    cq = await queued_receives(pair, n)
    rows = bytearray(b"\xab" * 4 * SIZE)
    for none in (0, -1, -100):
        assert cq.poll_rows(rows, none) == 0
    assert rows == b"\xab" * 4 * SIZE
    got: list[Row] = []
    assert cq.poll_rows(rows, 2) == 2
    got += rows_of(rows, 2)
    assert rows[2 * SIZE :] == b"\xab" * 2 * SIZE  # untouched
    got += [row_of(w) for w in cq.poll(1)]
    got += by_array(cq)  # 3
    assert cq.poll_rows(rows) == 4  # as many as fit
    got += rows_of(rows, 4)
    got += [row_of(w) for w in cq.poll(1)]
    assert cq.poll_rows(rows, 100) == 1  # the last one
    got += rows_of(rows, 1)
    assert cq.poll_rows(rows) == 0 and cq.poll(4) == [] and cq.poll_into(WCArray(4)) == 0
    assert len(cq) == 0
    qp = pair.server.qp.qp_num
    grh = int(WCFlags.GRH) if is_linux_rxe(pair.server.ctx.query_device()) else 0
    assert got == [(i, 0, int(WCOpcode.RECV), i, qp, grh, 0, 0) for i in range(n)]


async def test_misuse_is_einval_naming_the_problem(pair: Pair) -> None:
    """A buffer that is not one to write rows into is refused (EINVAL, the message says
    why) and takes nothing; any writable contiguous buffer of a row or more is taken
    (of any item type or shape, at any address); a closed CQ refuses as ``poll_into``."""
    cq = await queued_receives(pair, 3)
    for rows, problem in [
        (bytes(4 * SIZE), "read-only"),
        (memoryview(bytearray(8 * SIZE))[::2], "C-contiguous"),
        (bytearray(SIZE - 1), "less than one 40-byte row"),
        (12, "writable buffer, not int"),
        ([0] * SIZE, "writable buffer, not list"),
    ]:
        with pytest.raises(VerbsError) as info:
            cq.poll_rows(rows)
        assert info.value.errno == errno.EINVAL and problem in str(info.value), info.value
    taken: list[Row] = []
    for rows in [
        array.array("Q", bytes(SIZE)),
        memoryview(bytearray(2 * SIZE + 1))[1:],
        memoryview(bytearray(2 * SIZE)).cast("B", [2, SIZE]),
    ]:
        taken += rows_of(rows, cq.poll_rows(rows, 1))
    assert [(r[0], r[3]) for r in taken] == [(0, 0), (1, 1), (2, 2)]  # nothing was lost
    spare = pair.server.ctx.create_cq(4)
    spare.close()
    with pytest.raises(VerbsError) as a:
        spare.poll_into(WCArray(1))
    with pytest.raises(VerbsError) as b:
        spare.poll_rows(bytearray(SIZE))
    assert a.value.errno == b.value.errno
