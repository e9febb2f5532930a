"""The RDS tools' library side: rds-ping, rds-stress, rds-info and a messaging demo.

One name for the tools of :mod:`rdmashim.rds_ping`, :mod:`rdmashim.rds_info`,
:mod:`rdmashim.rds_stress` and :mod:`rdmashim.rds_demo` (and what they share,
:mod:`rdmashim.rds_common`).

What ``rdmashim rds ...`` runs, over :mod:`rdmashim.ulps.rds` (see the CLI for
the flags). Nothing here prints: results are returned, per-second figures and
progress go to callbacks, and tables come back as text.

Ports (RDS ports, not TCP ports):

- :data:`ECHO_PORT` (7, after the echo service of RFC 862): Linux answers RDS
  pings in the kernel, on port 0; our RDS has no such responder, so the pinged
  node runs :func:`serve_echo` (``rdmashim rds ping --serve``), which sends
  every message back to where it came from.
- :data:`INFO_PORT` (10000, after ``RDS_INFO_FIRST``): :func:`serve_info`
  answers rds-info queries (:func:`query_info`) with :func:`format_info`'s
  tables of the node it serves. A node lives inside the process that runs it,
  so ``rdmashim rds info`` asks a running node over RDS; the query's own
  connection shows up in the answer.
- :data:`STRESS_PORT` (4000, rds-stress's default): the passive side of
  :func:`stress_active` / :func:`stress_passive` listens there; active task
  ``i`` binds ``port + 1 + i``, as rds-stress's children do.

Every tool needs its own node, and a node needs its own IP address (nodes of
several processes cannot share one): on Linux any 127.x.y.z is loopback.
"""

from __future__ import annotations

from rdmashim.rds_common import (
    EPHEMERAL,
    RdsToolError,
    bind_any,
    busy,
    busy_any,
    drain,
    guess_source,
    open_node,
    serve_answers,
)
from rdmashim.rds_defaults import (
    DEMO_MIN_SIZE,
    ECHO_PORT,
    INFO_PORT,
    INFO_TABLES,
    MIN_STRESS_BYTES,
    RDS_CM_PORT,
    STRESS_PORT,
)
from rdmashim.rds_demo import (
    DEMO_PORT,
    DEMO_WINDOW,
    DemoCut,
    DemoProgress,
    DemoResult,
    run_rds_demo,
)
from rdmashim.rds_info import format_info, query_info, serve_info
from rdmashim.rds_ping import (
    PING_SOCKETS,
    PING_WAIT,
    PingReply,
    PingStats,
    format_ping_reply,
    ping,
    serve_echo,
)
from rdmashim.rds_stress import (
    ACK_TIMEOUT,
    FLAG_RDMA_READ,
    FLAG_RDMA_WRITE,
    OP_ACK,
    OP_DONE,
    OP_DONE_ACK,
    OP_REQ,
    STRESS_COLUMNS,
    STRESS_HEADER,
    STRESS_MAGIC,
    STRESS_RDMA,
    PassiveResult,
    StressConfig,
    StressResult,
    StressSample,
    format_stress_row,
    stress_active,
    stress_passive,
)

__all__ = [
    "ACK_TIMEOUT",
    "DEMO_MIN_SIZE",
    "DEMO_PORT",
    "DEMO_WINDOW",
    "ECHO_PORT",
    "EPHEMERAL",
    "FLAG_RDMA_READ",
    "FLAG_RDMA_WRITE",
    "INFO_PORT",
    "INFO_TABLES",
    "MIN_STRESS_BYTES",
    "OP_ACK",
    "OP_DONE",
    "OP_DONE_ACK",
    "OP_REQ",
    "PING_SOCKETS",
    "PING_WAIT",
    "RDS_CM_PORT",
    "STRESS_COLUMNS",
    "STRESS_HEADER",
    "STRESS_MAGIC",
    "STRESS_PORT",
    "STRESS_RDMA",
    "DemoCut",
    "DemoProgress",
    "DemoResult",
    "PassiveResult",
    "PingReply",
    "PingStats",
    "RdsToolError",
    "StressConfig",
    "StressResult",
    "StressSample",
    "bind_any",
    "busy",
    "busy_any",
    "drain",
    "format_info",
    "format_ping_reply",
    "format_stress_row",
    "guess_source",
    "open_node",
    "ping",
    "query_info",
    "run_rds_demo",
    "serve_answers",
    "serve_echo",
    "serve_info",
    "stress_active",
    "stress_passive",
]
