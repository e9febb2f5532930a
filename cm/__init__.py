"""Connection management in librdmacm's model: event channel, CM ids, resolution, connect.

``EventChannel`` and ``CMId`` mirror ``rdma_create_event_channel`` and
``rdma_cm_id``; ``open_connection`` and ``serve`` are the trio-style layer
over them.
"""

from rdmashim.cm.channel import EventChannel
from rdmashim.cm.cmid import CMId
from rdmashim.cm.highlevel import (
    CMError,
    Connection,
    ConnectionRejected,
    ConnectionRequest,
    ConnectionUnreachable,
    open_connection,
    open_device_for,
    serve,
)
from rdmashim.cm.types import CMEvent, CMEventType, ConnParam, PortSpace

__all__ = [
    "CMError",
    "CMEvent",
    "CMEventType",
    "CMId",
    "ConnParam",
    "Connection",
    "ConnectionRejected",
    "ConnectionRequest",
    "ConnectionUnreachable",
    "EventChannel",
    "PortSpace",
    "open_connection",
    "open_device_for",
    "serve",
]
