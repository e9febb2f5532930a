"""The trio I/O around one queue pair's engine: a receive task and a transmit task.

Receive: ``recv_into`` the buffer the engine names (a staging buffer, or the
target slice of registered memory for a large payload), then tell the engine.
Transmit: gather the FPDUs the engine produces (headers, memory slices, CRC
trailers) into as few ``sendmsg`` calls as the socket allows.
"""

from __future__ import annotations

import contextlib
import logging
import socket as _stdlib_socket
from collections.abc import Callable

import trio

from rdmashim.verbs.softiwarp.engine import Engine, EngineState

log = logging.getLogger(__name__)

_IOV_MAX = 1024
LINGER = 2.0
"""Seconds to wait for the peer's FIN after ours before closing the socket."""


class Link:
    """Moves bytes between a connected TCP socket and an :class:`Engine`."""

    def __init__(
        self,
        engine: Engine,
        sock: trio.socket.SocketType,
        leftover: bytes = b"",
        on_idle: Callable[[], None] = lambda: None,
    ) -> None:
        self.engine = engine
        self.sock = sock
        self._leftover = leftover
        self._wakeup = trio.Event()
        self._on_progress = on_idle
        self.closed = trio.Event()
        self._rx_done = trio.Event()

    def kick(self) -> None:
        """Wake the transmit task: new work was posted or arrived."""
        self._wakeup.set()

    async def run(self) -> None:
        """Run both directions until the connection ends, then close the socket."""
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._rx_loop)
                nursery.start_soon(self._tx_loop, nursery.cancel_scope)
        finally:
            self.sock.close()
            self.closed.set()

    async def _rx_loop(self) -> None:
        # Runs until the peer's FIN: after an error the engine discards what arrives,
        # so that closing the socket never resets a Terminate still in flight.
        engine = self.engine
        if self._leftover:
            engine.receive_data(self._leftover)
            self._after_rx()
        recv_into = self.sock.recv_into
        try:
            while True:
                n = await recv_into(engine.recv_buffer())
                if not n:
                    engine.connection_lost()
                    break
                engine.received(n)
                self._after_rx()
        except OSError as exc:
            engine.connection_lost(exc)
        self._rx_done.set()
        self._wakeup.set()
        self._on_progress()

    def _after_rx(self) -> None:
        if self.engine.tx_ready:
            self._wakeup.set()
        self._on_progress()

    async def _tx_loop(self, scope: trio.CancelScope) -> None:
        engine = self.engine
        sock = self.sock
        try:
            while True:
                if not engine.tx_ready:
                    if engine.state is EngineState.ERROR:
                        break
                    await self._wakeup.wait()
                    self._wakeup = trio.Event()
                    continue
                bufs = engine.produce()
                total = 0
                while bufs:
                    n = await sock.sendmsg(bufs[:_IOV_MAX])
                    total += n
                    bufs = _advance(bufs, n)
                engine.sent(total)
                self._on_progress()
        except OSError as exc:
            engine.connection_lost(exc)
            self._on_progress()
        # ERROR: the Terminate (if any) is out; end our half, let the peer end its own.
        with contextlib.suppress(OSError):
            sock.shutdown(_stdlib_socket.SHUT_WR)
        with trio.move_on_after(LINGER):
            await self._rx_done.wait()
        scope.cancel()


def _advance(bufs: list, n: int) -> list:
    """Drop the first ``n`` bytes of a buffer list."""
    i = 0
    while i < len(bufs):
        size = len(bufs[i]) if not isinstance(bufs[i], memoryview) else bufs[i].nbytes
        if n < size:
            break
        n -= size
        i += 1
    rest = bufs[i:]
    if n and rest:
        rest[0] = memoryview(rest[0])[n:]
    return rest
