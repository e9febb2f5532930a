"""The native engine's device lock under ThreadSanitizer: ``tools/native_threads.c`` has
a thread serve one QP (``rs_qp_serve_poll``, as ``CQ.serve_in_thread`` does, or
``rs_qp_serve_slot``, as it does answering from slots), the main
thread drive its peer and a third register and deregister regions in the same memory
table; built with ``-fsanitize=thread``, it must answer every message right with no
race reported. The same program with the lock compiled out must be reported (the test
can fail). Needs clang and its sanitizer runtimes, as the fuzz test does."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from libfuzzer import unavailable
from test_native_fuzz import SOURCES, TOOLS

FLAGS = ["-g", "-O1", "-fsanitize=thread"]
NO_LOCK = """#include <pthread.h>
#define pthread_mutex_lock(lock) 0
#define pthread_mutex_unlock(lock) 0
"""


def build(out: Path, *, locked: bool = True) -> Path:
    clang = shutil.which("clang")
    if clang is None:
        unavailable("clang is not installed (the program is built with ThreadSanitizer)")
    engine: list[str] = [str(SOURCES / "_engine.c")]
    steps = []
    if not locked:  # the engine alone without its lock, the rest as it is
        header = out.with_suffix(".h")
        header.write_text(NO_LOCK)
        engine = [str(out.with_suffix(".o"))]
        steps.append([
            clang, *FLAGS, "-c", "-include", str(header), "-I", str(SOURCES),
            str(SOURCES / "_engine.c"), "-o", engine[0],
        ])  # fmt: skip
    steps.append([
        clang, *FLAGS, "-I", str(SOURCES), str(TOOLS / "native_threads.c"), *engine,
        str(SOURCES / "_accel.c"), "-o", str(out),
    ])  # fmt: skip
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True, timeout=300, check=False)
        if done.returncode:
            unavailable(f"clang cannot build with ThreadSanitizer: {done.stderr}")
    return out


def run(program: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(program), *args], capture_output=True, text=True, timeout=300, check=False
    )


def test_a_served_qp_beside_registrations_has_no_race(tmp_path: Path) -> None:
    done = run(build(tmp_path / "native_threads"))
    assert "ThreadSanitizer" not in done.stderr, done.stderr[-4000:]
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout == "native_threads: 5000 messages answered by the serving thread\n"


def test_a_qp_answering_from_slots_beside_registrations_has_no_race(tmp_path: Path) -> None:
    """The same, the thread serving through ``rs_qp_serve_slot`` (C posts each answer
    from its Send slot, gives the Receive back and frees the slots)."""
    done = run(build(tmp_path / "native_threads"), "slots")
    assert "ThreadSanitizer" not in done.stderr, done.stderr[-4000:]
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout == (
        "native_threads: 5000 messages answered by the serving thread from slots\n"
    )


def test_without_the_lock_the_races_are_reported(tmp_path: Path) -> None:
    done = run(build(tmp_path / "native_threads_no_lock", locked=False))
    assert "WARNING: ThreadSanitizer: data race" in done.stderr
    assert done.returncode != 0
