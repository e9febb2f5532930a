"""The bounds of an RDS node: everything a peer can make it hold is limited here.

:class:`RdsSettings` groups them; ``RdsNode(address, settings=RdsSettings(...))``
takes one. Each field says what it bounds, what happens when the bound is hit,
and the Linux RDS setting it follows (``net/rds``), where there is one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rdmashim.verbs.busypoll import check_busy_poll
from rdmashim.verbs.errors import integer

Transport = Literal["rdma", "tcp"]
"""What carries an RDS node's connections: RC queue pairs (``rds_rdma``) or TCP (``rds_tcp``)."""
TRANSPORTS: tuple[Transport, ...] = ("rdma", "tcp")

SNDBUF = 4 * 1024 * 1024
"""Default :attr:`RdsSettings.sndbuf`."""
RCVBUF = 4 * 1024 * 1024
"""Default :attr:`RdsSettings.rcvbuf`."""
BUSY_POLL = 10e-6
"""Default :attr:`RdsSettings.busy_poll`: 10 µs, as librdmacm's rsockets poll their CQ
before they block (``polling_time``)."""


@dataclass(frozen=True, slots=True)
class RdsSettings:
    """Limits and timers of an :class:`~rdmashim.ulps.rds.node.RdsNode`."""

    sndbuf: int = SNDBUF
    """Bytes of messages a peer connection holds, queued or sent but not yet
    acknowledged, before senders wait (``sendto``) or get ``trio.WouldBlock``
    (``sendto_nowait``, Linux's EAGAIN). Linux: ``rds_sk_sndbuf`` (half of
    ``SO_SNDBUF``), counted per socket there, per peer here."""
    max_queued_messages: int = 4096
    """Messages a peer connection holds, queued or unacknowledged, however small
    (an empty message has no bytes to count): the same answer as ``sndbuf``.
    Replies the node makes itself (RDS pongs) are dropped past it. Linux: none."""
    rcvbuf: int = RCVBUF
    """Bytes a socket holds unread before its port is marked congested in the
    map peers receive. Linux: ``rds_sk_rcvbuf`` (half of ``SO_RCVBUF``)."""
    rcvbuf_limit: int = 4 * RCVBUF
    """Bytes a socket holds unread before messages for it are dropped (counted in
    ``node.drops_rcvbuf_full`` and logged): a peer that ignores the congestion
    map cannot fill our memory. Linux: none (it relies on the map)."""
    reconnect_min: float = 0.05
    """Seconds: the first reconnect window. Linux: ``reconnect_min_delay_ms``."""
    reconnect_max: float = 8.0
    """Seconds: the window doubles after each failed attempt up to this. Each
    attempt waits a random time in the upper half of the window (Linux waits
    anywhere in ``[0, window)``). Linux: ``reconnect_max_delay_ms`` (1 s)."""
    give_up_after: int = 4
    """Failed attempts in a row, to a peer never reached, after which it is
    unreachable: its queued messages are dropped and sendto raises EHOSTUNREACH.
    A peer reached once is retried while there is something for it (as Linux)."""
    unreachable_for: float = 2.0
    """Seconds sendto reports an unreachable peer as such before trying it again."""
    max_peers: int = 256
    """Peer entries (connections, up or down) the node keeps. At the bound, the
    entry idle the longest is dropped; when none is idle, a new peer's connect
    is rejected and a sendto to a new peer raises ENOBUFS. Linux: none."""
    peer_idle_expiry: float = 60.0
    """Seconds without a message either way, with nothing queued, after which
    a peer's session is closed and its entry (sequence numbers, counters,
    congestion map) dropped. Linux keeps connections until the module unloads."""
    busy_poll: float = BUSY_POLL
    """Seconds a waiting ``recvfrom`` polls for a message, after the last bytes came,
    before it blocks (0: at once): busy polling, the CPU time traded for the wake-up of
    an idle CPU (:mod:`rdmashim.verbs.busypoll`; it sets ``busy_poll`` on the sessions'
    CQs). ``math.inf`` never blocks. The default's 10 µs is rsockets' (librdmacm's
    ``polling_time``): in a request-and-answer exchange on two CPUs the answer often
    comes within it, and each wait it catches saves a sleep and a wake-up (tens of
    µs where idle vCPUs halt: rds stress ``-d 1`` over RDS/TCP 0.71 of raw TCP's rate
    blocking at once, 1.11 polling 10 µs; over RDMA 1.89 polling). Linux:
    ``SO_BUSY_POLL`` on a socket, ``net.core.busy_read`` (0 by default)."""

    def __post_init__(self) -> None:
        counts = ("sndbuf", "max_queued_messages", "rcvbuf", "rcvbuf_limit", "max_peers")
        for name in (*counts, "give_up_after"):
            value = getattr(self, name)
            number = integer(value)
            if number is None or number < 1:
                raise ValueError(f"RdsSettings.{name} must be an integer, at least 1: {value!r}")
            object.__setattr__(self, name, number)  # (a numpy integer, say, kept as an int)
        if self.rcvbuf_limit < self.rcvbuf:
            raise ValueError("RdsSettings.rcvbuf_limit must be at least rcvbuf")
        if not 0 < self.reconnect_min <= self.reconnect_max:  # (NaN fails each comparison)
            raise ValueError("RdsSettings needs 0 < reconnect_min <= reconnect_max")
        check_busy_poll(self.busy_poll)
        if not (self.unreachable_for >= 0 and self.peer_idle_expiry > 0):
            raise ValueError(
                "RdsSettings.unreachable_for must be at least 0 and peer_idle_expiry above 0"
            )
