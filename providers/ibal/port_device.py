"""The portable verbs over IBAL, part 1: devices, contexts, PDs and MRs (backend ``ibal``).

As WinOF's libibverbs ran over IBAL, each portable object holds an IBAL
handle and each call is an ``ib_*`` call: ``open_device`` is ``ib_open_al``
on the HCA backend plus ``ib_open_ca``, ``query_device`` is ``ib_query_ca``,
``alloc_pd`` is ``ib_alloc_pd``, ``reg_mr`` is ``ib_reg_mem``. IBAL's
callbacks run on the AL's callback thread; what they report reaches the
application's trio loop through its ``TrioToken.run_sync_soon`` (in the
order the callbacks ran). CQs, QPs and SRQs are in :mod:`.port_queues`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, Self

import trio

from rdmashim.providers.ibal.al import (
    DEFAULT_HCA_BACKEND,
    HCA_ENV_VAR,
    IbAl,
    ib_close_al,
    ib_open_al,
)
from rdmashim.providers.ibal.ca import IbCa, ib_open_ca, ib_query_ca
from rdmashim.providers.ibal.events import FROM_PORTABLE, ib_async_event_rec_t
from rdmashim.providers.ibal.memory import (
    IbMr,
    IbPd,
    from_access,
    ib_alloc_pd,
    ib_dealloc_pd,
    ib_dereg_mr,
    ib_mr_create_t,
    ib_query_mr,
    ib_reg_mem,
    to_access,
)
from rdmashim.providers.ibal.status import IbError, IbStatus, errno_from_status
from rdmashim.verbs.attrs import AHAttr, DeviceAttr, PortAttr
from rdmashim.verbs.backend import load_backend, own
from rdmashim.verbs.enums import Access, Mtu, NodeType, PortState, QPType, Transport
from rdmashim.verbs.errors import NotSupported, VerbsError, check_access
from rdmashim.verbs.events import AsyncEvent, AsyncEventType
from rdmashim.verbs.wr import SGE

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from rdmashim.verbs import abc
    from rdmashim.verbs.attrs import QPCap

log = logging.getLogger(__name__)

BACKEND_NAME = "ibal"
PREFIX = "ibal_"
"""An ibal device is named after the HCA device it sits on: ``ibal_siw_lo``."""
IB_CMA_HEADER_LEN = 36
"""Bytes of REQ private data the rdma_cm IP header takes on an InfiniBand CA."""
REQ_PDATA = 92
"""IBAL's REQ private data limit, the smallest of REQ, REP (196) and REJ (148)."""

TO_PORTABLE: dict[int, AsyncEventType] = {}
for _portable, _ib in FROM_PORTABLE.items():
    TO_PORTABLE.setdefault(_ib, _portable)
"""The portable event type of each IBAL event code (the first portable type naming it)."""


def hca_backend() -> str:
    """The HCA backend the ibal devices sit on: ``RDMASHIM_IBAL_HCA``, else softiwarp."""
    name = os.environ.get(HCA_ENV_VAR) or DEFAULT_HCA_BACKEND
    if name == BACKEND_NAME:
        raise VerbsError(errno.EINVAL, "ibal", f"{HCA_ENV_VAR}=ibal: IBAL cannot sit on itself")
    return name


def raise_verbs(operation: str, exc: IbError) -> NoReturn:
    """Raise ``exc`` as the portable API's error (NotSupported for IB_UNSUPPORTED)."""
    if exc.status is IbStatus.IB_UNSUPPORTED:
        raise NotSupported(operation, str(exc)) from exc
    raise VerbsError(errno_from_status(exc.status), operation, str(exc)) from exc


@contextlib.contextmanager
def verbs_errors(operation: str) -> Iterator[None]:
    """Turn an :class:`IbError` of the block into a :class:`VerbsError` of ``operation``."""
    try:
        yield
    except IbError as exc:
        raise_verbs(operation, exc)


@dataclass(frozen=True, slots=True)
class Device:
    """An ibal device: one CA of the HCA backend (``hca_device`` of ``hca_backend``)."""

    name: str
    node_guid: int
    hca_device: str
    hca_backend: str
    netdev: str | None = None
    """The network interface of the HCA device, where its backend says."""
    backend: str = BACKEND_NAME

    @property
    def sits_on(self) -> str:
        """``device (backend)`` of the HCA under it, as ``rdmashim devices`` shows it."""
        return f"{self.hca_device} ({self.hca_backend})"


def get_device_list() -> list[Device]:
    """One device per CA of the HCA backend."""
    hca = hca_backend()
    return [
        Device(
            PREFIX + dev.name,
            dev.node_guid,
            dev.name,
            hca,
            dev.netdev,
        )
        for dev in load_backend(hca).get_device_list()
    ]


class Context:
    """An opened ibal device: an AL on the HCA backend and its open CA (see module docstring).

    ``al`` and ``ca`` are the IBAL handles; ``token`` is the application's trio
    loop, where callbacks are delivered.
    """

    backend = BACKEND_NAME

    def __init__(self, device: Device) -> None:
        self.device = device
        self.token = trio.lowlevel.current_trio_token()
        self._events_in, self._events_out = trio.open_memory_channel[AsyncEvent](1024)
        self.closed = False
        self.close_listeners: list[Callable[[], None]] = []
        """Called when the context closes (the CM ids on it report DEVICE_REMOVAL)."""
        self.al: IbAl = ib_open_al(device.hca_backend)
        try:
            self.ca: IbCa = ib_open_ca(self.al, device.node_guid, self._ca_event, self)
        except BaseException:
            ib_close_al(self.al)
            raise
        self._attr: DeviceAttr | None = None
        self.qp_numbers: dict[int, int] = {}
        """The HCA's QP numbers of bound QPs -> this backend's (see ``port_queues.QP``)."""
        self.pds: weakref.WeakSet[PD] = weakref.WeakSet()

    def __repr__(self) -> str:
        return f"<ibal Context {self.device.name}>"

    # ------------------------------------------------------------------ app loop
    def to_app(self, fn: Callable[..., object], *args: object) -> None:
        """Run ``fn(*args)`` on the application's trio loop (from a callback).

        An exception there would kill the application's trio run (``run_sync_soon``
        callbacks must not raise): it is logged instead.
        """

        def guarded() -> None:
            try:
                fn(*args)
            except Exception:
                log.exception("ibal: %s on the application's loop failed", fn)

        with contextlib.suppress(trio.RunFinishedError):
            self.token.run_sync_soon(guarded)

    def event_handler(self, element: object) -> Callable[[ib_async_event_rec_t], None]:
        """An IBAL event callback queuing the portable event of ``element``."""

        def on_event(rec: ib_async_event_rec_t) -> None:
            kind = TO_PORTABLE.get(rec.code)
            if kind is not None:
                self.to_app(self._queue_event, AsyncEvent(kind, element))  # type: ignore[arg-type]

        return on_event

    def _ca_event(self, rec: ib_async_event_rec_t) -> None:
        kind = TO_PORTABLE.get(rec.code)
        if kind is not None:
            self.to_app(self._queue_event, AsyncEvent(kind, rec.port_number or None))

    def _queue_event(self, event: AsyncEvent) -> None:
        with contextlib.suppress(trio.WouldBlock, trio.ClosedResourceError):
            self._events_in.send_nowait(event)

    async def get_async_event(self) -> AsyncEvent:
        """The next asynchronous event (CA, CQ, QP and SRQ event callbacks)."""
        try:
            return await self._events_out.receive()
        except trio.EndOfChannel:
            raise VerbsError(errno.EBADF, "get_async_event", "context closed") from None

    # ------------------------------------------------------------------ queries
    def query_device(self) -> DeviceAttr:
        """``ib_query_ca``'s attributes; ``max_private_data`` is IBAL's REQ limit (less the
        rdma_cm IP header on an InfiniBand CA)."""
        if self._attr is not None:
            return self._attr
        with verbs_errors("query_device"):
            a = ib_query_ca(self.ca)
        ib = a.transport is Transport.IB
        self._attr = DeviceAttr(
            fw_ver=a.fw_ver, node_guid=a.ca_guid, vendor_id=a.vend_id, vendor_part_id=a.dev_id,
            hw_ver=a.revision, phys_port_cnt=a.num_ports, max_mr_size=a.init_region_size,
            page_size_cap=4096, max_qp=a.max_qps, max_qp_wr=a.max_wrs, max_sge=a.max_sges,
            max_sge_rd=a.max_rd_sges, max_cq=a.max_cqs, max_cqe=a.max_cqes, max_mr=a.init_regions,
            max_pd=a.max_pds, max_qp_rd_atom=a.max_qp_resp_res,
            max_qp_init_rd_atom=a.max_qp_init_depth, max_srq=a.max_srq,
            max_srq_wr=a.max_srq_wrs, max_srq_sge=a.max_srq_sges, max_inline_data=0,
            atomic_cap=a.atomicity, transport=a.transport,
            node_type=NodeType.CA if ib else NodeType.RNIC,
            max_private_data=min(a.max_private_data, REQ_PDATA - (IB_CMA_HEADER_LEN if ib else 0)),
            active_side_sends_first=a.active_side_sends_first, max_mw=0,
            sys_image_guid=a.system_image_guid,
        )  # fmt: skip
        return self._attr

    def query_port(self, port_num: int = 1) -> PortAttr:
        """``ib_query_ca``'s port ``port_num``."""
        with verbs_errors("query_port"):
            a = ib_query_ca(self.ca)
        if not 1 <= port_num <= a.num_ports:
            raise VerbsError(errno.EINVAL, "query_port", f"no port {port_num}")
        p = a.p_port_attr[port_num - 1]
        return PortAttr(
            state=PortState(p.link_state), max_mtu=Mtu(p.mtu), active_mtu=Mtu(p.mtu),
            gid_tbl_len=p.num_gids, max_msg_sz=p.max_msg_size,
            link_layer="InfiniBand" if a.transport is Transport.IB else "Ethernet",
            netdev=p.netdev, lid=p.lid, sm_lid=p.sm_lid, lmc=p.lmc,
        )  # fmt: skip

    # ------------------------------------------------------------------ objects
    def query_gid(self, port_num: int, index: int) -> bytes:
        """Refused: IBAL here serves iWARP, which has no UD to address by GID."""
        raise NotSupported("query_gid", "no GID table (IBAL over iWARP: iWARP has no UD)")

    def alloc_pd(self) -> PD:
        """``ib_alloc_pd``."""
        self._check("alloc_pd")
        return PD(self)

    def create_comp_channel(self) -> abc.CompChannel:
        """A completion channel (events arrive on the application's loop)."""
        from rdmashim.providers.ibal.port_queues import CompChannel

        self._check("create_comp_channel")
        return CompChannel(self)

    def create_cq(
        self,
        cqe: int,
        channel: abc.CompChannel | None = None,
        *,
        handler: abc.CQHandler | None = None,
    ) -> abc.CQ:
        """``ib_create_cq`` with a completion callback; it reports to ``channel`` or
        calls ``handler`` on the application's loop."""
        from rdmashim.providers.ibal.port_queues import CQ

        self._check("create_cq")
        return CQ(self, cqe, channel, handler)

    def _check(self, operation: str) -> None:
        if self.closed:
            raise VerbsError(errno.EBADF, operation, "context closed")

    def close(self) -> None:
        """``ib_close_al``: closes the CA and everything created on it."""
        if self.closed:
            return
        self.closed = True
        listeners, self.close_listeners = self.close_listeners, []
        for listener in listeners:
            listener()
        self._events_in.close()
        ib_close_al(self.al)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@asynccontextmanager
async def open_device(name: str | None = None) -> AsyncIterator[Context]:
    """Open ibal device ``name`` (the first, ``ibal_siw_lo`` on the built-in engine, if None)."""
    devices = get_device_list()
    device: Device | None
    if name is None:
        lo = [d for d in devices if d.netdev == "lo"]
        device = next(iter(lo or devices), None)
    else:
        device = next((d for d in devices if d.name == name), None)
    if device is None:
        raise VerbsError(errno.ENODEV, "open_device", f"no ibal device {name!r}")
    with verbs_errors("open_device"):
        ctx = Context(device)
    try:
        yield ctx
    finally:
        ctx.close()


class PD:
    """A protection domain: ``ib_alloc_pd`` (``h_pd``)."""

    def __init__(self, context: Context) -> None:
        self.context = context
        self.qps: weakref.WeakSet[Any] = weakref.WeakSet()
        """Its QPs (their HCA numbers are learnt once bound)."""
        context.pds.add(self)
        with verbs_errors("alloc_pd"):
            self.h_pd: IbPd = ib_alloc_pd(context.ca, pd_context=self)
        self.closed = False

    def reg_mr(
        self, buffer: Buffer, access: Access = Access.LOCAL_WRITE, *, iova: int | None = None
    ) -> MR:
        """``ib_reg_mem`` of the whole buffer (``iova``: the facade's ``ib_mr_create_t.iova``)."""
        access = check_access("reg_mr", access)
        try:
            view = memoryview(buffer).cast("B")
        except TypeError as exc:
            raise VerbsError(errno.EINVAL, "reg_mr", str(exc)) from exc
        try:
            with verbs_errors("reg_mr"):
                _, _, h_mr = ib_reg_mem(
                    self.h_pd, ib_mr_create_t(view, view.nbytes, from_access(access), iova)
                )
        except BaseException:
            view.release()
            raise
        return MR(self, h_mr, view)

    def create_qp(
        self,
        *,
        send_cq: abc.CQ,
        recv_cq: abc.CQ,
        cap: QPCap | None = None,
        srq: abc.SRQ | None = None,
        sq_sig_all: bool = False,
        qp_type: QPType = QPType.RC,
    ) -> abc.QP:
        """``ib_create_qp``: an unbound QP (a CM id's ``connect``/``accept`` binds it)."""
        from rdmashim.providers.ibal.port_queues import QP

        if qp_type is not QPType.RC:
            raise NotSupported(
                "create_qp", f"{qp_type.name} QPs (IBAL over iWARP: iWARP has no UD, RC only)"
            )
        return QP(self, send_cq, recv_cq, cap, srq, sq_sig_all)

    def create_ah(self, attr: AHAttr) -> abc.AH:
        """Refused: address vectors are for UD, which iWARP lacks."""
        raise NotSupported("create_ah", "UD (IBAL over iWARP: iWARP has no UD)")

    def create_srq(self, max_wr: int = 128, max_sge: int = 1) -> abc.SRQ:
        """``ib_create_srq``."""
        from rdmashim.providers.ibal.port_queues import SRQ

        return SRQ(self, max_wr, max_sge)

    def close(self) -> None:
        """``ib_dealloc_pd`` (destroys its QPs, SRQs and MRs)."""
        if self.closed or self.context.closed:
            self.closed = True
            return
        self.closed = True
        with contextlib.suppress(IbError):
            ib_dealloc_pd(self.h_pd)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def own_pd(pd: object, operation: str) -> PD:
    """``pd`` as an ibal PD (EINVAL for another backend's)."""
    return own(pd, PD, operation)


class MR:
    """A registered region: ``ib_reg_mem`` (``h_mr``)."""

    def __init__(self, pd: PD, h_mr: IbMr, view: memoryview) -> None:
        self.pd = pd
        self.h_mr = h_mr
        self.buf = view
        self.addr: int = int(h_mr.mr.addr)
        self.iova = h_mr.vaddr
        self.length = h_mr.length
        with verbs_errors("reg_mr"):
            attr = ib_query_mr(h_mr)
        self.lkey: int = attr.lkey
        self.rkey: int = attr.rkey
        self.access: Access = to_access(attr.access_ctrl)
        self.closed = False

    def sge(self, offset: int = 0, length: int | None = None) -> SGE:
        """An SGE over ``[offset, offset + length)`` of the region."""
        if length is None:
            length = self.length - offset
        if offset < 0 or length < 0 or offset + length > self.length:
            raise VerbsError(errno.EINVAL, "sge", f"[{offset}, +{length}) outside the region")
        return SGE(self.iova + offset, length, self.lkey)

    def dereg(self) -> None:
        """``ib_dereg_mr``."""
        self.close()

    def close(self) -> None:
        """``ib_dereg_mr`` (idempotent)."""
        if self.closed:
            return
        self.closed = True
        if not self.h_mr.destroyed:
            with contextlib.suppress(IbError):
                ib_dereg_mr(self.h_mr)
        self.buf.release()  # the buffer may move again

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["MR", "PD", "Context", "Device", "get_device_list", "open_device"]
