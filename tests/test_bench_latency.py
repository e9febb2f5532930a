"""``benchmarks/bench.py`` send-lat and send-lat-poll run end to end on loopback.

A smoke test, not a benchmark: one short sample of each side; no figure is
judged, only that both rows print ours, raw TCP and their ratio, and that the
JSON names the busy polling the polling row used.
"""

from __future__ import annotations

import json
from pathlib import Path

from benchrun import run_benchmark


def test_latency_rows_blocking_and_polling(tmp_path: Path) -> None:
    out = tmp_path / "lat.json"
    args = ["--only", "send-lat", "--only", "send-lat-poll", "--repeat", "1", "--iters", "200"]
    done = run_benchmark("bench.py", *args, "--busy-poll", "30", "--json", str(out))
    assert done.returncode == 0, done.stderr
    rows = {ln.split()[0]: ln.split() for ln in done.stdout.splitlines() if ln.strip()}
    for name in ("send-lat", "send-lat-poll"):
        ours, raw, ratio = (float(x) for x in rows[name][3:6])
        assert ours > 0 and raw > 0 and abs(ratio - ours / raw) < 0.01 * ratio + 0.002
        assert rows[name][6] == "usec"
    doc = json.loads(out.read_text())
    assert doc["meta"]["busy_poll_us"] == 30
    assert [r["name"] for r in doc["results"]] == ["send-lat", "send-lat-poll"]


def test_busy_poll_flag_refuses_nonsense() -> None:
    done = run_benchmark("bench.py", "--busy-poll", "-5")
    assert done.returncode == 2
    assert "--busy-poll: -5 outside 0..1000000" in done.stderr
