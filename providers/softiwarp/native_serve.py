"""A connection served from a thread of its own (``CQ.serve_in_thread`` on the native engine).

A ULP that answers most messages at once, as an RPC server does, can let a thread
take its connection's completions instead of a task: a turn of the thread is one call
into C without the GIL (``rs_qp_serve_poll``: ``poll`` of the socket and an eventfd,
the read, the engine's processing of what came and the write of what waits to go,
then the poll of the CQ into the caller's ``WCArray``), then, holding the GIL, the
ULP's callback, which may post on the QP. No trio task wakes for a message, and the
event loop's machinery around a wait (the socket's loan, the idle-wait budget, the
receive task's parking) is not on the way: what a message costs is the engine's
call, the poll and the ULP's own work, as in a TCP server's thread per connection.

While the thread serves, the QP's receive task is parked and the event loop leaves
the QP, its CQ and the socket to it: the provider's news of new completions are
handed on by that thread only (``NativeQP._sync``), and a write the socket had no
room for stays in C for the thread's wait to finish. The thread gives the QP back
when the ULP's callback returns False, when the QP leaves RTS or has news only the
event loop acts on (the peer's RTR, a CQ overrun), and when the waiting task is
cancelled (its eventfd). Every call into the engine takes its device's lock
(``_engine.c``), so the thread and the event loop's calls on the device's other QPs,
its registrations and deregistrations never meet inside C.

A connection that answers from slots (``verbs.slots.Slots``) is served by
:class:`Answering` while its slots are usable: their state is handed to C
(``rs_slots``), and a turn is one call, ``rs_qp_serve_slot``, that posts the last
answer from its Send slot, gives its Receive back, writes, waits, reads and polls,
freeing the Send slots from their completions itself; a lone received message comes
back as three numbers (its slot, its length, a free Send slot) for ``slots.answer``,
and only the rest becomes rows for the callback, with the state handed back first.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from rdmashim.providers.softiwarp.native import ffi, lib
from rdmashim.verbs.errors import VerbsError
from rdmashim.verbs.slots import LEFT

if TYPE_CHECKING:
    from rdmashim.verbs.slots import Slots
    from rdmashim.verbs.wr import WCArray


class ServedCQ(Protocol):
    """What the thread asks of the CQ it polls (``NativeCQ``)."""

    def serve_poll(self, qp: Any, fd: int, wake: int, wcs: WCArray) -> int: ...

    def rows_for(self, wcs: WCArray) -> Any: ...


class ServedQP(Protocol):
    """What the thread asks of the QP it serves (``NativeQP``)."""

    _served_by: int | None


class Answering:
    """A thread's hold on a connection's slots: their state in C (``rs_slots``) while
    it answers from them (:meth:`serve`), handed over before and back after."""

    def __init__(self, slots: Slots) -> None:
        self.slots = slots
        self._free = ffi.new("uint32_t[]", slots.nsend)
        self._unacked = ffi.new("uint32_t[]", slots.nsend)
        self._reposts = ffi.new("uint32_t[]", slots.repost_every)
        c = self.c = ffi.new("rs_slots *")
        c.recv_addr, c.recv_size, c.recv_lkey = slots.recv
        c.send_addr, c.send_size, c.send_lkey = slots.send
        c.nrecv, c.nsend, c.send_base = slots.nrecv, slots.nsend, slots.send_base
        c.signal_every, c.repost_every = slots.signal_every, slots.repost_every
        c.free, c.unacked, c.reposts = self._free, self._unacked, self._reposts

    def give(self) -> None:
        """Hand the slots' state to C."""
        s, c = self.slots, self.c
        c.nfree, c.head, c.nunacked, c.nreposts = len(s.free), 0, len(s.unacked), len(s.reposts)
        self._free[0 : c.nfree] = s.free
        self._unacked[0 : c.nunacked] = list(s.unacked)
        self._reposts[0 : c.nreposts] = s.reposts
        c.unsignaled, c.room = s.unsignaled, s.room
        c.lone, c.reply_len = 0, lib.RS_NO_REPLY

    def take(self) -> None:
        """Take the slots' state back from C, into the same lists."""
        s, c = self.slots, self.c
        s.free[:] = self._free[0 : c.nfree]
        head, ring, nsend = c.head, self._unacked, s.nsend
        s.unacked.clear()
        s.unacked.extend(ring[(head + i) % nsend] for i in range(c.nunacked))
        s.reposts[:] = self._reposts[0 : c.nreposts]
        s.unsignaled, s.room = c.unsignaled, c.room

    def serve(self, ptr: Any, fd: int, wake: int, cq: ServedCQ, wcs: WCArray) -> int:
        """Turns answering from the slots until one has rows for the callback (their
        count, taken into ``wcs``) or the QP goes back (0 or below, as
        ``rs_qp_serve_slot`` says; 0 too when ``answer`` left a message for later)."""
        c, answer, turn = self.c, self.slots.answer, lib.rs_qp_serve_slot
        assert answer is not None
        rows = cq.rows_for(wcs)
        out, summed = rows.c, rows.sum
        self.give()
        try:
            while True:
                n: int = turn(ptr, fd, wake, c, out, summed)
                if n == 1 and c.lone:
                    length = answer(c.recv_slot, c.recv_len, c.send_slot)
                    if length >= 0:
                        c.reply_len = length
                        continue
                    if length == LEFT:
                        return 0
                if n == -errno.EINVAL:
                    raise VerbsError(
                        errno.EINVAL, "serve_in_thread",
                        f"an answer of {c.reply_len} bytes does not fit a {c.send_size}-byte "
                        "Send slot, or the slots changed during a turn or do not add up "
                        "(a Send slot both free and out, or out twice)",
                    )  # fmt: skip
                if n > 0:
                    rows.decode_into(wcs, n)
                return n
        finally:
            self.take()


@dataclass(slots=True)
class Service:
    """One turn of a thread serving a QP: from :meth:`run`'s start to its return."""

    ptr: Any
    """The QP's ``rs_qp``."""
    fd: int
    """Its socket."""
    wake: int
    """The eventfd :meth:`interrupt` writes."""
    cq: ServedCQ
    wcs: WCArray
    on_completions: Callable[[WCArray, int], bool]
    answering: Answering | None = None

    def run(self, qp: ServedQP) -> None:
        """The thread's loop (see the module doc); returns when the QP goes back."""
        qp._served_by = threading.get_ident()
        ptr, fd, wake, cq, wcs = self.ptr, self.fd, self.wake, self.cq, self.wcs
        on_completions, answering = self.on_completions, self.answering
        while True:
            if answering is not None and answering.slots.usable():
                n = answering.serve(ptr, fd, wake, cq, wcs)
            else:
                n = cq.serve_poll(ptr, fd, wake, wcs)  # (0: news for the event loop; < 0: woken)
            if n <= 0 or not on_completions(wcs, n):
                return

    def interrupt(self) -> None:
        """Make :meth:`run` return soon (from any thread)."""
        os.eventfd_write(self.wake, 1)
