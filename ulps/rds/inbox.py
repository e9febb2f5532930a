"""The sockets' receive queues: one :class:`Inbox` per socket, kept by the node's
:class:`Inboxes`, in Python or in C.

A node delivers each message to the inbox of the socket bound to its port, and
``recvfrom`` takes from it. :class:`PyInboxes` keeps them in Python (a deque per
socket: the reference). :class:`CInboxes` keeps them in C (``_plain.c``), where RDS's
plain-message path (:mod:`.plain`) queues a session's plain messages without Python;
the messages Python delivers go into the same queues, so each socket has one order.
:func:`rdmashim.ulps.rds.plain.inboxes` chooses. Both keep ``count`` and ``nbytes``
as plain attributes of :attr:`Inbox.counts`, read without a call, and the node's
count of inboxes holding messages as ``holding`` of :attr:`Inboxes.counts`.
"""

from __future__ import annotations

import functools
import ipaddress
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

if TYPE_CHECKING:
    from rdmashim.ulps.rds.connection import IPAddress


class ReceivedMessage(NamedTuple):
    """A message waiting in a socket's receive queue."""

    data: bytes
    sender: tuple[str, int]
    seq: int
    """The sender node's sequence number for it (rds-info's receive queue)."""


class Inbox(Protocol):
    """One socket's receive queue, oldest message first."""

    counts: Any
    """What has ``count`` (messages queued) and ``nbytes`` (their bytes) as attributes,
    and ``use_once``: the socket's live use-once registrations, which its
    :class:`~.rdma.Registrations` keep there (a message chasing an RDMA operation matters
    to the socket only while it has one)."""

    def push(self, data: bytes, peer: IPAddress, sport: int, seq: int) -> None:
        """Queue a message from ``peer``'s port ``sport``, numbered ``seq`` by its node."""

    def take(self) -> ReceivedMessage:
        """Take the oldest message (the caller checked there is one: IndexError if not)."""
        ...

    def clear(self) -> None:
        """Drop every message."""

    def __iter__(self) -> Iterator[ReceivedMessage]:
        """The messages, oldest first (for listings; a copy: the queue may change)."""
        ...

    def __len__(self) -> int:
        """How many messages are queued."""
        ...


class Inboxes(Protocol):
    """A node's inboxes: one per bound port."""

    counts: Any
    """What has ``holding`` (inboxes that hold messages) as an attribute."""

    def open(self, port: int) -> Inbox:
        """A new, empty inbox for the socket bound to ``port``."""
        ...

    def close(self, port: int, inbox: Inbox) -> None:
        """``port``'s socket closed: its inbox is emptied and no longer found by port."""


_message = tuple.__new__
"""``ReceivedMessage``'s tuple made without its ``__new__`` (a Python call)."""
_last_peer: list[Any] = [None, ("", 0, b"")]
"""The address :func:`_forms` last gave, and what it gave: a node delivers from the
same few peers, each one address object (hashing one costs a Python call)."""


def _forms(ip: IPAddress) -> tuple[str, int, bytes]:
    """How an inbox names a sender ``ip``: its text, its family (4 or 6) and its
    address in 16 bytes (C's ``rp_msg.peer``), made once for a run of messages from it."""
    if ip is not _last_peer[0]:
        _last_peer[:] = [ip, (str(ip), ip.version, ip.packed.ljust(16, b"\0"))]
    found: tuple[str, int, bytes] = _last_peer[1]
    return found


class PyInbox:
    """An :class:`Inbox` in Python."""

    __slots__ = ("_counts", "_messages", "count", "counts", "nbytes", "use_once")

    def __init__(self, counts: PyInboxes) -> None:
        self._messages: deque[ReceivedMessage] = deque()
        self._counts = counts
        self.count = 0
        self.nbytes = 0
        self.use_once = 0
        self.counts = self

    def push(self, data: bytes, peer: IPAddress, sport: int, seq: int) -> None:
        """:meth:`Inbox.push`."""
        if not self.count:
            self._counts.holding += 1
        last = _last_peer
        text = (last[1] if peer is last[0] else _forms(peer))[0]
        self._messages.append(_message(ReceivedMessage, (data, (text, sport), seq)))
        self.count += 1
        self.nbytes += len(data)

    def take(self) -> ReceivedMessage:
        """:meth:`Inbox.take`."""
        msg = self._messages.popleft()
        self.count -= 1
        self.nbytes -= len(msg.data)
        if not self.count:
            self._counts.holding -= 1
        return msg

    def clear(self) -> None:
        """:meth:`Inbox.clear`."""
        if self.count:
            self._counts.holding -= 1
        self._messages.clear()
        self.count = self.nbytes = 0

    def __iter__(self) -> Iterator[ReceivedMessage]:
        return iter(list(self._messages))

    def __len__(self) -> int:
        return self.count


class PyInboxes:
    """:class:`Inboxes` in Python (the reference)."""

    __slots__ = ("counts", "holding")

    def __init__(self) -> None:
        self.holding = 0
        self.counts = self

    def open(self, port: int) -> PyInbox:
        """:meth:`Inboxes.open`."""
        return PyInbox(self)

    def close(self, port: int, inbox: Inbox) -> None:
        """:meth:`Inboxes.close`."""
        inbox.clear()


@functools.lru_cache(maxsize=1024)
def _c_sender_text(family: int, packed: bytes) -> str:
    """The text of an address a C message names (4 or 16 bytes of ``packed``)."""
    return str(ipaddress.ip_address(packed[:4] if family == 4 else packed))


class _Closed:
    """What a closed :class:`CInbox` counts: nothing (its C queue is freed)."""

    count = 0
    nbytes = 0
    use_once = 0


class CInbox:
    """An :class:`Inbox` in C (``rp_inbox``, owned by the node's table); ``counts`` is
    the C struct itself, and nothing once the inbox is closed."""

    __slots__ = ("_inboxes", "counts")

    def __init__(self, inboxes: CInboxes, box: Any) -> None:
        self.counts: Any = box
        self._inboxes = inboxes  # (the table outlives its inboxes: it owns them)

    def push(self, data: bytes, peer: IPAddress, sport: int, seq: int) -> None:
        """:meth:`Inbox.push`."""
        last = _last_peer
        _, family, packed = last[1] if peer is last[0] else _forms(peer)
        if self._inboxes.lib.rp_push(self.counts, seq, sport, family, packed, data, len(data)):
            raise MemoryError(f"no memory to queue a {len(data)}-byte RDS message")

    def take(self) -> ReceivedMessage:
        """:meth:`Inbox.take` (:func:`_message_of`, inline: two Python calls a message
        less); IndexError when it is empty, as a deque's."""
        inboxes = self._inboxes
        lib, unpack = inboxes.lib, inboxes.ffi.unpack
        msg = lib.rp_take(self.counts)
        if not msg:  # (NULL: reading it would crash the process)
            raise IndexError("take from an empty RDS inbox")
        try:
            sender = (_c_sender_text(msg.family, unpack(msg.peer, 16)), msg.sport)
            return _message(ReceivedMessage, (unpack(msg.data, msg.len), sender, msg.seq))
        finally:
            lib.rp_free(msg)

    def clear(self) -> None:
        """:meth:`Inbox.clear`."""
        if self.counts is not _Closed:
            self._inboxes.lib.rp_clear(self.counts)

    def __iter__(self) -> Iterator[ReceivedMessage]:
        if self.counts is _Closed:
            return iter(())
        ffi, found = self._inboxes.ffi, []
        msg = self.counts.head
        while msg != ffi.NULL:
            found.append(_message_of(ffi, msg))
            msg = msg.next
        return iter(found)

    def __len__(self) -> int:
        return int(self.counts.count)


def _message_of(ffi: Any, msg: Any) -> ReceivedMessage:
    """The :class:`ReceivedMessage` of a C message (``rp_msg``)."""
    sender = (_c_sender_text(msg.family, ffi.unpack(msg.peer, 16)), msg.sport)
    return ReceivedMessage(ffi.unpack(msg.data, msg.len), sender, msg.seq)


class CInboxes:
    """:class:`Inboxes` in C (``rp_ports``): the port table :mod:`.plain`'s scan reads."""

    __slots__ = ("counts", "ffi", "lib")

    def __init__(self, ffi: Any, lib: Any) -> None:
        self.ffi, self.lib = ffi, lib
        ports = lib.rp_ports_new()
        if ports == ffi.NULL:
            raise MemoryError("no memory for an RDS node's port table")
        self.counts = ffi.gc(ports, lib.rp_ports_free)

    def open(self, port: int) -> CInbox:
        """:meth:`Inboxes.open`: the inbox, found by the scan from now on."""
        box = self.lib.rp_open(self.counts, port)
        if box == self.ffi.NULL:
            raise MemoryError(f"no memory for the receive queue of RDS port {port}")
        return CInbox(self, box)

    def close(self, port: int, inbox: Inbox) -> None:
        """:meth:`Inboxes.close`: the C queue is freed; the inbox counts nothing after."""
        assert isinstance(inbox, CInbox)
        if inbox.counts is not _Closed:
            self.lib.rp_close(self.counts, inbox.counts)
            inbox.counts = _Closed
