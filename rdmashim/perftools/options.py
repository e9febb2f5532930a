"""The six tools' options: perftest's flags where they apply, and the values they imply.

:func:`add_arguments` puts perftest's flags on a parser (both spellings of the
long ones where perftest has an underscore); :func:`config_from_args` turns
the parsed flags into a :class:`PerfConfig`, applying perftest's own rules for
the values a flag leaves open (iterations, queue depths, CQ moderation), so
that a peer running the real perftest with the same flags posts the same
number of receives and grants the same credits.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from rdmashim.cliargs import UsageError, backend, duration, host, integer, port, size

TOOLS = ("write_bw", "read_bw", "send_bw", "write_lat", "read_lat", "send_lat")
PORT = 18515
"""perftest's default port (``DEF_PORT``); the comm and the test connections both use it."""
MAX_SIZE = 1 << 23
"""The largest size ``-a`` runs (8 MiB, perftest's ``MAX_SIZE``)."""
MAX_MSG = 1 << 30
"""The largest ``-s`` we accept."""
MIN_ITERS = 5
CQ_MOD = 100
CQ_MOD_SIZE_LIMIT = 8192
"""Above this size (without ``-a``) every Write/Read/Send is signalled, as in perftest."""
CYCLE_BUFFER = 4096
"""Our page size: the unit in which perftest lays out and cycles its buffers."""
CACHE_LINE = 64


@dataclass(frozen=True)
class PerfConfig:
    """One run of one tool, with every value decided."""

    tool: str
    server_addr: str | None
    """The server to connect to; None: we are the server."""
    port: int = PORT
    device: str | None = None
    backend: str | None = None
    size: int = 65536
    iters: int = 1000
    duration: float | None = None
    all_sizes: bool = False
    max_size: int = MAX_SIZE
    tx_depth: int = 128
    rx_depth: int = 1
    cq_mod: int = CQ_MOD
    num_qps: int = 1
    out_reads: int | None = None
    gbits: bool = False
    cpu_util: bool = False
    plot: str | None = None
    vs_tcp: bool = False
    """Ours: also run each size over plain TCP between the same endpoints (both ends ours)."""
    bind: str | None = None
    """The address the server listens on (default all)."""
    events: bool = False
    """``-e``: the test's waits for completions sleep; by default they poll (CQ.busy_poll)."""

    @property
    def server(self) -> bool:
        return self.server_addr is None

    @property
    def verb(self) -> str:
        return self.tool.split("_")[0]

    @property
    def latency(self) -> bool:
        return self.tool.endswith("_lat")

    def sizes(self) -> list[int]:
        """The message sizes to run: 2 B .. ``max_size`` for ``-a``, else ``size``."""
        if not self.all_sizes:
            return [self.size]
        return [1 << i for i in range(1, 24) if 1 << i <= self.max_size]

    @property
    def buffer_size(self) -> int:
        """Bytes per half buffer (perftest's ``BUFF_SIZE``): the largest size, at least a page."""
        return max(max(self.sizes()), CYCLE_BUFFER)


def add_arguments(p: argparse.ArgumentParser, tool: str) -> None:
    """perftest's flags (the ones that apply here) for ``tool``."""
    lat = tool.endswith("_lat")
    p.add_argument(
        "server_addr",
        nargs="?",
        type=host,
        default=None,
        help="the server to connect to (none: be the server)",
    )
    p.add_argument("-d", "--ib-dev", dest="device", default=None, help="use device DEV")
    p.add_argument(
        "-p", "--port", type=port, default=PORT, help=f"port of the exchange (default {PORT})"
    )
    p.add_argument(
        "-s",
        "--size",
        type=size(1, MAX_MSG),
        default=None,
        help=f"message size (default {2 if lat else 65536})",
    )
    p.add_argument(
        "-n",
        "--iters",
        type=integer(MIN_ITERS, 1 << 31),
        default=None,
        help=f"iterations (at least {MIN_ITERS}; default {5000 if tool == 'write_bw' else 1000})",
    )
    p.add_argument(
        "-D",
        "--duration",
        type=duration(least=1.0),
        default=None,
        help="run for this many seconds instead of -n",
    )
    p.add_argument(
        "-a",
        "--all",
        dest="all_sizes",
        action="store_true",
        help="run sizes 2 B .. 8 MiB (powers of 2)",
    )
    p.add_argument(
        "--max-size",
        type=size(2, MAX_SIZE),
        default=MAX_SIZE,
        help="largest size -a runs (not in perftest; both sides must agree; default 8M)",
    )
    p.add_argument(
        "-t",
        "--tx-depth",
        type=integer(1, 1 << 15),
        default=None,
        help=f"send queue depth (default {1 if lat else 128})",
    )
    p.add_argument(
        "-r",
        "--rx-depth",
        type=integer(1, 1 << 15),
        default=None,
        help="receive queue depth (Send tests; default 512)",
    )
    p.add_argument(
        "-Q",
        "--cq-mod",
        type=integer(1, 1024),
        default=None,
        help=f"signal every N-th work request (default {CQ_MOD})",
    )
    p.add_argument(
        "-q",
        "--qp",
        dest="num_qps",
        type=integer(1, 64),
        default=1,
        help="number of QPs (bandwidth tests; each is an rdma_cm connection)",
    )
    p.add_argument(
        "-o",
        "--outs",
        dest="out_reads",
        type=integer(1, 1024),
        default=None,
        help="outstanding RDMA Reads (Read tests; default: the device's limit)",
    )
    p.add_argument(
        "-R",
        "--rdma_cm",
        "--rdma-cm",
        dest="rdma_cm",
        action="store_true",
        help="connect the QPs with the rdma_cm (always so here: iWARP has no other way)",
    )
    p.add_argument(
        "-F",
        "--CPU-freq",
        dest="cpu_freq",
        action="store_true",
        help="accepted for perftest's sake (we measure with a monotonic clock)",
    )
    p.add_argument("-c", "--connection", default="RC", help="connection type (only RC)")
    p.add_argument(
        "-e",
        "--events",
        action="store_true",
        help="sleep on CQ events (default: poll the CQs, as perftest, yielding the CPU to "
        "whatever else waits for it between polls)",
    )
    p.add_argument(
        "--report_gbits",
        "--report-gbits",
        dest="gbits",
        action="store_true",
        help="report bandwidth in Gb/s (10**9 bits) instead of MB/s",
    )
    p.add_argument(
        "--cpu_util",
        "--cpu-util",
        dest="cpu_util",
        action="store_true",
        help="show this host's CPU use during each measurement",
    )
    p.add_argument(
        "--plot",
        metavar="FILE",
        default=None,
        help="draw the -a sweep into FILE.png or FILE.svg (needs matplotlib)",
    )
    p.add_argument(
        "--vs-tcp",
        dest="vs_tcp",
        action="store_true",
        help="also run each size over plain TCP between the same two hosts and show it "
        "beside ours (not in perftest: both sides must be rdmashim perf with --vs-tcp)",
    )
    p.add_argument(
        "--bind", type=host, default=None, help="server: the address to listen on (default all)"
    )
    p.add_argument(
        "--backend",
        type=backend,
        default=None,
        help="backend (default: RDMASHIM_BACKEND, else softiwarp)",
    )


def config_from_args(tool: str, args: argparse.Namespace) -> PerfConfig:
    """The run the flags describe; a :class:`UsageError` for flags that do not fit."""
    lat = tool.endswith("_lat")
    send = tool.startswith("send")
    if args.connection.upper() != "RC":
        raise UsageError(f"connection type {args.connection} is not supported (only RC)")
    if lat and args.num_qps != 1:
        raise UsageError("latency tests run one QP (-q 1)")
    if args.duration is not None and args.all_sizes:
        raise UsageError("-D and -a do not go together (as in perftest)")
    if args.duration is not None and args.iters is not None:
        raise UsageError("-D and -n do not go together (as in perftest)")
    if args.plot is not None:
        if not args.plot.lower().endswith((".png", ".svg")):
            raise UsageError(f"--plot {args.plot}: the file must end in .png or .svg")
        if not args.all_sizes:
            raise UsageError("--plot draws an -a sweep: add -a")
        if lat:
            raise UsageError("--plot draws bandwidth tests only")
        if args.server_addr is None:
            raise UsageError("--plot is for the client (the side that measures)")
    if args.vs_tcp and lat:
        raise UsageError("--vs-tcp runs with the bandwidth tests only")
    if args.rx_depth is not None and not send:
        raise UsageError("-r applies to the Send tests only")
    if args.out_reads is not None and not tool.startswith("read"):
        raise UsageError("-o applies to the Read tests only")
    if args.all_sizes and args.size is not None:
        raise UsageError("-a runs every size: drop -s")
    size_ = args.size if args.size is not None else (2 if lat else 65536)
    iters = args.iters if args.iters is not None else (5000 if tool == "write_bw" else 1000)
    tx_depth = args.tx_depth if args.tx_depth is not None else (1 if lat else 128)
    rx_depth = args.rx_depth if args.rx_depth is not None else (512 if send else 1)
    if args.duration is None:  # perftest's force_dependencies, for the same numbers
        tx_depth = min(tx_depth, iters)
        if send:
            rx_depth = min(rx_depth, iters)
    cq_mod = args.cq_mod if args.cq_mod is not None else CQ_MOD
    if args.cq_mod is None and size_ > CQ_MOD_SIZE_LIMIT and not args.all_sizes:
        cq_mod = 1
    cq_mod = min(cq_mod, tx_depth)
    if send and rx_depth % 2 and not args.all_sizes:
        rx_depth += 1  # perftest rounds an odd Send rx depth up (without -a)
    return PerfConfig(
        tool=tool,
        server_addr=args.server_addr,
        port=args.port,
        device=args.device,
        backend=args.backend,
        size=size_,
        iters=iters,
        duration=args.duration,
        all_sizes=args.all_sizes,
        max_size=args.max_size,
        tx_depth=tx_depth,
        rx_depth=rx_depth,
        cq_mod=cq_mod,
        num_qps=args.num_qps,
        out_reads=args.out_reads,
        gbits=args.gbits,
        cpu_util=args.cpu_util,
        plot=args.plot,
        vs_tcp=args.vs_tcp,
        bind=args.bind,
        events=args.events,
    )


__all__ = [
    "MAX_SIZE",
    "PORT",
    "TOOLS",
    "PerfConfig",
    "add_arguments",
    "config_from_args",
]
