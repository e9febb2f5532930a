"""``--plot``: an ``-a`` sweep drawn as bandwidth and message rate against size.

matplotlib is an optional extra (``pip install 'rdmashim[plot]'``); without it
``--plot`` fails with one line saying so, before anything connects.
"""

from __future__ import annotations

from collections.abc import Sequence

from rdmashim.perftools.report import BwResult


class PlotUnavailable(Exception):
    """matplotlib is not installed."""


def require_matplotlib() -> None:
    """Fail early (one line) when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotUnavailable("--plot needs matplotlib: pip install 'rdmashim[plot]'") from None


def plot_sweep(path: str, tool: str, rows: Sequence[BwResult], *, gbits: bool = False) -> None:
    """Draw ``rows`` (one per size) into ``path`` (.png or .svg): bandwidth on the left axis,
    message rate on the right, sizes on a log2 axis."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r.size for r in rows]
    fig, left = plt.subplots(figsize=(8, 4.5))
    unit = "Gb/s" if gbits else "MB/s"
    left.plot(sizes, [r.bw_avg for r in rows], "o-", color="tab:blue", label=f"BW average [{unit}]")
    left.set_xscale("log", base=2)
    left.set_xlabel("message size [bytes]")
    left.set_ylabel(f"bandwidth [{unit}]", color="tab:blue")
    right = left.twinx()
    right.plot(sizes, [r.msg_rate for r in rows], "s--", color="tab:red", label="MsgRate [Mpps]")
    right.set_ylabel("message rate [Mpps]", color="tab:red")
    left.set_title(f"rdmashim perf {tool}")
    left.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


__all__ = ["PlotUnavailable", "plot_sweep", "require_matplotlib"]
