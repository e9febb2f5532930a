"""The RDS tools' well-known ports and rds-info's tables.

Plain values, so the CLI builds its parser from them without importing the
RDS machinery; the tools use the same ones.
"""

from __future__ import annotations

from rdmashim.ulps.rds.settings import TRANSPORTS
from rdmashim.ulps.rds.wire import RDS_CM_PORT, RDS_MAX_MSG_SIZE, RDS_PORT

ECHO_PORT = 7
INFO_PORT = 10000
STRESS_PORT = 4000
INFO_TABLES = {
    "c": "statistic counters",
    "k": "sockets",
    "n": "connections",
    "r": "receive queue messages",
    "s": "send queue messages",
    "t": "retransmit queue messages",
    "T": "TCP sockets (RDS over TCP)",
}
"""rds-info's table letters that apply (all of them but the IB transport's)."""
ALL_TABLES = "".join(INFO_TABLES)
MIN_STRESS_BYTES = 16
"""The smallest rds-stress message: its header (``stress.STRESS_HEADER``)."""
DEMO_MIN_SIZE = 14
"""The smallest demo message: its stamp (``demo._STAMP``; the tests check both)."""

__all__ = [
    "ALL_TABLES",
    "DEMO_MIN_SIZE",
    "ECHO_PORT",
    "INFO_PORT",
    "INFO_TABLES",
    "MIN_STRESS_BYTES",
    "RDS_CM_PORT",
    "RDS_MAX_MSG_SIZE",
    "RDS_PORT",
    "STRESS_PORT",
    "TRANSPORTS",
]
