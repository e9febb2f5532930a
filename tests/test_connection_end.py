"""A connection whose peer resets it, or stops reading: the QP ends and its connection
closes within the driver's linger bound, whatever was still waiting to be written.

The reset is Linux's ``tcp_disconnect()`` (``connect(AF_UNSPEC)`` on the QP's own
socket, as ``tests/test_rds_faults.py`` cuts RDS sessions): the file descriptor stays
the driver's, a RST goes to the peer and every later write fails. Work posted after
the reset is framed and then cannot be written; the connection must still close at
once, not wait for a peer's FIN that nothing will send (the RDS fault test saw
``cm`` connections wait out their 5 s close bound so).

The stalled peer completes MPA and then never reads nor closes, so the socket fills
and stays full. A QP moved to ERR then has bytes it can never write; without a
bound its connection, and the QP's memory, would be held for as long as the peer
lives. Linux siw drops the connection when the QP is destroyed; we give what is
still to go (a Terminate) and the peer's FIN ``LINGER`` seconds from the failure.
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
from typing import Any

import pytest
import trio

from rdmashim import Access, QPCap, QPState, SendFlags, SendWR, WCStatus, WROpcode
from rdmashim.providers.softiwarp.driver import LINGER

from pairs import Side, make_pair, raw_initiator

pytestmark = pytest.mark.usefixtures("each_engine")  # native and Python

_libc = ctypes.CDLL(None, use_errno=True)
_AF_UNSPEC = struct.pack("=H14x", socket.AF_UNSPEC)


def reset(side: Side) -> None:
    """Reset the TCP connection under ``side``'s QP (private API: the driver's socket)."""
    fd = side.qp._link.sock.fileno()
    if _libc.connect(fd, _AF_UNSPEC, len(_AF_UNSPEC)) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"connect(AF_UNSPEC): {os.strerror(code)}")


@pytest.mark.parametrize("posts", [0, 1, 8])
async def test_a_reset_connection_closes_within_the_linger_bound(ctx: Any, posts: int) -> None:
    client, server = await make_pair(ctx)
    src = client.reg(b"x" * 4096)
    reset(client)
    # Posted before the driver has read the reset: framed, and the write fails.
    for i in range(posts):
        client.qp.post_send(SendWR(i, WROpcode.SEND, [src.sge()], SendFlags.SIGNALED))
    with trio.fail_after(LINGER + 1.5):
        await client.qp.wait_closed()
        await server.qp.wait_closed()
    assert client.qp.state == server.qp.state == QPState.ERR
    wcs = client.send_cq.poll(16)
    assert [wc.wr_id for wc in wcs] == list(range(posts))
    assert all(wc.status == WCStatus.WR_FLUSH_ERR for wc in wcs), wcs


async def test_a_qp_in_error_whose_peer_stopped_reading_closes_within_the_linger_bound(
    ctx: Any,
) -> None:
    pd = ctx.alloc_pd()
    cq = ctx.create_cq(64)
    qp = pd.create_qp(send_cq=cq, recv_cq=cq, cap=QPCap(max_send_wr=32, max_recv_wr=4))
    src = pd.reg_mr(bytearray(1 << 20), Access.LOCAL_WRITE)
    peer, _, _ = await raw_initiator(qp)
    # The peer reads nothing more: 32 MiB of Sends fill both sockets' buffers.
    for i in range(32):
        qp.post_send(SendWR(i, WROpcode.SEND, [src.sge()], SendFlags(0)))
    await trio.sleep(0.2)
    qp.modify(qp_state=QPState.ERR)
    with trio.fail_after(LINGER + 1.5):
        await qp.wait_closed()
    assert qp.state == QPState.ERR
    await peer.aclose()
