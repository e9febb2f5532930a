"""What an RDS-over-RDMA session does around its CQ's native handler (RDS's C path,
:mod:`.plain`): a reader's drive of the CQ, and what becomes of the messages and
acknowledgements C took without Python.

C delivers a plain message to its socket inside the engine's call, and adds the
credits it takes and the receives it posts again to the flow's counters itself. The
rest (the connection's numbers and counters, the acknowledgements of our messages) is
folded into the session only when something needs it: a Send of Python's, a look at
the room, counters asked for, or the session's backstop timer. Whether our own
acknowledgement must go alone is judged when a reader goes back to waiting, from C's
numbers: by then its answer has usually carried it, and nothing is folded.

A message Python would send next and alone goes from C's own send buffers, with the
RDMA Write it chases if any; that operation ends when the session next folds, unless
someone waits for it.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any

from rdmashim.ulps.rds.rdma import status_of
from rdmashim.ulps.rds.rdma_flow import ACK_DELAY, ACK_HELD, ACK_NOW, RdmaFlow
from rdmashim.ulps.rds.rdma_pacing import ACK_BACKSTOP
from rdmashim.verbs import WCStatus

if TYPE_CHECKING:
    from collections.abc import Callable

    import trio

    from rdmashim.ulps.rds.connection import RdsConnection
    from rdmashim.ulps.rds.plain import PlainReceiver
    from rdmashim.ulps.rds.rdma import RdmaOp
    from rdmashim.verbs.abc import CQ


class HookedSession:
    """The part of :class:`~.rdma_session.Session` that works with the native handler
    (a base class: the session holds the state named here)."""

    flow: RdmaFlow
    cq: CQ
    rds: RdsConnection
    lost: bool
    _plain: PlainReceiver | None
    _unfolded: Any
    """The C scan's state (``rp_rx``), or None: no C path."""
    _hooked: bool
    _unjudged: bool
    _ack_listed: bool
    _on_ack: Callable[[Any], None]
    _timer: trio.CancelScope | None
    _timer_at: float
    _clock: Callable[[], float]
    _send_ack: Callable[[], None]

    def ack_needed(self) -> None:
        """A reader goes back to waiting (the node calls this once after the handler held
        an acknowledgement back): if no message of ours carried it yet, it goes on its
        own :data:`~rdmashim.ulps.rds.rdma_flow.ACK_DELAY` after the hold began, not at
        the backstop (:data:`ACK_BACKSTOP`)."""
        self._ack_listed = False
        if self._unjudged:
            self._judge()
        at = self.flow.state.ack_at
        if at < self._timer_at and (timer := self._timer) is not None:
            timer.deadline = self._timer_at = at

    def want_acks(self) -> None:
        """A sender waits for room: what the native handler took is folded in now (its
        acknowledgements may make the room), and it asks for Python at the next ones."""
        if self._hooked:
            self._plain.sending(True)  # type: ignore[union-attr]
            if self._unfolded.has_ack:
                self._fold()

    def _judge(self) -> None:
        """Look at the acknowledgement of messages the native handler took: it goes now if
        many receives wait to be granted, else it is held (unless a message of ours
        carried it meanwhile)."""
        self._unjudged = False
        flow = self.flow
        rx = self._unfolded
        newer = rx is not None and rx.has_ack  # (C's numbers: judged without a fold)
        due = flow.acknowledge(self._clock, rx.next_recv if newer else None)
        if due == ACK_NOW:
            if newer:
                self._fold()  # (the acknowledgement's number is the connection's)
            self._send_ack()
            flow.state.ack_at = math.inf
        elif (
            due == ACK_HELD and (at := flow.state.ack_at) < self._timer_at
            and (timer := self._timer) is not None
        ):  # fmt: skip
            timer.deadline = self._timer_at = at

    def _fold(self) -> None:
        """Give the session what the CQ's native handler took (:meth:`.PlainReceiver.fold`):
        its credits, acknowledgements and numbers. Whether to hold an acknowledgement back
        is looked at when the reader goes back to waiting (by then its answer may have
        carried it), or at the backstop (:data:`ACK_BACKSTOP`) if no reader comes back."""
        plain = self._plain
        assert plain is not None  # (has_ack is C's)
        if plain.fold(None):
            self._taken_in_c()

    def _taken_in_c(self) -> None:
        """The native handler took messages: whether their acknowledgement goes on its own
        is looked at when a reader goes back to waiting (:meth:`ack_needed`), and what
        they changed is folded in by the backstop at the latest."""
        self._unjudged = True
        if not self._ack_listed:
            self._ack_listed = True
            self._on_ack(self)
        if self._timer_at == math.inf and (timer := self._timer) is not None:
            timer.deadline = self._timer_at = self._clock() + ACK_DELAY + ACK_BACKSTOP

    def settle(self) -> None:
        """Fold in what the native handler took, and bring in what went through the gate
        of a socket's sendto in C (:meth:`.Carrier.settle`; the fold brings that in first,
        whether or not the handler took anything)."""
        if self._plain is not None:
            self._fold()

    def _open(self) -> None:
        """A message went from C (plain, or chasing an RDMA Write) with nothing of Python's
        before it: a socket's next ones may go in one call into C
        (:meth:`.SendGate.open`) until Python sends, queues or folds anything, or the
        backstop, armed now, comes (each of those brings them in first)."""
        if self._hooked and self._timer_at != math.inf:
            self._plain.open()  # type: ignore[union-attr]

    async def drive_until(self, ready: Callable[[], bool], quiet: int = 0) -> bool:
        """A reader's wait (:class:`~.transport.Drivable`): it drives the session's CQ
        (``cq.drive_until``); ``quiet`` is its socket's port, for which the native handler
        wakes no one (the reader looks after each read). What C took is noted when it
        returns (:meth:`_taken_in_c`) and folded in when something needs it."""
        if not self._hooked:
            return await self.cq.drive_until(ready)
        hook = self._plain.hook  # type: ignore[union-attr]
        hook.quiet_port = quiet
        try:
            return await self.cq.drive_until(ready)
        finally:
            hook.quiet_port = 0
            if self._unfolded.has_ack and not self._unjudged:
                self._taken_in_c()  # (folded when something needs it: no call a message)

    def interrupt_wait(self) -> None:
        """Make a :meth:`drive_until` in progress look at its ``ready`` again now."""
        self.cq.interrupt_wait()

    # ------------------------------------------------------------------ sending in C
    def _staged_in_c(
        self, seq: int, sport: int, dport: int, data: bytes, rdma: RdmaOp | None
    ) -> bool:
        """Whether C's send buffers took the message (and the RDMA Write it chases)."""
        plain = self._plain
        assert plain is not None  # (on the C path: _alone)
        if rdma is None:
            return bool(plain.send(seq, sport, dport, data, len(data)))
        mr = rdma._mr
        if not rdma.write or mr is None:
            return False
        if not plain.send_write(seq, sport, dport, data, len(data), *rdma._c_write(mr)):
            return False
        rdma._watch = functools.partial(self._watch_write, seq)  # (no cycle through rdma)
        return True

    def _watch_write(self, seq: int) -> None:
        """Someone waits for the RDMA operation C sent with message ``seq``: it ends with
        the acknowledgement, which C may have taken already (folded in here), else the
        native handler asks when it comes. (Nobody waiting, the status comes at the next
        fold: a handler run per operation costs rds stress ``-D 64K`` a fifth.)"""
        if self.lost or self._plain is None:
            return
        self.settle()
        unacked = self.rds.unacked
        if unacked and unacked[0].seq <= seq:  # (else the fold ended it)
            self._plain.watch(seq)

    def _write_failed(self, seq: int, status: WCStatus) -> None:
        """The RDMA Write a message sent in C chased (numbered ``seq``; -1: not one) failed
        with ``status``: its operation says so, as :meth:`.RdmaPosts.done` says it of
        Python's (a flushed one is dropped with its message when the session ends)."""
        if seq < 0 or status == WCStatus.WR_FLUSH_ERR:
            return
        self._plain.sync()  # type: ignore[union-attr]  # (it may have gone through the gate)
        for msg in self.rds.unacked:
            if msg.seq == seq and msg.rdma is not None:
                self.rds.counters.rdma_failures += 1
                msg.rdma._finish(status_of(status), status.name)
                return
