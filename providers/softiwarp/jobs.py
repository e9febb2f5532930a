"""The work a queue pair's engine carries: send and receive jobs, runs of them, the
receive completions of a run, and the per-connection settings and states.

Plain data, shared by the transmit, receive and Read modules of the engine.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, auto

from rdmashim.providers.softiwarp import ddp
from rdmashim.providers.softiwarp.ddp import Opcode
from rdmashim.providers.softiwarp.memory import AccessViolation, Region, Violation
from rdmashim.verbs.enums import SendFlags, WCFlags, WCOpcode, WCStatus, WROpcode
from rdmashim.verbs.wr import SGE, WC

log = logging.getLogger(__name__)

Chunk = bytes | bytearray | memoryview
"""A piece of an FPDU as it goes to ``socket.sendmsg``: header, payload slice, pad, CRC."""

SIGNALED = int(SendFlags.SIGNALED)
"""The bits of :attr:`SendJob.flags` the engine tests, plain ints as the field is (an
int tested against an ``IntFlag`` member runs the enum's Python code: measured 1.1 us
against 0.035, several times a message)."""
SOLICITED = int(SendFlags.SOLICITED)
FENCE = int(SendFlags.FENCE)


class EngineState(Enum):
    """Where the engine is in the QP's life (siw's IDLE/RTS/TERMINATE/ERROR)."""

    IDLE = auto()
    RTS = auto()
    TERMINATE = auto()
    ERROR = auto()


class RxStep(Enum):
    """Where the receiver is in the FPDU it reads: its header, its payload, its PAD and
    CRC, or nowhere (after an error, received bytes are dropped)."""

    HEADER = auto()
    PAYLOAD = auto()
    TRAILER = auto()
    DISCARD = auto()


@dataclass(slots=True)
class EngineConfig:
    """Per-connection parameters settled by MPA negotiation."""

    crc: bool = True
    ird: int = 16
    ord: int = 16
    max_fpdu: int = ddp.MAX_FPDU
    rtr_to_send: Opcode | None = None
    """P2P initiator: the zero-length message to send first (WRITE or READ_REQUEST)."""
    wait_for_rtr: bool = False
    """P2P responder: hold transmission until the initiator's RTR arrives."""


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
        return ddp.SEND_CTRL_OF[2 * bool(flags & SOLICITED) + invalidate]

    def add(self, wr_id: int, ctrl: int, flags: int, inline: bytes, inv: int) -> None:
        """Append an entry: control byte ``ctrl`` (from :meth:`ctrl`), its ``flags``, its
        data and the STag a Send with Invalidate names."""
        self.ctrls.append(ctrl)
        self.chunks.append(inline)
        self.lens.append(len(inline))
        self.invs.append(inv)
        self.wr_ids.append(wr_id)
        if flags & SIGNALED:
            self.signaled.append(wr_id)
            self.flags = SIGNALED
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
        run.flags = SIGNALED if signaled else 0
        run.done = False
        run.status = WCStatus.SUCCESS
        return run

    @staticmethod
    def fpdu_bytes(length: int) -> int:
        """The bytes of the FPDU of an entry carrying ``length`` bytes."""
        return ddp.fpdu_len(ddp.UNTAGGED_HDR_LEN - 2 + length)

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
            WC(
                wr_id,
                WCStatus.SUCCESS,
                WCOpcode.RECV,
                byte_len,
                qp_num,
                WCFlags.NONE,
                0,
                0,
                solicited,
            )
            for wr_id, byte_len, solicited in zip(
                self.wr_ids[start:stop],
                self.byte_lens[start:stop],
                self.solicited_of(start, stop),
                strict=True,
            )
        ]


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
class ReadResponse:
    sink_stag: int
    sink_to: int
    source: memoryview
    src_stag: int


@dataclass(eq=False, slots=True)
class RxMessage:
    """The untagged receive in progress on QN 0."""

    job: RecvJob
    segments: list[memoryview]
    received: int = 0
    status: WCStatus = WCStatus.SUCCESS


@dataclass(frozen=True, slots=True)
class Ready:
    """In the outbox: the peer-to-peer initiator's RTR arrived, so this responder may
    transmit from now on (the CM reports the connection established)."""


@dataclass(frozen=True, slots=True)
class Failed:
    """In the outbox: the QP went to ERROR, for ``error``; the flush completions of its
    send work come before it, those of its receive queue are the provider's to make
    (:meth:`~.qp_state.QPEngineState.flush_recv`)."""

    error: Exception


Outcome = WC | list[WC] | RecvRun | Ready | Failed
"""What the engine puts in its outbox, in order: a completion (a send's or a receive's,
by its opcode), the send completions of a :class:`SendRun` together, the receive
completions of a run of small Sends, or an event."""


def check_wire_fields(job: SendJob) -> None:
    """Refuse a work request whose fields do not fit their wire fields (32-bit STags and
    MO, 64-bit TO) or whose remote range wraps: a local protection error."""
    if not (
        0 <= job.rkey <= ddp.U32_MAX
        and 0 <= job.invalidate_rkey <= ddp.U32_MAX
        and 0 <= job.length <= ddp.U32_MAX
        and 0 <= job.remote_addr <= ddp.TO_LIMIT - job.length
    ):
        raise AccessViolation(Violation.BOUNDS, job.rkey, job.remote_addr, job.length)
