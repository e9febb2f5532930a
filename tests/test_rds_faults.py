"""RDS under faults: connections cut underneath, and peer processes killed and started again.

What RDS promises, and what these tests hold it to:

* **Connections cut underneath** (the QP moved to ERR, or a TCP reset; over
  RDS/TCP, the connection shut down by one side): nothing
  is lost and nothing is delivered twice; each (sending socket, receiving
  socket) pair sees its messages in order. The connection resends what the
  peer had not acknowledged, flagged as retransmitted; the receiver drops
  flagged messages it already has.
* **The receiving process killed** and started again on the same address: RDS
  acknowledges a message once it is handed to the receiving socket, so the
  sender drops exactly the messages the dead process had; everything it had
  not acknowledged goes again to the new process, whose numbering starts
  afresh (it takes the jump forward, as Linux RDS does). A message the dead
  process had received but not yet acknowledged therefore arrives twice,
  once in each process: no receiver can tell a resend from news when it has
  forgotten everything, and Linux RDS behaves the same. So the assertion is:
  every message delivered at least once across the processes, exactly once
  and in order within each, with duplicates only where one process's
  deliveries end and the next one's begin (and no more of them than the
  sender retransmitted). Delivered here means handed to the socket by RDS:
  the receiving agent reports each message at that moment, before the
  acknowledgement can leave (a message in the socket's queue that the
  application has not read yet dies with the process, acknowledged).
* **The sending process killed** and started again: its new numbering starts
  at 1 again, below what the receiver expects; a first transmission with an
  old number means the peer restarted, and is delivered. What the dead
  process had queued but not sent is gone with it, so each killed sender's
  messages arrive as a prefix of what it sent, in order, each once; the last
  sender's arrive in full.

The connection tests run on both transports; the process tests on RDMA. The
fault helpers reach into private attributes (``Session.qp``, the QP's
``_link.sock``, the trio socket the engine's driver reads), and the receiving
agent overrides ``RdsNode._deliver`` to log: acceptable in a fault injection
test, and named where they are used.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import itertools
import json
import os
import random
import socket
import struct
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import rds_agent
import trio
import trio.lowlevel
from rds_agent import check, payload

from rdmashim import QPState
from rdmashim.ulps.rds.node import RdsError, RdsNode, RdsSocket, Transport
from rdmashim.ulps.rds.rdma_session import Session
from rdmashim.ulps.rds.tcp import TcpSession

import netns
from rdsnodes import transports, wait_until

LOW, HIGH = "127.0.0.1", "127.0.0.2"
"""The test process's node, and the other one (the agent's, in the process tests)."""


async def start_node(address: str, port: int = 0, transport: Transport = "rdma") -> RdsNode:
    node = RdsNode(address, port, transport=transport)
    await node.__aenter__()
    return node


@contextlib.asynccontextmanager
async def node_pair(transport: Transport = "rdma") -> AsyncIterator[tuple[RdsNode, RdsNode]]:
    a = await start_node(LOW, transport=transport)
    try:
        b = await start_node(HIGH, a.port, transport)
        try:
            yield a, b
        finally:
            await b.__aexit__(None, None, None)
    finally:
        await a.__aexit__(None, None, None)


# ---------------------------------------------------------------------- cutting
_libc = ctypes.CDLL(None, use_errno=True)
_AF_UNSPEC = struct.pack("=H14x", socket.AF_UNSPEC)


def live(node: RdsNode) -> Session | TcpSession | None:
    """The node's session with its one peer, if it is up (not lost, QP still in RTS)."""
    (rds,) = node.connections()
    session = rds.session
    if session is None or session.lost:
        return None
    if isinstance(session, Session) and session.qp.state is not QPState.RTS:
        return None
    return session


def tcp_reset(session: Session) -> None:
    """Reset the TCP connection under a session: a RST goes to the peer.

    ``connect(AF_UNSPEC)`` on a connected TCP socket is Linux's
    ``tcp_disconnect()``: it sends a RST, drops what is queued both ways and
    leaves ECONNRESET pending, so both ends see a reset connection. The file
    descriptor stays the driver's (``session.qp._link.sock``: private API).
    Not ``SO_LINGER`` 0 and ``close()``, which also resets: closing the fd
    under the driver makes its pending ``wait_readable`` raise
    ``ClosedResourceError``, which takes the whole node down, and the fd
    number could be reused by the reconnection while the old driver still
    holds it.
    """
    fd = session.qp._link.sock.fileno()
    if _libc.connect(fd, _AF_UNSPEC, len(_AF_UNSPEC)) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"connect(AF_UNSPEC): {os.strerror(code)}")


def qp_error(session: Session) -> None:
    """Move the session's QP to ERR, as a verbs consumer may (the engine ends the connection)."""
    session.qp.modify(qp_state=QPState.ERR)


def tcp_shutdown(session: TcpSession) -> None:
    """Shut an RDS/TCP connection down from one side (``TcpSession.cut``). Not a reset:
    what a reset throws away of what TCP already acknowledged is lost (docs/rds.md)."""
    session.cut()


CUTS: dict[str, dict[str, Callable[[Any], None]]] = {
    "rdma": {"qp-err": qp_error, "tcp-reset": tcp_reset},
    "tcp": {"shutdown": tcp_shutdown},
}


# ---------------------------------------------------------------------- 100k messages
TOTAL = 100_000
CUT_EVERY = 4_000
"""Messages between cuts: 24 cuts in 100,000 messages."""
PORTS = {LOW: [4000, 4001], HIGH: [5000, 5001]}


@pytest.mark.slow
@transports
async def test_100k_messages_across_cuts_none_lost_none_duplicated_in_order(
    transport: Transport,
) -> None:
    """Two sockets per node, traffic both ways, the connection cut every 4,000 messages.

    The cuts alternate between the two nodes and between moving the QP to ERR
    and resetting the TCP connection; each waits for the connection the last
    one broke to be back, so every cut hits a live session.
    """
    rng = random.Random(100_000)
    cuts_here = CUTS[transport]
    async with node_pair(transport) as (a, b):
        socks = {addr: [node.bind(p) for p in PORTS[addr]] for addr, node in ((LOW, a), (HIGH, b))}
        sent: dict[tuple, int] = {}  # (src, dst) -> messages sent (numbered 0..n-1)
        received: dict[tuple, list[int]] = {}
        bad: list[tuple] = []
        progress = {"sent": 0, "received": 0}
        hits = dict.fromkeys(cuts_here, 0)
        idle = [0]  # cuts that found this node with nothing unsent or unacknowledged
        start = trio.current_time()

        async def send(mine: list[RdsSocket], peers: list[RdsSocket], count: int) -> None:
            # One task per node, from both its sockets: two tasks sending to the same
            # peer lose a wake-up (test_two_tasks_sending_to_one_peer_both_finish).
            for i in range(count):
                sock = mine[rng.randrange(len(mine))]
                dst = peers[rng.randrange(len(peers))]
                key = (sock.address, dst.address)
                seq = sent.get(key, 0)
                sent[key] = seq + 1
                await sock.sendto(payload(sock.port, 0, seq), dst.address)
                progress["sent"] += 1
                if i % 16 == 0:
                    await trio.lowlevel.checkpoint()

        async def receive(sock: RdsSocket) -> None:
            while True:
                data, src = await sock.recvfrom()
                (tag, _, seq), ok = check(data)
                received.setdefault((src, sock.address), []).append(seq)
                if not ok or tag != src[1]:
                    bad.append((src, sock.address, seq))
                progress["received"] += 1

        def renewed(cut: list[object]) -> bool:
            """Both nodes have a live session and neither is one the last cut broke."""
            now = [live(a), live(b)]
            return all(s is not None and all(s is not c for c in cut) for s in now)

        async def cut_now_and_then() -> None:
            cut: list[object] = []  # both ends' sessions at the last cut: both must be replaced
            for i in range(1, TOTAL // CUT_EVERY):
                await wait_until(lambda i=i: progress["sent"] >= i * CUT_EVERY, 60, "sending")
                node = (a, b)[i % 2]
                kind = list(cuts_here)[i // 2 % len(cuts_here)]
                # The peer of the node cut last may not have seen that cut yet: its
                # session looks live until it does, and a cut of it would be the
                # same break counted twice.
                await wait_until(lambda cut=cut: renewed(cut), 10, "reconnecting")
                session = live(node)
                assert session is not None
                cut = [live(a), live(b)]
                if not (session.rds.unsent or session.rds.unacked):
                    idle[0] += 1  # nothing in flight: nobody needs to reconnect
                cuts_here[kind](session)
                hits[kind] += 1

        with trio.fail_after(90):
            async with trio.open_nursery() as nursery:
                for sock in socks[LOW] + socks[HIGH]:
                    nursery.start_soon(receive, sock)
                nursery.start_soon(cut_now_and_then)
                async with trio.open_nursery() as senders:
                    for mine, theirs in ((LOW, HIGH), (HIGH, LOW)):
                        senders.start_soon(send, socks[mine], socks[theirs], TOTAL // 2)
                await wait_until(lambda: progress["received"] == TOTAL, 60, "receiving")
                (ab,), (ba,) = a.connections(), b.connections()
                # A cut after the last delivery still has its acks to bring back.
                await wait_until(
                    lambda: not (ab.unacked or ba.unacked), 30, "acknowledging everything"
                )
                nursery.cancel_scope.cancel()
        seconds = trio.current_time() - start

        stats = {
            "messages": progress["received"],
            "seconds": round(seconds, 1),
            "cuts": hits,
            "reconnects": ab.counters.sessions - 1,
            "retransmits": ab.counters.retransmits + ba.counters.retransmits,
            "duplicates dropped": ab.counters.recv_drop_old_seq + ba.counters.recv_drop_old_seq,
        }
        print("RDS 100k under cuts:", stats)
        assert not bad, f"payloads damaged: {bad[:5]}"
        assert sum(sent.values()) == TOTAL == progress["received"]
        assert len(sent) == 8  # every socket sent to both of the other node's sockets
        for key, count in sent.items():
            got = received.get(key, [])
            assert got == list(range(count)), f"{key}: {describe(got, count)}"
        assert min(hits.values()) >= 5, hits
        cuts = sum(hits.values()) - idle[0]
        for rds in (ab, ba):
            assert rds.counters.sessions - 1 >= max(cuts, 10), (rds.counters, hits, idle)
            assert rds.counters.peer_restarts == rds.counters.recv_seq_gaps == 0, rds.counters
        assert stats["retransmits"] > 0  # the resets caught messages in flight


def describe(got: list[int], count: int) -> str:
    """What is wrong with a received sequence (expected 0..count-1)."""
    dups = sorted(s for s, n in collections.Counter(got).items() if n > 1)[:5]
    missing = sorted(set(range(count)) - set(got))[:5]
    pairs = enumerate(zip(got, range(count), strict=False))
    first = next((i for i, (x, y) in pairs if x != y), None)
    return f"{len(got)} of {count}; duplicated {dups}, missing {missing}, first wrong at {first}"


# ---------------------------------------------------------------------- processes
@dataclass
class Process:
    """An agent process and what it reported, read as it comes (``rds_agent.py`` lines)."""

    label: str
    agent: netns.Agent
    seqs: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    """Deliveries it reported, per (sport, dport): the stamps' sequence numbers in order."""
    count: int = 0
    bad: list[Any] = field(default_factory=list)
    ready: trio.Event = field(default_factory=trio.Event)
    up: trio.Event = field(default_factory=trio.Event)
    ended: trio.Event = field(default_factory=trio.Event)
    resulted: trio.Event = field(default_factory=trio.Event)
    result: dict[str, Any] | None = None
    error: str | None = None

    @classmethod
    async def start(cls, nursery: trio.Nursery, label: str, scenario: str, **kw: Any) -> Process:
        agent = await netns.Agent.start(label, rds_agent.argv(scenario, **kw))
        process = cls(label, agent)
        nursery.start_soon(process.follow)
        return process

    async def follow(self) -> None:
        stdout = self.agent.process.stdout
        assert stdout is not None
        rest = b""
        try:
            while chunk := await stdout.receive_some(1 << 16):
                *lines, rest = (rest + chunk).split(b"\n")
                for line in lines:
                    self.take(json.loads(line))
        finally:
            self.ended.set()

    def take(self, message: dict[str, Any]) -> None:
        if "d" in message:
            ip, sport, dport, tag, _incarnation, seq, ok = message["d"]
            self.seqs.setdefault((sport, dport), []).append(seq)
            self.count += 1
            if not ok or tag != sport or ip != LOW:
                self.bad.append(message["d"])
        elif "ready" in message:
            self.ready.set()
        elif "up" in message:
            self.up.set()
        elif "result" in message:
            self.result = message["result"]
            self.resulted.set()
        elif "error" in message:
            self.error = message["error"]

    async def wait(self, event: trio.Event, seconds: float = 20) -> None:
        with trio.move_on_after(seconds):
            async with trio.open_nursery() as nursery:

                async def died() -> None:
                    await self.ended.wait()
                    nursery.cancel_scope.cancel()

                nursery.start_soon(died)
                await event.wait()
                nursery.cancel_scope.cancel()
        if not event.is_set():
            raise self.agent._fail(f"{self.error or 'no answer'} (waiting {seconds} s)")

    async def go(self) -> None:
        """Start a standby receiver's node and wait until it listens."""
        assert self.agent.process.stdin is not None
        await self.agent.process.stdin.send_all(b"go\n")
        await self.wait(self.up)

    async def kill(self) -> None:
        self.agent.process.kill()  # SIGKILL: no chance to close anything itself
        await self.agent.process.wait()
        await self.ended.wait()  # every line it wrote is in

    async def finish(self) -> dict[str, Any]:
        """Let it go, and its result; then kill it (all is delivered: a close is slow)."""
        await self.agent.release()
        await self.wait(self.resulted)
        await self.kill()
        assert self.result is not None
        return self.result


@contextlib.asynccontextmanager
async def processes() -> AsyncIterator[tuple[trio.Nursery, list[Process]]]:
    """A nursery to follow agents in, and the list of them, all ended on the way out."""
    started: list[Process] = []
    try:
        async with trio.open_nursery() as nursery:
            yield nursery, started
            nursery.cancel_scope.cancel()
    finally:
        for process in started:
            await process.agent.aclose()


def stamps_across(runs: list[tuple[str, list[int]]], count: int) -> int:
    """Check one pair's deliveries across receiver processes; return the duplicates.

    Within each process: consecutive numbers, so in order and each once.
    Across them: the first starts at 0, each next one starts no later than
    right after the previous one's last (no gap), the last ends at
    ``count - 1``; together they cover every number.
    """
    for label, seqs in runs:
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), (
            f"{label}: not in order or not each once: {describe(seqs, seqs[-1] + 1)}"
        )
    assert runs[0][1][0] == 0, f"{runs[0][0]} did not start at 0"
    for (before, older), (after, newer) in itertools.pairwise(runs):
        assert newer[0] <= older[-1] + 1, f"gap: {before} to {older[-1]}, {after} from {newer[0]}"
    assert max(seqs[-1] for _, seqs in runs) == count - 1
    assert set().union(*(set(seqs) for _, seqs in runs)) == set(range(count))
    return sum(len(seqs) for _, seqs in runs) - count


async def test_receiver_killed_and_restarted_mid_stream() -> None:
    """The receiver (another process, on HIGH) SIGKILLed 6 times; 64,000 messages.

    Each replacement is started ahead in standby (imported, waiting for
    ``go``), so the receiver is back within milliseconds of the kill: a
    sender that fails ``GIVE_UP_AFTER`` (4) attempts in a row, ~0.35 s,
    declares the peer unreachable and drops what it had queued (see
    ``test_receiver_gone_past_the_give_up_window_is_reported``).
    """
    rng = random.Random(44)
    per_pair, kills, dports = 16000, 6, [5000, 5001]
    a = await start_node(LOW)
    try:
        socks = [a.bind(4000), a.bind(4001)]
        with trio.fail_after(120):
            async with processes() as (nursery, started):

                async def spawn() -> Process:
                    process = await Process.start(
                        nursery, f"receiver#{len(started)}", "receiver", address=HIGH,
                        port=a.port, ports=dports, standby=True,
                    )  # fmt: skip
                    started.append(process)
                    await process.wait(process.ready)
                    return process

                current = await spawn()
                await current.go()
                spare = await spawn()
                failure: list[RdsError] = []
                sent_all = trio.Event()
                downtimes: list[float] = []

                async def send_all() -> None:
                    # One task, both sockets (see the 100k test on why not one task each).
                    try:
                        for seq in range(per_pair):
                            for sock, dport in itertools.product(socks, dports):
                                await sock.sendto(payload(sock.port, 0, seq), (HIGH, dport))
                            if seq % 4 == 0:
                                await trio.lowlevel.checkpoint()
                    except RdsError as exc:
                        failure.append(exc)
                    sent_all.set()

                nursery.start_soon(send_all)
                for k in range(kills):
                    threshold = rng.randrange(1500, 3000)
                    await wait_until(
                        lambda p=current, n=threshold: p.count >= n or bool(failure),
                        30, f"{current.label} receiving",
                    )  # fmt: skip
                    assert not failure, f"the sender gave up on the receiver: {failure[0]}"
                    (rds,) = a.connections()
                    assert rds.unsent or rds.unacked, "nothing left in flight to kill it under"
                    down = trio.current_time()
                    await current.kill()
                    current = spare
                    await current.go()
                    downtimes.append(trio.current_time() - down)
                    if k < kills - 1:
                        spare = await spawn()
                await sent_all.wait()
                assert not failure, f"the sender gave up on the receiver: {failure[0]}"

                def all_in() -> bool:
                    pairs = {(s.port, d) for s in socks for d in dports}
                    return all(
                        any(p.seqs.get(pair, [-1])[-1] == per_pair - 1 for p in started)
                        for pair in pairs
                    )

                await wait_until(all_in, 30, "the last messages")
                result = await current.finish()

        assert [p.bad for p in started] == [[]] * len(started)
        duplicates = 0
        for sport, dport in ((s.port, d) for s in socks for d in dports):
            runs = [(p.label, p.seqs[sport, dport]) for p in started if p.seqs.get((sport, dport))]
            duplicates += stamps_across(runs, per_pair)
        (rds,) = a.connections()
        print(
            f"receiver killed {kills} times: {4 * per_pair} messages, {duplicates} delivered "
            f"twice across processes, {rds.counters.retransmits} retransmitted, "
            f"{rds.counters.sessions} sessions, down {max(downtimes) * 1000:.0f} ms at most"
        )
        assert duplicates <= rds.counters.retransmits
        assert rds.counters.sessions == kills + 1
        # The last receiver started afresh: it took the sender's numbers where they were.
        counters = result["counters"][LOW]
        assert counters["recv_seq_gaps"] == counters["peer_restarts"] == 0, result
    finally:
        await a.__aexit__(None, None, None)


async def test_sender_killed_and_restarted_mid_stream() -> None:
    """The sender (another process, on HIGH) SIGKILLed 4 times, each time started again.

    Each sender process numbers from the clock, above its former self: the
    receiver (this process) takes the jump ahead.
    """
    rng = random.Random(3)
    count, kills = 8000, 4
    a = await start_node(LOW)
    try:
        sock = a.bind(4000)
        received: dict[int, list[int]] = {}  # incarnation -> seqs
        bad: list[Any] = []

        async def receive() -> None:
            while True:
                data, src = await sock.recvfrom()
                (tag, incarnation, seq), ok = check(data)
                received.setdefault(incarnation, []).append(seq)
                if not ok or src != (HIGH, 5000) or tag != 5000:
                    bad.append((src, tag, incarnation, seq, ok))

        thresholds = []
        with trio.fail_after(90):
            async with processes() as (nursery, started):
                nursery.start_soon(receive)
                for incarnation in range(kills + 1):
                    process = await Process.start(
                        nursery, f"sender#{incarnation}", "sender", address=HIGH, port=a.port,
                        sport=5000, dest=[LOW, 4000], count=count, incarnation=incarnation, pace=8,
                    )  # fmt: skip
                    started.append(process)
                    if incarnation == kills:
                        break
                    thresholds.append(rng.randrange(1000, 2500))
                    await wait_until(
                        lambda i=incarnation, p=process: len(received.get(i, ())) >= thresholds[i]
                        or p.ended.is_set(), 30, f"{process.label} sending",
                    )  # fmt: skip
                    assert not process.ended.is_set(), process.agent._fail(f"{process.error}")
                    await process.kill()
                await wait_until(lambda: len(received.get(kills, ())) >= count or
                                 process.ended.is_set(), 30, "the last sender")  # fmt: skip
                assert not process.ended.is_set(), process.agent._fail(f"{process.error}")
                await process.finish()

        assert not bad, bad[:5]
        assert sorted(received) == list(range(kills + 1))
        for incarnation, seqs in sorted(received.items()):
            # Each process's messages: a prefix of what it sent, in order, each once.
            assert seqs == list(range(len(seqs))), f"sender#{incarnation}: {describe(seqs, count)}"
            if incarnation < kills:  # killed in the middle of its stream
                assert thresholds[incarnation] <= len(seqs) < count
        assert len(received[kills]) == count  # the last one's all arrived
        (rds,) = a.connections()
        print(
            f"sender killed {kills} times: received {[len(v) for v in received.values()]}, "
            f"jumps ahead seen {rds.counters.recv_seq_gaps}"
        )
        # Each new sender numbers above its former self (the clock): a jump ahead, taken.
        assert (rds.counters.recv_seq_gaps, rds.counters.peer_restarts) == (kills, 0), rds.counters
    finally:
        await a.__aexit__(None, None, None)


async def test_receiver_gone_for_good_keeps_messages_queued() -> None:
    """The receiver killed and not started again: nothing accepted is dropped.

    A peer that was connected once is retried for as long as there is something
    for it (as Linux RDS does); sendto keeps queuing until the connection's send
    buffer (``sndbuf`` bytes or ``max_queued_messages``) is full, then waits
    (``sendto_nowait`` says WouldBlock). Only a peer that never answered is
    declared unreachable (``test_rds.py``). What the dead process had reported
    stays an in-order prefix.
    """
    a = await start_node(LOW)
    try:
        sock = a.bind(4000)
        async with processes() as (nursery, started):
            receiver = await Process.start(
                nursery, "receiver", "receiver", address=HIGH, port=a.port, ports=[5000]
            )
            started.append(receiver)
            await receiver.wait(receiver.up)
            seq = 0
            with trio.fail_after(20):
                while receiver.count < 500:
                    await sock.sendto(payload(4000, 0, seq), (HIGH, 5000))
                    seq += 1
                    if seq % 8 == 0:
                        await trio.sleep(0.001)
                await receiver.kill()
                with pytest.raises(trio.WouldBlock):
                    while True:
                        sock.sendto_nowait(payload(4000, 0, seq), (HIGH, 5000))
                        seq += 1
                        if seq % 64 == 0:
                            await trio.sleep(0.005)
                await trio.sleep(1.0)  # several reconnect attempts later
        (rds,) = a.connections()
        assert not rds.has_room and (rds.unsent or rds.unacked)
        assert rds.counters.sessions == 1  # retried, never reconnected, nothing dropped
        seqs = receiver.seqs[4000, 5000]
        assert seqs == list(range(len(seqs))) and not receiver.bad
    finally:
        await a.__aexit__(None, None, None)


# ---------------------------------------------------------------------- regressions
@transports
async def test_unreachable_peer_is_tried_again_once_it_is_back(transport: Transport) -> None:
    a = await start_node(LOW, transport=transport)
    try:
        sock = a.bind(4000)
        with trio.fail_after(10):
            while True:  # nobody at HIGH yet: the node gives up on it
                try:
                    await sock.sendto(b"anyone?", (HIGH, 5000))
                except RdsError as exc:
                    assert exc.errno == errno.EHOSTUNREACH
                    break
                await trio.sleep(0.05)
        b = await start_node(HIGH, a.port, transport)
        try:
            inbox = b.bind(5000)
            last: RdsError | None = None
            with trio.move_on_after(5) as scope:
                while True:
                    try:
                        await sock.sendto(b"back?", (HIGH, 5000))
                        break
                    except RdsError as exc:
                        last = exc
                    await trio.sleep(0.1)
            assert not scope.cancelled_caught, f"still unreachable 5 s after it is back: {last}"
            with trio.fail_after(10):
                assert await inbox.recvfrom() == (b"back?", (LOW, 4000))
        finally:
            await b.__aexit__(None, None, None)
    finally:
        await a.__aexit__(None, None, None)


@transports
async def test_two_tasks_sending_to_one_peer_both_finish(transport: Transport) -> None:
    async with node_pair(transport) as (a, b):
        first, second, inbox = a.bind(4000), a.bind(4001), b.bind(5000)
        n, size = 20, 256 * 1024  # 10 MiB through a 4 MiB send buffer: both tasks wait

        async def send(sock: RdsSocket) -> None:
            for _ in range(n):
                await sock.sendto(bytes(size), (HIGH, 5000))

        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(send, first)
                nursery.start_soon(send, second)
                for _ in range(2 * n):
                    await inbox.recvfrom()


@transports
async def test_two_tasks_waiting_for_a_congested_port_both_finish(transport: Transport) -> None:
    from rdmashim.ulps.rds.settings import RCVBUF

    async with node_pair(transport) as (a, b):
        first, second, inbox = a.bind(4000), a.bind(4001), b.bind(5000)
        size = 256 * 1024
        fill, n = RCVBUF // size + 4, 4

        async def send(sock: RdsSocket, count: int) -> None:
            for _ in range(count):
                await sock.sendto(bytes(size), (HIGH, 5000))

        with trio.fail_after(5):
            async with a.monitor_congestion() as updates:
                await send(first, fill)  # unread, past RCVBUF: the port congests
                assert await updates.receive() == (HIGH, {5000})
                (rds,) = a.connections()
                await wait_until(lambda: not rds.unsent and not rds.unacked, 5, "delivering")
            async with trio.open_nursery() as nursery:
                nursery.start_soon(send, first, n)
                nursery.start_soon(send, second, n)
                await trio.sleep(0.2)  # both wait for the port
                for _ in range(fill + 2 * n):
                    await inbox.recvfrom()
