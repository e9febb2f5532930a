"""Bytes the Linux kernel's siw really sent (../shared/tools/siwvm/captures): our codecs,
MPA rules and FPDU parser take every one of them."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from crc32c import crc32c

from rdmashim.verbs.softiwarp import ddp, mpa
from rdmashim.verbs.softiwarp.negotiation import MpaOptions, answer_request, check_reply

from pcapstreams import tcp_streams

CAPTURES = Path(__file__).resolve().parents[2] / "shared" / "tools" / "siwvm" / "captures"
RPING = {"SEND", "READ_REQUEST", "READ_RESPONSE", "WRITE"}
RECORDED = {
    "siw-rping.pcap": RPING,
    "siw-write_bw.pcap": {"WRITE"},
    "siw-read_bw.pcap": {"READ_REQUEST", "READ_RESPONSE"},
    "siw-send_bw.pcap": {"SEND"},
    "host-python-vs-guest-siw-rping.pcap": RPING,
    "host-python-vs-guest-siw-rping-crc.pcap": RPING,
}


def connections(name: str) -> list[tuple[bytes, bytes]]:
    """(initiator's bytes, responder's bytes) of every MPA connection in a capture."""
    path = CAPTURES / name
    if not path.exists():
        pytest.skip(f"{path} not present")
    streams = tcp_streams(path)
    out = []
    for s in streams:
        data = s.data()
        if not data.startswith(mpa.REQ_KEY):
            continue
        back = next((r for r in streams if r.src == s.dst and r.dst == s.src), None)
        if back is not None and back.data().startswith(mpa.REP_KEY):
            out.append((data, back.data()))
    return out


def walk_fpdus(stream: bytes, crc: bool) -> Counter:
    """Parse every complete FPDU; check its CRC (and ignore its PAD bytes) like our engine."""
    seen: Counter = Counter()
    pos = 0
    while pos + 4 <= len(stream):
        hdr = ddp.parse_header(stream[pos:])
        if hdr is None:
            break
        end = pos + hdr.ulpdu_len + 2
        pad = ddp.pad_len(hdr.ulpdu_len)
        if end + pad + 4 > len(stream):
            break  # the capture ends inside this FPDU
        if crc:
            assert ddp.check_trailer(crc32c(stream[pos:end]), stream[end : end + pad + 4])
        else:
            assert stream[end + pad : end + pad + 4] == b"\0\0\0\0"
        if hdr.opcode is ddp.Opcode.TERMINATE:
            ddp.parse_terminate(stream[pos + hdr.header_len : end])
        seen[hdr.opcode.name] += 1
        pos = end + pad + 4
    return seen


@pytest.mark.parametrize("name", list(RECORDED))
def test_recorded_siw_connections(name: str) -> None:
    conns = connections(name)
    assert conns, "no MPA connection in the capture"
    total: Counter = Counter()
    for initiator, responder in conns:
        req, used_req = mpa.parse_start_frame(initiator, reply=False)
        rep, used_rep = mpa.parse_start_frame(responder, reply=True)
        assert not req.markers and not rep.markers and not rep.reject
        # Our responder answers siw's Request; our initiator accepts siw's Reply.
        reply, ours = answer_request(req, MpaOptions(crc=False), b"")
        assert reply.revision == req.revision and reply.enhanced == req.enhanced
        theirs = check_reply(req, rep, MpaOptions(crc=req.crc, ird=req.ird, ord=req.ord))
        crc = theirs.crc
        assert ours.crc == req.crc  # siw does not ask for CRC; with C set by a peer it runs it
        total += walk_fpdus(initiator[used_req:], crc) + walk_fpdus(responder[used_rep:], crc)
    assert RECORDED[name] <= set(total), total


def test_siw_request_bytes() -> None:
    """The Request every siw sends by default (rev 2, enhanced, IRD=ORD=1, no CRC)."""
    initiator, _ = connections("siw-rping.pcap")[0]
    assert initiator[:24] == mpa.REQ_KEY + bytes([0x10, 0x02, 0x00, 0x04, 0, 1, 0, 1])
