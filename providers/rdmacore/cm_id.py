"""CM ids over librdmacm, for event channels of the rdma-core backend.

:class:`NativeChannel` is the backend's connector: it owns the ``rdma_event_channel``,
whose fd is non-blocking; its ``run`` task, in the
:class:`~rdmashim.cm.channel.EventChannel`'s nursery, waits on it with
``trio.lowlevel.wait_readable``, reads every ``rdma_cm_event``, copies it into a
:class:`~rdmashim.cm.types.CMEvent` (status, private data, connection parameters) and
acknowledges it at once, so ``rdma_destroy_id`` never waits for an event the application
still holds.

:class:`RdmaCoreCMId` satisfies :class:`rdmashim.cm.abc.CMId`.
Its ``context`` is the backend's context for the device librdmacm bound the id
to (``id->verbs``), matched by device name through the channel; PDs and QPs
for the id must be made on it. The kernel's rdma_cm does the rest: TCP and
MPA on iWARP, IB CM on InfiniBand/RoCE.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import socket
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio

from rdmashim.cm import addressing
from rdmashim.cm.base import CMIdBase, QPArgs
from rdmashim.cm.states import Call
from rdmashim.cm.types import (
    CMEventType,
    ConnParam,
    PortSpace,
    check_conn_param,
    check_connect_timeout,
    check_listen,
    check_private_data,
    check_sockaddr,
)
from rdmashim.cm.types import CMState as State
from rdmashim.providers.rdmacore import lib
from rdmashim.providers.rdmacore.cdefs import ffi
from rdmashim.providers.rdmacore.completion import notify_closing
from rdmashim.providers.rdmacore.device import IB_CM_PRIVATE_DATA, Context
from rdmashim.providers.rdmacore.memory import PD
from rdmashim.providers.rdmacore.queue_pair import QP
from rdmashim.verbs import abc
from rdmashim.verbs.backend import own
from rdmashim.verbs.enums import QPType, Transport
from rdmashim.verbs.errors import BackendUnavailable, NotSupported, VerbsError

if TYPE_CHECKING:
    from rdmashim.cm.abc import ChannelHost

TRANSPORT_OPTIONS: frozenset[str] = frozenset()
"""The portable transport options this backend honours: none, the kernel's iw_cm
negotiates MPA; only the defaults are accepted."""

log = logging.getLogger(__name__)

_CONNECTED_SPACES = (PortSpace.TCP, PortSpace.IB)
_CONNECT_FAILURES = {
    errno.ECONNREFUSED: CMEventType.REJECTED,
    errno.ETIMEDOUT: CMEventType.UNREACHABLE,
    errno.EHOSTUNREACH: CMEventType.UNREACHABLE,
    errno.ENETUNREACH: CMEventType.UNREACHABLE,
}
"""errno of a failed ``rdma_connect`` -> the event reported instead (see connect)."""
IB_CM_REJ_CONSUMER_DEFINED = 28
"""The IB CM's reject reason for a REJ the peer's application sent (``rdma_reject``)."""
_IB_REJECT_ERRNO = {IB_CM_REJ_CONSUMER_DEFINED: errno.ECONNRESET}
"""A REJECTED event's status on IB and RoCE is the IB CM's reject reason, positive
(the kernel's cma.c passes ``rej_rcvd.reason`` on); the portable API gives the errno
iWARP gives: -ECONNRESET when the peer rejected (an MPA Reject), -ECONNREFUSED for
any other reason (no listener: reason 8, invalid service ID), the reason in ``detail``."""
_SOCKADDR_IN6 = struct.Struct("=HH4s16sI")  # family, port, flowinfo, address, scope id


# ---------------------------------------------------------------------- addresses
def to_sockaddr(addr: addressing.SockAddr) -> Any:
    """A ``struct sockaddr_storage *`` for an (address, port[, flowinfo, scope_id]) tuple."""
    host = str(addr[0])
    name, _, zone = host.partition("%")
    ip = ipaddress.ip_address(name)
    port = int(addr[1]).to_bytes(2, "big")
    out = ffi.new("struct sockaddr_storage *")
    if ip.version == 4:
        raw = struct.pack("=H", socket.AF_INET) + port + ip.packed
    else:
        flowinfo = int(addr[2]) if len(addr) > 2 else 0
        scope_id = int(addr[3]) if len(addr) > 3 else (socket.if_nametoindex(zone) if zone else 0)
        raw = _SOCKADDR_IN6.pack(
            socket.AF_INET6, 0, flowinfo.to_bytes(4, "big"), ip.packed, scope_id
        )
        raw = raw[:2] + port + raw[4:]
    ffi.memmove(out, raw, len(raw))
    return out


def from_sockaddr(storage: Any) -> addressing.SockAddr | None:
    """The tuple for a ``struct sockaddr_storage`` (None for an unset address)."""
    raw = bytes(ffi.buffer(ffi.addressof(storage), _SOCKADDR_IN6.size))
    family = storage.ss_family
    port = int.from_bytes(raw[2:4], "big")
    if family == socket.AF_INET:
        return (socket.inet_ntop(socket.AF_INET, raw[4:8]), port)
    if family == socket.AF_INET6:
        _, _, flowinfo, packed, scope_id = _SOCKADDR_IN6.unpack(raw)
        return (
            socket.inet_ntop(socket.AF_INET6, packed),
            port,
            int.from_bytes(flowinfo, "big"),
            scope_id,
        )
    return None


def _conn_param(param: Any) -> ConnParam:
    length = param.private_data_len
    if length and param.private_data != ffi.NULL:
        data = bytes(ffi.buffer(param.private_data, length))
    else:
        data = b""
    return ConnParam(
        data,
        param.responder_resources,
        param.initiator_depth,
        param.flow_control,
        param.retry_count,
        param.rnr_retry_count,
        param.srq,
        param.qp_num,
    )


# ---------------------------------------------------------------------- channel
class NativeChannel:
    """librdmacm's event channel behind an :class:`~rdmashim.cm.channel.EventChannel`."""

    def __init__(self, channel: ChannelHost) -> None:
        self.channel = channel
        cm = lib.rdmacm()
        ptr = cm.rdma_create_event_channel()
        if ptr == ffi.NULL:
            err = lib.last_errno()
            if err in (errno.ENODEV, errno.ENOENT):
                raise BackendUnavailable(
                    "rdmacore: rdma_create_event_channel: no /dev/infiniband/rdma_cm "
                    "(load the kernel's rdma_cm for user space: modprobe rdma_ucm)"
                )
            raise VerbsError(err, "rdma_create_event_channel")
        self._ptr = ptr
        self.fd: int = ptr.fd
        os.set_blocking(self.fd, False)
        self._ids: dict[int, RdmaCoreCMId] = {}

    def create_id(self, ps: PortSpace, user_context: object) -> RdmaCoreCMId:
        """A new id (``rdma_create_id``) in a connected port space."""
        ps = PortSpace(ps)
        if ps not in _CONNECTED_SPACES:
            raise NotSupported("create_id", f"port space {ps.name}: UD QPs are not in the API")
        out = ffi.new("struct rdma_cm_id **")
        lib.check(lib.rdmacm().rdma_create_id(self._ptr, out, ffi.NULL, int(ps)), "rdma_create_id")
        return self._wrap(out[0], ps, user_context)

    def _wrap(self, ptr: Any, ps: PortSpace, user_context: Any) -> RdmaCoreCMId:
        cm_id = RdmaCoreCMId(self.channel, ps, user_context, ptr, self)
        self._ids[lib.address(ptr)] = cm_id
        return cm_id

    def _forget(self, cm_id: RdmaCoreCMId) -> None:
        self._ids.pop(lib.address(cm_id._ptr), None)

    async def run(self) -> None:
        """Read events as they arrive and deliver them, in order, to the channel."""
        cm = lib.rdmacm()
        out = ffi.new("struct rdma_cm_event **")
        while True:
            try:
                await trio.lowlevel.wait_readable(self.fd)
            except trio.ClosedResourceError:
                return
            while cm.rdma_get_cm_event(self._ptr, out) == 0:
                raw = out[0]
                kind = CMEventType(raw.event)
                copied = (raw.id, raw.listen_id, raw.status, _conn_param(raw.param.conn))
                cm.rdma_ack_cm_event(raw)
                await self._deliver(kind, *copied)
            err = lib.last_errno()
            if err not in (errno.EAGAIN, errno.EWOULDBLOCK):
                raise VerbsError(err, "rdma_get_cm_event")

    async def _deliver(
        self, kind: CMEventType, id_ptr: Any, listen_ptr: Any, status: int, param: ConnParam
    ) -> None:
        if kind is CMEventType.CONNECT_REQUEST:
            listener = self._ids.get(lib.address(listen_ptr))
            if listener is None:
                log.info("connection request for a listener no longer known refused")
                lib.rdmacm().rdma_destroy_id(id_ptr)
                return
            cm_id = self._wrap(id_ptr, listener.ps, listener.user_context)
            self.channel.adopt(cm_id)
            try:
                await cm_id._incoming(listener, status, param)
            except (BackendUnavailable, VerbsError) as exc:  # one request, not the channel
                log.warning("connection request dropped: no device for it: %s", exc)
                cm_id.destroy()
            return
        known = self._ids.get(lib.address(id_ptr))
        if known is None:
            log.debug("%s for a destroyed id dropped", kind.name)
            return
        await known._on_event(kind, status, param)

    def close(self) -> None:
        """Destroy the event channel (its ids are destroyed already)."""
        if self._ptr is not None:
            notify_closing(self.fd)
            lib.rdmacm().rdma_destroy_event_channel(self._ptr)
            self._ptr = None


# ---------------------------------------------------------------------- ids
SOURCE_PORT_TRIES = 8
"""Ports :func:`_on_tcp_free_port` tries when rdma_cm holds the one it picked."""
_PORT_HELD = (errno.EADDRINUSE, errno.EADDRNOTAVAIL)
"""What rdma_cm answers for a port it holds (see :func:`_on_tcp_free_port`)."""


def _on_tcp_free_port(
    addr: addressing.SockAddr | None, six: bool, call: Callable[[Any], None]
) -> None:
    """``call(sockaddr)`` with ``addr`` (any address if None) and, when it names no
    port, a port no TCP socket holds, not even one in TIME_WAIT; the next such port
    when rdma_cm holds it already, up to :data:`SOURCE_PORT_TRIES`.

    An iWARP connection, and a listener, are TCP sockets at the id's port. Left to
    pick it (port 0), the kernel's rdma_cm chooses in its own port space, blind to
    TCP's, and siw's bind inside ``rdma_connect``, or its listen inside
    ``rdma_listen``, then fails now and then with EADDRINUSE, too late to try another
    port (both seen in the guest). A port rdma_cm holds fails at once, here: with
    EADDRINUSE, or EADDRNOTAVAIL where the wildcard address is on either side (the
    kernel's cma_check_port; an id bound or resolved but not connected holds its port
    in rdma_cm's space only, where the TCP probe does not see it). On InfiniBand any
    free port serves as well.
    """
    if addr is not None and int(addr[1]):
        call(to_sockaddr(addr))
        return
    tries = SOURCE_PORT_TRIES
    while True:
        if addr is not None:
            scope = int(addr[3]) if len(addr) > 3 else 0
            chosen = addressing.tcp_port_probe(str(addr[0]), 0, scope)
        else:
            chosen = addressing.tcp_port_probe("::" if six else "0.0.0.0")
        try:
            call(to_sockaddr(chosen))
            return
        except VerbsError as exc:
            tries -= 1
            if exc.errno not in _PORT_HELD or not tries:
                raise


class RdmaCoreCMId(CMIdBase[Context, QP]):
    """A communication identifier over librdmacm (``struct rdma_cm_id``).

    The calls and events of :class:`rdmashim.cm.abc.CMId`. Transport settings are the
    kernel's own (siw's, or the RNIC's): only the defaults are valid
    (:data:`TRANSPORT_OPTIONS`), and ``negotiated`` is None (librdmacm does not tell
    what the kernel's iw_cm settled). ``max_pending`` bounds the kernel's listen
    backlog (``listen`` takes the smaller).
    """

    transport_options = TRANSPORT_OPTIONS
    options_refused_because = "the kernel's iw_cm negotiates MPA"

    def __init__(
        self,
        channel: ChannelHost,
        ps: PortSpace,
        user_context: Any,
        ptr: Any,
        native: NativeChannel,
    ) -> None:
        super().__init__(channel, ps, user_context)
        self._ptr = ptr
        self._native = native
        self._bound = False
        """Whether ``bind_addr`` bound the kernel's id (and chose its port)."""
        self._timer: trio.CancelScope | None = None
        self._disconnecting = False
        """Whether ``disconnect`` called ``rdma_disconnect`` (a DREQ went out on IB)."""

    # ------------------------------------------------------------------ helpers
    def _refresh_addresses(self) -> None:
        route = self._ptr.route.addr
        self.local_addr = from_sockaddr(route.src_storage) or self.local_addr
        self.peer_addr = from_sockaddr(route.dst_storage) or self.peer_addr

    async def _attach_device(self) -> None:
        """Find the backend context of the device librdmacm bound this id to."""
        verbs = self._ptr.verbs
        if verbs == ffi.NULL:
            return
        name = ffi.string(verbs.device.name).decode()
        if self.context is None or self.context.device.name != name:
            self.context = own(await self.channel.device_context(name), Context, "rdma_cm")

    def _native_param(self, operation: str, param: ConnParam | None) -> tuple[Any, Any]:
        param = param or ConnParam()
        check_conn_param(self.context, operation, param, self._private_data_limit(operation))
        attr = self._bound_context(operation).query_device()
        native = ffi.new("struct rdma_conn_param *")
        data = ffi.new("char[]", param.private_data) if param.private_data else ffi.NULL
        native.private_data = data
        native.private_data_len = len(param.private_data)
        native.responder_resources = min(param.responder_resources, attr.max_qp_rd_atom, 255)
        native.initiator_depth = min(param.initiator_depth, attr.max_qp_init_rd_atom, 255)
        native.flow_control = param.flow_control
        native.retry_count = param.retry_count
        native.rnr_retry_count = param.rnr_retry_count
        native.srq = param.srq
        native.qp_num = param.qp_num
        return native, data

    def _private_data_limit(self, operation: str) -> int | None:
        """The most private data ``operation`` carries: on iWARP one limit for all (None:
        ``max_private_data``), on IB and RoCE the IB CM message's
        (:data:`~rdmashim.providers.rdmacore.device.IB_CM_PRIVATE_DATA`)."""
        iwarp = self.context is None or self.context.device.transport is Transport.IWARP
        return None if iwarp else IB_CM_PRIVATE_DATA[operation]

    def _bound_context(self, operation: str) -> Context:
        if self.context is None:
            raise VerbsError(errno.EINVAL, operation, "resolve the address and route first")
        return self.context

    def _require_qp_on_iwarp(self, operation: str) -> None:
        """An iWARP connection needs the id's QP (on IB, CONNECT_RESPONSE comes without)."""
        if self._bound_context(operation).device.transport is Transport.IWARP:
            self._require_qp(operation, "iWARP connections need the id's QP")

    # ------------------------------------------------------------------ addressing
    def bind_addr(self, addr: addressing.SockAddr) -> None:
        """Bind to a local address and port (``rdma_bind_addr``)."""
        self._require(Call.BIND_ADDR)
        cm = lib.rdmacm()
        addr = check_sockaddr("bind_addr", addr)

        def bind(sockaddr: Any) -> None:
            lib.check(
                cm.rdma_bind_addr(self._ptr, ffi.cast("struct sockaddr *", sockaddr)),
                "rdma_bind_addr",
            )

        _on_tcp_free_port(addr, ":" in str(addr[0]), bind)
        self._refresh_addresses()
        self._bound = True
        self._move(Call.BIND_ADDR)

    def resolve_addr(
        self,
        src: addressing.SockAddr | None,
        dst: tuple[str, int] | addressing.SockAddr,
        timeout_ms: int = 2000,
    ) -> None:
        """Resolve ``dst`` (host name, IPv4 or IPv6): ADDR_RESOLVED or ADDR_ERROR follows."""
        self._require(Call.RESOLVE_ADDR)
        dst = check_sockaddr("resolve_addr", dst)
        if src is not None:
            src = check_sockaddr("resolve_addr", src)
        self._move(Call.RESOLVE_ADDR)
        self._spawn(
            self._resolve_addr, src, dst, timeout_ms, self._bound, failed=CMEventType.ADDR_ERROR
        )

    async def _resolve_addr(
        self, src: addressing.SockAddr | None, dst: addressing.SockAddr, timeout_ms: int,
        bound: bool,
    ) -> None:  # fmt: skip
        try:
            candidates = await addressing.resolve(str(dst[0]), int(dst[1]))
            if src is not None:
                want_v6 = ":" in str(src[0])
                candidates = [c for c in candidates if (":" in c[0]) == want_v6]
            if not candidates:
                raise OSError(errno.EADDRNOTAVAIL, f"no address of {dst[0]} in our family")
            peer = candidates[0]

            def resolve(sockaddr: Any) -> None:
                lib.check(
                    lib.rdmacm().rdma_resolve_addr(
                        self._ptr,
                        ffi.cast("struct sockaddr *", sockaddr),
                        ffi.cast("struct sockaddr *", to_sockaddr(peer)),
                        timeout_ms,
                    ),
                    "rdma_resolve_addr",
                )

            if bound:  # the port is the one bind_addr gave
                resolve(ffi.NULL if src is None else to_sockaddr(src))
            else:
                _on_tcp_free_port(src, ":" in peer[0], resolve)
        except OSError as exc:
            status = -errno.EADDRNOTAVAIL if isinstance(exc, socket.gaierror) else -(exc.errno or 5)
            self._report(CMEventType.ADDR_ERROR, status, detail=str(exc))

    def resolve_route(self, timeout_ms: int = 2000) -> None:
        """Resolve the route to the resolved destination: ROUTE_RESOLVED or ROUTE_ERROR."""
        self._require(Call.RESOLVE_ROUTE)
        lib.check(lib.rdmacm().rdma_resolve_route(self._ptr, timeout_ms), "rdma_resolve_route")
        self._move(Call.RESOLVE_ROUTE)

    # ------------------------------------------------------------------ QP
    def _check_pd(self, pd: abc.PD) -> None:
        if own(pd, PD, "create_qp").context._ptr != self._ptr.verbs:
            raise VerbsError(
                errno.EINVAL,
                "create_qp",
                "PD is not on the device context librdmacm bound the id to",
            )

    def _new_qp(self, pd: abc.PD, args: QPArgs) -> QP:
        """``rdma_create_qp`` on ``pd``."""
        ours = own(pd, PD, "create_qp")

        def create(attr: Any) -> Any:
            lib.check(lib.rdmacm().rdma_create_qp(self._ptr, ours._ptr, attr), "rdma_create_qp")
            return self._ptr.qp

        qp = ours._create_qp(*args, QPType.RC, create)
        qp.close_listeners.append(self._qp_closed)
        qp.error_listeners.append(self._qp_in_error)
        return qp

    def _qp_closed(self) -> None:
        if self.state is not State.DESTROYED:
            self._ptr.qp = ffi.NULL
        self.qp = None

    def _ends_with_its_qp(self) -> bool:
        """Whether the kernel ends the connection itself when the QP goes to ERR: on
        iWARP yes (siw sends a Terminate and closes the TCP stream); on IB and RoCE
        the IB CM knows nothing of the QP, so the connection stays until a DREQ."""
        return self.context is not None and self.context.device.transport is Transport.IWARP

    def _qp_in_error(self, why: Exception) -> None:
        """The id's QP went to ERR (an error completion, a fatal async event, ``modify``):
        the connection ends, as the portable API promises (both sides get DISCONNECTED).
        On IB and RoCE that takes a DREQ, which ``rdma_disconnect`` sends."""
        if self.state is State.ESTABLISHED and not self._ends_with_its_qp():
            log.info("%s: the QP went to ERR (%s); disconnecting", self, why)
            try:  # called from poll() and the like: their caller gets no error of ours
                self._disconnect_now()
            except VerbsError as exc:
                log.warning("%s: disconnecting after the QP's error: %s", self, exc)

    # ------------------------------------------------------------------ connecting
    def connect(self, param: ConnParam | None = None) -> None:
        """Connect to the resolved peer: ESTABLISHED, REJECTED, UNREACHABLE or CONNECT_ERROR."""
        self._require(Call.CONNECT)
        self._require_qp_on_iwarp("connect")
        check_connect_timeout("connect", self.connect_timeout)
        native, _data = self._native_param("connect", param)
        failed = lib.rdmacm().rdma_connect(self._ptr, native) != 0
        err = lib.last_errno() if failed else 0
        if failed and err not in _CONNECT_FAILURES:
            raise VerbsError(err, "rdma_connect")
        self._move(Call.CONNECT)
        if failed:
            # Linux siw (and other iWARP drivers) make the TCP connection inside
            # rdma_connect (siw_cm.c, siw_connect: "connect() is called in blocking
            # mode"), so a refused or unreachable peer fails the call instead of
            # coming back as an event; report it as the event librdmacm gives where
            # the connection is made asynchronously.
            detail = f"rdma_connect: {os.strerror(err)}"
            self._report(_CONNECT_FAILURES[err], -err, detail=detail)
            return
        self._timer = trio.CancelScope()
        self._spawn(self._connect_timer, self._timer, self.connect_timeout)

    async def _connect_timer(self, scope: trio.CancelScope, limit: float) -> None:
        with scope:
            await trio.sleep(limit)
            if self.state is State.CONNECT:
                self._report(CMEventType.UNREACHABLE, -errno.ETIMEDOUT, detail="no answer in time")

    def listen(self, backlog: int = 128) -> None:
        """Listen on the bound address (the wildcard if unbound): CONNECT_REQUEST events."""
        self._require(Call.LISTEN)
        check_listen("listen", backlog, self.max_pending)
        if self.state is State.IDLE:
            self.bind_addr(("0.0.0.0", 0))
        limit = min(backlog, self.max_pending)
        lib.check(lib.rdmacm().rdma_listen(self._ptr, limit), "rdma_listen")
        self._refresh_addresses()
        self._move(Call.LISTEN)

    async def _incoming(self, listener: RdmaCoreCMId, status: int, param: ConnParam) -> None:
        self._refresh_addresses()
        await self._attach_device()
        self._report(
            CMEventType.CONNECT_REQUEST, status,
            private_data=param.private_data, param=param, listen_id=listener,
        )  # fmt: skip

    def accept(self, param: ConnParam | None = None) -> None:
        """Accept the connection request on this id (ESTABLISHED follows)."""
        self._require(Call.ACCEPT)
        self._require_qp_on_iwarp("accept")
        native, _data = self._native_param("accept", param)
        lib.check(lib.rdmacm().rdma_accept(self._ptr, native), "rdma_accept")
        self._move(Call.ACCEPT)

    def reject(self, private_data: bytes = b"") -> None:
        """Reject the connection request on this id with ``private_data``."""
        self._require(Call.REJECT)
        check_private_data(self.context, "reject", private_data, self._private_data_limit("reject"))
        data = ffi.new("char[]", private_data) if private_data else ffi.NULL
        lib.check(lib.rdmacm().rdma_reject(self._ptr, data, len(private_data)), "rdma_reject")
        self._move(Call.REJECT)

    def disconnect(self) -> None:
        """End the connection (``rdma_disconnect``); both sides get DISCONNECTED."""
        self._require(Call.DISCONNECT)
        self._move(Call.DISCONNECT)
        if self.state is not State.DISCONNECTED:
            self._disconnect_now()

    def _disconnect_now(self) -> None:
        """``rdma_disconnect``, and the QP is failed."""
        self._disconnecting = True
        lib.check(lib.rdmacm().rdma_disconnect(self._ptr), "rdma_disconnect")
        if self.qp is not None:
            # rdma_disconnect(3): the QP is in the error state now. On iWARP
            # librdmacm asks for SQD, which siw turns into CLOSING and then
            # ERROR once TCP is closed (siw_qp.c); its query reports no state.
            self.qp._failed(ConnectionAbortedError("disconnected by the local side"))

    # ------------------------------------------------------------------ events
    async def _on_event(self, kind: CMEventType, status: int, param: ConnParam) -> None:
        """Deliver a librdmacm event; the state moves as the table says."""
        E = CMEventType
        private_data = b""
        reported: ConnParam | None = None
        detail = ""
        if kind is E.ADDR_RESOLVED:
            self._refresh_addresses()
            try:
                await self._attach_device()
            except (BackendUnavailable, VerbsError) as exc:
                self._report(E.ADDR_ERROR, -errno.ENODEV, detail=str(exc))
                return
        elif kind in (E.ESTABLISHED, E.CONNECT_RESPONSE):
            if self.state is State.ROUTE_RESOLVED or self._disconnecting:
                # After the connect timed out, or a disconnect while accepting (which
                # the kernel's iw_cm does not act on before the connection is up).
                log.info("%s after the id gave up the connection; disconnecting", kind.name)
                self._disconnect_now()
                return
            self._stop_timer()
            self._refresh_addresses()
            if self.qp is not None:
                self.qp._connected()
            private_data, reported = param.private_data, param
        elif kind in (E.REJECTED, E.UNREACHABLE, E.CONNECT_ERROR):
            if self.state is State.ROUTE_RESOLVED:
                return  # our timer reported the failure already
            self._stop_timer()
            private_data = param.private_data
            if kind is E.REJECTED and status > 0:
                detail = self._reject_reason(status)
                status = -_IB_REJECT_ERRNO.get(status, errno.ECONNREFUSED)
        elif kind is E.DISCONNECTED:
            if self.state is State.ROUTE_RESOLVED:
                return  # the connection that came after the timeout, which we ended
            if not self._disconnecting and not self._ends_with_its_qp():
                self._answer_dreq()
            self._report(kind, status)
            if self.qp is not None:
                self.qp._disconnected(ConnectionResetError("connection closed"), flush=True)
            return
        self._report(kind, status, private_data=private_data, param=reported, detail=detail)

    def _reject_reason(self, reason: int) -> str:
        """The words for an IB CM reject reason, which rdma_cm passes as a REJECTED
        event's status on IB and RoCE (iw_cm passes -ECONNREFUSED)."""
        try:
            text = lib.function(lib.rdmacm(), "rdma_reject_msg")(self._ptr, reason)
        except NotSupported:
            text = ffi.NULL
        words = ffi.string(text).decode(errors="replace") if text != ffi.NULL else "unknown"
        return f"IB CM reject reason {reason}: {words}"

    def _answer_dreq(self) -> None:
        """The peer's DREQ ended the connection: answer it with a DREP now
        (``rdma_disconnect``), so the peer's DISCONNECTED follows at once, as on iWARP,
        where the TCP close needs no answer, rather than when this application calls
        ``disconnect`` or the DREQ times out (the IB CM sends no DREP on its own)."""
        self._disconnecting = True
        if lib.rdmacm().rdma_disconnect(self._ptr) != 0:
            log.debug("%s: answering the DREQ: %s", self, os.strerror(lib.last_errno()))

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # ------------------------------------------------------------------ teardown
    def _teardown(self, before: State) -> None:
        """``rdma_destroy_id``; a connection on the id ends."""
        self._stop_timer()
        self._native._forget(self)
        if self.qp is not None:
            self.qp.close_listeners.remove(self._qp_closed)
            self.qp._disconnected(ConnectionAbortedError("CM id destroyed"))
        if lib.rdmacm().rdma_destroy_id(self._ptr):
            log.warning("rdma_destroy_id: %s", os.strerror(lib.last_errno()))
