"""RDMA by cookie's plain values: a cookie's parts and how an operation ended.

No I/O and no verbs: the sans-IO connection (:mod:`.connection`) settles an
operation with an :class:`RdmaStatus` without knowing how it ran, and
:mod:`.rdma` builds the operations and registrations on the portable verbs.
"""

from __future__ import annotations

from enum import IntEnum


class RdmaStatus(IntEnum):
    """How an RDMA operation ended (``RDS_RDMA_*`` in Linux's uapi ``rds.h``)."""

    SUCCESS = 0
    REMOTE_ERROR = 1
    """The peer refused the access: unknown cookie, out of bounds, no right."""
    CANCELED = 2
    """The node closed before the operation ran."""
    DROPPED = 3
    """The connection broke before the peer confirmed the operation."""
    OTHER_ERROR = 4


def make_cookie(rkey: int, offset: int = 0) -> int:
    """R_Key and offset into one cookie (``rds_rdma_make_cookie``)."""
    return (rkey & 0xFFFFFFFF) | (offset << 32)


def cookie_rkey(cookie: int) -> int:
    """The R_Key of a cookie."""
    return cookie & 0xFFFFFFFF


def cookie_offset(cookie: int) -> int:
    """The offset of a cookie: where its region starts in the peer's address space."""
    return cookie >> 32
