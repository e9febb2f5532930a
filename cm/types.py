"""rdma_cm's vocabulary: event types, port spaces, connection parameters, events.

Names and values are librdmacm's (``RDMA_CM_EVENT_*``, ``RDMA_PS_*``) without
the prefixes, so a C ULP ports line by line.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rdmashim.cm.cmid import CMId


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


@dataclass(frozen=True, slots=True)
class CMEvent:
    """``struct rdma_cm_event``: what happened to which id.

    ``status`` is 0 or a negative errno, as librdmacm reports it. For
    CONNECT_REQUEST ``id`` is the new id of the incoming connection and
    ``listen_id`` the listening one.
    """

    event: CMEventType
    id: CMId
    status: int = 0
    private_data: bytes = b""
    param: ConnParam | None = None
    listen_id: CMId | None = None
    detail: str = ""
    """What went wrong, in words, for error events."""
    _channel: Any = None

    def ack(self) -> None:
        """Acknowledge the event (``rdma_ack_cm_event``); destroying an id waits for it."""
        if self._channel is not None:
            self._channel._ack(self)

    def __str__(self) -> str:
        text = f"{self.event.name} on {self.id}"
        if self.status:
            text += f" (status {self.status})"
        if self.detail:
            text += f": {self.detail}"
        return text
