"""What the benchmark scripts share for reporting: run metadata, the engine line of every header,
the progress line, profiles."""

from __future__ import annotations

import datetime
import io
import os
import platform
import pstats
import subprocess
import sys
from pathlib import Path
from typing import Any

import trio

import rdmashim
from rdmashim.providers.softiwarp import engines, fastpath
from rdmashim.registry import chosen_backend
from rdmashim.ulps.rds import plain


def engine(backend: str | None = None) -> str:
    """The engine a run uses: the backend (``backend``, else ``RDMASHIM_BACKEND``'s, else
    softiwarp) and, for the built-in soft-iWARP transport, which engine runs it (native or
    Python, and why: ``engines.describe()``; ``RDMASHIM_ENGINE`` chooses,
    ``RDMASHIM_NO_EXTENSIONS=1`` forces Python) and the Python engine's data-path kernels."""
    name = chosen_backend(backend)
    if name != "softiwarp":
        return f"{name} backend"
    which = engines.describe()
    if which.startswith("native"):
        return f"softiwarp backend, {which} engine"
    return f"softiwarp backend, {which} engine; its kernels: {fastpath.describe()}"


def engine_line(backend: str | None = None, width: int = 16) -> str:
    """Every benchmark header's engine line, its label padded to ``width`` (:func:`engine`)."""
    return f" {'Engine':<{width}}: {engine(backend)}"


def rds_path_line(width: int = 16) -> str:
    """The RDS benchmarks' header line: where RDS takes its plain messages (C or Python,
    and why: ``plain.describe()``)."""
    return f" {'RDS plain path':<{width}}: {plain.describe()}"


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; the platform's word elsewhere): ratios to
    raw TCP move with it, so every run records it."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_line(width: int = 16) -> str:
    """A benchmark header's CPU line, its label padded to ``width`` (:func:`cpu_model`)."""
    return f" {'CPU':<{width}}: {os.cpu_count()} x {cpu_model()}"


def run_meta(backend: str | None = None) -> dict[str, Any]:
    """Where and when a run happened: date, commit, Python, the CPU and how many, load
    average at the start, the backend and the engine (:func:`engine`; ``backend`` as
    there)."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
    except OSError:
        commit = ""
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "nproc": os.cpu_count(),
        "cpu": cpu_model(),
        "loadavg_start": os.getloadavg(),
        "commit": commit,
        "rdmashim": rdmashim.__version__,
        "trio": trio.__version__,
        "backend": chosen_backend(backend),
        "engine": engine(backend),
        "rds_plain_path": plain.describe(),
    }


def process_cpu(pid: int) -> float:
    """CPU seconds (user and system, all threads) the process ``pid`` has used so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Status:
    """A one-line ``\\r`` status on stderr, only when stderr is a terminal."""

    def __init__(self) -> None:
        self.on = sys.stderr.isatty()
        self.width = 0

    def show(self, text: str) -> None:
        if self.on:
            sys.stderr.write("\r" + text.ljust(self.width))
            sys.stderr.flush()
            self.width = len(text)

    def clear(self) -> None:
        if self.on and self.width:
            sys.stderr.write("\r" + " " * self.width + "\r")
            sys.stderr.flush()
            self.width = 0


def top_functions(path: Path, n: int) -> str:
    """The ``n`` functions of a pstats file with the most time of their own (tottime)."""
    out = io.StringIO()
    stats = pstats.Stats(str(path), stream=out)
    stats.sort_stats(pstats.SortKey.TIME).print_stats(n)
    text = out.getvalue()
    start = text.find("   ncalls")
    return text[start:].rstrip() if start >= 0 else text.rstrip()
