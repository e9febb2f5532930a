"""The RDS tools' library side: rds-ping, rds-stress, rds-info and a messaging demo.

What ``rdmashim rds ...`` runs, over :mod:`rdmashim.ulps.rds` (see the CLI for
the flags). Nothing here prints: results are returned, per-second figures and
progress go to callbacks, and tables come back as text.

Ports (RDS ports, not TCP ports):

- :data:`ECHO_PORT` (7, after the echo service of RFC 862): Linux answers RDS
  pings in the kernel, on port 0; our RDS has no such responder, so the pinged
  node runs :func:`serve_echo` (``rdmashim rds ping --serve``), which sends
  every message back to where it came from.
- :data:`INFO_PORT` (10000, after ``RDS_INFO_FIRST``): :func:`serve_info`
  answers rds-info queries (:func:`query_info`) with :func:`format_info`'s
  tables of the node it serves. A node lives inside the process that runs it,
  so ``rdmashim rds info`` asks a running node over RDS; the query's own
  connection shows up in the answer.
- :data:`STRESS_PORT` (4000, rds-stress's default): the passive side of
  :func:`stress_active` / :func:`stress_passive` listens there; active task
  ``i`` binds ``port + 1 + i``, as rds-stress's children do.

Every tool needs its own node, and a node needs its own IP address (nodes of
several processes cannot share one): on Linux any 127.x.y.z is loopback.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import random
import socket
import struct
import time
import zlib
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field, fields
from typing import Any

import trio

from rdmashim.rds_defaults import (
    ALL_TABLES,
    DEMO_MIN_SIZE,
    ECHO_PORT,
    INFO_PORT,
    INFO_TABLES,
    MIN_STRESS_BYTES,
    RDS_CM_PORT,
    STRESS_PORT,
)
from rdmashim.ulps.rds.connection import SNDBUF, Counters, RdsConnection
from rdmashim.ulps.rds.node import RCVBUF, RdsError, RdsNode, RdsSocket
from rdmashim.ulps.rds.rdma import RdmaOp, RdmaStatus
from rdmashim.ulps.rds.wire import RDS_MAX_MSG_SIZE
from rdmashim.verbs import QPState

log = logging.getLogger(__name__)

EPHEMERAL = (32768, 60999)
"""Ports :func:`bind_any` picks from (Linux's default ``ip_local_port_range``)."""


class RdsToolError(Exception):
    """A tool could not do its job (no answer, a bad message, a bad option)."""


# =============================================================================================
# helpers
# =============================================================================================


def guess_source(dest: str) -> str:
    """The local address the routing table picks for ``dest`` (as rds-ping does).

    For a loopback destination Linux answers 127.0.0.1; when that is ``dest``
    itself, a random 127.x.y.z is taken instead, since two nodes cannot share
    an address.
    """
    ip = ipaddress.ip_address(dest)
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((dest, 1))
        source = probe.getsockname()[0]
    if source == str(ip) and ip.is_loopback and ip.version == 4:
        rng = random.Random()
        while source == str(ip):
            source = f"127.{rng.randrange(1, 255)}.{rng.randrange(256)}.{rng.randrange(1, 255)}"
    return source


def bind_any(node: RdsNode, rng: random.Random | None = None) -> RdsSocket:
    """A socket on a free port of ``node`` (what binding to port 0 does in Linux)."""
    rng = rng or random.Random()
    for _ in range(1000):
        try:
            return node.bind(rng.randint(*EPHEMERAL))
        except RdsError:
            continue
    raise RdsToolError(f"no free RDS port on {node.address}")


@asynccontextmanager
async def open_node(address: str, cm_port: int = RDS_CM_PORT) -> AsyncIterator[RdsNode]:
    """An :class:`RdsNode` on ``address``; a failure to start says what to check."""
    async with AsyncExitStack() as stack:
        try:
            node = await stack.enter_async_context(RdsNode(address, cm_port))
        except OSError as exc:
            raise _node_error(exc, address, cm_port) from exc
        yield node


def _node_error(exc: OSError, address: str, cm_port: int) -> RdsToolError:
    """Why a node did not start, with what to check."""
    hint = ""
    if exc.errno == errno.EADDRINUSE:
        hint = " (another RDS node on this address? each node needs its own address)"
    elif exc.errno == errno.EADDRNOTAVAIL:
        hint = " (not an address of this machine; any 127.x.y.z is, on Linux)"
    where = f"{address}, rdma_cm port {cm_port}"
    return RdsToolError(f"cannot start an RDS node on {where}: {exc}{hint}")


def busy(node: RdsNode) -> bool:
    """Whether some connection of ``node`` still holds unsent or unacknowledged messages."""
    return any(rds.unsent or rds.unacked for rds in node.connections())


async def drain(node: RdsNode, within: float = 3.0) -> bool:
    """Wait until the peers acknowledged everything ``node`` sent; False after ``within`` s."""
    with trio.move_on_after(within):
        while busy(node):  # noqa: ASYNC110 - RdsConnection has no event for "all acknowledged"
            await trio.sleep(0.01)
        return True
    return False


# =============================================================================================
# ping
# =============================================================================================

PING_SOCKETS = 8
"""Sockets the pinger cycles through; a reply is matched to its ping by socket (rds-ping)."""
PING_WAIT = 1.0
"""Seconds a counted ping waits for the last replies, however short its interval."""


@dataclass(frozen=True)
class PingReply:
    """One line of rds-ping's output: a reply, or an error sending ping ``seq``."""

    seq: int
    usec: int | None = None
    sender: str | None = None
    """The replying address, when it is not the pinged one."""
    dup: bool = False
    error: str | None = None


def format_ping_reply(reply: PingReply) -> str:
    """rds-ping's line: ``   1: 23 usec`` (``DUP!``, ``(other address)``, ``ERROR: ...``)."""
    line = f" {reply.seq:3d}:"
    if reply.usec is not None:
        line += f" {reply.usec} usec"
    if reply.sender is not None:
        line += f" ({reply.sender})"
    if reply.dup:
        line += " DUP!"
    if reply.error is not None:
        line += f" ERROR: {reply.error}"
    return line


@dataclass
class PingStats:
    sent: int = 0
    received: int = 0
    rtts_usec: list[int] = field(default_factory=list)


@dataclass
class _PingSlot:
    sock: RdsSocket
    sent_id: int = 0
    sent_ns: int = 0
    replies: int = 0


async def ping(
    node: RdsNode,
    dest: str,
    *,
    port: int = ECHO_PORT,
    count: int = 0,
    interval: float = 1.0,
    on_reply: Callable[[PingReply], None] = lambda reply: None,
) -> PingStats:
    """rds-ping: an empty message to ``(dest, port)`` every ``interval`` seconds.

    As rds-ping, it cycles through :data:`PING_SOCKETS` sockets and takes a
    message arriving on a socket as the reply to that socket's last ping. With
    ``count``, it stops once ``count`` replies arrived, or one interval after
    the ``count``-th ping (at least :data:`PING_WAIT` s); without, it runs until cancelled.
    """
    dest = str(ipaddress.ip_address(dest))
    stats = PingStats()
    slots = [_PingSlot(bind_any(node)) for _ in range(PING_SOCKETS)]
    try:
        async with trio.open_nursery() as nursery:

            async def receive(slot: _PingSlot) -> None:
                while True:
                    _, (ip, _port) = await slot.sock.recvfrom()
                    usec = (time.perf_counter_ns() - slot.sent_ns) // 1000
                    reply = PingReply(
                        slot.sent_id, usec, ip if ip != dest else None, dup=slot.replies > 0
                    )
                    slot.replies += 1
                    if not reply.dup:
                        stats.received += 1
                        stats.rtts_usec.append(usec)
                    on_reply(reply)
                    if count and stats.received >= count:
                        nursery.cancel_scope.cancel()

            for slot in slots:
                nursery.start_soon(receive, slot)
            next_at = trio.current_time()
            index = 0
            while not (count and stats.sent >= count):
                slot = slots[index]
                index = (index + 1) % PING_SOCKETS
                stats.sent += 1
                slot.sent_id, slot.sent_ns, slot.replies = stats.sent, time.perf_counter_ns(), 0
                try:
                    await slot.sock.sendto(b"", (dest, port))
                except RdsError as exc:
                    reason = os.strerror(exc.errno) if exc.errno else str(exc)
                    log.info("ping %d to %s: %s", slot.sent_id, dest, exc)
                    on_reply(PingReply(slot.sent_id, error=reason))
                next_at += interval
                if not (count and stats.sent >= count):
                    await trio.sleep_until(next_at)
            await trio.sleep_until(max(next_at, trio.current_time() + PING_WAIT))
            nursery.cancel_scope.cancel()
    finally:
        for slot in slots:
            slot.sock.close()
    return stats


async def _serve(
    node: RdsNode,
    port: int,
    answer: Callable[[bytes, tuple[str, int]], bytes | None],
    task_status: Any,
) -> None:
    """Bind ``port`` and send ``answer(data, sender)`` back for every message (None: nothing)."""
    sock = node.bind(port)
    task_status.started(sock.address)
    try:
        while True:
            data, sender = await sock.recvfrom()
            reply = answer(data, sender)
            if reply is None:
                continue
            try:
                await sock.sendto(reply, sender)
            except RdsError as exc:
                log.info("answer to %s:%d failed: %s", *sender, exc)
    finally:
        sock.close()


async def serve_echo(
    node: RdsNode, port: int = ECHO_PORT, *, task_status: Any = trio.TASK_STATUS_IGNORED
) -> None:
    """Send every message arriving at ``port`` back to its sender (the pinged side)."""

    def echo(data: bytes, sender: tuple[str, int]) -> bytes:
        log.debug("echo %d bytes to %s:%d", len(data), *sender)
        return data

    await _serve(node, port, echo, task_status)


# =============================================================================================
# info
# =============================================================================================

_INFO_REQUEST = b"rds-info:"


def _counter_rows(nodes: Sequence[RdsNode]) -> list[tuple[str, int]]:
    rows = {f.name: 0 for f in fields(Counters)}
    for node in nodes:
        for rds in node.connections():
            for f in fields(rds.counters):
                rows[f.name] += getattr(rds.counters, f.name)
    rows["drops_no_socket"] = sum(n.drops_no_socket for n in nodes)
    rows["loopback_messages"] = sum(n.loopback_messages for n in nodes)
    return list(rows.items())


def _check_tables(tables: str) -> None:
    for letter in tables:
        if letter not in INFO_TABLES:
            raise ValueError(f"no rds-info table {letter!r} (have {ALL_TABLES})")


def format_info(nodes: RdsNode | Iterable[RdsNode], tables: str = ALL_TABLES) -> str:
    """rds-info's tables (letters of :data:`INFO_TABLES`) for nodes of this process.

    Columns are rds-info's, with these differences: the sockets table's last
    column is the bytes queued unread (``Unread``) instead of an inode; ``Tos``
    is always 0. Counters are summed over
    the nodes' connections; ``drops_no_socket`` and ``loopback_messages`` are
    the nodes' own.
    """
    all_nodes = [nodes] if isinstance(nodes, RdsNode) else list(nodes)
    out: list[str] = []
    _check_tables(tables)
    for letter in tables:
        if letter == "c":
            out.append(f"\nCounters:\n{'CounterName':>25} {'Value':>16}")
            out += [f"{name:>25} {value:>16}" for name, value in _counter_rows(all_nodes)]
        elif letter == "k":
            out.append(
                f"\nRDS Sockets:\n{'BoundAddr':>15} {'BPort':>5} {'ConnAddr':>15} {'CPort':>5} "
                f"{'SndBuf':>10} {'RcvBuf':>10} {'Unread':>8}"
            )
            for node in all_nodes:
                for sock in node.sockets():
                    out.append(
                        f"{node.address!s:>15} {sock.port:>5} {'0.0.0.0':>15} {0:>5} "
                        f"{SNDBUF:>10} {RCVBUF:>10} {sock.queued_bytes:>8}"
                    )
        elif letter == "n":
            out.append(
                f"\nRDS Connections:\n{'LocalAddr':>15} {'RemoteAddr':>15} {'Tos':>4} "
                f"{'NextTX':>16} {'NextRX':>16} {'Flgs':>4}"
            )
            for node in all_nodes:
                for rds in node.connections():
                    out.append(
                        f"{rds.local!s:>15} {rds.peer!s:>15} {0:>4} {rds.next_seq:>16} "
                        f"{rds.next_recv:>16} {node.connection_flags(str(rds.peer))}"
                    )
        else:
            name = {"r": "Receive", "s": "Send", "t": "Retransmit"}[letter]
            out.append(
                f"\n{name} Message Queue:\n{'LocalAddr':>15} {'LPort':>5} {'RemoteAddr':>15} "
                f"{'RPort':>5} {'Tos':>4} {'Seq':>16} {'Bytes':>10}"
            )
            for node in all_nodes:
                out += [
                    f"{local:>15} {lport:>5} {remote:>15} {rport:>5} {0:>4} {seq:>16} {size:>10}"
                    for local, lport, remote, rport, seq, size in _queued(node, letter)
                ]
    return "\n".join(out).lstrip("\n") + "\n"


def _queued(node: RdsNode, letter: str) -> Iterator[tuple[str, int, str, int, int, int]]:
    """(local, lport, remote, rport, seq, bytes) of the messages in a queue of rds-info."""
    if letter == "r":
        for sock in node.sockets():
            for msg in list(sock.received):
                yield str(node.address), sock.port, *msg.sender, msg.seq, len(msg.data)
        return
    for rds in node.connections():
        for msg in list(rds.unsent if letter == "s" else rds.unacked):
            yield str(rds.local), msg.sport, str(rds.peer), msg.dport, msg.seq, len(msg.data)


async def serve_info(
    node: RdsNode, port: int = INFO_PORT, *, task_status: Any = trio.TASK_STATUS_IGNORED
) -> None:
    """Answer :func:`query_info` requests with :func:`format_info` of ``node``."""

    def info(data: bytes, sender: tuple[str, int]) -> bytes | None:
        if not data.startswith(_INFO_REQUEST):
            log.info("not an rds-info request from %s:%d", *sender)
            return None
        tables = data[len(_INFO_REQUEST) :].decode("ascii", "replace") or ALL_TABLES
        try:
            text = format_info(node, tables)
        except ValueError as exc:
            text = f"error: {exc}\n"
        return text.encode()[:RDS_MAX_MSG_SIZE]

    await _serve(node, port, info, task_status)


async def query_info(
    node: RdsNode,
    dest: str,
    tables: str = ALL_TABLES,
    *,
    port: int = INFO_PORT,
    within: float = 5.0,
) -> str:
    """Ask the node at ``dest`` (running :func:`serve_info`) for its rds-info tables."""
    _check_tables(tables)
    sock = bind_any(node)
    try:
        with trio.move_on_after(within):
            await sock.sendto(_INFO_REQUEST + tables.encode(), (dest, port))
            data, _ = await sock.recvfrom()
            return data.decode("utf-8", "replace")
        raise RdsToolError(
            f"no rds-info answer from {dest} (RDS port {port}) within {within:g} s: "
            "only nodes run by `rdmashim rds ping --serve` or `rdmashim rds stress` "
            "(or calling rdmashim.rds_tools.serve_info) answer"
        )
    except RdsError as exc:
        raise RdsToolError(f"rds-info query to {dest}: {exc}") from exc
    finally:
        sock.close()


# =============================================================================================
# stress
# =============================================================================================

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


def _rdma_pattern(size: int) -> bytes:
    """What an ack writes (and a request offers to be read): the same bytes every time."""
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
            first = group
            while isinstance(first, BaseExceptionGroup):
                first = first.exceptions[0]
            raise RdsToolError(f"{cfg.dest}: {first}") from None
        clock = _Clock()
        on_start()

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
            try:
                for _ in range(cfg.depth):
                    await send_one()
                while pending:
                    with trio.move_on_after(ACK_TIMEOUT) as waiting:
                        data, sender = await sock.recvfrom()
                    if waiting.cancelled_caught:
                        raise RdsToolError(
                            f"task {i}: no ack from {cfg.dest} for {ACK_TIMEOUT:g} s"
                        )
                    t = perf()
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

        async def reporter() -> None:
            last = clock.snapshot()
            next_at = trio.current_time() + 1.0
            while True:
                await trio.sleep_until(next_at)
                next_at += 1.0
                snap = clock.snapshot()
                sample = snap.minus(last)
                sample.tasks = running[0]
                per_second.append(sample)
                on_second(sample)
                last = snap

        async def timer() -> None:
            if cfg.seconds:
                with trio.move_on_after(cfg.seconds):
                    await stop.wait()
                stop.set()

        async with trio.open_nursery() as outer:
            outer.start_soon(reporter)
            outer.start_soon(timer)
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
    task_status: Any = trio.TASK_STATUS_IGNORED,
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


# =============================================================================================
# demo
# =============================================================================================

DEMO_PORT = 4000
DEMO_WINDOW = 128
"""Messages each sender keeps in flight to each receiver (at most)."""
_STAMP = struct.Struct("!HQI")
"""Sender's node index, its sequence number towards this receiver, CRC32 of the payload."""


@dataclass
class DemoProgress:
    elapsed: float
    delivered: int
    bytes: int
    cuts: int
    phase: str


@dataclass
class DemoCut:
    """A connection cut: when, which, how long the reconnection took, and how many
    messages each side (the cut one, the peer) resent on the new session."""

    at: float
    local: str
    peer: str
    reconnect_s: float | None = None
    resent: tuple[int, int] | None = None
    queued: int | None = None
    """Messages the two nodes sent each other while the connection was down."""


@dataclass
class DemoResult:
    addresses: list[str]
    size: int
    sent: int = 0
    delivered: int = 0
    duplicated: int = 0
    out_of_order: int = 0
    corrupt: int = 0
    seconds: float = 0.0
    """From the first send to the last delivery."""
    cuts: list[DemoCut] = field(default_factory=list)
    connections: list[tuple[str, str, dict[str, int]]] = field(default_factory=list)
    """(local, peer, counters) of every node's view of every connection."""
    info: str = ""
    """format_info of all nodes at the end."""

    @property
    def lost(self) -> int:
        return self.sent - self.delivered

    @property
    def ok(self) -> bool:
        clean = not (self.lost or self.duplicated or self.out_of_order or self.corrupt)
        return clean and self.delivered > 0

    @property
    def msgs_per_s(self) -> float:
        return self.delivered / self.seconds if self.seconds else 0.0

    @property
    def mbytes_per_s(self) -> float:
        return self.delivered * self.size / self.seconds / 1e6 if self.seconds else 0.0


@dataclass(eq=False)
class _Stream:
    """Messages from one node's socket to another's."""

    sent: int = 0
    delivered: int = 0
    room: trio.Event = field(default_factory=trio.Event)


async def _start_nodes(stack: AsyncExitStack, addresses: Sequence[str], port: int) -> list[RdsNode]:
    """Nodes on ``addresses``, all on one CM port (``0``: a free one, retried on a clash)."""
    for attempt in range(5):
        nodes: list[RdsNode] = []
        inner = AsyncExitStack()
        chosen = port
        try:
            for address in addresses:
                node = await inner.enter_async_context(RdsNode(address, chosen))
                chosen = node.port
                nodes.append(node)
        except OSError as exc:
            await inner.aclose()
            if port or attempt == 4:
                raise _node_error(exc, address, chosen) from exc
            continue
        await stack.enter_async_context(inner)
        return nodes
    raise AssertionError("unreachable")


async def run_rds_demo(
    *,
    nodes: int = 4,
    seconds: float = 8.0,
    size: int = 1024,
    cuts: int = 2,
    first_address: str = "127.0.0.1",
    cm_port: int = 0,
    on_progress: Callable[[DemoProgress], None] = lambda p: None,
    on_event: Callable[[str], None] = lambda text: None,
) -> DemoResult:
    """Several nodes on loopback addresses, every socket sending to every other.

    Each message carries its sender, a sequence number per (sender, receiver)
    and a CRC32 of its payload; receivers check that each arrives exactly once,
    in order, intact. ``cuts`` times during the run, a live connection is cut
    underneath (its QP moved to ERR, as a broken link would); RDS reconnects
    and resends what the peer had not acknowledged. After ``seconds`` the
    senders stop and the demo waits for every message to arrive.
    """
    if nodes < 2:
        raise ValueError("the demo needs at least 2 nodes")
    if not DEMO_MIN_SIZE <= size <= RDS_MAX_MSG_SIZE:
        raise ValueError(f"size {size} outside {DEMO_MIN_SIZE}..{RDS_MAX_MSG_SIZE}")
    base = ipaddress.ip_address(first_address)
    addresses = [str(base + i) for i in range(nodes)]
    result = DemoResult(addresses, size)
    rng = random.Random(4)
    block = rng.randbytes(size + 4096)
    streams = {(i, j): _Stream() for i in range(nodes) for j in range(nodes) if i != j}
    body = size - _STAMP.size
    async with AsyncExitStack() as stack:
        all_nodes = await _start_nodes(stack, addresses, cm_port)
        socks = [node.bind(DEMO_PORT) for node in all_nodes]
        on_event(
            f"{nodes} RDS nodes on {', '.join(addresses)} (rdma_cm port {all_nodes[0].port}), "
            f"socket {DEMO_PORT} on each; every socket sends {size}-byte messages to every other"
        )
        stop = trio.Event()
        t0 = time.perf_counter()
        last_delivery = [t0]
        delivered_bytes = [0]
        phase = ["sending"]

        async def sender(i: int, j: int) -> None:
            stream = streams[i, j]
            sock, dest = socks[i], (addresses[j], DEMO_PORT)
            offset = (i * 7 + j * 13) % 4096
            while not stop.is_set():
                if stream.sent - stream.delivered >= DEMO_WINDOW:
                    # Wait until half the window is free, then send a burst: the node
                    # posts a burst's messages together.
                    while stream.sent - stream.delivered > DEMO_WINDOW // 2 and not stop.is_set():
                        stream.room = trio.Event()
                        await stream.room.wait()
                    if stop.is_set():
                        break
                offset = (offset + 1) % 4096
                payload = block[offset : offset + body]
                msg = _STAMP.pack(i, stream.sent, zlib.crc32(payload)) + payload
                stream.sent += 1
                result.sent += 1
                await sock.sendto(msg, dest)

        async def receiver(j: int) -> None:
            while True:
                data, (ip, _port) = await socks[j].recvfrom()
                i, seq, crc = _STAMP.unpack_from(data)
                stream = streams[i, j]
                if addresses[i] != ip or zlib.crc32(memoryview(data)[_STAMP.size :]) != crc:
                    result.corrupt += 1
                if seq < stream.delivered:
                    result.duplicated += 1
                    continue
                if seq > stream.delivered:
                    result.out_of_order += 1
                stream.delivered = seq + 1
                result.delivered += 1
                delivered_bytes[0] += len(data)
                last_delivery[0] = time.perf_counter()
                stream.room.set()

        def connection(i: int, j: int) -> RdsConnection | None:
            return {str(c.peer): c for c in all_nodes[i].connections()}.get(addresses[j])

        async def cut_once(side: int, other: int) -> bool:
            near, far = connection(side, other), connection(other, side)
            session = near.session if near is not None else None
            if near is None or far is None or session is None or session.lost:
                return False
            both = (near, far)
            resent = tuple(c.counters.retransmits for c in both)
            queued = sum(c.counters.send_messages for c in both)
            session.qp.modify(qp_state=QPState.ERR)
            cut = DemoCut(time.perf_counter() - t0, addresses[side], addresses[other])
            result.cuts.append(cut)
            on_event(
                f"{cut.at:5.1f} s  cut the connection {cut.local} -> {cut.peer} underneath "
                "(its QP to ERR); the senders carry on"
            )
            with trio.move_on_after(10):
                while near.session is None or near.session is session or near.session.lost:  # noqa: ASYNC110
                    await trio.sleep(0.002)
                cut.reconnect_s = time.perf_counter() - t0 - cut.at
                cut.queued = sum(c.counters.send_messages for c in both) - queued
                await trio.sleep(0.05)  # let the far side's session start too
                cut.resent = (both[0].counters.retransmits - resent[0],
                              both[1].counters.retransmits - resent[1])  # fmt: skip
                on_event(
                    f"{cut.at + cut.reconnect_s:5.1f} s  reconnected after "
                    f"{cut.reconnect_s * 1000:.0f} ms; {cut.queued} messages sent in the "
                    f"meantime waited in the queue, {sum(cut.resent)} had to be resent"
                )
            return True

        async def cutter() -> None:
            pairs = [(a, b) for a in range(nodes) for b in range(nodes) if a < b]
            for k in range(cuts):
                due = t0 + seconds * (k + 1) / (cuts + 1)
                await trio.sleep(max(0.0, due - time.perf_counter()))
                a, b = pairs[(k * (nodes // 2)) % len(pairs)]
                side, other = (a, b) if k % 2 == 0 else (b, a)  # alternate the side cut
                for _ in range(100):
                    if await cut_once(side, other):
                        break
                    await trio.sleep(0.02)

        async def progress() -> None:
            while True:
                on_progress(
                    DemoProgress(
                        time.perf_counter() - t0, result.delivered, delivered_bytes[0],
                        len(result.cuts), phase[0],
                    )
                )  # fmt: skip
                await trio.sleep(0.25)

        async with trio.open_nursery() as nursery:
            for j in range(nodes):
                nursery.start_soon(receiver, j)
            nursery.start_soon(progress)
            nursery.start_soon(cutter)
            async with trio.open_nursery() as senders:
                for i, j in streams:
                    senders.start_soon(sender, i, j)
                await trio.sleep(seconds)
                stop.set()
                for stream in streams.values():
                    stream.room.set()
            phase[0] = "draining"
            with trio.move_on_after(30):
                while result.delivered < result.sent or busy_any(all_nodes):  # noqa: ASYNC110
                    await trio.sleep(0.02)
            nursery.cancel_scope.cancel()
        result.seconds = last_delivery[0] - t0
        for node in all_nodes:
            for rds in node.connections():
                counters = {f.name: getattr(rds.counters, f.name) for f in fields(rds.counters)}
                result.connections.append((str(rds.local), str(rds.peer), counters))
        result.info = format_info(all_nodes)
    return result


def busy_any(nodes: Iterable[RdsNode]) -> bool:
    return any(busy(node) for node in nodes)


__all__ = [
    "DEMO_MIN_SIZE",
    "ECHO_PORT",
    "INFO_PORT",
    "INFO_TABLES",
    "MIN_STRESS_BYTES",
    "RDS_CM_PORT",
    "STRESS_COLUMNS",
    "STRESS_PORT",
    "DemoProgress",
    "DemoResult",
    "PassiveResult",
    "PingReply",
    "PingStats",
    "RdsToolError",
    "StressConfig",
    "StressResult",
    "StressSample",
    "bind_any",
    "drain",
    "format_info",
    "format_ping_reply",
    "format_stress_row",
    "guess_source",
    "open_node",
    "ping",
    "query_info",
    "run_rds_demo",
    "serve_echo",
    "serve_info",
    "stress_active",
    "stress_passive",
]
