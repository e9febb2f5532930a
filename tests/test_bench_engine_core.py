"""``benchmarks/engine_core.py`` runs: a smoke test, not a benchmark (no figure judged
but that each row prints a positive figure and its ratio to raw TCP)."""

from __future__ import annotations

import pytest
from benchrun import run_benchmark

from rdmashim.providers.softiwarp import native


def test_engine_core_rows() -> None:
    done = run_benchmark("engine_core.py", "--messages", "640", "--batch", "64", "--repeats", "1")
    assert done.returncode == 0, done.stderr
    if not native.AVAILABLE:
        assert "native core: n/a" in done.stdout
        pytest.skip(f"native engine: {native.WHY_NOT}")
    rows = {ln.split("  ")[1].strip(): ln for ln in done.stdout.splitlines() if "ns/message" in ln}
    assert set(rows) == {"native core", "Python engine", "raw TCP"}, done.stdout
    for line in rows.values():
        figure, ratio = float(line.split()[-5]), float(line.split()[-3].rstrip("x"))
        assert figure > 0 and ratio > 0, line


def test_engine_core_refuses_bad_flags() -> None:
    done = run_benchmark("engine_core.py", "--batch", "0")
    assert done.returncode == 2 and "--batch 1..4096" in done.stderr
