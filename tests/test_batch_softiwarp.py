"""The batch verbs on the built-in engine where its own rules show: a CQ overrun reads the
same through ``poll_into`` as through ``poll``; a batch of inline Sends posted by its
plan (one run, no per-entry checks) copies, limits and refuses as ``post_send`` does; a
CQ keeps a run of received Sends as columns and hands them out, whole or in part, between
other completions, as it would one by one."""

from __future__ import annotations

import errno
from collections.abc import Callable
from typing import Any

import pytest
import trio
from test_resources import BOUND, connected, drain, post_receives

from rdmashim import (
    Access,
    AsyncEventType,
    QPCap,
    RecvBatch,
    RecvWR,
    SendBatch,
    SendFlags,
    SendWR,
    VerbsError,
    WCArray,
    WCFlags,
    WCOpcode,
    WCStatus,
    WROpcode,
)
from rdmashim.providers.softiwarp import posting
from rdmashim.providers.softiwarp.native_wr import RecvPlan, SendPlan


async def test_poll_into_after_an_overrun_is_eoverflow() -> None:
    async with connected(prepare=post_receives(8), cqe=4) as pair:
        client = pair.client
        src = client.pd.reg_mr(b"overrun!", Access(0))
        batch = SendBatch(
            SendWR(i, WROpcode.SEND, [src.sge()], SendFlags.SIGNALED) for i in range(8)
        )
        client.qp.post_send_batch(batch)
        with trio.fail_after(BOUND):
            event = await client.context.get_async_event()
        assert (event.event_type, event.element) == (AsyncEventType.CQ_ERR, client.send_cq)
        cq = client.send_cq
        for poll in (lambda: cq.poll_into(WCArray(16)), lambda: cq.poll(16)):
            with pytest.raises(VerbsError) as info:
                poll()
            assert info.value.errno == errno.EOVERFLOW


@pytest.mark.usefixtures("python_engine")  # the Python provider's plans
async def test_a_batch_of_inline_sends_by_its_plan_is_post_send() -> None:
    cap = QPCap(max_send_wr=4, max_inline_data=16)
    async with connected(prepare=post_receives(24), cap=cap) as pair:
        client, server = pair.client, pair.server
        src = client.pd.reg_mr(bytearray(b"abcdefgh"), Access.LOCAL_WRITE)
        flags = SendFlags.INLINE
        batch = SendBatch(
            [
                SendWR(1, WROpcode.SEND, [src.sge(0, 2)], flags),
                SendWR(2, WROpcode.SEND, [src.sge(2, 3)], flags | SendFlags.SOLICITED),
                SendWR(3, WROpcode.SEND, [src.sge(5, 3)], flags | SendFlags.SIGNALED),
            ]
        )
        client.qp.post_send_batch(batch)  # finds the regions
        client.qp.post_send_batch(batch)  # by the plan
        plans = batch.prepared(id(client.qp.context.memory), None)._plans  # type: ignore[arg-type]
        assert set(plans) == {3} and plans[3] is not None
        src.buf[:] = b"ABCDEFGH"  # copied at each post: the next one sends these
        client.qp.post_send_batch(batch, 2)  # 1 and 2, unsignaled
        batch.set(0, wr_id=4, send_flags=flags | SendFlags.SIGNALED)
        client.qp.post_send_batch(batch)
        assert [w.wr_id for w in await drain(client.send_cq, 4)] == [3, 3, 4, 3]
        got = await drain(server.recv_cq, 11)
        assert [(w.status, w.byte_len, w.solicited) for w in got] == [
            (WCStatus.SUCCESS, n, sol)
            for n, sol in [(2, 0), (3, 1), (3, 0)] * 2 + [(2, 0), (3, 1), (2, 0), (3, 1), (3, 0)]
        ]
        placed = bytes(pair.server_mr.buf)
        assert [placed[64 * i : 64 * i + w.byte_len] for i, w in enumerate(got)] == [
            b"ab", b"cde", b"fgh", b"ab", b"cde", b"fgh", b"AB", b"CDE", b"AB", b"CDE", b"FGH"
        ]  # fmt: skip
        # Past the send queue: refused as post_send refuses the list (ENOMEM, bad_wr the
        # entry past max_send_wr), the entries before it go.
        five = SendBatch([batch[2]] * 5)
        with pytest.raises(VerbsError) as batched:
            client.qp.post_send_batch(five)
        assert (batched.value.errno, batched.value.bad_wr) == (errno.ENOMEM, 4)
        assert len(await drain(client.send_cq, 4)) == 4
        # Its region gone: refused as post_send refuses an inline SGE outside a region.
        src.close()
        with pytest.raises(VerbsError) as plain:
            client.qp.post_send(list(batch.wrs(range(3))))
        with pytest.raises(VerbsError) as batched:
            client.qp.post_send_batch(batch)
        assert (batched.value.errno, batched.value.bad_wr) == (plain.value.errno, 0)


async def test_a_run_of_receive_completions_polled_in_parts() -> None:
    n = 20
    async with connected(prepare=post_receives(2 * n), cap=QPCap(max_inline_data=16)) as pair:
        client, server = pair.client, pair.server
        src = client.pd.reg_mr(bytearray(range(8)), Access.LOCAL_WRITE)
        sink = client.pd.reg_mr(bytearray(8), Access.LOCAL_WRITE)
        client.qp.post_recv(RecvWR(0, [sink.sge()]))
        batch = SendBatch(
            SendWR(i, WROpcode.SEND, [src.sge(0, i % 7)], SendFlags.INLINE | flags)
            for i in range(n)
            for flags in [SendFlags.SOLICITED if i % 5 == 1 else SendFlags.NONE]
        )
        cq = server.recv_cq
        assert cq is server.send_cq
        client.qp.post_send_batch(batch)
        await until(lambda: len(cq) == n)
        # A completion between two runs stays in its place.
        server.qp.post_send(SendWR(77, WROpcode.SEND, [pair.server_mr.sge(0, 1)]))
        client.qp.post_send_batch(batch)  # the plan's way
        await until(lambda: len(cq) == 2 * n + 1)
        wcs = WCArray(3)
        got = []
        while len(cq) > 4:  # parts of runs into an array, and as WCs
            k = cq.poll_into(wcs)
            got += [wcs[i] for i in range(k)]
            got += cq.poll(2)
        k = cq.poll_into(WCArray(2 * n))
        assert k == len(cq) + k <= 4
        recv = [(i % 7, i % 5 == 1) for i in range(n)]
        expected = [(WCOpcode.RECV, *r) for r in recv]
        expected = [*expected, (WCOpcode.SEND, 0, False), *expected]
        assert [(w.opcode, w.byte_len, w.solicited) for w in got] == expected[: len(got)]
        assert len(got) + k == 2 * n + 1
        assert [w.wr_id for w in got if w.opcode == WCOpcode.RECV] == list(range(len(got) - 1))
        assert {(w.status, w.qp_num, w.wc_flags) for w in got} == {
            (WCStatus.SUCCESS, server.qp.qp_num, WCFlags.NONE)
        }


async def until(ready: Callable[[], bool]) -> None:
    """Wait for bytes in flight to be processed until ``ready()`` (nothing to wake on)."""
    with trio.fail_after(BOUND):
        while not ready():  # noqa: ASYNC110 - the engine's progress sets no event to wait on
            await trio.sleep(0.005)


async def test_a_receive_checked_before_is_checked_again_once_a_region_goes() -> None:
    async with connected(cap=QPCap(max_inline_data=16)) as pair:
        client, server = pair.client, pair.server
        sink = server.pd.reg_mr(bytearray(16), Access.LOCAL_WRITE)
        recvs = RecvBatch(RecvWR(i, [sink.sge(8 * i, 8)]) for i in range(2))
        batch = SendBatch(
            SendWR(i, WROpcode.SEND, [bytes([65 + i]) * 8], SendFlags.INLINE) for i in range(2)
        )
        server.qp.post_recv_batch(recvs)
        client.qp.post_send_batch(batch)  # a run: both receives checked (and kept so)
        assert [w.status for w in await drain(server.recv_cq, 2)] == [WCStatus.SUCCESS] * 2
        assert bytes(sink.buf) == b"A" * 8 + b"B" * 8
        server.qp.post_recv_batch(recvs)
        other = server.pd.reg_mr(bytearray(8), Access.LOCAL_WRITE)
        other.close()  # any region gone: what was checked is checked again
        sink.close()
        client.qp.post_send_batch(batch)
        got = await drain(server.recv_cq, 2)
        assert [(w.wr_id, w.status) for w in got] == [
            (0, WCStatus.LOC_PROT_ERR), (1, WCStatus.WR_FLUSH_ERR)
        ]  # fmt: skip


@pytest.mark.usefixtures("python_engine")  # the Python provider's plans
async def test_a_request_posted_again_keeps_its_template_while_unchanged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``post_send`` works a request out once (a template) and again only when one of
    the fields it was worked out from changed, however it changed (a field set, its
    ``sg_list`` edited in place); a request with raw inline bytes is worked out at every
    post. What goes out is always what the request says at the post."""
    made: list[int] = []
    make = posting.SendTemplate.__init__

    def counted(self: posting.SendTemplate, w: SendWR, *made_of: tuple[object, ...]) -> None:
        made.append(w.wr_id)
        make(self, w, *made_of)

    monkeypatch.setattr(posting.SendTemplate, "__init__", counted)
    async with connected(prepare=post_receives(24), cap=QPCap(max_inline_data=16)) as pair:
        client, server = pair.client, pair.server
        src = client.pd.reg_mr(bytearray(b"first...second.."), Access.LOCAL_WRITE)
        a = SendWR(1, WROpcode.SEND, [src.sge(0, 8)], SendFlags(0))
        b = SendWR(2, WROpcode.SEND, [src.sge(8, 8)], SendFlags.INLINE)
        raw = bytearray(b"raw")
        c = SendWR(3, WROpcode.SEND, [raw], SendFlags.INLINE)
        client.qp.post_send([a, b, c])
        client.qp.post_send([a, b, c])
        assert made == [1, 2, 3, 3]  # fails when templates are not kept
        a.sg_list = [src.sge(8, 8)]  # set
        b.sg_list[0] = src.sge(0, 5)  # type: ignore[index]  # edited in place
        raw[:] = b"new"
        client.qp.post_send([a, b, c])
        b.send_flags = SendFlags.INLINE | SendFlags.SIGNALED
        client.qp.post_send([a, b])
        assert made == [1, 2, 3, 3, 1, 2, 3, 2]
        # Flags back to those of before (RDS's slots, signaled or not) find the template
        # kept before; a third set of flags makes a new one (and the oldest is let go).
        b.send_flags = SendFlags.INLINE
        client.qp.post_send([a, b])
        b.send_flags = SendFlags.INLINE | SendFlags.SIGNALED
        client.qp.post_send([a, b])
        assert made == [1, 2, 3, 3, 1, 2, 3, 2]  # fails when only the last one is kept
        b.send_flags = SendFlags.INLINE | SendFlags.SOLICITED
        client.qp.post_send([a, b])
        b.send_flags = SendFlags.INLINE
        client.qp.post_send([a, b])
        assert made == [1, 2, 3, 3, 1, 2, 3, 2, 2, 2]
        assert [w.wr_id for w in await drain(client.send_cq, 2)] == [2, 2]
        got = await drain(server.recv_cq, 19)
        placed = bytes(pair.server_mr.buf)
        assert [placed[64 * w.wr_id : 64 * w.wr_id + w.byte_len] for w in got] == [
            b"first...", b"second..", b"raw", b"first...", b"second..", b"raw",
            b"second..", b"first", b"new", b"second..", b"first",
        ] + [b"second..", b"first"] * 4  # fmt: skip
        # A QP keeps a bounded number of them (requests made anew at each post: a new id).
        many = [SendWR(i, WROpcode.RDMA_READ, [src.sge(0, 1)] * 2) for i in range(1100)]
        with pytest.raises(VerbsError):  # two SGEs in a Read: refused after the templates
            client.qp.post_send(many)
        assert 0 < len(client.qp._templates) <= posting.TEMPLATES_KEPT


_SHORTCUT_CAP = QPCap(max_send_wr=8, max_inline_data=16)


def _four_byte_sends(client: Any, n: int) -> tuple[Any, SendBatch]:
    """A region of 16 bytes and a batch of ``n`` signaled Sends of its 4-byte pieces."""
    src = client.pd.reg_mr(bytearray(b"one.two.three..."), Access.LOCAL_WRITE)
    return src, SendBatch(
        SendWR(i, WROpcode.SEND, [src.sge(4 * i, 4)], SendFlags.SIGNALED) for i in range(n)
    )


async def test_an_entry_posted_alone_again_goes_out_as_it_is_now() -> None:
    """A batch's entry posted alone again, unchanged, goes straight to C (the native
    engine's ``SendPlan.singles``); one changed since goes out changed, one naming a
    region deregistered since is refused; what it was checked against is noted with it."""
    async with connected(prepare=post_receives(8), cap=_SHORTCUT_CAP) as pair:
        client, server = pair.client, pair.server
        src, batch = _four_byte_sends(client, 2)
        for _ in range(2):  # (the second time by the shortcut, where the engine has it)
            client.qp.post_send_batch(batch, indices=[1])
        batch.set(1, sg_list=[src.sge(8, 8)])
        client.qp.post_send_batch(batch, indices=[1])
        got = await drain(server.recv_cq, 3)
        placed = bytes(pair.server_mr.buf)
        assert [placed[64 * w.wr_id : 64 * w.wr_id + w.byte_len] for w in got] == [
            b"two.", b"two.", b"three..."
        ]  # fmt: skip
        await drain(client.send_cq, 3)
        other = client.pd.reg_mr(bytearray(b"spare..."), Access.LOCAL_WRITE)
        batch.set(0, sg_list=[other.sge()])
        client.qp.post_send_batch(batch, indices=[0])
        await drain(client.send_cq, 1)
        other.close()
        with pytest.raises(VerbsError) as info:
            client.qp.post_send_batch(batch, indices=[0])
        assert info.value.errno == errno.EINVAL
        inline = SendBatch([SendWR(5, WROpcode.SEND, [src.sge(0, 16)], SendFlags.INLINE)])
        client.qp.post_send_batch(inline, indices=[0])
        client.qp.post_send_batch(inline, indices=[0])
        await drain(server.recv_cq, 2)
        if hasattr(client.qp, "_plan_key"):  # the native engine: noted for these limits
            ((_, key), _array) = inline.prepared(SendPlan, SendPlan).singles[0]
            assert key == client.qp._plan_key and 16 in key  # (another max_inline: not it)


async def test_a_few_entries_posted_together_again_go_out_as_they_are_now() -> None:
    """A short list of a batch's entries posted together again, unchanged (an RDMA
    operation and the Send behind it), goes straight to C as one entry alone does
    (``SendPlan.singles``, under the indices' tuple); a change to one of them drops that
    note and the next post carries the change, a change to another entry keeps it, and
    a region deregistered since is refused."""
    async with connected(prepare=post_receives(8), cap=_SHORTCUT_CAP) as pair:
        client, server = pair.client, pair.server
        src, batch = _four_byte_sends(client, 3)
        native = hasattr(client.qp, "_plan_key")
        plan = batch.prepared(SendPlan, SendPlan)
        for _ in range(2):  # (the second time by the shortcut, where the engine has it)
            client.qp.post_send_batch(batch, indices=[2, 0])
        if native:
            assert (2, 0) in plan.singles
        batch.set(1, sg_list=[src.sge(0, 8)])
        client.qp.post_send_batch(batch, indices=[1])
        if native:
            assert (2, 0) in batch.prepared(SendPlan, SendPlan).singles  # (1 is not in it)
        batch.set(0, sg_list=[src.sge(8, 8)])
        if native:
            assert (2, 0) not in batch.prepared(SendPlan, SendPlan).singles
        client.qp.post_send_batch(batch, indices=[2, 0])
        got = await drain(server.recv_cq, 7)
        placed = bytes(pair.server_mr.buf)
        assert [placed[64 * w.wr_id : 64 * w.wr_id + w.byte_len] for w in got] == [
            b"thre", b"one.", b"thre", b"one.", b"one.two.", b"thre", b"three..."
        ]  # fmt: skip
        await drain(client.send_cq, 7)
        other = client.pd.reg_mr(bytearray(b"spare..."), Access.LOCAL_WRITE)
        batch.set(2, sg_list=[other.sge()])
        client.qp.post_send_batch(batch, indices=[2, 0])
        client.qp.post_send_batch(batch, indices=[2, 0])
        await drain(client.send_cq, 4)
        other.close()
        with pytest.raises(VerbsError) as info:
            client.qp.post_send_batch(batch, indices=[2, 0])
        assert info.value.errno == errno.EINVAL


async def test_a_receive_reposted_alone_again_takes_its_entry_as_it_is_now() -> None:
    """A receive batch's entry reposted alone as it completes (every ULP's receive ring):
    unchanged, it goes straight to C (the native engine's ``RecvPlan.singles``) and the
    next Send lands where it says; changed since, it lands where it says now; naming a
    region deregistered since, it is refused; what it was checked against is noted
    with it."""
    async with connected(prepare=post_receives(1)) as pair:
        client, server = pair.client, pair.server
        ring = client.pd.reg_mr(bytearray(64), Access.LOCAL_WRITE)
        src = server.pd.reg_mr(bytearray(b"one.two.three..."), Access(0))
        batch = RecvBatch([RecvWR(7, [ring.sge(0, 8)]), RecvWR(8, [ring.sge(8, 8)])])
        landed: list[tuple[int, bytes]] = []

        async def send_and_take(offset: int, length: int) -> None:
            server.qp.post_send(SendWR(0, WROpcode.SEND, [src.sge(offset, length)]))
            (wc,) = await drain(client.recv_cq, 1)
            wc.raise_for_status()
            at = 8 * (wc.wr_id - 7) if wc.wr_id in (7, 8) else 32
            landed.append((wc.wr_id, bytes(ring.buf[at : at + wc.byte_len])))

        for word in range(2):  # (the second time by the shortcut, where the engine has it)
            client.qp.post_recv_batch(batch, indices=[0])
            await send_and_take(4 * word, 4)
        native = hasattr(client.qp, "_recv_key")
        if native:
            ((_, key), _entry) = batch.prepared(RecvPlan, RecvPlan).singles[0]
            assert key == client.qp._recv_key
        batch.set(0, wr_id=9, sg_list=[ring.sge(32, 8)])
        client.qp.post_recv_batch(batch, indices=[0])
        await send_and_take(8, 8)
        assert landed == [(7, b"one."), (7, b"two."), (9, b"three...")]
        spare = client.pd.reg_mr(bytearray(8), Access.LOCAL_WRITE)
        batch.set(1, sg_list=[spare.sge()])
        client.qp.post_recv_batch(batch, indices=[1])
        server.qp.post_send(SendWR(0, WROpcode.SEND, [src.sge(0, 3)]))
        (wc,) = await drain(client.recv_cq, 1)
        assert (wc.wr_id, wc.byte_len, bytes(spare.buf[:3])) == (8, 3, b"one")
        spare.close()
        with pytest.raises(VerbsError) as info:
            client.qp.post_recv_batch(batch, indices=[1])
        assert info.value.errno == errno.EINVAL


async def test_an_entry_changed_at_every_post_leaves_the_others_as_they_were() -> None:
    """A batch one entry of which changes before each post (RDS's RDMA Write, NFS's reply
    length): the others keep their shortcut and the checks stay right. The native plan's
    summary follows the changed entry; one it overstates (a key no entry names any more,
    of a region deregistered since) is made anew at the next post, not refused."""
    async with connected(prepare=post_receives(8)) as pair:
        client, server = pair.client, pair.server
        a = client.pd.reg_mr(bytearray(b"aaaa"), Access.LOCAL_WRITE)
        b = client.pd.reg_mr(bytearray(b"bbbb"), Access.LOCAL_WRITE)
        batch = SendBatch(
            [SendWR(0, WROpcode.SEND, [a.sge()]), SendWR(1, WROpcode.SEND, [b.sge()])]
        )
        batch.set(0, send_flags=SendFlags.SIGNALED)
        batch.set(1, send_flags=SendFlags.SIGNALED)
        client.qp.post_send_batch(batch, indices=[0])
        client.qp.post_send_batch(batch, indices=[0])
        native = hasattr(client.qp, "_plan_key")
        plan = batch.prepared(SendPlan, SendPlan) if native else None
        kept = plan.singles.get(0) if plan is not None else None
        batch.set(1, sg_list=[a.sge(0, 2)])  # entry 1 now names region a only
        if plan is not None:
            assert batch.prepared(SendPlan, SendPlan) is plan and plan.singles.get(0) is kept
        gone = b.sge()
        b.close()
        client.qp.post_send_batch(batch)  # both: b is named by none, so none is refused
        if plan is not None:
            assert plan._summary is not None and not plan._summary.loose
            assert plan._summary.keys == {a.sge().lkey}
        got = await drain(server.recv_cq, 4)
        placed = bytes(pair.server_mr.buf)
        assert [placed[64 * w.wr_id : 64 * w.wr_id + w.byte_len] for w in got] == [
            b"aaaa", b"aaaa", b"aaaa", b"aa"
        ]  # fmt: skip
        batch.set(1, sg_list=[gone])
        with pytest.raises(VerbsError) as info:  # a region gone since: refused, not sent
            client.qp.post_send_batch(batch, indices=[1])
        assert info.value.errno == errno.EINVAL
        await drain(client.send_cq, 4)
