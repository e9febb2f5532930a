"""One RDS-over-RDMA session's flow, sans-IO: credits, acknowledgements, fragments.

A :class:`RdmaFlow` turns an :class:`~rdmashim.ulps.rds.connection.RdsConnection`'s
queue into the bytes of Sends and the bytes of received Sends into whole messages,
and keeps the session's credit-based flow control and cumulative acknowledgements.
It reads no clock (time comes in as ``now``), posts nothing and knows no verbs: the
session (:mod:`.rdma_session`) hands it a buffer to write a fragment into
(:meth:`RdmaFlow.fill`, :meth:`RdmaFlow.fill_ack`) and the bytes of each completed
receive (:meth:`RdmaFlow.receive`), and posts the Sends it makes.

On the wire (Linux's ``rds_ib``): messages go as fragments of at most
``RDS_FRAG_SIZE`` bytes, each with its own 48-byte header repeating the message's
sequence number, length and ports; the first fragment alone carries the extension
headers. Every header carries our cumulative ack (``h_ack``) and the credits we grant
(``h_credit``, at most ``RDS_MAX_ADV_CREDIT`` a header). A Send goes only where the
peer posted a receive (a credit), data never takes the last credit, and neither does
a bare ack unless it grants some; a peer that grants none at connect time turns flow
control off (:meth:`RdmaFlow.peer_credits`). Our congestion map goes between
messages as sequence 0 with ``h_flags`` exactly ``CONG_BITMAP``.
"""

from __future__ import annotations

import functools
import logging
import math
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING

from rdmashim.ulps.rds.connection import OutMessage, RdsConnection
from rdmashim.ulps.rds.cookie import cookie_rkey
from rdmashim.ulps.rds.wire import (
    FLAGS_BY_VALUE,
    HEADER_STRUCT,
    RDS_FRAG_SIZE,
    RDS_HEADER_LEN,
    RDS_MAX_ADV_CREDIT,
    RdmaExt,
    RdsExtType,
    RdsFlag,
    RdsHeader,
    RdsProtocolError,
    encode_extensions,
)

if TYPE_CHECKING:
    from rdmashim.ulps.rds.rdma import RdmaOp

log = logging.getLogger(__name__)

RECV_SLOTS = 128
"""Receives a session keeps posted, and the credits it grants at connect time."""
ACK_REQUIRED_EVERY = 8
"""A message asks the peer for an acknowledgement (``RDS_FLAG_ACK_REQUIRED``) at
least once in this many, and the last one before the queue runs dry always does:
Linux acknowledges only what asks (``ib_recv.c`` ``rds_ib_set_ack``) unless a message
of its own carries the ack (its ``rds_sysctl_max_unacked_packets``, 8, in ``send.c``)."""
ACK_DELAY = 0.002
"""Seconds a session holds an acknowledgement back for a message of ours to carry it:
a bare one goes only when none of ours went within this time of the first message it
acknowledges."""
ACK_NONE = 0
""":meth:`RdmaFlow.acknowledge`: nothing to do (no ack owed, or one held already)."""
ACK_NOW = 1
""":meth:`RdmaFlow.acknowledge`: send a bare ack now (many receives wait to be granted)."""
ACK_HELD = 2
""":meth:`RdmaFlow.acknowledge`: the ack is held back now, until :attr:`FlowState.ack_at`."""
_ACK_REQUIRED = int(RdsFlag.ACK_REQUIRED)
_pack_header = HEADER_STRUCT.pack_into
_CONG_BITMAP = RdsFlag.CONG_BITMAP
_CONG_BITS = int(RdsFlag.CONG_BITMAP)
_FRONT = struct.Struct(HEADER_STRUCT.format[:-3] + "B")
"""The header up to the first extension header's type byte (0: none): what
:meth:`RdmaFlow.receive_at` reads of every received Send."""
_RDMA_EXT = int(RdsExtType.RDMA)
_RKEY = struct.Struct("!I")
_RKEY_AT = _FRONT.size
"""Where an RDMA extension header's R_Key is (after its type byte)."""
_AFTER_RDMA = _RKEY_AT + _RKEY.size
"""The type byte after an RDMA extension header (0: it is the only one)."""


@functools.lru_cache(maxsize=64)
def _rdma_area(cookie: int) -> bytes:
    """The extension area of a message chasing an RDMA operation on ``cookie`` and
    carrying no other extension (made once per cookie: rds stress ``-D`` names a few)."""
    return encode_extensions((RdmaExt(cookie_rkey(cookie)),))


@functools.lru_cache(maxsize=64)
def _chasing(rkey: int) -> tuple[RdmaExt]:
    """The extensions of a received message whose only one names ``rkey`` (as above)."""
    return (RdmaExt(rkey),)


class FlowState:
    """A flow's counters that the C path shares (``rp_flow`` in ``_plain.h``: there they
    live in C memory, and the CQ's native handler and a plain message's Send in C change
    them too); this class holds them on the Python path. :class:`RdmaFlow` sets their
    starting values, on either."""

    __slots__ = (
        "ack_at", "ack_countdown", "acked_to_peer", "advertise", "flow_control", "send_credits",
    )  # fmt: skip

    send_credits: int
    """Receives the peer has posted for us that we have not used yet."""
    flow_control: bool
    """Whether Sends wait for the peer's credits (see :meth:`RdmaFlow.peer_credits`)."""
    advertise: int
    """Receives we posted again that the peer has not been granted yet."""
    ack_countdown: int
    """Messages left before the next one asks for an acknowledgement."""
    acked_to_peer: int
    """The last sequence number a header of ours acknowledged."""
    ack_at: float
    """When an acknowledgement held back must go on its own."""


class RdmaFlow:
    """Credits, acknowledgements and fragments of one RDMA session (sans-IO; see the
    module docstring). ``rds`` is the connection the session carries."""

    __slots__ = (
        "assembly",
        "current",
        "extra_flags",
        "fence",
        "last",
        "next_fragment",
        "rdma_op",
        "rds",
        "state",
        "talk",
    )  # fmt: skip

    def __init__(self, rds: RdsConnection, state: FlowState | None = None) -> None:
        self.rds = rds
        self.state: FlowState = FlowState() if state is None else state
        """The counters the C path shares (:class:`FlowState`; ``state`` is its C struct
        there)."""
        st = self.state
        st.send_credits = 0
        st.flow_control = True
        st.advertise = 0
        st.ack_countdown = 0
        st.acked_to_peer = rds.next_recv - 1
        st.ack_at = math.inf
        self.current: OutMessage | None = None
        """The message whose fragments go next (None: take the next from the queue)."""
        self.next_fragment = 0
        self.extra_flags = 0
        """Flags the current message's headers carry beside its own (ACK_REQUIRED)."""
        self.assembly: tuple[RdsHeader, bytearray] | None = None
        """The first header and the bytes so far of a message arriving in fragments."""
        self.talk = -1
        """The ports (``sport << 16 | dport``) of the sockets' messages received since
        the session last reset it to -1 (-2: more than one pair)."""
        self.last = True
        """The last fragment :meth:`fill` wrote ends its message (its Send is solicited)."""
        self.fence = False
        """The last fragment :meth:`fill` wrote follows an RDMA Read (its Send is fenced)."""
        self.rdma_op: RdmaOp | None = None
        """The RDMA operation of the message :meth:`fill` just started: the session posts
        it ahead of the fragment, and sets this back to None."""

    def peer_credits(self, credits: int) -> None:
        """The credits the peer's private data announced (``dp_credit``); 0: no flow
        control on this session, either way (``ib_cm.c`` ``rds_ib_set_flow_control``)."""
        self.state.flow_control = credits != 0
        self.state.send_credits = credits

    # ------------------------------------------------------------------ sending
    def fill(self, buf: bytearray | memoryview, base: int, rdma_room: bool = True) -> int:
        """Write the next fragment (header and payload) at ``buf[base:]`` and return its
        length, or 0 when nothing may go now: the queue is empty, the credits are down
        to the last one, or the next message carries an RDMA operation and there is no
        ``rdma_room``. :attr:`last`, :attr:`fence` and :attr:`rdma_op` then describe
        the fragment. Between messages our newest congestion map goes first."""
        st = self.state
        if st.flow_control and st.send_credits <= 1:
            return 0
        msg = self.current
        fence = False
        if msg is None:
            rds = self.rds
            if rds.map_out is not None:  # not numbered: it asks for no acknowledgement
                msg = self.current = OutMessage(0, 0, 0, rds.map_out, _CONG_BITMAP, own=True)
                rds.map_out = None
                self.next_fragment = self.extra_flags = 0
            elif not rds.unsent or (rds.unsent[0].rdma is not None and not rdma_room):
                return 0
            else:
                msg = self.current = rds.unsent.popleft()
                rds.unacked.append(msg)
                self.next_fragment = 0
                # It asks for an acknowledgement now and then (ACK_REQUIRED_EVERY), and
                # when it is the last one queued.
                if st.ack_countdown == 0 or not rds.unsent:
                    self.extra_flags = _ACK_REQUIRED
                    st.ack_countdown = ACK_REQUIRED_EVERY - 1
                else:
                    self.extra_flags = 0
                    st.ack_countdown -= 1
                op = msg.rdma
                if op is not None:
                    self.rdma_op = op
                    fence = not op.write  # the peer sees the message after the Read
        self.fence = fence
        fragment = self.next_fragment
        data = msg.data
        if fragment == 0 and len(data) <= RDS_FRAG_SIZE:  # the whole message: no view
            self.current = None
            self.last = True
            return self._write(buf, base, msg, True, data)
        start = fragment * RDS_FRAG_SIZE
        self.next_fragment = fragment + 1
        self.last = last = self.next_fragment >= msg.fragments
        if last:
            self.current = None
        payload = memoryview(data)[start : start + RDS_FRAG_SIZE]
        return self._write(buf, base, msg, fragment == 0, payload)

    def ack_allowed(self) -> bool:
        """Whether a bare ack may go: the last credit only goes to one that grants the
        peer some (spent on a bare ack, both sides could end up with none and wait for
        each other for ever)."""
        st = self.state
        return not st.flow_control or st.send_credits > 1 or bool(st.send_credits and st.advertise)

    def fill_ack(self, buf: bytearray | memoryview, base: int) -> int:
        """Write a bare ack (ports 0, no payload: our ack and credits) at ``buf[base:]``;
        its length. The caller checks :meth:`ack_allowed` first."""
        self.last = True
        self.fence = False
        return self._write(buf, base, None, True, b"")

    def _write(
        self,
        buf: bytearray | memoryview,
        base: int,
        msg: OutMessage | None,
        first: bool,
        payload: bytes | memoryview,
    ) -> int:
        """Pack a header (and the payload after it) at ``buf[base:]``: ``msg``'s, or a bare
        ack's for None. Every header carries our ack and what credits it can grant."""
        st = self.state
        credit = st.advertise
        if credit > RDS_MAX_ADV_CREDIT:
            credit = RDS_MAX_ADV_CREDIT
        st.advertise -= credit
        st.acked_to_peer = ack = self.rds.next_recv - 1
        st.ack_at = math.inf  # this one carries it
        size = len(payload)
        if msg is None:
            _pack_header(buf, base, 0, ack, 0, 0, 0, 0, credit, 0, b"")
        else:
            exthdr = b""
            if first and msg.extensions:
                extensions = msg.extensions
                if msg.rdma is not None:
                    extensions += (RdmaExt(msg.rdma.rkey),)
                exthdr = encode_extensions(extensions)
            elif first and msg.rdma is not None:
                exthdr = _rdma_area(msg.rdma.cookie)
            flags = int(msg.flags) | self.extra_flags
            _pack_header(
                buf, base, msg.seq, ack, len(msg.data), msg.sport, msg.dport, flags, credit,
                0, exthdr,
            )  # fmt: skip
            if size:
                buf[base + RDS_HEADER_LEN : base + RDS_HEADER_LEN + size] = payload
        if st.flow_control:
            st.send_credits -= 1
        return RDS_HEADER_LEN + size

    # ------------------------------------------------------------------ acknowledging
    def acknowledge(self, clock: Callable[[], float], next_recv: int | None = None) -> int:
        """What to do about our acknowledgement after receiving: :data:`ACK_NOW` when many
        receives wait to be granted; :data:`ACK_HELD` when a new message waits for one
        and none was held: it is held for :data:`ACK_DELAY` from ``clock()`` (read only
        then) for a message of ours to carry, until :attr:`FlowState.ack_at`; else
        :data:`ACK_NONE`. ``next_recv``: the number due next where it is newer than the
        connection's (the native handler's, not yet folded in)."""
        st = self.state
        if st.advertise >= RECV_SLOTS // 2:
            return ACK_NOW
        if (self.rds.next_recv if next_recv is None else next_recv) - 1 <= st.acked_to_peer:
            st.ack_at = math.inf  # a message of ours carried it
            return ACK_NONE
        if st.ack_at != math.inf:
            return ACK_NONE
        st.ack_at = clock() + ACK_DELAY
        return ACK_HELD

    def ack_expired(self, now: float) -> bool:
        """Whether, at ``now``, a held-back ack must go on its own (no message of ours
        carried it in time); the hold ends either way once it is due."""
        st = self.state
        if now < st.ack_at:
            return False
        st.ack_at = math.inf
        return self.rds.next_recv - 1 > st.acked_to_peer

    # ------------------------------------------------------------------ receiving
    def reposted(self, receives: int) -> None:
        """The session posted ``receives`` receive buffers again: credits to grant."""
        if self.state.flow_control:
            self.state.advertise += receives

    def receive(self, view: memoryview) -> None:
        """Take the bytes of one received Send (a fragment or a bare ack): its credits and
        ack, and the message it completes, handed to the connection (copied: ``view``
        may be reused once this returns). Raises :class:`RdsProtocolError` for bytes
        that are no RDS fragment."""
        self.receive_at(view, 0, len(view))

    def receive_at(self, buf: memoryview, base: int, nbytes: int) -> None:
        """:meth:`receive` of the ``nbytes`` at ``buf[base:]`` (a receive buffer: the
        session hands its registered buffer over as it is, no view made per Send).

        The header is read with one unpack where it is buffer; a message in one
        fragment with no checksum, no extension headers (or only the RDMA one of a
        message chasing an RDMA operation) and no congestion map (what every Send of a
        steady exchange is) is taken from there, and the rest goes through
        :meth:`RdsHeader.decode`, which checks and parses them."""
        if nbytes < RDS_HEADER_LEN:
            raise RdsProtocolError(f"{nbytes}-byte message shorter than an RDS header")
        seq, ack, length, sport, dport, flags, credit, csum, ext = _FRONT.unpack_from(buf, base)
        header = None
        extensions: tuple[RdmaExt, ...] = ()
        if ext == _RDMA_EXT and not buf[base + _AFTER_RDMA] and length == nbytes - RDS_HEADER_LEN:
            # A message in one fragment chasing an RDMA operation (its only extension).
            extensions, ext = _chasing(_RKEY.unpack_from(buf, base + _RKEY_AT)[0]), 0
        if csum or ext or length > RDS_FRAG_SIZE or flags & _CONG_BITS:
            header = RdsHeader.decode(buf[base : base + nbytes])
        self.state.send_credits += credit
        rds = self.rds
        unacked = rds.unacked
        if unacked and unacked[0].seq <= ack:  # (acked's own test: a call less when not)
            rds.acked(ack)
        if sport or dport or length:  # else a bare ack, as ib_recv.c's
            talk = sport << 16 | dport
            if talk != self.talk and sport and dport:  # (not the node's own)
                self.talk = talk if self.talk == -1 else -2
            start = base + RDS_HEADER_LEN
            if self.assembly is None and length == nbytes - RDS_HEADER_LEN:  # one copy
                if header is None:  # (a plain message, or a chaser: no header made)
                    rds.take(
                        seq, sport, dport, flags, bytes(buf[start : base + nbytes]), extensions
                    )
                else:
                    rds.received(header, bytes(buf[start : base + nbytes]))
            else:
                if header is None:
                    flag = FLAGS_BY_VALUE[flags]
                    header = RdsHeader(seq, ack, length, sport, dport, flag, credit, 0, extensions)
                self._assemble(header, buf[start : base + nbytes])

    def _assemble(self, header: RdsHeader, fragment: memoryview) -> None:
        """Add a fragment of a message in several (a view of the receive buffer: copied
        before it is reused)."""
        if self.assembly is None:
            self.assembly = (header, bytearray())
        first, data = self.assembly
        if header.sequence != first.sequence:
            raise RdsProtocolError(
                f"fragment of message {header.sequence} inside message {first.sequence}"
            )
        data += fragment
        if len(data) > first.length:
            raise RdsProtocolError(f"message {first.sequence} longer than its {first.length} bytes")
        if len(data) == first.length:
            self.assembly = None
            self.rds.received(first, bytes(data))
