"""The IB CM calls (``ib_cm_listen`` ... ``ib_cm_drep``) over the portable CM of the AL's HCAs.

IBAL's CM speaks IB CM MADs; an iWARP HCA sets its connections up with MPA
over TCP instead, so each IB CM message rides the transport's own step
through the portable CM (:mod:`rdmashim.cm`), and the wire stays exactly
what Linux siw speaks:

=========  ===================================================================
REQ        MPA Request: ``cm_id.connect`` with the REQ private data, to the TCP
           port the service ID names (its low 16 bits), at the path's IP address
REP        MPA Reply: ``cm_id.accept`` with the REP private data
RTU        active side: a local step after the REP callback (no wire message);
           passive side: its RTU callback when the connection is ESTABLISHED
REJ        passive: MPA Reject with the REJ private data (the active side's REJ
           callback reports IB_REJ_USER_DEFINED: MPA carries no reason);
           active, after a REP: a disconnection. A refused TCP connection or one
           closed unanswered (no listen matched) is IB_REJ_INVALID_SID, no answer
           in time IB_REJ_TIMEOUT
MRA        no wire message: accepted in the states IBAL accepts it, recorded; the
           peer's MRA callback never fires on iWARP
DREQ       ``cm_id.disconnect``; the peer's DREQ callback on DISCONNECTED
DREP       the receiver's local completion; the initiator's DREP callback when its
           disconnection completes (both sides' in a DREQ race)
=========  ===================================================================

Each CA has one portable event channel, owned by a task on the AL's progress
loop; every call body runs there, and every callback on the callback thread.
The QP named in ``ib_cm_req``/``ib_cm_rep`` is bound to the connection's CM id
(:meth:`IbQp.bind`) before the MPA exchange starts. A listen covers the CAs
open in the AL when it is made: it listens on every IP address of their
interfaces, at the service ID's port. The pure state machine is
:mod:`.cm_state`; the structures and records are :mod:`.cm_types`.
"""

from __future__ import annotations

import errno
import logging
from dataclasses import dataclass, field, replace
from typing import Any

import trio

from rdmashim.cm import addressing
from rdmashim.cm.channel import EventChannel
from rdmashim.cm.types import CMEvent, CMEventType, ConnParam
from rdmashim.providers.ibal.al import DestroyCallback, Handle, IbAl
from rdmashim.providers.ibal.ca import IbCa
from rdmashim.providers.ibal.cm_state import (
    PDATA_SIZE,
    CmMachine,
    CmMsg,
    Notify,
    Send,
    Wire,
    ib_rej_status_t,
    rej_status_for,
    timeout_seconds,
)
from rdmashim.providers.ibal.cm_types import (
    ib_cm_drep_rec_t,
    ib_cm_drep_t,
    ib_cm_dreq_rec_t,
    ib_cm_dreq_t,
    ib_cm_listen_t,
    ib_cm_mra_t,
    ib_cm_rej_rec_t,
    ib_cm_rej_t,
    ib_cm_rep_rec_t,
    ib_cm_rep_t,
    ib_cm_req_rec_t,
    ib_cm_req_t,
    ib_cm_rtu_rec_t,
    ib_cm_rtu_t,
    port_of_service_id,
)
from rdmashim.providers.ibal.ibat import ib_path_rec_t, iwarp_gid
from rdmashim.providers.ibal.qp import IbQp, ib_qp_state_t, ib_qp_type_t
from rdmashim.providers.ibal.status import IbError, IbStatus

log = logging.getLogger(__name__)

E = CMEventType
RC = ib_qp_type_t.IB_QPT_RELIABLE_CONN


# ---------------------------------------------------------------------------- per-CA CM
class CaCm:
    """The CM of one CA: its portable event channel and the listens on it."""

    def __init__(self, ca: IbCa) -> None:
        self.ca = ca
        self.channel: EventChannel | None = None
        self.ports: dict[int, PortListen] = {}

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Own the channel and dispatch its events until the CA or the AL closes.

        Closing the CA ends its CM ids with DEVICE_REMOVAL; the first event after it
        ends the task (closing the AL cancels it).
        """
        channel = EventChannel(contexts=[self.ca.context], backend=self.ca.al.hca_backend)
        try:
            async with channel:
                self.channel = channel
                task_status.started()
                async for event in channel:
                    event.ack()
                    try:
                        self._dispatch(event)
                    except Exception:
                        log.exception("ibal cm: handling %s failed", event)
                    if self.ca.destroyed:
                        break
        finally:  # also when closing the AL cancels it: nothing may keep the CA's ids
            self.channel = None
            self.ca.cm = None

    def _dispatch(self, event: CMEvent) -> None:
        if event.event == E.CONNECT_REQUEST:
            owner = event.listen_id.user_context if event.listen_id is not None else None
            if isinstance(owner, PortListen):
                owner.request(event)
            else:
                event.id.destroy()
            return
        owner = event.id.user_context
        if isinstance(owner, CmConnection):
            owner.on_event(event)


async def _cm_of(ca: IbCa, call: str) -> CaCm:
    """The CA's CM, its channel started on first use (progress thread)."""
    ca.check(call)
    cm = ca.cm
    if cm is None:
        cm = ca.cm = CaCm(ca)
        assert ca.al.nursery is not None
        await ca.al.nursery.start(cm.run)
    return cm


def _open_cas(al: IbAl) -> list[IbCa]:
    return [h for h in al._children if isinstance(h, IbCa) and not h.destroyed]


# ---------------------------------------------------------------------------- listens
class IbCmListen(Handle):
    """A listen (``ib_listen_handle_t``); ``ib_cm_cancel`` ends it."""

    def __init__(self, al: IbAl, info: ib_cm_listen_t, listen_context: Any, port: int) -> None:
        super().__init__(al, None, listen_context)
        self.info = replace(info, p_compare_buffer=bytes(info.p_compare_buffer))
        self.port = port
        self.ports: list[PortListen] = []

    def matches(self, private_data: bytes, ca: IbCa) -> bool:
        """Whether a REQ with ``private_data`` that arrived on ``ca`` is for this listen."""
        info = self.info
        if info.ca_guid and info.ca_guid != ca.guid:
            return False
        if not info.compare_length:
            return True
        window = private_data[info.compare_offset : info.compare_offset + info.compare_length]
        return window == info.p_compare_buffer[: info.compare_length]

    def _close_resources(self) -> None:
        for port in self.ports:
            port.remove(self)
        self.ports.clear()


@dataclass(eq=False)
class PortListen:
    """A CA's listening CM ids at one TCP port, shared by the listens on that port."""

    cm: CaCm
    port: int
    cm_ids: list[Any] = field(default_factory=list)
    listens: list[IbCmListen] = field(default_factory=list)

    def open(self, ip: str = "") -> None:
        """Listen on every address of the CA's interface (IBAL's listen is per CA, not per IP),
        or on ``ip`` alone (the ``ib_cm_listen_t.ip`` extension)."""
        assert self.cm.channel is not None
        netdev = self.cm.ca.context.query_port(1).netdev
        addrs: list[Any] = [(ip, self.port)] if ip else []
        for entry in addressing.interfaces() if not ip else []:
            if entry.interface != netdev:
                continue
            family6 = entry.address.version == 6
            addrs.append(
                (str(entry.address), self.port, 0, entry.scope_id)
                if family6
                else (str(entry.address), self.port)
            )
        for addr in addrs:
            cm_id = self.cm.channel.create_id(self)
            try:
                cm_id.bind_addr(addr)
                cm_id.listen()
            except OSError:
                cm_id.destroy()
                self.close()
                raise
            self.cm_ids.append(cm_id)
        if not self.cm_ids:
            raise IbError(
                IbStatus.IB_INVALID_PORT_STATE, "ib_cm_listen", f"{netdev} has no IP address"
            )

    def close(self) -> None:
        for cm_id in self.cm_ids:
            cm_id.destroy()
        self.cm_ids.clear()
        self.cm.ports.pop(self.port, None)

    def remove(self, listen: IbCmListen) -> None:
        if listen in self.listens:
            self.listens.remove(listen)
        if not self.listens:
            self.close()

    def request(self, event: CMEvent) -> None:
        """A CONNECT_REQUEST: the REQ callback of the listen it matches, else refuse it."""
        child = event.id
        pdata = bytes(event.private_data)
        listen = next(
            (ln for ln in self.listens if not ln.destroyed and ln.matches(pdata, self.cm.ca)), None
        )
        if listen is None or child.context is not self.cm.ca.context:
            # IBAL answers a REQ no listen matches with REJ(IB_REJ_INVALID_SID); the MPA
            # counterpart is closing the connection unanswered, as a port without a listener
            # refuses it.
            log.info("ibal cm: no listen matches a REQ at port %d; refusing it", self.port)
            child.destroy()
            return
        param = event.param or ConnParam()
        conn = CmConnection(self.cm, CmMachine(passive=True), child, ib_qp_type_t(RC))
        conn.peer_param = param
        child.user_context = conn
        record = ib_cm_req_rec_t(
            context=listen.user_context,
            h_cm_req=conn,
            h_cm_listen=listen,
            p_req_pdata=pdata,
            qp_type=RC,
            resp_res=param.responder_resources,
            flow_ctrl=False,
            rnr_retry_cnt=param.rnr_retry_count,
            primary_path=_path_of(child, self.cm.ca),
        )
        if listen.info.pfn_cm_req_cb is not None:  # ib_cm_listen requires it
            listen.al.callback(listen.info.pfn_cm_req_cb, record)


def _path_of(cm_id: Any, ca: IbCa) -> ib_path_rec_t:
    """The path of an incoming connection as its requester sees it (its GID is the source)."""
    local, peer = cm_id.local_addr, cm_id.peer_addr
    netdev = ca.context.query_port(1).netdev
    ours = iwarp_gid(netdev)
    peer_if = addressing.interface_of(str(peer[0]))
    theirs = iwarp_gid(peer_if) if peer_if is not None else bytes(16)
    return ib_path_rec_t(
        dgid=ours,
        sgid=theirs,
        src_ip=str(peer[0]),
        dst_ip=str(local[0]),
        scope_id=peer[3] if len(peer) > 3 else 0,
        ifname=netdev,
        device_name=ca.device_name,
        ca_guid=ca.guid,
    )


def ib_cm_listen(h_al: IbAl, p_cm_listen: ib_cm_listen_t, listen_context: Any = None) -> IbCmListen:
    """Listen for REQs to ``svc_id`` (``ib_cm_listen``); returns the listen handle.

    IB_INVALID_PARAMETER without a REQ callback; IB_INVALID_SETTING for a
    service ID that maps to no TCP port, a QP type other than RC, a compare
    window outside the REQ private data, or a listen that is not unique (the
    same service ID without distinct compare buffers, or another service ID on
    the same port); IB_INVALID_GUID when the CA or port named is not open.
    """
    return h_al.call_async("ib_cm_listen", _listen, h_al, p_cm_listen, listen_context)


async def _listen(al: IbAl, info: ib_cm_listen_t, listen_context: Any) -> IbCmListen:
    call = "ib_cm_listen"
    if info.pfn_cm_req_cb is None:
        raise IbError(IbStatus.IB_INVALID_PARAMETER, call, "pfn_cm_req_cb is required")
    if info.qp_type != RC:
        raise IbError(IbStatus.IB_INVALID_SETTING, call, "iWARP connects RC QPs only")
    port = port_of_service_id(info.svc_id, call)
    if info.compare_offset + info.compare_length > PDATA_SIZE[CmMsg.REQ] or (
        len(info.p_compare_buffer) < info.compare_length
    ):
        raise IbError(IbStatus.IB_INVALID_SETTING, call, "compare window outside the REQ data")
    cas = [
        ca
        for ca in _open_cas(al)
        if info.ca_guid in (0, ca.guid) and info.port_guid in (0, ca.guid)
    ]
    if not cas:
        raise IbError(IbStatus.IB_INVALID_GUID, call, "no open CA (or port) matches the listen")
    listen = IbCmListen(al, info, listen_context, port)
    try:
        for ca in cas:
            cm = await _cm_of(ca, call)
            ports = cm.ports.get(port)
            for other in ports.listens if ports is not None else []:
                _check_unique(other.info, listen.info, call)
            if ports is None:
                ports = cm.ports[port] = PortListen(cm, port)
                ports.open(info.ip)
            ports.listens.append(listen)
            listen.ports.append(ports)
    except BaseException:
        listen._release()
        raise
    return listen


def _check_unique(old: ib_cm_listen_t, new: ib_cm_listen_t, call: str) -> None:
    if old.svc_id != new.svc_id:
        raise IbError(
            IbStatus.IB_INVALID_SETTING,
            call,
            f"service IDs {old.svc_id:#x} and {new.svc_id:#x} share TCP port {new.svc_id & 0xFFFF}",
        )
    if not old.compare_length or not new.compare_length:
        raise IbError(IbStatus.IB_INVALID_SETTING, call, "a listen on this service ID exists")
    if (old.compare_offset, old.compare_length) != (new.compare_offset, new.compare_length):
        raise IbError(IbStatus.IB_INVALID_SETTING, call, "compare offset and length must match")
    if old.p_compare_buffer[: old.compare_length] == new.p_compare_buffer[: new.compare_length]:
        raise IbError(IbStatus.IB_INVALID_SETTING, call, "the same compare buffer is listened on")


def ib_cm_cancel(h_cm_listen: IbCmListen, pfn_destroy_cb: DestroyCallback = None) -> None:
    """Stop listening (``ib_cm_cancel``); ``pfn_destroy_cb`` gets the listen context after."""
    if not isinstance(h_cm_listen, IbCmListen):
        raise IbError(IbStatus.IB_INVALID_HANDLE, "ib_cm_cancel", "not a listen handle")
    h_cm_listen.destroy("ib_cm_cancel", pfn_destroy_cb)


# ---------------------------------------------------------------------------- connections
class CmConnection:
    """One connection's CM handle (``ib_cm_handle_t``).

    It is the ``h_cm_req``, ``h_cm_rep`` and ``h_cm_dreq`` of the records: which
    calls it takes depends on its state (:class:`CmMachine`).
    """

    def __init__(self, cm: CaCm, machine: CmMachine, cm_id: Any, qp_type: ib_qp_type_t) -> None:
        self.cm = cm
        self.al = cm.ca.al
        self.machine = machine
        self.cm_id = cm_id
        self.qp_type = qp_type
        self.h_qp: IbQp | None = None
        self.callbacks: dict[CmMsg, Any] = {}
        self.peer_param = ConnParam()
        self.req: ib_cm_req_t | None = None

    def __repr__(self) -> str:
        return f"<ib_cm_handle {self.machine}>"

    @property
    def local_addr(self) -> tuple[Any, ...] | None:
        """Our IP endpoint of the connection (an extension: IB CM has no IP addresses, but
        an iWARP connection is a TCP connection; the ibal backend reports them)."""
        if self.cm_id is None:  # the connection is over
            return None
        addr: tuple[Any, ...] | None = self.cm_id.local_addr
        return addr

    @property
    def peer_addr(self) -> tuple[Any, ...] | None:
        """The peer's IP endpoint of the connection (see :attr:`local_addr`)."""
        if self.cm_id is None:
            return None
        addr: tuple[Any, ...] | None = self.cm_id.peer_addr
        return addr

    # ------------------------------------------------------------------ wire steps
    def send(self, steps: list[Send]) -> None:
        for step in steps:
            if step.wire is Wire.REJECT:
                self.cm_id.reject(step.private_data)
            elif step.wire is Wire.DISCONNECT:
                self.cm_id.disconnect()
        self._settle()

    def _settle(self) -> None:
        if self.machine.finished:
            if self.h_qp is not None and self.h_qp.cm_conn is self:
                self.h_qp.cm_conn = None
            if self.cm_id is not None:
                self.cm_id.destroy()
                self.cm_id = None

    # ------------------------------------------------------------------ transport events
    def on_event(self, event: CMEvent) -> None:
        kind = event.event
        if self.h_qp is not None and self.h_qp.destroyed:
            self.machine.destroyed()
        if kind == E.ADDR_RESOLVED:
            self._route_ready(event, resolve_route=True)
        elif kind == E.ROUTE_RESOLVED:
            self._route_ready(event, resolve_route=False)
        elif kind == E.ESTABLISHED:
            self.notify(self.machine.established(bytes(event.private_data)))
        elif kind == E.REJECTED:
            pdata = bytes(event.private_data)
            self.notify(self.machine.rejected(rej_status_for(True, event.status, pdata), pdata))
        elif kind in (E.ADDR_ERROR, E.ROUTE_ERROR, E.UNREACHABLE, E.CONNECT_ERROR):
            self.notify(self.machine.rejected(rej_status_for(False, event.status, b"")))
        elif kind == E.DISCONNECTED:
            self.notify(self.machine.disconnected())
        elif kind == E.DEVICE_REMOVAL:
            self.machine.destroyed()
        self._settle()

    def _route_ready(self, event: CMEvent, *, resolve_route: bool) -> None:
        """The active side's resolution steps, then bind the QP and send the REQ."""
        cm_id, req, h_qp = self.cm_id, self.req, self.h_qp
        assert req is not None and h_qp is not None
        try:
            if cm_id.context is not self.cm.ca.context:
                raise IbError(
                    IbStatus.IB_INVALID_SETTING, "ib_cm_req", "the route leaves by another CA"
                )
            if resolve_route:
                cm_id.resolve_route()
                return
            h_qp.bind(cm_id)
            param = ConnParam(req.p_req_pdata, req.resp_res, req.init_depth)
            cm_id.connect(param)
        except OSError as exc:
            log.info("ibal cm: REQ on %s failed: %s", h_qp, exc)
            status = -(exc.errno or errno.EIO)
            self.notify(self.machine.rejected(rej_status_for(False, status, b"")))

    # ------------------------------------------------------------------ callbacks
    def notify(self, notes: list[Notify]) -> None:
        h_qp = self.h_qp
        qp_context = h_qp.user_context if h_qp is not None else None
        for note in notes:
            record: Any
            if note.msg is CmMsg.REP:
                record = ib_cm_rep_rec_t(
                    p_rep_pdata=note.private_data,
                    qp_type=self.qp_type,
                    h_cm_rep=self,
                    qp_context=qp_context,
                    resp_res=self.peer_param.responder_resources,
                    flow_ctrl=False,
                )
            elif note.msg is CmMsg.RTU:
                record = ib_cm_rtu_rec_t(b"", h_qp, qp_context)
            elif note.msg is CmMsg.REJ:
                assert note.rej_status is not None
                record = ib_cm_rej_rec_t(note.rej_status, b"", note.private_data, h_qp, qp_context)
            elif note.msg is CmMsg.DREQ:
                record = ib_cm_dreq_rec_t(self, b"", qp_context)
            else:
                record = ib_cm_drep_rec_t(note.cm_status, b"", h_qp, qp_context)
            callback = self.callbacks.get(note.msg)
            if callback is not None:
                self.al.callback(callback, record)


def _connection(h_cm: Any, call: str) -> CmConnection:
    if not isinstance(h_cm, CmConnection):
        raise IbError(IbStatus.IB_INVALID_HANDLE, call, "not a connection handle")
    return h_cm


def _usable_qp(h_qp: Any, call: str, qp_type: int) -> IbQp:
    """The QP a REQ or REP names: an open, unbound RC QP of this AL."""
    if not isinstance(h_qp, IbQp) or h_qp.destroyed:
        raise IbError(IbStatus.IB_INVALID_QP_HANDLE, call, "not an open QP")
    if qp_type != RC or h_qp.create.qp_type != RC:
        raise IbError(IbStatus.IB_INVALID_SETTING, call, "iWARP connects RC QPs only")
    if h_qp.qp is not None or h_qp.cm_conn is not None:
        raise IbError(IbStatus.IB_INVALID_STATE, call, "the QP has a connection already")
    if h_qp.state is ib_qp_state_t.IB_QPS_ERROR:
        raise IbError(IbStatus.IB_INVALID_QP_STATE, call, "the QP is in ERROR")
    return h_qp


def ib_cm_req(p_cm_req: ib_cm_req_t) -> None:
    """Request a connection (``ib_cm_req``): the REP, REJ callbacks follow.

    The path's ``dst_ip`` (:func:`ibat_query_path`) is where the peer is
    reached, at the TCP port the service ID names; its source must be on the
    QP's CA (IB_INVALID_SETTING otherwise, as IBAL's "the primary path is not
    on the same channel adapter as the queue pair").
    """
    if p_cm_req is None or p_cm_req.p_primary_path is None:
        raise IbError(IbStatus.IB_INVALID_PARAMETER, "ib_cm_req", "a primary path is required")
    h_qp = p_cm_req.h_qp
    if not isinstance(h_qp, IbQp):
        raise IbError(IbStatus.IB_INVALID_QP_HANDLE, "ib_cm_req", "not a QP")
    h_qp.al.call_async("ib_cm_req", _req, p_cm_req)


async def _req(req: ib_cm_req_t) -> None:
    call = "ib_cm_req"
    h_qp = _usable_qp(req.h_qp, call, req.qp_type)
    if req.pfn_cm_rep_cb is None or req.pfn_cm_rej_cb is None:
        raise IbError(IbStatus.IB_INVALID_PARAMETER, call, "REP and REJ callbacks are required")
    port = port_of_service_id(req.svc_id, call)
    path = req.p_primary_path
    assert path is not None
    if path.device_name and path.device_name != h_qp.ca.device_name:
        raise IbError(
            IbStatus.IB_INVALID_SETTING,
            call,
            f"the path leaves by {path.device_name}, the QP is on {h_qp.ca.device_name}",
        )
    machine = CmMachine(passive=False)
    steps = machine.req(bytes(req.p_req_pdata))
    assert steps and steps[0].wire is Wire.CONNECT
    cm = await _cm_of(h_qp.ca, call)
    assert cm.channel is not None
    conn = CmConnection(cm, machine, None, ib_qp_type_t(req.qp_type))
    conn.req = replace(req, p_req_pdata=bytes(req.p_req_pdata))
    conn.h_qp = h_qp
    conn.callbacks = {
        CmMsg.REP: req.pfn_cm_rep_cb,
        CmMsg.REJ: req.pfn_cm_rej_cb,
        CmMsg.MRA: req.pfn_cm_mra_cb,
    }
    limit = (
        req.timeout_ms / 1000
        if req.timeout_ms
        else timeout_seconds(req.remote_resp_timeout, req.max_cm_retries)
    )
    cm_id = cm.channel.create_id(conn)
    conn.cm_id = cm_id
    cm_id.connect_timeout = limit
    if hasattr(cm_id, "mpa_reply_timeout"):
        cm_id.mpa_reply_timeout = limit
    six = ":" in path.dst_ip
    src = (path.src_ip, 0, 0, path.scope_id) if six else (path.src_ip, 0)
    dst = (path.dst_ip, port, 0, path.scope_id) if six else (path.dst_ip, port)
    h_qp.cm_conn = conn
    try:
        cm_id.resolve_addr(src if path.src_ip else None, dst, max(1, int(limit * 1000)))
    except BaseException:
        h_qp.cm_conn = None
        cm_id.destroy()
        raise


def ib_cm_rep(h_cm_req: CmConnection, p_cm_rep: ib_cm_rep_t) -> None:
    """Accept a REQ (``ib_cm_rep``) with ``h_qp``; the RTU (or REJ) callback follows."""
    conn = _connection(h_cm_req, "ib_cm_rep")
    conn.al.call("ib_cm_rep", _rep, conn, p_cm_rep)


def _rep(conn: CmConnection, rep: ib_cm_rep_t) -> None:
    call = "ib_cm_rep"
    h_qp = _usable_qp(rep.h_qp, call, rep.qp_type)
    if h_qp.ca is not conn.cm.ca:
        raise IbError(IbStatus.IB_INVALID_SETTING, call, "the QP is on another CA than the REQ")
    steps = conn.machine.rep(bytes(rep.p_rep_pdata))
    conn.h_qp = h_qp
    conn.callbacks = {
        CmMsg.RTU: rep.pfn_cm_rtu_cb,
        CmMsg.REJ: rep.pfn_cm_rej_cb,
        CmMsg.MRA: rep.pfn_cm_mra_cb,
        CmMsg.DREQ: rep.pfn_cm_dreq_cb,
    }
    h_qp.cm_conn = conn
    try:
        h_qp.bind(conn.cm_id)
    except IbError:
        conn.machine.rejected(ib_rej_status_t.IB_REJ_INSUF_QP)
        conn.cm_id.reject(b"")
        conn._settle()
        raise
    peer = conn.peer_param
    param = ConnParam(
        steps[0].private_data,
        responder_resources=peer.responder_resources,
        initiator_depth=min(rep.init_depth, peer.initiator_depth),
    )
    conn.cm_id.accept(param)


def ib_cm_rtu(h_cm_rep: CmConnection, p_cm_rtu: ib_cm_rtu_t) -> None:
    """The active side's ready-to-use (``ib_cm_rtu``): a local step on iWARP."""
    conn = _connection(h_cm_rep, "ib_cm_rtu")

    def rtu() -> None:
        conn.send(conn.machine.rtu(bytes(p_cm_rtu.p_rtu_pdata)))
        conn.callbacks[CmMsg.DREQ] = p_cm_rtu.pfn_cm_dreq_cb

    conn.al.call("ib_cm_rtu", rtu)


def ib_cm_rej(h_cm: CmConnection, p_cm_rej: ib_cm_rej_t) -> None:
    """Reject a REQ (passive: MPA Reject with the private data) or a REP (active)."""
    conn = _connection(h_cm, "ib_cm_rej")
    rej = p_cm_rej
    conn.al.call(
        "ib_cm_rej",
        lambda: conn.send(conn.machine.rej(bytes(rej.p_rej_pdata), bytes(rej.p_ari))),
    )


def ib_cm_mra(h_cm: CmConnection, p_cm_mra: ib_cm_mra_t) -> None:
    """Acknowledge a REQ or REP that needs time (``ib_cm_mra``): no wire message on iWARP."""
    conn = _connection(h_cm, "ib_cm_mra")
    mra = p_cm_mra
    conn.al.call(
        "ib_cm_mra", lambda: conn.send(conn.machine.mra(bytes(mra.p_mra_pdata), mra.svc_timeout))
    )


def ib_cm_dreq(p_cm_dreq: ib_cm_dreq_t) -> None:
    """Disconnect ``h_qp``'s connection (``ib_cm_dreq``); the DREP callback follows."""
    h_qp = p_cm_dreq.h_qp
    if not isinstance(h_qp, IbQp) or h_qp.destroyed:
        raise IbError(IbStatus.IB_INVALID_QP_HANDLE, "ib_cm_dreq", "not an open QP")

    def dreq() -> None:
        conn = h_qp.cm_conn
        if conn is None:
            raise IbError(IbStatus.IB_INVALID_STATE, "ib_cm_dreq", "the QP is not connected")
        steps = conn.machine.dreq(bytes(p_cm_dreq.p_dreq_pdata))
        conn.callbacks[CmMsg.DREP] = p_cm_dreq.pfn_cm_drep_cb
        conn.send(steps)

    h_qp.al.call("ib_cm_dreq", dreq)


def ib_cm_drep(h_cm_dreq: CmConnection, p_cm_drep: ib_cm_drep_t) -> None:
    """Answer the peer's disconnection (``ib_cm_drep``): a local completion on iWARP."""
    conn = _connection(h_cm_dreq, "ib_cm_drep")
    conn.al.call("ib_cm_drep", lambda: conn.send(conn.machine.drep(bytes(p_cm_drep.p_drep_pdata))))


__all__ = [
    "CmConnection",
    "IbCmListen",
    "ib_cm_cancel",
    "ib_cm_drep",
    "ib_cm_dreq",
    "ib_cm_listen",
    "ib_cm_mra",
    "ib_cm_rej",
    "ib_cm_rep",
    "ib_cm_req",
    "ib_cm_rtu",
]
