"""A TCP connection reset under a connected QP: the QP ends and its connection closes.

The reset is Linux's ``tcp_disconnect()`` (``connect(AF_UNSPEC)`` on the QP's own
socket, as ``tests/test_rds_faults.py`` cuts RDS sessions): the file descriptor stays
the driver's, a RST goes to the peer and every later write fails. Work posted after
the reset is framed and then cannot be written; the connection must still close at
once (the driver's linger bound), not wait for a peer's FIN that nothing will send.
The RDS fault test saw ``cm`` connections wait out their 5 s close bound so.
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
from typing import Any

import pytest
import trio

from rdmashim import QPState, SendFlags, SendWR, WCStatus, WROpcode
from rdmashim.providers.softiwarp.driver import LINGER

from pairs import Side, make_pair

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
