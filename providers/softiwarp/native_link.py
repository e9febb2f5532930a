"""The native engine as the connection setup, the CM and the I/O driver see it.

:class:`NativeEngine` is one QP's C state behind the Python engine's face (its state,
start, errors and the bytes read with the MPA exchange); :class:`NativeLink` is that
QP's trio I/O (:class:`~.driver.Link`): the socket's bytes go to C and back in one
call each (``rs_qp_read_fd``, ``rs_qp_flush_fd``), and a waiter that takes the socket
on again waits, reads and polls in one (``rs_qp_wait_poll_fd``). The verbs objects
over them are :mod:`.native_provider`'s.
"""

from __future__ import annotations

import errno
import socket as _stdlib_socket
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

import trio

from rdmashim.providers.softiwarp import native
from rdmashim.providers.softiwarp.driver import BUSY, Busy, Link
from rdmashim.providers.softiwarp.jobs import EngineConfig, EngineState
from rdmashim.providers.softiwarp.memory import Region
from rdmashim.providers.softiwarp.native import ffi, lib
from rdmashim.providers.softiwarp.native_cq import NativeCQ
from rdmashim.providers.softiwarp.native_memory import NativeMemoryTable
from rdmashim.providers.softiwarp.terminate import ProtocolError, TermCode
from rdmashim.verbs import lending
from rdmashim.verbs.errors import VerbsError

_STATES = (EngineState.IDLE, EngineState.RTS, EngineState.TERMINATE, EngineState.ERROR)
_RX_READ = 256 * 1024
"""What one ``rs_qp_read_fd`` reads at most (``RX_READ`` in ``_engine.c``)."""
_EAGAIN = -errno.EAGAIN
_EINTR = -errno.EINTR
_EBUSY = -errno.EBUSY
_ERR_REMOTE = 2
_ERR_USER = 5
# C's own numbers (_engine.h), bound once
_ERR_CQ_OVERRUN = lib.RS_ERR_CQ_OVERRUN if lib is not None else 0
_NEWS_CQ = lib.RS_NEWS_CQ if lib is not None else 0
LOWAT_MIN, LOWAT_MAX = 16 * 1024, 1024 * 1024
"""Owed bytes from which a reader waits for them before it looks, and at most how many."""
SPIN_SLICE = 200e-6
"""Seconds a busy-polling waiter spins in C before the other tasks get a turn."""


class EngineOwner(Protocol):
    """What a :class:`NativeEngine` asks of the QP that owns it (the native QP)."""

    _awaiting_rtr: bool
    _cqs: Sequence[NativeCQ]

    def _sync(self) -> None:
        """Hand on what C did since the last look (completions, ERROR, the peer's RTR)."""


class NativeEngine:
    """One QP's C state, seen as the Python engine is by the connection setup, the CM
    and the :class:`~.driver.Link` (state, start, errors, bytes in)."""

    def __init__(
        self, owner: EngineOwner, core: native.NativeQP, memory: NativeMemoryTable
    ) -> None:
        self._owner = owner
        self.core = core
        self.ptr = core._ptr
        self.view = core.view
        self.qp_num = core.qp_num
        self.memory = memory
        self.config = EngineConfig()
        self.on_ready: Callable[[], None] = lambda: None
        """P2P responder: called when the initiator's RTR arrives (the CM's ESTABLISHED)."""
        self.error: Exception | None = None
        self.remote_terminate: TermCode | None = None
        self.link: NativeLink | None = None
        """The QP's socket's driver, once MPA is done (:meth:`submit_send` writes into it)."""
        self._wrote = ffi.new("int64_t *")
        """Where ``rs_qp_post_send_fd`` says how its writes ended."""
        self.runner = ffi.new("rs_runner *")
        """``qp.native_runner``'s context (``rs_runner``): the QP, and its socket while a
        link has it open (-1: none)."""
        self.runner.qp, self.runner.fd = self.ptr, -1

    @property
    def state(self) -> EngineState:
        """The protocol state."""
        return _STATES[lib.rs_qp_state(self.ptr)]

    @property
    def tx_ready(self) -> bool:
        """Whether bytes wait to be sent."""
        return bool(self.view.tx_ready)

    @property
    def bytes_received(self) -> int:
        """Bytes received ever (busy polling watches it)."""
        return int(lib.rs_qp_rx_total(self.ptr))

    @property
    def sq_depth(self) -> int:
        """Send work requests posted and not completed."""
        return int(self.view.sq_depth)

    def start(self, config: EngineConfig) -> None:
        """Enter RTS with what MPA negotiated."""
        self.core.start(config)
        self.config = config
        self._owner._awaiting_rtr = config.wait_for_rtr

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Bytes from the peer (those read with the MPA exchange)."""
        self.core.receive(data)
        self._owner._sync()

    def set_error(self, exc: Exception | None = None) -> None:
        """Move to ERROR (the user, the CM, a failed handler): flush everything."""
        self._fail(exc or ConnectionAbortedError("QP moved to ERROR"))

    def connection_lost(self, exc: Exception | None = None) -> None:
        """The TCP connection closed or failed."""
        self._fail(exc or ConnectionResetError("connection closed by peer"))

    def _fail(self, exc: Exception) -> None:
        if lib.rs_qp_state(self.ptr) == 3:  # ERROR already
            return
        self.error = self.error or exc
        lib.rs_qp_set_error(self.ptr, _ERR_USER, str(exc).encode()[:150])
        self._owner._sync()

    def submit_send(self, array: Any, n: int) -> int:
        """Give C ``n`` packed send requests (``rs_send_wr[]``); when the socket has room,
        C writes their bytes in the same call. How many C took."""
        link = self.link
        if link is None or link._pending:  # not connected, or the transmit task waits
            return int(lib.rs_qp_post_send(self.ptr, array, n, self.core._why))
        wrote = self._wrote
        taken = lib.rs_qp_post_send_fd(self.ptr, array, n, self.core._why, link._fd, wrote)
        if wrote[0]:
            link.stopped_by(wrote[0])
        return int(taken)

    def run_hook(self) -> None:
        """Run the native handler of the QP's send CQ now (``rs_qp_run_hook``); when the
        socket has room, C writes what it posted in the same call."""
        link = self.link
        if link is None or link._pending:  # not connected, or the transmit task waits
            lib.rs_qp_run_hook(self.ptr)  # (that task writes what it posted)
            return
        wrote = self._wrote
        lib.rs_qp_run_hook_fd(self.ptr, link._fd, wrote)
        if wrote[0]:
            link.stopped_by(wrote[0])

    @property
    def kind(self) -> int:
        """Why C moved the QP to ERROR (``RS_ERR_*``; 0 while it has not)."""
        return int(self.core.error[0])

    def explain(self) -> Exception:
        """Why C moved the QP to ERROR, as the Python engine says it."""
        kind, code, message = self.core.error
        if kind == _ERR_CQ_OVERRUN:
            full = [cq for cq in self._owner._cqs if cq._view.overrun]
            return full[0].overrun_error() if full else VerbsError(errno.EOVERFLOW, "cq", message)
        if kind == _ERR_REMOTE:
            self.remote_terminate = code
            meaning = code.meaning
            text = (
                f"the peer ended the connection: {meaning}"
                if meaning
                else "the peer ended the connection with a Terminate"
            )
            return ProtocolError(text, code)
        if kind == _ERR_USER:
            return ConnectionResetError(message)
        return ProtocolError(message, code)


class NativeLink(Link):
    """The trio I/O of one native QP: the socket's bytes go to C and back in one call."""

    def __init__(self, engine: NativeEngine, sock: trio.socket.SocketType, leftover: bytes) -> None:
        super().__init__(engine, sock, leftover)  # type: ignore[arg-type]
        engine.runner.fd = self._fd  # (a ULP's C may write into it now: rs_run)
        self._runner = engine.runner
        self._ptr = engine.ptr
        self._view = engine.view
        self._sync = engine._owner._sync
        self._cqs = engine._owner._cqs
        self._lowat = 1
        """The socket's SO_RCVLOWAT (:meth:`_expect`)."""
        self._got = ffi.new("int64_t[2]")
        """What ``rs_qp_wait_poll_fd``'s read returned, and whether its rows are all the
        caller has to hand on."""
        self._trio_first = False
        """:meth:`wait_poll` found trio with work (or its time up): the wait that follows
        goes through trio at once, not through another idle ``poll``."""
        self.idle_ok = True
        """Whether the last idle wait read (or was never tried): :meth:`wait_poll` is
        tried only then (both ends of a ping-pong in one run never wait idle)."""

    def revoke(self, region: Region) -> None:
        """C holds what waits to be written: nothing here views a region."""

    def _closing(self) -> None:
        """The socket closes now: ``rs_run`` writes into it no more."""
        self._runner.fd = -1

    def _write(self) -> None:
        """Write what C framed until it has nothing more or the socket is full."""
        self._pending = []
        n = lib.rs_qp_flush_fd(self._ptr, self._fd)
        if n:
            self.stopped_by(n)
        elif lib.rs_qp_state(self._ptr) == 3:
            self._tx_wakeup.set()  # let the transmit task end the connection

    def flush(self) -> None:
        """:meth:`_write`, then hand on what C did meanwhile."""
        self._write()
        self._sync()

    def stopped_by(self, n: int) -> None:
        """A write into the socket ended with ``-errno`` ``n``: the socket is full
        (``-EAGAIN``: the transmit task waits for room and goes on) or failed (C is in
        ERROR: the transmit task ends the connection)."""
        if self.threaded:  # (C keeps it: the serving thread's wait writes it, or sees ERROR)
            return
        if n == _EAGAIN:
            self._pending = [b""]  # (what the transmit task waits to write)
        self._tx_wakeup.set()

    def _read(self) -> bool | None:
        """Read once into C; whether the socket is (probably) empty now, None at its end."""
        return self._took(lib.rs_qp_read_fd(self._ptr, self._fd))

    def _read_idle(self) -> bool | Literal[Busy.BUSY] | None:
        """The wait and the read in one call into C, without the GIL (see
        :meth:`.driver.Link._read_idle`)."""
        if self._trio_first:
            self._trio_first = False
            return BUSY
        found = self.wait_point.idle()
        n = _EBUSY if found is None else lib.rs_qp_wait_read_fd(self._ptr, self._fd, *found)
        self.idle_ok = n != _EBUSY
        if n == _EBUSY:
            return BUSY
        return self._took(n)

    def wait_poll(self, cq: NativeCQ, out: Any, summary: Any, n: int, spin: float) -> int:
        """A waiter's next wait when it takes the socket on again (a ping-pong): the
        busy polling for ``spin`` seconds, the idle wait, the read and the poll of up to
        ``n`` completions of ``cq`` (this QP's only CQ) into the C rows ``out`` (what
        they have in common in ``summary``) in one call into C
        (``rs_qp_wait_poll_fd``). The rows taken; 0 when nothing was, or when this wait
        must go through :meth:`read_until`: the socket was not lent to the waiter or its
        last read did not empty it, the other tasks are due a turn
        (:data:`~rdmashim.verbs.lending.READS_BEFORE_YIELD`), trio has other work, or
        ``spin`` is longer than one slice (:data:`SPIN_SLICE`). What was read is
        processed as :meth:`read_until`'s reads are, and the socket lent again.
        """
        loan = self._loan
        if (
            not loan.active or not self._drained or spin > SPIN_SLICE
            or self._streak >= lending.READS_BEFORE_YIELD
        ):  # fmt: skip
            return 0
        loan.end()
        found = self.wait_point.idle()
        taken = 0
        if found is None:
            self.idle_ok = False
        else:
            got = self._got
            # Nothing but the rows to hand on (got[1]) is possible only while the CQ has
            # no one to wake or notify and the socket's mark is the plain one.
            quiet = (
                LOWAT_MIN
                if self._lowat == 1 and cq._waiter is None and cq._reader is None
                and not cq._armed
                else 0
            )  # fmt: skip
            taken = lib.rs_qp_wait_poll_fd(
                self._ptr, self._fd, int(spin * 1e9), found[0], found[1], cq._ptr,
                out, n, summary, quiet, got,
            )  # fmt: skip
            read = got[0]
            if read == _EBUSY:
                self.idle_ok = False
                self._trio_first = True
            else:
                # The idle wait ended a wait that began while trio had nothing to do and
                # would have ended had it any: no task's turn was taken. A spin looks at
                # nothing else: a turn is due after READS_BEFORE_YIELD of them.
                self._streak = self._streak + 1 if spin else 0
                if got[1]:  # (C cleared the news; the CQ's count stays 0: NativeCQ._sync)
                    view = cq._view
                    cq._pushed, cq._notable = view.pushed, view.notable
                    self._drained = read < _RX_READ
                else:
                    self._took(read)
        if self._rx_stopped:
            self.hand_back()  # (the receive task ends the connection)
        else:
            loan.lend()
        return int(taken)

    async def _spin(self, seconds: float) -> bool | None:
        """Busy polling in C, without the GIL: read until bytes come, for at most
        ``seconds`` (and :data:`SPIN_SLICE`, then the other tasks run)."""
        ns = int(min(seconds, SPIN_SLICE) * 1e9)
        n = lib.rs_qp_spin_fd(self._ptr, self._fd, ns)
        if n == _EAGAIN:
            await trio.lowlevel.checkpoint()
            self._streak = 0  # (the others ran)
        elif n > 0:
            # Read without letting the others run: a turn is due after
            # READS_BEFORE_YIELD of these (read_until takes it at the next wait's start;
            # busy polling must not starve a task that became ready meanwhile, such as
            # a new connection's own). The next wait may be one call again (else, busy
            # polling, no idle wait would come to say so).
            self._streak += 1
            self.idle_ok = True
        return self._took(n)

    def _took(self, n: int) -> bool | None:
        """What a read into C of ``n`` bytes (or -errno) means: whether the socket is
        (probably) empty now, None at its end."""
        if n == _EAGAIN:
            self._drained = True
            return True
        if n == _EINTR:
            return False
        if n <= 0:  # the peer's FIN or a socket error: C moved to ERROR
            self._rx_stopped = True
            self.flush()
            return None
        view = self._view
        if view.tx_ready and not self._pending:  # Read Responses, ...
            self.flush()  # (it syncs)
        elif view.news and (  # (none: a CQ's native handler took what came)
            view.news != _NEWS_CQ or self._cqs[0]._reader is not self.wait_point
            or not self._handed_to_driver()
        ):  # fmt: skip
            self._sync()
        owed = view.rx_owed
        if owed >= LOWAT_MIN or self._lowat != 1:  # (else the mark stays 1: nothing to do)
            self._expect(owed)
        self._drained = drained = n < _RX_READ
        return drained

    def _handed_to_driver(self) -> bool:
        """Completions alone came to the CQ this task drives (:meth:`.CQ.drive_until`:
        the caller found its reader to be this link's): when it is the QP's only CQ,
        has a handler, is armed for any completion and has no other waiter, run the
        handler now, in one hop, and say so (else :meth:`_sync` hands the completions
        on, through the context's queue of due handlers)."""
        cqs = self._cqs
        if len(cqs) != 1:
            return False
        cq = cqs[0]
        context = cq.context
        if (
            not cq._armed or cq._solicited_only or cq._waiter is not None
            or cq.channel is not None or cq.handler is None or context._dispatching
        ):  # fmt: skip
            return False
        found = cq._view
        if found.overrun:
            return False
        self._view.news = 0
        cq._pushed, cq._notable, cq._count = found.pushed, found.notable, found.count
        cq._armed = False
        context._dispatching = True  # (as the context's dispatch runs a handler)
        try:
            cq._handler_run()
        finally:
            context._dispatching = False
        return True

    def _expect(self, owed: int) -> None:
        """Let the socket say it is readable only once ``owed`` bytes (what the peer
        owes: the rest of an FPDU, of the responses to our Reads; at most
        :data:`LOWAT_MAX`) are there, not at every segment: a peer that sends a large
        response in small pieces (Linux siw: one FPDU a TCP segment) wakes its reader a
        few times, not once a segment. Only bytes that must come are waited for, and a
        FIN or an error wakes the reader whatever the mark."""
        mark = min(owed, LOWAT_MAX) if owed >= LOWAT_MIN else 1
        if mark != self._lowat:
            self._lowat = mark
            self.sock.setsockopt(_stdlib_socket.SOL_SOCKET, _stdlib_socket.SO_RCVLOWAT, mark)
