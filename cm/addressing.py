"""Local interfaces and routes: which interface (and so which device) reaches an address.

``interfaces()`` lists the machine's IP addresses per interface (``getifaddrs``
through cffi, no compiler needed); ``route_source()`` asks the kernel's routing
table which local address it would use to reach a destination (a connected UDP
socket sends nothing); ``resolve()`` turns a host name or literal into socket
addresses without blocking the trio loop.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass

import cffi
import trio

_ffi = cffi.FFI()
_ffi.cdef(
    """
    struct sockaddr { unsigned short sa_family; char sa_data[14]; };
    struct ifaddrs {
        struct ifaddrs *ifa_next; char *ifa_name; unsigned int ifa_flags;
        struct sockaddr *ifa_addr; struct sockaddr *ifa_netmask;
        void *ifa_ifu; void *ifa_data;
    };
    int getifaddrs(struct ifaddrs **ifap);
    void freeifaddrs(struct ifaddrs *ifa);
    """
)
_libc = None

IFF_UP = 0x1
IFF_LOOPBACK = 0x8

SockAddr = tuple  # (host, port) or (host, port, flowinfo, scope_id)


@dataclass(frozen=True, slots=True)
class InterfaceAddress:
    """One IP address of a local interface."""

    interface: str
    address: ipaddress.IPv4Address | ipaddress.IPv6Address
    up: bool
    loopback: bool


def interfaces() -> list[InterfaceAddress]:
    """Every IPv4 and IPv6 address of every local interface (Linux ``getifaddrs``)."""
    global _libc
    if _libc is None:
        _libc = _ffi.dlopen(None)
    head = _ffi.new("struct ifaddrs **")
    if _libc.getifaddrs(head) != 0:
        raise OSError(_ffi.errno, "getifaddrs failed")
    out = []
    try:
        p = head[0]
        while p != _ffi.NULL:
            sa = p.ifa_addr
            if sa != _ffi.NULL and sa.sa_family in (socket.AF_INET, socket.AF_INET6):
                if sa.sa_family == socket.AF_INET:
                    raw = bytes(_ffi.buffer(sa, 8))[4:8]
                else:
                    raw = bytes(_ffi.buffer(sa, 24))[8:24]
                out.append(
                    InterfaceAddress(
                        _ffi.string(p.ifa_name).decode(),
                        ipaddress.ip_address(raw),
                        bool(p.ifa_flags & IFF_UP),
                        bool(p.ifa_flags & IFF_LOOPBACK),
                    )
                )
            p = p.ifa_next
    finally:
        _libc.freeifaddrs(head[0])
    return out


def interface_of(address: str) -> str | None:
    """The local interface that owns ``address``; None if no interface has it.

    A wildcard address (``0.0.0.0``, ``::``) has no interface; an IPv4-mapped
    IPv6 address (``::ffff:10.0.0.1``) is the IPv4 address's.
    """
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # an IPv4 peer of a dual-stack socket: ::ffff:a.b.c.d
    if ip.is_unspecified:
        return None
    for entry in interfaces():
        if entry.address == ip:
            return entry.interface
    if ip.is_loopback:
        return next((e.interface for e in interfaces() if e.loopback), None)
    return None


def route_source(destination: str, family: int, scope_id: int = 0) -> str:
    """The local address the routing table picks to reach ``destination``.

    ``scope_id`` is the interface index of an IPv6 link-local destination.
    Raises OSError (ENETUNREACH, EHOSTUNREACH, ...) when there is no route.
    """
    target = (destination, 9) if family == socket.AF_INET else (destination, 9, 0, scope_id)
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(target)
        return probe.getsockname()[0]


async def resolve(host: str | None, port: int, *, passive: bool = False) -> list[SockAddr]:
    """Socket addresses for a host name or literal (IPv4 and IPv6), in resolver order."""
    flags = socket.AI_PASSIVE if passive and host is None else 0
    infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=flags)
    seen: list[SockAddr] = []
    for *_, sockaddr in infos:
        if sockaddr not in seen:
            seen.append(sockaddr)
    return seen
