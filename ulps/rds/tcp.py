"""RDS over TCP, as Linux's ``rds_tcp`` speaks it (``net/rds/tcp*.c``).

One TCP connection per pair of nodes carries both directions. On the stream
every message is its 48-byte :class:`~rdmashim.ulps.rds.wire.RdsHeader` and
then ``h_len`` bytes of payload, whole (no 4 KiB fragments as over RDMA), with
``h_ack`` and ``h_credit`` zero: TCP does the flow control, and a message
counts as acknowledged once TCP has the peer's ack for its last byte (Linux's
``rds_tcp_is_acked`` against ``snd_una``; here the socket's ``SIOCOUTQ``).

* :mod:`.tcp_stream` (sans-IO) frames messages onto the stream
  (:class:`~rdmashim.ulps.rds.tcp_stream.StreamSender`) and cuts them back out
  (:class:`~rdmashim.ulps.rds.tcp_stream.StreamDecoder`).
* :class:`TcpSession` drives one connected stream for an
  :class:`~rdmashim.ulps.rds.connection.RdsConnection`: the numbering,
  retransmission after a reconnect and the dropping of duplicates are the
  connection's, shared with the RDMA transport.

Congestion maps travel as Linux's ``rds_cong_update_alloc`` makes them:
sequence 0, ports 0, ``h_flags`` exactly ``CONG_BITMAP``, never retransmitted;
the receiver takes them outside the sequence (``tcp_recv.c`` ``rds_tcp_data_recv``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import socket
import struct
import termios
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import trio

from rdmashim.ulps.rds.connection import RdsConnection
from rdmashim.ulps.rds.tcp_stream import SEND_BATCH, StreamDecoder, StreamSender
from rdmashim.ulps.rds.transport import SessionLost
from rdmashim.ulps.rds.wire import (
    RdsProtocolError,
)
from rdmashim.verbs import busypoll, lending

if TYPE_CHECKING:
    from rdmashim.ulps.rds.plain import PlainPath
    from rdmashim.ulps.rds.rdma import RdmaOp

log = logging.getLogger(__name__)

ACK_POLL = 0.002
"""Seconds between looks at how much of what we wrote TCP has had acknowledged, while
much of it is in flight (:data:`FILLING`) or a sender waits for room."""
ACK_BACKSTOP = 0.02
"""The same while little is in flight: then every read looks too (the peer's bytes
come after it took ours, in a request-and-answer exchange after each message), so the
watching task, which woke every :data:`ACK_POLL` for what a read had seen already, wakes
seldom (at one request in flight: 0.14 wake-ups a message at 2,000 a second before)."""
FILLING = 8
"""Much is in flight from this fraction of the queue's bounds on (``sndbuf`` bytes,
``max_queued_messages``) queued or unacknowledged: the acknowledgements are looked at
every :data:`ACK_POLL`, so that a stream one way finds room in time."""
KEEPALIVE_IDLE = 5
"""Seconds of silence before a keepalive probe, and between probes (``rds_tcp_keepalive``)."""
KEEPALIVE_COUNT = 5
"""Unanswered keepalive probes after which the connection is dead (``rds_tcp_keepalive``)."""
_SIOCOUTQ = termios.TIOCOUTQ
"""Linux's SIOCOUTQ: bytes written to a TCP socket that the peer has not acknowledged."""
_INT = struct.Struct("i")


def tune(sock: trio.socket.SocketType) -> None:
    """Set a connection up as ``rds_tcp_tune`` and ``rds_tcp_keepalive`` do: no Nagle,
    keepalive after 5 s of silence, dead after 5 unanswered probes 5 s apart. A
    connection already gone is left alone: its session finds out."""
    options = [
        (socket.IPPROTO_TCP, "TCP_NODELAY", 1),
        (socket.SOL_SOCKET, "SO_KEEPALIVE", 1),
        (socket.IPPROTO_TCP, "TCP_KEEPIDLE", KEEPALIVE_IDLE),
        (socket.IPPROTO_TCP, "TCP_KEEPINTVL", KEEPALIVE_IDLE),
        (socket.IPPROTO_TCP, "TCP_KEEPCNT", KEEPALIVE_COUNT),
    ]
    with contextlib.suppress(OSError):
        for level, option, value in options:
            if hasattr(socket, option):
                sock.setsockopt(level, getattr(socket, option), value)


def unacknowledged_bytes(sock: trio.socket.SocketType) -> int:
    """Bytes written to ``sock`` that its peer has not acknowledged yet (SIOCOUTQ)."""
    fd = sock.fileno()
    if fd < 0:
        raise OSError(errno.EBADF, "the RDS/TCP socket is closed")
    buf = fcntl.ioctl(fd, _SIOCOUTQ, bytes(_INT.size))
    value: int = _INT.unpack(buf)[0]
    return value


class TcpSession:
    """One TCP connection carrying an :class:`RdsConnection`'s messages.

    :meth:`run` runs three tasks until the connection breaks: one writes what
    the connection has queued (the newest congestion map first), one reads and
    hands whole messages to the connection, and one watches TCP's
    acknowledgements while something written is unacknowledged, and tells the
    connection which messages the peer has.

    A message queued while the writer has nothing in hand is written at once, in
    the sender's task (:meth:`pump_sends`: one ``write``, no task switch), the
    answers to a read that delivered several messages too: held back for the writer
    to send together, they waited a task switch each time (rds stress ``t=1 d=4``
    0.37-0.39 of raw TCP held, 1.11-1.16 not). What the socket does not take at once
    is left to the writer, which writes it before anything else.

    A task waiting for a message may read in place of the reader
    (:meth:`drive_until`): the socket then wakes that task itself, and the message
    it waits for reaches it with no task switch. When its wait ends with that
    message, the socket is lent (:mod:`rdmashim.verbs.lending`): the reader stays
    parked unless the run loop comes to wait for I/O before the task waits again.
    """

    def __init__(
        self, rds: RdsConnection, stream: trio.SocketStream, plain: PlainPath | None = None
    ) -> None:
        self.rds = rds
        self.stream = stream
        self.lost = False
        fd = stream.socket.fileno()
        self._plain = None if plain is None else plain.stream(rds, fd)
        """The stream's plain messages, read and taken in C (None: no C path)."""
        self.decoder = StreamDecoder(self._plain)
        """The stream cut into messages (the whole plain ones taken in C, on the C path)."""
        self.sender = StreamSender(rds)
        """What goes on the stream, and what TCP's acks cover."""
        self._gate = (
            None if plain is None
            else plain.stream_sends(rds, self.sender, fd, self._left)
        )  # fmt: skip
        """A socket's sendto in one call into C while the stream is ours alone (None: no C
        path): opened by :meth:`pump_sends`, closed by anything that queues."""
        self._wake = trio.Event()
        self._written = trio.Event()
        self._writing = False
        """The writer task is in a write: nothing else may write meanwhile."""
        self._rest: memoryview | None = None
        """What a write in :meth:`pump_sends` left unwritten, for the writer."""
        self._driving = False
        """A task in :meth:`drive_until` reads in place of the reader task."""
        self._reader_scope: trio.CancelScope | None = None
        self._wait = lending.WaitPoint()
        """What :meth:`drive_until` waits on, opened when :meth:`run` starts
        (:meth:`interrupt_wait` ends that wait)."""
        self._reader_back = trio.Event()
        self._loan = lending.Loan(self)
        """Whether the socket is lent: the reader stays parked meanwhile."""
        self._empty = False
        """The last read found the socket empty, or did not fill its buffer."""
        self._streak = 0
        """Reads by :meth:`drive_until` since its task last waited through trio."""
        self._acks_due = False
        """A read brought bytes while ours were in flight: TCP's acknowledgements are
        looked at (:meth:`check_acks`) before the reader next waits, not between the
        message and its answer."""
        self.bytes_read = 0
        """Bytes read from the connection so far."""
        self._failure: BaseException | None = None
        self._scope: trio.CancelScope | None = None
        self._ack_wait: trio.CancelScope | None = None
        """The watching task's wait of :data:`ACK_BACKSTOP`, while it is in one (a queue
        that fills up cuts it short: :meth:`pump_sends`)."""
        settings = rds.settings
        self._filling = (settings.sndbuf // FILLING, settings.max_queued_messages // FILLING)

    def pump_sends(self) -> None:
        """Something was queued: write it now, or have the writer look (never blocks)."""
        if self._ack_wait is not None and self._filled():
            self._ack_wait.cancel()  # the watching task looks every ACK_POLL now
            self._ack_wait = None
        if self._writing or self._rest is not None or self.lost:
            self._wake.set()
            return
        batch = self.sender.batch()
        if not batch:
            return
        try:
            n = os.write(self.stream.socket.fileno(), batch)
        except OSError:  # full (EAGAIN), or broken: the writer's write says which
            n = 0
        self.sender.wrote(n)
        if n < len(batch):
            self._left(memoryview(batch)[n:])
        elif self._gate is not None and not self.rds.unsent and self.rds.map_out is None:
            self._gate.open()  # (the socket took it all, and nothing else waits)
        self._written.set()

    def _left(self, rest: bytes | memoryview) -> None:
        """The socket took only part of what went: the writer writes ``rest`` first."""
        self._rest = memoryview(rest)
        self._wake.set()

    def want_acks(self) -> None:
        """Nothing to do: this session hands each acknowledgement on as it reads it."""

    def settle(self) -> None:
        """Nothing to do: this session hands each message on as it reads it."""

    def send_plain(self, sport: int, dport: int, data: bytes, rdma: RdmaOp | None = None) -> bool:
        """False: the message is queued, and :meth:`pump_sends` writes it at once in the
        sender's task. (Written from here instead, rds stress ``-d 1`` over RDS/TCP moved
        nothing: 0.765 -> 0.760 of raw TCP, medians of seven alternated rounds. A socket's
        sendto skips the queue through the gate in C instead: :class:`~.gate.StreamSends`.)"""
        return False

    def cut(self) -> None:
        """Break the connection underneath (for tests and the demo): we stop writing,
        the peer's session ends at our end of stream, and so does ours at its. Both
        read what was on its way first: TCP acknowledged it, so nothing may stay unread.
        """
        if not self.lost:
            with contextlib.suppress(OSError):  # already gone
                self.stream.socket.shutdown(socket.SHUT_WR)

    async def run(self) -> None:
        """Carry messages until the connection breaks (raises :class:`SessionLost`)."""
        self.rds.counters.sessions += 1
        self._wait.open(self.stream.socket.fileno())
        try:
            async with trio.open_nursery() as nursery:
                self._scope = nursery.cancel_scope
                for task in (self._writer, self._reader, self._acks):
                    nursery.start_soon(self._guard, task)
        finally:
            self.lost = True
            self._loan.end()
            self._wait.close()  # a task in drive_until returns
            with contextlib.suppress(OSError):  # what TCP delivered need not go again
                self.check_acks()
            if not isinstance(self._failure, RdsProtocolError):
                self._drain()
            if self._plain is not None:
                self._plain.close()
            if not self.heard:
                self.rds.counters.sessions_refused += 1
        raise SessionLost(str(self._failure or "the session ended"))

    def _drain(self) -> None:
        """Take what is still in the socket's receive buffer before it is closed.

        TCP acknowledged those bytes, so the peer counts their messages as
        delivered and will not send them again: closing with them unread would
        lose them (Linux reads in the socket's data-ready callback, so its
        buffer holds nothing to lose).
        """
        fd = self.stream.socket.fileno()
        while fd >= 0:
            try:
                data = os.read(fd, SEND_BATCH)
                if not data:
                    return
                self._take(data)
            except (OSError, RdsProtocolError):  # empty (EAGAIN), reset, or garbage
                return

    async def _guard(self, task: Callable[[], Awaitable[None]]) -> None:
        try:
            await task()
        except RdsProtocolError as exc:
            log.warning("RDS/TCP protocol error from %s: %s", self.rds.peer, exc)
            self._fail(exc)
        except (OSError, SessionLost, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        if self._failure is None:
            self._failure = exc
        self.lost = True
        assert self._scope is not None
        self._scope.cancel()

    async def _writer(self) -> None:
        while True:
            rest, self._rest = self._rest, None
            batch = rest if rest is not None else self.sender.batch()
            if not batch:
                self._wake = trio.Event()
                await self._wake.wait()
                continue
            self._writing = True
            try:
                await self.stream.send_all(batch)
            finally:
                self._writing = False
            self.sender.wrote(len(batch))
            self._written.set()

    async def _reader(self) -> None:
        sock = self.stream.socket
        while True:
            if self._driving or self._loan.active:
                self._reader_back = trio.Event()
                await self._reader_back.wait()
                continue
            if self._read():
                with trio.CancelScope() as self._reader_scope:  # drive_until cancels it
                    await trio.lowlevel.wait_readable(sock)
                self._reader_scope = None
            else:
                await trio.lowlevel.checkpoint()

    def _read(self) -> bool:
        """Read once and take what came; whether the socket was empty. Raises
        :class:`SessionLost` at the peer's end of stream, OSError on a socket error. On the
        C path a read that begins at a message is taken in one call into C
        (:meth:`~.plain.PlainStream.read`)."""
        try:
            if self._plain is not None:
                got = self._plain.read(self.decoder, self.rds.received)
            else:
                data = os.read(self.stream.socket.fileno(), SEND_BATCH)
                got = len(data)
                self.decoder.take(data, self.rds.received)
        except BlockingIOError:
            self._empty = True
            self._before_waiting()
            return True
        if not got:
            raise SessionLost(f"{self.rds.peer} closed the connection")
        self.bytes_read += got
        if self.sender.inflight:  # (see ACK_BACKSTOP; the gate's messages wait for it)
            self._acks_due = True
        self._empty = empty = got < SEND_BATCH
        return empty

    def _before_waiting(self) -> None:
        """The reader is about to wait: the look at TCP's acknowledgements that a read
        made due (the answers to what it brought went meanwhile, in a ping-pong)."""
        if self._acks_due:
            self._acks_due = False
            if self.sender.inflight and self.heard:
                self._look_at_acks()

    async def drive_until(self, ready: Callable[[], object], quiet: int = 0) -> bool:
        """Read and take messages in place of the reader task until ``ready()`` is true,
        the session ends or :meth:`interrupt_wait` is called (``quiet``, the reader's
        port, changes nothing here: the session wakes readers in Python, which costs a
        reader driving it nothing); False at once when another
        task reads already or the session is lost (wait some other way). With the
        node's ``busy_poll`` it reads the empty socket again, between trio checkpoints,
        for that long after the last bytes came before it waits
        (:mod:`rdmashim.verbs.busypoll`). While trio has nothing else to do it waits
        for the socket in a poll of its own (:mod:`rdmashim.verbs.idle`)."""
        if self._driving or self.lost or self._scope is None:  # (None: not running yet)
            return False
        self._driving = True
        empty = False
        if self._loan.end():  # lent to the last wait: this one takes it on
            empty = self._empty  # (then wait before reading)
        if self._reader_scope is not None:
            self._reader_scope.cancel()  # the reader task leaves the socket now
        lend = False
        spin = self.rds.settings.busy_poll
        seen, spin_end = self.bytes_read, time.perf_counter() + spin
        try:
            while not ready() and not self.lost:
                if empty and spin:
                    now = time.perf_counter()
                    if self.bytes_read != seen:
                        seen, spin_end = self.bytes_read, now + spin
                    if now < spin_end:  # busy polling: read again after the others ran
                        self._streak = 0
                        await busypoll.pause()
                        empty = self._read()
                        continue
                if empty:
                    # An idle wait (rdmashim.verbs.idle) begins only while trio has
                    # nothing to do and ends when it has: no task's turn is taken by it.
                    self._streak = 0
                    self._before_waiting()
                    if not self._wait.block():
                        await self._wait.wait_readable()  # (or interrupt_wait(), or the end)
                    if not ready() and not self.lost:
                        empty = self._read()
                else:
                    empty = self._read()
                    self._streak += 1
            if self._streak >= lending.READS_BEFORE_YIELD and not self.lost:
                self._streak = 0
                await trio.lowlevel.checkpoint()  # (reads that never waited through trio)
            lend = not self.lost
        except RdsProtocolError as exc:
            log.warning("RDS/TCP protocol error from %s: %s", self.rds.peer, exc)
            self._fail(exc)
        except (OSError, SessionLost) as exc:
            self._fail(exc)
        finally:
            self._driving = False
            if lend:
                self._loan.lend()
            else:
                self._reader_back.set()
        return True

    def hand_back(self) -> None:
        """The socket goes back to the reader task (:class:`~rdmashim.verbs.lending.Lender`
        calls this before the run loop waits for I/O)."""
        self._loan.returned()
        self._reader_back.set()

    def interrupt_wait(self) -> None:
        """Make a :meth:`drive_until` in progress look at its ``ready`` again now."""
        self._wait.interrupt()

    @property
    def heard(self) -> bool:
        """Whether the peer has sent anything on this connection."""
        return self.bytes_read > 0

    def _take(self, data: bytes) -> None:
        self.bytes_read += len(data)
        self.decoder.take(data, self.rds.received)

    async def _acks(self) -> None:
        while True:
            if not self.sender.inflight and self.rds.direct is None:  # (the gate: closed)
                self._written = trio.Event()
                await self._written.wait()
            if self._filled() or self.rds.room_wanted:
                await trio.sleep(ACK_POLL)
            else:
                with trio.move_on_after(ACK_BACKSTOP) as self._ack_wait:
                    await trio.sleep_forever()
                self._ack_wait = None
            self.check_acks()

    def _filled(self) -> bool:
        """Whether much is in flight (:data:`FILLING`)."""
        rds, (size, count) = self.rds, self._filling
        return rds.queued_bytes >= size or len(rds.unsent) + len(rds.unacked) >= count

    def info(self) -> tuple[str, int, str, int, int, int, int, int, int]:
        """rds-info's TCP socket row: local and peer (address, port), the header and
        payload bytes still to come, bytes written, the offset just past the last
        message written, and the offset TCP has had acknowledged (``SIOCOUTQ``)."""
        sock = self.stream.socket
        if self._gate is not None:
            self._gate.sync()
        try:
            local, peer = sock.getsockname()[:2], sock.getpeername()[:2]
            acked = self.sender.written - unacknowledged_bytes(sock)
        except OSError:  # gone already
            local, peer, acked = ("-", 0), ("-", 0), 0
        sender = self.sender
        return (*local, *peer, *self.decoder.remaining, sender.written, sender.last_offset, acked)

    def check_acks(self) -> None:
        """Tell the connection which messages TCP has delivered in full, once the peer
        has spoken on this connection: till then TCP's ack says only that its kernel
        took the bytes, and a peer whose RDS refuses the connection resets it with
        them unread (``tcp_listen.c`` ``rds_tcp_accept_one``). They go again, flagged,
        on the next connection; a peer that had them drops them by number. What went
        through the gate is brought in first (its messages are acknowledged too)."""
        if self._gate is not None:
            self._gate.sync()
        if self.heard:
            self._look_at_acks()

    def _look_at_acks(self) -> None:
        """Tell the connection which of the messages that Python knows of TCP has delivered
        in full (the gate's come later on the stream: they count towards where it is, but
        stay open to the gate till brought in)."""
        sender = self.sender
        written = sender.written if self._gate is None else sender.written + self._gate.written
        sender.acked_to(written - unacknowledged_bytes(self.stream.socket))
