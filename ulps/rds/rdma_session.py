"""One RDS-over-RDMA session: an RC connection carrying an RdsConnection's messages.

:class:`Session` is the I/O half of a session: the QP, the CQ and its completion
handler, the registered send and receive slots, the work requests and when they
are posted. What goes into each Send, the credits and the acknowledgements are
:class:`~rdmashim.ulps.rds.rdma_flow.RdmaFlow`'s (sans-IO); the numbering,
retransmission and duplicates are the connection's
(:mod:`~rdmashim.ulps.rds.connection`). The connection setup (rdma_cm, the private
data) is :mod:`.rdma_transport`'s.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections import deque
from typing import TYPE_CHECKING

import trio

from rdmashim.ulps.rds.connection import RdsConnection
from rdmashim.ulps.rds.plain import ROWS
from rdmashim.ulps.rds.rdma import RdmaOp, RdmaStatus, status_of
from rdmashim.ulps.rds.rdma_flow import ACK_DELAY, ACK_HELD, ACK_NOW, RECV_SLOTS, RdmaFlow
from rdmashim.ulps.rds.transport import SessionLost
from rdmashim.ulps.rds.wire import RDS_FRAG_SIZE, RDS_HEADER_LEN, RdsProtocolError
from rdmashim.verbs import (
    SGE,
    Access,
    QPState,
    RecvBatch,
    RecvWR,
    SendBatch,
    SendFlags,
    SendWR,
    WCArray,
    WCOpcode,
    WCStatus,
    WROpcode,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from rdmashim.cm import Connection, ConnectionRequest
    from rdmashim.ulps.rds.plain import PlainPath
    from rdmashim.verbs.abc import CQ

log = logging.getLogger(__name__)

SLOT = RDS_HEADER_LEN + RDS_FRAG_SIZE
SEND_SLOTS = 64
REPOST_BATCH = 16
"""Receive buffers go back to the QP (and their credits to the peer) in lists of at
least this many: a post per message, where one message comes at a time, costs more
than the few receives it keeps posted (at least 112 of 128 stay posted). A post of
8 cost the native engine 14-18 us (rds stress d=1, a loaded machine): 2 us a message;
of 16, half that."""
SIGNAL_EVERY = 16
"""A session asks for a completion every this many Sends (or each one when slots run
low): one completion frees the slots of every Send posted before it. Each costs a
completion handler run of its own where no receive comes with it (at one request in
flight, on the built-in engine, in its dispatcher task: a task switch too): 8 made
that 0.13 handler runs a message more, 16 makes it 0.06."""
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
ACK_BACKSTOP = 10 * ACK_DELAY
"""Seconds after :data:`~rdmashim.ulps.rds.rdma_flow.ACK_DELAY` by which the session's
task sends an acknowledgement held back for a message of ours to carry when no reader
went back to waiting meanwhile. A reader that does (:meth:`Session.ack_needed`) brings
the timer back to ``ACK_DELAY``; a reader comes back after each message it answers, and
by then its answer carried the acknowledgement. So the task's timer is set once per
this many seconds, not once per ``ACK_DELAY``, and rarely fires for nothing: at one
request in flight it woke the task 0.17-0.44 times a message (2,000-450 a second), each
wake-up a pass of trio's run loop and about 30 Python calls."""
RDMA_DEPTH = 16
"""RDMA operations a session keeps in flight (beside its send slots on the send queue)."""
_RDMA_WR = 1 << 32
"""Work request ids at and above this are RDMA operations; below, send slots."""
_SUCCESS = WCStatus.SUCCESS
_RECV = WCOpcode.RECV
_SEND = WROpcode.SEND
_UNSIGNALED = SendFlags(0)
_FLAGS = [
    (SendFlags.FENCE if variant & 8 else SendFlags.NONE)
    | (SendFlags.SOLICITED if variant & 4 else SendFlags.NONE)
    | (SendFlags.SIGNALED if variant & 2 else SendFlags.NONE)
    | (SendFlags.INLINE if variant & 1 else SendFlags.NONE)
    for variant in range(16)
]
"""A Send's flags by variant, ``fence << 3 | last fragment << 2 | signaled << 1 | inline``:
made once, as Flag arithmetic costs a Python call each time."""
_RDMA_ENTRY = SEND_SLOTS
"""The first of a session's :data:`RDMA_DEPTH` batch entries for RDMA operations (the
entries below it are the send slots' Sends)."""


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

    Sends are posted from one prepared :class:`~rdmashim.verbs.SendBatch`, by its
    entries: what one pump makes goes in one ``post_send_batch`` (the engine frames it
    into one write), and an entry is packed again only when its fields change. When a
    handler run delivers several messages (a burst), the first answer their receivers
    send goes at once, so that the peer works on it meanwhile (unless the burst is
    larger than :data:`OPENING_MAX` and came from several sockets: others in flight keep
    the peer busy then); the next ones wait in the queue and go together, posted by the
    receiver that goes back to waiting when no socket holds a message any more
    (:meth:`answer_burst`), or else by :meth:`run`'s task a turn of the scheduler later
    (a burst of requests costs two posts and two writes, and at the peer two reads and
    two handler runs), up to :data:`BURST_MAX` of them: more are posted as they come.
    The wire is the same either way: the same headers, flags and order.
    """

    def __init__(
        self,
        rds: RdsConnection,
        conn: Connection | ConnectionRequest,
        on_burst: Callable[[Session], None] = lambda session: None,
        on_ack: Callable[[Session], None] = lambda session: None,
        plain: PlainPath | None = None,
    ) -> None:
        self.rds = rds
        self.flow = RdmaFlow(rds)
        """Credits, acknowledgements and fragments (sans-IO)."""
        self._on_burst = on_burst
        """Called when the session first holds back the answers to a burst (see
        :meth:`answer_burst`)."""
        self._on_ack = on_ack
        """Called when the session starts holding back an acknowledgement (see
        :meth:`ack_needed`)."""
        self._ack_listed = False
        """:attr:`_on_ack` was called and :meth:`ack_needed` not yet."""
        self.conn = conn
        self.qp = conn.qp
        self.cq = conn.send_cq
        self.cq.busy_poll = rds.settings.busy_poll  # (a reader may drive it: RdsSocket.recvfrom)
        received = bytearray(SLOT * RECV_SLOTS)
        self.recv_mr = conn.pd.reg_mr(received, Access.LOCAL_WRITE)
        self.send_mr = conn.pd.reg_mr(bytearray(SLOT * SEND_SLOTS), Access.LOCAL_WRITE)
        self._recv_buf = self.recv_mr.buf
        self._send_buf = self.send_mr.buf
        first = self.send_mr.sge(0, SLOT)
        self._send_addr, self._send_lkey = first.addr, first.lkey
        self._sends = SendBatch(
            [SendWR(slot, _SEND) for slot in range(SEND_SLOTS)]
            + [SendWR(_RDMA_WR, WROpcode.RDMA_WRITE) for _ in range(RDMA_DEPTH)]
        )
        """Each send slot's Send (entry ``slot``), then :data:`RDMA_DEPTH` entries for the
        RDMA operations of one post: an entry posted again with the fields it had is one
        the engine packed already."""
        self._slot_shapes = [-1] * SEND_SLOTS
        """Each slot Send's length and flags variant (``length << 4 | variant``, see
        :data:`_FLAGS`) as its entry holds them: set again only when they change."""
        self._max_inline = conn.qp.cap.max_inline_data
        """Sends up to this long go INLINE (copied when posted; the slot is free again at
        once, though it is reused only after a later signaled Send completes)."""
        self.free_slots = list(range(SEND_SLOTS))
        self.posted: deque[int] = deque()
        """Send slots in flight, in posting order (the send queue completes in order)."""
        self.rdma: dict[int, RdmaOp] = {}
        """RDMA operations in flight, by work request id: the id of operation number
        ``n`` (:attr:`_next_rdma`) is its batch entry's, ``_RDMA_WR + n % RDMA_DEPTH``,
        so an entry posted again with the fields it had is one the engine packed
        already (rds stress ``-D`` writes into the same few buffers again and again)."""
        self._next_rdma = _RDMA_WR
        """The number of the next RDMA operation (they are numbered in posting order)."""
        self._rdma_shapes: list[tuple[object, ...] | None] = [None] * RDMA_DEPTH
        """What each RDMA entry holds (region, cookie, offset, write): set again only
        when that changes."""
        self._writes: deque[tuple[int, RdmaOp]] = deque()
        """The RDMA Writes in :attr:`rdma` and their numbers, in posting order. A Write is
        posted unsignaled (as Linux posts one without ``RDS_RDMA_NOTIFY_ME``): it is done
        when a Send posted after it completes, and its operation when the peer
        acknowledges the message (a failed one still completes, with its error)."""
        self._rdma_marks = [_RDMA_WR] * SEND_SLOTS
        """For each send slot, :attr:`_next_rdma` when it was last posted: the RDMA
        operations numbered below it went before the slot's Send."""
        self.lost = False
        self._wcs = WCArray(ROWS)
        self._room = ROWS
        self._plain = None if plain is None else plain.receiver(rds, self.flow, received, SLOT)
        """The C scan of plain messages (:mod:`.plain`), or None: the Python path."""
        self._take = self._take_columns if self._plain is None else self._take_rows
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
        self._timer: trio.CancelScope | None = None
        self._timer_at = math.inf
        """:attr:`_timer`'s deadline, kept here: reading a cancel scope's costs a call."""
        self._clock = trio.lowlevel.current_clock().current_time
        """``trio.current_time`` without its look-up of the run (a call per message less)."""
        self._pumping = False
        self._repump = False
        self._entries: list[int] = []
        """The batch entries filled and not yet posted (:meth:`_submit` posts them)."""

        self._reposts: list[int] = []
        """Receive buffers taken and not yet posted again (see :data:`REPOST_BATCH`)."""

        # Before the connection is up: the peer may send as soon as it is.
        self.qp.post_recv_batch(self._recvs)

    def peer_credits(self, credits: int) -> None:
        """The credits the peer's private data announced (:meth:`RdmaFlow.peer_credits`)."""
        self.flow.peer_credits(credits)

    def close(self) -> None:
        """Deregister the session's buffers (once its QP is destroyed)."""
        self.recv_mr.close()
        self.send_mr.close()

    # ------------------------------------------------------------------ transmit
    def _post_rdma(self, op: RdmaOp) -> None:
        """Post the RDMA Write or Read a message carries, ahead of the message (the flow
        gives one only while there is room: see :meth:`pump_sends`)."""
        n = self._next_rdma
        self._next_rdma = n + 1
        k = n % RDMA_DEPTH
        wr_id = _RDMA_WR + k
        self.rdma[wr_id] = op
        mr = op._mr
        assert mr is not None  # registered when the message was queued (_begin)
        write = op.write
        if write:
            self._writes.append((n, op))
        shape = (mr, op.cookie, op.remote_offset, write)
        if self._rdma_shapes[k] != shape:  # else the entry stays as packed
            self._rdma_shapes[k] = shape
            if write:
                opcode, flags = WROpcode.RDMA_WRITE, _UNSIGNALED
            else:  # the data is here when the Read completes
                opcode, flags = WROpcode.RDMA_READ, SendFlags.SIGNALED
            self._sends.set(
                _RDMA_ENTRY + k, wr_id=wr_id, opcode=opcode, sg_list=[mr.sge()],
                send_flags=flags, remote_addr=op.remote_addr, rkey=op.rkey,
            )  # fmt: skip
        self._entries.append(_RDMA_ENTRY + k)
        counters = self.rds.counters
        counters.rdma_bytes += op.length
        if write:
            counters.rdma_writes += 1
        else:
            counters.rdma_reads += 1

    def _writes_done(self, slot: int) -> None:
        """The Send of ``slot`` completed: so did the RDMA Writes posted before it."""
        writes, mark, rdma = self._writes, self._rdma_marks[slot], self.rdma
        while writes and writes[0][0] < mark:
            n, op = writes.popleft()
            wr_id = _RDMA_WR + n % RDMA_DEPTH
            if rdma.get(wr_id) is op:  # (else a failed one was taken already)
                del rdma[wr_id]

    def _rdma_done(self, wr_id: int, status: WCStatus) -> None:
        op = self.rdma.pop(wr_id)
        if status == WCStatus.SUCCESS:
            if not op.write:  # the data is here; a Write is done when the peer acks
                op._finish(RdmaStatus.SUCCESS)
        elif status != WCStatus.WR_FLUSH_ERR:
            self.rds.counters.rdma_failures += 1
            op._finish(status_of(status), status.name)

    def _post_slot(self, slot: int, length: int) -> None:
        """Add the Send of ``slot``, which holds a fragment of ``length`` bytes that the flow
        wrote, to the ones :meth:`_submit` posts.

        The last fragment of a message (and an ack) is solicited: a Linux peer arms
        its receive CQ for solicited completions only (``ib_cm.c``
        ``rds_ib_setup_qp``; ``ib_send.c`` ``rds_ib_xmit`` solicits a message's last
        fragment, ``ib_recv.c`` ``rds_ib_recv_init_ack`` every ack), so it would not
        look at what came before until a solicited Send arrives."""
        posted = self.posted
        posted.append(slot)
        self._rdma_marks[slot] = self._next_rdma
        flow = self.flow
        variant = (
            flow.fence << 3
            | flow.last << 2
            | (not len(posted) % SIGNAL_EVERY or len(self.free_slots) < SIGNAL_EVERY) << 1
            | (length <= self._max_inline)
        )
        shape = length << 4 | variant
        if self._slot_shapes[slot] != shape:  # else the entry stays as packed
            self._slot_shapes[slot] = shape
            self._sends.set(
                slot, send_flags=_FLAGS[variant],
                sg_list=[SGE(self._send_addr + slot * SLOT, length, self._send_lkey)],
            )  # fmt: skip
        self._entries.append(slot)

    def _submit(self) -> None:
        """Post the Sends (and RDMA operations) filled since the last call, as one list:
        the engine frames them together and hands them to TCP in one write."""
        entries = self._entries
        if entries:
            self._entries = []
            self.qp.post_send_batch(self._sends, indices=entries)

    def pump_sends(self, now: bool = False) -> None:
        """Post what waits to go out (never blocks): ``now``, or, while the receivers of
        a burst of delivered messages answer them (:attr:`_burst`), the first answer now
        (:data:`OPENING_MAX`) and the others once they all have, in one list
        (:meth:`answer_burst`, or :meth:`run`'s task), unless :data:`BURST_MAX` of them
        wait.

        Posting: as many fragments as credits and send slots allow. Data never takes
        the last credit: that one is kept for a credit update. Between messages our
        newest congestion map goes first, as a message numbered 0 that is never
        resent. What one call makes is posted as one list. A call from inside another
        (a completion handler run by a post) returns: the running one pumps again for
        the slots and credits it freed.
        """
        rds = self.rds
        if not now and self._burst and len(rds.unsent) < BURST_MAX:
            if self._opening:  # the first answer goes at once: the peer starts on it
                self._opening = False
            else:
                if not self._flush_due:
                    self._flush_due = True
                    self._on_burst(self)
                    self._wake.set()
                return
        flow = self.flow
        if self.lost or (flow.current is None and not rds.unsent and rds.map_out is None):
            return
        if self._pumping:
            self._repump = True
            return
        self._pumping = True
        try:
            free, buf, rdma = self.free_slots, self._send_buf, self.rdma
            self._repump = True
            while self._repump:
                self._repump = False
                while (flow.current is not None or rds.unsent or rds.map_out is not None) and free:
                    slot = free[-1]
                    # RDMA room: fewer than RDMA_DEPTH in flight, and the next one's
                    # entry among them free (they end in order, but for a Read whose
                    # response has not come while later Writes are done).
                    room = (
                        len(rdma) < RDMA_DEPTH
                        and _RDMA_WR + self._next_rdma % RDMA_DEPTH not in rdma
                    )
                    length = flow.fill(buf, slot * SLOT, room)
                    if not length:
                        break
                    op = flow.rdma_op
                    if op is not None:
                        flow.rdma_op = None
                        self._post_rdma(op)
                    self._post_slot(free.pop(), length)
                if rds.unsent or flow.current is not None:  # no credit, slot or RDMA room
                    rds.counters.credit_waits += 1
                entries = self._entries  # (_submit, inline: a call per message less)
                if entries:
                    self._entries = []
                    self.qp.post_send_batch(self._sends, indices=entries)
        finally:
            self._pumping = False

    def answer_burst(self) -> None:
        """Post the answers held back for a burst now, if they still wait: their
        receivers are done (the node calls this when a receiver goes back to waiting and
        no socket holds a message; else :meth:`run`'s task does, a turn or two later)."""
        if self._flush_due:
            self._flush_due = self._burst = False
            self.pump_sends(True)

    def ack_needed(self) -> None:
        """A reader goes back to waiting (the node calls this once after the handler held
        an acknowledgement back): if no message of ours carried it yet, it goes on its
        own :data:`~rdmashim.ulps.rds.rdma_flow.ACK_DELAY` after the hold began, not at
        the backstop (:data:`ACK_BACKSTOP`)."""
        self._ack_listed = False
        at = self.flow.ack_at
        if at < self._timer_at and (timer := self._timer) is not None:
            timer.deadline = self._timer_at = at

    def _send_ack(self) -> None:
        if self.free_slots and self.flow.ack_allowed():
            slot = self.free_slots.pop()
            self._post_slot(slot, self.flow.fill_ack(self._send_buf, slot * SLOT))
            self._submit()
            self.rds.counters.acks_sent += 1

    # ------------------------------------------------------------------ receive
    def _on_cq(self, cq: CQ) -> None:
        """The CQ's completion handler: take everything, then re-arm (see the class).

        The receives among the completions are posted again once :data:`REPOST_BATCH`
        wait (even when a broken one ends the session: the QP flushes them then)."""
        if self.lost:
            return
        room = self._room
        rds, flow = self.rds, self.flow
        counters = rds.counters
        received = counters.recv_messages
        take = self._take
        flow.talk = -1
        try:
            while True:
                try:
                    n = take(cq)
                finally:
                    reposts = self._reposts
                    if len(reposts) >= REPOST_BATCH and not self.lost:
                        self._reposts = []
                        self.qp.post_recv_batch(self._recvs, indices=reposts)
                        flow.reposted(len(reposts))
                if not n:  # (a run for completions taken already)
                    cq.req_notify()
                    if not len(cq):
                        break
                    continue
                if flow.current is not None or rds.unsent or rds.map_out is not None:
                    self.pump_sends(True)  # (what the new credits and slots let go)
                # Our acknowledgement: at once if many receives wait to be granted, else
                # within ACK_DELAY unless a message of ours carries it.
                due = flow.acknowledge(self._clock)
                if due == ACK_HELD:
                    # The run task's timer as a backstop (ACK_BACKSTOP): a reader going
                    # back to waiting brings it to ack_at. A timer set already wakes the
                    # task sooner; it sets the next one then (moving a deadline costs
                    # more than that wake-up).
                    if self._timer_at == math.inf and (timer := self._timer) is not None:
                        timer.deadline = self._timer_at = flow.ack_at + ACK_BACKSTOP
                    if not self._ack_listed:
                        self._ack_listed = True
                        self._on_ack(self)
                elif due == ACK_NOW:
                    self._send_ack()
                    flow.ack_at = math.inf
                # A short poll emptied the CQ: arm now, and poll again only if something
                # came meanwhile (the CQ's length says; a poll finding none costs more).
                if n < room:
                    cq.req_notify()
                    if not len(cq):
                        break
            burst = counters.recv_messages - received
            self._burst = burst > 1
            self._opening = self._burst and (burst <= OPENING_MAX or self.flow.talk != -2)
        except RdsProtocolError as exc:
            log.warning("RDS protocol error from %s: %s", self.rds.peer, exc)
            self._end(SessionLost(str(exc)))
        except SessionLost as exc:
            self._end(exc)

    def _take_columns(self, cq: CQ) -> int:
        """Poll into the session's :class:`WCArray` and take each completion (the Python
        path); how many there were."""
        n = cq.poll_into(self._wcs)
        wcs = self._wcs
        completion = self._completion
        for i in range(n):
            completion(wcs.wr_id[i], wcs.status[i], wcs.opcode[i], wcs.byte_len[i])
        return n

    def _take_rows(self, cq: CQ) -> int:
        """Poll rows (``cq.poll_rows``) and take them: runs of plain messages in C
        (:mod:`.plain`), any other row as the Python path takes it; how many there were."""
        plain = self._plain
        assert plain is not None  # (chosen with it)
        n = cq.poll_rows(plain.rows)
        plain.take(n, self._completion, self._reposts)
        return n

    def _completion(self, wr_id: int, status: WCStatus, opcode: int, length: int) -> None:
        """Take one completion: a received message (its buffer to be posted again), a
        Send (its slot and every earlier one free), an RDMA operation (done), or a
        failure (:class:`SessionLost`)."""
        rdma = self.rdma
        if rdma and wr_id in rdma:  # receives use slot numbers: no clash
            self._rdma_done(wr_id, status)
        if status != _SUCCESS:
            raise SessionLost(f"{status.name} (work request {wr_id:#x}) with {self.rds.peer}")
        if opcode == _RECV:
            self._reposts.append(wr_id)
            self.flow.receive_at(self._recv_buf, wr_id * SLOT, length)
        elif wr_id < _RDMA_WR:  # this Send and every one before it are done
            while (slot := self.posted.popleft()) != wr_id:
                self.free_slots.append(slot)
            self.free_slots.append(slot)
            if self._writes:
                self._writes_done(slot)

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
        self.pump_sends(True)
        try:
            self.cq.set_handler(self._on_cq)
            self._on_cq(self.cq)  # what came before, and arm
            while self._failure is None:
                # (the backstop while no reader came back since the hold: ack_needed)
                self._timer_at = self.flow.ack_at + (ACK_BACKSTOP if self._ack_listed else 0.0)
                with trio.CancelScope(deadline=self._timer_at) as self._timer:
                    await self._wake.wait()
                self._timer = None
                self._timer_at = math.inf
                if self._wake.is_set():
                    self._wake = trio.Event()
                if self._failure is None and self._flush_due:
                    # The receivers woken with this one may not have run yet: let them.
                    await trio.lowlevel.cancel_shielded_checkpoint()
                    self.answer_burst()  # (unless a receiver did meanwhile)
                if self._failure is None and self.flow.ack_expired(self._clock()):
                    self._send_ack()
            raise self._failure
        finally:
            self.lost = True
            with contextlib.suppress(OSError):  # the CQ may be closed already
                self.cq.set_handler(None)
