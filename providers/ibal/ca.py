"""Channel adapters: ``ib_get_ca_guids``, ``ib_open_ca``, ``ib_query_ca``, ``ib_close_ca``.

A CA is a device of the AL's portable HCA backend, named by its node GUID.
Opening it starts a task on the progress loop that holds the portable device
open (``async with backend.open_device(name)``) and, inside it, two readers:
one takes the context's asynchronous events and raises the CA, CQ, QP or SRQ
event callback they concern; the other takes completion events from the CA's
one completion channel and hands each to its CQ (:mod:`.cq`). Closing the CA
destroys what was created on it, closes the device and ends the task.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from rdmashim.providers.ibal.al import DestroyCallback, Handle, IbAl
from rdmashim.providers.ibal.events import code_for, ib_async_event_rec_t, ib_async_event_t
from rdmashim.providers.ibal.ibat import iwarp_gid
from rdmashim.providers.ibal.status import IbError, IbStatus
from rdmashim.verbs.backend import load_backend
from rdmashim.verbs.enums import AtomicCap, Transport
from rdmashim.verbs.errors import BackendUnavailable

if TYPE_CHECKING:
    from rdmashim.providers.ibal.cm import CaCm

log = logging.getLogger(__name__)

GID_LINK_LOCAL_PREFIX = 0xFE80_0000_0000_0000
"""The subnet prefix of an InfiniBand port's GID (link-local; the portable API has no GID query)."""

EventCallback = Callable[[ib_async_event_rec_t], None] | None
"""What ``pfn_*_event_cb`` takes: a callback given an :class:`ib_async_event_rec_t`, or None."""


@dataclass(frozen=True, slots=True)
class ib_gid_t:
    """``ib_gid_t``: a 64-bit subnet prefix and a 64-bit interface id (``raw``: 16 bytes)."""

    subnet_prefix: int
    interface_id: int

    @property
    def raw(self) -> bytes:
        """The 16 bytes of the GID, in network order."""
        return self.subnet_prefix.to_bytes(8, "big") + self.interface_id.to_bytes(8, "big")


@dataclass(frozen=True, slots=True)
class ib_port_attr_t:
    """``ib_port_attr_t``: what the HCA knows of a port.

    ``mtu`` holds an ``IB_MTU_LEN_*`` value (1 = 256 ... 5 = 4096 bytes),
    ``link_state`` an ``IB_LINK_*`` value (1 DOWN ... 4 ACTIVE), as IBAL does.
    ``port_guid`` is the node GUID for port 1 (plus the port number less one
    for other ports). ``p_gid_table`` holds the GID the transport derives: on iWARP
    the interface's MAC in the first six bytes (as Linux siw and :mod:`.ibat` make
    it), on InfiniBand the link-local prefix and the port GUID.
    """

    port_guid: int
    port_num: int
    mtu: int
    transport: Transport
    max_msg_size: int
    lid: int
    lmc: int
    sm_lid: int
    link_state: int
    num_gids: int
    num_pkeys: int
    p_gid_table: tuple[ib_gid_t, ...]
    netdev: str
    """The port's network interface (an extension: iWARP and RoCE ports have one)."""


@dataclass(frozen=True, slots=True)
class ib_ca_attr_t:
    """``ib_ca_attr_t``: the HCA's limits, with IBAL's field names, and its ports.

    ``fw_ver`` is the portable API's firmware string (IBAL's is a number);
    ``max_private_data`` and ``active_side_sends_first`` are the transport's
    connection limits (an iWARP CA carries 252 bytes of private data and its
    passive side must not send first).
    """

    ca_guid: int
    vend_id: int
    dev_id: int
    revision: int
    fw_ver: str
    max_qps: int
    max_wrs: int
    max_sges: int
    max_rd_sges: int
    max_cqs: int
    max_cqes: int
    max_pds: int
    init_regions: int
    init_region_size: int
    init_windows: int
    max_qp_resp_res: int
    max_resp_res: int
    max_qp_init_depth: int
    max_srq: int
    max_srq_wrs: int
    max_srq_sges: int
    max_inline: int
    atomicity: AtomicCap
    modify_wr_depth: bool
    modify_srq_depth: bool
    system_image_guid: int
    num_ports: int
    p_port_attr: tuple[ib_port_attr_t, ...]
    transport: Transport
    max_private_data: int
    active_side_sends_first: bool


class EventSource(Handle):
    """A handle with an asynchronous event callback (CA, CQ, QP, SRQ)."""

    def __init__(
        self, al: IbAl, parent: Handle | None, context: Any, pfn_event_cb: EventCallback
    ) -> None:
        super().__init__(al, parent, context)
        self.pfn_event_cb = pfn_event_cb

    def raise_event(self, code: ib_async_event_t, port_number: int = 0) -> None:
        """Queue the event callback with a record of ``code`` (if there is a callback)."""
        if self.pfn_event_cb is not None and not self.destroyed:
            record = ib_async_event_rec_t(code, self.user_context, self, port_number)
            self.al.callback(self.pfn_event_cb, record)


class SharedQueue(EventSource):
    """A CQ or SRQ: the QPs using it (``users``) must be destroyed before it."""

    def __init__(
        self, al: IbAl, parent: Handle | None, context: Any, pfn_event_cb: EventCallback
    ) -> None:
        super().__init__(al, parent, context, pfn_event_cb)
        self.users: set[Any] = set()
        """The QPs completing or receiving through this queue."""

    def _check_idle(self, call: str) -> None:
        self.check(call)
        if any(not user.destroyed for user in self.users):
            raise IbError(IbStatus.IB_RESOURCE_BUSY, call, "QPs still use it")

    def destroy_idle(self, call: str, pfn_destroy_cb: DestroyCallback) -> None:
        """Destroy as :meth:`Handle.destroy`, IB_RESOURCE_BUSY while QPs use the queue."""
        self.check(call)
        self.al.call(call, self._check_idle, call)
        self.destroy(call, pfn_destroy_cb)


class IbCa(EventSource):
    """An open CA (``ib_ca_handle_t``).

    ``context`` is the portable device context (the CM opens its ids on it),
    ``device_name`` and ``guid`` name the device, ``al`` is the access layer;
    ``user_context`` is the ``ca_context`` given to ``ib_open_ca``.
    """

    invalid = IbStatus.IB_INVALID_CA_HANDLE

    def __init__(
        self, al: IbAl, device_name: str, guid: int, pfn_ca_event_cb: EventCallback, ca_context: Any
    ) -> None:
        super().__init__(al, None, ca_context, pfn_ca_event_cb)
        self.device_name = device_name
        self.cm: CaCm | None = None
        """Its connection manager, made by :mod:`.cm` on first use (the CA owns it)."""
        self.guid = guid
        self.context: Any = None
        self.channel: Any = None
        self._scope: trio.CancelScope | None = None
        self._objects: dict[int, Any] = {}

    # ------------------------------------------------------------------ registry
    def register(self, portable: Any, handle: Any) -> None:
        """Route the events of ``portable`` (a CQ, QP or SRQ) to ``handle``."""
        self._objects[id(portable)] = handle

    def unregister(self, portable: Any) -> None:
        """Stop routing the events of ``portable``."""
        self._objects.pop(id(portable), None)

    # ------------------------------------------------------------------ tasks
    async def hold(self, backend: Any, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Keep the device open, reading its events, until the CA closes."""
        with trio.CancelScope() as self._scope:
            async with backend.open_device(self.device_name) as ctx:
                self.context = ctx
                self.channel = ctx.create_comp_channel()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._read_async_events, ctx)
                    nursery.start_soon(self._read_cq_events, self.channel)
                    task_status.started()

    async def _read_async_events(self, ctx: Any) -> None:
        while not self.destroyed:
            try:
                event = await ctx.get_async_event()
            except Exception as exc:  # the context closed under us
                log.debug("%s: async events end: %s", self.device_name, exc)
                return
            self._dispatch(event)

    def _dispatch(self, event: Any) -> None:
        code = code_for(event.event_type)
        element = event.element
        if element is None or isinstance(element, int):
            self.raise_event(code, element or 0)
            return
        handle = self._objects.get(id(element))
        if handle is None:
            log.debug("%s: %s for an object not made here", self.device_name, code.name)
            return
        handle.raise_event(code)

    async def _read_cq_events(self, channel: Any) -> None:
        while not self.destroyed:
            try:
                cq = await channel.get_cq_event()
                cq.ack_events(1)
            except Exception as exc:
                # While the CA is open this loses every later notification of its CQs:
                # say so where a test's captured log shows it.
                level = logging.DEBUG if self.destroyed else logging.WARNING
                log.log(level, "%s: completion events end: %r", self.device_name, exc)
                return
            handle = self._objects.get(id(cq))
            if handle is not None and not handle.destroyed:
                handle.completion_event()

    # ------------------------------------------------------------------ calls
    def query(self) -> ib_ca_attr_t:
        """The ``ib_query_ca`` body (progress thread)."""
        self.check("ib_query_ca")
        dev = self.context.query_device()
        ports = tuple(self._port_attr(dev, n) for n in range(1, dev.phys_port_cnt + 1))
        return ib_ca_attr_t(
            ca_guid=dev.node_guid,
            vend_id=dev.vendor_id,
            dev_id=dev.vendor_part_id,
            revision=dev.hw_ver,
            fw_ver=dev.fw_ver,
            max_qps=dev.max_qp,
            max_wrs=dev.max_qp_wr,
            max_sges=dev.max_sge,
            max_rd_sges=dev.max_sge_rd,
            max_cqs=dev.max_cq,
            max_cqes=dev.max_cqe,
            max_pds=dev.max_pd,
            init_regions=dev.max_mr,
            init_region_size=dev.max_mr_size,
            init_windows=dev.max_mw,
            max_qp_resp_res=dev.max_qp_rd_atom,
            max_resp_res=dev.max_qp_rd_atom,
            max_qp_init_depth=dev.max_qp_init_rd_atom,
            max_srq=dev.max_srq,
            max_srq_wrs=dev.max_srq_wr,
            max_srq_sges=dev.max_srq_sge,
            max_inline=dev.max_inline_data,
            atomicity=dev.atomic_cap,
            modify_wr_depth=False,
            modify_srq_depth=False,
            system_image_guid=dev.sys_image_guid,
            num_ports=dev.phys_port_cnt,
            p_port_attr=ports,
            transport=dev.transport,
            max_private_data=dev.max_private_data,
            active_side_sends_first=dev.active_side_sends_first,
        )

    def _port_attr(self, dev: Any, port_num: int) -> ib_port_attr_t:
        port = self.context.query_port(port_num)
        guid = dev.node_guid + port_num - 1
        return ib_port_attr_t(
            port_guid=guid,
            port_num=port_num,
            mtu=int(port.active_mtu),
            transport=dev.transport,
            max_msg_size=port.max_msg_sz,
            lid=port.lid,
            lmc=port.lmc,
            sm_lid=port.sm_lid,
            link_state=int(port.state),
            num_gids=port.gid_tbl_len,
            num_pkeys=0 if dev.transport is Transport.IWARP else 1,
            p_gid_table=(self._gid(dev, port.netdev, guid),),
            netdev=port.netdev,
        )

    @staticmethod
    def _gid(dev: Any, netdev: str, guid: int) -> ib_gid_t:
        if dev.transport is Transport.IWARP:
            raw = iwarp_gid(netdev, dev)
            return ib_gid_t(int.from_bytes(raw[:8], "big"), int.from_bytes(raw[8:], "big"))
        return ib_gid_t(GID_LINK_LOCAL_PREFIX, guid)

    def _close_resources(self) -> None:
        self._objects.clear()
        for resource in (self.channel, self.context):
            close_quietly(resource)
        if self._scope is not None:
            self._scope.cancel()


def close_quietly(resource: Any) -> None:
    """Close a portable resource; a failure is logged (the handle is gone either way)."""
    if resource is None:
        return
    try:
        resource.close()
    except Exception:
        log.warning("closing %r failed", resource, exc_info=True)


def _backend(al: IbAl, call: str) -> Any:
    try:
        return load_backend(al.hca_backend)
    except BackendUnavailable as exc:
        raise IbError(IbStatus.IB_UNSUPPORTED, call, str(exc)) from exc


def ib_get_ca_guids(h_al: IbAl) -> list[int]:
    """The node GUIDs of the AL's CAs (``ib_get_ca_guids``; no sizing call needed)."""
    return h_al.call("ib_get_ca_guids", _guids, h_al)


def _guids(al: IbAl) -> list[int]:
    return [dev.node_guid for dev in _backend(al, "ib_get_ca_guids").get_device_list()]


def ib_open_ca(
    h_al: IbAl, ca_guid: int, pfn_ca_event_cb: EventCallback = None, ca_context: Any = None
) -> IbCa:
    """Open the CA whose node GUID is ``ca_guid`` (``ib_open_ca``); IB_INVALID_GUID if none."""
    return h_al.call_async("ib_open_ca", _open_ca, h_al, ca_guid, pfn_ca_event_cb, ca_context)


async def _open_ca(al: IbAl, guid: int, pfn_ca_event_cb: EventCallback, ca_context: Any) -> IbCa:
    backend = _backend(al, "ib_open_ca")
    device = next((d for d in backend.get_device_list() if d.node_guid == guid), None)
    if device is None:
        raise IbError(IbStatus.IB_INVALID_GUID, "ib_open_ca", f"no CA with GUID {guid:#018x}")
    ca = IbCa(al, device.name, guid, pfn_ca_event_cb, ca_context)
    assert al.nursery is not None
    try:
        await al.nursery.start(ca.hold, backend)
    except BaseException:
        ca._release()
        raise
    return ca


def ib_query_ca(h_ca: IbCa) -> ib_ca_attr_t:
    """The CA's attributes and its ports' (``ib_query_ca``; no sizing call needed)."""
    h_ca.check("ib_query_ca")
    return h_ca.al.call("ib_query_ca", h_ca.query)


def ib_close_ca(h_ca: IbCa, pfn_destroy_cb: DestroyCallback = None) -> None:
    """Close the CA and destroy everything created on it (``ib_close_ca``)."""
    h_ca.destroy("ib_close_ca", pfn_destroy_cb)
