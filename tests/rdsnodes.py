"""Test helper: RDS nodes of this process on loopback addresses."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import trio

from rdmashim.ulps.rds.node import TRANSPORTS, RdsNode, Transport
from rdmashim.ulps.rds.settings import RdsSettings

transports = pytest.mark.parametrize("transport", TRANSPORTS)
"""Run a test on both RDS transports (it takes a ``transport`` argument)."""


async def nodes(
    addresses: list[str], transport: Transport = "rdma", settings: RdsSettings | None = None
) -> list[RdsNode]:
    """Start nodes on loopback addresses, all on the first one's (free) port."""
    out: list[RdsNode] = []
    port = 0
    for address in addresses:
        node = RdsNode(address, port, transport=transport, settings=settings)
        await node.__aenter__()
        port = node.port
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
