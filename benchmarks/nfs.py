#!/usr/bin/env python3
"""Our NFSv3 server and client over RPC-over-RDMA beside the same over TCP, in one run.

Two processes on one machine: this script is the client; it starts the
server as a subprocess (a fresh interpreter running this file with
``--serve``), which runs :func:`~rdmashim.ulps.nfsrdma.server.serve_nfs`
on 127.0.0.1 over a temporary export directory on disk: NFSv3 on
RPC-over-RDMA (the built-in soft-iWARP engine) and on TCP, MOUNT and
rpcbind on free ports. The client is :class:`~rdmashim.ulps.nfsrdma.client.
NfsClient`, mounting once per sample over ``rdma`` or ``tcp``; mounting and
unmounting are outside the timed window. Samples alternate RDMA, TCP, RDMA,
TCP, ...; the medians of ``--repeat`` samples and their ratio RDMA/TCP are
reported.

Benchmarks (``--only`` takes these names):

``read``
    :meth:`NfsClient.read_file` of a ``--size`` MiB file of random bytes
    (rtmax pieces, ``IN_FLIGHT`` READs outstanding) into a preallocated
    buffer. The file was written into the export before the run, so the
    server reads it from the page cache. Over RDMA each READ's data comes by
    RDMA Write into the client's registered Write chunk.
``write``
    :meth:`NfsClient.write_file` of ``--size`` MiB (create, wtmax pieces
    UNSTABLE, ``IN_FLIGHT`` outstanding, a COMMIT every 32 MiB, which the
    server answers after an ``fsync`` of the file). Over RDMA the server
    pulls each WRITE's data by RDMA Read from the client's Read chunk.
``getattr``
    ``--getattrs`` GETATTRs of the export's root, one at a time; the rate
    (calls/s), the latency of each call (median, 99th percentile), and the
    server process's CPU time per call (user and system, all threads, from
    ``/proc``: our server's own cost of a metadata call, whatever the client),
    beside the floor of any server's CPU per call on this machine, measured in
    the same run (``floor.c``'s blocking ping-pong: both ends' CPU per message;
    on a virtual machine a wake-up from a blocking wait costs more CPU than the
    system calls around it; without a C compiler the line says why not).

Every byte is checked after its window: the read buffer against the file,
the written file on disk against the source.

Usage::

    python benchmarks/nfs.py [--quick] [--repeat N] [--size MIB] [--getattrs N]
                             [--only NAME] [--json FILE]
    python benchmarks/nfs.py --profile DIR --only read   # cProfile both processes

cProfile sees the thread it runs in only: the server's profile of a TCP
sample is its event loop's, without the connection's own thread, where our
server reads, answers and writes the calls (``rdmashim.ulps.nfsrdma.tcp``);
the calls that go to a task (READ, WRITE, ...) are there.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from rdmashim.ulps.nfsrdma.client import COMMIT_EVERY, IN_FLIGHT, NfsClient, Proto
from rdmashim.ulps.nfsrdma.server import ServerConfig, serve_nfs

import floor
from report import Status, cpu_line, engine_line, process_cpu, run_meta, top_functions
from streams import stop_process

HOST = "127.0.0.1"
BACKEND = "softiwarp"
"""Both ends' backend: the built-in engine."""
MiB = 1 << 20
READ_FILE = "read.bin"
WRITE_FILE = "write.bin"
PROTOS: tuple[Proto, Proto] = ("rdma", "tcp")
RESULT_LINE = "-" * 84


class BenchError(RuntimeError):
    """A benchmark went wrong (wrong bytes, a server that did not start, ...)."""


# =============================================================================================
# server process
# =============================================================================================


async def _control(profile_dir: Path | None) -> None:
    """Read the client's commands on stdin until EOF (the end of the run).

    ``profile`` turns cProfile on in this process; ``dump NAME`` turns it off,
    writes ``server-NAME.pstats`` to the profile directory and says ``DUMPED``.
    """
    prof: cProfile.Profile | None = None
    pending = b""
    async with trio.lowlevel.FdStream(os.dup(sys.stdin.fileno())) as stdin:
        while chunk := await stdin.receive_some(4096):
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                command, _, name = line.decode().partition(" ")
                if command == "profile":
                    prof = cProfile.Profile()
                    prof.enable()
                elif command == "dump" and prof is not None and profile_dir is not None:
                    prof.disable()
                    prof.dump_stats(profile_dir / f"server-{name}.pstats")
                    prof = None
                    print("DUMPED", flush=True)


async def serve_main(
    export: Path, state: Path, profile_dir: Path | None, at: list[str] | None
) -> None:
    """The server: on free ports of 127.0.0.1 with our rpcbind, or ``at`` (host, TCP and
    RDMA ports) without rpcbind (``benchmarks/nfs_kernel.py``)."""
    host, tcp, rdma, rpcbind = (at[0], int(at[1]), int(at[2]), None) if at else (HOST, 0, 0, 0)
    config = ServerConfig(
        export, root_squash=False, host=host, tcp_port=tcp, rdma_port=rdma, rpcbind_port=rpcbind,
        backend=BACKEND, state_dir=state,
    )  # fmt: skip
    async with trio.open_nursery() as nursery:
        serving = await nursery.start(serve_nfs, config)
        print(f"READY {serving.rpcbind_port} {serving.export}", flush=True)
        await _control(profile_dir)  # the client closes our stdin when it is done
        nursery.cancel_scope.cancel()


# =============================================================================================
# client
# =============================================================================================


@dataclass
class Config:
    size: int
    getattrs: int
    rpcbind_port: int
    export: str
    export_dir: Path
    data: bytes
    server: subprocess.Popen[bytes]
    profile_dir: Path | None = None
    floor_binary: floor.FloorBinary | None = None
    """The compiled floor.c, or None: ``floor_why`` says why not."""
    floor_why: str = ""


class Window:
    """A sample's timed window: wall clock and both processes' CPU time, and with
    ``--profile`` cProfile in both processes."""

    def __init__(self, cfg: Config, name: str) -> None:
        self.cfg = cfg
        self.name = name
        self.profile = cProfile.Profile() if cfg.profile_dir else None
        self.seconds = self.client_cpu = self.server_cpu = 0.0

    def _tell(self, line: str) -> None:
        stdin = self.cfg.server.stdin
        assert stdin is not None
        stdin.write(line.encode() + b"\n")
        stdin.flush()

    def start(self) -> None:
        if self.profile:
            self._tell("profile")
            self.profile.enable()
        self.server_cpu = -process_cpu(self.cfg.server.pid)
        self.client_cpu = -time.process_time()
        self.seconds = -time.perf_counter()

    async def stop(self) -> None:
        self.seconds += time.perf_counter()
        self.client_cpu += time.process_time()
        self.server_cpu += process_cpu(self.cfg.server.pid)
        if self.profile and self.cfg.profile_dir:
            self.profile.disable()
            self.profile.dump_stats(self.cfg.profile_dir / f"client-{self.name}.pstats")
            self._tell(f"dump {self.name}")
            stdout = self.cfg.server.stdout
            assert stdout is not None
            answer = await trio.to_thread.run_sync(stdout.readline)
            if answer.strip() != b"DUMPED":
                raise BenchError(f"the server did not write its profile (said {answer!r})")

    def figures(self, value: float, **more: float) -> dict[str, float]:
        """The sample's result: its value, the window, the CPU time of each process."""
        return {
            "value": value,
            "seconds": self.seconds,
            "client_cpu_s": self.client_cpu,
            "server_cpu_s": self.server_cpu,
            **more,
        }


class Collect:
    """A sink for :meth:`NfsClient.read_file`: the bytes, in order, into a preallocated buffer."""

    def __init__(self, size: int) -> None:
        self.buf = bytearray(size)
        self.view = memoryview(self.buf)
        self.pos = 0

    def write(self, data: bytes, /) -> int:
        end = self.pos + len(data)
        self.view[self.pos : end] = data
        self.pos = end
        return len(data)


async def bench_read(nfs: NfsClient, cfg: Config, window: Window) -> dict[str, float]:
    sink = Collect(cfg.size)
    window.start()
    got = await nfs.read_file("/" + READ_FILE, sink)
    await window.stop()
    if got != cfg.size:
        raise BenchError(f"READ: {got} bytes, not the {cfg.size} bytes of the file")
    if sink.buf != cfg.data:
        at = next(i for i, (a, b) in enumerate(zip(sink.buf, cfg.data, strict=True)) if a != b)
        raise BenchError(f"READ: the bytes read differ from the file's, first at byte {at}")
    return window.figures(got / window.seconds / MiB, bytes=got)


async def bench_write(nfs: NfsClient, cfg: Config, window: Window) -> dict[str, float]:
    source = io.BytesIO(cfg.data)
    window.start()
    put = await nfs.write_file("/" + WRITE_FILE, source, cfg.size)
    await window.stop()
    if put != cfg.size or (cfg.export_dir / WRITE_FILE).read_bytes() != cfg.data:
        raise BenchError(f"WRITE: the file on disk is not the {cfg.size} bytes written")
    return window.figures(put / window.seconds / MiB, bytes=put)


async def bench_getattr(nfs: NfsClient, cfg: Config, window: Window) -> dict[str, float]:
    clock = time.perf_counter_ns
    samples: list[int] = []
    window.start()
    for _ in range(cfg.getattrs):
        t = clock()
        await nfs.getattr("/")  # the root: one GETATTR, no LOOKUP
        samples.append(clock() - t)
    await window.stop()
    us = sorted(s / 1000 for s in samples)
    return window.figures(
        cfg.getattrs / window.seconds,
        calls=cfg.getattrs,
        lat_median_us=statistics.median(us),
        lat_p99_us=us[min(len(us) - 1, int(len(us) * 0.99))],
        server_cpu_us=window.server_cpu / cfg.getattrs * 1e6,
    )


GETATTR_ROWS = {"lat_median_us": "  median", "lat_p99_us": "  p99", "server_cpu_us": "  server CPU"}
"""The per-call figures of ``getattr`` (medians of the samples) and their rows."""


@dataclass(frozen=True)
class Bench:
    name: str
    run: Callable[[NfsClient, Config, Window], Awaitable[dict[str, float]]]
    unit: str


BENCHES = [
    Bench("read", bench_read, "MiB/s"),
    Bench("write", bench_write, "MiB/s"),
    Bench("getattr", bench_getattr, "calls/s"),
]


async def one_sample(cfg: Config, bench: Bench, proto: Proto) -> dict[str, float]:
    """Mount over ``proto``, run ``bench`` once, unmount (only the benchmark is timed)."""
    async with NfsClient.connect(
        HOST, cfg.export, proto=proto, rpcbind_port=cfg.rpcbind_port, backend=BACKEND
    ) as nfs:
        return await bench.run(nfs, cfg, Window(cfg, f"{bench.name}-{proto}"))


def _median(details: list[dict[str, float]], key: str = "value") -> float:
    return statistics.median(d[key] for d in details)


async def run_samples(
    cfg: Config, benches: list[Bench], repeat: int, status: Status
) -> list[dict[str, Any]]:
    results = []
    for bench in benches:
        details: dict[str, list[dict[str, float]]] = {proto: [] for proto in PROTOS}
        floor_cpu: list[float] = []
        floor_why = cfg.floor_why
        for i in range(repeat):
            for proto in PROTOS:
                status.show(f"{bench.name}: sample {i + 1}/{repeat} ({proto})")
                with trio.fail_after(600):
                    details[proto].append(await one_sample(cfg, bench, proto))
            if bench.name == "getattr" and not floor_why:
                status.show(f"getattr: sample {i + 1}/{repeat} (the server CPU floor)")
                floor_why = await _floor_cpu(cfg, floor_cpu)
        rdma, tcp = _median(details["rdma"]), _median(details["tcp"])
        result: dict[str, Any] = {
            "name": bench.name,
            "unit": bench.unit,
            "rdma_median": rdma,
            "tcp_median": tcp,
            "ratio": rdma / tcp,
            "ratio_meaning": "RDMA/TCP throughput (>1: RDMA faster)",
            "rdma": [d["value"] for d in details["rdma"]],
            "tcp": [d["value"] for d in details["tcp"]],
            "samples": details,
        }
        for key in ("seconds", "client_cpu_s", "server_cpu_s"):
            result[key] = {proto: _median(details[proto], key) for proto in PROTOS}
        if bench.name == "getattr":
            for key in GETATTR_ROWS:
                result[key] = {proto: _median(details[proto], key) for proto in PROTOS}
            result["floor_cpu_us"], result["floor_why"] = floor_cpu, floor_why
        results.append(result)
    status.clear()
    return results


FLOOR_ROUND_TRIPS = 5000
"""Round trips of each floor.c sample the server CPU floor is taken from."""


async def _floor_cpu(cfg: Config, samples: list[float]) -> str:
    """One sample of the server CPU floor (:func:`floor.cpu_per_message`) added to
    ``samples``, taken between the GETATTR samples (the figure moves with the
    machine's state); "" or why it could not be taken."""
    if cfg.floor_binary is None:
        return cfg.floor_why or "floor.c was not built"
    try:
        samples.append(await floor.cpu_per_message(cfg.floor_binary, FLOOR_ROUND_TRIPS, 500))
    except floor.FloorUnavailable as exc:
        return str(exc)
    return ""


def _row(name: str, size: str, rdma: float, tcp: float, unit: str, prec: int = 1) -> str:
    ratio = rdma / tcp if tcp else math.nan  # a CPU time under one clock tick reads 0
    return f" {name:<13}{size:>10}{rdma:>13.{prec}f}{tcp:>13.{prec}f}{ratio:>11.3f}  {unit}"


def print_table(cfg: Config, results: list[dict[str, Any]]) -> None:
    print(RESULT_LINE)
    print(f" {'benchmark':<13}{'size':>10}{'RDMA':>13}{'TCP':>13}{'RDMA/TCP':>11}  unit")
    for r in results:
        if r["name"] == "getattr":
            calls = f"{cfg.getattrs} x"
            print(_row("getattr", calls, r["rdma_median"], r["tcp_median"], "calls/s", 0))
            for key, label in GETATTR_ROWS.items():
                per_call = r[key]
                print(_row(label, "1 call", per_call["rdma"], per_call["tcp"], "usec"))
        else:
            size = f"{cfg.size // MiB} MiB"
            print(_row(r["name"], size, r["rdma_median"], r["tcp_median"], r["unit"]))
    print(RESULT_LINE)
    print(" ratio RDMA/TCP: above 1 is faster over RDMA, but for usec (latency, server CPU per")
    print(" call) it is slower or costlier")
    print(f" {'seconds (median)':<23}{'RDMA: window':>13}{'client':>8}{'server':>8}"
          f"{'TCP: window':>13}{'client':>8}{'server':>8}")  # fmt: skip
    for r in results:
        cells = "".join(
            f"{r['seconds'][proto]:>13.3f}{r['client_cpu_s'][proto]:>8.3f}"
            f"{r['server_cpu_s'][proto]:>8.3f}"
            for proto in PROTOS
        )
        print(f" {r['name']:<23}{cells}")
    print(" client, server: CPU time (user+system, all threads) of each process in the window")
    for r in results:
        if r["name"] == "getattr":
            print(_floor_line(r["floor_cpu_us"], r["floor_why"]))
    print(RESULT_LINE)


def _floor_line(samples: list[float], why: str) -> str:
    """The server CPU floor as the table's footnote says it."""
    if why or not samples:
        return f" server CPU floor: n/a ({why or 'not measured'})"
    each = ", ".join(f"{x:.1f}" for x in samples)
    return (
        f" server CPU floor: {statistics.median(samples):.1f} usec a message at each end of a C\n"
        f"   TCP ping-pong that only waits, receives and answers (floor.c block, after each\n"
        f"   pair of GETATTR samples: {each}): no server here costs less a call"
    )


def _filesystem(path: Path) -> str:
    """The type and device of the file system holding ``path`` (from /proc/mounts)."""
    best, found = "", "unknown"
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return found
    where = str(path.resolve())
    for line in mounts:
        device, point, fstype = line.split()[:3]
        inside = where == point or where.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, found = point, f"{fstype} ({device} on {point})"
    return found


def print_header(args: argparse.Namespace, cfg: Config, meta: dict[str, Any]) -> None:
    print(RESULT_LINE)
    print(" rdmashim NFSv3: RPC-over-RDMA (soft-iWARP) vs TCP (our server and client, loopback)")
    print(RESULT_LINE)
    print(engine_line(BACKEND, width=11))
    print(f" Repeats    : {args.repeat:<18} Reported : median of repeats")
    size = f"{cfg.size // MiB} MiB"
    print(f" File size  : {size:<18} GETATTRs : {cfg.getattrs}, one at a time")
    print(f" Export     : {meta['export_fs']}, file in the page cache for READ")
    print(f" WRITE      : UNSTABLE, COMMIT (server fsync) every {COMMIT_EVERY // MiB} MiB")
    flight = f"{IN_FLIGHT} READs/WRITEs"
    print(f" In flight  : {flight:<18} Python   : {meta['python']}")
    print(f" CPUs       : {meta['nproc']:<18} Date     : {meta['date']}")
    print(cpu_line(width=11))


async def client_main(
    args: argparse.Namespace, cfg: Config, benches: list[Bench]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    meta = {
        **run_meta(BACKEND),
        "host": HOST,
        "repeat": args.repeat,
        "file_size": cfg.size,
        "getattrs": cfg.getattrs,
        "in_flight": IN_FLIGHT,
        "commit_every": COMMIT_EVERY,
        "write_stable": "UNSTABLE, then COMMIT",
        "export_fs": _filesystem(cfg.export_dir),
        "read_from": "page cache (the file was written just before the run)",
    }
    if args.profile:
        details = []
        for bench in benches:
            for proto in PROTOS:
                details.append((bench, proto, await one_sample(cfg, bench, proto)))
        report_profiles(details, Path(args.profile))
        return meta, []
    print_header(args, cfg, meta)
    sys.stdout.flush()
    results = await run_samples(cfg, benches, args.repeat, Status())
    meta["loadavg_end"] = os.getloadavg()
    print_table(cfg, results)
    return meta, results


def report_profiles(
    details: list[tuple[Bench, Proto, dict[str, float]]], profile_dir: Path
) -> None:
    """Print the top functions of both processes' profiles of each sample."""
    for bench, proto, detail in details:
        name = f"{bench.name}-{proto}"
        print(f"== {name}: {detail['value']:.4g} {bench.unit} (profiled, slower)")
        for label in ("client", "server"):
            path = profile_dir / f"{label}-{name}.pstats"
            tcp_server = label == "server" and proto == "tcp"
            unseen = " (not its connection's thread)" if tcp_server else ""
            print(f"-- {label} process{unseen}, top 20 by tottime ({path})")
            print(top_functions(path, 20) if path.exists() else "   (no profile written)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Our NFSv3 over RPC-over-RDMA beside TCP (two processes, loopback)."
    )
    p.add_argument("--quick", action="store_true", help="32 MiB, 2000 GETATTRs, 3 repeats")
    p.add_argument("--json", metavar="FILE", help="write every sample to FILE")
    p.add_argument("--repeat", type=int, help="samples per transport, alternating (default 3)")
    p.add_argument("--size", type=int, metavar="MIB", help="file size for read and write")
    p.add_argument("--getattrs", type=int, metavar="N", help="GETATTRs per sample")
    p.add_argument(
        "--only",
        action="append",
        choices=[b.name for b in BENCHES],
        help="run only this benchmark (repeatable)",
    )
    p.add_argument("--dir", help="where the export directory is made (default: the tmp dir)")
    p.add_argument(
        "--profile",
        metavar="DIR",
        help="run one profiled sample per benchmark and transport (both processes) and "
        "print the top 20 functions by tottime; no table",
    )
    p.add_argument("--serve", nargs=2, metavar=("EXPORT", "STATE"), help=argparse.SUPPRESS)
    p.add_argument("--profile-dir", help=argparse.SUPPRESS)
    p.add_argument("--serve-at", nargs=3, metavar=("HOST", "TCP", "RDMA"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.repeat is None:
        args.repeat = 3
    if args.size is None:
        args.size = 32 if args.quick else 256
    if args.getattrs is None:
        args.getattrs = 2000 if args.quick else 10_000
    if args.repeat < 1 or args.size < 1 or args.getattrs < 1:
        p.error("--repeat, --size and --getattrs must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve:
        profile_dir = Path(args.profile_dir) if args.profile_dir else None
        trio.run(serve_main, Path(args.serve[0]), Path(args.serve[1]), profile_dir, args.serve_at)
        return 0
    benches = [b for b in BENCHES if not args.only or b.name in args.only]
    profile_dir = Path(args.profile).resolve() if args.profile else None
    if profile_dir:
        profile_dir.mkdir(parents=True, exist_ok=True)
    size = args.size * MiB
    with tempfile.TemporaryDirectory(prefix="rdmashim-nfs-bench-", dir=args.dir) as tmp:
        export, state = Path(tmp) / "export", Path(tmp) / "state"
        export.mkdir()
        try:
            binary, why = floor.build(Path(tmp)), ""
        except floor.FloorUnavailable as exc:
            binary, why = None, str(exc)
        data = os.urandom(size)
        (export / READ_FILE).write_bytes(data)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--serve", str(export), str(state)]
        if profile_dir:
            cmd += ["--profile-dir", str(profile_dir)]
        server = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        try:
            assert server.stdout is not None
            line = server.stdout.readline().decode().split()
            if len(line) != 3 or line[0] != "READY":
                raise BenchError(f"server did not start (said {line!r})")
            cfg = Config(
                size, args.getattrs, int(line[1]), line[2], export, data, server, profile_dir,
                binary, why,
            )  # fmt: skip
            meta, results = trio.run(client_main, args, cfg, benches)
        finally:
            stop_process(server)
    if args.json and not args.profile:
        doc = {"meta": meta, "results": results}
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
