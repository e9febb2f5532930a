"""Connection management in librdmacm's model: event channel, CM ids, resolution, connect.

``EventChannel`` and ``CMId`` mirror ``rdma_create_event_channel`` and
``rdma_cm_id``; ``open_connection`` and ``serve`` are the trio-style layer
over them. ``CMId`` is the protocol (:mod:`rdmashim.cm.abc`) every backend's
ids satisfy; the backends make them (:mod:`rdmashim.verbs.backend`).
"""

from rdmashim.cm.abc import CMId
from rdmashim.cm.channel import EventChannel
from rdmashim.cm.errors import CMError, ConnectionRejected, ConnectionUnreachable
from rdmashim.cm.highlevel import (
    Connection,
    ConnectionRequest,
    open_connection,
    open_device_for,
    serve,
)
from rdmashim.cm.states import CMStateError
from rdmashim.cm.types import (
    RTR,
    CMEvent,
    CMEventType,
    CMState,
    ConnParam,
    PortSpace,
    TransportOptions,
)

__all__ = [
    "RTR",
    "CMError",
    "CMEvent",
    "CMEventType",
    "CMId",
    "CMState",
    "CMStateError",
    "ConnParam",
    "Connection",
    "ConnectionRejected",
    "ConnectionRequest",
    "ConnectionUnreachable",
    "EventChannel",
    "PortSpace",
    "TransportOptions",
    "open_connection",
    "open_device_for",
    "serve",
]
