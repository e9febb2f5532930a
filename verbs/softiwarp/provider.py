"""The built-in engine's verbs objects: devices, context, PD, MR, CQ, channel, QP, SRQ.

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
from abc import abstractmethod
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING, Protocol, Self, TypeVar

import psutil
import trio

from rdmashim.verbs import abc
from rdmashim.verbs.attrs import AHAttr, DeviceAttr, PortAttr, QPAttr, QPCap
from rdmashim.verbs.backend import own
from rdmashim.verbs.buffers import PinnedBuffer, PinnedRegion, pin
from rdmashim.verbs.busypoll import BusyPoll, spin_until
from rdmashim.verbs.enums import (
    Access,
    AtomicCap,
    Mtu,
    NodeType,
    PortState,
    QPState,
    QPType,
    SendFlags,
    Transport,
    WCFlags,
    WCOpcode,
    WCStatus,
    WROpcode,
)
from rdmashim.verbs.errors import (
    NotSupported,
    VerbsError,
    check_access,
    check_cq_target,
    refused_wr,
)
from rdmashim.verbs.events import AsyncEvent, AsyncEventType
from rdmashim.verbs.softiwarp import fastpath
from rdmashim.verbs.softiwarp.engine import Engine
from rdmashim.verbs.softiwarp.jobs import (
    EngineConfig,
    EngineState,
    RecvJob,
    RecvRun,
    SendJob,
    SendRun,
)
from rdmashim.verbs.softiwarp.memory import AccessViolation, MemoryTable, Region
from rdmashim.verbs.softiwarp.mpa import MAX_PRIVATE_DATA, V2_BLOCK_LEN
from rdmashim.verbs.softiwarp.terminate import TermCode
from rdmashim.verbs.wr import (
    SGE,
    WC,
    InlineData,
    RecvBatch,
    RecvWR,
    SendBatch,
    SendWR,
    WCArray,
    recv_problem,
    send_problem,
    wr_id_problem,
)

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from rdmashim.verbs.softiwarp.driver import Link

log = logging.getLogger(__name__)

BACKEND_NAME = "softiwarp"
VENDOR_ID = 0x626D74  # as Linux siw ("bmt")
MAX_QP_WR = 16384
MAX_SGE = 6
MAX_INLINE = 80
COPY_SEND_MAX = 8192
"""A Send (or Send with Invalidate) of one SGE of registered memory, without INLINE or
FENCE, of at most this many bytes is copied when posted and then goes as an inline one
does (framed in C with the Sends beside it, or written at once from ``post_send``):
cheaper than keeping its SGE for the framing later. Its region must be in the QP's PD,
else it takes the general path, which reports the error."""
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


class _Resource:
    """Closing is idempotent; a closed resource refuses use and leaves its parent."""

    _closed = False
    _kind = "resource"
    _parent: _Parent | None = None

    def _check_open(self, operation: str) -> None:
        if self._closed:
            raise VerbsError(errno.EBADF, operation, f"{self._kind} is closed")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _leave_parent(self) -> None:
        """Mark closed and let the parent forget this resource (nothing else holds it)."""
        self._closed = True
        if self._parent is not None:
            self._parent._children.pop(id(self), None)
            self._parent = None

    def close(self) -> None:  # pragma: no cover - overridden
        self._leave_parent()


_R = TypeVar("_R", bound=_Resource)
_LOCAL_WRITE = int(Access.LOCAL_WRITE)


class _Parent(_Resource):
    """A resource that closes the resources created from it when it closes."""

    def __init__(self) -> None:
        self._children: dict[int, _Resource] = {}

    def _adopt(self, child: _R) -> _R:
        child._parent = self
        self._children[id(child)] = child
        return child

    def close(self) -> None:
        """Close this and, first, everything created from it (idempotent)."""
        if self._closed:
            return
        for child in reversed(list(self._children.values())):
            child.close()
        self._leave_parent()


class Context(_Parent):
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


class PD(_Parent):
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
        pinned = pin(buffer, writable=bool(rights & _LOCAL_WRITE))
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


class MR(PinnedRegion, _Resource):
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


class CompChannel(_Resource):
    """A completion channel (``ibv_comp_channel``); events are awaited, not polled.

    ``fd`` is None for the built-in engine (its completions never leave the
    process); backends with a kernel channel expose its file descriptor.
    """

    _kind = "completion channel"
    fd: int | None = None

    def __init__(self) -> None:
        self._send, self._recv = trio.open_memory_channel[CQ](1 << 16)

    def _notify(self, cq: CQ) -> None:
        if not self._closed:
            self._send.send_nowait(cq)

    async def get_cq_event(self) -> CQ:
        """Wait for the next event and return the CQ it is for (acknowledge it later)."""
        self._check_open("get_cq_event")
        return await self._recv.receive()

    def close(self) -> None:
        """Close the channel."""
        if not self._closed:
            self._leave_parent()
            self._send.close()


class CQ(_Resource):
    """A completion queue (``ibv_cq``)."""

    _kind = "completion queue"
    busy_poll = BusyPoll()

    def __init__(self, context: Context, cqe: int, channel: CompChannel | None) -> None:
        self.context = context
        self.cqe = cqe
        self.channel = channel
        self._entries: deque[WC | RecvRun] = deque()
        """Completions in order: one :class:`WC` each, or runs of receive completions
        kept column by column (never empty)."""
        self._count = 0
        """Completions in ``_entries``."""
        self._armed = False
        self._solicited_only = False
        self._overrun = False
        self._waiter = trio.Event()
        self._reader: Link | None = None
        """The connection a task in :meth:`wait` reads in place of its receive task."""
        self._qps: dict[int, QPBase] = {}
        """The QPs completing into this CQ (they go to ERR if it overruns)."""
        self.events_acked = 0
        self.events_delivered = 0
        self.handler: abc.CQHandler | None = None

    def set_handler(self, handler: abc.CQHandler | None) -> None:
        """Call ``handler(self)`` for the completion that follows each :meth:`req_notify`.

        It runs in the task that made the completion: a received message's in the
        connection's receive task, right after the bytes it read are processed (no
        task switch); others (a post's send completions, flushes) in the context's
        dispatcher task soon after. A handler that posts or polls finds its new
        completions reported the same way once it re-armed. An exception in it is
        logged and moves the QPs completing here to ERR (their ``error`` is it).
        """
        self._check_open("set_handler")
        check_cq_target("set_handler", self.channel, handler)
        self.handler = handler

    def _handler_run(self) -> None:
        handler = self.handler
        if handler is None or self._closed:
            return
        try:
            handler(self)
        except Exception as exc:
            log.exception("completion handler %r failed; its CQ's QPs go to ERR", handler)
            for qp in list(self._qps.values()):
                if qp.state is not QPState.ERR:
                    qp.engine.set_error(exc)

    def _push(self, wc: WC) -> None:
        if self._count >= self.cqe:
            self._overflow(wc)
            return
        self._entries.append(wc)
        self._count += 1
        self._arrived(wc.solicited or wc.status != WCStatus.SUCCESS)

    def _push_all(self, wcs: list[WC]) -> None:
        """Queue completions in order as :meth:`_push` of each, with one wakeup and at
        most one event or handler call for them all."""
        if len(wcs) > self.cqe - self._count:
            for wc in wcs:  # up to the overrun (rare): each as it comes
                self._push(wc)
            return
        self._entries.extend(wcs)
        self._count += len(wcs)
        self._arrived(
            not self._solicited_only
            or any(wc.solicited or wc.status != WCStatus.SUCCESS for wc in wcs)
        )

    def _push_run(self, run: RecvRun) -> None:
        """Queue a run of successful receive completions as :meth:`_push_all` of them,
        kept as the run (one entry)."""
        if len(run) > self.cqe - self._count:
            for wc in run.take(len(run)):  # up to the overrun (rare): each as it comes
                self._push(wc)
            return
        self._entries.append(run)
        self._count += len(run)
        self._arrived(
            not self._solicited_only or (run.solicited is not None and True in run.solicited)
        )

    def _overflow(self, lost: object) -> None:
        """More than ``cqe`` completions: ``lost`` (the one that did not fit, or None when
        the native engine's ring counted the loss) is reported, the QPs go to ERR."""
        if not self._overrun:
            self._overrun = True
            log.error("CQ overrun: %d entries; completion %r lost", self.cqe, lost)
            self.context._post_async(AsyncEventType.CQ_ERR, self)
            # Not from inside the engine that is completing: on the next tick.
            self.context.nursery.start_soon(self._fail_qps)

    def _arrived(self, notable: bool) -> None:
        """Completions were queued: wake waiters; an armed CQ reports them if one of them
        is ``notable`` (solicited or an error) or it was armed for any."""
        self._waiter.set()
        if self._reader is not None:
            self._reader.interrupt()
        if self._armed and (not self._solicited_only or notable):
            self._armed = False
            if self.channel is not None:
                self.events_delivered += 1
                self.channel._notify(self)
            elif self.handler is not None:
                self.context._handler_due(self)

    async def _fail_qps(self) -> None:
        """After an overrun: every QP completing here goes to ERR (QP_FATAL each)."""
        cause = self.overrun_error()
        for qp in list(self._qps.values()):
            if qp.state is not QPState.ERR or self._failed_by_overrun(qp):
                qp.engine.set_error(cause)
                self.context._post_async(AsyncEventType.QP_FATAL, qp)

    def overrun_error(self) -> VerbsError:
        """What a QP failed by this CQ's overrun has as its ``error``."""
        return VerbsError(errno.EOVERFLOW, "cq", f"CQ overrun: more than {self.cqe} completions")

    def _failed_by_overrun(self, qp: QPBase) -> bool:
        """Whether ``qp`` is in ERR because of this CQ's overrun already (the native
        engine fails the QP whose completion did not fit at once)."""
        return False

    def poll(self, num_entries: int = 16) -> list[WC]:
        """Take up to ``num_entries`` completions, oldest first (never blocks).

        After an overrun (more completions than ``cqe``; the context reported CQ_ERR)
        it raises EOVERFLOW."""
        self._check_open("poll_cq")
        if self._overrun:
            raise VerbsError(errno.EOVERFLOW, "poll_cq", f"more than {self.cqe} completions queued")
        return self._take(num_entries)

    def _take(self, num_entries: int) -> list[WC]:
        entries = self._entries
        taken: list[WC] = []
        left = max(0, min(num_entries, self._count))  # (none for fewer than none)
        self._count -= left
        while left:
            entry = entries[0]
            if entry.__class__ is RecvRun:
                n = min(left, len(entry))
                taken += entry.take(n)
                if not entry:
                    entries.popleft()
            else:
                n = 1
                taken.append(entries.popleft())  # type: ignore[arg-type]
            left -= n
        return taken

    def poll_into(self, wcs: WCArray, num_entries: int | None = None) -> int:
        """Take up to ``num_entries`` (default ``len(wcs)``) completions into ``wcs``; how many.

        The CQ keeps the engine's completions as they come (one named tuple each, or
        the columns of a run of receives); this moves their fields into the array's
        lists (a run's a column at a time) and keeps none of them."""
        self._check_open("poll_cq")
        if self._overrun:
            raise VerbsError(errno.EOVERFLOW, "poll_cq", f"more than {self.cqe} completions queued")
        total = self._count if num_entries is None else min(num_entries, self._count)
        if total <= 0:  # (an empty CQ: a handler's last poll after re-arming; or none asked)
            return 0
        total = min(total, len(wcs.wr_id))
        entries = self._entries
        self._count -= total
        pos = 0
        rows: list[WC] = []
        while pos + len(rows) < total:
            entry = entries[0]
            if entry.__class__ is not RecvRun:
                rows.append(entries.popleft())  # type: ignore[arg-type]
                continue
            if rows:
                wcs.fill(rows, pos)
                pos += len(rows)
                rows = []
            run: RecvRun = entry
            n = min(total - pos, len(run))
            start = run.start
            _fill_run(wcs, pos, run, start, start + n)
            run.start += n
            if not run:
                entries.popleft()
            pos += n
        if rows:
            wcs.fill(rows, pos)
        return total

    async def poll_wait_into(self, wcs: WCArray, num_entries: int | None = None) -> int:
        """Wait for completions and take up to ``num_entries`` of them into ``wcs``."""
        await self.wait()
        return self.poll_into(wcs, num_entries)

    def req_notify(self, solicited_only: bool = False) -> None:
        """Arm the CQ: the next (solicited) completion sends one event to the channel or
        calls the handler once (completions already queued do not count)."""
        self._check_open("req_notify_cq")
        self._armed = True
        self._solicited_only = solicited_only

    def ack_events(self, n: int) -> None:
        """Acknowledge ``n`` events taken from the channel."""
        self.events_acked += n

    async def wait(self) -> None:
        """Wait until the CQ holds at least one completion.

        When one connected QP completes here, no CQ of it has a handler and no other
        task reads its connection already, the waiting task reads that connection
        itself in place of its receive task: a received message that completes here
        wakes it in one hop. Otherwise the receive task wakes it.
        """
        self._check_open("wait")
        while not self._count:
            link = self._sole_link()
            if link is not None and link.can_read:
                self._reader = link
                try:
                    await link.read_until(self._ready, spin=self.busy_poll)
                finally:
                    self._reader = None
            elif not await spin_until(self._ready, self.busy_poll):
                self._waiter = trio.Event()
                await self._waiter.wait()
            self._check_open("wait")

    async def drive_until(self, ready: Callable[[], object]) -> bool:
        """Wait until ``ready()`` is true, reading the connection of the only QP completing
        here in this task and running this CQ's handler after each read (so a message
        the handler hands on wakes nobody else); True then, or when the connection
        ended. :meth:`interrupt_wait` makes it look at ``ready`` again. False at once
        when this CQ serves other than one connected QP or another task reads it: wait
        some other way."""
        self._check_open("drive_until")
        qp = self._only_qp()
        link = qp._link if qp is not None else None
        if link is None or not link.can_read:
            return False
        context = self.context
        task = trio.lowlevel.current_task()
        context._drivers.add(task)
        self._reader = link
        try:
            await link.read_until(ready, after_read=context._dispatch_due, spin=self.busy_poll)
        finally:
            self._reader = None
            context._drivers.discard(task)
        return True

    def interrupt_wait(self) -> None:
        """Make a :meth:`drive_until` in progress look at its ``ready`` again now (what it
        waits for came another way)."""
        if self._reader is not None:
            self._reader.interrupt()

    def _sole_link(self) -> Link | None:
        """The connection of the only QP completing here, unless a CQ of it has a handler
        (a handler runs in the receive task, after the batch it read)."""
        qp = self._only_qp()
        if qp is None or qp.send_cq.handler is not None or qp.recv_cq.handler is not None:
            return None
        return qp._link

    def _only_qp(self) -> QPBase | None:
        """The QP completing here, when there is exactly one."""
        return next(iter(self._qps.values())) if len(self._qps) == 1 else None

    def _ready(self) -> bool:
        return bool(self._count) or self._closed

    async def poll_wait(self, num_entries: int = 16) -> list[WC]:
        """Wait for completions and take up to ``num_entries`` of them (at least one)."""
        await self.wait()
        return self.poll(num_entries)

    def __len__(self) -> int:
        return self._count

    def close(self) -> None:
        """Destroy the CQ."""
        if not self._closed:
            self._leave_parent()
            self._waiter.set()
            if self._reader is not None:
                self._reader.interrupt()


def _fill_run(wcs: WCArray, pos: int, run: RecvRun, start: int, stop: int) -> None:
    """Entries ``start:stop`` of a run into ``wcs`` from entry ``pos`` on, a column at a
    time."""
    n = stop - start
    end = pos + n
    wcs.wr_id[pos:end] = run.wr_ids[start:stop]
    wcs.status[pos:end] = [_SUCCESS] * n
    wcs.opcode[pos:end] = [_RECV] * n
    wcs.byte_len[pos:end] = run.byte_lens[start:stop]
    wcs.qp_num[pos:end] = [run.qp_num] * n
    wcs.wc_flags[pos:end] = [_NO_FLAGS] * n
    zeros = [0] * n
    wcs.invalidated_rkey[pos:end] = zeros
    wcs.vendor_err[pos:end] = zeros
    wcs.solicited[pos:end] = run.solicited_of(start, stop)
    wcs.imm_data[pos:end] = zeros


class SRQ(_Resource):
    """A shared receive queue (``ibv_srq``)."""

    _kind = "shared receive queue"

    def __init__(self, pd: PD, max_wr: int, max_sge: int) -> None:
        self.pd = pd
        self.max_wr = max_wr
        self.max_sge = max_sge
        self._queue: deque[RecvJob] = deque()

    def post_recv(self, wr: RecvWR | Iterable[RecvWR]) -> None:
        """Post one receive work request or a list of them."""
        self._check_open("post_srq_recv")
        jobs, refused = _recv_jobs("post_srq_recv", _as_list(wr), self.pd.context.memory)
        self._post_jobs(jobs)
        if refused is not None:
            raise refused

    def post_recv_batch(
        self, batch: RecvBatch, count: int | None = None, *, indices: Sequence[int] | None = None
    ) -> None:
        """Post entries of a prepared batch (see :meth:`QP.post_recv_batch`)."""
        self._check_open("post_srq_recv")
        jobs, max_nsge, refused = _batch_jobs(batch, "post_srq_recv", count, indices)
        self._post_jobs(jobs, max_nsge)
        if refused is not None:
            raise refused

    def _post_jobs(self, jobs: Sequence[RecvJob], max_nsge: int | None = None) -> None:
        _queue_recvs("post_srq_recv", self._queue, jobs, self.max_wr, self.max_sge, "SRQ", max_nsge)

    def close(self) -> None:
        """Destroy the SRQ."""
        self._leave_parent()


_W = TypeVar("_W", SendWR, RecvWR)


def _as_list(wr: _W | Iterable[_W]) -> list[_W]:
    if isinstance(wr, SendWR | RecvWR):
        return [wr]
    return list(wr)


def _recv_job(w: RecvWR) -> RecvJob | None:
    """The engine's form of a receive (it only reads it: a batch posts one many times),
    or None when it cannot be posted (:func:`recv_problem` says why)."""
    sges = tuple(w.sg_list)
    if len(sges) == 1:  # (the common case, checked inline: a post of one costs 0.1 us less)
        s = sges[0]
        if (
            s.__class__ is SGE
            and 0 <= s.length <= _U32
            and 0 <= s.lkey <= _U32
            and 0 <= s.addr <= _U64
            and 0 <= w.wr_id <= _U64
        ):
            return RecvJob(w.wr_id, sges, s.length)
    if recv_problem(w):
        return None
    return RecvJob(w.wr_id, sges, sum(s.length for s in sges))


def _recv_jobs(
    operation: str, wrs: Iterable[RecvWR], memory: MemoryTable
) -> tuple[list[RecvJob], VerbsError | None]:
    """The jobs of ``wrs`` up to the first that cannot be posted, and the error that
    one raises once those before it are posted (``bad_wr`` its index), if any."""
    jobs: list[RecvJob] = []
    for i, w in enumerate(wrs):
        job = _recv_job(w)
        problem = recv_problem(w) if job is None else unregistered(job.sges, memory)
        if job is None or problem:
            return jobs, refused_wr(errno.EINVAL, operation, i, problem or "")
        jobs.append(job)
    return jobs, None


def unregistered(sges: Iterable[SGE], memory: MemoryTable) -> str | None:
    """Why a work request cannot be posted when one of its SGEs names no registered
    region (its MR closed, say), or None. (Whether the region holds the SGE, its PD
    and its rights are checked when the data moves, as on every backend.)"""
    for s in sges:
        if s.length and memory.lookup(s.lkey) is None:
            return f"{s}: lkey {s.lkey:#x} names no registered memory region (was its MR closed?)"
    return None


class _RecvJobs(list[RecvJob]):
    """A receive batch's entries as engine jobs (:meth:`RecvBatch.prepared`)."""

    max_nsge = 0
    """The most SGEs an entry has had (a post within the limit skips the per-entry check)."""

    def __init__(self, n: int) -> None:
        super().__init__([None] * n)  # type: ignore[list-item]
        self.refused: dict[int, str] = {}
        """The entries that cannot be posted, and why (EINVAL when a post reaches them)."""

    def set(self, i: int, wr: RecvWR) -> None:
        job = _recv_job(wr)
        if job is None:
            self.refused[i] = recv_problem(wr) or ""
            self[i] = RecvJob(0, (), 0)  # (never posted)
            return
        self.refused.pop(i, None)
        self[i] = job
        self.max_nsge = max(self.max_nsge, len(job.sges))


def _queue_recvs(
    operation: str, queue: deque[RecvJob], jobs: Sequence[RecvJob], max_wr: int, max_sge: int,
    name: str, max_nsge: int | None = None,
    flush: Callable[[Sequence[RecvJob]], None] | None = None,
) -> None:  # fmt: skip
    """Queue receive jobs as ``post_recv`` posts a list (``bad_wr`` the first refused, the
    ones before it queued; ``name`` the queue's in the error); with ``flush`` (a QP in
    ERR) they are flushed instead. When no job has more than ``max_nsge`` SGEs (a batch
    or a single request knows) and all fit, one ``extend``."""
    if (
        flush is None
        and max_nsge is not None
        and max_nsge <= max_sge
        and len(queue) + len(jobs) <= max_wr
    ):
        queue.extend(jobs)
        return
    for i, job in enumerate(jobs):
        if len(job.sges) > max_sge:
            raise refused_wr(errno.EINVAL, operation, i, f"{len(job.sges)} SGEs > {max_sge}")
        if flush is not None:
            flush([job])
            continue
        if len(queue) >= max_wr:
            raise refused_wr(errno.ENOMEM, operation, i, f"{name} full ({max_wr})")
        queue.append(job)


def _batch_jobs(
    batch: RecvBatch, operation: str, count: int | None, indices: Sequence[int] | None
) -> tuple[list[RecvJob], int, VerbsError | None]:
    """The jobs a receive batch post takes up to the first entry that cannot be posted,
    the most SGEs any of them may have, and the error that entry raises once those
    before it are posted (``bad_wr`` its position in the post), if any."""
    entries = batch.select(operation, count, indices)
    jobs = batch.prepared(RecvJob, _RecvJobs)
    refused = jobs.refused
    if refused:
        for k, i in enumerate(entries):
            if i in refused:
                taken = list(map(jobs.__getitem__, entries[:k]))
                return taken, jobs.max_nsge, refused_wr(errno.EINVAL, operation, k, refused[i])
    if isinstance(entries, range):
        return jobs[: entries.stop], jobs.max_nsge, None
    return list(map(jobs.__getitem__, entries)), jobs.max_nsge, None


_U32 = 0xFFFFFFFF
_U64 = 0xFFFFFFFFFFFFFFFF
_INLINE = int(SendFlags.INLINE)
_SIGNALED = int(SendFlags.SIGNALED)
_WR_ID = attrgetter("wr_id")
# Enum members bound once: an attribute lookup on an enum class costs per work request.
_RDMA_READ = WROpcode.RDMA_READ
_SEND_INV = WROpcode.SEND_WITH_INV
_FENCE = int(SendFlags.FENCE)
_RUN_BYTES = 256 * 1024
"""A :class:`SendRun` takes no more entries once its FPDUs reach this many bytes."""
_RTS = QPState.RTS
_SUCCESS = WCStatus.SUCCESS
_RECV = WCOpcode.RECV
_NO_FLAGS = WCFlags.NONE
_ERR = QPState.ERR
_SUPPORTED_SEND = frozenset(
    {WROpcode.SEND, WROpcode.SEND_WITH_INV, WROpcode.RDMA_WRITE, WROpcode.RDMA_READ}
)
_WIRE_LIMITS = (
    "length, rkey, invalidate_rkey or remote_addr + length do not fit the wire "
    "(32, 32, 32 and 64 bits)"
)


class _InlineSGE:
    """An SGE of an inline send: the region it names is looked up once and kept while it
    stays registered (a deregistered one is looked up again, and refused if gone)."""

    __slots__ = ("end", "length", "offset", "region", "sge")

    def __init__(self, sge: SGE) -> None:
        self.sge = sge
        self.length = sge.length
        self.region: Region | None = None
        self.offset = self.end = 0

    def read(self, memory: MemoryTable, pd: object = None) -> bytes | None:
        """A copy of the bytes the SGE names now, or None if no region holds them (or,
        with ``pd``, the region is of another PD: a Send without INLINE reads only its
        QP's memory)."""
        region = self.region
        s = self.sge
        if region is None or not region.valid:
            region = self.region = memory.lookup(s.lkey)
            if region is None or not 0 <= s.addr - region.addr <= region.length - s.length:
                self.region = None
                return None
            self.offset = s.addr - region.addr
            self.end = self.offset + s.length
        if pd is not None and region.pd is not pd:
            return None
        return region.view[self.offset : self.end].tobytes()


def _inline_bytes(i: int, part: _InlineSGE | InlineData, memory: MemoryTable) -> bytes:
    """A copy of what one element of an inline send's ``sg_list`` holds now."""
    if isinstance(part, _InlineSGE):
        data = part.read(memory)
        if data is None:
            raise refused_wr(
                errno.EINVAL, "post_send", i, f"inline SGE {part.sge} outside a region"
            )
        return data
    return bytes(part)


def _fields_of(w: SendWR) -> tuple[object, ...] | None:
    """What a :class:`_SendTemplate` is made of: the request's fields it reads, its SGEs by
    value (a named tuple each); None when its ``sg_list`` holds raw bytes (read at
    post time, and mutable: such a template is never reused)."""
    sges = tuple(w.sg_list)
    for s in sges:
        if s.__class__ is not SGE:
            return None
    return (w.opcode, w.send_flags, sges, w.remote_addr, w.rkey, w.invalidate_rkey)


_TEMPLATES_KEPT = 1024
"""The most send templates a QP keeps for requests posted again (then it starts over)."""


class _SendTemplate:
    """What a send work request means independently of the QP, worked out once.

    The checks ``post_send`` makes of a request alone (opcode, raw bytes without
    INLINE, the wire's field widths) are decided here and raised at post time in
    ``post_send``'s order, after the QP's SGE limit and queue depth.
    """

    __slots__ = (
        "copied",
        "flags",
        "inline",
        "invalid",
        "invalidate_rkey",
        "keys_fit",
        "length",
        "local",
        "made_of",
        "nsge",
        "opcode",
        "prior",
        "remote_addr",
        "rkey",
        "run_ctrl",
        "source",
        "unsupported",
    )  # fmt: skip

    def __init__(self, w: SendWR, made_of: tuple[object, ...] | None = None) -> None:
        opcode = w.opcode if w.opcode.__class__ is WROpcode else WROpcode(w.opcode)
        self.opcode = opcode
        self.made_of = made_of
        """What it was made of (:func:`_fields_of`), when :meth:`QP._template` keeps it."""
        self.prior: _SendTemplate | None = None
        """The template kept for the same request before this one (RDS's send slots
        alternate between flags, signaled or not: both are kept)."""
        self.unsupported = (
            None if opcode in _SUPPORTED_SEND else f"{opcode.name} is not an iWARP operation"
        )
        self.invalid: str | None = send_problem(w)
        """Why a post of it fails (EINVAL), if it does whatever the QP."""
        self.flags = flags = int(w.send_flags)
        sges = w.sg_list
        self.nsge = len(sges)
        remote_addr, rkey, inv = self.remote_addr, self.rkey, _ = (
            w.remote_addr, w.rkey, w.invalidate_rkey,
        )  # fmt: skip
        self.keys_fit = keys_fit = 0 <= rkey <= _U32 and 0 <= inv <= _U32 and remote_addr >= 0
        self.invalidate_rkey = inv if opcode is _SEND_INV else 0
        """What goes in the header's Invalidate STag field (zero but for a Send with
        Invalidate: RFC 5040 reserves it in other messages)."""
        self.local: tuple[SGE, ...] = ()
        self.length = 0
        self.source: _InlineSGE | None = None
        """The one SGE of registered memory of an inline Send (the common case) or of a
        Send copied when posted (:data:`COPY_SEND_MAX`)."""
        self.copied = False
        """A Send without INLINE copied when posted: its region must be in the QP's PD."""
        runnable = opcode in (WROpcode.SEND, _SEND_INV) and not flags & _FENCE and keys_fit
        self.run_ctrl = 0
        """An inline or copied Send without FENCE joins a :class:`SendRun` if its data fit
        one FPDU: its control byte there (0: it does not)."""
        self.inline: tuple[_InlineSGE | InlineData, ...] | None = None
        if self.invalid:
            return
        if flags & _INLINE and opcode is not _RDMA_READ:
            if len(sges) == 1 and sges[0].__class__ is SGE:
                self.source = source = _InlineSGE(sges[0])
                self.inline = (source,)
            else:
                self.inline = tuple(_InlineSGE(s) if isinstance(s, SGE) else s for s in sges)
            if runnable:
                self.run_ctrl = SendRun.ctrl(flags, opcode is _SEND_INV)
            return
        local = tuple(s for s in sges if isinstance(s, SGE))
        if len(local) != len(sges):
            self.invalid = "raw bytes need INLINE"
            return
        self.local = local
        self.length = length = sum(s.length for s in local)
        if not (length <= _U32 and keys_fit and remote_addr <= _U64 + 1 - length):
            self.invalid = _WIRE_LIMITS
        elif runnable and len(local) == 1 and 0 < length <= COPY_SEND_MAX:
            self.source = _InlineSGE(local[0])
            self.copied = True
            self.run_ctrl = SendRun.ctrl(flags, opcode is _SEND_INV)


class _RunPlan:
    """What a post of a batch's first entries needs when they all join one
    :class:`SendRun`: inline Sends without FENCE, each with one SGE whose region was
    found, worked out once. A post checks that those regions are still registered and
    the QP's limits, copies the data and makes the run, with no per-entry checks."""

    __slots__ = (
        "ctrls", "data", "ids", "invs", "kernels", "lens", "longest", "longest_inline", "pd",
        "regions", "signaled", "size",
    )  # fmt: skip

    def __init__(self, templates: Sequence[_SendTemplate]) -> None:
        self.ctrls = bytes(t.run_ctrl for t in templates)
        self.invs = array("I", [t.invalidate_rkey for t in templates])
        self.signaled = [i for i, t in enumerate(templates) if t.flags & _SIGNALED]
        """The indices of the entries with SIGNALED."""
        sources: list[_InlineSGE] = [t.source for t in templates]  # type: ignore[misc]
        regions: list[Region] = [s.region for s in sources]  # type: ignore[misc]
        self.lens = array("I", [s.length for s in sources])
        self.kernels = kernels = fastpath.kernels()
        self.data = kernels.send_plan(regions, [s.offset for s in sources], self.lens)
        """What the kernels copy the entries' data by."""
        self.regions = list({id(r): r for r in regions}.values())
        """The regions the data come from (each still registered, or the plan is void)."""
        self.longest = max(self.lens)
        self.longest_inline = max(
            (n for n, t in zip(self.lens, templates, strict=True) if not t.copied), default=0
        )
        """The longest entry with INLINE (the QP's ``max_inline_data`` bounds those)."""
        pds = [r.pd for r, t in zip(regions, templates, strict=True) if t.copied]
        self.pd: object = pds[0] if pds else None
        """The PD of the copied entries' regions (:meth:`possible`: one), None if none."""
        self.size = sum(map(SendRun.fpdu_bytes, self.lens))
        self.ids: tuple[list[int], list[int]] | None = None
        """The entries' wr_ids and those of the SIGNALED ones, taken at the first post
        (a run only reads them)."""

    @staticmethod
    def possible(templates: Sequence[_SendTemplate]) -> bool | None:
        """Whether these entries may be posted by a plan: never (False: fewer than two,
        or one would not join a run), not now (None: a region not found yet, or gone),
        or yes."""
        if len(templates) < 2:
            return False
        lengths = 0
        for t in templates:
            src = t.source
            if not t.run_ctrl or src is None or t.remote_addr > _U64 + 1 - src.length:
                return False
            lengths += SendRun.fpdu_bytes(src.length)
        if lengths > _RUN_BYTES:  # not one run, as the general path makes them
            return False
        found = all(t.source.region is not None and t.source.region.valid for t in templates)  # type: ignore[union-attr]
        if found and len({id(t.source.region.pd) for t in templates if t.copied}) > 1:  # type: ignore[union-attr]
            return False  # copied entries of two PDs: a QP has one, the general path reports
        return True if found else None

    def run(self, wrs: Sequence[SendWR]) -> SendRun:
        """The run of ``wrs`` (the entries the plan was made of), their data copied now."""
        ids = self.ids
        if ids is None:  # a batch's entries change only through it, which voids the plan
            wr_ids = list(map(_WR_ID, wrs))
            ids = self.ids = (wr_ids, [wr_ids[i] for i in self.signaled])
        data = self.kernels.gather(self.data)
        return SendRun.of(data, self.lens, self.ctrls, self.invs, *ids, self.size)


class _SendTemplates(list[_SendTemplate]):
    """A send batch's entries as templates, for one context's memory table."""

    def __init__(self, n: int, memory: MemoryTable) -> None:
        super().__init__([None] * n)  # type: ignore[list-item]
        self.memory = memory
        """The table the inline SGEs' regions are looked up in (the templates cache them)."""
        self._plans: dict[int, _RunPlan | None] = {}
        """By how many first entries a post takes: their plan, or None if they can have
        none (until an entry is set again)."""

    def set(self, i: int, wr: SendWR) -> None:
        self[i] = t = _SendTemplate(wr)
        bad_id = wr_id_problem(wr.wr_id)  # (an entry changes only through here)
        if bad_id and not t.invalid:
            t.invalid, t.inline, t.source, t.run_ctrl = bad_id, None, None, 0
        self._plans.clear()

    def plan(self, count: int) -> _RunPlan | None:
        """The plan of the first ``count`` entries while its regions stay registered
        (made again once one is gone or was not found yet: the general path looks the
        SGEs up again)."""
        if count in self._plans:
            plan = self._plans[count]
            if plan is None or all(r.valid for r in plan.regions):
                return plan
        entries = self[:count]
        possible = _RunPlan.possible(entries)
        if possible is None:
            return None
        plan = self._plans[count] = _RunPlan(entries) if possible else None
        return plan


class EngineView(Protocol):
    """What a QP's verbs object asks of its engine, the Python one or the native one."""

    error: Exception | None
    remote_terminate: TermCode | None
    config: EngineConfig

    def set_error(self, exc: Exception | None = None) -> None: ...


class QPBase(_Resource):
    """What both engines' queue pairs share (``ibv_qp``): the attributes, the state a
    user sees, ``query``, ``modify`` and waiting for the connection's end."""

    _kind = "queue pair"
    engine: EngineView
    _link: Link | None

    def __init__(
        self, pd: PD, send_cq: CQ, recv_cq: CQ, cap: QPCap, srq: SRQ | None, sq_sig_all: bool
    ) -> None:
        self.pd = pd
        self.context = pd.context
        self.send_cq = send_cq
        self.recv_cq = recv_cq
        self.cap = cap
        self.srq = srq
        self.sq_sig_all = sq_sig_all
        self.qp_num = next(self.context._qp_numbers)
        self._link = None
        self._state = QPState.INIT
        send_cq._qps[id(self)] = recv_cq._qps[id(self)] = self
        self.error_listeners: list[Callable[[Exception], None]] = []
        """Called with the cause when the QP goes to ERR (the CM reports DISCONNECTED)."""

    @property
    def qp_type(self) -> QPType:
        """Always RC on iWARP."""
        return QPType.RC

    @property
    def state(self) -> QPState:
        """Current state: INIT until connected, RTS, then ERR."""
        return self._state

    @property
    def error(self) -> Exception | None:
        """Why the QP went to ERR (a Terminate's code, a lost connection, ...), if it did."""
        return self.engine.error

    @property
    def remote_terminate(self) -> TermCode | None:
        """The error code of a Terminate the peer sent, if it sent one."""
        return self.engine.remote_terminate

    def query(self) -> QPAttr:
        """Current attributes."""
        cfg = self.engine.config
        return QPAttr(
            qp_state=self._state,
            qp_type=QPType.RC,
            qp_num=self.qp_num,
            cap=self.cap,
            max_rd_atomic=cfg.ord,
            max_dest_rd_atomic=cfg.ird,
            sq_sig_all=self.sq_sig_all,
        )

    def modify(self, *, qp_state: QPState, qkey: int | None = None) -> None:
        """Change state; a user may only move a QP to ERR (the CM moves it to RTS).
        ``qkey`` is for UD QPs, which iWARP lacks (EINVAL)."""
        self._check_open("modify_qp")
        if QPState(qp_state) is not QPState.ERR or qkey is not None:
            raise VerbsError(
                errno.EINVAL,
                "modify_qp",
                f"{QPState(qp_state).name}: iWARP QPs are connected by the CM",
            )
        self.engine.set_error()

    async def wait_closed(self) -> None:
        """Wait until the connection is gone (after ERR, once the socket is closed)."""
        if self._link is not None:
            await self._link.closed.wait()

    @abstractmethod
    def post_send(self, wr: SendWR | Iterable[SendWR]) -> None:
        """Post one send work request or a list of them (never blocks)."""

    @abstractmethod
    def post_recv(self, wr: RecvWR | Iterable[RecvWR]) -> None:
        """Post one receive work request or a list of them (never blocks)."""

    @abstractmethod
    def post_send_batch(
        self, batch: SendBatch, count: int | None = None, *, indices: Sequence[int] | None = None
    ) -> None:
        """Post entries of a prepared send batch."""

    @abstractmethod
    def post_recv_batch(
        self, batch: RecvBatch, count: int | None = None, *, indices: Sequence[int] | None = None
    ) -> None:
        """Post entries of a prepared receive batch."""

    @abstractmethod
    def connect(self, config: EngineConfig, sock: trio.socket.SocketType, leftover: bytes) -> None:
        """MPA is done (``leftover``: the bytes read past its frames): enter RTS and run
        the connection."""

    @abstractmethod
    def when_ready(self, callback: Callable[[], None]) -> None:
        """P2P responder: ``callback`` runs when the initiator's RTR arrives."""

    def _leave_cqs(self) -> None:
        self.send_cq._qps.pop(id(self), None)
        self.recv_cq._qps.pop(id(self), None)
        self._leave_parent()


class QP(QPBase):
    """A reliable-connected queue pair on the Python engine."""

    def __init__(
        self, pd: PD, send_cq: CQ, recv_cq: CQ, cap: QPCap, srq: SRQ | None, sq_sig_all: bool
    ) -> None:
        super().__init__(pd, send_cq, recv_cq, cap, srq, sq_sig_all)
        self._rq: deque[RecvJob] = deque()
        self._templates: dict[int, _SendTemplate] = {}
        """By the id of the request posted: its template (:meth:`_template`)."""
        self.engine: Engine = Engine(
            qp_num=self.qp_num,
            pd=pd,
            memory=self.context.memory,
            recv_queue=srq._queue if srq is not None else self._rq,
            on_send_wc=send_cq._push,
            on_recv_wc=recv_cq._push,
            on_recv_wcs=recv_cq._push_run,
            on_send_wcs=send_cq._push_all,
            sq_sig_all=sq_sig_all,
            on_fatal=self._on_fatal,
        )

    def _on_fatal(self, exc: Exception) -> None:
        for listener in self.error_listeners:
            listener(exc)
        self._state = QPState.ERR
        jobs = list(self._rq)
        self._rq.clear()
        self.engine.flush_recv(jobs)
        if self._link is not None:
            self._link.kick()

    # ---------------------------------------------------------------- posting
    def post_send(self, wr: SendWR | Iterable[SendWR]) -> None:
        """Post one send work request or a list of them (never blocks).

        Errors in the request itself raise :class:`VerbsError` naming the request
        (``bad_wr``); those before it stay posted. Errors found while processing
        come back as completions.
        """
        self._check_open("post_send")
        wrs = (wr,) if wr.__class__ is SendWR else _as_list(wr)
        self._post_sends(wrs, list(map(self._template, wrs)))

    def _template(self, w: SendWR) -> _SendTemplate:
        """The template of ``w``: one made when this object was posted before, while the
        fields it was made of are the same (RDS posts the requests of its send slots
        again and again, a list may repeat a request), else a new one. Two are kept per
        request, the last and the one before: a slot's flags alternate (signaled or
        not), and each miss would work the request out again."""
        kept = self._templates
        t = kept.get(id(w))
        fields = _fields_of(w)
        if t is not None:  # (a kept one's made_of is never None)
            if t.made_of == fields:
                return t
            prior = t.prior
            if prior is not None and prior.made_of == fields:  # the flags of before again
                t.prior = None
                prior.prior = t
                kept[id(w)] = prior
                return prior
        new = _SendTemplate(w, fields)
        if fields is not None:
            if t is not None:
                t.prior = None
                new.prior = t
            elif len(kept) >= _TEMPLATES_KEPT:
                kept.clear()
            kept[id(w)] = new
        return new

    def post_send_batch(
        self, batch: SendBatch, count: int | None = None, *, indices: Sequence[int] | None = None
    ) -> None:
        """Post the first ``count`` entries of a prepared batch (all if None), or the
        entries ``indices`` names, as :meth:`post_send` of that list.

        What does not depend on the QP (the opcode, flags, SGEs, wire limits, the
        region an inline SGE names) is worked out once per entry and kept with the
        batch; each post checks the QP's limits and state, copies inline data and
        makes the engine's job.
        """
        self._check_open("post_send")
        entries = batch.select("post_send", count, indices)
        memory = self.context.memory
        # By the table's id: the templates hold the table, so the id is not reused meanwhile.
        templates = batch.prepared(id(memory), lambda n: _SendTemplates(n, memory))
        if isinstance(entries, range):
            wrs = batch.wrs(entries)
            if not self._post_run(wrs, templates.plan(entries.stop)):
                self._post_sends(wrs, templates[: entries.stop])
        else:
            self._post_sends(batch.wrs(entries), [templates[i] for i in entries])

    def _post_run(self, wrs: Sequence[SendWR], plan: _RunPlan | None) -> bool:
        """Post ``wrs`` as one run by their batch's ``plan`` when the QP's state and
        limits let every entry pass (what :meth:`_post_sends` would make of them); False
        (nothing posted) otherwise."""
        if plan is None or self._state is not _RTS:
            return False
        cap = self.cap
        engine = self.engine
        if (
            len(wrs) > cap.max_send_wr - engine.sq_depth
            or cap.max_send_sge < 1
            or plan.longest > engine.small_send_max
            or plan.longest_inline > cap.max_inline_data
            or (plan.pd is not None and plan.pd is not self.pd)
        ):
            return False
        engine.post_send(plan.run(wrs))
        self._kick()
        return True

    def _post_sends(self, wrs: Sequence[SendWR], templates: Sequence[_SendTemplate]) -> None:
        """Post ``wrs`` (``templates[i]`` made from ``wrs[i]``) in order; the first refused
        raises with ``bad_wr`` its index and the ones before stay posted (and go out)."""
        state = self._state
        if state is not _RTS and state is not _ERR:
            if wrs:
                raise refused_wr(
                    errno.ENOTCONN, "post_send", 0, f"QP {self.qp_num} is {state.name}"
                )
            return
        cap = self.cap
        # Posting to the engine in RTS only queues: the depth grows by one per job.
        room = cap.max_send_wr - self.engine.sq_depth if state is _RTS else len(wrs)
        max_sge, max_inline = cap.max_send_sge, cap.max_inline_data
        post = self.engine.post_send
        memory = self.context.memory
        most = self.engine.small_send_max
        fast_max = min(most, max_inline)
        pd = self.pd
        run: SendRun | None = None
        try:
            # A post of one request makes a plain job: a run of one costs more.
            several = len(templates) > 1
            for i, t in enumerate(templates):
                if not 0 <= wrs[i].wr_id <= _U64:
                    raise refused_wr(
                        errno.EINVAL, "post_send", i, wr_id_problem(wrs[i].wr_id) or ""
                    )
                ctrl = t.run_ctrl if several else 0
                src = t.source
                if (
                    ctrl
                    and i < room
                    and t.nsge <= max_sge
                    and src is not None
                    and (region := src.region) is not None
                    and region.valid
                    and src.length <= (most if t.copied else fast_max)
                    and t.remote_addr <= _U64 + 1 - src.length
                    and (not t.copied or region.pd is pd)
                ):
                    # The common case: every check below passes, the copy joins the run.
                    inline: bytes | None = region.view[src.offset : src.end].tobytes()
                else:
                    if t.unsupported:
                        raise NotSupported("post_send", f"work request {i}: {t.unsupported}")
                    limit = 1 if t.opcode is _RDMA_READ else max_sge
                    if t.nsge > limit:
                        raise refused_wr(errno.EINVAL, "post_send", i, f"{t.nsge} SGEs > {limit}")
                    if i >= room:
                        raise refused_wr(
                            errno.ENOMEM, "post_send", i, f"send queue full ({cap.max_send_wr})"
                        )
                    inline = None
                    parts = t.inline
                    if parts is None:
                        if t.invalid:
                            raise refused_wr(errno.EINVAL, "post_send", i, t.invalid)
                        length = t.length
                        if problem := unregistered(t.local, memory):
                            raise refused_wr(errno.EINVAL, "post_send", i, problem)
                        if src is not None:  # copied when posted: its region looked up now
                            inline = src.read(memory, pd)
                    else:
                        # The engine sends the copy; the SGEs are not kept.
                        if src is not None and (data := src.read(memory)) is not None:
                            inline = data  # looked up (again)
                        elif len(parts) == 1:
                            inline = _inline_bytes(i, parts[0], memory)
                        else:
                            inline = b"".join([_inline_bytes(i, p, memory) for p in parts])
                        length = len(inline)
                        if length > max_inline:
                            raise refused_wr(
                                errno.EINVAL, "post_send", i,
                                f"{length} inline bytes > {max_inline}",
                            )  # fmt: skip
                        if not (t.keys_fit and t.remote_addr <= _U64 + 1 - length):
                            raise refused_wr(errno.EINVAL, "post_send", i, _WIRE_LIMITS)
                    if not ctrl or inline is None or length > most:  # a job of its own
                        job = SendJob(
                            wrs[i].wr_id, t.opcode, t.flags, t.local, inline, length,
                            t.remote_addr, t.rkey, t.invalidate_rkey,
                        )  # fmt: skip
                        if run is not None:
                            post(run)
                            run = None
                        post(job)
                        continue
                if run is None or run.size >= _RUN_BYTES:
                    if run is not None:
                        post(run)
                    run = SendRun()
                run.add(wrs[i].wr_id, ctrl, t.flags, inline, t.invalidate_rkey)  # type: ignore[arg-type]
        finally:  # the requests before a refused one are posted: they go out now
            if run is not None:
                post(run)
            self._kick()

    def _kick(self) -> None:
        """Work was posted: the driver writes what the engine frames of it now."""
        if self._link is not None:
            self._link.kick()

    def post_recv(self, wr: RecvWR | Iterable[RecvWR]) -> None:
        """Post one receive work request or a list of them (never blocks)."""
        self._check_open("post_recv")
        memory = self.context.memory
        if wr.__class__ is RecvWR:  # one request: no list to make
            job = _recv_job(wr)
            problem = recv_problem(wr) if job is None else unregistered(job.sges, memory)
            if job is None or problem:
                raise refused_wr(errno.EINVAL, "post_recv", 0, problem or "")
            self._post_recvs((job,), len(job.sges))
            return
        jobs, refused = _recv_jobs("post_recv", _as_list(wr), memory)
        self._post_recvs(jobs)
        if refused is not None:
            raise refused

    def post_recv_batch(
        self, batch: RecvBatch, count: int | None = None, *, indices: Sequence[int] | None = None
    ) -> None:
        """Post the first ``count`` entries of a prepared batch (all if None), or the
        entries ``indices`` names, as :meth:`post_recv` of that list (the engine's
        receive jobs are made once per entry and posted again each time)."""
        self._check_open("post_recv")
        jobs, max_nsge, refused = _batch_jobs(batch, "post_recv", count, indices)
        self._post_recvs(jobs, max_nsge)
        if refused is not None:
            raise refused

    def _post_recvs(self, jobs: Sequence[RecvJob], max_nsge: int | None = None) -> None:
        if self.srq is not None:
            raise VerbsError(errno.EINVAL, "post_recv", "QP uses an SRQ; post to the SRQ")
        cap = self.cap
        _queue_recvs(
            "post_recv", self._rq, jobs, cap.max_recv_wr, cap.max_recv_sge,
            "receive queue", max_nsge,
            self.engine.flush_recv if self._state is _ERR else None,
        )  # fmt: skip

    # ---------------------------------------------------------------- state
    def when_ready(self, callback: Callable[[], None]) -> None:
        """P2P responder: ``callback`` runs when the initiator's RTR arrives."""
        self.engine.on_ready = callback

    def connect(self, config: EngineConfig, sock: trio.socket.SocketType, leftover: bytes) -> None:
        """MPA is done: the engine enters RTS and a :class:`~.driver.Link` runs the socket."""
        from rdmashim.verbs.softiwarp.driver import Link

        self.engine.start(config)
        link = Link(self.engine, sock, leftover)
        self._attach(link)
        self.context.nursery.start_soon(link.run)

    def _attach(self, link: Link) -> None:
        self._link = link
        link.after_receive = self.context._after_receive
        self._state = QPState.RTS if self.engine.state is EngineState.RTS else self._state

    def close(self) -> None:
        """Destroy the QP: outstanding work is flushed and the connection dropped."""
        if self._closed:
            return
        if self.engine.state is not EngineState.ERROR:
            self.engine.set_error(ConnectionAbortedError("QP destroyed"))
        self._leave_cqs()


def check_sge(memory: MemoryTable, pd: PD, sge: SGE, access: Access) -> memoryview:
    """Resolve a local SGE (for tools that read or fill registered memory)."""
    try:
        return memory.resolve(sge.lkey, pd, sge.addr, sge.length, access)
    except AccessViolation as exc:
        raise VerbsError(errno.EACCES, "sge", str(exc)) from exc


__all__ = [
    "CQ",
    "MR",
    "PD",
    "QP",
    "SRQ",
    "CompChannel",
    "Context",
    "Device",
    "WCOpcode",
    "get_device_list",
]
