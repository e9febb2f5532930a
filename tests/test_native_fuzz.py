"""The native engine's receive path, fuzzed coverage-guided under ASan and UBSan.

``tools/native_fuzz.c`` (libFuzzer) is built with the engine's C sources under
``-fsanitize=fuzzer,address,undefined`` and run for a bounded time from a seed
corpus of the wire fuzzer's inputs (``tools/fuzz_wire.py``, made for the harness's
region table); nothing may crash, trip a sanitizer or break the harness's checks
(guard zones, regions no peer may write, a region deregistered mid-stream left
alone). A build of the engine without one bounds check (``-DRS_FUZZ_SELFTEST``)
must be caught, so the harness is shown to find what it looks for. The long run's
figure is in ``docs/security.md``.

Needs clang with its libFuzzer and sanitizer runtimes (Debian: clang,
libclang-rt-14-dev); skipped with the reason without them, failed instead under
``RDMASHIM_REQUIRE_FUZZER=1`` (CI installs them).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import libfuzzer

from tooling import TOOLS, tool

ROOT = TOOLS.parent
SOURCES = ROOT / "providers" / "softiwarp"
SECONDS = int(os.environ.get("RDMASHIM_NATIVE_FUZZ_SECONDS", "45"))
"""How long the bounded run fuzzes (CI's slice)."""


def build(out: Path, *defines: str) -> Path:
    sources = [TOOLS / "native_fuzz.c", SOURCES / "_engine.c", SOURCES / "_accel.c"]
    return libfuzzer.build(out, sources, SOURCES, *defines)


def harness_table() -> dict[str, list[int]]:
    """The harness's regions (native_fuzz.c's table[]): STag (i + 1) << 8 | 0x42, TO its
    iova or 0x10000 * (i + 1)."""
    regions = tool("fuzz_wire")._REGIONS
    return {
        name: [(i + 1) << 8 | 0x42, iova or 0x10000 * (i + 1), length]
        for i, (name, (length, _, _, iova, _)) in enumerate(regions.items())
    }


def seed_corpus(directory: Path, count: int = 300) -> int:
    """The wire fuzzer's inputs as harness inputs: a byte of choices (CRC as the input
    was made, how the stream is cut, a region deregistered mid-stream for some), a
    byte naming that region, then the stream."""
    fuzz_wire = tool("fuzz_wire")
    generator = fuzz_wire.Generator(harness_table())
    rng = random.Random(1)
    written = 0
    for index in range(count):
        case = generator.case(1, index)
        if case.cls == "mpa":  # MPA setup is Python's, not the native engine's
            continue
        choices = int(case.crc) | rng.randrange(8) << 1 | (rng.random() < 0.3) << 4
        head = bytes([choices, rng.randrange(256)])
        (directory / f"seed{index:05d}").write_bytes(head + case.stream)
        written += 1
    return written


def test_the_receive_path_survives_coverage_guided_fuzzing(tmp_path: Path) -> None:
    corpus = libfuzzer.corpus_of(tmp_path, seed_corpus)
    assert len(list(corpus.iterdir())) > 200
    libfuzzer.survives(build(tmp_path / "native_fuzz"), corpus, SECONDS)


def test_the_harness_catches_a_missing_bounds_check(tmp_path: Path) -> None:
    binary = build(tmp_path / "native_fuzz_selftest", "-DRS_FUZZ_SELFTEST")
    libfuzzer.catches(binary, libfuzzer.corpus_of(tmp_path, seed_corpus), "a Write past its region")
