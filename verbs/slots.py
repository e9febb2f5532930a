"""Messages answered from slots: the state a thread serving a QP may take over.

A connection that answers each message it receives, as an RPC server does, can keep
its Receives and its Sends in fixed slots of two registered buffers: Receive slot
``i`` is posted as ``wr_id`` ``i``, Send slot ``j`` is sent as ``wr_id`` ``send_base +
j``. :class:`Slots` holds what it knows of them (which Send slots are free, which are
posted and not known complete, the Receives given back and not posted yet, how many
Sends since the last signaled one, the send queue's room), so that
``CQ.serve_in_thread(..., slots=...)`` can hand the whole of it to a backend that
answers in a thread without Python between the messages: the native engine then
posts each answer and gives its Receive back itself, frees the Send slots from their
completions, and calls :attr:`Slots.answer` with a lone received message and a free
Send slot (``docs/verbs.md``, "Answering from slots"). Its owner uses the same lists
in the event loop (they are the same objects before and after the thread); the
backend changes them only while it serves.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from rdmashim.verbs.wr import SGE

LEFT = -1
"""What :attr:`Slots.answer` returns when it took the message but sends no answer now
(the Receive stays the owner's; the thread gives the QP back)."""
NOT_TAKEN = -2
"""What :attr:`Slots.answer` returns when the message is not one it answers: it goes
to ``on_completions`` as a completion."""

Answer = Callable[[int, int, int], int]
"""``answer(recv_slot, length, send_slot)``: the message of ``length`` bytes in Receive
slot ``recv_slot``, answered by writing the answer at the start of Send slot
``send_slot`` and returning its length (the backend then posts it and gives the
Receive back), or :data:`LEFT` or :data:`NOT_TAKEN`."""


@dataclass(eq=False, slots=True)
class Slots:
    """The Receive and Send slots of one connection (see the module doc)."""

    recv: SGE
    """Receive slot 0: slot ``i`` is ``recv.length`` bytes at ``recv.addr + i * recv.length``."""
    nrecv: int
    send: SGE
    """Send slot 0: slot ``j`` is ``send.length`` bytes at ``send.addr + j * send.length``."""
    nsend: int
    send_base: int
    """The ``wr_id`` of Send slot 0."""
    signal_every: int
    """Sends from slots per signaled one: its completion frees it and those before it."""
    repost_every: int
    """Receives given back before they are posted again, in one post."""
    room: int
    """Work requests the send queue has room for."""
    free: list[int] = field(default_factory=list)
    """Free Send slots, a stack (the last is taken next)."""
    unacked: deque[int] = field(default_factory=deque)
    """Send slots posted and not known complete, in the order posted."""
    reposts: list[int] = field(default_factory=list)
    """Receive slots given back, not posted yet."""
    unsignaled: int = 0
    """Sends from slots since the last signaled one."""
    held: int = 0
    """Send slots out whose completion means more than a free slot (work requests
    before it, regions to close): while there are any, the owner frees them itself and
    a backend does not take the slots over."""
    answer: Answer | None = None
    """How a thread answers a lone message (None: it does not)."""

    def usable(self) -> bool:
        """Whether a backend may take the slots over now."""
        return self.held == 0 and self.answer is not None

    # What an owner does itself, as the backend does it (for the completions it is
    # handed, and on backends that do not answer from slots):

    def take_send(self) -> tuple[int, bool]:
        """A free Send slot for a Send of one work request posted now, and whether that
        Send is signaled (every ``signal_every``-th); counted as out."""
        slot = self.free.pop()
        signaled = self.unsignaled + 1 >= self.signal_every
        self.unsignaled = 0 if signaled else self.unsignaled + 1
        self.unacked.append(slot)
        self.room -= 1
        return slot, signaled

    def completed(self, slot: int) -> None:
        """The signaled Send of ``slot`` completed: it and every Send out before it are
        free (each of one work request: see :attr:`held`)."""
        while True:
            done = self.unacked.popleft()
            self.free.append(done)
            self.room += 1
            if done == slot:
                return

    def give_back(self, recv_slot: int) -> list[int]:
        """Receive slot ``recv_slot`` is done with: the Receive slots to post again now
        (``repost_every`` of them at once), or none yet."""
        self.reposts.append(recv_slot)
        if len(self.reposts) < self.repost_every:
            return []
        now = self.reposts[:]
        self.reposts.clear()
        return now
