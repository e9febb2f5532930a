"""The trio I/O around one queue pair's engine.

Receive: a task reads straight into the buffer the engine names (a staging
buffer, or the target slice of registered memory for a large payload) with
non-blocking ``readv`` calls, and waits for readability only when the socket
is empty.

Transmit: :meth:`Link.flush` is synchronous. ``post_send`` (and the receive
task, when a Read Request asks for a response) calls it directly: it gathers
the FPDUs the engine produces (headers, memory slices, CRC trailers) into
``writev`` calls until the engine has nothing more or the socket is full. Only
then does a transmit task wait for writability and continue. So a small Send
leaves inside ``post_send``, with no task switch.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket as _stdlib_socket
from collections.abc import Callable

import trio

from rdmashim.verbs.softiwarp.engine import Chunk, Engine, EngineState

log = logging.getLogger(__name__)

_IOV_MAX = 1024
LINGER = 2.0
"""Seconds to wait for the peer's FIN after ours before closing the socket."""
_ERROR = EngineState.ERROR
_RX_BATCH = 16
"""Reads in a row without waiting before the receive task yields to others."""


class Link:
    """Moves bytes between a connected TCP socket and an :class:`Engine`."""

    def __init__(self, engine: Engine, sock: trio.socket.SocketType, leftover: bytes = b"") -> None:
        self.engine = engine
        self.sock = sock
        self._fd = sock.fileno()
        self._leftover = leftover
        self._pending: list[Chunk] = []
        self._pending_total = 0
        self._tx_wakeup = trio.Event()
        self._rx_done = trio.Event()
        self.closed = trio.Event()
        self.after_receive: Callable[[], None] = lambda: None
        """Called in the receive task after each batch of received bytes is processed."""

    # ------------------------------------------------------------------ transmit
    def kick(self) -> None:
        """New work was posted or arrived: send what can be sent now."""
        if not self._pending:
            self.flush()

    def flush(self) -> None:
        """Send until the engine has nothing more or the socket is full (never blocks)."""
        engine = self.engine
        fd = self._fd
        pending = self._pending
        while True:
            if not pending:
                if not engine.tx_ready:
                    if engine.state is _ERROR:
                        self._tx_wakeup.set()  # let the transmit task end the connection
                    return
                pending = engine.produce()
                if not pending:
                    return
            try:
                n = os.writev(fd, pending[:_IOV_MAX])
            except BlockingIOError:
                self._pending = pending
                self._tx_wakeup.set()
                return
            except OSError as exc:
                self._pending = []
                engine.connection_lost(exc)
                self._tx_wakeup.set()
                return
            self._pending_total += n
            pending = _advance(pending, n)
            if not pending:
                total, self._pending_total = self._pending_total, 0
                engine.sent(total)
            self._pending = pending

    async def _tx_loop(self, scope: trio.CancelScope) -> None:
        engine = self.engine
        while True:
            await self._tx_wakeup.wait()
            self._tx_wakeup = trio.Event()
            while self._pending:
                await trio.lowlevel.wait_writable(self.sock)
                self.flush()
            if engine.state is _ERROR and not engine.tx_ready:
                break
        # ERROR: the Terminate (if any) is out; end our half, let the peer end its own.
        with contextlib.suppress(OSError):
            self.sock.shutdown(_stdlib_socket.SHUT_WR)
        with trio.move_on_after(LINGER):
            await self._rx_done.wait()
        scope.cancel()

    # ------------------------------------------------------------------ receive
    async def _rx_loop(self) -> None:
        # Runs until the peer's FIN: after an error the engine discards what arrives,
        # so that closing the socket never resets a Terminate still in flight.
        engine = self.engine
        fd = self._fd
        readv = os.readv
        if self._leftover:
            engine.receive_data(self._leftover)
            self._after_rx()
        streak = 0
        drained = False
        while True:
            if drained:
                # The last read did not fill its buffer: the socket was empty then, so
                # wait instead of a read that would fail (a reply goes out sooner).
                drained = False
                streak = 0
                await trio.lowlevel.wait_readable(self.sock)
            buf = engine.recv_buffer()
            try:
                n = readv(fd, [buf])
            except BlockingIOError:
                drained = True
                continue
            except OSError as exc:
                if exc.errno != errno.EINTR:
                    engine.connection_lost(exc)
                    break
                continue
            if not n:
                engine.connection_lost()
                break
            drained = n < len(buf)
            engine.received(n)
            self._after_rx()
            streak += 1
            if streak >= _RX_BATCH:
                streak = 0
                await trio.lowlevel.checkpoint()
        self._rx_done.set()
        self._after_rx()

    def _after_rx(self) -> None:
        if not self._pending and (self.engine.tx_ready or self.engine.state is _ERROR):
            self.flush()
        self.after_receive()

    # ------------------------------------------------------------------ lifetime
    async def run(self) -> None:
        """Run both directions until the connection ends, then close the socket.

        Nothing that goes wrong on one connection leaves this task (it runs in the
        device's nursery, beside every other connection): an unexpected error is
        logged and fails this QP only, as a lost connection.
        """
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._rx_loop)
                nursery.start_soon(self._tx_loop, nursery.cancel_scope)
                self.flush()
        except Exception as exc:
            log.exception("QP %d: connection dropped after an internal error", self.engine.qp_num)
            self._pending = []
            try:
                self.engine.connection_lost(exc)
            except Exception:
                log.exception("QP %d: flushing after the error failed", self.engine.qp_num)
        finally:
            self.sock.close()
            self.closed.set()


def _advance(bufs: list[Chunk], n: int) -> list[Chunk]:
    """Drop the first ``n`` bytes of a buffer list."""
    i = 0
    count = len(bufs)
    while i < count:
        size = len(bufs[i])  # bytes, or byte-format memoryviews
        if n < size:
            break
        n -= size
        i += 1
    rest = bufs[i:] if i else bufs
    if n:
        rest = rest.copy() if rest is bufs else rest
        rest[0] = memoryview(rest[0])[n:]
    return rest
