"""The engine's fast path for small Sends (many whole FPDUs in one received buffer)
against its general path (the same bytes fed one at a time, which never holds a
whole FPDU when the header is parsed): both must give the same completions, the
same placed bytes and the same Terminate."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from test_engine_sansio import Host, untagged, wire

from rdmashim import SGE, WCStatus
from rdmashim.verbs.softiwarp.ddp import QN, Opcode
from rdmashim.verbs.softiwarp.engine import EngineState, RecvJob

_FLAW = st.sampled_from(
    ["none", "bad_crc", "wrong_msn", "too_long", "dead_region", "no_receive", "inv", "not_last"]
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
    fpdus = []
    for i, size in enumerate(sizes):
        op = Opcode.SEND_SE if i % 3 == 0 else Opcode.SEND
        payload = bytes((i + k) & 0xFF for k in range(size))
        msn, last = i + 1, True
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
    if whole:
        host.engine.receive_data(data)
    else:
        for k in range(len(data)):
            host.engine.receive_data(data[k : k + 1])
    term = b"".join(bytes(b) for b in host.engine.produce())
    return (
        [(w.wr_id, w.status, w.byte_len, w.solicited) for w in host.recv_wcs],
        bytes(recv.view),
        host.engine.state,
        host.engine.error.code if host.engine.error is not None else None,
        term,
    )


@settings(max_examples=150, deadline=None)
@given(
    crc=st.booleans(),
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=12),
    flaw=_FLAW,
    at=st.integers(0, 11),
)
def test_whole_buffer_matches_bytewise(crc: bool, sizes: list[int], flaw: str, at: int) -> None:
    whole = _run(crc, sizes, flaw, at, whole=True)
    assert whole == _run(crc, sizes, flaw, at, whole=False)
    if flaw == "none" or (at >= len(sizes) and flaw != "bad_crc"):
        assert whole[2] is EngineState.RTS
        assert [w[:3] for w in whole[0]] == [(i, WCStatus.SUCCESS, n) for i, n in enumerate(sizes)]
