"""``benchmarks/nfs.py`` runs end to end at its smallest sizes and prints both transports.

A smoke test, not a benchmark: 4 MiB read and written, 100 GETATTRs, one
sample per transport; no figure is judged, only that every row has an RDMA
and a TCP value and that ``--json`` holds the samples of both.
"""

from __future__ import annotations

import json
from pathlib import Path

from benchrun import run_benchmark


def test_nfs_benchmark_prints_rdma_and_tcp(tmp_path: Path) -> None:
    out = tmp_path / "nfs.json"
    args = ["--size", "4", "--getattrs", "100", "--repeat", "1", "--json", str(out)]
    done = run_benchmark("nfs.py", *args)
    assert done.returncode == 0, done.stderr
    assert "RDMA" in done.stdout and "TCP" in done.stdout and "RDMA/TCP" in done.stdout
    rows: dict[str, list[str]] = {}
    for line in done.stdout.splitlines():  # the first row of each name: the results table
        if line.strip():
            rows.setdefault(line.split()[0], line.split())
    for name, unit in (("read", "MiB/s"), ("write", "MiB/s"), ("getattr", "calls/s")):
        row = rows[name]
        rdma, tcp, ratio = (float(x) for x in row[-4:-1])
        assert row[-1] == unit and rdma > 0 and tcp > 0
        assert abs(ratio - rdma / tcp) < 0.01 * ratio + 0.002
    cpu = next(line.split() for line in done.stdout.splitlines() if "server CPU" in line)
    assert cpu[-1] == "usec" and float(cpu[-4]) >= 0 and float(cpu[-3]) >= 0  # (clock ticks)
    getattr_doc = next(r for r in json.loads(out.read_text())["results"] if r["name"] == "getattr")
    assert set(getattr_doc["server_cpu_us"]) == {"rdma", "tcp"}
    doc = json.loads(out.read_text())
    assert doc["meta"]["file_size"] == 4 << 20 and doc["meta"]["commit"]
    for result in doc["results"]:
        assert len(result["rdma"]) == len(result["tcp"]) == 1, result["name"]
