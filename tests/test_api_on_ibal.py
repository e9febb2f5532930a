"""The shared API suite and the RDS suites with ``RDMASHIM_BACKEND=ibal`` (the portable API
over the IBAL facade on the built-in engine), in a subprocess; fails with its output."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from clirun import RDMASHIM, run, subnet

ROOT = Path(__file__).resolve().parent.parent
SUITES = ["tests/api", "tests/test_rds.py", "tests/test_rds_rdma.py"]

pytestmark = pytest.mark.slow


def test_api_and_rds_suites_pass_on_ibal() -> None:
    env = {**os.environ, "RDMASHIM_BACKEND": "ibal"}
    env.pop("RDMASHIM_IBAL_HCA", None)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", *SUITES, "-q", "-p", "no:cacheprovider"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert run.returncode == 0, f"RDMASHIM_BACKEND=ibal pytest failed:\n{run.stdout}\n{run.stderr}"


def test_rds_demo_on_ibal() -> None:
    out = run(
        [*RDMASHIM, "rds", "demo", "-T", "3", "--cuts", "2", "--address", subnet() + "1", "-q"],
        env={"RDMASHIM_BACKEND": "ibal"},
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "every message arrived exactly once" in out.stdout


def test_devices_name_the_hca_under_ibal() -> None:
    out = run([*RDMASHIM, "devices"])
    assert out.returncode == 0, out.stderr
    assert "ibal_siw_lo" in out.stdout and "ibal on siw_lo (softiwarp)" in out.stdout
