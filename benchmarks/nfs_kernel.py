#!/usr/bin/env python3
"""The Linux kernel's NFS client in the project's QEMU guest against our NFS server.

The guest (``tests/siwvm.py``: the test bed's image, siw loaded, ``siw0`` on
``eth0``) boots under QEMU **TCG emulation** on tap 4 as 10.77.0.14 in the
test bed's namespace; our server (``benchmarks/nfs.py --serve``, the
built-in soft-iWARP engine, a process of its own) runs in that namespace on
the bridge's address, NFS over RDMA on port 20051 and over TCP on 2051 (MOUNT
on the TCP port, no rpcbind), so it does not meet the ports of
``tests/test_nfs_kernel.py``. For each repeat and transport the guest mounts
``vers=3,proto=rdma|tcp,nolock``, then with ``dd bs=1M``:

- **write**: ``--size`` MiB from ``/dev/zero`` to a new file, ``conv=fsync``
  (the kernel writes UNSTABLE and COMMITs at the end, the server fsyncs);
- **read**: the guest's page cache dropped (``echo 3 > drop_caches``), then
  the ``--size`` MiB file the host wrote into the export (in the host's page
  cache) to ``/dev/null``;

timed in the guest with ``date +%s.%N`` around each ``dd``; then it unmounts.
The table gives MiB/s medians and RDMA/TCP. Under TCG the guest's CPU is
emulated, so the figures measure the emulation more than either protocol.

Needs root, QEMU and the image of ``tools/guest/build.py``. The guest is booted
under ``flock /tmp/rdmashim-guest.lock`` (taken here), as every guest of the
project; the namespace is made if missing and never taken down.

Usage::

    sudo python benchmarks/nfs_kernel.py [--size MIB] [--repeat N] [--json FILE]
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import trio

from report import Status, cpu_line, engine_line, process_cpu, run_meta, top_functions
from streams import stop_process

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import siwvm  # the test bed lives with the tests

GUEST_NAME = "rdmashim-nfs-bench"
GUEST_IP = "10.77.0.14"
TAP = 4
TCP_PORT = 2051
RDMA_PORT = 20051
LOCK = Path("/tmp/rdmashim-guest.lock")
READ_FILE = "in.bin"
MiB = 1 << 20
PROTOS = ("rdma", "tcp")
SERVER_BACKEND = "softiwarp"
"""Our server's backend (benchmarks/nfs.py --serve runs the built-in engine)."""
RESULT_LINE = "-" * 72
MOUNTS: dict[str, str] = {}
"""The guest's /proc/mounts line of each transport's mount (its rsize, wsize, ...)."""

GUEST_SCRIPT = r"""
set -e -o pipefail
PROTO={proto}; M=/mnt/nfsbench
if [ $PROTO = rdma ]; then modprobe rpcrdma; fi
mkdir -p $M
mount -t nfs -o vers=3,proto=$PROTO,port={port},mountport={tcp_port},mountproto=tcp,nolock \
    {host}:{export} $M
echo "MOUNT $(grep " $M " /proc/mounts)"
now() {{ date +%s.%N; }}
T0=$(now)
dd if=/dev/zero of=$M/out.$PROTO bs=1M count={mib} conv=fsync status=none
T1=$(now)
echo "RESULT write $T0 $T1"
sync; echo 3 > /proc/sys/vm/drop_caches
T0=$(now)
dd if=$M/{read_file} of=/dev/null bs=1M status=none
T1=$(now)
echo "RESULT read $T0 $T1"
rm $M/out.$PROTO
umount $M
"""


@contextmanager
def guest_lock() -> Iterator[None]:
    """Hold ``/tmp/rdmashim-guest.lock`` (flock, as ``flock(1)`` takes it)."""
    with LOCK.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def start_server(export: Path, state: Path, profile: Path | None) -> subprocess.Popen[bytes]:
    """``benchmarks/nfs.py --serve`` inside the namespace, on the bridge's address (with
    ``profile``: ready to write cProfile files there, :func:`one_run` says when)."""
    nfs = Path(__file__).resolve().parent / "nfs.py"
    at = [siwvm.HOST_IP, str(TCP_PORT), str(RDMA_PORT)]
    cmd = [sys.executable, str(nfs), "--serve", str(export), str(state), "--serve-at", *at]
    if profile:
        cmd += ["--profile-dir", str(profile)]
    server = subprocess.Popen(siwvm.netns_cmd(*cmd), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert server.stdout is not None
    line = server.stdout.readline().decode().split()
    if not line or line[0] != "READY":
        stop_process(server)
        raise RuntimeError(f"the server did not start (said {line!r})")
    return server


def _tell(server: subprocess.Popen[bytes], command: str) -> None:
    """A line to the server's control (``profile``, ``dump NAME``: nfs.py's ``_control``)."""
    assert server.stdin is not None and server.stdout is not None
    server.stdin.write(command.encode() + b"\n")
    server.stdin.flush()
    if command.startswith("dump "):
        answer = server.stdout.readline().decode().strip()
        if answer != "DUMPED":
            raise RuntimeError(f"the server did not write its profile (said {answer!r})")


async def one_run(
    guest: siwvm.Guest, server: subprocess.Popen[bytes], export: Path, proto: str, mib: int,
    profiled: bool = False,
) -> dict[str, float]:  # fmt: skip
    """Mount over ``proto``, write then read ``mib`` MiB with dd, unmount; seconds of each,
    and of the whole job the wall-clock time and the server's CPU time (``profiled``: the
    server profiles the job into ``server-kernel-PROTO.pstats``)."""
    port = RDMA_PORT if proto == "rdma" else TCP_PORT
    script = GUEST_SCRIPT.format(
        proto=proto, port=port, tcp_port=TCP_PORT, host=siwvm.HOST_IP, export=export,
        mib=mib, read_file=READ_FILE,
    )  # fmt: skip
    if profiled:
        _tell(server, "profile")
    cpu, start = process_cpu(server.pid), time.monotonic()
    result = await guest.run(script, limit=60.0 + 10.0 * mib)
    job = {"job": time.monotonic() - start, "server_cpu": process_cpu(server.pid) - cpu}
    if profiled:
        _tell(server, f"dump kernel-{proto}")
    if result.returncode != 0:
        raise RuntimeError(f"guest job ({proto}) failed:\n{result.output}")
    seconds = {}
    for line in result.output.splitlines():
        if line.startswith("MOUNT "):
            MOUNTS[proto] = line.removeprefix("MOUNT ")
        elif line.startswith("RESULT "):
            _, op, t0, t1 = line.split()
            seconds[op] = float(t1) - float(t0)
    if set(seconds) != {"read", "write"}:
        raise RuntimeError(f"guest job ({proto}) gave no timings:\n{result.output}")
    return seconds | job


async def run_all(
    guest: siwvm.Guest, server: subprocess.Popen[bytes], export: Path, mib: int, repeat: int,
    profiled: bool = False,
) -> dict[str, dict[str, list[float]]]:  # fmt: skip
    status = Status()
    seconds: dict[str, dict[str, list[float]]] = {
        key: {p: [] for p in PROTOS} for key in ("write", "read", "job", "server_cpu")
    }
    for i in range(repeat):
        for proto in PROTOS:
            status.show(f"guest dd: sample {i + 1}/{repeat} ({proto})")
            last = profiled and i == repeat - 1  # (the last sample: the others unprofiled)
            for key, s in (await one_run(guest, server, export, proto, mib, last)).items():
                seconds[key][proto].append(s)
    status.clear()
    return seconds


def print_table(mib: int, results: list[dict[str, Any]]) -> None:
    print(RESULT_LINE)
    print(f" {'guest kernel dd':<18}{'size':>9}{'RDMA':>11}{'TCP':>11}{'RDMA/TCP':>11}  unit")
    for r in results:
        print(
            f" {r['name']:<18}{f'{mib} MiB':>9}{r['rdma_median']:>11.2f}"
            f"{r['tcp_median']:>11.2f}{r['ratio']:>11.3f}  MiB/s"
        )
    print(RESULT_LINE)
    print(" guest under QEMU TCG emulation: these figures measure the emulation, not the protocol")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="The guest kernel's NFS client (QEMU TCG) against our server, RDMA and TCP."
    )
    p.add_argument("--size", type=int, default=64, metavar="MIB", help="MiB per dd (default 64)")
    p.add_argument("--repeat", type=int, default=3, help="samples per transport (default 3)")
    p.add_argument("--json", metavar="FILE", help="write every sample to FILE")
    p.add_argument(
        "--profile", metavar="DIR",
        help="cProfile our server in the last sample of each transport; print its top functions",
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.size < 1 or args.repeat < 1:
        p.error("--size and --repeat must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    why = siwvm.missing_requirements()
    if why:
        print(f"nfs_kernel.py: cannot boot the guest: {why}", file=sys.stderr)
        return 2
    meta = {
        **run_meta(SERVER_BACKEND),
        "guest": "QEMU TCG",
        "file_size": args.size * MiB,
        "repeat": args.repeat,
    }
    with tempfile.TemporaryDirectory(prefix="rdmashim-nfs-kernel-") as tmp, guest_lock():
        export, state = Path(tmp) / "export", Path(tmp) / "state"
        export.mkdir()
        (export / READ_FILE).write_bytes(os.urandom(args.size * MiB))
        siwvm.netns_up(taps=TAP + 1)
        profile = Path(args.profile).resolve() if args.profile else None
        if profile:
            profile.mkdir(parents=True, exist_ok=True)
        server = start_server(export, state, profile)
        guest = siwvm.Guest(GUEST_NAME, ip=GUEST_IP, tap=siwvm.tap(TAP))
        try:
            guest.start()
            meta["boot_seconds"] = guest.boot_seconds
            seconds = trio.run(
                run_all, guest, server, export, args.size, args.repeat, profile is not None
            )
        finally:
            guest.stop()
            stop_process(server)
    meta["loadavg_end"] = os.getloadavg()
    results = []
    for op in ("write", "read"):
        mibs = {p: [args.size / s for s in seconds[op][p]] for p in PROTOS}
        rdma, tcp = statistics.median(mibs["rdma"]), statistics.median(mibs["tcp"])
        name = "write (fsync)" if op == "write" else "read (cold)"
        results.append(
            {"name": name, "rdma_median": rdma, "tcp_median": tcp, "ratio": rdma / tcp, **mibs}
        )
    print(engine_line(SERVER_BACKEND, width=0) + " (our server's)")
    print(cpu_line(width=0))
    print(f" guest booted in {meta['boot_seconds']:.1f} s; {args.repeat} samples per transport")
    for proto, line in MOUNTS.items():
        print(f" {proto} mount: {line}")
    meta["mounts"] = MOUNTS
    print_table(args.size, results)
    for proto in PROTOS:
        job, cpu = (statistics.median(seconds[k][proto]) for k in ("job", "server_cpu"))
        print(f" {proto} job (mount, write, read, umount): {job:.1f} s, server CPU {cpu:.2f} s")
    if profile:
        for proto in PROTOS:
            unseen = ", not its connection's thread" if proto == "tcp" else ""
            print(f"-- our server, {proto} job (last sample, profiled{unseen}), top 20 by tottime")
            print(top_functions(profile / f"server-kernel-{proto}.pstats", 20))
    if args.json:
        doc = {"meta": meta, "seconds": seconds, "results": results}
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
