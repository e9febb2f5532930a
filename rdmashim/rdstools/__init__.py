"""The RDS tools: rds-ping, rds-stress, rds-info and a messaging demo over :mod:`rdmashim.ulps.rds`.

What ``rdmashim rds ...`` runs. Each tool lives in its own module; import from it directly:

- :mod:`~rdmashim.rdstools.ping`: :func:`~rdmashim.rdstools.ping.ping` and the
  pinged node's :func:`~rdmashim.rdstools.ping.serve_echo`;
- :mod:`~rdmashim.rdstools.stress`: :func:`~rdmashim.rdstools.stress.stress_active`
  and :func:`~rdmashim.rdstools.stress.stress_passive`, rds-stress's protocol and columns;
- :mod:`~rdmashim.rdstools.info`: :func:`~rdmashim.rdstools.info.format_info`,
  :func:`~rdmashim.rdstools.info.serve_info` and :func:`~rdmashim.rdstools.info.query_info`;
- :mod:`~rdmashim.rdstools.demo`: :func:`~rdmashim.rdstools.demo.run_rds_demo`;
- :mod:`~rdmashim.rdstools.common`: what they share (their error, opening a node,
  binding a port, draining, answering requests);
- :mod:`~rdmashim.rdstools.defaults`: the ports and tables as plain values;
- :mod:`~rdmashim.rdstools.cli` (the parser) and :mod:`~rdmashim.rdstools.commands`
  (the commands, which print; the library modules do not: results are returned,
  per-second figures and progress go to callbacks, and tables come back as text).

Ports (RDS ports, not TCP ports):

- ``ECHO_PORT`` (7, after the echo service of RFC 862): Linux answers RDS
  pings in the kernel, on port 0; our RDS has no such responder, so the pinged
  node runs ``serve_echo`` (``rdmashim rds ping --serve``), which sends every
  message back to where it came from.
- ``INFO_PORT`` (10000, after ``RDS_INFO_FIRST``): ``serve_info`` answers
  rds-info queries (``query_info``) with ``format_info``'s tables of the node
  it serves. A node lives inside the process that runs it, so ``rdmashim rds
  info`` asks a running node over RDS; the query's own connection shows up in
  the answer.
- ``STRESS_PORT`` (4000, rds-stress's default): the passive side of
  ``stress_active`` / ``stress_passive`` listens there; active task ``i`` binds
  ``port + 1 + i``, as rds-stress's children do.

Every tool needs its own node, and a node needs its own IP address (nodes of
several processes cannot share one): on Linux any 127.x.y.z is loopback.
The tools use the portable API and :mod:`rdmashim.ulps.rds` only, never a
backend's internals.
"""
