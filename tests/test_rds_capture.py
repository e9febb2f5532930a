"""RDS on the wire: a capture of two nodes' connection, judged by Wireshark's dissectors.

Messages of one and several fragments, acks, and RDMA by cookie (a Write and
a Read, each followed by the message chasing it) between two loopback nodes;
the wire judge (``tools/wirejudge.py``) must frame every FPDU and find the RDMAP
traffic in order, and every Send must hold a well-formed RDS header.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from rdmashim.providers.softiwarp import ddp, mpa
from rdmashim.ulps.rds.rdma import RdmaOp, RdmaStatus
from rdmashim.ulps.rds.wire import RDS_HEADER_LEN, RdmaExt, RdsHeader

import wirecap
from pcapstreams import tcp_streams
from rdsnodes import close, nodes

pytestmark = pytest.mark.wire

A, B = "127.0.0.1", "127.0.0.2"


@pytest.fixture
def wire_tools() -> None:
    """Skip where tcpdump, tshark or root are missing (see test_wire)."""
    why = wirecap.missing_requirements()
    if why:
        pytest.skip(why)


async def exchange(sa: Any, sb: Any) -> None:
    target = bytearray(64 * 1024)
    cookie = sb.get_mr(target)
    await sb.sendto(cookie.to_bytes(8, "big"), (A, 4000))
    theirs = int.from_bytes((await sa.recvfrom())[0], "big")
    for i in range(20):
        await sa.sendto(b"m%d" % i * (1 + 500 * (i % 3)), (B, 5000))
    write = RdmaOp.write_to(theirs, bytes(range(256)) * 100)
    await sa.sendto(b"after the write", (B, 5000), rdma=write)
    read = RdmaOp.read_into(theirs, bytearray(5000), offset=100)
    await sa.sendto(b"after the read", (B, 5000), rdma=read)
    assert await write.wait() == await read.wait() == RdmaStatus.SUCCESS
    for _ in range(22):
        await sb.recvfrom()


async def test_rds_traffic_with_rdma(wire_tools: None, tmp_path: Path) -> None:
    pcap = tmp_path / "rds.pcap"
    with trio.fail_after(60):
        a, b = await nodes([A, B])
        async with wirecap.tcpdump(pcap, a.port) as cap:
            try:
                await exchange(a.bind(4000), b.bind(5000))
            finally:
                await close([a, b])  # inside the capture: the connection's end is in it
        # Not RPC: Wireshark's RPC-over-RDMA heuristic would take an RDS header whose
        # sequence and ack are both 1 for an RDMA_NOMSG (xid 0, vers 1, proc 1).
        rc, result, _ = await wirecap.judge_capture(pcap, a.port, "--no-rpcrdma")
    text = wirecap.summary(result)
    assert cap.dropped == 0, f"incomplete capture: {cap.stderr}"
    assert rc == 0, f"the wire judge found problems:\n{text}"
    opcodes = result.get("rdmap_opcodes", {})
    assert {"Send", "Write", "Read Request", "Read Response"} <= set(opcodes), text
    # Send, and Send with Solicited Event (a message's last fragment and every ack).
    sends = [f for f in result["fpdu_list"] if f.get("opcode") in (3, 5)]
    assert any(f.get("opcode") == 5 for f in sends), text
    assert sends and all(f["payload_len"] >= RDS_HEADER_LEN for f in sends), text
    headers = [RdsHeader.decode(p) for p in send_payloads(pcap)]
    assert all(h is not None for h in headers)
    chasing = [h for h in headers if any(isinstance(e, RdmaExt) for e in h.extensions)]
    assert [h.length for h in chasing] == [15, 14], chasing  # the two messages after RDMA


def send_payloads(pcap: Path) -> list[bytes]:
    """The payload of every Send FPDU (with or without Solicited Event) in the
    capture's MPA connections."""
    out = []
    for stream in tcp_streams(pcap):
        data = stream.data()
        if not data.startswith((mpa.REQ_KEY, mpa.REP_KEY)):
            continue
        _, pos = mpa.parse_start_frame(data, reply=data.startswith(mpa.REP_KEY))
        while (hdr := ddp.parse_header(data, pos, len(data))) is not None:
            end = pos + hdr.ulpdu_len + 2
            if hdr.opcode in (ddp.Opcode.SEND, ddp.Opcode.SEND_SE):
                out.append(data[pos + hdr.header_len : end])
            pos = end + ddp.pad_len(hdr.ulpdu_len) + 4
    return out
