"""Completion handlers: ``cq.set_handler(fn)`` / ``create_cq(..., handler=fn)``.

After ``req_notify`` arms a CQ, the next (solicited) completion calls the handler
once with the CQ; the handler polls, posts and re-arms. An exception in it is
logged and moves the QPs completing into the CQ to ERR. A CQ takes a channel or a
handler, never both.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable
from typing import Any

import pytest
import trio
from api.support import QUIET, SIG, TIMEOUT, Cm, Pair, drain, is_linux_siw, ok

from rdmashim import QPState, RecvWR, SendFlags, SendWR, VerbsError, WCArray, WCStatus, WROpcode


async def until(predicate: Callable[[], bool]) -> None:
    """Wait until ``predicate()`` holds (checked every millisecond, bounded by TIMEOUT)."""
    with trio.fail_after(TIMEOUT):
        while not predicate():  # noqa: ASYNC110 (the handler runs elsewhere: nothing to await)
            await trio.sleep(0.001)


class Counter:
    """A handler that only counts its calls (it neither polls nor re-arms)."""

    def __init__(self) -> None:
        self.calls: list[Any] = []

    def __call__(self, cq: Any) -> None:
        self.calls.append(cq)


async def test_handler_called_once_per_arming(cm: Cm) -> None:
    pair = await cm.pair()
    client, server = pair.client, pair.server
    cq = server.recv_cq
    handler = Counter()
    cq.set_handler(handler)
    assert cq.handler is handler
    server.post_recvs(server.reg(4 * 16), 4, 16)
    msg = client.reg(b"m")
    client.qp.post_send(SendWR(0, WROpcode.SEND, [msg.sge()], SIG))
    ok(await drain(client.send_cq, 1))
    await until(lambda: len(cq) == 1)
    await trio.sleep(QUIET)
    assert handler.calls == []  # not armed: no call
    cq.req_notify()
    client.qp.post_send([SendWR(i, WROpcode.SEND, [msg.sge()], SIG) for i in (1, 2)])
    ok(await drain(client.send_cq, 2))
    await until(lambda: len(cq) == 3)
    await trio.sleep(QUIET)
    assert handler.calls == [cq]  # two completions, one arming: one call
    cq.req_notify()
    client.qp.post_send(SendWR(3, WROpcode.SEND, [msg.sge()], SIG))
    await until(lambda: len(handler.calls) == 2)
    assert [w.wr_id for w in ok(await drain(cq, 4))] == [0, 1, 2, 3]


async def test_solicited_only_arming_calls_for_a_solicited_send(cm: Cm) -> None:
    pair = await cm.pair()
    client, server = pair.client, pair.server
    cq = server.recv_cq
    handler = Counter()
    cq.set_handler(handler)
    server.post_recvs(server.reg(64), 2, 32)
    msg = client.reg(b"hi")
    cq.req_notify(solicited_only=True)
    client.qp.post_send(SendWR(1, WROpcode.SEND, [msg.sge()], SIG))
    ok(await drain(client.send_cq, 1))
    await until(lambda: len(cq) == 1)
    await trio.sleep(QUIET)
    assert handler.calls == []
    client.qp.post_send(SendWR(2, WROpcode.SEND, [msg.sge()], SIG | SendFlags.SOLICITED))
    await until(lambda: len(cq) == 2)
    if is_linux_siw(server.ctx.query_device()):
        await trio.sleep(QUIET)
        if not handler.calls:
            pytest.xfail("kernel siw raises no solicited-only event for a receive (test_cq.py)")
    await until(lambda: len(handler.calls) == 1)
    assert [w.wr_id for w in ok(await drain(cq, 2))] == [0, 1]


class Echo:
    """A handler answering each received message with a Send of the same bytes, from
    inside the handler, re-posting the receive there too (a batch-verbs loop)."""

    def __init__(self, end: Any, slots: int, size: int) -> None:
        self.end = end
        self.size = size
        self.rbuf = end.reg(slots * size)
        self.sbuf = end.reg(slots * size)
        self.wcs = WCArray(slots)
        self.echoed = 0
        self.errors: list[Any] = []
        end.post_recvs(self.rbuf, slots, size)

    def __call__(self, cq: Any) -> None:
        while True:
            n = cq.poll_into(self.wcs)
            if not n:
                cq.req_notify()
                n = cq.poll_into(self.wcs)  # what came before the arming
                if not n:
                    return
            for i in range(n):
                wc = self.wcs[i]
                if wc.status != WCStatus.SUCCESS:
                    self.errors.append(wc)
                    continue
                if wc.opcode.name != "RECV":
                    continue
                base = wc.wr_id * self.size
                self.sbuf.buf[base : base + wc.byte_len] = self.rbuf.buf[base : base + wc.byte_len]
                self.end.qp.post_recv(RecvWR(wc.wr_id, [self.rbuf.sge(base, self.size)]))
                self.end.qp.post_send(
                    SendWR(wc.wr_id, WROpcode.SEND, [self.sbuf.sge(base, wc.byte_len)], SIG)
                )
                self.echoed += 1


async def test_handler_posts_sends_and_receives(cm: Cm) -> None:
    pair = await cm.pair()
    client, server = pair.client, pair.server
    echo = Echo(server, 8, 32)
    # One CQ for both directions: the handler also takes its own Sends' completions.
    server.send_cq.set_handler(echo)
    server.recv_cq.set_handler(echo)
    server.send_cq.req_notify()
    server.recv_cq.req_notify()
    rbuf = client.reg(8 * 32)
    client.post_recvs(rbuf, 8, 32)
    msgs = [bytes([65 + i]) * (i + 1) for i in range(24)]
    for k, data in enumerate(msgs):
        out = client.reg(data)
        client.qp.post_send(SendWR(k, WROpcode.SEND, [out.sge()], SIG))
        (got,) = ok(await drain(client.recv_cq, 1))
        assert bytes(rbuf.buf[got.wr_id * 32 : got.wr_id * 32 + got.byte_len]) == data
        client.qp.post_recv(RecvWR(got.wr_id, [rbuf.sge(got.wr_id * 32, 32)]))
    ok(await drain(client.send_cq, len(msgs)))
    assert echo.echoed == len(msgs)
    assert echo.errors == []


class Raising:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, cq: Any) -> None:
        self.calls += 1
        raise RuntimeError("handler bug")


async def test_handler_raising_is_logged_and_fails_the_qp(
    cm: Cm, caplog: pytest.LogCaptureFixture
) -> None:
    pair = await cm.pair()
    client, server = pair.client, pair.server
    handler = Raising()
    server.recv_cq.set_handler(handler)
    server.post_recvs(server.reg(64), 2, 32)
    server.recv_cq.req_notify()
    msg = client.reg(b"x")
    with caplog.at_level(logging.ERROR):
        client.qp.post_send(SendWR(1, WROpcode.SEND, [msg.sge()], SIG))
        await until(lambda: server.qp.state is QPState.ERR)
    assert handler.calls == 1
    assert "handler" in caplog.text and "handler bug" in caplog.text
    wcs = await drain(server.recv_cq, 2)  # the received one, then the other flushed
    assert [w.status for w in wcs] == [WCStatus.SUCCESS, WCStatus.WR_FLUSH_ERR]
    # The device goes on: a new pair on it works.
    again = await cm.pair()
    again.server.post_recvs(again.server.reg(16), 1, 16)
    again.client.qp.post_send(SendWR(2, WROpcode.SEND, [again.client.reg(b"y").sge()], SIG))
    ok(await drain(again.server.recv_cq, 1))


async def test_closed_cq_calls_no_handler(cm: Cm) -> None:
    pair = await cm.pair()
    client, server = pair.client, pair.server
    handler = Counter()
    cq = server.ctx.create_cq(16, handler=handler)
    assert cq.handler is handler
    cq.req_notify()
    cq.close()
    with pytest.raises(VerbsError) as info:
        cq.set_handler(handler)
    assert info.value.errno == errno.EBADF
    # The pair's own CQs are untouched.
    server.post_recvs(server.reg(16), 1, 16)
    client.qp.post_send(SendWR(1, WROpcode.SEND, [client.reg(b"z").sge()], SIG))
    ok(await drain(server.recv_cq, 1))
    assert handler.calls == []


async def test_a_cq_takes_a_channel_or_a_handler(device: Any) -> None:
    channel = device.create_comp_channel()
    with pytest.raises(VerbsError) as info:
        device.create_cq(16, channel, handler=Counter())
    assert info.value.errno == errno.EINVAL
    cq = device.create_cq(16, channel)
    with pytest.raises(VerbsError) as info:
        cq.set_handler(Counter())
    assert info.value.errno == errno.EINVAL
    cq.set_handler(None)  # removing none is fine
    assert cq.handler is None
    cq.close()
    plain = device.create_cq(16)
    handler = Counter()
    plain.set_handler(handler)
    plain.set_handler(None)
    assert plain.handler is None
    plain.close()
    channel.close()


async def test_a_qp_has_a_native_runner_where_cqs_take_native_handlers(pair: Pair) -> None:
    """``qp.native_runner()`` (the C call a ULP's C makes to have what it staged posted)
    is there exactly where the backend calls native handlers (``set_native_handler``
    True): two addresses; elsewhere None, and ``run_native_handler()`` is False."""
    qp, cq = pair.client.qp, pair.client.send_cq
    calls = cq.set_native_handler(0, 0)  # (0: none set, as before)
    runner = qp.native_runner()
    assert (runner is not None) == calls
    if runner is None:
        assert qp.run_native_handler() is False
    else:
        assert all(isinstance(n, int) and n > 0 for n in runner)
