"""Asynchronous events of a device context (``ibv_get_async_event``)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Any


class AsyncEventType(IntEnum):
    """``enum ibv_event_type``."""

    CQ_ERR = 0
    QP_FATAL = 1
    QP_REQ_ERR = 2
    QP_ACCESS_ERR = 3
    COMM_EST = 4
    SQ_DRAINED = 5
    PATH_MIG = 6
    PATH_MIG_ERR = 7
    DEVICE_FATAL = 8
    PORT_ACTIVE = 9
    PORT_ERR = 10
    LID_CHANGE = 11
    PKEY_CHANGE = 12
    SM_CHANGE = 13
    SRQ_ERR = 14
    SRQ_LIMIT_REACHED = 15
    QP_LAST_WQE_REACHED = 16
    CLIENT_REREGISTER = 17
    GID_CHANGE = 18
    WQ_FATAL = 19


PORT_EVENTS = frozenset(
    {
        AsyncEventType.PORT_ACTIVE,
        AsyncEventType.PORT_ERR,
        AsyncEventType.LID_CHANGE,
        AsyncEventType.PKEY_CHANGE,
        AsyncEventType.SM_CHANGE,
        AsyncEventType.CLIENT_REREGISTER,
        AsyncEventType.GID_CHANGE,
    }
)
"""Events whose element is a port number (the others name a CQ, QP, SRQ or nothing)."""

QP_ERROR_EVENTS = frozenset(
    {AsyncEventType.QP_FATAL, AsyncEventType.QP_REQ_ERR, AsyncEventType.QP_ACCESS_ERR}
)
"""Events that leave their QP in the error state."""


@dataclass(frozen=True, slots=True)
class AsyncEvent:
    """What happened (``event_type``) to which object: the CQ, QP or SRQ, a port number,
    or None for device-wide events."""

    event_type: AsyncEventType
    element: Any
