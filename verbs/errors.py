"""Errors raised by the verbs API."""

from __future__ import annotations

import errno as _errno
import operator
import os

from rdmashim.verbs.enums import Access, WCStatus


class VerbsError(OSError):
    """A verbs call failed. ``errno`` is the POSIX error number, ``operation`` the call.

    A ``post_send``/``post_recv`` that refuses a work request sets ``bad_wr`` to its
    index in the list posted (the requests before it stay posted), as libibverbs'
    ``bad_wr`` points at it.
    """

    bad_wr: int | None = None

    def __init__(self, err: int, operation: str, detail: str = "") -> None:
        message = f"{operation}: {os.strerror(err)}"
        if detail:
            message += f" ({detail})"
        super().__init__(err, message)
        self.operation = operation
        self.detail = detail

    def __str__(self) -> str:
        return f"[Errno {self.errno}] {self.strerror}"


def check_cq_target(operation: str, channel: object, handler: object) -> None:
    """A CQ reports to a completion channel or calls a handler, not both (EINVAL)."""
    if channel is not None and handler is not None:
        raise VerbsError(_errno.EINVAL, operation, "a CQ takes a channel or a handler")


def refused_wr(err: int, operation: str, index: int, detail: str) -> VerbsError:
    """The error of a post that refuses its work request ``index`` (its ``bad_wr``)."""
    exc = VerbsError(err, operation, f"work request {index}: {detail}")
    exc.bad_wr = index
    return exc


def integer(value: object) -> int | None:
    """``value`` as an int when it is an integer (any type with ``__index__``, as
    numpy's, but not a bool), else None: what a count, port or size may be."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def check_access(operation: str, access: int) -> Access:
    """``access`` as :class:`Access` flags, or EINVAL when it holds other bits (an
    IntFlag would take -1 as every right) or remote write without local write (as
    libibverbs)."""
    rights = int(access)
    if rights < 0 or rights & ~_ACCESS:
        raise VerbsError(
            _errno.EINVAL, operation, f"access {rights:#x} holds bits that are no Access"
        )
    if rights & _REMOTE_WRITES and not rights & Access.LOCAL_WRITE:
        raise VerbsError(_errno.EINVAL, operation, "remote write access needs LOCAL_WRITE")
    return access if isinstance(access, Access) else Access(rights)


_ACCESS = int(
    Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ | Access.REMOTE_ATOMIC
    | Access.MW_BIND
)  # fmt: skip
_REMOTE_WRITES = int(Access.REMOTE_WRITE | Access.REMOTE_ATOMIC)


class NotSupported(VerbsError):
    """The device or backend does not provide this feature."""

    def __init__(self, operation: str, detail: str = "") -> None:
        super().__init__(_errno.EOPNOTSUPP, operation, detail)


class BackendUnavailable(ImportError):
    """A backend cannot be used on this machine; the message says what is missing."""


class CompletionError(Exception):
    """A work completion carried an error status."""

    def __init__(self, wc: object, status: WCStatus) -> None:
        super().__init__(f"work request {getattr(wc, 'wr_id', '?')} completed with {status.name}")
        self.wc = wc
        self.status = status


class ProtocolViolation(Exception):
    """A connection broke its transport's protocol and ended (on iWARP: a Terminate).

    A QP's ``error`` is one of these when the peer sent a Terminate or this side
    found the peer's stream malformed; backends subclass it with the details
    (the built-in engine's carries the Terminate's layer/type/code).
    """
