"""One peer node's entry in a node's peer table: its connection and what keeps it up.

The entry is what the node (:mod:`.peers`) and its transport (:mod:`.transport`)
share about one peer: the sans-IO :class:`~rdmashim.ulps.rds.connection.RdsConnection`,
whether a connect is under way and the task keeping a session up, why the peer
counts as unreachable, and the events senders wait on (room in the queue, a port
of the peer no longer congested).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import trio

from rdmashim.ulps.rds.connection import RdsConnection


@dataclass(eq=False)
class Peer:
    """A peer node: its connection and the task that keeps a session up."""

    rds: RdsConnection
    connecting: bool = False
    poked: bool = False
    """RDS/TCP: the peer connected to ask us, the lower address, to connect."""
    redial: bool = False
    """RDS/TCP: our session, the lower address's, ended without our closing it. Linux's
    higher address never connects again by itself: it knocks only when it sends anew,
    and waits for the lower one with whatever it had not delivered (``threads.c``
    ``rds_queue_reconnect``), so we connect again, as Linux's lower address does, until
    a session is up or the peer has been idle for ``peer_idle_expiry``."""
    knocked: trio.Event = field(default_factory=trio.Event)
    """RDS/TCP: set by a knock, which ends the wait between our attempts to connect:
    the peer is there now."""
    connector: trio.CancelScope | None = None
    session_scope: trio.CancelScope | None = None
    unreachable: BaseException | None = None
    unreachable_until: float = 0.0
    failures: int = 0
    uncongested: trio.Event = field(default_factory=trio.Event)
    """Set when a port of the peer stops being congested (senders wait on it)."""
    room: trio.Event = field(default_factory=trio.Event)
    """Set when the connection's queue may have room again (senders wait on it)."""

    def __post_init__(self) -> None:
        self.rds.on_room = self.room_opened

    @property
    def live(self) -> bool:
        """Whether a session carries the connection and has not broken."""
        session = self.rds.session
        return session is not None and not session.lost

    def room_opened(self) -> None:
        """The connection's ``on_room``: wake the senders waiting for room."""
        self.room.set()

    async def wait_room(self) -> None:
        """Wait until the connection's queue has room for another message."""
        rds = self.rds
        while not rds.has_room:
            if self.room.is_set():  # shared by every waiter: replacing it strands the others
                self.room = trio.Event()
            rds.room_wanted = True
            if (session := rds.session) is not None:
                session.want_acks()  # (may make the room: the wait then returns at once)
            await self.room.wait()

    async def wait_uncongested(self) -> None:
        """Wait until a port of the peer stops being congested (or the entry goes)."""
        if self.uncongested.is_set():  # shared by every waiter, as wait_room's
            self.uncongested = trio.Event()
        await self.uncongested.wait()

    def forgotten(self) -> None:
        """The node dropped the entry: senders waiting on it look the peer up again."""
        self.uncongested.set()
        self.room.set()
