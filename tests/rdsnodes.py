"""Test helper: RDS nodes of this process on loopback addresses."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable

import pytest
import trio

from rdmashim.ulps.rds.node import TRANSPORTS, RdsNode, Transport
from rdmashim.ulps.rds.settings import RdsSettings

transports = pytest.mark.parametrize("transport", TRANSPORTS)
"""Run a test on both RDS transports (it takes a ``transport`` argument)."""


def free_port(*addresses: str) -> int:
    """A TCP port free on every one of ``addresses`` now (RDS nodes share one port: a
    port the kernel picks free on one address may be a connection's on another)."""
    for _ in range(100):
        with contextlib.ExitStack() as stack:
            first = stack.enter_context(socket.socket())
            first.bind((addresses[0], 0))
            port = int(first.getsockname()[1])
            try:
                for address in addresses[1:]:
                    stack.enter_context(socket.socket()).bind((address, port))
            except OSError:
                continue
            return port
    raise OSError(f"no port free on all of {addresses}")


async def nodes(
    addresses: list[str],
    transport: Transport = "rdma",
    settings: RdsSettings | None = None,
    port: int = 0,
) -> list[RdsNode]:
    """Start nodes on loopback addresses, all on ``port`` (0: one free on them all)."""
    out: list[RdsNode] = []
    port = port or free_port(*addresses)
    for address in addresses:
        node = RdsNode(address, port, transport=transport, settings=settings)
        await node.__aenter__()
        out.append(node)
    return out


async def close(all_nodes: list[RdsNode]) -> None:
    for node in reversed(all_nodes):
        await node.__aexit__(None, None, None)


async def wait_until(condition: Callable[[], object], seconds: float, what: str) -> None:
    """Poll ``condition`` (plain state, no event to wait on) until it holds; an
    AssertionError naming ``what`` after ``seconds``."""
    with trio.move_on_after(seconds):
        while not condition():  # noqa: ASYNC110 - conditions on plain state, not events
            await trio.sleep(0.005)
        return
    raise AssertionError(f"{what}: not within {seconds} s")
