#!/usr/bin/env python3
"""The ``rdmashim perf -a --vs-tcp`` sweep, drawn: the plot committed as
``docs/img/perf_write_bw_sweep.png``.

Two processes on loopback, like ``bench.py``: this script is the client and
starts ``rdmashim perf TOOL -a --vs-tcp`` as the server in a subprocess. For
each size of the sweep (2 B .. ``--max-size``, powers of two) the client runs
``-n`` messages of ours (perftest's loop), then, after the whole sweep, the
same messages over plain TCP between the same two processes (``--vs-tcp``:
one ``send`` per message). It prints perftest's table and ours beside TCP,
and draws both, bandwidth and message rate against size, titled with the
date, the commit and the engine path.

Usage::

    python benchmarks/sweep.py                  # write_bw, 2 B .. 8 MiB, 5000 messages each
    python benchmarks/sweep.py --tool read_bw --iters 500 --out /tmp/read.svg
    RDMASHIM_NO_EXTENSIONS=1 python benchmarks/sweep.py --out /tmp/pure.png
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import trio

from rdmashim.cliargs import size
from rdmashim.perftools.cli import terminal_progress
from rdmashim.perftools.options import MAX_SIZE, add_arguments, config_from_args
from rdmashim.perftools.plot import plot_sweep
from rdmashim.perftools.run import run

from report import engine_line, run_meta

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "docs" / "img" / "perf_write_bw_sweep.png"
HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="rdmashim perf -a --vs-tcp, drawn (loopback).")
    p.add_argument("--tool", choices=["write_bw", "read_bw", "send_bw"], default="write_bw")
    p.add_argument(
        "--iters", type=int, default=5000, help="messages per size (default 5000, perftest's)"
    )
    p.add_argument(
        "--max-size", type=size(2, MAX_SIZE), default=MAX_SIZE, help="largest size (default 8M)"
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the plot, .png or .svg")
    p.add_argument("--json", metavar="FILE", help="also write every row to FILE")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    meta = run_meta()
    print(engine_line(width=0), flush=True)
    port = free_port()
    flags = ["-a", "--max-size", str(args.max_size), "-n", str(args.iters), "--vs-tcp"]
    server = subprocess.Popen(
        [sys.executable, "-m", "rdmashim", "perf", args.tool, *flags, "-p", str(port),
         "--bind", HOST],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    parser = argparse.ArgumentParser()
    add_arguments(parser, args.tool)
    config = config_from_args(args.tool, parser.parse_args([*flags, "-p", str(port), HOST]))
    try:
        result = trio.run(run, config, print, terminal_progress())
        if server.wait(60):
            raise SystemExit(f"sweep.py: the perf server failed ({server.returncode})")
    finally:
        server.kill()
    commit = meta["commit"][:7] or "?"
    title = (
        f"rdmashim perf {args.tool} -a -n {args.iters} --vs-tcp, loopback\n"
        f"{meta['date'][:16].replace('T', ' ')} UTC, commit {commit}\nengine: {meta['engine']}"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    plot_sweep(str(args.out), args.tool, result.bw, tcp=result.tcp, title=title)
    print(f"plot: {args.out}")
    if args.json:
        rows: list[dict[str, Any]] = [
            {"size": o.size, "iters": o.iters, "bw_avg": o.bw_avg, "msg_rate": o.msg_rate,
             "tcp_bw_avg": t.bw_avg, "tcp_msg_rate": t.msg_rate}
            for o, t in zip(result.bw, result.tcp, strict=True)
        ]  # fmt: skip
        doc = {"meta": {**meta, "tool": args.tool, "iters": args.iters}, "rows": rows}
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
