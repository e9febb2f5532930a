"""The built-in engine's CM ids: librdmacm's ``rdma_cm_id`` with trio colouring, MPA over TCP.

Calls that start something (``resolve_addr``, ``resolve_route``, ``listen``,
``connect``, ``accept``, ``reject``, ``disconnect``) return at once; what
happens is reported as events on the id's channel, exactly as librdmacm
reports it:

========================  ==========================================================
ADDR_RESOLVED / _ERROR     the destination resolved and a local device chosen (or not)
ROUTE_RESOLVED / _ERROR    the route is usable (iWARP: the device's port is up)
CONNECT_REQUEST            an incoming connection, on a new id, with private data
ESTABLISHED                connected; the QP is in RTS
REJECTED                   the peer rejected (its private data) or refused the TCP connection
UNREACHABLE                no answer from the peer's host in time, or no route to it
CONNECT_ERROR              MPA setup failed: timeout, markers, CRC or revision mismatch, bad key
DISCONNECTED               the connection ended (either side, or an error) and the QP is in ERR
TIMEWAIT_EXIT              the TCP connection is fully closed; the id may be reused or destroyed
DEVICE_REMOVAL             the device context the id uses was closed
========================  ==========================================================

CONNECT_RESPONSE (an active id without a QP) does not occur on iWARP: the
connection needs its QP from the start. UDP and IB port spaces and multicast
raise NotSupported on iWARP devices.

:class:`Connector` is the backend's rdma_cm for an event channel: it makes
these ids and has no background work of its own (each id runs its work in the
channel's nursery).
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import socket
from dataclasses import fields
from typing import TYPE_CHECKING

import trio

from rdmashim.cm import addressing
from rdmashim.cm.base import CMIdBase, QPArgs
from rdmashim.cm.states import Call
from rdmashim.cm.types import (
    RTR,
    CMEventType,
    ConnParam,
    PortSpace,
    TransportOptions,
    check_conn_param,
    check_connect_timeout,
    check_listen,
    check_private_data,
    check_sockaddr,
)
from rdmashim.cm.types import CMState as State
from rdmashim.providers.softiwarp.connection import (
    MPA_REPLY_TIMEOUT,
    MPA_REQUEST_TIMEOUT,
    ConnectRequest,
    MpaTimeout,
    accept_qp,
    connect_qp,
    read_request,
    reject,
)
from rdmashim.providers.softiwarp.negotiation import MpaOptions, MpaRejected, MpaResult
from rdmashim.providers.softiwarp.provider import PD, Context
from rdmashim.providers.softiwarp.qp import QPBase
from rdmashim.providers.softiwarp.terminate import ProtocolError
from rdmashim.verbs import abc
from rdmashim.verbs.backend import own
from rdmashim.verbs.enums import PortState
from rdmashim.verbs.errors import VerbsError

if TYPE_CHECKING:
    from rdmashim.cm.abc import ChannelHost
    from rdmashim.cm.abc import CMId as AnyCMId

log = logging.getLogger(__name__)

ACCEPT_RETRY_DELAY = 0.1
"""Seconds a listener waits before accepting again after running out of descriptors or
memory (as ``trio.serve_listeners``)."""
ACCEPT_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
"""``accept`` errors that say the process or system is out of something for a while."""
LOG_INTERVAL = 10.0
"""Seconds between two warnings of the same kind from one listener."""


class _Throttled:
    """Logs a warning at most once per :data:`LOG_INTERVAL`, counting the ones it held back."""

    def __init__(self) -> None:
        self._last = -LOG_INTERVAL
        self._held = 0

    def warning(self, message: str, *args: object) -> None:
        now = trio.current_time()
        if now - self._last < LOG_INTERVAL:
            self._held += 1
            return
        if self._held:
            message += f" ({self._held} more since the last warning)"
        log.warning(message, *args)
        self._last = now
        self._held = 0


def _drop(stream: trio.SocketStream) -> None:
    """Close a connection at once (as siw does after a bad MPA exchange: a FIN, or a
    reset when unread bytes remain); nothing more is owed to this peer."""
    stream.socket.close()


def _peer_of(stream: trio.SocketStream) -> addressing.SockAddr | None:
    """The peer's address, or None when the connection is already gone."""
    try:
        peer: addressing.SockAddr = stream.socket.getpeername()
    except OSError:
        return None
    return peer


class CMId(CMIdBase[Context, QPBase]):
    """A communication identifier (``struct rdma_cm_id``); see the module docstring.

    ``context`` is the device context chosen by address resolution (or by the
    listener an incoming connection arrived on); create the PD, CQs and the QP
    on it. ``user_context`` is whatever the caller passed to ``create_id``.
    ``options`` are the MPA settings this id asks for or accepts (CRC, revision,
    P2P, FPDU size): every :class:`TransportOptions` field.
    """

    transport_options = frozenset(f.name for f in fields(TransportOptions))

    def __init__(self, channel: ChannelHost, ps: PortSpace, user_context: object = None) -> None:
        super().__init__(channel, ps, user_context)
        self.mpa_request_timeout = MPA_REQUEST_TIMEOUT
        """Seconds a listener waits for a new connection's MPA Request (siw: 5)."""
        self.mpa_reply_timeout = MPA_REPLY_TIMEOUT
        """Seconds an active id waits for the MPA Reply (siw: 10)."""
        self.mpa: MpaResult | None = None
        """What MPA setup settled (CRC, revision, IRD/ORD, RTR), once connected."""
        self._family = socket.AF_INET
        self._stream: trio.SocketStream | None = None
        self._request: ConnectRequest | None = None
        self._listeners: list[trio.SocketListener] = []
        self._disconnect_reported = False
        self._handshakes: dict[trio.SocketStream, trio.CancelScope] = {}
        """A listener's connections whose MPA Request is still coming, oldest first."""
        self._unanswered: set[CMId] = set()
        """A listener's CONNECT_REQUEST ids the application has not answered yet."""
        self._listen_id: CMId | None = None
        self._throttled = _Throttled()

    # ------------------------------------------------------------------ helpers
    @property
    def negotiated(self) -> TransportOptions | None:
        """What MPA setup settled, once connected: CRC, revision, and ``p2p`` with the
        ``rtr`` message chosen (``max_fpdu`` is this side's own)."""
        result = self.mpa
        if result is None:
            return None
        return TransportOptions(
            crc=bool(result.crc), revision=result.revision, p2p=result.rtr is not RTR.NONE,
            rtr=RTR(result.rtr), max_fpdu=self.options.max_fpdu,
        )  # fmt: skip

    @property
    def _the_qp(self) -> QPBase:
        """The id's QP, which connecting and accepting require (``_begin`` checks)."""
        assert self.qp is not None, "connect and accept need the QP"
        return self.qp

    async def _bind_device(self, local_ip: str) -> None:
        netdev = addressing.interface_of(local_ip)
        if netdev is None:
            raise OSError(errno.EADDRNOTAVAIL, f"no local interface has address {local_ip}")
        self._watch_device(own(await self.channel.device_context(f"siw_{netdev}"), Context, "bind"))

    # ------------------------------------------------------------------ addressing
    def bind_addr(self, addr: addressing.SockAddr) -> None:
        """Bind to a local address and port (``rdma_bind_addr``); port 0 picks one at listen.

        A specific address binds the id to that interface's device; the wildcard
        address listens on every device.
        """
        self._require(Call.BIND_ADDR)
        self._require_tcp("bind_addr")
        addr = check_sockaddr("bind_addr", addr)
        host = addr[0]
        try:
            ip = ipaddress.ip_address(str(host).split("%", 1)[0])
        except ValueError:
            raise VerbsError(
                errno.EINVAL, "bind_addr", f"{host!r} is not an IP address (resolve names first)"
            ) from None
        self._family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
        if not ip.is_unspecified and addressing.interface_of(str(ip)) is None:
            raise VerbsError(errno.EADDRNOTAVAIL, "bind_addr", f"{host} is not a local address")
        self.local_addr = tuple(addr)
        self._move(Call.BIND_ADDR)

    def resolve_addr(
        self,
        src: addressing.SockAddr | None,
        dst: tuple[str, int] | addressing.SockAddr,
        timeout_ms: int = 2000,
    ) -> None:
        """Resolve ``dst`` (host name, IPv4 or IPv6) and choose the local device.

        The routing table picks the source address unless ``src`` names one; the
        device is the one bound to that address's interface. Reports
        ADDR_RESOLVED or ADDR_ERROR.
        """
        self._require(Call.RESOLVE_ADDR)
        self._require_tcp("resolve_addr")
        dst = check_sockaddr("resolve_addr", dst)
        if src is not None and self.state is State.IDLE:
            self.bind_addr(src)
        self._move(Call.RESOLVE_ADDR)
        self._spawn(self._resolve_addr, dst, timeout_ms / 1000)

    async def _resolve_addr(self, dst: addressing.SockAddr, limit: float) -> None:
        try:
            with trio.fail_after(limit):
                candidates = await addressing.resolve(str(dst[0]), int(dst[1]))
                if self.local_addr is not None and self.local_addr[0] not in ("0.0.0.0", "::"):
                    want = 6 if ":" in str(self.local_addr[0]) else 4
                    candidates = [c for c in candidates if (":" in c[0]) == (want == 6)]
                if not candidates:
                    raise OSError(errno.EADDRNOTAVAIL, f"no address of {dst[0]} in our family")
                peer = candidates[0]
                family = socket.AF_INET6 if ":" in peer[0] else socket.AF_INET
                scope_id = peer[3] if family == socket.AF_INET6 else 0
                if self.local_addr is not None and self.local_addr[0] not in ("0.0.0.0", "::"):
                    source = str(self.local_addr[0])
                else:
                    source = addressing.route_source(peer[0], family, scope_id)
                await self._bind_device(source)
        except (OSError, trio.TooSlowError) as exc:
            if isinstance(exc, socket.gaierror):
                status = -errno.EADDRNOTAVAIL  # the name has no address
            else:
                status = -(getattr(exc, "errno", None) or errno.ETIMEDOUT)
            self._report(CMEventType.ADDR_ERROR, status, detail=str(exc) or "timed out")
            return
        self._family = family
        port = self.local_addr[1] if self.local_addr else 0
        self.local_addr = (
            (source, port) if family == socket.AF_INET else (source, port, 0, scope_id)
        )
        self.peer_addr = tuple(peer)
        self._report(CMEventType.ADDR_RESOLVED)

    def resolve_route(self, timeout_ms: int = 2000) -> None:
        """Check the route to the resolved destination (ROUTE_RESOLVED or ROUTE_ERROR).

        On iWARP the route is the TCP/IP one; it is usable when the device's port
        (its interface) is up.
        """
        self._require(Call.RESOLVE_ROUTE)
        self._move(Call.RESOLVE_ROUTE)
        self._spawn(self._resolve_route, failed=CMEventType.ROUTE_ERROR)

    async def _resolve_route(self) -> None:
        assert self.context is not None  # ADDR_RESOLVED binds it
        port = self.context.query_port(1)
        if port.state != PortState.ACTIVE:
            detail = f"{port.netdev} is down"
            self._report(CMEventType.ROUTE_ERROR, -errno.ENETDOWN, detail=detail)
            return
        self._report(CMEventType.ROUTE_RESOLVED)

    # ------------------------------------------------------------------ QP
    def _new_qp(self, pd: abc.PD, args: QPArgs) -> QPBase:
        return own(pd, PD, "create_qp").create_qp(**args._asdict())

    # ------------------------------------------------------------------ active side
    def connect(self, param: ConnParam | None = None) -> None:
        """Connect to the resolved peer (ESTABLISHED, REJECTED, UNREACHABLE or CONNECT_ERROR)."""
        self._require(Call.CONNECT)
        check_connect_timeout("connect", self.connect_timeout)
        param = self._begin(Call.CONNECT, param)
        self._spawn(self._connect, param, failed=CMEventType.CONNECT_ERROR)

    def _begin(self, call: Call, param: ConnParam | None) -> ConnParam:
        """Checks shared by connect and accept; then the id moves on and hears of its QP's
        errors (a disconnect before the connection is set up is one)."""
        self._require(call)
        self._require_qp(call.value, "iWARP connections need the id's QP")
        param = param or ConnParam()
        check_conn_param(self.context, call.value, param)
        self._answered()
        self._move(call)
        self._the_qp.error_listeners.append(self._on_qp_error)
        return param

    def _mpa_options(self, param: ConnParam) -> MpaOptions:
        """The engine's MPA options: the portable ones with IRD/ORD from ``param``."""
        o = self.options
        return MpaOptions(
            crc=o.crc, revision=o.revision, p2p=o.p2p, rtr=o.rtr, max_fpdu=o.max_fpdu,
            ird=param.responder_resources, ord=param.initiator_depth,
        )  # fmt: skip

    async def _connect(self, param: ConnParam) -> None:
        assert self.peer_addr is not None and self.local_addr is not None
        try:
            with trio.fail_after(self.connect_timeout):
                sock = trio.socket.socket(self._family, socket.SOCK_STREAM)
                try:
                    await sock.bind((self.local_addr[0], self.local_addr[1], *self.local_addr[2:]))
                    await sock.connect(self.peer_addr)
                except BaseException:
                    sock.close()
                    raise
        except trio.TooSlowError:
            self._fail(CMEventType.UNREACHABLE, -errno.ETIMEDOUT, "no answer from the peer")
            return
        except ConnectionRefusedError as exc:
            self._fail(CMEventType.REJECTED, -errno.ECONNREFUSED, str(exc))
            return
        except OSError as exc:
            kind = (
                CMEventType.UNREACHABLE
                if exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ETIMEDOUT)
                else CMEventType.CONNECT_ERROR
            )
            self._fail(kind, -(exc.errno or errno.EIO), str(exc))
            return
        stream = trio.SocketStream(sock)
        self.local_addr = sock.getsockname()
        try:
            result = await connect_qp(
                self._the_qp, stream, private_data=param.private_data,
                options=self._mpa_options(param), reply_timeout=self.mpa_reply_timeout,
            )  # fmt: skip
        except MpaRejected as exc:
            self._fail(CMEventType.REJECTED, -errno.ECONNRESET, str(exc), exc.private_data)
            return
        except MpaTimeout as exc:
            self._fail(CMEventType.CONNECT_ERROR, -errno.ETIMEDOUT, str(exc))
            return
        except (ProtocolError, OSError) as exc:
            self._fail(CMEventType.CONNECT_ERROR, -errno.ECONNREFUSED, str(exc))
            return
        self.mpa = result
        self._report(
            CMEventType.ESTABLISHED,
            private_data=result.private_data,
            param=ConnParam(result.private_data, result.ird, result.ord),
        )
        self._spawn(self._watch_close)

    def _fail(self, kind: CMEventType, status: int, detail: str, private_data: bytes = b"") -> None:
        self._report(kind, status, private_data=private_data, detail=detail)

    # ------------------------------------------------------------------ passive side
    def listen(self, backlog: int = 128) -> None:
        """Listen for connections on the bound address (CONNECT_REQUEST events)."""
        self._require(Call.LISTEN)
        self._require_tcp("listen")
        check_listen("listen", backlog, self.max_pending)
        if self.local_addr is None:
            self.local_addr = ("0.0.0.0", 0)
        host = str(self.local_addr[0])
        port = int(self.local_addr[1])
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        raw = socket.socket(family, socket.SOCK_STREAM)
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and host == "::":
            raw.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        try:
            raw.bind((host, port, *self.local_addr[2:]))
            raw.listen(backlog)
        except OSError as exc:
            raw.close()
            raise VerbsError(exc.errno or errno.EADDRINUSE, "listen", str(exc)) from exc
        self.local_addr = raw.getsockname()
        listener = trio.SocketListener(trio.socket.from_stdlib_socket(raw))
        self._listeners.append(listener)
        self._move(Call.LISTEN)
        self._spawn(self._accept_loop, listener)

    async def _accept_loop(self, listener: trio.SocketListener) -> None:
        while True:
            try:
                stream = await listener.accept()
            except trio.ClosedResourceError:
                return
            except OSError as exc:
                if exc.errno not in ACCEPT_CAPACITY_ERRNOS:
                    log.error("%s: accept failed, no longer listening: %s", self, exc)
                    return
                self._throttled.warning(
                    "%s: accept: %s; retrying every %.1f s", self, exc, ACCEPT_RETRY_DELAY
                )
                await trio.sleep(ACCEPT_RETRY_DELAY)
                continue
            self._admit(stream)

    def _admit(self, stream: trio.SocketStream) -> None:
        """Start reading a new connection's MPA Request, within :attr:`max_pending`."""
        if len(self._handshakes) + len(self._unanswered) >= self.max_pending:
            if self._handshakes:
                oldest = next(iter(self._handshakes))
                self._handshakes.pop(oldest).cancel()
                dropped = "the oldest connection still owing its MPA Request"
            else:
                _drop(stream)
                dropped = "a new connection"
            self._throttled.warning(
                "%s: max_pending (%d) connections pending, dropping %s",
                self, self.max_pending, dropped,
            )  # fmt: skip
            if dropped == "a new connection":
                return
        scope = trio.CancelScope()
        self._handshakes[stream] = scope
        self.channel.nursery.start_soon(self._incoming, stream, scope)

    async def _incoming(self, stream: trio.SocketStream, scope: trio.CancelScope) -> None:
        """One new connection up to its CONNECT_REQUEST; nothing it does escapes."""
        peer = _peer_of(stream)
        child = None
        try:
            with scope:
                request = await read_request(stream, request_timeout=self.mpa_request_timeout)
                child = await self._request_arrived(stream, request)
        except (MpaTimeout, ProtocolError, OSError, trio.BrokenResourceError) as exc:
            log.info("dropping connection from %s: %s", peer, exc)
        except Exception:
            log.exception("%s: dropping connection from %s", self, peer)
        finally:
            self._handshakes.pop(stream, None)
            if child is None:
                _drop(stream)

    async def _request_arrived(
        self, stream: trio.SocketStream, request: ConnectRequest
    ) -> CMId | None:
        """Make the child id of a valid MPA Request and report CONNECT_REQUEST."""
        if self.state is not State.LISTEN:
            return None
        local, peer = stream.socket.getsockname(), stream.socket.getpeername()
        child = own(self.channel.create_id(self.user_context, self.ps), CMId, "listen")
        try:
            child.options = self.options
            child.local_addr, child.peer_addr = local, peer
            child._family = stream.socket.family
            await child._bind_device(str(local[0]))
        except OSError as exc:
            log.warning("no device for %s: %s", local, exc)
            child.destroy()
            with trio.move_on_after(self.mpa_request_timeout):
                await reject(stream, request, b"")
            return None
        except BaseException:
            child.destroy()
            raise
        child._stream, child._request = stream, request
        child._listen_id = self
        self._unanswered.add(child)
        frame = request.frame
        param = ConnParam(
            request.private_data,
            responder_resources=frame.ord if frame.enhanced else 16,
            initiator_depth=frame.ird if frame.enhanced else 16,
        )
        child._report(
            CMEventType.CONNECT_REQUEST,
            private_data=request.private_data, param=param, listen_id=self,
        )  # fmt: skip
        return child

    def _answered(self) -> None:
        """This CONNECT_REQUEST id was accepted, rejected or destroyed: no longer pending."""
        if self._listen_id is not None:
            self._listen_id._unanswered.discard(self)
            self._listen_id = None

    def accept(self, param: ConnParam | None = None) -> None:
        """Accept the connection request on this id (ESTABLISHED follows)."""
        param = self._begin(Call.ACCEPT, param)
        stream, request = self._stream, self._request
        assert stream is not None and request is not None  # CONNECT_REQUEST holds them
        self._stream = self._request = None  # the task owns the stream, then the QP's link
        self._spawn(self._accept, stream, request, param, failed=CMEventType.CONNECT_ERROR)

    async def _accept(
        self, stream: trio.SocketStream, request: ConnectRequest, param: ConnParam
    ) -> None:
        options = self._mpa_options(param)
        if options.p2p:
            self._the_qp.when_ready(lambda: self._established(b""))
        try:
            result = await accept_qp(
                self._the_qp, stream, request, private_data=param.private_data, options=options
            )
        except (ProtocolError, OSError) as exc:
            _drop(stream)
            if self.state is State.ACCEPTING:  # not after a disconnect (DISCONNECTED came)
                self._report(CMEventType.CONNECT_ERROR, -errno.ECONNRESET, detail=str(exc))
            return
        except BaseException:
            _drop(stream)
            raise
        self.mpa = result
        if result.rtr is RTR.NONE:
            self._established(result.private_data)
        self._spawn(self._watch_close)

    def _established(self, private_data: bytes) -> None:
        if self.state is State.ACCEPTING:
            self._report(CMEventType.ESTABLISHED, private_data=private_data)

    def reject(self, private_data: bytes = b"") -> None:
        """Reject the connection request on this id with ``private_data``."""
        self._require(Call.REJECT)
        check_private_data(self.context, "reject", private_data)
        stream, request = self._stream, self._request
        self._stream = None
        self._request = None
        self._answered()
        self._move(Call.REJECT)

        async def send_reject() -> None:
            assert stream is not None
            try:
                with trio.move_on_after(self.mpa_request_timeout):
                    await reject(stream, request, private_data)
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                log.info("reject to %s: %s", self.peer_addr, exc)
            except Exception:
                log.exception("reject to %s failed", self.peer_addr)
            finally:
                _drop(stream)

        self.channel.nursery.start_soon(send_reject)

    # ------------------------------------------------------------------ teardown
    def _on_qp_error(self, exc: Exception) -> None:
        if self.state in (State.ESTABLISHED, State.ACCEPTING) and not self._disconnect_reported:
            self._disconnect_reported = True
            self._report(CMEventType.DISCONNECTED, detail=str(exc))

    async def _watch_close(self) -> None:
        await self._the_qp.wait_closed()
        self._on_qp_error(ConnectionResetError("connection closed"))
        self.channel.post(CMEventType.TIMEWAIT_EXIT, self)

    def disconnect(self) -> None:
        """End the connection (``rdma_disconnect``): the QP goes to ERR, outstanding work
        is flushed (completed work stays completed), the TCP connection closes and both
        sides get DISCONNECTED."""
        self._require(Call.DISCONNECT)
        self._move(Call.DISCONNECT)
        if self.qp is not None and self.state is not State.DISCONNECTED:
            self.qp.engine.set_error(ConnectionAbortedError("disconnected by the local side"))

    def _teardown(self, before: State) -> None:
        """Close the listeners and the connection (a request: at once; an established
        or accepting id: its QP goes to ERR, flushing its work)."""
        self._answered()
        if self._stream is not None:  # a request not answered
            _drop(self._stream)
        self._stream = None
        self._request = None
        for listener in self._listeners:
            listener.socket.close()
        self._listeners.clear()
        for scope in self._handshakes.values():
            scope.cancel()
        if self.qp is not None and before in (State.ESTABLISHED, State.ACCEPTING):
            self.qp.engine.set_error(ConnectionAbortedError("CM id destroyed"))


class Connector:
    """The built-in engine's rdma_cm for one event channel: it makes :class:`CMId` s."""

    def __init__(self, channel: ChannelHost) -> None:
        self.channel = channel

    def create_id(self, ps: PortSpace, user_context: object) -> AnyCMId:
        """A new id in port space ``ps`` (only TCP can connect on iWARP)."""
        return CMId(self.channel, ps, user_context)

    async def run(self) -> None:
        """Nothing runs for the channel as a whole: each id runs its own work."""

    def close(self) -> None:
        """Nothing to release: the ids are destroyed with the channel."""
