"""The gate of a socket's sendto in one call into C (:class:`~.connection.DirectSends`),
for both transports: while a session would send a plain message in C next, with
nothing of Python's queued, a socket's message is numbered and sent in C
(``rp_sendto`` over RDMA, :class:`~.plain.PlainReceiver`; ``rp_stream_sendto`` over TCP,
:class:`StreamSends`), and the connection hears of it when Python brings it in
(:meth:`SendGate.sync`): before anything of the connection's outgoing state is read or
changed. Used on the compiled plain-message path (:mod:`.plain`) only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rdmashim.ulps.rds.connection import RdsConnection
    from rdmashim.ulps.rds.inbox import CInboxes
    from rdmashim.ulps.rds.rdma import RdmaOp, Sources
    from rdmashim.ulps.rds.tcp_stream import StreamSender


class SendGate:
    """The gate of a socket's sendto in one call into C (:class:`~.connection.DirectSends`),
    the part both transports share (``rp_gate``): :meth:`open` hands C the connection's
    numbers and bounds, :meth:`sync` closes the gate and brings in what went through it.
    A transport's class adds how C sends (``sendto``, ``run``) and what else a message
    sent so changes in its session (:meth:`_brought_in`)."""

    __slots__ = ("_cong", "_cong_c", "_ffi", "_gate", "_rds", "log")

    sendto: Callable[[int, int, bytes, int], int]
    """``sendto(sport, dport, data, len(data))``: the message through the gate in one call
    into C (the transport's: 1 or 2 when it went, 0 when not; see :class:`.DirectSends`)."""
    run: Callable[[], object]
    """What the transport does when :attr:`sendto` said 2."""

    def __init__(self, ffi: Any, rds: RdsConnection, gate: Any) -> None:
        self._ffi, self._rds = ffi, rds
        self._gate = gate
        """The gate's state in C (``rp_gate``)."""
        self.log: list[tuple[int, int, bytes, RdmaOp | None]] = []
        """The messages sent through the gate, (sport, dport, data, the RDMA Write it chases
        or None), until :meth:`sync`."""
        self._cong: object = None
        self._cong_c: Any = None
        """The peer's congestion map the gate last saw, and its bits as C reads them."""

    @property
    def unsynced(self) -> int:
        """Messages sent through the gate and not brought in yet."""
        return int(self._gate.unsynced)

    def open(self) -> None:
        """Open the gate, from the connection's numbers and bounds as they are now: the
        session would send a plain message in C next, with nothing of Python's queued."""
        rds, gate = self._rds, self._gate
        cong = rds.peer_congestion
        if cong is not self._cong:
            self._cong, self._cong_c = cong, self._ffi.from_buffer(cong.bits)
        gate.peer_cong = self._cong_c
        gate.next_seq = rds.next_seq
        gate.queued_bytes = rds.queued_bytes
        gate.queued = len(rds.unsent) + len(rds.unacked)
        settings = rds.settings
        gate.sndbuf, gate.max_queued = settings.sndbuf, settings.max_queued_messages
        gate.open = 1
        rds.direct = self  # (while it is set, the gate is open)

    def sync(self) -> None:
        """Close the gate and bring in what went through it: the connection numbers and
        keeps it as C numbered it (:meth:`.RdsConnection.sent_directly`). Nothing to do
        while it is closed (nothing goes through a closed gate)."""
        rds = self._rds
        if rds.direct is not self:
            return
        rds.direct = None
        gate = self._gate
        gate.open = 0
        if gate.unsynced:
            log, self.log = self.log, []
            assert len(log) == gate.unsynced  # (each went with its entry)
            gate.unsynced = 0
            seq = rds.next_seq
            rds.sent_directly(log)
            assert rds.next_seq == gate.next_seq
            self._brought_in(log, seq)

    def sendto_write(
        self, sport: int, dport: int, data: bytes, op: RdmaOp, sources: Sources
    ) -> int:
        """:attr:`sendto` for a message chasing an RDMA Write: 0, unless the transport's
        gate sends those too."""
        return 0

    def _brought_in(self, log: list[tuple[int, int, bytes, RdmaOp | None]], seq: int) -> None:
        """The connection has the messages of ``log`` now, numbered from ``seq`` on: what
        else they change in the session."""


class StreamSends(SendGate):
    """RDS/TCP's sends through the gate: a socket's plain message numbered and written to
    the connection's socket, framed as :class:`~.tcp_stream.StreamSender` frames it, in
    one call into C (``rp_stream_sendto``). What went reaches the stream's sender when
    Python brings it in (:meth:`sync`): where each message ends on the stream (TCP's
    acknowledgement of those bytes is the peer's of the message), and what the socket
    left of the last one, which ``rest`` takes and writes before anything else."""

    __slots__ = ("_rest", "_sender", "_tx", "run", "sendto")

    def __init__(
        self,
        inboxes: CInboxes,
        rds: RdsConnection,
        sender: StreamSender,
        fd: int,
        rest: Callable[[bytes], None],
    ) -> None:
        ffi = inboxes.ffi
        tx = self._tx = ffi.new("rp_stream_tx *")
        tx.fd = fd
        super().__init__(ffi, rds, tx.gate)
        self._sender, self._rest = sender, rest
        self.sendto = functools.partial(inboxes.lib.rp_stream_sendto, tx)
        """``sendto(sport, dport, data, len(data))``: :c:func:`rp_stream_sendto`, 1 when it
        went whole, 2 when the socket took part of it (then :attr:`run` brings it in), 0
        when it did not go (Python's sendto takes it)."""
        self.run: Callable[[], object] = self.sync

    @property
    def written(self) -> int:
        """Bytes written through the gate and not brought in yet."""
        return int(self._tx.written)

    def _brought_in(self, log: list[tuple[int, int, bytes, RdmaOp | None]], seq: int) -> None:
        """The stream's sender learns where the messages end on the stream; what the socket
        left of the last one goes to ``rest``."""
        tx, sender = self._tx, self._sender
        written, partial, before = tx.written, tx.partial, sender.written
        tx.written = tx.partial = 0
        rest = sender.sent_directly(log, seq, partial)
        assert sender.written - before == written  # (C's framing is the sender's)
        if rest:
            self._rest(rest)
