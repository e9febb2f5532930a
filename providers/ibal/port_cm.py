"""rdma_cm over IBAL's CM (backend ``ibal``): WinOF's librdmacm on ``ib_cm_*``.

=====================  ==============================================================
``resolve_addr``        the destination's address; the routing table picks the source,
                        whose interface names the HCA device and so the ibal device
``resolve_route``       ``ibat_query_path`` (source, destination) -> ``ib_path_rec_t``
``create_qp``           ``ib_create_qp``: an unbound QP (``ib_cm_req``/``_rep`` bind it)
``connect``             ``ib_cm_req`` to service ID ``0x01000000 | ps << 16 | port``;
                        the REP callback answers ``ib_cm_rtu`` and reports ESTABLISHED,
                        the REJ callback REJECTED or UNREACHABLE
``listen``              ``ib_cm_listen`` on the service ID of the bound port (port 0:
                        a free ephemeral port, reported in ``local_addr``); each REQ
                        callback is a CONNECT_REQUEST on a new id
``accept``/``reject``   ``ib_cm_rep`` (ESTABLISHED on the RTU callback) / ``ib_cm_rej``
``disconnect``          ``ib_cm_dreq``; the DREP callback, or the peer's DREQ callback
                        (answered with ``ib_cm_drep``), reports DISCONNECTED and
                        TIMEWAIT_EXIT
=====================  ==============================================================

On an InfiniBand CA the REQ private data starts with rdma_cm's 36-byte IP
header (:mod:`.cma_header`); on iWARP it does not, as rdma_cm does. Every
callback runs on the AL's callback thread and hands its event to the
application's trio loop (``run_sync_soon``), so events keep their order.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import logging
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio

from rdmashim.cm import addressing
from rdmashim.cm.base import CMIdBase, QPArgs
from rdmashim.cm.states import Call
from rdmashim.cm.types import (
    CMEventType,
    CMState,
    ConnParam,
    PortSpace,
    check_conn_param,
    check_connect_timeout,
    check_listen,
    check_private_data,
    check_sockaddr,
)
from rdmashim.providers.ibal import cma_header
from rdmashim.providers.ibal.cm import (
    CmConnection,
    IbCmListen,
    ib_cm_cancel,
    ib_cm_drep,
    ib_cm_dreq,
    ib_cm_listen,
    ib_cm_rej,
    ib_cm_rep,
    ib_cm_req,
    ib_cm_rtu,
)
from rdmashim.providers.ibal.cm_state import ib_rej_status_t
from rdmashim.providers.ibal.cm_types import (
    RDMA_CM_SERVICE_ID,
    ib_cm_drep_t,
    ib_cm_dreq_t,
    ib_cm_listen_t,
    ib_cm_rej_t,
    ib_cm_rep_t,
    ib_cm_req_t,
    ib_cm_rtu_t,
)
from rdmashim.providers.ibal.ibat import ib_path_rec_t, ibat_query_path
from rdmashim.providers.ibal.port_device import PREFIX, Context, get_device_list, verbs_errors
from rdmashim.providers.ibal.port_queues import QP
from rdmashim.providers.ibal.status import IbError
from rdmashim.verbs.backend import own
from rdmashim.verbs.enums import Transport
from rdmashim.verbs.errors import VerbsError

if TYPE_CHECKING:
    from rdmashim.cm.abc import ChannelHost
    from rdmashim.cm.abc import CMId as AnyCMId
    from rdmashim.verbs import abc

log = logging.getLogger(__name__)
E = CMEventType
State = CMState


def service_id(ps: PortSpace, port: int) -> int:
    """rdma_cm's service ID of ``port`` in port space ``ps``."""
    return RDMA_CM_SERVICE_ID | (int(ps) & 0xFF) << 16 | port


def device_for(ip: str) -> str:
    """The ibal device whose HCA sits on the interface owning local address ``ip``."""
    netdev = addressing.interface_of(ip)
    if netdev is None:
        raise OSError(errno.EADDRNOTAVAIL, f"no local interface has address {ip}")
    for dev in get_device_list():
        if dev.netdev == netdev:
            return dev.name
    raise OSError(errno.ENODEV, f"no ibal device on {netdev}")


def _free_port(host: str, port: int) -> int:
    """Check ``host:port`` can be bound (port 0: pick a free ephemeral one) and return it."""
    try:
        return int(addressing.tcp_port_probe(host, port, reuse=True)[1])
    except OSError as exc:
        raise VerbsError(exc.errno or errno.EADDRINUSE, "listen", str(exc)) from exc


_LISTENING: dict[int, list[tuple[str, object]]] = {}
"""Ports this backend listens on in this process: port -> (host, id) (IBAL's listens
start in the background, so a second listen on a port is refused here, at once)."""


def _reserve(host: str, port: int, cm_id: object) -> None:
    taken = _LISTENING.setdefault(port, [])
    wild = ("0.0.0.0", "::")
    if any(h == host or h in wild or host in wild for h, _ in taken):
        raise VerbsError(errno.EADDRINUSE, "listen", f"port {port} is listened on")
    taken.append((host, cm_id))


def _release(port: int, cm_id: object) -> None:
    taken = _LISTENING.get(port, [])
    taken[:] = [(h, i) for h, i in taken if i is not cm_id]
    if not taken:
        _LISTENING.pop(port, None)


class CMId(CMIdBase[Context, QP]):
    """A communication identifier over IBAL's CM (see the module docstring).

    ``connect_timeout`` bounds the wait for the REP (``ib_cm_req``'s ``timeout_ms``).
    """

    options_refused_because = "IBAL's CM has no transport settings"

    def __init__(
        self,
        channel: ChannelHost,
        connector: Connector,
        ps: PortSpace,
        user_context: object = None,
    ) -> None:
        super().__init__(channel, ps, user_context)
        self._connector = connector
        self.path: ib_path_rec_t | None = None
        self._conn: CmConnection | None = None
        self._listens: list[IbCmListen] = []
        self._ended = False
        """DISCONNECTED was reported (the connection ended, or was ended while accepting)."""

    # ------------------------------------------------------------------ helpers
    def _later(self, fn: Callable[..., object], *args: object) -> None:
        """From a callback: run ``fn(*args)`` on the application's loop, unless destroyed."""
        ctx = self.context
        assert ctx is not None

        def run() -> None:
            if self.state is not State.DESTROYED:
                fn(*args)

        ctx.to_app(run)

    async def _bind_device(self, local_ip: str) -> None:
        self._watch_device(await self._connector.device_context(device_for(local_ip)))

    def _is_ib(self) -> bool:
        return self.context is not None and self.context.query_device().transport is Transport.IB

    # ------------------------------------------------------------------ addressing
    def bind_addr(self, addr: addressing.SockAddr) -> None:
        """Bind to a local address and port (``rdma_bind_addr``)."""
        self._require(Call.BIND_ADDR)
        self._require_tcp("bind_addr")
        addr = check_sockaddr("bind_addr", addr)
        host = str(addr[0]).split("%", 1)[0]
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            raise VerbsError(
                errno.EINVAL, "bind_addr", f"{addr[0]!r} is not an IP address (resolve names first)"
            ) from None
        if not ip.is_unspecified and addressing.interface_of(str(ip)) is None:
            raise VerbsError(errno.EADDRNOTAVAIL, "bind_addr", f"{host} is not a local address")
        self.local_addr = tuple(addr)
        self._move(Call.BIND_ADDR)

    def resolve_addr(
        self, src: addressing.SockAddr | None, dst: addressing.SockAddr, timeout_ms: int = 2000
    ) -> None:
        """Resolve ``dst``; the route's source picks the device (ADDR_RESOLVED / ADDR_ERROR)."""
        self._require(Call.RESOLVE_ADDR)
        self._require_tcp("resolve_addr")
        dst = check_sockaddr("resolve_addr", dst)
        if src is not None and self.state is State.IDLE:
            self.bind_addr(src)
        self._move(Call.RESOLVE_ADDR)
        self._spawn(self._resolve_addr, dst, timeout_ms / 1000, failed=E.ADDR_ERROR)

    async def _resolve_addr(self, dst: addressing.SockAddr, limit: float) -> None:
        bound = self.local_addr
        specific = bound is not None and str(bound[0]) not in ("0.0.0.0", "::")
        try:
            with trio.fail_after(limit):
                candidates = await addressing.resolve(str(dst[0]), int(dst[1]))
                if specific:
                    assert bound is not None
                    six = ":" in str(bound[0])
                    candidates = [c for c in candidates if (":" in c[0]) == six]
                if not candidates:
                    raise OSError(errno.EADDRNOTAVAIL, f"no address of {dst[0]} in our family")
                peer = candidates[0]
                family = socket.AF_INET6 if ":" in peer[0] else socket.AF_INET
                scope_id = peer[3] if family == socket.AF_INET6 else 0
                if specific:
                    assert bound is not None
                    source = str(bound[0])
                else:
                    source = addressing.route_source(peer[0], family, scope_id)
            # Opening the device is local work, not resolution: the limit is not for it (an
            # AL and an rdma-core CA take seconds to open in an emulated guest).
            await self._bind_device(source)
        except (OSError, trio.TooSlowError) as exc:
            status = (
                -errno.EADDRNOTAVAIL
                if isinstance(exc, socket.gaierror)
                else -(getattr(exc, "errno", None) or errno.ETIMEDOUT)
            )
            self._report(E.ADDR_ERROR, status, detail=str(exc) or "timed out")
            return
        port = bound[1] if bound else 0
        self.local_addr = (
            (source, port) if family == socket.AF_INET else (source, port, 0, scope_id)
        )
        self.peer_addr = tuple(peer)
        self._report(E.ADDR_RESOLVED)

    def resolve_route(self, timeout_ms: int = 2000) -> None:
        """``ibat_query_path`` to the destination (ROUTE_RESOLVED / ROUTE_ERROR)."""
        self._require(Call.RESOLVE_ROUTE)
        self._move(Call.RESOLVE_ROUTE)
        self._spawn(self._resolve_route, timeout_ms / 1000, failed=E.ROUTE_ERROR)

    async def _resolve_route(self, limit: float) -> None:
        assert self.local_addr is not None and self.peer_addr is not None
        assert self.context is not None
        src, dst = str(self.local_addr[0]), str(self.peer_addr[0])
        if len(self.peer_addr) > 3 and self.peer_addr[3]:
            dst = f"{dst}%{self.peer_addr[3]}"
        hca = self.context.device.hca_backend
        try:
            path = await trio.to_thread.run_sync(
                lambda: ibat_query_path(src, dst, hca_backend=hca, timeout=limit)
            )
        except IbError as exc:
            self._report(E.ROUTE_ERROR, -(exc.errno or errno.EIO), detail=str(exc))
            return
        if path.device_name and PREFIX + path.device_name != self.context.device.name:
            detail = f"the path leaves by {path.device_name}, not {self.context.device.name}"
            self._report(E.ROUTE_ERROR, -errno.ENETUNREACH, detail=detail)
            return
        self.path = path
        self._report(E.ROUTE_RESOLVED)

    # ------------------------------------------------------------------ QP
    def _new_qp(self, pd: abc.PD, args: QPArgs) -> QP:
        """``ib_create_qp`` on ``pd``: unbound until connect or accept."""
        return QP(pd, *args)

    # ------------------------------------------------------------------ active side
    def connect(self, param: ConnParam | None = None) -> None:
        """``ib_cm_req`` over the resolved path (ESTABLISHED, REJECTED or UNREACHABLE)."""
        self._require(Call.CONNECT)
        self._require_qp("connect", "IBAL connects a QP")
        assert self.qp is not None
        check_connect_timeout("connect", self.connect_timeout)
        param = param or ConnParam()
        check_conn_param(self.context, "connect", param)
        assert self.peer_addr is not None and self.local_addr is not None
        assert self.path is not None
        pdata = param.private_data
        if self._is_ib():
            header = cma_header.CmaHeader(
                str(self.local_addr[0]), int(self.local_addr[1]), str(self.peer_addr[0])
            )
            pdata = cma_header.encode(header) + pdata
        req = ib_cm_req_t(
            svc_id=service_id(self.ps, int(self.peer_addr[1])), h_qp=self.qp.h_qp,
            p_primary_path=self.path, pfn_cm_rep_cb=self._on_rep, pfn_cm_rej_cb=self._on_rej,
            p_req_pdata=pdata, resp_res=param.responder_resources,
            init_depth=param.initiator_depth, rnr_retry_cnt=param.rnr_retry_count,
            retry_cnt=param.retry_count, timeout_ms=max(1, int(self.connect_timeout * 1000)),
        )  # fmt: skip
        self._move(Call.CONNECT)
        with verbs_errors("connect"):
            ib_cm_req(req)

    def _on_rep(self, rec: Any) -> None:
        """REP callback (callback thread): ``ib_cm_rtu``, then ESTABLISHED."""
        self._conn = rec.h_cm_rep
        try:
            ib_cm_rtu(rec.h_cm_rep, ib_cm_rtu_t(pfn_cm_dreq_cb=self._on_dreq))
        except IbError as exc:
            self._later(self._post_fail, E.CONNECT_ERROR, -(exc.errno or errno.EIO), str(exc), b"")
            return
        param = ConnParam(rec.p_rep_pdata, rec.resp_res, rec.resp_res)
        self._later(self._established, rec.p_rep_pdata, param)

    def _on_rej(self, rec: Any) -> None:
        """REJ callback: REJECTED (a reject, no listener) or UNREACHABLE (timeout)."""
        status = rec.rej_status
        if status == ib_rej_status_t.IB_REJ_TIMEOUT:
            args = (E.UNREACHABLE, -errno.ETIMEDOUT, "no answer from the peer", b"")
        elif status == ib_rej_status_t.IB_REJ_INVALID_SID:
            args = (E.REJECTED, -errno.ECONNREFUSED, "no listener at the service ID", b"")
        else:
            args = (E.REJECTED, -errno.ECONNRESET, f"rejected ({status.name})", rec.p_rej_pdata)
        self._later(self._post_fail, *args)

    def _post_fail(self, kind: E, status: int, detail: str, pdata: bytes) -> None:
        if self.state not in (State.CONNECT, State.ACCEPTING):
            log.info("%s: %s after the id moved on: %s", self, kind.name, detail)
            return
        if self.state is State.ACCEPTING:
            kind = E.CONNECT_ERROR
        self._report(kind, status, private_data=pdata, detail=detail)
        if self.qp is not None:
            self.qp.connection_ended()

    def _established(self, pdata: bytes, param: ConnParam | None) -> None:
        if self.state not in (State.CONNECT, State.ACCEPTING):
            if self._ended and self.qp is not None:  # disconnected while accepting
                with contextlib.suppress(IbError):
                    ib_cm_dreq(ib_cm_dreq_t(self.qp.h_qp))
            return
        if self._conn is not None and self._conn.local_addr is not None:
            self.local_addr = self._conn.local_addr  # the port the transport bound
        self._report(E.ESTABLISHED, private_data=pdata, param=param)

    # ------------------------------------------------------------------ passive side
    def listen(self, backlog: int = 128) -> None:
        """``ib_cm_listen`` on the bound port's service ID (CONNECT_REQUEST events)."""
        self._require(Call.LISTEN)
        self._require_tcp("listen")
        check_listen("listen", backlog, self.max_pending)
        if self.local_addr is None:
            self.local_addr = ("0.0.0.0", 0)
        host = str(self.local_addr[0])
        port = _free_port(host, int(self.local_addr[1]))
        _reserve(host, port, self)
        self.local_addr = (host, port, *self.local_addr[2:])
        self._move(Call.LISTEN)
        self._spawn(self._listen, host, port, failed=E.CONNECT_ERROR)

    async def _listen(self, host: str, port: int) -> None:
        if host in ("0.0.0.0", "::"):
            names = [d.name for d in get_device_list()]
        else:
            names = [device_for(host)]
        for name in names:
            ctx = await self._connector.device_context(name)
            if self.context is None:
                self.context = ctx
            info = ib_cm_listen_t(
                svc_id=service_id(self.ps, port), ca_guid=ctx.ca.guid,
                pfn_cm_req_cb=self._req_handler(ctx), ip="" if len(names) > 1 else host,
            )  # fmt: skip
            try:
                listen = ib_cm_listen(ctx.al, info, self)
            except IbError as exc:
                log.warning("%s: ib_cm_listen on %s: %s", self, name, exc)
                continue
            if self.state is State.DESTROYED:
                ib_cm_cancel(listen)
                return
            self._listens.append(listen)

    def _req_handler(self, ctx: Context) -> Callable[[Any], None]:
        def on_req(rec: Any) -> None:
            with contextlib.suppress(trio.RunFinishedError):
                ctx.token.run_sync_soon(self._request, ctx, rec)

        return on_req

    def _request(self, ctx: Context, rec: Any) -> None:
        """A REQ callback on the application's loop: a new id, CONNECT_REQUEST."""
        conn: CmConnection = rec.h_cm_req
        if self.state is not State.LISTEN:
            with contextlib.suppress(IbError):
                ib_cm_rej(conn, ib_cm_rej_t())
            return
        pdata = bytes(rec.p_req_pdata)
        local, peer = conn.local_addr, conn.peer_addr
        if ctx.query_device().transport is Transport.IB:
            try:
                header, pdata = cma_header.decode(pdata)
            except cma_header.CmaHeaderError as exc:
                log.info("%s: REQ without an rdma_cm header (%s); rejecting", self, exc)
                with contextlib.suppress(IbError):
                    ib_cm_rej(conn, ib_cm_rej_t(ib_rej_status_t.IB_REJ_USER_DEFINED))
                return
            peer = (header.src_ip, header.src_port)
        child = CMId(self.channel, self._connector, self.ps, self.user_context)
        self.channel.adopt(child)
        child._watch_device(ctx)
        child.local_addr, child.peer_addr = local, peer
        child._conn = conn
        param = ConnParam(pdata, responder_resources=rec.resp_res, initiator_depth=rec.resp_res)
        child._report(E.CONNECT_REQUEST, private_data=pdata, param=param, listen_id=self)

    def accept(self, param: ConnParam | None = None) -> None:
        """``ib_cm_rep`` with the id's QP (ESTABLISHED on the RTU callback)."""
        self._require(Call.ACCEPT)
        self._require_qp("accept", "IBAL connects a QP")
        assert self.qp is not None
        param = param or ConnParam()
        check_conn_param(self.context, "accept", param)
        rep = ib_cm_rep_t(
            h_qp=self.qp.h_qp, p_rep_pdata=param.private_data, pfn_cm_rtu_cb=self._on_rtu,
            pfn_cm_rej_cb=self._on_rej, pfn_cm_dreq_cb=self._on_dreq,
        )  # fmt: skip
        rep.init_depth = param.initiator_depth
        assert self._conn is not None
        self._move(Call.ACCEPT)
        with verbs_errors("accept"):
            ib_cm_rep(self._conn, rep)

    def _on_rtu(self, rec: Any) -> None:
        self._later(self._established, b"", None)

    def reject(self, private_data: bytes = b"") -> None:
        """``ib_cm_rej`` of the request with ``private_data``."""
        self._require(Call.REJECT)
        check_private_data(self.context, "reject", private_data)
        assert self._conn is not None
        self._move(Call.REJECT)
        with verbs_errors("reject"):
            ib_cm_rej(self._conn, ib_cm_rej_t(p_rej_pdata=private_data))

    # ------------------------------------------------------------------ teardown
    def _on_dreq(self, rec: Any) -> None:
        """The peer's DREQ (or the connection ended): ``ib_cm_drep``, DISCONNECTED."""
        with contextlib.suppress(IbError):
            ib_cm_drep(rec.h_cm_dreq, ib_cm_drep_t())
        self._later(self._ended_now, "disconnected by the peer")

    def _on_drep(self, rec: Any) -> None:
        self._later(self._ended_now, "disconnected")

    def _ended_now(self, detail: str) -> None:
        if self._ended:
            return
        self._ended = True
        self._report(E.DISCONNECTED, detail=detail)
        if self.qp is not None:
            self.qp.connection_ended()
        self._report(E.TIMEWAIT_EXIT)

    def disconnect(self) -> None:
        """``ib_cm_dreq`` (both sides get DISCONNECTED). While accepting, before the RTU,
        the IB CM has no message for it: the id reports DISCONNECTED at once and sends
        the DREQ when the RTU comes."""
        self._require(Call.DISCONNECT)
        self._move(Call.DISCONNECT)
        if self.state is State.DISCONNECTED or self.qp is None:
            return
        if self.state is State.ACCEPTING:
            self._ended_now("disconnected while accepting")
            return
        with contextlib.suppress(IbError):
            ib_cm_dreq(ib_cm_dreq_t(self.qp.h_qp, pfn_cm_drep_cb=self._on_drep))

    def _teardown(self, state: State) -> None:
        """Cancel the listens, end or refuse the connection."""
        for listen in self._listens:
            with contextlib.suppress(IbError):
                ib_cm_cancel(listen)
        self._listens.clear()
        if state is State.LISTEN and self.local_addr is not None:
            _release(int(self.local_addr[1]), self)
        with contextlib.suppress(IbError):
            if state is State.CONNECT_REQUEST and self._conn is not None:
                ib_cm_rej(self._conn, ib_cm_rej_t())
            elif state in (State.ESTABLISHED, State.ACCEPTING) and self.qp is not None:
                ib_cm_dreq(ib_cm_dreq_t(self.qp.h_qp))
        if self.qp is not None:
            self.qp.connection_ended()


class Connector:
    """The ibal backend's rdma_cm for one event channel: it makes :class:`CMId` s."""

    def __init__(self, channel: ChannelHost) -> None:
        self.channel = channel
        self._opening: dict[str, trio.Event] = {}

    async def device_context(self, name: str) -> Context:
        """The channel's context of ``name``, opened once when ids ask at the same time."""
        while name in self._opening:
            await self._opening[name].wait()
        done = self._opening[name] = trio.Event()
        try:
            return own(await self.channel.device_context(name), Context, "bind")
        finally:
            del self._opening[name]
            done.set()

    def create_id(self, ps: PortSpace, user_context: object) -> AnyCMId:
        """A new id in port space ``ps`` (TCP connects)."""
        return CMId(self.channel, self, ps, user_context)

    async def run(self) -> None:
        """Nothing runs for the channel as a whole (IBAL's threads do the work)."""

    def close(self) -> None:
        """Nothing to release: the ids are destroyed with the channel."""


__all__ = ["CMId", "Connector", "device_for", "service_id"]
