"""Asynchronous events: ``ib_async_event_t``, ``ib_async_event_rec_t``, and the portable map.

A CA's event task reads the portable context's events
(``get_async_event``) and hands each to the handle it concerns: a CQ, QP or
SRQ event goes to that object's ``pfn_*_event_cb``, a device or port event
to the CA's ``pfn_ca_event_cb``, each with an :class:`ib_async_event_rec_t`
on the callback thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from rdmashim.verbs.events import AsyncEventType


class ib_async_event_t(IntEnum):
    """``ib_async_event_t``, value for value (WinOF's ``ib_types.h`` order)."""

    IB_AE_SQ_ERROR = 1
    IB_AE_SQ_DRAINED = 2
    IB_AE_RQ_ERROR = 3
    IB_AE_CQ_ERROR = 4
    IB_AE_QP_FATAL = 5
    IB_AE_QP_COMM = 6
    IB_AE_QP_APM = 7
    IB_AE_LOCAL_FATAL = 8
    IB_AE_PKEY_TRAP = 9
    IB_AE_QKEY_TRAP = 10
    IB_AE_MKEY_TRAP = 11
    IB_AE_PORT_TRAP = 12
    IB_AE_SYSIMG_GUID_TRAP = 13
    IB_AE_BUF_OVERRUN = 14
    IB_AE_LINK_INTEGRITY = 15
    IB_AE_FLOW_CTRL_ERROR = 16
    IB_AE_BKEY_TRAP = 17
    IB_AE_QP_APM_ERROR = 18
    IB_AE_WQ_REQ_ERROR = 19
    IB_AE_WQ_ACCESS_ERROR = 20
    IB_AE_PORT_ACTIVE = 21
    IB_AE_PORT_DOWN = 22
    IB_AE_CLIENT_REREGISTER = 23
    IB_AE_SRQ_LIMIT_REACHED = 24
    IB_AE_SRQ_CATAS_ERROR = 25
    IB_AE_SRQ_QP_LAST_WQE_REACHED = 26
    IB_AE_RESET_DRIVER = 27
    IB_AE_RESET_CLIENT = 28
    IB_AE_RESET_END = 29
    IB_AE_RESET_FAILED = 30
    IB_AE_LID_CHANGE = 31
    IB_AE_PKEY_CHANGE = 32
    IB_AE_SM_CHANGE = 33
    IB_AE_GID_CHANGE = 34
    IB_AE_RESET_4_RMV = 35
    IB_AE_CQ_OVERFLOW = 36
    IB_AE_UNKNOWN = 37


A = ib_async_event_t
FROM_PORTABLE: dict[AsyncEventType, ib_async_event_t] = {
    AsyncEventType.CQ_ERR: A.IB_AE_CQ_ERROR,
    AsyncEventType.QP_FATAL: A.IB_AE_QP_FATAL,
    AsyncEventType.QP_REQ_ERR: A.IB_AE_WQ_REQ_ERROR,
    AsyncEventType.QP_ACCESS_ERR: A.IB_AE_WQ_ACCESS_ERROR,
    AsyncEventType.COMM_EST: A.IB_AE_QP_COMM,
    AsyncEventType.SQ_DRAINED: A.IB_AE_SQ_DRAINED,
    AsyncEventType.PATH_MIG: A.IB_AE_QP_APM,
    AsyncEventType.PATH_MIG_ERR: A.IB_AE_QP_APM_ERROR,
    AsyncEventType.DEVICE_FATAL: A.IB_AE_LOCAL_FATAL,
    AsyncEventType.PORT_ACTIVE: A.IB_AE_PORT_ACTIVE,
    AsyncEventType.PORT_ERR: A.IB_AE_PORT_DOWN,
    AsyncEventType.LID_CHANGE: A.IB_AE_LID_CHANGE,
    AsyncEventType.PKEY_CHANGE: A.IB_AE_PKEY_CHANGE,
    AsyncEventType.SM_CHANGE: A.IB_AE_SM_CHANGE,
    AsyncEventType.SRQ_ERR: A.IB_AE_SRQ_CATAS_ERROR,
    AsyncEventType.SRQ_LIMIT_REACHED: A.IB_AE_SRQ_LIMIT_REACHED,
    AsyncEventType.QP_LAST_WQE_REACHED: A.IB_AE_SRQ_QP_LAST_WQE_REACHED,
    AsyncEventType.CLIENT_REREGISTER: A.IB_AE_CLIENT_REREGISTER,
    AsyncEventType.GID_CHANGE: A.IB_AE_GID_CHANGE,
    AsyncEventType.WQ_FATAL: A.IB_AE_QP_FATAL,
}
"""The IBAL code for each portable (``ibv_event_type``) event."""


def code_for(event_type: AsyncEventType) -> ib_async_event_t:
    """The IBAL event code of a portable event (IB_AE_UNKNOWN if it has none)."""
    return FROM_PORTABLE.get(event_type, A.IB_AE_UNKNOWN)


@dataclass(frozen=True, slots=True)
class ib_async_event_rec_t:
    """``ib_async_event_rec_t``: what happened (``code``) to which object (``handle``).

    ``context`` is the context given when the object was created or opened;
    ``handle`` is the :class:`IbCa`, :class:`IbCq`, :class:`IbQp` or
    :class:`IbSrq` (IBAL's ``handle`` union); ``port_number`` is set for port
    events.
    """

    code: ib_async_event_t
    context: Any
    handle: Any
    port_number: int = 0
    vendor_specific: int = 0
