"""``rdmashim perf TOOL``: perftest's six tools as subcommands.

``rdmashim perf write_bw -R`` (server) and ``rdmashim perf write_bw -R HOST``
(client), likewise ``read_bw``, ``send_bw``, ``write_lat``, ``read_lat`` and
``send_lat``; either side may be perftest's own ``ib_write_bw -R`` etc.
Progress goes to stderr only when it is a terminal.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Any

from rdmashim.perftools.options import TOOLS, add_arguments, config_from_args

if TYPE_CHECKING:
    from rdmashim.perftools.run import ProgressFactory

_HELP = {
    "write_bw": "RDMA Write bandwidth (perftest's ib_write_bw)",
    "read_bw": "RDMA Read bandwidth (ib_read_bw)",
    "send_bw": "Send bandwidth (ib_send_bw)",
    "write_lat": "RDMA Write latency (ib_write_lat)",
    "read_lat": "RDMA Read latency (ib_read_lat)",
    "send_lat": "Send latency (ib_send_lat)",
}


def _cmd(args: argparse.Namespace) -> int:
    import trio

    from rdmashim.perftools.plot import plot_sweep, require_matplotlib
    from rdmashim.perftools.run import run

    config = config_from_args(args.tool, args)
    if config.plot is not None:
        require_matplotlib()

    def emit(line: str) -> None:
        print(line, flush=True)

    result = trio.run(run, config, emit, terminal_progress())
    if config.plot is not None:
        plot_sweep(config.plot, config.tool, result.bw, gbits=config.gbits, tcp=result.tcp)
        print(f"plot: {config.plot}", file=sys.stderr)
    return 0


def terminal_progress() -> ProgressFactory | None:
    """Progress bars on stderr when it is a terminal, else none."""
    return _bars if sys.stderr.isatty() else None


def _bars(label: str, total: int | None) -> Any:
    """A tqdm bar on stderr for one size (only made when stderr is a terminal): messages
    done of ``total``, or for a ``-D`` run (no total) the count and the rate. A terminal
    that reports no size (a bare pty) gets an 80-column bar, not tqdm's empty one."""
    from tqdm import tqdm  # type: ignore[import-untyped]

    size = os.get_terminal_size(sys.stderr.fileno())
    shape = {} if size.columns and size.lines else {"ncols": 80, "nrows": 24}
    return tqdm(total=total, desc=label, unit="msg", leave=False, file=sys.stderr, **shape)


def add_perf(sub: Any) -> None:
    """Register ``perf`` and its six tools on the ``rdmashim`` command's subparsers."""
    perf = sub.add_parser(
        "perf",
        help="perftest's bandwidth and latency tools; talks to ib_*_bw -R / ib_*_lat -R",
        description="perftest's tools on the portable API: run one side here and the other "
        "here or with perftest (both sides need the same flags; -R is implied).",
    )
    tools = perf.add_subparsers(dest="tool", required=True, parser_class=type(perf))
    for tool in TOOLS:
        p = tools.add_parser(tool, help=_HELP[tool], description=_HELP[tool])
        add_arguments(p, tool)
        p.set_defaults(func=_cmd, tool=tool, prog=f"rdmashim perf {tool}")


__all__ = ["add_perf", "terminal_progress"]
