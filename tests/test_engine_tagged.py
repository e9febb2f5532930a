"""The engine's fast path for runs of whole tagged FPDUs (MSS-sized RDMA Writes and Read
Responses in one received buffer) against its general path (the same bytes fed one at a
time, which never holds a whole FPDU when the header is parsed): both must give the
same placed bytes, completions, state and Terminate, for clean and flawed runs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_engine_sansio import RW, Host, tagged, untagged, wire

from rdmashim import SGE, Access, SendFlags, WCStatus, WROpcode
from rdmashim.providers.softiwarp import ddp
from rdmashim.providers.softiwarp.ddp import QN, Opcode
from rdmashim.providers.softiwarp.jobs import EngineState, RecvJob, SendJob
from rdmashim.providers.softiwarp.memory import Region

_SIG = int(SendFlags.SIGNALED)
pytestmark = pytest.mark.usefixtures("engine_kernels")  # compiled and Python kernels

_WRITE_FLAWS = [
    "none", "bad_crc", "other_region", "past_end", "below", "wrap", "no_remote_write",
    "other_pd", "dead", "empty", "reserved_bits", "send_between", "stray_response",
]  # fmt: skip
_READ_FLAWS = [
    "none", "bad_crc", "wrong_to", "early_last", "too_long", "wrong_stag", "write_between",
    "two_reads", "extra_response", "no_last",
]  # fmt: skip


def _payload(i: int, size: int) -> bytes:
    return bytes((i * 7 + k) & 0xFF for k in range(size))


def _feed(host: Host, data: bytes, whole: bool) -> None:
    if whole:
        host.engine.receive_data(data)
    else:
        for k in range(len(data)):
            host.engine.receive_data(data[k : k + 1])


def _region(host: Host, size: int, addr: int, access: Access = RW, pd: object = None) -> Region:
    """A region at a fixed address (so two runs quote the same TOs in their Terminates)."""
    view = memoryview(bytearray(size))
    return host.memory.register(host.pd if pd is None else pd, view, addr, access)


def _terminate(data: bytes, regions: list[Region]) -> tuple | None:
    """What a Terminate FPDU says, the STags it quotes replaced by their region's index
    (STags are random: two runs draw different ones)."""
    if not data:
        return None
    hdr = ddp.parse_header(data)
    assert hdr is not None and hdr.opcode is Opcode.TERMINATE
    term = ddp.parse_terminate(data[ddp.UNTAGGED_HDR_LEN : hdr.ulpdu_len + 2])
    copied = term.copied_header
    for i, region in enumerate(regions):
        copied = copied.replace(region.stag.to_bytes(4, "big"), bytes([0xEE, 0xEE, 0xEE, i]))
    return term.code, term.ddp_header_copied, term.rdmap_header_copied, copied


def _outcome(host: Host, regions: list[Region]) -> tuple:
    term = b"".join(bytes(b) for b in host.engine.produce())
    return (
        [(w.wr_id, w.status, w.byte_len) for w in host.send_wcs],
        [(w.wr_id, w.status, w.byte_len) for w in host.recv_wcs],
        [bytes(r.view) for r in regions],
        host.engine.state,
        host.engine.error.code if host.engine.error is not None else None,
        _terminate(term, regions),
    )


def _writes(crc: bool, sizes: list[int], flaw: str, at: int, whole: bool) -> tuple:
    host = Host(crc)
    total = sum(sizes) + 8
    target = _region(host, total, 0x10000)
    other = _region(host, total, 0x10000)  # the same addresses: only the STag differs
    local_only = _region(host, total, 0x30000, Access.LOCAL_WRITE)
    foreign = _region(host, total, 0x40000, RW, object())
    dead = _region(host, total, 0x50000)
    host.memory.deregister(dead)
    recv = _region(host, 64, 0x60000)
    host.rq.append(RecvJob(7, (SGE(recv.addr, 64, recv.stag),), 64))
    fpdus = []
    to = target.addr + 3
    for i, size in enumerate(sizes):
        stag, at_to, payload = target.stag, to, _payload(i, size)
        hit = i == at
        if hit and flaw == "other_region":
            stag = other.stag
        if hit and flaw == "past_end":
            at_to = target.addr + target.length - size + 1
        if hit and flaw == "below":
            at_to = target.addr - 1
        if hit and flaw == "wrap":
            at_to = (1 << 64) - 1
        if hit and flaw in ("no_remote_write", "other_pd", "dead"):
            region = {"no_remote_write": local_only, "other_pd": foreign, "dead": dead}[flaw]
            stag, at_to = region.stag, region.addr
        if hit and flaw == "empty":
            payload = b""
        if hit and flaw == "send_between":
            fpdus.append(untagged(Opcode.SEND, QN.SEND, 1, 0, b"between"))
        if hit and flaw == "stray_response":
            fpdus.append(tagged(Opcode.READ_RESPONSE, target.stag, target.addr, b"x"))
        fpdu = tagged(Opcode.WRITE, stag, at_to, payload, last=i == len(sizes) - 1)
        if hit and flaw == "reserved_bits":
            header = bytearray(fpdu[0])
            header[2] |= 0x04  # DDP reserved: the general path ignores it, the kernel stops
            fpdu = (bytes(header), fpdu[1])
        fpdus.append(fpdu)
        to += size
    data = bytearray(wire(*fpdus, crc=crc))
    if flaw == "bad_crc":
        data[-1] ^= 1
    _feed(host, bytes(data), whole)
    return _outcome(host, [target, other, recv, local_only, foreign, dead])


def _reads(crc: bool, sizes: list[int], flaw: str, at: int, whole: bool) -> tuple:
    host = Host(crc)
    length = sum(sizes)
    sink = _region(host, length + 8, 0x10000)
    second = _region(host, 5, 0x20000)
    post = host.engine.post_send
    sge = (SGE(sink.addr + 1, length, sink.stag),)
    post(SendJob(1, WROpcode.RDMA_READ, int(SendFlags.SIGNALED), sge, None, length, 0x5000, 77))
    if flaw == "two_reads":
        sge2 = (SGE(second.addr, 5, second.stag),)
        post(SendJob(2, WROpcode.RDMA_READ, int(SendFlags.SIGNALED), sge2, None, 5, 0x6000, 78))
    post(SendJob(3, WROpcode.SEND, int(SendFlags.SIGNALED), (), b"after", 5))
    sent = b"".join(bytes(b) for b in host.engine.produce())
    host.engine.sent(len(sent))
    fpdus = []
    to = sink.addr + 1
    for i, size in enumerate(sizes):
        stag, at_to, payload, last = sink.stag, to, _payload(i, size), i == len(sizes) - 1
        hit = i == at
        if hit and flaw == "wrong_to":
            at_to += 4
        if hit and flaw == "early_last" and size:
            last = True
        if hit and flaw == "too_long":
            payload += b"!"
        if hit and flaw == "wrong_stag":
            stag = second.stag
        if hit and flaw == "write_between":
            fpdus.append(tagged(Opcode.WRITE, second.stag, second.addr, b"w"))
        if flaw == "no_last":
            last = False
        fpdus.append(tagged(Opcode.READ_RESPONSE, stag, at_to, payload, last=last))
        to += size
    if flaw == "two_reads":
        fpdus.append(tagged(Opcode.READ_RESPONSE, second.stag, second.addr, b"12345"))
    if flaw == "extra_response":
        fpdus.append(tagged(Opcode.READ_RESPONSE, sink.stag, sink.addr + 1, b"more"))
    data = bytearray(wire(*fpdus, crc=crc))
    if flaw == "bad_crc":
        data[-1] ^= 1
    _feed(host, bytes(data), whole)
    return _outcome(host, [sink, second])


RUNS = {
    "crc": st.booleans(),
    "sizes": st.lists(st.integers(0, 90), min_size=1, max_size=10),
    "at": st.integers(0, 9),
}


@settings(max_examples=150, deadline=None)
@given(**RUNS, flaw=st.sampled_from(_WRITE_FLAWS))
def test_writes_whole_match_bytewise(crc: bool, sizes: list[int], flaw: str, at: int) -> None:
    whole = _writes(crc, sizes, flaw, at, whole=True)
    assert whole == _writes(crc, sizes, flaw, at, whole=False)
    if flaw == "none" or (at >= len(sizes) and flaw != "bad_crc"):
        assert whole[3] is EngineState.RTS
        assert whole[2][0][3 : 3 + sum(sizes)] == b"".join(
            _payload(i, n) for i, n in enumerate(sizes)
        )


@settings(max_examples=150, deadline=None)
@given(**RUNS, flaw=st.sampled_from(_READ_FLAWS))
def test_read_responses_whole_match_bytewise(
    crc: bool, sizes: list[int], flaw: str, at: int
) -> None:
    whole = _reads(crc, sizes, flaw, at, whole=True)
    assert whole == _reads(crc, sizes, flaw, at, whole=False)
    if flaw == "none":
        assert whole[3] is EngineState.RTS
        assert whole[0] == [(1, WCStatus.SUCCESS, sum(sizes)), (3, WCStatus.SUCCESS, 0)]


@pytest.mark.parametrize("crc", [True, False])
@pytest.mark.parametrize(
    ("run", "flaw"), [(_writes, f) for f in _WRITE_FLAWS] + [(_reads, f) for f in _READ_FLAWS]
)
@pytest.mark.parametrize("sizes", [[20, 0, 33, 20, 7, 20], [600, 0, 5000, 520, 7, 700]])
def test_each_flaw_in_the_middle_of_a_run(run, flaw: str, crc: bool, sizes: list[int]) -> None:
    # (payloads from 512 bytes take the kernels' copying CRC pass)
    for at in (0, 3):
        assert run(crc, sizes, flaw, at, whole=True) == run(crc, sizes, flaw, at, whole=False)


def test_clean_runs_never_reach_the_general_path() -> None:
    """A clean run of whole Writes and the whole response of a Read are placed by the
    kernels: the general path never parses one of their headers."""
    sizes = [1448] * 40 + [17]
    expected = b"".join(_payload(i, n) for i, n in enumerate(sizes))
    host = Host(True)
    region = host.region(sum(sizes))
    host.engine.receive_data(
        wire(*(tagged(Opcode.WRITE, region.stag, region.addr + 1448 * i, _payload(i, n))
               for i, n in enumerate(sizes)))
    )  # fmt: skip
    assert host.engine._hdr is None  # the general path's last parsed header: none
    assert bytes(region.view) == expected
    host = Host(True)
    sink = host.region(sum(sizes))
    sge = (SGE(sink.addr, len(expected), sink.stag),)
    host.engine.post_send(SendJob(1, WROpcode.RDMA_READ, _SIG, sge, None, len(expected), 0, 9))
    host.engine.produce()
    host.engine.receive_data(
        wire(*(tagged(Opcode.READ_RESPONSE, sink.stag, sink.addr + 1448 * i, _payload(i, n),
                      last=i == len(sizes) - 1) for i, n in enumerate(sizes)))
    )  # fmt: skip
    assert host.engine._hdr is None
    assert bytes(sink.view) == expected
    assert [(w.wr_id, w.status) for w in host.send_wcs] == [(1, WCStatus.SUCCESS)]


@pytest.mark.parametrize("first", ["write", "send"])
def test_writes_and_sends_taking_turns_never_reach_the_general_path(first: str) -> None:
    """RDS's RDMA by cookie: each message is a Write followed by the Send that announces
    it. Read in one buffer, the Writes and the Sends are all taken by the fast paths,
    each after the other, whichever comes first; the general path parses no header."""
    host = Host(True)
    region = host.region(16 * 100)
    inbox = host.region(16 * 64)
    for i in range(16):
        host.rq.append(RecvJob(i, (SGE(inbox.addr + 64 * i, 64, inbox.stag),), 64))
    fpdus = []
    for i in range(8):
        write = tagged(Opcode.WRITE, region.stag, region.addr + 100 * i, _payload(i, 100))
        send = untagged(Opcode.SEND, QN.SEND, i + 1, 0, b"announce %d" % i)
        fpdus += [write, send] if first == "write" else [send, write]
    host.engine.receive_data(wire(*fpdus))
    assert host.engine._hdr is None
    assert bytes(region.view[:800]) == b"".join(_payload(i, 100) for i in range(8))
    assert [(w.wr_id, w.status, w.byte_len) for w in host.recv_wcs] == [
        (i, WCStatus.SUCCESS, len(b"announce %d" % i)) for i in range(8)
    ]
    assert bytes(inbox.view[64 * 7 : 64 * 7 + 10]) == b"announce 7"


@settings(max_examples=60, deadline=None)
@given(
    size=st.integers(0, 5000),
    max_fpdu=st.sampled_from([64, 1460, 4096, 65536]),
    split=st.integers(0, 5000),
    crc=st.booleans(),
)
def test_tagged_framing_matches_the_codec(size: int, max_fpdu: int, split: int, crc: bool) -> None:
    """A Write from one SGE or two is framed (by whichever kernels run) into the FPDUs the
    codec gives, ``max_fpdu`` bytes at most each."""
    host = Host(crc, max_fpdu=max_fpdu)
    data = _payload(3, size)
    cut = min(split, size)
    first, second = host.region(data[:cut] or b"\0"), host.region(data[cut:] or b"\0")
    sges = (SGE(first.addr, cut, first.stag), SGE(second.addr, size - cut, second.stag))
    job = SendJob(1, WROpcode.RDMA_WRITE, 0, sges, None, size, 0x7000, 0x1234)
    host.engine.post_send(job)
    framed = b"".join(bytes(b) for b in host.engine.produce())
    chunk = (max_fpdu - ddp.TAGGED_HDR_LEN - ddp.TRAILER_CRC_LEN) & ~3
    pieces = [data[o : o + chunk] for o in range(0, size, chunk)] or [b""]
    expected = wire(
        *(
            tagged(Opcode.WRITE, 0x1234, 0x7000 + k * chunk, piece, last=k == len(pieces) - 1)
            for k, piece in enumerate(pieces)
        ),
        crc=crc,
    )
    assert framed == expected
