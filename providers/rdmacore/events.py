"""Which of libibverbs' asynchronous events name a port and which leave a QP in error."""

from __future__ import annotations

from rdmashim.verbs.events import AsyncEventType

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
