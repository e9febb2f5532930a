"""One RDS connection's state: numbered, reliable, ordered messages to one peer node.

Sans-IO: no trio, no verbs, no sockets. An :class:`RdsConnection` outlives the
sessions (RC connections or TCP connections, :mod:`.transport`) it runs on. It
numbers every message and keeps it until the peer acknowledges it; a session
takes messages from :attr:`RdsConnection.unsent` (moving them to
:attr:`RdsConnection.unacked`) and reports acknowledgements (:meth:`~RdsConnection.acked`)
and whole received messages (:meth:`~RdsConnection.received`). When a session
breaks, whatever the peer had not acknowledged is sent again on the next one
(:meth:`~RdsConnection.resume`), flagged RETRANSMITTED; the receiver drops what it
already has. Nothing is lost and nothing is delivered twice. A message carrying an
RDMA operation (:mod:`.rdma`) is the exception: it is never sent twice, and a
broken session drops it with a status saying so.

What happens next is told through callbacks (``deliver``, ``on_congestion``,
``on_room``), and time comes in as arguments (:meth:`~RdsConnection.active_at`):
the object never reads a clock. Over RDMA the per-session credits,
acknowledgements and fragments are :mod:`.rdma_flow`'s, equally sans-IO.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv6Address
from typing import TYPE_CHECKING, Protocol

from rdmashim.ulps.rds.cookie import RdmaStatus
from rdmashim.ulps.rds.settings import RdsSettings
from rdmashim.ulps.rds.wire import (
    RDS_FRAG_SIZE,
    CongestionMap,
    Extension,
    RdsFlag,
    RdsHeader,
    RdsProtocolError,
)

if TYPE_CHECKING:
    from rdmashim.ulps.rds.rdma import RdmaOp, Sources

log = logging.getLogger(__name__)

IPAddress = IPv4Address | IPv6Address
Deliver = Callable[[IPAddress, int, int, int, "tuple[Extension, ...]", bytes], None]
"""What a connection hands each new message to: (peer, its sequence number, source
port, destination port, extension headers, data). Fields, not an :class:`RdsHeader`:
the RDMA session reads a plain message's header in place and makes none."""


class Carrier(Protocol):
    """What carries a connection now: a session of its transport (:mod:`.transport`)."""

    lost: bool
    """The session broke or ended; it carries nothing more."""

    def pump_sends(self) -> None:
        """Something was queued: send what the session can now (never blocks)."""

    def want_acks(self) -> None:
        """A sender waits for room: acknowledgements the session took without Python
        reach the connection now, and the next ones as they come (:meth:`RdsConnection.acked`)."""

    def cut(self) -> None:
        """Break the connection underneath, as a failure would (tests, the demo)."""

    def settle(self) -> None:
        """What the session took without Python (messages, acknowledgements) reaches the
        connection's numbers and counters now, not at the session's next look."""

    def send_plain(self, sport: int, dport: int, data: bytes, rdma: RdmaOp | None = None) -> bool:
        """Send a plain message (no flags or extension; at most an RDMA operation it
        chases, registered already) at once, numbered as the connection's next
        (:meth:`RdsConnection.sent`), when nothing else of the connection waits to go;
        False: queue it (:meth:`RdsConnection.queue`) instead."""


class DirectSends(Protocol):
    """A session's way to send a socket's plain message, or one chasing an RDMA Write,
    without the connection: the message is numbered and sent in one call into C
    (``rp_sendto``, RDS's C path), and the connection hears of it when :meth:`sync`
    brings it in. A socket's ``sendto`` calls :attr:`sendto` (:meth:`sendto_write`),
    keeps what went in :attr:`log` and, when told, posts it with :attr:`run`."""

    @property
    def sendto(self) -> Callable[[int, int, bytes, int], int]:
        """``sendto(sport, dport, data, len(data))``: 1 when it went (numbered next and
        posted), 2 when :attr:`run` must still post it, 0 when the connection must take
        it (its gate is closed, no room, a congested port, ...)."""

    def sendto_write(
        self, sport: int, dport: int, data: bytes, op: RdmaOp, sources: Sources
    ) -> int:
        """:attr:`sendto` for a message chasing the RDMA Write ``op`` (a new one, from
        ``bytes`` whose registration the node keeps in ``sources``); 0 leaves ``op`` as it
        was."""

    @property
    def log(self) -> list[tuple[int, int, bytes, RdmaOp | None]]:
        """What went, (sport, dport, data, its RDMA Write or None) in order, until
        :meth:`sync` brings it in."""

    @property
    def run(self) -> Callable[[], object]:
        """Post what :attr:`sendto` staged."""

    def sync(self) -> None:
        """Close the gate (every later message goes through the connection until the
        session opens it again) and bring in what went: numbered, kept for the peer's
        acknowledgement and counted (:meth:`RdsConnection.sent_directly`)."""


@dataclass(eq=False, slots=True)
class OutMessage:
    """A message on its way: numbered, kept until the peer acknowledges it."""

    seq: int
    sport: int
    dport: int
    data: bytes
    flags: RdsFlag = RdsFlag.NONE
    rdma: RdmaOp | None = None
    extensions: tuple[Extension, ...] = ()
    own: bool = False
    """The node's own message (a congestion map, a ping reply, a handshake probe):
    worth no reconnect, and kept by no peer entry."""

    @property
    def fragments(self) -> int:
        return max(1, -(-len(self.data) // RDS_FRAG_SIZE))


@dataclass(slots=True)
class Counters:
    """What a connection counted (the rds-info counters that apply)."""

    send_messages: int = 0
    send_bytes: int = 0
    recv_messages: int = 0
    recv_bytes: int = 0
    retransmits: int = 0
    recv_drop_old_seq: int = 0
    recv_seq_gaps: int = 0
    peer_restarts: int = 0
    acks_sent: int = 0
    credit_waits: int = 0
    sessions: int = 0
    sessions_refused: int = 0
    """RDS/TCP sessions that ended before the peer sent a byte: its RDS refused the
    connection. Linux resets one that arrives while its own connect to us is under
    way (``tcp_listen.c`` ``rds_tcp_accept_one``: the path is not DOWN)."""
    cong_updates_sent: int = 0
    """Congestion maps sent (one at the start of every session, and on each change)."""
    cong_updates_received: int = 0
    """Congestion maps the peer sent (Linux's ``s_cong_update_received``)."""
    rdma_writes: int = 0
    rdma_reads: int = 0
    rdma_bytes: int = 0
    rdma_failures: int = 0
    rdma_dropped: int = 0
    replies_dropped: int = 0
    """RDS pongs not sent because the connection's queue was full."""


@dataclass(eq=False)
class RdsConnection:
    """Ordered, reliable delivery of RDS messages to one peer node."""

    local: IPAddress
    peer: IPAddress
    deliver: Deliver
    """Called for each new message, in order (see :data:`Deliver`)."""
    unsent: deque[OutMessage] = field(default_factory=deque)
    unacked: deque[OutMessage] = field(default_factory=deque)
    next_seq: int = field(default_factory=time.time_ns)
    """The sequence number of our next message. The first is the wall clock in
    nanoseconds, as TCP picks its initial sequence number from a clock: a new entry
    for the peer (after this process restarted, or the entry expired) numbers above
    anything an earlier one sent, so a peer that kept its receive state (Linux's
    ``cp_next_rx_seq`` lives as long as the module) never takes a message we send
    again after a reconnect, flagged RETRANSMITTED, for one it has seen
    (``recv.c`` ``rds_recv_incoming``). Linux starts at 1."""
    next_recv: int = 1
    """The sequence number of the next new message from the peer."""
    heard: bool = False
    """Whether a numbered message has come from the peer: the first one sets
    :attr:`next_recv` wherever the peer's numbering starts."""
    numbered_from: int = 1
    """The number the peer's current numbering started at (as far as we took it)."""
    earlier: tuple[int, int] | None = None
    """The first and last numbers we took from the peer before it last restarted its
    numbering: a resend numbered between them, while they lie above the new numbers, is
    a duplicate (see :meth:`received`)."""
    counters: Counters = field(default_factory=Counters)
    on_congestion: Callable[[RdsConnection, set[int]], None] = lambda rds, ports: None
    """Called with the ports whose congestion bit changed in the peer's map."""
    peer_congestion: CongestionMap = field(default_factory=CongestionMap)
    """The peer node's congestion map: its ports whose receivers are full."""
    session: Carrier | None = None
    """The session carrying the connection now (set and cleared by the node's peers)."""
    map_out: bytes | None = None
    """The congestion map waiting to go out. Maps go outside the sequence (number 0,
    never resent), between messages, as Linux's ``rds_cong_update_alloc`` makes them
    and ``rds_send_xmit`` sends them on either transport."""
    peer_generation: int = 0
    """The peer's generation number from its handshake probe (0: none seen)."""
    queued_bytes: int = 0
    settings: RdsSettings = field(default_factory=RdsSettings)
    """The bounds of the queue (``sndbuf``, ``max_queued_messages``)."""
    last_active: float = 0.0
    """When (the caller's clock) a session began or ended, or a message was last queued
    or received as of :meth:`active_at`'s last look (messages and maps only set
    :attr:`busy`: a clock read per message costs more than the node's idle check needs)."""
    busy: bool = False
    """A message or map was queued or received since :attr:`last_active` was set."""
    on_room: Callable[[], None] = lambda: None
    """Called when the queue may have room again: after an acknowledgement that made
    room while :attr:`room_wanted`, and whenever messages are dropped."""
    room_wanted: bool = False
    """A sender waits for room (acknowledgements look at the room only then); the
    waiter sets it, :meth:`acked` clears it when it calls :attr:`on_room`."""
    direct: DirectSends | None = None
    """The session's way of sending without the connection, while it is open (the session
    sets it, and :meth:`DirectSends.sync` clears it): what went that way is brought in
    before the connection's outgoing state is read or changed."""

    def active_at(self, now: float) -> float:
        """When the connection was last active, as seen at ``now`` (the caller's clock): a
        message since the last look counts as activity now."""
        if self.busy:
            self.busy = False
            self.last_active = now
        return self.last_active

    @property
    def connected(self) -> bool:
        """Whether a session carries the connection now."""
        return self.session is not None

    @property
    def canonical(self) -> bool:
        """Whether this side initiates (the lower address, as Linux RDS)."""
        return int(self.local) < int(self.peer)

    # ------------------------------------------------------------------ sending
    def queue(
        self,
        sport: int,
        dport: int,
        data: bytes,
        flags: RdsFlag = RdsFlag.NONE,
        rdma: RdmaOp | None = None,
        *,
        extensions: tuple[Extension, ...] = (),
        own: bool = False,
    ) -> None:
        """Number a message and queue it; the session takes it when it pumps next
        (:meth:`Carrier.pump_sends`, which the caller calls).

        ``rdma``, an operation whose local buffer is registered already, runs
        just before the message on the same session. ``own`` marks the node's
        own messages (see :attr:`OutMessage.own`).
        """
        self._bring_in()
        data = bytes(data)
        self.unsent.append(
            OutMessage(self._number(data), sport, dport, data, flags, rdma, extensions, own)
        )

    def sent(self, sport: int, dport: int, data: bytes, rdma: RdmaOp | None = None) -> None:
        """Number and keep a plain message that its session sent at once, as the
        connection's next (:meth:`Carrier.send_plain`): it waits for the peer's
        acknowledgement as a queued one does once sent."""
        self._bring_in()
        self._keep(sport, dport, data, rdma)

    def _bring_in(self) -> None:
        """What the session sent without the connection reaches it first (:attr:`direct`)."""
        if self.direct is not None:
            self.direct.sync()

    def sent_directly(self, log: list[tuple[int, int, bytes, RdmaOp | None]]) -> None:
        """The messages (sport, dport, data, the RDMA Write each chases or None) a session
        sent without the connection (:class:`DirectSends`), in order: numbered next and
        kept as :meth:`sent` keeps one (the session numbered them so in C)."""
        for sport, dport, data, rdma in log:
            self._keep(sport, dport, data, rdma)

    def _keep(self, sport: int, dport: int, data: bytes, rdma: RdmaOp | None) -> None:
        """Number a message sent at once and keep it for the peer's acknowledgement (its
        RDMA Write, if any, counted: it was posted with it)."""
        self.unacked.append(OutMessage(self._number(data), sport, dport, data, rdma=rdma))
        if rdma is not None:
            counters = self.counters
            counters.rdma_bytes += rdma.length
            counters.rdma_writes += 1

    def _number(self, data: bytes) -> int:
        """The next message's number, and its count in the queue and the counters."""
        seq = self.next_seq
        self.next_seq = seq + 1
        self.busy = True
        self.queued_bytes += len(data)
        counters = self.counters
        counters.send_messages += 1
        counters.send_bytes += len(data)
        return seq

    def queue_map(self, data: bytes) -> None:
        """Queue our congestion map; it replaces one still waiting to go out.

        A map is a state, not a change: of several unsent ones only the last
        counts, so a peer flipping our ports cannot make us queue maps without
        bound. The newest waits in :attr:`map_out` and goes before the next
        message (a session breaking under it loses it: every session starts
        with a fresh one).
        """
        self._bring_in()  # (the map goes before any later message)
        self.map_out = bytes(data)
        self.counters.cong_updates_sent += 1

    @property
    def pending(self) -> bool:
        """Whether messages of sockets wait to be sent or acknowledged. The node's own
        (congestion maps, pongs, probes) do not count: every session starts with a
        fresh map, and a pong is worth no reconnect, nor keeps a peer entry."""
        self._bring_in()
        return any(not m.own for queue in (self.unsent, self.unacked) for m in queue)

    @property
    def queued_messages(self) -> int:
        """Messages queued or sent and not yet acknowledged."""
        self._bring_in()
        return len(self.unsent) + len(self.unacked)

    @property
    def has_room(self) -> bool:
        """Whether another message may be queued without waiting."""
        self._bring_in()
        settings = self.settings  # (inline: a test per message)
        return (
            self.queued_bytes < settings.sndbuf
            and len(self.unsent) + len(self.unacked) < settings.max_queued_messages
        )

    def acked(self, ack: int) -> None:
        """The peer has every message up to ``ack``."""
        if ack >= self.next_seq:  # (it covers some that went through the gate: in first)
            self._bring_in()
        unacked = self.unacked
        if not unacked or unacked[0].seq > ack:
            return  # nothing new: the room did not change
        while unacked and unacked[0].seq <= ack:
            msg = unacked.popleft()
            self.queued_bytes -= len(msg.data)
            if msg.rdma is not None:  # it arrived, so its RDMA operation is done
                msg.rdma._finish(RdmaStatus.SUCCESS)
        if self.room_wanted and self.has_room:
            self.room_wanted = False
            self.on_room()

    def resume(self, peer_ack: int) -> None:
        """A new session starts: drop what the peer has, send the rest again, in order.

        Messages with an RDMA operation are not sent again but dropped.
        """
        self._bring_in()  # (what went through the last session's gate goes again too)
        self.acked(peer_ack)
        again = []
        for m in self.unacked:
            if m.rdma is None:
                again.append(
                    OutMessage(
                        m.seq, m.sport, m.dport, m.data, m.flags | RdsFlag.RETRANSMITTED,
                        extensions=m.extensions, own=m.own,
                    )
                )  # fmt: skip
            else:
                self._drop(m, RdmaStatus.DROPPED, "the connection broke before the peer had it")
        self.counters.retransmits += len(again)
        self.unacked.clear()
        self.unsent.extendleft(reversed(again))

    def _drop(self, msg: OutMessage, status: RdmaStatus, why: str) -> None:
        self.queued_bytes -= len(msg.data)
        if msg.rdma is not None and not msg.rdma.done:
            self.counters.rdma_dropped += 1
            msg.rdma._finish(status, why)

    def drop_port(self, sport: int) -> int:
        """Drop the messages a closed socket had queued or unacknowledged (Linux's
        ``rds_send_drop_to``); how many. A message half posted finishes its fragments."""
        self._bring_in()
        dropped = 0
        for queue in (self.unsent, self.unacked):
            keep = deque(m for m in queue if m.sport != sport)
            for msg in queue:
                if msg.sport == sport:
                    self._drop(msg, RdmaStatus.CANCELED, "its socket closed")
                    dropped += 1
            queue.clear()
            queue.extend(keep)
        if dropped:
            self.on_room()
        return dropped

    def drop_all(self, status: RdmaStatus, why: str) -> int:
        """Drop every queued and unacknowledged message (the peer is gone); how many."""
        self._bring_in()
        dropped = 0
        for queue in (self.unacked, self.unsent):
            while queue:
                self._drop(queue.popleft(), status, why)
                dropped += 1
        self.on_room()
        return dropped

    # ------------------------------------------------------------------ receiving
    def received(self, header: RdsHeader, data: bytes) -> None:
        """A whole message arrived: a congestion map (``h_flags`` exactly CONG_BITMAP,
        as ``ib_recv.c`` ``rds_ib_process_recv`` and ``tcp_recv.c``
        ``rds_tcp_data_recv`` tell one, on either transport) goes to :meth:`peer_map`;
        a numbered message is delivered once, in order.

        An old sequence number on a retransmission is a duplicate and dropped.
        On a first transmission it means the peer started afresh (its process
        restarted): numbering restarts from there. A number beyond the next
        one means the peer resent what it still had after we restarted (Linux
        RDS accepts both the same way).

        One more duplicate is told apart, where Linux is wrong: a Linux peer restarts
        its numbering at 1 when it learns that we restarted (``recv.c``
        ``rds_conn_peer_gen_update``), while messages it numbered before wait in its
        queue and go after the restart. When the connection then breaks, it sends
        again, flagged, what TCP had not acknowledged: an old number among the new
        ones. Its number lies above the new ones, so Linux takes it as new (delivered
        twice) and skips ahead, dropping the resends after it as old, though it never
        had them. A resend numbered within :attr:`earlier` is dropped here instead.
        """
        if header.flags == RdsFlag.CONG_BITMAP:
            self.peer_map(data)
            return
        self.take(
            header.sequence, header.sport, header.dport, header.flags, data, header.extensions
        )

    def take(
        self, seq: int, sport: int, dport: int, flags: int, data: bytes,
        extensions: tuple[Extension, ...] = (),
    ) -> None:  # fmt: skip
        """:meth:`received` of a numbered message (no congestion map) from its header's
        fields: what a session that read the header in place calls, making no header."""
        self.busy = True
        if seq != self.next_recv and not self._new_out_of_turn(seq, flags):
            self.counters.recv_drop_old_seq += 1
            return
        self.next_recv = seq + 1
        self.heard = True
        counters = self.counters
        counters.recv_messages += 1
        counters.recv_bytes += len(data)
        self.deliver(self.peer, seq, sport, dport, extensions, data)

    def _new_out_of_turn(self, seq: int, flags: int) -> bool:
        """Whether a message numbered other than :attr:`next_recv` is new (see
        :meth:`received`); a new one below it starts the peer's numbering afresh."""
        due = self.next_recv
        if not self.heard:
            self.numbered_from = seq
            return True
        if flags & RdsFlag.RETRANSMITTED:
            earlier = self.earlier
            if seq < due or (earlier is not None and due <= earlier[0] <= seq <= earlier[1]):
                return False
        if seq < due:
            log.info("RDS peer %s restarted its numbering at %d", self.peer, seq)
            self.counters.peer_restarts += 1
            self.earlier = (self.numbered_from, due - 1)
            self.numbered_from = seq
        else:
            log.info("RDS peer %s resumes at %d where %d was due", self.peer, seq, due)
            self.counters.recv_seq_gaps += 1
        return True

    def peer_map(self, data: bytes) -> None:
        """The peer's congestion map arrived."""
        new = CongestionMap.decode(data)
        if new is None:
            raise RdsProtocolError(f"congestion map of {len(data)} bytes from {self.peer}")
        self.busy = True
        self.counters.cong_updates_received += 1
        self._bring_in()  # (its gate saw the old map)
        changed = self.peer_congestion.diff(new)
        self.peer_congestion = new
        if changed:
            self.on_congestion(self, changed)

    def peer_restarted(self, generation: int) -> int:
        """The peer's handshake probe names a generation other than the one it named
        before: it restarted. As Linux's ``rds_conn_peer_gen_update`` (``recv.c``),
        what we still meant to send again to its former self is dropped, and its
        numbering is taken afresh; how many messages were dropped."""
        log.info("RDS peer %s restarted (generation %#x)", self.peer, generation)
        self.counters.peer_restarts += 1
        stale = [m for m in self.unsent if m.flags & RdsFlag.RETRANSMITTED]
        for msg in stale:
            self.unsent.remove(msg)
            self._drop(msg, RdmaStatus.DROPPED, "the peer restarted")
        self.next_recv = self.numbered_from = 1
        self.heard = False  # its first message sets where its numbering starts
        self.earlier = None
        if stale:
            self.on_room()
        return len(stale)
