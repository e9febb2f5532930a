"""RDS's plain-message path: where a session's plain messages go from a poll's rows to
their sockets, in C when it was built, else in Python. Chosen here, once.

The pattern of the engine's accelerator (``providers/softiwarp/fastpath.py``), one layer
up: ``_plain`` (C through cffi, ``_plain.c``, built when a compiler was there at install
time) keeps the sockets' receive queues (:class:`~.inbox.CInboxes`) and takes a poll's
plain messages into them in one call (:class:`PlainReceiver`), and the Python path
(:class:`~.inbox.PyInboxes`, :meth:`.RdmaFlow.receive_at`, :meth:`.RdsNode._deliver`) is
the reference and the fallback. A message is plain when it is a received Send of one
fragment with no checksum, no extension header and no congestion map, numbered next,
for a bound port whose socket holds less than ``rcvbuf``: what every message of a
steady exchange is. The C path knows no verbs backend (it reads the portable rows of
``cq.poll_rows``), so RDS stays above the portable API on every backend.

The compiled path is used when it was built, unless the environment variable
``RDMASHIM_NO_EXTENSIONS`` is set (to anything but ``0``) when this module is first
imported; :func:`use` changes the choice for nodes made later (the tests run the RDS
suites on both).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from rdmashim.ulps.rds.gate import SendGate, StreamSends
from rdmashim.ulps.rds.inbox import CInboxes, Inboxes, PyInboxes
from rdmashim.verbs import WC_ROW, WCStatus

if TYPE_CHECKING:
    from rdmashim.ulps.rds.connection import RdsConnection
    from rdmashim.ulps.rds.rdma import RdmaOp, Registrations, Sources
    from rdmashim.ulps.rds.rdma_flow import RdmaFlow
    from rdmashim.ulps.rds.settings import RdsSettings
    from rdmashim.ulps.rds.tcp_stream import Received, StreamDecoder, StreamSender
    from rdmashim.verbs import SGE

log = logging.getLogger(__name__)

ENV_NO_EXTENSIONS = "RDMASHIM_NO_EXTENSIONS"
ROWS = 64
"""Rows a session polls at a time (and room for their reposts and wake-ups)."""
READ_BYTES = 64 * 1024
"""What an RDS/TCP session's read in C takes at most (:meth:`PlainStream.read`)."""
_STATUS = {int(status): status for status in WCStatus}
"""A row's status as its enum member, found without ``WCStatus()``'s two Python calls."""


def _load() -> tuple[Any, str]:
    if os.environ.get(ENV_NO_EXTENSIONS, "") not in ("", "0"):
        return None, f"{ENV_NO_EXTENSIONS} is set"
    try:
        from rdmashim.ulps.rds import _plain  # type: ignore[attr-defined]
    except ImportError as exc:
        return None, f"not built or not loadable ({exc})"
    return _plain, ""


COMPILED, WHY_NOT = _load()
"""The compiled module (``ffi``, ``lib``), or None and the reason why not."""
if COMPILED is None:
    log.debug("RDS's compiled plain-message path unavailable: %s", WHY_NOT)

_current: Any = COMPILED


def use(compiled: bool) -> None:
    """Make nodes created from now on use the compiled path (when it was built) or the
    Python one."""
    global _current
    if compiled and COMPILED is None:
        raise RuntimeError(f"RDS's compiled plain-message path is unavailable: {WHY_NOT}")
    _current = COMPILED if compiled else None


def compiled() -> bool:
    """Whether nodes created now take plain messages in C."""
    return _current is not None


def describe() -> str:
    """One line for info output: ``yes (C)`` or ``no (why)``."""
    if _current is not None:
        return "yes (C)"
    return f"no ({WHY_NOT or 'the Python path was chosen'})"


def inboxes() -> Inboxes:
    """The receive queues of a new node: in C when the compiled path is used."""
    if _current is None:
        return PyInboxes()
    return CInboxes(_current.ffi, _current.lib)


class Wakeable(Protocol):
    """A socket, as the plain-message path sees it."""

    _registrations: Registrations

    def _wake(self) -> None:
        """A message was queued: wake a reader."""


class PlainPath:
    """A node's plain-message path: its C inboxes, its bounds, and its sockets by port
    (whose readers it wakes: ``sock._wake()``)."""

    def __init__(
        self, inboxes: CInboxes, settings: RdsSettings, sockets: Mapping[int, Wakeable]
    ) -> None:
        self.inboxes = inboxes
        self.settings = settings
        self.sockets = sockets

    def stream(self, rds: RdsConnection, fd: int) -> PlainStream:
        """The plain messages of an RDS/TCP session carrying ``rds`` on socket ``fd``, taken
        from its stream in C."""
        return PlainStream(self, rds, fd)

    def stream_sends(
        self, rds: RdsConnection, sender: StreamSender, fd: int, rest: Callable[[bytes], None]
    ) -> StreamSends:
        """The gate of an RDS/TCP session carrying ``rds`` on socket ``fd``, whose stream
        ``sender`` frames (:class:`StreamSends`); ``rest`` takes what the socket left of a
        message sent through it."""
        return StreamSends(self.inboxes, rds, sender, fd, rest)

    def flow_state(self) -> Any:
        """A session's flow counters in C memory (``rp_flow``), for its :class:`RdmaFlow`:
        the native handler and :meth:`PlainReceiver.send` change them too."""
        return self.inboxes.ffi.new("rp_flow *")

    def receiver(
        self,
        rds: RdsConnection,
        flow: RdmaFlow,
        recv: bytearray,
        slot: int,
        sge: SGE,
        batch: int,
        sends: SendRing,
    ) -> PlainReceiver:
        """The scan of one session, which receives into ``recv`` in buffers of ``slot``
        bytes (it polls its completions into the receiver's :attr:`PlainReceiver.rows`);
        ``sge`` is the first buffer's, as registered; receives go back in lists of at
        least ``batch``. ``recv`` is the registered bytearray
        itself, not a view of it: C keeps a pointer to it (a view's export, released by
        the garbage collector in a cycle's arbitrary order, can be gone first). ``flow``'s
        state is :meth:`flow_state`'s; ``sends`` are the buffers of Sends made in C."""
        return PlainReceiver(self, rds, flow, recv, slot, sge, batch, sends)


class SendRing(NamedTuple):
    """The send buffers of a session's plain messages sent in C (:meth:`PlainReceiver.send`)."""

    buffer: bytearray
    """Registered, ``slots`` buffers of the session's slot size (the bytearray itself, as
    ``recv`` above)."""
    sge: SGE
    """The first buffer's, as registered."""
    slots: int
    wr_base: int
    """Buffer ``i``'s Send is work request ``wr_base + i``."""
    max_inline: int
    signal_every: int
    ack_every: int


def path(
    inboxes: Inboxes, settings: RdsSettings, sockets: Mapping[int, Wakeable]
) -> PlainPath | None:
    """The plain-message path of a node with ``inboxes`` (None: its inboxes are Python's,
    and so is every message's way to them)."""
    if isinstance(inboxes, CInboxes):
        return PlainPath(inboxes, settings, sockets)
    return None


class PlainReceiver(SendGate):
    """One session's plain messages, taken from a poll's rows in C: by the CQ's native
    handler (``rp_handle``, :attr:`handler`) where the backend calls one, else by the
    session's handler through :meth:`take` (``rp_scan``). What C took goes into the
    session's state when Python next looks (:meth:`fold`)."""

    __slots__ = (
        "_chased", "_flow", "_lib", "_ports", "_recv", "_reposts", "_rows_c", "_send",
        "_sockets", "_unpack", "_woken", "_writes", "hook", "rows", "run", "send",
        "send_write", "sendto", "sent", "state", "watcher", "write_seq",
    )  # fmt: skip

    def __init__(
        self,
        plain: PlainPath,
        rds: RdsConnection,
        flow: RdmaFlow,
        recv: bytearray,
        slot: int,
        sge: SGE,
        batch: int,
        sends: SendRing,
    ) -> None:
        inboxes = plain.inboxes
        ffi = inboxes.ffi
        self._lib = inboxes.lib
        self._ports = inboxes.counts
        self._sockets = plain.sockets
        self._flow = flow
        self.rows = bytearray(ROWS * WC_ROW.size)
        """Where the session polls its completions (``cq.poll_rows``: rows of ``WC_ROW``)."""
        self._rows_c = ffi.from_buffer("rp_row[]", self.rows)
        self._recv = ffi.from_buffer(recv)
        rx = self.state = ffi.new("rp_rx *")
        """The scan's state (``rp_rx``): ``has_ack`` set while C took rows not yet folded."""
        rx.slot = slot
        rx.rcvbuf = plain.settings.rcvbuf
        rx.rcvbuf_limit = plain.settings.rcvbuf_limit
        rx.family, packed = rds.peer.version, rds.peer.packed
        ffi.memmove(rx.peer, packed, len(packed))
        self._reposts = ffi.new("uint32_t[]", ROWS)
        self._woken = ffi.new("uint16_t[]", ROWS)
        self._chased = ffi.new("int64_t[]", ROWS)
        self._unpack = ffi.unpack
        hook = self.hook = ffi.new("rp_hook *")
        super().__init__(ffi, rds, hook.gate)
        """The native handler's context (``rp_hook``): its ``quiet_port`` is the port whose
        reader drives the session (0: none), for whose plain messages it wakes no one
        (the reader looks after the read)."""
        hook.rx, hook.ports, hook.rows, hook.room = rx, self._ports, self._rows_c, ROWS
        hook.recv, hook.recv_len = self._recv, len(self._recv)
        hook.reposts, hook.woken, hook.chased = self._reposts, self._woken, self._chased
        hook.recv_addr, hook.recv_lkey, hook.repost_batch = sge.addr, sge.lkey, batch
        hook.flow = flow.state
        self._send = ffi.from_buffer(sends.buffer)
        hook.send, hook.send_addr, hook.send_lkey = self._send, sends.sge.addr, sends.sge.lkey
        hook.send_slots, hook.send_wr = sends.slots, sends.wr_base
        hook.max_inline = sends.max_inline
        hook.signal_every, hook.ack_every = sends.signal_every, sends.ack_every
        self._writes = ffi.new("rp_write[]", sends.slots)
        hook.writes = self._writes
        self.send = functools.partial(self._lib.rp_send, hook)
        """``send(seq, sport, dport, data, len(data))``: :c:func:`rp_send`, a plain message
        Python would send next with nothing else queued, written and staged in C (1), or
        not (0: Python sends it); ``qp.run_native_handler()`` then posts what was staged."""
        self.send_write = functools.partial(self._lib.rp_send_write, hook)
        """``send_write(seq, sport, dport, data, len(data), addr, lkey, length,
        remote_addr, rkey)``: :c:func:`rp_send_write`, :attr:`send` for a message chasing
        an RDMA Write of ``length`` bytes at ``addr`` (registered, ``lkey``) into the peer's
        region (``rkey``, from ``remote_addr``)."""
        self.write_seq = functools.partial(self._lib.rp_write_seq, hook)
        """``write_seq(wr_id)``: the sequence number of the message whose Write (sent in
        C) work request ``wr_id`` is, or -1."""
        self.sent = functools.partial(self._lib.rp_sent, hook)
        """``sent(wr_id)``: a successful Send completion Python polled; 1 when it was one
        of :attr:`send`'s (its buffer and the ones before it are free again)."""
        self.sendto = functools.partial(self._lib.rp_sendto, hook)
        """``sendto(sport, dport, data, len(data))``: :c:func:`rp_sendto`, a socket's plain
        message numbered, staged and posted in one call while the gate is open
        (:meth:`open`): 1, or 2 when :attr:`run` must still post it (the caller appends
        it to :attr:`log` either way); else 0."""
        self.run: Callable[[], object] = _nothing
        """Post what was staged (:meth:`posting`: the QP's ``run_native_handler``)."""
        self.watcher: Callable[[int], None] = _nothing
        """``watcher(seq)``: someone waits for the RDMA Write that message ``seq`` chased
        (:meth:`posting`: the session's)."""
        self.release()

    def posting(
        self,
        run: Callable[[], object],
        runner: tuple[int, int] | None,
        watcher: Callable[[int], None],
    ) -> None:
        """How what :attr:`sendto` staged is posted: ``run`` from Python (the QP's
        ``run_native_handler``), and in the same call into C by ``runner`` (the QP's
        ``native_runner()``: function and context; None: Python always runs it); and
        who hears of a wait for a Write sent so (:attr:`watcher`)."""
        self.run, self.watcher = run, watcher
        hook = self.hook
        if runner is None:
            hook.run = self._ffi.NULL
        else:
            hook.run = self._ffi.cast("uint32_t (*)(void *)", runner[0])
            hook.run_ctx = self._ffi.cast("void *", runner[1])

    def sendto_write(
        self, sport: int, dport: int, data: bytes, op: RdmaOp, sources: Sources
    ) -> int:
        """:attr:`sendto` for a message chasing an RDMA Write (``rp_sendto_write``), when
        ``op`` is new and writes ``bytes`` whose registration the node keeps
        (:meth:`.RdmaOp._begin_kept`): 1 or 2 as :attr:`sendto` says (the caller appends
        it to :attr:`log` with ``op``), else 0 and ``op`` is as it was. A wait for ``op``
        brings it in first (:meth:`sync`)."""
        mr = op._begin_kept(sources)
        if mr is None:
            return 0
        went: int = self._lib.rp_sendto_write(
            self.hook, sport, dport, data, len(data), *op._c_write(mr)
        )
        if went:
            op._watch = self.sync  # (then the watch sync gives it)
        else:
            op._unbegin()
        return went

    def _brought_in(self, log: list[tuple[int, int, bytes, RdmaOp | None]], seq: int) -> None:
        """A wait for an RDMA Write that went through the gate asks the session's
        :attr:`watcher`, as for its own send of one (``_staged_in_c``)."""
        for _, _, _, op in log:
            if op is not None:
                op._watch = functools.partial(self.watcher, seq)
            seq += 1

    @property
    def handler(self) -> tuple[int, int]:
        """The CQ's native handler and its context (``cq.set_native_handler``)."""
        return int(self._lib.rp_handle_address()), int(self._ffi.cast("uintptr_t", self.hook))

    def hold(self) -> None:
        """Python's handler runs: the native handler takes nothing meanwhile."""
        self.hook.held = 1

    def release(self, grant: int = 0) -> None:
        """Python took what waited (its handler emptied the CQ): the native handler may
        take again, from the session's state as it is now (not while a message in
        fragments is assembled: every row is the assembly's), and asks once the flow's
        credits to grant (``advertise``) reach ``grant`` (0: never)."""
        rx, hook = self.state, self.hook
        hook.grant_at = grant
        rx.next_recv = self._rds.next_recv
        rx.talk = -1  # (the next run's messages: RdmaFlow.talk)
        hook.held = self._flow.assembly is not None

    def sending(self, waiting: bool) -> None:
        """Whether the session's sends wait for credits or a sender for room (the native
        handler asks at every row it takes then: its credits and acknowledgement)."""
        self.hook.sends_waiting = waiting

    def watch(self, seq: int) -> None:
        """The oldest message not yet acknowledged whose RDMA operation ends with its
        acknowledgement, unless one is watched already (the native handler asks then)."""
        if not self.hook.ack_watch:
            self.hook.ack_watch = seq

    def watch_oldest(self) -> None:
        """Watch the oldest message not yet acknowledged that carries an RDMA operation
        (none: nothing)."""
        unacked = self._rds.unacked
        self.hook.ack_watch = next((m.seq for m in unacked if m.rdma is not None), 0)

    def take_left(
        self, completion: Callable[[int, WCStatus, int, int], None], reposts: list[int]
    ) -> int:
        """Take the rows the native handler polled and left to Python (as :meth:`take`);
        how many there were (0: none)."""
        hook = self.hook
        start, n = int(hook.left), int(hook.polled)
        if start >= n:
            return 0
        hook.left = hook.polled = 0
        self.take(n, completion, reposts, start)
        return n - start

    def take(
        self,
        n: int,
        completion: Callable[[int, WCStatus, int, int], None],
        reposts: list[int],
        start: int = 0,
    ) -> None:
        """Take rows ``start..n-1`` of :attr:`rows` in order: each run of plain messages in
        C (their credits, acks and numbers into the session's state, their payloads onto
        their sockets, whose readers are woken, their receive buffers onto ``reposts``, and
        so are those the native handler had not posted yet), and any other row by
        ``completion(wr_id, status, opcode, byte_len)`` (the Python path's), as is every
        row while a message in fragments is being assembled."""
        flow, rows = self._flow, self.rows
        while start < n:
            if flow.assembly is None:  # (else every row is the assembly's: Python's)
                start = self._scan(start, n, reposts)
            if start < n:  # a row that is not plain: the Python path's
                row = WC_ROW.unpack_from(rows, start * WC_ROW.size)
                status = _STATUS.get(row[1])
                completion(row[0], WCStatus(row[1]) if status is None else status, row[2], row[3])
                start += 1

    def _scan(self, start: int, n: int, reposts: list[int]) -> int:
        """Take the run of plain messages from row ``start`` on in C, and write what they
        changed back into the session's state; the first row not taken."""
        rx = self.state
        if rx.has_ack:  # (what C took before goes first: next_recv is C's until then)
            self.fold(reposts)
        rx.next_recv = self._rds.next_recv
        rx.talk = self._flow.talk
        took: int = self._lib.rp_scan(
            rx, self._ports, self._rows_c + start, n - start, self._recv, len(self._recv),
            self._reposts, ROWS, self._woken, self._chased, ROWS,
        )  # fmt: skip
        if took:
            self.fold(reposts)
        return start + took

    def fold(self, reposts: list[int] | None) -> int:
        """Write what C took since the last fold into the session's state (acks, numbers,
        counters, credits a scan took; readers woken, use-once registrations ended), its
        receive buffers onto ``reposts`` (None: they stay the native handler's to post);
        the messages it took. (The native handler adds the credits it takes and the
        receives it posts again to the flow's counters itself: they need no fold.)"""
        rx, rds, flow, unpack, hook = self.state, self._rds, self._flow, self._unpack, self.hook
        self.sync()  # (the acknowledgements may be of messages sent through the gate)
        if not rx.has_ack:
            return 0
        rx.has_ack = 0
        if reposts is not None:
            reposts += unpack(self._reposts, rx.nreposts)
            rx.nreposts = 0
        flow.state.send_credits += rx.credits
        unacked = rds.unacked
        if unacked and unacked[0].seq <= rx.ack:
            rds.acked(rx.ack)
            if hook.ack_watch and hook.ack_watch <= rx.ack:  # (watch the next one, if any)
                self.watch_oldest()
        messages: int = rx.messages
        rx.credits = 0
        if messages:
            flow.talk = rx.talk
            rx.talk = -1
            sockets, nwoken = self._sockets, rx.nwoken
            ports = unpack(self._woken, nwoken) if nwoken else []
            if rx.chasers:  # (their sockets' use-once registrations end)
                for port, rkey in zip(ports, unpack(self._chased, nwoken), strict=True):
                    if rkey >= 0 and (sock := sockets.get(port)) is not None:
                        sock._registrations.used(rkey)
                rx.chasers = 0
            _delivered(rx, rds, sockets, ports)
        return messages


def _nothing(*_: object) -> None:
    """:attr:`PlainReceiver.run` and :attr:`~PlainReceiver.watcher` until the session sets
    them."""


def _delivered(
    rx: Any, rds: RdsConnection, sockets: Mapping[int, Wakeable], ports: list[int]
) -> None:
    """Give ``rds`` the ``rx.messages`` messages C delivered (their numbers and counters)
    and wake the readers of ``ports`` (one entry a message, as ``RdsNode._deliver`` wakes
    them); ``rx`` counts afresh."""
    messages: int = rx.messages
    rx.messages = 0
    rds.next_recv = rx.next_recv
    rds.heard = rds.busy = True
    counters = rds.counters
    counters.recv_messages += messages
    counters.recv_bytes += rx.bytes
    rx.bytes = rx.nwoken = 0
    for port in ports:
        if (sock := sockets.get(port)) is not None:
            sock._wake()


class PlainStream:
    """One RDS/TCP session's plain messages, taken from its byte stream in C: :meth:`read`
    reads the socket and hands the whole plain messages at the front of what came to
    their sockets in one call (``rp_stream_read``), and :meth:`scan` those at the front
    of what the session's :class:`~.tcp_stream.StreamDecoder` buffered (``rp_stream``)."""

    __slots__ = (
        "_buf", "_buffer", "_from_buffer", "_lib", "_ports", "_rds", "_read", "_sockets",
        "_unpack", "_woken", "state",
    )  # fmt: skip

    def __init__(self, plain: PlainPath, rds: RdsConnection, fd: int) -> None:
        inboxes = plain.inboxes
        ffi = inboxes.ffi
        self._lib, self._from_buffer, self._unpack = inboxes.lib, ffi.from_buffer, ffi.unpack
        self._buffer = ffi.buffer
        self._ports, self._sockets, self._rds = inboxes.counts, plain.sockets, rds
        rx = self.state = ffi.new("rp_rx *")
        """The scan's state (``rp_rx``; only its numbering and delivery counts are used)."""
        rx.rcvbuf = plain.settings.rcvbuf
        rx.rcvbuf_limit = plain.settings.rcvbuf_limit
        rx.family, packed = rds.peer.version, rds.peer.packed
        ffi.memmove(rx.peer, packed, len(packed))
        rx.talk = -1
        self._woken = ffi.new("uint16_t[]", ROWS)
        self._buf = ffi.new("char[]", READ_BYTES)
        read = self._read = ffi.new("rp_stream_rx *")
        """The reads' state (``rp_stream_rx``)."""
        read.rx, read.ports, read.woken, read.woken_room = rx, self._ports, self._woken, ROWS
        read.fd, read.buf, read.cap = fd, self._buf, READ_BYTES

    def read(self, decoder: StreamDecoder, received: Received) -> int:
        """Read the socket once, without waiting, and take what came. When the stream's
        next byte begins a message (:attr:`~.tcp_stream.StreamDecoder.at_message`), in one
        call into C: the whole plain messages at the front of what came go to their
        sockets, and what follows them (a message in part, or one that is not plain and
        the rest) to ``decoder``; else all of it to ``decoder`` (``received`` takes the
        messages it completes). The bytes read (0: the end of the stream); OSError when
        the read failed (BlockingIOError: nothing to read)."""
        read, rx = self._read, self.state
        if not decoder.at_message:  # (a read in C must begin at a message)
            data = os.read(read.fd, READ_BYTES)
            decoder.take(data, received)
            return len(data)
        rx.next_recv = self._rds.next_recv
        took: int = self._lib.rp_stream_read(read)
        got: int = read.got
        if not got:
            if read.error:
                raise OSError(read.error, os.strerror(read.error))  # (errno's subclass)
            return 0
        if rx.messages:
            _delivered(rx, self._rds, self._sockets, self._unpack(self._woken, rx.nwoken))
        if took < got:
            decoder.take(self._buffer(self._buf + took, got - took), received)
        return got

    def close(self) -> None:
        """The socket is about to close: :meth:`read` reads nothing from now on (its number
        may soon name another socket)."""
        self._read.fd = -1

    def scan(self, buf: bytearray, pos: int) -> tuple[int, int]:
        """Take the whole plain messages in ``buf`` from ``pos`` on (at most :data:`ROWS`);
        (bytes taken, messages)."""
        rx = self.state
        rx.next_recv = self._rds.next_recv
        took: int = self._lib.rp_stream(
            rx, self._ports, self._from_buffer(buf) + pos, len(buf) - pos, self._woken, ROWS
        )
        if not took:
            return 0, 0
        messages: int = rx.messages
        _delivered(rx, self._rds, self._sockets, self._unpack(self._woken, rx.nwoken))
        return took, messages
