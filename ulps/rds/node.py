"""RDS nodes and sockets: reliable, ordered datagrams between (IP, port) endpoints.

An :class:`RdsNode` is this machine's RDS presence on one local IP address. It
listens for RDS connections (unless told otherwise on Linux's port: ``RDS_PORT``
for IPv4 over RDMA, ``RDS_CM_PORT`` for IPv6 and for TCP) on its transport,
``"rdma"`` (rdma_cm and RC queue pairs, Linux's ``rds_rdma``) or ``"tcp"``
(Linux's ``rds_tcp``, :mod:`.tcp`), and keeps one
:class:`RdsConnection` per peer node, shared by all its sockets. The lower
address initiates, as Linux RDS does; when both sides start at once, the lower
address's attempt wins, so two nodes never build two connections.
:class:`RdsSocket` is a socket bound to (node address, port)::

    async with RdsNode("10.0.0.1") as node:
        sock = node.bind(4000)
        await sock.sendto(b"hello", ("10.0.0.2", 4000))
        data, (ip, port) = await sock.recvfrom()

Over RDMA everything here uses only the portable verbs and rdma_cm API.
"""

from __future__ import annotations

import dataclasses
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

from rdmashim.cm import (
    CMError,
    Connection,
    ConnectionRejected,
    ConnectionRequest,
    open_connection,
    open_device_for,
    serve,
)
from rdmashim.ulps.rds.connection import IPAddress, RdsConnection
from rdmashim.ulps.rds.rdma import RdmaOp, RdmaStatus, Registrations
from rdmashim.ulps.rds.rdma_flow import RECV_SLOTS
from rdmashim.ulps.rds.rdma_session import Session
from rdmashim.ulps.rds.settings import TRANSPORTS, RdsSettings, Transport
from rdmashim.ulps.rds.tcp import TcpSession, tune
from rdmashim.ulps.rds.transport import SessionLost
from rdmashim.ulps.rds.wire import (
    RDS_CM_PORT,
    RDS_FLAG_PROBE_PORT,
    RDS_MAX_MSG_SIZE,
    RDS_PORT,
    CongestionMap,
    ConnectPrivate,
    GenNumExt,
    NpathsExt,
    RdmaExt,
    RdsHeader,
)
from rdmashim.verbs.attrs import QPCap
from rdmashim.verbs.busypoll import spin_until
from rdmashim.verbs.errors import integer
from rdmashim.verbs.tasks import service_nursery

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from rdmashim.verbs.abc import CQ, PD

log = logging.getLogger(__name__)


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


QP_CAP = QPCap(max_send_wr=128, max_recv_wr=RECV_SLOTS, max_send_sge=1, max_recv_sge=1)
"""The queues of a session's QP; :attr:`RdsNode` adds the inline bytes its device takes."""
MAX_INLINE = 128
"""Inline bytes a session asks for at most (where the device takes them): a Send that
fits (a standalone ack, a header and a small message) is copied when posted, which
the built-in engine frames in its batch paths."""
RDS_TCP_NPATHS = 1
"""Paths we announce in the handshake probe: one (Linux offers up to
``RDS_MPATH_WORKERS``, 8; the peer then uses the smaller number)."""
MONITOR_BACKLOG = 1024
"""Congestion changes a monitor may fall behind by; later ones are dropped for it."""


def default_port(address: IPAddress, transport: Transport) -> int:
    """The port Linux's RDS listens on and connects to: ``RDS_PORT`` (18634) for IPv4
    over RDMA, ``RDS_CM_PORT`` (16385) for IPv6 over RDMA and for TCP
    (``rdma_transport.c`` ``rds_rdma_listen_init``, ``ib_cm.c``
    ``rds_ib_conn_path_connect``, ``tcp_listen.c``)."""
    if transport == "rdma" and address.version == 4:
        return RDS_PORT
    return RDS_CM_PORT


class RdsError(OSError):
    """An RDS operation failed; ``errno`` says how."""


@dataclass(eq=False)
class _Peer:
    """A peer node: its connection and the task that keeps a session up."""

    rds: RdsConnection
    connecting: bool = False
    poked: bool = False
    """RDS/TCP: the peer connected to ask us, the lower address, to connect."""
    redial: bool = False
    """RDS/TCP: our session, the lower address's, ended without our closing it. Linux's
    higher address never connects again by itself: it knocks only when it sends anew,
    and waits for the lower one with whatever it had not delivered (``threads.c``
    ``rds_queue_reconnect``), so we connect again, as Linux's lower address does, until
    a session is up or the peer has been idle for ``peer_idle_expiry``."""
    knocked: trio.Event = field(default_factory=trio.Event)
    """RDS/TCP: set by a knock, which ends the wait between our attempts to connect:
    the peer is there now."""
    connector: trio.CancelScope | None = None
    session_scope: trio.CancelScope | None = None
    unreachable: BaseException | None = None
    unreachable_until: float = 0.0
    failures: int = 0
    uncongested: trio.Event = field(default_factory=trio.Event)
    """Set when a port of the peer stops being congested (senders wait on it)."""
    room: trio.Event = field(default_factory=trio.Event)
    """Set when the connection's queue may have room again (senders wait on it)."""

    def room_opened(self) -> None:
        """The connection's ``on_room``: wake the senders waiting for room."""
        self.room.set()

    async def wait_room(self) -> None:
        """Wait until the connection's queue has room for another message."""
        rds = self.rds
        while not rds.has_room:
            if self.room.is_set():  # shared by every waiter: replacing it strands the others
                self.room = trio.Event()
            rds.room_wanted = True
            await self.room.wait()


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
    _driving: CQ | TcpSession | None = None
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
            entry = node._connection(ip)
            rds = entry.rds
            if not rds.has_room:
                await entry.wait_room()
            elif rds.peer_congestion.test(port):
                if entry.uncongested.is_set():  # shared by every waiter, as wait_room's
                    entry.uncongested = trio.Event()
                await entry.uncongested.wait()
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
        entry = node._connection(ip)
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
            drivable = node._drivable()
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
            for entry in self.node._peers.values():
                entry.rds.drop_port(self.port)
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
        self.port = default_port(self.address, transport) if port is None else port
        self.transport: Transport = transport
        """``"rdma"`` or ``"tcp"``: what carries the node's connections."""
        self.generation = random.getrandbits(32) | 1
        """This node's generation number, sent in the RDS/TCP handshake probe: a peer
        that sees it change knows we restarted (Linux's ``c_my_gen_num``)."""
        self.settings = settings or RdsSettings()
        """The node's bounds and timers (:class:`RdsSettings`)."""
        self._peers: dict[IPAddress, _Peer] = {}
        self._recent: tuple[IPAddress, _Peer] | None = None
        """The peer last looked up and its entry: senders name the same address object
        again (``_parse_ip`` remembers it), and hashing an address costs a Python call."""
        self._recent_text: tuple[IPAddress | None, str] = (None, "")
        """The sender address last delivered from, and its text (same reason)."""
        self._sockets: dict[int, RdsSocket] = {}
        self._holding = 0
        """How many sockets hold received messages."""
        self._bursts: dict[Session, None] = {}
        """Sessions that held back the answers to a burst (:meth:`_answer_bursts`), each
        once."""
        self._nursery: trio.Nursery | None = None
        self.pd: PD | None = None
        """The protection domain every connection and RDMA registration of the node uses."""
        self.drops_no_socket = 0
        self.drops_rcvbuf_full = 0
        """Messages dropped because their socket held ``settings.rcvbuf_limit`` unread."""
        self.peers_expired = 0
        """Peer entries dropped for idleness (``settings.peer_idle_expiry``) or room."""
        self.loopback_messages = 0
        self.congestion = CongestionMap()
        """This node's ports whose sockets hold more than ``settings.rcvbuf`` bytes unread."""
        self._monitors: list[trio.MemorySendChannel[tuple[str, set[int]]]] = []
        self._qp_cap = QP_CAP
        """:data:`QP_CAP` with as many inline bytes as the device takes, up to
        :data:`MAX_INLINE` (set when the node starts)."""

    # ------------------------------------------------------------------ lifetime
    @asynccontextmanager
    async def _run(self) -> AsyncIterator[RdsNode]:
        if self.transport == "tcp":
            async with service_nursery() as nursery:
                self._nursery = nursery
                listeners = await trio.open_tcp_listeners(self.port, host=str(self.address))
                self.port = listeners[0].socket.getsockname()[1]
                nursery.start_soon(trio.serve_listeners, self._tcp_incoming, listeners)
                async with self._running(nursery):
                    yield self
            return
        async with open_device_for(str(self.address)) as ctx, service_nursery() as nursery:
            self.pd = ctx.alloc_pd()
            self._nursery = nursery
            inline = min(MAX_INLINE, ctx.query_device().max_inline_data)
            self._qp_cap = dataclasses.replace(QP_CAP, max_inline_data=inline)
            local = await nursery.start(
                lambda task_status: serve(
                    self._incoming, self.port, host=str(self.address), cap=self._qp_cap,
                    cqe=1024, pd=self.pd, task_status=task_status,
                )
            )  # fmt: skip
            self.port = local[1]
            async with self._running(nursery):
                yield self

    @asynccontextmanager
    async def _running(self, nursery: trio.Nursery) -> AsyncIterator[None]:
        """The node's life once it listens, whatever the transport."""
        nursery.start_soon(self._expire_idle)
        try:
            yield
        finally:
            for entry in self._peers.values():
                entry.rds.drop_all(RdmaStatus.CANCELED, "the RDS node closed")
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
        EOPNOTSUPP over TCP, which has no RDMA)."""
        if self.transport == "tcp":
            raise RdsError(
                errno.EOPNOTSUPP,
                "RDMA by cookie needs the rdma transport; this RDS node runs over tcp",
            )
        if self.pd is None:
            raise RdsError(errno.ENOTCONN, "the RDS node is not running")
        return self.pd

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
        probe = sport == RDS_FLAG_PROBE_PORT and self.transport == "tcp"
        entry.rds.queue(
            0, sport, b"", extensions=self._probe_extensions() if probe else (), own=True
        )
        self._pump(entry)

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
        up = entry.rds.session is not None and not entry.rds.session.lost
        return (
            ("s" if up and entry.rds.unsent else "-")
            + ("c" if entry.connecting else "-")
            + ("C" if up else "-")
            + ("E" if entry.unreachable else "-")
        )

    # ------------------------------------------------------------------ connections
    def connections(self) -> list[RdsConnection]:
        """Every peer connection (for counters and rds-info)."""
        return [p.rds for p in self._peers.values()]

    def _new_peer(self, peer: IPAddress) -> _Peer:
        """A new entry for ``peer``, or RdsError saying why there is none."""
        if peer.version != self.address.version:
            raise RdsError(errno.EAFNOSUPPORT, f"{peer} and {self.address} differ in family")
        entry = self._new_entry(peer)
        if entry is None:
            raise RdsError(
                errno.ENOBUFS,
                f"no room for RDS peer {peer}: {len(self._peers)} peers, none idle "
                f"(max_peers={self.settings.max_peers})",
            )
        return entry

    def _drivable(self) -> CQ | TcpSession | None:
        """What a waiting reader may drive: the CQ of the node's only session, or the
        session itself over TCP (a node with several peers has its messages come from
        several connections)."""
        if len(self._peers) != 1:
            return None
        session = next(iter(self._peers.values())).rds.session
        if session is None or session.lost:
            return None
        if isinstance(session, Session):
            return session.cq
        return session if isinstance(session, TcpSession) else None

    def _connection(self, peer: IPAddress) -> _Peer:
        recent = self._recent
        if recent is not None and recent[0] is peer:
            entry = recent[1]
        else:
            entry = self._peers.get(peer) or self._new_peer(peer)
            self._recent = (peer, entry)
        if entry.unreachable is not None and entry.rds.session is None:
            if trio.current_time() >= entry.unreachable_until:
                entry.unreachable = None  # it may be back: this message tries again
                entry.failures = 0
                return entry
            exc = entry.unreachable
            raise RdsError(errno.EHOSTUNREACH, f"no RDS node at {peer}: {exc}") from exc
        return entry

    def _burst_held(self, session: Session) -> None:
        self._bursts[session] = None

    def _answer_bursts(self) -> None:
        """Post the answers sessions hold back for their bursts (see
        :meth:`Session.answer_burst`)."""
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
        self, entry: _Peer, sport: int, dport: int, data: bytes, rdma: RdmaOp | None = None
    ) -> None:
        """Queue a message on the connection of ``entry`` (from :meth:`_connection`)."""
        if rdma is not None:
            try:
                rdma._begin(self.running_pd())
            except ValueError as exc:
                raise RdsError(errno.EINVAL, str(exc)) from exc
        entry.rds.queue(sport, dport, data, rdma=rdma)
        self._pump(entry)

    def _pump(self, entry: _Peer) -> None:
        """Something was queued on the peer's connection: its session sends it, or a
        session is started."""
        session = entry.rds.session
        if session is None:
            self._start_connector(entry)
        else:
            session.pump_sends()

    def _start_connector(self, entry: _Peer) -> None:
        """Start keeping a session to the peer up, unless that is already under way."""
        if entry.connector is None and self._nursery is not None:
            entry.connector = trio.CancelScope()
            self._nursery.start_soon(self._connect, entry, entry.connector)

    def _new_entry(self, peer: IPAddress) -> _Peer | None:
        """A new peer entry, making room for it if need be (None: no room)."""
        if len(self._peers) >= self.settings.max_peers:
            now = trio.current_time()
            idle = [(e.rds.active_at(now), p) for p, e in self._peers.items() if self._droppable(e)]
            if not idle:
                return None
            self._drop_peer(min(idle)[1], "to make room")
        rds = RdsConnection(
            self.address, peer, self._deliver, on_congestion=self._peer_congestion,
            settings=self.settings, last_active=trio.current_time(),
        )  # fmt: skip
        entry = self._peers[peer] = _Peer(rds)
        rds.on_room = entry.room_opened
        return entry

    @staticmethod
    def _droppable(entry: _Peer) -> bool:
        """Whether the entry holds nothing that would be lost: no session, no task, no
        message (its sequence numbers start afresh when the peer comes back)."""
        rds = entry.rds
        return (
            rds.session is None and entry.connector is None and entry.session_scope is None
            and not rds.pending and not entry.poked
        )  # fmt: skip

    def _drop_peer(self, peer: IPAddress, why: str) -> None:
        entry = self._peers.pop(peer)
        self._recent = None
        self.peers_expired += 1
        entry.uncongested.set()  # senders waiting on it look the peer up again
        entry.room.set()
        log.info("RDS %s forgets peer %s (%s)", self.address, peer, why)

    async def _expire_idle(self) -> None:
        """Close idle sessions and drop idle peer entries (``settings.peer_idle_expiry``)."""
        while True:
            await trio.sleep(min(self.settings.peer_idle_expiry / 4, 1.0))
            self._expire(trio.current_time())

    def _expire(self, now: float) -> None:
        for peer, entry in list(self._peers.items()):
            rds = entry.rds
            if now - rds.active_at(now) < self.settings.peer_idle_expiry or rds.pending:
                continue
            if entry.session_scope is not None:
                log.debug("RDS %s closes its idle session with %s", self.address, peer)
                entry.session_scope.cancel()
            elif self._droppable(entry):
                self._drop_peer(peer, f"idle for {now - rds.last_active:.0f} s")

    def _private(self, rds: RdsConnection) -> bytes:
        return ConnectPrivate(
            rds.local, rds.peer, ack_seq=rds.next_recv - 1, credit=RECV_SLOTS
        ).encode()

    async def _connect(self, entry: _Peer, scope: trio.CancelScope) -> None:
        """Keep a session to the peer up while there is something to send."""
        rds, settings = entry.rds, self.settings
        window = settings.reconnect_min
        with scope:
            try:
                while rds.session is None and (
                    rds.pending or entry.poked or self._redial_due(entry)
                ):
                    if not rds.canonical and entry.failures == 0:
                        # give the canonical side the first move
                        await trio.sleep(settings.reconnect_min)
                        if rds.connected:  # the peer's connection came meanwhile
                            break
                    refused = rds.counters.sessions_refused
                    if entry.knocked.is_set():
                        entry.knocked = trio.Event()
                    try:
                        if self.transport == "tcp":
                            await self._tcp_active(entry)
                        else:
                            await self._active_session(entry)
                        if rds.counters.sessions_refused == refused:  # else: backing off on
                            window = settings.reconnect_min
                    except (CMError, OSError) as exc:
                        if isinstance(exc, ConnectionRejected) and exc.errno == errno.ECONNRESET:
                            # Its RDS answered (rdma_reject): reachable, only busy, as Linux
                            # is while its own connect is under way (ib_cm.c
                            # rds_ib_cm_handle_connect): no step towards giving up.
                            log.info("RDS connect to %s rejected by its RDS: %s", rds.peer, exc)
                        else:
                            entry.failures += 1
                            log.info(
                                "RDS connect to %s failed (%d): %s", rds.peer, entry.failures, exc
                            )
                        if entry.failures >= settings.give_up_after and not rds.counters.sessions:
                            self._unreachable(entry, exc)
                            return
                    # Linux's backoff (rds_queue_reconnect): the window doubles up to a
                    # maximum; we wait in its upper half, so the attempts thin out for sure.
                    # A knock ends the wait: the peer is there now.
                    with trio.move_on_after(random.uniform(window / 2, window)):
                        await entry.knocked.wait()
                    window = min(window * 2, settings.reconnect_max)
            finally:
                entry.connector = None
                entry.connecting = False

    def _redial_due(self, entry: _Peer) -> bool:
        """Whether to connect again after losing the session (:attr:`_Peer.redial`); not
        once the peer has been idle for ``peer_idle_expiry`` (Linux tries for ever)."""
        if entry.redial:
            now = trio.current_time()
            entry.redial = now - entry.rds.active_at(now) < self.settings.peer_idle_expiry
        return entry.redial

    async def _active_session(self, entry: _Peer) -> None:
        rds = entry.rds
        holder: list[Session] = []

        def prepare(conn: Connection) -> None:
            if holder:  # an attempt open_connection gave up on (its QP is gone)
                holder.pop().close()
            holder.append(Session(rds, conn, self._burst_held))

        entry.connecting = True
        try:
            async with open_connection(
                str(rds.peer), self.port, private_data=self._private(rds), cap=self._qp_cap,
                cqe=1024, pd=self.pd, prepare=prepare,
            ) as conn:  # fmt: skip
                entry.connecting = False
                theirs = ConnectPrivate.decode(conn.private_data, ipv6=rds.peer.version == 6)
                holder[0].peer_credits(theirs.credit)
                await self._run_session(entry, holder[0], theirs.ack_seq)
        finally:
            entry.connecting = False
            if holder:  # the QP is gone: its buffers can go
                holder[0].close()

    async def _incoming(self, request: ConnectionRequest) -> None:
        ipv6 = self.address.version == 6
        try:
            theirs = ConnectPrivate.decode(request.private_data, ipv6=ipv6)
        except ValueError as exc:
            log.warning("RDS connect from %s with bad private data: %s", request.peer_addr, exc)
            await request.reject(b"")
            return
        if theirs.saddr == self.address:
            log.warning("RDS connect from %s claims our own address", request.peer_addr)
            await request.reject(b"")
            return
        entry = self._peers.get(theirs.saddr) or self._new_entry(theirs.saddr)
        if entry is None:
            log.warning(
                "RDS connect from %s rejected: %d peers, none idle (max_peers)",
                theirs.saddr, len(self._peers),
            )  # fmt: skip
            await request.reject(b"")
            return
        live = entry.rds.session is not None and not entry.rds.session.lost
        log.debug(
            "RDS %s: request from %s (connecting=%s live=%s canonical=%s)",
            self.address, theirs.saddr, entry.connecting, live, entry.rds.canonical,
        )  # fmt: skip
        if entry.rds.canonical and (entry.connecting or live):
            # Ours, from the lower address, wins (or is already up): one connection per pair.
            log.debug("RDS %s rejects %s: ours wins", self.address, theirs.saddr)
            await request.reject(b"")
            return
        if entry.connector is not None and not entry.rds.canonical:
            entry.connector.cancel()
        session = Session(entry.rds, request, self._burst_held)
        try:
            conn = await request.accept(private_data=self._private(entry.rds))
            session.conn = conn
            session.peer_credits(theirs.credit)
            await self._run_session(entry, session, theirs.ack_seq)
        finally:
            with trio.CancelScope(shield=True):
                await request.aclose()  # the QP is gone: its buffers can go
            session.close()

    async def _tcp_active(self, entry: _Peer) -> None:
        """One RDS/TCP connect. The lower address's connection carries the traffic;
        the higher address only knocks: it connects and closes at once, and the
        lower one connects back (``tcp_connect.c`` ``rds_tcp_state_change``,
        ``tcp_listen.c`` ``rds_tcp_accept_one_path``). Raises OSError when nothing
        came of it."""
        rds = entry.rds
        entry.connecting = True
        try:
            stream = await trio.open_tcp_stream(
                str(rds.peer), self.port, local_address=str(self.address)
            )
        finally:
            entry.connecting = False
        async with stream:
            tune(stream.socket)
            if rds.canonical:
                entry.poked = False
                await self._run_session(entry, TcpSession(rds, stream), 0)
                return
        with trio.move_on_after(self.settings.reconnect_max):
            while rds.session is None:  # noqa: ASYNC110 - woken by the peer's connection
                await trio.sleep(self.settings.reconnect_min)
        if rds.session is None:
            raise OSError(errno.ETIMEDOUT, f"RDS/TCP node {rds.peer} did not connect back")

    async def _tcp_incoming(self, stream: trio.SocketStream) -> None:
        """A TCP connection to our RDS port (see :meth:`_tcp_active` for who connects)."""
        async with stream:
            try:
                peer = ipaddress.ip_address(stream.socket.getpeername()[0])
            except OSError:  # gone already
                return
            if peer == self.address or peer.version != self.address.version:
                log.warning("RDS/TCP connection from %s refused", peer)
                return
            entry = self._peers.get(peer) or self._new_entry(peer)
            if entry is None:
                log.warning(
                    "RDS/TCP connection from %s refused: %d peers, none idle (max_peers)",
                    peer, len(self._peers),
                )  # fmt: skip
                return
            rds = entry.rds
            if rds.canonical:
                # The higher address knocked: close, and connect ourselves.
                log.debug("RDS/TCP %s: %s knocked", self.address, peer)
                entry.poked = True
                session = rds.session
                if isinstance(session, TcpSession) and not session.lost:
                    # Either a knock that was on its way while ours connected, or the
                    # peer lost its end (it rebooted, say). A probe on our connection
                    # tells them apart: a peer without the connection resets it, and
                    # the session's end connects anew (poked); a live one answers.
                    log.info("RDS/TCP %s: %s knocked while connected; probing", self.address, peer)
                    if rds.has_room:
                        self._probe(rds)
                else:
                    entry.knocked.set()
                    self._start_connector(entry)
                return
            tune(stream.socket)
            if entry.connector is not None:
                entry.connector.cancel()  # a knock of ours, now answered
            await self._run_session(entry, TcpSession(rds, stream), 0)

    async def _run_session(
        self, entry: _Peer, session: Session | TcpSession, peer_ack: int
    ) -> None:
        """Carry the connection on a new session until it ends. ``peer_ack``: the last
        message the peer says it has (RDMA private data; 0 over TCP, where what
        TCP acknowledged is known already)."""
        rds = entry.rds
        if entry.session_scope is not None:
            entry.session_scope.cancel()  # a stale session the peer has given up on
        if rds.session is not None:
            rds.session.lost = True
        entry.unreachable = None
        entry.failures = 0
        entry.redial = False
        rds.resume(peer_ack)
        # Every new session starts with our map: a port that filled up or drained
        # while no session was up would otherwise stay wrong at the peer for good.
        self._send_map(rds)
        if self.transport == "tcp":
            self._probe(rds)
        rds.session = session
        rds.last_active = trio.current_time()
        log.debug("RDS session %s -> %s up (peer acked %d)", rds.local, rds.peer, peer_ack)
        with trio.CancelScope() as scope:
            entry.session_scope = scope
            try:
                await session.run()
            except SessionLost as exc:
                log.info("RDS session with %s lost: %s", rds.peer, exc)
                entry.redial = self.transport == "tcp" and rds.canonical
            finally:
                if rds.session is session:
                    rds.session = None
                if isinstance(session, Session):  # nothing to answer for it any more
                    self._bursts.pop(session, None)
                rds.last_active = trio.current_time()
                if entry.session_scope is scope:
                    entry.session_scope = None
        if rds.pending or entry.poked or entry.redial:
            self._start_connector(entry)

    def _unreachable(self, entry: _Peer, exc: BaseException) -> None:
        rds = entry.rds
        entry.unreachable = exc
        entry.unreachable_until = trio.current_time() + self.settings.unreachable_for
        dropped = rds.drop_all(RdmaStatus.DROPPED, f"RDS node {rds.peer} is unreachable")
        log.warning("RDS node %s unreachable; %d queued messages dropped", rds.peer, dropped)
