"""``benchmarks/calls.py``: what a ping-pong message costs at each end in calls.

Call counts do not depend on the machine's load, so one design property is held
here: with the native engine, a message makes at most five calls into C at each
end (the read, the receive's repost, the post that writes, the poll, and here, both
ends in one process, an idle wait that finds trio busy), the rest of what the
provider needs being read from C's memory (``rs_qp_view``, ``rs_cq_view``,
``rs_mem_view``). The CPU figures are only printed.
"""

from __future__ import annotations

import os
import re

import pytest
from benchrun import run_benchmark

from rdmashim.providers.softiwarp import native


def _rows(out: str) -> dict[str, tuple[float, float]]:
    rows = {}
    for line in out.splitlines():
        found = re.match(r"(.+?)\s+(\d+\.\d)\s+(\d+\.\d)$", line)
        if found:
            rows[found.group(1)] = (float(found.group(2)), float(found.group(3)))
    return rows


def test_calls_prints_both_sides_per_message() -> None:
    done = run_benchmark("calls.py", "--iters", "300", "--top", "5")
    assert done.returncode == 0, done.stderr
    rows = _rows(done.stdout)
    ours, raw = rows["all calls"]
    assert ours > 20 and raw > 20, done.stdout  # (each side's loop is in the profile)
    assert rows["trio"][1] > 0 and "ours/raw: calls" in done.stdout
    assert "# ours: the 5 functions called most a message" in done.stdout


@pytest.mark.skipif(not native.AVAILABLE, reason=f"the native engine: {native.WHY_NOT}")
def test_a_native_message_makes_at_most_five_calls_into_c_at_each_end() -> None:
    """The read, the repost, the post that writes, the poll; and, both ends being in
    one process, an idle wait that finds trio with work (the other end's) and returns
    (``verbs/idle.py``: across processes that wait and the read are one call)."""
    env = {k: v for k, v in os.environ.items() if k != "RDMASHIM_ENGINE"}
    done = run_benchmark("calls.py", "--iters", "300", env=env | {"RDMASHIM_ENGINE": "native"})
    assert done.returncode == 0, done.stderr
    crossings = _rows(done.stdout)["compiled: the engine (_accel)"][0]
    assert 4.5 <= crossings <= 5.5, done.stdout
