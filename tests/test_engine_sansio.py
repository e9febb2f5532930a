"""Two engines wired back to back in memory, no sockets: byte streams cut anywhere,
and arbitrary bytes from a hostile peer."""

from __future__ import annotations

from collections import deque

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rdmashim import SGE, Access, SendFlags, WCOpcode, WCStatus, WROpcode
from rdmashim.verbs.buffers import pin
from rdmashim.verbs.softiwarp.engine import Engine, EngineConfig, EngineState, RecvJob, SendJob
from rdmashim.verbs.softiwarp.memory import MemoryTable
from rdmashim.verbs.softiwarp.terminate import LlpCode, RdmapCode, RdmapType, llp, rdmap

RW = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ


class Host:
    """One engine with its memory, receive queue and completion lists."""

    def __init__(self, crc: bool, ird: int = 4, ord: int = 4) -> None:
        self.memory = MemoryTable()
        self.pd = object()
        self.rq: deque[RecvJob] = deque()
        self.send_wcs: list = []
        self.recv_wcs: list = []
        self.engine = Engine(
            qp_num=1,
            pd=self.pd,
            memory=self.memory,
            take_recv=lambda: self.rq.popleft() if self.rq else None,
            on_send_wc=self.send_wcs.append,
            on_recv_wc=self.recv_wcs.append,
        )
        self.engine.start(EngineConfig(crc=crc, ird=ird, ord=ord))
        self._keep: list = []

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


def test_linux_siw_pad_bytes_are_ignored() -> None:
    """Linux siw sends non-zero PAD; a receiver ignores PAD contents (CRC still covers them)."""
    from crc32c import crc32c

    from rdmashim.verbs.softiwarp import ddp

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
