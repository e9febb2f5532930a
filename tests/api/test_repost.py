"""One work request object posted again and again (a ping-pong's reply, a receive
reposted as it completes): every post means what a first post of that request would
mean now. A backend may keep what it checked and packed at the first post (the native
engine hands a request posted again straight to C); a region closed since, a queue
full now or a QP in ERR must still be seen."""

from __future__ import annotations

from typing import Any

import pytest
from api.support import SIG, Cm, Pair, drain, ok, quiet

from rdmashim import QPCap, QPState, RecvWR, SendWR, VerbsError, WCStatus, WROpcode

FORMS = pytest.mark.parametrize("form", ["alone", "list of one"])
"""A request posted again alone, or as a list of one (the same post, in another form)."""


def _as(form: str, wr: Any) -> Any:
    return [wr] if form == "list of one" else wr


async def _sent_once(pair: Pair, wr_id: int) -> tuple[SendWR, Any]:
    """A signaled Send of a region of the client's, posted and completed once (the
    server has two receives posted): the request and its region."""
    pair.server.post_recvs(pair.server.reg(64), 2, 32)
    region = pair.client.reg(b"payload!")
    wr = SendWR(wr_id, WROpcode.SEND, [region.sge()], SIG)
    pair.client.qp.post_send(wr)
    ok(await drain(pair.client.send_cq, 1))
    return wr, region


async def _send_after_close(pair: Pair, repost: bool, form: str) -> tuple[object, ...]:
    """Post a Send from a region, close the region, post it again (``repost``: the same
    object; else an equal new one): the exception, or the completion."""
    client = pair.client
    wr, gone = await _sent_once(pair, 7)
    gone.close()
    again = wr if repost else SendWR(7, WROpcode.SEND, [gone.sge()], SIG)
    try:
        client.qp.post_send(_as(form, again))
    except VerbsError as exc:
        return ("refused", exc.errno, exc.bad_wr)
    (wc,) = await drain(client.send_cq, 1)
    return ("completed", wc.wr_id, wc.status)


@FORMS
async def test_a_send_posted_again_after_its_region_closed_is_refused_as_a_new_one(
    cm: Cm, form: str
) -> None:
    reposted = await _send_after_close(await cm.pair(), True, form)
    assert reposted == await _send_after_close(await cm.pair(), False, form)
    assert reposted[0] == "refused" or reposted[2] != WCStatus.SUCCESS, reposted


async def _recv_after_close(pair: Pair, repost: bool, form: str) -> tuple[object, ...]:
    """Post a receive, receive into it and post it again, close its region, post it once
    more (``repost``: the same object; else an equal new one): the exception, or
    "accepted" (a device may check the key only when a message comes)."""
    client, server = pair.client, pair.server
    src, dst = client.reg(b"one"), server.reg(8)
    recv = RecvWR(5, [dst.sge()])
    for _ in range(2):  # received into, then posted again: the repost is the known one
        server.qp.post_recv(_as(form, recv))
        client.qp.post_send(SendWR(1, WROpcode.SEND, [src.sge()], SIG))
        ok(await drain(server.recv_cq, 1))
        ok(await drain(client.send_cq, 1))
    dst.close()
    try:
        server.qp.post_recv(_as(form, recv if repost else RecvWR(5, [dst.sge()])))
    except VerbsError as exc:
        return ("refused", exc.errno, exc.bad_wr)
    return ("accepted",)


@FORMS
async def test_a_receive_posted_again_after_its_region_closed_is_refused_as_a_new_one(
    cm: Cm, form: str
) -> None:
    reposted = await _recv_after_close(await cm.pair(), True, form)
    assert reposted == await _recv_after_close(await cm.pair(), False, form)


async def test_a_receive_posted_again_into_a_full_queue_is_refused_as_a_new_one(
    cm: Cm,
) -> None:
    pair = await cm.pair(cap=QPCap(max_send_wr=8, max_recv_wr=2))
    qp = pair.server.qp
    dst = pair.server.reg(8)
    recv = RecvWR(5, [dst.sge()])
    for _ in range(qp.query().cap.max_recv_wr):  # (the device may give more than asked)
        qp.post_recv(recv)
    refusals = []
    for again in (recv, RecvWR(5, [dst.sge()])):
        with pytest.raises(VerbsError) as caught:
            qp.post_recv(again)
        refusals.append((caught.value.errno, caught.value.bad_wr))
    assert refusals[0] == refusals[1]


async def _send_after_err(pair: Pair, repost: bool) -> tuple[object, ...]:
    """Post a Send, move the QP to ERR, post it again (``repost``: the same object; else
    an equal new one): the exception, or what completes within QUIET seconds (a flush
    here; Linux siw completes nothing posted to a QP in ERR)."""
    client = pair.client
    wr, region = await _sent_once(pair, 9)
    client.qp.modify(qp_state=QPState.ERR)
    try:
        client.qp.post_send(wr if repost else SendWR(9, WROpcode.SEND, [region.sge()], SIG))
    except VerbsError as exc:
        return ("refused", exc.errno, exc.bad_wr)
    return ("completed", *[(wc.wr_id, wc.status) for wc in await quiet(client.send_cq)])


async def test_a_send_posted_again_after_err_means_what_a_new_one_does(cm: Cm) -> None:
    reposted = await _send_after_err(await cm.pair(), repost=True)
    assert reposted == await _send_after_err(await cm.pair(), repost=False)


@pytest.mark.parametrize("what", ["send", "receive"])
async def test_a_list_of_one_that_is_not_a_request_is_refused(pair: Pair, what: str) -> None:
    """A list of one is posted as its request alone, once it is one; else the error
    names what it is."""
    post = pair.client.qp.post_send if what == "send" else pair.client.qp.post_recv
    with pytest.raises(TypeError, match="work request 0 is a str"):
        post(["not a work request"])
