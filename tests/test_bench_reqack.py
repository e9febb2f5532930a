"""``benchmarks/bench.py`` req-ack and req-write run end to end on loopback.

A smoke test, not a benchmark: one short sample of each side; no figure is
judged, only that both rows print ours, raw TCP and their ratio, that every
request was answered (the JSON's transaction counts), and that req-write's
RDMA Writes landed (the client checks its MR holds the server's bytes, and the
run fails if not). And the server, which sizes answers from the client's bytes,
refuses requests it cannot serve and goes on serving.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import trio
from benchrun import BENCHMARKS, run_benchmark

import rdmashim
from rdmashim import Access, QPCap, RecvWR, SendWR, WCStatus, WROpcode
from rdmashim.providers.softiwarp.connection import connect_qp

sys.path.insert(0, str(BENCHMARKS))  # bench.py's wire formats, and the modules it imports
from bench import HOST, PRIV_REQ, RAW_REQ_HDR, REQ_HDR, REQ_SLOT


def test_request_answer_rows(tmp_path: Path) -> None:
    out = tmp_path / "req.json"
    args = ["--only", "req-ack", "--only", "req-write", "--repeat", "1", "--duration", "0.3"]
    done = run_benchmark("bench.py", *args, "--json", str(out))
    assert done.returncode == 0, done.stderr
    rows = {ln.split()[0]: ln.split() for ln in done.stdout.splitlines() if ln.strip()}
    for name, size, depth in (("req-ack", "1024", "1"), ("req-write", "64", "4")):
        assert rows[name][1:3] == [size, depth]
        ours, raw, ratio = (float(x) for x in rows[name][3:6])
        assert ours > 0 and raw > 0 and abs(ratio - ours / raw) < 0.01 * ratio + 0.002
        assert rows[name][6] == "tx/sec"
    doc = json.loads(out.read_text())
    for result in doc["results"]:
        for side in ("ours", "raw"):
            (sample,) = result["samples"][side]
            assert sample["transactions"] > 10
            assert sample["rtt_us"] > 0


def _bench_server() -> tuple[subprocess.Popen[str], int, int]:
    """``bench.py --serve``: its process, RDMA and raw TCP ports."""
    proc = subprocess.Popen(
        [sys.executable, str(BENCHMARKS / "bench.py"), "--serve", "--host", HOST],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    ready = proc.stdout.readline().split()
    assert ready[:1] == ["READY"], ready
    return proc, int(ready[1]), int(ready[2])


def _raw_exchange(port: int, header: bytes, request: bytes, want: int) -> bytes:
    """Send ``header`` and ``request`` to the raw TCP port; up to ``want`` bytes back
    (fewer at EOF)."""
    with socket.create_connection((HOST, port), timeout=10) as sock:
        sock.sendall(header + request)
        got = b""
        while len(got) < want and (chunk := sock.recv(want - len(got))):
            got += chunk
        return got


async def test_server_refuses_hostile_requests_and_serves_on() -> None:
    """The request/answer server sizes its answers from the client's bytes: a raw
    header asking for a 4 GiB answer or 0-byte requests, and an RDMA request too short
    for its head or asking for more than its buffers hold, end that connection with
    the refusal named; the next client is served."""
    proc, rdma_port, raw_port = _bench_server()
    try:
        for size, answer in ((0, 8), (8, 0xFFFFFFFF)):
            assert _raw_exchange(raw_port, RAW_REQ_HDR.pack(b"Q", size, answer), b"", 8) == b""
        for request in (
            bytes(8),
            REQ_HDR.pack(REQ_SLOT + 1, 0, 0, 0),
            REQ_HDR.pack(8, 1 << 30, 0, 0),
        ):
            async with rdmashim.open_device("siw_lo") as ctx:
                pd = ctx.alloc_pd()
                cq = ctx.create_cq(16)
                qp = pd.create_qp(send_cq=cq, recv_cq=cq, cap=QPCap(max_send_wr=4, max_recv_wr=4))
                mr = pd.reg_mr(bytearray(REQ_SLOT), Access.LOCAL_WRITE)
                qp.post_recv(RecvWR(1, [mr.sge()]))
                mr.buf[: len(request)] = request
                stream = await trio.open_tcp_stream(HOST, rdma_port)
                await connect_qp(qp, stream, private_data=PRIV_REQ.pack(b"Q", 1, 0, 65536))
                qp.post_send(SendWR(2, WROpcode.SEND, [mr.sge(0, len(request))]))
                with trio.fail_after(10):
                    wcs = [wc for _ in range(2) for wc in await cq.poll_wait(1)]
                assert {wc.wr_id: wc.status for wc in wcs} == {
                    2: WCStatus.SUCCESS,
                    1: WCStatus.WR_FLUSH_ERR,
                }  # the request went; no answer came, the server ended the connection
                qp.close()
                pd.close()
                cq.close()
        assert _raw_exchange(raw_port, RAW_REQ_HDR.pack(b"Q", 8, 8), bytes(8), 8) == bytes(8)
    finally:
        _, err = proc.communicate(timeout=30)  # (the server ends when its stdin closes)
    assert err.count("BenchError") == 5, err
    for named in ("raw requests of 0 B", "answers of 4294967295 B", "a 8 B request",
                  f"a {REQ_SLOT + 1} B answer", f"a {1 << 30} B Write"):  # fmt: skip
        assert named in err, err
