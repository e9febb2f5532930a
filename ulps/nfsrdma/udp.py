"""ONC RPC over UDP (RFC 5531): one call per datagram, no record marking.

rpcbind is asked over UDP as well as TCP (``rpcinfo -T udp``, the portmapper
lookups of old clients), so our rpcbind answers on a UDP socket of the same
port number. :func:`open_udp` binds one; :func:`serve_udp` answers the calls
that come to it, one datagram at a time, in order (no task per datagram: a
flood costs one call's work at a time and nothing piles up). Each datagram
is one whole call; its reply is one datagram, sent back to the sender from
the address the call was sent to (``IP_PKTINFO``/``IPV6_PKTINFO``, so a host
with several addresses answers from the one asked), and that address is the
call's :attr:`~.service.CallContext.local`.

No datagram stops the server: a call it cannot decode gets the reply
:class:`~.rpc.RpcServer` gives it (GARBAGE_ARGS, RPC_MISMATCH, AUTH_ERROR,
PROG_UNAVAIL, ...); a datagram that is not a call (too short for a header, a
reply) is dropped with a log line, and so is a reply that cannot be sent (too
large for a datagram, a sender that cannot be reached).
"""

from __future__ import annotations

import logging
import socket
import struct

import trio

from rdmashim.ulps.nfsrdma.service import CallHandler

log = logging.getLogger(__name__)

MAX_DATAGRAM = 65535
"""The largest datagram read: any UDP payload fits."""
IP_PKTINFO = getattr(socket, "IP_PKTINFO", 8)
"""Linux's value (Python names it only from 3.13)."""
_IN_PKTINFO = struct.Struct("=i4s4s")
"""``struct in_pktinfo``: interface index, the address to send from, the header's destination."""
_IN6_INFO = 20
"""The size of ``struct in6_pktinfo``: the address (16 bytes), the interface index."""
_CONTROL_SIZE = socket.CMSG_SPACE(_IN6_INFO)
TRANSPORT = "udp"

Control = list[tuple[int, int, bytes]]


async def open_udp(family: int, host: str, port: int) -> trio.socket.SocketType:
    """A UDP socket of ``family`` bound to ``host``:``port`` that learns each datagram's
    destination (IPv6 sockets are IPv6 only, as trio's TCP listeners)."""
    sock = trio.socket.socket(family, socket.SOCK_DGRAM)
    try:
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_RECVPKTINFO, 1)
        else:
            sock.setsockopt(socket.IPPROTO_IP, IP_PKTINFO, 1)
        await sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def _destination(ancdata: list[tuple[int, int, bytes]]) -> tuple[str, Control]:
    """The address a datagram was sent to, and the control message that sends the
    reply from it ("" and none when the datagram did not say)."""
    for level, kind, data in ancdata:
        if (level, kind) == (socket.IPPROTO_IP, IP_PKTINFO) and len(data) >= _IN_PKTINFO.size:
            _, _, address = _IN_PKTINFO.unpack_from(data)
            send_from = _IN_PKTINFO.pack(0, address, bytes(4))  # any interface, this source
            return socket.inet_ntop(socket.AF_INET, address), [(level, kind, send_from)]
        if (level, kind) == (socket.IPPROTO_IPV6, socket.IPV6_PKTINFO) and len(data) >= _IN6_INFO:
            info = bytes(data[:_IN6_INFO])  # the same address and interface
            return socket.inet_ntop(socket.AF_INET6, info[:16]), [(level, kind, info)]
    return "", []


async def serve_udp(server: CallHandler, sock: trio.socket.SocketType) -> None:
    """Answer the calls arriving on ``sock`` (from :func:`open_udp`) until cancelled;
    the socket is closed then."""
    with sock:
        log.info("ONC RPC over UDP on %s", sock.getsockname())
        while True:
            data, ancdata, _, sender = await sock.recvmsg(MAX_DATAGRAM, _CONTROL_SIZE)
            address: tuple[str, int] = sender  # type: ignore[assignment]  # trio says object
            peer = (str(address[0]), int(address[1]))
            local, control = _destination(ancdata)
            reply = await server.handle_call(memoryview(data), peer, TRANSPORT, local)
            if reply is None:
                continue  # not a call: RpcServer said why
            message = b"".join(reply.inline())
            try:
                await sock.sendmsg([message], control, 0, sender)
            except OSError as exc:
                log.warning("udp %s: reply of %d bytes not sent: %s", peer, len(message), exc)


__all__ = ["MAX_DATAGRAM", "open_udp", "serve_udp"]
