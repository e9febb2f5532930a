"""RDS: reliable, ordered datagrams between (IP, port) endpoints.

All sockets of two nodes share one RC connection (or one TCP connection with
``transport="tcp"``)::

    from rdmashim.ulps.rds import RdsNode

    async with RdsNode("10.0.0.1") as node:
        sock = node.bind(4000)
        await sock.sendto(b"hello", ("10.0.0.2", 4000))
        data, (ip, port) = await sock.recvfrom()

``docs/rds.md`` describes the nodes, the wire, flow control and RDMA by cookie, and
how the modules divide the work (the sans-IO connection state, the transport table).
"""

from rdmashim.ulps.rds.cookie import RdmaStatus, cookie_offset, cookie_rkey, make_cookie
from rdmashim.ulps.rds.errors import RdsError
from rdmashim.ulps.rds.inbox import ReceivedMessage
from rdmashim.ulps.rds.node import RdsNode, default_port
from rdmashim.ulps.rds.rdma import RdmaOp
from rdmashim.ulps.rds.settings import RdsSettings
from rdmashim.ulps.rds.sockets import RdsSocket
from rdmashim.ulps.rds.wire import (
    RDS_CM_PORT,
    RDS_MAX_MSG_SIZE,
    RDS_PORT,
    RDS_TCP_PORT,
    RdsProtocolError,
)

__all__ = [
    "RDS_CM_PORT",
    "RDS_MAX_MSG_SIZE",
    "RDS_PORT",
    "RDS_TCP_PORT",
    "RdmaOp",
    "RdmaStatus",
    "RdsError",
    "RdsNode",
    "RdsProtocolError",
    "RdsSettings",
    "RdsSocket",
    "ReceivedMessage",
    "cookie_offset",
    "cookie_rkey",
    "default_port",
    "make_cookie",
]
