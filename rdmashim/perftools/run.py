"""One run of a tool, end to end: connections, perftest's exchange, measurement, report.

The order of the exchange is perftest's, tool by tool (the peer may be the
real ``ib_*_bw -R`` / ``ib_*_lat -R``): the preamble of
:func:`~rdmashim.perftools.session.preamble`, a handshake, the test
connections, a handshake; then the QP data (:class:`~rdmashim.perftools.wire.Dest`)
traded as many times as perftest's tool does (per QP or once, see
:data:`DEST_ROUNDS`); then the measurement with the tool's own
synchronisation, and the closing handshake. After ``write_bw`` and
``read_bw`` the client sends its results to the server, which prints them;
the other tools print each side's own figures.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import psutil
import trio

from rdmashim.cm import EventChannel
from rdmashim.perftools import measure, rawtcp, report, wire
from rdmashim.perftools.options import PerfConfig
from rdmashim.perftools.session import (
    Comm,
    PerfError,
    Resources,
    accept_comm,
    accept_tests,
    connect_comm,
    connect_tests,
    preamble,
)

log = logging.getLogger(__name__)

Emit = Callable[[str], None]
"""Where the report's lines go (the CLI prints them)."""


class Bar(Protocol):
    """A progress bar for one size (tqdm's ``update`` and ``close``)."""

    def update(self, n: int = 1) -> object: ...

    def close(self) -> None: ...


ProgressFactory = Callable[[str, int | None], Bar | None]
"""``(label, total messages or None when -D runs by time)`` -> a bar for one size, or None."""

DEST_ROUNDS = {
    "write_bw": ("each", "each", "one"),
    "read_bw": ("each", "each", "one"),
    "send_bw": ("each", "one", "each"),
    "write_lat": ("one", "each", "each", "one"),
    "read_lat": ("one", "each", "each", "one"),
    "send_lat": ("each", "one", "each"),
}
"""How often each perftest tool trades the QP data before it measures:
per QP ("each") or for the first QP only ("one")."""


@dataclass
class RunResult:
    """What a run measured (the lines printed), for callers and the plot."""

    bw: list[report.BwResult] = field(default_factory=list)
    lat: list[report.LatResult | report.LatDurationResult] = field(default_factory=list)
    peer_version: str = ""
    remote: report.BwResult | None = None
    """A write_bw/read_bw server: the client's results."""
    tcp: list[report.BwResult] = field(default_factory=list)
    """``--vs-tcp`` (client): the same sizes over plain TCP."""


class _CPU:
    """This host's CPU use over an interval, as ``--cpu_util`` shows it."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.start = psutil.cpu_times() if enabled else None

    def percent(self) -> float | None:
        if self.start is None:
            return None
        end = psutil.cpu_times()
        busy = sum(end) - end.idle - (sum(self.start) - self.start.idle)
        total = sum(end) - sum(self.start)
        return 100.0 * busy / total if total > 0 else 0.0


async def run(
    config: PerfConfig,
    emit: Emit,
    progress: ProgressFactory | None = None,
    *,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> RunResult:
    """Run ``config``; a server reports its port through ``task_status`` once listening."""
    async with EventChannel(backend=config.backend) as channel, _tcp_listener(config) as tcp:
        listener = None
        if config.server:
            listener = channel.create_id()
            address = config.bind or "0.0.0.0"
            try:
                listener.bind_addr((address, config.port))
                listener.listen()
            except OSError as exc:
                raise PerfError(f"cannot listen on {address}:{config.port}: {exc}") from exc
            assert listener.local_addr is not None
            task_status.started(listener.local_addr[1])
            emit("")
            emit("************************************")
            emit("* Waiting for client to connect... *")
            emit("************************************")
            comm = await accept_comm(channel, listener)
        else:
            comm = await connect_comm(channel, config)
        res: Resources | None = None
        try:
            mtu = int(comm.context.query_port(1).active_mtu)
            tcp_port = tcp.socket.getsockname()[1] if tcp else 0
            settled = await preamble(comm, mtu, tcp_port, config.vs_tcp and not config.server)
            if config.vs_tcp and not config.server and settled.peer.tcp_port is None:
                raise PerfError(
                    f"--vs-tcp: the server (perftest {settled.peer_version}) serves no raw TCP; "
                    "run it as rdmashim perf with --vs-tcp too"
                )
            res = Resources(config, max(config.buffer_size, settled.cycle_buffer))
            await comm.handshake(wire.Dest())
            if listener is not None:
                await accept_tests(channel, listener, config, res)
            else:
                await connect_tests(channel, config, res)
            await comm.handshake(wire.Dest())
            result = RunResult(peer_version=settled.peer_version)
            for line in report.banner(_banner(config, res, settled.mtu)):
                emit(line)
            await _trade_dests(comm, res, emit)
            await FLOWS[config.tool](comm, res, emit, progress, result)
            if tcp is not None and settled.peer.wants_tcp:
                await rawtcp.serve(tcp, len(config.sizes()))
            elif config.vs_tcp and settled.peer.tcp_port is not None:
                await _vs_tcp(config, settled.peer.tcp_port, emit, progress, result)
            return result
        finally:
            with trio.CancelScope(shield=True):
                await _close(comm, res)


def _banner(config: PerfConfig, res: Resources, mtu: int) -> report.Banner:
    sender = not config.server or config.tool in ("write_lat", "send_lat")
    send = config.verb == "send"
    return report.Banner(
        test=config.tool,
        device=res.links[0].cm_id.context.device.name if res.links[0].cm_id.context else "?",
        num_qps=config.num_qps,
        tx_depth=config.tx_depth if sender else None,
        rx_depth=config.rx_depth if send and (config.server or config.latency) else None,
        cq_mod=None if config.latency else config.cq_mod,
        mtu=mtu,
        out_reads=res.out_reads if config.verb == "read" else None,
        server=config.server,
    )


async def _trade_dests(comm: Comm, res: Resources, emit: Emit) -> None:
    rounds = DEST_ROUNDS[res.config.tool]
    for scope in rounds:
        links = res.links if scope == "each" else res.links[:1]
        for link in links:
            link.theirs = await comm.handshake(link.mine)
    read = res.config.verb == "read"
    rdma = res.config.verb != "send" or res.config.tool == "send_bw"
    for side, pick in (("local", "mine"), ("remote", "theirs")):
        for link in res.links:
            d = getattr(link, pick)
            emit(report.address_line(
                side, d.lid, d.qpn, d.psn, out_reads=d.out_reads if read else None,
                rkey=d.rkey if rdma else None, vaddr=d.vaddr if rdma else None,
            ))  # fmt: skip
            emit(report.gid_line(d.gid))


@contextlib.asynccontextmanager
async def _tcp_listener(config: PerfConfig) -> AsyncIterator[trio.SocketListener | None]:
    """``--vs-tcp`` server: a TCP listener on a free port of the address we serve on
    (None for a client or without ``--vs-tcp``)."""
    if not (config.server and config.vs_tcp):
        yield None
        return
    try:
        listener = (await trio.open_tcp_listeners(0, host=config.bind or "0.0.0.0"))[0]
    except OSError as exc:
        raise PerfError(f"--vs-tcp: cannot listen for raw TCP: {exc}") from exc
    async with listener:
        yield listener


async def _vs_tcp(config: PerfConfig, port: int, emit: Emit, progress: ProgressFactory | None,
                  result: RunResult) -> None:  # fmt: skip
    """``--vs-tcp`` client: every size again over plain TCP, and the table beside ours."""
    assert config.server_addr is not None
    for row in result.bw:
        with _bar(progress, config, row.size, " tcp") as bar:
            try:
                result.tcp.append(await rawtcp.measure(
                    config.server_addr, port, config, row.size, bar
                ))  # fmt: skip
            except (OSError, EOFError, rawtcp.RawTcpError) as exc:
                raise PerfError(f"--vs-tcp, {row.size} B: {exc}") from exc
    for line in report.vs_tcp_header(gbits=config.gbits):
        emit(line)
    for ours, tcp in zip(result.bw, result.tcp, strict=True):
        emit(report.vs_tcp_line(ours, tcp, gbits=config.gbits))
    emit(report.RULE)


@contextlib.contextmanager
def _bar(
    progress: ProgressFactory | None, config: PerfConfig, size: int, what: str = ""
) -> Iterator[measure.Progress | None]:
    """A progress callback for one size (None without a factory), its bar closed after;
    the bar's label names the size, and in an ``-a`` sweep which of how many it is."""
    total = None if config.duration is not None else config.iters * config.num_qps
    sizes = config.sizes()
    label = f"{size} B{what}"
    if len(sizes) > 1:
        label += f" ({sizes.index(size) + 1}/{len(sizes)})"
    bar = progress(label, total) if progress is not None else None
    try:
        yield bar.update if bar is not None else None
    finally:
        if bar is not None:
            bar.close()


async def _client_bw(
    res: Resources, size: int, progress: ProgressFactory | None
) -> report.BwResult:
    """The client's measurement of one size and its result row."""
    config = res.config
    cpu = _CPU(config.cpu_util)
    with _bar(progress, config, size) as bar:
        stamps = await measure.bw_client(res, size, bar)
    return report.bw_result(
        size, stamps.posted, stamps.completed, gbits=config.gbits,
        peak=config.duration is None, cpu_util=cpu.percent(),
    )  # fmt: skip


async def _exchange_report(comm: Comm, mine: report.BwResult) -> report.BwResult:
    messages = wire.BwReport(mine.size, mine.iters, mine.bw_peak, mine.bw_avg, mine.msg_rate)
    theirs = [await comm.xchg(m, "bandwidth report") for m in messages.encode()]
    got = wire.BwReport.decode(theirs)
    return report.BwResult(got.size, got.iters, got.bw_peak, got.bw_avg, got.msg_rate)


async def _rdma_bw(comm: Comm, res: Resources, emit: Emit, progress: ProgressFactory | None,
                   result: RunResult) -> None:  # fmt: skip
    """write_bw / read_bw: the client measures; the server waits, then prints the client's."""
    config = res.config
    for line in report.bw_header(gbits=config.gbits, cpu_util=config.cpu_util):
        emit(line)
    if config.server:
        await comm.handshake(res.links[0].mine)
        result.remote = await _exchange_report(comm, report.BwResult(0, 0, 0.0, 0.0, 0.0))
        emit(report.bw_line(result.remote, gbits=config.gbits))
    else:
        for size in config.sizes():
            row = await _client_bw(res, size, progress)
            result.bw.append(row)
            emit(report.bw_line(row, gbits=config.gbits))
        await comm.handshake(res.links[0].mine)
        await _exchange_report(comm, result.bw[-1])
    emit(report.RULE)
    await comm.handshake(res.links[0].mine)  # closing


async def _send_bw(comm: Comm, res: Resources, emit: Emit, progress: ProgressFactory | None,
                   result: RunResult) -> None:  # fmt: skip
    """send_bw: per size, the server posts its receives, a handshake, then both measure."""
    config = res.config
    for line in report.bw_header(gbits=config.gbits, cpu_util=config.cpu_util):
        emit(line)
    for size in config.sizes():
        if config.server:
            measure.post_receives(res, size, config.rx_depth)
        else:
            for link in res.links:
                assert link.credit_mr is not None
                link.credit_mr.buf[:] = bytes(len(link.credit_mr.buf))
        await comm.handshake(res.links[0].mine)
        if config.server:
            cpu = _CPU(config.cpu_util)
            with _bar(progress, config, size) as bar:
                stamps = await measure.send_bw_server(res, size, bar)
            row = report.bw_span_result(
                size, stamps.count, stamps.start, stamps.end, gbits=config.gbits,
                cpu_util=cpu.percent(),
            )  # fmt: skip
        else:
            row = await _client_bw(res, size, progress)
        result.bw.append(row)
        emit(report.bw_line(row, gbits=config.gbits))
        if config.all_sizes:
            await comm.handshake(res.links[0].mine)
    emit(report.RULE)
    await comm.handshake(res.links[0].mine)  # closing


def _lat_line(config: PerfConfig, size: int, stamps: measure.Stamps, cpu: _CPU,
              round_trip: bool) -> report.LatResult | report.LatDurationResult:  # fmt: skip
    if config.duration is not None:
        seconds = (stamps.posted[-1] - stamps.posted[0]) / 1e9 if len(stamps.posted) > 1 else 0.0
        return report.lat_duration_result(
            size, stamps.count, seconds, round_trip=round_trip, cpu_util=cpu.percent()
        )
    return report.lat_result(
        size, stamps.posted, round_trip=round_trip, iters=stamps.count, cpu_util=cpu.percent()
    )


async def _lat(comm: Comm, res: Resources, emit: Emit, progress: ProgressFactory | None,
               result: RunResult) -> None:  # fmt: skip
    """The latency tests: write_lat (no closing handshake), read_lat, send_lat."""
    config = res.config
    tool = config.tool
    if tool == "read_lat" and config.server:  # only the client reads
        await comm.handshake(res.links[0].mine)
        emit(report.RULE)
        return
    for line in report.lat_header(duration=config.duration is not None, cpu_util=config.cpu_util):
        emit(line)
    for size in config.sizes():
        if tool == "send_lat":
            measure.post_receives(res, size, config.rx_depth)
            await comm.handshake(res.links[0].mine)
        cpu = _CPU(config.cpu_util)
        loop = {"write_lat": measure.write_lat, "read_lat": measure.read_lat,
                "send_lat": measure.send_lat}[tool]  # fmt: skip
        with _bar(progress, config, size) as bar:
            stamps = await loop(res, size, bar)
        row = _lat_line(config, size, stamps, cpu, round_trip=tool != "read_lat")
        result.lat.append(row)
        emit(report.lat_line(row))
    emit(report.RULE)
    if tool != "write_lat":
        await comm.handshake(res.links[0].mine)  # closing


FLOWS = {
    "write_bw": _rdma_bw,
    "read_bw": _rdma_bw,
    "send_bw": _send_bw,
    "write_lat": _lat,
    "read_lat": _lat,
    "send_lat": _lat,
}


async def _close(comm: Comm, res: Resources | None) -> None:
    """Disconnect the test connections, then the comm connection."""
    for link in res.links if res is not None else []:
        try:
            link.cm_id.disconnect()
        except OSError as exc:  # already down
            log.debug("disconnect: %s", exc)
    for link in res.links if res is not None else []:
        qp = link.cm_id.qp
        if qp is not None:
            with trio.move_on_after(2):
                await qp.wait_closed()
        link.cm_id.destroy()
    try:
        await comm.aclose()
    except OSError as exc:
        log.debug("comm close: %s", exc)


__all__ = ["DEST_ROUNDS", "RunResult", "run"]
