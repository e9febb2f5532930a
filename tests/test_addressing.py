"""Interface discovery through psutil: addresses, scopes, MAC, MTU and state.

The machine's own interfaces give the portable checks (loopback, wildcard,
mapped addresses, the routing table's source). A network namespace with a
veth interface of a chosen MAC, MTU and link-local address gives the exact
ones, and lets the test take the link down; there ``/sys/class/net`` (what
the code read before) serves as the independent witness.
"""

from __future__ import annotations

import ctypes
import ipaddress
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator

import pytest
import trio

from rdmashim.cm import addressing
from rdmashim.providers.softiwarp import engines

import netns

NS = f"{netns.PREFIX}{os.getpid()}-addr"
MAC = "02:00:5e:00:53:01"


def test_loopback_addresses_are_on_the_loopback_interface() -> None:
    entries = addressing.interfaces()
    names = {name for _, name in socket.if_nameindex()}
    assert {e.interface for e in entries} <= names
    v4 = [e for e in entries if e.address == ipaddress.ip_address("127.0.0.1")]
    assert len(v4) == 1 and v4[0].loopback and v4[0].up
    assert addressing.interface_of("127.0.0.1") == v4[0].interface
    assert addressing.interface_of("127.0.0.2") == v4[0].interface  # all of 127/8 is loopback
    assert addressing.interface_of("::ffff:127.0.0.1") == v4[0].interface
    assert all(e.scope_id == 0 for e in entries if not e.address.is_link_local)


@pytest.mark.parametrize("address", ["0.0.0.0", "::", "198.51.100.254", "2001:db8::fe"])
def test_addresses_no_interface_owns(address: str) -> None:
    owned = {e.address for e in addressing.interfaces()}
    assert ipaddress.ip_address(address) not in owned
    assert addressing.interface_of(address) is None


@pytest.mark.parametrize(
    ("destination", "family"), [("127.0.0.1", socket.AF_INET), ("::1", socket.AF_INET6)]
)
def test_route_source_of_loopback(destination: str, family: int) -> None:
    assert addressing.route_source(destination, family) == destination


@pytest.fixture(scope="module")
def dummy_ns() -> Iterator[str]:
    """A namespace with a veth pair d0-d1; d0 has a chosen MAC, MTU 9000, IPv4 and link-local."""
    reason = netns.unavailable()
    if reason is not None:
        pytest.skip(f"network namespace test: {reason}")
    netns.ip("netns", "add", NS)
    try:
        for args in (
            ["link", "add", "d0", "address", MAC, "mtu", "9000", "type", "veth", "peer", "d1"],
            ["link", "set", "d0", "addrgenmode", "none"],  # no link-local but ours
            ["addr", "add", "10.77.0.1/24", "dev", "d0"],
            ["addr", "add", "fe80::77:1/64", "dev", "d0", "nodad"],
            ["link", "set", "d1", "up"],
            ["link", "set", "d0", "up"],
            ["link", "set", "lo", "up"],
        ):
            netns.ip("-n", NS, *args)
        yield NS
    finally:
        netns.ip("netns", "del", NS, check=False)


PROBE = textwrap.dedent(
    """
    import json, socket, subprocess, trio
    from rdmashim.cm import addressing
    from rdmashim.providers.softiwarp import engines, provider

    async def port():
        async with engines.open_device("siw_d0") as ctx:
            p = ctx.query_port(1)
            return {"state": p.state.name, "mtu": p.active_mtu.name, "netdev": p.netdev}

    out = {
        "entries": [
            [e.interface, str(e.address), e.up, e.loopback, e.scope_id]
            for e in addressing.interfaces()
        ],
        "index": socket.if_nametoindex("d0"),
        "of": {a: addressing.interface_of(a) for a in (
            "10.77.0.1", "fe80::77:1", "fe80::77:1%d0", "fe80::77:1%lo",
            f"fe80::77:1%{socket.if_nametoindex('d0')}",
        )},
        "route": addressing.route_source("10.77.0.9", socket.AF_INET),
        "route6": addressing.route_source("fe80::77:9", socket.AF_INET6,
                                          socket.if_nametoindex("d0")),
        "guid": provider.Device("siw_d0", "d0").node_guid,
        "sysfs_mac": open("/sys/class/net/d0/address").read().strip(),
        "up": trio.run(port),
    }
    subprocess.run(["ip", "link", "set", "d0", "down"], check=True)
    out["down"] = trio.run(port)
    out["sysfs_down"] = open("/sys/class/net/d0/operstate").read().strip()
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def probed(dummy_ns: str) -> dict:
    proc = subprocess.run(
        ["ip", "netns", "exec", dummy_ns, sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.netns
def test_addresses_and_scope_of_a_veth_interface(probed: dict) -> None:
    index = probed["index"]
    assert sorted(tuple(e) for e in probed["entries"] if e[0] == "d0") == [
        ("d0", "10.77.0.1", True, False, 0),
        ("d0", "fe80::77:1", True, False, index),
    ]
    assert probed["of"] == {
        "10.77.0.1": "d0",
        "fe80::77:1": "d0",
        "fe80::77:1%d0": "d0",
        "fe80::77:1%lo": None,  # the scope names another interface
        f"fe80::77:1%{index}": "d0",
    }
    assert probed["route"] == "10.77.0.1"
    assert probed["route6"] == "fe80::77:1"


@pytest.mark.netns
def test_node_guid_from_the_mac(probed: dict) -> None:
    assert probed["sysfs_mac"] == MAC
    assert probed["guid"] == 0x02005E_FFFE_005301


@pytest.mark.netns
def test_port_mtu_and_state_follow_the_link(probed: dict) -> None:
    assert probed["up"] == {"state": "ACTIVE", "mtu": "MTU_4096", "netdev": "d0"}
    assert probed["sysfs_down"] == "down"
    assert probed["down"] == {"state": "DOWN", "mtu": "MTU_4096", "netdev": "d0"}


@pytest.mark.netns
def test_port_state_in_a_thread_that_entered_the_namespace(dummy_ns: str) -> None:
    """psutil lists /proc/net/dev's interfaces (the process's namespace) but asks the
    calling thread's; a thread that setns'd into a namespace still sees its port up."""
    netns.ip("-n", dummy_ns, "link", "set", "d0", "up")
    seen: dict[str, object] = {}

    async def port() -> str:
        async with engines.open_device("siw_d0") as ctx:
            return ctx.query_port(1).state.name

    def enter_and_query() -> None:
        try:
            fd = os.open(f"/run/netns/{dummy_ns}", os.O_RDONLY)
            try:
                if ctypes.CDLL(None, use_errno=True).setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
                    raise OSError(ctypes.get_errno(), "setns")
            finally:
                os.close(fd)
            seen["state"] = trio.run(port)
        except Exception as exc:
            seen["error"] = exc

    thread = threading.Thread(target=enter_and_query)
    thread.start()
    thread.join(60)
    assert seen == {"state": "ACTIVE"}, seen
