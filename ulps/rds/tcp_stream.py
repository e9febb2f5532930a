"""RDS/TCP's byte stream, sans-IO: messages framed out, and cut back out of the bytes.

On the stream every message is its 48-byte :class:`~rdmashim.ulps.rds.wire.RdsHeader`
and then ``h_len`` bytes of payload, whole (no 4 KiB fragments as over RDMA), with
``h_ack`` and ``h_credit`` zero: TCP does the flow control, and a message counts as
acknowledged once TCP has the peer's ack for its last byte (Linux's
``rds_tcp_is_acked`` against ``snd_una``).

* :class:`StreamSender` takes an
  :class:`~rdmashim.ulps.rds.connection.RdsConnection`'s queue as the bytes to
  write (the newest congestion map first), learns where the messages a socket's
  sendto wrote in C end (:class:`~rdmashim.ulps.rds.gate.StreamSends`) and, told
  how far TCP has acknowledged the stream, which messages the peer has.
* :class:`StreamDecoder` cuts the byte stream into (header, payload) and refuses an
  ``h_len`` over ``RDS_MAX_MSG_SIZE`` before buffering any of it; on the C path its
  plain messages go to their sockets in C (:class:`~rdmashim.ulps.rds.plain.PlainStream`).

No trio and no sockets: :class:`~rdmashim.ulps.rds.tcp.TcpSession` does the I/O.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from rdmashim.ulps.rds.connection import OutMessage, RdsConnection
from rdmashim.ulps.rds.wire import HEADER_STRUCT, RDS_HEADER_LEN, RdsFlag, RdsHeader

if TYPE_CHECKING:
    from rdmashim.ulps.rds.rdma import RdmaOp

SEND_BATCH = 64 * 1024
"""Bytes of messages gathered into one write (Linux corks the socket around a batch)."""


Received = Callable[[RdsHeader, bytes], None]
"""What takes each message a decoder completes: ``received(header, payload)``."""


class PlainScan(Protocol):
    """Where the whole plain messages of a stream go to their sockets in C
    (:class:`~rdmashim.ulps.rds.plain.PlainStream`)."""

    def scan(self, buf: bytearray, pos: int) -> tuple[int, int]:
        """Take the whole plain messages in ``buf`` from ``pos`` on; (bytes, messages)."""


class StreamSender:
    """The sending half of one RDS/TCP connection's stream (sans-IO; see the module
    docstring). ``rds`` is the connection the stream carries."""

    def __init__(self, rds: RdsConnection) -> None:
        self.rds = rds
        self.written = 0
        """Bytes written on this connection so far (:meth:`wrote` counts them)."""
        self.inflight: deque[tuple[int, int]] = deque()
        """(stream offset just past the message, its sequence number), oldest first."""

    def batch(self) -> bytearray:
        """Take what is queued (the newest congestion map first) as the bytes to write
        next, up to about :data:`SEND_BATCH`; the messages move to ``unacked``. The
        caller writes them before it asks for another batch."""
        rds = self.rds
        batch = bytearray()
        if rds.map_out is not None:
            batch += map_header(len(rds.map_out))
            batch += rds.map_out
            rds.map_out = None
        while rds.unsent and len(batch) < SEND_BATCH:
            msg = rds.unsent.popleft()
            rds.unacked.append(msg)
            batch += message_header(msg)
            batch += msg.data
            self.inflight.append((self.written + len(batch), msg.seq))
        return batch

    def wrote(self, count: int) -> None:
        """``count`` more bytes of the batches went on the stream."""
        self.written += count

    def sent_directly(
        self, log: list[tuple[int, int, bytes, RdmaOp | None]], seq: int, partial: int
    ) -> bytes:
        """The plain messages of ``log`` (sport, dport, data, None), numbered from ``seq``
        on, went on the stream through the gate, framed as :meth:`batch` frames them
        (:class:`~.gate.StreamSends`); the socket took only ``partial`` bytes of the last
        (0: all of it). What is left of it, to write before anything else (empty: none)."""
        written, inflight = self.written, self.inflight
        for _, _, data, _ in log:
            written += RDS_HEADER_LEN + len(data)
            inflight.append((written, seq))
            seq += 1
        self.written = written
        if not partial:
            return b""
        sport, dport, data, _ = log[-1]
        whole = message_header(OutMessage(seq - 1, sport, dport, data)) + data
        self.written -= len(whole) - partial
        return whole[partial:]

    @property
    def last_offset(self) -> int:
        """The stream offset just past the last message written (or all written)."""
        return self.inflight[-1][0] if self.inflight else self.written

    def acked_to(self, offset: int) -> None:
        """TCP has the peer's ack for the stream up to ``offset``: the messages that end
        there or before are the peer's (:meth:`RdsConnection.acked`)."""
        inflight = self.inflight
        last = None
        while inflight and inflight[0][0] <= offset:
            last = inflight.popleft()[1]
        if last is not None:
            self.rds.acked(last)


class StreamDecoder:
    """Cuts an RDS/TCP byte stream into messages (sans-IO).

    :meth:`take` (and :meth:`feed`) take bytes as they come, in pieces of any size,
    and hand on the messages they complete. A header is checked as soon as its 48 bytes
    are in (:meth:`RdsHeader.decode`): a checksum that does not match, or an ``h_len``
    over ``RDS_MAX_MSG_SIZE``, raises :class:`RdsProtocolError` before any of the
    payload is kept, so a peer cannot make us buffer more than one message of at most
    1 MiB. With a ``plain`` path (:class:`~.plain.PlainStream`), the whole plain
    messages at the front of what is buffered go to their sockets in C between them.
    """

    def __init__(self, plain: PlainScan | None = None) -> None:
        self._buf = bytearray()
        self._header: RdsHeader | None = None
        self._plain = plain

    @property
    def buffered(self) -> int:
        """Bytes held for a message not complete yet."""
        return len(self._buf)

    @property
    def at_message(self) -> bool:
        """Whether the next byte of the stream begins a message: nothing buffered, and no
        header taken whose payload is still to come."""
        return self._header is None and not self._buf

    @property
    def remaining(self) -> tuple[int, int]:
        """(header bytes, payload bytes) still to come for the current message
        (rds-info's ``hdr_rem`` and ``data_rem``)."""
        if self._header is None:
            return RDS_HEADER_LEN - len(self._buf), 0
        return 0, self._header.length - len(self._buf)

    def feed(self, data: bytes | bytearray | memoryview) -> list[tuple[RdsHeader, bytes]]:
        """The messages ``data`` completes that the plain path did not take (all, without
        one), in order, as (header, payload)."""
        out: list[tuple[RdsHeader, bytes]] = []
        self.take(data, lambda header, payload: out.append((header, payload)))
        return out

    def take(self, data: bytes | bytearray | memoryview, received: Received) -> int:
        """Hand each message ``data`` completes to ``received(header, payload)``, in order and
        at once (the plain path, if any, takes the whole plain messages between them, as
        they come due); how many messages it completed."""
        buf = self._buf
        buf += data
        plain = self._plain
        pos = count = 0
        with memoryview(buf) as view:  # released before the consumed bytes are dropped
            while True:
                if self._header is None:
                    if plain is not None and len(buf) - pos >= RDS_HEADER_LEN:
                        took, messages = plain.scan(buf, pos)
                        pos += took
                        count += messages
                    if len(buf) - pos < RDS_HEADER_LEN:  # (decode's own test: a call less)
                        break
                    header = RdsHeader.decode(view[pos:])
                    assert header is not None
                    self._header = header
                    pos += RDS_HEADER_LEN
                end = pos + self._header.length
                if end > len(buf):
                    break
                header, self._header = self._header, None
                payload = bytes(view[pos:end])  # the one copy
                pos = end
                count += 1
                received(header, payload)
        del buf[:pos]
        return count


def message_header(msg: OutMessage) -> bytes:
    """A numbered message's header as it goes on the stream before its payload
    (``h_ack`` and ``h_credit`` zero, as ``rds_tcp_xmit`` sends it). Without extension
    headers (every message but a probe and its answer) it is packed with no
    :class:`RdsHeader` made: the fields are the queue's, checked when it took them."""
    if not msg.extensions:
        return _pack(msg.seq, 0, len(msg.data), msg.sport, msg.dport, msg.flags, 0, 0, b"")
    return RdsHeader(
        msg.seq, 0, len(msg.data), msg.sport, msg.dport, msg.flags, extensions=msg.extensions
    ).encode()


_pack = HEADER_STRUCT.pack


def map_header(length: int) -> bytes:
    """The header of a congestion map update of ``length`` bytes, as Linux's
    ``rds_cong_update_alloc`` makes it."""
    return RdsHeader(length=length, flags=RdsFlag.CONG_BITMAP).encode()
