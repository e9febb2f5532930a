"""``benchmarks/bench.py --path veth``: the MSS case runs end to end, or refuses in one line.

A smoke test, not a benchmark: one short sample of each side over a veth pair
between two network namespaces; no figure is judged, only that the run
completes, prints ours, raw TCP and their ratio, and that our FPDUs were
MSS-sized (each fits one TCP segment of the 1500-byte MTU).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from benchrun import run_benchmark

import netns


def bench(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return run_benchmark("bench.py", *args, env=env)


@pytest.mark.netns
def test_veth_write_bw_beside_raw_tcp(tmp_path: Path) -> None:
    reason = netns.unavailable()
    if reason is not None:
        pytest.skip(reason)
    out = tmp_path / "veth.json"
    args = ["--path", "veth", "--repeat", "1", "--duration", "0.3", "--json", str(out)]
    done = bench(*args)
    assert done.returncode == 0, done.stderr
    row = next(ln.split() for ln in done.stdout.splitlines() if ln.split()[:1] == ["write-bw"])
    ours, raw, ratio = (float(x) for x in row[3:6])
    assert ours > 0 and raw > 0 and abs(ratio - ours / raw) < 0.01 * ratio + 0.002
    assert "veth, MTU 1500" in done.stdout
    doc = json.loads(out.read_text())
    assert doc["meta"]["path"].startswith("veth") and doc["meta"]["max_fpdu"] == "mss"
    (result,) = doc["results"]
    fpdus = {sample["max_fpdu"] for sample in result["samples"]["ours"]}
    # An Ethernet MSS: 1500 less 40 bytes of IP and TCP headers, less options.
    assert fpdus and all(1200 <= size <= 1460 for size in fpdus), fpdus


def test_veth_refused_in_one_line(tmp_path: Path) -> None:
    """Without iproute2 on PATH the veth path says why in one line (and makes nothing)."""
    env = {**os.environ, "PATH": str(tmp_path)}
    done = bench("--path", "veth", "--quick", env=env)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert lines == ["bench.py --path veth: needs iproute2 (no 'ip' command on PATH)"], lines
