"""rdma_cm across three hosts made of network namespaces and veth pairs.

The network is described in ``netns.py``: hosts a, b and c on a bridged LAN
(10.201.0.0/24, fd00:201::/64), b and c also on a direct link (10.202.0.0/24,
fd00:202::/64, link-local fe80::202:x), a and c on a spare link (10.209.0.0/24).
Each host's side runs as an agent process inside its namespace
(``netns_agent.py``); the tests start the agents, read their JSON results and
judge them here. Only the test subnets are ever addressed.
"""

from __future__ import annotations

import errno
import ipaddress
import time
from typing import Any

import pytest
import trio

import netns

pytestmark = pytest.mark.netns

DONE = ["DISCONNECTED", "TIMEWAIT_EXIT"]
"""What each side of a connection sees after either side disconnects, in order."""


def host_of(sockaddr: list[Any]) -> str:
    """The address part of a socket address: no ``%scope``, IPv4-mapped shown as IPv4."""
    ip = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    return str(ip)


def kinds(events: list[dict[str, Any]]) -> list[str]:
    return [e["event"] for e in events]


async def connect_through(
    net: netns.Network,
    client: str,
    server: str,
    dst: str,
    *,
    bind: str = "0.0.0.0",
    disconnect: str = "client",
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Listen on ``server``, connect from ``client`` to ``dst`` and exchange data; both results."""
    with trio.fail_after(60):
        async with await net.hosts[server].start(
            "serve", bind=bind, private_data=f"welcome from {server}",
            disconnect=disconnect == "server",
        ) as listener:  # fmt: skip
            port = (await listener.message())["port"]
            active = await net.hosts[client].run(
                "connect", dst=[dst, port], name=client, private_data=f"{client} calling",
                disconnect=disconnect == "client",
            )  # fmt: skip
            await listener.release()
            passive = await listener.result()
    return active, passive


def assert_connected(
    active: dict[str, Any], passive: dict[str, Any], client: str, server: str
) -> None:
    """Established both ways, the data moved intact, and both sides saw the end."""
    assert active["connect"]["event"] == "ESTABLISHED", active
    assert passive["request"]["event"] == "CONNECT_REQUEST", passive
    assert passive["established"]["event"] == "ESTABLISHED", passive
    # Private data both ways: the request's, and the accept's after the MR info.
    assert bytes.fromhex(passive["request"]["private_data"]) == f"{client} calling".encode()
    accepted = bytes.fromhex(active["connect"]["private_data"])
    assert accepted.endswith(f"welcome from {server}".encode())
    # Each side's address is the other's peer.
    assert host_of(active["local_addr"]) == host_of(passive["peer_addr"])
    assert host_of(active["peer_addr"]) == host_of(passive["local_addr"])
    assert active["local_addr"][1] == passive["peer_addr"][1]
    assert active["peer_addr"][1] == passive["local_addr"][1]
    # Send, RDMA Write and RDMA Read: the Read returns what the Write put in the peer.
    assert active["opcodes"] == ["SEND", "RDMA_WRITE", "RDMA_READ"]
    assert passive["received"] == [f"hello from {client}", "done"]
    assert active["read_sha256"] == active["written_sha256"] == passive["block_sha256"]
    # The disconnect reached both hosts, promptly.
    assert kinds(active["after"]) == DONE, active["after"]
    assert kinds(passive["after"]) == DONE, passive["after"]
    assert all(e["elapsed"] < 5 for e in active["after"] + passive["after"])


# ---------------------------------------------------------------------- resolution
@pytest.mark.parametrize(
    ("host", "dst", "device", "source"),
    [
        ("b", "10.201.0.3", "siw_vb0", "10.201.0.2"),
        ("b", "10.202.0.3", "siw_vb1", "10.202.0.2"),
        ("b", "fd00:201::3", "siw_vb0", "fd00:201::2"),
        ("b", "fd00:202::3", "siw_vb1", "fd00:202::2"),
        ("b", "fe80::202:3%vb1", "siw_vb1", "fe80::202:2"),
        ("c", "10.202.0.2", "siw_vc1", "10.202.0.3"),
        ("c", "10.201.0.1", "siw_vc0", "10.201.0.3"),
        ("a", "10.201.0.2", "siw_va0", "10.201.0.1"),
    ],
)
async def test_resolve_picks_the_interface_the_route_uses(
    net: netns.Network, host: str, dst: str, device: str, source: str
) -> None:
    result = await net.hosts[host].run("resolve", dst=[dst, 4791])
    assert result["addr"]["event"] == "ADDR_RESOLVED", result
    assert result["route"]["event"] == "ROUTE_RESOLVED", result
    assert result["device"] == device
    assert host_of(result["local_addr"]) == source
    assert host_of(result["peer_addr"]) == host_of([dst]) and result["peer_addr"][1] == 4791


@pytest.mark.parametrize("dst", ["10.250.0.1", "fd00:250::1"])
async def test_addr_error_when_no_route(net: netns.Network, dst: str) -> None:
    result = await net.a.run("resolve", dst=[dst, 4791])
    assert result["addr"]["event"] == "ADDR_ERROR", result
    assert result["addr"]["status"] == -errno.ENETUNREACH


async def test_route_error_when_the_interface_goes_down(net: netns.Network) -> None:
    try:
        result = await net.a.run("route_error", dst=["10.209.0.3", 4791], ifname="va9")
    finally:
        net.a.ip("link", "set", "va9", "up")
    assert result["addr"]["event"] == "ADDR_RESOLVED", result
    assert result["device"] == "siw_va9"
    assert result["operstate"] == "down"  # the namespace's own sysfs
    assert result["route"]["event"] == "ROUTE_ERROR", result
    assert result["route"]["status"] == -errno.ENETDOWN


# ---------------------------------------------------------------------- connections
@pytest.mark.parametrize(
    ("client", "server", "dst", "bind", "devices"),
    [
        ("a", "b", "10.201.0.2", "0.0.0.0", ("siw_va0", "siw_vb0")),
        ("b", "c", "10.201.0.3", "0.0.0.0", ("siw_vb0", "siw_vc0")),
        ("c", "a", "10.201.0.1", "0.0.0.0", ("siw_vc0", "siw_va0")),
        ("b", "c", "10.202.0.3", "0.0.0.0", ("siw_vb1", "siw_vc1")),
        ("a", "b", "fd00:201::2", "::", ("siw_va0", "siw_vb0")),
        ("c", "b", "fd00:202::2", "::", ("siw_vc1", "siw_vb1")),
        ("b", "c", "fe80::202:3%vb1", "::", ("siw_vb1", "siw_vc1")),
        ("a", "b", "10.201.0.2", "::", ("siw_va0", "siw_vb0")),
    ],
    ids=[
        "a-b", "b-c", "c-a", "b-c-direct", "a-b-ipv6", "c-b-ipv6-direct",
        "b-c-ipv6-link-local", "a-b-ipv4-to-dual-stack-listener",
    ],
)  # fmt: skip
async def test_connection_across_hosts(
    net: netns.Network, client: str, server: str, dst: str, bind: str, devices: tuple[str, str]
) -> None:
    active, passive = await connect_through(net, client, server, dst, bind=bind)
    assert active.get("device") == devices[0], active
    assert passive.get("device") == devices[1], passive
    assert_connected(active, passive, client, server)


@pytest.mark.parametrize("who", ["client", "server"])
async def test_disconnected_on_both_hosts(net: netns.Network, who: str) -> None:
    active, passive = await connect_through(net, "a", "c", "10.201.0.3", disconnect=who)
    assert_connected(active, passive, "a", "c")
    by_peer = active if who == "server" else passive
    assert by_peer["after"][0]["detail"] == "connection closed by peer"


async def test_listener_bound_to_one_address_takes_only_that_address(
    net: netns.Network,
) -> None:
    with trio.fail_after(60):
        async with await net.c.start("serve", bind="10.202.0.3") as listener:
            port = (await listener.message())["port"]
            elsewhere = await net.b.run("connect", dst=["10.201.0.3", port], name="b")
            active = await net.b.run("connect", dst=["10.202.0.3", port], name="b")
            await listener.release()
            passive = await listener.result()
    assert elsewhere["connect"]["event"] == "REJECTED", elsewhere
    assert elsewhere["connect"]["status"] == -errno.ECONNREFUSED
    assert (active["device"], passive["device"]) == ("siw_vb1", "siw_vc1")
    assert active["connect"]["event"] == "ESTABLISHED", active
    assert passive["received"] == ["hello from b", "done"]


# ---------------------------------------------------------------------- failures
@pytest.mark.parametrize(
    ("dst", "connect_timeout", "status", "within"),
    [
        ("10.201.0.99", 1.5, -errno.ETIMEDOUT, (1.4, 3)),  # connect_timeout ends it
        ("10.201.0.98", 8, -errno.EHOSTUNREACH, (0, 7)),  # the kernel gives up on ARP
        ("fd00:201::99", 8, -errno.EHOSTUNREACH, (0, 7)),  # ... or on neighbour discovery
    ],
    ids=["timeout", "arp-fails", "nd-fails"],
)
async def test_unreachable_host(
    net: netns.Network,
    dst: str,
    connect_timeout: float,
    status: int,
    within: tuple[float, float],
) -> None:
    start = time.monotonic()
    result = await net.a.run("connect", dst=[dst, 4791], name="a", connect_timeout=connect_timeout)
    assert time.monotonic() - start < 15
    assert result["route"]["event"] == "ROUTE_RESOLVED", result
    assert result["connect"]["event"] == "UNREACHABLE", result
    assert result["connect"]["status"] == status
    low, high = within
    assert low <= result["connect"]["elapsed"] < high


@pytest.mark.parametrize("dst", ["10.201.0.2", "fd00:201::2"])
async def test_closed_port_is_rejected(net: netns.Network, dst: str) -> None:
    result = await net.a.run("connect", dst=[dst, 9], name="a")  # nothing listens on b
    assert result["connect"]["event"] == "REJECTED", result
    assert result["connect"]["status"] == -errno.ECONNREFUSED
    assert result["connect"]["elapsed"] < 2


async def test_rejected_request_carries_the_peers_private_data(net: netns.Network) -> None:
    with trio.fail_after(60):
        async with await net.b.start(
            "serve", action="reject", private_data="busy, try c"
        ) as listener:
            port = (await listener.message())["port"]
            active = await net.a.run(
                "connect", dst=["10.201.0.2", port], name="a", private_data="let me in"
            )
            await listener.release()
            passive = await listener.result()
    assert passive["request"]["event"] == "CONNECT_REQUEST", passive
    assert bytes.fromhex(passive["request"]["private_data"]) == b"let me in"
    assert host_of(passive["peer_addr"]) == "10.201.0.1" and passive["device"] == "siw_vb0"
    assert active["connect"]["event"] == "REJECTED", active
    assert bytes.fromhex(active["connect"]["private_data"]) == b"busy, try c"
    assert active["connect"]["status"] == -errno.ECONNRESET
    assert active["connect"]["elapsed"] < 5
