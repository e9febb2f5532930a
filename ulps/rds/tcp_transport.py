"""RDS over TCP's entry in the transport table (Linux's ``rds_tcp`` transport).

:class:`TcpTransport` listens on the node's address, TCP port ``RDS_TCP_PORT``,
and carries each connection on a :class:`~rdmashim.ulps.rds.tcp.TcpSession`. One
connection carries both directions, and the lower address makes it: the higher
address only knocks (it connects and closes at once) and the lower one connects
back (``tcp_connect.c`` ``rds_tcp_state_change``, ``tcp_listen.c``
``rds_tcp_accept_one_path``). Every session starts with the handshake probe.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, ClassVar

import trio

from rdmashim.ulps.rds.connection import Carrier, IPAddress
from rdmashim.ulps.rds.settings import Transport
from rdmashim.ulps.rds.tcp import TcpSession, tune
from rdmashim.ulps.rds.transport import Capabilities, TransportHost
from rdmashim.ulps.rds.wire import RDS_TCP_PORT

if TYPE_CHECKING:
    from rdmashim.ulps.rds.peer import Peer
    from rdmashim.verbs.abc import PD

log = logging.getLogger(__name__)


class TcpTransport:
    """RDS over TCP connections (see the module docstring)."""

    name: ClassVar[Transport] = "tcp"
    capabilities: ClassVar[Capabilities] = Capabilities(
        rdma_by_cookie=False, handshake_probe=True, redial_lost=True
    )

    def __init__(self, host: TransportHost) -> None:
        self.host = host

    @staticmethod
    def default_port(address: IPAddress) -> int:
        """``RDS_TCP_PORT`` (16385) for either family (``tcp_listen.c``)."""
        return RDS_TCP_PORT

    @property
    def pd(self) -> PD | None:
        """None: TCP has no RDMA."""
        return None

    @asynccontextmanager
    async def opened(self) -> AsyncIterator[None]:
        """Nothing to hold: the listener lives in the node's nursery."""
        yield

    async def listen(self, nursery: trio.Nursery) -> int:
        """Accept TCP connections on the node's address and port."""
        host = self.host
        listeners = await trio.open_tcp_listeners(host.port, host=str(host.address))
        port: int = listeners[0].socket.getsockname()[1]
        nursery.start_soon(trio.serve_listeners, self._incoming, listeners)
        return port

    def drivable(self, session: Carrier) -> TcpSession | None:
        """The session itself: a reader reads the socket in place of its reader task."""
        return session if isinstance(session, TcpSession) else None

    async def connect(self, entry: Peer) -> None:
        """One RDS/TCP connect. The lower address's connection carries the traffic;
        the higher address only knocks, and waits for the lower one to connect back.
        Raises OSError when nothing came of it."""
        rds, host = entry.rds, self.host
        entry.connecting = True
        try:
            stream = await trio.open_tcp_stream(
                str(rds.peer), host.port, local_address=str(host.address)
            )
        finally:
            entry.connecting = False
        async with stream:
            tune(stream.socket)
            if rds.canonical:
                entry.poked = False
                await host.carry(entry, TcpSession(rds, stream, host.plain), 0)
                return
        settings = host.settings
        with trio.move_on_after(settings.reconnect_max):
            while rds.session is None:  # noqa: ASYNC110 - woken by the peer's connection
                await trio.sleep(settings.reconnect_min)
        if rds.session is None:
            raise OSError(errno.ETIMEDOUT, f"RDS/TCP node {rds.peer} did not connect back")

    async def _incoming(self, stream: trio.SocketStream) -> None:
        """A TCP connection to our RDS port (see :meth:`connect` for who connects)."""
        host = self.host
        async with stream:
            try:
                peer = ipaddress.ip_address(stream.socket.getpeername()[0])
            except OSError:  # gone already
                return
            if peer == host.address or peer.version != host.address.version:
                log.warning("RDS/TCP connection from %s refused", peer)
                return
            entry = host.entry_for(peer, "RDS/TCP connection")
            if entry is None:
                return
            rds = entry.rds
            if rds.canonical:
                # The higher address knocked: close, and connect ourselves.
                log.debug("RDS/TCP %s: %s knocked", host.address, peer)
                entry.poked = True
                if entry.live:
                    # Either a knock that was on its way while ours connected, or the
                    # peer lost its end (it rebooted, say). A probe on our connection
                    # tells them apart: a peer without the connection resets it, and
                    # the session's end connects anew (poked); a live one answers.
                    log.info("RDS/TCP %s: %s knocked while connected; probing", host.address, peer)
                    if rds.has_room:
                        host.probe(rds)
                else:
                    entry.knocked.set()
                    host.start_connector(entry)
                return
            tune(stream.socket)
            if entry.connector is not None:
                entry.connector.cancel()  # a knock of ours, now answered
            await host.carry(entry, TcpSession(rds, stream, host.plain), 0)
