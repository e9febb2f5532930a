"""RDS's plain-message path in C, fuzzed coverage-guided under ASan and UBSan.

``tools/rds_plain_fuzz.c`` (libFuzzer) is built with ``ulps/rds/_plain.c`` under
``-fsanitize=fuzzer,address,undefined`` and run for a bounded time from a seed corpus
of plain messages, bare acks and rows of every kind (written here); nothing may crash,
trip a sanitizer or break the harness's checks of the inboxes against what each scan
says it did. A build without the receive-buffer bounds check (``-DRP_FUZZ_SELFTEST``)
must be caught, so the harness is shown to find what it looks for. The long run's
figure is in ``docs/security.md``.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import libfuzzer

from rdmashim.ulps.rds.wire import HEADER_STRUCT, RDS_HEADER_LEN
from rdmashim.verbs import WC_ROW, WCOpcode

from tooling import TOOLS

SOURCES = TOOLS.parent / "ulps" / "rds"
SECONDS = int(os.environ.get("RDMASHIM_RDS_FUZZ_SECONDS", "30"))
"""How long the bounded run fuzzes (CI's slice)."""
SLOTS, SLOT = 8, RDS_HEADER_LEN + 256
"""The harness's receive buffers (rds_plain_fuzz.c's SLOTS and SLOT)."""
PORTS = (9, 4000, 4001, 65535, 0, 1, 5000)
"""Its bound ports first, then ports it has no socket for."""


def build(out: Path, *defines: str) -> Path:
    sources = [TOOLS / "rds_plain_fuzz.c", SOURCES / "_plain.c"]
    return libfuzzer.build(out, sources, SOURCES, *defines)


def seed(rng: random.Random) -> bytes:
    """One poll: mostly plain messages numbered on from the first buffer's, some rows of
    other kinds and lengths."""
    n = rng.randrange(1, SLOTS + 1)
    rows, buffers, first = b"", bytearray(SLOTS * SLOT), rng.randrange(1 << 40)
    for k in range(n):
        payload = bytes(rng.randrange(256) for _ in range(rng.choice([0, 5, 64, 256])))
        sport, dport = rng.choice(PORTS), rng.choice(PORTS[:4] * 3 + PORTS[4:])
        if rng.random() < 0.1:
            sport = dport = 0  # a bare ack
            payload = b""
        flags = rng.choice([0, 0, 0, 1, 2, 4])
        HEADER_STRUCT.pack_into(
            buffers, k * SLOT, first + k, rng.randrange(1 << 20), len(payload), sport, dport,
            flags, rng.randrange(256), rng.choice([0, 0, 0, 7]), b"",
        )  # fmt: skip
        buffers[k * SLOT + RDS_HEADER_LEN : k * SLOT + RDS_HEADER_LEN + len(payload)] = payload
        opcode = rng.choice([int(WCOpcode.RECV)] * 8 + [int(WCOpcode.SEND), 7])
        rows += WC_ROW.pack(k, rng.choice([0] * 9 + [5]), opcode, RDS_HEADER_LEN + len(payload),
                            1, 0, 0, 0)  # fmt: skip
    return bytes([n - 1]) + rows + bytes(buffers)


def seed_corpus(directory: Path, count: int = 200) -> int:
    rng = random.Random(7)
    for index in range(count):
        (directory / f"seed{index:05d}").write_bytes(seed(rng))
    return count


def test_the_plain_path_survives_coverage_guided_fuzzing(tmp_path: Path) -> None:
    corpus = libfuzzer.corpus_of(tmp_path, seed_corpus)
    libfuzzer.survives(build(tmp_path / "rds_plain_fuzz"), corpus, SECONDS)


def test_the_harness_catches_a_missing_bounds_check(tmp_path: Path) -> None:
    binary = build(tmp_path / "rds_plain_fuzz_selftest", "-DRP_FUZZ_SELFTEST")
    corpus = libfuzzer.corpus_of(tmp_path, seed_corpus)
    libfuzzer.catches(binary, corpus, "a read past the receive buffers")
