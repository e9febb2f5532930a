"""The built-in engine's devices, contexts, protection domains and memory regions
(siw's ``siw_verbs.c`` and ``siw_mem.c``); its CQs and channels are in :mod:`.cq`,
its QPs and SRQs in :mod:`.qp`, the checks of posted work in :mod:`.posting`.

A device is bound to a local network interface (``siw_lo``, ``siw_eth0``, ...),
as ``rdma link add siw0 type siw netdev eth0`` binds Linux siw. An opened
context owns a trio nursery in which every connected QP runs its receive and
transmit tasks, so progress happens while the application's trio loop runs.
"""

from __future__ import annotations

import errno
import itertools
import logging
import socket
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import psutil
import trio

from rdmashim.providers.softiwarp.cq import CQ, CompChannel
from rdmashim.providers.softiwarp.memory import MemoryTable, Region
from rdmashim.providers.softiwarp.mpa import MAX_PRIVATE_DATA, V2_BLOCK_LEN
from rdmashim.providers.softiwarp.qp import QP, SRQ
from rdmashim.providers.softiwarp.resource import Parent, Resource
from rdmashim.verbs import abc
from rdmashim.verbs.attrs import AHAttr, DeviceAttr, PortAttr, QPCap
from rdmashim.verbs.backend import own
from rdmashim.verbs.buffers import PinnedBuffer, PinnedRegion, pin
from rdmashim.verbs.enums import (
    Access,
    AtomicCap,
    Mtu,
    NodeType,
    PortState,
    QPType,
    Transport,
)
from rdmashim.verbs.errors import (
    NotSupported,
    VerbsError,
    check_access,
    check_cq_target,
)
from rdmashim.verbs.events import AsyncEvent, AsyncEventType

if TYPE_CHECKING:
    from typing_extensions import Buffer

log = logging.getLogger(__name__)

BACKEND_NAME = "softiwarp"
VENDOR_ID = 0x626D74  # as Linux siw ("bmt")
MAX_QP_WR = 16384
MAX_SGE = 6
MAX_INLINE = 80
MAX_ORD_IRD = 128
MAX_CQE = 1 << 20
MAX_ASYNC_EVENTS = 1024
"""Asynchronous events a context keeps for ``get_async_event``; beyond, the oldest go."""
DEFAULT_MAX_REGISTERED_BYTES: int | None = None
"""A context's default bound on the bytes registered in all its MRs (None: no bound)."""


@dataclass(frozen=True, slots=True)
class Device:
    """A soft-iWARP device: the engine bound to one network interface."""

    name: str
    netdev: str
    backend: str = BACKEND_NAME

    @property
    def node_guid(self) -> int:
        """A stable 64-bit id derived from the interface's MAC (or name, for lo)."""
        raw = _mac_of(self.netdev)
        if not any(raw):
            raw = self.netdev.encode()[:6].ljust(6, b"\0")
        return int.from_bytes(raw[:3] + b"\xff\xfe" + raw[3:6], "big")

    @property
    def sys_image_guid(self) -> int:
        """The MAC in the first six bytes, as Linux siw reports it (siw_query_device)."""
        return int.from_bytes(_mac_of(self.netdev)[:6].ljust(8, b"\0"), "big")


def _link_state(netdev: str) -> tuple[bool, int]:
    """Whether the interface is up, and its MTU.

    psutil lists interfaces from ``/proc/net/dev``, which shows the process's
    network namespace, but asks each one's flags and addresses from the calling
    thread's. A thread that entered another namespace (``setns``) finds its
    interfaces only among the addresses: present there means up (MTU 1500 assumed).
    """
    link = psutil.net_if_stats().get(netdev)
    if link is not None:
        return link.isup, link.mtu or 1500
    return netdev in psutil.net_if_addrs(), 1500


def _mac_of(netdev: str) -> bytes:
    """The interface's hardware address (empty if it has none, as tunnels)."""
    for entry in psutil.net_if_addrs().get(netdev, ()):
        if entry.family == psutil.AF_LINK and entry.address:
            # "02:fc:00:00:00:01" on POSIX, "02-FC-00-00-00-01" on Windows
            try:
                return bytes.fromhex(entry.address.replace(":", "").replace("-", ""))
            except ValueError:
                log.debug("%s: unparsable hardware address %r", netdev, entry.address)
    return b""


def get_device_list() -> list[Device]:
    """One device per local network interface."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        names = ["lo"]
    return [Device(f"siw_{name}", name) for name in names]


def find_device(name: str | None) -> Device:
    """The device ``name`` (None: the loopback's, else the first); ENODEV if none is."""
    devices = get_device_list()
    if name is None:
        for dev in devices:
            if dev.netdev in ("lo", "lo0"):
                return dev
        if devices:
            return devices[0]
    for dev in devices:
        if dev.name == name:
            return dev
    known = ", ".join(d.name for d in devices) or "none"
    raise VerbsError(errno.ENODEV, "open_device", f"no device {name!r} (have: {known})")


class Context(Parent):
    """An opened device (``ibv_context``)."""

    _kind = "device context"

    def __init__(self, device: Device, nursery: trio.Nursery) -> None:
        super().__init__()
        self.device = device
        self.nursery = nursery
        self.memory = MemoryTable()
        self._qp_numbers = itertools.count(1)
        self.close_listeners: list[Callable[[], None]] = []
        """Called when the context closes (the CM reports DEVICE_REMOVAL to its ids)."""
        self.max_registered_bytes = DEFAULT_MAX_REGISTERED_BYTES
        """Bound on the bytes registered in all MRs of this context (None: no bound);
        ``reg_mr`` past it fails with ENOMEM, as ``ibv_reg_mr`` past RLIMIT_MEMLOCK."""
        self.registered_bytes = 0
        """Bytes registered in the context's MRs now."""
        self._async_events: deque[AsyncEvent] = deque(maxlen=MAX_ASYNC_EVENTS)
        self._async_waiter = trio.Event()
        self._due: deque[CQ] = deque()
        """CQs whose handler is due (armed, then a completion came)."""
        self._dispatching = False
        self._receivers: weakref.WeakSet[trio.lowlevel.Task] = weakref.WeakSet()
        """The Links' receive tasks: they run due handlers after each batch they read."""
        self._drivers: set[trio.lowlevel.Task] = set()
        """Tasks in :meth:`CQ.drive_until`: they run due handlers after each read."""
        self._dispatcher_wakeup: trio.Event | None = None
        """Wakes the task that runs handlers due outside a receive task (None: not started)."""

    @property
    def backend(self) -> str:
        """Name of the backend serving this context."""
        return BACKEND_NAME

    def query_device(self) -> DeviceAttr:
        """Limits and capabilities of the device."""
        return DeviceAttr(
            fw_ver="rdmashim-softiwarp",
            node_guid=self.device.node_guid,
            sys_image_guid=self.device.sys_image_guid,
            vendor_id=VENDOR_ID,
            vendor_part_id=0,
            hw_ver=0,
            phys_port_cnt=1,
            max_mr_size=(1 << 64) - 1,
            page_size_cap=4096,
            max_qp=1 << 16,
            max_qp_wr=MAX_QP_WR,
            max_sge=MAX_SGE,
            max_sge_rd=1,
            max_cq=1 << 16,
            max_cqe=MAX_CQE,
            max_mr=1 << 20,
            max_pd=1 << 16,
            max_qp_rd_atom=MAX_ORD_IRD,
            max_qp_init_rd_atom=MAX_ORD_IRD,
            max_srq=1 << 16,
            max_srq_wr=MAX_QP_WR,
            max_srq_sge=MAX_SGE,
            max_inline_data=MAX_INLINE,
            atomic_cap=AtomicCap.NONE,
            transport=Transport.IWARP,
            node_type=NodeType.RNIC,
            max_private_data=MAX_PRIVATE_DATA - V2_BLOCK_LEN,
            active_side_sends_first=True,
        )

    def query_port(self, port_num: int = 1) -> PortAttr:
        """State of the device's only port (the interface)."""
        if port_num != 1:
            raise VerbsError(errno.EINVAL, "query_port", f"port {port_num} (only port 1 exists)")
        up, mtu = _link_state(self.device.netdev)
        return PortAttr(
            state=PortState.ACTIVE if up else PortState.DOWN,
            max_mtu=Mtu.MTU_4096,
            active_mtu=Mtu.fitting(mtu),
            gid_tbl_len=1,
            max_msg_sz=0xFFFFFFFF,
            link_layer="Ethernet",
            netdev=self.device.netdev,
        )

    def query_gid(self, port_num: int, index: int) -> bytes:
        """Refused: iWARP addresses by IP and has no UD to address by GID."""
        raise NotSupported("query_gid", "no GID table (iWARP has no UD: RC only)")

    def alloc_pd(self) -> PD:
        """A new protection domain."""
        self._check_open("alloc_pd")
        return self._adopt(PD(self))

    def create_comp_channel(self) -> CompChannel:
        """A completion channel that CQs can report events to."""
        self._check_open("create_comp_channel")
        return self._adopt(CompChannel())

    def create_cq(
        self,
        cqe: int,
        channel: abc.CompChannel | None = None,
        *,
        handler: abc.CQHandler | None = None,
    ) -> CQ:
        """A completion queue holding up to ``cqe`` completions, reporting to ``channel``
        or calling ``handler`` (see :meth:`CQ.set_handler`)."""
        self._check_open("create_cq")
        if channel is not None:
            channel = own(channel, CompChannel, "create_cq")
        check_cq_target("create_cq", channel, handler)
        if not 1 <= cqe <= MAX_CQE:
            raise VerbsError(errno.EINVAL, "create_cq", f"cqe {cqe} outside 1..{MAX_CQE}")
        cq = self._adopt(self._new_cq(cqe, channel))
        if handler is not None:
            cq.set_handler(handler)
        return cq

    @property
    def engine(self) -> str:
        """Which engine serves this context: ``python`` here (``native``: see
        :mod:`.native_provider`; :mod:`.engines` chooses when a device is opened)."""
        return "python"

    def _new_cq(self, cqe: int, channel: CompChannel | None) -> CQ:
        return CQ(self, cqe, channel)

    def _new_qp(
        self, pd: PD, send: CQ, recv: CQ, cap: QPCap, srq: SRQ | None, sq_sig_all: bool
    ) -> QP:
        return QP(pd, send, recv, cap, srq, sq_sig_all)

    def _new_srq(self, pd: PD, max_wr: int, max_sge: int) -> SRQ:
        return SRQ(pd, max_wr, max_sge)

    # ------------------------------------------------------------ completion handlers
    def _handler_due(self, cq: CQ) -> None:
        """``cq`` was armed and a completion came: its handler runs in the receive task
        after the batch it is reading, or else in the dispatcher task soon after."""
        self._due.append(cq)
        task = trio.lowlevel.current_task()
        if self._dispatching or task in self._drivers or task in self._receivers:
            return
        wakeup = self._dispatcher_wakeup
        if wakeup is None:
            self._dispatcher_wakeup = trio.Event()
            self.nursery.start_soon(self._dispatcher)
        else:
            wakeup.set()

    def _after_receive(self) -> None:
        """Called by a Link's receive task after each batch it read: run due handlers."""
        self._receivers.add(trio.lowlevel.current_task())
        self._dispatch_due()

    def _dispatch_due(self) -> None:
        """Run the due handlers, if any (after a read, by a receive task or a task in
        :meth:`CQ.drive_until`)."""
        if self._due:
            self._dispatch()

    async def _dispatcher(self) -> None:
        self._dispatch()
        while True:
            wakeup = self._dispatcher_wakeup = trio.Event()
            await wakeup.wait()
            self._dispatch()

    def _dispatch(self) -> None:
        """Run the due handlers, and those falling due meanwhile, one at a time."""
        if self._dispatching:
            return  # a handler posted work: the running loop takes what falls due
        self._dispatching = True
        due = self._due
        try:
            while due:
                cq = due.popleft()
                cq._handler_run()
        finally:
            self._dispatching = False

    def _post_async(self, event_type: AsyncEventType, element: abc.CQ | abc.QP) -> None:
        if len(self._async_events) == MAX_ASYNC_EVENTS:
            log.warning("%s: async event queue full, oldest event dropped", self.device.name)
        self._async_events.append(AsyncEvent(event_type, element))
        self._async_waiter.set()

    async def get_async_event(self) -> AsyncEvent:
        """Wait for the next asynchronous event (``ibv_get_async_event``).

        The built-in engine reports a CQ overrun (CQ_ERR on the CQ) and the QPs it
        moves to ERR for it (QP_FATAL on each). Up to :data:`MAX_ASYNC_EVENTS` wait
        here; nothing needs acknowledging.
        """
        self._check_open("get_async_event")
        while not self._async_events:
            self._async_waiter = trio.Event()
            await self._async_waiter.wait()
            self._check_open("get_async_event")
        return self._async_events.popleft()

    def close(self) -> None:
        """Close the context and everything created from it; tell the listeners."""
        if not self._closed:
            super().close()
            self._async_waiter.set()
            for listener in self.close_listeners:
                listener()


class PD(Parent):
    """A protection domain (``ibv_pd``)."""

    _kind = "protection domain"

    def __init__(self, context: Context) -> None:
        super().__init__()
        self.context = context

    def reg_mr(
        self, buffer: Buffer, access: Access = Access.LOCAL_WRITE, *, iova: int | None = None
    ) -> MR:
        """Register any buffer-protocol object without copying it.

        Remote write access needs local write access, as in libibverbs; a read-only
        buffer can be registered only without write access. ``iova`` is the address
        the region's first byte has for local and remote access
        (``ibv_reg_mr_iova``; 0 gives a zero-based region); by default it is the
        buffer's own address.
        """
        self._check_open("reg_mr")
        access = check_access("reg_mr", access)
        rights = int(access)  # (each operator on the flags costs an Enum call)
        pinned = pin(buffer, writable=bool(rights & Access.LOCAL_WRITE))
        base = pinned.addr if iova is None else iova
        if not 0 <= base <= (1 << 64) - pinned.length:
            pinned.release()
            raise VerbsError(errno.EINVAL, "reg_mr", f"iova {base} does not fit 64 bits")
        ctx = self.context
        limit = ctx.max_registered_bytes
        if limit is not None and ctx.registered_bytes + pinned.length > limit:
            pinned.release()
            raise VerbsError(
                errno.ENOMEM, "reg_mr",
                f"{pinned.length} more bytes would pass the context's max_registered_bytes "
                f"({ctx.registered_bytes} of {limit} registered)",
            )  # fmt: skip
        try:
            region = ctx.memory.register(self, pinned.view, base, access)
        except MemoryError as exc:
            pinned.release()
            raise VerbsError(errno.ENOMEM, "reg_mr", str(exc)) from None
        ctx.registered_bytes += pinned.length
        return self._adopt(MR(self, pinned, region))

    def create_ah(self, attr: AHAttr) -> abc.AH:
        """Refused: address handles are for UD, which iWARP lacks."""
        raise NotSupported("create_ah", "UD (iWARP has no UD: RC only)")

    def create_qp(
        self,
        *,
        send_cq: abc.CQ,
        recv_cq: abc.CQ,
        cap: QPCap | None = None,
        srq: abc.SRQ | None = None,
        sq_sig_all: bool = False,
        qp_type: QPType = QPType.RC,
    ) -> QP:
        """A reliable-connected queue pair; the CM (or :mod:`.connection`) connects it."""
        self._check_open("create_qp")
        send = own(send_cq, CQ, "create_qp")
        recv = own(recv_cq, CQ, "create_qp")
        shared = None if srq is None else own(srq, SRQ, "create_qp")
        if qp_type != QPType.RC:
            raise NotSupported(
                "create_qp", f"{QPType(qp_type).name} QPs (iWARP has RC only: no UD)"
            )
        cap = cap or QPCap()
        limits = (
            (cap.max_send_wr, 1, MAX_QP_WR, "max_send_wr"),
            (cap.max_recv_wr, 0, MAX_QP_WR, "max_recv_wr"),
            (cap.max_send_sge, 0, MAX_SGE, "max_send_sge"),
            (cap.max_recv_sge, 0, MAX_SGE, "max_recv_sge"),
            (cap.max_inline_data, 0, MAX_INLINE, "max_inline_data"),
        )
        for value, low, high, name in limits:
            if not low <= value <= high:
                raise VerbsError(errno.EINVAL, "create_qp", f"{name}={value} outside {low}..{high}")
        return self._adopt(self.context._new_qp(self, send, recv, cap, shared, sq_sig_all))

    def create_srq(self, max_wr: int = 128, max_sge: int = 1) -> SRQ:
        """A shared receive queue for QPs of this PD."""
        self._check_open("create_srq")
        if not (1 <= max_wr <= MAX_QP_WR and 0 <= max_sge <= MAX_SGE):
            raise VerbsError(errno.EINVAL, "create_srq", f"max_wr={max_wr} max_sge={max_sge}")
        return self._adopt(self.context._new_srq(self, max_wr, max_sge))


class MR(PinnedRegion, Resource):
    """A registered memory region (``ibv_mr``)."""

    _kind = "memory region"

    def __init__(self, pd: PD, pinned: PinnedBuffer, region: Region) -> None:
        self.pd = pd
        self._pinned = pinned
        self._region = region

    @property
    def iova(self) -> int:
        """The address of the first byte for work requests and the peer (``addr`` unless
        registered with another ``iova``)."""
        return self._region.addr

    @property
    def lkey(self) -> int:
        """Local key (the STag)."""
        return self._region.stag

    @property
    def rkey(self) -> int:
        """Remote key (the STag, as on iWARP)."""
        return self._region.stag

    @property
    def access(self) -> Access:
        """Access rights the region was registered with."""
        return self._region.access

    def close(self) -> None:
        """Deregister the region (idempotent)."""
        if self._closed:
            return
        self._leave_parent()
        self.pd.context.memory.deregister(self._region)
        self.pd.context.registered_bytes -= self._pinned.length
        self._pinned.release()

    dereg = close
