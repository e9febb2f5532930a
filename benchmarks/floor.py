"""This machine's latency floor: ``floor.c``, an 8-byte TCP ping-pong in C over 127.0.0.1.

bench.py's latency rows are judged against it as well as against raw Python
TCP: what the kernel's loopback TCP costs with no Python on either end, in the
two ways our rows wait (``block``: both ends block in ``recv``, the floor of
send-lat; ``poll``: both ends spin on non-blocking ``recv``, the floor of
send-lat-poll). ``block`` also gives the floor of a server's CPU per call
(:func:`cpu_per_message`, which ``nfs.py`` prints beside its server's): on a
virtual machine, a wake-up from a blocking wait costs far more CPU than the
system calls around it. It is compiled when a run starts, with ``$CC`` or the compiler
Python was built with (``sysconfig``'s ``CC``), else ``cc``, into a temporary
directory of that run; without a compiler, :func:`build` says why not.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import subprocess
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

import trio

SOURCE = Path(__file__).resolve().parent / "floor.c"
MODES = ("block", "poll", "hop")
"""floor.c's modes: both ends block in ``recv``; both spin on non-blocking ``recv``; at
both ends a progress thread blocks in ``recv`` and hands each message to the waiting
thread through an eventfd (the cost of a progress thread's hand-over, against ``block``)."""
CFLAGS = ("-O2", "-Wall", "-Wextra", "-pthread")


class FloorUnavailable(RuntimeError):
    """The floor cannot be measured here (no C compiler, or it failed); the text says why."""


@dataclass(frozen=True)
class FloorBinary:
    """A compiled ``floor.c`` and the command line that built it."""

    path: Path
    command: str


def compiler() -> list[str]:
    """The C compiler's command: ``$CC``, else Python's own (``sysconfig``), else ``cc``.
    Raises :class:`FloorUnavailable` naming what was looked for when it is not there."""
    named = os.environ.get("CC")
    words = shlex.split(named or sysconfig.get_config_var("CC") or "cc")
    if words and shutil.which(words[0]):
        return words
    if not named and shutil.which("cc"):
        return ["cc"]
    where = f"$CC={named!r} not found" if named else "no cc or gcc on PATH"
    raise FloorUnavailable(f"no C compiler: {where}")


def build(directory: Path) -> FloorBinary:
    """Compile ``floor.c`` into ``directory``; :class:`FloorUnavailable` if it cannot be."""
    out = directory / "floor"
    cmd = [*compiler(), *CFLAGS, "-o", str(out), str(SOURCE)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise FloorUnavailable(f"the C compiler failed: {exc}") from None
    if done.returncode != 0:
        first = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[0]
        raise FloorUnavailable(f"floor.c did not compile: {first}")
    return FloorBinary(out, shlex.join([*cmd[:-3], "floor.c"]))


def parse(line: str) -> dict[str, str]:
    """``floor``'s output line, ``key=value`` words, as a dict."""
    return dict(word.split("=", 1) for word in line.split() if "=" in word)


async def run(binary: FloorBinary, mode: str, round_trips: int, warmup: int) -> dict[str, str]:
    """One run of the helper: its output's fields (:func:`parse`); ``mode`` one of
    :data:`MODES`. :class:`FloorUnavailable` if it failed or took more than a minute
    and 100 us a round trip."""
    cmd = [str(binary.path), mode, str(round_trips), str(warmup)]
    limit = 60 + (round_trips + warmup) * 1e-4
    with trio.move_on_after(limit) as scope:
        done = await trio.run_process(cmd, capture_stdout=True, capture_stderr=True, check=False)
    if scope.cancelled_caught:
        raise FloorUnavailable(f"floor {mode}: no result in {limit:.0f} s")
    if done.returncode != 0:
        raise FloorUnavailable(f"floor {mode} failed: {done.stderr.decode().strip()}")
    return parse(done.stdout.decode())


def field_us(fields: dict[str, str], key: str, mode: str) -> float:
    """The nanosecond figure ``key`` of a run's ``fields``, in microseconds."""
    try:
        return int(fields[key]) / 1000
    except (KeyError, ValueError):
        raise FloorUnavailable(f"floor {mode} said {fields!r}, no {key}") from None


async def measure(binary: FloorBinary, mode: str, round_trips: int, warmup: int) -> float:
    """The median half round trip in microseconds over ``round_trips`` ping-pongs after
    ``warmup`` (see :func:`run`)."""
    return field_us(await run(binary, mode, round_trips, warmup), "median_half_rtt_ns", mode)


async def cpu_per_message(binary: FloorBinary, round_trips: int, warmup: int) -> float:
    """Microseconds of CPU (user and system, both ends) per message one end took in
    and answered, both ends blocking in ``recv``: what a server that only waits,
    receives and answers costs a call on this machine, the floor of a server's CPU
    per call (``benchmarks/nfs.py``)."""
    return field_us(await run(binary, "block", round_trips, warmup), "cpu_ns_per_message", "block")


def main(argv: list[str] | None = None) -> int:
    """``python benchmarks/floor.py``: every mode's median half round trip, the modes
    alternating ``--repeat`` times, and what a progress thread's hand-over adds."""
    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--round-trips", type=int, default=20000)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args(argv)

    async def sample(binary: FloorBinary) -> dict[str, list[float]]:
        got: dict[str, list[float]] = {mode: [] for mode in (*MODES, "cpu")}
        for _ in range(args.repeat):
            for mode in MODES:
                fields = await run(binary, mode, args.round_trips, 1000)
                got[mode].append(field_us(fields, "median_half_rtt_ns", mode))
                if mode == "block":
                    got["cpu"].append(field_us(fields, "cpu_ns_per_message", mode))
        return got

    with tempfile.TemporaryDirectory() as tmp:
        try:
            got = trio.run(sample, build(Path(tmp)))
        except FloorUnavailable as exc:
            print(f"floor: n/a ({exc})")
            return 1
    med = {mode: statistics.median(v) for mode, v in got.items()}
    for mode in MODES:
        samples = ", ".join(f"{x:.1f}" for x in got[mode])
        print(f"{mode:6s} {med[mode]:7.1f} us half round trip (median of {samples})")
    print(f"a progress thread's hand-over adds {med['hop'] - med['block']:.1f} us a message "
          f"({med['hop'] / med['block']:.2f}x block)")  # fmt: skip
    print(
        f"block: {med['cpu']:.1f} us of CPU a message at each end (both ends' CPU time; "
        f"median of {', '.join(f'{x:.1f}' for x in got['cpu'])})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
