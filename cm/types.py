"""rdma_cm's vocabulary: event types, port spaces, connection parameters, events.

Names and values are librdmacm's (``RDMA_CM_EVENT_*``, ``RDMA_PS_*``) without
the prefixes, so a C ULP ports line by line.
"""

from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass, fields
from enum import Enum, IntEnum, IntFlag, auto
from typing import TYPE_CHECKING, Any

from rdmashim.cm.addressing import host_port
from rdmashim.verbs.errors import VerbsError, integer

if TYPE_CHECKING:
    from rdmashim.cm.abc import ChannelHost, CMId
    from rdmashim.verbs.abc import Context

DEFAULT_MAX_PENDING = 256
"""Connections a listener holds that are not yet accepted or rejected (see
:attr:`rdmashim.cm.CMId.max_pending`)."""


class CMEventType(IntEnum):
    """``enum rdma_cm_event_type``."""

    ADDR_RESOLVED = 0
    ADDR_ERROR = 1
    ROUTE_RESOLVED = 2
    ROUTE_ERROR = 3
    CONNECT_REQUEST = 4
    CONNECT_RESPONSE = 5
    CONNECT_ERROR = 6
    UNREACHABLE = 7
    REJECTED = 8
    ESTABLISHED = 9
    DISCONNECTED = 10
    DEVICE_REMOVAL = 11
    MULTICAST_JOIN = 12
    MULTICAST_ERROR = 13
    ADDR_CHANGE = 14
    TIMEWAIT_EXIT = 15


class PortSpace(IntEnum):
    """``enum rdma_port_space``."""

    IPOIB = 0x0002
    TCP = 0x0106
    UDP = 0x0111
    IB = 0x013F


class CMState(Enum):
    """Where a CM id is in its life; it moves by one table (:mod:`rdmashim.cm.states`)."""

    IDLE = auto()
    ADDR_BOUND = auto()
    ADDR_QUERY = auto()
    ADDR_RESOLVED = auto()
    ROUTE_QUERY = auto()
    ROUTE_RESOLVED = auto()
    CONNECT = auto()
    LISTEN = auto()
    CONNECT_REQUEST = auto()
    ACCEPTING = auto()
    ESTABLISHED = auto()
    DISCONNECTED = auto()
    DESTROYED = auto()


class RTR(IntFlag):
    """Ready-to-receive message types of RFC 6581 peer-to-peer connection setup."""

    NONE = 0
    SEND = 1
    WRITE = 2
    READ = 4


@dataclass(frozen=True, slots=True)
class TransportOptions:
    """How a connection's transport is set up: the iWARP MPA knobs (RFC 5044, RFC 6581).

    ``crc``: ask for MPA CRC32c (on whenever either side asks). ``revision``: MPA
    revision 2 (RFC 6581 IRD/ORD exchange) or 1. ``p2p``: peer-to-peer mode, in
    which the initiator offers the ``rtr`` message types and the responder picks
    one, after which either side may send first. ``max_fpdu``: the largest FPDU
    this side sends, in bytes (not negotiated). IRD/ORD come from
    :class:`ConnParam`.

    A backend honours the fields its ``CMBackend.transport_options`` names and
    refuses other non-default values with ``NotSupported`` (rdma-core leaves MPA
    to the kernel's iw_cm). A CM id's ``negotiated`` is one of these too: what
    setup settled (``p2p`` and the ``rtr`` chosen, ``crc``, ``revision``).
    """

    crc: bool = True
    revision: int = 2
    p2p: bool = False
    rtr: RTR = RTR.WRITE | RTR.READ
    max_fpdu: int = 65536

    def __post_init__(self) -> None:
        if integer(self.revision) not in (1, 2):
            raise ValueError(f"MPA revision {self.revision!r} (1 or 2)")
        for name in ("crc", "p2p"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"TransportOptions.{name} is True or False: {getattr(self, name)!r}"
                )
        if not isinstance(self.rtr, RTR):
            raise ValueError(f"TransportOptions.rtr is RTR flags: {self.rtr!r}")
        max_fpdu = integer(self.max_fpdu)
        if max_fpdu is None:
            raise ValueError(f"TransportOptions.max_fpdu is bytes, an integer: {self.max_fpdu!r}")
        object.__setattr__(self, "max_fpdu", max_fpdu)

    def non_default(self) -> frozenset[str]:
        """Names of the fields that differ from the defaults."""
        default = TransportOptions()
        return frozenset(
            f.name for f in fields(self) if getattr(self, f.name) != getattr(default, f.name)
        )


@dataclass(frozen=True, slots=True)
class ConnParam:
    """``struct rdma_conn_param``.

    ``responder_resources``: RDMA Reads this side serves at once (IRD);
    ``initiator_depth``: RDMA Reads this side issues at once (ORD). On a
    CONNECT_REQUEST event they describe the peer's wishes from our side:
    what it wants us to serve and what it can serve for us.
    """

    private_data: bytes = b""
    responder_resources: int = 16
    initiator_depth: int = 16
    flow_control: int = 0
    retry_count: int = 7
    rnr_retry_count: int = 7
    srq: int = 0
    qp_num: int = 0


class CMEvent:
    """``struct rdma_cm_event``: what happened to which id.

    Take one with ``await channel.get_event()`` and acknowledge it with
    :meth:`ack`. ``status`` is 0 or a negative errno, as librdmacm reports it.
    For CONNECT_REQUEST ``id`` is the new id of the incoming connection and
    ``listen_id`` the listening one.
    """

    __slots__ = {
        "_channel": "The channel to acknowledge to.",
        "detail": "What went wrong, in the backend's words, for error events (else empty).",
        "event": "The kind of event (:class:`CMEventType`), ``event->event``.",
        "id": "The CM id it happened to (a new one for CONNECT_REQUEST), ``event->id``.",
        "listen_id": "For CONNECT_REQUEST, the listening id it arrived on (else None).",
        "param": "The peer's :class:`ConnParam` (CONNECT_REQUEST, ESTABLISHED), else None.",
        "private_data": "The peer's private data (CONNECT_REQUEST, ESTABLISHED, REJECTED).",
        "status": "0, or a negative errno saying why (``event->status``).",
    }

    def __init__(
        self,
        event: CMEventType,
        id: CMId,
        status: int = 0,
        private_data: bytes = b"",
        param: ConnParam | None = None,
        listen_id: CMId | None = None,
        detail: str = "",
        *,
        channel: ChannelHost | None = None,
    ) -> None:
        self.event = event
        self.id = id
        self.status = status
        self.private_data = private_data
        self.param = param
        self.listen_id = listen_id
        self.detail = detail
        self._channel = channel

    def ack(self) -> None:
        """Acknowledge the event (``rdma_ack_cm_event``); destroying an id waits for it."""
        if self._channel is not None:
            self._channel.ack(self)

    def __repr__(self) -> str:
        return f"<CMEvent {self}>"

    @property
    def reason(self) -> str:
        """What went wrong, in words: the backend's ``detail`` without a leading
        ``[Errno N]``, else the status's ``strerror``; empty for a status of 0."""
        detail = _ERRNO_PREFIX.sub("", self.detail)
        if detail or not self.status:
            return detail
        return os.strerror(-self.status) if self.status < 0 else f"reason {self.status}"

    def __str__(self) -> str:
        text = self.event.name
        peer = self.id.peer_addr
        if peer is not None:
            text += f" for {host_port(str(peer[0]), int(peer[1]))}"
        if self.status < 0:
            text += f" ({errno.errorcode.get(-self.status, self.status)})"
        reason = self.reason
        return f"{text}: {reason}" if reason else text


_ERRNO_PREFIX = re.compile(r"^\[Errno -?\d+\] ")


def check_sockaddr(operation: str, addr: object) -> tuple[Any, ...]:
    """``addr`` as the CM takes a socket address: a host (a string) and a port 0..65535
    (an integer of any type but bool), then IPv6's flow info and scope id; EINVAL
    naming what is wrong otherwise (a port past 65535 would wrap in ``htons``)."""
    fields: tuple[Any, ...] = tuple(addr) if isinstance(addr, tuple | list) else ()
    if len(fields) < 2:
        raise VerbsError(errno.EINVAL, operation, f"{addr!r} is not a (host, port) address")
    host, port, *rest = fields
    if not isinstance(host, str):
        raise VerbsError(errno.EINVAL, operation, f"host {host!r} is not a string")
    number = integer(port)
    if number is None:
        raise VerbsError(errno.EINVAL, operation, f"port {port!r} is not an integer")
    if not 0 <= number <= 0xFFFF:
        raise VerbsError(errno.EINVAL, operation, f"port {number} outside 0..65535")
    return (host, number, *rest)


def check_connect_timeout(operation: str, seconds: float) -> None:
    """EINVAL unless ``seconds`` (a CM id's ``connect_timeout``) is above 0 (infinity:
    no limit); NaN and negative times would fail inside the connection's task."""
    if not seconds > 0:
        raise VerbsError(errno.EINVAL, operation, f"connect_timeout {seconds!r} is not above 0")


def check_listen(operation: str, backlog: int, max_pending: int) -> None:
    """EINVAL unless ``backlog`` and a listening id's ``max_pending`` are at least 1
    (with none, every connection would be dropped unseen)."""
    if not (backlog >= 1 and max_pending >= 1):
        raise VerbsError(
            errno.EINVAL, operation, f"backlog {backlog!r} and max_pending {max_pending!r}: "
            "both at least 1",
        )  # fmt: skip


_CONN_PARAM_LIMITS = (
    ("responder_resources", None), ("initiator_depth", None), ("flow_control", 0xFF),
    ("retry_count", 0xFF), ("rnr_retry_count", 0xFF), ("srq", 0xFF), ("qp_num", 0xFFFFFFFF),
)  # fmt: skip
"""The integer fields of :class:`ConnParam` and the most ``struct rdma_conn_param``
holds (None: any, the device's limit bounds it: IRD and ORD)."""


def check_conn_param(
    context: Context | None, operation: str, param: ConnParam, limit: int | None = None
) -> None:
    """:func:`check_private_data` of ``param``'s, then EINVAL for a field that is no
    integer, is negative or exceeds what ``struct rdma_conn_param`` holds."""
    check_private_data(context, operation, param.private_data, limit)
    for name, most in _CONN_PARAM_LIMITS:
        value = integer(getattr(param, name))
        if value is None or value < 0:
            raise VerbsError(
                errno.EINVAL, operation, f"{name} {getattr(param, name)!r} is no count"
            )
        if most is not None and value > most:
            raise VerbsError(errno.EINVAL, operation, f"{name} {value} outside 0..{most}")


def check_private_data(
    context: Context | None, operation: str, private_data: bytes, limit: int | None = None
) -> None:
    """EINVAL if ``private_data`` is no bytes-like object, or longer than ``limit`` or,
    when None, than the device takes (``max_private_data``; 252 bytes, MPA's limit,
    before a device is chosen)."""
    if not isinstance(private_data, bytes | bytearray | memoryview):
        raise VerbsError(
            errno.EINVAL, operation, f"private data is bytes, not {type(private_data).__name__}"
        )
    if limit is None:
        limit = context.query_device().max_private_data if context is not None else 252
    if len(private_data) > limit:
        raise VerbsError(
            errno.EINVAL, operation, f"{len(private_data)} bytes of private data > {limit}"
        )
