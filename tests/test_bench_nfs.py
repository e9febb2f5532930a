"""``benchmarks/nfs.py`` runs end to end at its smallest sizes and prints both transports.

A smoke test, not a benchmark: 4 MiB read and written, 100 GETATTRs, one
sample per transport; no figure is judged, only that every row has an RDMA
and a TCP value, that ``--json`` holds the samples of both, and that the server
CPU floor (``floor.c``) is printed beside them, or why it is not.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from benchrun import BENCHMARKS, run_benchmark

sys.path.insert(0, str(BENCHMARKS))  # floor.py, as nfs.py imports it
import floor


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
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith(" server CPU floor: "))
    try:
        floor.compiler()
    except floor.FloorUnavailable as exc:
        assert line == f" server CPU floor: n/a ({exc})"
        assert getattr_doc["floor_cpu_us"] == [] and getattr_doc["floor_why"] == str(exc)
        return
    (sample,) = getattr_doc["floor_cpu_us"]
    assert getattr_doc["floor_why"] == "" and 0 < sample < 10_000
    assert line.split()[3:5] == [f"{sample:.1f}", "usec"], line


def test_nfs_benchmark_without_a_compiler_says_why_there_is_no_floor() -> None:
    env = {**os.environ, "CC": "no-such-cc-rdmashim"}
    args = ["--only", "getattr", "--getattrs", "20", "--repeat", "1"]
    done = run_benchmark("nfs.py", *args, env=env)
    assert done.returncode == 0, done.stderr
    why = "no C compiler: $CC='no-such-cc-rdmashim' not found"
    assert f" server CPU floor: n/a ({why})" in done.stdout.splitlines()
