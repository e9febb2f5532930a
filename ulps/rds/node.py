"""RDS nodes: this machine's RDS on one address, reliable ordered datagrams to peers.

An :class:`RdsNode` is this machine's RDS presence on one local IP address. It
listens for RDS connections (unless told otherwise on Linux's port: ``RDS_PORT``
for IPv4 over RDMA, ``RDS_CM_PORT`` for IPv6 and for TCP) on its transport,
``"rdma"`` (rdma_cm and RC queue pairs, Linux's ``rds_rdma``,
:mod:`.rdma_transport`) or ``"tcp"`` (Linux's ``rds_tcp``, :mod:`.tcp_transport`),
an entry of the transport table :data:`TRANSPORT_TABLE` it calls through without
asking which one it has (:mod:`.transport`). It keeps one
:class:`~rdmashim.ulps.rds.connection.RdsConnection` per peer node (:mod:`.peers`),
shared by all its sockets (:mod:`.sockets`), and its congestion map
(:mod:`.congestion`). The lower address initiates, as Linux RDS does; when both
sides start at once, the lower address's attempt wins, so two nodes never build two
connections. The node delivers each message to the socket bound to its port, and
answers pings and RDS/TCP's handshake probe itself::

    async with RdsNode("10.0.0.1") as node:
        sock = node.bind(4000)
        await sock.sendto(b"hello", ("10.0.0.2", 4000))
        data, (ip, port) = await sock.recvfrom()

Over RDMA everything here uses only the portable verbs and rdma_cm API.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import random
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from types import TracebackType
from typing import TYPE_CHECKING

import trio

from rdmashim.ulps.rds import plain
from rdmashim.ulps.rds.congestion import NodeCongestion
from rdmashim.ulps.rds.connection import Carrier, IPAddress, RdsConnection
from rdmashim.ulps.rds.errors import RdsError
from rdmashim.ulps.rds.inbox import ReceivedMessage
from rdmashim.ulps.rds.peer import Peer
from rdmashim.ulps.rds.peers import PeerTable
from rdmashim.ulps.rds.rdma import RdmaOp, Sources
from rdmashim.ulps.rds.rdma_transport import RdmaTransport
from rdmashim.ulps.rds.settings import TRANSPORTS, RdsSettings, Transport
from rdmashim.ulps.rds.sockets import RdsSocket, port_number
from rdmashim.ulps.rds.tcp_transport import TcpTransport
from rdmashim.ulps.rds.transport import BurstHolder, RdsTransport
from rdmashim.ulps.rds.wire import (
    RDS_FLAG_PROBE_PORT,
    CongestionMap,
    Extension,
    GenNumExt,
    NpathsExt,
    RdmaExt,
)
from rdmashim.verbs.tasks import service_nursery

if TYPE_CHECKING:
    from rdmashim.verbs.abc import PD

__all__ = [
    "TRANSPORTS",
    "TRANSPORT_TABLE",
    "RdsError",
    "RdsNode",
    "RdsSocket",
    "ReceivedMessage",
    "Transport",
    "default_port",
]

log = logging.getLogger(__name__)

TRANSPORT_TABLE: dict[Transport, type[RdsTransport]] = {
    "rdma": RdmaTransport,
    "tcp": TcpTransport,
}
"""Each transport's entry (Linux's ``struct rds_transport``): made once per node."""
RDS_TCP_NPATHS = 1
"""Paths we announce in the handshake probe: one (Linux offers up to
``RDS_MPATH_WORKERS``, 8; the peer then uses the smaller number)."""


def default_port(address: IPAddress, transport: Transport) -> int:
    """The port Linux's RDS listens on and connects to: ``RDS_PORT`` (18634) for IPv4
    over RDMA, ``RDS_CM_PORT`` (16385) for IPv6 over RDMA and for TCP (each
    transport's ``default_port``)."""
    return TRANSPORT_TABLE[transport].default_port(address)


class RdsNode:
    """This machine's RDS endpoint on one IP address (see the module docstring)."""

    def __init__(
        self,
        address: str,
        port: int | None = None,
        *,
        transport: Transport = "rdma",
        settings: RdsSettings | None = None,
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"RDS transport {transport!r} is neither 'rdma' nor 'tcp'")
        self.address = ipaddress.ip_address(address)
        self.transport: Transport = transport
        """``"rdma"`` or ``"tcp"``: what carries the node's connections."""
        self.generation = random.getrandbits(32) | 1
        """This node's generation number, sent in the RDS/TCP handshake probe: a peer
        that sees it change knows we restarted (Linux's ``c_my_gen_num``)."""
        self.settings = settings or RdsSettings()
        """The node's bounds and timers (:class:`RdsSettings`)."""
        peers: dict[IPAddress, Peer] = {}
        self._sockets: dict[int, RdsSocket] = {}
        self._inboxes = plain.inboxes()
        """The sockets' receive queues (in C with the compiled plain-message path)."""
        self._congestion = NodeCongestion(self.address, peers)
        self.congestion = self._congestion.ours
        """This node's ports whose sockets hold more than ``settings.rcvbuf`` bytes unread."""
        self._table = PeerTable(
            self.address, 0, self.settings, peers, deliver=self._deliver,
            on_congestion=self._congestion.peer_changed,
            session_starting=self._session_starting, session_ended=self._session_ended,
            burst_held=self._burst_held, ack_held=self._ack_held, probe=self._probe,
            plain=plain.path(self._inboxes, self.settings, self._sockets),
        )  # fmt: skip
        self._transport = TRANSPORT_TABLE[transport](self._table)
        self._table.transport = self._transport
        self._table.port = self._transport.default_port(self.address) if port is None else port
        self._bursts: dict[BurstHolder, None] = {}
        """Sessions that held back the answers to a burst (:meth:`_answer_bursts`), each
        once."""
        self._acks: dict[BurstHolder, None] = {}
        """Sessions that held back an acknowledgement since a reader last went back to
        waiting (:meth:`_acks_needed`)."""
        self.drops_no_socket = 0
        self.drops_rcvbuf_full = 0
        """Messages dropped because their socket held ``settings.rcvbuf_limit`` unread."""
        self.loopback_messages = 0
        self._sources: Sources | None = None
        """The RDMA Write sources kept registered on the running PD (made on first use)."""

    @property
    def port(self) -> int:
        """The port the node listens on and connects to (the one picked, for port 0)."""
        return self._table.port

    @property
    def pd(self) -> PD | None:
        """The protection domain every connection and RDMA registration of the node uses
        (over RDMA, once the node started)."""
        return self._transport.pd

    @property
    def peers_expired(self) -> int:
        """Peer entries dropped for idleness (``settings.peer_idle_expiry``) or room."""
        return self._table.expired

    @property
    def _peers(self) -> dict[IPAddress, Peer]:
        return self._table.entries

    # ------------------------------------------------------------------ lifetime
    @asynccontextmanager
    async def _run(self) -> AsyncIterator[RdsNode]:
        async with self._transport.opened():
            try:
                async with service_nursery() as nursery:
                    self._table.nursery = nursery
                    self._table.port = await self._transport.listen(nursery)
                    nursery.start_soon(self._table.expire_idle)
                    try:
                        yield self
                    finally:
                        self._table.close()
                        for sock in list(self._sockets.values()):
                            sock.close()
            finally:
                if self._sources is not None:  # (before the PD goes)
                    self._sources.close()
                    self._sources = None

    async def __aenter__(self) -> RdsNode:
        self._cm = self._run()
        return await self._cm.__aenter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        return await self._cm.__aexit__(exc_type, exc, tb)

    def running_pd(self) -> PD:
        """:attr:`pd`, which exists while the node runs (ENOTCONN before and after;
        EOPNOTSUPP over a transport without RDMA, TCP)."""
        if not self._transport.capabilities.rdma_by_cookie:
            raise RdsError(
                errno.EOPNOTSUPP,
                "RDMA by cookie needs the rdma transport; "
                f"this RDS node runs over {self.transport}",
            )
        pd = self._transport.pd
        if pd is None:
            raise RdsError(errno.ENOTCONN, "the RDS node is not running")
        return pd

    def _rdma_sources(self) -> Sources:
        """The RDMA Write sources kept on :meth:`running_pd`'s PD (errors as it)."""
        pd = self.running_pd()
        if self._sources is None:
            self._sources = Sources(pd)
        return self._sources

    # ------------------------------------------------------------------ sockets
    def bind(self, port: int) -> RdsSocket:
        """A socket bound to (this node's address, ``port``); port 0 picks a free one."""
        port = port_number(port)
        if port == 0:
            port = next(p for p in range(32768, 61000) if p not in self._sockets)
        if not 0 < port < 65536:
            raise RdsError(errno.EINVAL, f"port {port} outside 1..65535")
        if port in self._sockets:
            raise RdsError(errno.EADDRINUSE, f"RDS port {port} is in use on {self.address}")
        sock = RdsSocket(self, port, self._inboxes.open(port))
        self._sockets[port] = sock
        return sock

    def _deliver(
        self, peer: IPAddress, seq: int, sport: int, dport: int,
        extensions: tuple[Extension, ...], data: bytes,
    ) -> None:  # fmt: skip
        if dport == 0 and sport != 0:  # an RDS ping: answer it, as Linux's rds_send_pong
            if sport == RDS_FLAG_PROBE_PORT:  # the handshake probe
                self._handshake(peer, extensions)
            self._pong(peer, sport)
            return
        if dport == RDS_FLAG_PROBE_PORT and sport == 0:  # the answer to our probe
            self._handshake(peer, extensions)
            return
        sock = self._sockets.get(dport)
        if sock is None:
            self.drops_no_socket += 1
            log.info("message from %s:%d for unbound port %d dropped", peer, sport, dport)
            return
        inbox = sock.received
        if inbox.counts.use_once:  # (else a chaser ends nothing: C does not look either)
            for ext in extensions:
                if isinstance(ext, RdmaExt):  # it chases an RDMA operation on one of ours
                    sock._registrations.used(ext.rkey)
        if inbox.counts.nbytes + len(data) > self.settings.rcvbuf_limit:
            self.drops_rcvbuf_full += 1
            log.info(
                "message from %s:%d dropped: port %d holds %d bytes unread (rcvbuf_limit)",
                peer, sport, dport, sock.queued_bytes,
            )  # fmt: skip
            return
        inbox.push(data, peer, sport, seq)
        sock._wake()
        if inbox.counts.nbytes > self.settings.rcvbuf:
            sock.congested = True
            self._congestion.mark(dport, True)

    def _pong(self, peer: IPAddress, sport: int) -> None:
        """Answer a ping, unless the connection's queue is full (a peer that pings but
        grants no credits must not make us queue pongs without bound)."""
        entry = self._peers.get(peer)
        if entry is None or not entry.rds.has_room:
            if entry is not None:
                entry.rds.counters.replies_dropped += 1
            log.debug("RDS pong to %s:%d dropped: its queue is full", peer, sport)
            return
        probe = sport == RDS_FLAG_PROBE_PORT and self._transport.capabilities.handshake_probe
        entry.rds.queue(
            0, sport, b"", extensions=self._probe_extensions() if probe else (), own=True
        )
        self._table.pump(entry)

    def _probe(self, rds: RdsConnection) -> None:
        """Queue the RDS/TCP handshake probe (``send.c`` ``rds_send_probe``)."""
        rds.queue(RDS_FLAG_PROBE_PORT, 0, b"", extensions=self._probe_extensions(), own=True)
        if rds.session is not None:
            rds.session.pump_sends()

    def _probe_extensions(self) -> tuple[NpathsExt, GenNumExt]:
        """What the RDS/TCP handshake probe and its answer carry (``rds_send_probe``)."""
        return (NpathsExt(RDS_TCP_NPATHS), GenNumExt(self.generation))

    def _handshake(self, peer: IPAddress, extensions: tuple[Extension, ...]) -> None:
        """A handshake probe or its answer (its extension headers): note the peer's
        generation number (``recv.c`` ``rds_recv_hs_exthdrs``). We use one path whatever
        it offers."""
        entry = self._peers.get(peer)
        generation = next((e.gen_num for e in extensions if isinstance(e, GenNumExt)), 0)
        if entry is None or not generation:
            return
        rds = entry.rds
        if rds.peer_generation and generation != rds.peer_generation:
            rds.peer_restarted(generation)
        rds.peer_generation = generation

    def _session_starting(self, rds: RdsConnection) -> None:
        """A new session is to carry ``rds``: our map goes first (a port that filled up or
        drained while no session was up would otherwise stay wrong at the peer for
        good), and the handshake probe where the transport has one."""
        self._congestion.send_map(rds)
        if self._transport.capabilities.handshake_probe:
            self._probe(rds)

    def _session_ended(self, session: Carrier) -> None:
        """Nothing is to be answered for a session that ended."""
        if session in self._bursts:
            self._bursts = {held: None for held in self._bursts if held is not session}
        self._acks.pop(session, None)  # type: ignore[call-overload]

    # ------------------------------------------------------------------ congestion
    def monitor_congestion(
        self,
    ) -> AbstractAsyncContextManager[trio.MemoryReceiveChannel[tuple[str, set[int]]]]:
        """Congestion changes of peer ports, as (peer address, ports that changed).

        ``async with node.monitor_congestion() as updates: async for peer, ports in updates``;
        ``port in node.peer_congestion(peer)`` tells the current state. A monitor
        :data:`~rdmashim.ulps.rds.congestion.MONITOR_BACKLOG` changes behind misses the
        changes after those.
        """
        return self._congestion.monitor()

    def peer_congestion(self, peer: str) -> CongestionMap:
        """The congestion map the node at ``peer`` last sent."""
        return self._congestion.of_peer(peer)

    def sockets(self) -> list[RdsSocket]:
        """Every bound socket (for rds-info)."""
        return sorted(self._sockets.values(), key=lambda sock: sock.port)

    def connection_flags(self, peer: str) -> str:
        """rds-info's flags for the connection to ``peer`` (s, c, C, E or -)."""
        entry = self._peers[ipaddress.ip_address(peer)]
        up = entry.live
        return (
            ("s" if up and entry.rds.unsent else "-")
            + ("c" if entry.connecting else "-")
            + ("C" if up else "-")
            + ("E" if entry.unreachable else "-")
        )

    # ------------------------------------------------------------------ connections
    def connections(self) -> list[RdsConnection]:
        """Every peer connection (for counters and rds-info)."""
        return self._table.connections()

    def _burst_held(self, session: BurstHolder) -> None:
        self._bursts[session] = None

    def _ack_held(self, session: BurstHolder) -> None:
        self._acks[session] = None

    def _acks_needed(self) -> None:
        """A reader goes back to waiting: the acknowledgements sessions hold back go on
        their own unless a message carries them in time (see
        :meth:`~rdmashim.ulps.rds.rdma_session.Session.ack_needed`)."""
        acks, self._acks = self._acks, {}
        for session in acks:
            session.ack_needed()

    def _answer_bursts(self) -> None:
        """Post the answers sessions hold back for their bursts (see
        :meth:`~rdmashim.ulps.rds.rdma_session.Session.answer_burst`)."""
        bursts, self._bursts = self._bursts, {}
        for session in bursts:
            session.answer_burst()

    def _send_loopback(
        self, sport: int, dport: int, data: bytes, rdma: RdmaOp | None = None
    ) -> None:
        """A message to the node's own address: the loopback transport, no connection."""
        if rdma is not None:
            raise RdsError(errno.EOPNOTSUPP, "RDMA to the node's own address (as Linux)")
        self.loopback_messages += 1
        self._deliver(self.address, self.loopback_messages, sport, dport, (), bytes(data))
