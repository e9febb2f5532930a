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
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from rdmashim.ulps.rds.rdma_flow import ACK_DELAY, ACK_HELD, ACK_NOW, RdmaFlow
from rdmashim.ulps.rds.rdma_pacing import ACK_BACKSTOP

if TYPE_CHECKING:
    from collections.abc import Callable

    import trio

    from rdmashim.ulps.rds.plain import PlainReceiver
    from rdmashim.verbs.abc import CQ


class HookedSession:
    """The part of :class:`~.rdma_session.Session` that works with the native handler
    (a base class: the session holds the state named here)."""

    flow: RdmaFlow
    cq: CQ
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
        """Fold in what the native handler took (:meth:`.Carrier.settle`)."""
        if self._unfolded is not None and self._unfolded.has_ack:
            self._fold()

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
