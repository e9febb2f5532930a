"""Two engines wired back to back in memory, no sockets: byte streams cut anywhere,
garbage, the outbox; the hosts and framing helpers the other engine tests use (a
hostile peer's streams: ``test_engine_hostile.py``)."""

from __future__ import annotations

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
    LlpCode,
    RdmapCode,
    RdmapType,
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
        wait_for_rtr: bool = False, max_fpdu: int = ddp.MAX_FPDU,
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
            EngineConfig(
                crc, ird, ord, max_fpdu, rtr_to_send=rtr_to_send, wait_for_rtr=wait_for_rtr
            )
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
