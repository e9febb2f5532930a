"""RDS across hosts made of network namespaces: every node sends to every other, all at once.

The hosts are ``netns.py``'s three (a, b and c on a bridged LAN, 10.201.0.0/24
and fd00:201::/64). One RDS node runs in each, as an agent process
(``rds_agent.py mesh``) on the standard RDS port, with two sockets, over RDMA
or over TCP. Once
every node listens, each sends ``COUNT`` messages from each of its sockets to
each socket of each other node, interleaved so that every pair is in flight at
once, while receiving. Each node checks every payload against its stamp
(content and length) and reports the sequence numbers it got per (sender
socket, receiving socket) pair; the test wants exactly 0..COUNT-1, in order,
from every pair, and one connection per pair of nodes.
"""

from __future__ import annotations

import ipaddress
from typing import Any

import pytest
import rds_agent
import trio

from rdmashim.ulps.rds.settings import Transport
from rdmashim.ulps.rds.wire import RDS_CM_PORT

import netns
from rdsnodes import transports

pytestmark = pytest.mark.netns

COUNT = 1000
"""Messages from each socket to each socket of every other node."""
PORTS = [4000, 4001]


def lan_address(host: netns.Host, version: int) -> str:
    """The host's address on the LAN, of the given IP version."""
    for address in host.interfaces[netns.LAN_PORTS[host.name]]:
        ip = ipaddress.ip_interface(address).ip
        if ip.version == version:
            return str(ip)
    raise LookupError(f"host {host.name} has no IPv{version} LAN address")


@transports
@pytest.mark.parametrize("version", [4, 6], ids=["ipv4", "ipv6"])
async def test_all_to_all_between_namespaces_content_and_order(
    net: netns.Network, version: int, transport: Transport
) -> None:
    hosts = list(net.hosts.values())
    addresses = {host.name: lan_address(host, version) for host in hosts}
    results: dict[str, dict[str, Any]] = {}
    agents: list[netns.Agent] = []
    try:
        with trio.fail_after(90):
            for host in hosts:
                me = addresses[host.name]
                peers = [a for name, a in addresses.items() if name != host.name]
                argv = rds_agent.argv(
                    "mesh", netns=host.netns, address=me, port=RDS_CM_PORT, ports=PORTS,
                    peers=peers, count=COUNT, transport=transport,
                )  # fmt: skip
                agents.append(await netns.Agent.start(f"mesh@{host.name}", argv))
            # Every node listens before any sends: a node gives up on a peer that
            # refuses it a few times in a row, and a Python start takes longer.
            for agent in agents:
                assert (await agent.message())["up"] == RDS_CM_PORT
            for agent in agents:
                assert agent.process.stdin is not None
                await agent.process.stdin.send_all(b"go\n")
            for host, agent in zip(hosts, agents, strict=True):
                results[host.name] = await agent.result(seconds=60)
    finally:
        for agent in agents:  # let them all go at once: each takes a while to close
            await agent.release()
        for agent in agents:
            await agent.aclose()
    print(
        f"IPv{version} all-to-all over {transport}:",
        {h: (round(r["seconds"], 2), {p: c["sessions"] for p, c in r["counters"].items()})
         for h, r in results.items()},
    )  # fmt: skip

    for host in hosts:
        result = results[host.name]
        others = [addresses[h.name] for h in hosts if h is not host]
        expected = {f"{ip}:{s}>{d}" for ip in others for s in PORTS for d in PORTS}
        assert set(result["got"]) == expected, (host.name, sorted(result["got"]))
        for pair, seqs in sorted(result["got"].items()):
            assert seqs == list(range(COUNT)), f"{host.name} from {pair}: {describe(seqs)}"
            assert result["bad"][pair] == 0, f"{host.name} from {pair}: damaged payloads"
        # One connection to each other node, whichever side spoke first.
        assert sorted(result["counters"]) == sorted(others), result["counters"]
        # Over TCP each node also gets the peer's handshake probe and the answer to its own.
        handshake = 2 if transport == "tcp" else 0
        for peer, counters in result["counters"].items():
            assert counters["recv_messages"] == COUNT * len(PORTS) ** 2 + handshake, (
                peer,
                counters,
            )
            assert counters["send_messages"] >= COUNT * len(PORTS) ** 2, (peer, counters)
            assert counters["retransmits"] == counters["recv_drop_old_seq"] == 0, counters
            assert counters["peer_restarts"] == counters["recv_seq_gaps"] == 0, counters
            assert counters["sessions"] == 1, (peer, counters)  # no collision, no churn


def describe(seqs: list[int]) -> str:
    """What is wrong with a received sequence (expected 0..COUNT-1)."""
    missing = sorted(set(range(COUNT)) - set(seqs))[:5]
    first = next((i for i, s in enumerate(seqs) if s != i), None)
    return f"{len(seqs)} received, missing {missing}, first out of place at index {first}"
