"""``benchmarks/bench.py`` req-ack and req-write run end to end on loopback.

A smoke test, not a benchmark: one short sample of each side; no figure is
judged, only that both rows print ours, raw TCP and their ratio, that every
request was answered (the JSON's transaction counts), and that req-write's
RDMA Writes landed (the client checks its MR holds the server's bytes, and the
run fails if not).
"""

from __future__ import annotations

import json
from pathlib import Path

from benchrun import run_benchmark


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
