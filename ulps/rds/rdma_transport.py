"""RDS over RDMA's entry in the transport table (Linux's ``rds_ib`` transport).

:class:`RdmaTransport` opens the device the CM uses for the node's address and one
PD, listens with ``cm.serve``, connects with ``cm.open_connection`` and carries each
RC connection on a :class:`~rdmashim.ulps.rds.rdma_session.Session`. The rdma_cm
private data is Linux's ``rds_ib_connect_private``: the addresses, the last message
we received (the peer resends what follows) and the credits we grant. Only the
portable verbs and rdma_cm API are used.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, ClassVar

import trio

from rdmashim.cm import (
    Connection,
    ConnectionRejected,
    ConnectionRequest,
    open_connection,
    open_device_for,
    serve,
)
from rdmashim.ulps.rds.connection import Carrier, IPAddress, RdsConnection
from rdmashim.ulps.rds.rdma_flow import RECV_SLOTS
from rdmashim.ulps.rds.rdma_session import Session
from rdmashim.ulps.rds.settings import Transport
from rdmashim.ulps.rds.transport import Capabilities, PeerBusy, TransportHost
from rdmashim.ulps.rds.wire import RDS_CM_PORT, RDS_PORT, ConnectPrivate
from rdmashim.verbs.attrs import QPCap

if TYPE_CHECKING:
    from rdmashim.ulps.rds.peer import Peer
    from rdmashim.verbs.abc import PD

log = logging.getLogger(__name__)

QP_CAP = QPCap(max_send_wr=128, max_recv_wr=RECV_SLOTS, max_send_sge=1, max_recv_sge=1)
"""The queues of a session's QP; the transport adds the inline bytes its device takes."""
MAX_INLINE = 128
"""Inline bytes a session asks for at most (where the device takes them): a Send that
fits (a standalone ack, a header and a small message) is copied when posted, which
the built-in engine frames in its batch paths."""
CQE = 1024
"""Entries of each session's CQ."""


class RdmaTransport:
    """RDS over RC queue pairs set up with rdma_cm (see the module docstring)."""

    name: ClassVar[Transport] = "rdma"
    capabilities: ClassVar[Capabilities] = Capabilities(
        rdma_by_cookie=True, handshake_probe=False, redial_lost=False
    )

    def __init__(self, host: TransportHost) -> None:
        self.host = host
        self._pd: PD | None = None
        self.qp_cap = QP_CAP
        """:data:`QP_CAP` with as many inline bytes as the device takes, up to
        :data:`MAX_INLINE` (set when the node starts)."""

    @staticmethod
    def default_port(address: IPAddress) -> int:
        """``RDS_PORT`` (18634) for IPv4, ``RDS_CM_PORT`` (16385) for IPv6
        (``rdma_transport.c`` ``rds_rdma_listen_init``, ``ib_cm.c``
        ``rds_ib_conn_path_connect``)."""
        return RDS_PORT if address.version == 4 else RDS_CM_PORT

    @property
    def pd(self) -> PD | None:
        """The protection domain every connection and RDMA registration of the node uses."""
        return self._pd

    @asynccontextmanager
    async def opened(self) -> AsyncIterator[None]:
        """The device the CM uses for the node's address, and its PD."""
        async with open_device_for(str(self.host.address)) as ctx:
            self._pd = ctx.alloc_pd()
            inline = min(MAX_INLINE, ctx.query_device().max_inline_data)
            self.qp_cap = dataclasses.replace(QP_CAP, max_inline_data=inline)
            yield

    async def listen(self, nursery: trio.Nursery) -> int:
        """Serve rdma_cm connection requests on the node's address and port."""
        host = self.host
        local = await nursery.start(
            lambda task_status: serve(
                self._incoming, host.port, host=str(host.address), cap=self.qp_cap,
                cqe=CQE, pd=self._pd, task_status=task_status,
            )
        )  # fmt: skip
        port: int = local[1]
        return port

    def drivable(self, session: Carrier) -> Session | None:
        """The session: a reader drives its CQ's completion handler."""
        return session if isinstance(session, Session) else None

    @staticmethod
    def _private(rds: RdsConnection) -> bytes:
        if rds.session is not None:  # (a session the peer gave up on: its numbers first)
            rds.session.settle()
        return ConnectPrivate(
            rds.local, rds.peer, ack_seq=rds.next_recv - 1, credit=RECV_SLOTS
        ).encode()

    async def connect(self, entry: Peer) -> None:
        """Connect to the peer and carry the connection until it ends."""
        rds, host = entry.rds, self.host
        holder: list[Session] = []

        def prepare(conn: Connection) -> None:
            if holder:  # an attempt open_connection gave up on (its QP is gone)
                holder.pop().close()
            holder.append(Session(rds, conn, host.burst_held, host.ack_held, host.plain))

        entry.connecting = True
        try:
            async with open_connection(
                str(rds.peer), host.port, private_data=self._private(rds), cap=self.qp_cap,
                cqe=CQE, pd=self._pd, prepare=prepare, source=str(rds.local),
            ) as conn:  # fmt: skip
                entry.connecting = False
                theirs = ConnectPrivate.decode(conn.private_data, ipv6=rds.peer.version == 6)
                holder[0].peer_credits(theirs.credit)
                await host.carry(entry, holder[0], theirs.ack_seq)
        except ConnectionRejected as exc:
            if exc.errno == errno.ECONNRESET:
                raise PeerBusy(str(exc)) from exc
            raise
        finally:
            entry.connecting = False
            if holder:  # the QP is gone: its buffers can go
                holder[0].close()

    async def _incoming(self, request: ConnectionRequest) -> None:
        host = self.host
        address = host.address
        try:
            theirs = ConnectPrivate.decode(request.private_data, ipv6=address.version == 6)
        except ValueError as exc:
            log.warning("RDS connect from %s with bad private data: %s", request.peer_addr, exc)
            await request.reject(b"")
            return
        if theirs.saddr == address:
            log.warning("RDS connect from %s claims our own address", request.peer_addr)
            await request.reject(b"")
            return
        entry = host.entry_for(theirs.saddr, "RDS connect")
        if entry is None:
            await request.reject(b"")
            return
        rds = entry.rds
        log.debug(
            "RDS %s: request from %s (connecting=%s live=%s canonical=%s)",
            address, theirs.saddr, entry.connecting, entry.live, rds.canonical,
        )  # fmt: skip
        if rds.canonical and (entry.connecting or entry.live):
            # Ours, from the lower address, wins (or is already up): one connection per pair.
            log.debug("RDS %s rejects %s: ours wins", address, theirs.saddr)
            await request.reject(b"")
            return
        if entry.connector is not None and not rds.canonical:
            entry.connector.cancel()
        session = Session(rds, request, host.burst_held, host.ack_held, host.plain)
        try:
            conn = await request.accept(private_data=self._private(rds))
            session.conn = conn
            session.peer_credits(theirs.credit)
            await host.carry(entry, session, theirs.ack_seq)
        finally:
            with trio.CancelScope(shield=True):
                await request.aclose()  # the QP is gone: its buffers can go
            session.close()
