"""Devices and opened contexts of the rdma-core backend.

``open_device`` hands out librdmacm's own context for the device when
librdmacm is available (``rdma_get_devices``; borrowed: librdmacm keeps it
open while it is loaded), because librdmacm accepts only PDs and QPs made on
the context it opened itself (``id->verbs``). Without librdmacm the device is
opened with ``ibv_open_device``. Either way closing the context closes
everything created from it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import weakref
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import trio

from rdmashim.providers.rdmacore import lib
from rdmashim.providers.rdmacore.base import Resource
from rdmashim.providers.rdmacore.cdefs import ffi
from rdmashim.providers.rdmacore.completion import CQ, CompChannel
from rdmashim.providers.rdmacore.events import PORT_EVENTS, QP_ERROR_EVENTS
from rdmashim.providers.rdmacore.memory import PD
from rdmashim.verbs import abc
from rdmashim.verbs.attrs import DeviceAttr, PortAttr
from rdmashim.verbs.backend import own
from rdmashim.verbs.enums import AtomicCap, Mtu, NodeType, PortState, QPState, Transport
from rdmashim.verbs.errors import BackendUnavailable, VerbsError, check_cq_target
from rdmashim.verbs.events import AsyncEvent, AsyncEventType

log = logging.getLogger(__name__)

BACKEND_NAME = "rdmacore"
SYSFS = Path("/sys/class/infiniband")
IWARP_PRIVATE_DATA = 248
"""What Linux's iw_cm with siw carries (6.1, measured: a 252-byte connect is rejected;
MPA allows 256, of which MPA v2's IRD/ORD block takes 4)."""
IB_PRIVATE_DATA = 56
"""rdma_cm's limit for a connect on IB/RoCE (``rdma_connect(3)``): the IB CM's REQ carries
92 bytes, of which rdma_cm's own header takes 36. ``max_private_data`` reports it, the
smallest of the three (:data:`IB_CM_PRIVATE_DATA`)."""
IB_CM_PRIVATE_DATA = {"connect": IB_PRIVATE_DATA, "accept": 196, "reject": 148}
"""Private data each operation carries on IB/RoCE: the REQ's (less rdma_cm's header),
the REP's and the REJ's whole private data fields (the kernel's ``ib_cm.h``
``IB_CM_REP_PRIVATE_DATA_SIZE`` and ``IB_CM_REJ_PRIVATE_DATA_SIZE``)."""
NO_DEVICE_HINT = (
    "load a driver, or add a software device: "
    "modprobe siw rdma_ucm; rdma link add siw0 type siw netdev eth0"
)


def _byteswapped64(value: int) -> int:
    return int.from_bytes(value.to_bytes(8, "little"), "big")


def _enum(kind: Any, value: int, default: Any) -> Any:
    try:
        return kind(value)
    except ValueError:
        return default


@dataclass(frozen=True, slots=True)
class Device:
    """An RDMA device libibverbs knows (``ibv_device``)."""

    name: str
    node_guid: int
    transport: Transport
    node_type: NodeType
    backend: str = BACKEND_NAME

    @property
    def netdev(self) -> str | None:
        """The network interface of its first port (sysfs), None if sysfs does not say."""
        return netdev_of(self.name, 1) or None


def netdev_of(device: str, port_num: int) -> str:
    """The network interface of a device's port, from sysfs ("" if sysfs does not say).

    RoCE ports name it in their GID attributes, hardware devices have a ``net``
    folder; a software iWARP device (siw) has neither, but its GID is its
    interface's MAC followed by zeros, so the interface with that MAC is it.
    """
    port = SYSFS / device / "ports" / str(port_num)
    try:
        return (port / "gid_attrs" / "ndevs" / "0").read_text().strip()
    except OSError:
        pass
    try:
        return next((SYSFS / device / "device" / "net").iterdir()).name
    except (OSError, StopIteration):
        pass
    try:
        gid = bytes.fromhex((port / "gids" / "0").read_text().strip().replace(":", ""))
    except (OSError, ValueError):
        return ""
    if len(gid) != 16 or any(gid[6:]) or not any(gid[:6]):
        return ""
    for name, entries in psutil.net_if_addrs().items():
        for entry in entries:
            if entry.family == psutil.AF_LINK and entry.address:
                mac = entry.address.replace(":", "").replace("-", "").lower()
                if mac == gid[:6].hex():
                    return name
    return ""


def _device_of(dev: Any) -> Device:
    return Device(
        ffi.string(dev.name).decode(),
        _byteswapped64(lib.verbs().ibv_get_device_guid(dev)),
        _enum(Transport, dev.transport_type, Transport.IB),
        _enum(NodeType, dev.node_type, NodeType.CA),
    )


def _native_list() -> tuple[Any, int]:
    """(``ibv_device **`` or NULL, errno): the library's device list."""
    v = lib.verbs()
    count = ffi.new("int *")
    devices = v.ibv_get_device_list(count)
    if devices == ffi.NULL:
        return devices, lib.last_errno()
    return ffi.gc(devices, v.ibv_free_device_list), 0


def _entries(devices: Any) -> list[Any]:
    out = []
    i = 0
    while devices != ffi.NULL and devices[i] != ffi.NULL:
        out.append(devices[i])
        i += 1
    return out


def _why_no_device(err: int) -> str:
    if err == errno.ENOSYS or not Path("/sys/class/infiniband_verbs").exists():
        return f"no RDMA device: this kernel offers no RDMA verbs ({NO_DEVICE_HINT})"
    return f"no RDMA device ({NO_DEVICE_HINT})"


def get_device_list() -> list[Device]:
    """The RDMA devices of this machine; [] if there are none (or the kernel has no RDMA)."""
    devices, err = _native_list()
    if err:
        log.debug("ibv_get_device_list: %s", os.strerror(err))
    return [_device_of(dev) for dev in _entries(devices)]


def unavailable_reason() -> str | None:
    """None if a device can be opened here, else why not (libraries missing, no device)."""
    try:
        devices, err = _native_list()
    except BackendUnavailable as exc:
        return str(exc)
    if not _entries(devices):
        return _why_no_device(err)
    return None


def _rdmacm_context(name: str) -> Any:
    """librdmacm's context for device ``name``, or None (no librdmacm, or it lacks it)."""
    try:
        cm = lib.rdmacm()
    except BackendUnavailable as exc:
        log.debug("opening %s without librdmacm: %s", name, exc)
        return None
    contexts = cm.rdma_get_devices(ffi.NULL)
    if contexts == ffi.NULL:
        log.debug("rdma_get_devices: %s", os.strerror(lib.last_errno()))
        return None
    try:
        for ctx in _entries(contexts):
            if ffi.string(ctx.device.name).decode() == name:
                return ctx
        return None
    finally:
        cm.rdma_free_devices(contexts)


INLINE_PROBE_LIMIT = 1 << 16
"""The largest ``max_inline_data`` the probe tries (no provider takes more)."""
IBV_QPT_RC = 2


def _probe_max_inline(ctx: Any) -> int:
    """The largest ``cap.max_inline_data`` with which ``ibv_create_qp`` makes an RC QP."""
    v = lib.verbs()
    pd = v.ibv_alloc_pd(ctx)
    if pd == ffi.NULL:
        log.debug("inline probe: ibv_alloc_pd: %s", os.strerror(lib.last_errno()))
        return 0
    cq = v.ibv_create_cq(ctx, 1, ffi.NULL, ffi.NULL, 0)
    try:
        if cq == ffi.NULL:
            log.debug("inline probe: ibv_create_cq: %s", os.strerror(lib.last_errno()))
            return 0

        def takes(n: int) -> int | None:
            """What the provider gives for a request of ``n`` bytes (None: refused)."""
            attr = ffi.new("struct ibv_qp_init_attr *")
            attr.send_cq = attr.recv_cq = cq
            attr.cap.max_send_wr = attr.cap.max_recv_wr = 1
            attr.cap.max_send_sge = attr.cap.max_recv_sge = 1
            attr.cap.max_inline_data = n
            attr.qp_type = IBV_QPT_RC
            qp = v.ibv_create_qp(pd, attr)
            if qp == ffi.NULL:
                return None
            given: int = attr.cap.max_inline_data
            v.ibv_destroy_qp(qp)
            return max(n, given)

        best = takes(0)
        if best is None:
            return 0
        refused = INLINE_PROBE_LIMIT + 1
        n = 64
        while best < n <= INLINE_PROBE_LIMIT:
            got = takes(n)
            if got is None:
                refused = n
                break
            best = got
            n = max(2 * n, best + 1)
        while refused - best > 1:
            mid = (best + refused) // 2
            got = takes(mid)
            if got is None:
                refused = mid
            else:
                best = max(best, got)
        return min(best, INLINE_PROBE_LIMIT)
    finally:
        if cq != ffi.NULL:
            v.ibv_destroy_cq(cq)
        v.ibv_dealloc_pd(pd)


@asynccontextmanager
async def open_device(name: str | None = None) -> AsyncIterator[Context]:
    """Open a device (the first one if ``name`` is None); closes it and its children after."""
    devices, err = _native_list()
    entries = _entries(devices)
    if not entries:
        raise BackendUnavailable(f"rdmacore: {_why_no_device(err)}")
    known = {ffi.string(dev.name).decode(): dev for dev in entries}
    if name is None:
        name = next(iter(known))
    if name not in known:
        raise VerbsError(
            errno.ENODEV, "open_device", f"no device {name!r} (have: {', '.join(known)})"
        )
    device = _device_of(known[name])
    ptr = _rdmacm_context(name)
    borrowed = ptr is not None
    if ptr is None:
        ptr = lib.check_ptr(lib.verbs().ibv_open_device(known[name]), "ibv_open_device")
    del devices, entries, known
    ctx = Context(device, ptr, borrowed)
    try:
        yield ctx
    finally:
        ctx.close()
    await trio.lowlevel.checkpoint()


class Context(Resource):
    """An opened device (``ibv_context``)."""

    _kind = "device context"

    def __init__(self, device: Device, ptr: Any, borrowed: bool) -> None:
        super().__init__()
        self.device = device
        self._ptr = ptr
        self.borrowed = borrowed
        """True for librdmacm's context (closing it leaves the C context open)."""
        self._objects: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
        self._qps: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
        self._async_fd: int = ptr.async_fd
        self._async_nonblocking = False
        self._max_inline: int | None = None
        self.immediate_data = device.transport is not Transport.IWARP
        """Whether Send and RDMA Write with immediate data can be posted: not on iWARP,
        whose verbs (Linux siw and iw_* providers, RFC 5040) carry no immediate data
        without RFC 7306."""
        self._created()

    @property
    def backend(self) -> str:
        """Name of the backend serving this context."""
        return BACKEND_NAME

    def _track(self, ptr: Any, obj: Any) -> None:
        """Remember which Python object wraps a CQ, QP or SRQ (for async events)."""
        self._objects[lib.address(ptr)] = obj

    def _track_qp(self, qp_num: int, qp: Any) -> None:
        """Remember a QP by number (completions name their QP so)."""
        self._qps[qp_num] = qp

    def _cq_handler_failed(self, cq: Any, why: Exception) -> None:
        """``cq``'s completion handler raised: the QPs completing into it go to ERR."""
        for qp in list(self._qps.values()):
            if (qp.send_cq is cq or qp.recv_cq is cq) and not qp.closed:
                with contextlib.suppress(OSError):
                    qp.modify(qp_state=QPState.ERR)
                qp._failed(why)

    def _qp_failed(self, qp_num: int, why: Exception) -> None:
        """A completion with an error status came from QP ``qp_num``: it is in ERR."""
        qp = self._qps.get(qp_num)
        if qp is not None:
            qp._failed(why)

    def _max_inline_data(self) -> int:
        """The most inline data an RC QP of this device takes (probed once, then cached).

        libibverbs has no device attribute for it, so QPs are created with growing
        ``cap.max_inline_data`` until the provider refuses one, then the limit is
        bisected; a provider that rounds up reports the larger value in the
        ``ibv_qp_init_attr.cap`` it fills in, and that is taken as the floor.
        """
        if self._max_inline is None:
            self._max_inline = _probe_max_inline(self._ptr)
        return self._max_inline

    def query_device(self) -> DeviceAttr:
        """Limits and capabilities of the device."""
        self._check_open("query_device")
        a = ffi.new("struct ibv_device_attr *")
        lib.check(lib.verbs().ibv_query_device(self._ptr, a), "ibv_query_device")
        iwarp = self.device.transport is Transport.IWARP
        return DeviceAttr(
            fw_ver=ffi.string(a.fw_ver).decode(errors="replace"),
            node_guid=_byteswapped64(a.node_guid),
            sys_image_guid=_byteswapped64(a.sys_image_guid),
            device_cap_flags=a.device_cap_flags,
            vendor_id=a.vendor_id,
            vendor_part_id=a.vendor_part_id,
            hw_ver=a.hw_ver,
            phys_port_cnt=a.phys_port_cnt,
            max_mr_size=a.max_mr_size,
            page_size_cap=a.page_size_cap,
            max_qp=a.max_qp,
            max_qp_wr=a.max_qp_wr,
            max_sge=a.max_sge,
            max_sge_rd=a.max_sge_rd,
            max_cq=a.max_cq,
            max_cqe=a.max_cqe,
            max_mr=a.max_mr,
            max_pd=a.max_pd,
            max_qp_rd_atom=a.max_qp_rd_atom,
            max_qp_init_rd_atom=a.max_qp_init_rd_atom,
            max_srq=a.max_srq,
            max_srq_wr=a.max_srq_wr,
            max_srq_sge=a.max_srq_sge,
            max_inline_data=self._max_inline_data(),
            atomic_cap=_enum(AtomicCap, a.atomic_cap, AtomicCap.NONE),
            transport=self.device.transport,
            node_type=self.device.node_type,
            max_private_data=IWARP_PRIVATE_DATA if iwarp else IB_PRIVATE_DATA,
            active_side_sends_first=iwarp,
            max_mw=a.max_mw,
        )

    def query_port(self, port_num: int = 1) -> PortAttr:
        """State and limits of port ``port_num`` (numbered from 1)."""
        self._check_open("query_port")
        a = ffi.new("struct ibv_port_attr *")
        lib.check(lib.verbs().ibv_query_port(self._ptr, port_num, a), "ibv_query_port")
        return PortAttr(
            state=_enum(PortState, a.state, PortState.NOP),
            max_mtu=_enum(Mtu, a.max_mtu, Mtu.MTU_256),
            active_mtu=_enum(Mtu, a.active_mtu, Mtu.MTU_256),
            gid_tbl_len=a.gid_tbl_len,
            max_msg_sz=a.max_msg_sz,
            link_layer="Ethernet" if a.link_layer == 2 else "InfiniBand",
            netdev=netdev_of(self.device.name, port_num),
            lid=a.lid,
            sm_lid=a.sm_lid,
            lmc=a.lmc,
            port_cap_flags=a.port_cap_flags,
        )

    def query_gid(self, port_num: int, index: int) -> bytes:
        """Entry ``index`` of port ``port_num``'s GID table (``ibv_query_gid``)."""
        self._check_open("query_gid")
        gid = ffi.new("union ibv_gid *")
        lib.check(lib.verbs().ibv_query_gid(self._ptr, port_num, index, gid), "ibv_query_gid")
        return bytes(gid.raw)

    def alloc_pd(self) -> PD:
        """A new protection domain."""
        self._check_open("alloc_pd")
        return PD(self)

    def create_comp_channel(self) -> CompChannel:
        """A completion channel that CQs can report events to."""
        self._check_open("create_comp_channel")
        return CompChannel(self)

    def create_cq(
        self,
        cqe: int,
        channel: abc.CompChannel | None = None,
        *,
        handler: abc.CQHandler | None = None,
    ) -> CQ:
        """A completion queue holding at least ``cqe`` completions, reporting to
        ``channel`` or calling ``handler`` (:meth:`CQ.set_handler`)."""
        self._check_open("create_cq")
        check_cq_target("create_cq", channel, handler)
        cq = CQ(self, cqe, None if channel is None else own(channel, CompChannel, "create_cq"))
        if handler is not None:
            cq.set_handler(handler)
        return cq

    async def get_async_event(self) -> AsyncEvent:
        """Wait for the next asynchronous event (acknowledged at once: it is copied)."""
        self._check_open("get_async_event")
        if not self._async_nonblocking:
            os.set_blocking(self._async_fd, False)
            self._async_nonblocking = True
        v = lib.verbs()
        event = ffi.new("struct ibv_async_event *")
        while True:
            if v.ibv_get_async_event(self._ptr, event) != 0:
                err = lib.last_errno()
                if err not in (errno.EAGAIN, errno.EWOULDBLOCK):
                    raise VerbsError(err, "ibv_get_async_event")
                await trio.lowlevel.wait_readable(self._async_fd)
                self._check_open("get_async_event")
                continue
            kind = _enum(AsyncEventType, event.event_type, None)
            if kind in PORT_EVENTS:
                element: Any = event.element.port_num
            elif kind is AsyncEventType.DEVICE_FATAL or kind is None:
                element = None
            else:
                element = self._objects.get(lib.address(event.element.cq))
                if kind in QP_ERROR_EVENTS and element is not None:
                    element._failed(ConnectionError(f"{kind.name} async event"))
            v.ibv_ack_async_event(event)
            if kind is not None:
                return AsyncEvent(kind, element)
            log.warning("%s: unknown async event %d dropped", self.device.name, event.event_type)

    def _destroy(self) -> None:
        if not self.borrowed:
            lib.check(lib.verbs().ibv_close_device(self._ptr), "ibv_close_device")
