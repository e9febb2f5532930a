"""A connection served from a thread of its own (``CQ.serve_in_thread`` on the native engine).

A ULP that answers most messages at once, as an RPC server does, can let a thread
take its connection's completions instead of a task: the thread waits in one call
into C without the GIL (``rs_qp_serve_wait``: ``poll`` of the socket and an eventfd,
then the read, the engine's processing of what came and the write of what waits to
go), then, holding the GIL, polls the CQ into the caller's ``WCArray`` and calls the
ULP there, which may post on the QP. No trio task wakes for a message, and the
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

from rdmashim.providers.softiwarp.native import lib

if TYPE_CHECKING:
    from rdmashim.verbs.wr import WCArray

_RTS = lib.RS_QP_RTS if lib is not None else 1
_NEWS_CQ = lib.RS_NEWS_CQ if lib is not None else 1


class ServedCQ(Protocol):
    """What the thread asks of the CQ it polls (``NativeCQ``)."""

    def __len__(self) -> int: ...

    def poll_into(self, wcs: WCArray, num_entries: int | None = None) -> int: ...


class ServedQP(Protocol):
    """What the thread asks of the QP it serves (``NativeQP``)."""

    _served_by: int | None

    def _sync(self) -> None: ...


@dataclass(slots=True)
class Service:
    """One turn of a thread serving a QP: from :meth:`run`'s start to its return."""

    ptr: Any
    """The QP's ``rs_qp``."""
    fd: int
    """Its socket."""
    wake: int
    """The eventfd :meth:`interrupt` writes."""
    view: Any
    """The QP's ``rs_qp_view``."""
    cq: ServedCQ
    wcs: WCArray
    on_completions: Callable[[WCArray, int], bool]

    def run(self, qp: ServedQP) -> None:
        """The thread's loop (see the module doc); returns when the QP goes back."""
        qp._served_by = threading.get_ident()
        ptr, fd, wake, view, cq, wcs = self.ptr, self.fd, self.wake, self.view, self.cq, self.wcs
        on_completions = self.on_completions
        while True:
            if not len(cq) and lib.rs_qp_serve_wait(ptr, fd, wake) < 0:
                return  # woken (the owner takes the QP back), or poll failed
            if view.news & ~_NEWS_CQ or lib.rs_qp_state(ptr) != _RTS:
                return  # (the event loop acts on it: RTR, ERROR, an overrun)
            qp._sync()
            n = cq.poll_into(wcs)
            if n and not on_completions(wcs, n):
                return

    def interrupt(self) -> None:
        """Make :meth:`run` return soon (from any thread)."""
        os.eventfd_write(self.wake, 1)
