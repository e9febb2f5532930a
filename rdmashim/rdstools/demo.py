"""Several RDS nodes messaging all-to-all through connection cuts (``rdmashim rds demo``)."""

from __future__ import annotations

import ipaddress
import random
import struct
import time
import zlib
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field, fields

import trio

from rdmashim.rdstools.common import busy_any, node_error, port_name
from rdmashim.rdstools.defaults import DEMO_MIN_SIZE
from rdmashim.rdstools.info import format_info
from rdmashim.ulps.rds.connection import RdsConnection
from rdmashim.ulps.rds.node import RdsNode
from rdmashim.ulps.rds.settings import Transport
from rdmashim.ulps.rds.wire import RDS_MAX_MSG_SIZE

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


async def _start_nodes(
    stack: AsyncExitStack, addresses: Sequence[str], port: int, transport: Transport
) -> list[RdsNode]:
    """Nodes on ``addresses``, all on one CM port (``0``: a free one, retried on a clash)."""
    for attempt in range(5):
        nodes: list[RdsNode] = []
        inner = AsyncExitStack()
        chosen = port
        try:
            for address in addresses:
                node = await inner.enter_async_context(
                    RdsNode(address, chosen, transport=transport)
                )
                chosen = node.port
                nodes.append(node)
        except OSError as exc:
            await inner.aclose()
            if port or attempt == 4:
                raise node_error(exc, address, chosen, transport) from exc
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
    transport: Transport = "rdma",
    on_progress: Callable[[DemoProgress], None] = lambda p: None,
    on_event: Callable[[str], None] = lambda text: None,
) -> DemoResult:
    """Several nodes on loopback addresses, every socket sending to every other.

    Each message carries its sender, a sequence number per (sender, receiver)
    and a CRC32 of its payload; receivers check that each arrives exactly once,
    in order, intact. ``cuts`` times during the run, a live connection is cut
    underneath (its QP moved to ERR, as a broken link would; over TCP, one side
    shuts the connection down); RDS reconnects
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
        all_nodes = await _start_nodes(stack, addresses, cm_port, transport)
        socks = [node.bind(DEMO_PORT) for node in all_nodes]
        on_event(
            f"{nodes} RDS nodes on {', '.join(addresses)} "
            f"({port_name(transport)} {all_nodes[0].port}), "
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
            session.cut()
            cut = DemoCut(time.perf_counter() - t0, addresses[side], addresses[other])
            result.cuts.append(cut)
            on_event(
                f"{cut.at:5.1f} s  cut the connection {cut.local} -> {cut.peer} underneath "
                f"({'its QP to ERR' if transport == 'rdma' else 'a TCP shutdown'}); "
                "the senders carry on"
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
