"""The RDMAP/DDP protocol engine of one queue pair, free of I/O (sans-IO).

The engine turns posted work into FPDU bytes and received bytes into placed
data and completions. The trio driver only moves bytes:

* transmit: :meth:`Engine.produce` returns the buffers of the next FPDUs
  (headers, slices of registered memory, trailers) for one gathering send;
  after sending them all the driver calls :meth:`Engine.sent`, which completes
  the Sends and Writes whose last byte went out.
* receive: :meth:`Engine.recv_buffer` names where the next received bytes go,
  either straight into the target slice of registered memory (direct placement
  of a large payload) or into the staging buffer; after ``recv_into`` the driver
  calls :meth:`Engine.received` with the byte count.

Completions are handed to the ``on_send_wc`` / ``on_recv_wc`` callables given
at construction. A protocol violation by the peer, or a local error, queues a
Terminate (RFC 5040 §5.3), moves the QP to ERROR and flushes all outstanding
work; so does a Terminate from the peer or the loss of the connection.
"""

from __future__ import annotations

import logging
import traceback
from array import array
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum, auto
from itertools import repeat
from operator import attrgetter, call

from rdmashim.verbs.enums import Access, SendFlags, WCFlags, WCOpcode, WCStatus, WROpcode
from rdmashim.verbs.softiwarp import ddp
from rdmashim.verbs.softiwarp.ddp import QN, Opcode
from rdmashim.verbs.softiwarp.fastpath import kernels
from rdmashim.verbs.softiwarp.kernels import CTRL_WRITE as _CTRL_WRITE
from rdmashim.verbs.softiwarp.kernels import MSG_WORDS as _MSG_WORDS
from rdmashim.verbs.softiwarp.kernels import SEND_MIN as _SEND_MIN
from rdmashim.verbs.softiwarp.kernels import SPAN as _SPAN
from rdmashim.verbs.softiwarp.kernels import TAGGED_CTRLS as _TAGGED_CTRLS
from rdmashim.verbs.softiwarp.kernels import TAGGED_MIN as _TAGGED_MIN
from rdmashim.verbs.softiwarp.kernels import Targets, send_fpdu
from rdmashim.verbs.softiwarp.memory import AccessViolation, MemoryTable, Region, Violation
from rdmashim.verbs.softiwarp.terminate import (
    DDP_CATASTROPHIC,
    RDMAP_LOCAL_CATASTROPHIC,
    DdpTaggedCode,
    DdpUntaggedCode,
    Layer,
    LlpCode,
    ProtocolError,
    RdmapCode,
    RdmapType,
    TermCode,
    ddp_tagged,
    ddp_untagged,
    llp,
    rdmap,
)
from rdmashim.verbs.wr import SGE, WC

log = logging.getLogger(__name__)

Chunk = bytes | bytearray | memoryview
"""A piece of an FPDU as it goes to ``socket.sendmsg``: header, payload slice, pad, CRC."""

MAX_FPDU = 65536
"""Largest FPDU we send: the 16-bit ULPDU length allows 65535 + 2 + pad + CRC bytes."""
RTR_STAG = 1
"""STag of the zero-length RDMA Write/Read that RFC 6581 peer-to-peer RTR sends."""
STAGING_SIZE = 256 * 1024
DIRECT_MIN = 16 * 1024
"""Payload left to receive above which bytes go straight into the target region."""
PRODUCE_MAX = 1024 * 1024
"""Bytes of FPDUs one :meth:`Engine.produce` returns at most (one more step of a message
may pass it). Measured: the compiled tagged framing's buffers of 4 MiB in flight cost
31 us per 64 KiB step in page faults (the allocator hands memory back and takes it
again), 1 MiB 6.6 us."""
TAGGED_STEP = 1024 * 1024
"""Payload bytes of tagged FPDUs framed per kernel call (at least one FPDU's). Measured
(write-bw, 1 MiB Writes): 64 KiB steps, one 64 KB FPDU per call, left the sender bound
by Python per FPDU (0.84 of raw TCP); 1 MiB steps 0.91-1.0."""
TO_LIMIT = 1 << 64
"""Tagged offsets are 64 bits: a segment or Read whose TO + length passes this wraps."""
U32_MAX = 0xFFFFFFFF
"""Largest value of a 32-bit wire field (STag, MO); MSNs count modulo 2^32 (RFC 5041)."""

_CRC_BYTES = ddp.TRAILER_CRC_LEN
_FENCE = int(SendFlags.FENCE)
_SIGNALED = int(SendFlags.SIGNALED)
_SOLICITED = int(SendFlags.SOLICITED)
_UNTAGGED = ddp.UNTAGGED
_LOCAL_WRITE = int(Access.LOCAL_WRITE)
_REMOTE_WRITE = int(Access.REMOTE_WRITE)
_DDP_LAST_SEGMENT = ddp.DDP_LAST | ddp.DDP_VERSION
"""DDP control byte of an untagged last segment (reserved bits zero)."""
_CTRL_SEND_PLAIN = ddp.RDMAP_VERSION | Opcode.SEND
_CTRL_SEND_SE = ddp.RDMAP_VERSION | Opcode.SEND_SE
_INV_STEP = Opcode.SEND_INV - Opcode.SEND
"""From SEND / SEND_SE to SEND_INV / SEND_SE_INV (each follows its plain opcode)."""
_QN_SEND = int(QN.SEND)
_ONE = 1
"""``_ONE.__eq__`` maps a scan's solicited words (1 or 0) to bools at C speed."""
_GT = int.__gt__
_pack_span = _SPAN.pack
_unpack_span = _SPAN.unpack
_WR_ID = attrgetter("wr_id")
_CHECKED = attrgetter("checked")
_SPAN_OF = attrgetter("span")
_SEND_FPDU_BASE = ddp.UNTAGGED_HDR_LEN + 3
"""Header bytes of an untagged FPDU, plus 3 to round its payload up to the pad."""
_UNTAGGED_HDR_LEN = ddp.UNTAGGED_HDR_LEN
_UNTAGGED_ULPDU_MIN = _UNTAGGED_HDR_LEN - 2
"""ULPDU length of an untagged segment without payload."""
_RUN_CTRLS = (_CTRL_SEND_PLAIN, _CTRL_SEND_SE)
"""Control bytes of the Sends a run of the fast path holds."""
_ZERO_PAD = ddp.ZERO_PAD
_CTRL_SEND = {
    (False, False): Opcode.SEND,
    (False, True): Opcode.SEND_INV,
    (True, False): Opcode.SEND_SE,
    (True, True): Opcode.SEND_SE_INV,
}
_SUCCESS = WCStatus.SUCCESS
_WC_RECV = WCOpcode.RECV
_NO_FLAGS = WCFlags.NONE
"""The fields of a successful completion, looked up once (an Enum member through its
class costs 50 ns, three of them a third of a completion's making)."""
_WC_OPCODE = {
    WROpcode.SEND: WCOpcode.SEND,
    WROpcode.SEND_WITH_INV: WCOpcode.SEND,
    WROpcode.RDMA_WRITE: WCOpcode.RDMA_WRITE,
    WROpcode.RDMA_READ: WCOpcode.RDMA_READ,
}


class EngineState(Enum):
    """Where the engine is in the QP's life (siw's IDLE/RTS/TERMINATE/ERROR)."""

    IDLE = auto()
    RTS = auto()
    TERMINATE = auto()
    ERROR = auto()


_RTS = EngineState.RTS
_ERROR = EngineState.ERROR
_TERMINATE = EngineState.TERMINATE


class _Rx(Enum):
    HDR = auto()
    PAYLOAD = auto()
    TRAILER = auto()
    DISCARD = auto()


# Members bound once: an attribute lookup on an enum class costs ~60 ns per use.
_RX_HDR = _Rx.HDR
_RX_PAYLOAD = _Rx.PAYLOAD
_RX_TRAILER = _Rx.TRAILER
_RX_DISCARD = _Rx.DISCARD


def slice_segments(segments: Sequence[memoryview], offset: int, length: int) -> list[memoryview]:
    """The pieces of the concatenation of ``segments`` in ``[offset, offset + length)``."""
    if len(segments) == 1:
        return [segments[0][offset : offset + length]]
    out = []
    for seg in segments:
        n = len(seg)
        if offset >= n:
            offset -= n
            continue
        take = min(n - offset, length)
        out.append(seg[offset : offset + take])
        length -= take
        offset = 0
        if not length:
            break
    return out


@dataclass(eq=False, slots=True)
class SendJob:
    """A send queue work request as the engine carries it."""

    wr_id: int
    opcode: WROpcode
    flags: int
    """``SendFlags`` as a plain int (the data path tests bits without enum arithmetic)."""
    sges: Sequence[SGE]
    inline: bytes | None
    length: int
    remote_addr: int = 0
    rkey: int = 0
    invalidate_rkey: int = 0
    done: bool = False
    status: WCStatus = WCStatus.SUCCESS
    sink: memoryview | None = None
    received: int = 0
    msn: int = 0
    """MSN of the Read Request that carried this RDMA Read."""


class SendRun:
    """Consecutive inline Sends posted together, carried by the engine as one job.

    Each entry is a work request of its own (an SQ slot, a wr_id, a completion if
    signaled or flushed); the run is framed by one kernel call. ``post_send`` of a
    list makes one of the Sends (and Sends with Invalidate) that carry inline data
    fitting one FPDU and no FENCE.
    """

    __slots__ = (
        "chunks",
        "ctrls",
        "done",
        "flags",
        "invs",
        "lens",
        "signaled",
        "size",
        "status",
        "wr_ids",
    )

    opcode = WROpcode.SEND
    """What the SQ's checks see (a run is never a Read)."""

    def __init__(self) -> None:
        self.chunks: list[Chunk] = []
        """The entries' data, in order (one piece each, or one for them all)."""
        self.lens = array("I")
        """Each entry's length."""
        self.ctrls = bytearray()
        """The RDMAP control byte of each entry (Send or Send with SE, with Invalidate)."""
        self.invs = array("I")
        self.wr_ids: list[int] = []
        self.signaled: list[int] = []
        """The wr_ids of the entries with SIGNALED, in order."""
        self.size = 0
        """Bytes of the entries' FPDUs."""
        self.flags = 0
        """SIGNALED if an entry is (a run never has FENCE)."""
        self.done = False
        self.status = WCStatus.SUCCESS

    @staticmethod
    def ctrl(flags: int, invalidate: bool) -> int:
        """The RDMAP control byte of an entry with ``flags`` (Send with Invalidate if
        ``invalidate``)."""
        ctrl = _CTRL_SEND_SE if flags & _SOLICITED else _CTRL_SEND_PLAIN
        return ctrl + _INV_STEP if invalidate else ctrl

    def add(self, wr_id: int, ctrl: int, flags: int, inline: bytes, inv: int) -> None:
        """Append an entry: control byte ``ctrl`` (from :meth:`ctrl`), its ``flags``, its
        data and the STag a Send with Invalidate names."""
        self.ctrls.append(ctrl)
        self.chunks.append(inline)
        self.lens.append(len(inline))
        self.invs.append(inv)
        self.wr_ids.append(wr_id)
        if flags & _SIGNALED:
            self.signaled.append(wr_id)
            self.flags = _SIGNALED
        self.size += self.fpdu_bytes(len(inline))

    @classmethod
    def of(
        cls, data: Chunk, lens: array[int], ctrls: bytes, invs: array[int], wr_ids: list[int],
        signaled: list[int], size: int,
    ) -> SendRun:  # fmt: skip
        """A run made whole: the entries' data joined and the lists as :meth:`add` of
        each entry would leave them (``size`` their FPDUs' bytes); the run keeps them
        and never changes them."""
        run = cls.__new__(cls)  # every field set here: no empty lists made to be replaced
        run.chunks, run.lens, run.invs, run.wr_ids, run.signaled, run.size = (
            [data], lens, invs, wr_ids, signaled, size,
        )  # fmt: skip
        run.ctrls = ctrls  # type: ignore[assignment]
        run.flags = _SIGNALED if signaled else 0
        run.done = False
        run.status = WCStatus.SUCCESS
        return run

    @staticmethod
    def fpdu_bytes(length: int) -> int:
        """The bytes of the FPDU of an entry carrying ``length`` bytes."""
        return ((_SEND_FPDU_BASE + length) & ~3) + _CRC_BYTES

    def __len__(self) -> int:
        return len(self.wr_ids)


class RecvRun:
    """The successful receive completions of a run of small Sends, column by column:
    what a CQ keeps of them (no :class:`WC` per message unless one is asked for).

    Entry ``i`` is the completion of the receive ``wr_ids[i]``: opcode RECV, status
    SUCCESS, ``byte_lens[i]`` bytes, ``solicited[i]`` (``solicited`` None: none is),
    no flags. ``start`` is the first entry not taken yet (a CQ takes them from the
    front).
    """

    __slots__ = ("byte_lens", "qp_num", "solicited", "start", "wr_ids")

    def __init__(
        self,
        wr_ids: list[int],
        byte_lens: Sequence[int],
        solicited: list[bool] | None,
        qp_num: int,
    ) -> None:
        self.wr_ids = wr_ids
        self.byte_lens = byte_lens
        self.solicited = solicited
        self.qp_num = qp_num
        self.start = 0

    def __len__(self) -> int:
        return len(self.wr_ids) - self.start

    def solicited_of(self, start: int, stop: int) -> list[bool]:
        """Whether entries ``start:stop`` are solicited."""
        solicited = self.solicited
        return [False] * (stop - start) if solicited is None else solicited[start:stop]

    def take(self, n: int) -> list[WC]:
        """The next ``n`` entries as completions, taken."""
        start = self.start
        self.start = stop = start + n
        qp_num = self.qp_num
        return [
            WC(wr_id, _SUCCESS, _WC_RECV, byte_len, qp_num, _NO_FLAGS, 0, 0, solicited)
            for wr_id, byte_len, solicited in zip(
                self.wr_ids[start:stop], self.byte_lens[start:stop], self.solicited_of(start, stop),
                strict=True,
            )
        ]  # fmt: skip


@dataclass(eq=False, slots=True)
class RecvJob:
    """A posted receive as the engine carries it."""

    wr_id: int
    sges: Sequence[SGE]
    length: int
    checked: tuple[object, Region] | None = None
    """For a receive of one non-empty SGE: the memory token it was checked under
    (:meth:`MemoryTable.token`) and the region, one tuple shared by every receive
    checked under that token in that region (a receive posted again is not checked
    again while the token holds; a run's receives are found all checked in one region
    by counting one object, with nothing made per receive)."""
    span: bytes = b""
    """With :attr:`checked`: the offset in the region and the length as a
    :data:`~.kernels.SPAN` (a run's spans go to the kernel joined)."""


@dataclass(eq=False, slots=True)
class _ReadResponse:
    sink_stag: int
    sink_to: int
    source: memoryview
    src_stag: int


@dataclass(eq=False, slots=True)
class _RxMessage:
    """The untagged receive in progress on QN 0."""

    job: RecvJob
    segments: list[memoryview]
    received: int = 0
    status: WCStatus = WCStatus.SUCCESS


@dataclass(slots=True)
class EngineConfig:
    """Per-connection parameters settled by MPA negotiation."""

    crc: bool = True
    ird: int = 16
    ord: int = 16
    max_fpdu: int = MAX_FPDU
    rtr_to_send: Opcode | None = None
    """P2P initiator: the zero-length message to send first (WRITE or READ_REQUEST)."""
    wait_for_rtr: bool = False
    """P2P responder: hold transmission until the initiator's RTR arrives."""


@dataclass(eq=False)
class Engine:
    """The protocol state of one RC queue pair (see the module docstring)."""

    qp_num: int
    pd: object
    memory: MemoryTable
    recv_queue: deque[RecvJob]
    """The receives posted to the QP (or its SRQ), oldest first: the engine takes them
    from the left, a run of them at a time, and puts back the ones a run did not use."""
    on_send_wc: Callable[[WC], None]
    on_recv_wc: Callable[[WC], None]
    sq_sig_all: bool = False
    config: EngineConfig = field(default_factory=EngineConfig)
    on_fatal: Callable[[Exception], None] = lambda exc: None
    on_ready: Callable[[], None] = lambda: None
    """Called when a P2P responder receives the initiator's RTR (it may transmit from now)."""
    on_recv_wcs: Callable[[RecvRun], None] | None = None
    """Takes the successful receive completions of a run of small Sends at once, in
    order (default: ``on_recv_wc`` for each). No completion callable may end the QP."""
    on_send_wcs: Callable[[list[WC]], None] | None = None
    """Takes the completions of a :class:`SendRun` at once (default: ``on_send_wc``
    for each)."""

    state: EngineState = EngineState.IDLE
    error: Exception | None = None
    """Why the QP went to ERROR (a ProtocolError names the Terminate code)."""
    remote_terminate: TermCode | None = None

    def __post_init__(self) -> None:
        self._sq: deque[SendJob | SendRun] = deque()
        self._sq_order: deque[SendJob | SendRun] = deque()
        self._orq: deque[SendJob] = deque()
        self._irq: deque[_ReadResponse] = deque()
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
        self._rx_send: _RxMessage | None = None
        self._staging = bytearray()
        """Allocated (``STAGING_SIZE``) when the first bytes are received: a QP that
        never connects (a request rejected, a stranger held pending) costs none."""
        self._sview = memoryview(self._staging)
        self._start = 0
        self._end = 0
        self._rx = _RX_HDR
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
        self._recv_wcs = self.on_recv_wcs or _each_of_run(self.on_recv_wc)
        self._send_wcs = self.on_send_wcs or _each(self.on_send_wc)
        self._run_extra = 0
        """Entries of the runs in the SQ beyond one each (``sq_depth`` counts entries)."""
        self.bytes_sent = 0
        self.bytes_received = 0
        self.memory.watch(self)

    # ------------------------------------------------------------------ setup
    def start(self, config: EngineConfig) -> None:
        """Enter RTS with the parameters MPA negotiated."""
        if not 64 <= config.max_fpdu <= MAX_FPDU:
            raise ValueError(f"max_fpdu {config.max_fpdu} outside 64..{MAX_FPDU}")
        self.config = config
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

    def _queue_control(self, ulpdu: bytes) -> None:
        self._control += ddp.encode_fpdu(ulpdu, crc=self.config.crc)

    # ------------------------------------------------------------------ posting
    def post_send(self, job: SendJob | SendRun) -> None:
        """Queue a send work request, or a run of them (already checked against the QP's
        limits)."""
        state = self.state
        if state is _ERROR or state is _TERMINATE:  # identity: Enum hashing is Python code
            self._complete_send(job, WCStatus.WR_FLUSH_ERR)
            return
        if isinstance(job, SendRun):
            self._run_extra += len(job) - 1
        self._sq.append(job)

    @property
    def sq_depth(self) -> int:
        """Send work requests posted and not yet completed."""
        return len(self._sq) + len(self._sq_order) + self._run_extra

    @property
    def small_send_max(self) -> int:
        """The most payload bytes of a Send framed in one FPDU (a :class:`SendRun`'s
        entries carry no more)."""
        return (self.config.max_fpdu - ddp.UNTAGGED_HDR_LEN - _CRC_BYTES) & ~3

    @property
    def _tagged_max(self) -> int:
        """The most payload bytes of one tagged FPDU."""
        return (self.config.max_fpdu - ddp.TAGGED_HDR_LEN - _CRC_BYTES) & ~3

    @property
    def tx_ready(self) -> bool:
        """Whether :meth:`produce` has something to send now."""
        if self._terminate is not None or self._control:
            return True
        if self.state is not _RTS or self._rtr_pending:
            return False
        if self._current is not None or self._irq:
            return True
        return bool(self._sq) and self._sq_head_may_start()

    def _sq_head_may_start(self) -> bool:
        head = self._sq[0]
        if head.flags & _FENCE and self._orq:
            return False
        return not (head.opcode is WROpcode.RDMA_READ and len(self._orq) >= self.config.ord)

    # ------------------------------------------------------------------ transmit
    def produce(self, max_bytes: int = PRODUCE_MAX, max_buffers: int = 512) -> list[Chunk]:
        """Buffers of the next FPDUs to send (empty when there is nothing to send)."""
        if self._terminate is not None:
            return self._take_terminate()
        out, self._control = self._control, []
        if self.state is not _RTS or self._rtr_pending:
            return out
        size = 0
        while size < max_bytes and len(out) < max_buffers:
            if self._current is None and self._sq and not self._irq:
                size += self._small_send_fpdus(out, max_bytes - size)
                if size >= max_bytes:
                    break  # (a SendRun left at the head must not reach _start_next)
            if self._current is None and not self._start_next():
                break
            try:
                fpdus, last, nbytes = next(self._current)  # type: ignore[arg-type]
            except AccessViolation as exc:
                self._local_error(exc)
                return out + self._take_terminate()
            except Exception as exc:  # a bug of ours must not take the process down
                self._internal_error(exc)
                return out + self._take_terminate()
            if last:
                if self._current_job is not None:
                    self._burst_done.append(self._current_job)
                else:
                    self._responding -= 1
                self._current = None
                self._current_job = None
            out.extend(fpdus)
            size += nbytes
        return out

    def _seal(self, fpdu: list[Chunk]) -> int:
        """Append PAD and CRC field to an FPDU's header and payload pieces; its bytes."""
        header = fpdu[0]
        ulpdu_len = (header[0] << 8) | header[1]
        pad = -(ulpdu_len + 2) & 3
        if self.config.crc:
            crc32c = self._kernels.crc32c
            value = 0
            for part in fpdu:
                value = crc32c(part, value)
            if pad:
                value = crc32c(_ZERO_PAD[pad], value)
            fpdu.append(_ZERO_PAD[pad] + value.to_bytes(4, "little"))
        else:
            fpdu.append(bytes(pad + 4))
        return ulpdu_len + 6 + pad

    def _small_send_fpdus(self, out: list[Chunk], budget: int) -> int:
        """Frame the inline Sends at the head of the send queue that fit one FPDU each.

        The fast path of :meth:`produce`: this picks the work requests; the kernels
        frame them all (header, payload, PAD, CRC) into one buffer appended to
        ``out``. Returns the bytes added. It stops at the first work request that is
        anything else (the general path then takes it).
        """
        sq = self._sq
        send, send_inv = WROpcode.SEND, WROpcode.SEND_WITH_INV  # enum lookups cost
        op = sq[0].opcode
        if op is not send and op is not send_inv:
            return 0  # (an RDMA operation; a SendRun's opcode is SEND)
        orq = self._orq
        order = self._sq_order
        burst = self._burst_done
        most = self.small_send_max
        chunks: list[Chunk] = []
        lens: list[int] = []
        ctrls = bytearray()
        invs: list[int] = []
        size = 0
        run: SendRun | None = None  # the run taken, when it is all (framed from its arrays)
        while sq and size < budget:
            job = sq[0]
            if isinstance(job, SendRun):  # taken whole (its size is bounded at post time)
                sq.popleft()
                order.append(job)
                burst.append(job)
                run = None if lens else job
                chunks += job.chunks
                lens += job.lens
                ctrls += job.ctrls
                invs += job.invs
                size += job.size
                continue
            inline = job.inline
            op = job.opcode
            if (
                inline is None
                or (op is not send and op is not send_inv)
                or len(inline) != job.length
                or job.length > most
                or (job.flags & _FENCE and orq)
            ):
                break
            try:
                _check_wire_fields(job)
            except AccessViolation:
                break  # the general path reports it
            sq.popleft()
            order.append(job)
            burst.append(job)
            run = None
            ctrl = _CTRL_SEND_SE if job.flags & _SOLICITED else _CTRL_SEND_PLAIN
            chunks.append(inline)
            lens.append(len(inline))
            ctrls.append(ctrl + _INV_STEP if op is send_inv else ctrl)
            invs.append(job.invalidate_rkey if op is send_inv else 0)
            size += ((_SEND_FPDU_BASE + len(inline)) & ~3) + _CRC_BYTES
        if lens:
            msns = self._tx_msn
            msn = msns[_QN_SEND]
            msns[_QN_SEND] = (msn + len(lens)) & U32_MAX
            data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            if run is not None:  # its arrays go to the kernels as they are
                lens, ctrls, invs = run.lens, run.ctrls, run.invs  # type: ignore[assignment]
            out.append(
                self._kernels.frame_sends(
                    data, lens, ctrls, invs, (msn + 1) & U32_MAX, self.config.crc
                )
            )
        return size

    def _take_terminate(self) -> list[Chunk]:
        term, self._terminate = self._terminate, None
        self.state = EngineState.ERROR
        return [term] if term is not None else []

    def sent(self, nbytes: int) -> None:
        """The driver handed every buffer of the last :meth:`produce` to TCP."""
        self.bytes_sent += nbytes
        done, self._burst_done = self._burst_done, []
        read = WROpcode.RDMA_READ
        for job in done:
            if job.opcode is not read:
                job.done = True
        self._drain_sq_order()

    def _start_next(self) -> bool:
        if self._irq:
            resp = self._irq.popleft()
            self._current = self._tagged_fpdus(
                Opcode.READ_RESPONSE, resp.sink_stag, resp.sink_to, [resp.source]
            )
            self._current_job = None
            self._current_stags = (resp.src_stag,)
            return True
        if not self._sq or not self._sq_head_may_start():
            return False
        job = self._sq.popleft()
        assert isinstance(job, SendJob)  # produce() frames a run at the head itself
        self._sq_order.append(job)
        self._current_job = job
        self._current = self._job_fpdus(job)
        self._current_stags = () if job.inline is not None else tuple(s.lkey for s in job.sges)
        return True

    def _local_segments(self, job: SendJob) -> list[memoryview]:
        if job.inline is not None:
            return [memoryview(job.inline)]
        resolve = self.memory.resolve
        return [
            resolve(s.lkey, self.pd, s.addr, s.length, Access.NONE) for s in job.sges if s.length
        ]

    def _job_fpdus(self, job: SendJob) -> Iterator[tuple[list[Chunk], bool, int]]:
        op = job.opcode
        _check_wire_fields(job)
        if op is WROpcode.RDMA_READ:
            sge = job.sges[0] if job.sges else SGE(0, 0, 0)
            if job.length:
                job.sink = self.memory.resolve(
                    sge.lkey, self.pd, sge.addr, sge.length, Access.LOCAL_WRITE
                )
            else:
                job.sink = memoryview(b"")
            job.msn = self._tx_msn[QN.READ_REQUEST] = (self._tx_msn[QN.READ_REQUEST] + 1) & U32_MAX
            self._orq.append(job)
            hdr = ddp.encode_read_request(
                self._tx_msn[QN.READ_REQUEST], sge.lkey, sge.addr, job.length,
                job.rkey, job.remote_addr,
            )  # fmt: skip
            request: list[Chunk] = [hdr]
            yield request, True, self._seal(request)
            return
        segments = self._local_segments(job)
        if op is WROpcode.RDMA_WRITE:
            yield from self._tagged_fpdus(Opcode.WRITE, job.rkey, job.remote_addr, segments)
            return
        opcode = _CTRL_SEND[(bool(job.flags & _SOLICITED), op is WROpcode.SEND_WITH_INV)]
        msn = self._tx_msn[QN.SEND] = (self._tx_msn[QN.SEND] + 1) & U32_MAX
        chunk = (self.config.max_fpdu - ddp.UNTAGGED_HDR_LEN - _CRC_BYTES) & ~3
        total = job.length
        mo = 0
        pack = _UNTAGGED.pack
        ctrl = opcode | ddp.RDMAP_VERSION
        inv = job.invalidate_rkey if op is WROpcode.SEND_WITH_INV else 0  # else reserved: 0
        while True:
            n = min(chunk, total - mo)
            last = mo + n == total
            ddp_ctrl = ddp.DDP_VERSION | (ddp.DDP_LAST if last else 0)
            header = pack(ddp.UNTAGGED_HDR_LEN - 2 + n, ddp_ctrl, ctrl, inv, QN.SEND, msn, mo)
            fpdu: list[Chunk] = [header]
            fpdu += slice_segments(segments, mo, n)
            yield fpdu, last, self._seal(fpdu)
            mo += n
            if last:
                return

    def _tagged_fpdus(
        self, opcode: Opcode, stag: int, to: int, segments: Sequence[memoryview]
    ) -> Iterator[tuple[list[Chunk], bool, int]]:
        """The FPDUs of a Write or Read Response, framed by the kernels a step of
        ``TAGGED_STEP`` payload bytes at a time (a step that spans SGEs is joined)."""
        chunk = self._tagged_max
        step = max(chunk, TAGGED_STEP // chunk * chunk)
        total = sum(len(s) for s in segments)
        frame = self._kernels.frame_tagged
        crc = self.config.crc
        ctrl = opcode | ddp.RDMAP_VERSION
        off = 0
        while True:
            n = min(step, total - off)
            last = off + n == total
            pieces = slice_segments(segments, off, n) if segments else []
            src = pieces[0] if len(pieces) == 1 else b"".join(pieces)
            fpdus = frame(src, ctrl, stag, to + off, chunk, last, crc)
            yield fpdus, last, sum(map(len, fpdus))
            off += n
            if last:
                return

    # ------------------------------------------------------------------ receive
    def recv_buffer(self) -> memoryview:
        """Where the driver should ``recv_into`` next."""
        if (
            self._rx is _RX_PAYLOAD
            and self._start == self._end
            and self._remaining >= DIRECT_MIN
            and self._targets
        ):
            target = self._targets[0]
            direct = target[: self._remaining] if len(target) > self._remaining else target
            self._direct = direct
            return direct
        self._direct = None
        if not self._staging:
            self._staging = bytearray(STAGING_SIZE)
            self._sview = memoryview(self._staging)
        if self._start == self._end:
            self._start = self._end = 0
        elif STAGING_SIZE - self._end < 4096:
            n = self._end - self._start
            self._staging[:n] = self._sview[self._start : self._end]
            self._start, self._end = 0, n
        return self._sview[self._end :]

    def received(self, nbytes: int) -> None:
        """``nbytes`` arrived in the buffer :meth:`recv_buffer` returned."""
        self.bytes_received += nbytes
        if self._rx is _RX_DISCARD:
            self._start = self._end = 0
            return
        direct = self._direct
        if direct is not None:
            self._direct = None
            if self.config.crc:
                self._crc = self._kernels.crc32c(direct[:nbytes], self._crc)
            self._remaining -= nbytes
            target = self._targets[0]
            if nbytes == len(target):
                self._targets.pop(0)
            else:
                self._targets[0] = target[nbytes:]
            if not self._remaining:
                self._rx = _RX_TRAILER
            return
        start, end = self._start, self._end + nbytes
        self._end = end
        try:
            if self._rx is _RX_HDR and self._rx_send is None and end - start >= _SEND_MIN:
                # Whole Sends first: when they are all the bytes (a ping-pong reads one),
                # no pass of the general loop.
                start = self._start = self._small_sends(self._sview, start, end)
                if start == end:
                    self._start = self._end = 0
                    return
            self._process()
        except ProtocolError as exc:
            self._protocol_error(exc)
        except Exception as exc:  # a bug of ours must not take the process down
            self._internal_error(exc)

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Feed received bytes (copying them into place); for tests and tools."""
        view = memoryview(data)
        while view and self._rx is not _RX_DISCARD:
            buf = self.recv_buffer()
            n = min(len(buf), len(view))
            buf[:n] = view[:n]
            view = view[n:]
            self.received(n)

    def _process(self) -> None:
        sview = self._sview
        crc_on = self.config.crc
        crc32c = self._kernels.crc32c
        while True:
            avail = self._end - self._start
            rx = self._rx
            if rx is _RX_HDR:
                # The fast paths, in turn while they make progress: the Sends after a
                # run of Writes (RDS's RDMA by cookie) need no general path either.
                while avail >= _TAGGED_MIN:
                    start = self._start
                    ctrl = sview[start + 3]
                    if ctrl in _TAGGED_CTRLS:
                        self._start = self._tagged_run(sview, start, self._end, ctrl)
                    elif self._rx_send is None:
                        self._start = self._small_sends(sview, start, self._end)
                    if self._start == start or self._rx is _RX_DISCARD:
                        break
                    avail = self._end - self._start
                if self._rx is _RX_DISCARD:
                    break
                if avail < 4:
                    break
                hdr = ddp.parse_header(sview, self._start, self._end)
                if hdr is None:
                    break
                hlen = ddp.HEADER_LEN_BY_OPCODE[hdr.opcode]
                if crc_on:
                    self._crc = crc32c(sview[self._start : self._start + hlen])
                self._hdr = hdr
                self._start += hlen
                self._begin_segment(hdr)
                if self._rx is _RX_DISCARD:
                    break
            elif rx is _RX_PAYLOAD:
                take = min(avail, self._remaining)
                if not take:
                    break
                src = sview[self._start : self._start + take]
                if crc_on:
                    self._crc = crc32c(src, self._crc)
                self._place(src)
                self._start += take
                self._remaining -= take
                if not self._remaining:
                    self._rx = _RX_TRAILER
            elif rx is _RX_TRAILER:
                hdr = self._hdr
                assert hdr is not None
                need = (-(hdr.ulpdu_len + 2) & 3) + 4
                if avail < need:
                    break
                trailer = sview[self._start : self._start + need]
                if crc_on and not ddp.check_trailer(self._crc, trailer):
                    raise ProtocolError("received CRC mismatch", llp(LlpCode.CRC))
                self._start += need
                self._rx = _RX_HDR
                self._end_segment(hdr)
                if self._rx is _RX_DISCARD:
                    break
            else:
                break
        if self._start == self._end:
            self._start = self._end = 0

    def _small_sends(self, sview: memoryview, start: int, end: int) -> int:
        """Complete the whole one-segment Sends at ``sview[start:end]``; the new start.

        The fast path of :meth:`_process` for the common case: untagged Sends or
        Sends with SE whose FPDUs (header, payload, trailer) are all in the staging
        buffer, with the expected MSNs, no message in progress and good CRCs. The
        kernels find that run and place the payloads; this takes a receive for each
        and completes it. The run ends at the first FPDU that is anything else or
        would fail a check, before any state changes for it: the general path then
        handles (and reports) that FPDU.
        """
        if (
            self.state is not _RTS
            or self._rtr_pending
            or sview[start + 2] != _DDP_LAST_SEGMENT
            or (sview[start + 3] != _CTRL_SEND_PLAIN and sview[start + 3] != _CTRL_SEND_SE)
        ):
            return start  # not a Send (a bulk FPDU, say): no kernel call for nothing
        rx_msn = self._rx_msn
        crc = self.config.crc
        size = send_fpdu(sview, start, end, rx_msn[_QN_SEND], crc)
        if not size:
            return start  # the general path reports what is wrong, or waits for the rest
        after = start + size
        if (end - after < _SEND_MIN or sview[after + 3] not in _RUN_CTRLS) and self._lone_send(
            sview, start, size
        ):
            return after
        kernels = self._kernels
        stop, msgs = kernels.scan_sends(sview, start, end, rx_msn[_QN_SEND], crc)
        queue = self.recv_queue
        count = min(len(msgs) // _MSG_WORDS, len(queue))
        if count == len(queue):
            jobs = [*queue]
            queue.clear()
        else:
            popleft = queue.popleft
            jobs = list(map(call, repeat(popleft, count)))  # count poplefts, at C speed
        pd = self.pd
        # What the checks of this run's receives are kept under (none for one message:
        # a ping-pong costs less without).
        token = self.memory.token(pd) if count > 1 else None
        if token is not None and self._place_checked(sview, jobs, msgs, token):
            self._complete_small_sends(jobs, msgs)
            return stop if count * _MSG_WORDS == len(msgs) else self._fpdu_at(msgs, count)
        locate = self.memory.locate
        handle = kernels.handle
        regions: dict[int, Region] = {}
        """The regions of the SGEs met in this run, checked once each (no user code
        runs during a run: none is deregistered meanwhile)."""
        segments: list[tuple[object, int, int, int]] = []
        nsegs: list[int] = []
        refused: RecvJob | None = None
        for k, job in enumerate(jobs):
            if msgs[k * _MSG_WORDS + 1] > job.length:
                refused = job
                break
            sges = job.sges
            if len(sges) == 1 and sges[0].length:
                s = sges[0]
                region = regions.get(s.lkey)
                off = s.addr - region.addr if region is not None else -1
                if region is None or off < 0 or off + s.length > region.length:
                    try:
                        region, off = locate(s.lkey, pd, s.addr, s.length, _LOCAL_WRITE)
                    except AccessViolation:
                        refused = job
                        break
                    regions[s.lkey] = region
                if token is not None:
                    job.checked = self._checked_in(token, region)
                    job.span = _pack_span(off, s.length)
                segments.append((region.handle or handle(region), region.length, off, s.length))
                nsegs.append(1)
            else:
                try:
                    spans = self._recv_spans(job)
                except AccessViolation:
                    refused = job
                    break
                for region, off, n in spans:
                    segments.append((region.handle or handle(region), region.length, off, n))
                nsegs.append(len(spans))
        else:
            k = len(jobs)
        if k < len(jobs):
            # Back to the queue, in order: the refused one goes to the general path.
            queue.extendleft(reversed(jobs[k + 1 if refused is not None else k :]))
            del jobs[k:]
        if jobs:
            kernels.place(sview, msgs, Targets(segments, nsegs))
        if jobs:
            self._complete_small_sends(jobs, msgs)
        if len(jobs) * _MSG_WORDS == len(msgs):
            return stop
        fpdu = self._fpdu_at(msgs, len(jobs))
        if refused is not None:
            # The general path reports it (LOC_PROT_ERR or LOC_LEN_ERR, Terminate).
            self._start = fpdu + ddp.UNTAGGED_HDR_LEN
            hdr = ddp.parse_header(sview, fpdu, end)
            assert hdr is not None
            self._fit_send(self._open_send(refused, hdr), hdr, hdr.payload_len)
            raise AssertionError("a refused Send passed the general checks")
        return fpdu

    def _lone_send(self, sview: memoryview, start: int, size: int) -> bool:
        """Complete the Send whose checked FPDU of ``size`` bytes is at ``sview[start]``
        into the receive at the head of the queue when that has one non-empty SGE of a
        region that holds it (the ping-pong case, or the Send after an RDMA Write: no
        scan, no run's bookkeeping); False, nothing changed, otherwise (the run's
        general loop then takes it and reports what fails)."""
        queue = self.recv_queue
        if not queue:
            return False
        job = queue[0]
        sges = job.sges
        length = (sview[start] << 8 | sview[start + 1]) - _UNTAGGED_ULPDU_MIN
        if len(sges) != 1 or length > job.length or not sges[0].length:
            return False
        s = sges[0]
        try:
            region, off = self.memory.locate(s.lkey, self.pd, s.addr, s.length, _LOCAL_WRITE)
        except AccessViolation:
            return False
        queue.popleft()
        src = start + _UNTAGGED_HDR_LEN
        region.view[off : off + length] = sview[src : src + length]
        self._complete_recv(job.wr_id, length, sview[start + 3] == _CTRL_SEND_SE)
        return True

    def _place_checked(
        self, sview: memoryview, jobs: list[RecvJob], msgs: Sequence[int], token: object
    ) -> bool:
        """Place the scanned messages ``msgs`` into the receives ``jobs`` (one each) when
        every receive was checked under ``token`` and holds its message; False (nothing
        placed) when one was not (the general loop then checks them, and finds which
        fails)."""
        # (No object per receive here: a run of thousands made that many for the garbage
        # collector, 180 ns a message in send-rate's receiver.)
        checks = list(map(_CHECKED, jobs))
        first = checks[0]
        kernels = self._kernels
        if first is not None and first[0] is token and checks.count(first) == len(checks):
            region = first[1]  # the usual: one region
            handle = region.handle or kernels.handle(region)
            try:
                kernels.place_in(sview, msgs, handle, b"".join(map(_SPAN_OF, jobs)))
            except ValueError:
                return False  # a Send longer than its receive: the general loop reports it
            return True
        if None in checks:
            return False
        tokens, regions = zip(*checks, strict=True)
        if tokens.count(token) != len(tokens):
            return False
        offs, lens = zip(*map(_unpack_span, map(_SPAN_OF, jobs)), strict=True)
        if any(map(_GT, msgs[1 : len(jobs) * _MSG_WORDS : _MSG_WORDS], lens)):
            return False
        make_handle = kernels.handle
        segments = [
            (r.handle or make_handle(r), r.length, off, n)
            for r, off, n in zip(regions, offs, lens, strict=True)
        ]
        kernels.place(sview, msgs, Targets(segments, [1] * len(jobs)))
        return True

    def _checked_in(self, token: object, region: Region) -> tuple[object, Region]:
        """The (token, region) tuple every receive checked under ``token`` in ``region``
        shares; those of an older token are dropped when a new one comes (a region
        deregistered since is not kept)."""
        pairs = self._checked_pairs
        if self._pairs_token is not token:
            pairs.clear()
            self._pairs_token = token
        pair = pairs.get(region)
        if pair is None:
            pair = pairs[region] = (token, region)
        return pair

    def _complete_small_sends(self, jobs: list[RecvJob], msgs: Sequence[int]) -> None:
        """Complete the receives ``jobs`` with the first scanned messages of ``msgs``."""
        if len(jobs) == 1:  # a completion costs less than a run of one
            self._complete_recv(jobs[0].wr_id, msgs[1], msgs[2] == 1)
            return
        rx_msn = self._rx_msn
        rx_msn[_QN_SEND] = (rx_msn[_QN_SEND] + len(jobs)) & U32_MAX
        words = len(jobs) * _MSG_WORDS
        solicited = msgs[2:words:_MSG_WORDS]
        self._recv_wcs(
            RecvRun(
                list(map(_WR_ID, jobs)), msgs[1:words:_MSG_WORDS],
                list(map(_ONE.__eq__, solicited)) if any(solicited) else None, self.qp_num,
            )
        )  # fmt: skip

    def _complete_recv(self, wr_id: int, length: int, solicited: bool) -> None:
        """Complete one receive with the next Send (``length`` bytes) of the fast paths."""
        rx_msn = self._rx_msn
        rx_msn[_QN_SEND] = (rx_msn[_QN_SEND] + 1) & U32_MAX
        self.on_recv_wc(
            WC(wr_id, _SUCCESS, _WC_RECV, length, self.qp_num, _NO_FLAGS, 0, 0, solicited)
        )  # fmt: skip

    @staticmethod
    def _fpdu_at(msgs: Sequence[int], k: int) -> int:
        """Where the FPDU of scanned message ``k`` starts."""
        return msgs[k * _MSG_WORDS] - ddp.UNTAGGED_HDR_LEN

    def _tagged_run(self, sview: memoryview, start: int, end: int, ctrl: int) -> int:
        """Place the whole tagged FPDUs at ``sview[start:end]`` bound for one region;
        the new start.

        The fast path of :meth:`_process` for bulk data in FPDUs too small for direct
        placement (MSS-sized, as siw sends them): this resolves and checks the first
        FPDU's target once, a region of the PD with remote write access for an RDMA
        Write, the sink of the Read at the head of the ORQ for a Read Response; the
        kernels place the run of FPDUs with that STag inside it (Read Responses in
        order, up to the one that ends the Read, which completes here). The run ends
        before the first FPDU that is anything else or would fail a check: the
        general path then handles (and reports) it.
        """
        if self.state is not _RTS or self._rtr_pending:
            return start
        stag = int.from_bytes(sview[start + 4 : start + 8], "big")
        kernels = self._kernels
        if ctrl == _CTRL_WRITE:
            region = self.memory.lookup(stag)
            if (
                region is None
                or region.pd is not self.pd
                or not region.rights & _REMOTE_WRITE
                or region.addr + region.length > TO_LIMIT
            ):
                return start
            target = region.handle or kernels.handle(region)
            stop, _, _ = kernels.place_tagged(
                sview, start, end, ctrl, stag, region.addr, target, 0, self.config.crc, False
            )
            return stop
        if not self._orq:
            return start
        job = self._orq[0]
        sink = job.sink
        if not job.length or sink is None or len(sink) != job.length or stag != job.sges[0].lkey:
            return start
        to = job.sges[0].addr + job.received
        stop, after, last = kernels.place_tagged(
            sview, start, end, ctrl, stag, to, sink, job.received, self.config.crc, True
        )
        job.received += after - to
        if last:
            self._read_done()
        return stop

    def _place(self, src: memoryview) -> None:
        targets = self._targets
        while src:
            target = targets[0]
            n = len(target)
            if n <= len(src):
                target[:] = src[:n]
                targets.pop(0)
                src = src[n:]
            else:
                k = len(src)
                target[:k] = src
                targets[0] = target[k:]
                return

    def _begin_segment(self, hdr: ddp.Header) -> None:
        if self.state is not _RTS:
            raise ProtocolError("FPDU before the connection reached RTS", DDP_CATASTROPHIC)
        payload = hdr.ulpdu_len + 2 - ddp.HEADER_LEN_BY_OPCODE[hdr.opcode]
        op = hdr.opcode
        self._targets = []
        if op is Opcode.WRITE:
            if payload:
                if hdr.to + payload > TO_LIMIT:
                    raise ProtocolError(
                        f"Write at TO {hdr.to:#x} + {payload} wraps",
                        ddp_tagged(DdpTaggedCode.TO_WRAP),
                        header=hdr,
                    )
                try:
                    view = self.memory.resolve(
                        hdr.stag, self.pd, hdr.to, payload, Access.REMOTE_WRITE
                    )
                except AccessViolation as exc:
                    raise ProtocolError(str(exc), exc.violation.ddp_code(), header=hdr) from exc
                self._targets = [view]
            elif self._rtr_pending:
                self._rtr_received()
        elif op is Opcode.READ_RESPONSE:
            self._targets = self._read_response_targets(hdr, payload)
        elif op in ddp.SEND_OPCODES:
            self._targets = self._send_targets(hdr, payload)
        elif op is Opcode.READ_REQUEST:
            if payload:
                raise ProtocolError("Read Request with payload", DDP_CATASTROPHIC)
        else:  # Terminate
            self._check_untagged(hdr, QN.TERMINATE)
            if hdr.mo != 0:
                raise ProtocolError(
                    f"Terminate with MO {hdr.mo}", ddp_untagged(DdpUntaggedCode.INVALID_MO)
                )
            self._term_body = bytearray(payload)
            self._targets = [memoryview(self._term_body)]
        self._remaining = payload
        self._rx = _RX_PAYLOAD if payload else _RX_TRAILER

    def _rtr_received(self) -> None:
        self._rtr_pending = False
        self.on_ready()

    def _check_untagged(self, hdr: ddp.Header, qn: QN) -> None:
        if hdr.qn != qn:
            raise ProtocolError(
                f"{hdr.opcode.name} on queue {hdr.qn}",
                ddp_untagged(DdpUntaggedCode.INVALID_QN),
                header=hdr,
            )
        if hdr.msn != self._rx_msn[qn]:
            raise ProtocolError(
                f"MSN {hdr.msn} on queue {qn.name}, expected {self._rx_msn[qn]}",
                ddp_untagged(DdpUntaggedCode.MSN_RANGE),
                header=hdr,
            )

    def _send_targets(self, hdr: ddp.Header, payload: int) -> list[memoryview]:
        self._check_untagged(hdr, QN.SEND)
        msg = self._rx_send
        if msg is None:
            if hdr.mo != 0:
                raise ProtocolError(
                    f"first segment with MO {hdr.mo}",
                    ddp_untagged(DdpUntaggedCode.INVALID_MO),
                    header=hdr,
                )
            if self._rtr_pending:
                self._rtr_received()
            job = self.recv_queue.popleft() if self.recv_queue else None
            if job is None:
                raise ProtocolError(
                    "Send with no receive posted",
                    ddp_untagged(DdpUntaggedCode.MSN_NO_BUFFER),
                    header=hdr,
                )
            msg = self._open_send(job, hdr)
        elif hdr.mo != msg.received:
            raise ProtocolError(
                f"MO {hdr.mo}, expected {msg.received}",
                ddp_untagged(DdpUntaggedCode.INVALID_MO),
                header=hdr,
            )
        self._fit_send(msg, hdr, payload)
        targets = slice_segments(msg.segments, msg.received, payload)
        msg.received += payload
        return targets

    def _recv_spans(self, job: RecvJob) -> list[tuple[Region, int, int]]:
        """Region, offset and length of each piece of registered memory a receive's
        SGEs name (raises AccessViolation)."""
        locate = self.memory.locate
        pd = self.pd
        sges = job.sges
        if len(sges) == 1:  # the common case, without the comprehension
            s = sges[0]
            if s.length:
                return [(*locate(s.lkey, pd, s.addr, s.length, _LOCAL_WRITE), s.length)]
            return []
        return [
            (*locate(s.lkey, pd, s.addr, s.length, _LOCAL_WRITE), s.length)
            for s in sges
            if s.length
        ]

    def _recv_segments(self, job: RecvJob) -> list[memoryview]:
        """The registered memory a receive's SGEs name (raises AccessViolation)."""
        return [region.view[off : off + n] for region, off, n in self._recv_spans(job)]

    def _open_send(self, job: RecvJob, hdr: ddp.Header) -> _RxMessage:
        """Start receiving a Send into ``job``; a receive naming bad memory is refused."""
        msg = _RxMessage(job, [])
        self._rx_send = msg
        try:
            msg.segments = self._recv_segments(job)
        except AccessViolation as exc:
            msg.status = WCStatus.LOC_PROT_ERR
            raise ProtocolError(str(exc), DDP_CATASTROPHIC, header=hdr) from exc
        return msg

    def _fit_send(self, msg: _RxMessage, hdr: ddp.Header, payload: int) -> None:
        """Refuse a Send segment that overflows the receive it is placed into."""
        if msg.received + payload > msg.job.length:
            # Linux siw (siw_qp_rx.c, siw_send_check_ntoh) reports "MSN: no buffer" here,
            # not RFC 5041's "message too long"; we send what siw sends.
            msg.status = WCStatus.LOC_LEN_ERR
            raise ProtocolError(
                f"Send of more than the {msg.job.length} bytes posted",
                ddp_untagged(DdpUntaggedCode.MSN_NO_BUFFER),
                header=hdr,
            )

    def _read_response_targets(self, hdr: ddp.Header, payload: int) -> list[memoryview]:
        if not self._orq:
            raise ProtocolError(
                "Read Response with no Read outstanding", DDP_CATASTROPHIC, header=hdr
            )
        job = self._orq[0]
        sge = job.sges[0] if job.sges else SGE(0, 0, 0)
        expected_to = sge.addr + job.received
        if job.length and hdr.stag != sge.lkey:
            raise ProtocolError(
                f"Read Response to STag {hdr.stag:#x}, expected {sge.lkey:#x}",
                ddp_tagged(DdpTaggedCode.INVALID_STAG),
                header=hdr,
            )
        if (job.length and hdr.to != expected_to) or job.received + payload > job.length:
            raise ProtocolError(
                "Read Response outside the Read's sink",
                ddp_tagged(DdpTaggedCode.BASE_BOUNDS),
                header=hdr,
            )
        assert job.sink is not None
        view = job.sink[job.received : job.received + payload]
        job.received += payload
        return [view] if payload else []

    def _end_segment(self, hdr: ddp.Header) -> None:
        op = hdr.opcode
        if op is Opcode.WRITE:
            return
        if op in ddp.SEND_OPCODES:
            if not hdr.last:
                return
            msg = self._rx_send
            assert msg is not None
            self._rx_send = None
            self._rx_msn[QN.SEND] = (self._rx_msn[QN.SEND] + 1) & U32_MAX
            flags = WCFlags.NONE
            inv = 0
            if op in (Opcode.SEND_INV, Opcode.SEND_SE_INV):
                violation = self.memory.invalidate(hdr.inv_stag, self.pd)
                if violation is not None:
                    self.on_recv_wc(
                        WC(
                            msg.job.wr_id,
                            WCStatus.REM_INV_REQ_ERR,
                            WCOpcode.RECV,
                            msg.received,
                            self.qp_num,
                        )
                    )
                    etype = (
                        RdmapType.REMOTE_OPERATION
                        if violation is Violation.INVALID_STAG
                        else RdmapType.REMOTE_PROTECTION
                    )
                    raise ProtocolError(
                        f"cannot invalidate STag {hdr.inv_stag:#x}: {violation.value}",
                        rdmap(etype, RdmapCode.CANNOT_INVALIDATE),
                        header=hdr,
                    )
                flags = WCFlags.WITH_INV
                inv = hdr.inv_stag
            self.on_recv_wc(
                WC(
                    msg.job.wr_id, WCStatus.SUCCESS, WCOpcode.RECV, msg.received, self.qp_num,
                    flags, inv, solicited=op in (Opcode.SEND_SE, Opcode.SEND_SE_INV),
                )
            )  # fmt: skip
        elif op is Opcode.READ_RESPONSE:
            if not hdr.last:
                return
            job = self._orq[0]
            if job.received != job.length:
                raise ProtocolError(
                    f"Read Response of {job.received} bytes for a {job.length}-byte Read",
                    ddp_tagged(DdpTaggedCode.BASE_BOUNDS),
                    header=hdr,
                )
            self._read_done()
        elif op is Opcode.READ_REQUEST:
            self._check_untagged(hdr, QN.READ_REQUEST)
            if self._responding >= self.config.ird:
                raise ProtocolError(
                    f"more than IRD={self.config.ird} Read Requests outstanding",
                    rdmap(RdmapType.REMOTE_OPERATION, RdmapCode.CATASTROPHIC_STREAM),
                    header=hdr,
                    quote_rdmap=True,
                )
            self._rx_msn[QN.READ_REQUEST] = (self._rx_msn[QN.READ_REQUEST] + 1) & U32_MAX
            if hdr.sink_to + hdr.read_size > TO_LIMIT or hdr.src_to + hdr.read_size > TO_LIMIT:
                raise ProtocolError(
                    f"Read of {hdr.read_size} bytes from TO {hdr.src_to:#x} to TO "
                    f"{hdr.sink_to:#x} wraps",
                    rdmap(RdmapType.REMOTE_PROTECTION, RdmapCode.TO_WRAP),
                    header=hdr,
                    quote_rdmap=True,
                )
            if hdr.read_size == 0:
                source = memoryview(b"")
                if self._rtr_pending:
                    self._rtr_received()
            else:
                try:
                    source = self.memory.resolve(
                        hdr.src_stag, self.pd, hdr.src_to, hdr.read_size, Access.REMOTE_READ
                    )
                except AccessViolation as exc:
                    raise ProtocolError(
                        str(exc), exc.violation.rdmap_code(), header=hdr, quote_rdmap=True
                    ) from exc
            self._irq.append(_ReadResponse(hdr.sink_stag, hdr.sink_to, source, hdr.src_stag))
            self._responding += 1
        elif op is Opcode.TERMINATE:
            assert self._term_body is not None
            term = ddp.parse_terminate(self._term_body)
            self.remote_terminate = term.code
            log.warning("QP %d: peer sent Terminate %s", self.qp_num, term.code)
            meaning = term.code.meaning
            message = (
                f"the peer ended the connection: {meaning}"
                if meaning
                else ("the peer ended the connection with a Terminate")
            )
            self._enter_error(ProtocolError(message, term.code), remote=term)

    def _read_done(self) -> None:
        """The Read at the head of the ORQ received all of its response."""
        job = self._orq.popleft()
        job.done = True
        job.sink = None  # placed: no view of the sink beyond its completion
        self._drain_sq_order()

    # ------------------------------------------------------------------ errors
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
            self.on_recv_wc(WC(msg.job.wr_id, msg.status, WCOpcode.RECV, 0, self.qp_num))
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
        if self.state is _RTS:
            self._terminate_bytes(ddp.encode_terminate(term))

    def _terminate_bytes(self, ulpdu: bytes) -> None:
        self._terminate = b"".join(bytes(b) for b in ddp.encode_fpdu(ulpdu, crc=self.config.crc))

    def connection_lost(self, exc: Exception | None = None) -> None:
        """The TCP connection closed or failed: ERROR and flush."""
        if self.state is not _ERROR:
            self._enter_error(exc or ConnectionResetError("connection closed by peer"))

    def set_error(self, exc: Exception | None = None) -> None:
        """Move to ERROR at the user's request (``modify`` to ERR): flush everything."""
        self._enter_error(exc or ConnectionAbortedError("QP moved to ERROR"))

    def _enter_error(self, exc: Exception, remote: ddp.Terminate | None = None) -> None:
        if self.state is _ERROR:
            return
        _clear_frames(exc)  # what the failed calls' frames held (views of regions) goes
        self.memory.unwatch(self)  # from here on the engine holds no view of a region
        self.error = self.error or exc
        self._rx = _RX_DISCARD
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
            if isinstance(queued, SendRun):
                self._run_extra -= len(queued) - 1
            self._complete_send(queued, WCStatus.WR_FLUSH_ERR)
        msg = self._rx_send
        if msg is not None:
            self._rx_send = None
            self.on_recv_wc(WC(msg.job.wr_id, WCStatus.WR_FLUSH_ERR, WCOpcode.RECV, 0, self.qp_num))
        self.on_fatal(exc)

    # ------------------------------------------------------------------ memory
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
            self.on_recv_wc(WC(msg.job.wr_id, WCStatus.LOC_PROT_ERR, WCOpcode.RECV, 0, self.qp_num))
        error = ProtocolError(
            f"local protection error: memory region {stag:#010x} deregistered while in use",
            RDMAP_LOCAL_CATASTROPHIC,
        )
        self._send_terminate(ddp.Terminate(error.code))
        self._enter_error(error)

    def flush_recv(self, jobs: Sequence[RecvJob]) -> None:
        """Complete receives of a QP in ERROR with WR_FLUSH_ERR."""
        for job in jobs:
            self.on_recv_wc(WC(job.wr_id, WCStatus.WR_FLUSH_ERR, WCOpcode.RECV, 0, self.qp_num))

    # ------------------------------------------------------------------ completions
    def _drain_sq_order(self) -> None:
        order = self._sq_order
        quiet = not self.sq_sig_all
        success = WCStatus.SUCCESS
        while order and order[0].done:
            job = order.popleft()
            if isinstance(job, SendRun):
                self._run_extra -= len(job) - 1
            if quiet and job.status is success and not job.flags & _SIGNALED:
                continue  # what _complete_send would do, without the call
            self._complete_send(job, job.status)

    def _complete_send(self, job: SendJob | SendRun, status: WCStatus) -> None:
        if isinstance(job, SendRun):
            quiet = status is WCStatus.SUCCESS and not self.sq_sig_all
            ids = job.signaled if quiet else job.wr_ids
            if ids:
                send, qp_num = WCOpcode.SEND, self.qp_num
                self._send_wcs([WC(wr_id, status, send, 0, qp_num) for wr_id in ids])
            return
        if status is WCStatus.SUCCESS and not (self.sq_sig_all or job.flags & _SIGNALED):
            return
        byte_len = job.length if job.opcode is WROpcode.RDMA_READ else 0
        self.on_send_wc(WC(job.wr_id, status, _WC_OPCODE[job.opcode], byte_len, self.qp_num))


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


def _each(callback: Callable[[WC], None]) -> Callable[[list[WC]], None]:
    """A callable taking a list of completions that hands each to ``callback``."""

    def each(wcs: list[WC]) -> None:
        for wc in wcs:
            callback(wc)

    return each


def _each_of_run(callback: Callable[[WC], None]) -> Callable[[RecvRun], None]:
    """A callable taking a :class:`RecvRun` that hands each of its completions to
    ``callback``."""

    def each(run: RecvRun) -> None:
        for wc in run.take(len(run)):
            callback(wc)

    return each


def _check_wire_fields(job: SendJob) -> None:
    """Refuse a work request whose fields do not fit their wire fields (32-bit STags and
    MO, 64-bit TO) or whose remote range wraps: a local protection error."""
    if not (
        0 <= job.rkey <= U32_MAX
        and 0 <= job.invalidate_rkey <= U32_MAX
        and 0 <= job.length <= U32_MAX
        and 0 <= job.remote_addr <= TO_LIMIT - job.length
    ):
        raise AccessViolation(Violation.BOUNDS, job.rkey, job.remote_addr, job.length)


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
