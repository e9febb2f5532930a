"""A hostile peer against one engine, in memory: every violation RFC 5040/5041/5044
name gets its Terminate code, mutated streams end in a Terminate or pass but never
crash or write outside a region, STags are not guessable, and an internal error
ends one QP only."""

from __future__ import annotations

import collections
import itertools
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_engine_sansio import RW, Host, read_request, tagged, untagged, wire

from rdmashim import SGE, Access, SendFlags, WCStatus, WROpcode
from rdmashim.providers.softiwarp import ddp
from rdmashim.providers.softiwarp.ddp import QN, Opcode
from rdmashim.providers.softiwarp.jobs import (
    EngineState,
    RecvJob,
    SendJob,
)
from rdmashim.providers.softiwarp.memory import MemoryTable
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

pytestmark = pytest.mark.usefixtures("engine_kernels")  # compiled and Python kernels


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
