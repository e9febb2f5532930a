"""``benchmarks/floor.c``, this machine's latency floor, and bench.py's floor column.

The helper is built with the system C compiler and run for a few hundred round
trips in each mode; only sanity is judged (a positive half round trip below
10 ms: which mode is faster is not guaranteed on a loaded machine). bench.py's
latency rows then print the floor and ours/floor, or the reason there is none,
and every header names the engine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from benchrun import BENCHMARKS, run_benchmark

sys.path.insert(0, str(BENCHMARKS))  # floor.py, as bench.py imports it
import floor

LAT_ROWS = ("send-lat", "send-lat-poll")
ARGS = ("--only", "send-lat", "--only", "send-lat-poll", "--repeat", "1", "--iters", "200")


def _binary(directory: Path) -> floor.FloorBinary:
    try:
        return floor.build(directory)
    except floor.FloorUnavailable as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize("mode", floor.MODES)
def test_floor_helper_prints_a_sane_half_round_trip(tmp_path: Path, mode: str) -> None:
    binary = _binary(tmp_path)
    done = subprocess.run(
        [str(binary.path), mode, "300", "30"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    fields = floor.parse(done.stdout)
    assert fields["mode"] == mode and fields["round_trips"] == "300", done.stdout
    assert 0 < int(fields["median_half_rtt_ns"]) < 10_000_000, done.stdout
    assert 0 < int(fields["cpu_ns_per_message"]) < 10_000_000, done.stdout


@pytest.mark.parametrize("args", [["poll", "300"], ["spin", "300", "30"], ["block", "0", "30"],
                                  ["block", "12x", "30"], ["block", "300", "-1"]])  # fmt: skip
def test_floor_helper_refuses_bad_arguments(tmp_path: Path, args: list[str]) -> None:
    done = subprocess.run([str(_binary(tmp_path).path), *args], capture_output=True, text=True)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("usage: floor poll|block"), done.stderr


def _rows(stdout: str) -> dict[str, list[str]]:
    return {ln.split()[0]: ln.split() for ln in stdout.splitlines() if ln.strip()}


def test_bench_latency_rows_beside_the_floor(tmp_path: Path) -> None:
    """Each latency row: ours, raw TCP, ours/raw as before, then the floor and ours/floor
    (or, without a compiler here, the reason); the JSON holds the same."""
    out = tmp_path / "lat.json"
    done = run_benchmark("bench.py", *ARGS, "--json", str(out))
    assert done.returncode == 0, done.stderr
    doc = json.loads(out.read_text())
    rows = _rows(done.stdout)
    assert "Engine          : softiwarp backend, " in done.stdout
    assert doc["meta"]["engine"].startswith("softiwarp backend, ")
    try:
        floor.compiler()
    except floor.FloorUnavailable as exc:
        for name in LAT_ROWS:
            assert f"floor: n/a ({exc})" in " ".join(rows[name]), rows[name]
        return
    for name, result in zip(LAT_ROWS, doc["results"], strict=True):
        ours, raw, ratio = (float(x) for x in rows[name][3:6])
        assert rows[name][6] == "usec" and abs(ratio - ours / raw) < 0.01 * ratio + 0.002
        fl, times = float(rows[name][7]), rows[name][8]
        assert 0 < fl < 10_000 and times.endswith("x"), rows[name]
        assert abs(float(times[:-1]) - ours / fl) < 0.01 * ours / fl + 0.01
        assert result["floor_mode"] == ("block" if name == "send-lat" else "poll")
        assert result["floor_median"] == pytest.approx(fl, abs=0.005)
        assert result["floor_ratio"] == pytest.approx(result["ours_median"] / fl, rel=0.01)
    assert doc["meta"]["floor"]["command"].endswith("floor.c")


def test_bench_without_a_compiler_says_why_and_names_python_kernels() -> None:
    """A $CC that is not there: both latency rows and the header say why there is no
    floor, and the run goes on; with the compiled kernels turned off the header says so."""
    env = {**os.environ, "CC": "no-such-cc-rdmashim", "RDMASHIM_NO_EXTENSIONS": "1"}
    env.pop("RDMASHIM_ENGINE", None)  # (no compiled code: the Python engine)
    done = run_benchmark("bench.py", *ARGS, env=env)
    assert done.returncode == 0, done.stderr
    why = "no C compiler: $CC='no-such-cc-rdmashim' not found"
    assert f" Floor (C)       : n/a ({why})" in done.stdout
    rows = _rows(done.stdout)
    for name in LAT_ROWS:
        assert " ".join(rows[name]).endswith(f"usec floor: n/a ({why})"), rows[name]
    engine = (
        "softiwarp backend, python (RDMASHIM_NO_EXTENSIONS is set) engine; its kernels: no "
        "(RDMASHIM_NO_EXTENSIONS"
    )
    assert f" Engine          : {engine}" in done.stdout
