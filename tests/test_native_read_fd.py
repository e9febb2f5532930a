"""The native engine's socket read (``rs_qp_read_fd``) of a large RDMA Write whose FPDUs
reach the socket cut anywhere, held to the same stream fed to ``rs_qp_rx`` in the same
pieces: the same bytes placed, the same state, error and Terminate, a bad CRC included.
"""

from __future__ import annotations

import errno
import random
import socket

import pytest

from rdmashim import SGE, Access, SendFlags, WROpcode
from rdmashim.providers.softiwarp import native
from rdmashim.providers.softiwarp.jobs import EngineConfig, EngineState
from rdmashim.verbs.buffers import pin
from rdmashim.verbs.wr import SendWR

from nativecore import two_qps

pytestmark = pytest.mark.skipif(native.lib is None, reason="the native engine is not built here")
SIZE = 300_000
CUTS = [1000, 30_000, 70_000, 5, 20_000, 17, 65_000]
"""Pieces the stream reaches the socket in: reads end inside a payload (with more or less
than 16 KiB of it left), inside a header or inside a trailer."""


def _stream(src: bytearray, stag: int, addr: int) -> bytes:
    """The FPDUs of an RDMA Write of ``src`` to ``stag``/``addr``, as a QP frames them."""
    psrc = pin(src, writable=True)
    with two_qps(EngineConfig(crc=True, max_fpdu=65536)) as core:
        core.memory.add(0x1100, psrc.addr, psrc.addr, len(src), Access.LOCAL_WRITE, core.pd)
        write = SendWR(1, WROpcode.RDMA_WRITE, [SGE(psrc.addr, len(src), 0x1100)],
                       SendFlags.SIGNALED, remote_addr=addr, rkey=stag)  # fmt: skip
        core.a.post_send([write])
        out = b""
        while chunk := core.a.take():
            out += chunk
            core.a.taken(len(chunk))
        return out


def _receive(stream: bytes, through_socket: bool) -> tuple[bytes, EngineState, str, bytes]:
    """Feed ``stream`` (the Write's FPDUs) to a QP whose region is its target: through a
    real socket in :data:`CUTS`-sized pieces (``rs_qp_read_fd``), or
    to ``rs_qp_rx`` in the same pieces. What landed, the state, the error's words and
    what the QP sends back (a Terminate, or nothing)."""
    dst = bytearray(SIZE)
    pdst = pin(dst, writable=True)
    with two_qps(EngineConfig(crc=True, max_fpdu=65536)) as core:
        b = core.b
        core.memory.add(0x1200, pdst.addr, 0, SIZE, Access.REMOTE_WRITE, core.pd)  # (iova 0)
        ours, theirs = socket.socketpair()
        with ours, theirs:
            ours.setblocking(False)
            at, i = 0, 0
            while at < len(stream):
                piece = stream[at : at + CUTS[i % len(CUTS)]]
                at, i = at + len(piece), i + 1
                if not through_socket:
                    b.receive(piece)
                    continue
                theirs.sendall(piece)
                while (got := b.read_fd(ours.fileno())) > 0:
                    pass
                assert got == -errno.EAGAIN or b.state is not EngineState.RTS, got
        back = b""
        while chunk := b.take():
            back += chunk
            b.taken(len(chunk))
        return bytes(dst), b.state, b.error[2], back


def _pair(corrupt: int | None) -> tuple[bytes, bytes]:
    rng = random.Random(7)
    src = bytearray(rng.randbytes(SIZE))
    stream = bytearray(_stream(src, 0x1200, 0))
    if corrupt is not None:
        stream[corrupt] ^= 0x40
    return bytes(src), bytes(stream)


def test_a_write_cut_anywhere_lands_whole_as_through_the_general_path() -> None:
    src, stream = _pair(None)
    read = _receive(stream, through_socket=True)
    general = _receive(stream, through_socket=False)
    assert read == general
    assert read[0] == src and read[1] is EngineState.RTS


def test_a_bad_crc_read_from_the_socket_ends_the_connection_with_a_terminate() -> None:
    """A byte flipped deep in the second FPDU's payload: the trailer's CRC finds it, the
    QP leaves RTS and sends a Terminate, the same through the socket as through the
    general path."""
    _, stream = _pair(None)
    second = 8 + 65_000 + 40_000  # (past the first FPDU, inside the second's payload)
    _, bad = _pair(second)
    assert bad != stream
    read = _receive(bad, through_socket=True)
    assert read == _receive(bad, through_socket=False)
    assert read[1] is not EngineState.RTS and "CRC" in read[2] and read[3]
