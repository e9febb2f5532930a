"""Asynchronous events of a device context (``ibv_get_async_event``), for every backend.

``event = await ctx.get_async_event()`` gives an :class:`AsyncEvent`: what
happened (``event_type``, libibverbs' ``enum ibv_event_type``) to which object
(the CQ, QP or SRQ, a port number, or None for device-wide events).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rdmashim.verbs.abc import CQ, QP, SRQ


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


@dataclass(frozen=True, slots=True)
class AsyncEvent:
    """What happened (``event_type``) to which object (``element``)."""

    event_type: AsyncEventType
    element: CQ | QP | SRQ | int | None
    """The CQ, QP or SRQ it happened to, the port number, or None (device-wide)."""
