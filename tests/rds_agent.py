"""One RDS node in its own process, for the RDS fault and multi-host tests.

Started as ``python rds_agent.py SCENARIO KWARGS-JSON``: directly (another
process on a loopback address, one the test can kill and start again) or
inside a network namespace through ``netns.Host``-style ``ip netns exec``
(:func:`argv` builds either command line). Like ``netns_agent.py`` it writes
JSON lines to stdout, flushed one by one: progress, then ``{"result": ...}``,
or ``{"error": traceback}``; ``netns.Agent`` reads them.

Scenarios:

``receiver``
    A node that logs every message **when RDS hands it to the socket**, before
    the acknowledgement covering it can leave (see :class:`LoggingNode`), as
    ``{"d": [sender ip, sport, dport, tag, incarnation, seq, content ok]}``.
    With ``standby`` it first imports everything, says ``{"ready": true}`` and
    waits for a ``go`` line on stdin, so a test can replace a killed receiver
    within milliseconds rather than a Python start-up's ~0.3 s.
``sender``
    Sends ``count`` stamped messages from one socket to one destination (at a
    given pace), reporting ``{"sent": n}`` now and then; when all are acknowledged it
    reports its counters and lingers until stdin closes.
``mesh``
    One node of an all-to-all test: says ``{"up": ...}``, waits for ``go``,
    sends ``count`` messages from each of its sockets to each socket of each
    peer while receiving, and reports, per (sender, receiving port) pair, the
    sequence numbers received in order and how many failed the content check.

Every payload carries a stamp, ``STAMP`` = (tag, incarnation, seq): the tag
names the sending socket (its port), the incarnation its process (a sender
started again numbers from 0 again) and seq counts that socket's messages to
one destination. The rest of the payload is the stamp repeated, to a length
that is a function of the stamp (:func:`size_of`), so the receiver checks
length and content without being told either; about one message in 40 is
longer than an RDS fragment (4 KiB) and travels as several.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import sys
import traceback
from pathlib import Path
from typing import Any

import trio

from rdmashim.ulps.rds import plain
from rdmashim.ulps.rds.node import RdsNode, RdsSocket
from rdmashim.ulps.rds.settings import Transport

AGENT = Path(__file__)
STAMP = struct.Struct("!HHI")
"""(tag, incarnation, seq) at the start of every payload."""
Stamp = tuple[int, int, int]


# ---------------------------------------------------------------------- payloads
def size_of(tag: int, incarnation: int, seq: int) -> int:
    """The payload length for a stamp: mostly small, now and then several fragments."""
    h = (seq * 2654435761 + tag * 40503 + incarnation * 7919) & 0xFFFFFFFF
    if h % 40 == 0:
        return 4097 + (h >> 8) % 12000  # two to four fragments
    return STAMP.size + (h >> 8) % 300


def payload(tag: int, incarnation: int, seq: int) -> bytes:
    """The message stamped (tag, incarnation, seq), stamp repeated to its length."""
    stamp = STAMP.pack(tag, incarnation, seq)
    size = size_of(tag, incarnation, seq)
    return (stamp * (size // STAMP.size + 1))[:size]


def check(data: bytes) -> tuple[Stamp, bool]:
    """The stamp of a received payload, and whether the payload is exactly as sent."""
    stamp: Stamp = STAMP.unpack_from(data)
    return stamp, len(data) >= STAMP.size and data == payload(*stamp)


# ---------------------------------------------------------------------- plumbing
def emit(**message: Any) -> None:
    print(json.dumps(message, separators=(",", ":")), flush=True)


def argv(scenario: str, netns: str | None = None, **kwargs: Any) -> list[str]:
    """The command line that runs ``scenario`` (inside ``netns`` if given)."""
    command = [sys.executable, str(AGENT), scenario, json.dumps(kwargs)]
    return ["ip", "netns", "exec", netns, *command] if netns else command


class Stdin:
    """Lines from the test on stdin; end of file means the test let us go."""

    def __init__(self) -> None:
        self.stream = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
        self.buffer = b""

    async def line(self) -> bytes | None:
        """The next line, or None at end of file."""
        while b"\n" not in self.buffer:
            chunk = await self.stream.receive_some(4096)
            if not chunk:
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line

    async def until_closed(self) -> None:
        while await self.line() is not None:
            pass


class LoggingNode(RdsNode):
    """A node that reports every message as RDS delivers it to a socket.

    ``_deliver`` runs before the session acknowledges the message (the ack
    goes out after the batch of completions it came in), and the report is
    written to the pipe before it returns: whatever the sender was told has
    arrived has been reported, even if this process is killed the next moment.
    """

    def __init__(self, address: str, port: int) -> None:
        plain.use(False)  # every message through _deliver (C queues plain ones itself)
        super().__init__(address, port)

    def _deliver(
        self, peer: Any, seq: int, sport: int, dport: int, extensions: Any, data: bytes
    ) -> None:
        (tag, incarnation, number), ok = check(data)
        emit(d=[str(peer), sport, dport, tag, incarnation, number, ok])
        super()._deliver(peer, seq, sport, dport, extensions, data)


async def drain(sock: RdsSocket) -> None:
    """Read a socket forever (the log was written at delivery)."""
    while True:
        await sock.recvfrom()


def counters(node: RdsNode) -> dict[str, dict[str, int]]:
    return {str(rds.peer): dataclasses.asdict(rds.counters) for rds in node.connections()}


# ---------------------------------------------------------------------- scenarios
async def receiver(address: str, port: int, ports: list[int], standby: bool = False) -> dict:
    """Log every delivery (see the module docstring) until stdin closes."""
    stdin = Stdin()
    if standby:
        emit(ready=True)
        if await stdin.line() is None:
            return {"started": False}
    async with LoggingNode(address, port) as node, trio.open_nursery() as nursery:
        for p in ports:
            nursery.start_soon(drain, node.bind(p))
        emit(up=node.port)
        await stdin.until_closed()
        emit(result={"started": True, "counters": counters(node)})  # before the slow close
        nursery.cancel_scope.cancel()
    return {}


async def sender(
    address: str,
    port: int,
    sport: int,
    dest: list[Any],
    count: int,
    incarnation: int,
    pace: int = 0,
) -> dict:
    """Send ``count`` stamped messages; report when all are acknowledged; linger.

    With ``pace``, sleep a millisecond after every ``pace`` messages (a stream
    a test can kill in the middle of, rather than a burst).
    """
    stdin = Stdin()
    async with RdsNode(address, port) as node:
        sock = node.bind(sport)
        emit(up=node.port)
        target = (dest[0], dest[1])
        for seq in range(count):
            await sock.sendto(payload(sport, incarnation, seq), target)
            if seq % 200 == 0:
                emit(sent=seq + 1)
                await trio.lowlevel.checkpoint()
            if pace and seq % pace == 0:
                await trio.sleep(0.001)
        (rds,) = node.connections()
        while rds.unsent or rds.unacked:  # noqa: ASYNC110 - no event tells this
            await trio.sleep(0.01)
        emit(result={"sent": count, "counters": counters(node)})
        await stdin.until_closed()
    return {}


async def mesh(
    address: str,
    port: int,
    ports: list[int],
    peers: list[str],
    count: int,
    transport: Transport = "rdma",
) -> dict:
    """Send ``count`` messages from every local socket to every peer socket; check arrivals."""
    stdin = Stdin()
    expected = count * len(peers) * len(ports) * len(ports)
    got: dict[str, list[int]] = {}
    bad: dict[str, int] = {}
    async with RdsNode(address, port, transport=transport) as node:
        socks = [node.bind(p) for p in ports]
        emit(up=node.port)
        if await stdin.line() is None:
            return {"started": False}
        start = trio.current_time()
        done = trio.Event()

        async def send() -> None:
            # One task for all sockets: two tasks sending to one peer can lose a wake-up
            # while they wait for room (see test_rds_faults.py's known bugs).
            targets = [(peer, p) for peer in peers for p in ports]
            for seq in range(count):
                for sock in socks:
                    for target in targets:  # interleaved: every pair is in flight at once
                        await sock.sendto(payload(sock.port, 0, seq), target)
                await trio.lowlevel.checkpoint()

        async def receive(sock: RdsSocket) -> None:
            while True:
                data, (ip, sport) = await sock.recvfrom()
                (tag, _, seq), ok = check(data)
                key = f"{ip}:{sport}>{sock.port}"
                got.setdefault(key, []).append(seq)
                bad[key] = bad.get(key, 0) + (not ok or tag != sport)
                if sum(map(len, got.values())) == expected:
                    done.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send)
            for sock in socks:
                nursery.start_soon(receive, sock)
            await done.wait()
            elapsed = trio.current_time() - start
            emit(result={"got": got, "bad": bad, "seconds": elapsed, "counters": counters(node)})
            await stdin.until_closed()  # peers may still want our acks
            nursery.cancel_scope.cancel()
    return {}


SCENARIOS = {f.__name__: f for f in (receiver, sender, mesh)}


def main() -> None:
    scenario, kwargs = sys.argv[1], json.loads(sys.argv[2])
    try:
        result = trio.run(lambda: SCENARIOS[scenario](**kwargs))
    except BaseException:
        emit(error=traceback.format_exc())
        sys.exit(1)
    if result:
        emit(result=result)


if __name__ == "__main__":
    main()
