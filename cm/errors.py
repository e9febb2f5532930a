"""The errors of ``open_connection`` and ``serve``, in the user's words.

A failed connection setup arrives as a CM event (REJECTED, UNREACHABLE,
ADDR_ERROR, ...) with a status and, from some backends, a detail.
:func:`setup_error` turns one into the :class:`CMError` to raise, whose text
names the host and port and what happened (``connect to 127.0.0.1:41577
refused: nothing listening``, ``cannot resolve host 'x': Name or service not
known``); the errno and the event stay on the exception.
"""

from __future__ import annotations

import errno

from rdmashim.cm.addressing import host_port
from rdmashim.cm.types import CMEvent, CMEventType

E = CMEventType


class CMError(ConnectionError):
    """Connection setup failed. ``str()`` says where and what happened; ``errno`` is
    the event's status as a positive errno, ``event`` the CM event that said so."""

    def __init__(self, event: CMEvent, message: str) -> None:
        super().__init__(-event.status if event.status < 0 else errno.EIO, message)
        self.event = event

    def __str__(self) -> str:
        return str(self.strerror)


class ConnectionRejected(CMError):
    """The peer rejected the connection (``private_data`` is its answer), or nothing
    listens on the port (``errno`` is ECONNREFUSED then)."""

    @property
    def private_data(self) -> bytes:
        """What the peer said when it rejected."""
        return self.event.private_data


class ConnectionUnreachable(CMError):
    """The peer's host did not answer in time, or there is no route to it."""


_KINDS: dict[CMEventType, type[CMError]] = {
    E.REJECTED: ConnectionRejected,
    E.UNREACHABLE: ConnectionUnreachable,
}


def setup_error(event: CMEvent, host: str, port: int, *, passive: bool = False) -> CMError:
    """The error to raise for ``event``, which ended connecting to ``host``:``port``
    (``passive``: accepting the connection from there)."""
    where = host_port(host, port)
    doing = f"accepting the connection from {where}" if passive else f"connect to {where}"
    return _KINDS.get(event.event, CMError)(event, _message(event, host, doing))


def _why(event: CMEvent) -> str:
    return event.reason or "no reason given"


def _message(event: CMEvent, host: str, doing: str) -> str:
    status = -event.status
    match event.event:
        case E.ADDR_ERROR if status in (errno.EADDRNOTAVAIL, errno.ETIMEDOUT):
            return f"cannot resolve host {host!r}: {_why(event)}"
        case E.ADDR_ERROR | E.ROUTE_ERROR:
            return f"no route to host {host!r}: {_why(event)}"
        case E.REJECTED if status == errno.ECONNREFUSED:
            return f"{doing} refused: nothing listening"
        case E.REJECTED:
            said = event.private_data
            answer = f", which said {said!r}" if said else " (no private data)"
            return f"{doing} rejected by the peer{answer}"
        case E.UNREACHABLE if status == errno.ETIMEDOUT:
            return f"{doing} timed out: {_why(event)}"
        case E.UNREACHABLE:
            return f"{doing} failed: host unreachable ({_why(event)})"
        case E.DISCONNECTED:
            return f"{doing} failed: the connection ended during setup"
        case E.DEVICE_REMOVAL:
            return f"{doing} failed: the device was closed"
        case _:
            return f"{doing} failed: {_why(event)}"


__all__ = ["CMError", "ConnectionRejected", "ConnectionUnreachable", "setup_error"]
