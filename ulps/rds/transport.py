"""The RDS transport table: what a node asks of the transport that carries it.

Linux RDS has one ``struct rds_transport`` of operations (``rds.h``: listen,
connect, accept, send, what the transport can do) that ``rds_ib`` and ``rds_tcp``
each fill in, and the core calls through it without asking which one it has.
:class:`RdsTransport` is that table here, filled in once by
:class:`~rdmashim.ulps.rds.rdma_transport.RdmaTransport` (rdma_cm and RC queue
pairs) and once by :class:`~rdmashim.ulps.rds.tcp_transport.TcpTransport`
(Linux's ``rds_tcp``). A transport is given its node as a :class:`TransportHost`:
the peer table, and the one way to carry a connection on a new session
(:meth:`TransportHost.carry`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

from rdmashim.ulps.rds.connection import Carrier, IPAddress, RdsConnection
from rdmashim.ulps.rds.settings import RdsSettings, Transport

if TYPE_CHECKING:
    import trio

    from rdmashim.ulps.rds.peer import Peer
    from rdmashim.ulps.rds.plain import PlainPath
    from rdmashim.verbs.abc import PD


class SessionLost(Exception):
    """The connection under a session (an RC queue pair, a TCP connection) broke."""


class PeerBusy(ConnectionError):
    """The peer's RDS answered and turned the connection down for now (its own
    connect to us is under way): reachable, so no step towards giving up."""


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a transport can do, which the node asks instead of its name."""

    rdma_by_cookie: bool
    """Messages may carry RDMA operations on registered buffers (``RDS_GET_MR``)."""
    handshake_probe: bool
    """Each session starts with RDS/TCP's handshake probe, and a probe is answered with
    the same extension headers (paths, our generation number: ``rds_send_probe``)."""
    redial_lost: bool
    """The lower address connects again by itself after losing a session, while the
    peer is not idle (Linux's higher ``rds_tcp`` address never does)."""


class TransportSession(Carrier, Protocol):
    """A transport's session: one connection carrying an :class:`RdsConnection`."""

    async def run(self) -> None:
        """Carry messages until the connection breaks (raises :class:`SessionLost`)."""


class BurstHolder(Carrier, Protocol):
    """A session that holds back the answers to a burst of delivered messages until
    their receivers are done (:meth:`TransportHost.burst_held`)."""

    def answer_burst(self) -> None:
        """Send the answers held back, if they still wait."""

    def ack_needed(self) -> None:
        """A reader goes back to waiting: an acknowledgement the session holds back for a
        message of ours to carry goes on its own if none carried it in time
        (:meth:`TransportHost.ack_held`)."""


class Drivable(Protocol):
    """What a waiting reader may drive in place of the session's own task (a CQ, a TCP
    session): it reads and hands messages on until ``ready()`` is true."""

    async def drive_until(self, ready: Callable[[], bool], quiet: int = 0) -> bool:
        """Drive until ``ready()``; False at once when it cannot (wait some other way).
        ``quiet`` is the port of the reader's socket: a message for it needs no wake-up
        (the reader looks after each read)."""
        ...

    def interrupt_wait(self) -> None:
        """Make a :meth:`drive_until` in progress look at its ``ready`` again now."""


class TransportHost(Protocol):
    """The node, as its transport sees it."""

    address: IPAddress
    port: int
    settings: RdsSettings
    plain: PlainPath | None
    """The node's plain-message path in C (None: messages reach the sockets in Python)."""

    def entry_for(self, peer: IPAddress, what: str) -> Peer | None:
        """The entry of ``peer``, made if need be; None when there is no room (logged,
        ``what`` naming the connection refused)."""

    def start_connector(self, entry: Peer) -> None:
        """Start keeping a session to the peer up, unless that is under way already."""

    async def carry(self, entry: Peer, session: TransportSession, peer_ack: int) -> None:
        """Carry the peer's connection on ``session`` until it ends; ``peer_ack`` is the
        last message the peer says it has."""

    def probe(self, rds: RdsConnection) -> None:
        """Queue RDS/TCP's handshake probe on ``rds`` (and send it if a session is up)."""

    def burst_held(self, session: BurstHolder) -> None:
        """``session`` holds back the answers to a burst until its receivers are done."""

    def ack_held(self, session: BurstHolder) -> None:
        """``session`` holds back an acknowledgement: the next reader to go back to
        waiting calls its :meth:`~BurstHolder.ack_needed`."""


class RdsTransport(Protocol):
    """One transport's operations (see the module docstring)."""

    name: ClassVar[Transport]
    capabilities: ClassVar[Capabilities]

    def __init__(self, host: TransportHost) -> None:
        """A transport for the node ``host``."""

    @staticmethod
    def default_port(address: IPAddress) -> int:
        """The port Linux's RDS listens on and connects to over this transport."""
        ...

    @property
    def pd(self) -> PD | None:
        """The protection domain of RDMA by cookie, while the node runs (None: none)."""
        ...

    def opened(self) -> AbstractAsyncContextManager[None]:
        """What the transport holds while the node runs (a device and its PD); entered
        before the node's tasks start and left after they end."""
        ...

    async def listen(self, nursery: trio.Nursery) -> int:
        """Listen on the host's address and port; the port (the one picked for port 0).
        Connections coming in are accepted by tasks in ``nursery``."""
        ...

    async def connect(self, entry: Peer) -> None:
        """One attempt to connect to the peer; returns when the session it made ended,
        or when the peer will connect back. Raises OSError when nothing came of it
        (:class:`PeerBusy` when the peer's RDS turned it down for now)."""

    def drivable(self, session: Carrier) -> Drivable | None:
        """What a waiting reader may drive for ``session`` (None: nothing)."""
        ...
