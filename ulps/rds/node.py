"""RDS nodes and sockets: reliable, ordered datagrams between (IP, port) endpoints.

An :class:`RdsNode` is this machine's RDS presence on one local IP address. It
listens for RDS connections (unless told otherwise on Linux's port: ``RDS_PORT``
for IPv4 over RDMA, ``RDS_CM_PORT`` for IPv6 and for TCP) on its transport,
``"rdma"`` (rdma_cm and RC queue pairs, Linux's ``rds_rdma``,
:mod:`.rdma_transport`) or ``"tcp"`` (Linux's ``rds_tcp``, :mod:`.tcp_transport`),
an entry of the transport table :data:`TRANSPORT_TABLE` it calls through without
asking which one it has (:mod:`.transport`). It keeps one
:class:`~rdmashim.ulps.rds.connection.RdsConnection` per peer node (:mod:`.peers`),
shared by all its sockets. The lower address initiates, as Linux RDS does; when both
sides start at once, the lower address's attempt wins, so two nodes never build two
connections. :class:`RdsSocket` is a socket bound to (node address, port)::

    async with RdsNode("10.0.0.1") as node:
        sock = node.bind(4000)
        await sock.sendto(b"hello", ("10.0.0.2", 4000))
        data, (ip, port) = await sock.recvfrom()

Over RDMA everything here uses only the portable verbs and rdma_cm API.
"""

from __future__ import annotations

import errno
import functools
import ipaddress
import logging
import random
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, NamedTuple

import trio

from rdmashim.ulps.rds.connection import Carrier, IPAddress, RdsConnection
from rdmashim.ulps.rds.errors import RdsError
from rdmashim.ulps.rds.peer import Peer
from rdmashim.ulps.rds.peers import PeerTable
from rdmashim.ulps.rds.rdma import RdmaOp, Registrations
from rdmashim.ulps.rds.rdma_transport import RdmaTransport
from rdmashim.ulps.rds.settings import TRANSPORTS, RdsSettings, Transport
from rdmashim.ulps.rds.tcp_transport import TcpTransport
from rdmashim.ulps.rds.transport import BurstHolder, Drivable, RdsTransport
from rdmashim.ulps.rds.wire import (
    RDS_FLAG_PROBE_PORT,
    RDS_MAX_MSG_SIZE,
    CongestionMap,
    GenNumExt,
    NpathsExt,
    RdmaExt,
    RdsHeader,
)
from rdmashim.verbs.busypoll import spin_until
from rdmashim.verbs.errors import integer
from rdmashim.verbs.tasks import service_nursery

if TYPE_CHECKING:
    from typing_extensions import Buffer

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
MONITOR_BACKLOG = 1024
"""Congestion changes a monitor may fall behind by; later ones are dropped for it."""


def default_port(address: IPAddress, transport: Transport) -> int:
    """The port Linux's RDS listens on and connects to: ``RDS_PORT`` (18634) for IPv4
    over RDMA, ``RDS_CM_PORT`` (16385) for IPv6 over RDMA and for TCP (each
    transport's ``default_port``)."""
    return TRANSPORT_TABLE[transport].default_port(address)


@functools.lru_cache(maxsize=1024)
def _parse_ip(text: str) -> IPAddress:
    """``ipaddress.ip_address``, remembered: a sender names the same few peers."""
    return ipaddress.ip_address(text)


def _port_number(port: object) -> int:
    """``port`` as an int (:func:`~rdmashim.verbs.errors.integer`), or EINVAL."""
    number = integer(port)
    if number is None:
        raise RdsError(errno.EINVAL, f"port {port!r} is not an integer")
    return number


@functools.lru_cache(maxsize=1024)
def _ip_text(ip: IPAddress) -> str:
    """The text of an address (a received message's sender), remembered."""
    return str(ip)


class ReceivedMessage(NamedTuple):
    """A message waiting in a socket's receive queue."""

    data: bytes
    sender: tuple[str, int]
    seq: int
    """The sender node's sequence number for it (rds-info's receive queue)."""


@dataclass(eq=False)
class RdsSocket:
    """An RDS socket bound to (node address, port)."""

    node: RdsNode
    port: int
    queued_bytes: int = 0
    closed: bool = False
    received: deque[ReceivedMessage] = field(default_factory=deque)
    """Messages not yet taken by :meth:`recvfrom`, oldest first."""
    _arrived: trio.lowlevel.ParkingLot = field(default_factory=trio.lowlevel.ParkingLot)
    _driving: Drivable | None = None
    """The CQ a reader drives while it waits (see :meth:`recvfrom`)."""
    _registrations: Registrations = field(default_factory=Registrations)

    @property
    def address(self) -> tuple[str, int]:
        """(IP, port) this socket is bound to."""
        return (str(self.node.address), self.port)

    def _check(self, data: bytes, dest: tuple[str, int]) -> tuple[IPAddress, int]:
        if self.closed:
            raise RdsError(errno.EBADF, "sendto on a closed RDS socket")
        limit = min(RDS_MAX_MSG_SIZE, self.node.settings.sndbuf)  # Linux: both bound it
        if len(data) > limit:
            raise RdsError(errno.EMSGSIZE, f"{len(data)}-byte message exceeds RDS's {limit}")
        try:
            host, port = dest
        except (ValueError, TypeError) as exc:
            raise RdsError(errno.EINVAL, f"{dest!r} is not an (address, port) pair") from exc
        try:
            ip = _parse_ip(host)
        except (ValueError, TypeError) as exc:
            raise RdsError(errno.EINVAL, f"{host!r} is not an IP address") from exc
        if port.__class__ is not int:
            port = _port_number(port)
        if not 0 <= port < 65536:  # port 0: an RDS ping, answered by the node
            raise RdsError(errno.EINVAL, f"port {port} outside 1..65535")
        return ip, port

    async def sendto(
        self, data: bytes, dest: tuple[str, int], *, rdma: RdmaOp | None = None
    ) -> None:
        """Send one message to (IP, port), with an RDMA operation to run before it.

        Waits while the connection's queue is full or the destination port is
        congested (its receiver is full). ``await rdma.wait()`` tells how the
        operation ended (see :mod:`rdmashim.ulps.rds.rdma`).
        """
        ip, port = self._check(data, dest)
        node = self.node
        if ip == node.address:
            node._send_loopback(self.port, port, data, rdma)
            return
        while True:  # the peer entry may expire while we wait: look again
            entry = node._table.lookup(ip)
            rds = entry.rds
            if not rds.has_room:
                await entry.wait_room()
            elif rds.peer_congestion.test(port):
                await entry.wait_uncongested()
            else:
                break
        node._send(entry, self.port, port, data, rdma)

    def sendto_nowait(
        self, data: bytes, dest: tuple[str, int], *, rdma: RdmaOp | None = None
    ) -> None:
        """Send without waiting; raises ``trio.WouldBlock`` while the queue is full."""
        ip, port = self._check(data, dest)
        node = self.node
        if ip == node.address:
            node._send_loopback(self.port, port, data, rdma)
            return
        entry = node._table.lookup(ip)
        if entry.rds.peer_congestion.test(port):
            raise RdsError(errno.ENOBUFS, f"RDS port {port} on {ip} is congested")
        if not entry.rds.has_room:
            raise trio.WouldBlock
        node._send(entry, self.port, port, data, rdma)

    async def recvfrom(self) -> tuple[bytes, tuple[str, int]]:
        """The next message for this socket and its sender's (IP, port)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        parked = False
        while True:
            if self.closed:
                raise RdsError(errno.EBADF, "recvfrom on a closed RDS socket")
            if self.received:
                break
            node = self.node
            if not node._holding and node._bursts:  # every receiver has answered
                node._answer_bursts()
            drivable = node._table.drivable()
            if drivable is not None:
                self._driving = drivable
                try:
                    driven = await drivable.drive_until(self._readable)
                finally:
                    self._driving = None
                if driven:
                    parked = True
                    continue
            elif node.settings.busy_poll and await spin_until(
                self._readable, node.settings.busy_poll
            ):
                parked = True  # (it yielded)
                continue
            await self._arrived.park()
            parked = True
        message = self._take()
        if not parked:
            await trio.lowlevel.cancel_shielded_checkpoint()
        return message

    def recvfrom_nowait(self) -> tuple[bytes, tuple[str, int]]:
        """The next message if one is here, else ``trio.WouldBlock`` (Linux's recvmsg
        with MSG_DONTWAIT). A server that drains its socket this way answers the
        messages of a burst in one turn of the scheduler, so the node posts the
        answers together."""
        if self.closed:
            raise RdsError(errno.EBADF, "recvfrom on a closed RDS socket")
        if not self.received:
            raise trio.WouldBlock
        return self._take()

    def _take(self) -> tuple[bytes, tuple[str, int]]:
        msg = self.received.popleft()
        if not self.received:
            self.node._holding -= 1
        self.queued_bytes -= len(msg.data)
        if self.queued_bytes < self.node.settings.rcvbuf // 2:
            self.node._set_congested(self.port, False)
        return msg.data, msg.sender

    def _readable(self) -> bool:
        return bool(self.received) or self.closed

    def _push(self, msg: ReceivedMessage) -> None:
        if not self.received:
            self.node._holding += 1
        self.received.append(msg)
        self.queued_bytes += len(msg.data)
        if self._arrived:  # a reader waits (unpark costs even when none does)
            self._arrived.unpark()
        elif self._driving is not None:
            self._driving.interrupt_wait()

    # ------------------------------------------------------------------ RDMA by cookie
    def get_mr(self, buffer: Buffer, *, use_once: bool = False) -> int:
        """Register ``buffer`` (writable) for peers to RDMA into or out of; returns its
        cookie (``RDS_GET_MR``). A ``use_once`` registration ends when the first
        message chasing an RDMA operation on it arrives."""
        if self.closed:
            raise RdsError(errno.EBADF, "get_mr on a closed RDS socket")
        return self._registrations.add(self.node.running_pd(), buffer, use_once=use_once)

    def free_mr(self, cookie: int) -> None:
        """End a registration (``RDS_FREE_MR``); peers' RDMA on it fails from now on."""
        if not self._registrations.free(cookie):
            shown = f"{cookie:#x}" if isinstance(cookie, int) else repr(cookie)
            raise RdsError(errno.EINVAL, f"no RDMA registration with cookie {shown}")

    def registered(self, cookie: int) -> bool:
        """Whether ``cookie`` names one of this socket's live registrations."""
        return cookie in self._registrations

    def close(self) -> None:
        """Unbind and deregister; messages for this port are dropped from now on, and so
        are the ones it sent that no peer has acknowledged (Linux's ``rds_release``)."""
        if not self.closed:
            self.closed = True
            for rds in self.node.connections():
                rds.drop_port(self.port)
            self.node._sockets.pop(self.port, None)
            self.node._set_congested(self.port, False)
            self._registrations.close()
            if self.received:  # dropped, as Linux drops a closed socket's queue
                self.received.clear()
                self.queued_bytes = 0
                self.node._holding -= 1
            self._arrived.unpark_all()
            if self._driving is not None:
                self._driving.interrupt_wait()


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
        self._table = PeerTable(
            self.address, 0, self.settings, deliver=self._deliver,
            on_congestion=self._peer_congestion, session_starting=self._session_starting,
            session_ended=self._session_ended, burst_held=self._burst_held, probe=self._probe,
        )  # fmt: skip
        self._transport = TRANSPORT_TABLE[transport](self._table)
        self._table.transport = self._transport
        self._table.port = self._transport.default_port(self.address) if port is None else port
        self._recent_text: tuple[IPAddress | None, str] = (None, "")
        """The sender address last delivered from, and its text (a sender names the
        same few peers, and formatting an address costs a Python call)."""
        self._sockets: dict[int, RdsSocket] = {}
        self._holding = 0
        """How many sockets hold received messages."""
        self._bursts: dict[BurstHolder, None] = {}
        """Sessions that held back the answers to a burst (:meth:`_answer_bursts`), each
        once."""
        self.drops_no_socket = 0
        self.drops_rcvbuf_full = 0
        """Messages dropped because their socket held ``settings.rcvbuf_limit`` unread."""
        self.loopback_messages = 0
        self.congestion = CongestionMap()
        """This node's ports whose sockets hold more than ``settings.rcvbuf`` bytes unread."""
        self._monitors: list[trio.MemorySendChannel[tuple[str, set[int]]]] = []

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
        async with self._transport.opened(), service_nursery() as nursery:
            self._table.nursery = nursery
            self._table.port = await self._transport.listen(nursery)
            nursery.start_soon(self._table.expire_idle)
            try:
                yield self
            finally:
                self._table.close()
                for sock in list(self._sockets.values()):
                    sock.close()

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

    # ------------------------------------------------------------------ sockets
    def bind(self, port: int) -> RdsSocket:
        """A socket bound to (this node's address, ``port``); port 0 picks a free one."""
        port = _port_number(port)
        if port == 0:
            port = next(p for p in range(32768, 61000) if p not in self._sockets)
        if not 0 < port < 65536:
            raise RdsError(errno.EINVAL, f"port {port} outside 1..65535")
        if port in self._sockets:
            raise RdsError(errno.EADDRINUSE, f"RDS port {port} is in use on {self.address}")
        sock = RdsSocket(self, port)
        self._sockets[port] = sock
        return sock

    def _deliver(self, peer: IPAddress, header: RdsHeader, data: bytes) -> None:
        sport, dport = header.sport, header.dport
        if dport == 0 and sport != 0:  # an RDS ping: answer it, as Linux's rds_send_pong
            if sport == RDS_FLAG_PROBE_PORT:  # the handshake probe
                self._handshake(peer, header)
            self._pong(peer, sport)
            return
        if dport == RDS_FLAG_PROBE_PORT and sport == 0:  # the answer to our probe
            self._handshake(peer, header)
            return
        sock = self._sockets.get(dport)
        if sock is None:
            self.drops_no_socket += 1
            log.info("message from %s:%d for unbound port %d dropped", peer, sport, dport)
            return
        for ext in header.extensions:
            if isinstance(ext, RdmaExt):  # it chases an RDMA operation on one of ours
                sock._registrations.used(ext.rkey)
        if sock.queued_bytes + len(data) > self.settings.rcvbuf_limit:
            self.drops_rcvbuf_full += 1
            log.info(
                "message from %s:%d dropped: port %d holds %d bytes unread (rcvbuf_limit)",
                peer, sport, dport, sock.queued_bytes,
            )  # fmt: skip
            return
        recent = self._recent_text
        if recent[0] is not peer:
            recent = self._recent_text = (peer, _ip_text(peer))
        sock._push(ReceivedMessage(data, (recent[1], sport), header.sequence))
        if sock.queued_bytes > self.settings.rcvbuf:
            self._set_congested(dport, True)

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

    def _handshake(self, peer: IPAddress, header: RdsHeader) -> None:
        """A handshake probe or its answer: note the peer's generation number
        (``recv.c`` ``rds_recv_hs_exthdrs``). We use one path whatever it offers."""
        entry = self._peers.get(peer)
        generation = next((e.gen_num for e in header.extensions if isinstance(e, GenNumExt)), 0)
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
        self._send_map(rds)
        if self._transport.capabilities.handshake_probe:
            self._probe(rds)

    def _session_ended(self, session: Carrier) -> None:
        """Nothing is to be answered for a session that ended."""
        if session in self._bursts:
            self._bursts = {held: None for held in self._bursts if held is not session}

    # ------------------------------------------------------------------ congestion
    def _set_congested(self, port: int, congested: bool) -> None:
        if congested == self.congestion.test(port):
            return
        if congested:
            self.congestion.set(port)
        else:
            self.congestion.clear(port)
        log.debug("RDS %s port %d %scongested", self.address, port, "" if congested else "un")
        for entry in self._peers.values():
            if entry.rds.session is not None:
                self._send_map(entry.rds)

    def _send_map(self, rds: RdsConnection) -> None:
        rds.queue_map(self.congestion.encode())
        if rds.session is not None:
            rds.session.pump_sends()

    def _peer_congestion(self, rds: RdsConnection, ports: set[int]) -> None:
        entry = self._peers.get(rds.peer)
        if entry is not None:
            entry.uncongested.set()
        for monitor in list(self._monitors):
            try:
                monitor.send_nowait((str(rds.peer), ports))
            except trio.WouldBlock:  # a peer flipping its map cannot fill our memory
                log.debug("congestion monitor %d changes behind: one dropped", MONITOR_BACKLOG)
            except trio.BrokenResourceError:
                self._monitors.remove(monitor)

    @asynccontextmanager
    async def monitor_congestion(
        self,
    ) -> AsyncIterator[trio.MemoryReceiveChannel[tuple[str, set[int]]]]:
        """Congestion changes of peer ports, as (peer address, ports that changed).

        ``async with node.monitor_congestion() as updates: async for peer, ports in updates``;
        ``port in node.peer_congestion(peer)`` tells the current state. A monitor
        :data:`MONITOR_BACKLOG` changes behind misses the changes after those.
        """
        send, recv = trio.open_memory_channel[tuple[str, set[int]]](MONITOR_BACKLOG)
        self._monitors.append(send)
        try:
            async with recv:
                yield recv
        finally:
            if send in self._monitors:
                self._monitors.remove(send)

    def peer_congestion(self, peer: str) -> CongestionMap:
        """The congestion map the node at ``peer`` last sent."""
        entry = self._peers.get(ipaddress.ip_address(peer))
        return entry.rds.peer_congestion if entry is not None else CongestionMap()

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
        header = RdsHeader(self.loopback_messages, 0, len(data), sport, dport)
        self._deliver(self.address, header, bytes(data))

    def _send(
        self, entry: Peer, sport: int, dport: int, data: bytes, rdma: RdmaOp | None = None
    ) -> None:
        """Queue a message on the connection of ``entry`` (from :meth:`PeerTable.lookup`)."""
        if rdma is not None:
            try:
                rdma._begin(self.running_pd())
            except ValueError as exc:
                raise RdsError(errno.EINVAL, str(exc)) from exc
        rds = entry.rds
        rds.queue(sport, dport, data, rdma=rdma)
        session = rds.session  # (PeerTable.pump, inline: a call per message less)
        if session is None:
            self._table.start_connector(entry)
        else:
            session.pump_sends()
