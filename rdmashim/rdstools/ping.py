"""rds-ping over our RDS: :func:`ping`, and :func:`serve_echo` for the pinged node."""

from __future__ import annotations

import ipaddress
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from rdmashim.rdstools.common import bind_any, serve_answers
from rdmashim.rdstools.defaults import ECHO_PORT
from rdmashim.ulps.rds.node import RdsError, RdsNode, RdsSocket

log = logging.getLogger(__name__)

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


async def serve_echo(
    node: RdsNode,
    port: int = ECHO_PORT,
    *,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Send every message arriving at ``port`` back to its sender (the pinged side)."""

    def echo(data: bytes, sender: tuple[str, int]) -> bytes:
        log.debug("echo %d bytes to %s:%d", len(data), *sender)
        return data

    await serve_answers(node, port, echo, task_status)
