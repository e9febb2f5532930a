"""Building and running a libFuzzer harness under ASan and UBSan, for the fuzz tests of
the project's C that parses a peer's bytes (the native engine's receive path, RDS's
plain-message path).

Needs clang with its libFuzzer and sanitizer runtimes (Debian: clang,
libclang-rt-14-dev); a test without them is skipped with the reason, or failed under
``RDMASHIM_REQUIRE_FUZZER=1`` (CI installs them).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

FLAGS = ["-g", "-O1", "-fsanitize=fuzzer,address,undefined", "-fno-sanitize-recover=all"]


def unavailable(why: str) -> None:
    """Skip the calling test for ``why``, or fail it where the fuzzer is required."""
    if os.environ.get("RDMASHIM_REQUIRE_FUZZER", "") not in ("", "0"):
        pytest.fail(f"RDMASHIM_REQUIRE_FUZZER is set, but {why}")
    pytest.skip(why)


def build(out: Path, sources: list[Path], include: Path, *defines: str) -> Path:
    """Compile ``sources`` (the harness first) into the fuzzer binary ``out``."""
    clang = shutil.which("clang")
    if clang is None:
        unavailable("clang is not installed (the harness is built with its libFuzzer)")
    done = subprocess.run(
        [clang, *FLAGS, *defines, "-I", str(include), *map(str, sources), "-o", str(out)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    if done.returncode:
        if _toolchain_builds(clang, out.parent):  # (then the harness or our C is wrong)
            pytest.fail(f"the fuzz harness does not build: {done.stderr}")
        unavailable(f"clang cannot build a libFuzzer binary (libclang-rt missing?): {done.stderr}")
    return out


def _toolchain_builds(clang: str, directory: Path) -> bool:
    """Whether clang builds an empty libFuzzer target here: a build of ours that fails
    where this one does not is a fault of ours, not a missing runtime."""
    source = directory / "empty_fuzz_target.c"
    source.write_text(
        "#include <stddef.h>\n#include <stdint.h>\n"
        "int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) { return (int)(d && n) * 0; }\n"
    )
    done = subprocess.run(
        [clang, *FLAGS, str(source), "-o", str(directory / "empty_fuzz_target")],
        capture_output=True, timeout=300, check=False,
    )  # fmt: skip
    return done.returncode == 0


def fuzz(binary: Path, corpus: Path, seconds: int) -> subprocess.CompletedProcess[str]:
    """Run ``binary`` for ``seconds`` from (and into) ``corpus``."""
    limits = [f"-max_total_time={seconds}", "-timeout=10", "-rss_limit_mb=2048"]
    artifacts = f"-artifact_prefix={binary.parent}/"  # a crash's input, not in the cwd
    return subprocess.run(
        [str(binary), *limits, artifacts, str(corpus)],
        capture_output=True, text=True, timeout=seconds + 300, check=False,
    )  # fmt: skip


def corpus_of(directory: Path, seed: Callable[[Path], int]) -> Path:
    """``directory/corpus``, made and filled by ``seed`` (which says how many it wrote)."""
    corpus = directory / "corpus"
    corpus.mkdir()
    assert seed(corpus) > 0
    return corpus


def survives(binary: Path, corpus: Path, seconds: int) -> None:
    """Fuzz for ``seconds``: nothing may crash, trip a sanitizer or a harness check."""
    done = fuzz(binary, corpus, seconds)
    report = done.stdout + done.stderr
    assert done.returncode == 0, report[-4000:]
    assert "ORACLE" not in report and "Sanitizer" not in report, report[-4000:]
    assert "Done" in report, report[-2000:]


def catches(binary: Path, corpus: Path, what: str, seconds: int = 120) -> None:
    """Fuzz a build with a planted bug: the run must fail, found by a sanitizer or a
    harness check (``what`` names the bug for the message when it is not)."""
    done = fuzz(binary, corpus, seconds)
    report = done.stdout + done.stderr
    assert done.returncode != 0, f"{what} went unnoticed:\n" + report[-2000:]
    assert "ORACLE" in report or "Sanitizer" in report, report[-4000:]
