"""IBAT: IP address to path record translation, as WinOF's ``IBAT::QueryPath`` does it.

WinOF's rdma_cm runs over the IB CM, which knows GIDs and path records, not IP
addresses; IBAT bridges the two: given a source and a destination IP address
it picks the local port, resolves the destination's link address through the
neighbour (ARP/ND) table and returns the path record the CM connects with.
:func:`ibat_query_path` does the same over the portable HCAs, step by step:

1. **Source.** When none is given, the routing table picks it
   (:func:`rdmashim.cm.addressing.route_source`, the portable CM's own route
   lookup, as WinOF asks ``SIO_ROUTING_INTERFACE_QUERY``).
2. **Local interface and CA.** The interface that owns the source address
   (:func:`rdmashim.cm.addressing.interface_of`), and the HCA device bound to
   that interface (the device list of the AL's HCA backend: the built-in
   engine has one device per interface, ``siw_<ifname>``).
3. **Destination link address.** A local destination (loopback, or any
   address of this machine) needs no resolution: its interface's hardware
   address. Any other destination goes through the kernel's neighbour table:
   the route to it names the next hop (the destination itself on-link, else
   its gateway), a datagram to the discard port provokes resolution, and the
   table is read until the entry is complete. The route and neighbour tables
   are read through rtnetlink (Linux only: on another platform the query
   fails with ``IB_NOT_FOUND`` saying so; a local destination still works).
4. **GIDs** as the transport reports them. An iWARP device's GID is its
   interface's MAC in the first six bytes and zeros after (Linux siw's
   ``siw_query_gid``); an interface without a hardware address (loopback,
   tunnels) uses the six bytes the device puts in its node GUID instead
   (the built-in engine: the interface name; current Linux siw picks a random
   address there).

The record keeps IBAL's ``ib_path_rec_t`` fields (LIDs 0 and the default
P_Key, as iWARP ports report them) plus the IP endpoints it was resolved from,
which the CM over an IP transport connects to.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import socket
import struct
import sys
import time
from dataclasses import dataclass
from typing import Any

import psutil

from rdmashim.cm import addressing
from rdmashim.providers.ibal.status import IbError, IbStatus
from rdmashim.verbs.backend import load_backend
from rdmashim.verbs.enums import Mtu

log = logging.getLogger(__name__)

GID_LEN = 16
IB_DEFAULT_PKEY = 0xFFFF
IB_PATH_SELECTOR_EXACTLY = 2
"""``ib_path_rec_t.mtu``/``rate`` hold a selector in their top two bits."""
NEIGHBOUR_TIMEOUT = 3.0
"""Seconds :func:`ibat_query_path` waits for the neighbour table to resolve a destination."""
NEIGHBOUR_POLL = 0.01
DISCARD_PORT = 9

Ip = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True, slots=True)
class ib_path_rec_t:
    """A path record (``ib_path_rec_t``) and the IP endpoints it was resolved from.

    ``mtu`` holds the MTU selector in its top two bits and the ``IB_MTU_LEN_*``
    code below; ``num_path`` has the reversible bit (0x80) set. ``src_ip``,
    ``dst_ip`` (and ``scope_id`` for an IPv6 link-local destination) are where
    the CM connects over an IP transport; ``ifname``, ``device_name`` and
    ``ca_guid`` name the local interface and the CA bound to it (``""``/0 when
    the HCA backend's device list does not say which device sits on it).
    """

    dgid: bytes
    sgid: bytes
    dlid: int = 0
    slid: int = 0
    service_id: int = 0
    hop_flow_raw: int = 0
    tclass: int = 0
    num_path: int = 0x81
    pkey: int = IB_DEFAULT_PKEY
    qos_class_sl: int = 0
    mtu: int = (IB_PATH_SELECTOR_EXACTLY << 6) | Mtu.MTU_1024
    rate: int = 0
    pkt_life: int = 0
    preference: int = 0
    src_ip: str = ""
    dst_ip: str = ""
    scope_id: int = 0
    ifname: str = ""
    device_name: str = ""
    ca_guid: int = 0

    @property
    def sl(self) -> int:
        """The service level (low four bits of ``qos_class_sl``)."""
        return self.qos_class_sl & 0xF

    @property
    def mtu_bytes(self) -> int:
        """The path MTU in bytes."""
        return 128 << (self.mtu & 0x3F)


def _fail(detail: str, status: IbStatus = IbStatus.IB_NOT_FOUND) -> IbError:
    return IbError(status, "ibat_query_path", detail)


# ---------------------------------------------------------------------------- devices and GIDs
def _device_on(ifname: str, hca_backend: str | None) -> Any:
    """The HCA backend's device bound to ``ifname``, or None if its list does not say."""
    for device in load_backend(hca_backend).get_device_list():
        if device.netdev == ifname:
            return device
    return None


def _hardware_address(ifname: str) -> bytes:
    """The interface's hardware address; empty when it has none (or it is all zeros)."""
    for entry in psutil.net_if_addrs().get(ifname, ()):
        if entry.family == psutil.AF_LINK and entry.address:
            raw = bytes.fromhex(entry.address.replace(":", "").replace("-", ""))
            return raw if any(raw) else b""
    return b""


def iwarp_gid(ifname: str, device: Any = None) -> bytes:
    """The GID an iWARP device on ``ifname`` reports: six address bytes, ten zeros.

    The address is the interface's MAC; without one, the six bytes the device
    put in its node GUID (around the EUI-64 ``ff:fe``).
    """
    raw = _hardware_address(ifname)
    if not raw and device is not None:
        guid = int(device.node_guid).to_bytes(8, "big")
        raw = guid[:3] + guid[5:]
    if not raw:
        raw = ifname.encode()[:6].ljust(6, b"\0")
    return raw[:6].ljust(GID_LEN, b"\0")


def _mtu_code(ifname: str) -> int:
    link = psutil.net_if_stats().get(ifname)
    size = link.mtu if link is not None and link.mtu else 1500
    return (IB_PATH_SELECTOR_EXACTLY << 6) | Mtu.fitting(size)


# ---------------------------------------------------------------------------- rtnetlink
NETLINK_ROUTE = 0
NLMSG_ERROR, NLMSG_DONE = 2, 3
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
RTM_NEWROUTE, RTM_GETROUTE, RTM_NEWNEIGH, RTM_GETNEIGH = 24, 26, 28, 30
RTA_DST, RTA_OIF, RTA_GATEWAY = 1, 4, 5
NDA_DST, NDA_LLADDR = 1, 2
RTN_LOCAL = 2
NUD_INCOMPLETE, NUD_FAILED = 0x01, 0x20
_NLMSGHDR = struct.Struct("=IHHII")
_RTMSG = struct.Struct("=BBBBBBBBI")
_NDMSG = struct.Struct("=BBHiHBB")
_RTATTR = struct.Struct("=HH")


def _align(n: int) -> int:
    return (n + 3) & ~3


def _attrs(data: bytes) -> dict[int, bytes]:
    """A netlink message's attributes (type -> payload)."""
    out: dict[int, bytes] = {}
    while len(data) >= _RTATTR.size:
        length, kind = _RTATTR.unpack_from(data)
        if length < _RTATTR.size:
            break
        out[kind & 0x7FFF] = data[_RTATTR.size : length]
        data = data[_align(length) :]
    return out


def _netlink(kind: int, flags: int, body: bytes) -> list[tuple[int, bytes]]:
    """Send one rtnetlink request; return the (type, payload) messages of its answer."""
    if not sys.platform.startswith("linux"):
        raise _fail(f"no neighbour table reader on {sys.platform} (IBAT reads Linux's rtnetlink)")
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_ROUTE) as sock:
        sock.settimeout(2.0)
        sock.bind((0, 0))
        message = _NLMSGHDR.pack(_NLMSGHDR.size + len(body), kind, NLM_F_REQUEST | flags, 1, 0)
        sock.send(message + body)
        out: list[tuple[int, bytes]] = []
        while True:
            data = sock.recv(1 << 16)
            while len(data) >= _NLMSGHDR.size:
                length, mtype, _, _, _ = _NLMSGHDR.unpack_from(data)
                payload = data[_NLMSGHDR.size : length]
                data = data[_align(length) :]
                if mtype == NLMSG_DONE:
                    return out
                if mtype == NLMSG_ERROR:
                    (code,) = struct.unpack_from("=i", payload)
                    if code:
                        raise OSError(-code, f"rtnetlink: {errno.errorcode.get(-code, code)}")
                    return out
                out.append((mtype, payload))
            if not flags & NLM_F_DUMP:
                return out


def _next_hop(dst: Ip, scope_id: int) -> tuple[Ip, int, bool]:
    """(next hop, output interface index, destination is local) from the routing table."""
    family = socket.AF_INET6 if dst.version == 6 else socket.AF_INET
    body = _RTMSG.pack(family, dst.max_prefixlen, 0, 0, 0, 0, 0, 0, 0)
    body += _RTATTR.pack(_RTATTR.size + len(dst.packed), RTA_DST) + dst.packed
    if scope_id:
        body += _RTATTR.pack(_RTATTR.size + 4, RTA_OIF) + struct.pack("=i", scope_id)
    try:
        answer = _netlink(RTM_GETROUTE, 0, body)
    except OSError as exc:
        raise _fail(f"no route to {dst}: {exc}", IbStatus.IB_NOT_FOUND) from exc
    for mtype, payload in answer:
        if mtype != RTM_NEWROUTE:
            continue
        route_type = _RTMSG.unpack_from(payload)[7]
        attrs = _attrs(payload[_RTMSG.size :])
        oif = struct.unpack("=i", attrs[RTA_OIF])[0] if RTA_OIF in attrs else 0
        gateway = attrs.get(RTA_GATEWAY)
        hop = ipaddress.ip_address(gateway) if gateway else dst
        return hop, oif, route_type == RTN_LOCAL
    raise _fail(f"the routing table gave no route to {dst}")


def _neighbour(hop: Ip, ifindex: int) -> tuple[int, bytes] | None:
    """(NUD state, link address) of ``hop`` on ``ifindex`` in the neighbour table."""
    family = socket.AF_INET6 if hop.version == 6 else socket.AF_INET
    for mtype, payload in _netlink(RTM_GETNEIGH, NLM_F_DUMP, _NDMSG.pack(family, 0, 0, 0, 0, 0, 0)):
        if mtype != RTM_NEWNEIGH:
            continue
        _, _, _, index, state, _, _ = _NDMSG.unpack_from(payload)
        attrs = _attrs(payload[_NDMSG.size :])
        if attrs.get(NDA_DST) == hop.packed and (not ifindex or index == ifindex):
            return state, attrs.get(NDA_LLADDR, b"")
    return None


def _provoke(src: Ip, dst: Ip, scope_id: int) -> None:
    """Make the kernel resolve the next hop to ``dst``: one empty datagram to the discard port."""
    family = socket.AF_INET6 if dst.version == 6 else socket.AF_INET
    target: tuple[Any, ...] = (str(dst), DISCARD_PORT)
    if family == socket.AF_INET6:
        target = (str(dst), DISCARD_PORT, 0, scope_id)
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((str(src), 0, 0, scope_id) if family == socket.AF_INET6 else (str(src), 0))
            probe.sendto(b"", target)
        except OSError as exc:
            log.debug("probe to %s: %s", dst, exc)


def _resolve_link_address(src: Ip, dst: Ip, scope_id: int, timeout: float) -> bytes:
    """The link address of the next hop to ``dst`` (empty: the destination is local)."""
    hop, oif, local = _next_hop(dst, scope_id)
    if local:
        return b""
    deadline = time.monotonic() + timeout
    provoked = False
    while True:
        entry = _neighbour(hop, oif)
        if entry is not None:
            state, lladdr = entry
            if state & NUD_FAILED:
                raise _fail(f"{hop} did not answer address resolution (neighbour FAILED)")
            if lladdr and not state & NUD_INCOMPLETE:
                return lladdr
        if not provoked:
            _provoke(src, dst, scope_id)
            provoked = True
        if time.monotonic() >= deadline:
            raise _fail(f"{hop} unresolved after {timeout} s", IbStatus.IB_TIMEOUT)
        time.sleep(NEIGHBOUR_POLL)


# ---------------------------------------------------------------------------- the query
def _ip(text: str, what: str) -> tuple[Ip, int]:
    host, _, scope = str(text).partition("%")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        detail = f"{what} {text!r} is not an IP address"
        raise IbError(IbStatus.IB_INVALID_PARAMETER, "ibat_query_path", detail) from None
    scope_id = 0
    if scope:
        scope_id = int(scope) if scope.isdigit() else socket.if_nametoindex(scope)
    return ip, scope_id


def ibat_query_path(
    src_ip: str | None,
    dst_ip: str,
    *,
    hca_backend: str | None = None,
    timeout: float = NEIGHBOUR_TIMEOUT,
) -> ib_path_rec_t:
    """The path record from ``src_ip`` (None: the routing table's choice) to ``dst_ip``.

    See the module docstring for the steps. ``hca_backend`` is the backend
    whose devices are the CAs (the AL's, ``ib_open_al``'s default when None).
    Raises :class:`IbError`: IB_INVALID_PARAMETER for a malformed address,
    IB_NOT_FOUND when there is no route, no local interface owns the source,
    the neighbour does not answer or the platform has no neighbour table
    reader, IB_TIMEOUT when resolution is still pending after ``timeout``.
    Blocks the caller while the neighbour resolves, as IBAT's query does.
    """
    from rdmashim.providers.ibal.al import DEFAULT_HCA_BACKEND, HCA_ENV_VAR

    backend = hca_backend or os.environ.get(HCA_ENV_VAR) or DEFAULT_HCA_BACKEND
    dst, scope_id = _ip(dst_ip, "destination")
    family = socket.AF_INET6 if dst.version == 6 else socket.AF_INET
    if src_ip is None:
        try:
            src_text = addressing.route_source(str(dst), family, scope_id)
        except OSError as exc:
            raise _fail(f"no route to {dst}: {exc}") from exc
    else:
        src_text = src_ip
    src, _ = _ip(src_text, "source")
    if src.version != dst.version:
        raise IbError(
            IbStatus.IB_INVALID_PARAMETER, "ibat_query_path", f"{src} and {dst} differ in family"
        )
    ifname = addressing.interface_of(str(src))
    if ifname is None:
        raise _fail(f"no local interface has address {src}")
    device = _device_on(ifname, backend)
    sgid = iwarp_gid(ifname, device)
    local_if = addressing.interface_of(str(dst)) if not scope_id else None
    if local_if is not None:
        dgid = iwarp_gid(local_if, _device_on(local_if, backend))
    else:
        lladdr = _resolve_link_address(src, dst, scope_id, timeout)
        dgid = lladdr[:6].ljust(GID_LEN, b"\0") if lladdr else sgid
    return ib_path_rec_t(
        dgid=dgid,
        sgid=sgid,
        mtu=_mtu_code(ifname),
        src_ip=str(src),
        dst_ip=str(dst),
        scope_id=scope_id,
        ifname=ifname,
        device_name=device.name if device is not None else "",
        ca_guid=int(device.node_guid) if device is not None else 0,
    )
