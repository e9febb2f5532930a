"""The contract between the portable CM and a backend's connection management.

:class:`CMId` is what every backend's CM id offers (``rdma_cm_id``; the
built-in engine's speaks MPA over TCP itself, rdma-core's drives librdmacm).
A backend's :class:`Connector` makes the ids of one
:class:`~rdmashim.cm.channel.EventChannel` and may run background work in
the channel's nursery (librdmacm's event pump); it reaches the channel only
through :class:`ChannelHost`, what an event channel offers its backend.
:class:`CMBackend` is a backend with its rdma_cm: the verbs' ``Backend``
(:mod:`rdmashim.verbs.backend`) plus its connector and the transport options it
honours.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from rdmashim.cm.types import PortSpace
from rdmashim.verbs.backend import Backend

if TYPE_CHECKING:
    import trio

    from rdmashim.cm.addressing import SockAddr
    from rdmashim.cm.types import CMEvent, CMEventType, CMState, ConnParam, TransportOptions
    from rdmashim.verbs.abc import CQ, PD, QP, SRQ, Context
    from rdmashim.verbs.attrs import QPCap


class CMId(Protocol):
    """A communication identifier (``struct rdma_cm_id``) of any backend.

    Calls that start something (``resolve_addr``, ``resolve_route``, ``listen``,
    ``connect``, ``accept``) return at once; what happens arrives as events on
    the id's channel. ``context`` is the device context address resolution chose
    (or the listener's request arrived on): create the PD, CQs and QP there.
    """

    @property
    def ps(self) -> PortSpace:
        """The port space."""

    user_context: Any
    """Whatever the caller passed to ``create_id``, or set since (``id->context``): yours,
    never looked at."""

    @property
    def context(self) -> Context | None:
        """The device context the id is bound to, once resolved or requested."""

    @property
    def pd(self) -> PD | None:
        """The PD of the id's QP."""

    @property
    def qp(self) -> QP | None:
        """The id's QP, once ``create_qp`` made it."""

    @property
    def state(self) -> CMState:
        """Where the id is in its life."""

    @property
    def local_addr(self) -> SockAddr | None:
        """Our address and port, once bound."""

    @property
    def peer_addr(self) -> SockAddr | None:
        """The peer's address and port, once resolved or connected."""

    @property
    def negotiated(self) -> TransportOptions | None:
        """What connection setup settled, where the backend can tell (else None)."""

    options: TransportOptions
    """Transport settings this id asks for or accepts (a listener passes them on)."""
    connect_timeout: float
    """Seconds an active id waits for an answer before UNREACHABLE."""
    max_pending: int
    """A listener's bound on connections not yet accepted or rejected."""

    def bind_addr(self, addr: SockAddr) -> None:
        """Bind to a local address and port (``rdma_bind_addr``)."""

    def resolve_addr(self, src: SockAddr | None, dst: SockAddr, timeout_ms: int = 2000) -> None:
        """Resolve ``dst`` and choose the local device: ADDR_RESOLVED or ADDR_ERROR."""

    def resolve_route(self, timeout_ms: int = 2000) -> None:
        """Resolve the route to the destination: ROUTE_RESOLVED or ROUTE_ERROR."""

    def create_qp(
        self,
        pd: PD,
        *,
        send_cq: CQ,
        recv_cq: CQ,
        cap: QPCap | None = None,
        srq: SRQ | None = None,
        sq_sig_all: bool = False,
    ) -> QP:
        """Create the id's QP on ``pd``, which must be on ``context``."""

    def destroy_qp(self) -> None:
        """Destroy the id's QP (``rdma_destroy_qp``); nothing if it has none."""

    def connect(self, param: ConnParam | None = None) -> None:
        """Connect to the resolved peer: ESTABLISHED, REJECTED, UNREACHABLE or CONNECT_ERROR."""

    def listen(self, backlog: int = 128) -> None:
        """Listen on the bound address: CONNECT_REQUEST events."""

    def accept(self, param: ConnParam | None = None) -> None:
        """Accept the connection request on this id (ESTABLISHED follows)."""

    def reject(self, private_data: bytes = b"") -> None:
        """Reject the connection request on this id with ``private_data``."""

    def disconnect(self) -> None:
        """End the connection (``rdma_disconnect``); both sides get DISCONNECTED."""

    def destroy(self) -> None:
        """Release the id (``rdma_destroy_id``); idempotent."""

    def join_multicast(self, addr: SockAddr, context: object = None) -> None:
        """Join a multicast group (UD QPs; no backend offers them yet)."""


class ChannelHost(Protocol):
    """What an event channel offers the connector and the ids of its backend."""

    @property
    def nursery(self) -> trio.Nursery:
        """The channel's nursery, where CM work runs while the channel is open."""

    def create_id(self, context: object = None, ps: PortSpace = PortSpace.TCP) -> CMId:
        """A new id of this channel (a listener makes one per incoming connection)."""

    def adopt(self, cm_id: CMId) -> None:
        """Count an id the connector made itself (an incoming connection) as the channel's."""

    def forget(self, cm_id: CMId) -> None:
        """A destroyed id leaves the channel."""

    def post(
        self,
        kind: CMEventType,
        cm_id: CMId,
        status: int = 0,
        *,
        private_data: bytes = b"",
        param: ConnParam | None = None,
        listen_id: CMId | None = None,
        detail: str = "",
    ) -> None:
        """Queue an event of ``cm_id`` for the application (none once the channel closed).

        ``status`` is 0 or a negative errno; ``detail`` says what went wrong in words.
        """

    def ack(self, event: CMEvent) -> None:
        """Acknowledge an event the application took (``rdma_ack_cm_event``)."""

    async def device_context(self, name: str) -> Context:
        """The opened context of device ``name`` (opened in the channel if needed)."""


class Connector(Protocol):
    """A backend's rdma_cm for one event channel: makes its ids, runs its background work."""

    def create_id(self, ps: PortSpace, user_context: object) -> CMId:
        """A new id in port space ``ps`` (``rdma_create_id``)."""

    async def run(self) -> None:
        """Background work for the channel's life, in its nursery (may return at once)."""

    def close(self) -> None:
        """Release what the connector holds, after the channel's ids are destroyed."""


@runtime_checkable
class CMBackend(Backend, Protocol):
    """A backend with its rdma_cm; every registered backend is one (the event channel checks)."""

    @property
    def transport_options(self) -> frozenset[str]:
        """The :class:`~rdmashim.cm.types.TransportOptions` fields it honours; it refuses
        other non-default values with ``NotSupported``."""

    def cm_connector(self, channel: ChannelHost) -> Connector:
        """Its rdma_cm for the event channel ``channel`` (raises BackendUnavailable if it
        cannot offer one here)."""


__all__ = ["CMBackend", "CMId", "ChannelHost", "Connector"]
