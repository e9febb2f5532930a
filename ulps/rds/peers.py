"""A node's peer table: one entry per peer node, and the sessions that carry them.

:class:`PeerTable` keeps a :class:`~rdmashim.ulps.rds.peer.Peer` per peer node
(at most ``settings.max_peers``; an idle one makes room, and idle ones expire after
``settings.peer_idle_expiry``), and for each the task that keeps a session up while
there is something to send: the lower address initiates, as Linux RDS does, and
failed attempts back off as Linux's ``rds_queue_reconnect`` does. It is the node's
:class:`~rdmashim.ulps.rds.transport.TransportHost`: the transport connects and
accepts, and hands every new session to :meth:`PeerTable.carry`. Nothing here asks
which transport it has; what differs is in the transport's
:class:`~rdmashim.ulps.rds.transport.Capabilities`.
"""

from __future__ import annotations

import errno
import logging
import random
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

from rdmashim.ulps.rds.connection import Carrier, Deliver, IPAddress, RdsConnection
from rdmashim.ulps.rds.cookie import RdmaStatus
from rdmashim.ulps.rds.errors import RdsError
from rdmashim.ulps.rds.peer import Peer
from rdmashim.ulps.rds.settings import RdsSettings
from rdmashim.ulps.rds.transport import (
    BurstHolder,
    Drivable,
    PeerBusy,
    RdsTransport,
    SessionLost,
    TransportSession,
)

if TYPE_CHECKING:
    from rdmashim.ulps.rds.plain import PlainPath

log = logging.getLogger(__name__)


class PeerTable:
    """The peers of one node and the tasks keeping their sessions up (see the module
    docstring). The node gives it what happens around a session: ``deliver`` and
    ``on_congestion`` for every connection, ``session_starting`` (the node's map and
    probe go first), ``session_ended``, ``burst_held``, ``probe`` and its ``plain``
    path; and, once made for this table, the transport."""

    transport: RdsTransport
    """The node's transport (set by the node right after it made one for this table)."""

    def __init__(
        self,
        address: IPAddress,
        port: int,
        settings: RdsSettings,
        entries: dict[IPAddress, Peer],
        *,
        deliver: Deliver,
        on_congestion: Callable[[RdsConnection, set[int]], None],
        session_starting: Callable[[RdsConnection], None],
        session_ended: Callable[[Carrier], None],
        burst_held: Callable[[BurstHolder], None],
        ack_held: Callable[[BurstHolder], None],
        probe: Callable[[RdsConnection], None],
        plain: PlainPath | None = None,
    ) -> None:
        self.address = address
        self.plain = plain
        """The node's plain-message path in C, for the sessions (None: Python's)."""
        self.port = port
        """The port peers listen on (ours, once the node listens)."""
        self.settings = settings
        self.entries = entries
        """The entries by peer address (a dict the node's congestion maps share)."""
        self._recent: tuple[IPAddress, Peer] | None = None
        """The peer last looked up and its entry: senders name the same address object
        again, and hashing an address costs a Python call."""
        self.nursery: trio.Nursery | None = None
        """Where the connect and session tasks run (the node's, while it runs)."""
        self.expired = 0
        """Entries dropped for idleness (``settings.peer_idle_expiry``) or room."""
        self._deliver = deliver
        self._on_congestion = on_congestion
        self._session_starting = session_starting
        self._session_ended = session_ended
        self._burst_held = burst_held
        self.ack_held = ack_held
        """A session holds back an acknowledgement (the node's readers look at it)."""
        self._probe = probe

    # ------------------------------------------------------------------ the host
    def burst_held(self, session: BurstHolder) -> None:
        """A session holds back the answers to a burst (the node answers them)."""
        self._burst_held(session)

    def probe(self, rds: RdsConnection) -> None:
        """Queue RDS/TCP's handshake probe on ``rds`` (the node's generation in it)."""
        self._probe(rds)

    def entry_for(self, peer: IPAddress, what: str) -> Peer | None:
        """The entry of ``peer`` for a connection coming in, made if need be; None (and
        a warning naming ``what`` was refused) when there is no room."""
        entry = self.entries.get(peer) or self._new_entry(peer)
        if entry is None:
            log.warning(
                "%s from %s refused: %d peers, none idle (max_peers)",
                what, peer, len(self.entries),
            )  # fmt: skip
        return entry

    # ------------------------------------------------------------------ lookups
    def known(self, peer: IPAddress) -> Peer | None:
        """The entry of ``peer``, if the table has one (the one looked up last, when
        ``peer`` is the same address object: no hash, which costs a Python call)."""
        recent = self._recent
        if recent is not None and recent[0] is peer:
            return recent[1]
        entry = self.entries.get(peer)
        if entry is not None:
            self._recent = (peer, entry)
        return entry

    def lookup(self, peer: IPAddress) -> Peer:
        """The entry a sender to ``peer`` uses, made if need be; RdsError saying why
        there is none (a mixed family, no room, a peer found unreachable lately)."""
        entry = self.known(peer)
        if entry is None:
            entry = self._new_peer(peer)
            self._recent = (peer, entry)
        if entry.unreachable is not None and entry.rds.session is None:
            if trio.current_time() >= entry.unreachable_until:
                entry.unreachable = None  # it may be back: this message tries again
                entry.failures = 0
                return entry
            exc = entry.unreachable
            raise RdsError(errno.EHOSTUNREACH, f"no RDS node at {peer}: {exc}") from exc
        return entry

    def _new_peer(self, peer: IPAddress) -> Peer:
        """A new entry for ``peer``, or RdsError saying why there is none."""
        if peer.version != self.address.version:
            raise RdsError(errno.EAFNOSUPPORT, f"{peer} and {self.address} differ in family")
        entry = self._new_entry(peer)
        if entry is None:
            raise RdsError(
                errno.ENOBUFS,
                f"no room for RDS peer {peer}: {len(self.entries)} peers, none idle "
                f"(max_peers={self.settings.max_peers})",
            )
        return entry

    def _new_entry(self, peer: IPAddress) -> Peer | None:
        """A new peer entry, making room for it if need be (None: no room)."""
        if len(self.entries) >= self.settings.max_peers:
            now = trio.current_time()
            idle = [(e.rds.active_at(now), p) for p, e in self.entries.items() if droppable(e)]
            if not idle:
                return None
            self._drop(min(idle)[1], "to make room")
        rds = RdsConnection(
            self.address, peer, self._deliver, on_congestion=self._on_congestion,
            settings=self.settings, last_active=trio.current_time(),
        )  # fmt: skip
        entry = self.entries[peer] = Peer(rds)
        return entry

    def connections(self) -> list[RdsConnection]:
        """Every peer connection, with what its session took without Python settled in
        (:meth:`~.connection.Carrier.settle`: counters and numbers are current)."""
        for entry in self.entries.values():
            if (session := entry.rds.session) is not None:
                session.settle()
        return [p.rds for p in self.entries.values()]

    def drivable(self) -> Drivable | None:
        """What a waiting reader may drive: the CQ of the node's only session, or the
        session itself over TCP (a node with several peers has its messages come from
        several connections)."""
        if len(self.entries) != 1:
            return None
        for entry in self.entries.values():  # (the one: cheaper than next(iter(...)))
            session = entry.rds.session
        if session is None or session.lost:
            return None
        return self.transport.drivable(session)

    # ------------------------------------------------------------------ expiry
    def _drop(self, peer: IPAddress, why: str) -> None:
        entry = self.entries.pop(peer)
        self._recent = None
        self.expired += 1
        entry.forgotten()
        log.info("RDS %s forgets peer %s (%s)", self.address, peer, why)

    async def expire_idle(self) -> None:
        """Close idle sessions and drop idle peer entries (``settings.peer_idle_expiry``)."""
        while True:
            await trio.sleep(min(self.settings.peer_idle_expiry / 4, 1.0))
            self.expire(trio.current_time())

    def expire(self, now: float) -> None:
        """Close the sessions and drop the entries idle at ``now`` (trio's clock)."""
        for peer, entry in list(self.entries.items()):
            rds = entry.rds
            if now - rds.active_at(now) < self.settings.peer_idle_expiry or rds.pending:
                continue
            if entry.session_scope is not None:
                log.debug("RDS %s closes its idle session with %s", self.address, peer)
                entry.session_scope.cancel()
            elif droppable(entry):
                self._drop(peer, f"idle for {now - rds.last_active:.0f} s")

    # ------------------------------------------------------------------ sessions
    def pump(self, entry: Peer) -> None:
        """Something was queued on the peer's connection: its session sends it, or a
        session is started."""
        session = entry.rds.session
        if session is None:
            self.start_connector(entry)
        else:
            session.pump_sends()

    def start_connector(self, entry: Peer) -> None:
        """Start keeping a session to the peer up, unless that is already under way."""
        if entry.connector is None and self.nursery is not None:
            entry.connector = trio.CancelScope()
            self.nursery.start_soon(self._connect, entry, entry.connector)

    async def _connect(self, entry: Peer, scope: trio.CancelScope) -> None:
        """Keep a session to the peer up while there is something to send."""
        rds, settings = entry.rds, self.settings
        window = settings.reconnect_min
        with scope:
            try:
                while rds.session is None and (
                    rds.pending or entry.poked or self._redial_due(entry)
                ):
                    if not rds.canonical and entry.failures == 0:
                        # give the canonical side the first move
                        await trio.sleep(settings.reconnect_min)
                        if rds.connected:  # the peer's connection came meanwhile
                            break
                    refused = rds.counters.sessions_refused
                    if entry.knocked.is_set():
                        entry.knocked = trio.Event()
                    try:
                        await self.transport.connect(entry)
                        if rds.counters.sessions_refused == refused:  # else: backing off on
                            window = settings.reconnect_min
                    except OSError as exc:
                        if isinstance(exc, PeerBusy):
                            # Its RDS answered (rdma_reject): reachable, only busy, as Linux
                            # is while its own connect is under way (ib_cm.c
                            # rds_ib_cm_handle_connect): no step towards giving up.
                            log.info("RDS connect to %s rejected by its RDS: %s", rds.peer, exc)
                        else:
                            entry.failures += 1
                            log.info(
                                "RDS connect to %s failed (%d): %s", rds.peer, entry.failures, exc
                            )
                        if entry.failures >= settings.give_up_after and not rds.counters.sessions:
                            self._unreachable(entry, exc)
                            return
                    # Linux's backoff (rds_queue_reconnect): the window doubles up to a
                    # maximum; we wait in its upper half, so the attempts thin out for sure.
                    # A knock ends the wait: the peer is there now.
                    with trio.move_on_after(random.uniform(window / 2, window)):
                        await entry.knocked.wait()
                    window = min(window * 2, settings.reconnect_max)
            finally:
                entry.connector = None
                entry.connecting = False

    def _redial_due(self, entry: Peer) -> bool:
        """Whether to connect again after losing the session (:attr:`Peer.redial`); not
        once the peer has been idle for ``peer_idle_expiry`` (Linux tries for ever)."""
        if entry.redial:
            now = trio.current_time()
            entry.redial = now - entry.rds.active_at(now) < self.settings.peer_idle_expiry
        return entry.redial

    async def carry(self, entry: Peer, session: TransportSession, peer_ack: int) -> None:
        """Carry the connection on a new session until it ends. ``peer_ack``: the last
        message the peer says it has (RDMA private data; 0 over TCP, where what
        TCP acknowledged is known already)."""
        rds = entry.rds
        if entry.session_scope is not None:
            entry.session_scope.cancel()  # a stale session the peer has given up on
        if rds.session is not None:
            rds.session.settle()  # (what it took without Python: resume reads the numbers)
            rds.session.lost = True
        entry.unreachable = None
        entry.failures = 0
        entry.redial = False
        rds.resume(peer_ack)
        self._session_starting(rds)
        rds.session = session
        rds.last_active = trio.current_time()
        log.debug("RDS session %s -> %s up (peer acked %d)", rds.local, rds.peer, peer_ack)
        with trio.CancelScope() as scope:
            entry.session_scope = scope
            try:
                await session.run()
            except SessionLost as exc:
                log.info("RDS session with %s lost: %s", rds.peer, exc)
                entry.redial = self.transport.capabilities.redial_lost and rds.canonical
            finally:
                if rds.session is session:
                    rds.session = None
                self._session_ended(session)
                rds.last_active = trio.current_time()
                if entry.session_scope is scope:
                    entry.session_scope = None
        if rds.pending or entry.poked or entry.redial:
            self.start_connector(entry)

    def _unreachable(self, entry: Peer, exc: BaseException) -> None:
        rds = entry.rds
        entry.unreachable = exc
        entry.unreachable_until = trio.current_time() + self.settings.unreachable_for
        dropped = rds.drop_all(RdmaStatus.DROPPED, f"RDS node {rds.peer} is unreachable")
        log.warning("RDS node %s unreachable; %d queued messages dropped", rds.peer, dropped)

    def close(self) -> None:
        """The node closes: every queued message is dropped."""
        for entry in self.entries.values():
            entry.rds.drop_all(RdmaStatus.CANCELED, "the RDS node closed")


def droppable(entry: Peer) -> bool:
    """Whether the entry holds nothing that would be lost: no session, no task, no
    message (its sequence numbers start afresh when the peer comes back)."""
    rds = entry.rds
    return (
        rds.session is None and entry.connector is None and entry.session_scope is None
        and not rds.pending and not entry.poked
    )  # fmt: skip
