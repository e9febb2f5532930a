"""The portable verbs objects as protocols: what every backend's device, context, PD, MR,
CQ, completion channel, QP and SRQ offer.

Applications, the CM (:mod:`rdmashim.cm`) and the ULPs see only these types;
each backend's classes satisfy them structurally (mypy checks it where a
backend hands its objects out as these types, as psycopg's ``pq.abc`` does for
its libpq wrappers). Backend-specific extras (the built-in engine's
``engine``, rdma-core's ``borrowed`` ...) stay off the protocols.

A method that takes another verbs object (``create_cq(channel=...)``,
``create_qp(send_cq=...)``) is typed with the protocol; a backend refuses
objects of another backend with a :class:`~rdmashim.verbs.errors.VerbsError`
(EINVAL) rather than failing deep inside.

Attributes are read-only properties here: a backend may keep them as plain
attributes or compute them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Protocol, Self

from rdmashim.verbs.enums import Access, QPState, QPType

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from rdmashim.verbs.attrs import AHAttr, DeviceAttr, PortAttr, QPAttr, QPCap
    from rdmashim.verbs.events import AsyncEvent
    from rdmashim.verbs.slots import Slots
    from rdmashim.verbs.wr import SGE, WC, RecvBatch, RecvWR, SendBatch, SendWR, WCArray


class Resource(Protocol):
    """What every verbs object offers: an idempotent ``close()`` and ``with`` support."""

    def close(self) -> None:
        """Destroy the object and those created from it (idempotent)."""

    def __enter__(self) -> Self: ...

    def __exit__(self, *exc: object) -> None: ...


class Device(Protocol):
    """A device a backend lists (``ibv_device``)."""

    @property
    def name(self) -> str:
        """The name ``open_device`` takes (``siw_lo``, ``mlx5_0``, ...)."""

    @property
    def backend(self) -> str:
        """Name of the backend that lists it."""

    @property
    def node_guid(self) -> int:
        """The device's 64-bit node GUID."""

    @property
    def netdev(self) -> str | None:
        """The network interface it serves (its first port's), None where unknown."""


class Context(Resource, Protocol):
    """An opened device (``ibv_context``)."""

    @property
    def device(self) -> Device:
        """The device opened."""

    @property
    def backend(self) -> str:
        """Name of the backend serving this context."""

    def query_device(self) -> DeviceAttr:
        """Limits and capabilities of the device."""

    def query_port(self, port_num: int = 1) -> PortAttr:
        """State and limits of port ``port_num`` (numbered from 1)."""

    def query_gid(self, port_num: int, index: int) -> bytes:
        """Entry ``index`` of port ``port_num``'s GID table (16 bytes; all zero when unset).
        NotSupported where the transport has no GID table to address UD datagrams by."""

    def alloc_pd(self) -> PD:
        """A new protection domain."""

    def create_comp_channel(self) -> CompChannel:
        """A completion channel CQs can report events to."""

    def create_cq(
        self, cqe: int, channel: CompChannel | None = None, *, handler: CQHandler | None = None
    ) -> CQ:
        """A completion queue holding at least ``cqe`` completions; it reports to
        ``channel`` or calls ``handler`` (:meth:`CQ.set_handler`), not both (EINVAL)."""

    async def get_async_event(self) -> AsyncEvent:
        """Wait for the next asynchronous event (``ibv_get_async_event``)."""


class PD(Resource, Protocol):
    """A protection domain (``ibv_pd``)."""

    @property
    def context(self) -> Context:
        """The context the PD was allocated on."""

    def reg_mr(
        self, buffer: Buffer, access: Access = Access.LOCAL_WRITE, *, iova: int | None = None
    ) -> MR:
        """Register any buffer-protocol object in place (``ibv_reg_mr``/``_iova``)."""

    def create_qp(
        self,
        *,
        send_cq: CQ,
        recv_cq: CQ,
        cap: QPCap | None = None,
        srq: SRQ | None = None,
        sq_sig_all: bool = False,
        qp_type: QPType = QPType.RC,
    ) -> QP:
        """A queue pair on this PD."""

    def create_srq(self, max_wr: int = 128, max_sge: int = 1) -> SRQ:
        """A shared receive queue for QPs of this PD."""

    def create_ah(self, attr: AHAttr) -> AH:
        """An address handle for UD sends (``ibv_create_ah``); NotSupported where the
        transport has no UD (iWARP)."""


class AH(Resource, Protocol):
    """An address handle (``ibv_ah``): where a UD Send goes (``SendWR.ah``)."""

    @property
    def pd(self) -> PD:
        """The PD the handle was created on."""


class MR(Resource, Protocol):
    """A registered memory region (``ibv_mr``)."""

    @property
    def pd(self) -> PD:
        """The PD the region is registered in."""

    @property
    def addr(self) -> int:
        """Address of the buffer's first byte."""

    @property
    def length(self) -> int:
        """Length in bytes."""

    @property
    def iova(self) -> int:
        """The address of the first byte for work requests and the peer."""

    @property
    def lkey(self) -> int:
        """Local key."""

    @property
    def rkey(self) -> int:
        """Remote key."""

    @property
    def access(self) -> Access:
        """Access rights the region was registered with."""

    @property
    def buf(self) -> memoryview:
        """A byte view of the registered memory."""

    def sge(self, offset: int = 0, length: int | None = None) -> SGE:
        """An SGE over ``[offset, offset + length)`` of the region."""

    def dereg(self) -> None:
        """Deregister the region (``close``)."""


class CompChannel(Resource, Protocol):
    """A completion channel (``ibv_comp_channel``); events are awaited."""

    @property
    def fd(self) -> int | None:
        """The kernel channel's file descriptor, or None (the built-in engine has none)."""

    async def get_cq_event(self) -> CQ:
        """Wait for the next event; returns the CQ it is for (acknowledge it there)."""


CQHandler = Callable[["CQ"], None]
"""A completion handler: a plain function (never awaits, never blocks) called with the CQ."""


class CQ(Resource, Protocol):
    """A completion queue (``ibv_cq``)."""

    @property
    def context(self) -> Context:
        """The context the CQ was created on."""

    @property
    def cqe(self) -> int:
        """How many completions the CQ holds."""

    @property
    def channel(self) -> CompChannel | None:
        """The completion channel given at creation, if any."""

    busy_poll: float
    """Seconds the waiting calls (:meth:`wait`, :meth:`poll_wait`, :meth:`poll_wait_into`,
    :meth:`drive_until`) keep polling after the last arrival before they block: 0 (the
    default) blocks at once, ``math.inf`` never blocks; ValueError for anything but a
    number >= 0. The task yields to the others between polls. See
    :mod:`rdmashim.verbs.busypoll`."""

    def poll(self, num_entries: int = 16) -> list[WC]:
        """Take up to ``num_entries`` completions, oldest first (never blocks)."""

    def req_notify(self, solicited_only: bool = False) -> None:
        """Arm the CQ: the next (solicited) completion sends one event to the channel."""

    def ack_events(self, n: int) -> None:
        """Acknowledge ``n`` events taken from the channel."""

    @property
    def handler(self) -> CQHandler | None:
        """The completion handler, if one is set."""

    def set_handler(self, handler: CQHandler | None) -> None:
        """Call ``handler(cq)`` for the completion that follows each arming instead of an
        event on a channel (the kernel's ``ib_create_cq`` completion handler). None
        removes it. EINVAL on a CQ created with a channel. See ``docs/verbs.md``:
        where it runs, what it may do, and what an exception in it does."""

    async def wait(self) -> None:
        """Wait until the CQ holds at least one completion."""

    async def drive_until(self, ready: Callable[[], object]) -> bool:
        """Wait until ``ready()`` is true, this task running the CQ's completion handler
        itself as completions come (``ready`` is checked after each run): True then.
        False at once where the backend cannot (then wait some other way, such as for
        what the handler wakes). The built-in engine can when one connected QP
        completes here: the waiting task reads its connection, so a message the
        handler hands on costs no task switch. What makes ``ready`` true another way
        calls :meth:`interrupt_wait` after."""

    def interrupt_wait(self) -> None:
        """Make a :meth:`drive_until` in progress look at its ``ready`` again now."""

    async def serve_in_thread(
        self, wcs: WCArray, on_completions: Callable[[WCArray, int], bool],
        slots: Slots | None = None,
    ) -> bool:  # fmt: skip
        """Take completions into ``wcs`` in a thread of the backend's own and call
        ``on_completions(wcs, n)`` there for each batch, until it returns False, the QP
        leaves RTS or this task is cancelled: True then (completions may be left to
        poll). ``on_completions`` may post on the QP; nothing else may use the QP or
        this CQ meanwhile, and it must not touch trio. False at once where the backend
        cannot (then wait with :meth:`poll_wait_into`). The built-in engine's native
        engine can when one connected QP without an SRQ completes here and the CQ has
        no channel or handler: a server answering each message at once costs no task
        switch and no event loop pass a message (``docs/verbs.md``).

        ``slots``: the connection answers from slots (:class:`~rdmashim.verbs.slots.
        Slots`). Where the backend can, and while ``slots.usable()``, it takes their
        state over: it posts each answer and gives its Receive back itself, frees Send
        slots from their completions (which ``on_completions`` does not see), and hands
        a lone received message to ``slots.answer``; the rest, and whatever ``answer``
        does not take, goes to ``on_completions`` with the state handed back first. The
        native engine can; elsewhere ``slots`` is left alone."""

    def set_native_handler(self, function: int, context: int, owner: object = None) -> bool:
        """Have the backend call a C function with this CQ's completions, without Python:
        ``function`` is the address of a C function of the ABI in ``docs/verbs.md``
        ("Native completion handlers"), called with ``context`` (an address) when
        completions arrive; it polls and re-posts receives through the table of verbs it
        is given, and asks for the CQ to be handed on (to :meth:`set_handler`'s handler,
        as for a reported completion) by returning non-zero. ``owner`` is kept alive while
        the handler is set (what ``context`` points into). ``function`` 0 removes it.
        True when set; False where the backend calls no native handler (then use
        :meth:`set_handler`). The built-in engine's native engine calls one; the others
        do not yet."""

    async def poll_wait(self, num_entries: int = 16) -> list[WC]:
        """Wait for completions and take up to ``num_entries`` of them (at least one)."""

    def poll_into(self, wcs: WCArray, num_entries: int | None = None) -> int:
        """Take up to ``num_entries`` (default ``len(wcs)``) completions, oldest first, into
        entries ``0..n-1`` of ``wcs``; returns ``n`` (never blocks, no object per completion).
        Mixes with :meth:`poll`: each completion is taken once, in order."""

    def poll_rows(self, rows: Buffer, num_entries: int | None = None) -> int:
        """Take up to ``num_entries`` (default: as many as fit, its size in bytes //
        ``WC_ROW.size``) completions, oldest first, into the writable buffer ``rows`` as
        :data:`~rdmashim.verbs.wr.WC_ROW` rows ``0..n-1``; returns ``n`` (never blocks,
        no object per completion: for C code that reads the rows). Otherwise as
        :meth:`poll_into`: mixes with :meth:`poll` and :meth:`poll_into` (each completion
        taken once, in order), a closed CQ or an overrun raises as they do. EINVAL
        (:class:`~rdmashim.verbs.errors.VerbsError`) for ``rows`` that is not a writable
        C-contiguous buffer of at least one row."""

    async def poll_wait_into(self, wcs: WCArray, num_entries: int | None = None) -> int:
        """Wait for completions and take up to ``num_entries`` (default ``len(wcs)``) of them
        into ``wcs`` (at least one); returns how many."""

    def __len__(self) -> int:
        """Completions ready to be polled."""


class SRQ(Resource, Protocol):
    """A shared receive queue (``ibv_srq``)."""

    @property
    def pd(self) -> PD:
        """The PD the SRQ belongs to."""

    @property
    def max_wr(self) -> int:
        """Receives it holds."""

    @property
    def max_sge(self) -> int:
        """SGEs per receive."""

    def post_recv(self, wr: RecvWR | Iterable[RecvWR]) -> None:
        """Post one receive work request or a list of them."""

    def post_recv_batch(
        self, batch: RecvBatch, count: int | None = None, *, indices: Sequence[int] | None = None
    ) -> None:
        """Post the first ``count`` entries of ``batch`` (all if None) or the entries
        ``indices`` names, in one call: as :meth:`post_recv` of that list."""


class QP(Resource, Protocol):
    """A queue pair (``ibv_qp``)."""

    def run_native_handler(self) -> bool:
        """Run the native handler set on this QP's send CQ (``cq.set_native_handler``)
        now, inside the backend, whether completions wait or not, and send what it posted
        on this QP through its table of verbs (``post_send``): how a ULP's C that staged
        Sends in its handler's context has them posted, in one call. True when it ran;
        False where the backend calls no native handler, or none is set."""

    def native_runner(self) -> tuple[int, int] | None:
        """(function, context): a C function ``uint32_t run(void *context)`` that does
        what :meth:`run_native_handler` does, for a ULP's C to call with no Python on the
        way (from the caller's thread, never from inside the handler). It returns 0 when
        that is all, non-zero when :meth:`run_native_handler` must still be called from
        Python (the socket was full, the QP has news, no connection): then it may have
        done nothing. Valid while this QP object lives (after ``close()`` it returns
        non-zero and touches nothing). None where the backend has none."""

    @property
    def pd(self) -> PD:
        """The PD the QP was created on."""

    @property
    def context(self) -> Context:
        """The PD's context."""

    @property
    def send_cq(self) -> CQ:
        """Where send completions go."""

    @property
    def recv_cq(self) -> CQ:
        """Where receive completions go."""

    @property
    def srq(self) -> SRQ | None:
        """The shared receive queue, if the QP takes its receives from one."""

    @property
    def cap(self) -> QPCap:
        """The queue sizes the QP got."""

    @property
    def qp_num(self) -> int:
        """The QP number."""

    @property
    def qp_type(self) -> QPType:
        """RC, UC or UD."""

    @property
    def sq_sig_all(self) -> bool:
        """Whether every send request completes (else only SIGNALED ones)."""

    @property
    def state(self) -> QPState:
        """The current state."""

    @property
    def error(self) -> Exception | None:
        """Why the QP went to ERR, if it did: a
        :class:`~rdmashim.verbs.errors.ProtocolViolation` when the transport ended it."""

    def post_send(self, wr: SendWR | Iterable[SendWR]) -> None:
        """Post one send work request or a list of them (never blocks)."""

    def post_recv(self, wr: RecvWR | Iterable[RecvWR]) -> None:
        """Post one receive work request or a list of them (never blocks)."""

    def post_send_batch(
        self, batch: SendBatch, count: int | None = None, *, indices: Sequence[int] | None = None
    ) -> None:
        """Post the first ``count`` entries of ``batch`` (all if None) or the entries
        ``indices`` names, in one call: exactly as :meth:`post_send` of that list of
        requests (``bad_wr`` its position in it, inline data copied now)."""

    def post_recv_batch(
        self, batch: RecvBatch, count: int | None = None, *, indices: Sequence[int] | None = None
    ) -> None:
        """Post the first ``count`` entries of ``batch`` (all if None) or the entries
        ``indices`` names, in one call: as :meth:`post_recv` of that list."""

    def query(self) -> QPAttr:
        """Current attributes."""

    def modify(self, *, qp_state: QPState, qkey: int | None = None) -> None:
        """Change the QP's state (``ibv_modify_qp``). A UD QP takes its Q_Key with the
        move to INIT (``qkey``; receives with another Q_Key are dropped), then goes to
        RTR and RTS with no path; other QPs refuse ``qkey`` (EINVAL)."""

    async def wait_closed(self) -> None:
        """Wait until the QP's connection is gone."""


__all__ = [
    "AH",
    "CQ",
    "MR",
    "PD",
    "QP",
    "SRQ",
    "CQHandler",
    "CompChannel",
    "Context",
    "Device",
    "Resource",
]
