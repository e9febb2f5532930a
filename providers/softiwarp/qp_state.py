"""The state of one queue pair's engine and what changes it as a whole (siw's
``siw_qp.c``).

:class:`QPEngineState` holds the send queue, the ORQ and IRQ, the MSNs and the
receive position. It enters RTS with what MPA settled (sending the peer-to-peer
RTR), and on a protocol violation by the peer, a local error, the peer's
Terminate, the loss of the connection or the user's request it queues a
Terminate (RFC 5040 §5.3), moves to ERROR and flushes the outstanding work. It
completes send work in posting order, and is told when registered memory it uses
is deregistered. Completions and events go to its outbox, which the caller takes
after each call (nothing is called back). The Read (:mod:`.reads`), receive (:mod:`.rx_runs`,
:mod:`.rx`) and transmit (:mod:`.tx`) parts build on it.
"""

from __future__ import annotations

import logging
import traceback
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from rdmashim.providers.softiwarp import ddp
from rdmashim.providers.softiwarp.ddp import MAX_FPDU, QN, Opcode
from rdmashim.providers.softiwarp.fastpath import kernels
from rdmashim.providers.softiwarp.jobs import (
    SIGNALED,
    Chunk,
    EngineConfig,
    EngineState,
    Failed,
    Outcome,
    ReadResponse,
    Ready,
    RecvJob,
    RxMessage,
    RxStep,
    SendJob,
    SendRun,
)
from rdmashim.providers.softiwarp.memory import AccessViolation, MemoryTable, Region
from rdmashim.providers.softiwarp.terminate import (
    RDMAP_LOCAL_CATASTROPHIC,
    Layer,
    ProtocolError,
    RdmapType,
    TermCode,
)
from rdmashim.verbs.enums import SendFlags, WCOpcode, WCStatus, WROpcode
from rdmashim.verbs.wr import WC

log = logging.getLogger(__name__)

RTR_STAG = 1
"""STag of the zero-length RDMA Write/Read that RFC 6581 peer-to-peer RTR sends."""
_WC_OPCODE = {
    WROpcode.SEND: WCOpcode.SEND,
    WROpcode.SEND_WITH_INV: WCOpcode.SEND,
    WROpcode.RDMA_WRITE: WCOpcode.RDMA_WRITE,
    WROpcode.RDMA_READ: WCOpcode.RDMA_READ,
}


@dataclass(eq=False)
class QPEngineState:
    """The state of one RC queue pair's engine (siw's ``siw_qp``): the queues, the
    MSNs, the receive position; and what changes it as a whole: entering RTS, errors,
    Terminate, flushes, completions and deregistration of memory in use."""

    qp_num: int
    pd: object
    memory: MemoryTable
    recv_queue: deque[RecvJob]
    """The receives posted to the QP (or its SRQ), oldest first: the engine takes them
    from the left, a run of them at a time, and puts back the ones a run did not use."""
    sq_sig_all: bool = False
    config: EngineConfig = field(default_factory=EngineConfig)

    state: EngineState = EngineState.IDLE
    error: Exception | None = None
    """Why the QP went to ERROR (a ProtocolError names the Terminate code)."""
    remote_terminate: TermCode | None = None

    def __post_init__(self) -> None:
        self._sq: deque[SendJob | SendRun] = deque()
        self._sq_order: deque[SendJob | SendRun] = deque()
        self._orq: deque[SendJob] = deque()
        self._irq: deque[ReadResponse] = deque()
        self._responding = 0
        """Read Requests accepted whose response is not fully produced (at most IRD)."""
        self._current: Iterator[tuple[list[Chunk], bool, int]] | None = None
        """The FPDUs of the message being sent: their buffers (trailers included), whether
        they end the message, their bytes."""
        self._current_job: SendJob | None = None
        self._current_stags: tuple[int, ...] = ()
        """The STags of the local memory :attr:`_current` reads."""
        self._burst_done: list[SendJob | SendRun] = []
        self._terminate: bytes | None = None
        self._control: list[Chunk] = []
        self._tx_msn = [0, 0, 0]
        self._rx_msn = [1, 1, 1]
        self._rx_send: RxMessage | None = None
        self._staging = bytearray()
        """Allocated (``STAGING_SIZE``) when the first bytes are received: a QP that
        never connects (a request rejected, a stranger held pending) costs none."""
        self._sview = memoryview(self._staging)
        self._start = 0
        self._end = 0
        self._rx = RxStep.HEADER
        self._hdr: ddp.Header | None = None
        self._targets: list[memoryview] = []
        self._remaining = 0
        self._crc = 0
        self._direct: memoryview | None = None
        self._checked_pairs: dict[Region, tuple[object, Region]] = {}
        """The tuples receives share as :attr:`RecvJob.checked`, by region (see
        :meth:`_checked_in`), all of the token :attr:`_pairs_token`."""
        self._pairs_token: object = None
        self._term_body: bytearray | None = None
        self._rtr_pending = self.config.wait_for_rtr
        self._kernels = kernels()
        """The data-path kernels, compiled or Python (``fastpath``), fixed for this QP."""
        self.outbox: list[Outcome] = []
        """What the engine's calls put out, oldest first (:data:`~.jobs.Outcome`): the
        caller takes it after each call (a post, ``produce``/``sent``, ``received``,
        ``connection_lost``, ``set_error``, ``flush_recv``, a deregistration)."""
        self.sq_depth = 0
        """Send work requests posted and not yet completed (each entry of a run counts)."""
        self.small_send_max = 0
        """The most payload bytes of a Send framed in one FPDU (a :class:`SendRun`'s
        entries carry no more): fixed by the config (:meth:`_settle`)."""
        self._tagged_max = 0
        """The most payload bytes of one tagged FPDU (fixed by the config)."""
        self._settle(self.config)
        self.bytes_sent = 0
        self.bytes_received = 0
        self.memory.watch(self)

    def start(self, config: EngineConfig) -> None:
        """Enter RTS with the parameters MPA negotiated."""
        if not 64 <= config.max_fpdu <= MAX_FPDU:
            raise ValueError(f"max_fpdu {config.max_fpdu} outside 64..{MAX_FPDU}")
        self._settle(config)
        self._rtr_pending = config.wait_for_rtr
        if config.rtr_to_send is Opcode.WRITE:
            hdr = ddp.encode_tagged(Opcode.WRITE, True, RTR_STAG, 0, 0)
            self._queue_control(hdr)
        elif config.rtr_to_send is Opcode.READ_REQUEST:
            self._tx_msn[QN.READ_REQUEST] += 1
            rtr_read = SendJob(0, WROpcode.RDMA_READ, SendFlags.NONE, (), None, 0, done=False)
            rtr_read.sink = memoryview(b"")
            self._orq.append(rtr_read)
            hdr = ddp.encode_read_request(
                self._tx_msn[QN.READ_REQUEST], RTR_STAG, 0, 0, RTR_STAG, 0
            )
            self._queue_control(hdr)
        self.state = EngineState.RTS

    def _settle(self, config: EngineConfig) -> None:
        """Take ``config`` and what follows from it for every message: the payload one
        FPDU of ``config.max_fpdu`` bytes carries."""
        self.config = config
        self.small_send_max = ddp.max_payload(config.max_fpdu, ddp.UNTAGGED_HDR_LEN)
        self._tagged_max = ddp.max_payload(config.max_fpdu, ddp.TAGGED_HDR_LEN)

    def _queue_control(self, ulpdu: bytes) -> None:
        self._control += ddp.encode_fpdu(ulpdu, crc=self.config.crc)

    def _take_terminate(self) -> list[Chunk]:
        term, self._terminate = self._terminate, None
        self.state = EngineState.ERROR
        return [term] if term is not None else []

    def _protocol_error(self, exc: ProtocolError) -> None:
        """The peer broke the protocol: Terminate, ERROR, flush."""
        log.warning("QP %d: %s", self.qp_num, exc)
        copied = b""
        ddp_flag = rdmap_flag = False
        if isinstance(exc.header, ddp.Header):
            copied = _header_bytes(exc.header)
            rdmap_flag = exc.quote_rdmap
            ddp_flag = not rdmap_flag
        msg = self._rx_send
        if msg is not None and msg.status is not WCStatus.SUCCESS:
            self._rx_send = None
            self.outbox.append(WC(msg.job.wr_id, msg.status, WCOpcode.RECV, 0, self.qp_num))
        self._send_terminate(ddp.Terminate(exc.code, ddp_flag, rdmap_flag, copied))
        self._enter_error(exc)

    def _local_error(self, exc: AccessViolation) -> None:
        """A send work request named memory it may not use: LOC_PROT_ERR, Terminate, ERROR."""
        job = self._current_job
        log.warning("QP %d: local protection error: %s", self.qp_num, exc)
        if job is not None:
            job.status = WCStatus.LOC_PROT_ERR
            job.done = True
            self._current = None
            self._current_job = None
        error = ProtocolError(f"local protection error: {exc}", RDMAP_LOCAL_CATASTROPHIC)
        self._send_terminate(ddp.Terminate(error.code))
        self._enter_error(error)

    def _internal_error(self, exc: Exception) -> None:
        """An unexpected exception in the engine: log it loudly, end this QP only."""
        log.error("QP %d: internal error, connection terminated", self.qp_num, exc_info=exc)
        error = ProtocolError(f"internal error: {exc!r}", RDMAP_LOCAL_CATASTROPHIC)
        self._send_terminate(ddp.Terminate(error.code))
        self._enter_error(error)

    def _send_terminate(self, term: ddp.Terminate) -> None:
        if self.state is EngineState.RTS:
            self._terminate_bytes(ddp.encode_terminate(term))

    def _terminate_bytes(self, ulpdu: bytes) -> None:
        self._terminate = b"".join(bytes(b) for b in ddp.encode_fpdu(ulpdu, crc=self.config.crc))

    def _rtr_received(self) -> None:
        """The peer-to-peer initiator's RTR arrived: a responder may transmit now."""
        self._rtr_pending = False
        self.outbox.append(Ready())

    def _discarding(self) -> bool:
        """Whether received bytes are dropped (the QP is in ERROR)."""
        return self._rx is RxStep.DISCARD

    def connection_lost(self, exc: Exception | None = None) -> None:
        """The TCP connection closed or failed: ERROR and flush."""
        if self.state is not EngineState.ERROR:
            self._enter_error(exc or ConnectionResetError("connection closed by peer"))

    def set_error(self, exc: Exception | None = None) -> None:
        """Move to ERROR at the user's request (``modify`` to ERR): flush everything."""
        self._enter_error(exc or ConnectionAbortedError("QP moved to ERROR"))

    def _enter_error(self, exc: Exception, remote: ddp.Terminate | None = None) -> None:
        if self.state is EngineState.ERROR:
            return
        _clear_frames(exc)  # what the failed calls' frames held (views of regions) goes
        self.memory.unwatch(self)  # from here on the engine holds no view of a region
        self.error = self.error or exc
        self._rx = RxStep.DISCARD
        self._targets = []
        self._direct = None
        self.state = EngineState.TERMINATE if self._terminate is not None else EngineState.ERROR
        # The Read whose Request the peer's Terminate quotes gets the remote status.
        quoted = _quoted_read_request(remote) if remote is not None else None
        if remote is not None and quoted is not None:
            for job in self._orq:
                if job.msn == quoted.msn:
                    job.done = True
                    job.status = (
                        WCStatus.REM_ACCESS_ERR
                        if remote.code.layer == Layer.RDMAP
                        and remote.code.etype == RdmapType.REMOTE_PROTECTION
                        else WCStatus.REM_OP_ERR
                    )
                    break
        # Work handed to TCP in the burst in flight still completes in order.
        if self._current_job is not None and not self._current_job.done:
            self._current_job.status = WCStatus.WR_FLUSH_ERR
        self._current = None
        self._current_job = None
        self._current_stags = ()
        for entry in self._sq_order:
            if isinstance(entry, SendJob):
                entry.sink = None
            if not entry.done:
                entry.done = True
                entry.status = WCStatus.WR_FLUSH_ERR
        self._orq.clear()
        self._irq.clear()
        self._responding = 0
        self._burst_done.clear()
        self._drain_sq_order()
        while self._sq:
            queued = self._sq.popleft()
            self.sq_depth -= len(queued) if isinstance(queued, SendRun) else 1
            self._complete_send(queued, WCStatus.WR_FLUSH_ERR)
        msg = self._rx_send
        if msg is not None:
            self._rx_send = None
            flushed = WC(msg.job.wr_id, WCStatus.WR_FLUSH_ERR, WCOpcode.RECV, 0, self.qp_num)
            self.outbox.append(flushed)
        self.outbox.append(Failed(exc))

    def revoke(self, region: Region) -> None:
        """``region`` is being deregistered (the engine is a :class:`~.memory.Holder`).

        Work that the QP has started on it (a Send being received into it, a Write
        being placed into it, a Read whose sink it is, a message or Read Response
        being sent from it) can neither finish nor keep a view of it: that work
        completes with LOC_PROT_ERR, the peer gets a Terminate and the QP goes to
        ERROR, which drops every view. Work not started yet checks its memory when it
        starts, as always.
        """
        stag = region.stag
        msg = self._rx_send
        hdr = self._hdr
        reads = [job for job in self._orq if job.sges and job.sges[0].lkey == stag]
        receiving = msg is not None and any(s.lkey == stag for s in msg.job.sges)
        sending = self._current is not None and stag in self._current_stags
        writing = (
            bool(self._targets) and hdr is not None and hdr.opcode is Opcode.WRITE
            and hdr.stag == stag
        )  # fmt: skip
        if not (
            reads
            or receiving
            or sending
            or writing
            or any(resp.src_stag == stag for resp in self._irq)
        ):
            return
        log.warning("QP %d: memory region %#010x deregistered while in use", self.qp_num, stag)
        for job in reads:
            job.status, job.done = WCStatus.LOC_PROT_ERR, True
        if sending and self._current_job is not None:
            self._current_job.status, self._current_job.done = WCStatus.LOC_PROT_ERR, True
        if receiving and msg is not None:
            self._rx_send = None
            self.outbox.append(
                WC(msg.job.wr_id, WCStatus.LOC_PROT_ERR, WCOpcode.RECV, 0, self.qp_num)
            )
        error = ProtocolError(
            f"local protection error: memory region {stag:#010x} deregistered while in use",
            RDMAP_LOCAL_CATASTROPHIC,
        )
        self._send_terminate(ddp.Terminate(error.code))
        self._enter_error(error)

    def flush_recv(self, jobs: Sequence[RecvJob]) -> None:
        """Complete receives of a QP in ERROR with WR_FLUSH_ERR (into the outbox)."""
        flushed, qp_num = WCStatus.WR_FLUSH_ERR, self.qp_num
        self.outbox += [WC(job.wr_id, flushed, WCOpcode.RECV, 0, qp_num) for job in jobs]

    def _drain_sq_order(self) -> None:
        order = self._sq_order
        quiet = not self.sq_sig_all
        success = WCStatus.SUCCESS
        while order and order[0].done:
            job = order.popleft()
            self.sq_depth -= len(job) if isinstance(job, SendRun) else 1
            if quiet and job.status is success and not job.flags & SIGNALED:
                continue  # what _complete_send would do, without the call
            self._complete_send(job, job.status)

    def _complete_send(self, job: SendJob | SendRun, status: WCStatus) -> None:
        if isinstance(job, SendRun):
            quiet = status is WCStatus.SUCCESS and not self.sq_sig_all
            ids = job.signaled if quiet else job.wr_ids
            if ids:
                send, qp_num = WCOpcode.SEND, self.qp_num
                self.outbox.append([WC(wr_id, status, send, 0, qp_num) for wr_id in ids])
            return
        if status is WCStatus.SUCCESS and not (self.sq_sig_all or job.flags & SIGNALED):
            return
        byte_len = job.length if job.opcode is WROpcode.RDMA_READ else 0
        self.outbox.append(WC(job.wr_id, status, _WC_OPCODE[job.opcode], byte_len, self.qp_num))


def _clear_frames(exc: BaseException) -> None:
    """Drop the locals of the finished frames an exception's tracebacks hold (and those
    of the exceptions it was raised from): kept as a QP's error, it must not keep views
    of registered memory, or anything else a frame held, alive."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        e = pending.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if e.__traceback__ is not None:
            traceback.clear_frames(e.__traceback__)
        pending += (e.__cause__, e.__context__)


def _quoted_read_request(term: ddp.Terminate) -> ddp.Header | None:
    """The Read Request a Terminate quotes, if it quotes one."""
    try:
        hdr = ddp.parse_header(term.copied_header)
    except ProtocolError:
        return None
    return hdr if hdr is not None and hdr.opcode is Opcode.READ_REQUEST else None


def _header_bytes(hdr: ddp.Header) -> bytes:
    """Re-encode a received header for a Terminate's copy of it."""
    op = hdr.opcode
    if op in ddp.TAGGED_OPCODES:
        raw = ddp.encode_tagged(op, hdr.last, hdr.stag, hdr.to, hdr.payload_len)
    elif op is Opcode.READ_REQUEST:
        raw = ddp.encode_read_request(
            hdr.msn, hdr.sink_stag, hdr.sink_to, hdr.read_size, hdr.src_stag, hdr.src_to
        )
    else:
        raw = ddp.encode_untagged(
            op, hdr.last, hdr.qn, hdr.msn, hdr.mo, hdr.payload_len, hdr.inv_stag
        )
    return raw
