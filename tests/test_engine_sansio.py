"""Two engines wired back to back in memory, no sockets: byte streams cut anywhere,
and arbitrary bytes from a hostile peer."""

from __future__ import annotations

import collections
import itertools
import os
from collections import deque

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rdmashim import SGE, Access, SendFlags, WCOpcode, WCStatus, WROpcode
from rdmashim.providers.softiwarp import ddp
from rdmashim.providers.softiwarp.ddp import QN, Opcode
from rdmashim.providers.softiwarp.engine import Engine
from rdmashim.providers.softiwarp.jobs import (
    EngineConfig,
    EngineState,
    Failed,
    Ready,
    RecvJob,
    SendJob,
)
from rdmashim.providers.softiwarp.memory import MemoryTable
from rdmashim.providers.softiwarp.rx import STAGING_SIZE
from rdmashim.providers.softiwarp.terminate import (
    DdpTaggedCode,
    DdpType,
    DdpUntaggedCode,
    Layer,
    LlpCode,
    ProtocolError,
    RdmapCode,
    RdmapType,
    TermCode,
    ddp_tagged,
    ddp_untagged,
    llp,
    rdmap,
)
from rdmashim.verbs.buffers import pin

from outbox import sort_outbox

pytestmark = pytest.mark.usefixtures("engine_kernels")  # compiled and Python kernels

RW = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ


class Host:
    """One engine with its memory, receive queue and completion lists (read from the
    engine's outbox whenever they are looked at)."""

    def __init__(
        self, crc: bool, ird: int = 4, ord: int = 4, rtr_to_send: Opcode | None = None,
        wait_for_rtr: bool = False,
    ) -> None:  # fmt: skip
        self.memory = MemoryTable()
        self.pd = object()
        self.rq: deque[RecvJob] = deque()
        self._send_wcs: list = []
        self._recv_wcs: list = []
        self.events: list = []
        """The outbox's events (Ready, Failed), in order."""
        self.engine = Engine(qp_num=1, pd=self.pd, memory=self.memory, recv_queue=self.rq)
        self.engine.start(
            EngineConfig(crc, ird, ord, rtr_to_send=rtr_to_send, wait_for_rtr=wait_for_rtr)
        )
        self._keep: list = []

    def take_outbox(self) -> None:
        """Move what the engine put out into the lists: send and receive completions
        (a run's one by one), events."""
        self.events += sort_outbox(self.engine.outbox, self._send_wcs, self._recv_wcs)

    @property
    def send_wcs(self) -> list:
        self.take_outbox()
        return self._send_wcs

    @property
    def recv_wcs(self) -> list:
        self.take_outbox()
        return self._recv_wcs

    def region(self, data: bytes | int):
        pinned = pin(bytearray(data), writable=True)
        self._keep.append(pinned)
        return self.memory.register(self.pd, pinned.view, pinned.addr, RW)


def pump(a: Host, b: Host, cuts: list[int]) -> None:
    """Move every byte a and b produce to the other, in pieces of the given sizes."""
    cut = iter(cuts * 1000)
    for _ in range(10000):
        moved = False
        for src, dst in ((a, b), (b, a)):
            bufs = src.engine.produce()
            if not bufs:
                continue
            wire = b"".join(bytes(x) for x in bufs)
            src.engine.sent(len(wire))
            view = memoryview(wire)
            while view:
                n = max(1, next(cut, 4096))
                dst.engine.receive_data(view[:n])
                view = view[n:]
            moved = True
        if not moved:
            return
    raise AssertionError("engines did not go quiet")


@pytest.mark.parametrize("rtr", [Opcode.WRITE, Opcode.READ_REQUEST])
def test_events_and_completions_come_out_of_the_outbox_in_order(rtr: Opcode) -> None:
    """The engine calls nothing back: the peer-to-peer responder finds Ready in its
    outbox once the initiator's RTR arrived (and only then may send); when its
    connection is lost, the flush completion of the Send it held comes out before the
    Failed event that names the cause."""
    a, b = Host(True, rtr_to_send=rtr), Host(True, wait_for_rtr=True)
    b.engine.post_send(SendJob(5, WROpcode.SEND, 0, (), b"held", 4))
    assert not b.engine.produce() and not b.engine.outbox
    a.engine.outbox.clear()
    wire = b"".join(bytes(x) for x in a.engine.produce())
    a.engine.sent(len(wire))
    b.engine.receive_data(wire)
    assert b.engine.outbox == [Ready()]
    b.engine.outbox.clear()
    lost = ConnectionResetError("cable cut")
    b.engine.connection_lost(lost)
    flushed, failed = b.engine.outbox
    assert (flushed.wr_id, flushed.status, flushed.opcode) == (
        5,
        WCStatus.WR_FLUSH_ERR,
        WCOpcode.SEND,
    )
    assert failed == Failed(lost)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    cuts=st.lists(st.integers(1, 70000), min_size=1, max_size=8),
    crc=st.booleans(),
    sizes=st.lists(st.integers(0, 140000), min_size=1, max_size=4),
)
def test_any_segmentation_delivers_everything(cuts: list[int], crc: bool, sizes: list[int]) -> None:
    a, b = Host(crc), Host(crc)
    sends, writes, reads = [], [], []
    for i, size in enumerate(sizes):
        data = bytes((i * 7 + k) & 0xFF for k in range(min(size, 300))) * (size // 300 + 1)
        data = data[:size]
        src = a.region(data or b"\0")
        rbuf = b.region(size + 1)
        b.rq.append(RecvJob(i, (SGE(rbuf.addr, size + 1, rbuf.stag),), size + 1))
        sge = (SGE(src.addr, size, src.stag),)
        a.engine.post_send(SendJob(i, WROpcode.SEND, SendFlags.SIGNALED, sge, None, size))
        sends.append((data, rbuf))
        wdst = b.region(size or 1)
        a.engine.post_send(
            SendJob(
                100 + i, WROpcode.RDMA_WRITE, SendFlags.NONE, sge, None, size, wdst.addr, wdst.stag
            )
        )
        writes.append((data, wdst))
        rsink = a.region(size or 1)
        a.engine.post_send(
            SendJob(
                200 + i, WROpcode.RDMA_READ, SendFlags.SIGNALED,
                (SGE(rsink.addr, size, rsink.stag),), None, size, wdst.addr, wdst.stag,
            )
        )  # fmt: skip
        reads.append((data, rsink))
    pump(a, b, cuts)
    assert a.engine.state is b.engine.state is EngineState.RTS
    assert [(w.wr_id, w.status) for w in b.recv_wcs] == [
        (i, WCStatus.SUCCESS) for i in range(len(sizes))
    ]
    assert [w.byte_len for w in b.recv_wcs] == sizes
    # Completions come in post order: Send i, then Read i (the Writes are unsignaled).
    expected = [x for i in range(len(sizes)) for x in (i, 200 + i)]
    assert [w.wr_id for w in a.send_wcs] == expected
    assert {w.status for w in a.send_wcs} == {WCStatus.SUCCESS}
    for data, region in sends:
        assert bytes(region.view[: len(data)]) == data
    for (data, region), (_, sink) in zip(writes, reads, strict=True):
        assert bytes(region.view[: len(data)]) == data
        assert bytes(sink.view[: len(data)]) == data


@settings(max_examples=300, deadline=None)
@given(garbage=st.binary(min_size=1, max_size=300), crc=st.booleans())
def test_arbitrary_bytes_end_in_terminate_never_a_crash(garbage: bytes, crc: bool) -> None:
    host = Host(crc)
    rbuf = host.region(64)
    host.rq.append(RecvJob(1, (SGE(rbuf.addr, 64, rbuf.stag),), 64))
    host.engine.receive_data(garbage)
    out = host.engine.produce()
    if host.engine.state is EngineState.RTS:
        assert out == []  # still waiting for the rest of an FPDU, or a whole valid one came
    else:
        assert host.engine.state is EngineState.ERROR
        assert host.engine.error is not None
        # The receive is either flushed or completed with an error, never lost.
        assert len(host.recv_wcs) <= 1
    # Whatever arrives after an error is discarded.
    host.engine.receive_data(garbage)


def test_crc_error_terminates_with_llp_code() -> None:
    a, b = Host(True), Host(True)
    dst = b.region(100)
    src = a.region(b"x" * 100)
    a.engine.post_send(
        SendJob(1, WROpcode.RDMA_WRITE, SendFlags.SIGNALED, (SGE(src.addr, 100, src.stag),),
                None, 100, dst.addr, dst.stag)
    )  # fmt: skip
    wire = bytearray(b"".join(bytes(x) for x in a.engine.produce()))
    wire[-1] ^= 0x01
    b.engine.receive_data(wire)
    assert b.engine.state is EngineState.TERMINATE  # until the Terminate is out
    assert b.engine.error.code == llp(LlpCode.CRC)
    term = b"".join(bytes(x) for x in b.engine.produce())
    assert b.engine.state is EngineState.ERROR
    a.engine.receive_data(term)
    assert a.engine.state is EngineState.ERROR
    assert a.engine.remote_terminate == b.engine.error.code


def test_staging_buffer_comes_with_the_first_received_bytes() -> None:
    """A QP that never receives (a request held or rejected) holds no staging buffer."""
    a, b = Host(True), Host(True)
    assert len(a.engine._staging) == 0
    dst = a.region(64)
    src = b.region(b"y" * 64)
    b.engine.post_send(
        SendJob(1, WROpcode.RDMA_WRITE, SendFlags.SIGNALED, (SGE(src.addr, 64, src.stag),),
                None, 64, dst.addr, dst.stag)
    )  # fmt: skip
    a.engine.receive_data(b"".join(bytes(x) for x in b.engine.produce()))
    assert len(a.engine._staging) == STAGING_SIZE
    assert bytes(dst.view) == b"y" * 64


def test_linux_siw_pad_bytes_are_ignored() -> None:
    """Linux siw sends non-zero PAD; a receiver ignores PAD contents (CRC still covers them)."""
    from crc32c import crc32c

    from rdmashim.providers.softiwarp import ddp

    b = Host(True)
    rbuf = b.region(8)
    b.rq.append(RecvJob(7, (SGE(rbuf.addr, 8, rbuf.stag),), 8))
    header = ddp.encode_untagged(ddp.Opcode.SEND, True, 0, 1, 0, 3)
    body = header + b"abc" + b"\xaa"  # 1 PAD byte, not zero
    b.engine.receive_data(body + crc32c(body).to_bytes(4, "little"))
    assert b.engine.state is EngineState.RTS
    assert [(w.wr_id, w.byte_len, w.opcode) for w in b.recv_wcs] == [(7, 3, WCOpcode.RECV)]
    assert bytes(rbuf.view[:3]) == b"abc"


def test_more_reads_than_ird_terminate() -> None:
    """A peer that ignores our IRD gets RDMAP / remote operation / catastrophic, as from siw."""
    a, b = Host(False, ord=8), Host(False, ird=2)
    src = b.region(b"y" * 64)
    sink = a.region(64)
    for i in range(3):
        a.engine.post_send(
            SendJob(i, WROpcode.RDMA_READ, SendFlags.SIGNALED, (SGE(sink.addr, 64, sink.stag),),
                    None, 64, src.addr, src.stag)
        )  # fmt: skip
    wire = b"".join(bytes(x) for x in a.engine.produce())
    b.engine.receive_data(wire)  # three Read Requests before b answered any
    assert b.engine.error.code == rdmap(RdmapType.REMOTE_OPERATION, RdmapCode.CATASTROPHIC_STREAM)
    assert b.engine.error.quote_rdmap
    a.engine.receive_data(b"".join(bytes(x) for x in b.engine.produce()))
    # The third Read, whose Request the Terminate quotes, fails remotely; the others flush.
    assert [(w.wr_id, w.status) for w in a.send_wcs] == [
        (0, WCStatus.WR_FLUSH_ERR),
        (1, WCStatus.WR_FLUSH_ERR),
        (2, WCStatus.REM_OP_ERR),
    ]


# ---------------------------------------------------------------------- hostile peers
GUARD = 32


class GuardedHost(Host):
    """A Host whose regions are slices of larger buffers with canary bytes around them."""

    def __init__(self, crc: bool, ird: int = 4, ord: int = 4) -> None:
        super().__init__(crc, ird, ord)
        self.other_pd = object()
        self.arenas: list[tuple[bytearray, bytes, bool]] = []

    def guarded(self, size: int, access: Access = RW, pd: object | None = None, frozen=True):
        """A region between canaries; ``frozen``: no byte of it may change either."""
        arena = bytearray(bytes((i * 131 + 7) & 0xFF for i in range(size + 2 * GUARD)))
        pinned = pin(memoryview(arena)[GUARD : GUARD + size], writable=True)
        self._keep.append(pinned)
        self.arenas.append((arena, bytes(arena), frozen))
        return self.memory.register(pd or self.pd, pinned.view, pinned.addr, access)

    def guards_intact(self) -> bool:
        """No canary changed, nor any byte of a frozen region."""
        return all(
            arena == pristine
            if frozen
            else arena[:GUARD] == pristine[:GUARD] and arena[-GUARD:] == pristine[-GUARD:]
            for arena, pristine, frozen in self.arenas
        )


def wire(*fpdus: tuple[bytes, bytes], crc: bool = True) -> bytes:
    """Frame (header, payload) pairs as FPDUs."""
    return b"".join(
        bytes(b) for header, payload in fpdus for b in ddp.encode_fpdu(header, [payload], crc=crc)
    )


def tagged(op: Opcode, stag: int, to: int, payload: bytes, last: bool = True):
    return ddp.encode_tagged(op, last, stag, to, len(payload)), payload


def untagged(op: Opcode, qn: int, msn: int, mo: int, payload: bytes, last=True, inv=0):
    return ddp.encode_untagged(op, last, qn, msn, mo, len(payload), inv), payload


def read_request(msn: int, size: int, src_stag: int, src_to: int, sink_to: int = 0x1000):
    return ddp.encode_read_request(msn, 0x4242, sink_to, size, src_stag, src_to), b""


def _with_payload(fpdu: tuple[bytes, bytes], payload: bytes) -> tuple[bytes, bytes]:
    header = bytearray(fpdu[0])
    header[0:2] = (len(header) - 2 + len(payload)).to_bytes(2, "big")
    return bytes(header), payload


def _set_control(fpdu: tuple[bytes, bytes], ddp_ctrl: int | None = None, rdmap_ctrl=None):
    header = bytearray(fpdu[0])
    if ddp_ctrl is not None:
        header[2] = ddp_ctrl
    if rdmap_ctrl is not None:
        header[3] = rdmap_ctrl
    return bytes(header), fpdu[1]


def _cases(h: GuardedHost) -> dict[str, tuple[bytes, TermCode]]:
    """Each violation RFC 5040/5041/5044 name, as bytes from a peer, and its Terminate code."""
    rw = h.guarded(64)
    ro = h.guarded(64, Access.REMOTE_READ)
    local = h.guarded(64, Access.LOCAL_WRITE)
    other = h.guarded(64, pd=h.other_pd)
    high = h.memory.register(h.pd, rw.view, (1 << 64) - 64, RW)  # TO range ends at 2^64
    send = untagged(Opcode.SEND, QN.SEND, 1, 0, b"hello")
    write = tagged(Opcode.WRITE, rw.stag, rw.addr, b"w" * 8)
    t_wrap = ddp_tagged(DdpTaggedCode.TO_WRAP)
    r_wrap = rdmap(RdmapType.REMOTE_PROTECTION, RdmapCode.TO_WRAP)

    def rprot(code: RdmapCode) -> TermCode:
        return rdmap(RdmapType.REMOTE_PROTECTION, code)

    return {
        "write TO wrap": (wire(tagged(Opcode.WRITE, high.stag, (1 << 64) - 4, b"x" * 8)), t_wrap),
        "write at 2^64-1 on a low region": (
            wire(tagged(Opcode.WRITE, rw.stag, (1 << 64) - 1, b"xy")),
            t_wrap,
        ),
        "read source TO wrap": (wire(read_request(1, 8, high.stag, (1 << 64) - 4)), r_wrap),
        "read sink TO wrap (second Read Response FPDU)": (
            wire(read_request(1, 64, high.stag, high.addr, sink_to=(1 << 64) - 32)),
            r_wrap,
        ),
        "write one byte past the end": (
            wire(tagged(Opcode.WRITE, rw.stag, rw.addr + 57, b"x" * 8)),
            ddp_tagged(DdpTaggedCode.BASE_BOUNDS),
        ),
        "write one byte before the start": (
            wire(tagged(Opcode.WRITE, rw.stag, rw.addr - 1, b"x" * 8)),
            ddp_tagged(DdpTaggedCode.BASE_BOUNDS),
        ),
        "write to an STag of another PD": (
            wire(tagged(Opcode.WRITE, other.stag, other.addr, b"x")),
            ddp_tagged(DdpTaggedCode.STAG_NOT_ASSOC),
        ),
        "write to an invalid STag": (
            wire(tagged(Opcode.WRITE, rw.stag ^ 0x80, rw.addr, b"x")),
            ddp_tagged(DdpTaggedCode.INVALID_STAG),
        ),
        "write without REMOTE_WRITE": (
            wire(tagged(Opcode.WRITE, ro.stag, ro.addr, b"x")),
            ddp_tagged(DdpTaggedCode.INVALID_STAG),  # siw_qp.c siw_tagged_error
        ),
        "read without REMOTE_READ": (
            wire(read_request(1, 8, local.stag, local.addr)),
            rprot(RdmapCode.ACCESS_RIGHTS),
        ),
        "read one byte past the end": (
            wire(read_request(1, 8, rw.stag, rw.addr + 57)),
            rprot(RdmapCode.BASE_BOUNDS),
        ),
        "read of an invalid STag": (
            wire(read_request(1, 8, 0xDEAD00, rw.addr)),
            rprot(RdmapCode.INVALID_STAG),
        ),
        "read of an STag of another PD": (
            wire(read_request(1, 8, other.stag, other.addr)),
            rprot(RdmapCode.STAG_NOT_ASSOC),
        ),
        "DDP version, tagged": (
            wire(_set_control(write, ddp_ctrl=0xC2)),
            ddp_tagged(DdpTaggedCode.VERSION),
        ),
        "DDP version, untagged": (
            wire(_set_control(send, ddp_ctrl=0x40)),
            ddp_untagged(DdpUntaggedCode.VERSION),
        ),
        "RDMAP version": (
            wire(_set_control(send, rdmap_ctrl=0x83)),
            rdmap(RdmapType.REMOTE_OPERATION, RdmapCode.VERSION),
        ),
        "reserved opcode": (
            wire(_set_control(send, rdmap_ctrl=0x4C)),
            rdmap(RdmapType.REMOTE_OPERATION, RdmapCode.OPCODE),
        ),
        "untagged opcode with the tagged flag": (
            wire(_set_control(send, ddp_ctrl=0xC1)),
            rdmap(RdmapType.REMOTE_OPERATION, RdmapCode.OPCODE),
        ),
        "Send on the Read Request queue": (
            wire(untagged(Opcode.SEND, QN.READ_REQUEST, 1, 0, b"x")),
            ddp_untagged(DdpUntaggedCode.INVALID_QN),
        ),
        "Send on queue 7": (
            wire(untagged(Opcode.SEND, 7, 1, 0, b"x")),
            ddp_untagged(DdpUntaggedCode.INVALID_QN),
        ),
        "Send MSN out of range": (
            wire(untagged(Opcode.SEND, QN.SEND, 2, 0, b"x")),
            ddp_untagged(DdpUntaggedCode.MSN_RANGE),
        ),
        "Read Request MSN out of range": (
            wire(read_request(0, 8, rw.stag, rw.addr)),
            ddp_untagged(DdpUntaggedCode.MSN_RANGE),
        ),
        "Send with no buffer": (
            wire(send, untagged(Opcode.SEND, QN.SEND, 2, 0, b"x")),
            ddp_untagged(DdpUntaggedCode.MSN_NO_BUFFER),
        ),
        "first segment MO not 0": (
            wire(untagged(Opcode.SEND, QN.SEND, 1, 4, b"x")),
            ddp_untagged(DdpUntaggedCode.INVALID_MO),
        ),
        "next segment MO wrong": (
            wire(
                untagged(Opcode.SEND, QN.SEND, 1, 0, b"ab", last=False),
                untagged(Opcode.SEND, QN.SEND, 1, 3, b"c"),
            ),
            ddp_untagged(DdpUntaggedCode.INVALID_MO),
        ),
        "Send longer than the receive": (
            wire(untagged(Opcode.SEND, QN.SEND, 1, 0, b"x" * 65)),
            ddp_untagged(DdpUntaggedCode.MSN_NO_BUFFER),  # siw_qp_rx.c siw_send_check_ntoh
        ),
        "Send header claiming 65535 bytes (the rest never comes)": (
            b"\xff\xff" + untagged(Opcode.SEND, QN.SEND, 1, 0, b"")[0][2:],
            ddp_untagged(DdpUntaggedCode.MSN_NO_BUFFER),
        ),
        "Write header claiming 65535 bytes into 64 (the rest never comes)": (
            b"\xff\xff" + tagged(Opcode.WRITE, rw.stag, rw.addr, b"")[0][2:],
            ddp_tagged(DdpTaggedCode.BASE_BOUNDS),
        ),
        "CRC error": (wire(send)[:-1] + bytes([wire(send)[-1] ^ 1]), llp(LlpCode.CRC)),
        "ULPDU length shorter than the header": (
            b"\x00\x05" + wire(send)[2:],
            llp(LlpCode.FPDU_START),
        ),
        "Read Request carrying payload": (
            wire(_with_payload(read_request(1, 8, rw.stag, rw.addr), b"abcd")),
            TermCode(Layer.DDP, DdpType.CATASTROPHIC, 0),
        ),
        "Read Response with no Read outstanding": (
            wire(tagged(Opcode.READ_RESPONSE, rw.stag, rw.addr, b"x")),
            TermCode(Layer.DDP, DdpType.CATASTROPHIC, 0),
        ),
        "Send with Invalidate of another PD's STag": (
            wire(untagged(Opcode.SEND_INV, QN.SEND, 1, 0, b"x", inv=other.stag)),
            rdmap(RdmapType.REMOTE_PROTECTION, RdmapCode.CANNOT_INVALIDATE),
        ),
        "Send with Invalidate of a region without remote rights": (
            wire(untagged(Opcode.SEND_INV, QN.SEND, 1, 0, b"x", inv=local.stag)),
            rdmap(RdmapType.REMOTE_PROTECTION, RdmapCode.CANNOT_INVALIDATE),
        ),
        "Send with Invalidate of an unknown STag": (
            wire(untagged(Opcode.SEND_INV, QN.SEND, 1, 0, b"x", inv=0xBAD00)),
            rdmap(RdmapType.REMOTE_OPERATION, RdmapCode.CANNOT_INVALIDATE),
        ),
        "Terminate with MO not 0": (
            wire(untagged(Opcode.TERMINATE, QN.TERMINATE, 1, 4, bytes(4))),
            ddp_untagged(DdpUntaggedCode.INVALID_MO),
        ),
    }


VIOLATIONS = list(_cases(GuardedHost(True)))


@pytest.mark.parametrize("feed", ["whole", "bytewise"])
@pytest.mark.parametrize("name", VIOLATIONS)
def test_each_violation_gets_its_terminate(name: str, feed: str) -> None:
    """The Terminate code table (docs/softiwarp.md): Terminate, ERROR, work flushed, no write."""
    h = GuardedHost(True)
    data, code = _cases(h)[name]
    rbuf = h.guarded(64, Access.LOCAL_WRITE, frozen=False)
    h.rq.append(RecvJob(1, (SGE(rbuf.addr, 64, rbuf.stag),), 64))
    h.engine.post_send(SendJob(9, WROpcode.SEND, SendFlags.SIGNALED, (), None, 0))
    for piece in [data] if feed == "whole" else [data[i : i + 1] for i in range(len(data))]:
        h.engine.receive_data(piece)
    assert h.engine.state is EngineState.TERMINATE, h.engine.error
    assert isinstance(h.engine.error, ProtocolError) and h.engine.error.code == code
    out = b"".join(bytes(x) for x in h.engine.produce())
    assert h.engine.state is EngineState.ERROR
    term = ddp.parse_header(out)
    assert term is not None and term.opcode is Opcode.TERMINATE
    assert ddp.parse_terminate(out[20 : 2 + term.ulpdu_len]).code == code
    assert (9, WCStatus.WR_FLUSH_ERR) in [(w.wr_id, w.status) for w in h.send_wcs]
    assert h.guards_intact()
    assert all(h.memory.lookup(r.stag) is r for r in h.memory._regions.values())  # none invalid
    h.engine.receive_data(data)  # discarded after the error
    assert h.engine.produce() == [] and h.guards_intact()


def _hostile_pair(crc: bool, sizes: list[int]) -> tuple[Host, GuardedHost, bytes]:
    """A valid stream of Sends, Writes and Reads from a to b, and b with guarded memory."""
    a, b = Host(crc), GuardedHost(crc)
    rw = b.guarded(4096, frozen=False)
    ro = b.guarded(256, Access.REMOTE_READ)
    b.guarded(256, pd=b.other_pd)
    for i in range(3):
        rbuf = b.guarded(256, Access.LOCAL_WRITE, frozen=False)
        b.rq.append(RecvJob(i, (SGE(rbuf.addr, 256, rbuf.stag),), 256))
    src = a.region(bytes(range(256)) * 16)
    sink = a.region(4096)
    for i, size in enumerate(sizes):
        sge = (SGE(src.addr, size, src.stag),)
        op = (WROpcode.SEND, WROpcode.RDMA_WRITE, WROpcode.RDMA_READ)[i % 3]
        if op is WROpcode.RDMA_READ:
            target = ro if size <= 256 else rw
            sge = (SGE(sink.addr, size, sink.stag),)
            a.engine.post_send(SendJob(i, op, SendFlags.SIGNALED, sge, None, size, target.addr,
                                       target.stag))  # fmt: skip
        else:
            size = min(size, 256) if op is WROpcode.SEND else size
            sge = (SGE(src.addr, size, src.stag),)
            a.engine.post_send(SendJob(i, op, SendFlags.SIGNALED, sge, None, size, rw.addr + 8,
                                       rw.stag))  # fmt: skip
    stream = b"".join(bytes(x) for x in a.engine.produce())
    return a, b, stream


_INTERESTING = [0, 1, 0x7FFFFFFF, 0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF, 0xFFFFFFFFFFFFFFF0, 1 << 63]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    crc=st.booleans(),
    sizes=st.lists(st.integers(0, 4000), min_size=1, max_size=5),
    mutations=st.lists(
        st.tuples(
            st.sampled_from(["flip", "word", "dword", "qword", "cut", "insert"]),
            st.integers(0, 1 << 16),
            st.one_of(st.sampled_from(_INTERESTING), st.integers(0, (1 << 64) - 1)),
        ),
        min_size=1,
        max_size=4,
    ),
    cuts=st.lists(st.integers(1, 5000), min_size=1, max_size=4),
)
def test_mutated_streams_terminate_or_pass_never_crash(
    crc: bool, sizes: list[int], mutations: list, cuts: list[int]
) -> None:
    """Valid streams with bits flipped, fields overwritten (32/64-bit values near the
    limits), cut or padded with garbage: the engine places them or answers with a
    Terminate, never raises, never writes outside a region, never spins."""
    _, b, stream = _hostile_pair(crc, sizes)
    data = bytearray(stream)
    for kind, pos, value in mutations:
        if not data:
            break
        pos %= len(data)
        if kind == "flip":
            data[pos] ^= 1 << (value % 8)
        elif kind in ("word", "dword", "qword"):
            n = {"word": 2, "dword": 4, "qword": 8}[kind]
            data[pos : pos + n] = (value & ((1 << (8 * n)) - 1)).to_bytes(n, "big")
        elif kind == "cut":
            del data[pos:]
        else:
            data[pos:pos] = value.to_bytes(8, "little")[: 1 + value % 8]
    view, cut = memoryview(bytes(data)), itertools.cycle(cuts)
    while view:
        n = next(cut)
        b.engine.receive_data(view[:n])
        view = view[n:]
    for _ in range(1000):
        if not b.engine.produce():
            break
    else:
        raise AssertionError("the engine keeps producing")
    assert b.engine.state in (EngineState.RTS, EngineState.ERROR)
    if b.engine.state is EngineState.ERROR:
        assert isinstance(b.engine.error, ProtocolError), b.engine.error
    assert b.guards_intact()


def test_msn_counts_modulo_2_32() -> None:
    """A long-lived connection goes on past MSN 2^32 - 1 (RFC 5041: MSNs wrap to 0)."""
    a, b = Host(True), Host(True)
    for q in (QN.SEND, QN.READ_REQUEST):
        a.engine._tx_msn[q] = 0xFFFFFFFE
        b.engine._rx_msn[q] = 0xFFFFFFFF
    src = a.region(b"abcd")
    remote = b.region(b"wxyz")
    for i in range(3):
        rbuf = b.region(4)
        b.rq.append(RecvJob(i, (SGE(rbuf.addr, 4, rbuf.stag),), 4))
        a.engine.post_send(
            SendJob(i, WROpcode.SEND, SendFlags.SIGNALED, (SGE(src.addr, 4, src.stag),), None, 4)
        )
        sink = a.region(4)
        a.engine.post_send(
            SendJob(10 + i, WROpcode.RDMA_READ, SendFlags.SIGNALED,
                    (SGE(sink.addr, 4, sink.stag),), None, 4, remote.addr, remote.stag)
        )  # fmt: skip
    pump(a, b, [4096])
    assert a.engine.state is b.engine.state is EngineState.RTS
    assert [w.status for w in a.send_wcs + b.recv_wcs] == [WCStatus.SUCCESS] * 9
    assert b.engine._rx_msn[QN.SEND] == b.engine._rx_msn[QN.READ_REQUEST] == 2


@pytest.mark.parametrize(
    ("opcode", "remote_addr", "rkey"),
    [
        (WROpcode.RDMA_WRITE, (1 << 64) - 4, 0x100),
        (WROpcode.RDMA_READ, (1 << 64) - 4, 0x100),
        (WROpcode.RDMA_WRITE, 0, 1 << 32),
        (WROpcode.RDMA_READ, -1, 0x100),
    ],
)
def test_work_request_that_does_not_fit_the_wire_is_a_local_error(
    opcode: WROpcode, remote_addr: int, rkey: int
) -> None:
    a = Host(True)
    buf = a.region(8)
    a.engine.post_send(
        SendJob(1, opcode, SendFlags.SIGNALED, (SGE(buf.addr, 8, buf.stag),), None, 8,
                remote_addr, rkey)
    )  # fmt: skip
    a.engine.produce()
    assert a.engine.state is EngineState.ERROR
    assert [(w.wr_id, w.status) for w in a.send_wcs] == [(1, WCStatus.LOC_PROT_ERR)]


def test_stags_are_not_predictable() -> None:
    """Part 5 of issue 10: index and key are random, never 0 or the RTR STag 1."""
    table, pd = MemoryTable(), object()
    view = memoryview(bytearray(16))
    stags = [table.register(pd, view, 0x1000, RW).stag for _ in range(2000)]
    assert len(set(stags)) == len(stags)
    assert min(stags) > 0xFF  # index 0 (STags 0 and 1) is never handed out
    steps = {(b >> 8) - (a >> 8) for a, b in itertools.pairwise(stags)}
    assert len(steps) > 1900  # no fixed stride between consecutive indices
    keys = collections.Counter(s & 0xFF for s in stags)
    assert len(keys) > 200 and max(keys.values()) < 40  # all 256 keys in use, none favoured
    # a guess next to a live STag (index or key off by one) names nothing
    live = set(stags)
    for s in stags[:200]:
        for guess in (s + 1, s - 1, s + 256, s - 256):
            if guess not in live:
                assert table.lookup(guess) is None


def test_a_forked_child_draws_other_stags() -> None:
    """The STags' random words come from a pool: a child must not reuse the words its
    parent draws next (it inherited the pool)."""
    table, pd = MemoryTable(), object()
    view = memoryview(bytearray(16))
    table.register(pd, view, 0x1000, RW)  # the pool is filled
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover (the child reports through the pipe)
        stags = [table.register(pd, view, 0x1000, RW).stag for _ in range(8)]
        os.write(write, b"".join(s.to_bytes(4, "little") for s in stags))
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        theirs = pipe.read()
    os.waitpid(child, 0)
    ours = [table.register(pd, view, 0x1000, RW).stag for _ in range(8)]
    assert len(theirs) == 32
    assert {int.from_bytes(theirs[i : i + 4], "little") for i in range(0, 32, 4)}.isdisjoint(ours)


@pytest.mark.parametrize(
    ("guess", "code"),
    [
        ("their STag", DdpTaggedCode.STAG_NOT_ASSOC),
        ("next index", DdpTaggedCode.INVALID_STAG),
        ("other key", DdpTaggedCode.INVALID_STAG),
    ],
)
def test_guessed_stag_of_another_connection_is_refused(guess: str, code: DdpTaggedCode) -> None:
    """QPs of one device share its memory table: a peer that learned one STag and tries
    a region of another connection's PD, or a neighbour of its own STag, is refused."""
    a, b = Host(True), GuardedHost(True)
    mine = b.guarded(64)
    theirs = b.guarded(64, pd=b.other_pd)
    stag = {
        "their STag": theirs.stag,
        "next index": mine.stag + 256,
        "other key": mine.stag ^ 0x01,
    }[guess]
    src = a.region(b"x" * 8)
    a.engine.post_send(
        SendJob(1, WROpcode.RDMA_WRITE, SendFlags.SIGNALED, (SGE(src.addr, 8, src.stag),),
                None, 8, theirs.addr, stag)
    )  # fmt: skip
    b.engine.receive_data(b"".join(bytes(x) for x in a.engine.produce()))
    assert b.engine.state is EngineState.TERMINATE
    assert b.engine.error.code == ddp_tagged(code)
    assert b.guards_intact()


def test_internal_error_ends_one_qp_not_the_process(caplog: pytest.LogCaptureFixture) -> None:
    """A bug of ours (here: the memory table raising) is logged and ends this QP with a
    local catastrophic Terminate; nothing escapes into the driver."""
    h = GuardedHost(True)
    rw = h.guarded(64)

    class Broken:
        def resolve(self, *args: object) -> None:
            raise RuntimeError("simulated engine bug")

        def unwatch(self, holder: object) -> None:
            """(The engine leaves the table's holders when it enters ERROR.)"""

    h.engine.memory = Broken()  # type: ignore[assignment]
    h.engine.receive_data(wire(tagged(Opcode.WRITE, rw.stag, rw.addr, b"x")))
    assert h.engine.state is EngineState.TERMINATE
    assert h.engine.error.code == rdmap(RdmapType.CATASTROPHIC, RdmapCode.UNSPECIFIED)
    assert any(r.levelname == "ERROR" and r.exc_info for r in caplog.records)
    assert h.engine.produce() and h.engine.state is EngineState.ERROR
