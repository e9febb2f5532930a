"""What the peer owes a native QP, and the socket's low-water mark that follows it.

The QP view's ``rx_owed`` (``rs_qp_view``) counts the payload bytes that must still
arrive (the rest of the FPDU being received, the responses to our outstanding Reads);
the native link sets the socket's SO_RCVLOWAT to it (between 16 KiB and 1 MiB, else 1) so
that a peer which sends a large response in small pieces does not wake the reader once
a piece.
"""

from __future__ import annotations

import socket

import pytest
import trio

import rdmashim
from rdmashim import SGE, Access, SendFlags, WROpcode
from rdmashim.providers.softiwarp import native
from rdmashim.providers.softiwarp.jobs import EngineConfig
from rdmashim.verbs.buffers import pin
from rdmashim.verbs.wr import SendWR

from nativecore import two_qps
from pairs import make_pair

pytestmark = pytest.mark.skipif(native.lib is None, reason="the native engine is not built here")
SIZE = 100_000


def test_owed_is_what_the_responses_to_our_reads_still_bring() -> None:
    """A Read of 100,000 bytes: owed from when it is framed, less what each piece of the
    response placed, 0 at its end (and 0 for a QP that owes nothing)."""
    src, dst = bytearray(b"r" * SIZE), bytearray(SIZE)
    psrc, pdst = pin(src, writable=True), pin(dst, writable=True)
    with two_qps(EngineConfig(crc=True, max_fpdu=4096)) as core:
        a, b, pd = core.a, core.b, core.pd
        access = Access.REMOTE_READ | Access.LOCAL_WRITE
        core.memory.add(0x1100, psrc.addr, psrc.addr, SIZE, access, pd)
        core.memory.add(0x1200, pdst.addr, pdst.addr, SIZE, Access.LOCAL_WRITE, pd)
        assert a.view.rx_owed == 0
        read = SendWR(5, WROpcode.RDMA_READ, [SGE(pdst.addr, SIZE, 0x1200)], SendFlags.SIGNALED,
                      remote_addr=psrc.addr, rkey=0x1100)  # fmt: skip
        a.post_send([read])
        request = a.take()
        a.taken(len(request))
        assert a.view.rx_owed == SIZE
        b.receive(request)
        response = b""
        while chunk := b.take():
            response += chunk
            b.taken(len(chunk))
        owed = [a.view.rx_owed]
        for i in range(0, len(response), 7000):  # pieces that cut FPDUs anywhere
            a.receive(response[i : i + 7000])
            owed.append(a.view.rx_owed)
        assert owed[-1] == 0 and dst == src
        assert owed == sorted(owed, reverse=True) and len(set(owed)) > 10
        assert all(0 <= SIZE - o <= min(len(response), 7000 * k) for k, o in enumerate(owed))


@pytest.mark.parametrize(
    ("owed", "mark"),
    [
        (0, 1),
        (16 * 1024 - 1, 1),
        (16 * 1024, 16 * 1024),
        (40_000, 40_000),
        (10**9, 1024 * 1024),
    ],
)
async def test_the_socket_waits_for_what_is_owed(owed: int, mark: int) -> None:
    """The native link's mark on a real connected socket (SO_RCVLOWAT as the kernel
    reports it), and back to 1 when nothing is owed."""
    async with rdmashim.open_device() as ctx:
        if getattr(ctx, "engine", None) != "native":
            pytest.skip("the device runs the Python engine here (RDMASHIM_ENGINE)")
        client, _server = await make_pair(ctx)
        link = client.qp._link
        link._expect(owed)
        got = link.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)
        assert got == mark
        link._expect(0)
        assert link.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1
        await trio.lowlevel.checkpoint()
