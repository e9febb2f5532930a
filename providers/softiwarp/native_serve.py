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
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from rdmashim.verbs.wr import WCArray


class ServedCQ(Protocol):
    """What the thread asks of the CQ it polls (``NativeCQ``)."""

    def serve_poll(self, qp: Any, fd: int, wake: int, wcs: WCArray) -> int: ...


class ServedQP(Protocol):
    """What the thread asks of the QP it serves (``NativeQP``)."""

    _served_by: int | None


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

    def run(self, qp: ServedQP) -> None:
        """The thread's loop (see the module doc); returns when the QP goes back."""
        qp._served_by = threading.get_ident()
        ptr, fd, wake, cq, wcs = self.ptr, self.fd, self.wake, self.cq, self.wcs
        on_completions = self.on_completions
        while True:
            n = cq.serve_poll(ptr, fd, wake, wcs)  # (0: news for the event loop; < 0: woken)
            if n <= 0 or not on_completions(wcs, n):
                return

    def interrupt(self) -> None:
        """Make :meth:`run` return soon (from any thread)."""
        os.eventfd_write(self.wake, 1)
