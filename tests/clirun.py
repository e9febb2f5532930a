"""Running the ``rdmashim`` command (and the examples) as a user does, in a subprocess."""

from __future__ import annotations

import os
import random
import re
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RDMASHIM = [sys.executable, "-m", "rdmashim"]
DEADLINE = 20.0
"""Seconds a command with bad input may take to say so (the machine is slow and shared)."""
STRESS_ROW = re.compile(
    r"^\s*(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$"
)
"""A row of ``rds stress``: tsks, tx/s, tx+rx K/s, rw+rr K/s, tx us/c, rtt us, cpu %."""


def subnet() -> str:
    """A 127.x.y. prefix of our own, so parallel runs do not meet."""
    return f"127.{random.randrange(1, 255)}.{random.randrange(256)}."


def free_port(address: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def run(
    argv: list[str], *, env: Mapping[str, str] | None = None, timeout: float = DEADLINE
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` to its end (a hang fails the test with TimeoutExpired)."""
    return subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, **(env or {})},
    )


def rdmashim(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return run([*RDMASHIM, *args], timeout=timeout)


def assert_one_error_line(out: subprocess.CompletedProcess[str], status: int, text: str) -> str:
    """``out`` ended with ``status`` and said exactly one line on stderr, containing ``text``."""
    lines = out.stderr.splitlines()
    assert out.returncode == status, (out.returncode, out.stderr)
    assert len(lines) == 1, out.stderr
    assert "Traceback" not in out.stderr + out.stdout
    assert text in lines[0], lines[0]
    return lines[0]


class Running:
    """A command running in the background whose output is read as it comes."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.seen = {"stdout": b"", "stderr": b""}

    def wait_for(self, pattern: str, stream: str = "stdout", timeout: float = 30.0) -> None:
        """Read ``stream`` until ``pattern`` matches it (the test fails after ``timeout`` s)."""
        pipe = getattr(self.proc, stream)
        deadline = time.monotonic() + timeout
        while re.search(pattern, self.seen[stream].decode(errors="replace"), re.M) is None:
            left = deadline - time.monotonic()
            assert left > 0, f"no {pattern!r} in {timeout} s; {stream} so far: {self.seen!r}"
            ready, _, _ = select.select([pipe], [], [], left)
            if ready:
                chunk = os.read(pipe.fileno(), 65536)
                assert chunk, f"exited ({self.proc.wait()}) before {pattern!r}: {self.seen!r}"
                self.seen[stream] += chunk

    def interrupt(self, timeout: float = DEADLINE) -> tuple[int, str, str]:
        """Ctrl-C; wait for the end: (status, all of stdout, stderr)."""
        self.proc.send_signal(signal.SIGINT)
        return self.finish(timeout)

    def finish(self, timeout: float = DEADLINE) -> tuple[int, str, str]:
        out, err = self.proc.communicate(timeout=timeout)
        out, err = self.seen["stdout"] + out, self.seen["stderr"] + err
        return self.proc.returncode, out.decode(), err.decode()

    def stop(self) -> None:
        """Make sure it is gone (Ctrl-C, then kill)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


@contextmanager
def background(*args: str, first: str = r".") -> Iterator[Running]:
    """``rdmashim ARGS`` running until the end of the block, once ``first`` is on its stdout."""
    running = Running([*RDMASHIM, *args])
    try:
        running.wait_for(first)
        yield running
    finally:
        running.stop()
