"""What every RDS transport has in common: how a session ends.

Filled in by :mod:`.rdma_transport` and :mod:`.tcp_transport`.
"""

from __future__ import annotations


class SessionLost(Exception):
    """The connection under a session (an RC queue pair, a TCP connection) broke."""
