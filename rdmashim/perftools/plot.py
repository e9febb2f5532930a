"""``--plot``: an ``-a`` sweep drawn as bandwidth and message rate against size
(with ``--vs-tcp``, plain TCP's beside ours).

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


def plot_sweep(
    path: str,
    tool: str,
    rows: Sequence[BwResult],
    *,
    gbits: bool = False,
    tcp: Sequence[BwResult] = (),
    title: str | None = None,
) -> None:
    """Draw ``rows`` (one per size) into ``path`` (.png or .svg): average bandwidth above,
    message rate below, against size on a log2 axis, both on log axes; with ``tcp``
    (``--vs-tcp``), plain TCP's figures for the same sizes beside ours."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    unit = "Gb/s" if gbits else "MB/s"
    fig, (bw, rate) = plt.subplots(2, 1, sharex=True, figsize=(8, 6.5))
    series = [("rdmashim", rows, "o-", "tab:blue")]
    if tcp:
        series.append(("raw TCP", tcp, "s--", "tab:orange"))
    for label, data, style, color in series:
        sizes = [r.size for r in data]
        bw.plot(sizes, [r.bw_avg for r in data], style, color=color, label=label, markersize=4)
        rate.plot(sizes, [r.msg_rate for r in data], style, color=color, label=label,
                  markersize=4)  # fmt: skip
    bw.set_ylabel(f"BW average [{unit}]")
    rate.set_ylabel("message rate [Mpps]")
    rate.set_xlabel("message size [bytes]")
    rate.set_xscale("log", base=2)
    for ax in (bw, rate):
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="best")
    bw.set_title(title or f"rdmashim perf {tool}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


__all__ = ["PlotUnavailable", "plot_sweep", "require_matplotlib"]
