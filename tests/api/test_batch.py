"""The batch verbs: ``SendBatch``/``RecvBatch`` posted with one call, completions polled
into a ``WCArray``. Each must mean exactly what the plain API means for the same list of
work requests: the same bytes, completions, order, ``bad_wr`` and errors."""

from __future__ import annotations

import errno
from typing import Any

import pytest
import trio
from api.support import SIG, TIMEOUT, Cm, Pair, drain, ok, pattern, quiet

from rdmashim import (
    SGE,
    QPCap,
    RecvBatch,
    RecvWR,
    SendBatch,
    SendFlags,
    SendWR,
    VerbsError,
    WCArray,
    WCOpcode,
    WCStatus,
    WROpcode,
)

INLINE = SendFlags.INLINE


def shape(wcs: list[Any]) -> list[tuple[int, WCStatus, WCOpcode, int]]:
    """What two equivalent posts must complete alike (QP numbers aside)."""
    return [(w.wr_id, w.status, w.opcode, w.byte_len) for w in wcs]


async def drain_into(cq: Any, n: int, size: int = 7) -> list[Any]:
    """Exactly ``n`` completions through ``poll_wait_into`` (an array of ``size``)."""
    wcs = WCArray(size)
    out: list[Any] = []
    with trio.fail_after(TIMEOUT):
        while len(out) < n:
            k = await cq.poll_wait_into(wcs, n - len(out))
            assert 1 <= k <= min(size, n - len(out))
            out += [wcs[i] for i in range(k)]
    return out


async def inline_pair(cm: Cm, need: int = 64) -> Pair:
    limit = (await cm.device_attr()).max_inline_data
    if limit < need:
        pytest.skip(f"the device has max_inline_data={limit}")
    return await cm.pair(cap=QPCap(max_send_wr=64, max_recv_wr=64, max_inline_data=need))


async def test_send_batch_is_the_list_posted(pair: Pair) -> None:
    client, server = pair.client, pair.server
    src = client.reg(pattern(300, 1))
    dst = server.reg(300)
    wrs = [
        SendWR(1, WROpcode.SEND, [src.sge(0, 100)], SIG),
        SendWR(2, WROpcode.RDMA_WRITE, [src.sge(100, 100)], SIG, dst.addr, dst.rkey),
        SendWR(3, WROpcode.SEND, [src.sge(200, 100)], SendFlags.NONE),
        SendWR(4, WROpcode.SEND, [], SIG),
    ]
    rbuf = server.reg(3 * 128)
    server.post_recvs(rbuf, 3, 128)
    client.qp.post_send(wrs)
    plain_sent = ok(await drain(client.send_cq, 3))
    plain_recv = ok(await drain(server.recv_cq, 3))
    first = bytes(rbuf.buf)
    rbuf.buf[:] = bytes(len(rbuf.buf))
    dst.buf[:] = bytes(300)
    server.post_recvs(rbuf, 3, 128)
    client.qp.post_send_batch(SendBatch(wrs))
    batch_sent = ok(await drain(client.send_cq, 3))
    assert shape(batch_sent) == shape(plain_sent) and [w.wr_id for w in batch_sent] == [1, 2, 4]
    assert shape(await drain(server.recv_cq, 3)) == shape(plain_recv)
    assert bytes(rbuf.buf[:128]) == first[:128] == pattern(300, 1)[:100] + bytes(28)
    assert bytes(rbuf.buf[128:228]) == pattern(300, 1)[200:]
    assert bytes(dst.buf[:100]) == pattern(300, 1)[100:200]


async def test_a_prepared_batch_posted_many_times(pair: Pair) -> None:
    client, server = pair.client, pair.server
    n, rounds = 8, 40
    src = client.reg(pattern(n * 16, 2))
    sends = SendBatch(
        SendWR(i, WROpcode.SEND, [src.sge(i * 16, 16)], SIG if i == n - 1 else SendFlags.NONE)
        for i in range(n)
    )
    rbuf = server.reg(2 * n * 16)
    recvs = RecvBatch(RecvWR(i, [rbuf.sge(i * 16, 16)]) for i in range(2 * n))
    server.qp.post_recv_batch(recvs)
    wcs = WCArray(2 * n)
    for r in range(rounds):
        client.qp.post_send_batch(sends)
        (done,) = ok(await drain(client.send_cq, 1))
        assert done.wr_id == n - 1
        got = 0
        with trio.fail_after(TIMEOUT):
            while got < n:
                k = await server.recv_cq.poll_wait_into(wcs, n - got)
                assert wcs.status[:k] == [WCStatus.SUCCESS] * k
                assert wcs.opcode[:k] == [WCOpcode.RECV] * k
                ids = wcs.wr_id[:k]
                # Receives complete in posting order: this round's half of the ring.
                half = (r % 2) * n
                assert ids == list(range(half + got, half + got + k)), (r, ids)
                for j in ids:
                    assert (
                        bytes(rbuf.buf[j * 16 : j * 16 + 16])
                        == pattern(n * 16, 2)[(j % n) * 16 : (j % n) * 16 + 16]
                    )
                server.qp.post_recv_batch(recvs, indices=ids)
                got += k
    assert await quiet(server.recv_cq) == []


async def test_count_and_indices_select_entries(pair: Pair) -> None:
    client, server = pair.client, pair.server
    src = client.reg(b"abcdefgh")
    batch = SendBatch(SendWR(i, WROpcode.SEND, [src.sge(i, 1)], SIG) for i in range(8))
    rbuf = server.reg(8)
    recvs = RecvBatch(RecvWR(10 + i, [rbuf.sge(i, 1)]) for i in range(8))
    server.qp.post_recv_batch(recvs, 3)
    server.qp.post_recv_batch(recvs, indices=[4, 4])  # one entry twice: two receives
    client.qp.post_send_batch(batch, 2)
    client.qp.post_send_batch(batch, indices=[7, 3, 3])
    assert [w.wr_id for w in ok(await drain(client.send_cq, 5))] == [0, 1, 7, 3, 3]
    assert [w.wr_id for w in ok(await drain(server.recv_cq, 5))] == [10, 11, 12, 14, 14]
    assert bytes(rbuf.buf[:5]) == b"abh\0d"
    client.qp.post_send_batch(batch, 0)
    client.qp.post_send_batch(batch, indices=[])
    for bad in ({"count": 9}, {"count": -1}, {"indices": [8]}, {"indices": [-1]}):
        with pytest.raises(VerbsError) as info:
            client.qp.post_send_batch(batch, **bad)
        assert info.value.errno == errno.EINVAL and info.value.bad_wr is None
    with pytest.raises(VerbsError) as info:
        server.qp.post_recv_batch(recvs, 1, indices=[0])
    assert info.value.errno == errno.EINVAL
    assert await quiet(client.send_cq) == []


async def _post_refused(cm: Cm, post: Any) -> tuple[Any, ...]:
    """Post five Sends whose fourth has more SGEs than the device allows, on a new pair:
    the refusal (errno, bad_wr) if the post raised, and the completions that follow."""
    pair = await cm.pair()
    client, server = pair.client, pair.server
    attr = client.ctx.query_device()
    mr = client.reg(64)
    wrs = [SendWR(i, WROpcode.SEND, [mr.sge(i, 1)], SIG) for i in range(5)]
    wrs[3] = SendWR(3, WROpcode.SEND, [mr.sge(i, 1) for i in range(attr.max_sge + 1)], SIG)
    server.post_recvs(server.reg(64), 8, 8)
    try:
        post(client.qp, wrs)
    except VerbsError as exc:
        refused = (exc.errno, exc.bad_wr)
        done = await drain(client.send_cq, exc.bad_wr or 0)  # those before it went
        # What is posted works on: the fixed request, by itself.
        batch = SendBatch(wrs)
        batch.set(3, sg_list=[mr.sge(3, 1)])
        client.qp.post_send_batch(batch, indices=[3])
        done += await drain(client.send_cq, 1)
    else:  # kernel siw takes the list and fails the request later, and the connection
        return None, []
    return refused, [(w.wr_id, w.status) for w in done]


async def test_a_refused_entry_is_bad_wr_and_those_before_go(cm: Cm) -> None:
    plain = await _post_refused(cm, lambda qp, wrs: qp.post_send(wrs))
    batched = await _post_refused(cm, lambda qp, wrs: qp.post_send_batch(SendBatch(wrs)))
    assert batched == plain
    if plain[0] is not None:
        assert plain[0][1] == 3 and plain[1] == [(i, WCStatus.SUCCESS) for i in (0, 1, 2, 3)]
        # With indices, bad_wr is the position in the list the indices make.
        picked = await _post_refused(
            cm, lambda qp, wrs: qp.post_send_batch(SendBatch(wrs), indices=[4, 3, 0])
        )
        assert picked == ((plain[0][0], 1), [(4, WCStatus.SUCCESS), (3, WCStatus.SUCCESS)])


async def test_a_full_receive_queue_refuses_the_rest(cm: Cm) -> None:
    pair = await cm.pair(cap=QPCap(max_send_wr=8, max_recv_wr=4))
    client, server = pair.client, pair.server
    cap = server.qp.query().cap.max_recv_wr
    rbuf = server.reg(8 * (cap + 2))
    wrs = [RecvWR(i, [rbuf.sge(i * 8, 8)]) for i in range(cap + 2)]
    src = client.reg(b"x")
    refusals = []
    for post in (server.qp.post_recv, lambda w: server.qp.post_recv_batch(RecvBatch(w))):
        with pytest.raises(VerbsError) as info:
            post(wrs)
        refusals.append((info.value.errno, info.value.bad_wr))
        # The ones before were posted: as many sends as the queue holds all complete.
        client.qp.post_send([SendWR(i, WROpcode.SEND, [src.sge()], SIG) for i in range(cap)])
        assert [w.wr_id for w in ok(await drain(server.recv_cq, cap))] == list(range(cap))
        ok(await drain(client.send_cq, cap))
    assert refusals[0] == refusals[1] and refusals[0][1] == cap


async def test_batch_entries_change_in_place(pair: Pair) -> None:
    client, server = pair.client, pair.server
    src = client.reg(b"0123456789")
    batch = SendBatch([SendWR(1, WROpcode.SEND, [src.sge(0, 2)], SIG)])
    assert batch[0].sg_list == (src.sge(0, 2),) and len(batch) == 1
    rbuf = server.reg(30)
    recvs = RecvBatch([RecvWR(1, [rbuf.sge(0, 10)])])
    for k in range(3):
        recvs.set(0, wr_id=100 + k, sg_list=[rbuf.sge(10 * k, 10)])
        server.qp.post_recv_batch(recvs)
        batch.set(0, wr_id=50 + k, sg_list=[src.sge(k, 3)])
        client.qp.post_send_batch(batch)
    batch[0] = SendWR(9, WROpcode.SEND, [src.sge(0, 1)], SendFlags.NONE)  # not posted
    assert [w.wr_id for w in ok(await drain(client.send_cq, 3))] == [50, 51, 52]
    got = ok(await drain(server.recv_cq, 3))
    assert [(w.wr_id, w.byte_len) for w in got] == [(100, 3), (101, 3), (102, 3)]
    assert bytes(rbuf.buf[0:3]) + bytes(rbuf.buf[10:13]) + bytes(rbuf.buf[20:23]) == b"012123234"


async def test_inline_data_is_copied_at_each_post(cm: Cm) -> None:
    pair = await inline_pair(cm)
    client, server = pair.client, pair.server
    rbuf = server.reg(4 * 64)
    server.post_recvs(rbuf, 4, 64)
    data = bytearray(b"first version...")
    src = client.reg(b"from a region!!!")
    batch = SendBatch(
        [
            SendWR(1, WROpcode.SEND, [data], SIG | INLINE),
            SendWR(2, WROpcode.SEND, [src.sge()], SIG | INLINE),
        ]
    )
    client.qp.post_send_batch(batch)
    data[:5] = b"SECND"  # after posting: not what was sent, but what goes next time
    src.buf[:4] = b"FROM"
    client.qp.post_send_batch(batch)
    data[:5] = b"THIRD"
    src.buf[:4] = b"XXXX"
    ok(await drain(client.send_cq, 4))
    got = ok(await drain(server.recv_cq, 4))
    sent = [bytes(rbuf.buf[i * 64 : i * 64 + w.byte_len]) for i, w in enumerate(got)]
    assert sent == [
        b"first version...", b"from a region!!!", b"SECND version...", b"FROM a region!!!"
    ]  # fmt: skip


async def test_inline_limit_is_checked_at_each_post(cm: Cm) -> None:
    pair = await inline_pair(cm, 16)
    client = pair.client
    batch = SendBatch([SendWR(1, WROpcode.SEND, [bytes(16)], SIG | INLINE)] * 2)
    pair.server.post_recvs(pair.server.reg(64), 4, 16)
    client.qp.post_send_batch(batch)
    ok(await drain(client.send_cq, 2))
    limit = client.qp.query().cap.max_inline_data
    past = SendWR(1, WROpcode.SEND, [bytes(limit + 1)], SIG | INLINE)
    batch[1] = past  # past the QP's max_inline_data now
    with pytest.raises(VerbsError) as plain:
        client.qp.post_send([past])
    with pytest.raises(VerbsError) as batched:
        client.qp.post_send_batch(batch, indices=[1])
    assert (batched.value.errno, batched.value.bad_wr) == (plain.value.errno, 0)


async def _outcome(cm: Cm, post: str, inline: bool) -> tuple[object, ...]:
    """Post a Send from a region deregistered after the batch was made (and posted once):
    what the plain API or the batch gives for it (the exception, or the completion)."""
    pair = await (inline_pair(cm, 16) if inline else cm.pair())
    client, server = pair.client, pair.server
    server.post_recvs(server.reg(64), 2, 32)
    gone = client.reg(b"payload!")
    flags = SIG | INLINE if inline else SIG
    wr = SendWR(7, WROpcode.SEND, [gone.sge()], flags)
    batch = SendBatch([wr])
    client.qp.post_send_batch(batch)
    ok(await drain(client.send_cq, 1))
    gone.close()
    try:
        client.qp.post_send_batch(batch) if post == "batch" else client.qp.post_send(wr)
    except VerbsError as exc:
        return ("refused", exc.errno, exc.bad_wr)
    (wc,) = await drain(client.send_cq, 1)
    return ("completed", wc.wr_id, wc.status)


async def test_an_entry_changed_after_a_post_at_indices_is_posted_as_changed(pair: Pair) -> None:
    """A receive batch posted at indices, then changed in one entry: the next post at
    indices takes the new entry (a backend keeping the batch packed packs it again)."""
    client, server = pair.client, pair.server
    src = client.reg(b"abcd")
    rbuf = server.reg(8)
    recvs = RecvBatch(RecvWR(20 + i, [rbuf.sge(i, 1)]) for i in range(4))
    server.qp.post_recv_batch(recvs, indices=[2, 0])
    recvs[0] = RecvWR(30, [rbuf.sge(6, 1)])
    server.qp.post_recv_batch(recvs, indices=[0, 3])
    client.qp.post_send([SendWR(i, WROpcode.SEND, [src.sge(i, 1)], SIG) for i in range(4)])
    assert [w.wr_id for w in ok(await drain(server.recv_cq, 4))] == [22, 20, 30, 23]
    assert bytes(rbuf.buf) == b"b\0ad\0\0c\0"


async def test_a_send_batch_posted_at_the_same_indices_sends_what_its_entries_say_now(
    pair: Pair,
) -> None:
    """A send batch posted twice at the same two indices, one of them changed between
    (its length, as a session's slot takes a message of another size): the second post
    sends the changed entry. (The native engine kept the pair's packed form when it was
    the only list noted: RDS over veth saw a Send shorter than its header.)"""
    client, server = pair.client, pair.server
    src = client.reg(b"abcdefgh")
    rbuf = server.reg(4 * 8)
    server.post_recvs(rbuf, 4, 8)
    batch = SendBatch(SendWR(i, WROpcode.SEND, [src.sge(2 * i, 2)], SIG) for i in range(2))
    client.qp.post_send_batch(batch, indices=[0, 1])
    batch.set(1, sg_list=[src.sge(2, 5)])
    client.qp.post_send_batch(batch, indices=[0, 1])
    ok(await drain(client.send_cq, 4))
    got = ok(await drain(server.recv_cq, 4))
    sent = [bytes(rbuf.buf[i * 8 : i * 8 + w.byte_len]) for i, w in enumerate(got)]
    assert sent == [b"ab", b"cd", b"ab", b"cdefg"]


async def test_a_receive_batch_posted_one_index_at_a_time(pair: Pair) -> None:
    """Entries posted one at a time by index, as a server reposts each receive as it
    completes: each message lands in the entry posted, and completes with its wr_id."""
    client, server = pair.client, pair.server
    src = client.reg(b"wxyz")
    rbuf = server.reg(8)
    recvs = RecvBatch(RecvWR(40 + i, [rbuf.sge(2 * i, 2)]) for i in range(4))
    for i in (3, 1, 2):
        server.qp.post_recv_batch(recvs, indices=[i])
    client.qp.post_send([SendWR(i, WROpcode.SEND, [src.sge(i, 1)], SIG) for i in range(3)])
    assert [w.wr_id for w in ok(await drain(server.recv_cq, 3))] == [43, 41, 42]
    assert bytes(rbuf.buf) == b"\0\0x\0y\0w\0"


async def test_a_list_posted_again_sends_what_its_requests_say_now(pair: Pair) -> None:
    """The same list of the same request objects posted three times, one request
    changed in place between posts: each post sends what the requests say then (a
    backend keeping a list's packed form packs it again when a request changed)."""
    client, server = pair.client, pair.server
    src = client.reg(b"abcdefgh")
    rbuf = server.reg(6 * 8)
    server.post_recvs(rbuf, 6, 8)
    first = SendWR(1, WROpcode.SEND, [src.sge(0, 2)], SIG)
    wrs = [first, SendWR(2, WROpcode.SEND, [src.sge(2, 2)], SIG)]
    client.qp.post_send(wrs)
    client.qp.post_send(wrs)
    first.wr_id, first.sg_list = 3, [src.sge(4, 3)]
    client.qp.post_send(wrs)
    assert [w.wr_id for w in ok(await drain(client.send_cq, 6))] == [1, 2, 1, 2, 3, 2]
    got = ok(await drain(server.recv_cq, 6))
    sent = [bytes(rbuf.buf[i * 8 : i * 8 + w.byte_len]) for i, w in enumerate(got)]
    assert sent == [b"ab", b"cd", b"ab", b"cd", b"efg", b"cd"]


@pytest.mark.parametrize("inline", [False, True], ids=["sge", "inline"])
async def test_deregistered_region_between_posts(cm: Cm, inline: bool) -> None:
    batched = await _outcome(cm, "batch", inline)
    assert batched == await _outcome(cm, "plain", inline)
    if not inline:  # inline data may be copied from the address without the key (rdma-core)
        assert batched[0] == "refused" or batched[2] != WCStatus.SUCCESS, batched


async def test_srq_batch(cm: Cm) -> None:
    pair = await cm.pair(srq=True)
    client, server = pair.client, pair.server
    rbuf = server.reg(8 * 8)
    recvs = RecvBatch(RecvWR(i, [rbuf.sge(i * 8, 8)]) for i in range(8))
    server.srq.post_recv_batch(recvs, 4)
    server.srq.post_recv_batch(recvs, indices=[6, 5])
    src = client.reg(pattern(6 * 8, 3))
    client.qp.post_send([SendWR(i, WROpcode.SEND, [src.sge(i * 8, 8)], SIG) for i in range(6)])
    got = ok(await drain_into(server.recv_cq, 6))
    assert [w.wr_id for w in got] == [0, 1, 2, 3, 6, 5]
    assert bytes(rbuf.buf[48:56]) == pattern(48, 3)[32:40]
    with pytest.raises(VerbsError) as info:
        server.srq.post_recv_batch(recvs, 9)
    assert info.value.errno == errno.EINVAL


async def test_poll_into_smaller_and_larger_arrays_and_mixed_with_poll(pair: Pair) -> None:
    client, server = pair.client, pair.server
    n = 12
    src = client.reg(pattern(n, 4))
    server.post_recvs(server.reg(n * 4), n, 4)
    client.qp.post_send([SendWR(i, WROpcode.SEND, [src.sge(i, 1)], SIG) for i in range(n)])
    sent = ok(await drain(client.send_cq, n))
    assert [w.wr_id for w in sent] == list(range(n))
    with trio.fail_after(TIMEOUT):
        while len(server.recv_cq) < n:  # noqa: ASYNC110 (polled: nothing may be taken yet)
            await trio.sleep(0.01)
    small, large = WCArray(3), WCArray(50)
    assert server.recv_cq.poll_into(small) == 3
    first = [small[i] for i in range(3)]
    (fourth,) = server.recv_cq.poll(1)
    assert server.recv_cq.poll_into(large, 2) == 2
    assert large.byte_len[:2] == [1, 1] and large.qp_num[:2] == [server.qp.qp_num] * 2
    assert server.recv_cq.poll_into(large) == n - 6
    assert server.recv_cq.poll_into(large) == 0
    ids = [w.wr_id for w in first] + [fourth.wr_id] + large.wr_id[: n - 6]
    assert ids == [0, 1, 2, 3, *range(6, n)]
    assert first[1] == fourth._replace(wr_id=1) and first[1].solicited is False
    assert await quiet(server.recv_cq) == []


async def test_a_poll_for_none_or_fewer_takes_none(pair: Pair) -> None:
    """``num_entries`` 0 or below takes no completion (as ``ibv_poll_cq``) and leaves
    the queued ones, in order, for the next poll."""
    client, server = pair.client, pair.server
    server.post_recvs(server.reg(16), 4, 4)
    src = client.reg(pattern(4, 6))
    client.qp.post_send([SendWR(i, WROpcode.SEND, [src.sge(i, 1)], SIG) for i in range(4)])
    ok(await drain(client.send_cq, 4))
    with trio.fail_after(TIMEOUT):
        while len(server.recv_cq) < 4:  # noqa: ASYNC110 (polled: nothing may be taken yet)
            await trio.sleep(0.01)
    wcs = WCArray(8)
    for n in (0, -1, -100):
        assert server.recv_cq.poll(n) == []
        assert server.recv_cq.poll_into(wcs, n) == 0
    assert server.recv_cq.poll_into(wcs) == 4
    assert wcs.wr_id[:4] == [0, 1, 2, 3]
    assert server.recv_cq.poll_into(wcs, -1) == 0 and server.recv_cq.poll(-1) == []


async def test_poll_wait_into_waits(pair: Pair) -> None:
    client, server = pair.client, pair.server
    server.post_recvs(server.reg(64), 2, 32)
    wcs = WCArray(4)
    got: list[int] = []

    async def waiter() -> None:
        got.append(await server.recv_cq.poll_wait_into(wcs))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.sleep(0.05)
        assert got == []
        client.qp.post_send(
            SendWR(1, WROpcode.SEND, [client.reg(b"hi").sge()], SIG | SendFlags.SOLICITED)
        )
    assert got == [1]
    wc = wcs[0]
    assert (wc.wr_id, wc.status, wc.opcode, wc.byte_len) == (0, WCStatus.SUCCESS, WCOpcode.RECV, 2)


async def test_closed_qp_and_cq_refuse_as_the_plain_calls_do(pair: Pair) -> None:
    client = pair.client
    src = client.reg(b"x")
    wr = SendWR(1, WROpcode.SEND, [src.sge()], SIG)
    batch, recvs = SendBatch([wr]), RecvBatch([RecvWR(1, [src.sge()])])
    client.qp.close()
    for plain, batched in (
        (lambda: client.qp.post_send(wr), lambda: client.qp.post_send_batch(batch)),
        (lambda: client.qp.post_recv(recvs[0]), lambda: client.qp.post_recv_batch(recvs)),
    ):
        with pytest.raises(VerbsError) as a:
            plain()
        with pytest.raises(VerbsError) as b:
            batched()
        assert a.value.errno == b.value.errno
    cq = client.send_cq
    cq.close()
    with pytest.raises(VerbsError) as a:
        cq.poll(1)
    with pytest.raises(VerbsError) as b:
        cq.poll_into(WCArray(1))
    assert a.value.errno == b.value.errno
    with pytest.raises(VerbsError) as b:
        await cq.poll_wait_into(WCArray(1))
    assert a.value.errno == b.value.errno


def test_batch_and_array_values() -> None:
    wrs = [SendWR(1, WROpcode.SEND, [SGE(1, 2, 3)]), SendWR(2, WROpcode.RDMA_WRITE, [b"x"])]
    batch = SendBatch(wrs)
    wrs[0].wr_id = 99  # copied: the batch keeps what it was given
    assert [w.wr_id for w in (batch[0], batch[1])] == [1, 2]
    copy = batch[1]
    copy.rkey = 5
    assert batch[1].rkey == 0
    with pytest.raises(ValueError):
        WCArray(0)
    wcs = WCArray(2)
    assert len(wcs) == 2 and wcs[1].status == WCStatus.SUCCESS


@pytest.mark.parametrize("k", [1, 2, 5])
def test_array_fill_stores_rows_field_by_field(k: int) -> None:
    """``fill`` (what backends store polled completions with) puts each row's fields in
    its entry from ``start`` on, one row as many; a row of the wrong width is refused."""
    from rdmashim import WC, WCFlags

    rows = [
        WC(10 + i, WCStatus.REM_ACCESS_ERR, WCOpcode.RDMA_READ, i, 7, WCFlags.WITH_IMM, 3, 4,
           True, 9 + i, 11)
        for i in range(k)
    ]  # fmt: skip
    wcs = WCArray(k + 2)
    wcs.fill(rows, 1)
    assert [wcs[i] for i in range(1, k + 1)] == rows
    assert wcs[0] == WCArray(1)[0] and wcs[k + 1] == WCArray(1)[0]  # untouched
    with pytest.raises(ValueError):
        wcs.fill([tuple(rows[0])[:-1]] * k)
