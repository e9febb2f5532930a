"""Runs of inline Sends (``SendRun``): consecutive inline Sends posted together travel as
one engine job and are framed by one kernel call, yet each entry keeps its own SQ slot,
wr_id and completion. Checked on the engine alone (flush, ``sq_sig_all``) and through
the verbs over a real connection (mixed with Writes, Reads and a fence; unsignaled
entries; the send queue's depth; a CQ overrun)."""

from __future__ import annotations

import errno

import pytest
import trio
from test_engine_sansio import Host, pump
from test_resources import BOUND, SIG, connected, drain, post_receives

from rdmashim import (
    Access,
    AsyncEventType,
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
from rdmashim.providers.softiwarp.jobs import RecvJob, SendJob, SendRun
from rdmashim.verbs.wr import SGE

INLINE = SendFlags.INLINE
CAP = QPCap(max_inline_data=64)


def _run(first: int, n: int, signaled: set[int] | None = None) -> SendRun:
    """A run of ``n`` 8-byte Sends with wr_ids from ``first`` (those in ``signaled``
    signaled, all if None)."""
    run = SendRun()
    for wr_id in range(first, first + n):
        flags = int(SendFlags.SIGNALED if signaled is None or wr_id in signaled else 0)
        run.add(wr_id, SendRun.ctrl(flags, False), flags, wr_id.to_bytes(8, "little"), 0)
    return run


@pytest.mark.usefixtures("engine_kernels")
def test_a_flush_completes_every_entry_of_a_run_with_its_wr_id_in_order() -> None:
    a = Host(crc=True)
    src = a.region(b"x" * 8)
    sge = (SGE(src.addr, 8, src.stag),)
    a.engine.post_send(SendJob(1, WROpcode.SEND, SendFlags.SIGNALED, sge, None, 8))
    a.engine.post_send(_run(10, 5, signaled={12}))
    a.engine.post_send(_run(20, 3, signaled=set()))
    assert a.engine.sq_depth == 9
    first = a.engine.produce(max_bytes=1)  # the Send alone
    a.engine.sent(sum(len(b) for b in first))
    assert a.engine.produce(max_bytes=1)  # the first run, handed over but not sent
    a.engine.set_error()
    assert [(w.wr_id, w.status) for w in a.send_wcs] == [(1, WCStatus.SUCCESS)] + [
        (i, WCStatus.WR_FLUSH_ERR) for i in [*range(10, 15), *range(20, 23)]
    ]
    assert a.engine.sq_depth == 0


@pytest.mark.usefixtures("engine_kernels")
def test_a_run_posted_in_error_is_flushed_entry_by_entry() -> None:
    a = Host(crc=True)
    a.engine.set_error()
    a.engine.post_send(_run(5, 3, signaled=set()))
    assert [(w.wr_id, w.status) for w in a.send_wcs] == [
        (i, WCStatus.WR_FLUSH_ERR) for i in range(5, 8)
    ]


@pytest.mark.usefixtures("engine_kernels")
@pytest.mark.parametrize("sig_all", [False, True])
def test_unsignaled_entries_complete_only_with_sq_sig_all(sig_all: bool) -> None:
    a, b = Host(crc=True), Host(crc=True)
    a.engine.sq_sig_all = sig_all
    rbuf = b.region(8 * 6)
    b.rq.extend(RecvJob(i, (SGE(rbuf.addr + 8 * i, 8, rbuf.stag),), 8) for i in range(6))
    a.engine.post_send(_run(0, 3, signaled={1}))
    a.engine.post_send(_run(3, 3, signaled=set()))
    pump(a, b, [4096])
    expected = list(range(6)) if sig_all else [1]
    assert [(w.wr_id, w.status) for w in a.send_wcs] == [(i, WCStatus.SUCCESS) for i in expected]
    assert [w.wr_id for w in b.recv_wcs] == list(range(6))
    assert bytes(rbuf.view) == b"".join(i.to_bytes(8, "little") for i in range(6))
    assert a.engine.sq_depth == 0


async def test_a_run_mixed_with_writes_reads_and_a_fence_completes_in_order() -> None:
    async with connected(prepare=post_receives(8), cap=CAP) as pair:
        client, server = pair.client, pair.server
        rights = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ
        target = server.pd.reg_mr(bytearray(b"remote!!" + bytes(8)), rights)
        src = client.pd.reg_mr(b"payload0", Access(0))
        sink = client.pd.reg_mr(bytearray(8), Access.LOCAL_WRITE)
        wrs = [
            SendWR(0, WROpcode.SEND, [b"send-0"], INLINE | SIG),
            SendWR(1, WROpcode.SEND, [b"send-1"], INLINE),
            SendWR(
                2, WROpcode.RDMA_READ, [sink.sge()], SIG, remote_addr=target.iova,
                rkey=target.rkey,
            ),
            SendWR(
                3, WROpcode.RDMA_WRITE, [src.sge()], SIG, remote_addr=target.iova + 8,
                rkey=target.rkey,
            ),
            # The fence holds this Send until the Read before it completed.
            SendWR(4, WROpcode.SEND, [b"send-4"], INLINE | SIG | SendFlags.FENCE),
            SendWR(5, WROpcode.SEND, [b"send-5"], INLINE),
            SendWR(6, WROpcode.SEND, [b"send-6"], INLINE | SIG),
        ]  # fmt: skip
        client.qp.post_send(wrs)
        sent = await drain(client.send_cq, 5)
        assert [(w.wr_id, w.status) for w in sent] == [
            (i, WCStatus.SUCCESS) for i in (0, 2, 3, 4, 6)
        ]
        assert bytes(sink.buf) == b"remote!!"
        assert bytes(target.buf) == b"remote!!payload0"
        got = await drain(server.recv_cq, 5)
        assert [(w.wr_id, w.byte_len) for w in got] == [(i, 6) for i in range(5)]
        data = bytes(pair.server_mr.buf)
        assert [data[64 * i : 64 * i + 6] for i in range(5)] == [
            b"send-0", b"send-1", b"send-4", b"send-5", b"send-6"
        ]  # fmt: skip


async def test_a_batch_longer_than_the_send_queue_is_refused_at_the_first_past_it() -> None:
    async with connected(
        prepare=post_receives(8), cap=QPCap(max_send_wr=4, max_inline_data=64)
    ) as pair:
        client, server = pair.client, pair.server
        batch = SendBatch(
            SendWR(i, WROpcode.SEND, [bytes([i]) * 4], INLINE | (SIG if i % 2 else 0))
            for i in range(6)
        )
        with pytest.raises(VerbsError) as info:
            client.qp.post_send_batch(batch)
        assert (info.value.errno, info.value.bad_wr) == (errno.ENOMEM, 4)
        sent = await drain(client.send_cq, 2)
        assert [(w.wr_id, w.status) for w in sent] == [(1, WCStatus.SUCCESS), (3, WCStatus.SUCCESS)]
        got = await drain(server.recv_cq, 4)
        assert [w.wr_id for w in got] == [0, 1, 2, 3]
        assert client.qp.state == QPState.RTS
        # The entries went out and completed: the whole queue is free again.
        client.qp.post_send_batch(batch, 4)
        assert [w.wr_id for w in await drain(client.send_cq, 2)] == [1, 3]


async def test_a_queue_holding_runs_counts_their_entries() -> None:
    async with connected(
        prepare=post_receives(8), cap=QPCap(max_send_wr=4, max_inline_data=64)
    ) as pair:
        client = pair.client
        client.qp.modify(qp_state=QPState.ERR)
        batch = SendBatch(SendWR(i, WROpcode.SEND, [b"q"], INLINE) for i in range(3))
        client.qp.post_send_batch(batch)  # flushed at once: every entry completes
        got = await drain(client.send_cq, 3)
        assert [(w.wr_id, w.status) for w in got] == [(i, WCStatus.WR_FLUSH_ERR) for i in range(3)]


async def test_a_run_overrunning_the_cq_reports_cq_err() -> None:
    async with connected(prepare=post_receives(8), cqe=4, cap=CAP) as pair:
        client = pair.client
        batch = SendBatch(SendWR(i, WROpcode.SEND, [b"over"], INLINE | SIG) for i in range(8))
        client.qp.post_send_batch(batch)
        with trio.fail_after(BOUND):
            event = await client.context.get_async_event()
        assert (event.event_type, event.element) == (AsyncEventType.CQ_ERR, client.send_cq)


async def test_receives_taken_in_a_run_that_stopped_go_back_in_order() -> None:
    """A run of Sends meets a receive too short for its message: the ones before complete,
    the short one fails (LOC_LEN_ERR), the ones after it are flushed in order."""

    def prepare(request):  # type: ignore[no-untyped-def]
        mr = request.pd.reg_mr(bytearray(64 * 4), Access.LOCAL_WRITE)
        sizes = [64, 64, 2, 64]
        request.qp.post_recv([RecvWR(i, [mr.sge(64 * i, sizes[i])]) for i in range(4)])
        return mr

    async with connected(prepare=prepare, cap=CAP) as pair:
        server = pair.server
        batch = SendBatch(SendWR(i, WROpcode.SEND, [b"four"], INLINE) for i in range(4))
        pair.client.qp.post_send_batch(batch)
        got = await drain(server.recv_cq, 4)
        assert [(w.wr_id, w.status) for w in got] == [
            (0, WCStatus.SUCCESS),
            (1, WCStatus.SUCCESS),
            (2, WCStatus.LOC_LEN_ERR),
            (3, WCStatus.WR_FLUSH_ERR),
        ]
