"""rping's wire protocol on the portable verbs API (``rdmashim ping``).

Either end may be rdma-core's ``rping`` (librdmacm/examples/rping.c). One
iteration ("ping"), after the connection is up:

1. client: Send ``{buf, rkey, size}`` (:data:`INFO`, big-endian) of its *start*
   buffer, which holds :func:`ping_data`;
2. server: RDMA Read of ``size`` bytes from there into its own buffer;
3. server: Send (the "go ahead"; 16 bytes, their content unused);
4. client: Send ``{buf, rkey, size}`` of its *sink* buffer;
5. server: RDMA Write of ``strlen(data) + 1`` bytes to the sink;
6. server: Send (go ahead); the client compares sink and start (``-V``).

As in rping, every message is exactly 16 bytes (anything else is "bogus
data"), each side keeps one receive posted and re-posts it as soon as it
completes, the client pings ``count`` times (0: until stopped) and then
disconnects, and the server serves one connection until the client goes away
(its ``count`` is not used). The active side (client) sends first, as iWARP
requires.

Differences from rping, none visible on the wire: the client clears its sink
before advertising it, so ``-V`` cannot pass on stale data; a server that
disconnects before ``count`` pings is an error for the client (rping calls it
success); limits rping leaves to the hardware (a peer's buffer larger than
ours, a Write longer than the peer's sink) are checked and reported.

Connections are made with the rdma_cm (:mod:`rdmashim.cm`), as rping does:
resolve address and route, ``connect`` with one RDMA Read each way
(responder_resources = initiator_depth = 1); the server listens, takes the
first CONNECT_REQUEST and accepts it on the device the request arrived on.

Library code only logs (``rdmashim.ping``); :class:`PingConfig.on_data`
receives the data that ``-v`` shows, and the CLI prints it.
"""

from __future__ import annotations

import logging
import math
import struct
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from rdmashim import (
    WC,
    Access,
    ProtocolViolation,
    QPCap,
    RecvWR,
    SendFlags,
    SendWR,
    WCOpcode,
    WCStatus,
    WROpcode,
)
from rdmashim.cm import (
    CMEvent,
    CMEventType,
    CMId,
    CMState,
    ConnParam,
    EventChannel,
    TransportOptions,
)
from rdmashim.ping_defaults import DEFAULT_SIZE, MAX_SIZE, MIN_SIZE, MSG_FMT, PORT

log = logging.getLogger(__name__)

INFO = struct.Struct("!QII")
"""``struct rping_rdma_info { __be64 buf; __be32 rkey; __be32 size; }``."""
SQ_DEPTH = 16
"""``RPING_SQ_DEPTH``."""

_FIRST, _LAST = ord("A"), ord("z")  # rping's data cycles through 'A' (65) .. 'z' (122)
_CYCLE = bytes(range(_FIRST, _LAST + 1))
_REMOTE = Access.LOCAL_WRITE | Access.REMOTE_READ | Access.REMOTE_WRITE


class PingError(Exception):
    """The ping failed; the message says how (in rping's words where it has some)."""


class _Disconnected(Exception):
    """The peer closed the connection (rping's DISCONNECTED state)."""


def ping_data(ping: int, size: int) -> bytes:
    """The ``size`` bytes rping's client puts in its start buffer for ping number ``ping``.

    ``"rdma-ping-%d: "``, then letters from ``'A' + ping % 58`` on, cycling
    through ``'A'..'z'``, and a NUL in the last byte.
    """
    if size < 1:
        return b""
    head = (MSG_FMT % ping).encode()[: size - 1]  # snprintf(buf, size, ...)
    n = size - len(head)  # at least 1: the NUL
    start = ping % len(_CYCLE)
    body = (_CYCLE[start:] + _CYCLE * (n // len(_CYCLE) + 1))[: n - 1]
    return head + body + b"\0"


def c_string(buf: bytes | bytearray | memoryview) -> bytes:
    """The bytes before the first NUL (what ``printf("%s")`` shows)."""
    raw = bytes(buf)
    end = raw.find(b"\0")
    return raw if end < 0 else raw[:end]


@dataclass(frozen=True)
class PingConfig:
    """What ``rping`` takes on its command line, plus the transport options.

    ``address``: the server to connect to (client) or the address to listen on
    (server, default all). ``count``: pings (client; 0 = until cancelled).
    ``size``: bytes per ping, :data:`MIN_SIZE` .. :data:`MAX_SIZE`.
    ``validate``: compare the echoed data (client). ``crc``/``p2p``: MPA CRC32c
    request and RFC 6581 peer-to-peer mode. ``timeout``: seconds any one step
    may wait for the peer (None: forever, as rping). ``on_data(ping, data)`` is
    called with each ping's data up to its NUL: the echo at the client, what was
    read at the server (rping ``-v``).
    """

    server: bool
    address: str | None = None
    port: int = PORT
    count: int = 0
    size: int = DEFAULT_SIZE
    validate: bool = False
    crc: bool = True
    p2p: bool = False
    revision: int = 2
    """MPA revision to request: 2 (RFC 6581 IRD/ORD, the default) or 1."""
    timeout: float | None = None
    on_data: Callable[[int, bytes], None] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not MIN_SIZE <= self.size <= MAX_SIZE:
            raise ValueError(f"Invalid size {self.size} (valid range is {MIN_SIZE} to {MAX_SIZE})")
        if self.count < 0:
            raise ValueError(f"Invalid count {self.count}")
        if not self.server and not self.address:
            raise ValueError("a client needs the server's address (-a)")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"Invalid port {self.port}")

    def options(self) -> TransportOptions:
        """Transport (MPA) setup: CRC, peer-to-peer and revision as asked."""
        return TransportOptions(crc=self.crc, p2p=self.p2p, revision=self.revision)


@dataclass
class PingResult:
    """How a ping session ended."""

    pings: int
    """Completed iterations."""
    size: int
    negotiated: TransportOptions | None = None
    """What MPA setup settled, where the backend tells (the built-in engine does)."""
    peer: tuple[str, int] | None = None
    disconnected_by_peer: bool = False


# ---------------------------------------------------------------- connection setup (rdma_cm)

_CONN = ConnParam(responder_resources=1, initiator_depth=1)
"""rping's conn_param: one RDMA Read outstanding each way."""


async def _event(channel: EventChannel, cm_id: CMId, want: CMEventType, step: str) -> CMEvent:
    """The next event for ``cm_id``; anything but ``want`` fails the step like rping."""
    while True:
        event = await channel.get_event()
        event.ack()
        if event.id is cm_id or event.listen_id is cm_id:
            break
    if event.event != want:
        why = f"{event.event.name}" + (f", {event.detail}" if event.detail else "")
        if event.event == CMEventType.REJECTED and event.status == -111:
            why = "connection refused"
        elif event.event == CMEventType.REJECTED:
            why = "connection rejected"
        raise PingError(f"{step} failed: {why}")
    return event


async def connect_client(channel: EventChannel, config: PingConfig) -> tuple[CMId, _Session]:
    """rping's client setup: resolve address and route, create the QP, connect."""
    cm_id = channel.create_id()
    cm_id.options = config.options()
    target = f"{config.address}:{config.port}"
    cm_id.resolve_addr(None, (config.address or "", config.port))
    await _event(channel, cm_id, CMEventType.ADDR_RESOLVED, f"resolving {target}")
    cm_id.resolve_route()
    await _event(channel, cm_id, CMEventType.ROUTE_RESOLVED, f"route to {target}")
    session = _Session(cm_id, config)
    cm_id.connect(_CONN)
    await _event(channel, cm_id, CMEventType.ESTABLISHED, f"connecting to {target}")
    return cm_id, session


def listen(channel: EventChannel, config: PingConfig) -> CMId:
    """rping's server setup: bind and listen (port 0 picks one)."""
    cm_id = channel.create_id()
    cm_id.options = config.options()
    address = config.address or "0.0.0.0"
    try:
        cm_id.bind_addr((address, config.port))
        cm_id.listen()
    except OSError as exc:
        raise PingError(f"cannot listen on {address}:{config.port}: {exc}") from exc
    return cm_id


async def accept_client(
    channel: EventChannel, listener: CMId, config: PingConfig
) -> tuple[CMId, _Session]:
    """The first connection request, accepted with its own QP (rping serves one client)."""
    request = await _event(channel, listener, CMEventType.CONNECT_REQUEST, "waiting for a client")
    cm_id = request.id
    log.debug("connection request from %s", cm_id.peer_addr)
    session = _Session(cm_id, config)
    cm_id.accept(_CONN)
    await _event(channel, cm_id, CMEventType.ESTABLISHED, f"accepting {cm_id.peer_addr}")
    return cm_id, session


# ---------------------------------------------------------------- one connection's resources


class _Session:
    """rping's control block: one CQ, one QP, and its registered buffers."""

    def __init__(self, cm_id: CMId, config: PingConfig) -> None:
        self.config = config
        self.cm_id = cm_id
        context = cm_id.context
        assert context is not None  # resolved, or a connection request: bound to a device
        self.pd = context.alloc_pd()
        self.cq = context.create_cq(SQ_DEPTH * 2)
        cap = QPCap(max_send_wr=SQ_DEPTH, max_recv_wr=2, max_send_sge=1, max_recv_sge=1)
        self.qp = cm_id.create_qp(self.pd, send_cq=self.cq, recv_cq=self.cq, cap=cap)
        self.recv_mr = self.pd.reg_mr(bytearray(INFO.size), Access.LOCAL_WRITE)
        self.send_mr = self.pd.reg_mr(bytearray(INFO.size), Access.NONE)
        self.rdma_mr = self.pd.reg_mr(bytearray(config.size), _REMOTE)
        self.start_mr = None if config.server else self.pd.reg_mr(bytearray(config.size), _REMOTE)
        self._received: deque[tuple[int, bytes]] = deque()
        self._rdma_done: deque[WCOpcode] = deque()
        self._sends_out = 0
        self.post_recv()

    def post_recv(self) -> None:
        self.qp.post_recv(RecvWR(0, [self.recv_mr.sge()]))

    # ---- completions
    def _handle(self, wc: WC) -> None:
        if wc.status != WCStatus.SUCCESS:
            if wc.status == WCStatus.WR_FLUSH_ERR:
                raise self._gone()
            raise PingError(
                f"cq completion failed status {int(wc.status)} ({wc.status.name})"
                + self._why_suffix()
            )
        if wc.opcode == WCOpcode.SEND:
            log.debug("send completion")
            self._sends_out -= 1
        elif wc.opcode == WCOpcode.RECV:
            log.debug("recv completion")
            self._received.append((wc.byte_len, bytes(self.recv_mr.buf[: wc.byte_len])))
            self.post_recv()
        elif wc.opcode in (WCOpcode.RDMA_READ, WCOpcode.RDMA_WRITE):
            log.debug("rdma %s completion", "read" if wc.opcode == WCOpcode.RDMA_READ else "write")
            self._rdma_done.append(wc.opcode)
        else:  # pragma: no cover - rping posts nothing else
            raise PingError(f"unknown completion {wc.opcode!r}")

    def _gone(self) -> Exception:
        """A flushed completion: the peer went away, or the QP failed."""
        error = self.qp.error
        if isinstance(error, ProtocolViolation):
            return PingError(f"connection terminated: {error}")
        return _Disconnected(str(error) if error else "disconnected")

    def _why_suffix(self) -> str:
        error = self.qp.error
        return f": {error}" if error else ""

    async def _pump(self, waiting_for: str) -> None:
        """Handle the next completions; wait at most ``config.timeout`` for them."""
        timeout = self.config.timeout
        with trio.move_on_after(math.inf if timeout is None else timeout) as scope:
            wcs = await self.cq.poll_wait(4)
        if scope.cancelled_caught:
            raise PingError(f"no answer from the peer in {timeout} s (waiting for {waiting_for})")
        for wc in wcs:
            self._handle(wc)

    async def recv_info(self, waiting_for: str) -> tuple[int, int, int]:
        """The next message: it must be an rping_rdma_info."""
        while not self._received:
            await self._pump(waiting_for)
        byte_len, data = self._received.popleft()
        if byte_len != INFO.size:
            raise PingError(f"Received bogus data, size {byte_len}")
        return INFO.unpack(data)

    async def send_info(self, addr: int, rkey: int, size: int) -> None:
        """Send an rping_rdma_info (the server's go-ahead is all zeros, as rping's)."""
        while self._sends_out:  # the last Send still owns send_buf
            await self._pump("a send completion")
        INFO.pack_into(self.send_mr.buf, 0, addr, rkey, size)
        log.debug("RDMA addr %x rkey %x len %d", addr, rkey, size)
        self._sends_out += 1
        self._post(SendWR(0, WROpcode.SEND, [self.send_mr.sge()], SendFlags.SIGNALED))

    async def rdma(self, opcode: WROpcode, length: int, addr: int, rkey: int) -> None:
        """RDMA Read into / Write from our rdma buffer; wait for its completion."""
        wr = SendWR(
            1, opcode, [self.rdma_mr.sge(0, length)], SendFlags.SIGNALED, addr, rkey
        )  # fmt: skip
        self._post(wr)
        want = WCOpcode.RDMA_READ if opcode == WROpcode.RDMA_READ else WCOpcode.RDMA_WRITE
        while not self._rdma_done:
            await self._pump(f"the RDMA {'Read' if want == WCOpcode.RDMA_READ else 'Write'}")
            if self._received:
                raise PingError("unexpected message from the peer during an RDMA operation")
        done = self._rdma_done.popleft()
        if done != want:  # pragma: no cover - one RDMA operation at a time
            raise PingError(f"unexpected {done.name} completion")

    def _post(self, wr: SendWR) -> None:
        try:
            self.qp.post_send(wr)
        except OSError as exc:
            raise PingError(f"post send error {exc}") from exc

    async def aclose(self) -> None:
        """Disconnect (rping_disconnect) and wait until the connection is gone."""
        if self.cm_id.state in (CMState.ESTABLISHED, CMState.ACCEPTING):
            self.cm_id.disconnect()
        with trio.move_on_after(5):
            await self.qp.wait_closed()
        self.cm_id.destroy()


# ---------------------------------------------------------------- the two roles


async def run_client(config: PingConfig) -> PingResult:
    """rping -c: connect, ping ``count`` times, disconnect."""
    result = PingResult(0, config.size)
    async with EventChannel() as channel:
        cm_id, s = await connect_client(channel, config)
        result.negotiated = cm_id.negotiated
        result.peer = (config.address or "", config.port)
        log.debug("rdma_connect successful")
        try:
            await _client_loop(s, config, result)
        except _Disconnected as exc:
            raise PingError(
                f"server disconnected after {result.pings} of {config.count} pings ({exc})"
            ) from None
        finally:
            with trio.CancelScope(shield=True):
                await s.aclose()
    return result


async def _client_loop(s: _Session, config: PingConfig, result: PingResult) -> None:
    assert s.start_mr is not None
    start, sink = s.start_mr, s.rdma_mr
    ping = 0
    while not config.count or ping < config.count:
        start.buf[:] = ping_data(ping, config.size)
        sink.buf[:] = bytes(config.size)
        await s.send_info(start.addr, start.rkey, config.size)
        await s.recv_info(f"ping {ping}: the server's go-ahead after its RDMA Read")
        await s.send_info(sink.addr, sink.rkey, config.size)  # state RDMA_WRITE_ADV
        await s.recv_info(f"ping {ping}: the server's go-ahead after its RDMA Write")
        if config.validate and sink.buf != start.buf:
            first = next(i for i in range(config.size) if sink.buf[i] != start.buf[i])
            raise PingError(f"data mismatch! (ping {ping}, first difference at byte {first})")
        if config.on_data is not None:
            config.on_data(ping, c_string(sink.buf))
        ping += 1
        result.pings = ping


async def run_server(
    config: PingConfig, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
) -> PingResult:
    """rping -s: serve one client until it disconnects.

    Reports the bound port through ``task_status`` (useful with port 0).
    """
    result = PingResult(0, config.size)
    async with EventChannel() as channel:
        listener = listen(channel, config)
        assert listener.local_addr is not None  # bound by listen()
        port = listener.local_addr[1]
        log.debug("listening on %s:%d", config.address or "0.0.0.0", port)
        task_status.started(port)
        cm_id, s = await accept_client(channel, listener, config)
        listener.destroy()
        result.negotiated = cm_id.negotiated
        if cm_id.peer_addr is not None:
            result.peer = (cm_id.peer_addr[0], cm_id.peer_addr[1])
        try:
            await _server_loop(s, config, result)
        except _Disconnected as exc:
            log.debug("server DISCONNECT EVENT... (%s)", exc)
            result.disconnected_by_peer = True
        finally:
            with trio.CancelScope(shield=True):
                await s.aclose()
    return result


async def _server_loop(s: _Session, config: PingConfig, result: PingResult) -> None:
    buf = s.rdma_mr
    while True:
        addr, rkey, length = await s.recv_info("the client's start buffer")  # RDMA_READ_ADV
        log.debug("Received rkey %x addr %x len %d from peer", rkey, addr, length)
        if length > config.size:
            raise PingError(
                f"the client's buffer has {length} bytes, more than ours ({config.size}, -S)"
            )
        await s.rdma(WROpcode.RDMA_READ, length, addr, rkey)
        log.debug("server received read complete")
        data = c_string(buf.buf)
        if config.on_data is not None:
            config.on_data(result.pings, data)
        await s.send_info(0, 0, 0)  # go ahead
        addr, rkey, sink_len = await s.recv_info("the client's sink buffer")  # RDMA_WRITE_ADV
        log.debug("server received sink adv: rkey %x addr %x len %d", rkey, addr, sink_len)
        length = min(len(data) + 1, config.size)  # strlen(rdma_buf) + 1
        if length > sink_len:
            raise PingError(f"the client's sink has {sink_len} bytes; the data needs {length}")
        await s.rdma(WROpcode.RDMA_WRITE, length, addr, rkey)
        log.debug("server rdma write complete")
        await s.send_info(0, 0, 0)  # go ahead
        result.pings += 1


async def run(config: PingConfig) -> PingResult:
    """Run the side ``config`` names."""
    return await (run_server(config) if config.server else run_client(config))


__all__ = [
    "DEFAULT_SIZE",
    "INFO",
    "MAX_SIZE",
    "MIN_SIZE",
    "PORT",
    "PingConfig",
    "PingError",
    "PingResult",
    "accept_client",
    "c_string",
    "connect_client",
    "listen",
    "ping_data",
    "run",
    "run_client",
    "run_server",
]
