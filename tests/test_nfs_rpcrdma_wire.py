"""RPC-over-RDMA on the wire: a capture judged by Wireshark's RPC-over-RDMA dissector.

A client and ``serve_rdma`` on loopback make every kind of message (short
calls, a Read chunk, a Write chunk, a Long Call, a Long Reply, RDMA_ERROR
ERR_CHUNK); the wire judge (``tools/wirejudge.py``) must find no problem in
MPA, DDP, RDMAP, RPC-over-RDMA or RPC.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from test_nfs_rpcrdma_transport import (
    BIG,
    ECHO,
    HOST,
    PROG,
    READ,
    SUM,
    WRITE,
    InlineBench,
    args_of,
    server,
)

from rdmashim.ulps.nfsrdma.rdma_client import RpcRdmaClient, TransportError
from rdmashim.ulps.nfsrdma.service import Reply

import wirecap

pytestmark = pytest.mark.wire


@pytest.fixture
def wire_tools() -> None:
    """Skip where tcpdump, tshark or root are missing."""
    why = wirecap.missing_requirements()
    if why:
        pytest.skip(why)


async def traffic(client: RpcRdmaClient) -> None:
    assert (await client.call(PROG, 1, SUM, args_of(3, 1, 2, 3))).uhyper() == 6
    write = Reply()
    write.opaque_ddp(bytes(range(256)) * 40 + b"odd")
    write.packer.uint(1)
    assert (await client.call(PROG, 1, WRITE, write)).uint() == 10243
    u = await client.call(PROG, 1, READ, args_of(20_000, 2), ddp_reply_size=32768)
    assert u.uint() == 2 and len(u.opaque()) == 20_000
    long_call = Reply()
    long_call.packer.opaque(bytes(9000))
    u = await client.call(PROG, 1, ECHO, long_call, reply_size_hint=16384)
    assert u.opaque() == bytes(9000)
    with pytest.raises(TransportError):
        await client.call(PROG, 1, BIG, args_of(6000, 1))


async def test_rpcrdma_traffic_passes_wiresharks_dissectors(
    wire_tools: None, tmp_path: Path
) -> None:
    pcap = tmp_path / "rpcrdma.pcap"
    with trio.fail_after(60):
        async with (
            server(InlineBench()) as (port, _),  # (answered at once: from slots in C)
            wirecap.tcpdump(pcap, port) as cap,
            RpcRdmaClient.connect(HOST, port) as client,
        ):
            await traffic(client)
        rc, result, _ = await wirecap.judge_capture(pcap, port)
    text = wirecap.summary(result)
    assert cap.dropped == 0, f"incomplete capture: {cap.stderr}"
    assert rc == 0, f"the wire judge found problems:\n{text}"
    opcodes = result.get("rdmap_opcodes", {})
    assert {"Send", "Write", "Read Request", "Read Response"} <= set(opcodes), text
    rpcrdma = result["rpcordma"]
    assert rpcrdma["procs"] == {"RDMA_MSG (0)": 7, "RDMA_NOMSG (1)": 2, "RDMA_ERROR (4)": 1}, text
    shapes = [(m["proc"][:10], m["read_list"], m["write_list"], m["reply_chunk"])
              for m in rpcrdma["messages"]]  # fmt: skip
    assert shapes == [
        ("RDMA_MSG (", 0, 0, 0),
        ("RDMA_MSG (", 0, 0, 0),  # SUM
        ("RDMA_MSG (", 1, 0, 0),
        ("RDMA_MSG (", 0, 0, 0),  # WRITE: a Read chunk
        ("RDMA_MSG (", 0, 1, 0),
        ("RDMA_MSG (", 0, 1, 0),  # READ: the Write chunk returned
        ("RDMA_NOMSG", 1, 0, 1),
        ("RDMA_NOMSG", 0, 0, 1),  # Long Call, Long Reply
        ("RDMA_MSG (", 0, 0, 0),
        ("RDMA_ERROR", None, None, None),  # too big: ERR_CHUNK
    ], text
    assert {m["credits"] for m in rpcrdma["messages"]} == {32}
