"""The wire judge (``tools/wirejudge.py``) on captures made here, byte by byte, from the RFCs.

Each test writes a pcap of one TCP connection (Ethernet, IPv4, TCP, then an MPA
Request and Reply and FPDUs laid out after RFC 5044, 5041 and 5040 with
``struct``, not with rdmashim's codecs) and runs the judge's command line on it:
clean traffic must pass with the fields decoded right; each broken variant must
fail with the finding that names it. Needs tshark (skipped without it).
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import siwvm
from crc32c import crc32c

pytestmark = pytest.mark.wire

JUDGE = Path(__file__).resolve().parent.parent / "tools" / "wirejudge.py"
PORT = 4791
CLIENT, SERVER = "10.0.0.1", "10.0.0.2"

# MPA (RFC 5044 7.1, RFC 6581 7.1)
REQ_KEY, REP_KEY = b"MPA ID Req Frame", b"MPA ID Rep Frame"
MARKERS, CRC, REJECT, ENHANCED = 0x80, 0x40, 0x20, 0x10
# RDMAP opcodes (RFC 5040 4.3)
WRITE, READ_REQ, READ_RESP, SEND, TERMINATE = 0, 1, 2, 3, 7


@pytest.fixture(autouse=True)
def tshark() -> None:
    if shutil.which("tshark") is None:
        pytest.skip("tshark not installed (apt-get install tshark)")


# ---------------------------------------------------------------- building captures


def start_frame(reply: bool, rev: int = 1, flags: int = 0, private: bytes = b"") -> bytes:
    key = REP_KEY if reply else REQ_KEY
    return key + struct.pack("!BBH", flags, rev, len(private)) + private


def ird_ord(ird: int = 1, ord_: int = 1, p2p: bool = False, write_rtr: bool = False) -> bytes:
    return struct.pack("!HH", ird | (0x8000 if p2p else 0), ord_ | (0x8000 if write_rtr else 0))


def untagged(opcode: int, qn: int, msn: int, mo: int = 0, last: bool = True, dv: int = 1) -> bytes:
    control = (0x40 if last else 0) | dv
    return struct.pack("!BBIIII", control, 0x40 | opcode, 0, qn, msn, mo)


def tagged(opcode: int, stag: int, to: int, last: bool = True) -> bytes:
    return struct.pack("!BBIQ", 0x80 | (0x40 if last else 0) | 1, 0x40 | opcode, stag, to)


def read_request(sink: int, sink_to: int, size: int, source: int, source_to: int) -> bytes:
    return struct.pack("!IQIIQ", sink, sink_to, size, source, source_to)


def fpdu(
    ulpdu: bytes, crc: bool, pad_byte: int = 0, bad_crc: bool = False, length: int = 0
) -> bytes:
    """ULPDU_Length, ULPDU, PAD to 4 bytes, CRC32c (little-endian; zeros without CRC)."""
    body = struct.pack("!H", length or len(ulpdu)) + ulpdu
    body += bytes([pad_byte]) * (-len(body) % 4)
    value = crc32c(body) ^ (0xFFFF if bad_crc else 0) if crc else 0
    return body + struct.pack("<I", value)


@dataclass
class Capture:
    """One TCP connection, client port 40000 to :data:`PORT`, as Ethernet frames."""

    frames: list[bytes] = field(default_factory=list)
    seq: dict[str, int] = field(default_factory=lambda: {CLIENT: 1000, SERVER: 5000})

    def segment(self, src: str, payload: bytes = b"", flags: int = 0x18) -> None:
        dst = SERVER if src == CLIENT else CLIENT
        sport, dport = (40000, PORT) if src == CLIENT else (PORT, 40000)
        tcp = struct.pack("!HHIIBBHHH", sport, dport, self.seq[src], self.seq[dst],
                          5 << 4, flags, 65535, 0, 0)  # fmt: skip
        self.seq[src] += len(payload) + (1 if flags & 0x03 else 0)  # SYN and FIN count one
        total = 20 + len(tcp) + len(payload)
        addresses = bytes(map(int, src.split("."))), bytes(map(int, dst.split(".")))
        ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, total, 0, 0x4000, 64, 6, 0, *addresses)
        ip = ip[:10] + struct.pack("!H", ip_checksum(ip)) + ip[12:]
        ether = b"\x02\0\0\0\0\x02" + b"\x02\0\0\0\0\x01" + b"\x08\x00"
        self.frames.append(ether + ip + tcp + payload)

    def connect(self) -> None:
        self.segment(CLIENT, flags=0x02)
        self.segment(SERVER, flags=0x12)
        self.segment(CLIENT, flags=0x10)

    def write(self, path: Path) -> Path:
        out = [struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 65535, 1)]
        for n, frame in enumerate(self.frames):
            out.append(struct.pack("<IIII", 1_700_000_000, n * 1000, len(frame), len(frame)))
            out.append(frame)
        path.write_bytes(b"".join(out))
        return path


def ip_checksum(header: bytes) -> int:
    total = sum(struct.unpack(f"!{len(header) // 2}H", header))
    while total > 0xFFFF:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def session(crc: bool = False, rev: int = 1, **broken: Any) -> Capture:
    """MPA exchange, then a Send, a Read Request and its Response, a two-segment Write.

    ``broken`` picks one fault: ``key``, ``crc_frame``, ``opcode``, ``length``,
    ``pad``, ``qn``, ``msn``, ``dv``, ``tagged_send``.
    """
    cap = Capture()
    cap.connect()
    flags = (CRC if crc else 0) | (ENHANCED if rev == 2 else 0)
    private = ird_ord() if rev == 2 else b""
    request = start_frame(False, rev, flags, private)
    if broken.get("key"):
        request = b"MPA ID Req Fram3" + request[16:]
    cap.segment(CLIENT, request)
    cap.segment(SERVER, start_frame(True, rev, flags, private))
    send = untagged(SEND, 0, broken.get("msn", 1), dv=broken.get("dv", 1))
    if broken.get("tagged_send"):
        send = tagged(SEND, 0x1234, 0)
    cap.segment(CLIENT, fpdu(send + b"hello, iwarp", crc, bad_crc=broken.get("crc_frame", False),
                             length=broken.get("length", 0)))  # fmt: skip
    rr = untagged(broken.get("opcode", READ_REQ), broken.get("qn", 1), 1)
    cap.segment(CLIENT, fpdu(rr + read_request(0x100, 0, 64, 0x200, 0x1000), crc))
    cap.segment(SERVER, fpdu(tagged(READ_RESP, 0x100, 0) + bytes(range(64)), crc))
    data = b"x" * 30  # 14 + 30 = 44: a ULPDU needing 2 bytes of PAD
    pad = broken.get("pad", 0)
    cap.segment(CLIENT, fpdu(tagged(WRITE, 0x300, 0, last=False) + data, crc, pad_byte=pad))
    cap.segment(CLIENT, fpdu(tagged(WRITE, 0x300, 30) + data, crc))
    cap.segment(CLIENT, fpdu(untagged(SEND, 0, 2) + b"bye", crc))
    return cap


def judge(pcap: Path, *options: str) -> tuple[int, dict[str, Any]]:
    done = subprocess.run(
        [sys.executable, str(JUDGE), str(pcap), str(PORT), "--list", *options],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return done.returncode, json.loads(done.stdout)


def rules(result: dict[str, Any]) -> set[str]:
    return {finding["rule"] for finding in result["lint"]}


# ---------------------------------------------------------------- clean traffic


@pytest.mark.parametrize(("rev", "crc"), [(1, False), (1, True), (2, False), (2, True)])
def test_clean_session_passes(tmp_path: Path, rev: int, crc: bool) -> None:
    rc, result = judge(session(crc=crc, rev=rev).write(tmp_path / "good.pcap"))
    text = json.dumps(result, indent=1)
    assert rc == 0 and result["ok"] and result["problems"] == [], text
    assert result["rdmap_opcodes"] == {"Send": 2, "Read Request": 1, "Read Response": 1, "Write": 2}
    assert result["fpdus"] == 6
    assert result["crc"] == {"good": 6 if crc else 0, "bad": 0, "not_checked": 0 if crc else 6}
    starts = result["mpa_start_frames"]
    assert (starts["req"], starts["rep"]) == (1, 1)
    for frame in starts["frames"]:
        assert frame["rev"] == rev and frame["flags"]["C"] == crc and not frame["flags"]["M"]
        assert frame["flags"]["H"] == (rev == 2)
        if rev == 2:
            assert frame["mpa_v2"]["ird"] == frame["mpa_v2"]["ord"] == 1
            assert not frame["mpa_v2"]["peer2peer"]
    fpdus = result["fpdu_list"]
    request = next(f for f in fpdus if f["opcode"] == READ_REQ)
    assert (request["qn"], request["msn"], request["read_size"]) == (1, 1, 64), request
    assert request["sink_stag"] == "0x00000100" and request["src_stag"] == "0x00000200"
    writes = [f for f in fpdus if f["opcode"] == WRITE]
    assert [(w["stag"], w["last"], w["payload_len"]) for w in writes] == [
        ("0x00000300", False, 30),
        ("0x00000300", True, 30),
    ]
    sends = [f for f in fpdus if f["opcode"] == SEND]
    assert [(s["qn"], s["msn"], s["mo"]) for s in sends] == [(0, 1, 0), (0, 2, 0)]


# ---------------------------------------------------------------- broken traffic


def test_bad_crc(tmp_path: Path) -> None:
    rc, result = judge(session(crc=True, crc_frame=True).write(tmp_path / "crc.pcap"))
    assert rc == 1 and not result["ok"]
    assert result["crc"]["bad"] == 1 and len(result["crc_errors"]) == 1
    assert "Bad CRC32" in result["crc_errors"][0]["tshark"]
    assert result["crc_errors"][0]["src"] == f"{CLIENT}:40000"


@pytest.mark.parametrize("guest", [CLIENT, SERVER])
def test_bad_crc_from_the_guest_is_set_aside(tmp_path: Path, guest: str) -> None:
    """The siw test bed's split (``siwvm.set_aside_guest``): a bad CRC the guest sent is
    its own finding; one we sent stays ours."""
    _, result = judge(session(crc=True, crc_frame=True).write(tmp_path / "crc.pcap"))
    split = siwvm.set_aside_guest(result, guest)
    if guest == CLIENT:  # the sender of the bad FPDU
        assert split["our_problems"] == [] and len(split["guest_crc"]) == 1, split
    else:
        assert split["our_problems"] == [f"1 {siwvm.CRC_PROBLEM}"] and split["guest_crc"] == []


def test_bad_key_leaves_everything_undissected(tmp_path: Path) -> None:
    rc, result = judge(session(key=True).write(tmp_path / "key.pcap"))
    assert rc == 1 and result["fpdus"] == 0
    assert result["mpa_start_frames"]["req"] == 0
    assert result["problems"][0].startswith("no MPA Request/Reply found")
    assert len(result["undissected_payload"]) == 8  # the start frames and the FPDUs


@pytest.mark.parametrize("length", [200, 20], ids=["too-long", "too-short"])
def test_wrong_ulpdu_length_loses_framing(tmp_path: Path, length: int) -> None:
    """A Send's ULPDU_Length off: what follows it is read as FPDUs it is not."""
    rc, result = judge(session(length=length).write(tmp_path / "length.pcap"))
    text = json.dumps(result, indent=1)
    assert rc == 1, text
    lost = result["malformed"] or result["undissected_payload"] or "mpa.ulpdu_len" in rules(result)
    assert lost, text
    rc, result = judge(session(crc=True, length=length).write(tmp_path / "length-crc.pcap"))
    assert rc == 1 and result["crc"]["bad"] >= 1, json.dumps(result, indent=1)


@pytest.mark.parametrize(
    ("fault", "rule"),
    [
        ({"opcode": 12}, "rdmap.opcode"),
        ({"qn": 0}, "ddp.qn"),
        ({"msn": 5}, "ddp.msn_mo"),
        ({"dv": 2}, "ddp.dv"),
        ({"tagged_send": True}, "ddp.tagged"),
        ({"pad": 0xAA}, "mpa.pad"),
    ],
    ids=lambda v: v if isinstance(v, str) else next(iter(v)),
)
def test_rule_tshark_accepts(tmp_path: Path, fault: dict[str, Any], rule: str) -> None:
    rc, result = judge(session(**fault).write(tmp_path / "lint.pcap"))
    assert rc == 1 and rule in rules(result), json.dumps(result["lint"], indent=1)
    rc, quiet = judge(tmp_path / "lint.pcap", "--no-lint")
    assert quiet["lint"] == [] and (rc == 0) == (quiet["problems"] == [])


def test_tcp_retransmission_is_set_aside(tmp_path: Path) -> None:
    """tshark frames no retransmitted copy; TCP's business, listed apart, not a problem."""
    cap = session()
    # Frames: 0-2 handshake, 3-4 MPA, 5 Send, 6 Read Request, 7 Read Response; send 7 again.
    cap.frames.append(cap.frames[7])
    rc, result = judge(cap.write(tmp_path / "retransmit.pcap"))
    assert rc == 0 and result["undissected_payload"] == [], json.dumps(result, indent=1)
    assert [r["frame"] for r in result["retransmitted_payload"]] == [len(cap.frames)]


def test_pad_from_a_named_sender_is_set_aside(tmp_path: Path) -> None:
    pcap = session(pad=0xAA).write(tmp_path / "pad.pcap")
    rc, result = judge(pcap, "--pad-from", SERVER)  # not the sender: still a problem
    assert rc == 1 and "mpa.pad" in rules(result)
    rc, result = judge(pcap, "--pad-from", CLIENT)
    assert rc == 0 and result["lint"] == [], json.dumps(result, indent=1)
    assert [p["rule"] for p in result["pad_ignored"]] == ["mpa.pad"]


def test_reject_flag_in_a_request(tmp_path: Path) -> None:
    cap = Capture()
    cap.connect()
    cap.segment(CLIENT, start_frame(False, 1, REJECT))
    cap.segment(SERVER, start_frame(True, 1, REJECT))
    rc, result = judge(cap.write(tmp_path / "reject.pcap"))
    assert rc == 1 and "mpa.reject" in rules(result)


def test_usage_errors(tmp_path: Path) -> None:
    rc, result = judge(tmp_path / "absent.pcap")
    assert rc == 2 and not result["ok"] and "absent.pcap" in result["problems"][0]
    garbage = tmp_path / "garbage.pcap"
    garbage.write_bytes(b"not a capture at all")
    rc, result = judge(garbage)
    assert rc == 2 and not result["ok"]
    rc, result = judge(session().write(tmp_path / "good.pcap"), "--tshark", "no-such-tshark")
    assert rc == 2 and "no-such-tshark" in result["problems"][0]
