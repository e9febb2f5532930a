"""RDS sockets: what a program binds, sends from and receives on.

An :class:`RdsSocket` is bound to (node address, port) by
:meth:`RdsNode.bind <rdmashim.ulps.rds.node.RdsNode.bind>`. It sends to any
(IP, port) over the connection its node keeps with that peer (:mod:`.peers`),
waiting while the connection's queue is full or the destination port is congested,
and receives the messages its node delivers to its port, in order per sender
(:class:`~rdmashim.ulps.rds.inbox.ReceivedMessage`, from its :mod:`.inbox`). A reader
waiting on a node with one peer drives that peer's session itself
(:meth:`RdsSocket.recvfrom`). Sockets know their node only as a :class:`SocketHost`.
"""

from __future__ import annotations

import errno
import functools
import ipaddress
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import trio

from rdmashim.ulps.rds.congestion import NodeCongestion
from rdmashim.ulps.rds.connection import IPAddress, RdsConnection
from rdmashim.ulps.rds.errors import RdsError
from rdmashim.ulps.rds.inbox import Inbox, Inboxes
from rdmashim.ulps.rds.peer import Peer
from rdmashim.ulps.rds.peers import PeerTable
from rdmashim.ulps.rds.rdma import RdmaOp, Registrations, Sources
from rdmashim.ulps.rds.settings import RdsSettings
from rdmashim.ulps.rds.transport import BurstHolder, Drivable
from rdmashim.ulps.rds.wire import RDS_MAX_MSG_SIZE
from rdmashim.verbs.busypoll import spin_until
from rdmashim.verbs.errors import integer

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from rdmashim.verbs.abc import PD


class SocketHost(Protocol):
    """The node, as its sockets see it (:class:`~rdmashim.ulps.rds.node.RdsNode`; the
    members with a leading underscore are the package's, not a program's)."""

    address: IPAddress
    settings: RdsSettings
    _table: PeerTable
    _congestion: NodeCongestion
    _sockets: dict[int, RdsSocket]
    _inboxes: Inboxes
    """The sockets' receive queues (``counts.holding``: how many hold messages)."""
    _bursts: dict[BurstHolder, None]
    _acks: dict[BurstHolder, None]

    def running_pd(self) -> PD:
        """The PD of RDMA by cookie, or RdsError."""
        ...

    def _rdma_sources(self) -> Sources:
        """The RDMA Write sources kept on the running PD, or RdsError."""
        ...

    def connections(self) -> list[RdsConnection]:
        """Every peer connection."""
        ...

    def _answer_bursts(self) -> None:
        """Post the answers sessions hold back for their bursts."""

    def _acks_needed(self) -> None:
        """Send the acknowledgements sessions hold back unless a message carries them."""

    def _send_loopback(self, sport: int, dport: int, data: bytes, rdma: RdmaOp | None) -> None:
        """Deliver a message to the node's own address."""


_ROUTES_KEPT = 64
"""Destinations a socket keeps parsed (:attr:`RdsSocket._routes`); then it starts afresh."""


@functools.lru_cache(maxsize=1024)
def _parse_ip(text: str) -> IPAddress:
    """``ipaddress.ip_address``, remembered: a sender names the same few peers."""
    return ipaddress.ip_address(text)


def port_number(port: object) -> int:
    """``port`` as an int (:func:`~rdmashim.verbs.errors.integer`), or EINVAL."""
    number = integer(port)
    if number is None:
        raise RdsError(errno.EINVAL, f"port {port!r} is not an integer")
    return number


@dataclass(eq=False)
class RdsSocket:
    """An RDS socket bound to (node address, port)."""

    node: SocketHost
    port: int
    received: Inbox
    """Messages not yet taken by :meth:`recvfrom`, oldest first (``len`` counts them)."""
    closed: bool = False
    congested: bool = False
    """The node marked this socket's port congested (it held more than ``rcvbuf`` bytes
    unread); :meth:`recvfrom` clears the mark once it holds less than half that."""
    _arrived: trio.lowlevel.ParkingLot = field(default_factory=trio.lowlevel.ParkingLot)
    _driving: Drivable | None = None
    """The CQ a reader drives while it waits (see :meth:`recvfrom`)."""
    _registrations: Registrations = field(init=False)
    _routes: dict[tuple[str, int], tuple[IPAddress, int, bool]] = field(default_factory=dict)
    """Destinations this socket sent to, as :meth:`_route` found them: (IP, port, whether
    it is the node's own address). A sender names the same few, and parsing and comparing
    an address cost Python calls per message."""

    def __post_init__(self) -> None:
        self._registrations = Registrations(self.received.counts)

    @property
    def queued_bytes(self) -> int:
        """Bytes of the messages not yet taken."""
        return int(self.received.counts.nbytes)

    @property
    def address(self) -> tuple[str, int]:
        """(IP, port) this socket is bound to."""
        return (str(self.node.address), self.port)

    def _check(self, data: bytes, dest: tuple[str, int]) -> tuple[IPAddress, int, bool]:
        """Whether this socket may send ``data`` to ``dest``: (IP, port, whether it is the
        node's own address), or RdsError saying why not."""
        if self.closed:
            raise RdsError(errno.EBADF, "sendto on a closed RDS socket")
        limit = min(RDS_MAX_MSG_SIZE, self.node.settings.sndbuf)  # Linux: both bound it
        if len(data) > limit:
            raise RdsError(errno.EMSGSIZE, f"{len(data)}-byte message exceeds RDS's {limit}")
        try:
            route = self._routes.get(dest) if dest.__class__ is tuple else None
        except TypeError:  # (an unhashable part: _route says which)
            route = None
        if route is None or dest[1].__class__ is not int:  # (True == 1: not the same port)
            route = self._route(dest)
        return route

    def _route(self, dest: tuple[str, int]) -> tuple[IPAddress, int, bool]:
        """:meth:`_check`'s look at ``dest``, kept in :attr:`_routes` when it is a tuple
        of a string and an int."""
        try:
            host, port = dest
        except (ValueError, TypeError) as exc:
            raise RdsError(errno.EINVAL, f"{dest!r} is not an (address, port) pair") from exc
        try:
            ip = _parse_ip(host)
        except (ValueError, TypeError) as exc:
            raise RdsError(errno.EINVAL, f"{host!r} is not an IP address") from exc
        if port.__class__ is not int:
            port = port_number(port)
        if not 0 <= port < 65536:  # port 0: an RDS ping, answered by the node
            raise RdsError(errno.EINVAL, f"port {port} outside 0..65535 (0: an RDS ping)")
        route = (ip, port, ip == self.node.address)
        if dest.__class__ is tuple and host.__class__ is str and dest[1].__class__ is int:
            if len(self._routes) >= _ROUTES_KEPT:
                self._routes.clear()
            self._routes[dest] = route
        return route

    async def sendto(
        self, data: bytes, dest: tuple[str, int], *, rdma: RdmaOp | None = None
    ) -> None:
        """Send one message to (IP, port), with an RDMA operation to run before it.

        Waits while the connection's queue is full or the destination port is
        congested (its receiver is full). ``await rdma.wait()`` tells how the
        operation ended (see :mod:`rdmashim.ulps.rds.rdma`).
        """
        if self._sent_directly(data, dest, rdma):
            return
        ip, port, own = self._check(data, dest)
        node = self.node
        if own:
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
        self._queue(entry, port, data, rdma)

    def sendto_nowait(
        self, data: bytes, dest: tuple[str, int], *, rdma: RdmaOp | None = None
    ) -> None:
        """Send without waiting; raises ``trio.WouldBlock`` while the queue is full."""
        if self._sent_directly(data, dest, rdma):
            return
        ip, port, own = self._check(data, dest)
        node = self.node
        if own:
            node._send_loopback(self.port, port, data, rdma)
            return
        entry = node._table.lookup(ip)
        if entry.rds.peer_congestion.test(port):
            raise RdsError(errno.ENOBUFS, f"RDS port {port} on {ip} is congested")
        if not entry.rds.has_room:
            raise trio.WouldBlock
        self._queue(entry, port, data, rdma)

    async def recvfrom(self) -> tuple[bytes, tuple[str, int]]:
        """The next message for this socket and its sender's (IP, port)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        parked = False
        while True:
            if self.closed:
                raise RdsError(errno.EBADF, "recvfrom on a closed RDS socket")
            if self.received.counts.count:
                break
            node = self.node
            if not node._inboxes.counts.holding and node._bursts:  # every receiver has answered
                node._answer_bursts()
            if node._acks:  # (after the answers: they carry acknowledgements)
                node._acks_needed()
            drivable = node._table.drivable()
            if drivable is not None:
                self._driving = drivable
                try:
                    driven = await drivable.drive_until(self._readable, self.port)
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
        if self.received.counts.count and self._arrived:
            # Messages the reader driving the session took for its own socket woke no one:
            # another reader parked here takes the next one.
            self._arrived.unpark()
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
        if not self.received.counts.count:
            raise trio.WouldBlock
        return self._take()

    def _take(self) -> tuple[bytes, tuple[str, int]]:
        msg = self.received.take()
        if self.congested and self.received.counts.nbytes < self.node.settings.rcvbuf // 2:
            self.congested = False
            self.node._congestion.mark(self.port, False)
        return msg.data, msg.sender

    def _readable(self) -> bool:
        return self.closed or bool(self.received.counts.count)

    def _wake(self) -> None:
        """A message was queued: wake a reader (the one parked, or the one driving)."""
        if self._arrived:  # a reader waits (unpark costs even when none does)
            self._arrived.unpark()
        elif self._driving is not None:
            self._driving.interrupt_wait()

    def _sent_directly(self, data: bytes, dest: tuple[str, int], rdma: RdmaOp | None) -> bool:
        """Whether a plain message, or one chasing an RDMA Write from ``bytes``, went in
        one call into C (``rp_sendto``): its session sends in C and keeps the gate open
        (:class:`~.connection.DirectSends`: nothing of the connection's waits, it has
        room, the port is not congested), and ``dest`` is a peer's (IP, port) this socket
        sent to before, ``data`` bytes."""
        if dest.__class__ is not tuple or data.__class__ is not bytes or self.closed:
            return False
        try:
            route = self._routes.get(dest)
        except TypeError:  # (an unhashable part: _check says which)
            return False
        if (
            route is not None and dest[1].__class__ is int and not route[2]  # (see _check)
            and (entry := self.node._table.known(route[0])) is not None
            and (direct := entry.rds.direct) is not None
            and (
                went := direct.sendto(self.port, route[1], data, len(data)) if rdma is None
                else direct.sendto_write(
                    self.port, route[1], data, rdma, self.node._rdma_sources()
                )
            )
        ):  # fmt: skip
            direct.log.append((self.port, route[1], data, rdma))
            if went > 1:  # (C's runner did not post it, or Python must look)
                direct.run()
            return True
        return False

    def _queue(self, entry: Peer, dport: int, data: bytes, rdma: RdmaOp | None) -> None:
        """Send a message on the connection of ``entry`` (from :meth:`PeerTable.lookup`):
        at once when its session can (:meth:`.Carrier.send_plain`), else queued."""
        rds = entry.rds
        session = rds.session
        if rdma is not None:
            try:
                rdma._begin(self.node._rdma_sources())
            except ValueError as exc:
                raise RdsError(errno.EINVAL, str(exc)) from exc
        if session is not None and session.send_plain(self.port, dport, bytes(data), rdma):
            return
        rds.queue(self.port, dport, data, rdma=rdma)
        if session is None:  # (PeerTable.pump, inline: a call per message less)
            self.node._table.start_connector(entry)
        else:
            session.pump_sends()

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
            self.node._congestion.mark(self.port, False)
            self._registrations.close()
            self.node._inboxes.close(self.port, self.received)  # (dropped, as Linux does)
            self._arrived.unpark_all()
            if self._driving is not None:
                self._driving.interrupt_wait()
