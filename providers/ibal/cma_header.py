"""The rdma_cm IP header a REQ's private data starts with over InfiniBand (a pure codec).

rdma_cm over IB (Linux ``struct cma_hdr`` in ``cma.c``, WinOF's
``IB_CMA_HEADER``) puts 36 bytes before the application's REQ private data:
the CMA version (0), the IP version in the high nibble of one byte, the
source port (network order), then the source and destination addresses as
16 bytes each (IPv4 in the last four, zeros before). Over iWARP the TCP
connection carries the addresses and rdma_cm sends no header.
"""

from __future__ import annotations

import ipaddress
import struct
from dataclasses import dataclass

CMA_VERSION = 0x00
HEADER_LEN = 36
_FORMAT = struct.Struct("!BBH16s16s")


class CmaHeaderError(ValueError):
    """Private data that does not start with a valid rdma_cm IP header."""


@dataclass(frozen=True, slots=True)
class CmaHeader:
    """The header's fields: source address and port, destination address."""

    src_ip: str
    src_port: int
    dst_ip: str

    @property
    def ip_version(self) -> int:
        """4 or 6."""
        return ipaddress.ip_address(self.src_ip).version


def _raw(text: str) -> bytes:
    ip = ipaddress.ip_address(text.split("%", 1)[0])
    return ip.packed.rjust(16, b"\0")


def encode(header: CmaHeader) -> bytes:
    """The 36 bytes of ``header``."""
    src = ipaddress.ip_address(header.src_ip.split("%", 1)[0])
    dst = ipaddress.ip_address(header.dst_ip.split("%", 1)[0])
    if src.version != dst.version:
        raise CmaHeaderError(f"{src} and {dst} differ in IP version")
    if not 0 <= header.src_port <= 0xFFFF:
        raise CmaHeaderError(f"port {header.src_port}")
    return _FORMAT.pack(
        CMA_VERSION, src.version << 4, header.src_port, _raw(str(src)), _raw(str(dst))
    )


def decode(data: bytes) -> tuple[CmaHeader, bytes]:
    """The header at the start of ``data`` and the application's private data after it."""
    if len(data) < HEADER_LEN:
        raise CmaHeaderError(f"{len(data)} bytes, the header takes {HEADER_LEN}")
    version, ip_version, port, src, dst = _FORMAT.unpack_from(data)
    if version != CMA_VERSION:
        raise CmaHeaderError(f"CMA version {version:#x}")
    family = ip_version >> 4
    if family == 4:
        if any(src[:12]) or any(dst[:12]):
            raise CmaHeaderError("IPv4 addresses with bytes before the last four")
        addrs = (str(ipaddress.IPv4Address(src[12:])), str(ipaddress.IPv4Address(dst[12:])))
    elif family == 6:
        addrs = (str(ipaddress.IPv6Address(src)), str(ipaddress.IPv6Address(dst)))
    else:
        raise CmaHeaderError(f"IP version {family}")
    return CmaHeader(addrs[0], port, addrs[1]), bytes(data[HEADER_LEN:])


__all__ = ["CMA_VERSION", "HEADER_LEN", "CmaHeader", "CmaHeaderError", "decode", "encode"]
