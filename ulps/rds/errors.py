"""The error an RDS socket or node operation raises: an OSError naming the problem.

(A peer breaking the protocol is :class:`~rdmashim.ulps.rds.wire.RdsProtocolError`.)
"""

from __future__ import annotations


class RdsError(OSError):
    """An RDS operation failed; ``errno`` says how."""
