"""Helpers of the shared API suite: connected pairs through the CM, event routing, draining.

Only the portable API is used (``rdmashim`` and ``rdmashim.cm``), so the suite
runs unchanged on every backend. A pair is made the way an application makes
one: a listening CM id on a local address (:data:`HOST`, 127.0.0.1 by default),
an active id that resolves the address and route, each side creates its PD,
CQs and QP on the device context the CM chose, then connect / accept. Both
sides' events come through one event channel; :class:`Events` hands each id
its own.

``RDMASHIM_API_TIMEOUT`` (seconds, default 10) bounds every wait; the siw VM
runs the suite with a longer one, as its CPU is emulated.
"""

from __future__ import annotations

import errno
import os
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any

import trio

from rdmashim import (
    WC_ROW,
    Access,
    DeviceAttr,
    QPCap,
    RecvWR,
    SendFlags,
    SendWR,
    WCStatus,
    WROpcode,
)
from rdmashim.cm import CMEvent, CMEventType, ConnParam, EventChannel

E = CMEventType
SIG = SendFlags.SIGNALED
RW = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ
TIMEOUT = float(os.environ.get("RDMASHIM_API_TIMEOUT", "10"))
"""Seconds any single wait of the suite may take."""
QUIET = 0.1
"""Seconds to watch for something that must not happen (an unsignaled completion, ...)."""
WARMUP_WR_ID = 0xFEED_0000
HOST = os.environ.get("RDMASHIM_API_HOST", "127.0.0.1")
"""The local address pairs connect over. The kernel's rdma_cm cannot resolve
127.0.0.1 to a siw device bound to ``lo`` (lo has no MAC for an iWARP GID), so
the siw VM binds siw to eth0 and sets this to eth0's address; the traffic still
takes the kernel's loopback path."""


def pattern(n: int, seed: int = 0) -> bytes:
    """``n`` bytes that differ from any other seed's and any shift of themselves."""
    block = bytes((i * 31 + seed * 7 + (i >> 8)) & 0xFF for i in range(4093))
    return (block * (n // len(block) + 1))[:n]


async def drain(cq: Any, n: int, limit: float | None = None) -> list[Any]:
    """Exactly ``n`` completions from ``cq`` (fails if they do not come in time)."""
    wcs: list[Any] = []
    with trio.fail_after(limit or TIMEOUT):
        while len(wcs) < n:
            wcs += await cq.poll_wait(n - len(wcs))
    return wcs


async def quiet(cq: Any) -> list[Any]:
    """What ``cq`` yields within :data:`QUIET` seconds (expected: nothing)."""
    await trio.sleep(QUIET)
    return cq.poll(64)


SIW_VENDOR_ID = 0x626D74


def is_linux_siw(attr: DeviceAttr) -> bool:
    """Whether the device is the Linux kernel's siw (through rdma-core).

    Its known protocol deviations are marked xfail (with the reason) where they
    show, rather than accepted: the built-in engine reports siw's vendor id too,
    but its own firmware name, and stays held to the standard.
    """
    return attr.vendor_id == SIW_VENDOR_ID and not attr.fw_ver.startswith("rdmashim")


RXE_VENDOR_ID = 0xFFFFFF


def is_linux_rxe(attr: DeviceAttr) -> bool:
    """Whether the device is the Linux kernel's Soft-RoCE, rxe (its vendor id,
    ``RXE_VENDOR_ID`` in rxe_param.h); its deviations are accepted where they show,
    each with its reason, as siw's are."""
    return attr.vendor_id == RXE_VENDOR_ID


def check_cut_send_queue(statuses: list[WCStatus]) -> None:
    """A send queue cut off mid-way completes SUCCESS up to some request, then
    WR_FLUSH_ERR. The one request being transmitted at the cut may complete with
    LOC_QP_OP_ERR instead: kernel siw completes a WQE whose transmission failed so
    (siw_qp_tx.c, siw_qp_sq_process), whatever the cause."""
    i = 0
    while i < len(statuses) and statuses[i] == WCStatus.SUCCESS:
        i += 1
    if i < len(statuses) and statuses[i] == WCStatus.LOC_QP_OP_ERR:
        i += 1
    assert set(statuses[i:]) <= {WCStatus.WR_FLUSH_ERR}, statuses


def ok(wcs: list[Any]) -> list[Any]:
    """Assert every completion succeeded; return them."""
    bad = [wc for wc in wcs if wc.status != WCStatus.SUCCESS]
    assert not bad, bad
    return wcs


class Events:
    """One CM event channel's events, sorted by CM id (every event acknowledged)."""

    def __init__(self, channel: EventChannel) -> None:
        self.channel = channel
        self._by_id: defaultdict[Any, deque[CMEvent]] = defaultdict(deque)
        self.requests: deque[CMEvent] = deque()

    async def _pump(self) -> None:
        event = await self.channel.get_event()
        event.ack()
        if event.event == E.CONNECT_REQUEST:
            self.requests.append(event)
        else:
            self._by_id[event.id].append(event)

    async def next(self, cm_id: Any, limit: float | None = None) -> CMEvent:
        """The next event of ``cm_id`` (not a CONNECT_REQUEST)."""
        with trio.fail_after(limit or TIMEOUT):
            while not self._by_id[cm_id]:
                await self._pump()
        return self._by_id[cm_id].popleft()

    async def expect(self, cm_id: Any, kind: CMEventType) -> CMEvent:
        """The next event of ``cm_id``, which must be ``kind``."""
        event = await self.next(cm_id)
        assert event.event == kind, f"expected {kind.name}, got {event}"
        return event

    async def request(self, limit: float | None = None) -> CMEvent:
        """The next CONNECT_REQUEST."""
        with trio.fail_after(limit or TIMEOUT):
            while not self.requests:
                await self._pump()
        return self.requests.popleft()

    async def until(self, cm_id: Any, kind: CMEventType) -> list[CMEvent]:
        """Events of ``cm_id`` up to and including the first ``kind``."""
        seen = [await self.next(cm_id)]
        while seen[-1].event != kind:
            seen.append(await self.next(cm_id))
        return seen


@dataclass(eq=False)
class End:
    """One side of a connection: its CM id and the verbs objects on the id's device."""

    id: Any
    pd: Any
    send_cq: Any
    recv_cq: Any
    qp: Any
    comp_channel: Any = None
    srq: Any = None
    mrs: list[Any] = field(default_factory=list)

    @property
    def ctx(self) -> Any:
        return self.id.context

    def reg(self, size_or_data: int | bytes, access: Access = RW) -> Any:
        """Register a new bytearray (zeroed, or a copy of the given bytes)."""
        mr = self.pd.reg_mr(bytearray(size_or_data), access)
        self.mrs.append(mr)
        return mr

    def post_recvs(self, mr: Any, count: int, size: int, first_id: int = 0) -> None:
        """``count`` receives of ``size`` bytes each, back to back in ``mr``."""
        wrs = [RecvWR(first_id + i, [mr.sge(i * size, size)]) for i in range(count)]
        (self.srq or self.qp).post_recv(wrs)


@dataclass(eq=False)
class Pair:
    """A connection made through the CM: ``client`` connected, ``server`` accepted."""

    client: End
    server: End
    events: Events
    connect_event: CMEvent
    """The server's CONNECT_REQUEST."""
    client_established: CMEvent
    server_established: CMEvent


def make_end(
    cm_id: Any,
    *,
    cap: QPCap | None,
    sq_sig_all: bool,
    cqe: int,
    comp_channel: bool,
    srq: Any = None,
    pd: Any = None,
) -> End:
    """PD, CQs (optionally on a completion channel) and the id's QP."""
    ctx = cm_id.context
    pd = pd or ctx.alloc_pd()
    chan = ctx.create_comp_channel() if comp_channel else None
    send_cq = ctx.create_cq(cqe, chan)
    recv_cq = ctx.create_cq(cqe, chan)
    qp = cm_id.create_qp(
        pd, send_cq=send_cq, recv_cq=recv_cq, cap=cap, srq=srq, sq_sig_all=sq_sig_all
    )
    return End(cm_id, pd, send_cq, recv_cq, qp, chan, srq)


class Cm:
    """The suite's CM: one event channel, a listener on :data:`HOST`, pairs on demand."""

    def __init__(self, channel: EventChannel) -> None:
        self.channel = channel
        self.events = Events(channel)
        self.listener: Any = None
        self.port = 0
        self._attr: DeviceAttr | None = None

    def listen(self) -> int:
        """Start the listener (once); returns its port."""
        if self.listener is None:
            self.listener = self.channel.create_id()
            self.listener.bind_addr((HOST, 0))
            self.listener.listen()
            self.port = self.listener.local_addr[1]
        return self.port

    async def resolve(self, port: int, host: str = HOST) -> Any:
        """A new active id with its address and route resolved."""
        cm_id = self.channel.create_id()
        cm_id.resolve_addr(None, (host, port))
        await self.events.expect(cm_id, E.ADDR_RESOLVED)
        cm_id.resolve_route()
        await self.events.expect(cm_id, E.ROUTE_RESOLVED)
        return cm_id

    async def device_attr(self) -> DeviceAttr:
        """The limits of the device the route to :data:`HOST` picks (no connection needed)."""
        if self._attr is None:
            cm_id = await self.resolve(self.listen())
            self._attr = cm_id.context.query_device()
            cm_id.destroy()
        return self._attr

    async def pair(
        self,
        *,
        cap: QPCap | None = None,
        sq_sig_all: bool = False,
        cqe: int = 1024,
        comp_channel: bool = False,
        srq: bool = False,
        private_data: bytes = b"",
        accept_data: bytes = b"",
        server_srq: Any = None,
        server_pd: Any = None,
        warm_up: bool = True,
    ) -> Pair:
        """A connected pair (see the module docstring).

        With ``warm_up`` (and on devices where the active side must send first)
        the client sends one empty message the server receives, so either side
        may send from then on; its completions are consumed here.
        """
        port = self.listen()
        cap = cap or QPCap(max_send_wr=256, max_recv_wr=256)
        opts = {"cap": cap, "sq_sig_all": sq_sig_all, "cqe": cqe, "comp_channel": comp_channel}
        for attempt in range(3):
            client_id = await self.resolve(port)
            client = make_end(client_id, **opts)
            try:
                client_id.connect(ConnParam(private_data=private_data))
                break
            except OSError as exc:
                # The kernel's rdma_cm may pick a local port whose TCP connection to the
                # listener is still in TIME_WAIT; siw connects inside rdma_connect and
                # fails with EADDRINUSE. A new id gets a new port (as open_connection does).
                if exc.errno != errno.EADDRINUSE or attempt == 2:
                    raise
                client_id.destroy()
                for resource in (client.qp, client.send_cq, client.recv_cq, client.pd):
                    resource.close()
                if client.comp_channel is not None:
                    client.comp_channel.close()
        dev = client_id.context.query_device()
        request = await self.events.request()
        server_id = request.id
        if srq and server_srq is None:
            server_pd = server_pd or server_id.context.alloc_pd()
            server_srq = server_pd.create_srq(cap.max_recv_wr, cap.max_recv_sge)
        server = make_end(server_id, **opts, srq=server_srq, pd=server_pd)
        warm = warm_up and dev.active_side_sends_first
        if warm:
            warm_mr = server.reg(16)
            (server.srq or server.qp).post_recv(RecvWR(WARMUP_WR_ID, [warm_mr.sge()]))
        server_id.accept(ConnParam(private_data=accept_data))
        client_est = await self.events.expect(client_id, E.ESTABLISHED)
        server_est = await self.events.expect(server_id, E.ESTABLISHED)
        pair = Pair(client, server, self.events, request, client_est, server_est)
        if warm:
            client.qp.post_send(SendWR(WARMUP_WR_ID, WROpcode.SEND, [], SIG))
            await _consume_warm_up(client.send_cq, server.recv_cq)
        return pair


async def _consume_warm_up(send_cq: Any, recv_cq: Any) -> None:
    (sent,) = await drain(send_cq, 1)
    (got,) = await drain(recv_cq, 1)
    for wc in (sent, got):
        assert (wc.wr_id, wc.status) == (WARMUP_WR_ID, WCStatus.SUCCESS), wc


async def settle(end: End, remote_mr: Any) -> None:
    """Wait until every Write ``end`` posted so far has been placed at the peer.

    An RDMA Write completes once sent; a Read posted after it on the same QP
    is answered only after the Write's data reached the peer's memory.
    """
    sink = end.reg(1)
    end.qp.post_send(
        SendWR(0xFFFF_FFFF, WROpcode.RDMA_READ, [sink.sge()], SIG, remote_mr.addr, remote_mr.rkey)
    )
    with trio.fail_after(TIMEOUT):
        while True:
            for wc in await end.send_cq.poll_wait(1):
                if wc.wr_id == 0xFFFF_FFFF:
                    assert wc.status == WCStatus.SUCCESS, wc
                    return


Row = tuple[Any, ...]
"""A :data:`~rdmashim.WC_ROW` row decoded: wr_id, status, opcode, byte_len, qp_num,
wc_flags, invalidated_rkey, solicited (the enums and the bool as ints)."""


def rows_of(rows: Any, n: int) -> list[Row]:
    """Rows ``0..n-1`` of a buffer ``cq.poll_rows`` wrote, decoded."""
    return [WC_ROW.unpack_from(rows, i * WC_ROW.size) for i in range(n)]


def row_of(wc: Any) -> Row:
    """What a row of ``wc`` holds (the enums and the bool as ints)."""
    return (wc.wr_id, int(wc.status), int(wc.opcode), wc.byte_len, wc.qp_num,
            int(wc.wc_flags), wc.invalidated_rkey, int(wc.solicited))  # fmt: skip


async def queued_receives(pair: Pair, n: int) -> Any:
    """The server's receive CQ once it holds the completions of ``n`` Sends, Send ``i``
    ``i`` bytes into receive ``i`` (none taken yet)."""
    client, server = pair.client, pair.server
    server.post_recvs(server.reg(16 * n), n, 16)
    src = client.reg(pattern(16, 5))
    client.qp.post_send([SendWR(i, WROpcode.SEND, [src.sge(0, i)], SIG) for i in range(n)])
    ok(await drain(client.send_cq, n))
    cq = server.recv_cq
    with trio.fail_after(TIMEOUT):
        while len(cq) < n:  # noqa: ASYNC110 (polled: nothing may be taken yet)
            await trio.sleep(0.005)
    return cq
