"""The connections of a perftest run and the exchange over them (trio I/O).

A run has two kinds of rdma_cm connections on the same port, as perftest's
``-R`` makes them: first the *comm* connection, an RC QP on which the two
sides trade the messages of :mod:`rdmashim.perftools.wire` with Send/Recv
(the client sends first, the server answers each message; one receive is
always posted, re-posted as soon as it completes); then, after a handshake on
it, one *test* connection per QP (``-q``), on which the measurement runs. The
perftest server stops listening between the two and listens again, so a
client retries a refused test connection for a while (perftest: 10 times,
100 ms apart; we allow :data:`CONNECT_TRIES` tries, for slow emulated peers).
"""

from __future__ import annotations

import logging
import math
import random
from collections import deque
from dataclasses import dataclass, field

import psutil
import trio

from rdmashim import WC, Access, QPCap, RecvWR, SendWR, WCOpcode, WCStatus, WROpcode
from rdmashim.cm import CMEvent, CMEventType, CMId, ConnParam, EventChannel
from rdmashim.perftools import wire
from rdmashim.perftools.options import CACHE_LINE, CYCLE_BUFFER, PerfConfig
from rdmashim.verbs.abc import CQ, MR, PD, Context

log = logging.getLogger(__name__)

COMM_BUF = 4096
"""Bytes of the comm connection's receive buffer (perftest's messages are at most 56)."""
CONNECT_TRIES = 40
CONNECT_GAP = 0.25
"""Seconds between tries of a refused test connection."""
_REMOTE = Access.LOCAL_WRITE | Access.REMOTE_READ | Access.REMOTE_WRITE
_FAILED = (CMEventType.REJECTED, CMEventType.UNREACHABLE, CMEventType.CONNECT_ERROR)


class PerfError(Exception):
    """The run failed; the message says where."""


async def next_event(channel: EventChannel, cm_id: CMId, step: str) -> CMEvent:
    """The next event of ``cm_id`` (or of a listener ``cm_id``); events of others are dropped."""
    while True:
        event = await channel.get_event()
        event.ack()
        if event.id is cm_id or event.listen_id is cm_id:
            log.debug("%s: %s", step, event.event.name)
            return event


def _expect(event: CMEvent, want: CMEventType, step: str) -> CMEvent:
    if event.event != want:
        detail = f" ({event.detail})" if event.detail else ""
        raise PerfError(f"{step}: {event.event.name}{detail}")
    return event


def completion_error(wc: WC, what: str, qp_error: Exception | None) -> PerfError:
    """The error for a failed completion; a flush means the peer went away."""
    if wc.status == WCStatus.WR_FLUSH_ERR:
        why = f": {qp_error}" if qp_error else ""
        return PerfError(f"{what}: the connection went down{why}")
    return PerfError(f"{what}: completion status {wc.status.name}")


LINGER = 1.0
"""Seconds a side that lets the peer close the comm connection first waits for it."""


class Comm:
    """The comm connection: perftest's exchange over Send/Recv."""

    def __init__(self, cm_id: CMId, client: bool) -> None:
        self.cm_id = cm_id
        self.client = client
        context = cm_id.context
        assert context is not None  # resolved or requested: bound to a device
        self.context = context
        self.pd = context.alloc_pd()
        self.cq = context.create_cq(8)
        cap = QPCap(max_send_wr=2, max_recv_wr=2, max_send_sge=1, max_recv_sge=1)
        self.qp = cm_id.create_qp(self.pd, send_cq=self.cq, recv_cq=self.cq, cap=cap)
        self.recv_mr = self.pd.reg_mr(bytearray(COMM_BUF), Access.LOCAL_WRITE)
        self.send_mr = self.pd.reg_mr(bytearray(COMM_BUF), Access.NONE)
        self._received: deque[bytes] = deque()
        self._sending = False
        self.peer = wire.Peer(rdmashim=False)
        """What the peer's version message said (set by :func:`preamble`)."""
        self._post_recv()

    def _post_recv(self) -> None:
        self.qp.post_recv(RecvWR(0, [self.recv_mr.sge()]))

    async def _pump(self, what: str) -> None:
        for wc in await self.cq.poll_wait(4):
            if wc.status != WCStatus.SUCCESS:
                raise completion_error(wc, what, self.qp.error)
            if wc.opcode == WCOpcode.RECV:
                self._received.append(bytes(self.recv_mr.buf[: wc.byte_len]))
                self._post_recv()
            else:
                self._sending = False

    async def send(self, data: bytes) -> None:
        self.send_mr.buf[: len(data)] = data
        self._sending = True
        self.qp.post_send(SendWR(1, WROpcode.SEND, [self.send_mr.sge(0, len(data))]))
        while self._sending:
            await self._pump("sending to the peer")

    async def recv(self, size: int, what: str) -> bytes:
        while not self._received:
            await self._pump(f"waiting for the peer's {what}")
        data = self._received.popleft()
        if len(data) != size:
            raise PerfError(
                f"the peer's {what} has {len(data)} bytes, perftest's has {size} "
                "(not perftest's exchange, or other flags on the two sides?)"
            )
        return data

    async def xchg(self, data: bytes, what: str) -> bytes:
        """One exchange: the client sends first, the server answers; returns the peer's."""
        if self.client:
            await self.send(data)
            return await self.recv(len(data), what)
        theirs = await self.recv(len(data), what)
        await self.send(data)
        return theirs

    async def handshake(self, mine: wire.Dest) -> wire.Dest:
        return wire.Dest.decode(await self.xchg(mine.encode(), "QP data (pingpong_dest)"))

    async def aclose(self) -> None:
        """Close the comm connection, letting a perftest peer close first.

        Kernel siw fails a perftest side's last Send (LOC_QP_OP_ERR, "Bad wc
        status 2") when our disconnect overtakes its completion, so our client
        always, and our server facing perftest, wait up to :data:`LINGER` for
        the peer to close first; between two rdmashim ends the server closes.
        """
        if self.client or not self.peer.rdmashim:
            with trio.move_on_after(LINGER):
                await self.qp.wait_closed()
        self.cm_id.disconnect()
        with trio.move_on_after(2):
            await self.qp.wait_closed()
        self.cm_id.destroy()


@dataclass
class Link:
    """One test connection: its QP, its buffer (send half, then receive half) and the peer's."""

    cm_id: CMId
    index: int
    mr: MR | None = None
    credit_mr: MR | None = None
    mine: wire.Dest = field(default_factory=wire.Dest)
    theirs: wire.Dest = field(default_factory=wire.Dest)


@dataclass
class Negotiated:
    """What the preamble settled."""

    peer_version: str
    cycle_buffer: int
    cache_line: int
    mtu: int
    """Bytes."""
    peer: wire.Peer = field(default_factory=lambda: wire.Peer(rdmashim=False))
    """The raw TCP port an rdmashim peer with ``--vs-tcp`` announced (None: none)."""


SERVER_SETTLE = 0.5
"""Seconds the client gives a perftest server to post its first receive."""
PREAMBLE_LIMIT = 30.0
"""Seconds the first exchange may take."""


async def preamble(
    comm: Comm, mtu_enum: int, tcp_port: int = 0, wants_tcp: bool = False
) -> Negotiated:
    """Versions, cycle buffer, cache line and MTU, in perftest's order.

    Our raw TCP port (``--vs-tcp`` server; 0: none) and whether we ask for the
    comparison (``--vs-tcp`` client) go after the version's NUL, where perftest
    does not look; what the peer put there comes back in the result, and tells
    the comm connection which side closes first.

    The client waits :data:`SERVER_SETTLE` seconds before its first Send: a
    perftest server posts its first receive only after the connection is up,
    and a Send that comes before it stalls the exchange for good. A peer that
    answers nothing within :data:`PREAMBLE_LIMIT` seconds is an error.
    """
    if comm.client:
        await trio.sleep(SERVER_SETTLE)
    with trio.move_on_after(PREAMBLE_LIMIT) as scope:
        mine = wire.encode_version(tcp_port=tcp_port, wants_tcp=wants_tcp)
        theirs = await comm.xchg(mine, "version")
    if scope.cancelled_caught:
        raise PerfError(f"the peer sent no perftest version within {PREAMBLE_LIMIT:.0f} s")
    peer = wire.decode_version(theirs)
    comm.peer = wire.decode_peer(theirs)
    if wire.version_number(peer) < wire.MIN_VERSION:
        raise PerfError(f"the peer speaks perftest {peer!r}; we need {wire.MIN_VERSION} or later")
    cycle = wire.decode_int(await comm.xchg(wire.encode_int(CYCLE_BUFFER), "page size"))
    line = wire.decode_int(await comm.xchg(wire.encode_int(CACHE_LINE), "cache line size"))
    rem_mtu = wire.decode_mtu(await comm.xchg(wire.encode_mtu(mtu_enum), "MTU"))
    mtu = min(mtu_enum, rem_mtu) if rem_mtu else mtu_enum
    return Negotiated(
        peer, max(cycle, CYCLE_BUFFER), max(line, CACHE_LINE), wire.MTU_BYTES[mtu], comm.peer,
    )  # fmt: skip


def conn_param(config: PerfConfig, out_reads: int) -> ConnParam:
    """perftest asks for Read resources only in the Read tests."""
    reads = out_reads if config.verb == "read" else 0
    return ConnParam(responder_resources=reads, initiator_depth=reads)


async def connect_comm(channel: EventChannel, config: PerfConfig) -> Comm:
    """The client's comm connection (retried while the server is not listening yet)."""
    assert config.server_addr is not None
    target = f"{config.server_addr}:{config.port}"
    for _attempt in range(CONNECT_TRIES):
        cm_id = channel.create_id()
        cm_id.resolve_addr(None, (config.server_addr, config.port))
        event = await next_event(channel, cm_id, "resolve")
        _expect(event, CMEventType.ADDR_RESOLVED, f"resolving {target}")
        cm_id.resolve_route()
        event = await next_event(channel, cm_id, "route")
        _expect(event, CMEventType.ROUTE_RESOLVED, f"route to {target}")
        comm = Comm(cm_id, client=True)
        cm_id.connect(ConnParam(responder_resources=0, initiator_depth=0))
        event = await next_event(channel, cm_id, "connect")
        if event.event not in _FAILED:
            _expect(event, CMEventType.ESTABLISHED, f"connecting to {target}")
            return comm
        cm_id.destroy()
        await trio.sleep(CONNECT_GAP)
    raise PerfError(f"cannot reach a perftest server at {target} ({event.event.name})")


async def accept_comm(channel: EventChannel, listener: CMId) -> Comm:
    """The server's comm connection: the first request on the listener."""
    request = _expect(
        await next_event(channel, listener, "listen"), CMEventType.CONNECT_REQUEST,
        "waiting for a client",
    )  # fmt: skip
    comm = Comm(request.id, client=False)
    request.id.accept(ConnParam(responder_resources=0, initiator_depth=0))
    _expect(await next_event(channel, request.id, "accept"), CMEventType.ESTABLISHED, "accepting")
    return comm


def port_gid(context: Context) -> bytes:
    """The GID of the device's port as an iWARP device gives it (Linux ``siw_query_gid``):
    the interface's MAC address and ten zero bytes. An interface without one
    (loopback) gives the six bytes the device made its node GUID from (EUI-64 with
    ``ff:fe`` in the middle), as siw does for it."""
    mac = b""
    for entry in psutil.net_if_addrs().get(context.query_port(1).netdev, ()):
        if entry.family == psutil.AF_LINK and entry.address:
            mac = bytes.fromhex(entry.address.replace(":", "").replace("-", ""))
    if not any(mac):
        guid = context.device.node_guid.to_bytes(8, "big")
        mac = guid[:3] + guid[5:]
    return mac[:6].ljust(16, b"\0")


class Resources:
    """The PD, CQs and QPs of the test connections (made on the first one's device)."""

    def __init__(self, config: PerfConfig, buffer_size: int) -> None:
        self.config = config
        self.buffer_size = buffer_size
        self.links: list[Link] = []
        self.pd: PD | None = None
        self.send_cq: CQ | None = None
        self.recv_cq: CQ | None = None
        self.out_reads = 1
        self.gid = bytes(16)

    def add(self, cm_id: CMId) -> Link:
        """A QP and its buffers on ``cm_id`` (resolved, or a connection request)."""
        config = self.config
        context = cm_id.context
        assert context is not None
        if self.pd is None:
            if config.device is not None and context.device.name != config.device:
                raise PerfError(
                    f"device {config.device} does not carry this connection "
                    f"(the rdma_cm chose {context.device.name})"
                )
            attr = context.query_device()
            self.out_reads = min(config.out_reads or attr.max_qp_rd_atom, attr.max_qp_rd_atom)
            self.out_reads = max(self.out_reads, 1)
            self.gid = port_gid(context)
            self.pd = context.alloc_pd()
            depth = (config.tx_depth + 8) * config.num_qps
            self.send_cq = context.create_cq(depth)
            self.recv_cq = context.create_cq((config.rx_depth + 8) * config.num_qps)
            if not config.events:  # perftest polls its CQs unless -e
                self.send_cq.busy_poll = self.recv_cq.busy_poll = math.inf
        pd, send_cq, recv_cq = self.pd, self.send_cq, self.recv_cq
        assert send_cq is not None and recv_cq is not None
        cap = QPCap(
            max_send_wr=self.config.tx_depth + 4, max_recv_wr=self.config.rx_depth + 4,
            max_send_sge=1, max_recv_sge=1,
        )  # fmt: skip
        qp = cm_id.create_qp(pd, send_cq=send_cq, recv_cq=recv_cq, cap=cap)
        link = Link(cm_id, len(self.links))
        link.mr = pd.reg_mr(bytearray(2 * self.buffer_size), _REMOTE)
        psn = random.getrandbits(24)
        rkey, vaddr = link.mr.rkey, link.mr.addr + self.buffer_size
        if config.tool == "send_bw":  # iWARP: credits come back by RDMA Write into this counter
            slots = 2 * config.num_qps
            link.credit_mr = pd.reg_mr(
                bytearray(4 * slots), Access.LOCAL_WRITE | Access.REMOTE_WRITE
            )
            rkey = link.credit_mr.rkey
            vaddr = link.credit_mr.addr + 4 * (config.num_qps + link.index)
        link.mine = wire.Dest(
            out_reads=self.out_reads, qpn=qp.qp_num, psn=psn, rkey=rkey, vaddr=vaddr, gid=self.gid
        )
        self.links.append(link)
        return link


async def connect_tests(channel: EventChannel, config: PerfConfig, res: Resources) -> None:
    """The client's test connections, retried while the server is not listening yet."""
    assert config.server_addr is not None
    target = (config.server_addr, config.port)
    for index in range(config.num_qps):
        for attempt in range(CONNECT_TRIES):
            cm_id = channel.create_id()
            cm_id.resolve_addr(None, target)
            _expect(
                await next_event(channel, cm_id, "resolve"), CMEventType.ADDR_RESOLVED, "resolving"
            )
            cm_id.resolve_route()
            _expect(await next_event(channel, cm_id, "route"), CMEventType.ROUTE_RESOLVED, "route")
            link = res.add(cm_id)
            cm_id.connect(conn_param(config, res.out_reads))
            event = await next_event(channel, cm_id, "connect")
            if event.event == CMEventType.ESTABLISHED:
                break
            res.links.pop()
            cm_id.destroy()
            if event.event not in _FAILED or attempt == CONNECT_TRIES - 1:
                _expect(event, CMEventType.ESTABLISHED, f"test connection {index}")
            log.debug("test connection %d refused (%s); again", link.index, event.event.name)
            await trio.sleep(CONNECT_GAP)


async def accept_tests(
    channel: EventChannel, listener: CMId, config: PerfConfig, res: Resources
) -> None:
    """The server's test connections: the next ``num_qps`` requests on the listener."""
    for _ in range(config.num_qps):
        request = _expect(
            await next_event(channel, listener, "listen"), CMEventType.CONNECT_REQUEST,
            "waiting for the test connection",
        )  # fmt: skip
        res.add(request.id)
        request.id.accept(conn_param(config, res.out_reads))
        _expect(
            await next_event(channel, request.id, "accept"), CMEventType.ESTABLISHED, "accepting"
        )


__all__ = [
    "Comm",
    "Link",
    "Negotiated",
    "PerfError",
    "Resources",
    "accept_comm",
    "accept_tests",
    "connect_comm",
    "connect_tests",
    "preamble",
]
