"""rds-stress over our RDS: :func:`stress_active` and :func:`stress_passive`, and its columns."""

from __future__ import annotations

import functools
import logging
import os
import struct
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import trio

from rdmashim.rdstools.common import RdsToolError, drain
from rdmashim.rdstools.defaults import MIN_STRESS_BYTES, STRESS_PORT
from rdmashim.ulps.rds.node import RdsError, RdsNode, RdsSocket
from rdmashim.ulps.rds.rdma import RdmaOp, RdmaStatus
from rdmashim.ulps.rds.wire import RDS_MAX_MSG_SIZE

log = logging.getLogger(__name__)

STRESS_HEADER = struct.Struct("!4sBBHII")
"""magic, op, flags, task, sequence number, bytes the ack must have."""
STRESS_RDMA = struct.Struct("!16sI")
"""After the header of a request with an RDMA flag: the cookie (16 bytes: wider than 64
bits where regions are addressed by virtual address) and the bytes to move."""
STRESS_MAGIC = b"rdst"
OP_REQ, OP_ACK, OP_DONE, OP_DONE_ACK = 1, 2, 3, 4
FLAG_RDMA_WRITE, FLAG_RDMA_READ = 1, 2
"""A request's flags: the ack is to write into (read from) the buffer of its cookie."""
ACK_TIMEOUT = 10.0
"""Seconds the active side waits for an answer before it gives up."""


@dataclass(frozen=True)
class StressConfig:
    """What the active side runs (rds-stress's ``-s -p -q -a -t -d -T``)."""

    dest: str
    port: int = STRESS_PORT
    req_bytes: int = 1024
    ack_bytes: int = MIN_STRESS_BYTES
    tasks: int = 1
    depth: int = 1
    seconds: float = 0.0
    """0: until the stop event is set."""
    rdma_bytes: int = 0
    """rds-stress's ``-D``: each ack comes with an RDMA operation of this many bytes."""
    rdma_read: bool = False
    """Whether that operation reads the request's buffer (else it writes into it)."""

    def __post_init__(self) -> None:
        least = {
            "req_bytes": MIN_STRESS_BYTES + (STRESS_RDMA.size if self.rdma_bytes else 0),
            "ack_bytes": MIN_STRESS_BYTES,
        }
        for name, low in least.items():
            size = getattr(self, name)
            if not low <= size <= RDS_MAX_MSG_SIZE:
                raise ValueError(f"{name} {size} outside {low}..{RDS_MAX_MSG_SIZE}")
        if not 0 <= self.rdma_bytes <= RDS_MAX_MSG_SIZE:
            raise ValueError(f"rdma_bytes {self.rdma_bytes} outside 0..{RDS_MAX_MSG_SIZE}")
        if self.tasks < 1 or self.depth < 1:
            raise ValueError("tasks and depth must be at least 1")
        if not 0 < self.port < 65535 - self.tasks:
            raise ValueError(f"port {self.port} leaves no room for {self.tasks} task ports")
        if self.seconds < 0:
            raise ValueError("seconds must not be negative")


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


@dataclass
class StressSample:
    """Counts over an interval; the properties are rds-stress's columns."""

    seconds: float = 0.0
    tasks: int = 0
    requests: int = 0
    tx_bytes: int = 0
    rx_bytes: int = 0
    send_calls: int = 0
    send_usecs: float = 0.0
    rtts: int = 0
    rtt_usecs: float = 0.0
    rdma_bytes: int = 0
    cpu_seconds: float = 0.0

    def minus(self, earlier: StressSample) -> StressSample:
        out = StressSample(tasks=self.tasks)
        for f in fields(self):
            if f.name != "tasks":
                setattr(out, f.name, getattr(self, f.name) - getattr(earlier, f.name))
        return out

    def copy(self) -> StressSample:
        return StressSample(**{f.name: getattr(self, f.name) for f in fields(self)})

    @property
    def tx_per_s(self) -> float:
        """Requests sent per second (``tx/s``)."""
        return self.requests / self.seconds if self.seconds else 0.0

    @property
    def kbytes_per_s(self) -> float:
        """Request and ack bytes, sent and received, in KiB per second (``tx+rx K/s``)."""
        return (self.tx_bytes + self.rx_bytes) / 1024 / self.seconds if self.seconds else 0.0

    @property
    def rdma_kbytes_per_s(self) -> float:
        """RDMA Write and Read bytes in KiB per second (``rw+rr K/s``)."""
        return self.rdma_bytes / 1024 / self.seconds if self.seconds else 0.0

    @property
    def tx_us_per_call(self) -> float:
        """Microseconds per ``sendto`` call (``tx us/c``)."""
        return self.send_usecs / self.send_calls if self.send_calls else 0.0

    @property
    def rtt_us(self) -> float:
        """Mean request-to-ack round trip (``rtt us``)."""
        return self.rtt_usecs / self.rtts if self.rtts else 0.0

    @property
    def cpu_percent(self) -> float:
        """This process's CPU time (user + system) per wall-clock time (``cpu %``)."""
        return 100 * self.cpu_seconds / self.seconds if self.seconds else 0.0


STRESS_COLUMNS = (
    f"{'tsks':>4} {'tx/s':>6} {'tx+rx K/s':>10} {'rw+rr K/s':>10} {'tx us/c':>7} "
    f"{'rtt us':>8} {'cpu %':>5}"
)
"""rds-stress's column heads (before its rx/s, mbi and mbo columns came)."""


def format_stress_row(sample: StressSample, average: bool = False) -> str:
    """One row of rds-stress's table; ``average`` adds its summary marker."""
    s = sample
    row = (
        f"{s.tasks:>4} {round(s.tx_per_s):>6} {s.kbytes_per_s:>10.2f} "
        f"{s.rdma_kbytes_per_s:>10.2f} {s.tx_us_per_call:>7.2f} {s.rtt_us:>8.2f} "
        f"{s.cpu_percent:>5.2f}"
    )
    return row + ("  (average)" if average else "")


@dataclass
class StressResult:
    """The whole run (from the start of the clock to the last ack) and each second of it."""

    total: StressSample
    per_second: list[StressSample]


class _Clock:
    """Running totals of the active side, all tasks together."""

    def __init__(self) -> None:
        self.now = StressSample()
        self.t0 = time.perf_counter()
        self.cpu0 = _cpu_seconds()

    def snapshot(self) -> StressSample:
        s = self.now.copy()
        s.seconds = time.perf_counter() - self.t0
        s.cpu_seconds = _cpu_seconds() - self.cpu0
        return s


def _stress_message(
    op: int,
    task: int,
    seq: int,
    ack_bytes: int,
    size: int,
    rdma: tuple[int, int, int] | None = None,
) -> bytes:
    """A stress message; ``rdma`` = (flag, cookie, bytes) asks the ack to move them."""
    flags = 0 if rdma is None else rdma[0]
    head = STRESS_HEADER.pack(STRESS_MAGIC, op, flags, task, seq, ack_bytes)
    if rdma is not None:
        head += STRESS_RDMA.pack(rdma[1].to_bytes(16, "big"), rdma[2])
    return head.ljust(size, b"\0")


def _parse_stress(data: bytes, sender: tuple[str, int]) -> tuple[int, int, int, int]:
    if len(data) < STRESS_HEADER.size:
        raise RdsToolError(f"{len(data)}-byte message from {sender[0]}:{sender[1]}: too short")
    magic, op, _, task, seq, ack_bytes = STRESS_HEADER.unpack_from(data)
    if magic != STRESS_MAGIC:
        raise RdsToolError(f"message from {sender[0]}:{sender[1]} is not an rds-stress message")
    return op, task, seq, ack_bytes


def _stress_rdma(data: bytes, sender: tuple[str, int]) -> RdmaOp | None:
    """The RDMA operation a request asks its ack to carry, if any."""
    flags = STRESS_HEADER.unpack_from(data)[2]
    if not flags & (FLAG_RDMA_WRITE | FLAG_RDMA_READ):
        return None
    if len(data) < STRESS_HEADER.size + STRESS_RDMA.size:
        raise RdsToolError(f"request from {sender[0]}:{sender[1]} lacks its RDMA arguments")
    raw_cookie, size = STRESS_RDMA.unpack_from(data, STRESS_HEADER.size)
    cookie = int.from_bytes(raw_cookie, "big")
    if size > RDS_MAX_MSG_SIZE:
        raise RdsToolError(f"request from {sender[0]}:{sender[1]} asks for {size} RDMA bytes")
    if flags & FLAG_RDMA_READ:
        return RdmaOp.read_into(cookie, bytearray(size))
    return RdmaOp.write_to(cookie, _rdma_pattern(size))


@functools.lru_cache(maxsize=8)
def _rdma_pattern(size: int) -> bytes:
    """What an ack writes (and a request offers to be read): the same bytes every time,
    made once per size (an ack's RDMA Write only reads them)."""
    return (b"rds-stress rdma " * (size // 16 + 1))[:size]


async def stress_active(
    node: RdsNode,
    cfg: StressConfig,
    *,
    on_start: Callable[[], None] = lambda: None,
    on_second: Callable[[StressSample], None] = lambda sample: None,
    stop: trio.Event | None = None,
) -> StressResult:
    """rds-stress's active side: ``tasks`` sockets sending requests, ``depth`` each in flight.

    Each request carries its task, sequence number and the ack size; the
    passive side answers each with an ack of that size, in order (checked).
    One request per task first brings the connection up (not counted); then
    the timed run starts (``on_start``), ``on_second`` gets each second's
    figures, and after ``cfg.seconds`` (or when ``stop`` is set) the tasks stop
    sending and wait for their last acks. Finally a DONE message tells the
    passive side the run is over (a ``stress_passive(once=True)`` exits).
    """
    stop = stop if stop is not None else trio.Event()
    dest = (cfg.dest, cfg.port)
    socks = [node.bind(cfg.port + 1 + i) for i in range(cfg.tasks)]
    control = node.bind(cfg.port)
    pad = cfg.req_bytes
    running = [0]
    per_second: list[StressSample] = []
    try:
        # Start-up: a request per task, answered, before the clock starts. It is sent
        # again every second, so an unreachable peer shows (sendto raises) at once.
        async def start_up(i: int, sock: RdsSocket) -> None:
            async with trio.open_nursery() as nursery:

                async def resend() -> None:
                    while True:
                        await sock.sendto(_stress_message(OP_REQ, i, 0, cfg.ack_bytes, pad), dest)
                        await trio.sleep(1.0)

                nursery.start_soon(resend)
                data, sender = await sock.recvfrom()
                op, task, seq, _ = _parse_stress(data, sender)
                if (op, task, seq) != (OP_ACK, i, 0):
                    raise RdsToolError(f"task {i}: start-up answer {(op, task, seq)}")
                nursery.cancel_scope.cancel()

        try:
            with trio.fail_after(ACK_TIMEOUT):
                async with trio.open_nursery() as nursery:
                    for i, sock in enumerate(socks):
                        nursery.start_soon(start_up, i, sock)
        except* trio.TooSlowError:
            raise RdsToolError(
                f"no answer from {cfg.dest} RDS port {cfg.port} in {ACK_TIMEOUT:g} s "
                f"(is `rdmashim rds stress -r {cfg.dest}` running there?)"
            ) from None
        except* RdsError as group:
            first: RdsError | ExceptionGroup[RdsError] = group
            while isinstance(first, BaseExceptionGroup):
                first = first.exceptions[0]
            raise RdsToolError(f"{cfg.dest}: {first}") from None
        clock = _Clock()
        on_start()
        # perf_counter at each running task's last ack (or its start), for the watchdog:
        # one timer for the run rather than a cancel scope per wait for an ack.
        last_ack: dict[int, float] = {}

        async def task(i: int, sock: RdsSocket) -> None:
            pending: deque[tuple[int, float]] = deque()
            seq = 0
            now = clock.now
            perf = time.perf_counter
            # With -D, one buffer per request in flight: acks come in order, so the
            # buffer of request n is free again when request n + depth is sent.
            pattern = _rdma_pattern(cfg.rdma_bytes)
            buffers = [bytearray(pattern) for _ in range(cfg.depth if cfg.rdma_bytes else 0)]
            cookies = [sock.get_mr(buf) for buf in buffers]
            flag = FLAG_RDMA_READ if cfg.rdma_read else FLAG_RDMA_WRITE

            async def send_one() -> None:
                nonlocal seq
                seq += 1
                rdma = None
                if buffers:
                    slot = seq % cfg.depth
                    if not cfg.rdma_read:  # the ack's Write must put these back
                        buffers[slot][0] = buffers[slot][-1] = 0
                    rdma = (flag, cookies[slot], cfg.rdma_bytes)
                msg = _stress_message(OP_REQ, i, seq, cfg.ack_bytes, pad, rdma)
                t0 = perf()
                await sock.sendto(msg, dest)
                t1 = perf()
                pending.append((seq, t0))
                now.requests += 1
                now.tx_bytes += len(msg)
                now.send_calls += 1
                now.send_usecs += (t1 - t0) * 1e6

            running[0] += 1
            last_ack[i] = perf()
            try:
                for _ in range(cfg.depth):
                    await send_one()
                while pending:
                    if sock.received:  # acks already here are taken without waiting
                        data, sender = sock.recvfrom_nowait()  # (rds-stress's MSG_DONTWAIT)
                    else:
                        data, sender = await sock.recvfrom()
                    last_ack[i] = t = perf()
                    op, task_no, ack_seq, _ = _parse_stress(data, sender)
                    if (op, ack_seq) == (OP_ACK, 0):
                        continue  # a late answer to a repeated start-up request
                    expected = pending[0][0]
                    if op != OP_ACK or task_no != i or ack_seq != expected:
                        raise RdsToolError(
                            f"task {i}: got op {op} task {task_no} seq {ack_seq}, "
                            f"expected the ack of request {expected}"
                        )
                    if len(data) != cfg.ack_bytes:
                        raise RdsToolError(f"task {i}: {len(data)}-byte ack, not {cfg.ack_bytes}")
                    if buffers:
                        buf = buffers[ack_seq % cfg.depth]
                        if buf[:1] != pattern[:1] or buf[-1:] != pattern[-1:]:
                            raise RdsToolError(f"task {i}: request {ack_seq}'s RDMA Write missing")
                        now.rdma_bytes += cfg.rdma_bytes
                    _, sent_at = pending.popleft()
                    now.rx_bytes += len(data)
                    now.rtts += 1
                    now.rtt_usecs += (t - sent_at) * 1e6
                    if not stop.is_set():
                        await send_one()
            finally:
                running[0] -= 1
                del last_ack[i]

        async def reporter() -> None:
            last = clock.snapshot()
            next_at = trio.current_time() + 1.0
            while True:
                await trio.sleep_until(next_at)
                if stop.is_set():  # the run's time is up: its tasks only wait for acks now
                    return
                next_at += 1.0
                snap = clock.snapshot()
                sample = snap.minus(last)
                sample.tasks = running[0]
                per_second.append(sample)
                on_second(sample)
                last = snap

        async def watchdog() -> None:
            while True:
                await trio.sleep(1.0)
                now = time.perf_counter()
                for i, since in last_ack.items():
                    if now - since > ACK_TIMEOUT:
                        raise RdsToolError(
                            f"task {i}: no ack from {cfg.dest} for {ACK_TIMEOUT:g} s"
                        )

        async def timer() -> None:
            if cfg.seconds:
                with trio.move_on_after(cfg.seconds):
                    await stop.wait()
                stop.set()

        async with trio.open_nursery() as outer:
            outer.start_soon(reporter)
            outer.start_soon(timer)
            outer.start_soon(watchdog)
            async with trio.open_nursery() as tasks:
                for i, sock in enumerate(socks):
                    tasks.start_soon(task, i, sock)
            outer.cancel_scope.cancel()
        total = clock.snapshot()
        total.tasks = cfg.tasks

        # Tell the passive side the run is over; it answers once it has sent every ack.
        await control.sendto(_stress_message(OP_DONE, 0, 0, MIN_STRESS_BYTES, 16), dest)
        with trio.move_on_after(5.0) as scope:
            while True:
                data, sender = await control.recvfrom()
                if _parse_stress(data, sender)[0] == OP_DONE_ACK:
                    break
        if scope.cancelled_caught:
            log.warning("no end-of-run answer from %s:%d", *dest)
        await drain(node, 2.0)
        return StressResult(total, per_second)
    finally:
        for sock in [*socks, control]:
            sock.close()


@dataclass
class PassiveResult:
    """What the passive side saw: requests in, acks out."""

    requests: int = 0
    acks: int = 0
    rx_bytes: int = 0
    tx_bytes: int = 0
    tasks: set[tuple[str, int]] = field(default_factory=set)
    seconds: float = 0.0
    """From the first request to the end of the run (of the runs that ended)."""
    started: float | None = None
    """``perf_counter`` at the first request of the run under way."""
    runs: int = 0
    rdma_bytes: int = 0
    rdma_failures: int = 0
    """RDMA operations of acks that did not succeed."""

    def elapsed(self) -> float:
        """Seconds of the runs so far, the one under way up to now included."""
        running = time.perf_counter() - self.started if self.started is not None else 0.0
        return self.seconds + running


async def stress_passive(
    node: RdsNode,
    port: int = STRESS_PORT,
    *,
    once: bool = True,
    result: PassiveResult | None = None,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> PassiveResult:
    """rds-stress's passive side: answer each request with an ack of the size it asks for.

    With ``once`` it returns after the first run's DONE message, when every
    ack has been acknowledged; otherwise it serves run after run until
    cancelled (pass ``result`` to read the counts then).
    """
    result = result if result is not None else PassiveResult()
    sock = node.bind(port)
    task_status.started(sock.address)
    in_flight: deque[RdmaOp] = deque()
    try:
        while True:
            if sock.received:  # requests already here are answered in this turn: their
                data, sender = sock.recvfrom_nowait()  # acks go out together
            else:
                data, sender = await sock.recvfrom()
            op, task, seq, ack_bytes = _parse_stress(data, sender)
            if op == OP_REQ:
                if result.started is None:
                    result.started = time.perf_counter()
                result.requests += 1
                result.rx_bytes += len(data)
                result.tasks.add(sender)
                ack = _stress_message(OP_ACK, task, seq, ack_bytes, ack_bytes)
                rdma = _stress_rdma(data, sender)
                await sock.sendto(ack, sender, rdma=rdma)
                if rdma is not None:
                    result.rdma_bytes += rdma.length
                    in_flight.append(rdma)
                while in_flight and in_flight[0].done:
                    done = in_flight.popleft()
                    read_wrong = not done.write and done.buffer != _rdma_pattern(done.length)
                    if done.status != RdmaStatus.SUCCESS or read_wrong:
                        log.warning("rds-stress RDMA %s: %s %s", done, done.status, done.detail)
                        result.rdma_failures += 1
                result.acks += 1
                result.tx_bytes += len(ack)
            elif op == OP_DONE:
                await sock.sendto(_stress_message(OP_DONE_ACK, 0, 0, 16, 16), sender)
                result.seconds, result.started = result.elapsed(), None
                result.runs += 1
                if once:
                    await drain(node, 3.0)
                    return result
            else:
                log.info("unexpected rds-stress op %d from %s:%d", op, *sender)
    finally:
        sock.close()
