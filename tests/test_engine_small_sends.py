"""The engine's fast path for small Sends (many whole FPDUs in one received buffer)
against its general path (the same bytes fed one at a time, which never holds a
whole FPDU when the header is parsed): both must give the same completions, the
same placed bytes and the same Terminate."""

from __future__ import annotations

import errno

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_engine_sansio import Host, pump, untagged, wire

from rdmashim import SGE, RecvWR, SendFlags, SendWR, VerbsError, WCStatus, WROpcode
from rdmashim.providers.softiwarp.ddp import QN, Opcode
from rdmashim.providers.softiwarp.engine import Engine
from rdmashim.providers.softiwarp.jobs import EngineState, RecvJob, SendJob
from rdmashim.providers.softiwarp.memory import Region

from pairs import Side

pytestmark = pytest.mark.usefixtures("engine_kernels")  # compiled and Python kernels

FLAWS = ["none", "bad_crc", "wrong_msn", "too_long", "dead_region", "no_receive", "inv", "not_last"]
_FLAW = st.sampled_from(FLAWS)


def _stream(crc: bool, sizes: list[int], flaw: str, at: int, first_msn: int) -> bytearray:
    """The FPDUs of Sends of ``sizes`` bytes from MSN ``first_msn`` on, with ``flaw`` at
    Send ``at`` if it is one of the stream's."""
    fpdus = []
    for i, size in enumerate(sizes):
        op = Opcode.SEND_SE if i % 3 == 0 else Opcode.SEND
        payload = bytes((i + k) & 0xFF for k in range(size))
        msn, last = first_msn + i, True
        if i == at and flaw == "wrong_msn":
            msn += 1
        if i == at and flaw == "inv":
            op = Opcode.SEND_INV
        if i == at and flaw == "not_last":
            last = False
        fpdus.append(untagged(op, QN.SEND, msn, 0, payload, last=last))
    data = bytearray(wire(*fpdus, crc=crc))
    if flaw == "bad_crc":
        data[-1] ^= 1
    return data


def _feed(host: Host, data: bytearray, whole: bool) -> None:
    if whole:
        host.engine.receive_data(data)
    else:
        for k in range(len(data)):
            host.engine.receive_data(data[k : k + 1])


def _outcome(host: Host, *regions: Region) -> tuple:
    term = b"".join(bytes(b) for b in host.engine.produce())
    return (
        [(w.wr_id, w.status, w.byte_len, w.solicited) for w in host.recv_wcs],
        [bytes(r.view) for r in regions],
        host.engine.state,
        host.engine.error.code if host.engine.error is not None else None,
        term,
    )


def _run(crc: bool, sizes: list[int], flaw: str, at: int, whole: bool):
    host = Host(crc)
    recv = host.region(64 * (len(sizes) + 1))
    dead = host.region(64)
    for i in range(len(sizes)):
        if flaw == "no_receive" and i == at:
            break
        region = dead if flaw == "dead_region" and i == at else recv
        length = 4 if flaw == "too_long" and i == at else 64
        sges = (SGE(region.addr, length // 2, region.stag), SGE(region.addr + 32, 32, region.stag))
        if i % 2:  # one SGE or two
            sges = (SGE(region.addr + 64 * i, length, region.stag),)
        host.rq.append(RecvJob(i, sges if region is recv or i % 2 else sges[:1], length))
    host.memory.deregister(dead)
    _feed(host, _stream(crc, sizes, flaw, at, 1), whole)
    return _outcome(host, recv)


def _run_reposted(crc: bool, sizes: list[int], flaw: str, at: int, whole: bool, split: bool):
    """As :func:`_run`, into receives of one SGE each (in one region, or alternating
    between two when ``split``) that took a clean run of Sends before, so the receiver
    checked and kept them; a dead region dies between the runs."""
    host = Host(crc)
    regions = (host.region(64 * len(sizes)), host.region(64 * len(sizes)))
    dead = host.region(64)
    jobs = []
    for i in range(len(sizes)):
        region = regions[i % 2 if split else 0]
        offset = 64 * i
        if flaw == "dead_region" and i == at:
            region, offset = dead, 0
        length = 4 if flaw == "too_long" and i == at else 64
        jobs.append(RecvJob(i, (SGE(region.addr + offset, length, region.stag),), length))
    host.rq.extend(jobs)
    host.engine.receive_data(_stream(crc, [1] * len(sizes), "none", -1, 1))
    assert len(host.recv_wcs) == len(sizes) and not host.rq
    host.recv_wcs.clear()
    if flaw == "dead_region":
        host.memory.deregister(dead)
    host.rq.extend(jobs[:at] if flaw == "no_receive" else jobs)
    _feed(host, _stream(crc, sizes, flaw, at, 1 + len(sizes)), whole)
    return _outcome(host, *regions)


FLAWED_RUNS = {
    "crc": st.booleans(),
    "sizes": st.lists(st.integers(0, 40), min_size=1, max_size=12),
    "flaw": _FLAW,
    "at": st.integers(0, 11),
}
"""Strategies for the arguments of ``_run`` but ``whole``: a run of Sends, maybe flawed."""


@settings(max_examples=150, deadline=None)
@given(**FLAWED_RUNS)
def test_whole_buffer_matches_bytewise(crc: bool, sizes: list[int], flaw: str, at: int) -> None:
    whole = _run(crc, sizes, flaw, at, whole=True)
    assert whole == _run(crc, sizes, flaw, at, whole=False)
    if flaw == "none" or (at >= len(sizes) and flaw != "bad_crc"):
        assert whole[2] is EngineState.RTS
        assert [w[:3] for w in whole[0]] == [(i, WCStatus.SUCCESS, n) for i, n in enumerate(sizes)]


@settings(max_examples=150, deadline=None)
@given(**FLAWED_RUNS, split=st.booleans())
def test_reposted_receives_whole_buffer_matches_bytewise(
    crc: bool, sizes: list[int], flaw: str, at: int, split: bool
) -> None:
    """Receives checked in an earlier run and posted again are not checked again (the
    fast path places into them as kept) until a region dies: the same outcome as the
    general path, which checks each receive as it comes."""
    whole = _run_reposted(crc, sizes, flaw, at, True, split)
    assert whole == _run_reposted(crc, sizes, flaw, at, False, split)
    if flaw == "none" or (at >= len(sizes) and flaw != "bad_crc"):
        assert whole[2] is EngineState.RTS
        assert [w[:3] for w in whole[0]] == [(i, WCStatus.SUCCESS, n) for i, n in enumerate(sizes)]


@pytest.mark.parametrize("crc", [True, False])
@pytest.mark.parametrize("flaw", FLAWS)
def test_one_send_whole_matches_bytewise(crc: bool, flaw: str) -> None:
    """A buffer holding one Send (the ping-pong case, placed without a run's
    bookkeeping) ends as the general path ends it, with each flaw."""
    whole = _run_reposted(crc, [8], flaw, 0, True, False)
    assert whole == _run_reposted(crc, [8], flaw, 0, False, False)
    if flaw == "none":
        assert [w[:3] for w in whole[0]] == [(0, WCStatus.SUCCESS, 8)]


@pytest.mark.parametrize("op", [Opcode.SEND, Opcode.SEND_SE])
def test_one_whole_send_skips_the_receive_loop(monkeypatch: pytest.MonkeyPatch, op: Opcode) -> None:
    """Bytes that are exactly one whole Send (what a ping-pong reads) are completed
    without a pass of the engine's receive loop; anything more goes through it."""
    host = Host(True)
    region = host.region(64)
    host.rq.extend(RecvJob(i, (SGE(region.addr + 32 * i, 32, region.stag),), 32) for i in (0, 1))
    one = wire(untagged(op, QN.SEND, 1, 0, b"ping"), crc=True)
    passes: list[int] = []
    general = Engine._process
    monkeypatch.setattr(Engine, "_process", lambda e: passes.append(1) or general(e))
    host.engine.receive_data(one)
    assert not passes  # fails when the one-Send entry of received() is gone
    assert [(w.wr_id, w.byte_len, w.solicited) for w in host.recv_wcs] == [
        (0, 4, op is Opcode.SEND_SE)
    ]
    assert bytes(region.view[:4]) == b"ping"
    host.engine.receive_data(wire(untagged(op, QN.SEND, 2, 0, b"pong"), crc=True)[:-1])
    assert passes and len(host.recv_wcs) == 1  # a part of a Send: the loop waits for the rest


@settings(max_examples=80, deadline=None)
@given(
    crc=st.booleans(),
    payloads=st.lists(st.binary(max_size=70), min_size=1, max_size=10),
    flags=st.lists(st.sampled_from([0, SendFlags.SOLICITED, SendFlags.SIGNALED]), min_size=10),
    inv=st.lists(st.booleans(), min_size=10),
)
def test_inline_framing_matches_general_path(
    crc: bool, payloads: list[bytes], flags: list[int], inv: list[bool]
) -> None:
    """Inline Sends framed by the fast path are the bytes the general path frames for
    the same Sends gathered from registered memory."""
    inline, gathered = Host(crc), Host(crc)
    for i, data in enumerate(payloads):
        op = WROpcode.SEND_WITH_INV if inv[i] else WROpcode.SEND
        stag = 0x1234 if inv[i] else 0
        region = gathered.region(data or b"\0")
        sges = (SGE(region.addr, len(data), region.stag),)
        flag = int(flags[i])
        inline.engine.post_send(SendJob(i, op, flag, (), data, len(data), invalidate_rkey=stag))
        gathered.engine.post_send(SendJob(i, op, flag, sges, None, len(data), invalidate_rkey=stag))
    fast = b"".join(bytes(b) for b in inline.engine.produce())
    assert fast == b"".join(bytes(b) for b in gathered.engine.produce())
    for host in (inline, gathered):
        host.engine.sent(len(fast))
    assert inline.send_wcs == gathered.send_wcs


def test_inline_sends_around_other_work() -> None:
    """A fenced Send waits for the Read before it; a Send whose invalidate STag does not
    fit 32 bits is refused as the general path refuses it; order is kept."""
    a, b = Host(True), Host(True)
    src = b.region(b"0123456789")
    sink = a.region(10)
    rbuf = b.region(64 * 3)
    for i in range(3):
        b.rq.append(RecvJob(i, (SGE(rbuf.addr + 64 * i, 64, rbuf.stag),), 64))
    post = a.engine.post_send
    post(SendJob(0, WROpcode.SEND, int(SendFlags.SIGNALED), (), b"first", 5))
    read_sge = (SGE(sink.addr, 10, sink.stag),)
    post(SendJob(1, WROpcode.RDMA_READ, 0, read_sge, None, 10, src.addr, src.stag))
    post(SendJob(2, WROpcode.SEND, int(SendFlags.FENCE | SendFlags.SIGNALED), (), b"fenced", 6))
    post(SendJob(3, WROpcode.SEND, int(SendFlags.SOLICITED), (), b"", 0))
    first = b"".join(bytes(x) for x in a.engine.produce())
    a.engine.sent(len(first))
    assert b"fenced" not in first  # held until the Read's response is in
    b.engine.receive_data(first)
    pump(a, b, [4096])
    assert [(w.wr_id, w.byte_len, w.solicited) for w in b.recv_wcs] == [
        (0, 5, False),
        (1, 6, False),
        (2, 0, True),
    ]
    assert bytes(rbuf.view[64:70]) == b"fenced"
    assert [(w.wr_id, w.status) for w in a.send_wcs] == [
        (0, WCStatus.SUCCESS),
        (2, WCStatus.SUCCESS),
    ]
    assert bytes(sink.view) == b"0123456789"
    post(SendJob(4, WROpcode.SEND_WITH_INV, 0, (), b"x", 1, invalidate_rkey=1 << 32))
    a.engine.produce()
    assert a.engine.state is EngineState.ERROR
    assert a.send_wcs[-1][:2] == (4, WCStatus.LOC_PROT_ERR)


async def test_inline_gathers_sges_and_bytes(pair: tuple[Side, Side]) -> None:
    """An inline Send may mix registered memory and plain bytes: they go out joined,
    copied when posted; a piece outside any region is refused at post time."""
    client, server = pair
    rbuf = server.reg(64)
    server.qp.post_recv(RecvWR(7, [rbuf.sge()]))
    src = client.reg(b"registered")
    inline = SendFlags.INLINE | SendFlags.SIGNALED
    client.qp.post_send(SendWR(1, WROpcode.SEND, [b"<", src.sge(0, 10), b">"], inline))
    src.buf[:3] = b"XXX"
    wc = (await server.recv_cq.poll_wait(1))[0]
    assert (wc.wr_id, wc.status, wc.byte_len) == (7, WCStatus.SUCCESS, 12)
    assert bytes(rbuf.buf[:12]) == b"<registered>"
    with pytest.raises(VerbsError) as info:
        client.qp.post_send(
            SendWR(2, WROpcode.SEND, [b"x", SGE(src.addr + 5, 10, src.lkey)], inline)
        )
    assert info.value.errno == errno.EINVAL


def test_a_run_checks_each_receive_once_into_one_shared_tuple() -> None:
    """The receives of a run checked in one region share one (token, region) tuple, so a
    later run finds them all checked by counting one object; a deregistration (a new
    token) makes them checked again, into a new tuple."""
    host = Host(True)
    rbuf = host.region(64 * 8)
    jobs = [RecvJob(i, (SGE(rbuf.addr + 64 * i, 64, rbuf.stag),), 64) for i in range(8)]

    def run(first_msn: int) -> None:
        host.rq.extend(jobs[:4])
        host.engine.receive_data(_stream(True, [8, 16, 24, 32], "none", -1, first_msn))

    run(1)
    shared = jobs[0].checked
    assert shared is not None and shared[1].stag == rbuf.stag
    assert all(job.checked is shared for job in jobs[:4])
    run(5)  # checked already: the run takes the spans as they are
    assert all(job.checked is shared for job in jobs[:4])
    host.memory.deregister(host.region(64))  # another region goes: a new token
    run(9)
    renewed = jobs[0].checked
    assert renewed is not None and renewed is not shared and renewed[0] is not shared[0]
    assert all(job.checked is renewed for job in jobs[:4])
    assert [w.byte_len for w in host.recv_wcs] == [8, 16, 24, 32] * 3
    assert all(w.status is WCStatus.SUCCESS for w in host.recv_wcs)
