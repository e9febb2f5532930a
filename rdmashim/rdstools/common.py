"""What the RDS tools share: their error, starting a node, picking a port, draining, answering.

See :mod:`rdmashim.rdstools` for the tools themselves.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import random
import socket
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import AsyncExitStack, asynccontextmanager

import trio

from rdmashim.ulps.rds.node import RdsError, RdsNode, RdsSocket, default_port
from rdmashim.ulps.rds.settings import RdsSettings, Transport

log = logging.getLogger(__name__)

EPHEMERAL = (32768, 60999)
"""Ports :func:`bind_any` picks from (Linux's default ``ip_local_port_range``)."""


class RdsToolError(Exception):
    """A tool could not do its job (no answer, a bad message, a bad option)."""


def guess_source(dest: str) -> str:
    """The local address the routing table picks for ``dest`` (as rds-ping does).

    For a loopback destination Linux answers 127.0.0.1; when that is ``dest``
    itself, a random 127.x.y.z is taken instead, since two nodes cannot share
    an address.
    """
    ip = ipaddress.ip_address(dest)
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((dest, 1))
        source: str = probe.getsockname()[0]
    if source == str(ip) and ip.is_loopback and ip.version == 4:
        rng = random.Random()
        while source == str(ip):
            source = f"127.{rng.randrange(1, 255)}.{rng.randrange(256)}.{rng.randrange(1, 255)}"
    return source


def bind_any(node: RdsNode, rng: random.Random | None = None) -> RdsSocket:
    """A socket on a free port of ``node`` (what binding to port 0 does in Linux)."""
    rng = rng or random.Random()
    for _ in range(1000):
        try:
            return node.bind(rng.randint(*EPHEMERAL))
        except RdsError:
            continue
    raise RdsToolError(f"no free RDS port on {node.address}")


@asynccontextmanager
async def open_node(
    address: str,
    cm_port: int | None = None,
    transport: Transport = "rdma",
    settings: RdsSettings | None = None,
) -> AsyncIterator[RdsNode]:
    """An :class:`RdsNode` on ``address`` (at Linux's port for the transport and address
    family when ``cm_port`` is None); a failure to start says what to check."""
    async with AsyncExitStack() as stack:
        try:
            node = await stack.enter_async_context(
                RdsNode(address, cm_port, transport=transport, settings=settings)
            )
        except OSError as exc:
            if cm_port is None:
                cm_port = default_port(ipaddress.ip_address(address), transport)
            raise node_error(exc, address, cm_port, transport) from exc
        yield node


def port_name(transport: Transport) -> str:
    """What a node's port is on ``transport``: "rdma_cm port" or "TCP port"."""
    return "rdma_cm port" if transport == "rdma" else "TCP port"


def node_error(
    exc: OSError, address: str, cm_port: int, transport: Transport = "rdma"
) -> RdsToolError:
    """Why a node did not start, with what to check."""
    hint = ""
    if exc.errno == errno.EADDRINUSE:
        hint = " (another RDS node on this address? each node needs its own address)"
    elif exc.errno == errno.EADDRNOTAVAIL:
        hint = " (not an address of this machine; any 127.x.y.z is, on Linux)"
    where = f"{address}, {port_name(transport)} {cm_port}"
    return RdsToolError(f"cannot start an RDS node on {where}: {exc}{hint}")


def busy(node: RdsNode) -> bool:
    """Whether some connection of ``node`` still holds unsent or unacknowledged messages."""
    return any(rds.unsent or rds.unacked for rds in node.connections())


async def drain(node: RdsNode, within: float = 3.0) -> bool:
    """Wait until the peers acknowledged everything ``node`` sent; False after ``within`` s."""
    with trio.move_on_after(within):
        while busy(node):  # noqa: ASYNC110 - RdsConnection has no event for "all acknowledged"
            await trio.sleep(0.01)
        return True
    return False


def busy_any(nodes: Iterable[RdsNode]) -> bool:
    """Whether some node of ``nodes`` is :func:`busy`."""
    return any(busy(node) for node in nodes)


async def serve_answers(
    node: RdsNode,
    port: int,
    answer: Callable[[bytes, tuple[str, int]], bytes | None],
    task_status: trio.TaskStatus[tuple[str, int]],
) -> None:
    """Bind ``port`` and send ``answer(data, sender)`` back for every message (None: nothing).

    What the echo and rds-info responders run.
    """
    sock = node.bind(port)
    task_status.started(sock.address)
    try:
        while True:
            data, sender = await sock.recvfrom()
            reply = answer(data, sender)
            if reply is None:
                continue
            try:
                await sock.sendto(reply, sender)
            except RdsError as exc:
                log.info("answer to %s:%d failed: %s", *sender, exc)
    finally:
        sock.close()
