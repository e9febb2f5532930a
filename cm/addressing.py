"""Local interfaces and routes: which interface (and so which device) reaches an address.

``interfaces()`` lists the machine's IP addresses per interface through psutil,
which asks each operating system its own way (``getifaddrs`` on Linux, macOS
and the BSDs, ``GetAdaptersAddresses`` on Windows); ``route_source()`` asks the
operating system's routing table which local address it would use to reach a
destination (a connected UDP socket sends nothing; this works the same on every
platform); ``resolve()`` turns a host name or literal into socket addresses
without blocking the trio loop.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from typing import Any

import psutil
import trio

SockAddr = tuple[Any, ...]
"""A socket address as the socket module gives it: (host, port), or for IPv6
(host, port, flowinfo, scope_id)."""


def host_port(host: str, port: int) -> str:
    """``host:port`` as a person writes it, an IPv6 address in brackets (``[::1]:7471``)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True, slots=True)
class InterfaceAddress:
    """One IP address of a local interface.

    ``scope_id`` is the interface index for an IPv6 link-local address (what a
    socket address's fourth field holds), else 0.
    """

    interface: str
    address: ipaddress.IPv4Address | ipaddress.IPv6Address
    up: bool
    loopback: bool
    scope_id: int = 0


def _index_of(name: str) -> int:
    try:
        return socket.if_nametoindex(name)
    except OSError:
        return 0


def interfaces() -> list[InterfaceAddress]:
    """Every IPv4 and IPv6 address of every local interface."""
    stats = psutil.net_if_stats()
    out = []
    for name, entries in psutil.net_if_addrs().items():
        ips = [
            ipaddress.ip_address(entry.address.split("%", 1)[0])
            for entry in entries
            if entry.family in (socket.AF_INET, socket.AF_INET6)
        ]
        link = stats.get(name)
        flags = link.flags.split(",") if link is not None else []
        # Windows reports no flags: there the loopback interface is the one with loopback IPs.
        loopback = "loopback" in flags or any(ip.is_loopback for ip in ips)
        for ip in ips:
            link_local = ip.version == 6 and ip.is_link_local
            out.append(
                InterfaceAddress(
                    name,
                    ip,
                    up=link is not None and link.isup,
                    loopback=loopback,
                    scope_id=_index_of(name) if link_local else 0,
                )
            )
    return out


def interface_of(address: str) -> str | None:
    """The local interface that owns ``address``; None if no interface has it.

    A wildcard address (``0.0.0.0``, ``::``) has no interface; an IPv4-mapped
    IPv6 address (``::ffff:10.0.0.1``) is the IPv4 address's. A scope
    (``fe80::1%eth0`` or ``fe80::1%2``) limits the search to that interface.
    """
    host, _, scope = address.partition("%")
    ip = ipaddress.ip_address(host)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # an IPv4 peer of a dual-stack socket: ::ffff:a.b.c.d
    if ip.is_unspecified:
        return None
    local = interfaces()
    for entry in local:
        if entry.address == ip and scope in ("", entry.interface, str(entry.scope_id)):
            return entry.interface
    if ip.is_loopback:
        return next((e.interface for e in local if e.loopback), None)
    return None


def route_source(destination: str, family: int, scope_id: int = 0) -> str:
    """The local address the routing table picks to reach ``destination``.

    ``scope_id`` is the interface index of an IPv6 link-local destination.
    Connecting a UDP socket consults the routing table and sends nothing, on
    Linux, macOS, the BSDs and Windows alike, so no platform needs its own
    route query (netlink, ``PF_ROUTE``, ``GetBestRoute2``). Raises OSError
    (ENETUNREACH, EHOSTUNREACH, ...) when there is no route.
    """
    target = (destination, 9) if family == socket.AF_INET else (destination, 9, 0, scope_id)
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(target)
        source: str = probe.getsockname()[0]
    return source


async def resolve(host: str | None, port: int, *, passive: bool = False) -> list[SockAddr]:
    """Socket addresses for a host name or literal (IPv4 and IPv6), in resolver order."""
    flags = socket.AI_PASSIVE if passive and host is None else 0
    infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=flags)
    seen: list[SockAddr] = []
    for *_, sockaddr in infos:
        if sockaddr not in seen:
            seen.append(sockaddr)
    return seen


def tcp_port_probe(
    host: str, port: int = 0, scope_id: int = 0, *, reuse: bool = False
) -> tuple[Any, ...]:
    """Bind a TCP socket to ``host:port`` and close it: the address it got (port 0:
    a free one the kernel picked). Without ``reuse`` (SO_REUSEADDR) no socket holds
    that port on ``host``, not even one in TIME_WAIT. Raises the bind's OSError."""
    six = ":" in host
    with socket.socket(socket.AF_INET6 if six else socket.AF_INET, socket.SOCK_STREAM) as probe:
        if reuse:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port, 0, scope_id) if six else (host, port))
        got = int(probe.getsockname()[1])
    return (host, got, 0, scope_id) if six else (host, got)
