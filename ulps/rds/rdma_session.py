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
from rdmashim.ulps.rds.plain import ROWS, SendRing
from rdmashim.ulps.rds.rdma import RdmaOp
from rdmashim.ulps.rds.rdma_flow import ACK_HELD, ACK_NOW, ACK_REQUIRED_EVERY, RECV_SLOTS, RdmaFlow
from rdmashim.ulps.rds.rdma_hooked import HookedSession
from rdmashim.ulps.rds.rdma_layout import C_SEND_SLOTS, C_SEND_WR, SEND_FLAGS, SEND_SLOTS, SLOT
from rdmashim.ulps.rds.rdma_ops import RDMA_DEPTH, RDMA_WR, RdmaPosts
from rdmashim.ulps.rds.rdma_pacing import (
    ACK_BACKSTOP,
    BURST_MAX,
    OPENING_MAX,
    REPOST_BATCH,
    SIGNAL_EVERY,
)
from rdmashim.ulps.rds.transport import SessionLost
from rdmashim.ulps.rds.wire import RdsProtocolError
from rdmashim.verbs import (
    SGE,
    Access,
    QPState,
    RecvBatch,
    RecvWR,
    SendBatch,
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

_SUCCESS = WCStatus.SUCCESS
_RECV = WCOpcode.RECV
_SEND = WROpcode.SEND
_RDMA_ENTRY = SEND_SLOTS
"""The first of a session's :data:`RDMA_DEPTH` batch entries for RDMA operations (the
entries below it are the send slots' Sends)."""


class Session(HookedSession):
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
    entries (an entry is packed again only when its fields change): what one pump makes
    goes in one ``post_send_batch``, which the engine frames into one write. On the C
    path, a message Python would send next and alone goes from C's own send buffers in
    one call (:meth:`.PlainReceiver.send`, posted by ``qp.run_native_handler``). When
    this handler takes a burst of delivered messages, their answers are held back to go
    together (:meth:`pump_sends`, :meth:`answer_burst`) on the Python path; on the C path
    none is held: the answers go from C one by one. The wire is the same either way: the
    same headers, flags and order. What the session does around the CQ's native
    handler (a reader's drive, folding in what C took) is :class:`.HookedSession`'s.
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
        self.flow = RdmaFlow(rds, None if plain is None else plain.flow_state())
        """Credits, acknowledgements and fragments (sans-IO; its counters in C memory on
        the C path)."""
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
            + [SendWR(RDMA_WR, WROpcode.RDMA_WRITE) for _ in range(RDMA_DEPTH)]
        )
        """Each send slot's Send (entry ``slot``), then :data:`RDMA_DEPTH` entries for the
        RDMA operations of one post: an entry posted again with the fields it had is one
        the engine packed already."""
        self._slot_shapes = [-1] * SEND_SLOTS
        """Each slot Send's length and flags variant (``length << 4 | variant``, see
        :data:`.SEND_FLAGS`) as its entry holds them: set again only when they change."""
        self._max_inline = conn.qp.cap.max_inline_data
        """Sends up to this long go INLINE (copied when posted; the slot is free again at
        once, though it is reused only after a later signaled Send completes)."""
        self.free_slots = list(range(SEND_SLOTS))
        self.posted: deque[int] = deque()
        """Send slots in flight, in posting order (the send queue completes in order)."""
        self.rdma = RdmaPosts(self._sends, _RDMA_ENTRY, SEND_SLOTS, rds.counters)
        """The RDMA operations this session posts ahead of their messages."""
        self.lost = False
        self._wcs = WCArray(ROWS)
        self._room = ROWS
        first = self.recv_mr.sge(0, SLOT)
        self._plain = self._c_send_mr = None
        if plain is not None:
            c_sends = bytearray(SLOT * C_SEND_SLOTS)
            self._c_send_mr = conn.pd.reg_mr(c_sends, Access.LOCAL_WRITE)
            ring = SendRing(
                c_sends, self._c_send_mr.sge(0, SLOT), C_SEND_SLOTS, C_SEND_WR,
                self._max_inline, SIGNAL_EVERY, ACK_REQUIRED_EVERY,
            )  # fmt: skip
            self._plain = plain.receiver(rds, self.flow, received, SLOT, first, REPOST_BATCH, ring)
        """The C path of plain messages (:mod:`.plain`), or None: the Python path."""
        self._unfolded = None if self._plain is None else self._plain.state
        """The C scan's state, whose ``has_ack`` says the CQ's native handler took rows
        that :meth:`_fold` has not given the session yet (None: no C path)."""
        self._hooked = False
        """The CQ calls the C scan's native handler (``cq.set_native_handler``)."""
        self._unjudged = False
        """Messages the native handler took were folded in without a look at whether
        their acknowledgement must be held back (:meth:`ack_needed` looks)."""
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
        if self._c_send_mr is not None:
            self._c_send_mr.close()

    # ------------------------------------------------------------------ transmit
    def _post_slot(self, slot: int, length: int) -> None:
        """Add the Send of ``slot``, which holds a fragment of ``length`` bytes that the flow
        wrote, to the ones :meth:`_submit` posts (its flags: :data:`.SEND_FLAGS`)."""
        posted = self.posted
        posted.append(slot)
        self.rdma.marks[slot] = self.rdma.next
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
                slot, send_flags=SEND_FLAGS[variant],
                sg_list=[SGE(self._send_addr + slot * SLOT, length, self._send_lkey)],
            )  # fmt: skip
        self._entries.append(slot)

    def _submit(self) -> None:
        """Post the Sends (and RDMA operations) filled since the last call, as one list."""
        entries = self._entries
        if entries:
            self._entries = []
            self.qp.post_send_batch(self._sends, indices=entries)

    def send_plain(self, sport: int, dport: int, data: bytes, rdma: RdmaOp | None = None) -> bool:
        """:meth:`.Carrier.send_plain`: from C's send buffers (:meth:`.PlainReceiver.send`;
        a message chasing an RDMA Write, :meth:`.PlainReceiver.send_write`, which posts
        the Write just before it), when the session is on the C path and would send
        nothing before it (a session on the C path holds no burst's answers back). A Read
        stays Python's (its Send is fenced behind it)."""
        plain = self._plain
        if plain is None:
            return False
        plain.sync()  # (the connection's number is C's until then)
        rds = self.rds
        if not self._alone(0) or not self._staged_in_c(rds.next_seq, sport, dport, data, rdma):
            return False
        rds.sent(sport, dport, data, rdma)
        self._staged()
        self._open()  # (a socket's next messages may go in one call into C)
        return True

    def _alone(self, queued: int) -> bool:
        """Whether a plain message may go in C: the session is on the C path and live,
        ``queued`` messages are queued (the one to send among them), and nothing else
        waits (no fragment, congestion map or RDMA Read in flight: a Send of Python's
        ends those) or is being posted. (Python's Writes in flight went with their
        messages: what C sends after them only follows them on the send queue.)"""
        rds = self.rds
        return (
            self._hooked and not self.lost and len(rds.unsent) == queued
            and self.flow.current is None and rds.map_out is None and not self._pumping
            and not self.rdma.reads
        )  # fmt: skip

    def _staged(self) -> None:
        """The Send :meth:`.PlainReceiver.send` staged goes out (the native handler's run
        posts it); the backstop folds the peer's acknowledgement in at the latest."""
        self.qp.run_native_handler()
        if self._timer_at == math.inf and (timer := self._timer) is not None:
            timer.deadline = self._timer_at = self._clock() + ACK_BACKSTOP  # (pump_sends)

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
        if self._alone(1):
            msg = rds.unsent[0]
            if (
                not msg.flags and not msg.extensions
                and self._staged_in_c(msg.seq, msg.sport, msg.dport, msg.data, msg.rdma)
            ):  # fmt: skip
                rds.unacked.append(rds.unsent.popleft())
                self._staged()
                return
        if (unfolded := self._unfolded) is not None and unfolded.has_ack:
            self._fold()  # (the acknowledgement C took goes out with these: fill reads it)
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
                    inflight = rdma.inflight
                    room = (
                        len(inflight) < RDMA_DEPTH
                        and RDMA_WR + rdma.next % RDMA_DEPTH not in inflight
                    )
                    length = flow.fill(buf, slot * SLOT, room)
                    if not length:
                        break
                    op = flow.rdma_op
                    if op is not None:
                        flow.rdma_op = None
                        rdma.post(op, self._entries)
                        if self._hooked:  # (it ends with the acknowledgement: C asks then)
                            self._plain.watch(rds.unacked[-1].seq)  # type: ignore[union-attr]
                    self._post_slot(free.pop(), length)
                if rds.unsent or flow.current is not None:  # no credit, slot or RDMA room
                    rds.counters.credit_waits += 1
                    if self._hooked:  # (the native handler asks when credits come)
                        self._plain.sending(True)  # type: ignore[union-attr]
                entries = self._entries  # (_submit, inline: a call per message less)
                if entries:
                    self._entries = []
                    self.qp.post_send_batch(self._sends, indices=entries)
            if self._hooked and self._timer_at == math.inf and (timer := self._timer) is not None:
                # The native handler takes the peer's acknowledgements of these without
                # Python: the session's task folds them in by this time at the latest.
                timer.deadline = self._timer_at = self._clock() + ACK_BACKSTOP
        finally:
            self._pumping = False

    def answer_burst(self) -> None:
        """Post the answers held back for a burst now, if they still wait: their
        receivers are done (the node calls this when a receiver goes back to waiting and
        no socket holds a message; else :meth:`run`'s task does, a turn or two later)."""
        if self._flush_due:
            self._flush_due = self._burst = False
            self.pump_sends(True)

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
        plain = self._plain
        if self._hooked:
            plain.hold()  # type: ignore[union-attr]
            plain.sync()  # type: ignore[union-attr]
            if self._unfolded.has_ack:
                # What C took first (its messages count in this run's burst): its
                # credits let sends go, its receives posted again may be due to the
                # peer as credits.
                self._fold()
                if flow.current is not None or rds.unsent or rds.map_out is not None:
                    self.pump_sends(True)
                if self._unjudged:
                    self._judge()
        try:
            if plain is not None and plain.hook.refused:
                raise SessionLost(f"the QP refused a Send to {rds.peer}: it is leaving RTS")
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
                        timer.deadline = self._timer_at = flow.state.ack_at + ACK_BACKSTOP
                    if not self._ack_listed:
                        self._ack_listed = True
                        self._on_ack(self)
                elif due == ACK_NOW:
                    self._send_ack()
                    flow.state.ack_at = math.inf
                # A short poll emptied the CQ: arm now, and poll again only if something
                # came meanwhile (the CQ's length says; a poll finding none costs more).
                if n < room:
                    cq.req_notify()
                    if not len(cq):
                        break
            burst = counters.recv_messages - received
            self._burst = burst > 1 and not self._hooked
            self._opening = self._burst and (burst <= OPENING_MAX or self.flow.talk != -2)
        except RdsProtocolError as exc:
            log.warning("RDS protocol error from %s: %s", self.rds.peer, exc)
            self._end(SessionLost(str(exc)))
        except SessionLost as exc:
            self._end(exc)
        finally:
            if self._hooked:
                waiting = rds.room_wanted or bool(rds.unsent) or flow.current is not None
                plain.sending(waiting)  # type: ignore[union-attr]
                plain.release(RECV_SLOTS // 2 if flow.state.flow_control else 0)  # type: ignore[union-attr]

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
        n = plain.take_left(self._completion, self._reposts)  # (the native handler's left first)
        if n:
            return n
        n = cq.poll_rows(plain.rows)
        plain.take(n, self._completion, self._reposts)
        return n

    def _completion(self, wr_id: int, status: WCStatus, opcode: int, length: int) -> None:
        """Take one completion: a received message (its buffer to be posted again), a
        Send (its slot and every earlier one free), an RDMA operation (done), or a
        failure (:class:`SessionLost`)."""
        inflight = self.rdma.inflight
        if inflight and wr_id in inflight:  # receives use slot numbers: no clash
            self.rdma.done(wr_id, status)
        if status != _SUCCESS:
            if wr_id >= C_SEND_WR and self._plain is not None:
                self._write_failed(self._plain.write_seq(wr_id), status)
            raise SessionLost(f"{status.name} (work request {wr_id:#x}) with {self.rds.peer}")
        if opcode == _RECV:
            self._reposts.append(wr_id)
            self.flow.receive_at(self._recv_buf, wr_id * SLOT, length)
        elif wr_id < RDMA_WR:  # this Send and every one before it are done
            while (slot := self.posted.popleft()) != wr_id:
                self.free_slots.append(slot)
            self.free_slots.append(slot)
            if self.rdma.writes:
                self.rdma.writes_done(slot)
        elif wr_id >= C_SEND_WR and self._plain is not None:
            self._plain.sent(wr_id)  # (a Send of a plain message made in C)

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
            if self._plain is not None:  # (C takes plain messages in the engine's calls)
                self._hooked = self.cq.set_native_handler(*self._plain.handler, self._plain)
                self._plain.watch_oldest()  # (what the first pump sent)
                if self._hooked:  # (a socket's sendto may go in one call into C: _open)
                    self._plain.posting(
                        self.qp.run_native_handler, self.qp.native_runner(), self._watch_write
                    )
            self._on_cq(self.cq)  # what came before, and arm
            while self._failure is None:
                # (the backstop while no reader came back since the hold: ack_needed)
                held_until = self.flow.state.ack_at
                self._timer_at = held_until + (ACK_BACKSTOP if self._ack_listed else 0.0)
                if self._hooked and self._timer_at == math.inf and self.rds.unacked:
                    self._timer_at = self._clock() + ACK_BACKSTOP  # (see pump_sends)
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
                self.settle()  # (no reader came back: the backstop)
                if self._unjudged:
                    self.ack_needed()  # (as a reader coming back would: no reader did)
                if self._failure is None and self.flow.ack_expired(self._clock()):
                    self._send_ack()
            raise self._failure
        finally:
            self.lost = True
            with contextlib.suppress(OSError):  # the CQ may be closed already
                if self._hooked:
                    self._hooked = False
                    self._plain.sync()  # type: ignore[union-attr]  # (the next session sends
                    self.cq.set_native_handler(0, 0)  # again what the peer did not have)
                    if self._unfolded.has_ack:  # (the next session numbers on from here)
                        self._plain.fold(None)  # type: ignore[union-attr]
                self.cq.set_handler(None)
