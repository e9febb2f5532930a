"""perftest's printed output: the test banner, the address lines and the result table.

Pure functions from numbers to text, so every line is tested as text. The
columns are perftest's (an RDMA engineer reads them at a glance, and scripts
that split perftest's lines on white space read ours):

bandwidth: ``#bytes #iterations BW peak[MB/sec] BW average[MB/sec] MsgRate[Mpps]``
(``Gb/sec`` with ``--report_gbits``), MB being 2**20 bytes and Gb 10**9 bits;

latency: ``#bytes #iterations t_min t_max t_typical t_avg t_stdev 99% 99.9%``
in microseconds, ``t_typical`` being the median; with ``-D`` only
``#bytes #iterations t_avg tps``.

The statistics are computed here from timestamps (nanoseconds): the peak
bandwidth as perftest finds it (the best rate over any run of messages that
ends at a signalled completion), the latency from the gaps between
successive posts (halved for the ping-pong tests, whose gap is a round trip).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

RULE = "-" * 87
"""The line perftest draws between sections."""
MB = 1 << 20
PEAK_SAMPLES = 256
"""Start and end points the peak search tries at most (perftest tries them all)."""
GBIT_BYTES = 125_000_000
"""Bytes per second in one Gb/s (perftest's ``--report_gbits`` factor)."""

TITLES = {
    "write_bw": "RDMA_Write BW Test",
    "read_bw": "RDMA_Read BW Test",
    "send_bw": "Send BW Test",
    "write_lat": "RDMA_Write Latency Test",
    "read_lat": "RDMA_Read Latency Test",
    "send_lat": "Send Latency Test",
}


@dataclass(frozen=True)
class BwResult:
    """One line of a bandwidth table (also what the client reports to the server)."""

    size: int
    iters: int
    bw_peak: float
    bw_avg: float
    msg_rate: float
    """Millions of messages per second."""
    cpu_util: float | None = None


@dataclass(frozen=True)
class LatResult:
    """One line of a latency table (microseconds)."""

    size: int
    iters: int
    t_min: float
    t_max: float
    t_typical: float
    t_avg: float
    t_stdev: float
    p99: float
    p999: float
    cpu_util: float | None = None


@dataclass(frozen=True)
class LatDurationResult:
    """One line of a latency table of a ``-D`` run."""

    size: int
    iters: int
    t_avg: float
    tps: float
    cpu_util: float | None = None


# ------------------------------------------------------------------ statistics
def bw_result(
    size: int,
    posted: Sequence[int],
    completed: Sequence[tuple[int, int]],
    *,
    gbits: bool = False,
    peak: bool = True,
    cpu_util: float | None = None,
) -> BwResult:
    """A bandwidth line from the post time of every message (ns) and the
    ``(index, time)`` of each signalled completion, in order.

    Average: all messages over first post to last completion. Peak (unless
    ``peak`` is off, as perftest has it for ``-D`` and for a ``send_bw`` server):
    the smallest time per message over any messages ``i..j`` with ``j`` signalled,
    ``i`` and ``j`` sampled (:data:`PEAK_SAMPLES` of each) to bound the work.
    """
    iters = len(posted)
    unit = GBIT_BYTES if gbits else MB
    if not iters or not completed:
        return BwResult(size, iters, 0.0, 0.0, 0.0, cpu_util)
    span = bw_span_result(size, iters, posted[0], completed[-1][1], gbits=gbits)
    best = 0.0
    if peak:
        best_per_msg = math.inf
        starts = range(0, iters, max(1, iters // PEAK_SAMPLES))
        ends = [*completed[:: max(1, len(completed) // PEAK_SAMPLES)], completed[-1]]
        for i in starts:
            start = posted[i]
            for j, done in ends:
                if j >= i:
                    best_per_msg = min(best_per_msg, (done - start) / (j - i + 1))
        if best_per_msg < math.inf:
            best = size / (max(best_per_msg, 1) / 1e9) / unit
    return BwResult(size, iters, best, span.bw_avg, span.msg_rate, cpu_util)


def bw_span_result(
    size: int, iters: int, start_ns: int, end_ns: int, *, gbits: bool = False,
    cpu_util: float | None = None,
) -> BwResult:  # fmt: skip
    """A bandwidth line with no peak: ``iters`` messages of ``size`` bytes in the span."""
    seconds = max(end_ns - start_ns, 1) / 1e9
    unit = GBIT_BYTES if gbits else MB
    return BwResult(
        size, iters, 0.0, size * iters / seconds / unit, iters / seconds / 1e6, cpu_util
    )


def lat_result(
    size: int, posted: Sequence[int], *, round_trip: bool, iters: int | None = None,
    cpu_util: float | None = None,
) -> LatResult:  # fmt: skip
    """A latency line from the post time (ns) of each iteration.

    Each sample is the gap between two successive posts, halved when the gap
    is a round trip (``write_lat``, ``send_lat``); percentiles are nearest-rank.
    ``iters`` (default: one per post) is the count shown.
    """
    shown = len(posted) if iters is None else iters
    factor = 2000.0 if round_trip else 1000.0  # ns -> us, and halve a round trip
    gaps = sorted((b - a) / factor for a, b in itertools.pairwise(posted))
    if not gaps:
        return LatResult(size, shown, 0, 0, 0, 0, 0, 0, 0, cpu_util)

    def rank(q: float) -> float:
        return gaps[min(len(gaps) - 1, max(0, math.ceil(q * len(gaps)) - 1))]

    return LatResult(
        size, shown, gaps[0], gaps[-1], statistics.median(gaps), statistics.fmean(gaps),
        statistics.pstdev(gaps), rank(0.99), rank(0.999), cpu_util,
    )  # fmt: skip


def lat_duration_result(
    size: int, iters: int, seconds: float, *, round_trip: bool, cpu_util: float | None = None
) -> LatDurationResult:
    """A ``-D`` latency line: the average per iteration and transactions per second."""
    if not iters or seconds <= 0:
        return LatDurationResult(size, iters, 0.0, 0.0, cpu_util)
    avg = seconds * 1e6 / iters / (2 if round_trip else 1)
    return LatDurationResult(size, iters, avg, iters / seconds, cpu_util)


# ------------------------------------------------------------------ text
@dataclass(frozen=True)
class Banner:
    """What the banner above the table shows."""

    test: str
    device: str
    transport: str = "IW"
    num_qps: int = 1
    tx_depth: int | None = None
    """Shown on the sending side only."""
    rx_depth: int | None = None
    """Shown on a Send receiver only."""
    cq_mod: int | None = None
    """Shown for bandwidth tests."""
    mtu: int = 1024
    link_layer: str = "Ethernet"
    out_reads: int | None = None
    """Shown for Read tests (instead of the inline size)."""
    inline: int = 0
    server: bool = False


def banner(b: Banner) -> list[str]:
    """The block perftest prints before connecting the test QPs."""
    lines = [RULE, f"{'':20}{TITLES[b.test]}"]
    lines.append(f" Dual-port       : OFF          Device         : {b.device}")
    lines.append(f" Number of qps   : {b.num_qps:<13d}Transport type : {b.transport}")
    lines.append(" Connection type : RC           Using SRQ      : OFF")
    if b.tx_depth is not None:
        lines.append(f" TX depth        : {b.tx_depth}")
    if b.rx_depth is not None:
        lines.append(f" RX depth        : {b.rx_depth}")
    if b.cq_mod is not None:
        lines.append(f" CQ Moderation   : {b.cq_mod}")
    lines.append(f" Mtu             : {b.mtu}[B]")
    lines.append(f" Link type       : {b.link_layer}")
    if b.out_reads is not None:
        lines.append(f" Outstand reads  : {b.out_reads}")
    else:
        lines.append(f" Max inline data : {b.inline}[B]")
    lines.append(" rdma_cm QPs     : ON")
    lines.append(" Data ex. method : rdma_cm")
    lines.append(RULE)
    return lines


def _hex(value: int, width: int) -> str:
    """C's ``%#0<width>x``: ``0x`` and zero padding, but a bare zero for 0."""
    return "0" * width if value == 0 else f"{value:#0{width}x}"


def address_line(side: str, lid: int, qpn: int, psn: int, *, out_reads: int | None = None,
                 rkey: int | None = None, vaddr: int | None = None) -> str:  # fmt: skip
    """`` local address: LID ... QPN ... PSN ...`` (and OUT, RKey, VAddr where they apply)."""
    line = f" {side} address: LID {_hex(lid, 4)} QPN {_hex(qpn, 6)} PSN {_hex(psn, 6)}"
    if out_reads is not None:
        line += f" OUT {_hex(out_reads, 4)}"
    if rkey is not None and vaddr is not None:
        line += f" RKey {_hex(rkey, 8)} VAddr {_hex(vaddr, 16)}"
    return line


def gid_line(gid: bytes) -> str:
    """`` GID: ...``: the 16 bytes in decimal, colon separated (perftest's own notation)."""
    return " GID: " + ":".join(f"{b:02d}" for b in gid)


def bw_header(*, gbits: bool = False, cpu_util: bool = False) -> list[str]:
    unit = "Gb/sec" if gbits else "MB/sec"
    head = f" #bytes     #iterations    BW peak[{unit}]    BW average[{unit}]   MsgRate[Mpps]"
    return [RULE, head + ("    CPU_Util[%]" if cpu_util else "")]


def bw_line(r: BwResult, *, gbits: bool = False) -> str:
    """One row; Gb/s figures under 0.1 get six decimals, as perftest gives them."""
    digits = 6 if gbits and r.bw_avg < 0.1 else 2
    row = (
        f" {r.size:<7d}    {r.iters:<10d}       {r.bw_peak:<7.{digits}f}"
        f"            {r.bw_avg:<7.{digits}f}            {r.msg_rate:<7.6f}"
    )
    return row + (f"      {r.cpu_util:<3.2f}" if r.cpu_util is not None else "")


def vs_tcp_header(*, gbits: bool = False) -> list[str]:
    """The ``--vs-tcp`` table (ours): each size's average beside plain TCP's."""
    unit = "Gb/sec" if gbits else "MB/sec"
    return [
        " The same transfers over plain TCP between the same hosts (--vs-tcp):",
        f" #bytes     BW average[{unit}]   TCP BW average[{unit}]   ours/TCP"
        "   MsgRate[Mpps]   TCP MsgRate[Mpps]",
    ]


def vs_tcp_line(ours: BwResult, tcp: BwResult, *, gbits: bool = False) -> str:
    """One row of the ``--vs-tcp`` table."""
    digits = 6 if gbits and min(ours.bw_avg, tcp.bw_avg) < 0.1 else 2
    ratio = ours.bw_avg / tcp.bw_avg if tcp.bw_avg else math.inf
    return (
        f" {ours.size:<7d}    {ours.bw_avg:<18.{digits}f}   {tcp.bw_avg:<22.{digits}f}"
        f"   {ratio:<8.3f}   {ours.msg_rate:<13.6f}   {tcp.msg_rate:.6f}"
    )


def lat_header(*, duration: bool = False, cpu_util: bool = False) -> list[str]:
    if duration:
        head = " #bytes        #iterations       t_avg[usec]    tps average"
    else:
        head = (
            " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]"
            "    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] "
        )
    return [RULE, head + ("    CPU_Util[%]" if cpu_util else "")]


def lat_line(r: LatResult | LatDurationResult) -> str:
    if isinstance(r, LatDurationResult):
        row = f" {r.size:<7d}       {r.iters:<10d}        {r.t_avg:<7.2f}        {r.tps:<7.2f}"
    else:
        row = (
            f" {r.size:<7d} {r.iters:<10d}  {r.t_min:<7.2f}        {r.t_max:<7.2f}      "
            f"{r.t_typical:<7.2f}          {r.t_avg:<7.2f}        {r.t_stdev:<7.2f}"
            f"          {r.p99:<7.2f}                {r.p999:<7.2f}"
        )
    return row + (f"      {r.cpu_util:<3.2f}" if r.cpu_util is not None else "")


__all__ = [
    "MB",
    "RULE",
    "TITLES",
    "Banner",
    "BwResult",
    "LatDurationResult",
    "LatResult",
    "address_line",
    "banner",
    "bw_header",
    "bw_line",
    "bw_result",
    "bw_span_result",
    "gid_line",
    "lat_duration_result",
    "lat_header",
    "lat_line",
    "lat_result",
    "vs_tcp_header",
    "vs_tcp_line",
]
