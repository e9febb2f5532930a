"""The Python engine's QP keeps what it checked of a request posted alone and takes it
again when the same request object is posted again (a receive reposted as it
completes, a ping-pong's reply): each guard of that shortcut is tried here, and the
repost must mean what a first post of the request would mean now (see also
``tests/api/test_repost.py``, which holds every backend to that). With the compiled
and the Python kernels.
"""

from __future__ import annotations

import errno
from typing import Any

import pytest
import trio

from rdmashim import (
    QPCap,
    QPState,
    RecvWR,
    SendFlags,
    SendWR,
    VerbsError,
    WCStatus,
    WROpcode,
)

from pairs import Side, make_pair

pytestmark = pytest.mark.usefixtures("engine_kernels")  # compiled and Python kernels

SIG = SendFlags.SIGNALED
INLINE = SendFlags.INLINE
BOUND = 10.0
"""Seconds any wait here may take (they take milliseconds)."""


async def _receive_one(client: Side, server: Side, data: bytes) -> Any:
    """Send ``data`` inline from the client; the server's receive completion."""
    client.qp.post_send(SendWR(1, WROpcode.SEND, [data], INLINE))
    with trio.fail_after(BOUND):
        (wc,) = await server.recv_cq.poll_wait(1)
    return wc


async def _received_into(client: Side, server: Side, recv: RecvWR) -> None:
    """Post ``recv`` and receive a message into it (its first post: what it checked is
    kept), then post it again (taken from what was kept, the queue holds it)."""
    server.qp.post_recv(recv)
    assert (await _receive_one(client, server, b"first")).status == WCStatus.SUCCESS
    server.qp.post_recv(recv)


async def test_a_receive_posted_again_with_other_fields_takes_them(ctx: Any) -> None:
    client, server = await make_pair(ctx)
    dst = server.reg(64)
    recv = RecvWR(1, [dst.sge(0, 8)])
    await _received_into(client, server, recv)
    assert (await _receive_one(client, server, b"second")).wr_id == 1
    recv.wr_id = 2
    server.qp.post_recv(recv)
    wc = await _receive_one(client, server, b"third")
    assert (wc.wr_id, wc.status) == (2, WCStatus.SUCCESS)
    recv.sg_list[0] = dst.sge(32, 8)  # (changed in place: the same list)
    server.qp.post_recv(recv)
    wc = await _receive_one(client, server, b"fourth")
    assert (wc.wr_id, wc.status) == (2, WCStatus.SUCCESS)
    assert bytes(dst.buf[32:38]) == b"fourth" and bytes(dst.buf[:5]) == b"third"


async def test_a_receive_posted_again_after_its_region_closed_is_refused(ctx: Any) -> None:
    client, server = await make_pair(ctx)
    dst = server.reg(64)
    recv = RecvWR(1, [dst.sge(0, 8)])
    await _received_into(client, server, recv)
    dst.close()
    with pytest.raises(VerbsError) as info:
        server.qp.post_recv(recv)
    assert info.value.errno == errno.EINVAL and info.value.bad_wr == 0


async def test_a_receive_posted_again_into_a_full_queue_is_refused(ctx: Any) -> None:
    client, server = await make_pair(ctx, cap=QPCap(max_recv_wr=2, max_inline_data=64))
    recv = RecvWR(1, [server.reg(64).sge(0, 8)])
    await _received_into(client, server, recv)
    server.qp.post_recv(recv)  # the queue's second
    with pytest.raises(VerbsError) as info:
        server.qp.post_recv(recv)
    assert info.value.errno == errno.ENOMEM and "receive queue full (2)" in str(info.value)


async def test_a_receive_posted_again_in_err_is_flushed(ctx: Any) -> None:
    client, server = await make_pair(ctx)
    recv = RecvWR(7, [server.reg(64).sge(0, 8)])
    await _received_into(client, server, recv)
    server.qp.modify(qp_state=QPState.ERR)  # flushes the one queued
    server.qp.post_recv(recv)  # flushed at once
    wcs = server.recv_cq.poll(8)
    assert [(wc.wr_id, wc.status) for wc in wcs] == [(7, WCStatus.WR_FLUSH_ERR)] * 2
