"""``benchmarks/rds_stress.py`` runs end to end on both RDS transports and prints every case.

A smoke test, not a benchmark: one short sample per side; no figure is judged,
only that each case the transport runs has our figure, raw TCP's and their
ratio, and that ``--json`` says which transport ran.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from benchrun import run_benchmark

from rdmashim.providers.softiwarp import engines, native

RDMA_CASE = "q=64 a=16 t=1 d=4 D=64K"


@pytest.mark.parametrize("transport", ["rdma", "tcp"])
def test_rds_stress_benchmark_prints_ours_beside_raw(tmp_path: Path, transport: str) -> None:
    out = tmp_path / "rds.json"
    args = ["--repeat", "1", "--duration", "0.3", "--transport", transport, "--json", str(out)]
    if transport == "tcp":  # (and the processes on one CPU)
        args += ["--cpu", str(min(os.sched_getaffinity(0)))]
    done = run_benchmark("rds_stress.py", *args)
    assert done.returncode == 0, done.stderr
    doc = json.loads(out.read_text())
    assert doc["meta"]["transport"] == transport
    assert doc["meta"]["busy_poll_us"] == {"ours": 10.0, "raw": 0.0}  # (each one's default)
    assert (doc["meta"]["cpu"] is None) == (transport == "rdma")
    assert ("both processes on CPU" in done.stdout) == (transport == "tcp")
    labels = [r["label"] for r in doc["results"]]
    assert (RDMA_CASE in labels) == (transport == "rdma"), labels
    assert len(labels) == (5 if transport == "rdma" else 4)
    for result in doc["results"]:
        ours, raw = result["median"]["ours"]["tx_per_s"], result["median"]["raw"]["tx_per_s"]
        assert ours > 0 and raw > 0
        assert abs(result["ratio_tx_per_s"] - ours / raw) < 1e-9
        for key in ("cpu_us_per_tx", "passive_cpu_us_per_tx"):
            assert all(result["median"][side][key] > 0 for side in ("ours", "raw")), key
        assert result["label"] in done.stdout
    assert ("RDS/TCP" in done.stdout) == (transport == "tcp")
    assert "cpu us/tx" in done.stdout


@pytest.mark.parametrize("engine", ["native", "python"])
def test_rds_breakdown_times_every_phase_at_both_ends(tmp_path: Path, engine: str) -> None:
    """Every hook of ``rds_breakdown.py`` still fires in order (a renamed or bypassed
    point leaves no cycle, and its phases without a median), on either engine, and raw
    TCP ran beside. On the native engine one C call reads and processes: the engine's
    own receive phase is empty (0), and so are trio's resuming and the read when the
    reader waited idle (the wait and the read are one call into C). With RDS's C path
    there, a plain message is numbered, posted and written in one call into C
    (``rp_sendto``): the framing and "after the write" phases are empty (0) too."""
    if engine == "native" and not native.AVAILABLE:
        pytest.skip(f"native engine unavailable: {native.WHY_NOT}")
    out = tmp_path / "breakdown.json"
    done = run_benchmark(
        "rds_breakdown.py", "--repeat", "1", "--duration", "0.5", "--json", str(out),
        env={**os.environ, engines.ENV_ENGINE: engine},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"{engine} (" in done.stdout  # the header names the engine
    doc = json.loads(out.read_text())
    assert len(doc["phases"]) == 13
    in_c = "RDS plain path: yes (C)" in done.stdout
    for side in ("active", "passive"):
        assert doc[side]["cycles"] > 100, doc[side]
        assert doc[side]["cpu_us_per_message"] > 0, doc[side]
        medians = list(doc[side]["median_us"])
        if engine == "native":
            if in_c:  # (framing and after the write: inside the one call, "write syscall")
                assert medians.pop(10) == 0 and medians.pop(8) == 0, doc[side]
            assert medians.pop(2) == 0, doc[side]  # (the engine's receive: inside readv)
            resumed, read = medians.pop(0), medians.pop(0)  # (0 after idle waits)
            assert 0 <= resumed < 100_000 and 0 <= read < 100_000, doc[side]
        assert all(0 < us < 100_000 for us in medians), doc[side]
    assert doc["median"]["raw"]["tx_per_s"] > 0
    assert (
        abs(doc["ratio"] - doc["median"]["ours"]["tx_per_s"] / doc["median"]["raw"]["tx_per_s"])
        < 1e-9
    )
    for phase in doc["phases"]:
        assert phase in done.stdout
