"""One RDS connection: reliable, ordered messages to one peer node over RC sessions.

An :class:`RdsConnection` outlives the RC connections (sessions) it runs on.
It numbers every message; a session carries messages as fragments of at most
``RDS_FRAG_SIZE`` bytes, each one Send with its own 48-byte RDS header, under
credit-based flow control (a Send only where the peer posted a receive; the
last credit is kept for credit updates) and cumulative acknowledgements
(piggybacked in ``h_ack``, or standalone). When a session breaks, whatever the
peer had not acknowledged is sent again on the next one, the peer's last
received sequence number travelling in the rdma_cm private data; the receiver
drops what it already has. Nothing is lost and nothing is delivered twice.
A message carrying an RDMA operation (:mod:`.rdma`) is the exception: it is
never sent twice, and a broken session drops it with a status saying so.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv6Address
from typing import TYPE_CHECKING

import trio

from rdmashim.ulps.rds.rdma import RdmaOp, RdmaStatus, status_of
from rdmashim.ulps.rds.settings import RdsSettings
from rdmashim.ulps.rds.wire import (
    HEADER_STRUCT,
    RDS_FRAG_SIZE,
    RDS_HEADER_LEN,
    RDS_MAX_ADV_CREDIT,
    CongestionMap,
    Extension,
    RdmaExt,
    RdsFlag,
    RdsHeader,
    RdsProtocolError,
    encode_extensions,
)
from rdmashim.verbs import (
    SGE,
    Access,
    QPState,
    RecvBatch,
    RecvWR,
    SendFlags,
    SendWR,
    WCArray,
    WCOpcode,
    WCStatus,
    WROpcode,
)

if TYPE_CHECKING:
    from rdmashim.cm import Connection, ConnectionRequest
    from rdmashim.ulps.rds.tcp import TcpSession
    from rdmashim.verbs.abc import CQ

log = logging.getLogger(__name__)

IPAddress = IPv4Address | IPv6Address
SLOT = RDS_HEADER_LEN + RDS_FRAG_SIZE
RECV_SLOTS = 128
SEND_SLOTS = 64
REPOST_BATCH = 8
"""Receive buffers go back to the QP (and their credits to the peer) in lists of at
least this many: a post per message, where one message comes at a time, costs more
than the few receives it keeps posted (at least 120 of 128 stay posted)."""
SIGNAL_EVERY = 8
ACK_REQUIRED_EVERY = 8
"""A message asks the peer for an acknowledgement (``RDS_FLAG_ACK_REQUIRED``) at
least once in this many, and the last one before the queue runs dry always does:
Linux acknowledges only what asks (``ib_recv.c`` ``rds_ib_set_ack``) unless a message
of its own carries the ack (its ``rds_sysctl_max_unacked_packets``, 8, in ``send.c``)."""
"""A session asks for a completion every this many Sends (or each one when slots run
low): one completion frees the slots of every Send posted before it."""
BURST_MAX = 16
"""Messages queued during a burst (see :meth:`Session.pump_sends`) after which they are
posted at once rather than all together later: the peer starts on these while the
rest are made, so the two ends work at the same time instead of taking turns."""
OPENING_MAX = 8
"""A burst of up to this many messages, or a larger one that all came from one socket
to one socket, has its first answer posted at once (see :meth:`Session.pump_sends`).
One conversation's two ends take turns unless the peer gets something to start on,
and so do both ends when a few messages are in flight; a larger burst from several
conversations comes while others are in flight, which keep both ends busy, and its
first answer alone only costs a write, a read and a handler run more at each end.
Measured (``rds stress``, 3 s runs, 2 each, against every first answer at once):
``-q 64 -a 16`` t=4 d=8 50.9-52.3k -> 55.5-58.5k tx/s, t=8 d=4 48.0-49.0k -> 51.2-53.2k,
t=2 d=16 54.1-54.5k -> 58.5-59.4k, ``-q 1024 -a 256`` t=4 d=8 47.8-48.7k -> 50.8-52.8k;
the same for t=1 d=4, t=1 d=16, t=2 d=4, t=4 d=2, t=1 d=4 -D 64K and t=1 d=1.
Holding every first answer instead made t=1 d=16 35-37k, against 44-48k."""
ACK_DELAY = 0.002
"""Seconds a session holds an acknowledgement back for a message of ours to carry it:
a bare one goes only when none of ours went within this time of the first message it
acknowledges."""
RDMA_DEPTH = 16
"""RDMA operations a session keeps in flight (beside its send slots on the send queue)."""
_RDMA_WR = 1 << 32
"""Work request ids at and above this are RDMA operations; below, send slots."""
_SUCCESS = WCStatus.SUCCESS
_RECV = WCOpcode.RECV
_SEND = WROpcode.SEND
_UNSIGNALED = SendFlags(0)
_ACK_REQUIRED = int(RdsFlag.ACK_REQUIRED)
_pack_header = HEADER_STRUCT.pack_into
_FLAGS = {
    (fence, last, signaled, inline): (
        (SendFlags.FENCE if fence else SendFlags.NONE)
        | (SendFlags.SOLICITED if last else SendFlags.NONE)
        | (SendFlags.SIGNALED if signaled else SendFlags.NONE)
        | (SendFlags.INLINE if inline else SendFlags.NONE)
    )
    for fence in (False, True)
    for last in (False, True)
    for signaled in (False, True)
    for inline in (False, True)
}
"""A Send's flags by (fence, last fragment, signaled, inline): made once, as Flag
arithmetic costs a Python call each time."""


class SessionLost(Exception):
    """The RC connection under a session broke."""


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
    deliver: Callable[[IPAddress, RdsHeader, bytes], None]
    """Called with (peer, first header, data) for each new message, in order."""
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
    session: Session | TcpSession | None = None
    map_out: bytes | None = None
    """The congestion map waiting to go out. Maps go outside the sequence (number 0,
    never resent), between messages, as Linux's ``rds_cong_update_alloc`` makes them
    and ``rds_send_xmit`` sends them on either transport."""
    on_burst: Callable[[Session], None] = lambda session: None
    """Called when a session first holds back the answers to a burst (see
    :meth:`Session.answer_burst`)."""
    peer_generation: int = 0
    """The peer's generation number from its handshake probe (0: none seen)."""
    queued_bytes: int = 0
    settings: RdsSettings = field(default_factory=RdsSettings)
    """The bounds of the queue (``sndbuf``, ``max_queued_messages``)."""
    last_active: float = 0.0
    """When (trio's clock) a session began or ended, or a message was last queued or
    received as of :meth:`active_at`'s last look (messages only set :attr:`busy`: a
    clock read per message costs more than the node's idle check needs)."""
    busy: bool = False
    """A message was queued or received since :attr:`last_active` was set."""
    _space: trio.Event = field(default_factory=trio.Event)
    _room_wanted: bool = False
    """A task waits in :meth:`wait_room` (acknowledgements look at the room only then)."""

    def active_at(self, now: float) -> float:
        """When the connection was last active, as seen at ``now`` (trio's clock): a
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
        """Number a message and queue it; it goes out as soon as a session can take it.

        ``rdma``, an operation whose local buffer is registered already, runs
        just before the message on the same session. ``own`` marks the node's
        own messages (see :attr:`OutMessage.own`).
        """
        msg = OutMessage(self.next_seq, sport, dport, bytes(data), flags, rdma, extensions, own)
        self.next_seq += 1
        self.busy = True
        self.unsent.append(msg)
        self.queued_bytes += len(msg.data)
        self.counters.send_messages += 1
        self.counters.send_bytes += len(msg.data)
        if self.session is not None:
            self.session.pump_sends()

    def queue_map(self, data: bytes) -> None:
        """Queue our congestion map; it replaces one still waiting to go out.

        A map is a state, not a change: of several unsent ones only the last
        counts, so a peer flipping our ports cannot make us queue maps without
        bound. The newest waits in :attr:`map_out` and goes before the next
        message (a session breaking under it loses it: every session starts
        with a fresh one).
        """
        self.map_out = bytes(data)
        self.counters.cong_updates_sent += 1
        if self.session is not None:
            self.session.pump_sends()

    @property
    def pending(self) -> bool:
        """Whether messages of sockets wait to be sent or acknowledged. The node's own
        (congestion maps, pongs, probes) do not count: every session starts with a
        fresh map, and a pong is worth no reconnect, nor keeps a peer entry."""
        return any(not m.own for queue in (self.unsent, self.unacked) for m in queue)

    @property
    def queued_messages(self) -> int:
        """Messages queued or sent and not yet acknowledged."""
        return len(self.unsent) + len(self.unacked)

    @property
    def has_room(self) -> bool:
        """Whether another message may be queued without waiting."""
        settings = self.settings  # (inline: a test per message)
        return (
            self.queued_bytes < settings.sndbuf
            and len(self.unsent) + len(self.unacked) < settings.max_queued_messages
        )

    async def wait_room(self) -> None:
        """Wait until the queue drops below the send buffer size."""
        while not self.has_room:
            if self._space.is_set():  # shared by every waiter: replacing it strands the others
                self._space = trio.Event()
            self._room_wanted = True
            await self._space.wait()

    def acked(self, ack: int) -> None:
        """The peer has every message up to ``ack``."""
        unacked = self.unacked
        if not unacked or unacked[0].seq > ack:
            return  # nothing new: the room did not change
        while unacked and unacked[0].seq <= ack:
            msg = unacked.popleft()
            self.queued_bytes -= len(msg.data)
            if msg.rdma is not None:  # it arrived, so its RDMA operation is done
                msg.rdma._finish(RdmaStatus.SUCCESS)
        if self._room_wanted and self.has_room:
            self._room_wanted = False
            self._space.set()

    def resume(self, peer_ack: int) -> None:
        """A new session starts: drop what the peer has, send the rest again, in order.

        Messages with an RDMA operation are not sent again but dropped.
        """
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
            self._space.set()
        return dropped

    def drop_all(self, status: RdmaStatus, why: str) -> int:
        """Drop every queued and unacknowledged message (the peer is gone); how many."""
        dropped = 0
        for queue in (self.unacked, self.unsent):
            while queue:
                self._drop(queue.popleft(), status, why)
                dropped += 1
        self._space.set()
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
        seq = header.sequence
        self.busy = True
        if seq != self.next_recv and not self._new_out_of_turn(seq, header.flags):
            self.counters.recv_drop_old_seq += 1
            return
        self.next_recv = seq + 1
        self.heard = True
        self.counters.recv_messages += 1
        self.counters.recv_bytes += len(data)
        self.deliver(self.peer, header, data)

    def _new_out_of_turn(self, seq: int, flags: RdsFlag) -> bool:
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
        self.last_active = trio.current_time()
        self.counters.cong_updates_received += 1
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
            self._space.set()
        return len(stale)


class Session:
    """One RC connection carrying an :class:`RdsConnection`'s messages.

    ``conn`` is a :class:`rdmashim.cm.Connection` (PD, CQ, QP), not yet
    connected: the session posts its receives first. :meth:`peer_credits` takes
    the credits the peer announced in its private data; none turns flow control
    off, as Linux's ``rds_ib_set_flow_control`` does (a Linux peer announces none
    unless its ``flow_control`` sysctl is on, and it is off by default). Without
    flow control the send slots bound what is in flight, and a receiver that has
    no receive posted makes the sender's QP retry (RNR retry 7: for ever).

    Completions are taken by the CQ's completion handler (as the kernel's RDS
    does in its ``ib_create_cq`` handler): it delivers received messages to
    their sockets, re-posts the receives, posts what the new credits allow and
    re-arms, where the backend reports the completion (the built-in engine: in
    the receive task that read the bytes). :meth:`run`'s task only sends a
    held-back acknowledgement when its delay ends and ends the session when the
    handler finds the connection broken.

    Sends are posted as lists: what one pump makes goes in one ``post_send``
    (the engine frames it into one write). When a handler run delivers several
    messages (a burst), the first answer their receivers send goes at once, so
    that the peer works on it meanwhile (unless the burst is larger than
    :data:`OPENING_MAX` and came from several sockets: others in flight keep the
    peer busy then); the next ones wait in the queue and go together, posted by
    the receiver that goes back to waiting when no socket holds a message any more
    (:meth:`answer_burst`), or else by :meth:`run`'s task a turn of the scheduler
    later (a burst of requests costs two posts and two writes, and at the peer two
    reads and two handler runs), up to :data:`BURST_MAX` of them: more are posted as
    they come. The wire is the same either way: the same headers, flags and order.
    """

    def __init__(self, rds: RdsConnection, conn: Connection | ConnectionRequest) -> None:
        self.rds = rds
        self.conn = conn
        self.qp = conn.qp
        self.cq = conn.send_cq
        self.cq.busy_poll = rds.settings.busy_poll  # (a reader may drive it: RdsSocket.recvfrom)
        self.send_credits = 0
        self.flow_control = True
        """Whether Sends wait for the peer's credits (see :meth:`peer_credits`)."""
        self.advertise = 0
        self._ack_countdown = 0
        """Messages left before the next one asks for an acknowledgement."""
        self.recv_mr = conn.pd.reg_mr(bytearray(SLOT * RECV_SLOTS), Access.LOCAL_WRITE)
        self.send_mr = conn.pd.reg_mr(bytearray(SLOT * SEND_SLOTS), Access.LOCAL_WRITE)
        self._recv_buf = self.recv_mr.buf
        self._send_buf = self.send_mr.buf
        first = self.send_mr.sge(0, SLOT)
        self._send_addr, self._send_lkey = first.addr, first.lkey
        self._slot_wrs = [SendWR(slot, _SEND) for slot in range(SEND_SLOTS)]
        """Each send slot's Send, filled in again for each fragment the slot carries
        (a post copies what it needs of a work request)."""
        self._slot_lengths = [-1] * SEND_SLOTS
        """The length of each slot's Send's SGE, kept while fragments fill it alike."""
        self._max_inline = conn.qp.cap.max_inline_data
        """Sends up to this long go INLINE (copied when posted; the slot is free again at
        once, though it is reused only after a later signaled Send completes)."""
        self.free_slots = list(range(SEND_SLOTS))
        self.posted: deque[int] = deque()
        """Send slots in flight, in posting order (the send queue completes in order)."""
        self.rdma: dict[int, RdmaOp] = {}
        """RDMA operations in flight, by work request id."""
        self._next_rdma = _RDMA_WR
        self._writes: deque[int] = deque()
        """The work request ids of the RDMA Writes in :attr:`rdma`, in posting order. A
        Write is posted unsignaled (as Linux posts one without ``RDS_RDMA_NOTIFY_ME``): it
        is done when a Send posted after it completes, and its operation when the peer
        acknowledges the message (a failed one still completes, with its error)."""
        self._rdma_marks = [_RDMA_WR] * SEND_SLOTS
        """For each send slot, :attr:`_next_rdma` when it was last posted: the RDMA
        operations below it went before the slot's Send."""
        self.current: OutMessage | None = None
        self.next_fragment = 0
        self._extra_flags = 0
        """Flags the current message's headers carry beside its own (ACK_REQUIRED)."""
        self.acked_to_peer = rds.next_recv - 1
        self._assembly: tuple[RdsHeader, bytearray, int] | None = None
        self.lost = False
        self._wcs = WCArray(64)
        self._room = len(self._wcs)
        self._recvs = RecvBatch(
            RecvWR(i, [self.recv_mr.sge(i * SLOT, SLOT)]) for i in range(RECV_SLOTS)
        )
        self._failure: SessionLost | None = None
        """Why the session ended, once the completion handler found out."""
        self._wake = trio.Event()
        """Set for :meth:`run`'s task when the session ends or sends wait for it."""
        self._burst = False
        """The last completion handler run delivered several messages: what their
        receivers send in answer waits for :meth:`run`'s task to post it together."""
        self._flush_due = False
        """:meth:`run`'s task is to post what waits."""
        self._opening = False
        """No answer to the burst went yet: the first goes at once (:data:`OPENING_MAX`)."""
        self._talk = -1
        """The ports (``sport << 16 | dport``) of the sockets' messages the handler run took
        so far (-1: none yet; -2: more than one pair)."""
        self._ack_at = math.inf
        """When an acknowledgement held back must go on its own."""
        self._timer: trio.CancelScope | None = None
        self._pumping = False
        self._repump = False
        self._wrs: list[SendWR] = []
        """Work requests made and not yet posted (:meth:`_submit` posts them)."""

        self._reposts: list[int] = []
        """Receive buffers taken and not yet posted again (see :data:`REPOST_BATCH`)."""

        # Before the connection is up: the peer may send as soon as it is.
        self.qp.post_recv_batch(self._recvs)

    def peer_credits(self, credits: int) -> None:
        """The credits the peer's private data announced (``dp_credit``); 0: no flow
        control on this session, either way (``ib_cm.c`` ``rds_ib_set_flow_control``)."""
        self.flow_control = credits != 0
        self.send_credits = credits

    def close(self) -> None:
        """Deregister the session's buffers (once its QP is destroyed)."""
        self.recv_mr.close()
        self.send_mr.close()

    # ------------------------------------------------------------------ transmit
    def _post_rdma(self, op: RdmaOp) -> None:
        """Post the RDMA Write or Read a message carries, ahead of the message."""
        wr_id = self._next_rdma
        self._next_rdma += 1
        self.rdma[wr_id] = op
        assert op._mr is not None  # registered when the message was queued (_begin)
        if op.write:
            self._writes.append(wr_id)
            opcode, flags = WROpcode.RDMA_WRITE, _UNSIGNALED
        else:  # the data is here when the Read completes
            opcode, flags = WROpcode.RDMA_READ, SendFlags.SIGNALED
        self._wrs.append(SendWR(wr_id, opcode, [op._mr.sge()], flags, op.remote_addr, op.rkey))
        counters = self.rds.counters
        counters.rdma_bytes += op.length
        if op.write:
            counters.rdma_writes += 1
        else:
            counters.rdma_reads += 1

    def _writes_done(self, slot: int) -> None:
        """The Send of ``slot`` completed: so did the RDMA Writes posted before it."""
        writes, mark, rdma = self._writes, self._rdma_marks[slot], self.rdma
        while writes and writes[0] < mark:
            rdma.pop(writes.popleft(), None)  # (None: a failed one was taken already)

    def _rdma_done(self, wr_id: int, status: WCStatus) -> None:
        op = self.rdma.pop(wr_id)
        if status == WCStatus.SUCCESS:
            if not op.write:  # the data is here; a Write is done when the peer acks
                op._finish(RdmaStatus.SUCCESS)
        elif status != WCStatus.WR_FLUSH_ERR:
            self.rds.counters.rdma_failures += 1
            op._finish(status_of(status), status.name)

    def _post(
        self,
        msg: OutMessage | None,
        first: bool = True,
        payload: bytes | memoryview = b"",
        fence: bool = False,
        last: bool = True,
    ) -> None:
        """Fill a send slot with a fragment of ``msg`` (None: a standalone ack, whose
        credits and acknowledgement every header carries) and add its Send to the
        ones :meth:`_submit` posts. The header is written straight into the slot.

        The last fragment of a message (and an ack) is solicited: a Linux peer arms
        its receive CQ for solicited completions only (``ib_cm.c``
        ``rds_ib_setup_qp``; ``ib_send.c`` ``rds_ib_xmit`` solicits a message's last
        fragment, ``ib_recv.c`` ``rds_ib_recv_init_ack`` every ack), so it would not
        look at what came before until a solicited Send arrives."""
        credit = self.advertise
        if credit > RDS_MAX_ADV_CREDIT:
            credit = RDS_MAX_ADV_CREDIT
        self.advertise -= credit
        self.acked_to_peer = ack = self.rds.next_recv - 1
        self._ack_at = math.inf  # this one carries it
        slot = self.free_slots.pop()
        base = slot * SLOT
        buf = self._send_buf
        size = len(payload)
        if msg is None:
            _pack_header(buf, base, 0, ack, 0, 0, 0, 0, credit, 0, b"")
        else:
            exthdr = b""
            if first and (msg.extensions or msg.rdma is not None):
                extensions = msg.extensions
                if msg.rdma is not None:
                    extensions += (RdmaExt(msg.rdma.rkey),)
                exthdr = encode_extensions(extensions)
            flags = int(msg.flags) | self._extra_flags
            _pack_header(
                buf, base, msg.seq, ack, len(msg.data), msg.sport, msg.dport, flags, credit,
                0, exthdr,
            )  # fmt: skip
            if size:
                buf[base + RDS_HEADER_LEN : base + RDS_HEADER_LEN + size] = payload
        if self.flow_control:
            self.send_credits -= 1
        posted = self.posted
        posted.append(slot)
        self._rdma_marks[slot] = self._next_rdma
        signaled = not len(posted) % SIGNAL_EVERY or len(self.free_slots) < SIGNAL_EVERY
        wr = self._slot_wrs[slot]
        length = RDS_HEADER_LEN + size
        if self._slot_lengths[slot] != length:  # else the slot's last list fits
            self._slot_lengths[slot] = length
            wr.sg_list = [SGE(self._send_addr + base, length, self._send_lkey)]
        wr.send_flags = _FLAGS[fence, last, signaled, length <= self._max_inline]
        self._wrs.append(wr)

    def _submit(self) -> None:
        """Post the Sends (and RDMA operations) made since the last call, as one list: the
        engine frames them together and hands them to TCP in one write."""
        wrs = self._wrs
        if wrs:
            self._wrs = []
            self.qp.post_send(wrs[0] if len(wrs) == 1 else wrs)

    def pump_sends(self) -> None:
        """Post what waits to go out (never blocks): now, or, while the receivers of a
        burst of delivered messages answer them (:attr:`_burst`), the first answer now
        (:data:`OPENING_MAX`) and the others once they all have, in one list
        (:meth:`answer_burst`, or :meth:`run`'s task), unless :data:`BURST_MAX` of them
        wait."""
        if self._burst and len(self.rds.unsent) < BURST_MAX:
            if self._opening:  # the first answer goes at once: the peer starts on it
                self._opening = False
                self._pump_now()
                return
            if not self._flush_due:
                self._flush_due = True
                self.rds.on_burst(self)
                self._wake.set()
            return
        self._pump_now()

    def answer_burst(self) -> None:
        """Post the answers held back for a burst now, if they still wait: their
        receivers are done (the node calls this when a receiver goes back to waiting and
        no socket holds a message; else :meth:`run`'s task does, a turn or two later)."""
        if self._flush_due:
            self._flush_due = self._burst = False
            self._pump_now()

    def _pump_now(self) -> None:
        """Post as many fragments as credits and send slots allow (never blocks).

        Data never takes the last credit: that one is kept for a credit update.
        Between messages our newest congestion map goes first, as a message
        numbered 0 that is never resent. What one call makes is posted as one list.
        A call from inside another (a completion handler run by a post) returns:
        the running one pumps again for the slots and credits it freed.
        """
        rds = self.rds
        if self.lost or (self.current is None and not rds.unsent and rds.map_out is None):
            return
        if self._pumping:
            self._repump = True
            return
        self._pumping = True
        try:
            self._repump = True
            while self._repump:
                self._repump = False
                self._pump()
                self._submit()
        finally:
            self._pumping = False

    def _pump(self) -> None:
        rds = self.rds
        while self.free_slots and (self.send_credits > 1 or not self.flow_control):
            fence = False
            if self.current is None:
                if rds.map_out is not None:
                    self._start(OutMessage(0, 0, 0, rds.map_out, RdsFlag.CONG_BITMAP, own=True))
                    rds.map_out = None
                elif not rds.unsent:
                    return
                elif rds.unsent[0].rdma is not None and len(self.rdma) >= RDMA_DEPTH:
                    break
                else:
                    numbered = rds.unsent.popleft()
                    rds.unacked.append(numbered)
                    self._start(numbered)
                    if numbered.rdma is not None:
                        self._post_rdma(numbered.rdma)
                        fence = not numbered.rdma.write  # the peer sees it after the Read
            msg = self.current
            assert msg is not None
            fragment = self.next_fragment
            data = msg.data
            if fragment == 0 and len(data) <= RDS_FRAG_SIZE:  # the whole message: no view
                self._post(msg, True, data, fence)
                self.current = None
                continue
            start = fragment * RDS_FRAG_SIZE
            self.next_fragment = fragment + 1
            last = self.next_fragment >= msg.fragments
            payload = memoryview(data)[start : start + RDS_FRAG_SIZE]
            self._post(msg, fragment == 0, payload, fence, last)
            if last:
                self.current = None
        if rds.unsent or self.current is not None:
            rds.counters.credit_waits += 1

    def _start(self, msg: OutMessage) -> None:
        """Make ``msg`` the message whose fragments go next; a numbered one asks for an
        acknowledgement now and then (:data:`ACK_REQUIRED_EVERY`)."""
        self.current = msg
        self.next_fragment = 0
        self._extra_flags = 0
        if msg.seq:
            if self._ack_countdown == 0 or not self.rds.unsent:
                self._extra_flags = _ACK_REQUIRED
                self._ack_countdown = ACK_REQUIRED_EVERY
            self._ack_countdown -= 1

    def _send_ack(self) -> None:
        # The last credit only goes to a message that grants the peer some: spent on a
        # bare ack, both sides could end up with none and wait for each other forever.
        if self.free_slots and (
            not self.flow_control or self.send_credits > 1 or (self.send_credits and self.advertise)
        ):
            self._post(None)
            self._submit()
            self.rds.counters.acks_sent += 1

    # ------------------------------------------------------------------ receive
    def _on_recv(self, slot: int, byte_len: int) -> None:
        """Take one received fragment (or ack); the caller posts its buffer again."""
        base = slot * SLOT
        view = self._recv_buf[base : base + byte_len]
        header = RdsHeader.decode(view)
        if header is None:
            raise RdsProtocolError(f"{byte_len}-byte message shorter than an RDS header")
        self.send_credits += header.credit
        self.rds.acked(header.ack)
        if header.sport or header.dport or header.length:  # else a bare ack, as ib_recv.c's
            talk = header.sport << 16 | header.dport
            if talk != self._talk and header.sport and header.dport:  # (not the node's own)
                self._talk = talk if self._talk == -1 else -2
            self._assemble(header, view[RDS_HEADER_LEN:])

    def _assemble(self, header: RdsHeader, fragment: memoryview) -> None:
        """Add a fragment (a view of the receive buffer: copied before it is reused)."""
        if self._assembly is None:
            if len(fragment) == header.length:  # a whole message: one copy
                self.rds.received(header, bytes(fragment))
                return
            self._assembly = (header, bytearray(), 0)
        first, data, _ = self._assembly
        if header.sequence != first.sequence:
            raise RdsProtocolError(
                f"fragment of message {header.sequence} inside message {first.sequence}"
            )
        data += fragment
        if len(data) > first.length:
            raise RdsProtocolError(f"message {first.sequence} longer than its {first.length} bytes")
        if len(data) == first.length:
            self._assembly = None
            self.rds.received(first, bytes(data))

    # ------------------------------------------------------------------ the loop
    def _completions(self, wcs: WCArray, n: int) -> None:
        """Take entries ``0..n-1`` of ``wcs``; the receives among them are posted again
        once :data:`REPOST_BATCH` wait (even when a broken one ends the session: the QP
        flushes them then)."""
        reposts = self._reposts
        wr_ids, statuses, opcodes, lengths = wcs.wr_id, wcs.status, wcs.opcode, wcs.byte_len
        rdma = self.rdma
        try:
            for i in range(n):
                wr_id = wr_ids[i]
                status = statuses[i]
                if rdma and wr_id in rdma:  # receives use slot numbers: no clash
                    self._rdma_done(wr_id, status)
                if status != _SUCCESS:
                    raise SessionLost(
                        f"{status.name} (work request {wr_id:#x}) with {self.rds.peer}"
                    )
                if opcodes[i] == _RECV:
                    reposts.append(wr_id)
                    self._on_recv(wr_id, lengths[i])
                elif wr_id < _RDMA_WR:  # this Send and every one posted before it are done
                    while (slot := self.posted.popleft()) != wr_id:
                        self.free_slots.append(slot)
                    self.free_slots.append(slot)
                    if self._writes:
                        self._writes_done(slot)
        finally:
            if len(reposts) >= REPOST_BATCH and not self.lost:
                self._reposts = []
                self.qp.post_recv_batch(self._recvs, indices=reposts)
                if self.flow_control:
                    self.advertise += len(reposts)

    def _on_cq(self, cq: CQ) -> None:
        """The CQ's completion handler: take everything, then re-arm (see the class)."""
        if self.lost:
            return
        wcs = self._wcs
        room = self._room
        armed = False
        counters = self.rds.counters
        received = counters.recv_messages
        self._talk = -1
        try:
            while True:
                n = cq.poll_into(wcs)
                if not n:
                    if armed:  # nothing came between the arming and this poll
                        break
                    cq.req_notify()
                    armed = True
                    continue
                self._completions(wcs, n)
                self._pump_now()
                self._acknowledge()
                # A short poll emptied the CQ: arm now, and the next poll takes what
                # came meanwhile (one poll fewer than polling until empty first).
                armed = n < room
                if armed:
                    cq.req_notify()
            burst = counters.recv_messages - received
            self._burst = burst > 1
            self._opening = self._burst and (burst <= OPENING_MAX or self._talk != -2)
        except RdsProtocolError as exc:
            log.warning("RDS protocol error from %s: %s", self.rds.peer, exc)
            self._end(SessionLost(str(exc)))
        except SessionLost as exc:
            self._end(exc)

    def _acknowledge(self) -> None:
        """Send an acknowledgement now if many receives wait to be announced, else make
        sure one goes within ``ACK_DELAY`` unless a message of ours carries it."""
        if self.advertise >= RECV_SLOTS // 2:
            self._send_ack()
            self._ack_at = math.inf
        elif self.rds.next_recv - 1 <= self.acked_to_peer:
            self._ack_at = math.inf  # a message of ours carried it
        elif self._ack_at == math.inf:
            self._ack_at = trio.current_time() + ACK_DELAY
            timer = self._timer
            # A timer set already wakes the run task sooner; it sets the next one then
            # (moving a deadline costs more than that wake-up, once per ACK_DELAY).
            if timer is not None and timer.deadline == math.inf:
                timer.deadline = self._ack_at

    def _end(self, failure: SessionLost) -> None:
        if self._failure is None:
            self._failure = failure
        self.lost = True
        self._wake.set()

    def cut(self) -> None:
        """Break the connection underneath, as a failure would (for tests and the demo):
        the QP goes to the error state and the session ends."""
        if not self.lost:
            self.qp.modify(qp_state=QPState.ERR)

    async def run(self) -> None:
        """Drive the session until its connection breaks (raises :class:`SessionLost`).

        :meth:`peer_credits` has taken the peer's private data by then.
        """
        self.rds.counters.sessions += 1
        self._pump_now()
        try:
            self.cq.set_handler(self._on_cq)
            self._on_cq(self.cq)  # what came before, and arm
            while self._failure is None:
                with trio.CancelScope(deadline=self._ack_at) as self._timer:
                    await self._wake.wait()
                self._timer = None
                if self._wake.is_set():
                    self._wake = trio.Event()
                if self._failure is None and self._flush_due:
                    # The receivers woken with this one may not have run yet: let them.
                    await trio.lowlevel.cancel_shielded_checkpoint()
                    self.answer_burst()  # (unless a receiver did meanwhile)
                if self._failure is None and trio.current_time() >= self._ack_at:
                    self._ack_at = math.inf
                    if self.rds.next_recv - 1 > self.acked_to_peer:
                        self._send_ack()
            raise self._failure
        finally:
            self.lost = True
            with contextlib.suppress(OSError):  # the CQ may be closed already
                self.cq.set_handler(None)
