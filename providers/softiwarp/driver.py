"""The trio I/O around one queue pair's engine.

Receive: a task reads straight into the buffer the engine names (a staging
buffer, or the target slice of registered memory for a large payload) with
non-blocking ``readv`` calls, and waits for readability only when the socket
is empty. A task waiting on a CQ may take its place (:meth:`Link.read_until`):
it then waits for the socket itself and processes what arrives, so the message
that completes its wait wakes it directly, not through the receive task. A wait
that ends with its completion lends the socket on: the receive task stays parked
while the task waits again before the run loop next waits for I/O (a ping-pong:
no task switch per message), and reads again from that loop pass on otherwise.
A waiter whose CQ has ``busy_poll`` set reads the empty socket again, between
trio checkpoints, for that long after the last bytes came before it waits.
A thread may take the socket in the receive task's place too
(:meth:`Link.lend_to_thread`: a connection served by a thread of its own).

Transmit: :meth:`Link.flush` is synchronous. ``post_send`` (and the receive
task, when a Read Request asks for a response) calls it directly: it gathers
the FPDUs the engine produces (headers, memory slices, CRC trailers) into
``writev`` calls until the engine has nothing more or the socket is full. Only
then does a transmit task wait for writability and continue. So a small Send
leaves inside ``post_send``, with no task switch. Every byte written is one the
engine returned from ``produce()``: there is no other way to the socket.

How far writes run ahead of the peer is the socket's ``TCP_NOTSENT_LOWAT``
(:meth:`Link._pace`): 16 KiB while the peer takes what is written quickly (the
bytes are still in the caches when the kernel moves them: loopback and veth
write-bw 1.09-2.29 of raw TCP with it, 0.73-1.28 with no limit), growing to 1 MiB
while each wait for room is long (a slow reader woke the transmit task once per
16 KiB of its window: about 1,800 times for 64 MiB to the kernel guest's NFS
client).
"""

from __future__ import annotations

import contextlib
import enum
import errno
import logging
import math
import os
import socket as _stdlib_socket
import time
from collections.abc import Callable
from typing import Literal, TypeVar

import outcome
import trio

from rdmashim.providers.softiwarp.engine import Engine
from rdmashim.providers.softiwarp.jobs import Chunk, EngineState
from rdmashim.providers.softiwarp.memory import Region
from rdmashim.verbs import busypoll, lending
from rdmashim.verbs.buffers import IOV_MAX, advance

log = logging.getLogger(__name__)
T = TypeVar("T")

_NOTSENT_LOWAT: int | None = getattr(_stdlib_socket, "TCP_NOTSENT_LOWAT", None)
LINGER = 2.0
"""Seconds a failed connection has, from the failure, to send what is still to go (a
Terminate) and get the peer's FIN after ours, before the socket is closed."""
SEND_MARK_MIN, SEND_MARK_MAX = 16 * 1024, 1024 * 1024
"""The range of the socket's ``TCP_NOTSENT_LOWAT``: how many written bytes may wait for
the peer's window before the socket is full (:meth:`Link._pace`)."""
SLOW_WAIT = 0.5e-3
"""Seconds of waiting for room in the socket from which the peer counts as slow."""


class Busy(enum.Enum):
    """What :meth:`Link._read_idle` says when it read nothing."""

    BUSY = "busy"


BUSY = Busy.BUSY
"""Nothing read: trio has other work, or the wait's time is up (the task waits through
trio)."""


class Link:
    """Moves bytes between a connected TCP socket and an :class:`Engine`."""

    def __init__(self, engine: Engine, sock: trio.socket.SocketType, leftover: bytes = b"") -> None:
        self.engine = engine
        self.sock = sock
        self._fd = sock.fileno()
        self._leftover = leftover
        self._send_mark = 0
        self._pace(0.0)
        self._pending: list[Chunk] = []
        self._pending_total = 0
        self._tx_wakeup = trio.Event()
        self._rx_done = trio.Event()
        self._ending = trio.CancelScope()
        """The transmit task's scope: its deadline bounds the end of a failed connection."""
        self.closed = trio.Event()
        self._rx_stopped = False
        """The connection ended (FIN, a socket error, a failure, the link's end): nothing
        more to read."""
        self._rx_failure: Exception | None = None
        """An unexpected error while a waiter processed received bytes."""
        self._waiter_reads = False
        """A task in :meth:`read_until` reads the socket in place of the receive task."""
        self._rx_scope: trio.CancelScope | None = None
        self.wait_point = lending.WaitPoint()
        """What :meth:`read_until` waits on (its ``interrupt()`` ends that wait: what the
        waiter waits for came another way)."""
        self.wait_point.open(self._fd)
        self._rx_parked: trio.lowlevel.Task | None = None
        """The receive task while it waits for a task in :meth:`read_until` to end (or
        after, while the socket is lent)."""
        self._drained = False
        """The last read found the socket empty (or did not fill its buffer)."""
        self._streak = 0
        """Reads by :meth:`read_until` since its task last waited through trio."""
        self._loan = lending.Loan(self)
        """Whether the socket is lent (:meth:`_lend`)."""
        self.threaded = False
        """A thread of its own serves the connection (:meth:`lend_to_thread`)."""
        self.after_receive: Callable[[], None] = lambda: None
        """Called in the receive task after each batch of received bytes is processed."""
        self.deliver: Callable[[], None] = lambda: None
        """Takes the engine's outbox (completions, events) after a call into the engine
        that filled it: the QP's :meth:`~.qp.QP._deliver`."""
        engine.memory.watch(self)

    def _closing(self) -> None:
        """The socket closes now (the native link's C forgets its descriptor here)."""

    def revoke(self, region: Region) -> None:
        """``region`` is being deregistered (the link is a :class:`~.memory.Holder`): the
        FPDUs waiting for room in the socket may hold views of it; they are copied, so
        they still go out whole (the stream stays framed) and hold no view."""
        if self._pending:
            self._pending = [bytes(chunk) for chunk in self._pending]

    # ------------------------------------------------------------------ transmit
    def kick(self) -> None:
        """New work was posted or arrived: send what can be sent now (never blocks). What
        the engine completed meanwhile is the caller's to hand on (the QP, after a post):
        a work request's route to the socket enters no module twice."""
        if not self._pending:
            self._write()

    def flush(self) -> None:
        """Send until the engine has nothing more or the socket is full (never blocks),
        then hand on what the engine completed meanwhile."""
        self._write()
        if self.engine.outbox:
            self.deliver()

    def _write(self) -> None:
        engine = self.engine
        fd = self._fd
        pending = self._pending
        while True:
            if not pending:
                pending = engine.produce()
                if not pending:
                    if engine.state is EngineState.ERROR:
                        self._tx_wakeup.set()  # let the transmit task end the connection
                    return
            try:
                n = os.writev(fd, pending[:IOV_MAX])
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
            pending = advance(pending, n)
            if not pending:
                total, self._pending_total = self._pending_total, 0
                engine.sent(total)
            self._pending = pending

    def _pace(self, waited: float) -> None:
        """After a wait of ``waited`` seconds for room in the socket: the peer is slow
        (:data:`SLOW_WAIT` or more), and the socket holds twice as many unsent bytes
        (at most :data:`SEND_MARK_MAX`), so its writer wakes half as often; or it is
        quick, and the socket holds half as many (at least :data:`SEND_MARK_MIN`)."""
        if waited >= SLOW_WAIT:
            mark = min(2 * self._send_mark, SEND_MARK_MAX)
        else:
            mark = max(self._send_mark // 2, SEND_MARK_MIN)
        if mark != self._send_mark and _NOTSENT_LOWAT is not None:
            self._send_mark = mark
            with contextlib.suppress(OSError):  # (the socket ended)
                self.sock.setsockopt(_stdlib_socket.IPPROTO_TCP, _NOTSENT_LOWAT, mark)

    @trio.lowlevel.enable_ki_protection  # (see _rx_loop)
    async def _tx_loop(self, scope: trio.CancelScope) -> None:
        engine = self.engine
        with self._ending:  # (its deadline: LINGER from the failure, see failed())
            while True:
                await self._tx_wakeup.wait()
                self._tx_wakeup = trio.Event()
                while self._pending:
                    start = time.perf_counter()
                    await trio.lowlevel.wait_writable(self.sock)
                    self._pace(time.perf_counter() - start)
                    self.flush()
                if engine.state is EngineState.ERROR and not engine.tx_ready:
                    break
            # ERROR: the Terminate (if any) is out; end our half, let the peer end its own.
            with contextlib.suppress(OSError):
                self.sock.shutdown(_stdlib_socket.SHUT_WR)
            self._ending.deadline = min(self._ending.deadline, trio.current_time() + LINGER)
            await self._rx_done.wait()
        scope.cancel()

    def failed(self) -> None:
        """The engine moved to ERROR: what it still sends (its Terminate) and the peer's
        FIN get :data:`LINGER` seconds from now, however the peer reads; a peer that
        stopped reading cannot hold the connection, and the QP's memory, for ever."""
        if self._ending.deadline == math.inf:
            self._ending.deadline = trio.current_time() + LINGER
        self.kick()

    # ------------------------------------------------------------------ receive
    # One task at a time reads the socket, so bytes are processed once and in order:
    # the receive task, except while a CQ waiter reads in its place (read_until).
    # That waiter is then woken by the socket itself and processes the message that
    # completes its wait, with no task switch in between; the receive task, moved
    # off the socket, parks until the waiter gives the socket back.
    @trio.lowlevel.enable_ki_protection
    async def _rx_loop(self) -> None:
        # Runs until the peer's FIN: after an error the engine discards what arrives,
        # so that closing the socket never resets a Terminate still in flight.
        # Both of a link's tasks are protected from Ctrl-C, as trio's own are: the
        # KeyboardInterrupt goes to the main task at its next checkpoint, never into the
        # engine's work half done, nor between a task noting itself as waiting and its
        # wait (trio 0.35's Event.wait, or the park below: a task that ended noted as
        # waiting is woken later, and trio fails with an internal error).
        self._take_leftover()
        self.after_receive()
        while not self._rx_stopped:
            if self._waiter_reads or self._loan.active:
                # Parked until read_until ends and reschedules it, or the socket lent to
                # the waiter comes back (hand_back): trio's bare primitive, as a parking
                # lot measured about 2 us more per message in send-lat.
                self._rx_parked = trio.lowlevel.current_task()
                await trio.lowlevel.wait_task_rescheduled(self._abort_park)
                continue
            with trio.CancelScope() as self._rx_scope:  # read_until cancels it
                await self._rx_run()
            self._rx_scope = None
        if self._rx_failure is not None:
            raise self._rx_failure
        self._rx_done.set()
        self._after_rx()

    def _abort_park(self, _: object) -> trio.lowlevel.Abort:
        """The parked receive task is cancelled (the link ends): nothing reschedules it."""
        self._rx_parked = None
        return trio.lowlevel.Abort.SUCCEEDED

    async def _rx_run(self) -> None:
        """Read and process until the connection ends or a waiter takes the socket."""
        streak = 0
        while not self._rx_stopped and not self._waiter_reads:
            drained = self._read()
            if drained is None:
                return
            self.after_receive()
            streak += 1
            if drained:
                # The last read did not fill its buffer: the socket was empty then, so
                # wait instead of a read that would fail (a reply goes out sooner).
                streak = 0
                await trio.lowlevel.wait_readable(self.sock)
            elif streak >= lending.READS_BEFORE_YIELD:
                streak = 0
                await trio.lowlevel.checkpoint()

    def _take_leftover(self) -> None:
        """Process the bytes read with the MPA exchange (before any read of the socket)."""
        if self._leftover:
            data, self._leftover = self._leftover, b""
            self.engine.receive_data(data)
            self.deliver()
            self._flush_after_rx()

    def _read(self) -> bool | None:
        """Read once and process what came; whether the socket is (probably) empty now.

        At the connection's end (FIN or a socket error: None) the engine is told and
        ``_rx_stopped`` is set."""
        engine = self.engine
        buf = engine.recv_buffer()
        try:
            n = os.readv(self._fd, [buf])
        except BlockingIOError:
            self._drained = True
            return True
        except OSError as exc:
            if exc.errno == errno.EINTR:
                return False
            self._lost(exc)
            return None
        if not n:
            self._lost(None)
            return None
        engine.received(n)
        if engine.outbox:
            self.deliver()
        self._flush_after_rx()
        self._drained = drained = n < len(buf)
        return drained

    def _lost(self, exc: Exception | None) -> None:
        """The connection ended (FIN, or a socket error ``exc``): nothing more to read."""
        self._rx_stopped = True
        self.engine.connection_lost(exc)
        if self.engine.outbox:
            self.deliver()

    def _flush_after_rx(self) -> None:
        if not self._pending and (self.engine.tx_ready or self.engine.state is EngineState.ERROR):
            self.flush()

    def _after_rx(self) -> None:
        self._flush_after_rx()
        self.after_receive()

    @property
    def can_read(self) -> bool:
        """Whether :meth:`read_until` may read now (nobody else does, the connection is up)."""
        return not (self._waiter_reads or self._rx_stopped)

    async def read_until(
        self,
        ready: Callable[[], object],
        after_read: Callable[[], None] | None = None,
        spin: float = 0.0,
    ) -> None:
        """Read and process in place of the receive task until ``ready()`` is true, the
        connection ends or :meth:`interrupt` is called (only when :attr:`can_read`).

        With ``spin`` (seconds) it reads the empty socket again, yielding to the other
        tasks between tries, until ``spin`` passed since the last bytes came (busy
        polling: :mod:`rdmashim.verbs.busypoll`), and only then waits for it.

        The receive task goes back to the socket when this is cancelled or the run
        loop next waits for I/O after it returned (unless a wait took the socket on
        by then: :meth:`_lend`); a socket taken on so, whose last read found it empty,
        is waited on before it is read. The bytes are processed whole, in order, by
        whichever task read them. Only the receive task runs ``after_receive``. An
        unexpected error while processing ends the connection as it would in the
        receive task.
        """
        assert self.can_read
        self._waiter_reads = True
        drained: bool | None = False
        if self._loan.end():  # lent to the waiter before: this one takes it on
            drained = self._drained
        if self._rx_scope is not None:
            self._rx_scope.cancel()  # the receive task leaves the socket now
        lend = False
        engine = self.engine
        seen = -1  # bytes received when the busy polling began
        spin_end = 0.0
        try:
            if self._leftover:
                self._take_leftover()
            if after_read is not None:
                after_read()
            if self._streak >= lending.READS_BEFORE_YIELD:
                # The other tasks' turn, due after reads none of which waited through
                # trio or idle (a stream, busy polling): now, at the start of a wait (in
                # a ping-pong, while the peer works on our last message), not between
                # the message that ends it and the answer.
                self._streak = 0
                await trio.lowlevel.checkpoint()
            while not ready() and not self._rx_stopped:
                if not drained:  # (the socket lent here was empty at its last read: wait)
                    drained = self._read()
                    self._streak += 1
                else:
                    now = time.perf_counter() if spin else 0.0
                    if spin and engine.bytes_received != seen:
                        seen, spin_end = engine.bytes_received, now + spin
                    if now < spin_end:  # busy polling (it keeps the count of reads)
                        drained = await self._spin(spin_end - now)
                    else:
                        got = self._read_idle()
                        if got is BUSY:
                            self._streak = 0
                            await self.wait_point.wait_readable()  # (or interrupt(), or the end)
                            drained = False
                            continue
                        drained = got
                        # trio was idle when this wait began (else BUSY) and any of its
                        # I/O would have ended it: no task's turn was taken, as after a
                        # wait through trio (a yield here would sit between the message
                        # and its answer).
                        self._streak = 0
                if after_read is not None:
                    after_read()
                if drained is None or ready():
                    break
                if not drained and self._streak >= lending.READS_BEFORE_YIELD:
                    self._streak = 0  # (a long stream of bytes: the others' turn now)
                    await trio.lowlevel.checkpoint()
            lend = not self._rx_stopped
        except Exception as exc:
            self._rx_stopped = True
            self._rx_failure = exc  # the receive task raises it, and the link ends
        finally:
            self._waiter_reads = False
            # Lent even when the receive task has not parked yet (a waiter that never let
            # trio run since it cancelled that task's read): the task parks when it runs
            # while the loan lasts, instead of taking the socket back before the waiter's
            # next wait, which would then never be one call.
            if lend:
                self._lend()
            elif self._rx_parked is not None:
                self.hand_back()

    async def lend_to_thread(self, body: Callable[[], T], interrupt: Callable[[], None]) -> T:
        """Run ``body()`` in a thread that serves the connection in place of the receive
        task (only when :attr:`can_read`): the receive task parks, and the bytes read
        with the MPA exchange are processed first. Cancelled, it calls ``interrupt()``
        (which must make ``body`` return soon) and waits for ``body``. Afterwards the
        receive task reads the socket again and what ``body`` left to write is written."""
        assert self.can_read
        self._waiter_reads = True
        self._loan.end()  # (lent to a waiter before: the thread takes it on)
        if self._rx_scope is not None:
            self._rx_scope.cancel()
        self._take_leftover()
        self.threaded = True
        try:
            return await in_thread(body, interrupt)
        finally:
            self.threaded = False
            self._waiter_reads = False
            self.flush()
            if self._rx_parked is not None:
                self.hand_back()

    def _read_idle(self) -> bool | Literal[Busy.BUSY] | None:
        """When trio has nothing else to do, wait for the socket in a system call of
        this task's own and read it (:mod:`~rdmashim.verbs.idle`): :meth:`_read`'s
        answer; :data:`BUSY` when nothing was read (the task waits through trio)."""
        if not self.wait_point.block():
            return BUSY
        return self._read()

    async def _spin(self, seconds: float) -> bool | None:
        """One try of busy polling, up to ``seconds`` from now: let the others run, then
        read again (:meth:`_read`'s answer)."""
        await busypoll.pause()
        self._streak = 0  # (the others ran)
        return self._read()

    def _lend(self) -> None:
        """Leave the parked receive task parked after a wait that ended with what it
        waited for: the waiter usually waits again (a ping-pong) before the run loop
        next waits for I/O, and takes the socket on; if it does not, the run's
        :class:`~rdmashim.verbs.lending.Lender` gives the socket back to the receive
        task then. Saves a task switch per message."""
        self._loan.lend()

    def hand_back(self) -> None:
        """Reschedule the parked receive task: it reads the socket again."""
        self._loan.returned()
        task, self._rx_parked = self._rx_parked, None
        if task is not None:
            trio.lowlevel.reschedule(task)

    # ------------------------------------------------------------------ lifetime
    @trio.lowlevel.enable_ki_protection  # (see _rx_loop)
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
                self.deliver()
            except Exception:
                log.exception("QP %d: flushing after the error failed", self.engine.qp_num)
        finally:
            self._rx_stopped = True
            self._pending = []  # never written now: no view of a region stays here
            self.engine.memory.unwatch(self)
            self._loan.end()
            self.wait_point.close()  # a waiter in read_until returns
            self._closing()
            self.sock.close()
            self.closed.set()


@trio.lowlevel.enable_ki_protection
async def in_thread(body: Callable[[], T], interrupt: Callable[[], None]) -> T:
    """``body()`` in a thread of trio's cache, its result or exception here. A cancelled
    caller calls ``interrupt()`` and still waits for ``body`` to return, then raises
    the cancellation: nothing ``body`` uses is released under it. Protected from Ctrl-C
    between starting the thread and waiting for it (the thread reschedules this task
    whatever happened)."""
    token = trio.lowlevel.current_trio_token()
    task = trio.lowlevel.current_task()

    def deliver(result: outcome.Outcome[T]) -> None:
        token.run_sync_soon(trio.lowlevel.reschedule, task, result)

    def abort(_: object) -> trio.lowlevel.Abort:
        interrupt()
        return trio.lowlevel.Abort.FAILED

    trio.lowlevel.start_thread_soon(body, deliver)
    result: T = await trio.lowlevel.wait_task_rescheduled(abort)
    await trio.lowlevel.checkpoint_if_cancelled()  # (a cancelled caller: Cancelled now)
    return result
