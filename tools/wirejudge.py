#!/usr/bin/env python3
"""Judge a capture of iWARP traffic with Wireshark's dissectors, and RFC rules on top.

::

    python3 tools/wirejudge.py CAPTURE PORT [--list] [--no-rpcrdma] [--no-lint]
                               [--rfc7306] [--pad-from ADDR ...] [--tshark PATH]

tshark (``-T pdml``) dissects the TCP traffic of PORT: MPA (RFC 5044, 6581),
DDP (RFC 5041), RDMAP (RFC 5040), and above them RPC-over-RDMA, ONC RPC and
NFS. Nobody on this project wrote those dissectors, which makes them a judge
of our bytes. This script turns their output into one JSON verdict on stdout:

* ``crc_errors``: FPDUs whose ``iwarp_mpa.crc_check`` says "Bad CRC32" (tshark
  raises no expert info for a bad CRC; the field's text is the only sign);
* ``undissected_payload``: TCP payload that tshark did not frame as MPA and did
  not reassemble into a later frame (a bad key, a missing start frame, framing
  lost after a wrong ULPDU_Length). A TCP retransmission is not framed by tshark
  either; those frames are listed in ``retransmitted_payload`` and not judged;
* ``malformed``: ``_ws.malformed`` / ``_ws.unreassembled`` (a short ULPDU_Length);
* ``expert_errors``: tshark expert infos of severity Warning or Error raised by
  MPA, DDP/RDMAP, RPC-over-RDMA, RPC or NFS;
* ``lint``: rules tshark accepts silently (see :data:`RULES`). ``--no-lint``
  turns them off; ``--pad-from ADDR`` lists non-zero PAD in frames sent from
  ADDR under ``pad_ignored`` instead (Linux siw sends PAD that is not zero; a
  receiver ignores it, our own sender must not).

``ok`` is true when none of these holds a finding and, if there is TCP payload,
at least one MPA start frame was seen. Exit status: 0 ok, 1 problems, 2 usage
error or tshark failure. Findings tshark 4.0 is known to get wrong are listed in
``ignored_tshark_quirks`` and do not count. ``--list`` adds ``fpdu_list``, every
FPDU with its decoded fields. Only the standard library; tshark must be on PATH.

The capture must hold the MPA Request and Reply: tshark's MPA dissector is a
TCP heuristic that recognises a connection by its start frames only.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

OPCODE_NAMES = {
    0: "Write",
    1: "Read Request",
    2: "Read Response",
    3: "Send",
    4: "Send with Invalidate",
    5: "Send with SE",
    6: "Send with SE and Invalidate",
    7: "Terminate",
    8: "Immediate Data",  # RFC 7306 from here on
    9: "Immediate Data with SE",
    10: "Atomic Request",
    11: "Atomic Response",
}
TAGGED = {0, 2}
"""Write and Read Response use the tagged buffer model, every other opcode the untagged."""
QUEUE_OF = {3: 0, 4: 0, 5: 0, 6: 0, 1: 1, 7: 2}
"""RFC 5040 5.1/6: Sends on QN 0, Read Requests on QN 1, Terminate on QN 2."""
ONE_SEGMENT = {1, 7}
"""Read Request and Terminate are a single DDP segment."""
RESERVED_AFTER_CONTROL = {1, 3, 5, 7}
"""Opcodes whose 32 bits after the RDMAP control byte are reserved (not an Invalidate STag)."""
TAGGED_HEADER, UNTAGGED_HEADER = 14, 18
FLAG_H = 0x10
"""RFC 6581: the MPA rev 2 flag saying an IRD/ORD block opens the private data."""
MAX_PRIVATE_DATA = 512
"""RFC 5044 7.1: PD_Length at most 512."""
JUDGED_PROTOCOLS = {"iwarp_mpa", "iwarp_ddp_rdmap", "rpcordma", "rpc", "nfs"}
SERIOUS = {"Warning", "Warn", "Error"}

RULES = {
    "mpa.rev": "MPA revision 1 or 2; a Reply's not above its Request's",
    "mpa.res": "reserved MPA flag bits zero (H allowed in rev 2)",
    "mpa.reject": "no Reject flag in a Request",
    "mpa.pd_length": f"private data at most {MAX_PRIVATE_DATA} bytes",
    "mpa.v2": "rev 2 with H carries the 4-byte IRD/ORD block",
    "mpa.start": "one Request and then one Reply per TCP connection",
    "mpa.pad": "PAD bytes zero (RFC 5044 4.1)",
    "mpa.ulpdu_len": "ULPDU_Length covers the DDP header (framing kept)",
    "ddp.dv": "DDP version 1",
    "ddp.rsvd": "DDP control reserved bits zero",
    "ddp.tagged": "T flag matches the opcode's buffer model",
    "ddp.qn": "QN 0 for Sends, 1 for Read Requests, 2 for Terminate",
    "ddp.single_segment": "Read Request and Terminate in one segment (L=1, MO=0)",
    "ddp.msn_mo": "MSN from 1 and MO from 0 per stream, sender and QN",
    "rdmap.rv": "RDMAP version 1",
    "rdmap.rsvd": "RDMAP control reserved bits zero",
    "rdmap.opcode": "RDMAP opcode defined (0-7; 0-11 with --rfc7306)",
    "rdmap.rsvd_ulp": "the reserved word after the RDMAP control byte zero",
}
"""Every lint rule, by the name findings carry."""


# ---------------------------------------------------------------- reading PDML


Fields = dict[str, list[ET.Element]]


def collect_fields(element: ET.Element, into: Fields | None = None) -> Fields:
    """Every ``<field>`` under ``element``, by name, in document order."""
    found: Fields = {} if into is None else into
    for child in element:
        if child.tag == "field":
            name = child.get("name")
            if name:
                found.setdefault(name, []).append(child)
            collect_fields(child, found)
    return found


def text(fields: Fields, name: str) -> str | None:
    elems = fields.get(name)
    return elems[0].get("show") if elems else None


def label(fields: Fields, name: str) -> str:
    """The field's ``showname`` after its "Label: " prefix ("" when absent)."""
    elems = fields.get(name)
    return elems[0].get("showname", "").split(": ", 1)[-1] if elems else ""


def raw(fields: Fields, name: str) -> bytes:
    elems = fields.get(name)
    value = elems[0].get("value", "") if elems else ""
    try:
        return bytes.fromhex(value)
    except ValueError:
        return b""


def number(fields: Fields, name: str) -> int | None:
    value = text(fields, name)
    if value is None or value == "":
        return None
    try:
        return int(value, 0)
    except ValueError:
        return {"True": 1, "False": 0}.get(value)


def flag(fields: Fields, name: str) -> bool:
    return text(fields, name) in ("1", "True")


@dataclass
class Pdu:
    """One MPA unit in a packet (a start frame or an FPDU) and the layers tshark put on it."""

    mpa: Fields
    upper: dict[str, list[Fields]] = field(default_factory=dict)


@dataclass
class Packet:
    """What the judge needs of one ``<packet>``."""

    number: int
    stream: int
    src: str
    tcp_len: int
    reassembled_later: bool
    retransmission: bool
    segments: list[int]
    """Frames whose bytes tshark reassembled into this one."""
    pdus: list[Pdu]
    broken: list[tuple[str, Pdu | None]]
    """(name, PDU it follows) of each ``_ws.malformed`` / ``_ws.unreassembled``."""
    experts: list[dict[str, str]]


def experts_in(proto: ET.Element) -> Iterator[dict[str, str]]:
    for expert in proto.iter("field"):
        if expert.get("name") != "_ws.expert":
            continue
        parts = collect_fields(expert)
        yield {
            "proto": proto.get("name", "?"),
            "message": text(parts, "_ws.expert.message") or "",
            "severity": label(parts, "_ws.expert.severity"),
            "group": label(parts, "_ws.expert.group"),
        }


def read_packet(element: ET.Element) -> Packet | None:
    protos = [p for p in element if p.tag == "proto"]
    layers = {p.get("name"): p for p in reversed(protos)}  # the first of each name
    if "tcp" not in layers:
        return None
    tcp = collect_fields(layers["tcp"])
    ip = layers.get("ip") or layers.get("ipv6")
    address = "?"
    if ip is not None:
        ip_fields = collect_fields(ip)
        address = text(ip_fields, "ip.src") or f"[{text(ip_fields, 'ipv6.src')}]"
    pdus: list[Pdu] = []
    broken: list[tuple[str, Pdu | None]] = []
    experts: list[dict[str, str]] = []
    for proto in protos:
        name = proto.get("name", "")
        experts.extend(experts_in(proto))
        if name == "iwarp_mpa":
            pdus.append(Pdu(collect_fields(proto)))
        elif name in JUDGED_PROTOCOLS and pdus:
            pdus[-1].upper.setdefault(name, []).append(collect_fields(proto))
        elif name in ("_ws.malformed", "_ws.unreassembled"):
            broken.append((proto.get("showname", name), pdus[-1] if pdus else None))
    segments = [
        int(f.get("show", "0")) for f in element.iter("field") if f.get("name") == "tcp.segment"
    ]
    frame = collect_fields(layers["frame"]) if "frame" in layers else {}
    return Packet(
        number=number(frame, "frame.number") or -1,
        stream=number(tcp, "tcp.stream") or 0,
        src=f"{address}:{text(tcp, 'tcp.srcport')}",
        tcp_len=number(tcp, "tcp.len") or 0,
        reassembled_later="tcp.reassembled_in" in tcp,
        retransmission="tcp.analysis.retransmission" in tcp
        or "tcp.analysis.fast_retransmission" in tcp,
        segments=segments,
        pdus=pdus,
        broken=broken,
        experts=experts,
    )


# ---------------------------------------------------------------- judging


@dataclass
class Judge:
    """Accumulates the verdict over the packets of one capture."""

    port: int
    lint_on: bool = True
    rfc7306: bool = False
    pad_from: frozenset[str] = frozenset()
    starts: list[dict[str, Any]] = field(default_factory=list)
    fpdus: list[dict[str, Any]] = field(default_factory=list)
    opcodes: Counter = field(default_factory=Counter)
    crc: Counter = field(default_factory=Counter)
    crc_errors: list[dict[str, Any]] = field(default_factory=list)
    malformed: list[dict[str, Any]] = field(default_factory=list)
    expert_errors: list[dict[str, Any]] = field(default_factory=list)
    capture_warnings: list[dict[str, Any]] = field(default_factory=list)
    quirks: list[dict[str, Any]] = field(default_factory=list)
    candidates: list[dict[str, Any]] = field(default_factory=list)
    retransmitted: list[dict[str, Any]] = field(default_factory=list)
    reassembled: set[int] = field(default_factory=set)
    lint: list[dict[str, Any]] = field(default_factory=list)
    pad_ignored: list[dict[str, Any]] = field(default_factory=list)
    rpcordma_procs: Counter = field(default_factory=Counter)
    rpcordma_messages: list[dict[str, Any]] = field(default_factory=list)
    rpc: list[dict[str, Any]] = field(default_factory=list)
    nfs: Counter = field(default_factory=Counter)
    frames_on_port: int = 0
    payload_frames: int = 0
    sequence: dict[tuple[int, str, int], tuple[int, int]] = field(default_factory=dict)
    """(stream, sender, QN) -> the (MSN, MO) the next untagged segment must carry."""
    handshake: dict[int, dict[str, dict[str, Any]]] = field(default_factory=dict)

    def finding(self, frame: int, rule: str, message: str, src: str = "") -> None:
        if not self.lint_on:
            return
        entry = {"frame": frame, "rule": rule, "message": message}
        if rule == "mpa.pad" and src.rsplit(":", 1)[0] in self.pad_from:
            self.pad_ignored.append(entry)
        else:
            self.lint.append(entry)

    def packet(self, pkt: Packet) -> None:
        self.frames_on_port += 1
        self.payload_frames += pkt.tcp_len > 0
        self.reassembled.update(pkt.segments)
        if pkt.tcp_len and not pkt.pdus and not pkt.reassembled_later:
            entry = {
                "frame": pkt.number,
                "stream": pkt.stream,
                "src": pkt.src,
                "tcp_len": pkt.tcp_len,
            }
            (self.retransmitted if pkt.retransmission else self.candidates).append(entry)
        infos = [self.pdu(pkt, pdu) for pdu in pkt.pdus]
        for what, after in pkt.broken:
            info = infos[pkt.pdus.index(after)] if after is not None else {}
            entry = {"frame": pkt.number, "what": what}
            why = self.quirk(what, info, after)
            if why:
                self.quirks.append({**entry, "why_ignored": why})
            else:
                self.malformed.append(entry)
        for expert in pkt.experts:
            self.expert(pkt, expert)

    @staticmethod
    def quirk(what: str, info: dict[str, Any], pdu: Pdu | None) -> str:
        """Why a "Malformed Packet" is tshark 4.0's mistake, not the wire's ("" if it is not)."""
        short_send = info.get("opcode") in (3, 4) and 0 <= (info.get("payload_len") or 0) < 16
        if "RPCoRDMA" in what and short_send:
            return "tshark's rpcordma heuristic reads 16 bytes of a shorter Send"
        chunked = pdu is not None and any(
            number(r, "rpcordma.writes_count") for r in pdu.upper.get("rpcordma", [])
        )
        if "NFS" in what and chunked:
            # RFC 8166 3.4.5: the READ data went by RDMA Write into the write chunk.
            return "tshark 4.0 looks for data inline that an RPC-over-RDMA Write chunk carried"
        return ""

    def expert(self, pkt: Packet, expert: dict[str, str]) -> None:
        proto, message = expert["proto"], expert["message"]
        if expert["severity"] not in SERIOUS or proto.startswith("_ws."):
            return
        entry = {"frame": pkt.number, **expert}
        if proto == "iwarp_mpa" and message.startswith(("Res field is NOT", "Rev field is NOT")):
            start = next((s for s in reversed(self.starts) if s["frame"] == pkt.number), None)
            if start and start["rev"] == 2 and not start["res"] & ~FLAG_H:
                entry["why_ignored"] = (
                    "tshark 4.0 knows MPA rev 1 only (RFC 6581's rev 2 and H flag)"
                )
                self.quirks.append(entry)
                return
        if proto in JUDGED_PROTOCOLS:
            self.expert_errors.append(entry)
        elif proto == "tcp":
            self.capture_warnings.append(entry)

    def pdu(self, pkt: Packet, pdu: Pdu) -> dict[str, Any]:
        mpa = pdu.mpa
        if "iwarp_mpa.req" in mpa or "iwarp_mpa.rep" in mpa:
            self.start_frame(pkt, mpa)
            return {}
        if "iwarp_mpa.fpdu" not in mpa:
            return {}
        info: dict[str, Any] = {
            "frame": pkt.number,
            "ulpdu_len": number(mpa, "iwarp_mpa.ulpdulength"),
        }
        self.fpdus.append(info)
        if info["ulpdu_len"] is not None and info["ulpdu_len"] < TAGGED_HEADER:
            # Shorter than any DDP header: framing lost (a wrong length before it, or garbage).
            self.finding(pkt.number, "mpa.ulpdu_len", f"ULPDU_Length {info['ulpdu_len']}")
        check = label(mpa, "iwarp_mpa.crc_check")
        if not check:
            self.crc["not_checked"] += 1
        elif "Bad CRC32" in check:
            self.crc["bad"] += 1
            self.crc_errors.append({"frame": pkt.number, "src": pkt.src, "tshark": check})
        else:
            self.crc["good"] += 1
        pad = raw(mpa, "iwarp_mpa.pad")
        if any(pad):
            self.finding(pkt.number, "mpa.pad", f"PAD {pad.hex()} is not zero", pkt.src)
        for ddp in pdu.upper.get("iwarp_ddp_rdmap", []):
            self.segment(pkt, info, ddp)
        self.upper_layers(pkt, pdu)
        return info

    def start_frame(self, pkt: Packet, mpa: Fields) -> None:
        kind = "req" if "iwarp_mpa.req" in mpa else "rep"
        res = number(mpa, "iwarp_mpa.res") or 0
        rev = number(mpa, "iwarp_mpa.rev")
        private = raw(mpa, "iwarp_mpa.privatedata")
        start: dict[str, Any] = {
            "frame": pkt.number,
            "stream": pkt.stream,
            "src": pkt.src,
            "type": kind,
            "rev": rev,
            "flags": {
                "M": flag(mpa, "iwarp_mpa.marker_flag"),
                "C": flag(mpa, "iwarp_mpa.crc_flag"),
                "R": flag(mpa, "iwarp_mpa.rej_flag"),
                "H": bool(res & FLAG_H),
            },
            "res": res,
            "pd_length": number(mpa, "iwarp_mpa.pdlength") or 0,
        }
        if rev == 2 and res & FLAG_H and len(private) >= 4:
            ird = int.from_bytes(private[:2], "big")
            ord_ = int.from_bytes(private[2:4], "big")
            start["mpa_v2"] = {  # RFC 6581 7.1: |P|Z| IRD |  and  |W|R| ORD |
                "ird": ird & 0x3FFF,
                "ord": ord_ & 0x3FFF,
                "peer2peer": bool(ird & 0x8000),
                "zero_len_fpdu_rtr": bool(ird & 0x4000),
                "write_rtr": bool(ord_ & 0x8000),
                "read_rtr": bool(ord_ & 0x4000),
                "ulp_private_data_len": len(private) - 4,
            }
        self.starts.append(start)
        self.check_start(start, private)

    def check_start(self, start: dict[str, Any], private: bytes) -> None:
        frame, rev, kind = start["frame"], start["rev"], start["type"]
        seen = self.handshake.setdefault(start["stream"], {})
        if kind in seen:
            self.finding(frame, "mpa.start", f"a second MPA {kind} in TCP stream {start['stream']}")
        seen[kind] = start
        if rev not in (1, 2):
            self.finding(frame, "mpa.rev", f"MPA revision {rev}")
        if start["res"] & ~(FLAG_H if rev == 2 else 0):
            self.finding(frame, "mpa.res", f"reserved MPA flag bits 0x{start['res']:02x}")
        if kind == "req" and start["flags"]["R"]:
            self.finding(frame, "mpa.reject", "Reject flag in an MPA Request")
        if start["pd_length"] > MAX_PRIVATE_DATA:
            self.finding(frame, "mpa.pd_length", f"PD_Length {start['pd_length']}")
        if rev == 2 and start["flags"]["H"] and len(private) < 4:
            self.finding(frame, "mpa.v2", "H flag without the IRD/ORD block")
        if kind == "rep":
            request = seen.get("req")
            if request is None:
                self.finding(frame, "mpa.start", "MPA Reply with no Request before it")
            elif rev is not None and request["rev"] is not None and rev > request["rev"]:
                self.finding(
                    frame, "mpa.rev", f"Reply rev {rev} above the Request's {request['rev']}"
                )

    def segment(self, pkt: Packet, info: dict[str, Any], ddp: Fields) -> None:
        frame = pkt.number
        tagged = flag(ddp, "iwarp_ddp.tagged_flag")
        last = flag(ddp, "iwarp_ddp.last_flag")
        op = number(ddp, "iwarp_rdma.opcode")
        known = 11 if self.rfc7306 else 7
        name = OPCODE_NAMES[op] if op is not None and op <= known else f"Unknown ({op})"
        self.opcodes[name] += 1
        ulpdu_len = info["ulpdu_len"]
        header = TAGGED_HEADER if tagged else UNTAGGED_HEADER
        payload = None if ulpdu_len is None else ulpdu_len - header
        info.update(opcode=op, opname=name, tagged=tagged, last=last, payload_len=payload)
        if tagged:
            info.update(stag=text(ddp, "iwarp_ddp.stag"), to=text(ddp, "iwarp_ddp.tagged_offset"))
        else:
            info.update(
                qn=number(ddp, "iwarp_ddp.qn"),
                msn=number(ddp, "iwarp_ddp.msn"),
                mo=number(ddp, "iwarp_ddp.mo"),
            )
            self.check_sequence(pkt, info)
        if number(ddp, "iwarp_ddp.dv") != 1:
            self.finding(frame, "ddp.dv", f"DDP version {number(ddp, 'iwarp_ddp.dv')}")
        if number(ddp, "iwarp_ddp.rsvd"):
            self.finding(frame, "ddp.rsvd", "DDP control reserved bits set")
        if number(ddp, "iwarp_rdma.version") != 1:
            self.finding(frame, "rdmap.rv", f"RDMAP version {number(ddp, 'iwarp_rdma.version')}")
        if number(ddp, "iwarp_rdma.rsv"):
            self.finding(frame, "rdmap.rsvd", "RDMAP control reserved bits set")
        if op is None or op > known:
            self.finding(frame, "rdmap.opcode", f"opcode {op} is reserved")
            return
        if (op in QUEUE_OF or op in TAGGED) and tagged != (op in TAGGED):
            model = "tagged" if op in TAGGED else "untagged"
            self.finding(frame, "ddp.tagged", f"{name} sent {'tagged' if tagged else 'untagged'}, "
                                              f"it is {model}")  # fmt: skip
            return
        if payload is not None and payload < 0:
            self.finding(frame, "mpa.ulpdu_len", f"ULPDU_Length {ulpdu_len} < header {header}")
        if not tagged and op in QUEUE_OF and info["qn"] != QUEUE_OF[op]:
            self.finding(frame, "ddp.qn", f"{name} on QN {info['qn']}, not {QUEUE_OF[op]}")
        if op in ONE_SEGMENT and (not last or info.get("mo")):
            self.finding(frame, "ddp.single_segment", f"{name} split over DDP segments")
        reserved = raw(ddp, "iwarp_rdma.reserved")
        if op in RESERVED_AFTER_CONTROL and any(reserved):
            self.finding(frame, "rdmap.rsvd_ulp", f"{name}: reserved word {reserved.hex()}")
        if op == 1:
            info.update(
                sink_stag=text(ddp, "iwarp_rdma.sinkstag"),
                src_stag=text(ddp, "iwarp_rdma.srcstag"),
                read_size=number(ddp, "iwarp_rdma.rdmardsz"),
            )
        if op == 7:
            info["terminate"] = {
                key.rsplit(".", 1)[-1]: label(ddp, key)
                for key in ddp
                if key.startswith(("iwarp_rdma.term_layer", "iwarp_rdma.term_etype_",
                                   "iwarp_rdma.term_errcode_"))
            }  # fmt: skip

    def check_sequence(self, pkt: Packet, info: dict[str, Any]) -> None:
        """RFC 5041 5.3: per queue, MSN starts at 1, one more per message; MO counts bytes."""
        if info["qn"] is None or info["payload_len"] is None:
            return
        key = (pkt.stream, pkt.src, info["qn"])
        msn, mo = self.sequence.get(key, (1, 0))
        if (info["msn"], info["mo"]) != (msn, mo):
            self.finding(pkt.number, "ddp.msn_mo", f"QN {info['qn']} from {pkt.src}: MSN "
                         f"{info['msn']} MO {info['mo']}, expected MSN {msn} MO {mo}")  # fmt: skip
        got_msn, got_mo = info["msn"] or 0, info["mo"] or 0
        if info["last"]:
            self.sequence[key] = ((got_msn + 1) % 2**32, 0)
        else:
            self.sequence[key] = (got_msn, got_mo + max(info["payload_len"], 0))

    def upper_layers(self, pkt: Packet, pdu: Pdu) -> None:
        for r in pdu.upper.get("rpcordma", []):
            proc = label(r, "rpcordma.msg_type")
            self.rpcordma_procs[proc] += 1
            self.rpcordma_messages.append({
                "frame": pkt.number,
                "xid": text(r, "rpcordma.xid"),
                "vers": number(r, "rpcordma.version"),
                "credits": number(r, "rpcordma.flow_control"),
                "proc": proc,
                "read_list": number(r, "rpcordma.reads_count"),
                "write_list": number(r, "rpcordma.writes_count"),
                "reply_chunk": number(r, "rpcordma.reply_count"),
            })  # fmt: skip
        for r in pdu.upper.get("rpc", []):
            self.rpc.append({
                "frame": pkt.number,
                "xid": text(r, "rpc.xid"),
                "type": {"0": "Call", "1": "Reply"}.get(text(r, "rpc.msgtyp") or "", "?"),
                "program": label(r, "rpc.program"),
                "version": number(r, "rpc.programversion"),
                "procedure": label(r, "rpc.procedure"),
            })  # fmt: skip
        for n in pdu.upper.get("nfs", []):
            proc = next((k for k in n if k.startswith("nfs.procedure_v")), None)
            if proc is not None:
                kind = self.rpc[-1]["type"] if self.rpc else "?"
                self.nfs[f"NFSv{proc[-1]} {label(n, proc)} {kind}"] += 1

    def verdict(self) -> dict[str, Any]:
        undissected = [u for u in self.candidates if u["frame"] not in self.reassembled]
        counts = {
            "FPDU(s) with a bad CRC32c": len(self.crc_errors),
            "malformed or unreassembled packet(s)": len(self.malformed),
            "expert warning(s)/error(s) from the iWARP/RPC dissectors": len(self.expert_errors),
            "TCP segment(s) with payload not dissected as MPA": len(undissected),
            "RFC rule violation(s) (lint)": len(self.lint),
        }
        problems = [f"{n} {what}" for what, n in counts.items() if n]
        if self.payload_frames and not self.starts:
            problems.insert(0, "no MPA Request/Reply found (tshark frames MPA only after both)")
        requests = sum(s["type"] == "req" for s in self.starts)
        return {
            "port": self.port,
            "ok": not problems,
            "problems": problems,
            "frames_on_port": self.frames_on_port,
            "tcp_payload_frames": self.payload_frames,
            "mpa_start_frames": {
                "req": requests,
                "rep": len(self.starts) - requests,
                "frames": self.starts,
            },
            "fpdus": len(self.fpdus),
            "rdmap_opcodes": dict(self.opcodes),
            "crc": {k: self.crc[k] for k in ("good", "bad", "not_checked")},
            "crc_errors": self.crc_errors,
            "malformed": self.malformed,
            "expert_errors": self.expert_errors,
            "undissected_payload": undissected,
            "retransmitted_payload": self.retransmitted,
            "lint": self.lint,
            "pad_ignored": self.pad_ignored,
            "capture_warnings": self.capture_warnings,
            "ignored_tshark_quirks": self.quirks,
            "rpcordma": {"procs": dict(self.rpcordma_procs), "messages": self.rpcordma_messages},
            "rpc": self.rpc,
            "nfs": dict(self.nfs),
        }


# ---------------------------------------------------------------- running tshark


def tshark_command(tshark: str, pcap: str, port: int, rpcrdma: bool) -> list[str]:
    cmd = [
        tshark, "-r", pcap, "-T", "pdml", "-Y", f"tcp.port == {port}",
        "-o", "tcp.desegment_tcp_streams:TRUE",
        "-o", "tcp.try_heuristic_first:TRUE",  # MPA is a heuristic dissector only
        "-o", "tcp.check_checksum:FALSE",  # offloaded checksums on lo are not errors
        "--disable-heuristic", "smb_direct_iwarp",
    ]  # fmt: skip
    if not rpcrdma:
        cmd += ["--disable-heuristic", "rpcrdma_iwarp"]
    return cmd


def judge(pcap: str, port: int, judge: Judge, tshark: str, rpcrdma: bool = True) -> dict[str, Any]:
    """Run tshark over ``pcap`` and feed ``judge``; its verdict (``ok`` False and a
    ``tshark_failed`` key when tshark did not finish)."""
    cmd = tshark_command(tshark, pcap, port, rpcrdma)
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        try:
            for _, element in ET.iterparse(proc.stdout, events=("end",)):
                if element.tag == "packet":
                    pkt = read_packet(element)
                    if pkt is not None:
                        judge.packet(pkt)
                    element.clear()
        except ET.ParseError as exc:
            proc.kill()
            return {"ok": False, "problems": [f"tshark gave no PDML: {exc}"], "tshark_failed": True}
        err = proc.stderr.read().decode(errors="replace").strip()
        if proc.wait() != 0:
            return {"ok": False, "problems": [f"tshark failed: {err}"], "tshark_failed": True}
    result = judge.verdict()
    result["tshark_cmd"] = " ".join(cmd)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[2], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("pcap", help="the capture (pcap or pcapng)")
    parser.add_argument("port", type=int, help="TCP port of the iWARP connection(s)")
    parser.add_argument("--list", action="store_true", help="add every FPDU's fields (fpdu_list)")
    parser.add_argument("--no-rpcrdma", action="store_true", help="no RPC-over-RDMA heuristic")
    parser.add_argument("--no-lint", action="store_true", help="only what tshark itself flags")
    parser.add_argument("--rfc7306", action="store_true", help="accept RDMAP opcodes 8-11")
    parser.add_argument(
        "--pad-from", action="append", default=[], metavar="ADDR",
        help="set aside non-zero PAD sent from this IP address (repeatable)",
    )  # fmt: skip
    parser.add_argument("--tshark", default="tshark", help="the tshark to run")
    args = parser.parse_args(argv)
    tshark = shutil.which(args.tshark)
    if tshark is None:
        print(
            json.dumps(
                {"ok": False, "problems": [f"{args.tshark} not found (apt-get install tshark)"]}
            )
        )
        return 2
    try:
        open(args.pcap, "rb").close()
    except OSError as exc:
        print(json.dumps({"ok": False, "problems": [f"cannot read {args.pcap}: {exc.strerror}"]}))
        return 2
    version = subprocess.run([tshark, "--version"], capture_output=True, text=True, check=False)
    state = Judge(args.port, not args.no_lint, args.rfc7306, frozenset(args.pad_from))
    result = judge(args.pcap, args.port, state, tshark, rpcrdma=not args.no_rpcrdma)
    if result.pop("tshark_failed", False):
        print(json.dumps(result))
        return 2
    result["tshark"] = (version.stdout.splitlines() or ["?"])[0]
    result["pcap"] = args.pcap
    if args.list:
        result["fpdu_list"] = state.fpdus
    print(json.dumps(result, indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
