"""The native engine's socket write (``rs_qp_write_fd``) of large RDMA Writes, whose FPDUs'
payloads go to TCP from their regions (one ``sendmsg``, no copy into the transmit buffer),
held to the bytes the general path frames (``rs_qp_tx``) for the same work requests:
through a socket that takes them in pieces (its buffer small, the reader slow), with small
Writes, a Send and a Write spread over two SGEs between them; and nothing of a region is
read once the call returns (what TCP did not take was copied), so bytes changed in it
afterwards are not the ones that go.
"""

from __future__ import annotations

import errno
import random
import socket
from collections.abc import Callable

import pytest

from rdmashim import SGE, Access, SendFlags, WROpcode
from rdmashim.providers.softiwarp import native
from rdmashim.providers.softiwarp.jobs import EngineConfig
from rdmashim.verbs.buffers import pin
from rdmashim.verbs.wr import SendWR

from nativecore import two_qps

pytestmark = pytest.mark.skipif(native.lib is None, reason="the native engine is not built here")
STAG = 0x1300
SIZES = [300_000, 20_000, 10_000, 70_000, 16_384, 65_520]
"""Writes from one region, one after the other: large ones (their payloads from the
region), small ones (copied), and FPDUs cut at 64 KiB."""


def _wrs(addr: int, sizes: list[int]) -> list[SendWR]:
    """Writes of ``sizes`` from ``addr`` (each from where the last ended), a Send after
    the third, and a last Write of two SGEs (copied: its FPDU spans both)."""
    wrs, at = [], 0
    for i, size in enumerate(sizes):
        sge = SGE(addr + at, size, STAG)
        wrs.append(SendWR(i, WROpcode.RDMA_WRITE, [sge], remote_addr=0x7000 + at, rkey=0x99))
        if i == 2:
            wrs.append(SendWR(100, WROpcode.SEND, [SGE(addr, 3000, STAG)]))
        at += size
    halves = [SGE(addr, 20_000, STAG), SGE(addr + 40_000, 20_000, STAG)]
    wrs.append(SendWR(101, WROpcode.RDMA_WRITE, halves, SendFlags.SIGNALED, 0x9000, 0x99))
    return wrs


def _framed(
    src: bytearray, sizes: list[int], write: Callable[[native.NativeQP], bytes]
) -> tuple[bytes, list[int], int]:
    """Register ``src`` on a fresh QP, post :func:`_wrs` and return what ``write`` sends,
    the ids of the completions and the work requests left."""
    psrc = pin(src, writable=True)
    with two_qps(EngineConfig(crc=True, max_fpdu=65536)) as core:
        core.memory.add(STAG, psrc.addr, psrc.addr, len(src), Access.LOCAL_WRITE, core.pd)
        core.a.post_send(_wrs(psrc.addr, sizes))
        sent = write(core.a)
        return sent, sorted(wc.wr_id for wc in core.cqs[0].poll()), core.a.sq_depth


def _through_tx(qp: native.NativeQP) -> bytes:
    out = b""
    while chunk := qp.take():
        out += chunk
        qp.taken(len(chunk))
    return out


def _through_socket(qp: native.NativeQP, when_full: Callable[[], None] = lambda: None) -> bytes:
    """Write with ``write_fd`` into a socket with a small buffer, read slowly in uneven
    pieces; ``when_full`` runs each time a write finds the socket full."""
    rng = random.Random(3)
    ours, theirs = socket.socketpair()
    out = bytearray()
    with ours, theirs:
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
        ours.setblocking(False)
        theirs.setblocking(False)
        while True:
            while (wrote := qp.write_fd(ours.fileno())) > 0:
                pass
            if wrote == -errno.EAGAIN:
                when_full()
            else:
                assert wrote == 0, wrote
            try:
                piece = theirs.recv(rng.choice([700, 5000, 40_000]))
            except BlockingIOError:
                piece = b""
            if not piece and wrote == 0:
                return bytes(out)
            out += piece


def test_large_writes_go_from_their_regions_as_the_same_bytes() -> None:
    src = bytearray(random.Random(5).randbytes(sum(SIZES)))
    expected = _framed(src, SIZES, _through_tx)
    assert expected[1:] == ([*range(len(SIZES)), 100, 101], 0)  # every one completed
    assert _framed(src, SIZES, _through_socket) == expected


def test_nothing_of_a_region_is_read_once_the_call_returns() -> None:
    """Writes that the engine frames in one call (within its budget): once a write finds
    the socket full, the region is zeroed, and what goes is still what was framed."""
    sizes = [150_000, 40_000, 20_000]
    src = bytearray(random.Random(6).randbytes(sum(sizes)))
    expected = _framed(src, sizes, _through_tx)
    fulls = []

    def zero() -> None:
        fulls.append(1)
        src[:] = bytes(len(src))

    assert _framed(src, sizes, lambda qp: _through_socket(qp, zero)) == expected
    assert fulls, "the socket was never full: nothing was left to copy"
