"""A bounded fuzz run of the compiled kernels under AddressSanitizer and UBSan.

``tools/accel_fuzz.c`` is compiled with ``providers/softiwarp/_accel.c`` (the same
source the extension builds) under ``-fsanitize=address,undefined`` and run for
``RDMASHIM_ACCEL_FUZZ_SECONDS`` (default 30) seconds of CPU time: any sanitizer
report or broken invariant fails the test. A second build with a deliberate
overread (``-DRS_FUZZ_SELFTEST``) shows that the harness catches one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
KERNELS = REPO / "providers" / "softiwarp"
DRIVER = REPO / "tools" / "accel_fuzz.c"
FLAGS = [
    "-g", "-O1", "-std=c11", "-Wall", "-Wextra", "-Werror",
    "-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer",
]  # fmt: skip
SECONDS = float(os.environ.get("RDMASHIM_ACCEL_FUZZ_SECONDS", "30"))
SANITIZERS = {
    "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0:halt_on_error=1",
    "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
}


def _build(out: Path, *defines: str) -> Path:
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc is not installed (the fuzz driver is built with it)")
    probe = subprocess.run(
        [gcc, *FLAGS, "-x", "c", "-", "-o", str(out.with_suffix(".probe"))],
        input="int main(void) { return 0; }\n", capture_output=True, text=True, check=False,
    )  # fmt: skip
    if probe.returncode != 0:
        pytest.skip(f"gcc cannot build with AddressSanitizer (libasan missing?): {probe.stderr}")
    build = subprocess.run(
        [gcc, *FLAGS, *defines, f"-I{KERNELS}", str(DRIVER), str(KERNELS / "_accel.c"),
         "-o", str(out)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr
    return out


def _run(binary: Path, seconds: float, seed: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(binary), str(seconds), str(seed)],
        capture_output=True, text=True, timeout=seconds * 4 + 120, check=False,
        env={**os.environ, **SANITIZERS},
    )  # fmt: skip


def test_fuzz_under_sanitizers_finds_nothing(tmp_path: Path) -> None:
    binary = _build(tmp_path / "accel_fuzz")
    proc = _run(binary, SECONDS, 20240613)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "Sanitizer" not in proc.stderr and "runtime error" not in proc.stderr, proc.stderr
    rounds = int(proc.stdout.split()[-1])
    assert rounds >= 1000, proc.stdout


def test_fuzz_harness_catches_an_overread(tmp_path: Path) -> None:
    """The kernels with the CRC field of the last FPDU allowed past the window: ASan
    reports the read past the input buffer."""
    binary = _build(tmp_path / "accel_fuzz_selftest", "-DRS_FUZZ_SELFTEST")
    proc = _run(binary, 30, 1)
    assert proc.returncode != 0
    assert "AddressSanitizer: heap-buffer-overflow" in proc.stderr, proc.stderr[-3000:]
    assert "rs_scan_sends" in proc.stderr
