"""Test helper: RDS nodes of this process on loopback addresses."""

from __future__ import annotations

from rdmashim.ulps.rds.node import RdsNode


async def nodes(addresses: list[str]) -> list[RdsNode]:
    """Start nodes on loopback addresses, all on the first one's (free) port."""
    out: list[RdsNode] = []
    port = 0
    for address in addresses:
        node = RdsNode(address, port)
        await node.__aenter__()
        port = node.port
        out.append(node)
    return out


async def close(all_nodes: list[RdsNode]) -> None:
    for node in reversed(all_nodes):
        await node.__aexit__(None, None, None)
